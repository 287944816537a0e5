"""kernels/cross_entropy.py through ``F.cross_entropy`` on neuron, against the CPU's float64 result on the same inputs.

The fused kernels compute in fp32 and round each result once to the input's dtype, so an element y of a result
is within ``u |y| + fp32 error`` of the exact value, u the dtype's unit roundoff. The fp32 error of a row's
log-sum-exp is at most about (C + 8) * 2**-24 (C terms summed, each exp within a few ulps), which the losses
carry absolutely and the probabilities exp(x - lse) relatively; a reduction over N rows adds N * 2**-24 of the
summed magnitudes.
"""
import pytest
import torch
import torch.nn.functional as F

import torchneuron  # noqa: F401  (registers the device)
from torchneuron.ops.nn import use_fused_cross_entropy
from torchneuron.runtime import profiler


@pytest.fixture(autouse=True)
def _fused():
    """The fused path is the default; a test that turns it off (``use_fused_cross_entropy``) gets it back after."""
    use_fused_cross_entropy(True)
    yield
    use_fused_cross_entropy(True)

U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}   # unit roundoffs
EPS32 = 2.0 ** -24
REDUCTIONS = ["mean", "sum", "none"]


def _inputs(N: int, C: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.randn(N, C) * 3).to(dtype)
    t = torch.randint(0, C, (N,))
    t[::7] = -100                                          # ignored rows
    return x, t


def _run(x, t, grad=None, **kw):
    """(loss, dx) on neuron and their float64 CPU references (the same inputs, the same incoming gradient)."""
    xn = x.to("neuron").requires_grad_()
    wn = kw.pop("weight", None)
    loss = F.cross_entropy(xn, t.to("neuron"), weight=None if wn is None else wn.to("neuron"), **kw)
    xr = x.double().requires_grad_()
    ref = F.cross_entropy(xr, t, weight=None if wn is None else wn.double(), **kw)
    g = torch.randn(ref.shape, dtype=torch.float64).to(x.dtype) if grad is None else grad
    loss.backward(g.to("neuron"))
    ref.backward(g.double())
    return loss.cpu().double(), xn.grad.cpu().double(), ref.detach(), xr.grad


def _check(out, ref, bound):
    """Every element of ``out`` within ``bound`` (elementwise) of ``ref``; NaN where ``ref`` is NaN."""
    assert torch.equal(out.isnan(), ref.isnan())
    err = (out - ref).abs().nan_to_num(0.0)
    worst = (err - bound.nan_to_num(0.0)).max()
    assert worst <= 0, f"off by {err.max().item():.3g} (bound {bound.max().item():.3g})"


