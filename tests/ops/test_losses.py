"""Classification losses (binary cross entropy, multi-class and multi-label margins) run on the device
(strict mode) and match the CPU; bad inputs and targets raise the CPU's errors."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import assert_raises_like_cpu, to_n

torch.manual_seed(0)
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _n(t):
    return None if t is None else to_n(t)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_binary_cross_entropy_and_grad(reduction, strict):
    x, t, w = torch.rand(4, 5), torch.rand(4, 5), torch.rand(4, 5)
    x[0, 0], x[1, 1] = 0.0, 1.0                     # the logs clamp at -100
    for weight in (None, w):
        xc, xn = x.clone().requires_grad_(), to_n(x).requires_grad_()
        want = F.binary_cross_entropy(xc, t, weight, reduction=reduction)
        got = F.binary_cross_entropy(xn, to_n(t), _n(weight), reduction=reduction)
        torch.testing.assert_close(got.cpu(), want, **TOL)
        g = torch.rand_like(want)
        want.backward(g)
        got.backward(to_n(g))
        torch.testing.assert_close(xn.grad.cpu(), xc.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("p", [1, 2])
def test_multi_margin_loss(p, strict):
    x, t, w = torch.randn(6, 7), torch.randint(0, 7, (6,)), torch.rand(7)
    x[2, 3], x[4, 1] = float("nan"), float("inf")    # a NaN margin term adds nothing, as on CPU
    for margin in (1.0, -0.5):
        for weight in (None, w):
            for reduction in ("none", "mean", "sum"):
                want = F.multi_margin_loss(x, t, p, margin, weight, reduction=reduction)
                got = F.multi_margin_loss(to_n(x), to_n(t), p, margin, _n(weight), reduction=reduction)
                torch.testing.assert_close(got.cpu(), want, equal_nan=True, **TOL)
    for xx, tt in ((torch.randn(5), torch.tensor(2)), (torch.randn(5), torch.tensor([2])),
                   (torch.randn(()), torch.tensor(0))):
        torch.testing.assert_close(F.multi_margin_loss(to_n(xx), to_n(tt), reduction="none").cpu(),
                                   F.multi_margin_loss(xx, tt, reduction="none"))


def test_multilabel_margin_loss(strict):
    x = torch.randn(6, 5)
    x[1, 1], x[3, 2] = float("inf"), float("nan")
    t = torch.tensor([[0, 1, -1, 3, 4], [2, 2, 0, -1, -1], [-1, 0, 0, 0, 0], [4, 3, 2, 1, 0], [1, -1, 3, -1, 2],
                      [0, 0, 0, 0, 0]])
    for reduction in ("none", "mean", "sum"):
        torch.testing.assert_close(F.multilabel_margin_loss(to_n(x), to_n(t), reduction=reduction).cpu(),
                                   F.multilabel_margin_loss(x, t, reduction=reduction), equal_nan=True, **TOL)
    got = torch.ops.aten.multilabel_margin_loss_forward(to_n(x), to_n(t), 0)
    for g, e in zip(got, torch.ops.aten.multilabel_margin_loss_forward(x, t, 0)):
        torch.testing.assert_close(g.cpu(), e, equal_nan=True, **TOL)
    for xx, tt in ((torch.randn(5), torch.tensor([3, 0, -1, 2, 1])), (torch.randn(()), torch.tensor(0))):
        torch.testing.assert_close(F.multilabel_margin_loss(to_n(xx), to_n(tt), reduction="none").cpu(),
                                   F.multilabel_margin_loss(xx, tt, reduction="none"))


@pytest.mark.parametrize("call", [
    lambda n: F.binary_cross_entropy(n(torch.tensor([0.5, 1.5])), n(torch.tensor([0.5, 0.5]))),
    lambda n: F.binary_cross_entropy(n(torch.tensor([0.5, 0.5])), n(torch.tensor([float("nan"), 0.5]))),
    lambda n: F.multi_margin_loss(n(torch.randn(3, 4)), n(torch.tensor([0, 4, 1]))),
    lambda n: F.multi_margin_loss(n(torch.randn(5, 0)), n(torch.tensor([0, 0, 0, 0, 0]))),
    lambda n: F.multi_margin_loss(n(torch.randn(5, 4)), n(torch.zeros(5, 4, dtype=torch.long))),
    lambda n: F.multilabel_margin_loss(n(torch.randn(3, 4)), n(torch.tensor([[0, 1, -1, 5]] * 3))),
    lambda n: F.multilabel_margin_loss(n(torch.randn(5, 4)), n(torch.zeros(4, dtype=torch.long))),
])
def test_errors_match_cpu(call, strict):
    assert_raises_like_cpu(call)


def test_margin_loss_grads(strict):
    x, t, w = torch.randn(6, 7), torch.randint(0, 7, (6,)), torch.rand(7)
    tl = torch.tensor([[0, 1, -1, 3, 4], [2, 2, 0, -1, -1], [-1, 0, 0, 0, 0], [4, 3, 2, 1, 0]])
    cases = [(F.multi_margin_loss, x, t, {"p": p, "margin": m, "weight": ww, "reduction": r})
             for p in (1, 2) for m in (1.0, -0.5) for ww in (None, w) for r in ("none", "mean")]
    cases += [(F.multi_margin_loss, torch.randn(5), torch.tensor(2), {"reduction": "none"})]
    cases += [(F.multilabel_margin_loss, torch.randn(4, 5), tl, {"reduction": r}) for r in ("none", "mean", "sum")]
    cases += [(F.multilabel_margin_loss, torch.randn(5), tl[0], {"reduction": "none"})]
    for fn, x, t, kw in cases:
        xc, xn = x.clone().requires_grad_(), to_n(x).requires_grad_()
        y = fn(xc, t, **kw)
        g = torch.rand_like(y)
        y.backward(g)
        fn(xn, to_n(t), **{k: _n(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}).backward(to_n(g))
        torch.testing.assert_close(xn.grad.cpu(), xc.grad, **TOL)


def test_margin_losses_refuse_int32_targets(strict):
    x, t = torch.randn(3, 4), torch.tensor([0, 1, 2], dtype=torch.int32)
    for call in (lambda n: F.multi_margin_loss(n(x), n(t)),
                 lambda n: F.multilabel_margin_loss(n(x), n(t.reshape(3, 1).expand(3, 4)))):
        with pytest.raises(RuntimeError) as cpu:
            call(lambda v: v)
        with pytest.raises(RuntimeError) as dev:
            call(to_n)
        assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("shape,weighted,dtype", [((1030, 65), False, torch.float32), ((300, 7), True, torch.float32),
                                                  ((7,), True, torch.float32), ((5,), False, torch.float32),
                                                  ((260, 33), True, torch.bfloat16)])
def test_nll_loss_forward_backward_ops(shape, weighted, dtype, reduction, strict):
    # the aten ops directly: grouped rows (1030 = 8 per partition + a tail), one sample, weights, ignored rows
    C = shape[-1]
    x = torch.randn(shape).to(dtype)
    t = torch.randint(0, C, shape[:-1])
    if t.dim():
        t[::5] = -100
    w = torch.rand(C).to(dtype) if weighted else None
    want = torch.ops.aten.nll_loss_forward(x, t, w, reduction, -100)
    got = torch.ops.aten.nll_loss_forward(to_n(x), to_n(t), _n(w), reduction, -100)
    tol = TOL if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype
        torch.testing.assert_close(g_.cpu(), w_, **{k: v * 10 for k, v in tol.items()})
    g = torch.randn(want[0].shape).to(dtype)
    dx = torch.ops.aten.nll_loss_backward(to_n(g), to_n(x), to_n(t), _n(w), reduction, -100, to_n(want[1]))
    torch.testing.assert_close(dx.cpu(), torch.ops.aten.nll_loss_backward(g, x, t, w, reduction, -100, want[1]), **tol)


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("rows", [6, 1030])
def test_nll_loss_keeps_non_finite_values_in_their_own_element(rows, reduction, strict):
    # masked logits (-inf, NaN) in other classes, a NaN class weight, ignored rows: only the picked
    # element of a counted row enters its loss and its gradient, as on the CPU
    C = 5
    x = torch.randn(rows, C)
    x[0, 3], x[1, 0], x[2, 4], x[3, 1] = float("-inf"), float("nan"), float("inf"), float("-inf")
    t = torch.randint(0, C, (rows,))
    t[:4] = torch.tensor([0, 2, 2, 1])                      # row 3 picks its -inf: an inf loss
    t[4] = 7                                                # ignored (ignore_index 7 is out of range)
    w = torch.rand(C)
    w[4] = float("nan")                                     # a weight no target picks... except row 2's
    t[2] = 3
    for weight in (None, w):
        want = torch.ops.aten.nll_loss_forward(x, t, weight, reduction, 7)
        got = torch.ops.aten.nll_loss_forward(to_n(x), to_n(t), _n(weight), reduction, 7)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_.cpu(), w_, **TOL, equal_nan=True)
        g = torch.randn(want[0].shape)
        dx = torch.ops.aten.nll_loss_backward(to_n(g), to_n(x), to_n(t), _n(weight), reduction, 7, to_n(want[1]))
        ref = torch.ops.aten.nll_loss_backward(g, x, t, weight, reduction, 7, want[1])
        torch.testing.assert_close(dx.cpu(), ref, **TOL, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_with_every_target_ignored(reduction, strict):
    # mean over no counted rows is 0/0 = NaN, yet the gradient is exactly 0 (nothing was picked)
    x = torch.randn(3, 4, requires_grad=True)
    xn = to_n(x.detach()).requires_grad_()
    t = torch.tensor([1, 1, 1])
    for inp, tt in ((x, t), (xn, to_n(t))):
        F.cross_entropy(inp, tt, ignore_index=1, label_smoothing=0.15, reduction=reduction).backward()
    torch.testing.assert_close(F.cross_entropy(xn, to_n(t), ignore_index=1, reduction=reduction).cpu(),
                               F.cross_entropy(x, t, ignore_index=1, reduction=reduction), equal_nan=True)
    torch.testing.assert_close(xn.grad.cpu(), x.grad, **TOL, equal_nan=True)


@pytest.mark.parametrize("bad", [9, -3, 2 ** 33 + 1])
def test_nll_loss_out_of_range_targets_raise_like_cpu(bad):
    # an int64 target whose low word is in range (2**33 + 1) is out of range too
    x, g = torch.randn(4, 9), torch.tensor(1.0)
    t = torch.tensor([0, bad, 1, -100])
    assert_raises_like_cpu(lambda c: torch.ops.aten.nll_loss_forward(c(x), c(t), None, 1, -100))
    assert_raises_like_cpu(lambda c: torch.ops.aten.nll_loss_backward(c(g), c(x), c(t), None, 1, -100,
                                                                      c(torch.tensor(3.0))))


def test_nll_loss_refuses_int32_targets_like_cpu():
    x, t = torch.randn(4, 3), torch.tensor([0, 1, 2, 1], dtype=torch.int32)
    assert_raises_like_cpu(lambda c: torch.ops.aten.nll_loss_forward(c(x), c(t), None, 1, -100))


def test_cross_entropy_over_more_classes_than_sbuf_rows_hold():
    """Rows of 5000 classes do not fit SBUF whole: the nll kernels take them in column blocks (no CPU
    fallback), with the CPU's values and gradients."""
    from torchneuron.fallback import fallback_counts, reset_fallback_counts
    x, t = torch.randn(6, 5000), torch.randint(0, 5000, (6,))
    xc, xn = x.clone().requires_grad_(), to_n(x).requires_grad_()
    want = F.cross_entropy(xc, t)
    want.backward()
    reset_fallback_counts()
    got = F.cross_entropy(xn, to_n(t))
    got.backward()
    tol = {"rtol": 5000 * 2.0**-24, "atol": 1e-7}   # a sum of 5000 exponentials in another order: n * u relative
    torch.testing.assert_close(got.cpu(), want, **tol)
    torch.testing.assert_close(xn.grad.cpu(), xc.grad, **tol)
    counts = fallback_counts()
    assert not any("nll_loss" in k or "log_softmax" in k for k in counts)


