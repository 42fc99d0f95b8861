"""The vision-path measures: the sticker probe, the blanked-photo effect, the token cosine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from vlm_catalog.paths import SAMPLE_CATALOGUE_DIR
from vlm_catalog.training.vision_probe import (
    image_effect,
    load_model,
    measure,
    photo_only_builder,
    probe_f1,
)


def test_probe_finds_a_signal_that_is_there_and_not_one_that_is_not() -> None:
    generator = torch.Generator().manual_seed(0)
    labels = (torch.rand(300, generator=generator) < 0.3).float()
    noise = torch.randn(300, 20, generator=generator)
    with_signal = noise.clone()
    with_signal[:, 3] += 8 * labels  # one feature carries the label
    assert probe_f1(with_signal, labels, train=200) > 0.95
    assert probe_f1(noise, labels, train=200) < 0.7


def test_blanking_the_photo_moves_the_answer_of_a_model_that_reads_it(tiny_base: Path) -> None:
    model = load_model(tiny_base)
    builder = photo_only_builder(tiny_base, seed=77)
    real, blank, count = image_effect(model, builder, list(range(30)))
    assert count >= 1
    assert 0.0 <= real <= 1.0 and 0.0 <= blank <= 1.0
    assert real != blank  # random weights still mix the photo into every position after it
    # a vision tower whose output is zero passes nothing on: blanking changes nothing
    for merger in [model.model.visual.merger, *model.model.visual.deepstack_merger_list]:
        torch.nn.init.zeros_(merger.linear_fc2.weight)
        torch.nn.init.zeros_(merger.linear_fc2.bias)
    real, blank, _ = image_effect(model, builder, list(range(30)))
    assert math.isclose(real, blank, rel_tol=1e-6)


def test_measure_reports_every_stage_of_the_tower(tiny_base: Path) -> None:
    report = measure(tiny_base, seed=77, records=12, effect_records=12)
    model = load_model(tiny_base)
    stages = ["raw", "patch_embed"] + [f"block{i}" for i in range(len(model.model.visual.blocks))] + ["merger"]
    assert list(report.probe_f1) == stages
    assert all(0.0 <= f1 <= 1.0 for f1 in report.probe_f1.values())
    assert -1.0 <= report.token_cosine <= 1.0


def test_an_unwritable_json_report_is_refused_before_the_probes(tmp_path: Path, capsys) -> None:
    """Before, the --json path was first tried after every probe had run: a traceback, the report lost."""
    from vlm_catalog.training import reference, vision_probe

    (tmp_path / "taken.json").mkdir()
    for main, argv in ((vision_probe.main, ["--model", str(tmp_path / "no-model")]),
                       (reference.main, ["--model", str(tmp_path / "no-model"), "--catalogue", str(tmp_path)])):
        assert main([*argv, "--json", str(tmp_path / "taken.json")]) == 2  # before any model is loaded
        assert "is a folder; give a file name" in capsys.readouterr().err


def test_a_model_catalogue_or_record_count_that_cannot_work_is_refused_in_one_line(
        tiny_base: Path, bases_that_do_not_load: dict[str, Path], tmp_path: Path, capsys) -> None:
    """Each was a traceback: --records 0 once the probes' images had been through the tower; a model
    of another type or with damaged weights, and a missing catalogue, from inside the loaders."""
    from vlm_catalog.training import reference, vision_probe

    missing = tmp_path / "no-catalogue"
    cases = [(vision_probe.main, ["--model", str(model)], f"--model {model} does not load: ")
             for model in bases_that_do_not_load.values()]
    cases += [(reference.main, ["--model", str(model), "--catalogue", str(SAMPLE_CATALOGUE_DIR)],
               f"--model {model} does not load: ") for model in bases_that_do_not_load.values()]
    cases.append((reference.main, ["--model", str(tiny_base), "--catalogue", str(missing)],
                  f"catalogue not found: {missing}"))
    for main, argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (argv, err)
    for records in ("0", "2", "-3"):  # the probe trains on 2/3 of them and scores the rest
        with pytest.raises(SystemExit) as stopped:  # argparse's usage error, before the model loads
            vision_probe.main(["--model", str(tiny_base), "--records", records])
        assert stopped.value.code == 2
        assert "argument --records: must be at least 3" in capsys.readouterr().err


def test_report_helpers_refuse_and_report_in_one_line(tmp_path: Path, capsys) -> None:
    from vlm_catalog.report_file import refuse_report_path, report_written

    assert not refuse_report_path(None) and not refuse_report_path(tmp_path / "new" / "report.json")
    assert not (tmp_path / "new").exists()  # checked, not made: a run refused later leaves no folder
    assert report_written(tmp_path / "new" / "report.json", "{}\n")
    assert (tmp_path / "new" / "report.json").read_text() == "{}\n"
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert not report_written(a_file / "report.json", "{}\n")  # a path no file can have
    assert capsys.readouterr().err == f"error: --json {a_file / 'report.json'}: cannot write it (Not a directory)\n"
