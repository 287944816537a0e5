"""The CPU fallback: ops with no neuron kernel run on the CPU and must give CPU's answers.

Every test runs the same code on CPU tensors and on neuron copies and compares; the
fallback's bookkeeping (one warning per op, counts, strict mode) is checked against
what the contract says.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchneuron

# Every op here falls back and warns once: noise, except in the warning tests,
# which install their own filter.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N = "neuron"


def _has_neuron_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "PrivateUse1")


def _require_fallback(op: str) -> None:
    """The test exercises the fallback through ``op``: skip if it ever gets a kernel."""
    if _has_neuron_kernel(op):
        pytest.skip(f"{op} now has a neuron kernel; pick another op without one")


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(e, device) for e in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _assert_same(cpu_result, neuron_result, **tol):
    """neuron_result is on neuron and equals cpu_result (dtype, shape, values)."""
    if isinstance(cpu_result, torch.Tensor):
        assert isinstance(neuron_result, torch.Tensor), type(neuron_result)
        assert neuron_result.device.type == "neuron", f"result on {neuron_result.device}"
        torch.testing.assert_close(neuron_result.cpu(), cpu_result, equal_nan=True, **tol)
    elif isinstance(cpu_result, (list, tuple)):
        assert len(cpu_result) == len(neuron_result)
        for c, n in zip(cpu_result, neuron_result):
            _assert_same(c, n, **tol)
    else:
        assert cpu_result == neuron_result


def _run_both(fn, *args, **tol):
    """Run ``fn`` on CPU args and on neuron copies of them; compare results and args."""
    cpu_args = [_to(a, "cpu") for a in args]
    neuron_args = [_to(a, N) for a in args]
    expected = fn(*cpu_args)
    got = fn(*neuron_args)
    _assert_same(expected, got, **tol)
    _assert_same(cpu_args, neuron_args, **tol)   # in-place effects on the inputs
    return expected, got


def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return e
    return None


@pytest.fixture(autouse=True)
def _not_strict():
    assert not torchneuron.is_strict(), "strict mode leaked from another test"
    yield
    torchneuron.set_strict(False)


def _base():
    return torch.arange(20.0).reshape(4, 5)


# ---- in-place ops on views ---------------------------------------------------

VIEW_INPLACE = {
    "row.add_": lambda a: a[1].add_(1),
    "col.mul_": lambda a: a[:, 0].mul_(2),
    "transpose.sub_": lambda a: a.t().sub_(torch.arange(4.0, device=a.device)),
    "strided.zero_": lambda a: a[::2, 1::2].zero_(),
    "diagonal.fill_": lambda a: a.diagonal().fill_(-1),
    "narrow.clamp_": lambda a: a.narrow(1, 1, 3).clamp_(max=5),
    "view.pow_": lambda a: a.view(-1)[3:9].pow_(2),
    "expand_src.copy_": lambda a: a[2].copy_(torch.tensor(7.0, device=a.device).expand(5)),
    "row.addcmul_": lambda a: a[3].addcmul_(a[0], a[1], value=0.5),
    "masked_fill_": lambda a: a[:, 2:].masked_fill_(a[:, 2:] > 10, 0),
}


@pytest.mark.parametrize("name", list(VIEW_INPLACE))
def test_inplace_op_on_view_updates_base(name):
    fn = VIEW_INPLACE[name]
    cpu, neuron = _base(), _base().to(N)
    out_cpu = fn(cpu)
    out_neuron = fn(neuron)
    torch.testing.assert_close(neuron.cpu(), cpu)
    torch.testing.assert_close(out_neuron.cpu(), out_cpu)
    # The in-place op returns the view itself, still aliasing the base.
    assert out_neuron.untyped_storage().data_ptr() == neuron.untyped_storage().data_ptr()


def test_inplace_on_view_seen_through_other_views():
    a = torch.zeros(3, 4, device=N)
    col, row = a[:, 1], a[2]
    col.add_(5)
    assert row.cpu().tolist() == [0.0, 5.0, 0.0, 0.0]
    assert a.cpu().sum().item() == 15.0


# ---- out= ----------------------------------------------------------------------


def test_out_of_the_right_size():
    x, y = torch.randn(3, 4), torch.randn(4, 2)
    out = torch.empty(3, 2, device=N)
    r = torch.mm(x.to(N), y.to(N), out=out)
    assert r is out
    torch.testing.assert_close(out.cpu(), x @ y)


@pytest.mark.parametrize("call", [
    lambda x, y, out: torch.mm(x, y, out=out),
    lambda x, y, out: torch.add(x @ y, 1.5, out=out),
    lambda x, y, out: torch.cat([x, y.t()], out=out),
    lambda x, y, out: torch.sum(x, dim=0, out=out),
    lambda x, y, out: torch.matmul(x, y, out=out),
], ids=["mm", "add", "cat", "sum", "matmul"])
def test_out_of_size_zero_is_resized(call):
    x, y = torch.randn(3, 4), torch.randn(4, 2)
    expected = call(x, y, torch.empty(0))
    out = torch.empty(0, device=N)
    r = call(x.to(N), y.to(N), out)
    assert r is out
    assert out.shape == expected.shape and out.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), expected)


def test_out_of_wrong_nonzero_size_is_resized_with_cpus_warning():
    x, y = torch.randn(3, 4), torch.randn(4, 2)
    with warnings.catch_warnings(record=True) as cpu_w:
        warnings.simplefilter("always")
        torch.mm(x, y, out=torch.empty(5, 5))
    with warnings.catch_warnings(record=True) as neuron_w:
        warnings.simplefilter("always")
        out = torch.empty(5, 5, device=N)
        torch.mm(x.to(N), y.to(N), out=out)
    assert out.shape == (3, 2)
    torch.testing.assert_close(out.cpu(), x @ y)
    resized = [str(w.message) for w in neuron_w if "resized" in str(w.message)]
    assert len(resized) == len([w for w in cpu_w if "resized" in str(w.message)]) == 1


def test_out_into_noncontiguous_view():
    x, y = torch.randn(3, 4), torch.randn(4, 3)
    big_cpu, big = torch.zeros(3, 3), torch.zeros(3, 3, device=N)
    torch.mm(x, y, out=big_cpu.t())
    torch.mm(x.to(N), y.to(N), out=big.t())
    torch.testing.assert_close(big.cpu(), big_cpu)


def test_out_tuple_returns():
    x = torch.randn(4, 6)
    vals, idx = torch.empty(0, device=N), torch.empty(0, dtype=torch.long, device=N)
    r = torch.max(x.to(N), dim=1, out=(vals, idx))
    assert r[0] is vals and r[1] is idx
    ev, ei = torch.max(x, dim=1)
    torch.testing.assert_close(vals.cpu(), ev)
    assert torch.equal(idx.cpu(), ei)


def test_out_of_wrong_dtype_raises_like_cpu():
    x = torch.randn(3, 3)
    cpu_err = _error_of(lambda: torch.mm(x, x, out=torch.empty(0, dtype=torch.long)))
    out = torch.empty(0, dtype=torch.long, device=N)
    with pytest.raises(type(cpu_err)) as info:
        torch.mm(x.to(N), x.to(N), out=out)
    assert str(info.value).split("\n")[0] == str(cpu_err).split("\n")[0]
    assert out.shape == (0,)


# ---- scalars, lists, tuples, optional args --------------------------------------


@pytest.mark.parametrize("fn", [
    lambda a: a + 2,
    lambda a: 3.5 * a,
    lambda a: torch.add(a, 3, alpha=2),
    lambda a: torch.pow(2, a),
    lambda a: a ** 0.5,
    lambda a: torch.where(a > 0, a, 0.25),
    lambda a: torch.clamp(a, -0.5, 0.5),
    lambda a: a.fill_(3.25),
    lambda a: torch.full_like(a, -1.5),
    lambda a: torch.lerp(a, a.flip(0), 0.3),
    lambda a: a.div(2, rounding_mode="floor"),
], ids=["add", "rmul", "alpha", "rpow", "pow", "where", "clamp", "fill_", "full_like", "lerp", "div_floor"])
def test_python_scalar_arguments(fn):
    _run_both(fn, torch.randn(5, 3).abs())


@pytest.mark.parametrize("fn", [
    lambda a, b: torch.cat([a, b]),
    lambda a, b: torch.cat([a, b], dim=1),
    lambda a, b: torch.stack([a, b, a]),
    lambda a, b: torch.stack([a, b], dim=-1),
    lambda a, b: torch.hstack([a, b]),
    lambda a, b: torch._foreach_add([a, b], 1.0),
    lambda a, b: torch._foreach_mul([a, b], [b, a]),
    lambda a, b: torch.block_diag(a, b),
    lambda a, b: torch.broadcast_tensors(a, b[:1]),
], ids=["cat", "cat1", "stack", "stack-1", "hstack", "foreach_add", "foreach_mul", "block_diag", "broadcast"])
def test_tensor_list_arguments(fn):
    _run_both(fn, torch.randn(2, 3), torch.randn(2, 3))


def test_foreach_inplace_updates_every_tensor():
    cpu = [torch.randn(3), torch.randn(2, 2), torch.randn(5)]
    neuron = [t.to(N) for t in cpu]
    torch._foreach_add_(cpu, 1.0)
    torch._foreach_add_(neuron, 1.0)
    torch._foreach_mul_(cpu, [t.clone() for t in cpu])
    torch._foreach_mul_(neuron, [t.clone() for t in neuron])
    for c, n in zip(cpu, neuron):
        assert n.device.type == "neuron"
        torch.testing.assert_close(n.cpu(), c)


def test_foreach_add_list_of_views():
    base_cpu, base = torch.zeros(3, 4), torch.zeros(3, 4, device=N)
    torch._foreach_add_([base_cpu[0], base_cpu[:, 2]], [torch.ones(4), torch.full((3,), 2.0)])
    torch._foreach_add_([base[0], base[:, 2]], [torch.ones(4, device=N), torch.full((3,), 2.0, device=N)])
    torch.testing.assert_close(base.cpu(), base_cpu)


@pytest.mark.parametrize("fn", [
    lambda a: torch.max(a, dim=1),
    lambda a: torch.min(a, dim=0, keepdim=True),
    lambda a: torch.sort(a, dim=1, descending=True),
    lambda a: torch.topk(a, 3, dim=1),
    lambda a: torch.kthvalue(a, 2, dim=1),
    lambda a: torch.aminmax(a),
    lambda a: torch.var_mean(a, dim=1),
    lambda a: torch.cummax(a, dim=1),
    lambda a: torch.unique(a.round(), return_inverse=True, return_counts=True),
    lambda a: torch.linalg.qr(a[:, :4]),
], ids=["max", "min", "sort", "topk", "kthvalue", "aminmax", "var_mean", "cummax", "unique", "qr"])
def test_tuple_returns(fn):
    expected, got = _run_both(fn, torch.randn(5, 6) * 3, atol=1e-5, rtol=1e-5)
    assert type(got) is type(expected)


def test_named_tuple_fields():
    x = torch.randn(4, 5)
    r = torch.max(x.to(N), dim=1)
    e = torch.max(x, dim=1)
    torch.testing.assert_close(r.values.cpu(), e.values)
    assert r.indices.dtype == torch.int64 and torch.equal(r.indices.cpu(), e.indices)


@pytest.mark.parametrize("fn", [
    lambda a: torch.clamp(a, min=None, max=1),
    lambda a: torch.clamp(a, min=-1, max=None),
    lambda a: torch.clamp(a, min=torch.zeros(6, device=a.device)),
    lambda a: a.sum(dim=None),
    lambda a: a.mean(dim=1, dtype=torch.float64),
    lambda a: torch.linalg.vector_norm(a, ord=3, dim=None),
    lambda a: F.layer_norm(a, (6,), weight=None, bias=None),
    lambda a: torch.nan_to_num(a.log(), nan=0.0, posinf=None, neginf=-5.0),
    lambda a: torch.std(a, dim=1, correction=0),
    lambda a: torch.round(a, decimals=1),
], ids=["clamp_max", "clamp_min", "clamp_tensor", "sum_none", "mean_dtype", "norm", "layer_norm", "nan_to_num",
        "std", "round"])
def test_optional_arguments(fn):
    _run_both(fn, torch.randn(4, 6) * 2, atol=1e-5, rtol=1e-5)


def test_generator_argument_reproduces():
    g = torch.Generator(device=N)
    mean, std = torch.arange(6.0, device=N), torch.linspace(0.5, 3.0, 6, device=N)
    g.manual_seed(5)
    a = torch.normal(mean, std, generator=g)
    b = torch.normal(mean, std, generator=g)
    g.manual_seed(5)
    c = torch.normal(mean, std, generator=g)
    assert a.device.type == "neuron"
    assert torch.equal(a.cpu(), c.cpu()) and not torch.equal(a.cpu(), b.cpu())
    g.manual_seed(6)
    d = torch.normal(2.0, 0.5, size=(3, 4), device=N, generator=g)
    g.manual_seed(6)
    assert d.shape == (3, 4) and torch.equal(d.cpu(), torch.normal(2.0, 0.5, size=(3, 4), device=N, generator=g).cpu())


# ---- dtypes, 0-dim, empty -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_integer_dtypes(dtype):
    a = torch.arange(-6, 18, dtype=dtype).reshape(4, 6) if dtype != torch.uint8 else \
        torch.arange(0, 24, dtype=dtype).reshape(4, 6)
    b = torch.full((4, 6), 5, dtype=dtype)
    ops = [
        lambda a, b: a + b,
        lambda a, b: a * 3,
        lambda a, b: torch.floor_divide(a, b),
        lambda a, b: torch.remainder(a, b),
        lambda a, b: a & b,
        lambda a, b: a | 1,
        lambda a, b: a > b,
        lambda a, b: a.sum(),           # int sums promote to int64
        lambda a, b: a.sum(dim=1),
        lambda a, b: a.argmax(dim=1),
        lambda a, b: a.cumsum(dim=0),
        lambda a, b: a.max(),
        lambda a, b: a.float() / b,
        lambda a, b: a.abs(),
    ]
    for op in ops:
        expected, got = _run_both(op, a, b)
        assert got.dtype == expected.dtype


def test_bool_dtype():
    a = torch.tensor([[True, False, True], [False, False, True]])
    b = torch.tensor([[True, True, False], [False, True, True]])
    for op in [
        lambda a, b: a & b, lambda a, b: a | b, lambda a, b: a ^ b, lambda a, b: ~a,
        lambda a, b: torch.logical_and(a, b), lambda a, b: a.any(), lambda a, b: a.all(dim=1),
        lambda a, b: a.sum(), lambda a, b: torch.where(a, 1.0, -1.0), lambda a, b: a.nonzero(),
        lambda a, b: a == b, lambda a, b: a.int() + b,
    ]:
        expected, got = _run_both(op, a, b)
        assert got.dtype == expected.dtype


def test_python_bool_and_item_of_bool():
    t = torch.tensor([1.0, 2.0], device=N)
    assert bool((t > 0).all()) is True
    assert bool((t > 1.5).all()) is False
    assert torch.equal(t, t.clone()) and not torch.equal(t, t + 1)


def test_zero_dim_tensors():
    s = torch.tensor(3.5)
    for op in [
        lambda s: s + 1, lambda s: s * s, lambda s: s.exp(), lambda s: s.sum(), lambda s: s.max(),
        lambda s: torch.stack([s, s]), lambda s: s.unsqueeze(0), lambda s: s.view(1, 1),
        lambda s: torch.where(s > 0, s, -s), lambda s: s.clamp(max=1.0),
    ]:
        expected, got = _run_both(op, s)
        assert got.dim() == expected.dim()
    n = s.to(N)
    assert n.dim() == 0 and n.item() == 3.5 and float(n * 2) == 7.0
    r = torch.randn(4, 5).to(N).sum()
    assert r.dim() == 0 and r.device.type == "neuron"


def test_cpu_zero_dim_tensor_mixes_with_neuron():
    x = torch.randn(3, 2)
    s = torch.tensor(2.5)                       # a CPU scalar tensor is allowed, as for CUDA
    r = x.to(N) * s
    assert r.device.type == "neuron"
    torch.testing.assert_close(r.cpu(), x * s)
    torch.testing.assert_close(torch.add(x.to(N), s, alpha=2).cpu(), torch.add(x, s, alpha=2))


@pytest.mark.parametrize("fn", [
    lambda e: e + 1,
    lambda e: e.sum(),
    lambda e: e.sum(dim=0),
    lambda e: e.mean(dim=1),
    lambda e: e.exp(),
    lambda e: torch.cat([e, e]),
    lambda e: e @ torch.ones(3, 2, device=e.device),
    lambda e: e.t() @ e,                        # (3,0)@(0,3): zeros
    lambda e: e.amax(dim=1),
    lambda e: e.sort(dim=0).values,
    lambda e: e.nonzero(),
    lambda e: e.cumsum(dim=0),
], ids=["add", "sum", "sum0", "mean1", "exp", "cat", "mm", "mm_k0", "amax", "sort", "nonzero", "cumsum"])
def test_empty_tensors(fn):
    _run_both(fn, torch.empty(0, 3))


def test_empty_reduction_error_matches_cpu():
    cpu_err = _error_of(lambda: torch.empty(0).max())
    with pytest.raises(type(cpu_err), match="Expected reduction dim"):
        torch.empty(0, device=N).max()


# ---- indexing --------------------------------------------------------------------


def test_indexing_with_cpu_index_tensors():
    x = torch.randn(5, 4)
    xn = x.to(N)
    idx = torch.tensor([0, 3, 3, 1])
    mask = torch.tensor([True, False, True, False, True])
    for got, expected in [
        (xn[idx], x[idx]),
        (xn[mask], x[mask]),
        (xn[idx, 1:], x[idx, 1:]),
        (xn[:, torch.tensor([2, 0])], x[:, torch.tensor([2, 0])]),
        (xn[idx, idx], x[idx, idx]),
        (xn[idx.to(N)], x[idx]),                  # neuron indices work too
        (xn[mask.to(N)], x[mask]),
    ]:
        assert got.device.type == "neuron"
        torch.testing.assert_close(got.cpu(), expected)


def test_index_put_with_cpu_index_tensors():
    x = torch.randn(5, 4)
    xn = x.to(N)
    idx = torch.tensor([4, 0])
    x[idx] = 1.5
    xn[idx] = 1.5
    x[torch.tensor([True, False, False, True, False])] = torch.arange(4.0)
    xn[torch.tensor([True, False, False, True, False])] = torch.arange(4.0, device=N)
    torch.testing.assert_close(xn.cpu(), x)
    acc_idx = torch.tensor([1, 1, 2])
    vals = torch.ones(3, 4)
    x.index_put_((acc_idx,), vals, accumulate=True)
    xn.index_put_((acc_idx,), vals.to(N), accumulate=True)
    torch.testing.assert_close(xn.cpu(), x)


@pytest.mark.parametrize("fn", [
    lambda a, i: a.index_select(0, i),
    lambda a, i: a.gather(1, i[:, None].expand(-1, 2) % 4),
    lambda a, i: torch.zeros_like(a).scatter_add(0, (i[:, None] % 3).expand(-1, 4), a[: len(i)]),
    lambda a, i: torch.zeros(6, 4, device=a.device).index_add(0, i, a[: len(i)]),
    lambda a, i: F.embedding(i, a),
    lambda a, i: a.take(i),
    lambda a, i: a.masked_select(a > 0),
], ids=["index_select", "gather", "scatter_add", "index_add", "embedding", "take", "masked_select"])
def test_index_ops_on_neuron_indices(fn):
    _run_both(fn, torch.randn(6, 4), torch.tensor([5, 0, 2, 2]))


# ---- convolution -----------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(stride=1, padding=0),
    dict(stride=2, padding=1),
    dict(stride=1, padding=2, dilation=2),
    dict(stride=1, padding="same"),
], ids=["plain", "stride2", "dilation", "same"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_forward_backward(kwargs, bias):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 9, 9, requires_grad=True)
    w = torch.randn(6, 4, 3, 3, requires_grad=True)
    b = torch.randn(6, requires_grad=True) if bias else None
    xn, wn = x.detach().to(N).requires_grad_(), w.detach().to(N).requires_grad_()
    bn = b.detach().to(N).requires_grad_() if bias else None
    y = F.conv2d(x, w, b, **kwargs)
    yn = F.conv2d(xn, wn, bn, **kwargs)
    assert yn.device.type == "neuron"
    torch.testing.assert_close(yn.detach().cpu(), y.detach(), atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    yn.backward(g.to(N))
    for cpu_t, neuron_t in [(x, xn), (w, wn)] + ([(b, bn)] if bias else []):
        assert neuron_t.grad.device.type == "neuron"
        torch.testing.assert_close(neuron_t.grad.cpu(), cpu_t.grad, atol=1e-4, rtol=1e-5)


def test_conv2d_groups_and_module():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(6, 6, 3, padding=1, groups=3)
    conv_n = torch.nn.Conv2d(6, 6, 3, padding=1, groups=3).to(N)
    conv_n.load_state_dict(conv.state_dict())
    x = torch.randn(2, 6, 7, 7)
    y = conv(x)
    yn = conv_n(x.to(N))
    torch.testing.assert_close(yn.detach().cpu(), y.detach(), atol=1e-5, rtol=1e-5)
    y.square().sum().backward()
    yn.square().sum().backward()
    torch.testing.assert_close(conv_n.weight.grad.cpu(), conv.weight.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(conv_n.bias.grad.cpu(), conv.bias.grad, atol=1e-4, rtol=1e-5)


def test_conv_transpose2d_forward_backward():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    xn, wn, bn = (t.detach().to(N).requires_grad_() for t in (x, w, b))
    kw = dict(stride=2, padding=1, output_padding=1)
    y = F.conv_transpose2d(x, w, b, **kw)
    yn = F.conv_transpose2d(xn, wn, bn, **kw)
    assert yn.shape == y.shape == (2, 3, 10, 10)
    torch.testing.assert_close(yn.detach().cpu(), y.detach(), atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    yn.backward(g.to(N))
    for cpu_t, neuron_t in [(x, xn), (w, wn), (b, bn)]:
        torch.testing.assert_close(neuron_t.grad.cpu(), cpu_t.grad, atol=1e-4, rtol=1e-5)


def test_conv1d_conv3d_and_bfloat16():
    torch.manual_seed(0)
    _run_both(lambda x, w: F.conv1d(x, w, padding=1), torch.randn(2, 3, 10), torch.randn(5, 3, 3), atol=1e-5, rtol=1e-5)
    _run_both(lambda x, w: F.conv3d(x, w), torch.randn(1, 2, 4, 4, 4), torch.randn(3, 2, 2, 2, 2), atol=1e-5, rtol=1e-5)
    x16, w16 = torch.randn(1, 3, 6, 6).bfloat16(), torch.randn(4, 3, 3, 3).bfloat16()
    _, got = _run_both(lambda x, w: F.conv2d(x, w), x16, w16)
    assert got.dtype == torch.bfloat16


def test_conv2d_channels_last():
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3)
    expected, got = _run_both(lambda x, w: F.conv2d(x, w), x, w, atol=1e-5, rtol=1e-5)
    assert got.is_contiguous(memory_format=torch.channels_last) == \
        expected.is_contiguous(memory_format=torch.channels_last)


# ---- warnings and counts ------------------------------------------------------------

FRESH_OP = "aten::special_bessel_j0.out"


def test_first_fallback_warns_once_naming_the_op():
    _require_fallback(FRESH_OP)
    x = torch.tensor([0.5, 1.0, 2.0]).to(N)
    torchneuron.reset_fallback_counts()
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        r = torch.special.bessel_j0(x)
    torch.testing.assert_close(r.cpu(), torch.special.bessel_j0(x.cpu()))
    assert len(first) == 1, [str(w.message) for w in first]
    assert first[0].category is UserWarning
    assert f"'{FRESH_OP}'" in str(first[0].message)
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        torch.special.bessel_j0(x)
        torch.special.bessel_j0(x)
    assert second == []
    assert torchneuron.fallback_counts()[FRESH_OP] == 3


def test_reset_shows_the_warning_again():
    _require_fallback(FRESH_OP)
    x = torch.tensor([0.5]).to(N)
    torch.special.bessel_j0(x)
    torchneuron.reset_fallback_counts()
    assert FRESH_OP not in torchneuron.fallback_counts()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.special.bessel_j0(x)
    assert len(w) == 1 and FRESH_OP in str(w[0].message)


def test_fallback_counts_per_op_name():
    _require_fallback("aten::add.out")
    x, y = torch.randn(4).to(N), torch.randn(4).to(N)
    out = torch.empty(4, device=N)
    torchneuron.reset_fallback_counts()
    assert torchneuron.fallback_counts() == {}
    for _ in range(3):
        torch.add(x, y, out=out)
    counts = torchneuron.fallback_counts()
    assert counts == {"aten::add.out": 3}
    assert isinstance(counts, dict)
    torch.add(x, y, out=out)
    assert torchneuron.fallback_counts()["aten::add.out"] == 4


def test_conv_and_dropout_are_counted():
    # the cases their device kernels leave to the CPU route: float64 convolution and dropout
    x, w = torch.randn(1, 1, 4, 4).to(N), torch.randn(1, 1, 3, 3).to(N)
    torchneuron.reset_fallback_counts()
    F.conv_transpose2d(x.double(), w.double())
    F.dropout(x.double(), 0.5, training=True)
    counts = torchneuron.fallback_counts()
    assert counts.get("aten::convolution_overrideable") == 1
    assert counts.get("aten::native_dropout") == 1


# ---- strict mode ---------------------------------------------------------------------


def test_strict_mode_raises_naming_the_op_and_leaves_no_damage():
    _require_fallback(FRESH_OP)
    x = torch.tensor([0.5, 1.0, 2.0]).to(N)
    x_before = x.cpu().clone()
    out = torch.full((7,), 4.0, device=N)
    torch.special.bessel_j0(x)                 # warm the allocator's cache for this size
    torchneuron.reset_fallback_counts()
    gc.collect()
    allocated = torch.neuron.memory_allocated()
    torchneuron.set_strict(True)
    try:
        assert torchneuron.is_strict()
        with pytest.raises(NotImplementedError, match=FRESH_OP.replace(".", r"\.")) as info:
            torch.special.bessel_j0(x)
        assert "TORCHNEURON_STRICT" in str(info.value)
        with pytest.raises(NotImplementedError, match="special_bessel_j0"):
            torch.special.bessel_j0(x, out=out)            # out of the wrong size, not resized
        assert torch.neuron.memory_allocated() == allocated
        assert torchneuron.fallback_counts() == {}
    finally:
        torchneuron.set_strict(False)
    assert not torchneuron.is_strict()
    assert torch.equal(x.cpu(), x_before)
    assert out.shape == (7,) and torch.equal(out.cpu(), torch.full((7,), 4.0))
    torch.testing.assert_close(torch.special.bessel_j0(x).cpu(), torch.special.bessel_j0(x_before))


def test_strict_mode_inplace_op_leaves_tensor_unchanged():
    _require_fallback("aten::lgamma.out")
    x = torch.tensor([0.5, 1.5, 3.0]).to(N)
    view = x[1:]
    torchneuron.set_strict(True)
    try:
        with pytest.raises(NotImplementedError, match=r"aten::lgamma\.out"):
            view.lgamma_()
    finally:
        torchneuron.set_strict(False)
    assert x.cpu().tolist() == [0.5, 1.5, 3.0]
    view.lgamma_()                              # works again once strict mode is off
    torch.testing.assert_close(x.cpu(), torch.tensor([0.5, 1.5, 3.0]).index_put_(
        (torch.tensor([1, 2]),), torch.tensor([1.5, 3.0]).lgamma()))


def test_strict_mode_covers_convolution_and_dropout():
    x, w = torch.randn(1, 1, 4, 4).to(N), torch.randn(1, 1, 3, 3).to(N)
    xd = x.double()
    torchneuron.set_strict(True)
    try:
        with pytest.raises(NotImplementedError, match="aten::convolution_overrideable"):
            F.conv_transpose2d(xd, w.double())             # float64: the CPU route
        with pytest.raises(NotImplementedError, match="aten::native_dropout"):
            F.dropout(xd, 0.5, training=True)
        # Core ops PyTorch needs from every device never fall back.
        y = torch.empty(3, device=N)
        z = x.view(16)[2:5].clone()
        y.copy_(z)
        assert y.cpu().tolist() == x.cpu().view(16)[2:5].tolist()
    finally:
        torchneuron.set_strict(False)


@pytest.mark.parametrize("value,strict", [("1", True), ("0", False)])
def test_strict_mode_from_environment(value, strict):
    script = textwrap.dedent(f"""
        import torch, torchneuron
        assert torchneuron.is_strict() is {strict}, torchneuron.is_strict()
        x = torch.tensor([0.5, 1.0]).to("neuron")
        try:
            r = torch.special.bessel_j0(x)
        except NotImplementedError as e:
            assert "{FRESH_OP}" in str(e), str(e)
            print("RAISED")
        else:
            assert torch.allclose(r.cpu(), torch.special.bessel_j0(x.cpu()))
            print("RAN")
    """)
    env = dict(os.environ, TORCHNEURON_STRICT=value)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == ("RAISED" if strict else "RAN")


# ---- errors read like CPU's, and leave no damage -----------------------------------------

ERROR_CASES = {
    "mm_shapes": lambda x: torch.mm(x, x),
    "mm_dtypes": lambda x: torch.mm(x, x.t().long()),
    "cat_shapes": lambda x: torch.cat([x, x[:, :2].t()]),
    "broadcast": lambda x: x + torch.ones(5, device=x.device),
    "inplace_broadcast": lambda x: x.add_(torch.ones(2, 1, 4, device=x.device)),
    "dim_range": lambda x: x.sum(dim=3),
    "index_range": lambda x: x[torch.tensor([10])],
    "gather_range": lambda x: x.gather(1, torch.tensor([[9]], device=x.device)),
    "index_select_range": lambda x: x.index_select(0, torch.tensor([5], device=x.device)),
    "view_shape": lambda x: x.view(5),
}


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_errors_match_cpu(name):
    fn = ERROR_CASES[name]
    x = torch.randn(3, 4)
    cpu_err = _error_of(fn, x.clone())
    assert cpu_err is not None
    xn = x.to(N)
    gc.collect()
    allocated = torch.neuron.memory_allocated()
    with pytest.raises(type(cpu_err)) as info:
        fn(xn)
    message = str(info.value).split("\n")[0]
    del info
    gc.collect()
    assert message == str(cpu_err).split("\n")[0]
    # nothing was damaged: the input is intact, memory is back, the next op works
    assert torch.equal(xn.cpu(), x)
    assert torch.neuron.memory_allocated() == allocated
    torch.testing.assert_close((xn @ xn.t()).cpu(), x @ x.t())


def test_mixed_neuron_and_cpu_tensors_raise():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([x.to(N), x])
    with pytest.raises(RuntimeError, match="same device"):
        x.to(N) + x
    with pytest.raises(RuntimeError, match="same device"):
        torch.mm(x.to(N), x.t())


def test_two_neuron_devices_mixed_raise():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    a, b = torch.randn(3).to("neuron:0"), torch.randn(3).to("neuron:1")
    with pytest.raises(RuntimeError, match="neuron:0 and neuron:1"):
        a + b
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([a, b])


def test_op_on_second_device_stays_there():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    x = torch.randn(3, 4)
    xn = x.to("neuron:1")
    r = torch.mm(xn, xn.t()).exp()
    assert r.device == torch.device("neuron", 1)
    assert r.untyped_storage().device == torch.device("neuron", 1)
    torch.testing.assert_close(r.cpu(), (x @ x.t()).exp())


# ---- regressions: bugs these tests found (resize_, unfold, device of resized outputs) -----


def test_tensor_resize_():
    t = torch.arange(4.0, device=N)
    t.resize_(2, 3)
    assert t.shape == (2, 3)
    assert t.view(-1)[:4].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    t.resize_(2)
    assert t.cpu().tolist() == [0.0, 1.0]


@pytest.mark.parametrize("loss", [F.mse_loss, F.smooth_l1_loss, F.soft_margin_loss])
def test_reduced_losses_that_resize_their_output(loss):
    _run_both(lambda a, b: loss(a, b), torch.randn(4, 5), torch.randn(4, 5))


def test_unfold_is_a_view():
    cpu, neuron = torch.arange(8.0), torch.arange(8.0, device=N)
    u_cpu, u = cpu.unfold(0, 3, 2), neuron.unfold(0, 3, 2)
    torch.testing.assert_close(u.cpu(), u_cpu)
    assert u.untyped_storage().data_ptr() == neuron.untyped_storage().data_ptr()
    u_cpu[0, 1].fill_(-1)
    u[0, 1].fill_(-1)
    torch.testing.assert_close(neuron.cpu(), cpu)


def test_resized_output_on_second_device_keeps_its_storage_there():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    before = torch.neuron.memory_allocated(1)
    r = torch.arange(4096, device="neuron:1")
    assert r.device == torch.device("neuron", 1)
    assert r.untyped_storage().device == torch.device("neuron", 1)
    assert torch.neuron.memory_allocated(1) - before >= 4096 * 8


def test_partial_overlap_raises_like_cpu():
    cpu = torch.arange(6.0)
    cpu_err = _error_of(lambda: torch.add(cpu[:-1], 1, out=cpu[1:]))
    assert isinstance(cpu_err, RuntimeError)
    x = torch.arange(6.0, device=N)
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.add(x[:-1], 1, out=x[1:])
