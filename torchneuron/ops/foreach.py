"""``torch._foreach_*`` ops as multi-tensor launches: one ``kernels.foreach`` program applies an op to
every tensor of the lists (the default ``foreach`` optimizers, ``clip_grad_norm_``'s scaling),
instead of PyTorch's composite loop of one launch per tensor.

Each op applies the tile function its single-tensor lowering uses (``kernels/tilemath.py``), so the
element-wise results are bit-identical to the per-tensor ops, but for a NaN's payload in bf16/fp16 results
(rounded as torch converts the tile: its vector and element-by-element paths give different payloads, on the
CPU too); ``_foreach_norm`` computes each tensor's norm by ``linalg_vector_norm``'s instructions, bit for bit.
Scalars reach the kernel as device operands, so a
new learning rate or bias correction does not mean a new Program: one shared by every tensor as one
(1, 1) operand, one per tensor as one (n, 1) operand written in one host-to-device transfer for the whole
list (a launch binds one slot for either, its rows of it for the latter, not one per tensor). Lists that
are not all contiguous float tensors of one dtype on one neuron device, whose tensors differ in shape at
one index, or with a scalar that is not a real number, take the per-tensor loop (each op then lowers, or
falls back, on its own).
"""
from __future__ import annotations

import bisect
import math
import operator
from typing import Any, Callable, Sequence

import torch

from torchneuron.kernels.foreach import foreach_kernel, foreach_norm_kernel, operand_name
from torchneuron.kernels import tilemath as tm
from torchneuron.ops.base import aten, FLOATS, HALF_FLOATS, remember, rounded_scalar
from torchneuron.ops.kernel_call import host_operand, launch_traced, PlanCache, scalar_operand, traced_kernel
from torchneuron.ops.pointwise import UNARY_FLOAT, UNARY_SAME
from torchneuron.ops.registry import lowering

MAX_GROUPS = 64  # tensors per launch: longer lists are cut into launches of this many

# (kernel, device index, tile function, result dtype, lists' dtype, shapes, scalar operands' dtypes, in place) ->
# the plan of one launch (its operands: ``_launch``'s per-position arguments, flattened; the results allocated in
# their tensors' shapes)
_PLANS = PlanCache()


class _Loop(Exception):
    """These arguments take the per-tensor loop."""


_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_get_device = torch.Tensor.get_device
_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")
_nbytes_of = operator.attrgetter("nbytes")
_numel = torch.Tensor.numel
# (the checks below run on every call of an optimizer's step, over every list: each reads one attribute of every
# tensor with map, whose loop runs in C, ~2x cheaper than a Python loop reading them all)


def _fusable(lists: Sequence[Sequence[torch.Tensor]]) -> bool:
    """Whether the tensor lists can run as one multi-tensor launch (see the module docstring)."""
    first = lists[0]
    if not first:
        return False
    device, dtype = first[0].device, first[0].dtype
    if device.type != "neuron" or dtype not in FLOATS:
        return False
    # (an int device index is cheaper to read than a device: with no other accelerator in the process, a tensor
    # of index ``device.index`` is a neuron tensor, a CPU one's being -1)
    index = device.index
    shapes = list(map(_shape_of, first))
    for lst in lists:
        if len(lst) != len(shapes) or (lst is not first and list(map(_shape_of, lst)) != shapes):
            return False
        if set(map(_dtype_of, lst)) != {dtype} or set(map(_get_device, lst)) != {index} \
                or not all(map(_is_contiguous, lst)):
            return False
    return True


# (each list's start addresses and byte sizes, self's first) -> whether an in-place call with tensors there aliases
# (``_aliased_in_place``): an optimizer's step passes the same tensors every step, so the sort and searches over
# their ranges run once
_ALIASING: dict[tuple, bool] = {}


