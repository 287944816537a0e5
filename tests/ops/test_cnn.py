"""Convolution, pooling, batch/group norm and dropout run on the device (strict mode) and match the CPU."""
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron
from tests.ops.bounds import U, assert_within, check_linear, gamma, linear_bounds, norm_bounds, var_bounds
from tests.ops.conftest import to_n

torch.manual_seed(0)
X = torch.randn(2, 4, 9, 10)


def _check_norm(fn, inputs, bounds):
    """fn(*inputs) (a normalization: x and optional weight, bias) on CPU and on neuron: the output and the gradients
    of every float input each within ``bounds(g)`` (``norm_bounds``' four, for the output gradient g) of the
    float64 result."""
    runs = {}
    for side, move in (("cpu", lambda t: t.clone()), ("device", to_n), ("exact", lambda t: t.double())):
        leaves = [None if t is None else move(t).detach().requires_grad_() for t in inputs]
        runs[side] = (fn(*leaves), leaves)
    want = runs["cpu"][0]
    assert runs["device"][0].dtype == want.dtype and runs["device"][0].shape == want.shape
    g = torch.randn(want.shape)
    for side, (out, _) in runs.items():
        out.backward(g.to(out.device, out.dtype))
    b_out, *b_grads = bounds(g)
    exact, exact_leaves = runs["exact"]
    for side in ("device", "cpu"):
        out, leaves = runs[side]
        assert_within(f"{side} output", out, exact.detach(), b_out)
        for i, (leaf, ref, bound) in enumerate(zip(leaves, exact_leaves, b_grads)):
            if leaf is not None:
                assert_within(f"{side} gradient {i}", leaf.grad, ref.grad, bound.reshape(ref.shape))


def _check_conv(fn, *inputs):
    """An fp32 convolution on CPU and on neuron: output and input gradients within the bound of two fp32
    accumulations (each side K * 2**-24 relative to the sum of the absolute terms, K the longest contraction:
    at most the elements of the input, weight or output), the sums of terms computed in float64 from the
    absolute inputs and output gradient (a convolution is linear in each operand)."""
    cpu = [t.clone().requires_grad_() for t in inputs]
    dev = [to_n(t).detach().requires_grad_() for t in inputs]
    want, got = fn(*cpu), fn(*dev)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(to_n(g))
    absolute = [t.double().abs().requires_grad_() for t in inputs]
    terms = fn(*absolute)
    terms.backward(g.double().abs())
    k = max(max(t.numel() for t in inputs), want.numel())
    assert [d.grad is None for d in dev] == [c.grad is None for c in cpu]     # an unused input has no gradient
    pairs = [(got, want, terms)] + [(d.grad, c.grad, a.grad) for d, c, a in zip(dev, cpu, absolute)
                                    if c.grad is not None]
    for i, (a, b, t) in enumerate(pairs):
        assert a.shape == b.shape and a.dtype == b.dtype
        err = (a.detach().cpu().double() - b.detach().double()).abs()
        bound = 2 * k * 2.0**-24 * t.detach()
        assert (err <= bound).all(), f"result {i}: error {err.max():.3e}, {(err / bound).max():.2f}x its bound"


CONVS = {
    "groups2_stride2_pad1_dil2": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, dilation=2, groups=2),
                                  (2, 4, 9, 10), (6, 2, 3, 3)),
    "plain": (lambda x, w, b: F.conv2d(x, w), (2, 3, 7, 6), (5, 3, 3, 3)),
    "pad1_bias": (lambda x, w, b: F.conv2d(x, w, b, padding=1), (1, 3, 8, 8), (4, 3, 3, 3)),
    "asymmetric": (lambda x, w, b: F.conv2d(x, w, b, stride=(1, 2), padding=(2, 0), dilation=(1, 2)),
                   (3, 2, 6, 11), (3, 2, 2, 3)),
    "pointwise_1x1": (lambda x, w, b: F.conv2d(x, w, b), (2, 5, 4, 3), (7, 5, 1, 1)),
    "depthwise": (lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=4), (2, 4, 5, 5), (4, 1, 3, 3)),
    "kernel_eq_input": (lambda x, w, b: F.conv2d(x, w, b), (2, 3, 4, 4), (2, 3, 4, 4)),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1), (2, 3, 11), (5, 3, 4)),
    "conv3d_groups_dil": (lambda x, w, b: F.conv3d(x, w, b, stride=(1, 2, 1), padding=1, dilation=(1, 1, 2), groups=2),
                          (2, 4, 4, 5, 6), (6, 2, 3, 2, 3)),
    "conv3d_1x1x1": (lambda x, w, b: F.conv3d(x, w, b), (1, 3, 2, 3, 4), (2, 3, 1, 1, 1)),
    "convT1d": (lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, padding=1, output_padding=1, groups=2,
                                                   dilation=2), (2, 4, 7), (4, 3, 3), 6),
    "convT2d_overlap": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(2, 3), padding=(1, 0),
                                                           output_padding=(1, 2), dilation=(1, 2)),
                        (2, 4, 5, 6), (4, 3, 3, 2), 3),
    "convT2d_disjoint": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=3), (1, 2, 4, 3), (2, 3, 2, 3), 3),
    "convT2d_plain": (lambda x, w, b: F.conv_transpose2d(x, w, b), (2, 3, 4, 5), (3, 2, 3, 3), 2),
    "convT3d": (lambda x, w, b: F.conv_transpose3d(x, w, b, stride=2, padding=1, output_padding=1, groups=2),
                (2, 4, 3, 4, 3), (4, 2, 3, 3, 2), 4),
    # output_padding >= stride is allowed when below the dilation
    "convT2d_outpad_dilation": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=1, output_padding=1, dilation=2),
                                (1, 2, 4, 4), (2, 2, 2, 2), 2),
}


