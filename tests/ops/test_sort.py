"""Scans and sorts run on the device (strict mode) and match the CPU."""
import pytest
import torch

from tests.ops.conftest import to_n

torch.manual_seed(0)


def same(dev, cpu, **kw):
    torch.testing.assert_close(dev.cpu(), cpu, equal_nan=True, **kw)


def test_cumsum_cumprod(strict):
    x = torch.randn(3, 4, 70)
    for dim in (0, 1, -1):
        same(to_n(x).cumsum(dim), x.cumsum(dim), atol=1e-5, rtol=1e-5)
        same(to_n(x * 0.1 + 1).cumprod(dim), (x * 0.1 + 1).cumprod(dim), atol=1e-5, rtol=1e-5)
    xi = torch.randint(-5, 5, (4, 6), dtype=torch.int32)
    same(to_n(xi).cumsum(1), xi.cumsum(1))                      # int64 result, like the CPU
    same(to_n(xi > 0).cumsum(0), (xi > 0).cumsum(0))
    same(to_n(xi).cumprod(0, dtype=torch.float32), xi.cumprod(0, dtype=torch.float32))
    a = to_n(x)
    a.cumsum_(1)
    same(a, x.cumsum(1), atol=1e-5, rtol=1e-5)
    out = to_n(torch.empty(0))
    torch.cumsum(to_n(x), 2, out=out)
    same(out, x.cumsum(2), atol=1e-5, rtol=1e-5)
    same(to_n(torch.tensor(3.0)).cumsum(0), torch.tensor(3.0).cumsum(0))


def test_integer_scans_past_int32_are_exact_like_cpu():
    # integer cumsum/cumprod give int64 like the CPU: sums whose partial sums could pass int32 scan the
    # int64 words on the device (strict mode); products past int32 are refused to the counted fallback
    import torchneuron
    before = torchneuron.is_strict()
    torchneuron.set_strict(True)
    try:
        for x in (torch.full((3, 5000), 2 ** 20, dtype=torch.int32),
                  torch.tensor([[2 ** 30, 2 ** 30, -2 ** 31, -2 ** 31, 5]], dtype=torch.int32),
                  torch.randint(-1000, 1000, (4, 300), dtype=torch.int32)):
            ref = x.cumsum(1)
            got = to_n(x).cumsum(1).cpu()
            assert got.dtype == ref.dtype == torch.int64
            assert torch.equal(got, ref)
            out = to_n(torch.empty(0, dtype=torch.int64))
            torch.cumsum(to_n(x), 1, out=out)
            assert torch.equal(out.cpu(), ref)
        short = torch.randint(-3, 4, (4, 15), dtype=torch.int16)
        assert torch.equal(to_n(short).cumprod(1).cpu(), short.cumprod(1))
        # an int32 result wraps mod 2**32 as the CPU's does
        wide = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 3000), dtype=torch.int32)
        for op in ("cumsum", "cumprod"):
            assert torch.equal(getattr(to_n(wide), op)(1, dtype=torch.int32).cpu(), getattr(wide, op)(1, dtype=torch.int32))
    finally:
        torchneuron.set_strict(before)
    for x in (torch.full((2, 40), 3, dtype=torch.int16), torch.full((2, 40), -3, dtype=torch.int32),
              torch.tensor([[2 ** 16, 2 ** 16, 7]], dtype=torch.int32)):
        ref = x.cumprod(1)
        got = to_n(x).cumprod(1).cpu()
        assert got.dtype == ref.dtype == torch.int64
        assert torch.equal(got, ref)


