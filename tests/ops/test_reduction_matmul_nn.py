"""Reductions, matrix products, softmax and layer norm run on the device (strict mode) and match the CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import to_n

torch.manual_seed(0)
A = torch.randn(4, 33, 7)

REDUCTIONS = {
    "sum": lambda t: t.sum(), "sum_1": lambda t: t.sum(1), "sum_02_keep": lambda t: t.sum((0, 2), keepdim=True),
    "mean_-1": lambda t: t.mean(-1), "amax_1": lambda t: t.amax(1), "amin_02": lambda t: t.amin((0, 2)),
    "max_dim": lambda t: t.max(1), "min_dim_keep": lambda t: t.min(2, keepdim=True), "argmax": lambda t: t.argmax(),
    "argmin_0": lambda t: t.argmin(0), "prod_2": lambda t: t.prod(2), "max": lambda t: t.max(),
    "transposed_sum": lambda t: t.transpose(0, 2).sum(0), "var": lambda t: t.var(1), "std": lambda t: t.std(-1),
    "bf16_sum": lambda t: t.bfloat16().sum(1),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions(name, strict):
    fn = REDUCTIONS[name]
    got, want = fn(to_n(A)), fn(A)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_var_std_accumulate_past_the_dtype_range_like_cpu(dtype, strict):
    # sums of squares past fp16's 65504 (1e5 unit normals; rows of magnitude ~200): the CPU accumulates
    # in fp32 and rounds once, so the results agree to a rounding of the dtype (one ulp either side)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100000, generator=g).to(dtype)
    rows = (torch.randn(4, 3000, generator=g) * 200).to(dtype)
    tol = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 0}
    for fn in (lambda t: t.var(), lambda t: t.std(), lambda t: t.var(-1), lambda t: t.std(-1, keepdim=True),
               lambda t: torch.var_mean(t, -1)[0], lambda t: torch.std_mean(t, correction=0)[0]):
        for t in (x, rows):
            ref = fn(t)
            got = fn(to_n(t)).cpu()
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_norms_accumulate_past_the_dtype_range_like_cpu(dtype, strict):
    # norm, linalg.vector_norm, _foreach_norm and cdist of fp16/bf16 with sums of squares past 65504: the
    # CPU accumulates in fp32 and rounds once, so the results agree to a rounding of the dtype
    g = torch.Generator().manual_seed(2)
    x = torch.randn(100000, generator=g).to(dtype)
    rows = (torch.randn(4, 3000, generator=g) * 200).to(dtype)
    tol = {"rtol": 2 * torch.finfo(dtype).eps, "atol": 0}
    for fn in (lambda t: t.norm(), lambda t: t.norm(dim=-1), lambda t: torch.linalg.vector_norm(t, 3, -1),
               lambda t: torch.linalg.vector_norm(t, 1), lambda t: torch.linalg.vector_norm(t, 0)):
        for t in (x, rows):
            torch.testing.assert_close(fn(to_n(t)).cpu(), fn(t), **tol)   # inf only where the CPU's is
    for got, ref in zip(torch._foreach_norm([to_n(x), to_n(rows)]), torch._foreach_norm([x, rows])):
        torch.testing.assert_close(got.cpu(), ref, **tol)
    a, b = rows[:3], rows[1:].flip(0)     # the CPU has no half cdist: its fp32 one, rounded once
    torch.testing.assert_close(torch.cdist(to_n(a), to_n(b)).cpu(), torch.cdist(a.float(), b.float()).to(dtype),
                               **tol)


def test_reduction_errors_match_cpu():
    for fn, exc in ((lambda t: t.sum(3), IndexError), (lambda t: t.sum((1, 1)), RuntimeError),
                    (lambda t: t[:0].max(), RuntimeError)):
        with pytest.raises(exc):
            fn(A)
        with pytest.raises(exc):
            fn(to_n(A))


def test_amax_amin_of_empty_tensors_match_cpu(strict):
    # no identity element: an empty reduced dim (IndexError) or no dim at all (RuntimeError) is refused,
    # while reducing a non-empty dim of an empty tensor gives an empty result
    x = torch.zeros(5, 0, 5)
    for fn in (lambda t: t.amax(1), lambda t: t.amin((0, 1)), lambda t: t.amax(), lambda t: t.amin([])):
        with pytest.raises(Exception) as cpu_err:
            fn(x)
        with pytest.raises(cpu_err.type, match=r"Expected reduction dim"):
            fn(to_n(x))
    assert to_n(x).amax(2).shape == x.amax(2).shape


def test_any_all_of_empty_tensors_match_cpu(strict):
    for shape, dim, keepdim in [((0,), None, False), ((2, 0), 1, False), ((2, 0), 0, True), ((0, 3), (0, 1), False)]:
        x = torch.zeros(shape)
        for name in ("any", "all"):
            args = () if dim is None else (dim, keepdim)
            want = getattr(x, name)(*args)
            got = getattr(to_n(x), name)(*args)
            assert got.dtype == want.dtype and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("m,k,n", [(37, 130, 65), (1, 5, 1), (128, 128, 512), (3, 1, 200)])
def test_mm_shapes_and_layouts(m, k, n, strict):
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.testing.assert_close((to_n(a) @ to_n(b)).cpu(), a @ b, atol=1e-4, rtol=1e-4)
    at, bt = to_n(a.t().contiguous()).t(), to_n(b.t().contiguous()).t()   # transposed operands: no copy
    torch.testing.assert_close((at @ bt).cpu(), a @ b, atol=1e-4, rtol=1e-4)


def test_matmul_family(strict):
    q, k = torch.randn(2, 3, 10, 16), torch.randn(2, 3, 16, 12)
    torch.testing.assert_close((to_n(q) @ to_n(k)).cpu(), q @ k, atol=1e-4, rtol=1e-4)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(5, 16)
    ref = lin(x)
    lin.to("neuron")
    torch.testing.assert_close(lin(to_n(x)).cpu(), ref, atol=1e-5, rtol=1e-5)
    c, m1, m2 = torch.randn(3, 1), torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(torch.addmm(to_n(c), to_n(m1), to_n(m2), beta=0.5, alpha=2).cpu(),
                               torch.addmm(c, m1, m2, beta=0.5, alpha=2), atol=1e-5, rtol=1e-5)
    b0, b1, b2 = torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    torch.testing.assert_close(torch.baddbmm(to_n(b0), to_n(b1), to_n(b2)).cpu(), torch.baddbmm(b0, b1, b2),
                               atol=1e-5, rtol=1e-5)
    e = torch.einsum("bij,bjk->bik", to_n(b1), to_n(b2))
    torch.testing.assert_close(e.cpu(), torch.einsum("bij,bjk->bik", b1, b2), atol=1e-5, rtol=1e-5)
    bf = (to_n(m1.bfloat16()) @ to_n(m2.bfloat16())).cpu()
    torch.testing.assert_close(bf, m1.bfloat16() @ m2.bfloat16(), atol=2e-2, rtol=2e-2)


def test_mm_errors_match_cpu():
    for a, b in ((torch.randn(2, 3), torch.randn(4, 5)), (torch.randn(2, 3), torch.randn(3, 5).bfloat16())):
        with pytest.raises(RuntimeError) as cpu:
            a @ b
        with pytest.raises(RuntimeError) as dev:
            to_n(a) @ to_n(b)
        assert str(dev.value).split("\n")[0] == str(cpu.value).split("\n")[0]


@pytest.mark.parametrize("dim", [-1, 0, 1])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_forward_backward(dim, log, strict):
    fn = F.log_softmax if log else F.softmax
    x = torch.randn(6, 40, requires_grad=True)
    xn = to_n(x.detach()).requires_grad_()
    g = torch.randn(6, 40)
    y, yn = fn(x, dim), fn(xn, dim)
    torch.testing.assert_close(yn.detach().cpu(), y.detach(), atol=1e-5, rtol=1e-5)
    y.backward(g)
    yn.backward(to_n(g))
    torch.testing.assert_close(xn.grad.cpu(), x.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_forward_backward(affine, strict):
    ln = torch.nn.LayerNorm(48, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ln.weight.normal_()
            ln.bias.normal_()
    lnn = torch.nn.LayerNorm(48, elementwise_affine=affine)
    lnn.load_state_dict(ln.state_dict())
    lnn.to("neuron")
    x = torch.randn(3, 5, 48, requires_grad=True)
    xn = to_n(x.detach()).requires_grad_()
    g = torch.randn(3, 5, 48)
    y, yn = ln(x), lnn(xn)
    torch.testing.assert_close(yn.detach().cpu(), y.detach(), atol=1e-5, rtol=1e-5)
    y.backward(g)
    yn.backward(to_n(g))
    torch.testing.assert_close(xn.grad.cpu(), x.grad, atol=1e-5, rtol=1e-5)
    if affine:
        torch.testing.assert_close(lnn.weight.grad.cpu(), ln.weight.grad, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lnn.bias.grad.cpu(), ln.bias.grad, atol=1e-4, rtol=1e-5)
    stats = torch.native_layer_norm(to_n(x.detach()), [48], None, None, 1e-5)
    ref = torch.native_layer_norm(x.detach(), [48], None, None, 1e-5)
    for s, r in zip(stats, ref):
        torch.testing.assert_close(s.cpu(), r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("D,dtype", [(48, torch.float32), (40, torch.bfloat16), (2000, torch.float32)])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
def test_native_layer_norm_backward_uses_saved_stats(D, dtype, mask, strict):
    # the backward reads the statistics it is given (as the CPU does), including a long-row multi-pass case
    gen = torch.Generator().manual_seed(D)       # the same inputs whatever ran before in this process
    x, g = torch.randn(6, D, generator=gen).to(dtype) * 3 + 1, torch.randn(6, D, generator=gen).to(dtype)
    w, b = torch.randn(D, generator=gen).to(dtype), torch.randn(D, generator=gen).to(dtype)
    _, mean, rstd = torch.native_layer_norm(x, [D], w, b, 1e-5)
    rstd = rstd * 1.5   # not what the input implies: a recomputing backward would not match
    # reference: the backward in fp32 from the same (exactly representable) inputs; the device computes in fp32
    # and rounds each result once to the dtype (bf16: 2**-9 relative, twice that allowed), while dx's sums cancel,
    # so its error is relative to the largest term, not to each element
    want = torch.ops.aten.native_layer_norm_backward(g.float(), x.float(), [D], mean.float(), rstd.float(),
                                                     w.float(), b.float(), list(mask))
    got = torch.ops.aten.native_layer_norm_backward(*(to_n(t) for t in (g, x)), [D], to_n(mean), to_n(rstd),
                                                    to_n(w), to_n(b), list(mask))
    rel = 1e-4 if dtype == torch.float32 else 2.0**-8
    for gt, wt in zip(got, want):
        assert (gt is None) == (wt is None)
        if wt is not None:
            torch.testing.assert_close(gt.cpu().float(), wt, atol=rel * wt.abs().max().item(), rtol=rel)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_layer_norm_of_empty_input(shape, strict):
    # no rows or no features: empty outputs, zero parameter gradients, on the device
    m, mn = torch.nn.LayerNorm(shape[-1:]), torch.nn.LayerNorm(shape[-1:]).to("neuron")
    x = torch.randn(shape, requires_grad=True)
    xn = to_n(x.detach()).requires_grad_()
    m(x).sum().backward()
    mn(xn).sum().backward()
    assert xn.grad.shape == x.grad.shape and xn.grad.is_neuron
    for a, b in ((mn.weight.grad, m.weight.grad), (mn.bias.grad, m.bias.grad)):
        torch.testing.assert_close(a.cpu(), b)


def test_layer_norm_bad_shape_matches_cpu():
    with pytest.raises(RuntimeError) as cpu:
        F.layer_norm(A, (8,))
    with pytest.raises(RuntimeError) as dev:
        F.layer_norm(to_n(A), (8,))
    assert str(dev.value) == str(cpu.value)


def test_addbmm_scalar_extremes_and_mean_dtype_errors(strict):
    i, b1, b2 = torch.randn(3, 5), torch.randn(4, 3, 2), torch.randn(4, 2, 5)
    torch.testing.assert_close(torch.addbmm(to_n(i), to_n(b1), to_n(b2), beta=0.5, alpha=2).cpu(),
                               torch.addbmm(i, b1, b2, beta=0.5, alpha=2), atol=1e-5, rtol=1e-5)
    s = torch.tensor(2.5)
    for got, want in zip(torch.max(to_n(s), 0), torch.max(s, 0)):
        torch.testing.assert_close(got.cpu(), want)
    for fn in (lambda t: t.long().mean(), lambda t: t.mean(dtype=torch.int64)):
        with pytest.raises(RuntimeError) as cpu:
            fn(A)
        with pytest.raises(RuntimeError) as dev:
            fn(to_n(A))
        assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("bias_shape,beta,alpha", [((7,), 1, 1), ((1, 7), 1, 1), ((5, 7), 1, 1), ((7,), 0.5, 1),
                                                   ((7,), 1, 2.0)])
def test_addmm_bias_row_fused_or_separate(bias_shape, beta, alpha, strict):
    # a bias row with beta = alpha = 1 is added inside the matmul launch, a full input (any beta, alpha) at the
    # product's store; a scaled bias row takes its own launch
    from torchneuron.runtime import profiler
    a, b, c = torch.randn(5, 3), torch.randn(3, 7), torch.randn(bias_shape)
    with profiler.record() as recs:
        got = torch.addmm(to_n(c), to_n(a), to_n(b), beta=beta, alpha=alpha)
    torch.testing.assert_close(got.cpu(), torch.addmm(c, a, b, beta=beta, alpha=alpha), atol=1e-5, rtol=1e-5)
    row = len(bias_shape) == 1 or bias_shape[0] == 1
    assert len(recs) == (1 if not row or (beta == 1 and alpha == 1) else 2)


@pytest.mark.parametrize("dim,conv", [(0, False), (-1, False), (0, True), (3, True)])
def test_weight_norm_parametrization(dim, conv, strict):
    # nn.utils.parametrizations.weight_norm: the fused _weight_norm_interface and its backward
    torch.manual_seed(0)
    layer = torch.nn.Conv2d(2, 5, 3) if conv else torch.nn.Linear(3, 4)
    m = torch.nn.utils.parametrizations.weight_norm(layer, dim=dim)
    mn = copy.deepcopy(m).to("neuron")
    x = torch.randn(2, 2, 5, 5) if conv else torch.randn(2, 3)
    a, b = m(x), mn(to_n(x))
    torch.testing.assert_close(b.detach().cpu(), a.detach(), atol=1e-5, rtol=1e-5)
    g = torch.randn_like(a)
    a.backward(g)
    b.backward(to_n(g))
    for (name, p), q in zip(m.named_parameters(), mn.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-5, rtol=1e-5, msg=lambda s: f"{name}: {s}")


def test_repeated_reductions_replay_the_plan_of_their_own_signature(strict):
    # a reduction keeps a plan per signature (device, shape, strides, dtype, dims, keepdim, dtype=): calls of one
    # input shape over other dims, with keepdim, in another layout (a copy first: unplanned), in bf16, as a mean, an amax
    # and a whole-tensor sum, interleaved and repeated, each give the unplanned path's bits, shape and launches;
    # a bad dim still raises PyTorch's error
    from torchneuron.ops import reduction
    from torchneuron.runtime import profiler
    x = torch.randn(6, 5, 7, generator=torch.Generator().manual_seed(13))
    calls = {"sum0": lambda t: (t, "sum", [0], False), "sum12 keep": lambda t: (t, "sum", [1, 2], True),
             "sum -1": lambda t: (t, "sum", [-1], False),
             "sum transposed": lambda t: (t.transpose(0, 2).contiguous().transpose(0, 2), "sum", [0], False),
             "bf16": lambda t: (t.bfloat16(), "sum", [0], False), "mean": lambda t: (t, "mean", [1], False),
             "amax": lambda t: (t, "max", [2], True), "all": lambda t: (t, "sum", [0, 1, 2], False)}
    ops = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax}
    xn = to_n(x)
    want = {}
    for name, make in calls.items():    # the unplanned path: reduction._reduce on canonical dims
        t, op, dims, keep = make(xn)
        with profiler.record() as records:
            out = reduction._reduce(t, sorted(d % 3 for d in dims), op, keep)
        want[name] = out.cpu(), len(records)
    for _ in range(2):
        for name, make in calls.items():
            t, op, dims, keep = make(xn)
            with profiler.record() as records:
                got = ops[op](t, dims, keepdim=keep)
            assert got.shape == want[name][0].shape and torch.equal(got.cpu(), want[name][0]), name
            assert len(records) == want[name][1], name
            torch.testing.assert_close(got.cpu().float(), ops[op](make(x)[0], dims, keepdim=keep).float(),
                                       rtol=0.02 if name == "bf16" else 1e-5, atol=0.05 if name == "bf16" else 1e-5)
    with pytest.raises(IndexError):
        torch.sum(xn, [3])