@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_forward_backward(name, strict):
    fn, xs, ws, *bias_size = CONVS[name]       # (a transposed convolution's bias size is given)
    _check_conv(fn, torch.randn(xs), torch.randn(ws), torch.randn(bias_size[0] if bias_size else ws[0]))


def test_conv_channels_last_3d(strict):
    x = torch.randn(2, 3, 4, 5, 3).contiguous(memory_format=torch.channels_last_3d)
    _check_conv(lambda x, w: F.conv3d(x, w, padding=1), x, torch.randn(4, 3, 2, 3, 3))
    _check_conv(lambda x, w: F.conv_transpose3d(x, w, stride=2), x, torch.randn(3, 2, 2, 2, 2))


def _check_conv_bf16(fn, x, w, rounds_once=("output", "dx", "dw")):
    """A 2-byte (bf16 or fp16) convolution fn(x, w) on CPU and on neuron, output and both gradients, against
    float64 of the same values. The device multiplies 2-byte values exactly in fp32, sums in fp32 and rounds once:
    within one rounding of the result to the dtype plus the fp32 sum's bound (k - 1 additions of the k terms of
    the element: the non-zero entries of the op's Jacobian in that operand). The CPU's 2-byte kernels may round
    each product and partial sum to the dtype: within that many roundings of the sum of absolute terms; so is
    the device's result where it is not named in ``rounds_once``."""
    dtype = x.dtype
    assert dtype in (torch.bfloat16, torch.float16) and w.dtype == dtype
    cpu = [t.clone().requires_grad_() for t in (x, w)]
    dev = [to_n(t).detach().requires_grad_() for t in (x, w)]
    want, got = fn(*cpu), fn(*dev)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    g = torch.randn(want.shape).to(dtype)
    want.backward(g)
    got.backward(to_n(g))
    x64, w64 = x.double(), w.double()
    # linear in each operand: the x-Jacobian gives the output's and dx's terms, the w-Jacobian dw's
    (exact, dx), (t_out, t_dx) = linear_bounds(lambda t: fn(t, w64), x, g, torch.float32)
    (_, dw), (_, t_dw) = linear_bounds(lambda t: fn(x64, t), w, g, torch.float32)
    (_, _), (c_out, c_dx) = linear_bounds(lambda t: fn(t, w64), x, g, dtype, roundings=1)
    (_, _), (_, c_dw) = linear_bounds(lambda t: fn(x64, t), w, g, dtype, roundings=1)
    u = U[dtype]
    errors = []
    for name, a, b, ref, dev_bound, cpu_bound in (("output", got, want, exact, t_out, c_out),
                                                  ("dx", dev[0].grad, cpu[0].grad, dx, t_dx, c_dx),
                                                  ("dw", dev[1].grad, cpu[1].grad, dw, t_dw, c_dw)):
        assert_within(f"cpu {name}", b, ref, cpu_bound)
        try:
            assert_within(f"device {name}", a, ref, u * (ref.abs() + dev_bound) + dev_bound
                          if name in rounds_once else cpu_bound)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "; ".join(errors)


def _conv_transpose_bf16_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 4, 5, generator=g).bfloat16(), torch.randn(3, 2, 3, 3, generator=g).bfloat16()


def test_conv_transpose_bf16_output_rounds_once_like_cpu(strict):
    # the window offsets' products are summed in fp32 and rounded once (they were rounded per offset and added
    # in bf16: up to 75x this bound, errors of 0.04 at magnitude 0.42)
    _check_conv_bf16(lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1), *_conv_transpose_bf16_inputs())


# 2-byte transposed convolutions (and a plain one whose input gradient takes col2im): (fn, x shape, w shape).
# 1-D and 2-D ones with padding <= dilation * (k - 1) run the direct kernel; 3-D ones and a larger padding
# take the matmul + col2im route, which sums the window offsets in fp32 too.
CONVS_2BYTE = {
    "convT1d": (lambda x, w: F.conv_transpose1d(x, w, stride=2, padding=1, output_padding=1, groups=2, dilation=2),
                (2, 4, 9), (4, 3, 3)),
    "convT2d_overlap": (lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1), (2, 3, 4, 5), (3, 2, 3, 3)),
    "convT2d_4x4_stride2": (lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1), (1, 6, 5, 4), (6, 5, 4, 4)),
    "convT2d_large_padding": (lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=3), (2, 3, 6, 5),
                              (3, 4, 3, 3)),
    "convT3d": (lambda x, w: F.conv_transpose3d(x, w, stride=2, padding=1, output_padding=1, groups=2),
                (2, 4, 3, 4, 3), (4, 2, 3, 3, 2)),
    "conv3d": (lambda x, w: F.conv3d(x, w, stride=2, padding=1), (1, 3, 5, 6, 5), (4, 3, 3, 3, 3)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(CONVS_2BYTE))
