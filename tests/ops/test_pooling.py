"""Pooling gradients in bf16/fp16 against an exact reference: overlapping windows' gradients are summed in
fp32 and rounded once, at least as exact as the CPU's."""
import pytest
import torch

from tests.ops.conftest import to_n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [2, 3])
def test_max_pool_gradient_of_overlapping_windows_rounds_once(dtype, dims, strict):
    # kernel 3, stride 1: an input element that is the maximum of up to 3**dims windows receives that many
    # gradients. Rounded once, each element is the exact sum (float64) rounded to the dtype, to within the fp32
    # sum's own rounding (3**dims terms: 27 * 2**-24 relative); summed in the dtype it drifted by several units
    gen = torch.Generator().manual_seed(0)
    shape = (2, 3) + (6,) * dims
    x = torch.randn(shape, generator=gen).to(dtype)
    x[(0, 0) + (2,) * dims] = 10.0                   # one element is the maximum of every window around it
    pool = torch.nn.functional.max_pool2d if dims == 2 else torch.nn.functional.max_pool3d
    _, idx = pool(x.double(), 3, 1, return_indices=True)
    g = (torch.randn(idx.shape, generator=gen) * 100).to(dtype)
    grad = getattr(torch.ops.aten, f"max_pool{dims}d_with_indices_backward")
    args = ([3] * dims, [1] * dims, [0] * dims, [1] * dims, False)
    exact = grad(g.double(), x.double(), *args, idx)
    got = grad(to_n(g), to_n(x), *args, to_n(idx)).cpu()
    assert got.dtype == dtype
    bound = (torch.finfo(dtype).eps / 2 + 3 ** dims * 2.0 ** -24) * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()
    cpu = grad(g, x, *args, idx)                  # (which sums in the dtype: no closer to the exact sum)
    assert ((got.double() - exact).abs() <= (cpu.double() - exact).abs() + bound).all()


NAN, INF = float("nan"), float("inf")
# windows of a 2x2 pooling: ties (the first maximum's index), NaN (the last NaN's index, value NaN), +-inf, -0/+0
WINDOWS = [[1, 3, 3, 2], [5, 5, 5, 5], [1, NAN, 2, NAN], [NAN, 1, NAN, 2], [INF, NAN, INF, 1], [-INF] * 4,
           [-0.0, 0.0, 0.0, -0.0], [INF, INF, -INF, 7], [-INF, -INF, -INF, -3]]
POOL_ARGS = {"2": ((2,), {}), "3_s1_p1": ((3, 1, 1), {}), "3_s2_p1_dil2_ceil": ((3, 2, 1), {"dilation": 2, "ceil_mode": True}),
             "rect": (((2, 3), (1, 2)), {}), "3_s2_p1": ((3, 2, 1), {}), "2_ceil": ((2, 2), {"ceil_mode": True})}


def _assert_pool_like_cpu(x: torch.Tensor, args: tuple, kwargs: dict) -> None:
    want_v, want_i = torch.nn.functional.max_pool2d(x, *args, return_indices=True, **kwargs)
    got_v, got_i = torch.nn.functional.max_pool2d(to_n(x), *args, return_indices=True, **kwargs)
    assert got_i.dtype == torch.int64 and got_v.dtype == x.dtype
    assert torch.equal(got_i.cpu(), want_i)
    # a maximum is selected, not computed: the same bits (the sign of a zero too), NaN where the CPU has NaN
    same = (got_v.cpu() == want_v) & (torch.signbit(got_v.cpu()) == torch.signbit(want_v))
    assert (same | (got_v.cpu().isnan() & want_v.isnan())).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [3, 128])
def test_max_pool2d_ties_nan_and_infinities_like_cpu(dtype, channels, strict):
    # each window alone, then the same values spread over a plane under every geometry (padding, ceil_mode,
    # dilation, a rectangular window): indices of ties and NaN as the CPU's rule picks them; 256 planes run as
    # 2 per partition
    for w in WINDOWS:
        _assert_pool_like_cpu(torch.tensor(w, dtype=dtype).view(1, 1, 2, 2), (2,), {})
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (2, channels, 9, 11), generator=gen).to(dtype)   # many ties
    flat = x.view(-1)
    picks = torch.randperm(flat.numel(), generator=gen)
    flat[picks[:12]] = NAN
    flat[picks[12:20]] = INF
    flat[picks[20:28]] = -INF
    flat[picks[28:34]] = torch.finfo(dtype).max
    x[1, 1] = -INF                                                            # a plane of -inf: first element inside
    for args, kwargs in POOL_ARGS.values():
        _assert_pool_like_cpu(x, args, kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_max_pool3d_ties_nan_and_infinities_like_cpu(dtype, strict):
    # 3-D pooling takes the window gather and argmax route: the CPU's rule for NaN (its last NaN's index) and
    # for windows of -inf overlapping the padding (their first element inside the input), as in 2-D
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-2, 3, (2, 3, 5, 6, 7), generator=gen).to(dtype)       # many ties
    flat = x.view(-1)
    picks = torch.randperm(flat.numel(), generator=gen)
    flat[picks[:20]] = NAN
    flat[picks[20:30]] = INF
    flat[picks[30:40]] = -INF
    x[1, 1] = -INF                                                            # a volume of -inf
    for args, kwargs in [((2,), {}), ((3, 1, 1), {}), ((3, 2, 1), {"dilation": 2, "ceil_mode": True}), ((3, 2, 1), {})]:
        want_v, want_i = torch.nn.functional.max_pool3d(x, *args, return_indices=True, **kwargs)
        got_v, got_i = torch.nn.functional.max_pool3d(to_n(x), *args, return_indices=True, **kwargs)
        assert torch.equal(got_i.cpu(), want_i)
        same = (got_v.cpu() == want_v) & (torch.signbit(got_v.cpu()) == torch.signbit(want_v))
        assert (same | (got_v.cpu().isnan() & want_v.isnan())).all()


