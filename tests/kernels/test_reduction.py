import pytest
import torch

from torchneuron.kernels import reduce
from tests.kernels.conftest import DTYPES, close

CASES = [((1,), 0), ((127, 129), 1), ((127, 129), 0), ((3, 300, 5), 1), ((300,), 0), ((2, 7), 1),
         ((4, 5, 600), 1), ((2, 9000), 1), ((5, 3, 130), 0), ((2, 150, 300), 1), ((), 0),
         ((1030, 192), 0), ((4000, 7), 0)]   # (the last two: grouped rows, then a transpose per 128 columns)
REF = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", CASES)
def test_reductions_match_torch(shape, dim, dtype):
    x = torch.randn(shape).to(dtype)
    for op, fn in REF.items():
        out = reduce(x, dim, op)
        # the kernel accumulates in fp32 and rounds once: compare with fp32 torch, bf16-scaled
        close(out, fn(x.float(), dim), dtype, scale=3.0 if op == "sum" else 1.0)
    p = (1 + 0.01 * x.float()).to(dtype)
    close(reduce(p, dim, "prod"), torch.prod(p.float(), dim), dtype, scale=3.0)
    assert torch.equal(reduce(x, dim, "argmax"), x.argmax(dim))
    assert torch.equal(reduce(x, dim, "argmin"), x.argmin(dim))


@pytest.mark.parametrize("shape,dim", [((3, 20000), 1), ((2, 140, 130), 1), ((40, 3), 0), ((4, 6), 1)])
def test_arg_first_index_and_nan_like_torch(shape, dim):
    x = torch.randint(0, 3, shape).float()           # many ties: the first index must win
    assert torch.equal(reduce(x, dim, "argmax"), x.argmax(dim))
    assert torch.equal(reduce(x, dim, "argmin"), x.argmin(dim))
    idx = [0] * len(shape)
    idx[dim] = shape[dim] - 2
    x[tuple(idx)] = float("nan")                     # a NaN: its index, and NaN values, like PyTorch
    assert torch.equal(reduce(x, dim, "argmax"), x.argmax(dim))
    assert torch.equal(reduce(x, dim, "argmin"), x.argmin(dim))
    assert torch.equal(reduce(x, dim, "max").isnan(), x.amax(dim).isnan())
    assert torch.equal(reduce(x, dim, "sum").isnan(), x.sum(dim).isnan())


@pytest.mark.parametrize("shape", [(3, 300, 130), (1, 260, 600), (40, 3, 7)])
def test_arg_over_a_middle_dim_with_ties_infs_and_nans(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, shape, generator=g).float()     # ties in every column
    x[..., 1] = float("-inf")                                 # a column of -inf: index 0
    x[:, -1, 2] = float("inf")
    cols = torch.rand(shape, generator=g) < 0.002             # NaNs scattered over rows and blocks
    x[cols] = float("nan")
    x[:, 0, 3], x[:, -1, 3] = float("nan"), float("nan")      # a column with two NaNs: the first wins
    assert torch.equal(reduce(x, 1, "argmax"), x.argmax(1))
    assert torch.equal(reduce(x, 1, "argmin"), x.argmin(1))


def test_keepdim():
    x = torch.randn(4, 5, 6)
    assert reduce(x, 1, "sum", keepdim=True).shape == (4, 1, 6)


def test_unknown_op_is_refused():
    with pytest.raises(AssertionError, match="unknown"):
        reduce(torch.zeros(2, 3), 1, "median")


def test_leading_dim_reduction_propagates_nan():
    x = torch.randn(300, 5)
    x[7, 2] = float("nan")
    for op, fn in REF.items():
        out = reduce(x, 0, op)
        want = fn(x, 0)
        assert torch.isnan(out[2]) and torch.allclose(out[[0, 1, 3, 4]], want[[0, 1, 3, 4]], atol=1e-4)