def test_conv_transpose_2byte_rounds_once(name, dtype, strict):
    fn, xs, ws = CONVS_2BYTE[name]
    g = torch.Generator().manual_seed(1)
    _check_conv_bf16(fn, torch.randn(xs, generator=g).to(dtype), torch.randn(ws, generator=g).to(dtype))


def test_conv_transpose_errors_match_cpu():
    x = torch.randn(1, 4, 5, 5)
    cases = [(lambda t: F.conv_transpose2d(t, torch.randn(4, 2, 3, 3, device=t.device), stride=2,
                                           output_padding=2), RuntimeError),       # output_padding >= stride
             (lambda t: F.conv_transpose2d(t, torch.randn(3, 2, 3, 3, device=t.device)), RuntimeError),  # channels
             (lambda t: F.conv_transpose3d(t.unsqueeze(2), torch.randn(4, 2, 1, 3, 3, device=t.device), padding=4),
              RuntimeError)]                                                       # output size below 1
    for fn, exc in cases:
        with pytest.raises(exc):
            fn(x)
        with pytest.raises(exc):
            fn(to_n(x))


def test_conv_transpose_float64_takes_the_cpu_route():
    x, w = torch.randn(1, 2, 4, 4, dtype=torch.float64), torch.randn(2, 3, 3, 3, dtype=torch.float64)
    assert torch.equal(F.conv_transpose2d(to_n(x), to_n(w), stride=2).cpu(), F.conv_transpose2d(x, w, stride=2))


def test_conv_bf16(strict):
    # the device sums bf16 products in fp32 and rounds once (the CPU's bf16 kernel may round partial sums too)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 6, 6, generator=g).bfloat16(), torch.randn(4, 3, 3, 3, generator=g).bfloat16()
    _check_conv_bf16(lambda x, w: F.conv2d(x, w, padding=1), x, w)


def test_conv_errors_match_cpu():
    cases = [(lambda t: F.conv2d(t, torch.randn(4, 3, 3, 3, device=t.device)), RuntimeError),  # 4 vs 3 channels
             (lambda t: F.conv2d(t, torch.randn(4, 4, 20, 3, device=t.device)), RuntimeError),  # kernel > input
             (lambda t: F.conv2d(t, torch.randn(4, 2, 3, 3, device=t.device), groups=3), RuntimeError)]
    for fn, exc in cases:
        with pytest.raises(exc):
            fn(X)
        with pytest.raises(exc):
            fn(to_n(X))


def test_conv_float64_takes_the_cpu_route():
    x, w = torch.randn(1, 2, 5, 5, dtype=torch.float64), torch.randn(3, 2, 3, 3, dtype=torch.float64)
    assert torch.equal(F.conv2d(to_n(x), to_n(w)).cpu(), F.conv2d(x, w))          # the same CPU kernel


def test_direct_conv_launches(strict):
    # a plain 1-D/2-D convolution is one launch forward; backward one launch for both gradients plus the bias sum
    # (a contraction C*KH*KW of more than 128: smaller ones, a stem's, take im2col's single matmul forward)
    from torchneuron.runtime import profiler
    for fn, xs, ws in ((lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), (2, 16, 9, 8), (4, 16, 3, 3)),
                       (lambda x, w, b: F.conv1d(x, w, b, padding=2, dilation=2), (2, 48, 11), (4, 48, 3))):
        x, w, b = to_n(torch.randn(xs)).requires_grad_(), to_n(torch.randn(ws)).requires_grad_(), to_n(torch.randn(4))
        with profiler.record() as fwd:
            y = fn(x, w, b)
        assert [r.name for r in fwd] == ["conv2d_kernel"]
        with profiler.record() as bwd:
            y.backward(torch.ones_like(y))
        names = [r.name for r in bwd]
        assert names.count("conv2d_backward_kernel") == 1 and "conv2d_kernel" not in names \
            and "conv2d_wgrad_kernel" not in names


def test_conv_padding_beyond_the_window_and_empty_batch(strict):
    # padding > dilation * (k - 1): the input gradient takes the im2col route; an empty batch: empty results
    _check_conv(lambda x, w, b: F.conv2d(x, w, b, padding=2), torch.randn(1, 2, 4, 4), torch.randn(3, 2, 1, 1),
                torch.randn(3))
    x, w = torch.randn(0, 2, 5, 5), torch.randn(3, 2, 3, 3)
    got = F.conv2d(to_n(x), to_n(w), padding=1)
    assert got.shape == (0, 3, 5, 5) and got.device.type == "neuron"