def _aliased_in_place(self: Sequence[torch.Tensor], lists: Sequence[Sequence[torch.Tensor]]) -> bool:
    """Whether an in-place call's tensors share memory other than ``self[i]`` with itself at position i.

    The per-tensor loop (what the CPU runs) writes tensor i before reading tensor i + 1, so a tensor repeated in
    ``self`` (``_foreach_mul_([a, a], 2)``: a * 4) or another list reading a later-written ``self`` tensor
    (``_foreach_add_([x, y], [y, x])``) sees the earlier writes; one launch would read every input first. Such
    calls take the loop. (The tensors are contiguous here: each covers one byte range.)"""
    ranges = tuple((tuple(map(_data_ptr, lst)), tuple(map(_nbytes_of, lst))) for lst in (self, *lists))
    aliased = _ALIASING.get(ranges)
    if aliased is None:
        aliased = remember(_ALIASING, ranges, _ranges_alias(ranges[0], ranges[1:]), 256)
    return aliased


def _ranges_alias(own: tuple, others: Sequence[tuple]) -> bool:
    """``_aliased_in_place`` on the lists' byte ranges, as (starts, sizes): ``own`` self's, ``others`` the other
    lists'."""
    starts, sizes = own
    spans = sorted((start, start + n) for start, n in zip(starts, sizes) if n)
    if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
        return True
    # self's ranges are disjoint and sorted, so their ends are too: a range [lo, hi) meets one of them exactly
    # when the last range starting before hi ends after lo
    firsts = [start for start, _ in spans]
    for lows, lengths in others:
        for i, (lo, n) in enumerate(zip(lows, lengths)):
            if not n or (lo == starts[i] and n == sizes[i]):
                continue   # nothing, or self[i]'s own elements (a += a): read and written in the same place
            k = bisect.bisect_left(firsts, lo + n)
            if k and spans[k - 1][1] > lo:
                return True
    return False


def _real(v: Any) -> float:
    if isinstance(v, torch.Tensor) or isinstance(v, complex):
        raise _Loop
    return float(v)


def _scalar_rows(values: list[float], device: torch.device) -> torch.Tensor:
    """The per-tensor scalars of one launch as a (len(values), 1) fp32 device operand, written in one transfer."""
    return host_operand(torch.tensor([[v] for v in values], dtype=torch.float32), torch.float32, device)


def _one_number(values: tuple[float, ...]) -> bool:
    """Whether ``values`` are all one number, sign of zero included (NaN never is: a list holding one stays per
    tensor)."""
    first = values[0]
    sign = math.copysign(1.0, first)
    return all(v == first and math.copysign(1.0, v) == sign for v in values)


def _shared_scalar(value: Any, device: torch.device) -> torch.Tensor:
    """A number as a (1, 1) fp32 device operand (rounded to fp32 as ``_scalar_rows`` rounds it)."""
    return scalar_operand(_real(value), torch.float32, device)


def _operand(o: Any, device: torch.device) -> Any:
    """A per-position operand: a same-shape tensor list stays; a one-element tensor on the device is a
    (1, 1) operand; a CPU scalar tensor or a number is a shared scalar; a sequence is one per tensor."""
    if isinstance(o, torch.Tensor):
        if o.device.type == "cpu" and o.dim() == 0:
            return _real(o.item())
        if o.device != device or o.numel() != 1 or not o.is_floating_point():
            raise _Loop
        return o.reshape(1, 1)
    return o


def _at_dtype(operands: list[Any], dtype: torch.dtype) -> list[Any]:
    """The scalar operands rounded to the lists' bfloat16 or float16 dtype first, as the per-tensor op reads its
    inputs (``elementwise.inputs_at_common_dtype``): ``bf16 + 0.3`` adds 0.30078125."""
    if dtype not in HALF_FLOATS:
        return operands

    def rounded(o: Any) -> Any:
        if isinstance(o, tuple):
            return tuple(rounded(v) for v in o)
        if isinstance(o, torch.Tensor) and o.dim() == 0:
            o = o.item() if o.device.type == "cpu" else o.to(dtype)
        return rounded_scalar(o, dtype) if isinstance(o, (int, float)) and not isinstance(o, bool) else o
    return [rounded(o) for o in operands]


