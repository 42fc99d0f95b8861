"""BitmaskBuffer: rows reused every step, reset to all-allowed, one copy to the logits' device."""

import pytest
import torch

from vlm_catalog.structured.bitmask import BitmaskBuffer, allow_only_token, apply_bitmask


def test_rows_are_reset_every_step_and_mask_the_logits():
    buffer = BitmaskBuffer(max_rows=4, vocab_size=70)
    rows = buffer.host(3)
    assert rows.shape == (3, 3) and bool((rows == -1).all())
    allow_only_token(rows, 1, 65)
    logits = torch.zeros(3, 70)
    apply_bitmask(logits, buffer.device(3), [1])
    assert torch.isinf(logits[1]).sum() == 69 and logits[1, 65] == 0
    assert bool((logits[[0, 2]] == 0).all())  # rows not listed are untouched
    again = buffer.host(2)  # the next step starts from every token allowed
    assert again.data_ptr() == rows.data_ptr() and bool((again == -1).all())


def test_row_count_is_checked():
    buffer = BitmaskBuffer(max_rows=2, vocab_size=32)
    with pytest.raises(ValueError, match="num_rows must be in 1..2"):
        buffer.host(3)


@pytest.mark.gpu
def test_cuda_rows_are_pinned_and_copied_in_one_transfer():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    buffer = BitmaskBuffer(max_rows=8, vocab_size=100, device="cuda")
    rows = buffer.host(5)
    assert rows.is_pinned()
    allow_only_token(rows, 4, 99)
    on_device = buffer.device(5)
    assert on_device.is_cuda and torch.equal(on_device.cpu(), rows)
