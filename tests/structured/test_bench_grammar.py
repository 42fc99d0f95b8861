"""scripts/bench_grammar.py on a few sample records: both grammars accept every candidate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_grammar_smoke(tmp_path):
    out = tmp_path / "grammar.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench_grammar.py"), "--records", "3", "--fill-batch", "8",
         "--fill-repeats", "2", "--fill-threads", "2", "--walk-batch", "8", "--random-steps", "12",
         "--vocab-size", "8192", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["records"] == 3
    assert report["records_where_both_accept_every_candidate"] == 3
    assert set(report["ms_per_record"]) == {"flat", "ours"}
    assert all(timing["median"] > 0 for timing in report["ms_per_record"].values())
    fill = report["bitmask_fill"]
    assert fill["batch"] == 8 and fill["threads"] == 2 and fill["rows_equal"] is True
    assert fill["ms_row_by_row"] > 0 and fill["ms_batched"] > 0
    walk = report["decode_steps"]  # every grammar took every token of its answer (accept raises otherwise)
    assert walk["batch"] == 8 and walk["steps"] > 5 and walk["ms_fill_median"] > 0 and walk["ms_advance_median"] > 0
    assert walk["vocab_size"] == fill["vocab_size"] == 8192  # a head wider than the 4,096-token tokenizer
    randomly = report["random_steps"]  # sampled among allowed tokens: accept raises on any other
    assert randomly["batch"] == 8 and 1 <= randomly["steps"] <= 12 and randomly["ms_advance_median"] > 0
