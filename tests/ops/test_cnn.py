"""Convolution, pooling, batch/group norm and dropout run on the device (strict mode) and match the CPU."""
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron
from tests.ops.conftest import to_n

torch.manual_seed(0)
X = torch.randn(2, 4, 9, 10)


def _check(fn, *inputs, atol=1e-4, rtol=1e-4):
    """fn on CPU and on neuron: outputs and the gradients of every float input agree."""
    cpu = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    dev = [to_n(t).detach().requires_grad_(t.is_floating_point()) for t in inputs]
    want, got = fn(*cpu), fn(*dev)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(to_n(g))
    for c, d in zip(cpu, dev):
        if c.grad is not None:
            torch.testing.assert_close(d.grad.cpu(), c.grad, atol=atol, rtol=rtol)


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


def test_conv_transpose_bf16(strict):
    x, w = torch.randn(2, 3, 4, 5).bfloat16(), torch.randn(3, 2, 3, 3).bfloat16()
    _check(lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1), x, w, atol=5e-2, rtol=2e-2)


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
    torch.testing.assert_close(F.conv_transpose2d(to_n(x), to_n(w), stride=2).cpu(),
                               F.conv_transpose2d(x, w, stride=2))


def test_conv_bf16(strict):
    # the device sums bf16 products in fp32 and rounds once: the reference is the fp32 convolution of the
    # same bf16 values, rounded to bf16 (the CPU's bf16 kernel rounds partial sums too, by up to ~0.1)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 6, 6, generator=g).bfloat16(), torch.randn(4, 3, 3, 3, generator=g).bfloat16()
    got = F.conv2d(to_n(x), to_n(w), padding=1)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), F.conv2d(x.float(), w.float(), padding=1).bfloat16(), atol=1e-2, rtol=1e-2)
    _check(lambda x, w: F.conv2d(x, w, padding=1), x, w, atol=1.3e-1, rtol=5e-2)


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
    torch.testing.assert_close(F.conv2d(to_n(x), to_n(w)).cpu(), F.conv2d(x, w))


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
    _check(lambda x, w, b: F.conv2d(x, w, b, padding=2), torch.randn(1, 2, 4, 4), torch.randn(3, 2, 1, 1),
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


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pooling_forward_backward(name, strict):
    _check(POOLS[name], X)


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
    _check(POOLS_3D[name], torch.randn(2, 3, 5, 6, 4))


def test_max_pool3d_indices(strict):
    x = torch.randn(2, 2, 5, 6, 7)
    v, i = F.max_pool3d(to_n(x), 3, 2, 1, return_indices=True)
    wv, wi = F.max_pool3d(x, 3, 2, 1, return_indices=True)
    torch.testing.assert_close(v.cpu(), wv)
    torch.testing.assert_close(i.cpu(), wi)


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
    torch.testing.assert_close(v.cpu(), wv)
    torch.testing.assert_close(i.cpu(), wi)


def test_pooling_bf16(strict):
    x = X.bfloat16()
    for fn in (lambda t: F.max_pool2d(t, 2), lambda t: F.avg_pool2d(t, 2), lambda t: F.adaptive_avg_pool2d(t, 3)):
        _check(fn, x, atol=2e-2, rtol=2e-2)


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


def test_batch_norm_training_updates_running_stats(strict):
    w, b = torch.randn(4), torch.randn(4)
    stats = [torch.randn(4), torch.rand(4) + 0.5]
    dstats = [to_n(s) for s in stats]
    _check(lambda x, w, b: F.batch_norm(x, *(dstats if x.is_neuron else stats), w, b, True, 0.2), X, w, b)
    for d, s in zip(dstats, stats):
        torch.testing.assert_close(d.cpu(), s, atol=1e-5, rtol=1e-5)


def test_batch_norm_eval_and_no_affine(strict):
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    _check(lambda x, w, b: F.batch_norm(x, to_n(rm) if x.is_neuron else rm, to_n(rv) if x.is_neuron else rv,
                                        w, b, False), X, torch.randn(4), torch.randn(4))
    _check(lambda x: F.batch_norm(x, None, None, training=True), torch.randn(5, 3))          # 2-D, no params
    out, mean, invstd = torch.native_batch_norm(to_n(X), None, None, to_n(rm), to_n(rv), False, 0.1, 1e-5)
    assert mean.shape == (0,) and invstd.shape == (0,)                                       # as the CPU kernel


def test_batch_norm_bf16_mixed(strict):
    ref, bn = nn.BatchNorm2d(4), nn.BatchNorm2d(4).to("neuron")     # fp32 parameters, bf16 input
    bn.num_batches_tracked = ref.num_batches_tracked = None          # (int64 += 1 is not lowered yet)
    want, got = ref(X.bfloat16()), bn(to_n(X.bfloat16()))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), want, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(bn.running_mean.cpu(), ref.running_mean, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(bn.running_var.cpu(), ref.running_var, atol=1e-3, rtol=1e-2)


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
    for gt, wt in zip(got, want):
        eps = torch.finfo(wt.dtype).eps
        assert gt.dtype == wt.dtype
        torch.testing.assert_close(gt.cpu(), wt, rtol=2 * eps, atol=8 * torch.finfo(torch.float16).eps)
    torch.testing.assert_close(F.group_norm(to_n(x), 2).cpu(), F.group_norm(x, 2), rtol=0,
                               atol=8 * torch.finfo(torch.float16).eps)


def test_group_norm_and_var_mean(strict):
    _check(lambda x, w, b: F.group_norm(x, 2, w, b), X, torch.randn(4), torch.randn(4))
    _check(lambda x: F.group_norm(x, 4), torch.randn(3, 4, 5))
    for kw in ({"dim": (0, 2)}, {"dim": 1, "correction": 0, "keepdim": True}, {}):
        got, want = torch.var_mean(to_n(X), **kw), torch.var_mean(X, **kw)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-5)