# ---- out= variants (derived from the functional kernels by register_out) ---------------------------------------
_aten = torch.ops.aten
_x, _g = torch.rand(4, 3) * 0.8 + 0.1, torch.rand(4, 3)
_cls = torch.tensor([0, 2, 1, 1])
_lbl = torch.tensor([[0, 1, -1], [2, -1, 0], [1, 0, 2], [0, -1, 1]])
OUT_CALLS = {   # name -> (call(convert, out), out tensor's keyword)
    "_softmax.out": lambda n, o: _aten._softmax.out(n(_x), 1, False, out=o),
    "_log_softmax.out": lambda n, o: _aten._log_softmax.out(n(_x), 0, False, out=o),
    "_softmax_backward_data.out": lambda n, o: _aten._softmax_backward_data.out(
        n(_g), n(_x.softmax(1)), 1, torch.float32, grad_input=o),
    "_log_softmax_backward_data.out": lambda n, o: _aten._log_softmax_backward_data.out(
        n(_g), n(_x.log_softmax(1)), 1, torch.float32, out=o),
    "binary_cross_entropy.out": lambda n, o: _aten.binary_cross_entropy.out(n(_x), n(_g), None, 0, out=o),
    "binary_cross_entropy_backward.grad_input": lambda n, o: _aten.binary_cross_entropy_backward.grad_input(
        n(_g), n(_x), n(_g), n(_g[0]), 1, grad_input=o),
    "multi_margin_loss.out": lambda n, o: _aten.multi_margin_loss.out(n(_x), n(_cls), 2, 0.5, None, 0, out=o),
    "multi_margin_loss_backward.grad_input": lambda n, o: _aten.multi_margin_loss_backward.grad_input(
        n(_g[:, 0]), n(_x), n(_cls), 1, 1.0, None, 0, grad_input=o),
    "multilabel_margin_loss_backward.grad_input": lambda n, o: _aten.multilabel_margin_loss_backward.grad_input(
        n(_g[:, 0]), n(_x), n(_lbl), 0, n((_lbl >= 0).float()), grad_input=o),
}


