"""out= variants that register_out derives from their functional kernels where the CPU writes into an out= tensor
of another dtype than the result: sum, prod, mean, amax, any/all, cat (and kthvalue, max.dim beside them); and the
out= variants moved onto it later (gather, norm, the matrix products, the scatters, index_add/index_copy,
searchsorted/bucketize, the LU/QR/Cholesky/determinant family), whose CPU kernels refuse such an out=.

Every (input dtype, out= dtype) pair is run on the CPU and on the device: the device gives the CPU's result,
element by element, or raises the CPU's exception type with its message. The inputs are small integers
(-2..2, nonzero for products) and the reductions have at most 12 of them, so every sum, product, mean (over
4 elements) and cast involved is exact in every dtype: results are compared exactly. Pairs that ran on the
device before these ops moved onto register_out must still run there: the fallback counter must not move.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import torchneuron
from torchneuron.ops import LOWERED

from .conftest import to_n

B, U8, I8, I16, I32, I64 = torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64
F16, BF16, F32, F64, C64 = torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64
DTYPES = (B, U8, I8, I16, I32, I64, F16, BF16, F32, F64, C64)
INTEGRAL = (B, U8, I8, I16, I32, I64)
CORE_FLOATS = (F16, BF16, F32)        # the float dtypes the engines compute in (float64 has no arithmetic)


def _values(dtype: torch.dtype, shape=(4, 3), nonzero: bool = False) -> torch.Tensor:
    """Small integers -2..2 (0..2 unsigned, 0/1 bool; no zeros with ``nonzero``), exact in every dtype."""
    n = 1
    for s in shape:
        n *= s
    v = (torch.arange(n) * 7 + 3) % 5 - 2
    if nonzero:
        v = torch.where(v == 0, 1, v)
    if dtype == B:
        v = v > 0
    elif dtype == U8:
        v = v.abs()
    return v.reshape(shape).to(dtype)


def _idx() -> torch.Tensor:
    return torch.empty(0, dtype=I64)


# name -> (call(x, out, conv) -> result, out shape, input values with nonzero?, native(input, out) before the move)
def _native_sum(i, o):     # integer sums exact on the device; no float64 result, no float -> integer cast
    return i != C64 and o != F64 and o != C64 and (o in CORE_FLOATS or (i in INTEGRAL and (o != B or i == B)))


def _native_prod(i, o):
    return i != C64 and o in CORE_FLOATS


def _native_mean(i, o):    # an integer input is refused natively whatever out= is
    return i != C64 and o != C64 and (i in INTEGRAL or (o in CORE_FLOATS))


def _native_any(i, o):
    return i not in (F64, C64) and o in (B, U8)


def _native_cat(i, o):     # float64 from an integer input takes the CPU
    return i != C64 and o != C64 and not (o == F64 and i in INTEGRAL)


def _native_mean_all(i, o):  # mean.dtype_out refuses an out= the input cannot be cast to before anything runs
    return _native_mean(i, o) or (o != C64 and not torch.can_cast(i, o))


def _native_amax(i, o):    # an out= unlike the input is refused natively; float64 has no device max
    return i != C64 and o != C64 and (i != o or i != F64)


def _native_kthvalue(i, o):   # likewise; and the CPU has no bool kthvalue: its kernel raises
    return i != C64 and o != C64 and (i != o or i not in (B, F64))


def _native_scan(i, o):       # scans compute in out='s dtype; no float64 on the device, no bool scan on the CPU
    return i not in (F64, C64) and o not in (B, F64, C64)


def _native_max_dim(i, o):    # (its out= variant took the CPU before; float values and indices on the device)
    return i == o and i in CORE_FLOATS


CASES = {
    "sum.IntList_out": (lambda x, out, c: torch.sum(x, 0, out=out), (3,), False, _native_sum),
    "sum.IntList_out (dims, keepdim)": (lambda x, out, c: torch.sum(x, (0, 1), True, out=out), (1, 1), False,
                                        _native_sum),
    # sum.out is PyTorch's wrapper of the functional sum (the input's promoted dtype, refused unlike out='s)
    "sum.out": (lambda x, out, c: torch.ops.aten.sum.out(x, out=out), (), False, lambda i, o: i not in (F64, C64)),
    "prod.int_out": (lambda x, out, c: torch.prod(x, 1, out=out), (4,), True, _native_prod),
    "mean.out": (lambda x, out, c: torch.mean(x, 0, out=out), (3,), False, _native_mean),
    "mean.dtype_out": (lambda x, out, c: torch.mean(x, out=out), (), False, _native_mean_all),
    "amax.out": (lambda x, out, c: torch.amax(x, 1, out=out), (4,), False, _native_amax),
    "any.out": (lambda x, out, c: torch.any(x, 0, out=out), (3,), False, _native_any),
    "any.dims_out": (lambda x, out, c: torch.any(x, (0, 1), out=out), (), False, _native_any),
    "any.all_out": (lambda x, out, c: torch.any(x, out=out), (), False, _native_any),
    "all.out": (lambda x, out, c: torch.all(x, 1, out=out), (4,), True, _native_any),
    "all.dims_out": (lambda x, out, c: torch.all(x, (1,), True, out=out), (4, 1), False, _native_any),
    "all.all_out": (lambda x, out, c: torch.all(x, out=out), (), True, _native_any),
    "cat.out": (lambda x, out, c: torch.cat([x, x[1:]], out=out), (7, 3), False, _native_cat),
    "cumsum.out": (lambda x, out, c: torch.cumsum(x, 1, out=out), (4, 3), False, _native_scan),
    "cumprod.out": (lambda x, out, c: torch.cumprod(x, 0, out=out), (4, 3), True,
                    lambda i, o: _native_scan(i, o) and i != I64),
    "kthvalue.values": (lambda x, out, c: torch.kthvalue(x, 2, 0, out=(out, c(_idx()))), (3,), False,
                        _native_kthvalue),
    "max.dim_max": (lambda x, out, c: torch.max(x, 1, out=(out, c(_idx()))), (4,), False, _native_max_dim),
}


def _fallbacks() -> int:
    return sum(torchneuron.fallback_counts().values())


def _outcome(call, convert) -> tuple:
    """("result", out= tensors on the CPU, whether the result is the out= tensor, warnings) or ("error", type,
    message) of ``call(convert)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out, res = call(convert)
        except Exception as e:  # noqa: BLE001 (the CPU's exception is the reference, whatever it is)
            return "error", type(e), str(e)
    # (the complex -> real cast warning and scatter's deprecation of reduce= are PyTorch's warn-once: only the first
    # of the two runs can see them)
    said = [str(w.message) for w in caught if "neuron kernel" not in str(w.message)
            and "Casting complex values to real" not in str(w.message) and "is deprecated" not in str(w.message)]
    res = tuple(res) if isinstance(res, tuple) else (res,)
    outs = out if isinstance(out, tuple) else (out,)
    return "result", [t.cpu() for t in outs], all(r is o for r, o in zip(res, outs)), said


