"""Padding, upsampling and adaptive/3-D pooling run on the device (strict mode) and match the CPU."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.bounds import assert_within, check_linear, check_linear_forward
from tests.ops.conftest import to_n

torch.manual_seed(0)

# Every op here is linear in its input, so ``check_linear`` holds the device and the CPU each to the rounding
# bound of its sums of terms against float64 (tests/ops/bounds.py). Roundings per term beyond the sums:
COPY = 0          # padding, nearest, max pooling and unpooling: copies and sums of copies (a forward is exact)
AVG = 2           # a window average: a reciprocal of the divisor and the product with it


def _interp(mode: str, dims: int, grid: bool = False) -> tuple[int, str | None]:
    """(roundings, weights) of an interpolation (or a grid sampling): one product per dim's weight (the
    weights' product, then the term), the weights themselves computed from rounded coordinates; nearest
    copies."""
    if mode.startswith("nearest"):
        return COPY, None
    return dims, ("grid-" if grid else "") + ("cubic" if "cubic" in mode else "linear")


def _adaptive(dims: int) -> int:
    """An adaptive average whose windows differ in size is a band matrix per dim on the device (1/k entries: a
    reciprocal and a product each); the even case is a plain window average."""
    return 2 * dims


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
    check_linear(lambda x: F.pad(x, pad, mode=mode), torch.randn(shape), COPY)


def test_pad_out_and_bf16(strict):
    x = torch.randn(2, 3, 7)
    out = to_n(torch.empty(0))
    torch.ops.aten.reflection_pad1d.out(to_n(x), [2, 1], out=out)
    assert torch.equal(out.cpu(), torch.ops.aten.reflection_pad1d(x, [2, 1]))           # padding copies
    xb = x.to(torch.bfloat16)
    assert torch.equal(F.pad(to_n(xb), (1, 2), mode="replicate").cpu(), F.pad(xb, (1, 2), mode="replicate"))


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
    "linear": ((2, 3, 5), dict(size=11, mode="linear")),
    "linear_aligned_down": ((2, 3, 9), dict(size=4, mode="linear", align_corners=True)),
    "linear_scale": ((2, 3, 4), dict(scale_factor=0.45, mode="linear")),
    "linear_from_one": ((1, 2, 1), dict(size=3, mode="linear")),
    "trilinear": ((1, 2, 3, 4, 2), dict(size=(5, 3, 6), mode="trilinear")),
    "trilinear_aligned": ((1, 2, 3, 4, 5), dict(scale_factor=(1.5, 2, 0.6), mode="trilinear", align_corners=True)),
    "bicubic": ((2, 2, 4, 5), dict(size=(7, 9), mode="bicubic")),
    "bicubic_aligned": ((1, 2, 6, 5), dict(size=(3, 8), mode="bicubic", align_corners=True)),
    "bicubic_scale": ((1, 2, 5, 6), dict(scale_factor=(1.7, 0.4), mode="bicubic")),
    "bicubic_to_one": ((1, 1, 4, 3), dict(size=(1, 1), mode="bicubic", align_corners=True)),
    # a dim whose size a scale leaves unchanged is copied by the CPU's linear kernels and bicubic backward
    "linear_same_size_scale": ((2, 3, 4), dict(scale_factor=1.1, mode="linear")),
    "bilinear_same_size_scale": ((1, 2, 10, 6), dict(scale_factor=(1.05, 1.4), mode="bilinear")),
    "bicubic_same_size_scale": ((1, 2, 4, 4), dict(scale_factor=1.1, mode="bicubic")),
    "bicubic_one_dim_same": ((1, 2, 4, 8), dict(scale_factor=(1.1, 1.3), mode="bicubic")),
}


@pytest.mark.parametrize("name", UPS)
def test_upsample(strict, name):
    shape, kw = UPS[name]
    check_linear(lambda x: F.interpolate(x, **kw), torch.randn(shape), *_interp(kw["mode"], len(shape) - 2))


def test_adaptive_max_pool2d(strict):
    x = torch.randn(2, 3, 7, 9)
    check_linear(lambda t: F.adaptive_max_pool2d(t, (3, 4)), x, COPY)
    check_linear(lambda t: F.adaptive_max_pool1d(t, 4), torch.randn(2, 3, 10), COPY)
    v, i = F.adaptive_max_pool2d(to_n(x), (4, 5), return_indices=True)
    wv, wi = F.adaptive_max_pool2d(x, (4, 5), return_indices=True)
    assert torch.equal(v.cpu(), wv)                                    # a maximum is selected, not computed
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
    assert_within("values", v, wv.double(), 0)                         # selected: equal, NaN where the CPU's
    assert torch.equal(i.cpu(), wi)
    assert F.adaptive_max_pool2d(to_n(x), (0, 2)).shape == (2, 3, 0, 2)


def test_adaptive_avg_pool3d(strict):
    check_linear(lambda t: F.adaptive_avg_pool3d(t, (2, 3, 2)), torch.randn(2, 3, 5, 7, 4), _adaptive(3))
    check_linear(lambda t: F.adaptive_avg_pool3d(t, (3, 1, 4)), torch.randn(2, 4, 5, 6), _adaptive(3))


@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=(3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 1)),
                                dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                                dict(kernel_size=2, divisor_override=3)])
def test_avg_pool3d(strict, kw):
    check_linear(lambda t: F.avg_pool3d(t, **kw), torch.randn(2, 2, 5, 6, 7), AVG)


@pytest.mark.parametrize("size", [(5,), (7, 3), (4, 6, 5)])
def test_nearest_exact(size, strict):
    x = torch.randn(2, 3, *[3] * len(size))
    want = F.interpolate(x, size=size, mode="nearest-exact")
    got = F.interpolate(x.to("neuron"), size=size, mode="nearest-exact")
    assert torch.equal(got.cpu(), want)                                # copies


@pytest.mark.parametrize("mode", ["linear", "bicubic", "trilinear"])
def test_interpolate_half_and_out(strict, mode):
    nd = {"linear": 1, "bicubic": 2, "trilinear": 3}[mode]
    x = torch.randn((1, 2) + (4,) * nd)
    for dt in (torch.bfloat16, torch.float16):
        # the device interpolates in fp32 and rounds once; the CPU within the bound of sums in the 2-byte dtype
        check_linear_forward(lambda t: F.interpolate(t, scale_factor=1.5, mode=mode), x.to(dt), *_interp(mode, nd),
                             device_rounds_once=True)
    op = {"linear": torch.ops.aten.upsample_linear1d, "bicubic": torch.ops.aten.upsample_bicubic2d,
          "trilinear": torch.ops.aten.upsample_trilinear3d}[mode]

    def out_variant(t):
        if t.dtype == torch.float64:                                   # (the float64 reference)
            return op(t, [6] * nd, False)
        out = torch.empty(0, device=t.device)
        op.out(t, [6] * nd, False, out=out)
        return out
    check_linear_forward(out_variant, x, *_interp(mode, nd))


def test_interpolate_errors_like_cpu(strict):
    """The CPU's size checks, which PyTorch's meta decompositions skip, raise on the device too."""
    aten = torch.ops.aten
    calls = [(aten.upsample_linear1d, (1, 2, 4), [0], False), (aten.upsample_bicubic2d, (1, 2, 4), [3, 3], False),
             (aten.upsample_trilinear3d, (1, 2, 4, 4, 4), [3, 0, 3], False),
             (aten.upsample_bicubic2d, (2, 0, 4, 4), [3, 3], False), (aten.upsample_nearest1d, (2, 1, 4), [0]),
             (aten.upsample_bicubic2d_backward, (2, 1, 3, 2), [3, 3], [2, 1, 4, 4], False)]
    for op, shape, *args in calls:
        with pytest.raises(RuntimeError) as want:
            op(torch.zeros(shape), *args)
        with pytest.raises(RuntimeError) as got:
            op(to_n(torch.zeros(shape)), *args)
        assert str(got.value).split(",")[0] == str(want.value).split(",")[0]


def test_empty_batches(strict):
    """Empty operands run the CPU's checks and give empty results on the device, forward and backward."""
    check_linear(lambda t: F.pad(t, (1, 2), mode="reflect"), torch.randn(0, 3, 3))
    check_linear(lambda t: F.pad(t, (0, 2, 0, 1), mode="replicate"), torch.randn(0, 3, 3, 3))
    check_linear(lambda t: F.adaptive_avg_pool3d(t, (5, 7, 4)), torch.randn(0, 2, 8, 8, 8))
    check_linear(lambda t: F.avg_pool3d(t, (2, 3, 1), (2, 1, 2)), torch.randn(0, 1, 4, 5, 4))
    check_linear(lambda t: F.interpolate(t, size=(3, 5), mode="bicubic"), torch.randn(0, 2, 4, 4))
    for pad in ([-1, -1, -1], [4, 4, 4]):
        with pytest.raises(RuntimeError, match="pad"):
            torch.ops.aten.avg_pool3d(to_n(torch.randn(0, 1, 49, 50)), [2, 2, 2], [50, 50, 50], pad)


