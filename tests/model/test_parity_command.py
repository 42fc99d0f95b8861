"""`vlm-catalog check-parity`: passes on a good checkpoint, exits 1 on a mismatch."""

import json

import kernels
from tests.model.helpers import build_checkpoint, noise_image, write_fp8_checkpoint
from vlm_catalog.cli import main
from vlm_catalog.paths import DEFAULT_MODEL_DIR


def test_check_parity_command(tmp_path, tiny_tokenizer, capsys, monkeypatch):
    checkpoint = build_checkpoint(tmp_path / "ckpt", tiny_tokenizer, seed=21, text_layers=1)
    image = tmp_path / "product.png"
    image.write_bytes(noise_image(70, 110, seed=3))
    report_path = tmp_path / "report.json"
    args = ["check-parity", str(checkpoint), "--image", str(image), "--tokens", "6", "--json", str(report_path)]
    assert main(args) == 0
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["tokens_match"] and report["max_abs_logit_diff"] <= 1e-4
    assert "PASS" in capsys.readouterr().out
    assert main([*args[:-1], "/dev/full"]) == 2  # the report cannot be written: one line, after the verdict
    captured = capsys.readouterr()
    assert "PASS" in captured.out and captured.err.endswith("\nerror: --json /dev/full: cannot write it (No space left on device)\n")

    # a 1% error in our RMSNorm weights must be caught
    real_rms_norm = kernels.rms_norm
    monkeypatch.setattr(kernels, "rms_norm",
                        lambda x, weight, eps, quantize=None: real_rms_norm(x, weight * 1.01, eps, quantize))
    assert main(args) == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_parity_errors(tmp_path, capsys):
    assert main(["check-parity", str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["check-parity", str(tmp_path / "missing"), "--json", str(tmp_path)]) == 2  # before any work
    assert "is a folder; give a file name" in capsys.readouterr().err
    for device in ("mps", "xyz", "cuda:x", "meta"):  # before, a torch traceback (exit 1)
        assert main(["check-parity", str(DEFAULT_MODEL_DIR), "--device", device, "--tokens", "1"]) == 2
        assert capsys.readouterr().err == f"error: device must be 'cpu' or 'cuda[:N]', got {device!r}\n"


def test_bad_arguments_and_reports_over_inputs_are_one_line_before_any_work(tmp_path, capsys):
    """`--atol nan` failed a good checkpoint (exit 1, a mismatch's code) and `inf` passed any; an
    `--image` folder was a traceback; `--json` could replace the image or the checkpoint's
    config.json."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    image = tmp_path / "product.png"
    image.write_bytes(noise_image(40, 40, seed=1))
    kept = {path: path.read_bytes() for path in (image, model / "config.json")}
    cases = {
        ("--atol", "nan"): "error: --atol must be a finite number above 0, got nan",
        ("--atol", "-1"): "error: --atol must be a finite number above 0, got -1.0",
        ("--atol", "inf"): "error: --atol must be a finite number above 0, got inf",
        ("--image", str(tmp_path)): f"error: --image {tmp_path}: cannot read it (Is a directory)",
        ("--image", str(image), "--json", str(image)):
            f"error: --json {image} would replace {image}, an input of this run; choose another path",
        ("--json", str(model / "config.json")):
            f"error: --json {model / 'config.json'} would replace {model / 'config.json'}, an input of this run",
    }
    for extra, message in cases.items():
        assert main(["check-parity", str(model), "--tokens", "1", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err
    assert all(path.read_bytes() == content for path, content in kept.items())


def test_check_parity_on_an_fp8_checkpoint_transformers_cannot_load_is_a_clear_error(tmp_path, tiny_tokenizer, capsys):
    import importlib.util

    import pytest

    if importlib.util.find_spec("accelerate") is not None:
        pytest.skip("with accelerate, transformers may load FP8 checkpoints")
    original = build_checkpoint(tmp_path / "original", tiny_tokenizer, seed=21, text_layers=1)
    write_fp8_checkpoint(original, tmp_path / "fp8", tmp_path / "widened", (16, 32))
    capsys.readouterr()  # the checkpoint writer's progress bars
    assert main(["check-parity", str(tmp_path / "fp8"), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: transformers cannot load") and "accelerate" in err and err.count("\n") == 1


def test_check_parity_refuses_a_checkpoint_transformers_routes_otherwise(tmp_path, tiny_tokenizer, capsys):
    """With norm_topk_prob false we leave the routing weights unnormalised (as vLLM) and transformers'
    Qwen3-VL-MoE renormalises anyway: before, check-parity printed FAIL (logits 1.9 apart), exit 1."""
    checkpoint = build_checkpoint(tmp_path / "ckpt", tiny_tokenizer, seed=21, text_layers=1, norm_topk_prob=False)
    capsys.readouterr()  # the checkpoint writer's progress bars
    assert main(["check-parity", str(checkpoint), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config.json sets norm_topk_prob to false") and "no reference" in err
    assert err.count("\n") == 1


def test_low_precision_tokens_may_differ_first_at_a_near_tie_of_the_reference(tmp_path, capsys):
    """In bfloat16 the shipped model's reference ties its top two at the first token (9.0 and 9.0);
    ours picks the other: before, FAIL (exit 1) with logits well inside the bound. A difference
    where the reference prefers its token by more than the bound still fails."""
    from vlm_catalog.model.parity import ParityReport

    report_path = tmp_path / "bf16.json"
    assert main(["check-parity", str(DEFAULT_MODEL_DIR), "--dtype", "bfloat16", "--tokens", "4",
                 "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["reference_margin_at_difference"] is not None
    assert "a near-tie, accepted" in capsys.readouterr().out

    def low_precision(margin, ours=(5, 6), reference=(5, 7)):
        return ParityReport(prompt_tokens=3, num_images=0, max_abs_logit_diff=0.3, ours=list(ours),
                            reference=list(reference), our_error_vs_float32=0.2, reference_error_vs_float32=0.2,
                            reference_margin_at_difference=margin)

    assert low_precision(0.0).passed(1e-4) and low_precision(0.3).passed(1e-4)  # bound 1.5 * 0.2 + 1e-4
    assert not low_precision(0.31).passed(1e-4)
    assert low_precision(None, reference=(5, 6)).passed(1e-4)
    float32 = ParityReport(prompt_tokens=3, num_images=0, max_abs_logit_diff=1e-5, ours=[5, 6], reference=[5, 7])
    assert not float32.passed(1e-4)  # float32: the tokens must be equal