POOLS = {
    "max2": lambda t: F.max_pool2d(t, 2),
    "max3_s1_p1": lambda t: F.max_pool2d(t, 3, 1, 1),
    "max_ceil_dil": lambda t: F.max_pool2d(t, 3, 2, 1, dilation=2, ceil_mode=True),
    "max_rect": lambda t: F.max_pool2d(t, (2, 3), (1, 2)),
    "max_unbatched": lambda t: F.max_pool2d(t[0], 2),
    "avg2": lambda t: F.avg_pool2d(t, 2),
    "avg_ceil_nopad": lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    "avg_ceil_pad": lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True),
    "avg_divisor": lambda t: F.avg_pool2d(t, (3, 2), 2, 1, divisor_override=5),
    "avg_unbatched": lambda t: F.avg_pool2d(t[0], 3, 1),
    "adaptive_4x3": lambda t: F.adaptive_avg_pool2d(t, (4, 3)),
    "adaptive_7": lambda t: F.adaptive_avg_pool2d(t, 7),
    "adaptive_1": lambda t: F.adaptive_avg_pool2d(t, 1),
    "avg1d": lambda t: F.avg_pool1d(t[0], 3, 2),
}


def _roundings(name: str) -> int:
    """Roundings per term beyond a window's sum: an average divides by its divisor (a reciprocal, then a
    product: 2); an adaptive average whose windows differ in size is two matmuls with band matrices of 1/kh and
    1/kw on the device (two reciprocals, two products: 4; its sums over kh and kw terms take kh + kw - 2 <=
    kh kw - 1 additions); max pooling, unfold and fold copy and add values (0: a window's maximum is exact)."""
    return 4 if "adaptive" in name else 2 if "avg" in name else 0


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pooling_forward_backward(name, strict):
    check_linear(POOLS[name], X, _roundings(name))


POOLS_3D = {
    "max3d": lambda t: F.max_pool3d(t, 2),
    "max3d_ceil_dil": lambda t: F.max_pool3d(t, 3, 2, 1, dilation=(1, 2, 1), ceil_mode=True),
    "max3d_rect_unbatched": lambda t: F.max_pool3d(t[0], (2, 1, 3), (1, 2, 2)),
    "unfold": lambda t: F.unfold(t[:, 0], (2, 3), dilation=(1, 2), padding=1, stride=(2, 1)),
    "unfold_unbatched": lambda t: F.unfold(t[0, 0], 2),
    "fold": lambda t: F.fold(t.reshape(2, 12, 30), (7, 7), (2, 3)),
    "adaptive_avg1d_empty": lambda t: F.adaptive_avg_pool1d(t[:0, 0, 0], 3),
}


@pytest.mark.parametrize("name", sorted(POOLS_3D))
def test_pooling_3d_unfold_forward_backward(name, strict):
    check_linear(POOLS_3D[name], torch.randn(2, 3, 5, 6, 4), _roundings(name))


def test_max_pool3d_indices(strict):
    x = torch.randn(2, 2, 5, 6, 7)
    v, i = F.max_pool3d(to_n(x), 3, 2, 1, return_indices=True)
    wv, wi = F.max_pool3d(x, 3, 2, 1, return_indices=True)
    assert torch.equal(v.cpu(), wv) and torch.equal(i.cpu(), wi)          # a maximum is selected, not computed


def test_pooling_3d_unfold_errors_match_cpu():
    x = torch.randn(2, 3, 5, 6, 4)
    cases = [(lambda t: F.max_pool3d(t, 3, 2, 2), RuntimeError),              # padding over half the kernel
             (lambda t: F.max_pool3d(t, 7), RuntimeError),                    # output size 0
             (lambda t: F.unfold(t[:, 0], 2, padding=-1), RuntimeError),
             (lambda t: F.unfold(t[:, 0], 9), RuntimeError),                  # kernel > input
             (lambda t: F.fold(t.reshape(2, 12, 30), (6, 7), (2, 3)), RuntimeError)]   # 30 blocks, 25 expected
    for fn, exc in cases:
        with pytest.raises(exc):
            fn(x)
        with pytest.raises(exc):
            fn(to_n(x))


def test_max_pool_indices(strict):
    v, i = F.max_pool2d(to_n(X), 3, 2, 1, return_indices=True)
    wv, wi = F.max_pool2d(X, 3, 2, 1, return_indices=True)
    assert i.dtype == torch.int64
    assert torch.equal(v.cpu(), wv) and torch.equal(i.cpu(), wi)          # a maximum is selected, not computed


def test_pooling_bf16(strict):
    # the device pools bf16 in fp32 and rounds once; the CPU's backward kernels may add in bf16
    x = X.bfloat16()
    for fn, roundings in ((lambda t: F.max_pool2d(t, 2), 0), (lambda t: F.avg_pool2d(t, 2), 2),
                          (lambda t: F.adaptive_avg_pool2d(t, 3), 4)):
        check_linear(fn, x, roundings, device_rounds_once=True)