def _assert_like_cpu(call) -> tuple:
    """``call`` on the device gives what it gives on the CPU, exactly; returns the CPU's outcome."""
    cpu = _outcome(call, lambda t: t)
    dev = _outcome(call, to_n)
    assert dev[0] == cpu[0], (cpu, dev)
    if cpu[0] == "error":
        assert dev == cpu
        return cpu
    assert dev[2] and cpu[2]          # the out= tensors are what the call returns
    for got, want in zip(dev[1], cpu[1]):
        assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
        assert torch.equal(got, want), (got, want)        # exact values: see the module's docstring
    assert dev[3] == cpu[3]           # the resize warning (word for word), or none
    return cpu


def _run(name: str, make_out) -> None:
    """Every (input, out=) dtype pair of ``name``; the pairs native before the move must not fall back."""
    call, shape, nonzero, native = CASES[name]
    for i in DTYPES:
        x = _values(i, nonzero=nonzero)
        for o in DTYPES:
            before = _fallbacks()
            _assert_like_cpu(lambda c: (lambda out: (out, call(c(x), out, c)))(c(make_out(shape, o))))
            if native(i, o):
                assert _fallbacks() == before, f"{name}: {i} -> {o} fell back"


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_dtype_pair_writes_or_refuses_like_the_cpu(name):
    _run(name, lambda shape, o: torch.full(shape, 7, dtype=o))


def test_the_moved_out_variants_are_derived_by_register_out():
    for name in ("sum.IntList_out", "prod.int_out", "mean.out", "amax.out", "amin.out", "any.out", "any.dims_out",
                 "any.all_out", "all.out", "all.dims_out", "all.all_out", "cat.out", "kthvalue.values",
                 "max.dim_max", "min.dim_min", "cumsum.out", "cumprod.out"):
        assert LOWERED[name].__doc__.startswith(f"``{name}``: "), name


