import pytest
import torch

from torchneuron.kernels import permute, transpose
from torchneuron.kernels.transpose import simplify

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int8, torch.uint8, torch.bool]
CASES = [((1, 1), (1, 0)), ((127, 129), (1, 0)), ((2, 300, 5), (0, 2, 1)), ((3, 4, 5, 6), (2, 0, 3, 1)),
         ((3, 4, 5, 6), (1, 0, 2, 3)), ((1000, 3), (1, 0)), ((7, 1, 130, 2), (3, 2, 1, 0)),
         ((2, 3, 4, 5, 6, 7), (5, 3, 1, 0, 2, 4)), ((5,), (0,)), ((), ()), ((0, 3), (1, 0)), ((3, 700, 600), (0, 2, 1))]


def _random(shape, dtype):
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    info = torch.iinfo(dtype)   # every bit pattern, including int32 values that are fp32 NaNs
    return torch.randint(info.min, info.max, shape, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dims", CASES)
def test_permute_is_exact(shape, dims, dtype):
    x = _random(shape, dtype)
    out = permute(x, dims)
    assert out.dtype == dtype and torch.equal(out, x.permute(dims).contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (2, 300, 5)])
def test_transpose_is_exact(shape, dtype):
    x = torch.randn(shape).to(dtype)
    assert torch.equal(transpose(x), x.transpose(-2, -1).contiguous())
    assert torch.equal(transpose(x, 0, -1), x.transpose(0, -1).contiguous())


def test_special_values_are_bit_exact():
    x = torch.tensor([[float("nan"), 1.0, -0.0], [float("-inf"), 3.0, float("inf")]])
    assert torch.equal(permute(x, (1, 0)).view(torch.int32), x.T.contiguous().view(torch.int32))


def test_simplify_merges_adjacent_dims_and_drops_ones():
    assert simplify((2, 3, 4, 5), (0, 2, 3, 1)) == ((2, 3, 20), (0, 2, 1))
    assert simplify((2, 1, 4), (2, 1, 0)) == ((2, 4), (1, 0))
    assert simplify((2, 3), (0, 1)) == ((6,), (0,))


def test_not_a_permutation_is_refused():
    with pytest.raises(AssertionError, match="not a permutation"):
        permute(torch.zeros(2, 3), (0, 0))