def test_pooling_errors_match_cpu():
    cases = [(lambda t: F.max_pool2d(t, 3, 2, 2), RuntimeError),       # padding over half the kernel
             (lambda t: F.avg_pool2d(t, 3, 1, 2), RuntimeError),
             (lambda t: F.max_pool2d(t, 20), RuntimeError),            # output size 0
             (lambda t: F.adaptive_avg_pool2d(t[0, 0, 0], 2), RuntimeError)]
    for fn, exc in cases:
        with pytest.raises(exc):
            fn(X)
        with pytest.raises(exc):
            fn(to_n(X))


def _bn_bounds(x, w, b, training=True, running=None, eps=1e-5):
    """``norm_bounds`` of a batch norm of x (N, C, ...): statistics over every dim but the channels'."""
    dims = tuple(d for d in range(x.dim()) if d != 1)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    w, b = (None if t is None else t.reshape(shape) for t in (w, b))
    running = None if running is None else tuple(t.double().reshape(shape) for t in running)
    return lambda g: norm_bounds(x, g, w, b, dims, eps, training, running)


def test_batch_norm_training_updates_running_stats(strict):
    w, b = torch.randn(4), torch.randn(4)
    stats = [torch.randn(4), torch.rand(4) + 0.5]
    dstats, stats64 = [to_n(s) for s in stats], [s.double() for s in stats]
    new = [s.clone() for s in stats]
    _check_norm(lambda x, w, b: F.batch_norm(x, *(dstats if x.is_neuron else stats64 if x.dtype == torch.float64
                                                else new), w, b, True, 0.2), (X, w, b), _bn_bounds(X, w, b))
    # (1 - m) old + m new, new the batch's mean and unbiased variance (``var_bounds``), three roundings
    b_var, b_mean = (t.reshape(4) for t in var_bounds(X, (0, 2, 3), correction=1))
    for name, d, c, exact, old, b_new in (("mean", dstats[0], new[0], stats64[0], stats[0], b_mean),
                                          ("var", dstats[1], new[1], stats64[1], stats[1], b_var)):
        bound = 0.2 * b_new + gamma(3) * (0.8 * old.double().abs() + (exact - 0.8 * old.double()).abs())
        assert_within(f"device running {name}", d, exact, bound)
        assert_within(f"cpu running {name}", c, exact, bound)


def test_batch_norm_eval_and_no_affine(strict):
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    w, b = torch.randn(4), torch.randn(4)
    _check_norm(lambda x, w, b: F.batch_norm(x, rm.to(x.device, x.dtype), rv.to(x.device, x.dtype), w, b, False),
                (X, w, b), _bn_bounds(X, w, b, training=False, running=(rm, rv)))
    x = torch.randn(5, 3)
    _check_norm(lambda x: F.batch_norm(x, None, None, training=True), (x,), _bn_bounds(x, None, None))  # 2-D
    out, mean, invstd = torch.native_batch_norm(to_n(X), None, None, to_n(rm), to_n(rv), False, 0.1, 1e-5)
    assert mean.shape == (0,) and invstd.shape == (0,)                                       # as the CPU kernel


@pytest.mark.parametrize("shape,affine", [((3, 130, 5), True), ((6, 5), False), ((2, 3, 80, 80), True)],
                         ids=["two_channel_tiles", "2d_no_affine", "beyond_one_tile"])
def test_batch_norm_training_fp32_kernel(shape, affine, strict):
    # fp32 training batch norm is one launch each way while a channel's values fit one tile (the first two);
    # beyond that the element-wise route: both within the float64 bounds
    from torchneuron.runtime import profiler
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen) * 2 + 1
    C = shape[1]
    w, b = (torch.randn(C, generator=gen), torch.randn(C, generator=gen)) if affine else (None, None)
    _check_norm(lambda x, w, b: F.batch_norm(x, None, None, w, b, True), (x, w, b), _bn_bounds(x, w, b))
    xn = to_n(x).requires_grad_()
    with profiler.record() as fwd:
        y = F.batch_norm(xn, to_n(torch.zeros(C)), to_n(torch.ones(C)), *(to_n(t) if affine else None for t in (w, b)),
                         True)
    g = torch.ones_like(y)
    with profiler.record() as bwd:
        y.backward(g)
    fits = x.numel() // C <= 8192
    assert ([r.name for r in fwd] == ["batch_norm_train_kernel"]) == fits
    assert ([r.name for r in bwd] == ["batch_norm_train_backward_kernel"]) == fits


