"""kernels/scatter.py against PyTorch's index assignment."""
import pytest
import torch

from torchneuron.kernels.scatter import scatter_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_scatter_rows_matches_index_assignment(dtype):
    table = torch.randn(60, 9).to(dtype)
    index = torch.randperm(60)[:200 % 60].to(torch.int32)
    values = torch.randn(index.numel(), 9).to(dtype)
    expected = table.clone()
    expected[index.long()] = values
    scatter_rows(table, index, values)
    assert torch.equal(table, expected)