@pytest.mark.parametrize("name", sorted(OUT_CALLS))
@pytest.mark.parametrize("out_shape", [(4, 3), (0,), (4,), (1, 4, 3), (2, 9)])
def test_out_variants_write_like_the_cpu(name, out_shape, strict):
    """Into an out= tensor of the result's shape, of no elements, or of another shape: the CPU's values, shape and
    strides, the out= tensor itself returned, no fallback (binary cross-entropy's out= keeps its own shape: see
    the next test)."""
    call = OUT_CALLS[name]
    cpu_out = torch.full(out_shape, 7.0)
    try:
        want = call(lambda t: t, cpu_out)
    except RuntimeError:   # (the weighted bce backward's in-place weighting of an out= it does not broadcast to)
        assert_raises_like_cpu(lambda n: call(n, n(torch.full(out_shape, 7.0))))
        return
    dev_out = to_n(torch.full(out_shape, 7.0))
    got = call(to_n, dev_out)
    assert got is dev_out
    assert got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got.cpu(), want, **TOL)


def _bce_outcome(call, convert, out_shape) -> tuple:
    out = convert(torch.full(out_shape, 7.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = call(convert, out)
        except RuntimeError as e:
            # (the type only: the device's in-place broadcast error names the first mismatched dim from the front,
            # the CPU's from the back)
            return ("error", type(e))
    return (res is out, out.shape, out.stride(), out.cpu(), [str(w.message) for w in caught if "resized" in
                                                               str(w.message)])


@pytest.mark.parametrize("out_shape", [(4, 3), (0,), (4,), (12,), (3, 4), (2, 9), (1, 4, 3), (4, 3, 1), (1,), ()])
@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_binary_cross_entropy_writes_its_out_through_its_squeezed_view_as_the_cpu(out_shape, reduction, weighted,
                                                                                 strict):
    """The CPU's kernels write each element's value into the out= tensor's squeezed view (resized, with the
    warning naming the view's shape, where its shape is not the squeezed result's), then weight and reduce the
    tensor in its own shape: an out= of another shape keeps it (the values fill its storage in order), a mean
    or sum is of the elements it shows. The device does the same, step by step: the same shapes, strides,
    values and warnings."""
    w = torch.rand(4, 3) if weighted else None
    g = _g if reduction == 0 else torch.tensor(0.7)
    # (the backward has no Python binding with out=: through the ATen overload the CPU's resize warning is printed
    # by C++ rather than raised in Python, so only the forward's warnings are compared)
    calls = ((lambda n, o: torch._C._nn.binary_cross_entropy(n(_x), n(_g), None if w is None else n(w), reduction,
                                                             out=o), True),
             (lambda n, o: _aten.binary_cross_entropy_backward.grad_input(n(g), n(_x), n(_g), None if w is None else
                                                                          n(w), reduction, grad_input=o), False))
    for call, warned in calls:
        want = _bce_outcome(call, lambda t: t, out_shape)
        got = _bce_outcome(call, to_n, out_shape)
        assert got[:3] == want[:3] and (got[4:] == want[4:] or not warned), (got, want)
        if want[0] != "error":
            torch.testing.assert_close(got[3], want[3], **TOL, equal_nan=True)   # (the module's loss tolerance)


def test_multilabel_margin_forward_writes_both_outputs(strict):
    loss, flags = torch.full((7,), 7.0), torch.empty(0)
    want = _aten.multilabel_margin_loss_forward.output(_x, _lbl, 0, output=loss, is_target=flags)
    dl, df = to_n(torch.full((7,), 7.0)), to_n(torch.empty(0))
    got = _aten.multilabel_margin_loss_forward.output(to_n(_x), to_n(_lbl), 0, output=dl, is_target=df)
    assert got[0] is dl and got[1] is df
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, **TOL)


@pytest.mark.parametrize("name", sorted(OUT_CALLS))
def test_out_variants_of_another_dtype_raise_like_the_cpu(name):
    """An fp16 out= for an fp32 result: the CPU's error, from its own kernel (the counted fallback)."""
    assert_raises_like_cpu(lambda n: OUT_CALLS[name](n, n(torch.empty(4, 3, dtype=torch.float16))))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("loss", [F.huber_loss, F.smooth_l1_loss])
def test_robust_losses_of_16_bit_values_round_once(loss, dtype):
    """Each element's huber / smooth-L1 loss is computed in fp32 and rounded once (rounding ``input - target``
    to the 16-bit dtype first put results a unit off where the difference is not exact in the dtype). The
    CPU's kernels round once for huber@fp16 and smooth-L1@bf16 and every step for the other two; so each
    result is at least as close to the exact loss as the CPU's, and equal to it where the CPU rounds once."""
    torch.manual_seed(0)
    x = (torch.randn(4096) * 30).to(dtype)
    t = (torch.randn(4096) * 0.3).to(dtype)
    for kw in ({"delta": 1.5} if loss is F.huber_loss else {"beta": 1.5}, {}):
        want = loss(x, t, reduction="none", **kw)
        got = loss(to_n(x), to_n(t), reduction="none", **kw).cpu()
        exact = loss(x.double(), t.double(), reduction="none", **kw)
        assert ((got.double() - exact).abs() <= (want.double() - exact).abs()).all()
        if (loss is F.huber_loss) == (dtype == torch.float16):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_xlogy_of_16_bit_values_rounds_where_the_cpu_does(dtype, strict):
    """xlogy of bf16/fp16 rounds log(y) to the dtype and then the product, as the CPU's kernel does
    (``x * std::log(y)`` on 2-byte scalars): the device equals the CPU bit for bit, and both are within those
    two roundings of the exact value, |r - x log y| <= (2u + u^2) |x log y| (u = eps / 2; the operands are
    exact in the dtype) plus the fp32 log's own error, a few fp32 units of |x log y| and of |x| (near y = 1)."""
    torch.manual_seed(0)
    x = torch.randn(8192).to(dtype)
    y = (torch.rand(8192) * 4).to(dtype)
    x[:4], y[4:8] = 0.0, 0.0
    want = torch.xlogy(x, y)
    got = torch.xlogy(to_n(x), to_n(y)).cpu()
    assert torch.equal(got, want)
    exact = torch.xlogy(x.double(), y.double())
    u, u32 = torch.finfo(dtype).eps / 2, torch.finfo(torch.float32).eps
    fin = exact.isfinite()
    bound = (2 * u + u * u + 4 * u32) * exact.abs() + 4 * u32 * x.double().abs()
    assert ((got.double() - exact).abs() <= bound)[fin].all()
    # a Python scalar y is taken to the dtype first, as the CPU's common dtype does
    assert torch.equal(torch.xlogy(to_n(x), 3.7).cpu(), torch.xlogy(x, 3.7))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
def test_kl_div_gradients_of_16_bit_values_round_where_the_cpu_does(dtype, reduction, strict):
    """kl_div(input, target) = xlogy(target, target) - target * input: the target's gradient is
    g log t + g - g input, formed by PyTorch's composition in the dtype with the terms rounded one by one and
    summed. With xlogy's backward (xlogy(g, t)) rounding as the CPU's, the device's gradients equal the CPU's
    bit for bit (they were a few units of the largest term off where the terms cancel), and each is within the
    roundings of its steps of the float64 gradient of the same inputs: a term rounded at most twice (2u + u^2
    of it) and the two sums of the accumulation (u of each partial sum), so (4u + u^2) sum|terms| bounds it,
    plus half a subnormal unit s of each product in the gradual underflow range (fp16 targets below 2^-14):
    g t rounded there and then divided by t is s / (2t) off, the other products s / 2."""
    torch.manual_seed(1)
    inp = torch.randn(16, 40).log_softmax(-1).to(dtype)
    tgt = torch.randn(16, 40).mul(2).softmax(-1).to(dtype)
    g = torch.randn(16, 40) if reduction == "none" else torch.randn(())
    g = g.to(dtype)
    grads = []
    for dev in ("cpu", "neuron", "float64"):
        i, t, gg = (inp.double(), tgt.double(), g.double()) if dev == "float64" else \
            (inp.to(dev), tgt.to(dev), g.to(dev))
        i, t = i.clone().requires_grad_(), t.clone().requires_grad_()
        F.kl_div(i, t, reduction=reduction).backward(gg)
        grads.append((i.grad.cpu(), t.grad.cpu()))
    (ci, ct), (ni, nt), (xi, xt) = grads
    assert torch.equal(ni, ci) and torch.equal(nt, ct)
    u = torch.finfo(dtype).eps / 2
    gs = g.double() / (16 if reduction == "batchmean" else 1)
    terms = gs.abs() * (tgt.double().log().abs() + 1 + inp.double().abs())
    s = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    floor = s / 2 * (3 + 1 / tgt.double())
    assert ((nt.double() - xt).abs() <= (4 * u + u * u) * terms + floor).all()