def test_batch_norm_bf16_mixed(strict):
    # the CPU keeps a bf16 input's statistics and normalization in fp32 and rounds the output once: each
    # side within the fp32 bounds plus one bf16 rounding of the float64 result of the same bf16 values
    ref, bn = nn.BatchNorm2d(4), nn.BatchNorm2d(4).to("neuron")     # fp32 parameters, bf16 input
    bn.num_batches_tracked = ref.num_batches_tracked = None          # (int64 += 1 is not lowered yet)
    x = X.bfloat16()
    want, got = ref(x), bn(to_n(x))
    assert got.dtype == torch.bfloat16
    x64 = x.double()
    exact = F.batch_norm(x64, None, None, training=True)
    b_y = _bn_bounds(x64, None, None)(torch.zeros_like(x64))[0]
    b_y = b_y + gamma(1, torch.bfloat16) * (exact.abs() + b_y)
    b_var, b_mean = (t.reshape(4) for t in var_bounds(x64, (0, 2, 3), correction=1))
    mean, var = x64.mean((0, 2, 3)), x64.var((0, 2, 3))
    for side, out, stats in (("device", got, bn), ("cpu", want, ref)):
        assert_within(f"{side} output", out, exact, b_y)
        # 0.9 * 0 + 0.1 * mean, 0.9 * 1 + 0.1 * var: the new statistic's bound and three roundings
        assert_within(f"{side} running mean", stats.running_mean, 0.1 * mean,
                      0.1 * b_mean + gamma(3) * 0.1 * mean.abs())
        assert_within(f"{side} running var", stats.running_var, 0.9 + 0.1 * var,
                      0.1 * b_var + gamma(3) * (0.9 + 0.1 * var))


def test_batch_norm_errors_match_cpu():
    for x in (X, to_n(X)):
        with pytest.raises(RuntimeError):
            F.batch_norm(x, torch.zeros(3, device=x.device), torch.ones(3, device=x.device))   # 3 stats, 4 channels
        with pytest.raises(ValueError):
            F.batch_norm(x[:1, :, :1, :1], None, None, training=True)                          # one value per channel


@pytest.mark.parametrize("scale", [1.0, 200.0, 1000.0])
@pytest.mark.parametrize("param_dtype", [None, torch.float16, torch.float32])
def test_fp16_group_norm_statistics_in_fp32_like_cpu(scale, param_dtype, strict):
    # fp16 inputs of magnitude ~200-1000 (variance past 65504): the CPU keeps the statistics in fp32, so
    # output, mean and rstd agree to a rounding of their dtype (outputs are O(1): 2 ulps absolute)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 4, 8, 8, generator=g) * scale).half()
    params = [] if param_dtype is None else [torch.randn(4, generator=g).to(param_dtype) for _ in range(2)]
    args = (None, None) if not params else tuple(params)
    want = torch.native_group_norm(x, *args, 2, 4, 64, 2, 1e-5)
    got = torch.native_group_norm(to_n(x), *(None if t is None else to_n(t) for t in args), 2, 4, 64, 2, 1e-5)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    # float64 of the same values; the fp32 bounds of ``norm_bounds``/``var_bounds`` and a rounding to each
    # result's dtype (a statistic computed in fp16 would be off by far more: its squares overflow)
    x64 = x.double().reshape(2, 2, 2, 64)
    w, b = (None if t is None else t.double().reshape(1, 2, 2, 1) for t in args)
    exact = torch.native_group_norm(x.double(), *(None if t is None else t.double() for t in args), 2, 4, 64, 2,
                                    1e-5)
    b_y = norm_bounds(x64, torch.zeros_like(x64), w, b, (2, 3), 1e-5, param_dims=(1, 2))[0].reshape(x.shape)
    b_var, b_mean = (t.reshape(2, 2) for t in var_bounds(x64, (2, 3), correction=0))
    var = x64.var((2, 3), correction=0)
    b_rstd = (0.5 * b_var / (var + 1e-5) + gamma(3)) * exact[2]   # (var + eps)^-1/2: half var's relative error
    for side, results in (("device", got), ("cpu", want)):
        for name, r, e, bound in zip(("output", "mean", "rstd"), results, exact, (b_y, b_mean, b_rstd)):
            assert_within(f"{side} {name}", r, e, bound + U[r.dtype] * (e.abs() + bound))
    plain = F.group_norm(x.double(), 2)
    b_plain = norm_bounds(x64, torch.zeros_like(x64), None, None, (2, 3), 1e-5)[0].reshape(x.shape)
    for side, y in (("device", F.group_norm(to_n(x), 2)), ("cpu", F.group_norm(x, 2))):
        assert_within(f"{side} F.group_norm", y, plain, b_plain + U[torch.float16] * (plain.abs() + b_plain))