def _launch(fn: Callable, self: Sequence[torch.Tensor], operands: list[Any], inplace: bool, op: str,
            result_dtype: torch.dtype | None = None):
    """``fn(self[i], *operands at i)`` for every i, in launches of up to MAX_GROUPS tensors.

    ``operands``: per position, a tensor list (the shapes of ``self``), a tuple of per-tensor scalars,
    or one shared operand (a number, or a scalar tensor). The results have ``result_dtype`` (self's if None)."""
    device, dtype = self[0].device, result_dtype or self[0].dtype
    lists = [o for o in operands if isinstance(o, list)]
    if not _fusable([self] + lists) or (inplace and _aliased_in_place(self, lists)):
        raise _Loop
    # per operand position: a tensor list, the per-tensor scalars as floats, or the shared (1, 1) operand (every
    # scalar read before anything runs: one the kernel cannot take sends the whole call to the per-tensor loop)
    columns: list[Any] = [self]
    kinds = ["full"]
    for o in operands:
        if isinstance(o, tuple):
            values = tuple(_real(v) for v in o)
            if _one_number(values):   # every tensor's the same (Adam's bias corrections): one shared operand
                columns.append(_shared_scalar(values[0], device))
                kinds.append("shared")
            else:
                columns.append(values)
                kinds.append("each")
        elif not isinstance(o, list):
            o = _operand(o, device)
            columns.append(o if isinstance(o, torch.Tensor) else _shared_scalar(o, device))
            kinds.append("shared")
        else:
            columns.append(o)
            kinds.append("full")
    # in place the results are self; else each group's is allocated by its launch (a list's empty tensors here)
    results = list(self) if inplace else [None] * len(self)
    live = [i for i, n in enumerate(map(_numel, self)) if n]
    if len(live) < len(self) and not inplace:
        for i in set(range(len(self))).difference(live):
            results[i] = torch.empty_like(self[i], dtype=dtype)
    # the per-tensor scalars of every launch written to the device at once: each launch binds its rows
    columns = [_scalar_rows([c[i] for i in live], device) if k == "each" else c for c, k in zip(columns, kinds)]
    index = device.index
    scalar_dtypes = tuple(torch.float32 if k == "each" else c.dtype for c, k in zip(columns, kinds) if k != "full")
    for lo in range(0, len(live), MAX_GROUPS):
        chunk = live[lo:lo + MAX_GROUPS]
        kernel = foreach_kernel(len(chunk), 1 + len(operands), tuple(kinds), inplace)
        # what the trace depends on (the lists share self's shapes and dtype; scalars are fp32 or the tensor's)
        shapes = tuple(map(_shape_of, self)) if len(chunk) == len(self) else tuple(self[i].shape for i in chunk)
        key = (kernel, index, fn, dtype, self[0].dtype, shapes, scalar_dtypes, inplace)
        # (one launch binds the per-tensor scalars whole: a slice costs a view)
        rows = slice(lo, lo + len(chunk)) if len(live) > MAX_GROUPS else None
        chunk_operands = _chunk_operands(columns, kinds, chunk, rows)
        plan = _PLANS.get(key)
        if plan is None:
            _first_launch(key, kernel, fn, self, chunk_operands, kinds, chunk, results, inplace, op)
        else:
            # a traced program: each tensor bound as it is (contiguous, the slot's element count), without the
            # views and name lookups of call_kernel; unbound results are allocated by the launch in their tensors'
            # shapes
            for i, t in zip(chunk, plan.launch(chunk_operands, index, op)):
                results[i] = t
    return None if inplace else results


def _first_launch(key: tuple, kernel: Any, fn: Callable, self: Sequence[torch.Tensor], operands: list,
                  kinds: list[str], chunk: list[int], results: list, inplace: bool, op: str) -> None:
    """Trace and launch the kernel of one chunk's first call (on ``_chunk_operands``), writing its results into
    ``results`` (in place: over self), and keep its plan under ``key``."""
    if not inplace:
        for i in chunk:
            results[i] = torch.empty_like(self[i], dtype=key[3])
    roles, inputs = {}, {}
    for j, kind in enumerate(kinds):   # (the kernel reads a list's tensors as rows)
        for k in range(len(chunk) if kind == "full" else 1):
            name, t = operand_name(k, j), operands[len(roles)]
            roles[name], inputs[name] = len(roles), t.view(1, -1) if kind == "full" else t
    traced = traced_kernel(kernel, inputs, {"fn": fn, "out_dtype": key[3]})
    launch_traced(traced, inputs, [] if inplace else [results[i].view(1, -1) for i in chunk], op, key[1])
    # the launch allocates each result in its tensor's shape (in place there is none: the kernel writes over self)
    _PLANS.keep(key, traced, roles, None if inplace else [tuple(self[i].shape) for i in chunk])


