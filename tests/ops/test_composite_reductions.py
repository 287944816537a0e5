"""Reductions and scans composed from lowered ops (ops/composite_reductions.py) run on the device (strict mode)
and match the CPU."""
import re

import pytest
import torch

from tests.ops.conftest import to_n

torch.manual_seed(0)
NAN = float("nan")


def same(dev, cpu, **kw):
    """The device result equals the CPU's (NaN matching NaN)."""
    if isinstance(cpu, (tuple, list)):
        for a, b in zip(dev, cpu):
            same(a, b, **kw)
        return
    torch.testing.assert_close(dev.cpu(), cpu, equal_nan=True, **kw)


def test_nansum(strict):
    x = torch.randn(3, 5)
    x[0, 1] = x[2, 4] = NAN
    same(to_n(x).nansum(), x.nansum(), atol=1e-5, rtol=1e-5)
    same(to_n(x).nansum(1, keepdim=True), x.nansum(1, keepdim=True), atol=1e-5, rtol=1e-5)
    out = to_n(torch.empty(0))
    torch.nansum(to_n(x), 0, out=out)
    same(out, x.nansum(0), atol=1e-5, rtol=1e-5)
    same(to_n(torch.empty(0, 3)).nansum(0), torch.empty(0, 3).nansum(0))
    xi = torch.randint(-5, 5, (4, 3), dtype=torch.int32)
    same(to_n(xi).nansum(0), xi.nansum(0))


def test_std_var_mean_aminmax_count(strict):
    x = torch.randn(4, 6)
    for kw in ({}, {"dim": 1}, {"dim": 0, "correction": 0, "keepdim": True}):
        same(torch.std_mean(to_n(x), **kw), torch.std_mean(x, **kw), atol=1e-5, rtol=1e-5)
        same(torch.var_mean(to_n(x), **kw), torch.var_mean(x, **kw), atol=1e-5, rtol=1e-5)
    same(torch.aminmax(to_n(x)), torch.aminmax(x))
    same(torch.aminmax(to_n(x), dim=1, keepdim=True), torch.aminmax(x, dim=1, keepdim=True))
    lo, hi = to_n(torch.empty(0)), to_n(torch.empty(0))
    torch.aminmax(to_n(x), dim=0, out=(lo, hi))
    same((lo, hi), torch.aminmax(x, dim=0))
    with pytest.raises(RuntimeError):
        torch.aminmax(to_n(torch.empty(0)))
    x[1, 2] = 0
    same(torch.count_nonzero(to_n(x), 1), torch.count_nonzero(x, 1))
    same(torch.count_nonzero(to_n(x)), torch.count_nonzero(x))


def test_median_nanmedian(strict):
    x = torch.randint(0, 4, (3, 7)).float()          # many ties: the index choice matters
    x[1, 3] = NAN
    x[2, ::2] = NAN
    for fn in (torch.median, torch.nanmedian):
        same(fn(to_n(x)), fn(x))
        for dim, keepdim in ((1, False), (0, True), (-1, True)):
            same(fn(to_n(x), dim, keepdim), fn(x, dim, keepdim))
        v, i = to_n(torch.empty(0)), to_n(torch.empty(0, dtype=torch.int64))
        fn(to_n(x), 1, out=(v, i))
        same((v, i), fn(x, 1))
        same(fn(to_n(torch.empty(0))), fn(torch.empty(0)))
        with pytest.raises(IndexError):
            fn(to_n(x), 2)
        with pytest.raises(IndexError):
            fn(to_n(torch.empty(2, 0)), 1)
    # an all-NaN line: NaN, index 0 here (the CPU's index there is an artifact of nth_element)
    allnan = torch.full((2, 5), NAN)
    same(torch.nanmedian(to_n(allnan), 1).values, torch.nanmedian(allnan, 1).values)
    same(torch.median(to_n(allnan), 1), torch.median(allnan, 1))
    xe = torch.randint(0, 3, (4, 6), dtype=torch.int32)
    same(torch.median(to_n(xe), 1), torch.median(xe, 1))


def test_cummax_cummin(strict):
    x = torch.randint(0, 4, (3, 9)).float()
    x[1, 4] = NAN
    x[1, 7] = NAN
    for fn in (torch.cummax, torch.cummin):
        for dim in (0, 1):
            same(fn(to_n(x), dim), fn(x, dim))
    xi = torch.randint(-3, 3, (5, 4), dtype=torch.int32)
    same(torch.cummax(to_n(xi), 0), torch.cummax(xi, 0))


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_int32_cummax_cummin_past_2_24_are_exact_like_cpu():
    # int32 values beyond +-2**24 are not exact in the device's fp32 keys: they are refused to the
    # counted fallback, so values and indices are the CPU's (a value not in the input never comes back)
    x = torch.tensor([[2 ** 24 + 1, 3, 2 ** 24 + 3, 5, -2 ** 31, 2 ** 31 - 1]], dtype=torch.int32)
    for fn in (torch.cummax, torch.cummin):
        got, ref = fn(to_n(x), 1), fn(x, 1)
        assert torch.equal(got.values.cpu(), ref.values) and torch.equal(got.indices.cpu(), ref.indices)


