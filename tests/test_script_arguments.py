"""Bad input to the scripts and `python -m` tools: one `error:` line (or argparse's usage error) and
exit 2 before any work, never a traceback; a refused start leaves nothing behind, and an existing
checkpoint is replaced only when asked."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from vlm_catalog.argument_types import at_least, positive_int
from vlm_catalog.model.tiny_checkpoint import (
    TinySpec,
    TinySpecError,
    build_tokenizer,
    make_tiny_checkpoint,
)

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "scripts"


def script(name: str):
    """`scripts/<name>.py` imported as a module, to call its `main(argv)` in this process."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def refused_in_one_line(capsys, main, argv: list[str]) -> str:
    """`main(argv)` must return 2 with one `error:` line on stderr; returns that line."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    return err


def usage_error(capsys, main, argv: list[str]) -> str:
    """`main(argv)` must stop with argparse's usage error (exit 2); returns its stderr."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2, argv
    return capsys.readouterr().err


def test_count_arguments_below_their_least_are_argparse_errors() -> None:
    assert positive_int("3") == 3 and at_least(3)("3") == 3
    for parse, text, message in ((positive_int, "0", "must be at least 1, got 0"),
                                 (positive_int, "-1", "must be at least 1, got -1"),
                                 (at_least(3), "2", "must be at least 3, got 2"),
                                 (positive_int, "abc", "expected an integer, got 'abc'")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


# -- scripts/make_tiny_checkpoint.py -----------------------------------------------------------------


def test_make_tiny_checkpoint_replaces_a_checkpoint_only_when_asked(tmp_path: Path, capsys) -> None:
    """Before, --out pointed at a trained model replaced its weights without a word; and a build that
    then failed (head_dim 7) would have lost them."""
    make = script("make_tiny_checkpoint").main
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "model.safetensors").write_bytes(b"trained")
    small = ["--set", "text_layers=1", "vision_depth=1", "deepstack_visual_indexes=0", "tokenizer_vocab_size=400"]
    err = refused_in_one_line(capsys, make, ["--out", str(trained), *small])
    assert err == f"error: {trained} exists; pass --overwrite to replace it\n"
    err = refused_in_one_line(capsys, make, ["--out", str(trained), "--overwrite", *small, "head_dim=7"])
    assert "these shapes make no working checkpoint" in err  # transformers' words, or (5.17) our config's
    assert (trained / "model.safetensors").read_bytes() == b"trained"
    assert make(["--out", str(trained), "--overwrite", *small]) == 0
    assert (trained / "config.json").is_file() and (trained / "model.safetensors").read_bytes() != b"trained"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["trained"]  # no scratch folder left


def test_make_tiny_checkpoint_refuses_bad_settings_and_outs_in_one_line(tmp_path: Path, capsys) -> None:
    """--set text_layers=abc and an --out that is a file were tracebacks; text_layers=-1 and indexes
    past the last layer were written; none of them may leave a folder."""
    make = script("make_tiny_checkpoint").main
    a_file = tmp_path / "a-file"
    a_file.write_text("precious")
    new = tmp_path / "new" / "checkpoint"
    cases = [
        (["--out", str(new), "--set", "text_layers=abc"], "--set text_layers=abc: text_layers takes an integer"),
        (["--out", str(new), "--set", "mrope_section=4,x"], "mrope_section takes comma-separated integers"),
        (["--out", str(new), "--set", "text_layers=-1"], "text_layers must be an integer of at least 1, got -1"),
        (["--out", str(new), "--set", "deepstack_visual_indexes=0,7"], "deepstack_visual_indexes must be layer indexes"),
        (["--out", str(new), "--set", "init_std=nan"], "init_std a finite one of at least 0"),
        (["--out", str(a_file)], f"--out {a_file} is a file; a checkpoint is a folder"),
        (["--out", str(a_file / "checkpoint")], "cannot be written: Not a directory"),
    ]
    for argv, message in cases:
        assert message in refused_in_one_line(capsys, make, argv), argv
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"] and a_file.read_text() == "precious"


def test_shapes_that_do_not_fit_together_are_refused_before_the_folder_is_made(tmp_path: Path) -> None:
    """head_dim 7 (RoPE needs an even one) left an empty --out; too many experts per token, a checkpoint
    our engine refuses, was written."""
    tokenizer = build_tokenizer(300)
    # head_dim 7: transformers refuses it ("RoPE requires an even rotary dimension"), or, where it does
    # not (5.17), our config's mrope_section check does
    for spec, message in ((TinySpec(head_dim=7), "these shapes make no working checkpoint: .*(RoPE|head_dim / 2 = 3)"),
                          (TinySpec(experts_per_token=9), "num_experts_per_tok 9 must be between 1 and num_experts 8")):
        with pytest.raises(TinySpecError, match=message):
            make_tiny_checkpoint(tmp_path / "out", spec, tokenizer=tokenizer)
        assert not (tmp_path / "out").exists()


# -- benchmarks -----------------------------------------------------------------------------------


def test_benchmarks_refuse_a_missing_catalogue_in_one_line(tmp_path: Path, capsys) -> None:
    from vlm_catalog.bench.loadgen import overhead

    missing = tmp_path / "no-catalogue"
    mains = [script(name).main for name in ("bench_offline", "bench_batch_feed", "bench_image_prefetch", "bench_grammar")]
    for main in [*mains, overhead.main]:
        assert refused_in_one_line(capsys, main, ["--dataset", str(missing)]) == f"error: catalogue not found: {missing}\n"


def test_benchmark_counts_and_sizes_out_of_range_are_refused_before_any_work(capsys) -> None:
    """--count 0 failed inside the benchmark, --repeats 0 at the medians, after every run; --vocab-size
    -1 in the grammar vocabulary: each a traceback."""
    from vlm_catalog.bench.loadgen import overhead

    for argv in (["--count", "0"], ["--repeats", "0"], ["--max-tokens", "-1"]):
        assert f"argument {argv[0]}: must be at least 1" in usage_error(capsys, overhead.main, argv)
    grammar = script("bench_grammar").main
    assert "argument --vocab-size: must be at least 1, got -1" in usage_error(capsys, grammar, ["--vocab-size", "-1"])
    err = refused_in_one_line(capsys, grammar, ["--vocab-size", "10"])
    assert "vocab_size 10 is smaller than the tokenizer's" in err


def test_bench_sampler_refuses_a_device_it_cannot_use(capsys) -> None:
    sampler = script("bench_sampler").main
    err = refused_in_one_line(capsys, sampler, ["--device", "foo"])
    assert err == "error: --device must be 'cpu' or 'cuda[:N]', got 'foo'\n"
    assert "device cuda:99: " in refused_in_one_line(capsys, sampler, ["--device", "cuda:99"])  # CPU-only torch, or too few GPUs