def test_int64_cumsum_exact_and_wrapping_like_cpu(strict):
    # int64 sums over the int32 word pairs: carries out of the low word, values past 2**31 and 2**32,
    # and wrap-around at 2**64 as the CPU's int64 arithmetic
    g = torch.Generator().manual_seed(3)
    cases = [torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]]),                     # an attention mask
             INT64_EDGES,
             torch.randint(-2 ** 63, 2 ** 63 - 1, (5, 300), generator=g),
             torch.full((2, 3000), 2 ** 32 - 1),                                     # a carry at every step
             torch.full((3, 2500), 2 ** 63 - 1),                                     # wraps past 2**64 many times
             torch.randint(-2 ** 40, 2 ** 40, (130, 3), generator=g)]                # more lines than partitions
    for x in cases:
        for d in range(x.dim()):
            assert torch.equal(to_n(x).cumsum(d).cpu(), x.cumsum(d)), (x.shape, d)
    x = cases[2]
    a = to_n(x)
    a.cumsum_(0)
    assert torch.equal(a.cpu(), x.cumsum(0))
    assert torch.equal(to_n(x).t().cumsum(1).cpu(), x.t().cumsum(1))                # a transposed view
    assert torch.equal(to_n(torch.tensor(-5)).cumsum(0).cpu(), torch.tensor(-5).cumsum(0))
    for dtype in (torch.int32, torch.int16):                                       # dtype= casts first
        assert torch.equal(to_n(x).cumsum(1, dtype=dtype).cpu(), x.cumsum(1, dtype=dtype)), dtype
    modest = torch.randint(-1000, 1000, (3, 300), generator=g)                     # fp32 sums exact below 2**24
    assert torch.equal(to_n(modest).cumsum(1, dtype=torch.float32).cpu(), modest.cumsum(1, dtype=torch.float32))
    small = torch.randint(-5, 5, (4, 70), dtype=torch.int8)
    assert torch.equal(to_n(small).cumsum(1, dtype=torch.int64).cpu(), small.cumsum(1, dtype=torch.int64))


def test_cumsum_long_rows(strict):
    x = torch.rand(2, 5000)
    same(to_n(x).cumsum(1), x.cumsum(1), atol=1e-3, rtol=1e-5)