def _bounds(x, ref_loss, ref_dx, reduction, dtype):
    """(loss bound, dx bound) from the roundings above."""
    N, C = x.shape
    u, row = U[dtype], (C + 8) * EPS32
    if reduction == "none":
        loss_b = u * ref_loss.abs() + row * 4 * (1 + x.double().abs().amax(1))
    else:
        loss_b = u * ref_loss.abs() + (row + N * EPS32) * 4 * N * (1 + x.double().abs().max())
    rel = row + 64 * EPS32 * (1 + x.double().abs().max())       # relative error of a probability
    dx_b = u * ref_dx.abs() + 2 * rel * ref_dx.abs().amax(1, keepdim=True) + 1e-30
    return loss_b, dx_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_wide_rows_match_the_cpu(dtype, reduction):
    """5000 classes: two column blocks; 300 rows: three row blocks, the last partial."""
    x, t = _inputs(300, 5000, dtype)
    loss, dx, ref, ref_dx = _run(x, t, reduction=reduction)
    loss_b, dx_b = _bounds(x, ref, ref_dx, reduction, dtype)
    _check(loss, ref, loss_b)
    _check(dx, ref_dx, dx_b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_class_weights_and_label_smoothing(dtype, reduction):
    x, t = _inputs(130, 300, dtype)
    w = torch.rand(300).to(dtype)
    for kw in ({"weight": w}, {"label_smoothing": 0.2}):
        loss, dx, ref, ref_dx = _run(x, t, reduction=reduction, **kw)
        loss_b, dx_b = _bounds(x, ref, ref_dx, reduction, dtype)
        _check(loss, ref, loss_b)
        _check(dx, ref_dx, dx_b)


def test_few_classes_take_the_composition():
    """Below FUSED_CE_MIN_CLASSES the composition's grouped rows are faster: log_softmax and nll launches."""
    x, t = _inputs(64, 100, torch.float32)
    with profiler.record() as fwd:
        F.cross_entropy(x.to("neuron"), t.to("neuron"))
    assert "cross_entropy_fwd_kernel" not in [r.name for r in fwd] and len(fwd) == 2


def test_the_fused_path_is_the_default_and_can_be_turned_off():
    x, t = _inputs(64, 300, torch.float32)
    with profiler.record() as default:
        F.cross_entropy(x.to("neuron"), t.to("neuron"))
    use_fused_cross_entropy(False)
    with profiler.record() as off:
        loss = F.cross_entropy(x.to("neuron"), t.to("neuron"))
    assert [r.name for r in default] == ["cross_entropy_fwd_kernel"]
    assert "cross_entropy_fwd_kernel" not in [r.name for r in off] and len(off) == 2
    torch.testing.assert_close(loss.cpu(), F.cross_entropy(x, t))


def test_one_launch_each_way():
    x, t = _inputs(256, 3000, torch.bfloat16)
    xn = x.to("neuron").requires_grad_()
    tn = t.to("neuron")
    with profiler.record() as fwd:
        loss = F.cross_entropy(xn, tn)
    with profiler.record() as bwd:
        loss.backward()
    assert [r.name for r in fwd] == ["cross_entropy_fwd_kernel"]
    # (autograd's seed, a one-element ones_like, is written by the host: no launch)
    assert [r.name for r in bwd] == ["cross_entropy_bwd_kernel"]


def test_masked_logits_and_a_block_of_minus_infinity():
    """Logits at -inf (a masked vocabulary) add nothing to the row's sum, as on the CPU: a whole column block of
    -inf, and a row that is -inf everywhere but its target."""
    x, t = _inputs(20, 5000, torch.float32)
    t[:] = torch.randint(4096, 5000, (20,))
    x[:10, :4096] = float("-inf")
    x[10] = float("-inf")
    x[10, t[10]] = 1.5
    for reduction in ("none", "mean"):
        loss, dx, ref, ref_dx = _run(x, t, reduction=reduction)
        loss_b, dx_b = _bounds(x.clamp(min=-1e4), ref, ref_dx, reduction, torch.float32)
        _check(loss, ref, loss_b)
        _check(dx, ref_dx, dx_b)


def test_one_sample_and_all_rows_ignored():
    x = torch.randn(5000)
    for reduction in REDUCTIONS:
        loss, dx, ref, ref_dx = _run(x.reshape(1, -1), torch.tensor([17]), reduction=reduction)
        xn = x.to("neuron")
        one = F.cross_entropy(xn, torch.tensor(17).to("neuron"), reduction=reduction)
        expected = F.cross_entropy(x.double(), torch.tensor(17), reduction=reduction)
        assert one.shape == expected.shape
        _check(one.cpu().double(), expected, 8 * 5008 * EPS32 * (1 + expected.abs()))
    x, t = _inputs(10, 300, torch.float32)
    t[:] = -100
    loss, dx, ref, ref_dx = _run(x, t, grad=torch.tensor(1.0))   # mean over no rows: NaN; gradient 0
    assert loss.isnan() and ref.isnan()
    assert torch.equal(dx, torch.zeros_like(dx)) and torch.equal(ref_dx, torch.zeros_like(ref_dx))


def test_second_derivative_differentiates_the_composition():
    x, t = _inputs(8, 300, torch.float32)
    xn = x.to("neuron").requires_grad_()
    (g,) = torch.autograd.grad(F.cross_entropy(xn, t.to("neuron")), xn, create_graph=True)
    (gg,) = torch.autograd.grad(g.square().sum(), xn)
    xr = x.double().requires_grad_()
    (gr,) = torch.autograd.grad(F.cross_entropy(xr, t), xr, create_graph=True)
    (ggr,) = torch.autograd.grad(gr.square().sum(), xr)
    torch.testing.assert_close(gg.cpu().double(), ggr, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", [300, -1, -101])
def test_a_target_out_of_range_raises_as_the_cpu(bad):
    x, t = _inputs(8, 300, torch.float32)
    t[3] = bad
    with pytest.raises(IndexError) as cpu:
        F.cross_entropy(x, t)
    with pytest.raises(IndexError) as dev:
        F.cross_entropy(x.to("neuron"), t.to("neuron"))
    assert str(dev.value) == str(cpu.value)


def test_what_the_kernels_do_not_take_runs_the_composition():
    """int32 targets (the CPU refuses them), class probabilities, weights with smoothing: PyTorch's composition."""
    x, t = _inputs(8, 300, torch.float32)
    with pytest.raises(RuntimeError) as cpu:
        F.cross_entropy(x, t.int())
    with pytest.raises(RuntimeError) as dev:
        F.cross_entropy(x.to("neuron"), t.int().to("neuron"))
    assert type(dev.value) is type(cpu.value)
    probs = torch.rand(8, 300).softmax(1)
    out = F.cross_entropy(x.to("neuron"), probs.to("neuron"))
    torch.testing.assert_close(out.cpu(), F.cross_entropy(x, probs), rtol=1e-5, atol=1e-5)
    w = torch.rand(300)
    loss, dx, ref, ref_dx = _run(x, t, weight=w, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-4, atol=1e-7)


def test_class_weights_that_require_grad_raise_as_the_cpu():
    x, t = _inputs(8, 300, torch.float32)
    w = torch.rand(300)

    def call(n):
        F.cross_entropy(n(x).requires_grad_(), n(t), weight=n(w).requires_grad_()).backward()
    with pytest.raises(RuntimeError) as cpu:
        call(lambda v: v.clone())
    with pytest.raises(RuntimeError) as dev:
        call(lambda v: v.to("neuron"))
    assert str(dev.value) == str(cpu.value)


def test_forward_mode_derivatives_take_the_composition():
    import torch.autograd.forward_ad as fwad
    x, t = _inputs(8, 300, torch.float32)
    v = torch.randn(8, 300)
    tangents = []
    for dev in ("cpu", "neuron"):
        with fwad.dual_level():
            out = F.cross_entropy(fwad.make_dual(x.to(dev), v.to(dev)), t.to(dev))
            tangents.append(fwad.unpack_dual(out).tangent.cpu())
    # the tangent sum_j (p_j - onehot_j) v_j / N: fp32 sums of C terms on both sides
    p = x.double().softmax(1)
    scale = ((p + 1) * v.double().abs()).sum() / 8
    assert (tangents[1].double() - tangents[0].double()).abs() <= 2 * (300 + 8) * EPS32 * scale


def test_a_compiled_call_takes_the_composition_the_compiler_lowers():
    """Under torch.compile the tensors are being traced: the autograd kernel hands them to PyTorch's composition,
    which the compiler lowers (a fused custom function would not be in its graph)."""
    x, t = _inputs(64, 300, torch.float32)
    xn = x.to("neuron").requires_grad_()
    loss = torch.compile(lambda a, b: F.cross_entropy(a, b), backend="neuron")(xn, t.to("neuron"))
    loss.backward()
    xr = x.double().requires_grad_()
    ref = F.cross_entropy(xr, t)
    ref.backward()
    loss_b, dx_b = _bounds(x, ref.detach(), xr.grad, "mean", torch.float32)
    _check(loss.detach().cpu().double(), ref.detach(), loss_b)
    _check(xn.grad.cpu().double(), xr.grad, dx_b)