# a dtype= given with out=: the CPU computes in it and refuses an out= of another dtype (before: the device
# computed in dtype= and cast into out=)
@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
@pytest.mark.parametrize("op", ["sum", "prod", "mean", "cumsum", "cumprod"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32, I32, I64, F64])
def test_a_dtype_argument_unlike_out_is_refused_like_the_cpu(op, dtype):
    fn = getattr(torch, op)
    for i in (I32, F16, F32):
        x = _values(i, nonzero=op.endswith("prod"))
        for o in DTYPES[:-1]:
            before = _fallbacks()
            _assert_like_cpu(lambda c: (lambda out: (out, fn(c(x), 0, dtype=dtype, out=out)))(c(torch.empty(0, dtype=o))))
            if o != dtype:        # the refusal (or mean's of an integer dtype=) is raised on the device
                assert _fallbacks() == before, f"{op}: {i} dtype={dtype} -> {o} fell back"


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_shaped_out_resizes_with_the_cpus_warning(name, strict):
    call, shape, nonzero, _ = CASES[name]
    dtype = B if name.startswith(("any", "all")) else F32
    x = _values(F32, nonzero=nonzero)
    for size in ((0,), (5,), (2, 9)):        # empty: resized quietly; else with the warning
        _assert_like_cpu(lambda c: (lambda out: (out, call(c(x), out, c)))(c(torch.full(size, 7, dtype=dtype))))


# out= made from the input x (and convert), then the call writing it
_ALIASED = {
    "sum": (lambda x, c: x[0], lambda x, out, c: torch.sum(x, 0, out=out)),           # out= is part of the input
    "amax": (lambda x, c: x[:, 0], lambda x, out, c: torch.amax(x, 1, out=out)),
    "mean": (lambda x, c: x[0], lambda x, out, c: torch.mean(x, 0, out=out)),
    "prod": (lambda x, c: x[:, 0], lambda x, out, c: torch.prod(x, 1, out=out)),
    "cat": (lambda x, c: x[:2], lambda x, out, c: torch.cat([x[1:2], x[3:]], out=out)),     # cat refuses any overlap
    "cat-legacy-empty-input": (lambda x, c: c(torch.zeros(0)), lambda x, out, c: torch.cat([out, x], out=out)),
    "cat-empty-view": (lambda x, c: x.view(-1)[:0], lambda x, out, c: torch.cat([x.view(-1)[:0], x.view(-1)], out=out)),
    "kthvalue": (lambda x, c: x[0], lambda x, out, c: torch.kthvalue(x, 2, 0, out=(out, c(_idx())))),
    "any-expanded": (lambda x, c: c(torch.empty(1, dtype=B)).expand(3), lambda x, out, c: torch.any(x, 0, out=out)),
    "sum-expanded": (lambda x, c: c(torch.empty(1)).expand(3), lambda x, out, c: torch.sum(x, 0, out=out)),
    "max-values-and-indices": (lambda x, c: x[0], lambda x, out, c: torch.max(x, 0, out=(out, out.view(I32)))),
}


def test_cat_casts_each_input_into_out_directly_as_the_cpu_does(strict):
    # an int32 beside a float16 input promotes to float16, where 2049 rounds: the CPU casts each input straight into
    # a float32 out=, so 2049 stays (a cast of the float16 result would give 2048)
    a, b = torch.tensor([2049, -3], dtype=I32), torch.tensor([0.5], dtype=F16)
    want = torch.cat([a, b], out=torch.empty(3))
    got = torch.cat([to_n(a), to_n(b)], out=to_n(torch.empty(3)))
    assert torch.equal(got.cpu(), want) and want[0] == 2049


