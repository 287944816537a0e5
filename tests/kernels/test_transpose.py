import pytest
import torch

from torchneuron.kernels import permute, transpose
from tests.kernels.conftest import DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (2, 300, 5)])
def test_transpose_is_exact(shape, dtype):
    x = torch.randn(shape).to(dtype)
    assert torch.equal(transpose(x), x.transpose(-2, -1).contiguous())
    assert torch.equal(permute(x, (*range(x.dim() - 2), x.dim() - 1, x.dim() - 2)), x.transpose(-2, -1))