def test_max_unpool3d(strict):
    x = torch.randn(2, 3, 4, 6, 4)
    v, i = F.max_pool3d(x, 2, return_indices=True)
    check_linear(lambda t: F.max_unpool3d(t, i.to(t.device), 2, output_size=(5, 7, 4)), v, COPY)
    got = F.max_unpool3d(to_n(v[0]), to_n(i[0]), 2)          # unbatched
    assert torch.equal(got.cpu(), F.max_unpool3d(v[0], i[0], 2))
    out = to_n(torch.empty(0))
    torch.ops.aten.max_unpool3d.out(to_n(v), to_n(i), [4, 6, 4], [2, 2, 2], [0, 0, 0], out=out)
    assert torch.equal(out.cpu(), F.max_unpool3d(v, i, 2))
    bad = i.clone()
    bad[1, 2, 1, 2, 1] = 96
    for t, j in ((v, bad), (to_n(v), to_n(bad))):
        with pytest.raises(RuntimeError, match=r"invalid max index: 96 \(output volumes are of size 4x6x4\)"):
            F.max_unpool3d(t, j, 2)
        with pytest.raises(RuntimeError, match="should be type int64"):
            F.max_unpool3d(t, j.to(torch.int32), 2)


# ---- grid sampling, fractional and 3-D adaptive max pooling, antialiased resizing ---------------------