def test_any_all_cast_into_uint8_and_refuse_other_dtypes_on_the_device(strict):
    x = _values(F32)
    for fn in (torch.any, torch.all):
        for o in (B, U8):
            want = fn(x, 0, out=torch.empty(3, dtype=o))
            got = fn(to_n(x), 0, out=to_n(torch.empty(3, dtype=o)))
            assert got.dtype == o and torch.equal(got.cpu(), want)
        for o in (I32, F32):     # refused before the dims are looked at, as on the CPU
            with pytest.raises(RuntimeError) as cpu:
                fn(x, 5, out=torch.empty(3, dtype=o))
            with pytest.raises(RuntimeError) as dev:
                fn(to_n(x), 5, out=to_n(torch.empty(3, dtype=o)))
            assert str(dev.value) == str(cpu.value)


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_an_aliasing_out_the_cpu_computes_is_counted_as_its_fallback():
    x = _values(F32)
    want = x.clone()
    torch.sum(want, 0, out=want[0])
    got = to_n(x)
    before = torchneuron.fallback_counts().get("aten::sum.IntList_out", 0)
    torch.sum(got, 0, out=got[0])
    assert torchneuron.fallback_counts().get("aten::sum.IntList_out", 0) == before + 1
    assert torch.equal(got.cpu(), want)


def test_strict_mode_refuses_the_cpu_kernel_but_not_its_overlap_errors(strict):
    x = to_n(_values(F32))
    with pytest.raises(NotImplementedError, match="sum.IntList_out"):
        torch.sum(x, 0, out=x[0])                   # the CPU computes it: that takes the fallback
    assert torch.equal(x.cpu(), _values(F32))       # untouched
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        torch.cat([x[1:2], x[3:]], out=x[:2])       # the CPU refuses it: its error, fallback or not


# ---- gather, norm and the matrix products: out= derived by register_out ---------------------------------------

_GATHER_INDEX = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0]])


def _native_same(i, o):       # the CPU refuses an out= unlike the input; the device raises that error itself
    return i != C64 and o != C64  # (complex operands are refused before any kernel sees them)


def _native_norm(i, o):       # float input on the device (float64 computes through the fallback)
    return i not in (F64, C64) and o != C64


def _native_product(i, o):    # an out= of another dtype is refused natively; integer and float64 products take the CPU
    return i != C64 and o != C64 and (i != o or i in CORE_FLOATS)


def _native_move(i, o):       # a plain scatter moves 8-byte elements as word pairs: every real dtype on the device
    return i != C64 and o != C64


def _native_sum(i, o):        # accumulating scatters: float64 has no device arithmetic
    return _native_move(i, o) and not i == o == F64


def _native_copy(i, o):       # index_copy moves rows of 1-4 byte elements only
    return _native_move(i, o) and not (i == o and i in (I64, F64))


def _native_search(result):   # positions of int64 and float64 data are left to the CPU
    return lambda i, o: _native_move(i, o) and not (i in (I64, F64) and o == result)


_LINE_INDEX = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])    # distinct in each row: a plain scatter is defined
_DUP_INDEX = torch.tensor([[0, 0], [2, 2], [1, 2], [0, 1]])     # repeated in rows: the accumulating ones combine
_ROWS = torch.tensor([0, 2, 0])


def _bounds(dtype: torch.dtype) -> torch.Tensor:
    """Boundaries sorted in ``dtype`` (searchsorted of unsorted ones is undefined)."""
    if dtype == B:
        return torch.tensor([False, True])
    return (torch.tensor([0, 1, 2]) if dtype == U8 else torch.tensor([-2, -1, 0, 1, 2])).to(dtype)


