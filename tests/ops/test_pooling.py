"""Pooling gradients in bf16/fp16 against an exact reference: overlapping windows' gradients are summed in
fp32 and rounded once, at least as exact as the CPU's."""
import pytest
import torch

from tests.ops.conftest import to_n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [2, 3])
def test_max_pool_gradient_of_overlapping_windows_rounds_once(dtype, dims, strict):
    # kernel 3, stride 1: an input element that is the maximum of up to 3**dims windows receives that many
    # gradients. Rounded once, each element is the exact sum (float64) rounded to the dtype, to within the fp32
    # sum's own rounding (3**dims terms: 27 * 2**-24 relative); summed in the dtype it drifted by several units
    gen = torch.Generator().manual_seed(0)
    shape = (2, 3) + (6,) * dims
    x = torch.randn(shape, generator=gen).to(dtype)
    x[(0, 0) + (2,) * dims] = 10.0                   # one element is the maximum of every window around it
    pool = torch.nn.functional.max_pool2d if dims == 2 else torch.nn.functional.max_pool3d
    _, idx = pool(x.double(), 3, 1, return_indices=True)
    g = (torch.randn(idx.shape, generator=gen) * 100).to(dtype)
    grad = getattr(torch.ops.aten, f"max_pool{dims}d_with_indices_backward")
    args = ([3] * dims, [1] * dims, [0] * dims, [1] * dims, False)
    exact = grad(g.double(), x.double(), *args, idx)
    got = grad(to_n(g), to_n(x), *args, to_n(idx)).cpu()
    assert got.dtype == dtype
    bound = (torch.finfo(dtype).eps / 2 + 3 ** dims * 2.0 ** -24) * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()
    cpu = grad(g, x, *args, idx)                  # (which sums in the dtype: no closer to the exact sum)
    assert ((got.double() - exact).abs() <= (cpu.double() - exact).abs() + bound).all()