def test_logcumsumexp(strict):
    x = torch.randn(3, 40) * 30
    x[0, 5] = float("-inf")
    x[1, :] = float("-inf")
    x[2, 7] = float("inf")
    for dim in (0, 1):
        same(torch.logcumsumexp(to_n(x), dim), torch.logcumsumexp(x, dim), atol=1e-4, rtol=1e-5)
    out = to_n(torch.empty(0))
    torch.logcumsumexp(to_n(x), 1, out=out)
    same(out, torch.logcumsumexp(x, 1), atol=1e-4, rtol=1e-5)
    same(torch.logcumsumexp(to_n(torch.tensor([1e3, 1e3 + 1, 0.0, NAN, 2.0])), 0),
         torch.logcumsumexp(torch.tensor([1e3, 1e3 + 1, 0.0, NAN, 2.0]), 0))


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(strict, reduce, include_self):
    x = torch.randn(5, 3)
    src = torch.randn(4, 3)
    idx = torch.tensor([0, 4, 0, 2])
    want = x.index_reduce(0, idx, src, reduce, include_self=include_self)
    same(to_n(x).index_reduce(0, to_n(idx), to_n(src), reduce, include_self=include_self), want)
    a = to_n(x)
    a.index_reduce_(0, to_n(idx), to_n(src), reduce, include_self=include_self)
    same(a, want)
    idx1 = torch.tensor([2, 1, 2])
    src1 = torch.randn(5, 3)
    same(to_n(x).index_reduce(1, to_n(idx1), to_n(src1), reduce, include_self=include_self),
         x.index_reduce(1, idx1, src1, reduce, include_self=include_self))


def test_index_reduce_errors():
    x, src = to_n(torch.randn(5, 3)), to_n(torch.randn(2, 3))
    with pytest.raises(IndexError):
        x.index_reduce(0, to_n(torch.tensor([0, 5])), src, "amax")
    with pytest.raises(RuntimeError):
        x.index_reduce(0, to_n(torch.tensor([0, 1])), src, "sum")


@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "max", "min"])
@pytest.mark.parametrize("initial", [None, 1.5])
def test_segment_reduce_matches_cpu(reduce, initial, strict):
    # batched lengths along axis 1 with empty segments; offsets; a trailing inner dim
    data = torch.randn(5, 6, 3)
    lengths = torch.tensor([[2, 0, 4], [1, 2, 3], [6, 0, 0], [0, 0, 6], [3, 3, 0]])
    offsets = torch.tensor([[0, 2, 2, 6]] * 5)
    for kw in ({"lengths": lengths}, {"offsets": offsets}):
        want = torch.segment_reduce(data, reduce, axis=1, initial=initial, **kw)
        got = torch.segment_reduce(to_n(data), reduce, axis=1, initial=initial,
                                   **{k: to_n(v) for k, v in kw.items()})
        torch.testing.assert_close(got.cpu(), want, equal_nan=True)
    flat = torch.randn(7)
    want = torch.segment_reduce(flat, reduce, lengths=torch.tensor([3, 0, 4]), initial=initial)
    got = torch.segment_reduce(to_n(flat), reduce, lengths=to_n(torch.tensor([3, 0, 4])), initial=initial)
    torch.testing.assert_close(got.cpu(), want, equal_nan=True)


def test_segment_reduce_bad_lengths_match_cpu(strict):
    for lengths in ([2, -1, 5], [2, 2]):
        with pytest.raises(RuntimeError) as cpu_err:
            torch.segment_reduce(torch.randn(6), "sum", lengths=torch.tensor(lengths))
        with pytest.raises(RuntimeError, match=re.escape(str(cpu_err.value))):
            torch.segment_reduce(to_n(torch.randn(6)), "sum", lengths=to_n(torch.tensor(lengths)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduce", ["sum", "mean", "prod"])
def test_reduced_float_segment_reduce_rounds_once(dtype, reduce, strict):
    # reduced in fp32 and rounded once: each segment is the float64 result rounded to the dtype (or its
    # neighbour, from fp32's own rounding of <= 7 operations); fp16 sums past 65504 are inf like the CPU's
    gen = torch.Generator().manual_seed(0)
    data = (torch.randn(2, 12, 3, generator=gen) * 8).to(dtype)
    data[1, :3, 0] = 60000.0 if dtype == torch.float16 else 1e38    # (an fp32 sum: finite)
    lengths = torch.tensor([[3, 0, 5, 4], [3, 4, 4, 1]])   # with an empty segment
    for initial in (None, 2.5):
        kw = {"lengths": lengths, "axis": 1, "initial": initial}
        exact = torch.segment_reduce(data.double(), reduce, **kw)
        got = torch.segment_reduce(to_n(data), reduce, **{**kw, "lengths": to_n(lengths)}).cpu()
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=2 * torch.finfo(dtype).eps,
                                   atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_float_std_mean_rounds_each_result_once(dtype, strict):
    # the variance's square root in fp32, then rounded: std is the float64 std rounded to the dtype or its
    # neighbour (fp32's rounding); fp16 values past sqrt(65504) per element would overflow a fp16 sum of squares
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 300, generator=gen) * 300).to(dtype)
    std, mean = torch.std_mean(to_n(x), 1)
    exact_std, exact_mean = torch.std_mean(x.double(), 1)
    for got, want in ((std, exact_std), (mean, exact_mean)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu().double(), want.to(dtype).double(), rtol=2 * torch.finfo(dtype).eps,
                                   atol=0)
