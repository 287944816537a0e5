"""Indexing, shape and factory ops run on the device (strict mode) and match the CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import to_n
from torchneuron.runtime import profiler

torch.manual_seed(0)
W = torch.randn(11, 6)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_embedding_and_index_select(dtype, strict):
    i = torch.tensor([[3, 0], [10, 3]], dtype=dtype)
    torch.testing.assert_close(F.embedding(to_n(i), to_n(W)).cpu(), F.embedding(i, W))
    j = torch.tensor([5, 0, 5], dtype=dtype)
    for dim in (0, 1, -1):
        k = j.clamp(max=W.shape[dim] - 1)
        torch.testing.assert_close(to_n(W).index_select(dim, to_n(k)).cpu(), W.index_select(dim, k))
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(to_n(x).index_select(1, to_n(j.clamp(max=3))).cpu(), x.index_select(1, j.clamp(max=3)))


def test_embedding_backward_with_padding(strict):
    i = torch.tensor([[3, 0, 3], [10, 3, 7]])
    w, wn = W.clone().requires_grad_(), to_n(W).requires_grad_()
    g = torch.randn(2, 3, 6)
    F.embedding(i, w, padding_idx=3).backward(g)
    F.embedding(to_n(i), wn, padding_idx=3).backward(to_n(g))
    torch.testing.assert_close(wn.grad.cpu(), w.grad, atol=1e-6, rtol=1e-6)


def test_index_out_of_range_raises_like_cpu():
    bad = torch.tensor([11])
    with pytest.raises(IndexError):
        F.embedding(bad, W)
    with pytest.raises(IndexError, match="index out of range"):
        F.embedding(to_n(bad), to_n(W))


def test_arange_tril_triu_cat(strict):
    torch.testing.assert_close(torch.arange(7, device="neuron").cpu(), torch.arange(7))
    torch.testing.assert_close(torch.arange(2, 9, 3, device="neuron", dtype=torch.float32).cpu(),
                               torch.arange(2, 9, 3, dtype=torch.float32))
    torch.testing.assert_close(torch.arange(-1.5, 2.0, 0.25, device="neuron").cpu(), torch.arange(-1.5, 2.0, 0.25))
    x = torch.randn(2, 4, 5)
    for k in (-1, 0, 2):
        torch.testing.assert_close(to_n(x).tril(k).cpu(), x.tril(k))
        torch.testing.assert_close(to_n(x).triu(k).cpu(), x.triu(k))
    torch.testing.assert_close(torch.cat([to_n(x), to_n(x[:, :2])], 1).cpu(), torch.cat([x, x[:, :2]], 1))
    torch.testing.assert_close(torch.stack([to_n(x), to_n(x)], -1).cpu(), torch.stack([x, x], -1))
    torch.testing.assert_close(torch.cat([to_n(x.int()), to_n(x)], 0).cpu(), torch.cat([x.int(), x], 0))


def test_flip(strict):
    x = torch.randn(3, 4, 5)
    for dims in ([0], [1, 2], [-1], []):
        torch.testing.assert_close(torch.flip(to_n(x), dims).cpu(), torch.flip(x, dims))
    with pytest.raises(RuntimeError, match="multiple times"):
        torch.flip(to_n(x), [0, 0])


def test_cat_errors_match_cpu():
    a, b = torch.randn(2, 3), torch.randn(2, 4)
    with pytest.raises(RuntimeError) as cpu:
        torch.cat([a, b], 0)
    with pytest.raises(RuntimeError) as dev:
        torch.cat([to_n(a), to_n(b)], 0)
    assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss_and_cross_entropy(reduction, weighted, strict):
    x, t, w = torch.randn(6, 5), torch.tensor([0, 4, 2, -100, 1, 4]), torch.rand(5)
    a, b = x.clone().requires_grad_(), to_n(x).requires_grad_()
    la = F.cross_entropy(a, t, weight=w if weighted else None, reduction=reduction)
    lb = F.cross_entropy(b, to_n(t), weight=to_n(w) if weighted else None, reduction=reduction)
    torch.testing.assert_close(lb.detach().cpu(), la.detach(), atol=1e-6, rtol=1e-6)
    la.sum().backward()
    lb.sum().backward()
    torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-6, rtol=1e-6)


def test_nll_loss_bad_target_raises_like_cpu():
    x, t = torch.randn(3, 4), torch.tensor([0, 7, 1])
    with pytest.raises(IndexError) as cpu:
        F.nll_loss(x, t)
    with pytest.raises(IndexError) as dev:
        F.nll_loss(to_n(x), to_n(t))
    assert str(dev.value) == str(cpu.value)


def test_mse_loss_any_all_norms_bitwise(strict):
    a, b = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5)
    an = to_n(a.detach()).requires_grad_()
    la, lb = F.mse_loss(a, b), F.mse_loss(an, to_n(b))
    la.backward()
    lb.backward()
    torch.testing.assert_close(lb.detach().cpu(), la.detach())
    torch.testing.assert_close(an.grad.cpu(), a.grad)
    x = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 3.0]])
    for fn in (torch.all, torch.any, lambda t: t.all(1), lambda t: t.any(0, keepdim=True)):
        torch.testing.assert_close(fn(to_n(x)).cpu(), fn(x))
    y = torch.randn(3, 7)
    for ord in (2, 1, float("inf"), 0, 3):
        torch.testing.assert_close(torch.linalg.vector_norm(to_n(y), ord, dim=1).cpu(),
                                   torch.linalg.vector_norm(y, ord, dim=1), atol=1e-5, rtol=1e-5)
    i, j = torch.tensor([5, -3, 12], dtype=torch.int32), torch.tensor([3, 6, -1], dtype=torch.int32)
    for fn in (torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor):
        torch.testing.assert_close(fn(to_n(i), to_n(j)).cpu(), fn(i, j))
    torch.testing.assert_close((~to_n(i)).cpu(), ~i)
    m = torch.tensor([True, False, True])
    torch.testing.assert_close((to_n(m) | ~to_n(m)).cpu(), m | ~m)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_cells(cls, strict):
    m = cls(8, 16, num_layers=2, batch_first=True)
    mn = cls(8, 16, num_layers=2, batch_first=True)
    mn.load_state_dict(m.state_dict())
    mn.to("neuron")
    x, g = torch.randn(3, 7, 8), torch.randn(3, 7, 16)
    y, yn = m(x)[0], mn(to_n(x))[0]
    torch.testing.assert_close(yn.detach().cpu(), y.detach(), atol=1e-5, rtol=1e-5)
    y.backward(g)
    yn.backward(to_n(g))
    for p, pn in zip(m.parameters(), mn.parameters()):
        torch.testing.assert_close(pn.grad.cpu(), p.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls,wd", [(torch.optim.AdamW, 0.1), (torch.optim.Adam, 0.01)])
def test_fused_adam(cls, wd, strict):
    torch.manual_seed(0)
    m, mn = torch.nn.Linear(33, 17), torch.nn.Linear(33, 17)
    mn.load_state_dict(m.state_dict())
    mn.to("neuron")
    opt, optn = cls(m.parameters(), lr=1e-2, weight_decay=wd), cls(mn.parameters(), lr=1e-2, weight_decay=wd,
                                                                      fused=True)
    for _ in range(4):
        x = torch.randn(8, 33)
        for mod, o, xx in ((m, opt, x), (mn, optn, to_n(x))):
            o.zero_grad()
            mod(xx).square().mean().backward()
            o.step()
    for p, pn in zip(m.parameters(), mn.parameters()):
        torch.testing.assert_close(pn.detach().cpu(), p.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_and_max_norm(mode, strict):
    w = torch.randn(10, 4)
    i, o = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4, 4, 6])
    psw = torch.rand(8) if mode == "sum" else None
    want = F.embedding_bag(i, w, o, mode=mode, per_sample_weights=psw, padding_idx=4)
    got = F.embedding_bag(to_n(i), to_n(w), to_n(o), mode=mode,
                          per_sample_weights=None if psw is None else to_n(psw), padding_idx=4)
    torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=1e-5)
    wn, wc = to_n(w), w.clone()
    F.embedding(to_n(i), wn, max_norm=1.0)                      # renormalises the looked-up rows in place
    F.embedding(i, wc, max_norm=1.0)
    torch.testing.assert_close(wn.cpu(), wc, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_arange_out_integer_truncation(dtype, strict):
    for args in ((0.5, 5, 1), (0.7, 5.2, 1.9), (2.9, -1, -1.5), (0, 10, 3)):
        got = torch.arange(*args, out=to_n(torch.empty(0, dtype=dtype)))
        torch.testing.assert_close(got.cpu(), torch.arange(*args, out=torch.empty(0, dtype=dtype)))
    if dtype == torch.int64:    # a step truncated to 0: the CPU's ValueError
        with pytest.raises(ValueError, match="step must be nonzero"):
            torch.arange(0, 64, 0.5, out=to_n(torch.empty(0, dtype=dtype)))


def test_int64_position_ids_are_one_launch(strict):
    # arange(n) as int64 (a model's position ids) is one iota writing the word pairs: n across partial and several
    # blocks; a non-contiguous out= keeps the iota and element-wise path
    from torchneuron.runtime import profiler
    for n in (1, 5, 128, 129, 4097, 70000):
        with profiler.record() as records:
            got = torch.arange(n, device="neuron")
        assert [r.name for r in records] == ["iota"] and got.dtype == torch.int64
        assert torch.equal(got.cpu(), torch.arange(n))
    out = to_n(torch.full((20, 2), -7, dtype=torch.int64))
    torch.arange(20, out=out[:, 1])
    want = torch.full((20, 2), -7, dtype=torch.int64)
    torch.arange(20, out=want[:, 1])
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_arange_of_any_start_and_step_is_one_launch(dtype, strict):
    # any start and step (truncated as the CPU truncates them) into a contiguous int32 result, or int64 of values
    # none negative, is one iota of that start and step: across partial and several blocks, stepping down, at the
    # exact-integer bound 2**24 of the element-wise path; int64 reaching below 0 keeps iota and the element-wise step
    from torchneuron.runtime import profiler
    cases = [(3, 40), (0, 40, 2), (7, 7 + 3 * 4097, 3), (129, 0, -1), (2 ** 24 - 300, 2 ** 24, 7), (5.9, 300.2, 2.7),
             (1000, -1000, -17), (-5, 20, 4), (0, 2 ** 24, 2 ** 23)]
    for args in cases:
        want = torch.arange(*args, dtype=dtype)
        with profiler.record() as records:
            got = torch.arange(*args, dtype=dtype, device="neuron")
        assert got.dtype == dtype and torch.equal(got.cpu(), want), args
        one = dtype == torch.int32 or want.min() >= 0
        assert (len(records) == 1) == one and records[0].name == "iota", (args, [r.name for r in records])
    for bad in ((0, 10, 0), (10, 0, 1)):    # the CPU's errors, the out= tensor left as it was
        out = to_n(torch.full((3,), 9, dtype=dtype))
        with pytest.raises(RuntimeError) as cpu:
            torch.arange(*bad, out=torch.full((3,), 9, dtype=dtype))
        with pytest.raises(type(cpu.value), match=str(cpu.value)):
            torch.arange(*bad, out=out)
        assert torch.equal(out.cpu(), torch.full((3,), 9, dtype=dtype))


def test_cat_rank_and_overlap_errors_match_cpu(strict):
    for ts in ([torch.randn(5), torch.randn(2, 5, 1, 1)], [torch.randn(4, 0), torch.randn(5, 0, 3)],
               [torch.tensor(1.0), torch.tensor(2.0)]):
        with pytest.raises(RuntimeError) as cpu:
            torch.hstack(ts) if ts[0].dim() else torch.cat(ts)
        with pytest.raises(RuntimeError) as dev:
            torch.hstack([to_n(t) for t in ts]) if ts[0].dim() else torch.cat([to_n(t) for t in ts])
        assert str(dev.value) == str(cpu.value)
    for dev in (lambda t: t, to_n):      # out= is a legacy empty input, which the resize makes overlap
        x = dev(torch.zeros(0))
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            torch.cat((x, dev(torch.randn(4, 6))), out=x)


def test_embedding_bag_max(strict):
    w = torch.randn(6, 3)
    w[3, 1], w[0, 2], w[4, 2] = float("nan"), 7.0, 7.0     # NaN wins its bag; ties go to the first row
    i, o = torch.tensor([1, 2, 4, 2, 0, 3, 4, 0]), torch.tensor([0, 2, 2, 5, 8])
    for pad in (-1, 2):
        for last in (False, True):
            want = torch.ops.aten._embedding_bag_forward_only(w, i, o, False, 2, False, None, last, pad)
            got = torch.ops.aten._embedding_bag_forward_only(to_n(w), to_n(i), to_n(o), False, 2, False, None, last,
                                                             pad)
            for g, e in zip(got, want):
                torch.testing.assert_close(g.cpu(), e, equal_nan=True)
    # a NaN row reaches only its own bags in sum mode
    want = F.embedding_bag(i, w, o[:-1], mode="sum")
    torch.testing.assert_close(F.embedding_bag(to_n(i), to_n(w), to_n(o[:-1]), mode="sum").cpu(), want,
                               equal_nan=True)


def test_cat_of_many_inputs_is_one_launch(strict):
    from torchneuron.runtime import profiler
    parts = [torch.randn(()) for _ in range(28)]                  # clip_grad_norm_'s stack of norms
    dev = [to_n(p) for p in parts]
    with profiler.record() as records:
        got = torch.stack(dev)
    assert len(records) == 1 and torch.equal(got.cpu(), torch.stack(parts))
    words = [torch.randint(-2 ** 40, 2 ** 40, (2, 3)) for _ in range(3)]    # int64: moved as int32 words
    assert torch.equal(torch.cat([to_n(w) for w in words], 1).cpu(), torch.cat(words, 1))
    base = torch.randn(4, 6)
    views = [to_n(base)[:, ::2], to_n(torch.randn(0, 3)), to_n(base).t()[:3, :4].t()[:, :3]]
    want = torch.cat([base[:, ::2], torch.randn(0, 3), base.t()[:3, :4].t()[:, :3]], 0)
    assert torch.equal(torch.cat(views, 0).cpu(), want)


def test_a_repeated_cat_launches_its_traced_program(strict):
    # the second call at the same shapes binds the inputs to the traced multi_copy directly: new values, the
    # CPU's result; two cats whose flat spans and copies coincide ([2, 3] + [2, 3] on dim 0, [6] + [6]) keep
    # their own result shapes; non-contiguous inputs of a planned shape and a dtype= call take the checked path
    from torchneuron.ops import indexing
    from torchneuron.runtime import profiler
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        for shapes, dim in ((((2, 3), (2, 3)), 0), (((6,), (6,)), 0), (((2, 3), (2, 5), (2, 1)), 1),
                            ((((),) * 5), None)):
            cpu = [torch.randn(s) for s in shapes]
            with profiler.record() as records:
                got = torch.stack([to_n(t) for t in cpu]) if dim is None else torch.cat([to_n(t) for t in cpu], dim)
            want = torch.stack(cpu) if dim is None else torch.cat(cpu, dim)
            assert len(records) == 1 and got.shape == want.shape and torch.equal(got.cpu(), want)
    assert any(key[3] == ((2, 3), (2, 3)) for key in indexing._CAT_PLANS.keys())
    for _ in range(2):     # inputs without elements: nothing to copy, no plan
        got = torch.cat([to_n(torch.randn(0, 3)), to_n(torch.randn(0, 2))], 1)
        assert got.shape == (0, 5) and got.device.type == "neuron"
    for seed in (1, 2):    # int64 moves as int32 words: the checked path, every time
        words = [torch.randint(-2 ** 40, 2 ** 40, (1, 1), generator=torch.Generator().manual_seed(seed + k))
                 for k in range(3)]
        assert torch.equal(torch.cat([to_n(w) for w in words], -1).cpu(), torch.cat(words, -1))
    base = torch.randn(3, 2)
    assert torch.equal(torch.cat([to_n(base).t(), to_n(base).t()], 0).cpu(), torch.cat([base.t(), base.t()], 0))
    halves = [torch.randn(2, 3), torch.randn(2, 3)]
    got = torch.cat([to_n(h) for h in halves], 0, out=to_n(torch.empty(4, 3, dtype=torch.float64)))
    assert got.dtype == torch.float64 and torch.equal(got.cpu(), torch.cat(halves, 0).double())
    with pytest.raises(RuntimeError, match="zero-dimensional"):    # the CPU's checks still run for new shapes
        torch.cat([to_n(torch.randn(())), to_n(torch.randn(()))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.bool,
                                   torch.int64])
def test_select_and_slice_backward_embed_the_gradient_in_one_launch(dtype, strict):
    # zeros of the input's shape with the gradient in the slice, as the CPU's composite writes them (+0.0 around
    # it; inf/NaN/-0.0/65504 carried exactly); a device dtype in one launch, int64 by ATen's own two steps; a
    # non-contiguous gradient at planned sizes takes the checked path
    aten = torch.ops.aten
    cases = [("select", (3, 128, 32), (0, 1)), ("select", (4, 5), (1, -1)), ("select", (5, 4), (0, 4)),
             ("select", (0, 3), (1, 2)), ("slice", (4, 6, 3), (1, 2, 5, 1)), ("slice", (70, 64), (0, 0, 67, 1)),
             ("slice", (8, 3), (1, 0, 0, 1)), ("slice", (6,), (0, -100, 100, 1)), ("slice", (6,), (0, -4, 2**63 - 1, 1)),
             ("slice", (4, 6, 3), (1, 1, 6, 2)), ("slice", (7, 5), (-2, 4, 2, 1))]
    for kind, sizes, args in cases * 2:     # the second time: the traced program launched directly, new values
        x = torch.zeros(sizes)
        view = x.select(args[0], args[1]) if kind == "select" else \
            x[(slice(None),) * (args[0] % x.dim()) + (slice(*args[1:]),)]
        g = torch.randn(view.shape) * 300
        if g.numel() >= 4:
            g.view(-1)[:4] = torch.tensor([float("inf"), float("nan"), -0.0, 65504.0])
        g = g.to(dtype)
        op = aten.select_backward if kind == "select" else aten.slice_backward
        want = op(g, list(sizes), *args)
        with profiler.record() as records:
            got = op(to_n(g), list(sizes), *args)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu().view(torch.uint8) if dtype != torch.bool else got.cpu(),
                           want.view(torch.uint8) if dtype != torch.bool else want)
        if dtype != torch.int64 and (kind == "select" or args[-1] == 1) and got.numel():
            assert len(records) == 1
    g = torch.randn(5, 7)
    got = aten.slice_backward(to_n(g).t(), [9, 5], 0, 1, 8, 1)
    assert torch.equal(got.cpu(), aten.slice_backward(g.t(), [9, 5], 0, 1, 8, 1))
    got = aten.slice_backward(to_n(g.t().contiguous()), [9, 5], 0, 1, 8, 1)
    assert torch.equal(got.cpu(), aten.slice_backward(g.t(), [9, 5], 0, 1, 8, 1))
    w = torch.randn(4, 5, requires_grad=True)           # through autograd: out[:, -1] of a model's output
    wn = to_n(w.detach()).requires_grad_()
    (w[:, -1] * torch.arange(4.0)).sum().backward()
    (wn[:, -1] * to_n(torch.arange(4.0))).sum().backward()
    assert torch.equal(wn.grad.cpu(), w.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", [True, False])
def test_embedding_backward_is_the_one_hot_product(dtype, fused, strict, monkeypatch):
    # the one-hot matrix comes straight from the index words (int64: the low words of the pairs, read whole): up to
    # ONEHOT_PRODUCT_ROWS rows built block by block in SBUF and multiplied there (one launch), else built in HBM
    # (onehot_rows) for a product launch; either way no copy of the low words, no iota. The one-hot bit for bit the
    # CPU's (several row and column blocks, the padding row, an index outside the rows: a zero column), the fused
    # product bit for bit the two launches', the gradient the CPU's
    import torchneuron.ops.indexing as indexing
    from torchneuron.kernels.indexing import onehot_product, onehot_rows
    from torchneuron.ops.kernel_call import call_kernel
    from torchneuron.runtime import profiler
    if not fused:
        monkeypatch.setattr(indexing, "ONEHOT_PRODUCT_ROWS", 0)
    gen = torch.Generator().manual_seed(7)
    for rows, n, D, padding_idx in ((10, 6, 5, -1), (300, 2500, 5, 4), (129, 3, 600, 128)):
        for idx_dtype in (torch.int64, torch.int32):
            idx = torch.randint(0, rows, (n,), generator=gen, dtype=idx_dtype)
            idx[0] = padding_idx if padding_idx >= 0 else 0
            g = (torch.randn(n, D, generator=gen) * 4).to(dtype)
            want = torch.ops.aten.embedding_dense_backward(g, idx, rows, padding_idx, False)
            with profiler.record() as records:
                got = torch.ops.aten.embedding_dense_backward(to_n(g), to_n(idx), rows, padding_idx, False)
            names = [r.name for r in records]
            assert names == (["onehot_product"] if fused else ["onehot_rows", "matmul_kernel"]), names
            if dtype == torch.float32:
                torch.testing.assert_close(got.cpu(), want)
            else:   # (the CPU sums 2-byte rows in their dtype): the float64 sums, summed in fp32, rounded once
                hot64 = (idx[None, :] == torch.arange(rows)[:, None]) & (torch.arange(rows)[:, None] != padding_idx)
                exact = hot64.double() @ g.double()
                bound = hot64.sum(1, keepdim=True) * 2.0 ** -24 * (hot64.double() @ g.double().abs())
                err = (got.cpu().double() - exact).abs()
                assert (err <= bound + torch.finfo(dtype).eps / 2 * (exact.abs() + bound)).all()
            words = to_n(idx).view(torch.int32) if idx_dtype == torch.int64 else to_n(idx)
            outside = words.clone()
            outside[-2] = rows                     # (the low word of an int64: its index n - 1 reads row rows)
            stride = 2 if idx_dtype == torch.int64 else 1
            meta = {"rows": rows, "stride": stride, "padding_idx": padding_idx}
            for w in (words, outside):
                (hot,) = call_kernel(onehot_rows, {"index": w}, {**meta, "out_dtype": dtype})
                low = w.cpu()[::stride].long()
                ref = (low[None, :] == torch.arange(rows)[:, None]) & (torch.arange(rows)[:, None] != padding_idx)
                assert torch.equal(hot.cpu(), ref.to(dtype))
                (product,) = call_kernel(onehot_product, {"index": w, "grad": to_n(g)}, meta)
                assert torch.equal(product.cpu(), (hot @ to_n(g)).cpu())
    w = W.clone().requires_grad_()                 # through autograd: a non-contiguous index (a copy first)
    wn = to_n(W).requires_grad_()
    idx = torch.tensor([[3, 0, 3, 1], [10, 2, 0, 5]])[:, :3]
    g = torch.randn(2, 3, W.shape[1])
    F.embedding(idx, w).backward(g)
    F.embedding(to_n(idx), wn).backward(to_n(g))
    torch.testing.assert_close(wn.grad.cpu(), w.grad)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 4])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_training(mode, padding_idx, include_last_offset, strict):
    # autograd's _embedding_bag, its dense backward and (sum mode) the per-sample-weights gradient
    torch.manual_seed(0)
    m = torch.nn.EmbeddingBag(10, 3, mode=mode, padding_idx=padding_idx, include_last_offset=include_last_offset)
    mn = copy.deepcopy(m).to("neuron")
    idx = torch.tensor([1, 2, 4, 5, 4, 9])
    off = torch.tensor([0, 2, 2, 6]) if include_last_offset else torch.tensor([0, 2, 2])   # an empty bag
    w = torch.rand(6, requires_grad=True) if mode == "sum" else None
    wn = to_n(w.detach()).requires_grad_() if w is not None else None
    a, b = m(idx, off, per_sample_weights=w), mn(to_n(idx), to_n(off), per_sample_weights=wn)
    torch.testing.assert_close(b.detach().cpu(), a.detach())
    g = torch.randn_like(a)
    a.backward(g)
    b.backward(to_n(g))
    torch.testing.assert_close(mn.weight.grad.cpu(), m.weight.grad)
    if w is not None:
        torch.testing.assert_close(wn.grad.cpu(), w.grad)


@pytest.mark.parametrize("bad", [2**32 + 1, 2**31 + 1, -(2**32) + 3])
def test_embedding_index_beyond_int32_raises_like_the_cpu(bad):
    """The low word of 2**32 + 1 is a valid row: the device must raise as the CPU does, not return row 1."""
    w = torch.randn(10, 4)
    idx = torch.tensor([1, bad])
    with pytest.raises(IndexError) as cpu:
        torch.nn.functional.embedding(idx, w)
    with pytest.raises(IndexError, match=str(cpu.value)):
        torch.nn.functional.embedding(idx.to("neuron"), w.to("neuron"))
    with pytest.raises(IndexError):
        torch.index_select(w.to("neuron"), 0, idx.to("neuron"))


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_float64_per_sample_weights_gradient_keeps_float64_precision():
    # the device computes in fp32: a float64 gradient goes to the CPU instead of losing half its digits
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(10, 5, dtype=torch.float64, generator=gen)
    idx, off = torch.tensor([5, 1, 6, 5, 6]), torch.tensor([0, 2])
    psw = torch.randn(5, dtype=torch.float64, generator=gen)
    grads = []
    for conv in (lambda t: t, to_n):
        p = conv(psw).requires_grad_(True)
        out = F.embedding_bag(conv(idx), conv(w), conv(off), mode="sum", per_sample_weights=p)
        (g,) = torch.autograd.grad(out, p, conv(torch.ones(2, 5, dtype=torch.float64)))
        grads.append(g.cpu())
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=4 * torch.finfo(torch.float64).eps)


def test_row_numbers_are_prefixes_of_one_table_per_device(strict):
    # one table per device, grown to the next power of two when a longer run is asked: a shorter run reads its
    # prefix (no new table), so the tables held stay within twice the longest run (not one table per length)
    from torchneuron.ops import indexing
    device = torch.device("neuron", 0)
    indexing._NUMBER_TABLES.pop(0, None)
    first = indexing.row_numbers(100, device)
    table = indexing._NUMBER_TABLES[0]
    assert table.numel() == 128 and torch.equal(first.cpu(), torch.arange(100, dtype=torch.int32))
    for n in (1, 7, 128):
        assert indexing.row_numbers(n, device).data_ptr() == table.data_ptr()
    longer = indexing.row_numbers(129, device)
    assert indexing._NUMBER_TABLES[0].numel() == 256 and torch.equal(longer.cpu(), torch.arange(129, dtype=torch.int32))
    assert torch.equal(first.cpu(), torch.arange(100, dtype=torch.int32))   # a run read before stays valid
    x = torch.randn(300, 200)                                   # tril's row numbers: a longer table again
    assert torch.equal(to_n(x).tril(-3).cpu(), x.tril(-3)) and torch.equal(to_n(x).triu(5).cpu(), x.triu(5))