def test_scan_backward(strict):
    x = torch.rand(3, 6) + 0.5
    for fn in (lambda t: t.cumsum(1), lambda t: t.cumprod(1)):
        a, b = x.clone().requires_grad_(), to_n(x).requires_grad_()
        g = torch.randn(3, 6)
        fn(a).backward(g)
        fn(b).backward(to_n(g))
        same(b.grad, a.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_stable_with_ties_and_nan(dtype, descending, strict):
    x = torch.randint(-3, 4, (5, 9)).to(dtype)
    if dtype.is_floating_point:
        x[1, 2] = x[3, 0] = float("nan")
    for dim in (1, 0):
        v, i = torch.sort(to_n(x), dim=dim, descending=descending, stable=True)
        cv, ci = torch.sort(x, dim=dim, descending=descending, stable=True)
        same(v, cv, atol=0, rtol=0)
        same(i, ci, atol=0, rtol=0)
    same(to_n(x).argsort(dim=0, descending=descending), x.argsort(dim=0, descending=descending, stable=True))
    same(to_n(x).msort(), x.msort())


def test_topk_kthvalue(strict):
    x = torch.randn(4, 10)
    for k, largest in ((3, True), (1, False), (10, True)):
        v, i = torch.topk(to_n(x), k, largest=largest)
        cv, ci = torch.topk(x, k, largest=largest)
        same(v, cv, atol=0, rtol=0)
        same(to_n(x).gather(1, i).cpu(), cv, atol=0, rtol=0)    # the indices point at those values
    v, i = torch.topk(to_n(x), 2, dim=0)
    same(v, torch.topk(x, 2, dim=0).values, atol=0, rtol=0)
    for k, dim, keepdim in ((3, 1, False), (1, 0, True)):
        v, i = torch.kthvalue(to_n(x), k, dim, keepdim)
        cv, ci = torch.kthvalue(x, k, dim, keepdim)
        same(v, cv, atol=0, rtol=0)
        same(i, ci)


def test_errors_match_cpu():
    x = torch.randn(3, 4)
    for cpu, dev in ((lambda: torch.topk(x, 5), lambda: torch.topk(to_n(x), 5)),
                     (lambda: torch.kthvalue(x, 5), lambda: torch.kthvalue(to_n(x), 5)),
                     (lambda: torch.sort(x, dim=2), lambda: torch.sort(to_n(x), dim=2)),
                     (lambda: x.cumsum(3), lambda: to_n(x).cumsum(3))):
        with pytest.raises(Exception) as c:
            cpu()
        with pytest.raises(c.type) as d:
            dev()
        assert str(d.value) == str(c.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_bitonic_sort_long_rows(dtype, strict):
    # rows past RANK_COLS take the bitonic network: ties stay in input order, NaN sorts as the largest
    x = torch.randint(-20, 20, (3, 300)).to(dtype)
    if dtype.is_floating_point:
        x[0, 5] = x[0, 200] = x[2, 0] = float("nan")
        x[0, 7] = x[1, 9] = float("inf")
        x[1, 3] = float("-inf")
    for descending in (False, True):
        for dim in (1, 0):
            v, i = torch.sort(to_n(x), dim=dim, descending=descending, stable=True)
            cv, ci = torch.sort(x, dim=dim, descending=descending, stable=True)
            same(v, cv, atol=0, rtol=0)
            same(i, ci, atol=0, rtol=0)


def test_bitonic_sort_in_several_launches(strict, monkeypatch):
    import torchneuron.ops.sort as sort_ops
    monkeypatch.setattr(sort_ops, "BITONIC_LIMIT", 30)        # 21 steps per 128 lines of 64: 128 lines a launch
    x = torch.randint(-5, 5, (300, 64)).float()
    x[5, 3] = float("nan")
    v, i = torch.sort(to_n(x), stable=True, descending=True)
    cv, ci = torch.sort(x, stable=True, descending=True)
    same(v, cv, atol=0, rtol=0)
    same(i, ci, atol=0, rtol=0)


def test_sort_8000(strict):
    x = torch.randn(8000)
    x[::97] = 0.5
    v, i = torch.sort(to_n(x), stable=True)
    cv, ci = torch.sort(x, stable=True)
    same(v, cv, atol=0, rtol=0)
    same(i, ci, atol=0, rtol=0)


def test_mode(strict):
    x = torch.randint(0, 4, (5, 6, 7)).float()
    for dim, keepdim in ((0, False), (1, True), (-1, False)):
        v, i = torch.mode(to_n(x), dim, keepdim)
        cv, _ = torch.mode(x, dim, keepdim)
        same(v, cv)
        same(to_n(x).gather(dim, i if keepdim else i.unsqueeze(dim)).cpu(), cv if keepdim else cv.unsqueeze(dim))
    y = torch.randn(7, 9)                                       # distinct values: the indices are determined
    for dim in (0, 1):
        v, i = torch.mode(to_n(y), dim)
        cv, ci = torch.mode(y, dim)
        same(v, cv)
        same(i, ci)
    v, i = torch.mode(to_n(torch.tensor([1.0, 2, 1, 2, 1])))
    assert (v.item(), i.item()) == (1.0, 4)                     # the CPU's pick: the last copy


def test_searchsorted_bucketize(strict):
    seq = torch.randn(4, 10).sort(-1).values
    vals = torch.randn(4, 6)
    vals[0, 0] = seq[0, 3]                                      # exactly on a boundary
    vals[1, 1] = float("nan")
    for right in (False, True):
        for out_int32 in (False, True):
            same(torch.searchsorted(to_n(seq), to_n(vals), right=right, out_int32=out_int32),
                 torch.searchsorted(seq, vals, right=right, out_int32=out_int32))
            same(torch.bucketize(to_n(vals), to_n(seq[0]), right=right, out_int32=out_int32),
                 torch.bucketize(vals, seq[0], right=right, out_int32=out_int32))
    unsorted = torch.randn(10)
    sorter = unsorted.argsort()
    same(torch.searchsorted(to_n(unsorted), to_n(vals), side="right", sorter=to_n(sorter)),
         torch.searchsorted(unsorted, vals, side="right", sorter=sorter))
    same(torch.searchsorted(to_n(seq[0]), 0.25), torch.searchsorted(seq[0], 0.25))
    out = to_n(torch.empty(0, dtype=torch.int64))
    torch.searchsorted(to_n(seq), to_n(vals), out=out)
    same(out, torch.searchsorted(seq, vals))


def test_histc_bincount(strict):
    x = torch.randn(6, 7) * 4
    x[0, 0] = 10.0                                             # the top edge goes to the last bin
    for kw in ({}, {"bins": 7, "min": -5, "max": 10}, {"bins": 3, "min": 0, "max": 0}):
        same(torch.histc(to_n(x), **kw), torch.histc(x, **kw))
    same(torch.histc(to_n(torch.tensor(2.0)), bins=4), torch.histc(torch.tensor(2.0), bins=4))
    i = torch.randint(0, 9, (30,))
    same(torch.bincount(to_n(i)), torch.bincount(i))
    same(torch.bincount(to_n(i), minlength=20), torch.bincount(i, minlength=20))
    w = torch.randint(-5, 5, (30,))
    same(torch.bincount(to_n(i), to_n(w)), torch.bincount(i, w))          # float64 result, as the CPU
    w = torch.randn(30)
    same(torch.bincount(to_n(i), to_n(w)), torch.bincount(i, w), atol=1e-5, rtol=1e-5)
    same(torch.bincount(to_n(torch.empty(0, dtype=torch.int64)), minlength=3),
         torch.bincount(torch.empty(0, dtype=torch.int64), minlength=3))


def _all_same(dev, cpu):
    for d, c in zip(dev, cpu):
        assert d.shape == c.shape and d.dtype == c.dtype
        same(d, c, atol=0, rtol=0)


def test_unique(strict):
    x = torch.tensor([[3.0, 1, 2, 1], [float("nan"), float("nan"), -0.0, 0.0]])
    aten = torch.ops.aten
    for inv in (False, True):
        for cnt in (False, True):
            _all_same(aten._unique2(to_n(x), True, inv, cnt), aten._unique2(x, True, inv, cnt))
            _all_same(aten.unique_consecutive(to_n(x), inv, cnt), aten.unique_consecutive(x, inv, cnt))
    y = torch.randint(0, 2, (5, 3, 4)).float()
    for dim in (0, 1, -1):
        _all_same(aten.unique_dim(to_n(y), dim, True, True, True), aten.unique_dim(y, dim, True, True, True))
        _all_same(aten.unique_consecutive(to_n(y), True, True, dim), aten.unique_consecutive(y, True, True, dim))
    z = torch.randint(0, 3, (9,), dtype=torch.int32)
    _all_same(torch.unique(to_n(z), return_inverse=True, return_counts=True),
              torch.unique(z, return_inverse=True, return_counts=True))
    _all_same(aten.unique_consecutive(to_n(z), True, True, 0), aten.unique_consecutive(z, True, True, 0))


def test_search_count_unique_errors_match_cpu(strict):
    x = torch.randn(3, 4)
    i = torch.tensor([1, 2])
    cases = ((lambda t: torch.bucketize(t, t), x),
             (lambda t: torch.searchsorted(t[0], t, side="left", right=True), x),
             (lambda t: torch.searchsorted(t[:2], t), x),
             (lambda t: torch.searchsorted(t, 0.5), x),
             (lambda t: torch.searchsorted(t[0], t, sorter=torch.full((4,), 9, device=t.device)), x),
             (lambda t: torch.histc(t, min=2, max=1), x),
             (lambda t: torch.histc(t, bins=0), x),
             (lambda t: torch.bincount(t - 3), i),
             (lambda t: torch.bincount(t, minlength=-1), i),
             (lambda t: torch.bincount(t.reshape(2, 1)), i),
             (lambda t: torch.ops.aten.unique_dim(t, 2, True, False, False), x),
             (lambda t: torch.ops.aten.unique_dim(t[0, 0], 0, True, False, False), x),
             (lambda t: torch.mode(t[:, :0], 1), x))
    for fn, arg in cases:
        with pytest.raises(Exception) as c:
            fn(arg)
        with pytest.raises(c.type):
            fn(to_n(arg))


INT64_EDGES = torch.tensor([0, -1, 1, 2 ** 31, -2 ** 31, 2 ** 31 - 1, -2 ** 31 - 1, 2 ** 32, 2 ** 32 + 5, -2 ** 40,
                            2 ** 62, -2 ** 63, 2 ** 63 - 1, 5, 5, -7])


@pytest.mark.parametrize("descending", [False, True])
def test_int64_sort_topk_argsort_beyond_32_bits(descending, strict):
    # two stable int32 passes (low word, then high word): exact order, equal values in input order
    g = torch.Generator().manual_seed(0)
    cases = [INT64_EDGES, INT64_EDGES[torch.randperm(16, generator=g)],
             torch.randint(-2 ** 40, 2 ** 40, (3, 300), generator=g), torch.randint(-3, 3, (4, 40), generator=g)]
    for x in cases:
        for d in range(x.dim()):
            want = torch.sort(x, dim=d, descending=descending, stable=True)
            got = torch.sort(to_n(x), dim=d, descending=descending, stable=True)
            assert torch.equal(got.values.cpu(), want.values) and torch.equal(got.indices.cpu(), want.indices)
    t = cases[2]
    assert torch.equal(to_n(t).topk(5, largest=not descending).values.cpu(), t.topk(5, largest=not descending).values)
    assert torch.equal(to_n(t).argsort(dim=0, descending=descending, stable=True).cpu(),
                       t.argsort(dim=0, descending=descending, stable=True))


def test_int64_unique(strict):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-2 ** 40, 2 ** 40, (50,), generator=g)
    x[::3] = 7
    x[1], x[2] = 2 ** 32 + 7, 7 - 2 ** 32                   # same low word as 7, different values
    for t in (x, x.reshape(5, 10), torch.tensor([3]), torch.tensor([2, 2, 2])):
        for kw in ({}, {"return_inverse": True, "return_counts": True}):
            want, got = torch.unique(t, **kw), torch.unique(to_n(t), **kw)
            want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
            for a, b in zip(got, want):
                assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("shape,k,dim", [((50257,), 10, 0), ((2, 20000), 50, 1), ((20000, 3), 5, 0)])
def test_topk_of_lines_longer_than_one_sort(shape, k, dim, strict):
    # (a vocabulary of logits): the leading k of each block of the line, then of those candidates
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    x.view(-1)[::7] = 0.5                                   # ties across blocks: index order kept
    for largest in (True, False):
        want, got = x.topk(k, dim, largest), to_n(x).topk(k, dim, largest)
        assert torch.equal(got.values.cpu(), want.values) and torch.equal(got.indices.cpu(), want.indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_sort_of_lines_longer_than_one_bitonic_sort(dtype, strict):
    # the radix sort: exact values, stable indices, NaN last (first descending), -0.0 equal to 0.0
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        x = torch.randn(2, 9000, generator=g).to(dtype)
        x[:, ::5] = 0.5
        x[0, 3], x[0, 7], x[0, 8], x[1, 11], x[1, 13] = float("nan"), -0.0, 0.0, float("-inf"), float("inf")
    else:
        x = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, 9000), generator=g, dtype=torch.int64).to(dtype)
        x[:, ::5] = 7
    for descending in (False, True):
        want = torch.sort(x, descending=descending, stable=True)
        got = torch.sort(to_n(x), descending=descending, stable=True)
        assert torch.equal(got.indices.cpu(), want.indices)
        assert torch.equal(got.values.cpu().float().nan_to_num(3.0), want.values.float().nan_to_num(3.0))


def test_unique_and_randperm_of_long_lines(strict):
    x = torch.arange(9500) % 997
    assert torch.equal(torch.unique(to_n(x)).cpu(), torch.unique(x))
    p = torch.randperm(9500, device="neuron")
    assert torch.equal(p.sort().values.cpu(), torch.arange(9500))
