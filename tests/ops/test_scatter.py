"""Gathers, scatters, index puts, masks and nonzero run on the device (strict mode) and match the CPU."""
import pytest
import torch

from tests.ops.conftest import to_n

torch.manual_seed(0)


def same(dev, cpu, **kw):
    torch.testing.assert_close(dev.cpu() if isinstance(dev, torch.Tensor) else dev, cpu, equal_nan=True, **kw)


def raises_like_cpu(fn_cpu, fn_dev):
    with pytest.raises(Exception) as cpu:
        fn_cpu()
    with pytest.raises(cpu.type) as dev:
        fn_dev()
    assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("idt", [torch.int64, torch.int32])
def test_gather_take(idt, strict):
    x = torch.randn(4, 5, 3)
    for dim in (0, 1, -1):
        idx = torch.randint(0, x.shape[dim], (3, 4, 2), dtype=idt)
        same(torch.gather(to_n(x), dim, to_n(idx)), torch.gather(x, dim, idx))
    i = torch.tensor([[0, -1], [59, 7]])
    same(torch.take(to_n(x), to_n(i)), torch.take(x, i))
    out = to_n(torch.empty(0))
    torch.gather(to_n(x), 1, to_n(idx[:, :5]), out=out)
    same(out, torch.gather(x, 1, idx[:, :5]))


def test_scatter_src_value(strict):
    x, src = torch.randn(4, 6), torch.randn(3, 7)
    idx = torch.stack([torch.randperm(6)[:4] for _ in range(3)])      # unique per line
    same(to_n(x).scatter(1, to_n(idx), to_n(src)), x.scatter(1, idx, src))
    same(to_n(x).scatter(1, to_n(idx), 2.5), x.scatter(1, idx, 2.5))
    idx0 = torch.stack([torch.randperm(4)[:3] for _ in range(5)], 1)
    a = to_n(x)
    a.scatter_(0, to_n(idx0), to_n(src))
    same(a, x.clone().scatter_(0, idx0, src))


