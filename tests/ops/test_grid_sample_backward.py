"""``grid_sampler_{2,3}d_backward`` on the device against CPU autograd: every mode, padding rule and
``align_corners``, grids reaching beyond [-1, 1], and the ``output_mask`` argument (strict: no fallback)."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import to_n


def _grads(x: torch.Tensor, g: torch.Tensor, go: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(input grad, grid grad) of ``F.grid_sample`` on the device of the operands, returned on the CPU."""
    x = x.detach().requires_grad_()
    g = g.detach().requires_grad_()
    F.grid_sample(x, g, **kw).backward(go)
    return x.grad.cpu(), g.grad.cpu()


def _check(x: torch.Tensor, g: torch.Tensor, **kw) -> None:
    go = torch.randn(F.grid_sample(x, g, **kw).shape)
    want = _grads(x, g, go, **kw)
    got = _grads(to_n(x), to_n(g), to_n(go), **kw)
    for w, r in zip(want, got):
        torch.testing.assert_close(r, w, atol=2e-5, rtol=1e-5)


SHAPES = {2: [((2, 3, 5, 7), (2, 6, 4)), ((1, 2, 1, 9), (1, 3, 5)), ((3, 1, 4, 4), (3, 1, 1))],
          3: [((2, 3, 4, 5, 3), (2, 3, 2, 4)), ((1, 2, 1, 3, 6), (1, 2, 2, 2))]}
CASES = [(k, mode, padding, shape) for k, modes in ((2, ("bilinear", "nearest", "bicubic")), (3, ("bilinear", "nearest")))
         for mode in modes for padding in ("zeros", "border", "reflection") for shape in SHAPES[k]]


@pytest.mark.parametrize("k,mode,padding,shape", CASES)
def test_grid_sample_backward(strict, k, mode, padding, shape):
    xs, gs = shape
    x = torch.randn(xs)
    g = torch.rand(*gs, k) * 3.2 - 1.6                     # points outside [-1, 1] too
    for align in (False, True):
        _check(x, g, mode=mode, padding_mode=padding, align_corners=align)


@pytest.mark.parametrize("k", [2, 3])
def test_grid_sample_backward_output_mask(strict, k):
    """Input grad off: undefined, as on the CPU; the grid grad is computed whatever its mask says."""
    op = torch.ops.aten.grid_sampler_2d_backward if k == 2 else torch.ops.aten.grid_sampler_3d_backward
    x = torch.randn((2, 3) + (4, 5, 3)[:k])
    g = torch.rand((2,) + (3, 2, 4)[:k] + (k,)) * 3 - 1.5
    go = torch.randn((2, 3) + (3, 2, 4)[:k])
    for mask in ([True, False], [False, True], [True, True]):
        want = op(go, x, g, 0, 1, False, mask)
        got = op(to_n(go), to_n(x), to_n(g), 0, 1, False, mask)
        assert (got[0] is None) == (want[0] is None)
        if want[0] is not None:
            torch.testing.assert_close(got[0].cpu(), want[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got[1].cpu(), want[1], atol=2e-5, rtol=1e-5)


def test_grid_sample_backward_errors_like_cpu(strict):
    aten = torch.ops.aten
    calls = [(aten.grid_sampler_2d_backward, (2, 1, 2, 2), (2, 1, 3, 3), (1, 2, 2, 2), 0),  # batch sizes differ
             (aten.grid_sampler_2d_backward, (1, 1, 2, 2), (1, 1, 3, 3), (1, 2, 2, 3), 0),  # coordinate count
             (aten.grid_sampler_3d_backward, (1, 1, 2, 2, 2), (1, 1, 3, 3, 3), (1, 2, 2, 2, 3), 2),  # 3-D bicubic
             (aten.grid_sampler_2d_backward, (1, 1, 2, 2), (1, 1, 0, 3), (1, 2, 2, 2), 0)]  # empty spatial dim
    for op, gos, shape, gshape, mode in calls:
        with pytest.raises(Exception) as cpu:
            op(torch.zeros(gos), torch.zeros(shape), torch.zeros(gshape), mode, 0, False, [True, True])
        with pytest.raises(type(cpu.value)) as dev:
            op(to_n(torch.zeros(gos)), to_n(torch.zeros(shape)), to_n(torch.zeros(gshape)), mode, 0, False,
               [True, True])
        assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_grid_sample_backward_many_passes(strict, mode):
    """More points than one pass holds (and a non-contiguous ``grad_output`` layout on the device)."""
    x = torch.randn(2, 3, 9, 11)
    g = torch.rand(2, 130, 140, 2) * 3 - 1.5
    go = torch.randn(2, 3, 130, 140)
    kw = dict(mode=mode, padding_mode="reflection", align_corners=False)
    want = _grads(x, g, go, **kw)
    got = _grads(to_n(x), to_n(g), to_n(go.transpose(2, 3).contiguous()).transpose(2, 3), **kw)
    for w, r in zip(want, got):
        torch.testing.assert_close(r, w, atol=1e-4, rtol=1e-5)


def test_one_hot_work_beyond_the_limit_takes_the_counted_fallback():
    # (N*S + 1) * N*P * 8 = (2*8000 + 1) * 2*2048 * 8 > ONEHOT_WORK_LIMIT: the CPU fallback, counted, and the CPU's
    # gradients exactly (its own kernel)
    import torchneuron
    from torchneuron.ops.sampling_grid_backward import ONEHOT_WORK_LIMIT

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 20, 20, 20, generator=gen)
    grid = torch.rand(2, 8, 16, 16, 3, generator=gen) * 2 - 1
    assert (2 * 8000 + 1) * 2 * 2048 * 8 > ONEHOT_WORK_LIMIT
    g = torch.randn(2, 2, 8, 16, 16, generator=gen)
    want = torch.ops.aten.grid_sampler_3d_backward(g, x, grid, 0, 0, False, [True, True])
    before = torchneuron.fallback_counts().get("aten::grid_sampler_3d_backward", 0)
    got = torch.ops.aten.grid_sampler_3d_backward(to_n(g), to_n(x), to_n(grid), 0, 0, False, [True, True])
    assert torchneuron.fallback_counts().get("aten::grid_sampler_3d_backward", 0) == before + 1
    for a, e in zip(got, want):
        assert torch.equal(a.cpu(), e)
