"""Vector products, trace, roll, equal, norm, 2-D nll_loss and max_unpool run on the device (strict
mode) and match the CPU; bad arguments raise the CPU's errors."""
import re

import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import assert_raises_like_cpu, to_n

torch.manual_seed(0)
A, B = torch.randn(37), torch.randn(37)
M, V, S = torch.randn(9, 37), torch.randn(37), torch.randn(9)
X4, T3 = torch.randn(2, 5, 3, 4), torch.randint(0, 5, (2, 3, 4))
T3[0, 0, 0] = -100
POOLED, IDX = F.max_pool2d(torch.randn(2, 3, 8, 8), 2, return_indices=True)
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _addmv_out(s, m, v):
    out = torch.empty(0, device=s.device)
    torch.addmv(s, m, v, beta=0.5, alpha=2, out=out)
    return out


def _ce_grad(reduction):
    def grad(x, t, w):
        x = x.detach().requires_grad_()
        y = F.cross_entropy(x, t, w, reduction=reduction)
        return torch.autograd.grad(y, x, torch.ones_like(y))[0]
    return grad


def _loss_grad(fn, a, b, **kw):
    a = a.detach().requires_grad_()
    return torch.autograd.grad(fn(a, b, **kw), a)[0]


CASES = {
    "dot": (torch.dot, A, B), "dot_strided": (lambda a, b: torch.dot(a[::2], b[::2]), A, B), "vdot": (torch.vdot, A, B),
    "mv": (torch.mv, M, V), "mv_t": (lambda m, v: torch.mv(m.t(), v), M.t().contiguous(), V),
    "vecmat": (torch.matmul, S, M), "addmv": (torch.addmv, S, M, V), "addmv_out": (_addmv_out, S, M, V),
    "addmv_beta0_nan": (lambda s, m, v: torch.addmv(s, m, v, beta=0), torch.full((9,), float("nan")), M, V),
    "addmv_": (lambda s, m, v: s.clone().addmv_(m, v), S, M, V),
    "trace": (torch.trace, torch.randn(5, 7)),
    "roll": (lambda t: torch.roll(t, 2), M), "roll_dims": (lambda t: torch.roll(t, (1, -3), (0, 1)), M),
    "roll_int32": (lambda t: torch.roll(t, 1, 0), torch.arange(6, dtype=torch.int32).reshape(3, 2)),
    "fftshift": (torch.fft.fftshift, M),
    "norm": (lambda t: torch.norm(t, dim=1), M), "norm_p3": (lambda t: torch.norm(t, 3, (0, 1), True), M),
    "dist": (torch.dist, M, M.flip(0)),
    "nll2d_mean": (F.nll_loss, X4, T3), "nll2d_none": (lambda x, t: F.nll_loss(x, t, reduction="none"), X4, T3),
    "ce2d_sum_w": (lambda x, t, w: F.cross_entropy(x, t, w, reduction="sum"), X4, T3, torch.rand(5)),
    "ce2d_grad_mean": (_ce_grad("mean"), X4, T3, torch.rand(5)),
    "ce2d_grad_none": (_ce_grad("none"), X4, T3, None),
    "unpool2d": (lambda p, i: F.max_unpool2d(p, i, 2), POOLED, IDX),
    "unpool2d_3d": (lambda p, i: F.max_unpool2d(p, i, 2), POOLED[0], IDX[0]),
    "smooth_l1": (lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), M, M.flip(0) * 2),
    "huber_none": (lambda a, b: F.huber_loss(a, b, reduction="none", delta=0.7), M, M.flip(0) * 2),
    "smooth_l1_grad": (lambda a, b: _loss_grad(F.smooth_l1_loss, a, b, beta=0.5), M, M.flip(0) * 2),
    "huber_grad_sum": (lambda a, b: _loss_grad(F.huber_loss, a, b, reduction="sum", delta=0.7), M, M.flip(0) * 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_cpu(name, strict):
    fn, *args = CASES[name]
    got = fn(*[to_n(a) if isinstance(a, torch.Tensor) else a for a in args]).cpu()
    torch.testing.assert_close(got, fn(*args), **TOL)


def test_equal(strict):
    nan = torch.tensor([1.0, float("nan")])
    for x, y in ((A, A.clone()), (A, B), (A, A[:5]), (nan, nan.clone()), (A[:0], B[:0])):
        assert torch.equal(to_n(x), to_n(y)) == torch.equal(x, y)


@pytest.mark.parametrize("call", [
    lambda n: torch.dot(n(A), n(A[:3])), lambda n: torch.dot(n(M), n(M)), lambda n: torch.mv(n(M), n(S)),
    lambda n: torch.trace(n(A)), lambda n: torch.roll(n(M), (1, 2), (0,)), lambda n: torch.roll(n(M), 1, 5),
    lambda n: F.nll_loss(n(X4), n(torch.full((2, 3, 4), 7))), lambda n: F.nll_loss(n(X4), n(T3[:, 0])),
    lambda n: F.huber_loss(n(A), n(B), delta=0.0), lambda n: F.smooth_l1_loss(n(A), n(B), beta=-1.0),
])
def test_errors_match_cpu(call, strict):
    assert_raises_like_cpu(call)


def test_unpool_bad_index(strict):
    # which invalid index the CPU names depends on its threads (planes run in parallel): compare the rest
    with pytest.raises(RuntimeError) as cpu:
        F.max_unpool2d(POOLED, IDX + 100, 2)
    with pytest.raises(RuntimeError) as dev:
        F.max_unpool2d(to_n(POOLED), to_n(IDX + 100), 2)
    assert re.sub(r"\d+ \(", "N (", str(dev.value)) == re.sub(r"\d+ \(", "N (", str(cpu.value))


def test_cross_and_batch_norm_variants(strict):
    a, b = torch.randn(4, 3), torch.randn(1, 3)
    torch.testing.assert_close(torch.linalg.cross(a.to("neuron"), b.to("neuron")).cpu(), torch.linalg.cross(a, b))
    with pytest.raises(IndexError):
        torch.linalg.cross(a.to("neuron"), a.to("neuron"), dim=2)
    x = torch.randn(4, 3, 5)
    for fn in (lambda t, rm, rv: torch.ops.aten._native_batch_norm_legit(t, None, None, rm, rv, True, 0.1, 1e-5),
               lambda t, rm, rv: torch.ops.aten._batch_norm_with_update(t, None, None, rm, rv, 0.1, 1e-5)[:3]):
        rm, rv = torch.zeros(3), torch.ones(3)
        rmn, rvn = rm.to("neuron"), rv.to("neuron")
        got, want = fn(x.to("neuron"), rmn, rvn), fn(x, rm, rv)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rmn.cpu(), rm, atol=1e-6, rtol=1e-5)      # running stats updated in place


