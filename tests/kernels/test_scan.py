"""kernels/scan.py against torch.cumsum / torch.cumprod."""
import pytest
import torch

import torchneuron.nki.language as nl
from torchneuron.kernels.scan import scan_rows


@pytest.mark.parametrize("shape", [(1, 5), (130, 70), (3, 5000)])
def test_cumulative_sum_of_rows(shape):
    x = torch.randn(shape)
    out = scan_rows(x, "sum", nl.float32, nl.float32)
    # fp32 running sums in another order than the CPU's: error grows with the row length
    torch.testing.assert_close(out, torch.cumsum(x, 1), atol=1e-6 * shape[1], rtol=1e-5)


def test_cumulative_product_of_rows():
    x = torch.rand(4, 40) + 0.5
    torch.testing.assert_close(scan_rows(x, "prod", nl.float32, nl.float32), torch.cumprod(x, 1), rtol=1e-5, atol=0)


def test_integer_sums_are_exact():
    x = torch.randint(-1000, 1000, (8, 300), dtype=torch.int32)
    assert torch.equal(scan_rows(x, "sum", nl.int32, nl.int32), torch.cumsum(x, 1, dtype=torch.int32))