@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_grid_sample_2d(strict, mode, padding):
    """Coordinates beyond [-1, 1] exercise every padding rule; the CPU's index math is followed exactly."""
    x = torch.randn(2, 3, 5, 7)
    g = torch.rand(2, 6, 4, 2) * 3.2 - 1.6
    for align in (False, True):
        # linear in x, the weights from the grid's coordinates (nearest: the CPU's rounding of the same fp32
        # coordinate picks the same element, exactly)
        check_linear_forward(lambda t: F.grid_sample(t, g.to(t.device, t.dtype), mode=mode, padding_mode=padding,
                                                     align_corners=align), x, *_interp(mode, 2, grid=True))


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample_3d(strict, mode):
    x = torch.randn(2, 3, 4, 5, 3)
    g = torch.rand(2, 3, 2, 4, 3) * 3 - 1.5
    for padding in ("zeros", "border", "reflection"):
        for align in (False, True):
            check_linear_forward(lambda t: F.grid_sample(t, g.to(t.device, t.dtype), mode=mode,
                                                         padding_mode=padding, align_corners=align),
                                 x, *_interp(mode, 3, grid=True))


def test_grid_sample_errors_like_cpu(strict):
    aten = torch.ops.aten
    calls = [(aten.grid_sampler_2d, (2, 1, 3, 3), (1, 2, 2, 2), 0),     # batch sizes differ
             (aten.grid_sampler_2d, (1, 1, 3, 3), (1, 2, 2, 3), 0),     # wrong coordinate count
             (aten.grid_sampler_3d, (1, 1, 3, 3, 3), (1, 2, 2, 2, 3), 2),  # no bicubic in 3-D
             (aten.grid_sampler_2d, (1, 1, 0, 3), (1, 2, 2, 2), 0)]     # empty spatial dim
    for op, shape, gshape, mode in calls:
        with pytest.raises(RuntimeError) as want:
            op(torch.zeros(shape), torch.zeros(gshape), mode, 0, False)
        with pytest.raises(RuntimeError) as got:
            op(to_n(torch.zeros(shape)), to_n(torch.zeros(gshape)), mode, 0, False)
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize("k", [2, 3])
def test_fractional_max_pool(strict, k):
    """Given the random samples the op is deterministic: windows, values and indices match the CPU's."""
    x = torch.randn((2, 3) + (9, 8, 7)[:k])
    x[0, 1].view(-1)[5] = float("nan")
    u = torch.rand(2, 3, k)
    kernel, out = (3, 2, 2)[:k], (4, 3, 2)[:k]
    op = torch.ops.aten.fractional_max_pool2d if k == 2 else torch.ops.aten.fractional_max_pool3d
    wv, wi = op(x, kernel, out, u)
    gv, gi = op(to_n(x), kernel, out, to_n(u))
    assert_within("values", gv, wv.double(), 0)                        # selected: equal, NaN where the CPU's
    assert torch.equal(gi.cpu(), wi)
    pool = F.fractional_max_pool2d if k == 2 else F.fractional_max_pool3d
    xs = torch.randn((1, 2) + (16, 9, 8)[:k])
    samples = torch.tensor([[[0.96, 0.2, 0.5][:k], [0.0, 0.7, 0.33][:k]]])
    check_linear(lambda t: pool(t, 2, output_ratio=(0.5,) * k, _random_samples=samples.to(t.device, t.dtype)), xs,
                 COPY)


