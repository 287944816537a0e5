"""The direct convolution kernels against float64 CPU convolutions of the same (dtype-rounded) values.

Tolerance: the operands are exact in their dtype, products are exact in fp32 and accumulate in fp32 over K
terms, then round once to the output dtype, so |out - ref| <= K * u32 * conv(|x|, |w|) + u_out * |ref|
(K the accumulation length; u32 = 2^-24, u_out the output dtype's unit roundoff)."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight

from torchneuron.kernels.conv import Dim, conv2d_backward_kernel, conv2d_kernel, conv2d_wgrad_kernel, conv_fits, dims_of

U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GRAD_DTYPES = [torch.float32, torch.bfloat16]   # (fp16 takes the same path as bf16: the forward covers it)


def within(out, ref, mag, K, dtype):
    """|out - ref| within K fp32 roundings of the magnitude plus one output rounding."""
    tol = K * 2.0 ** -24 * mag + U[dtype] * ref.abs() + 1e-30
    err = (out.double() - ref).abs()
    assert out.shape == ref.shape and out.dtype == dtype
    assert bool((err <= tol).all()), f"max error {err.max().item():.3g}, worst ratio {(err / tol).max().item():.3g}"


def case(N, C, H, W, O, kh, kw, s, p, d, G, dtype, bias=False):
    """Operands rounded to ``dtype`` (kept as float64 for the references) and the kernel's dims."""
    x = torch.randn(N, C, H, W).to(dtype).double()
    w = torch.randn(O, C // G, kh, kw).to(dtype).double()
    b = torch.randn(O).to(dtype).double() if bias else None
    dims = (dims_of(H, kh, s[0], (p[0], p[0]), d[0]), dims_of(W, kw, s[1], (p[1], p[1]), d[1]))
    return x, w, b, dims


def grad_case(N, O, H, W, p, dims, dtype):
    """An output gradient rounded to ``dtype`` (as float64) and the input gradient kernel's dims for it."""
    OH, OW = dims[0].out, dims[1].out
    gy = torch.randn(N, O, OH, OW).to(dtype).double()
    gdims = tuple(Dim(o, dd.s, dd.d * (dd.k - 1) - pp, i + pp - 1 - (o - 1) * dd.s, dd.k, dd.d, 1)
                  for o, i, dd, pp in ((OH, H, dims[0], p[0]), (OW, W, dims[1], p[1])))
    return gy, gdims


# (N, C, H, W, O, kh, kw, stride, padding, dilation, groups)
CASES = {
    "3x3 pad": (2, 3, 9, 9, 5, 3, 3, (1, 1), (1, 1), (1, 1), 1),
    "1x1": (1, 16, 6, 7, 8, 1, 1, (1, 1), (0, 0), (1, 1), 1),
    "stride 2 odd": (1, 16, 11, 9, 8, 3, 3, (2, 2), (1, 1), (1, 1), 1),
    "stride > kernel": (1, 4, 10, 10, 4, 2, 2, (3, 3), (0, 0), (1, 1), 1),
    "kernel > input": (1, 4, 3, 3, 4, 5, 5, (1, 1), (2, 2), (1, 1), 1),
    "dilation": (1, 8, 9, 9, 6, 3, 3, (1, 1), (2, 2), (2, 2), 1),
    "groups": (2, 8, 8, 8, 12, 3, 3, (1, 1), (1, 1), (1, 1), 4),
    "depthwise": (1, 6, 7, 7, 6, 3, 3, (1, 1), (1, 1), (1, 1), 6),
    "channel tiles": (1, 130, 5, 6, 140, 3, 3, (1, 1), (1, 1), (1, 1), 1),
    "1-D as H=1": (2, 5, 1, 40, 7, 1, 5, (1, 2), (0, 2), (1, 1), 1),
    "non-square": (1, 3, 12, 5, 4, 3, 1, (2, 1), (1, 0), (1, 1), 1),
    "wide rows": (1, 2, 3, 600, 3, 1, 3, (1, 1), (0, 1), (1, 1), 1),
    "two rows per chunk": (2, 8, 7, 50, 4, 3, 3, (1, 1), (1, 1), (1, 1), 1),    # weight gradient: x^T rows reused
    "a row per chunk, dilated": (1, 4, 6, 100, 3, 3, 3, (1, 1), (2, 2), (2, 2), 1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_forward(name, dtype):
    N, C, H, W, O, kh, kw, s, p, d, G = CASES[name]
    x, w, b, dims = case(N, C, H, W, O, kh, kw, s, p, d, G, dtype, bias=name in ("3x3 pad", "groups"))
    out = conv2d_kernel(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), dims=dims, groups=G)
    ref = F.conv2d(x, w, b, s, p, d, G)
    mag = F.conv2d(x.abs(), w.abs(), None if b is None else b.abs(), s, p, d, G)
    within(out, ref, mag, C // G * kh * kw + 1, dtype)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_input_gradient(name, dtype):
    N, C, H, W, O, kh, kw, s, p, d, G = CASES[name]
    x, w, _, dims = case(N, C, H, W, O, kh, kw, s, p, d, G, dtype)
    gy, gdims = grad_case(N, O, H, W, p, dims, dtype)
    if any(g.lo < 0 for g in gdims):   # padding beyond the window: the eager op takes the im2col route
        pytest.skip("padding larger than dilation * (k - 1)")
    out = conv2d_kernel(gy.to(dtype), w.to(dtype), dims=gdims, groups=G, flip=True)
    ref = conv2d_input(x.shape, w, gy, s, p, d, G)
    mag = conv2d_input(x.shape, w.abs(), gy.abs(), s, p, d, G)
    within(out, ref, mag, O // G * kh * kw, dtype)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_weight_gradient(name, dtype):
    N, C, H, W, O, kh, kw, s, p, d, G = CASES[name]
    x, w, _, dims = case(N, C, H, W, O, kh, kw, s, p, d, G, dtype)
    gy = torch.randn(N, O, dims[0].out, dims[1].out).to(dtype).double()
    out = conv2d_wgrad_kernel(x.to(dtype), gy.to(dtype), dims=dims, groups=G, kernel=(kh, kw))
    ref = conv2d_weight(x, w.shape, gy, s, p, d, G)
    mag = conv2d_weight(x.abs(), w.shape, gy.abs(), s, p, d, G)
    within(out, ref, mag, N * dims[0].out * dims[1].out, dtype)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("name", ["3x3 pad", "stride 2 odd", "groups", "two rows per chunk", "channel tiles"])
def test_both_gradients_in_one_launch(name, dtype):
    # conv2d_backward_kernel: the input gradient and the weight gradient of one program, each within its bound
    N, C, H, W, O, kh, kw, s, p, d, G = CASES[name]
    x, w, _, dims = case(N, C, H, W, O, kh, kw, s, p, d, G, dtype)
    gy, gdims = grad_case(N, O, H, W, p, dims, dtype)
    OH, OW = dims[0].out, dims[1].out
    gx, gw = conv2d_backward_kernel(x.to(dtype), gy.to(dtype), w.to(dtype), dims=dims, gdims=gdims, groups=G)
    within(gx, conv2d_input(x.shape, w, gy, s, p, d, G), conv2d_input(x.shape, w.abs(), gy.abs(), s, p, d, G),
           O // G * kh * kw, dtype)
    within(gw, conv2d_weight(x, w.shape, gy, s, p, d, G), conv2d_weight(x.abs(), w.shape, gy.abs(), s, p, d, G),
           N * OH * OW, dtype)


def test_weight_gradient_keeps_non_finite_values_in_their_windows():
    # the gradient's shifted copies (one transpose per chunk moved down kw partitions, the last column's NaN next to
    # the row end they wrap over) and reused x^T rows must carry a NaN / inf to exactly the weight entries whose
    # windows pair it with the other operand, as on the CPU (an inf in x's first or last columns also meets the
    # zeros the spread gradient holds there: inf * 0 makes NaNs the CPU does not have, so it is placed inside)
    x, gy = torch.randn(1, 4, 7, 50), torch.randn(1, 3, 7, 50)
    x[0, 1, 3, 20], gy[0, 2, 5, 49] = float("inf"), float("nan")
    dims = (dims_of(7, 3, 1, (1, 1), 1), dims_of(50, 3, 1, (1, 1), 1))
    out, ref = conv2d_wgrad_kernel(x, gy, dims=dims, kernel=(3, 3)), conv2d_weight(x, (3, 4, 3, 3), gy, padding=1)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())


def test_nan_and_inf_stay_in_their_positions():
    # a NaN / inf in one input position reaches exactly the outputs whose windows read it, as on the CPU
    x = torch.randn(1, 4, 8, 8)
    x[0, 1, 2, 3], x[0, 2, 6, 6] = float("nan"), float("inf")
    w = torch.rand(3, 4, 3, 3) + 0.1
    dims = (dims_of(8, 3, 1, (1, 1), 1),) * 2
    out, ref = conv2d_kernel(x, w, dims=dims), F.conv2d(x, w, padding=1)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())


def test_fits_refuses_what_does_not_fit_sbuf():
    dims = (dims_of(4, 7, 1, (3, 3), 1),) * 2
    assert conv_fits(64, (64, 64, 7, 7), 1, dims, False, 4)
    assert not conv_fits(4096, (4096, 4096, 7, 7), 1, dims, False, 4)     # weights of one co tile > budget
    assert not conv_fits(1024, (64, 1024, 7, 7), 1, dims, False, 4, wgrad=True)   # dW row > budget
