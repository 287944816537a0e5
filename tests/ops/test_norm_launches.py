"""``native_layer_norm`` in eager mode: one launch, its saved statistics returned in the input's dtype as on the
CPU (rounded once from fp32 by the kernel's store)."""
import pytest
import torch

from tests.ops.conftest import to_n
from torchneuron.runtime import profiler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [700, 5003])   # the one-pass and the multi-pass paths
def test_layer_norm_is_one_launch_with_statistics_like_cpu(D, dtype, strict):
    torch.manual_seed(0)
    x = (torch.randn(300, D) * 3 + 5).to(dtype)
    w, b = torch.randn(D).to(dtype), torch.randn(D).to(dtype)
    xn, wn, bn = to_n(x), to_n(w), to_n(b)
    with profiler.record() as recs:
        got = torch.native_layer_norm(xn, [D], wn, bn, 1e-5)
    assert [r.name for r in recs] == ["layer_norm_kernel"]
    # float64 statistics of the same rounded input, rounded once to the dtype: within its eps and the fp32
    # statistics' error (a random walk over D terms)
    xd = x.double()
    mean, rstd = xd.mean(-1, keepdim=True), (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    eps = torch.finfo(dtype).eps
    bound = eps + 8 * D ** 0.5 * torch.finfo(torch.float32).eps
    for t, ref in ((got[1], mean), (got[2], rstd)):
        assert t.dtype == dtype and t.shape == (300, 1)
        assert bool(((t.cpu().double() - ref).abs() <= bound * ref.abs()).all())


def _composed_norm(x: torch.Tensor) -> torch.Tensor:
    """The 2-norm as the separate launches compute it: |x| (in fp32 for 2-byte floats), its square, the whole sum,
    the square root, rounded to x's dtype."""
    a = x.abs().float()
    return (a * a).sum().sqrt().to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(), (1,), (129,), (128 * 40 + 3,), (7, 300), (2, 3, 64)])
def test_whole_tensor_two_norm_is_one_launch(shape, dtype, strict):
    # gradient clipping's total norm: squares, sum and square root in one launch, bit for bit what the separate
    # launches give (the same fp32 arithmetic in the same order), and within the float64 norm's bound: n fp32
    # roundings of the sum of squares (a relative n * u) plus the rounding to the dtype
    torch.manual_seed(1)
    x = (torch.randn(shape) * 3).to(dtype)
    xn = to_n(x)
    with profiler.record() as recs:
        got = torch.linalg.vector_norm(xn)
        kept = torch.linalg.vector_norm(xn, 2, keepdim=True)
    assert [r.name for r in recs] == ["norm2_kernel"] * 2
    assert got.shape == () and kept.shape == (1,) * x.dim() and got.dtype == kept.dtype == dtype
    assert torch.equal(got.cpu(), _composed_norm(xn).cpu()) and torch.equal(kept.cpu().reshape(()), got.cpu())
    exact = torch.linalg.vector_norm(x.double())
    bound = (x.numel() * 2.0 ** -24 + torch.finfo(dtype).eps / 2) * exact
    assert abs(got.cpu().double() - exact) <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_whole_tensor_two_norm_edges_match_cpu(dtype, strict):
    # zeros of both signs, infinities, NaN beside -inf, squares past fp16's 65504 (the CPU's fp32 sum, then inf on
    # the rounding to fp16), squares under fp32's smallest normal; a transposed view is made dense first
    cases = [[0.0, -0.0], [-float("inf"), 1.0], [-float("inf"), float("nan")], [65504.0, 65504.0], [1e-30, -1e-30]]
    for values in cases:
        x = torch.tensor(values).to(dtype)
        got, want = torch.linalg.vector_norm(to_n(x)).cpu(), torch.linalg.vector_norm(x)
        assert (got.isnan() and want.isnan()) or torch.equal(got, want), (values, got, want)
    x = torch.randn(40, 33).to(dtype)
    with profiler.record() as recs:
        got = torch.linalg.vector_norm(to_n(x).t())
    assert [r.name for r in recs][-1] == "norm2_kernel" and torch.equal(got.cpu(), _composed_norm(to_n(x)).cpu())


def test_other_two_norms_and_bad_input_match_cpu(strict):
    # a norm over some dims keeps the reduction launches; an integer input raises the CPU's error
    x = torch.randn(6, 50)
    torch.testing.assert_close(torch.linalg.vector_norm(to_n(x), 2, -1).cpu(), torch.linalg.vector_norm(x, 2, -1))
    with pytest.raises(RuntimeError) as cpu:
        torch.linalg.vector_norm(torch.ones(3, dtype=torch.int32))
    with pytest.raises(type(cpu.value), match="floating point"):
        torch.linalg.vector_norm(to_n(torch.ones(3, dtype=torch.int32)))


def test_a_repeated_layer_norm_launches_its_plan(strict, monkeypatch):
    # the second forward and backward at one signature bind their tensors to the planned programs (no trace, no
    # views): other values, the same bits as the first path computes for them, the CPU's values; another shape at the
    # same call site, a two-dim normalized shape and a missing weight are signatures of their own
    from torchneuron.ops import nn as nn_ops
    torch.manual_seed(3)

    def run(x, w, b, shape):
        xn = to_n(x).requires_grad_()
        y = torch.nn.functional.layer_norm(xn, shape, None if w is None else to_n(w), None if b is None else to_n(b))
        y.backward(to_n(torch.ones_like(x) * 0.5 + x))
        return y.detach().cpu(), xn.grad.cpu()

    cases = [((6, 5, 16), (16,), True), ((3, 16), (16,), True), ((6, 4, 8), (4, 8), True), ((5, 16), (16,), False)]
    first = {}
    for shape, norm, affine in cases:
        x = torch.randn(shape)
        w, b = (torch.randn(norm), torch.randn(norm)) if affine else (None, None)
        first[shape] = (x, w, b, run(x, w, b, norm))
    monkeypatch.setattr(nn_ops, "traced_kernel", None)       # a second trace would fail
    for shape, norm, affine in cases:
        x, w, b, (y1, g1) = first[shape]
        y2, g2 = run(x, w, b, norm)
        assert torch.equal(y1, y2) and torch.equal(g1, g2)   # the planned launches give the first path's bits
        xc = x.clone().requires_grad_()
        yc = torch.nn.functional.layer_norm(xc, norm, w, b)
        yc.backward(torch.ones_like(x) * 0.5 + x)
        torch.testing.assert_close(y2, yc.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g2, xc.grad, atol=1e-4, rtol=1e-4)


def test_a_planned_layer_norm_refuses_a_wrong_weight_like_cpu(strict):
    x, w = torch.randn(4, 16), torch.randn(16)
    torch.native_layer_norm(to_n(x), [16], to_n(w), to_n(w), 1e-5)            # the plan of this signature
    with pytest.raises(RuntimeError) as cpu:
        torch.native_layer_norm(x, [16], torch.randn(15), w, 1e-5)
    with pytest.raises(type(cpu.value)):
        torch.native_layer_norm(to_n(x), [16], to_n(torch.randn(15)), to_n(w), 1e-5)