def test_adaptive_max_pool3d(strict):
    x = torch.randn(2, 3, 5, 7, 4)
    x[1, 2, 3, 3, 3] = float("nan")
    v, i = F.adaptive_max_pool3d(to_n(x), (2, 3, 3), return_indices=True)
    wv, wi = F.adaptive_max_pool3d(x, (2, 3, 3), return_indices=True)
    assert_within("values", v, wv.double(), 0)                         # selected: equal, NaN where the CPU's
    assert torch.equal(i.cpu(), wi)
    check_linear(lambda t: F.adaptive_max_pool3d(t, (3, 2, 4)), torch.randn(3, 6, 5, 4), COPY)


def _antialiased(mode: str, sizes) -> tuple[int, str]:
    """(roundings, weights) of an antialiased resize: per dim the filter's values at rounded coordinates, divided
    by their sum (at most as many taps as inputs: that many additions, a division) and the product with the
    term; the triangle filter's slope is at most 1, the cubic's 1.35 (its taps' coordinates are scaled down)."""
    return sum(n + 2 for n in sizes), "cubic" if mode == "bicubic" else "linear"


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_antialiased_resize(strict, mode):
    """``_upsample_{bilinear,bicubic}2d_aa`` forward (their backward ops take the CPU fallback)."""
    x = torch.randn(2, 3, 10, 20)
    for kw in (dict(size=(3, 7)), dict(size=(23, 9)), dict(size=(4, 20), align_corners=True),
               dict(scale_factor=(1.7, 0.45))):
        check_linear_forward(lambda t: F.interpolate(t, mode=mode, antialias=True, **kw), x,
                             *_antialiased(mode, x.shape[2:]))


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_antialiased_resize_backward(mode, strict):
    for size in ((5, 5), (12, 3)):
        x = torch.randn(2, 3, 8, 8)
        check_linear(lambda t: F.interpolate(t, size=size, mode=mode, antialias=True), x,
                     *_antialiased(mode, x.shape[2:]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fractional_max_pool_windows_in_half_precision_like_cpu(dtype, strict):
    # the CPU computes the window starts in the input's dtype, rounding every step: the same windows here
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        x = torch.randn(2, 3, 9, 11, generator=g).to(dtype)
        u = torch.rand(2, 3, 2, generator=g).to(dtype)
        want = F.fractional_max_pool2d(x, 2, output_size=(4, 5), _random_samples=u, return_indices=True)
        got = F.fractional_max_pool2d(to_n(x), 2, output_size=(4, 5), _random_samples=to_n(u), return_indices=True)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_bounds_fail_a_unit_in_the_wrong_place(strict):
    # the derived bounds are far below the error of the other corner alignment or a neighbouring element
    x = torch.randn(2, 3, 5, 6)
    with pytest.raises(AssertionError, match="device output"):
        check_linear(lambda t: F.interpolate(t, size=(7, 9), mode="bilinear", align_corners=t.is_neuron), x,
                     *_interp("bilinear", 2))
    with pytest.raises(AssertionError, match="device output"):
        check_linear(lambda t: F.pad(t, (1, 2, 2, 1), mode="reflect" if t.is_neuron else "replicate"), x, COPY)
