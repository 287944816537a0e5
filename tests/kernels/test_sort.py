"""kernels/sort.py against PyTorch's stable sort."""
import pytest
import torch

from torchneuron.kernels.sort import bitonic_sort_rows


@pytest.mark.parametrize("n", [2, 17, 128, 1000])
@pytest.mark.parametrize("descending", [False, True])
def test_bitonic_sort_is_a_stable_sort(n, descending):
    key = torch.randint(-5, 5, (130, n)).float()      # many ties: the column index decides them
    values, ties = bitonic_sort_rows(key, descending=descending)
    expected, order = torch.sort(key, dim=1, descending=descending, stable=True)
    assert torch.equal(values, expected) and torch.equal(ties, order.to(torch.int32))