def test_max_pool2d_many_planes_and_bands_like_cpu(strict):
    # more planes than partitions (150: two tiles) and rows too wide for more than one output row per band
    gen = torch.Generator().manual_seed(1)
    _assert_pool_like_cpu(torch.randn(3, 50, 20, 33, generator=gen), (3, 2, 1), {})
    _assert_pool_like_cpu(torch.randn(1, 3, 9, 2500, generator=gen), (3, 2, 1), {})
    _assert_pool_like_cpu(torch.randn(3, 7, 12, generator=gen), (2,), {})    # unbatched


def test_max_pool2d_is_one_launch(strict):
    from torchneuron.runtime import profiler
    x = to_n(torch.randn(4, 8, 16, 16))
    with profiler.record() as recs:
        torch.nn.functional.max_pool2d(x, 2, return_indices=True)
    assert [r.name for r in recs] == ["max_pool2d_kernel"]


# (kernel, stride, padding, dilation, ceil_mode): POOL_ARGS's geometries spelled out
GRAD_GEOMETRIES = [([2, 2], [2, 2], [0, 0], [1, 1], False), ([3, 3], [1, 1], [1, 1], [1, 1], False),
                   ([3, 3], [2, 2], [1, 1], [2, 2], True), ([2, 3], [1, 2], [0, 0], [1, 1], False),
                   ([3, 3], [2, 2], [1, 1], [1, 1], False), ([2, 2], [2, 2], [0, 0], [1, 1], True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("planes", [6, 150, 256, 131])
def test_max_pool2d_gradient_like_float64(planes, dtype, strict):
    # one launch under every geometry (disjoint and overlapping windows, padding, ceil_mode, dilation): each output's
    # gradient lands at its index, overlapping windows' gradients summed in fp32 and rounded once (K <= 9 terms:
    # within half an ulp of the dtype plus K fp32 roundings of the float64 sum); an inf or NaN gradient reaches only
    # its own index. Planes: fewer than the partitions, 2 per partition (150, 256), and 131 (one per partition, two
    # tiles)
    from torchneuron.runtime import profiler
    gen = torch.Generator().manual_seed(planes)
    x = torch.randint(-2, 3, (1, planes, 9, 11), generator=gen).to(dtype)     # ties: the first maximum's index
    x.view(-1)[torch.randperm(x.numel(), generator=gen)[:10]] = NAN
    grad = torch.ops.aten.max_pool2d_with_indices_backward
    for k, s, p, d, ceil in GRAD_GEOMETRIES:
        _, idx = torch.nn.functional.max_pool2d(x, k, s, p, d, ceil, return_indices=True)
        g = torch.randn(idx.shape, generator=gen).to(dtype)
        g.view(-1)[torch.randperm(g.numel(), generator=gen)[:6]] = torch.tensor([INF, -INF, NAN] * 2, dtype=dtype)
        with profiler.record() as recs:
            got = grad(to_n(g), to_n(x), k, s, p, d, ceil, to_n(idx)).cpu()
        assert [r.name for r in recs] == ["max_pool2d_backward_kernel"]
        exact = grad(g.double(), x.double(), k, s, p, d, ceil, idx)
        terms = grad(g.double().abs().nan_to_num(0, 0, 0), x.double(), k, s, p, d, ceil, idx)
        assert got.dtype == dtype and got.shape == x.shape
        for f in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(f(got), f(exact.to(dtype)))
        fin = exact.isfinite()
        bound = (torch.finfo(dtype).eps / 2) * exact.abs() + 9 * 2.0 ** -24 * terms
        assert ((got.double() - exact).abs()[fin] <= bound[fin]).all()


def test_max_pool_argument_checks_are_cached_per_signature_and_still_raise(strict):
    # the meta kernel's checks run once per (shapes, strides, dtypes, arguments); a bad call is never cached: it raises
    # the CPU's error every time, also after a good call with the same tensors
    from torchneuron.ops.base import _meta_run_signature
    x = torch.randn(2, 3, 8, 8)
    _meta_run_signature.cache_clear()
    for _ in range(3):
        v, i = torch.nn.functional.max_pool2d(to_n(x), 2, return_indices=True)
        assert torch.equal(i.cpu(), torch.nn.functional.max_pool2d(x, 2, return_indices=True)[1])
    assert _meta_run_signature.cache_info().misses == 1
    for _ in range(2):
        for t in (x, to_n(x)):
            with pytest.raises(RuntimeError, match="pad should be at most half of effective kernel size"):
                torch.nn.functional.max_pool2d(t, 2, padding=2)
    # a strided input is another signature: checked (and run) on its own
    xt = x.transpose(2, 3)
    assert torch.equal(torch.nn.functional.max_pool2d(to_n(xt), 2).cpu(), torch.nn.functional.max_pool2d(xt, 2))