DERIVED = {
    "gather.out": (lambda x, out, c: torch.gather(x, 1, c(_GATHER_INDEX), out=out), (4, 2), False, _native_same),
    "norm.out": (lambda x, out, c: torch._VF.norm(x, 2, [0], False, out=out), (3,), False, _native_norm),
    "norm.dtype_out": (lambda x, out, c: torch._VF.norm(x, 1, [1], True, dtype=F32, out=out), (4, 1), False,
                       lambda i, o: i in (F16, BF16, F32) and o != C64),
    # the matrix products: x is [4, 3]; the CPU refuses an out= unlike the operands, the device raises that itself
    "mm.out": (lambda x, out, c: torch.mm(x, x.t(), out=out), (4, 4), False, _native_product),
    "bmm.out": (lambda x, out, c: torch.bmm(x[None], x.t()[None], out=out), (1, 4, 4), False, _native_product),
    "addmm.out": (lambda x, out, c: torch.addmm(x[0], x.t(), x, out=out), (3, 3), False, _native_product),
    "addmm.out (scaled, full input)": (lambda x, out, c: torch.addmm(x[:3], x.t(), x, beta=2, alpha=-1, out=out),
                                       (3, 3), False, _native_product),
    "baddbmm.out": (lambda x, out, c: torch.baddbmm(x[None, :3], x.t()[None], x[None], out=out), (1, 3, 3), False,
                    _native_product),
    "addbmm.out": (lambda x, out, c: torch.addbmm(x[:3], x.t()[None], x[None], alpha=2, out=out), (3, 3), False,
                   _native_product),
    "addmv.out": (lambda x, out, c: torch.addmv(x[:, 0], x, x[0], out=out), (4,), False, _native_product),
    # the scatters and row puts: the CPU refuses an out= unlike self, the device raises that itself
    "scatter.src_out": (lambda x, out, c: torch.scatter(x, 1, c(_LINE_INDEX), x[:, 1:], out=out), (4, 3), False,
                        _native_move),
    "scatter.value_out": (lambda x, out, c: torch.scatter(x, 1, c(_LINE_INDEX), 1, out=out), (4, 3), False,
                          _native_move),
    "scatter.reduce_out": (lambda x, out, c: torch.scatter(x, 1, c(_DUP_INDEX), x[:, 1:], reduce="add", out=out),
                           (4, 3), False, _native_sum),
    "scatter.value_reduce_out": (lambda x, out, c: torch.scatter(x, 1, c(_DUP_INDEX), 2, reduce="multiply",
                                                                 out=out), (4, 3), False, _native_sum),
    "scatter_add.out": (lambda x, out, c: torch.scatter_add(x, 1, c(_DUP_INDEX), x[:, 1:], out=out), (4, 3), False,
                        _native_sum),
    "scatter_reduce.two_out": (lambda x, out, c: torch.scatter_reduce(x, 1, c(_DUP_INDEX), x[:, 1:], "amax",
                                                                      include_self=False, out=out), (4, 3), False,
                               _native_sum),
    "index_add.out": (lambda x, out, c: torch.index_add(x, 0, c(_ROWS), x[1:], out=out), (4, 3), False, _native_sum),
    "index_copy.out": (lambda x, out, c: torch.index_copy(x, 0, c(_ROWS[:2]), x[2:], out=out), (4, 3), False,
                       _native_copy),
    # the searches: the CPU refuses an out= of another dtype than int64 (int32 with out_int32)
    "searchsorted.Tensor_out": (lambda x, out, c: torch.searchsorted(c(_bounds(x.dtype)), x, out=out), (4, 3),
                                False, _native_search(I64)),
    "searchsorted.Scalar_out": (lambda x, out, c: torch.searchsorted(c(_bounds(x.dtype)), 1, right=True, out=out), (),
                                False, _native_search(I64)),
    "bucketize.Tensor_out": (lambda x, out, c: torch.bucketize(x, c(_bounds(x.dtype)), right=True, out=out), (4, 3),
                             False, _native_search(I64)),
    # (torch.bucketize has no out= for a scalar: only the ATen overload reaches it, where the CPU's resize warning is
    # printed by C++ rather than raised in Python; the wrong-shape test takes the Tensor overload's instead)
    "bucketize.Scalar_out": (lambda x, out, c: torch.ops.aten.bucketize.Scalar_out(
        1, c(_bounds(x.dtype)), out_int32=True, out=out), (), False, _native_search(I32)),
}
CASES.update(DERIVED)
_RESULT_DTYPE = {"searchsorted.Tensor_out": I64, "searchsorted.Scalar_out": I64, "bucketize.Tensor_out": I64,
                 "bucketize.Scalar_out": I32}     # the others' results are float32's from float32 inputs


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
@pytest.mark.parametrize("name", sorted(DERIVED))
def test_derived_every_dtype_pair_writes_or_refuses_like_the_cpu(name):
    _run(name, lambda shape, o: torch.full(shape, 7, dtype=o))


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_derived_a_wrong_shaped_out_resizes_with_the_cpus_warning(name, strict):
    if name == "bucketize.Scalar_out":
        name = "bucketize.Tensor_out"      # (see DERIVED)
    call, shape, nonzero, _ = CASES[name]
    x = _values(F32, nonzero=nonzero)
    dtype = _RESULT_DTYPE.get(name, F32)
    for size in ((0,), (5,), (2, 9)) + ((shape,) if shape else ()):
        _assert_like_cpu(lambda c: (lambda out: (out, call(c(x), out, c)))(c(torch.full(size, 7, dtype=dtype))))


