import pytest
import torch

from torchneuron.kernels import reduce
from tests.kernels.conftest import DTYPES, close

CASES = [((1,), 0), ((127, 129), 1), ((127, 129), 0), ((3, 300, 5), 1), ((300,), 0), ((2, 7), 1)]
REF = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", CASES)
def test_reductions_match_torch(shape, dim, dtype):
    x = torch.randn(shape).to(dtype)
    for op, fn in REF.items():
        out = reduce(x, dim, op)
        # the kernel accumulates in fp32 and rounds once: compare with fp32 torch, bf16-scaled
        close(out, fn(x.float(), dim), dtype, scale=3.0 if op == "sum" else 1.0)
    assert torch.equal(reduce(x, dim, "argmax"), x.argmax(dim))


def test_keepdim():
    x = torch.randn(4, 5, 6)
    assert reduce(x, 1, "sum", keepdim=True).shape == (4, 1, 6)


def test_argmax_too_long_is_refused():
    with pytest.raises(AssertionError, match="max8"):
        reduce(torch.zeros(1, 16385), 1, "argmax")
