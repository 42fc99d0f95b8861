"""The model fingerprint a resumed batch job compares: what changes it and what does not."""

from __future__ import annotations

import os
import shutil

from vlm_catalog.batch.fingerprint import SAMPLE_BYTES, WHOLE_FILE_BYTES, model_fingerprint


def write_byte(path, offset: int, value: bytes) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        handle.write(value)


def test_large_weights_are_sampled_and_small_files_read_whole(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    weights = model / "model-00001-of-00002.safetensors"
    size = WHOLE_FILE_BYTES + 5 * SAMPLE_BYTES
    with weights.open("wb") as handle:
        handle.truncate(size)  # sparse: a 69 MiB file without 69 MiB of disk
    first = model_fingerprint(model)

    (model / "README.md").write_text("notes")  # not a file the loader reads
    os.utime(weights, (0, 0))
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)  # new modification times, same content
    assert model_fingerprint(model) == first == model_fingerprint(copy)

    for offset in (10, size // 2, size - 10):  # in the start, middle and end samples
        write_byte(weights, offset, b"\x01")
        assert model_fingerprint(model) != first
        write_byte(weights, offset, b"\x00")
        assert model_fingerprint(model) == first
    (model / "config.json").write_text('{"hidden_size": 9}')
    assert model_fingerprint(model) != first
    (model / "config.json").write_text('{"hidden_size": 8}')
    with weights.open("r+b") as handle:
        handle.truncate(size + 1)
    assert model_fingerprint(model) != first