def test_the_derived_out_variants_are_registered_by_register_out():
    for name in {n.split(" ")[0] for n in DERIVED}:
        assert LOWERED[name].__doc__.startswith(f"``{name}``: "), name


_DERIVED_ALIASED = {
    "gather-into-its-input": (lambda x, c: x[:, :2], lambda x, out, c: torch.gather(x, 1, c(_GATHER_INDEX[:, :2].remainder(2)),
                                                                                   out=out)),
    "norm-into-its-input": (lambda x, c: x[0], lambda x, out, c: torch._VF.norm(x, 2, [0], False, out=out)),
    "norm-expanded": (lambda x, c: c(torch.empty(1)).expand(3), lambda x, out, c: torch._VF.norm(x, 2, [0], False,
                                                                                                 out=out)),
    "scatter_add-into-its-self": (lambda x, c: x, lambda x, out, c: torch.scatter_add(
        out, 1, c(_DUP_INDEX), c(torch.ones(4, 2)), out=out)),
    "scatter-into-its-src": (lambda x, c: x[:, 1:].contiguous(), lambda x, out, c: torch.scatter(
        x[:, :2], 0, c(_LINE_INDEX[:, :2] % 4), out, out=out)),
    "scatter-expanded": (lambda x, c: c(torch.empty(1)).expand(4, 3), lambda x, out, c: torch.scatter(
        x, 1, c(_LINE_INDEX), 1.0, out=out)),
    "index_copy-into-its-source": (lambda x, c: x[2:], lambda x, out, c: torch.index_copy(
        x[:2], 0, c(_ROWS[:2] // 2), out, out=out)),
    "index_add-into-its-self": (lambda x, c: x[:3], lambda x, out, c: torch.index_add(
        out, 0, c(_ROWS), x[1:], alpha=2, out=out)),
    "searchsorted-into-its-values": (lambda x, c: x.view(I32)[:2], lambda x, out, c: torch.searchsorted(
        c(torch.tensor([-2, 0, 2], dtype=I32)), out, out_int32=True, out=out)),
}




@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
@pytest.mark.parametrize("name", sorted(DERIVED))
def test_derived_an_out_on_the_cpu_is_refused_as_on_the_cpu(name):
    call = CASES[name][0]
    x = _values(F32)
    with pytest.raises(RuntimeError) as cpu:
        call(to_n(x), torch.empty(0), to_n)
    assert "device" in str(cpu.value)


_PRODUCTS = ("mm.out", "bmm.out", "addmm.out", "addmm.out (scaled, full input)", "baddbmm.out", "addbmm.out",
             "addmv.out")


@pytest.mark.parametrize("name", _PRODUCTS)
@pytest.mark.parametrize("dtype", CORE_FLOATS)
def test_a_product_writes_straight_into_a_matching_out(name, dtype, strict):
    # a contiguous out= of the result's shape and dtype is the kernel's destination (register_out's into=): the same
    # launches as the functional form, no copy after them; any other out= takes a copy of the result
    from torchneuron.runtime import profiler
    call, shape, _, _ = CASES[name]
    x = to_n(_values(dtype))
    with profiler.record() as recs:
        want = call(x, None, to_n)
    functional = [r.name for r in recs]
    out = to_n(torch.full(shape, 7, dtype=dtype))
    ptr = out.data_ptr()
    with profiler.record() as recs:
        got = call(x, out, to_n)
    assert got is out and out.data_ptr() == ptr and [r.name for r in recs] == functional
    assert torch.equal(out.cpu(), want.cpu())
    strided = to_n(torch.full(shape + (2,), 7, dtype=dtype))[..., 0]     # non-contiguous: one copy more
    with profiler.record() as recs:
        call(x, strided, to_n)
    assert len(recs) == len(functional) + 1 and torch.equal(strided.cpu(), want.cpu())


@pytest.mark.parametrize("name", ["scatter.src_out", "scatter.value_out", "scatter.reduce_out", "scatter_add.out",
                                  "scatter_reduce.two_out", "index_add.out", "index_copy.out"])
def test_a_scatter_copies_self_straight_into_a_matching_out(name, strict):
    # a contiguous out= of self's shape and dtype is where the copy of self is made and scattered into (into=): the
    # functional form's launches (its clone of self becomes the copy into out=), no copy after them
    from torchneuron.runtime import profiler
    call, shape, _, _ = CASES[name]
    x = to_n(_values(F32))
    with profiler.record() as recs:
        want = call(x, None, to_n)
    out = to_n(torch.full(shape, 7.0))
    ptr = out.data_ptr()
    with profiler.record() as got_recs:
        got = call(x, out, to_n)
    assert got is out and out.data_ptr() == ptr and len(got_recs) == len(recs)
    assert torch.equal(out.cpu(), want.cpu())


_PRODUCTS_ALIASED = {
    "mm-into-its-input": (lambda x, c: x[:3, :3].contiguous(), lambda x, out, c: torch.mm(out, out, out=out)),
    "addmm-into-its-input": (lambda x, c: x[:3], lambda x, out, c: torch.addmm(out, x.t(), x, out=out)),
    "addmv-into-a-row": (lambda x, c: x[:, 0], lambda x, out, c: torch.addmv(x[:, 1], x, x[0], out=out)),
    "bmm-resized-into-its-input": (lambda x, c: x.view(-1)[:2], lambda x, out, c: torch.bmm(
        x.view(-1)[:4].view(1, 2, 2), x.view(-1)[4:8].view(1, 2, 2), out=out)),
}




@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
@pytest.mark.parametrize("name", sorted(DERIVED))
def test_derived_an_out_on_another_neuron_device_is_refused(name):
    if torch.neuron.device_count() < 2:
        pytest.skip("one neuron device")
    call = CASES[name][0]
    dtype = _RESULT_DTYPE.get(name, F32)      # (an out= of another dtype is refused first, as the CPU's kernel does)
    out = torch.full(CASES[name][1], 7, dtype=dtype, device="neuron:1")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        call(to_n(_values(F32)), out, to_n)
    assert torch.equal(out.cpu(), torch.full(CASES[name][1], 7, dtype=dtype))


# every aliasing case: the ops with their own out= handling, those derived by register_out, the products
_ALL_ALIASED = {**_ALIASED, **_DERIVED_ALIASED, **_PRODUCTS_ALIASED}
assert len(_ALL_ALIASED) == len(_ALIASED) + len(_DERIVED_ALIASED) + len(_PRODUCTS_ALIASED)


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
@pytest.mark.parametrize("name", sorted(_ALL_ALIASED))
def test_an_out_aliasing_an_input_or_itself_behaves_as_on_the_cpu(name):
    make_out, call = _ALL_ALIASED[name]
    x = _values(F32)

    def run(c):
        xc = c(x.clone())
        out = make_out(xc, c)
        return out, call(xc, out, c)
    _assert_like_cpu(run)


# ---- the factorisations: LU, QR, Cholesky, triangular solve, determinants (out= derived by register_out) -------

# rows of a diagonally dominant matrix, out of order so the LU swaps rows; its factors, Q and R are of magnitude
# at most 4, the determinant 56
_A = torch.tensor([[1., 4, 1], [4, 1, 0], [0, 1, 4]])
_SPD = _A.T @ _A
_RHS = torch.tensor([[1., 2], [0, 1], [3, -1]])
_LU, _PIV = torch.linalg.lu_factor(_A)
_I32 = torch.int32
# name -> (call(convert, outs), the out= tensors' dtypes; float ones are float32 from a float32 input)
FACTORISATIONS = {
    "linalg_lu_factor_ex.out": (lambda c, o: torch.linalg.lu_factor_ex(c(_A), out=o), (F32, _I32, _I32)),
    "linalg_lu.out": (lambda c, o: torch.linalg.lu(c(_A), out=o), (F32, F32, F32)),
    "lu_unpack.out": (lambda c, o: torch.lu_unpack(c(_LU), c(_PIV), out=o), (F32, F32, F32)),
    "linalg_qr.out": (lambda c, o: torch.linalg.qr(c(_A), out=o), (F32, F32)),
    "geqrf.a": (lambda c, o: torch.geqrf(c(_A), out=o), (F32, F32)),
    "_linalg_slogdet.sign": (lambda c, o: torch._linalg_slogdet(c(_A), out=o), (F32, F32, F32, _I32)),
    "_linalg_det.result": (lambda c, o: torch._linalg_det(c(_A), out=o), (F32, F32, _I32)),
    "linalg_cholesky_ex.L": (lambda c, o: torch.linalg.cholesky_ex(c(_SPD), out=o), (F32, _I32)),
    "triangular_solve.X": (lambda c, o: torch.triangular_solve(c(_RHS), c(_A.triu()), out=o), (F32, F32)),
}
# Two fp32 evaluations of a 3 x 3 factorisation: each entry is at most 2n = 6 rounded steps (one a square root,
# for Q, R and Cholesky) from entries of magnitude <= 4 (<= 56 for the determinant, 17 for the normal matrix), so
# each is within (2n)^2 u of the exact value relative to that magnitude (the columns' norms, well conditioned).
_U = 2.0 ** -24
_FACTOR_TOL = {"rtol": 2 * 36 * _U, "atol": 2 * 36 * _U * 56}


def _factor_outcome(call, convert, shapes, dtypes) -> tuple:
    """("result", out= tensors (shape, strides, CPU copy), whether they are what the call returns, resize
    warnings) or ("error", type, message)."""
    outs = tuple(convert(torch.full(s, 7, dtype=d)) for s, d in zip(shapes, dtypes))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = call(convert, outs)
        except Exception as e:  # noqa: BLE001 (the CPU's exception is the reference, whatever it is)
            return "error", type(e), str(e)
    said = [str(w.message) for w in caught if "resized" in str(w.message)]
    return ("result", [(o.shape, o.stride(), o.cpu()) for o in outs], all(r is o for r, o in zip(res, outs)),
            said)


def _assert_factorisation_like_cpu(name, shapes, dtypes) -> tuple:
    call = FACTORISATIONS[name][0]
    cpu = _factor_outcome(call, lambda t: t, shapes, dtypes)
    dev = _factor_outcome(call, to_n, shapes, dtypes)
    assert dev[0] == cpu[0], (cpu, dev)
    if cpu[0] == "error":
        assert dev == cpu
        return cpu
    assert dev[2] and cpu[2] and dev[3] == cpu[3]
    for (shape, stride, got), (want_shape, want_stride, want) in zip(dev[1], cpu[1]):
        # strides too: the CPU's structured kernels restride an out= they resize (column-major for LAPACK)
        assert shape == want_shape and stride == want_stride, (name, shape, stride, want_shape, want_stride)
        if want.is_floating_point():
            torch.testing.assert_close(got, want, **_FACTOR_TOL)
        else:
            assert torch.equal(got, want)
    return cpu


@pytest.mark.parametrize("name", sorted(FACTORISATIONS))
@pytest.mark.parametrize("size", [None, (0,), (2, 9)])
def test_a_factorisation_writes_its_outs_like_the_cpu(name, size, strict):
    """Out= tensors of the results' shapes (contiguous, where the CPU's results are column-major), empty, or of
    another shape (resized with the warning, restrided as the CPU's kernel restrides them)."""
    dtypes = FACTORISATIONS[name][1]
    if size is None:
        shapes = [r.shape for r in FACTORISATIONS[name][0](lambda t: t, tuple(torch.empty(0, dtype=d)
                                                                              for d in dtypes))]
    else:
        shapes = [size] * len(dtypes)
    _assert_factorisation_like_cpu(name, shapes, dtypes)


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
@pytest.mark.parametrize("name", sorted(FACTORISATIONS))
def test_a_factorisation_out_of_another_dtype_is_refused_like_the_cpu(name):
    """Each out= tensor in turn of another dtype: the CPU's error, raised on the device (no fallback); geqrf's CPU
    kernel writes float64 out= tensors, which takes its fallback."""
    dtypes = FACTORISATIONS[name][1]
    for k, d in enumerate(dtypes):
        wrong = list(dtypes)
        wrong[k] = F64 if d.is_floating_point else I64
        before = _fallbacks()
        cpu = _assert_factorisation_like_cpu(name, [(0,)] * len(dtypes), wrong)
        if name != "geqrf.a":
            assert cpu[0] == "error" and _fallbacks() == before, (name, k)


def test_the_factorisations_out_variants_are_registered_by_register_out():
    for name in FACTORISATIONS:
        assert LOWERED[name].__doc__.startswith(f"``{name}``: "), name


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_a_factorisation_into_its_input_behaves_as_on_the_cpu():
    def run(c):
        a = c(_A.clone())
        outs = (a, c(torch.empty(0, dtype=_I32)), c(torch.empty(0, dtype=_I32)))
        return outs, torch.linalg.lu_factor_ex(a, out=outs)
    _assert_like_cpu(run)