def _chunk_operands(columns: list[Any], kinds: list[str], chunk: list[int], rows: slice | None) -> list:
    """The kernel operands of one launch over the tensors ``chunk``, position by position: a list's tensors in
    group order, else the position's one scalar operand (see ``kernels.foreach``): a shared operand, or the
    ``rows`` of the per-tensor scalars (None: all of them)."""
    operands = []
    whole = len(chunk) == len(columns[0])   # (every tensor of the lists: each list as it is)
    for c, kind in zip(columns, kinds):
        if kind == "full":
            operands += c if whole else [c[i] for i in chunk]
        else:
            operands.append(c if kind == "shared" or rows is None else c[rows])
    return operands


def _register(overload: str, build: Callable, each: Callable, at_dtype: bool = False) -> None:
    """Lower ``aten::_foreach_<overload>``: ``build(*args, **kw)`` gives (tile function, operands after
    self, see ``_launch``); ``each(call, i, t, *args, **kw)`` is tensor i's op in the per-tensor loop,
    ``call`` being the ``torch.Tensor`` method of the same name. ``at_dtype``: the op reads its scalar operands
    in the lists' dtype (``_at_dtype``)."""
    packet, _, ov = overload.partition(".")
    inplace = packet.endswith("_")
    op = str(getattr(getattr(aten, "_foreach_" + packet), ov or "default"))
    call = getattr(torch.Tensor, packet)

    def kernel(self, *args, **kwargs):
        try:
            if not self:
                raise _Loop
            fn, operands = build(*args, **kwargs)
            if any(isinstance(o, tuple) and len(o) != len(self) for o in operands):
                raise RuntimeError("Tensor list must have same number of elements as scalar list.")  # (the CPU's)
            if at_dtype:
                operands = _at_dtype(operands, self[0].dtype)
            return _launch(fn, self, operands, inplace, op)
        except _Loop:
            out = [each(call, i, t, *args, **kwargs) for i, t in enumerate(self)]
            return None if inplace else out
    # complex operands take the per-tensor loop (``_fusable`` and ``_real`` refuse them), each op then lowering
    # or falling back on its own: no check of every tensor before the kernel runs
    lowering("_foreach_" + overload, complex_operands=True)(kernel)


def _alpha(fn: Callable, scaled: Callable | None, alpha: Any) -> tuple[Callable, list]:
    if alpha == 1:
        return fn, []
    if scaled is None:
        raise _Loop
    return scaled, [alpha]


def _binary(name: str, fn: Callable, scaled: Callable | None, at_dtype: bool) -> None:
    """``_foreach_<name>(_)`` with a scalar, a list of scalars, a tensor list or a scalar tensor (``at_dtype``:
    the scalars and alpha read in the lists' dtype, as ``add`` and ``sub`` read theirs; ``mul`` and ``div``
    read a scalar in float32)."""
    def with_other(other, *, alpha=1):
        f, extra = _alpha(fn, scaled, alpha)
        return f, [other, *extra]
    shared = lambda call, i, t, x, **kw: call(t, x, **kw)           # noqa: E731
    item = lambda call, i, t, xs, **kw: call(t, xs[i], **kw)        # noqa: E731
    for packet in (name, name + "_"):
        _register(f"{packet}.Scalar", lambda s: (fn, [s]), shared, at_dtype)
        _register(f"{packet}.ScalarList", lambda ss: (fn, [tuple(ss)]), item, at_dtype)
        _register(f"{packet}.List", lambda other, **kw: with_other(list(other), **kw), item, at_dtype)
        if hasattr(getattr(aten, "_foreach_" + packet), "Tensor"):
            _register(f"{packet}.Tensor", with_other, shared, at_dtype)


