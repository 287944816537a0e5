"""The foundation under the lowerings: the one refusal rule, derived ``out=`` variants, the one program
cache (kernels without inputs included) and launch errors mapped by type."""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path
import subprocess
import sys
import warnings

import pytest
import torch

import torchneuron
import torchneuron.ops
from torchneuron.ops import cache_size, LOWERED
from torchneuron.ops.indexing import arange_values
from torchneuron.ops.registry import COMPLEX_LOWERED, lowering

from .conftest import assert_raises_like_cpu, to_n


def _fallbacks(op: str) -> int:
    return torchneuron.fallback_counts().get(op, 0)


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_a_refusing_lowering_takes_the_counted_cpu_fallback():
    x = torch.randn(1, 2, 3, 3, dtype=torch.float64)       # float64: the device's upsampling refuses it
    before = _fallbacks("aten::upsample_nearest2d")
    got = torch.nn.functional.interpolate(to_n(x), scale_factor=2)
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), torch.nn.functional.interpolate(x, scale_factor=2), atol=0, rtol=0)
    assert _fallbacks("aten::upsample_nearest2d") == before + 1


def test_strict_mode_turns_the_refusal_into_an_error_naming_the_op(strict):
    x = to_n(torch.randn(1, 2, 3, 3, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="upsample_nearest2d"):
        torch.nn.functional.interpolate(x, scale_factor=2)


def test_no_lowering_module_calls_the_cpu_fallback_itself():
    found = {}
    for path in sorted(Path(torchneuron.ops.__file__).parent.glob("*.py")):
        if path.stem == "registry":   # the one place the refusal becomes the fallback
            continue
        tree = ast.parse(path.read_text())
        uses = sum(isinstance(node, ast.Name) and node.id == "cpu_fallback" for node in ast.walk(tree))
        if uses:
            found[path.stem] = uses
    assert found == {}, "raise Unsupported (naming another call in fallback=) instead of calling cpu_fallback"


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_a_refusal_that_names_its_fallback_runs_that_call_counted():
    before = _fallbacks("aten::eye.m_out")
    out = to_n(torch.empty(0, dtype=torch.float64))       # float64: the device does not store it
    got = torch.eye(3, out=out)                             # eye.out refuses with eye.m_out(3, 3, out=out)
    assert got is out and got.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), torch.eye(3, dtype=torch.float64), atol=0, rtol=0)
    assert _fallbacks("aten::eye.m_out") == before + 1


def test_strict_mode_refuses_a_named_fallback_naming_its_op(strict):
    with pytest.raises(NotImplementedError, match="eye"):
        torch.eye(3, out=to_n(torch.empty(0, dtype=torch.float64)))