@pytest.mark.parametrize("reduce", ["sum", "prod", "amax", "amin", "mean"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_duplicates(reduce, include_self, strict):
    x, src = torch.randn(3, 5), torch.randn(3, 8)
    idx = torch.randint(0, 5, (3, 8))
    same(to_n(x).scatter_reduce(1, to_n(idx), to_n(src), reduce, include_self=include_self),
         x.scatter_reduce(1, idx, src, reduce, include_self=include_self), atol=1e-5, rtol=1e-5)


def test_scatter_add_index_add(strict):
    x, src = torch.randn(5, 4), torch.randn(7, 4)
    idx = torch.randint(0, 5, (7, 4))
    same(to_n(x).scatter_add(0, to_n(idx), to_n(src)), x.scatter_add(0, idx, src), atol=1e-5, rtol=1e-5)
    i = torch.tensor([0, 4, 0, 2, 4, 4, 1])
    same(to_n(x).index_add(0, to_n(i), to_n(src), alpha=2.0), x.index_add(0, i, src, alpha=2.0), atol=1e-5, rtol=1e-5)
    a = to_n(x.t().contiguous())
    a.index_add_(1, to_n(i), to_n(src.t().contiguous()))
    same(a, x.t().index_add(1, i, src.t()), atol=1e-5, rtol=1e-5)
    xi = torch.randint(0, 9, (5, 4), dtype=torch.int32)
    same(to_n(xi).index_add(0, to_n(i), to_n(xi[:1].expand(7, 4).contiguous())), xi.index_add(0, i, xi[:1].expand(7, 4)))


def test_index_copy_fill(strict):
    x, src = torch.randn(5, 4), torch.randn(3, 4)
    i = torch.tensor([4, 0, 2])
    same(to_n(x).index_copy(0, to_n(i), to_n(src)), x.index_copy(0, i, src))
    s2 = torch.randn(5, 2)
    same(to_n(x).index_copy(1, to_n(i[1:]), to_n(s2)), x.index_copy(1, i[1:], s2))
    same(to_n(x).index_fill(1, to_n(torch.tensor([-1, 1])), -3.0), x.index_fill(1, torch.tensor([-1, 1]), -3.0))
    same(to_n(x).index_fill(0, to_n(i), to_n(torch.tensor(7.0))), x.index_fill(0, i, torch.tensor(7.0)))


def test_advanced_indexing(strict):
    x = torch.randn(4, 5, 6)
    i, j = torch.tensor([3, -1, 0, 3]), torch.tensor([[1], [3]])
    m = torch.rand(4, 5) > 0.5
    for key in ((i,), (slice(None), i[:3]), (i, slice(None), i[:1]), (j, i), (Ellipsis, i), (m,), (m[:, 0],),
                (slice(None), m[0]), (slice(None), slice(1, 3), i[:2])):
        dev_key = tuple(to_n(k) if isinstance(k, torch.Tensor) else k for k in key)
        same(to_n(x)[dev_key], x[key])


def test_index_put(strict):
    x = torch.randn(4, 5)
    i = torch.tensor([3, 0, -2])
    for acc in (False, True):
        v = torch.randn(3, 5)
        same(to_n(x).index_put((to_n(i),), to_n(v), accumulate=acc), x.index_put((i,), v, accumulate=acc))
    d = torch.tensor([1, 1, 3, 1])
    v = torch.randn(4, 5)
    same(to_n(x).index_put((to_n(d),), to_n(v), accumulate=True), x.index_put((d,), v, accumulate=True), atol=1e-5,
         rtol=1e-5)
    a, b = to_n(x), x.clone()
    a[:, to_n(i)] = to_n(torch.randn(4, 3) * 0 + 1.5)
    b[:, i] = 1.5
    same(a, b)
    m = x > 0
    a, b = to_n(x), x.clone()
    a[to_n(m)] = 0.0
    b[m] = 0.0
    same(a, b)
    a, b = to_n(x), x.clone()
    a[to_n(m)] = to_n(torch.arange(int(m.sum()), dtype=torch.float32))
    b[m] = torch.arange(int(m.sum()), dtype=torch.float32)
    same(a, b)


def test_masked_fill_scatter_select_nonzero(strict):
    x = torch.randn(3, 4)
    m = torch.rand(3, 4) > 0.5
    same(to_n(x).masked_fill(to_n(m), -1.0), x.masked_fill(m, -1.0))
    same(to_n(x).masked_fill(to_n(m[0]), to_n(torch.tensor(2.0))), x.masked_fill(m[0], torch.tensor(2.0)))
    same(to_n(x.int()).masked_fill(to_n(m), 5), x.int().masked_fill(m, 5))
    src = torch.randn(12)
    same(to_n(x).masked_scatter(to_n(m), to_n(src)), x.masked_scatter(m, src))
    same(torch.masked_select(to_n(x), to_n(m)), torch.masked_select(x, m))
    same(torch.masked_select(to_n(x), to_n(m[1])), torch.masked_select(x, m[1]))
    big = torch.arange(12).reshape(3, 4) * 2 ** 40 - 7             # 8-byte elements move as word pairs
    same(torch.masked_select(to_n(big), to_n(m)), torch.masked_select(big, m))
    same(torch.masked_select(to_n(x.double()), to_n(m[1])), torch.masked_select(x.double(), m[1]))
    for t in (x > 0, x.int(), torch.zeros(2, 3), torch.tensor(1.0), torch.randn(2, 3, 4) > 0):
        same(torch.nonzero(to_n(t)), torch.nonzero(t))
    same(to_n(x).nonzero(as_tuple=True)[1], x.nonzero(as_tuple=True)[1])


def test_errors_match_cpu():
    x = torch.randn(3, 4)
    bad = torch.tensor([[4]])
    raises_like_cpu(lambda: x.gather(1, bad), lambda: to_n(x).gather(1, to_n(bad)))
    raises_like_cpu(lambda: x.gather(1, bad.reshape(1)), lambda: to_n(x).gather(1, to_n(bad.reshape(1))))
    raises_like_cpu(lambda: x.scatter_add(1, bad, x), lambda: to_n(x).scatter_add(1, to_n(bad), to_n(x)))
    raises_like_cpu(lambda: x.take(torch.tensor([12])), lambda: to_n(x).take(to_n(torch.tensor([12]))))
    raises_like_cpu(lambda: x[torch.tensor([5])], lambda: to_n(x)[to_n(torch.tensor([5]))])
    raises_like_cpu(lambda: x.index_copy(0, torch.tensor([3]), x[:1]),
                    lambda: to_n(x).index_copy(0, to_n(torch.tensor([3])), to_n(x[:1])))
    raises_like_cpu(lambda: x.index_fill(0, torch.tensor([-4]), 1.0),
                    lambda: to_n(x).index_fill(0, to_n(torch.tensor([-4])), 1.0))
    raises_like_cpu(lambda: x.index_put_((torch.tensor([0, 1, 2]),), torch.ones(2)),
                    lambda: to_n(x).index_put_((to_n(torch.tensor([0, 1, 2])),), to_n(torch.ones(2))))
    raises_like_cpu(lambda: x[torch.ones(2, dtype=torch.bool)], lambda: to_n(x)[to_n(torch.ones(2, dtype=torch.bool))])
    raises_like_cpu(lambda: x.masked_fill(torch.ones(3, 4, dtype=torch.int32), 1.0),
                    lambda: to_n(x).masked_fill(to_n(torch.ones(3, 4, dtype=torch.int32)), 1.0))
    raises_like_cpu(lambda: torch.masked_select(x, torch.ones(3, 4)),
                    lambda: torch.masked_select(to_n(x), to_n(torch.ones(3, 4))))
    raises_like_cpu(lambda: x.masked_scatter(x > -9, torch.ones(3)),
                    lambda: to_n(x).masked_scatter(to_n(x > -9), to_n(torch.ones(3))))
    raises_like_cpu(lambda: x.gather(1, torch.zeros(3, 4, 2, dtype=torch.long)),
                    lambda: to_n(x).gather(1, to_n(torch.zeros(3, 4, 2, dtype=torch.long))))


@pytest.mark.parametrize("reduce", ["add", "multiply"])
def test_scatter_legacy_reduce(reduce, strict):
    x, src = torch.randn(3, 5), torch.randn(3, 6)
    idx = torch.randint(0, 5, (3, 6))
    same(to_n(x).scatter(1, to_n(idx), to_n(src), reduce=reduce), x.scatter(1, idx, src, reduce=reduce),
         atol=1e-5, rtol=1e-5)
    same(to_n(x).scatter_(0, to_n(idx[:, :4] % 3), 1.5, reduce=reduce),
         x.clone().scatter_(0, idx[:, :4] % 3, 1.5, reduce=reduce), atol=1e-5, rtol=1e-5)


def test_put(strict):
    x = torch.randn(4, 5)
    i, v = torch.tensor([[3, -1], [19, 0]]), torch.randn(2, 2)
    for acc in (False, True):
        same(to_n(x).put_(to_n(i), to_n(v), accumulate=acc), x.clone().put_(i, v, accumulate=acc))
    d = torch.tensor([1, 7, 1, -19])      # duplicates sum when accumulating
    a, b = to_n(x).t(), x.clone().t()      # a non-contiguous self
    a.put_(to_n(d), to_n(torch.arange(4.0)), accumulate=True)
    b.put_(d, torch.arange(4.0), accumulate=True)
    same(a, b)
    same(to_n(x).put(to_n(i), to_n(v)), x.put(i, v))


def test_put_errors_match_cpu(strict):
    x, v = torch.randn(2, 3), torch.randn(2)
    raises_like_cpu(lambda: x.put_(torch.tensor([0, 1], dtype=torch.int32), v),
                    lambda: to_n(x).put_(to_n(torch.tensor([0, 1], dtype=torch.int32)), to_n(v)))
    raises_like_cpu(lambda: x.put_(torch.tensor([0, 1]), v.double()),
                    lambda: to_n(x).put_(to_n(torch.tensor([0, 1])), to_n(v.double())))
    raises_like_cpu(lambda: x.put_(torch.tensor([0, 1, 2]), v),
                    lambda: to_n(x).put_(to_n(torch.tensor([0, 1, 2])), to_n(v)))
    raises_like_cpu(lambda: x.put_(torch.tensor([0, 6]), v), lambda: to_n(x).put_(to_n(torch.tensor([0, 6])), to_n(v)))


def test_nonzero_static(strict):
    for t in (torch.tensor([[0, 1.0], [2, 0]]), torch.randn(3, 4, 2) > 0, torch.tensor(3.0), torch.zeros(0, 3),
              torch.tensor([1, 0, 3], dtype=torch.int32)):
        for kw in ({"size": 0}, {"size": 3}, {"size": 30, "fill_value": 2 ** 40}):
            same(torch.nonzero_static(to_n(t), **kw), torch.nonzero_static(t, **kw))
    raises_like_cpu(lambda: torch.nonzero_static(torch.ones(2), size=-1),
                    lambda: torch.nonzero_static(to_n(torch.ones(2)), size=-1))


def test_out_overlap_and_dtype_errors_before_any_fallback(strict):
    ind = torch.tensor([2, 1, 0])
    for dev in (lambda t: t, to_n):     # out= that overlaps the index only once resized to the result
        i = dev(ind.clone())
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            torch.gather(dev(ind.clone()), 0, i[1:], out=i[:1])
    x, idx = torch.zeros(3, 5, dtype=torch.float64), torch.tensor([[0, 1], [1, 2]])
    raises_like_cpu(lambda: x.scatter_add(0, idx, torch.randn(2, 5)),
                    lambda: to_n(x).scatter_add(0, to_n(idx), to_n(torch.randn(2, 5))))
    m = torch.ones(1, 3)
    for mask in (m, m.to(torch.uint8)):
        raises_like_cpu(lambda: torch.zeros(1, 3).masked_scatter_(mask, torch.randn(3, 4)),
                        lambda: to_n(torch.zeros(1, 3)).masked_scatter_(to_n(mask), to_n(torch.randn(3, 4))))
    same(torch.gather(to_n(x[0].float()), 0, to_n(torch.empty(0, dtype=torch.uint8))),
         torch.gather(x[0].float(), 0, torch.empty(0, dtype=torch.uint8)))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_eight_byte_elements_move_as_word_pairs(dtype, strict):
    x = (torch.randn(4, 5) * 1e12).to(dtype) + (2 ** 40 if dtype == torch.int64 else 0.123456789012)
    idx = torch.randint(0, 4, (3, 5))
    same(torch.gather(to_n(x), 0, to_n(idx)), torch.gather(x, 0, idx), atol=0, rtol=0)
    same(to_n(x).t().gather(1, to_n(idx.t()[:, :2])), x.t().gather(1, idx.t()[:, :2]), atol=0, rtol=0)
    k = torch.tensor([[0, -1], [7, 19]])
    same(torch.take(to_n(x), to_n(k)), torch.take(x, k), atol=0, rtol=0)
    u, src = torch.stack([torch.randperm(4)[:3] for _ in range(5)], 1), (torch.randn(3, 5) * 1e12).to(dtype)
    same(to_n(x).scatter(0, to_n(u), to_n(src)), x.scatter(0, u, src), atol=0, rtol=0)
    i, v = torch.tensor([3, -1, 12]), (torch.randn(3) * 1e12).to(dtype)
    same(to_n(x).put_(to_n(i), to_n(v)), x.clone().put_(i, v), atol=0, rtol=0)
    if dtype == torch.int64:
        same(torch.nn.functional.one_hot(to_n(torch.tensor([0, 3, 1])), 5),
             torch.nn.functional.one_hot(torch.tensor([0, 3, 1]), 5))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_eight_byte_gather_scatter_of_size_one_dims_with_any_stride(dtype, strict):
    # a contiguous tensor may carry any stride on a size-1 dim (kthvalue's backward scatters into such a
    # block): the word-pair view must not depend on it
    x = torch.empty_strided((5, 1), (1, 5), dtype=dtype).copy_((torch.randn(5, 1) * 1e12).to(dtype))
    idx = torch.zeros(5, 1, dtype=torch.int64)
    same(torch.gather(to_n(x), 1, to_n(idx)), torch.gather(x, 1, idx), atol=0, rtol=0)
    src = torch.empty_strided((5, 1), (1, 7), dtype=dtype).copy_((torch.randn(5, 1) * 1e12).to(dtype))
    same(to_n(x).scatter(1, to_n(idx), to_n(src)), x.scatter(1, idx, src), atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_float64_kthvalue_backward_scatters_into_its_size_one_dim():
    # float64 kthvalue itself takes the counted fallback; its gradient is a device scatter into such a block
    g = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    gn = to_n(g.detach()).requires_grad_(True)
    cot = torch.randn(4, 5, dtype=torch.float64)
    torch.kthvalue(g, 2, 1)[0].backward(cot)
    torch.kthvalue(gn, 2, 1)[0].backward(to_n(cot))
    same(gn.grad, g.grad, atol=0, rtol=0)


INTS = [torch.int8, torch.int16, torch.uint8, torch.int32]


def _wide_ints(dtype, shape, g):
    """Values across the dtype's whole range, odd (so that no sum of them is a multiple of a large power of two)."""
    info = torch.iinfo(dtype)
    return (torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64) | 1).to(dtype)


@pytest.mark.parametrize("dtype", INTS + [torch.int64])
@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
def test_integer_scatter_reduce_exact_and_wrapping_like_cpu(dtype, reduce, strict):
    # 8-32-bit ints reduce in int32, exact mod 2**32, and wrap to their width as the CPU's arithmetic does
    # (an fp32 accumulation rounds past 2**24: 101**4 in int8, 600 int16 values near 30000); int64 reduces
    # on its word kernels, exact mod 2**64
    g = torch.Generator().manual_seed(5)
    s = _wide_ints(dtype, (4,), g)
    idx = torch.randint(0, 3, (600,), generator=g)                # line 3 gets nothing
    src = _wide_ints(dtype, (600,), g)
    for include_self in (True, False):
        ref = s.scatter_reduce(0, idx, src, reduce, include_self=include_self)
        got = to_n(s).scatter_reduce(0, to_n(idx), to_n(src), reduce, include_self=include_self).cpu()
        assert torch.equal(got, ref), (include_self, got, ref)
    p = torch.full((6,), 101, dtype=dtype)
    ref = torch.ones(2, dtype=dtype).scatter_reduce(0, torch.zeros(6, dtype=torch.int64), p, reduce)
    got = to_n(torch.ones(2, dtype=dtype)).scatter_reduce(0, to_n(torch.zeros(6, dtype=torch.int64)), to_n(p), reduce)
    assert torch.equal(got.cpu(), ref)
    if reduce == "sum":
        ref = s.scatter_add(0, idx, src)
        assert torch.equal(to_n(s).scatter_add(0, to_n(idx), to_n(src)).cpu(), ref)


@pytest.mark.parametrize("dtype", INTS + [torch.int64])
def test_integer_index_add_index_put_put_accumulate_exact_and_wrapping_like_cpu(dtype, strict):
    # row sums per byte of the values on TensorE (each exact in fp32), recombined in int32 (int64: on its word
    # kernels): exact mod 2**32 (2**64) and wrapped to the dtype's width like the CPU, with any alpha
    g = torch.Generator().manual_seed(6)
    t = _wide_ints(dtype, (5, 3), g)
    idx = torch.randint(0, 4, (700,), generator=g)                # row 4 gets nothing
    src = _wide_ints(dtype, (700, 3), g)
    for alpha in (1, 3, -5, torch.iinfo(dtype).max):
        assert torch.equal(to_n(t).index_add(0, to_n(idx), to_n(src), alpha=alpha).cpu(),
                           t.index_add(0, idx, src, alpha=alpha)), alpha
    for call in (lambda x, i, v: x.index_put_((i,), v, accumulate=True),
                 lambda x, i, v: x.put_(i * 3 + 1, v[:, 0], accumulate=True)):
        ref, got = t.clone(), to_n(t)
        call(ref, idx, src)
        call(got, to_n(idx), to_n(src))
        assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_row_sums_past_one_byte_product(dtype, strict, monkeypatch):
    # more rows than one byte product sums exactly: the products go in blocks of BYTE_ROWS rows
    from torchneuron.ops import scatter
    monkeypatch.setattr(scatter, "BYTE_ROWS", 64)
    g = torch.Generator().manual_seed(7)
    t, idx, src = _wide_ints(dtype, (3,), g), torch.randint(0, 3, (200,), generator=g), _wide_ints(dtype, (200,), g)
    assert torch.equal(to_n(t).index_add(0, to_n(idx), to_n(src)).cpu(), t.index_add(0, idx, src))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_eight_byte_masked_fill_selects_word_pairs(dtype, strict):
    # int64/float64 masked_fill_ selects both int32 words: every bit kept (values past 2**31, NaN, -0.0)
    g = torch.Generator().manual_seed(8)
    if dtype == torch.int64:
        x = torch.randint(-2 ** 63, 2 ** 63 - 1, (3, 7), generator=g)
        values = [1, -2 ** 63, 2 ** 40 + 3, torch.tensor(2 ** 35), torch.tensor(-9)]
    else:
        x = torch.randn(3, 7, generator=g, dtype=torch.float64) * 1e200
        values = [1.0000000001, float("nan"), -0.0, torch.tensor(2.5e-300, dtype=torch.float64)]
    m = torch.rand(3, 7, generator=g) < 0.5
    for v in values:
        for target, mask in ((x, m), (x, m[0]), (x.t(), m.t()), (x[1, 2], m[0, 0])):
            ref = target.clone().masked_fill_(mask, v)
            on_device = to_n(v) if isinstance(v, torch.Tensor) and v.dtype == dtype and v.dim() == 0 else v
            got = to_n(target).masked_fill_(to_n(mask), on_device).cpu()
            assert torch.equal(got.view(torch.int64) if dtype == torch.float64 else got,
                               ref.view(torch.int64) if dtype == torch.float64 else ref), (v, target.shape)
    # the CPU's conversion errors for a value the dtype cannot hold
    if dtype == torch.int64:
        with pytest.raises(OverflowError) as cpu:
            x.clone().masked_fill_(m, 2 ** 64)
        with pytest.raises(OverflowError) as dev:
            to_n(x).masked_fill_(to_n(m), 2 ** 64)
        assert str(dev.value) == str(cpu.value)