def test_empty_inputs_stay_on_the_device(strict):
    e = torch.randn(0, 5)
    n = e.to("neuron")
    for fn in (lambda t: torch.nn.functional.layer_norm(t, (5,)), lambda t: t.std(), lambda t: t.var(0),
               lambda t: t.index_select(1, torch.tensor([4, 0], device=t.device)), lambda t: t.softmax(1),
               lambda t: t.sum(0), lambda t: t.mean(1)):
        torch.testing.assert_close(fn(n).cpu(), fn(e), equal_nan=True)
    torch.testing.assert_close(torch.cat([torch.tensor([], device="neuron")] * 2).cpu(), torch.cat([torch.tensor([])] * 2))


def test_shuffle_indices_repeats_renorm(strict):
    x = torch.randn(2, 6, 3, 3)
    torch.testing.assert_close(F.channel_shuffle(x.to("neuron"), 3).cpu(), F.channel_shuffle(x, 3))
    for fn in (torch.tril_indices, torch.triu_indices):
        torch.testing.assert_close(fn(4, 5, 1, device="neuron").cpu(), fn(4, 5, 1))
    r = torch.tensor([2, 0, 3])
    torch.testing.assert_close(torch.repeat_interleave(r.to("neuron")).cpu(), torch.repeat_interleave(r))
    y = torch.randn(4, 5) * 3
    torch.testing.assert_close(torch.renorm(y.to("neuron"), 2, 0, 1.5).cpu(), torch.renorm(y, 2, 0, 1.5),
                               atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="at least 2 dimensions"):
        torch.renorm(torch.ones(3, device="neuron"), 2, 0, 1.0)


def test_angle_isin(strict):
    for x in (torch.tensor([-0.0, float("nan"), -float("inf"), 3, -1e-30]),
              torch.tensor([1, -2, 0], dtype=torch.int32)):
        torch.testing.assert_close(torch.angle(to_n(x)).cpu(), torch.angle(x), equal_nan=True)
    pairs = [(torch.tensor([1.0, 2, 3, float("nan")]), torch.tensor([2, 3, float("nan")])),
             (torch.tensor([[1, 2], [3, 2 ** 40]]), torch.tensor([2.5, 3.0])),
             (torch.tensor([1, 2 ** 40, 5]), torch.tensor([2 ** 40 + 1, 5])),
             (torch.tensor([1, 2, 3], dtype=torch.uint8), 3), (3, torch.tensor([1, 2, 3], dtype=torch.uint8)),
             (torch.arange(4.0), torch.empty(0))]
    for a, b in pairs:
        for invert in (False, True):
            got = torch.isin(to_n(a) if isinstance(a, torch.Tensor) else a,
                             to_n(b) if isinstance(b, torch.Tensor) else b, invert=invert)
            assert got.device.type == "neuron"
            assert torch.equal(got.cpu(), torch.isin(a, b, invert=invert))
    with pytest.raises(RuntimeError, match="Unsupported input type encountered for isin"):
        torch.isin(to_n(torch.tensor([True])), to_n(torch.tensor([True])))


@pytest.mark.parametrize("rows", [[[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], [[1, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]],
                                  [[0, 0, 0, 0]] * 3, [[0, 1, 1, 1]] * 3])
def test_transformer_mask_left_aligned_check(rows, strict):
    # nn.Transformer's fast-path test of its padding mask, decided on the device like on the CPU
    op = torch.ops.aten._nested_tensor_from_mask_left_aligned
    t, m = torch.randn(3, 4, 2), torch.tensor(rows).bool()
    assert op(to_n(t), to_n(m)) == op(t, m)


def test_transformer_mask_left_aligned_errors():
    op = torch.ops.aten._nested_tensor_from_mask_left_aligned
    t, m = torch.randn(3, 4, 2), torch.ones(3, 4, dtype=torch.bool)
    for args in ((t, m.float()), (t, m[0]), (t[0], m), (t, m[:2])):
        with pytest.raises(RuntimeError) as cpu:
            op(*args)
        with pytest.raises(RuntimeError) as dev:
            op(*(to_n(a) for a in args))
        assert str(dev.value) == str(cpu.value)
