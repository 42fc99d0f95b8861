import pytest

from vlm_catalog.model.tiny_checkpoint import build_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer(1000)
