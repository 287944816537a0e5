"""``F.rms_norm`` in eager mode: one launch of the norm kernels forward and one backward (``_fused_rms_norm`` and
its backward, as PyTorch routes it on CUDA), results within the rounding bounds of a float64 reference computed
on the CPU from the same rounded inputs, and the CPU's results and errors for what the kernels do not take."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import assert_raises_like_cpu, to_n
from torchneuron.runtime import profiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps


def _within(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, terms: int, rounded: int = 0) -> None:
    """``got`` against the float64 ``ref``: fp32 sums of ``terms`` values (a random-walk bound of 8 sqrt(terms)
    eps32 times the summed magnitudes ``mag``) of intermediates ``rounded`` times to ``got``'s dtype (half its eps
    each, relative to ``mag``), the result rounded once (its eps relative to ``ref``, its subnormal spacing below
    its smallest normal)."""
    fi = torch.finfo(got.dtype)
    tol = (8 * terms ** 0.5 * EPS32 + rounded * fi.eps / 2) * mag + fi.eps * ref.abs() + fi.tiny * fi.eps
    err = (got.detach().cpu().double() - ref).abs()
    assert bool((err <= tol).all()), f"error exceeds the bound by up to {float((err - tol).max()):.3g}"


def _reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float, k: int):
    """float64 (y, dx, dw) of RMS norm over the last ``k`` dims, and the magnitudes their rounding errors scale with."""
    x, w, dy = x.double().requires_grad_(), w.double().requires_grad_(), dy.double()
    dims = tuple(range(x.dim() - k, x.dim()))
    y = F.rms_norm(x, x.shape[x.dim() - k:], w, eps)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    with torch.no_grad():
        rstd = (x.pow(2).mean(dims, keepdim=True) + eps).rsqrt()
        xh, g = (x * rstd).abs(), (dy * w).abs()
        mag_dx = rstd * (g + xh * (g * xh).mean(dims, keepdim=True))
        mag_dw = (dy.abs() * xh).sum(tuple(range(x.dim() - k)))
        mag_y = xh * w.abs()
    return y.detach(), dx, dw, (mag_y, mag_dx, mag_dw)


def _launches(fn):
    with profiler.record() as recs:
        out = fn()
    return out, [r.name for r in recs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k,eps", [((300, 513), 1, 1e-6), ((2, 3, 40), 1, None), ((4, 6, 20), 2, 1e-5),
                                         ((130, 1801), 1, None), ((20, 4096), 1, None), ((3, 5003), 1, 1e-6)])
def test_forward_and_backward_one_launch_each(shape, k, eps, dtype, strict):
    # rows up to 4096 (bf16; fp32 ~2900) take the backward's one-pass path, 5003 its multi-pass one
    torch.manual_seed(0)
    norm_shape = shape[len(shape) - k:]
    x = (torch.randn(shape) * 2 + 1).to(dtype)
    w, dy = torch.randn(norm_shape).to(dtype), torch.randn(shape).to(dtype)
    xn, wn = to_n(x).requires_grad_(), to_n(w).requires_grad_()
    y, names = _launches(lambda: F.rms_norm(xn, norm_shape, wn, eps))
    assert names == ["layer_norm_kernel"] and y.dtype == dtype and y.shape == x.shape
    _, names = _launches(lambda: y.backward(to_n(dy)))
    assert names == ["layer_norm_bwd_kernel"]
    # no eps given: PyTorch adds fp32's epsilon (the statistics' dtype) for every input dtype
    ref_y, ref_dx, ref_dw, (mag_y, mag_dx, mag_dw) = _reference(x, w, dy, EPS32 if eps is None else eps, k)
    D, N = w.numel(), x.numel() // w.numel()
    # the CPU rounds x * rstd and then its product with w in half dtypes; the kernel rounds x * w * rstd once.
    # The backward rounds g = dy * w (dx), xh = x * rstd and dy * xh (dw) to the input dtype, as the CPU does
    _within(y, ref_y, mag_y, D)
    _within(xn.grad, ref_dx, mag_dx, D, rounded=1)
    _within(wn.grad, ref_dw, mag_dw, N + D, rounded=2)
    assert xn.grad.dtype == dtype and wn.grad.dtype == dtype


def test_matches_cpu_without_weight_and_on_strided_input(strict):
    torch.manual_seed(0)
    x = torch.randn(64, 96)
    for xc in (x, x.t()):   # a transposed view is made dense first
        xn = to_n(xc).requires_grad_()
        xr = xc.clone().requires_grad_()
        y, yr = F.rms_norm(xn, (xc.shape[-1],)), F.rms_norm(xr, (xc.shape[-1],))
        g = torch.randn(yr.shape)
        y.backward(to_n(g))
        yr.backward(g)
        torch.testing.assert_close(y.cpu(), yr, rtol=8 * 96 ** 0.5 * EPS32, atol=1e-6)
        torch.testing.assert_close(xn.grad.cpu(), xr.grad, rtol=8 * 96 ** 0.5 * EPS32, atol=1e-6)


def test_double_backward_matches_cpu(strict):
    # create_graph: the fused op's formula differentiates through the composite, as on the CPU
    torch.manual_seed(0)
    x0, w0 = torch.randn(6, 8), torch.randn(8)
    res = []
    for conv in (torch.clone, to_n):
        x, w = conv(x0).requires_grad_(), conv(w0).requires_grad_()
        y = F.rms_norm(x, (8,), w)
        gx, gw = torch.autograd.grad((y * y.detach()).sum(), (x, w), create_graph=True)
        res.append([t.detach().cpu() for t in (gx, gw, *torch.autograd.grad((gx * gx).sum() + gw.sum(), (x, w)))])
    for got, want in zip(res[1], res[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_forward_mode_ad_matches_cpu():
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    x, t = torch.randn(3, 5), torch.randn(3, 5)
    out = []
    for conv in (lambda v: v, to_n):
        with fwAD.dual_level():
            y = F.rms_norm(fwAD.make_dual(conv(x), conv(t)), (5,))
            out.append(fwAD.unpack_dual(y).tangent.cpu())
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["weight_shape", "normalized_shape", "empty_shape", "integer"])
def test_bad_input_raises_like_cpu(case):
    x, w = torch.randn(3, 4), torch.randn(4)
    calls = {
        "weight_shape": lambda c: F.rms_norm(c(x), (4,), c(torch.randn(5))),
        "normalized_shape": lambda c: F.rms_norm(c(x), (3, 4), c(w)),
        "empty_shape": lambda c: F.rms_norm(c(x), (), None),
        "integer": lambda c: F.rms_norm(c(torch.ones(3, 4, dtype=torch.int64)), (4,)),
    }
    assert_raises_like_cpu(calls[case])


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_mixed_dtypes_take_the_decomposition(x_dtype, w_dtype):
    # the kernel wants the weight in the input's dtype: other pairs decompose exactly as on the CPU
    torch.manual_seed(0)
    x, w = torch.randn(5, 16).to(x_dtype), torch.randn(16).to(w_dtype)
    y, want = F.rms_norm(to_n(x), (16,), to_n(w)), F.rms_norm(x, (16,), w)
    assert y.dtype == want.dtype
    torch.testing.assert_close(y.cpu(), want, rtol=torch.finfo(want.dtype).eps * 2, atol=1e-6)


def test_empty_input_matches_cpu(strict):
    x, w = to_n(torch.randn(0, 4)).requires_grad_(), to_n(torch.ones(4)).requires_grad_()
    y = F.rms_norm(x, (4,), w)
    assert y.shape == (0, 4) and y.device.type == "neuron"
    y.sum().backward()
    assert x.grad.shape == (0, 4) and bool((w.grad.cpu() == 0).all())


@pytest.mark.parametrize("shape,k", [((5, 7), 1), ((7,), 1), ((2, 3, 4), 2)])
def test_float64_runs_and_differentiates_like_cpu(shape, k):
    # the forward takes the counted CPU fallback; the CPU has no kernel of the fused backward, which is composed
    torch.manual_seed(0)
    x, g = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    w = torch.randn(shape[-k:], dtype=torch.float64)
    res = []
    for conv in (torch.clone, to_n):
        xd, wd = conv(x).requires_grad_(), conv(w).requires_grad_()
        y = F.rms_norm(xd, shape[-k:], wd)
        y.backward(conv(g))
        res.append([t.detach().cpu() for t in (y, xd.grad, wd.grad)])
    for got, want in zip(*res[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
