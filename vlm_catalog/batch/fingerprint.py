"""A digest of a model directory's files, so a resumed job notices a model changed in place.

A results file must not mix answers of two models. The path alone does not say
that: retraining or re-downloading into the same folder keeps it. Hashing 60 GB
of weights on every start would take minutes, so the digest reads:
- every file under `WHOLE_FILE_BYTES` whole (config, tokenizer, chat template,
  generation and preprocessor settings);
- for a larger file (the weights), its size and `SAMPLE_BYTES` at its start
  (the safetensors header and the first tensors), middle and end. Training
  changes every tensor, so it changes these samples.

Only the files the model loader reads count (`MODEL_FILE_SUFFIXES`), so editing
the folder's README does not stop a resume. Modification times do not count
either: copying the folder keeps the digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

MODEL_FILE_SUFFIXES = (".json", ".jinja", ".safetensors", ".txt", ".model", ".tiktoken")
WHOLE_FILE_BYTES = 64 * 2**20
SAMPLE_BYTES = 2**20


def model_fingerprint(model_dir: Path) -> str:
    """The digest (hex) of the model files in `model_dir`, in name order."""
    digest = hashlib.sha256()
    files = sorted(path for path in Path(model_dir).iterdir() if path.is_file() and path.suffix in MODEL_FILE_SUFFIXES)
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as handle:
            if size <= WHOLE_FILE_BYTES:
                digest.update(handle.read())
                continue
            for start in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
                handle.seek(start)
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()
