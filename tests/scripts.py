"""Running `scripts/*.py` from a test: a subprocess with this interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "scripts"


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`scripts/<name>` with `args`; its exit status and output, whatever they are."""
    return subprocess.run([sys.executable, str(SCRIPTS_DIR / name), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def script_report(name: str, tmp_path: Path, *args: str, timeout: float = 300) -> dict:
    """Run `scripts/<name>` with `args` and `--json`; it must exit 0. Returns the JSON it wrote."""
    report_path = tmp_path / "report.json"
    result = run_script(name, *args, "--json", str(report_path), timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(report_path.read_text())
