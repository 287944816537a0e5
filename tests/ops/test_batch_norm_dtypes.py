"""Training batch norm in bf16 and fp16 rounds its statistics where the CPU's kernel does.

The CPU's bf16 kernel keeps mean, sum of squares, variance and 1/std as bf16 scalars and normalizes the
input with the rounded mean and 1/std; its fp16 kernel computes the statistics in fp32 but still normalizes
with the saved fp16 ones. Normalizing with the fp32 statistics instead put 2-5% of the outputs one unit of
the dtype away from the CPU's. With the same roundings, a statistic can differ only where the two fp32 sums
(in different orders) straddle a rounding boundary of the dtype: with K <= 130 terms the sums differ
by at most K units of fp32 (2**-24) of the terms, so a statistic lands on the other side of a boundary
with a probability of about K * 2**-24 / 2**-8 < 1% per channel, and then moves by one unit of the dtype.
"""
import pytest
import torch

from tests.ops.conftest import to_n

CASES = [((5, 5, 5), 0.5, 0.6), ((8, 6, 4, 4), 0.1, 1e-5), ((16, 3), 0.3, 0.2), ((4, 7, 30), 0.1, 1e-3)]


def _ulps(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """|a - e| in units of the dtype at e's magnitude (its eps times |e|, at least its smallest normal)."""
    fi = torch.finfo(e.dtype)
    return (a.double() - e.double()).abs() / (fi.eps * e.double().abs()).clamp_min(fi.tiny)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,momentum,eps", CASES)
def test_training_batch_norm_rounds_statistics_as_the_cpu(strict, dtype, shape, momentum, eps):
    gen = torch.Generator().manual_seed(sum(shape) + (dtype == torch.float16))
    C = shape[1]
    x = (torch.randn(shape, generator=gen) * 4 + 2).to(dtype)
    w, b = torch.randn(C, generator=gen).to(dtype), torch.randn(C, generator=gen).to(dtype)
    rm, rv = torch.randn(C, generator=gen).to(dtype), torch.rand(C, generator=gen).to(dtype) + 0.5
    drm, drv = to_n(rm), to_n(rv)
    want = torch.native_batch_norm(x, w, b, rm, rv, True, momentum, eps)
    got = torch.native_batch_norm(to_n(x), to_n(w), to_n(b), drm, drv, True, momentum, eps)
    mean, invstd = want[1].double(), want[2].double()
    # a statistic's rounding flipped moves it by one unit: at most one such channel, by at most one unit
    for name, a, e in (("save_mean", got[1], want[1]), ("save_invstd", got[2], want[2]),
                       ("running_mean", drm, rm), ("running_var", drv, rv)):
        off = _ulps(a.cpu(), e)
        assert int((off > 0).sum()) <= 1 and float(off.max()) <= 1, (name, a.cpu(), e)
    out, ref = got[0].cpu().double(), want[0].double()
    view = [1, C] + [1] * (len(shape) - 2)
    alpha = (invstd * w.double()).abs().view(view)
    # one unit of the dtype in mean or 1/std carried through the terms x * alpha and mean * alpha, plus the
    # result's own rounding
    terms = (x.double().abs() + mean.abs().view(view)) * alpha
    assert bool(((out - ref).abs() <= torch.finfo(dtype).eps * (terms + ref.abs())).all())
    if torch.equal(got[1].cpu(), want[1]) and torch.equal(got[2].cpu(), want[2]):
        # the same statistics: x * alpha + beta in fp32, rounded once, on both; the CPU may fuse the multiply
        # and add or not (its scalar loop, the machine's ISA): the fp32 results differ by a rounding of
        # x * alpha, which can move the rounded result by one unit of the dtype at the result's magnitude
        fp32 = 2.0 ** -24 * x.double().abs() * alpha
        fi = torch.finfo(dtype)
        assert bool(((out - ref).abs() <= fi.eps * ref.abs().clamp_min(fi.tiny) + fp32).all())