def _gn_bounds(x, groups, w, b, eps=1e-5):
    """``norm_bounds`` of a group norm: x (N, C, ...) viewed as (N, G, C / G, L), statistics over the last two
    dims, the parameters per (G, C / G)."""
    n, c = x.shape[:2]
    shape = (n, groups, c // groups, -1)
    w, b = (None if t is None else t.reshape(1, groups, c // groups, 1) for t in (w, b))

    def bounds(g):
        found = norm_bounds(x.reshape(shape), g.reshape(shape), w, b, (2, 3), eps, param_dims=(1, 2))
        return [found[0].reshape(x.shape), found[1].reshape(x.shape), *found[2:]]
    return bounds


def test_group_norm_and_var_mean(strict):
    w, b = torch.randn(4), torch.randn(4)
    _check_norm(lambda x, w, b: F.group_norm(x, 2, w, b), (X, w, b), _gn_bounds(X, 2, w, b))
    x = torch.randn(3, 4, 5)
    _check_norm(lambda x: F.group_norm(x, 4), (x,), _gn_bounds(x, 4, None, None))
    for kw in ({"dim": (0, 2)}, {"dim": 1, "correction": 0, "keepdim": True}, {}):
        got, want, exact = torch.var_mean(to_n(X), **kw), torch.var_mean(X, **kw), torch.var_mean(X.double(), **kw)
        b_var, b_mean = var_bounds(X, kw.get("dim"), kw.get("correction", 1))
        for side, (v, m) in (("device", got), ("cpu", want)):
            assert_within(f"{side} var", v, exact[0], b_var.reshape(exact[0].shape))
            assert_within(f"{side} mean", m, exact[1], b_mean.reshape(exact[1].shape))


def test_dropout(strict):
    x = torch.randn(3000) + 5
    out, mask = torch.native_dropout(to_n(x), 0.3, True)
    assert mask.dtype == torch.bool and 0.65 < mask.float().mean().item() < 0.75
    # x * mask / 0.7: a division (or a rounded reciprocal and a product)
    kept = x.double() * mask.cpu() / 0.7
    assert_within("dropout", out, kept, gamma(2) * kept.abs())
    torch.manual_seed(7)
    a = F.dropout(to_n(x), 0.5).cpu()
    b = F.dropout(to_n(x), 0.5).cpu()
    torch.manual_seed(7)
    assert torch.equal(F.dropout(to_n(x), 0.5).cpu(), a) and not torch.equal(a, b)   # reproducible, advancing
    assert torch.equal(F.dropout(to_n(x), 0.5, training=False).cpu(), x)
    assert torch.equal(F.dropout(to_n(x), 0.0).cpu(), x)
    assert torch.equal(F.dropout(to_n(x), 1.0).cpu(), torch.zeros_like(x))
    out, mask = torch.native_dropout(to_n(x), 0.3, False)
    assert torch.equal(out.cpu(), x) and bool(mask.all())
    xd = to_n(x.reshape(30, 100)).requires_grad_()
    y = F.dropout(xd.bfloat16(), 0.25)
    y.float().sum().backward()
    keep = (y != 0).cpu().float()
    # the bf16 gradient: keep / 0.75 in at most three roundings of bf16 or finer
    assert_within("dropout gradient", xd.grad, keep.double() / 0.75, gamma(3, torch.bfloat16) * keep.double() / 0.75)
    with pytest.raises(ValueError):
        F.dropout(to_n(x), 1.5)


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3), nn.GroupNorm(2, 8), nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Dropout(0.1), nn.Linear(8, 10))


class _Replay(nn.Module):
    """The CPU model's dropout: applies the masks the device model drew, step by step."""

    def __init__(self, masks: list):
        super().__init__()
        self.masks, self.step = masks, 0

    def forward(self, x):
        return x * self.masks[self.step].to(x.dtype) / 0.9


def _yardstick(got, cpus, exact) -> tuple[float, float]:
    """(the device's deviation from float64, 4x the CPU's largest): the CPU runs' deviations from the float64
    run of the same model, at least one unit of fp32 (2**-23) of the exact values' magnitude."""
    exact = exact.detach().cpu().double()
    dev = float((got.detach().cpu().double() - exact).abs().max())
    cpu = max(float((c.detach().double() - exact).abs().max()) for c in cpus)
    return dev, 4 * max(cpu, 2.0**-23 * float(exact.abs().max()))


def test_cnn_trains_like_cpu(strict):
    # 20 AdamW steps: a derived bound would have to follow every rounding through the trajectory, so the yardstick
    # is the CPU's own: fp32 runs with 1 and 2 threads (other summation orders) against the same model trained in
    # float64. Rounding moves every fp32 run off the exact trajectory by the same few units (here the losses by
    # about one unit of fp32, the parameters by a few); the device's run must stay within 4x the CPU's largest
    # deviation (or of one unit of fp32). A wrong step (a dropout scale, a biased variance, a lost term) puts it
    # orders of magnitude further.
    torchneuron.reset_fallback_counts()
    dev = _cnn().to("neuron")
    # int64 arithmetic (num_batches_tracked += 1) is not lowered yet; momentum is fixed, so it is unused
    dev[1].num_batches_tracked = None
    masks = []
    dev[9].register_forward_hook(lambda m, i, o: masks.append((o != 0).cpu()))   # inputs are non-zero
    refs = {"cpu2": _cnn(), "cpu1": _cnn(), "exact": _cnn().double()}
    for m in refs.values():
        m[9] = _Replay(masks)
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 12, 12), torch.randint(0, 10, (4,))
    opt_d = torch.optim.AdamW(dev.parameters(), lr=1e-2)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in refs.items()}
    threads = {"cpu2": 2, "cpu1": 1, "exact": 2}
    xd, yd = to_n(x), to_n(y)
    before = torch.get_num_threads()
    try:
        for step in range(20):
            loss_d = F.cross_entropy(dev(xd), yd)
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            losses = {}
            for k, m in refs.items():
                torch.set_num_threads(threads[k])
                m[9].step = step
                losses[k] = F.cross_entropy(m(x.to(next(m.parameters()).dtype)), y)
                opts[k].zero_grad()
                losses[k].backward()
                opts[k].step()
            got, allowed = _yardstick(loss_d, [losses["cpu1"], losses["cpu2"]], losses["exact"])
            assert got <= allowed, f"step {step}: loss {got:.3e} off float64, beyond {allowed:.3e}"
    finally:
        torch.set_num_threads(before)
    # the first conv's bias feeds batch norm, so its true gradient is 0 and AdamW turns rounding noise into
    # +-lr steps that differ between any two runs; the rest (and the loss) does not depend on it
    got = dev.state_dict()
    cpus = [refs[k].state_dict() for k in ("cpu1", "cpu2")]
    want = refs["exact"].state_dict()
    for name in ("0.weight", "1.weight", "1.bias", "1.running_var", "4.weight", "4.bias", "10.weight"):
        off, allowed = _yardstick(got[name], [c[name] for c in cpus], want[name])
        assert off <= allowed, f"{name}: {off:.3e} off float64, beyond {allowed:.3e}"
    # eval mode (running statistics, no dropout) with the trained device weights, on the CPU in fp32 and float64
    evals = {k: _cnn() for k in ("cpu", "exact")}
    for m in evals.values():
        m.load_state_dict({k: v.cpu() for k, v in got.items()}, strict=False)
        m.eval()
    evals["exact"].double()
    dev.eval()
    off, allowed = _yardstick(dev(xd), [evals["cpu"](x)], evals["exact"](x.double()))
    assert off <= allowed, f"eval: {off:.3e} off float64, beyond {allowed:.3e}"
    assert torchneuron.fallback_counts() == {}


