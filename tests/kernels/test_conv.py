"""The direct convolution kernels against float64 CPU convolutions of the same (dtype-rounded) values.

Tolerance: the operands are exact in their dtype, products are exact in fp32 and accumulate in fp32 over K
terms, then round once to the output dtype, so |out - ref| <= K * u32 * conv(|x|, |w|) + u_out * |ref|
(K the accumulation length; u32 = 2^-24, u_out the output dtype's unit roundoff)."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight

import torchneuron
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
    "stride 3 dilated": (1, 4, 11, 13, 4, 3, 3, (3, 3), (1, 1), (2, 2), 1),      # weight gradient: 3 tap groups
    "window wider than a chunk's columns": (1, 2, 2, 100, 3, 1, 3, (1, 1), (0, 0), (1, 40), 1),   # a group split
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


# transposed convolutions (the eager forward runs them as ``flip``): (N, C, H, W, O/G, k, stride, padding,
# output_padding, dilation, groups)
TRANSPOSED = {
    "4x4 stride 2": (2, 16, 5, 6, 8, 4, 2, 1, 0, 1, 1),
    "3x3 stride 2 output_padding": (1, 8, 4, 5, 6, 3, 2, 1, 1, 1, 1),
    "groups dilated": (2, 8, 5, 4, 3, 3, 1, 2, 1, 2, 2),
    "channel tiles": (1, 130, 3, 4, 140, 3, 2, 0, 0, 1, 1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(TRANSPOSED))
def test_transposed_forward_with_bias(name, dtype):
    # every window offset's products and the bias summed in fp32 (PSUM, then the eviction), rounded once
    N, C, H, W, OG, k, s, p, op, d, G = TRANSPOSED[name]
    x = torch.randn(N, C, H, W).to(dtype).double()
    w = torch.randn(C, OG, k, k).to(dtype).double()
    b = torch.randn(OG * G).to(dtype).double()
    ref = F.conv_transpose2d(x, w, b, s, p, op, G, d)
    mag = F.conv_transpose2d(x.abs(), w.abs(), b.abs(), s, p, op, G, d)
    dims = tuple(Dim(i, s, d * (k - 1) - p, o + p - 1 - (i - 1) * s, k, d, 1) for i, o in ((H, ref.shape[2]),
                                                                                         (W, ref.shape[3])))
    out = conv2d_kernel(x.to(dtype), w.to(dtype), b.to(dtype), dims=dims, groups=G, flip=True)
    within(out, ref, mag, C // G * k * k + 1, dtype)


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
    # the gradient's shifted copies (one transpose per chunk moved down kw * d * rows partitions, the last column's
    # NaN at the end of the range they cover) and reused x^T rows must carry a NaN / inf to exactly the weight
    # entries whose windows pair it with the other operand, as on the CPU; an inf in x's first or last column
    # reaches only the window offsets that read that column
    x, gy = torch.randn(1, 4, 7, 50), torch.randn(1, 3, 7, 50)
    x[0, 1, 3, 20], gy[0, 2, 5, 49] = float("inf"), float("nan")
    x[0, 3, 2, 0], x[0, 0, 4, 49] = float("inf"), float("-inf")
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


# ---- non-finite values at the edges, through the eager op, against the CPU ----------------------------------
# An inf or NaN in x's first or last columns (rows, padding-adjacent positions) reaches exactly the outputs and
# weight-gradient entries whose sums read it: the weight gradient once paired every padded input column with a
# zero of the spread output gradient, and 0 * inf = NaN put NaNs in window offsets that never read the column.
# Likewise an inf or NaN weight reaches only the input-gradient elements whose sums have a term with it (the
# input gradient's kernel once multiplied it by the zeros around and inside the stride-spread output gradient).
# The CPU's sums (float64, and for x its own kernels in the test's dtype) are the reference for where NaN and
# inf lie; elsewhere a result differs from the float64 sum by at most K * eps(dtype) times the float64 sum of the
# absolute terms (K the length of its contraction: the products of dtype operands and at most K - 1 additions
# are each rounded at most once to a precision no coarser than the dtype's).
EDGE_CASES = {   # (spatial dims, size, kernel, stride, padding, dilation, groups)
    "2-D 3x3 pad 1": (2, 9, 3, 1, 1, 1, 1),
    "2-D 3x3 valid": (2, 9, 3, 1, 0, 1, 1),
    "2-D stride 2 pad 1": (2, 9, 3, 2, 1, 1, 1),
    "2-D stride 2 valid": (2, 10, 3, 2, 0, 1, 1),
    "2-D 1x1 stride 2": (2, 9, 1, 2, 0, 1, 1),
    "2-D dilation 2": (2, 9, 3, 1, 2, 2, 1),
    "2-D groups 2": (2, 8, 3, 1, 1, 1, 2),
    "1-D pad 1": (1, 20, 3, 1, 1, 1, 1),
    "1-D stride 2 dilation 2": (1, 21, 3, 2, 1, 2, 1),
    "3-D pad 1": (3, 5, 3, 1, 1, 1, 1),
}
EDGES = ["first column", "second column", "last column", "first row", "last row"]
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _edge_operands(nd, size, k, s, p, d, G, dtype, edge, target):
    """x, w and an output gradient in ``dtype`` with non-finite values at ``edge`` of ``target`` ("x", "w" or "gy"):
    +inf along it in [0, 1], NaN in [1, 0], -inf at its middle element in the last channel of the last image (or
    output channel, for w)."""
    C, O = 4, 6
    x = torch.randn(2, C, *[size] * nd).to(dtype)
    w = torch.randn(O, C // G, *[k] * nd).to(dtype)
    out = (size + 2 * p - d * (k - 1) - 1) // s + 1
    gy = torch.randn(2, O, *[out] * nd).to(dtype)
    t = {"x": x, "w": w, "gy": gy}[target]
    n = t.shape[-1]
    if edge == "second column" and n < 2:
        pytest.skip("a 1-wide window has no second column")
    if edge.endswith("row"):
        if nd == 1:
            pytest.skip("a 1-D convolution has no rows")
        index = (..., 0 if edge == "first row" else n - 1, slice(None))
    else:
        index = (..., {"first column": 0, "second column": 1, "last column": n - 1}[edge])
    t[0, 1][index], t[1, 0][index] = float("inf"), float("nan")
    line = t[-1, -1][index]
    line[tuple(n // 2 for n in line.shape)] = float("-inf")
    return x, w, gy


def _conv_and_grads(x, w, gy, s, p, d, G, device):
    x = x.detach().to(device).requires_grad_()
    w = w.detach().to(device).requires_grad_()
    y = CONV[x.dim() - 2](x, w, None, s, p, d, G)
    y.backward(gy.to(device))
    return [t.detach().cpu() for t in (y, x.grad, w.grad)]


def _same_non_finite(a, b, what):
    for name, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        diff = f(a) != f(b)
        assert not diff.any(), f"{what}: {name} differs at {diff.nonzero()[:4].tolist()} ({int(diff.sum())} places)"


@pytest.mark.parametrize("target", ["x", "w", "gy"])
@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_non_finite_values_at_the_edges_match_the_cpu(name, dtype, edge, target):
    nd, size, k, s, p, d, G = EDGE_CASES[name]
    x, w, gy = _edge_operands(nd, size, k, s, p, d, G, dtype, edge, target)
    strict = torchneuron.is_strict()
    torchneuron.set_strict(True)        # every op on the device: no CPU fallback computes a result
    try:
        got = _conv_and_grads(x, w, gy, s, p, d, G, "neuron")
    finally:
        torchneuron.set_strict(strict)
    exact = _conv_and_grads(x.double(), w.double(), gy.double(), s, p, d, G, "cpu")
    terms = _conv_and_grads(x.double().abs(), w.double().abs(), gy.double().abs(), s, p, d, G, "cpu")
    # for x the CPU's kernels in the test's dtype agree with float64 on which sums meet a non-finite value; an inf or
    # NaN of the output gradient (weight) meets the padding's zeros in the weight gradient's (output's) sums, 0 * inf
    # = NaN, in float64 and on the device, but not in the CPU's fp32 kernel for batches > 1 (oneDNN), which leaves
    # padding out of its sums: for gy and w the float64 sums are the reference
    cpu = _conv_and_grads(x, w, gy, s, p, d, G, "cpu") if target == "x" else exact
    K = [w[0].numel(), w.shape[0] // G * w[0, 0].numel(), gy.shape[0] * gy[0, 0].numel()]
    for what, g, c, e, t, kk in zip(("output", "input gradient", "weight gradient"), got, cpu, exact, terms, K):
        assert g.dtype == dtype and g.shape == e.shape
        _same_non_finite(g, c, what)
        _same_non_finite(g, e.to(dtype), what)
        fin = e.isfinite() & e.to(dtype).isfinite()
        err = (g.double() - e).abs()[fin]
        bound = kk * torch.finfo(dtype).eps * t[fin]
        assert bool((err <= bound).all()), f"{what}: error {(err / bound).max().item():.3g} x its bound"


@pytest.mark.parametrize("edge", ["first", "last"])
@pytest.mark.parametrize("name", ["3x3 pad", "stride 2 odd", "stride > kernel", "kernel > input", "dilation", "groups",
                                  "1-D as H=1", "wide rows", "two rows per chunk", "a row per chunk, dilated",
                                  "stride 3 dilated", "window wider than a chunk's columns"])
def test_weight_gradient_of_non_finite_edge_columns(name, edge):
    # the kernel alone over its chunkings (rows per chunk, columns split, several tap groups): inf / NaN in x's first
    # or last columns (and next to them) reach exactly the weight entries whose windows read them, as in float64
    N, C, H, W, O, kh, kw, s, p, d, G = CASES[name]
    x, w, _, dims = case(N, C, H, W, O, kh, kw, s, p, d, G, torch.float32)
    cols = [0, 1] if edge == "first" else [W - 1, W - 2]
    x[0, 0, :, cols[0]], x[0, C - 1, H // 2, cols[1]] = float("inf"), float("nan")
    gy = torch.randn(N, O, dims[0].out, dims[1].out).double()
    out = conv2d_wgrad_kernel(x.float(), gy.float(), dims=dims, groups=G, kernel=(kh, kw))
    ref = conv2d_weight(x, w.shape, gy, s, p, d, G)
    _same_non_finite(out, ref.float(), "weight gradient")
    fin = ref.isfinite()
    within(torch.where(fin, out, 0), torch.where(fin, ref, 0), conv2d_weight(x.abs().nan_to_num(0, 0), w.shape,
           gy.abs(), s, p, d, G), N * dims[0].out * dims[1].out, torch.float32)


@pytest.mark.parametrize("name", list(CASES))
def test_input_gradient_of_non_finite_weights(name):
    # the input-gradient kernel over its chunkings (a first offset with every output; none, under stride > kernel,
    # where the sums start from zeros): an inf / NaN weight reaches exactly the input-gradient elements whose sums
    # have a term with it, as in float64, not those where it would only meet padding or a zero inserted by the stride
    N, C, H, W, O, kh, kw, s, p, d, G = CASES[name]
    x, w, _, dims = case(N, C, H, W, O, kh, kw, s, p, d, G, torch.float32)
    gy, gdims = grad_case(N, O, H, W, p, dims, torch.float32)
    if any(g.lo < 0 for g in gdims):   # padding beyond the window: the eager op takes the im2col route
        pytest.skip("padding larger than dilation * (k - 1)")
    w[0, 0, 0, 0], w[O - 1, C // G - 1, kh - 1, kw - 1] = float("inf"), float("nan")
    out = conv2d_kernel(gy.float(), w.float(), dims=gdims, groups=G, flip=True)
    ref = conv2d_input(x.shape, w, gy, s, p, d, G)
    _same_non_finite(out, ref.float(), "input gradient")
    fin = ref.isfinite()
    within(torch.where(fin, out, 0), torch.where(fin, ref, 0), conv2d_input(x.shape, w.abs().nan_to_num(0, 0),
           gy.abs(), s, p, d, G), O // G * kh * kw, torch.float32)