def test_dropout(strict):
    x = torch.randn(3000) + 5
    out, mask = torch.native_dropout(to_n(x), 0.3, True)
    assert mask.dtype == torch.bool and 0.65 < mask.float().mean().item() < 0.75
    torch.testing.assert_close(out.cpu(), x * mask.cpu() / 0.7)
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
    torch.testing.assert_close(xd.grad.cpu(), (keep / 0.75).bfloat16().float())   # bf16 gradient
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


def test_cnn_trains_like_cpu(strict):
    torchneuron.reset_fallback_counts()
    dev = _cnn().to("neuron")
    # int64 arithmetic (num_batches_tracked += 1) is not lowered yet; momentum is fixed, so it is unused
    dev[1].num_batches_tracked = None
    masks = []
    dev[9].register_forward_hook(lambda m, i, o: masks.append((o != 0).cpu()))   # inputs are non-zero
    ref = _cnn()
    ref[9] = replay = _Replay(masks)
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 12, 12), torch.randint(0, 10, (4,))
    opt_d = torch.optim.AdamW(dev.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xd, yd = to_n(x), to_n(y)
    for step in range(20):
        loss_d = F.cross_entropy(dev(xd), yd)
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        replay.step = step
        loss_r = F.cross_entropy(ref(x), y)
        opt_r.zero_grad()
        loss_r.backward()
        opt_r.step()
        assert abs(loss_d.item() - loss_r.item()) <= 1e-4 * abs(loss_r.item()), step
    # the first conv's bias feeds batch norm, so its true gradient is 0 and AdamW turns rounding noise into
    # +-lr steps that differ between any two backends; the rest (and the loss) does not depend on it
    got, want = dev.state_dict(), ref.state_dict()
    for name in ("0.weight", "1.weight", "1.bias", "1.running_var", "4.weight", "4.bias", "10.weight"):
        torch.testing.assert_close(got[name].cpu(), want[name], atol=1e-3, rtol=1e-3)
    # eval mode (running statistics, no dropout) with the trained device weights
    ref[9] = nn.Dropout(0.1)
    ref.load_state_dict({k: v.cpu() for k, v in got.items()}, strict=False)
    dev.eval()
    ref.eval()
    torch.testing.assert_close(dev(xd).cpu(), ref(x), atol=1e-4, rtol=1e-4)
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
        xc, xn = x.clone().requires_grad_(), to_n(x).requires_grad_()
        want, got = pool(xc, k, s, p, ceil, cip, div), pool(xn, k, s, p, ceil, cip, div)
        torch.testing.assert_close(got.detach().cpu(), want.detach(), atol=1e-5, rtol=1e-5, equal_nan=True)
        grad = torch.randn(want.shape, generator=g)
        grad[0, 1, 0, 0] = float("nan")
        want.backward(grad)
        got.backward(to_n(grad))
        torch.testing.assert_close(xn.grad.cpu(), xc.grad, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("shape,out", [((2, 3, 8, 6), (4, 3)), ((2, 3, 7, 7), (1, 1)), ((3, 7, 9), (7, 3)),
                                       ((2, 2, 4, 6, 8), (2, 3, 4)), ((2, 2, 4, 6, 8), (1, 1, 1))])
def test_adaptive_avg_pool_of_even_windows_keeps_non_finite_values_in_them(shape, out, strict):
    # sizes that divide evenly (a global pool too) are plain window sums on the device
    pool = F.adaptive_avg_pool2d if len(out) == 2 else F.adaptive_avg_pool3d
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x.view(-1)[5] = float("nan")
    xc, xn = x.clone().requires_grad_(), to_n(x).requires_grad_()
    want, got = pool(xc, out), pool(xn, out)
    torch.testing.assert_close(got.detach().cpu(), want.detach(), atol=1e-5, rtol=1e-5, equal_nan=True)
    grad = torch.randn(want.shape)
    want.backward(grad)
    got.backward(to_n(grad))
    torch.testing.assert_close(xn.grad.cpu(), xc.grad, atol=1e-5, rtol=1e-5, equal_nan=True)