_binary("add", tm.add, tm.add_scaled, at_dtype=True)
_binary("sub", tm.sub, tm.sub_scaled, at_dtype=True)
_binary("mul", tm.mul, None, at_dtype=False)
_binary("div", tm.div, None, at_dtype=False)

for _name, _fn in {**UNARY_FLOAT, **UNARY_SAME}.items():
    if hasattr(aten, "_foreach_" + _name):
        for _packet in (_name, _name + "_"):
            _register(_packet, lambda _fn=_fn: (_fn, []), lambda call, i, t: call(t))


def _value_list(scalars: Any) -> tuple:
    """addcmul/addcdiv's per-tensor values, from a list or a (CPU) tensor of them."""
    return tuple(scalars.tolist()) if isinstance(scalars, torch.Tensor) else tuple(scalars)


for _name, _fn in (("addcmul", tm.addcmul), ("addcdiv", tm.addcdiv)):
    for _packet in (_name, _name + "_"):
        _register(f"{_packet}.Scalar", lambda a, b, value=1, _fn=_fn: (_fn, [list(a), list(b), value]),
                  lambda call, i, t, a, b, value=1: call(t, a[i], b[i], value=value))
        for _ov in ("ScalarList", "Tensor"):
            _register(f"{_packet}.{_ov}", lambda a, b, scalars, _fn=_fn: (_fn, [list(a), list(b), _value_list(scalars)]),
                      lambda call, i, t, a, b, scalars: call(t, a[i], b[i], value=_value_list(scalars)[i]))

def _lerp_branch(weight: Any) -> Callable:
    """The tile function of a lerp by one number (Adam's first moment): the branch ``tm.lerp`` selects for it,
    decided on the weight as the kernel reads it (rounded to fp32), so the kernel computes that branch only."""
    w = torch.tensor(_real(weight), dtype=torch.float32).item()
    return tm.lerp_small_weight if abs(w) < 0.5 else tm.lerp_large_weight


for _packet in ("lerp", "lerp_"):
    _register(f"{_packet}.Scalar", lambda e, w: (_lerp_branch(w), [list(e), w]), lambda call, i, t, e, w: call(t, e[i], w))
    _register(f"{_packet}.ScalarList", lambda e, ws: (tm.lerp, [list(e), tuple(ws)]),
              lambda call, i, t, e, ws: call(t, e[i], ws[i]))
    _register(f"{_packet}.List", lambda e, w: (tm.lerp, [list(e), list(w)]),
              lambda call, i, t, e, w: call(t, e[i], w[i]))


@lowering("_foreach_norm.Scalar", complex_operands=True)
def foreach_norm(self: list, ord: Any = 2, dtype: torch.dtype | None = None) -> list:
    """``_foreach_norm`` (``clip_grad_norm_``): for the 2-norm, one launch per MAX_GROUPS tensors
    (``kernels.foreach.foreach_norm_kernel``: each norm as ``linalg_vector_norm`` computes it), each norm allocated
    0-d by the launch."""
    if ord != 2 or dtype is not None or not _fusable([self]) or 0 in map(_numel, self):
        return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in self]
    index, op = self[0].get_device(), "aten::_foreach_norm"
    norms: list[torch.Tensor] = []
    for lo in range(0, len(self), MAX_GROUPS):
        chunk = self[lo:lo + MAX_GROUPS]
        kernel = foreach_norm_kernel(len(chunk))
        key = (kernel, index, self[0].dtype, tuple(map(_shape_of, chunk)))
        plan = _PLANS.get(key)
        if plan is None:   # traced on the tensors as rows; the plan binds them as they are (contiguous)
            inputs = {operand_name(k, 0): t.view(1, -1) for k, t in enumerate(chunk)}
            plan = _PLANS.keep(key, traced_kernel(kernel, inputs, {"out_dtype": self[0].dtype}),
                               {name: k for k, name in enumerate(inputs)}, [()] * len(chunk))
        norms += plan.launch(chunk, index, op)
    return norms
