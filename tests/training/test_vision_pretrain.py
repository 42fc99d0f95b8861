"""Vision pretraining: labels, a tower that learns them, and a graft that touches only the tower."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from vlm_catalog.data.synthetic.signature import GLYPHS
from vlm_catalog.training.vision_pretrain import PhotoData, main, photo_loss, pooled, reinitialise
from vlm_catalog.training.vision_probe import load_model


def test_photo_labels_follow_the_records(tiny_base: Path) -> None:
    data = PhotoData(tiny_base, seed=77)
    pixels, grids, stickers, glyphs = data.batch(list(range(12)))
    assert len(grids) == len(stickers) == len(glyphs) == 12
    assert pixels.shape[0] == sum(t * h * w for t, h, w in grids)
    for index in range(12):
        record = data.factory.make(77, index, photo_only_condition=True)
        assert stickers[index] == float(record.is_secondhand)
        assert GLYPHS[int(glyphs[index])] == data.factory.signature(record.category).glyph


def test_a_reinitialised_tower_fits_the_photo_labels(tiny_base: Path) -> None:
    model = load_model(tiny_base)
    visual = model.model.visual.train()
    reinitialise(visual, torch.Generator().manual_seed(0))
    batch = PhotoData(tiny_base, seed=77).batch(list(range(8)))
    head = torch.nn.Linear(2 * visual.merger.linear_fc2.out_features, 1 + len(GLYPHS))
    assert pooled(visual, batch[0], batch[1]).shape == (8, head.in_features)
    optimizer = torch.optim.AdamW(list(visual.parameters()) + list(head.parameters()), lr=3e-3)
    first, _ = photo_loss(visual, head, batch)
    for _ in range(60):
        loss, _ = photo_loss(visual, head, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.5 * float(first.detach())


def test_graft_replaces_only_the_vision_tower(tiny_base: Path, tmp_path: Path) -> None:
    out = tmp_path / "grafted"
    assert main(["--base", str(tiny_base), "--out", str(out), "--steps", "2", "--batch-size", "2"]) == 0
    before, after = load_file(tiny_base / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name].to(torch.bfloat16), after[name])}
    assert changed and all(".visual." in f".{name}" for name in changed)
    assert main(["--base", str(tiny_base), "--out", str(out), "--steps", "1"]) == 2  # never overwrites


def test_arguments_that_would_mislead_or_fail_after_training_are_refused_first(tiny_base: Path, tmp_path: Path,
                                                                                capsys) -> None:
    """--steps 0 exported a random tower as "pretrained" (exit 0); --batch-size 0 and an --out under a
    file were tracebacks, the latter after the training; equal seeds logged scores of training photos."""
    a_file = tmp_path / "afile"
    a_file.write_text("")
    base = ["--base", str(tiny_base)]
    cases = [
        ([*base, "--out", str(tmp_path / "a"), "--steps", "0"], "--steps and --batch-size must be at least 1"),
        ([*base, "--out", str(tmp_path / "a"), "--batch-size", "0"], "--steps and --batch-size must be at least 1"),
        ([*base, "--out", str(tmp_path / "a"), "--lr", "inf"], "--lr must be a finite number"),
        ([*base, "--out", str(tmp_path / "a"), "--data-seed", "9001"], "--data-seed and --eval-seed must differ"),
        ([*base, "--out", str(a_file / "out")], "is a file, not a folder"),
        ([*base, "--out", str(a_file / "deeper" / "out")], "cannot be written: Not a directory"),
        (["--base", str(tmp_path), "--out", str(tmp_path / "a")], "is not a checkpoint folder"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "a").exists()


def test_a_base_that_does_not_load_is_refused_before_training_and_makes_no_folder(
        bases_that_do_not_load: dict[str, Path], tmp_path: Path, capsys) -> None:
    """Before, a base with a config.json but no loadable weights was transformers' OSError traceback,
    after the --out folder's parent had been made."""
    out = tmp_path / "new" / "grafted"
    for base in bases_that_do_not_load.values():
        assert main(["--base", str(base), "--out", str(out), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --base {base} does not load: ") and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()
