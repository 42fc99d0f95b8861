"""`upload`: a step's small inputs reach the device with the values and dtype asked for."""

import pytest
import torch

from vlm_catalog.device_upload import upload


def test_lists_and_tensors_keep_their_values_in_the_dtype_asked_for():
    cpu = torch.device("cpu")
    ids = upload([3, 1, 2], cpu, torch.int32)
    assert ids.dtype == torch.int32 and ids.tolist() == [3, 1, 2]
    assert upload([0.5, 2.0], cpu, torch.float64).dtype == torch.float64
    assert upload([7, 8], cpu).dtype == torch.int64  # torch.tensor's own choice without a dtype
    expanded = torch.arange(4).unsqueeze(0).expand(3, -1)  # [3, 4], a stride-0 view
    assert torch.equal(upload(expanded, cpu), expanded)
    assert upload(torch.tensor([1, 2], dtype=torch.int32), cpu, torch.int64).dtype == torch.int64


@pytest.mark.gpu
def test_cuda_copies_arrive_before_they_are_used():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    host = torch.arange(1 << 20)
    on_device = upload(host, device)
    expanded = upload(torch.arange(5).unsqueeze(0).expand(3, -1), device)
    assert on_device.is_cuda and torch.equal(on_device.cpu(), host)  # stream order: the copy came first
    assert torch.equal(expanded.cpu(), torch.arange(5).unsqueeze(0).expand(3, -1))