@pytest.mark.parametrize("dims", [2, 3])
def test_avg_pool_keeps_non_finite_values_in_their_windows(dims, strict):
    # every variant (ceil_mode, padding, count_include_pad, divisor_override), values and gradients
    g = torch.Generator().manual_seed(0)
    pool = F.avg_pool2d if dims == 2 else F.avg_pool3d
    for k, s, p, ceil, cip, div in itertools.product([2, 3, (2, 3, 1)[:dims]], [None, 1, 2], [0, 1], [False, True],
                                                     [True, False], [None, 3]):
        if p > min(k if isinstance(k, tuple) else (k,)) // 2:
            continue                                          # (padding is at most half the kernel)
        x = torch.randn(2, 3, *(7, 9, 5)[:dims], generator=g)
        x.view(-1)[17], x.view(-1)[40] = float("nan"), float("inf")
        fn = lambda t: pool(t, k, s, p, ceil, cip, div)                 # noqa: E731
        grad = torch.randn(fn(x).shape, generator=g)
        grad[0, 1, 0, 0] = float("nan")
        check_linear(fn, x, 2, g=grad)       # non-finite where float64 is, elsewhere within the windows' bound


@pytest.mark.parametrize("shape,out", [((2, 3, 8, 6), (4, 3)), ((2, 3, 7, 7), (1, 1)), ((3, 7, 9), (7, 3)),
                                       ((2, 2, 4, 6, 8), (2, 3, 4)), ((2, 2, 4, 6, 8), (1, 1, 1))])
def test_adaptive_avg_pool_of_even_windows_keeps_non_finite_values_in_them(shape, out, strict):
    # sizes that divide evenly (a global pool too) are plain window sums on the device
    pool = F.adaptive_avg_pool2d if len(out) == 2 else F.adaptive_avg_pool3d
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x.view(-1)[5] = float("nan")
    check_linear(lambda t: pool(t, out), x, _roundings("adaptive"))


def test_bounds_fail_a_unit_in_the_wrong_place(strict):
    # the derived bounds are far below the error of a wrong divisor, selection or variance: each check fails
    with pytest.raises(AssertionError, match="device output"):       # a 3x3 window's average over 10
        check_linear(lambda t: F.avg_pool2d(t, 3, 2, 1, divisor_override=10 if t.is_neuron else None), X, 2)
    with pytest.raises(AssertionError, match="device output"):       # a window's minimum
        check_linear(lambda t: -F.max_pool2d(-t, 2) if t.is_neuron else F.max_pool2d(t, 2), X)
    w, b = torch.randn(4), torch.randn(4)
    with pytest.raises(AssertionError, match="device output"):       # the unbiased variance: 1 + 1/(2n) off
        _check_norm(lambda x, w, b: F.batch_norm(x, None, None, w, b, True) * (1 + 1 / 360 if x.is_neuron else 1),
                    (X, w, b), _bn_bounds(X, w, b))
