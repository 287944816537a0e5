"""Padding, upsampling and adaptive/3-D pooling run on the device (strict mode) and match the CPU."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import to_n

torch.manual_seed(0)


def _check(fn, x, atol=1e-5, rtol=1e-5):
    """fn on CPU and on neuron: output and input gradient agree."""
    cpu = x.clone().requires_grad_(True)
    dev = to_n(x).requires_grad_(True)
    want, got = fn(cpu), fn(dev)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(to_n(g))
    torch.testing.assert_close(dev.grad.cpu(), cpu.grad, atol=atol, rtol=rtol)


PADS = {
    "replicate1d": ((2, 3, 6), (2, 3), "replicate"),
    "replicate1d_unbatched": ((3, 6), (1, 0), "replicate"),
    "replicate2d": ((2, 2, 5, 4), (1, 2, 3, 0), "replicate"),
    "replicate2d_negative": ((1, 2, 6, 5), (-1, 2, 1, -2), "replicate"),
    "replicate3d": ((1, 2, 3, 4, 5), (1, 1, 0, 2, 2, 1), "replicate"),
    "reflect1d": ((2, 3, 6), (3, 5), "reflect"),
    "reflect2d": ((2, 2, 5, 4), (1, 3, 4, 2), "reflect"),
    "reflect2d_unbatched": ((2, 5, 4), (0, 1, 2, 2), "reflect"),
    "reflect3d": ((1, 2, 3, 4, 5), (2, 1, 1, 3, 0, 2), "reflect"),
}


@pytest.mark.parametrize("name", PADS)
def test_pad(strict, name):
    shape, pad, mode = PADS[name]
    _check(lambda x: F.pad(x, pad, mode=mode), torch.randn(shape))


def test_pad_out_and_bf16(strict):
    x = torch.randn(2, 3, 7)
    out = to_n(torch.empty(0))
    torch.ops.aten.reflection_pad1d.out(to_n(x), [2, 1], out=out)
    torch.testing.assert_close(out.cpu(), torch.ops.aten.reflection_pad1d(x, [2, 1]))
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(F.pad(to_n(xb), (1, 2), mode="replicate").cpu(), F.pad(xb, (1, 2), mode="replicate"))


def test_pad_errors_like_cpu(strict):
    x = torch.randn(1, 2, 4)
    with pytest.raises(RuntimeError, match="Padding size should be less than"):
        F.pad(x, (4, 0), mode="reflect")
    with pytest.raises(RuntimeError, match="Padding size should be less than"):
        F.pad(to_n(x), (4, 0), mode="reflect")


UPS = {
    "nearest1d_up": ((2, 3, 5), dict(size=12, mode="nearest")),
    "nearest1d_down": ((2, 3, 9), dict(size=4, mode="nearest")),
    "nearest2d_scale": ((1, 2, 4, 5), dict(scale_factor=(2, 1.7), mode="nearest")),
    "nearest2d_double": ((2, 2, 3, 4), dict(scale_factor=2, mode="nearest")),
    "nearest3d": ((1, 2, 3, 4, 2), dict(size=(5, 3, 6), mode="nearest")),
    "bilinear": ((2, 3, 4, 5), dict(size=(7, 9), mode="bilinear", align_corners=False)),
    "bilinear_aligned": ((2, 3, 4, 5), dict(size=(7, 3), mode="bilinear", align_corners=True)),
    "bilinear_scale": ((1, 2, 5, 6), dict(scale_factor=(1.5, 0.6), mode="bilinear", align_corners=False)),
    "bilinear_recompute": ((1, 2, 5, 6), dict(scale_factor=2.3, mode="bilinear", recompute_scale_factor=True)),
}


@pytest.mark.parametrize("name", UPS)
def test_upsample(strict, name):
    shape, kw = UPS[name]
    _check(lambda x: F.interpolate(x, **kw), torch.randn(shape), atol=1e-5, rtol=1e-4)


def test_adaptive_max_pool2d(strict):
    x = torch.randn(2, 3, 7, 9)
    _check(lambda t: F.adaptive_max_pool2d(t, (3, 4)), x)
    _check(lambda t: F.adaptive_max_pool1d(t, 4), torch.randn(2, 3, 10))
    v, i = F.adaptive_max_pool2d(to_n(x), (4, 5), return_indices=True)
    wv, wi = F.adaptive_max_pool2d(x, (4, 5), return_indices=True)
    torch.testing.assert_close(v.cpu(), wv)
    assert torch.equal(i.cpu(), wi)
    # ties keep the first occurrence, like the CPU kernel
    t = torch.tensor([[[1.0, 3.0, 3.0, 0.0, 3.0]]])
    assert torch.equal(F.adaptive_max_pool1d(to_n(t), 2, return_indices=True)[1].cpu(),
                       F.adaptive_max_pool1d(t, 2, return_indices=True)[1])


def test_adaptive_max_pool2d_nan_and_empty(strict):
    x = torch.randn(2, 3, 6, 5)
    x[0, 0, 1, 1] = x[0, 0, 1, 2] = x[1, 2, 4, 4] = float("nan")
    v, i = F.adaptive_max_pool2d(to_n(x), (2, 2), return_indices=True)
    wv, wi = F.adaptive_max_pool2d(x, (2, 2), return_indices=True)
    torch.testing.assert_close(v.cpu(), wv, equal_nan=True)
    assert torch.equal(i.cpu(), wi)
    assert F.adaptive_max_pool2d(to_n(x), (0, 2)).shape == (2, 3, 0, 2)


def test_adaptive_avg_pool3d(strict):
    _check(lambda t: F.adaptive_avg_pool3d(t, (2, 3, 2)), torch.randn(2, 3, 5, 7, 4))
    _check(lambda t: F.adaptive_avg_pool3d(t, (3, 1, 4)), torch.randn(2, 4, 5, 6))


@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=(3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 1)),
                                dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                                dict(kernel_size=2, divisor_override=3)])
def test_avg_pool3d(strict, kw):
    _check(lambda t: F.avg_pool3d(t, **kw), torch.randn(2, 2, 5, 6, 7))


@pytest.mark.parametrize("size", [(5,), (7, 3), (4, 6, 5)])
def test_nearest_exact(size, strict):
    x = torch.randn(2, 3, *[3] * len(size))
    want = F.interpolate(x, size=size, mode="nearest-exact")
    got = F.interpolate(x.to("neuron"), size=size, mode="nearest-exact")
    torch.testing.assert_close(got.cpu(), want)