def test_a_derived_out_variant_writes_into_the_given_tensor(strict):
    x = torch.randn(1, 2, 3, 3)
    expected = torch.nn.functional.interpolate(x, size=(5, 4))
    out = to_n(torch.empty(expected.shape))
    res = torch._C._nn.upsample_nearest2d(to_n(x), [5, 4], out=out)
    assert res is out
    torch.testing.assert_close(out.cpu(), expected, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_a_derived_out_variant_of_another_dtype_falls_back_like_the_cpu():
    x = torch.randn(1, 2, 3, 3)
    before = _fallbacks("aten::upsample_nearest2d.out")
    assert_raises_like_cpu(lambda conv: torch._C._nn.upsample_nearest2d(
        conv(x), [5, 4], out=conv(torch.empty(1, 2, 5, 4, dtype=torch.float64))))
    assert _fallbacks("aten::upsample_nearest2d.out") == before + 1


_X, _T = torch.rand(3, 4), torch.rand(3, 4)
_MASK, _IDX = _X > 0.5, torch.tensor([2, 0])
_L = torch.tril(torch.rand(4, 4)) + 2 * torch.eye(4)      # well conditioned: solves stay within a few ulps
_POOLED, _ARGMAX = torch.nn.functional.max_pool2d(torch.rand(1, 2, 4, 4), 2, return_indices=True)
_IMG = torch.rand(1, 2, 4, 4)
_POOL3, _ARG3 = torch.nn.functional.max_pool2d(_IMG, 2, 1, return_indices=True)   # overlapping windows
# out= overloads derived from their functional kernels: overload -> call(convert, out)
_DERIVED = {
    "mse_loss.out": lambda c, out: torch._C._nn.mse_loss(c(_X), c(_T), 0, out=out),
    "linalg_cross.out": lambda c, out: torch.linalg.cross(c(_X[:, :3]), c(_T[:, :3]), out=out),
    "index_select.out": lambda c, out: torch.index_select(c(_X), 1, c(_IDX), out=out),
    "masked_select.out": lambda c, out: torch.masked_select(c(_X), c(_MASK), out=out),
    "glu.out": lambda c, out: torch._C._nn.glu(c(_X), -1, out=out),
    "renorm.out": lambda c, out: torch.renorm(c(_X), 2, 0, 0.5, out=out),
    "isin.Tensor_Tensor_out": lambda c, out: torch.isin(c(torch.arange(6)), c(_IDX), out=out),
    "aminmax.out": lambda c, out: torch.aminmax(c(_X), dim=1, out=(out, c(torch.empty(0, dtype=out.dtype)))),
    "linalg_solve_triangular.out": lambda c, out: torch.linalg.solve_triangular(c(_L), c(_X[:, :4].T), upper=False,
                                                                                out=out),
    "cholesky_inverse.out": lambda c, out: torch.cholesky_inverse(c(_L), out=out),
    "max_unpool2d.out": lambda c, out: torch._C._nn.max_unpool2d(c(_POOLED), c(_ARGMAX), [4, 4], out=out),  # quiet
    "nansum.out": lambda c, out: torch.nansum(c(_X.masked_fill(_MASK, float("nan"))), 1, out=out),  # sums in out's dtype
    "_logcumsumexp.out": lambda c, out: torch.logcumsumexp(c(_X), 1, out=out),
    "histc.out": lambda c, out: torch.histc(c(_X), 5, 0, 1, out=out),
    "tril.out": lambda c, out: torch.tril(c(_X), 1, out=out),
    "triu.out": lambda c, out: torch.triu(c(_X), -1, out=out),
    "max_pool2d_with_indices.out": lambda c, out: torch.ops.aten.max_pool2d_with_indices.out(
        c(_IMG), [2, 2], [1, 1], out=out, indices=c(torch.empty(0, dtype=torch.int64))),   # quiet
    "max_pool2d_with_indices_backward.grad_input": lambda c, out: torch.ops.aten.max_pool2d_with_indices_backward(
        c(_POOL3), c(_IMG), [2, 2], [1, 1], [0, 0], [1, 1], False, c(_ARG3), grad_input=out),   # quiet
    "avg_pool2d.out": lambda c, out: torch._C._nn.avg_pool2d(c(_IMG), [2, 2], [1, 1], out=out),
    "avg_pool2d_backward.grad_input": lambda c, out: torch.ops.aten.avg_pool2d_backward(
        c(_POOL3), c(_IMG), [2, 2], [1, 1], [0, 0], False, True, None, grad_input=out),   # quiet
    "sort.values_stable": lambda c, out: torch.sort(c(_X), dim=0, stable=True,
                                                    out=(out, c(torch.empty(0, dtype=torch.int64)))),
    "topk.values": lambda c, out: torch.topk(c(_X), 2, out=(out, c(torch.empty(0, dtype=torch.int64)))),
    "mode.values": lambda c, out: torch.mode(c(_X.round()), 0, True, out=(out, c(torch.empty(0, dtype=torch.int64)))),
    "var.correction_out": lambda c, out: torch.var(c(_X), 1, correction=0, out=out),
    "std.correction_out": lambda c, out: torch.std(c(_X), 0, keepdim=True, out=out),
    "argmax.out": lambda c, out: torch.argmax(c(_X), 1, out=out),
    "argmin.out": lambda c, out: torch.argmin(c(_X), out=out),
    "linalg_vector_norm.out": lambda c, out: torch.linalg.vector_norm(c(_X), 3, 1, out=out),
    "take.out": lambda c, out: torch.take(c(_X), c(_IDX), out=out),
    "index.Tensor_out": lambda c, out: torch.ops.aten.index.Tensor_out(c(_X), [c(_IDX)], out=out),  # quiet
    "nonzero_static.out": lambda c, out: torch.nonzero_static(c(_MASK), size=4, out=out),
    # (their out= tensors of another dtype, cast into or refused as the CPU does: tests/ops/test_out_variants.py)
    "sum.IntList_out": lambda c, out: torch.sum(c(_X), 1, out=out),
    # (quarters: the products of 3 are exact in fp16, which the CPU rounds after each product and the device once)
    "prod.int_out": lambda c, out: torch.prod(c((_X * 4).round() / 4), 0, keepdim=True, out=out),
    "mean.out": lambda c, out: torch.mean(c(_X), (0, 1), out=out),
    "amax.out": lambda c, out: torch.amax(c(_X), 0, out=out),
    "cat.out": lambda c, out: torch.cat([c(_X), c(_T[:1])], out=out),
    "kthvalue.values": lambda c, out: torch.kthvalue(c(_X), 2, 1, out=(out, c(torch.empty(0, dtype=torch.int64)))),
    "max.dim_max": lambda c, out: torch.max(c(_X), 0, out=(out, c(torch.empty(0, dtype=torch.int64)))),
}


def _outcome(call, convert) -> tuple:
    """What ``call(convert)`` gives: ("result", values on the CPU, warnings) or ("error", type, message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = call(convert)
        except Exception as e:  # noqa: BLE001 (the CPU's exception is the reference, whatever it is)
            return "error", type(e), str(e)
    said = [str(w.message) for w in caught if "neuron kernel" not in str(w.message)]
    res = res if isinstance(res, tuple) else (res,)
    return "result", [t.cpu() for t in res], said


def _assert_like_cpu(call) -> None:
    cpu, dev = _outcome(call, lambda t: t), _outcome(call, to_n)
    assert dev[0] == cpu[0] and (cpu[0] == "result" or dev == cpu), (cpu, dev)
    if cpu[0] == "result":
        for got, want in zip(dev[1], cpu[1]):
            assert got.dtype == want.dtype and got.shape == want.shape
            # a few fp32 operations per element on values of order one (4-term sums and solves at most)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert dev[2] == cpu[2]       # the resize warning, word for word


@pytest.mark.parametrize("name", sorted(_DERIVED))
def test_a_derived_out_variant_resizes_and_warns_like_the_cpu(name, strict):
    assert LOWERED[name].__doc__.startswith(f"``{name}``: ")      # registered by register_out
    for size in (0, 5):                            # empty: resized quietly; else warned (unless the CPU does not)
        dtype = torch.bool if name.startswith("isin") else torch.int64 if name.startswith(("nonzero", "arg")) \
            else torch.float32
        _assert_like_cpu(lambda conv: _DERIVED[name](conv, conv(torch.empty(size, dtype=dtype))))


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
@pytest.mark.parametrize("name", sorted(_DERIVED))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32])
def test_a_derived_out_variant_of_another_dtype_casts_or_refuses_like_the_cpu(name, dtype):
    _assert_like_cpu(lambda conv: _DERIVED[name](conv, conv(torch.empty(0, dtype=dtype))))


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
def test_index_reduce_out_is_derived_and_writes_like_the_cpu(strict):
    # (not in the table above: the CPU's one-time beta warning would be compared word for word)
    assert LOWERED["index_reduce.out"].__doc__.startswith("``index_reduce.out``: ")
    for size in (0, 5):
        want = torch.index_reduce(_X, 1, _IDX, _T[:, :2], "amax", out=torch.empty(size))
        out = to_n(torch.empty(size))
        got = torch.index_reduce(to_n(_X), 1, to_n(_IDX), to_n(_T[:, :2]), "amax", out=out)
        assert got is out
        torch.testing.assert_close(out.cpu(), want, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_a_derived_out_variant_that_overlaps_refuses_like_the_cpu():
    for call in (lambda conv: (lambda x: torch.index_select(x, 0, conv(_IDX), out=x[1:]))(conv(_X.clone())),
                 lambda conv: (lambda x: torch.masked_select(x, conv(_MASK), out=x.view(-1)))(conv(_X.clone())),
                 lambda conv: (lambda x: torch._C._nn.mse_loss(x, conv(_T), 0, out=x))(conv(_X.clone())),
                 lambda conv: torch._C._nn.glu(conv(_X), -1, out=conv(torch.empty(1, 2)).expand(3, 2))):
        _assert_like_cpu(call)


def test_a_kernel_without_inputs_is_traced_once_in_the_one_program_cache(strict):
    device = torch.device("neuron", 0)
    before = cache_size()
    first = arange_values(1237, device)
    traced = cache_size()
    second = arange_values(1237, device)
    assert traced == before + 1 and cache_size() == traced
    for values in (first, second):
        torch.testing.assert_close(values.cpu(), torch.arange(1237, dtype=torch.int32), atol=0, rtol=0)


def test_an_index_outside_the_table_raises_the_cpus_index_error(strict):
    table = torch.randn(5, 3)
    assert_raises_like_cpu(lambda conv: torch.index_select(conv(table), 0, conv(torch.tensor([1, 5, 0]))))
    assert_raises_like_cpu(lambda conv: torch.nn.functional.embedding(conv(torch.tensor([[0, -1]])), conv(table)))


@pytest.mark.parametrize("name,make", [
    ("mm", lambda a: (a[0], a[1])), ("bmm", lambda a: (a[0][None], a[1][None])),
    ("addmm", lambda a: (a[2], a[0], a[1])), ("addbmm", lambda a: (a[2], a[0][None], a[1][None])),
    ("var_mean", lambda a: (a[0],)),
])
def test_refused_matmuls_and_var_mean_take_the_counted_fallback(name, make):
    # float64 operands: the lowerings refuse (raise Unsupported) and the registration runs the CPU kernel,
    # counted under the overload that was called
    torch.manual_seed(0)
    args = make([torch.randn(5, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64),
                 torch.randn(5, 3, dtype=torch.float64)])
    fn = getattr(torch, name)
    key = "aten::var_mean.correction" if name == "var_mean" else f"aten::{name}"
    before = _fallbacks(key)
    got = fn(*[to_n(a) for a in args])
    want = fn(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.device.type == "neuron"
        torch.testing.assert_close(g.cpu(), w, atol=0, rtol=0)
    assert _fallbacks(key) == before + 1


def test_a_second_lowering_of_a_lowered_op_is_refused_and_the_first_kept(strict):
    first = LOWERED["add.Tensor"]
    with pytest.raises(RuntimeError, match="aten::add.Tensor already has a neuron kernel"):
        lowering("add.Tensor")(lambda a, b, alpha=1: a)
    assert LOWERED["add.Tensor"] is first
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close((to_n(a) + to_n(b)).cpu(), a + b, atol=0, rtol=0)   # one fp32 add: exact


# Imports the ops modules one by one in the order given on the command line, with the package's __init__
# (which imports them in its own order) replaced by a bare package, and prints what each overload is lowered to.
_IMPORT_IN_ORDER = """
import importlib, importlib.util, json, os, sys, types
spec = importlib.util.find_spec("torchneuron")
bare = types.ModuleType("torchneuron.ops")
bare.__path__ = [os.path.join(os.path.dirname(spec.origin), "ops")]
sys.modules["torchneuron.ops"] = bare
import torch, torchneuron
for name in sys.argv[1:]:
    importlib.import_module("torchneuron.ops." + name)
from torchneuron.ops.registry import COMPLEX_LOWERED, LOWERED
print(json.dumps({"lowered": {k: f.__module__ + "." + f.__qualname__ for k, f in LOWERED.items()},
                  "complex": sorted(str(op) for op in COMPLEX_LOWERED)}))
"""


def _lowered_here() -> dict:
    return {"lowered": {k: f.__module__ + "." + f.__qualname__ for k, f in LOWERED.items()},
            "complex": sorted(str(op) for op in COMPLEX_LOWERED)}


def test_the_registered_ops_do_not_depend_on_the_order_the_ops_modules_are_imported_in():
    modules = sorted(p.stem for p in Path(torchneuron.ops.__file__).parent.glob("*.py") if p.stem != "__init__")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHNEURON_")}
    orders = (modules, modules[::-1])
    runs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", _IMPORT_IN_ORDER, *order], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for order in orders]
    here = _lowered_here()
    assert len(here["lowered"]) > 500 and here["complex"]           # the package's own import order
    for order, run in zip(orders, runs):
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, f"importing in the order {order}: {err}"
        assert json.loads(out) == here, f"importing in the order {order} registers other kernels"


@pytest.mark.parametrize("sa,sb", [
    ((2, 3), (4, 5)),              # two mismatches: the CPU names the last
    ((2, 3, 4), (5, 6, 4)),
    ((3, 2, 5), (4, 5)),           # different ranks, dimensions counted in the broadcast result
    ((7,), (2, 3, 6)),
    ((4, 1, 3), (2, 5)),
])
def test_shapes_that_do_not_broadcast_raise_the_cpus_error(sa, sb, strict):
    a, b = torch.randn(sa), torch.randn(sb)
    assert_raises_like_cpu(lambda conv: torch.add(conv(a), conv(b)))
    assert_raises_like_cpu(lambda conv: torch.mul(conv(b), conv(a)))
    assert_raises_like_cpu(lambda conv: torch.addcmul(conv(torch.randn(sa[-1:])), conv(a), conv(b)))
    assert_raises_like_cpu(lambda conv: torch.gt(conv(a.long()), conv(b.long())))        # the int64 path
    assert_raises_like_cpu(lambda conv: torch.where(conv(a > 0), conv(a), conv(b)))
    assert_raises_like_cpu(lambda conv: conv(a).masked_fill(conv(b > 0), 1.0))
    assert_raises_like_cpu(lambda conv: torch.masked_select(conv(a), conv(b > 0)))   # the mask is tensor "a"


def test_a_plan_binds_operands_by_role_and_allocates_its_results_in_the_shapes_given(strict):
    # ``PlanCache``: the plan traced for (a - b) replays on operands in the caller's order (the roles map slot
    # names to operand indices), allocating the result in the shape kept; past its limit the cache starts over
    import torchneuron.nki.language as nl
    from torchneuron.kernels import tilemath as tm
    from torchneuron.kernels.elementwise import KERNELS, NAMES
    from torchneuron.ops.kernel_call import PlanCache, traced_kernel
    torch.manual_seed(3)
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    da, db = to_n(a), to_n(b)
    cache = PlanCache(limit=1)
    traced = traced_kernel(KERNELS[2], {NAMES[0]: da, NAMES[1]: db},
                           {"fn": tm.sub, "out_dtype": torch.float32, "compute": nl.float32})
    plan = cache.keep(("sub",), traced, {NAMES[0]: 1, NAMES[1]: 0}, [(2, 12)], extra="kept")
    assert cache.get(("sub",)) is plan and cache.get(None) is None and plan.extra == "kept"
    (got,) = plan.launch((db, da), 0, "test::sub")         # operand 1 binds the first slot
    assert got.shape == (2, 12) and torch.equal(got.cpu(), (a - b).reshape(2, 12))
    cache.keep(("other",), traced, {NAMES[0]: 0, NAMES[1]: 1})
    cache.keep(("third",), traced, {NAMES[0]: 0, NAMES[1]: 1})
    assert cache.keys() == [("third",)]                    # two past the limit of one: started over
    (got,) = cache.get(("third",)).launch((da, db), 0, None)
    assert got.shape == (6, 4) and torch.equal(got.cpu(), a - b)


def test_call_kernel_writes_bound_outputs_and_allocates_the_rest(strict):
    # a kernel of two results, called with its second bound to a tensor: that tensor is returned and written, the
    # first allocated; both in the kernel's return order, bit for bit a call that binds none (a trace kept per
    # key returns each output from its slot)
    from torchneuron.kernels.softmax import attention_softmax_kernel
    from torchneuron.ops.kernel_call import call_kernel
    x = to_n(torch.randn(6, 8, generator=torch.Generator().manual_seed(9)))
    meta = {"scale": 0.5, "causal_len": 0}
    probs, lse = call_kernel(attention_softmax_kernel, {"x": x}, meta)
    into = to_n(torch.full((6, 1), 7.0))
    for _ in range(2):                      # the first call with these outputs, and a repeated one
        got = call_kernel(attention_softmax_kernel, {"x": x}, meta, [None, into])
        assert got[1] is into and got[0].shape == probs.shape and got[0] is not probs
        assert torch.equal(got[0].cpu(), probs.cpu()) and torch.equal(into.cpu(), lse.cpu())
        assert not torch.equal(probs.cpu()[:, :1], lse.cpu())
