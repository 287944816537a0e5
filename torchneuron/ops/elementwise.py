"""Device copies and element-wise launches: the two services every lowering builds on.

``device_copy(dst, src)`` copies between two views of one neuron device by a strided DMA kernel
(``kernels.copy.strided_copy``) over the storage spans the views cover, reading and writing each
through its strides (a cast when the dtypes differ). Dtypes the NeuronCore cannot compute in (int64,
float64, complex) are still copied on the device when source and destination share the dtype: the
DMA moves their bytes as int32 words. ``dense(t)`` gives kernels the contiguous operands they read.

``run_pointwise(fn, operands, kind)`` does what TensorIterator does on CPU: promotes dtypes
(``torch._prims_common.elementwise_dtypes``: Python scalars and 0-dim tensors are weak), broadcasts,
checks ``out=`` / in-place targets (shape and castability, with PyTorch's messages), and then launches
``kernels.elementwise`` once. Tiles compute in fp32 (ints in int32, exactly); the loads and the store
cast. Python scalars reach the kernel as (1, 1) device tensors, so one Program serves every value.

The two live in one module because each uses the other: a conversion copy to or from int64 and
float64 is an element-wise computation, and an element-wise result for a strided target is copied.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import elementwise_dtypes

import torchneuron.nki.language as nl
from torchneuron.kernels.copy import multi_copy, strided_copy, widen_int64
from torchneuron.kernels.elementwise import KERNELS, NAMES, fold_broadcast
from torchneuron.kernels.transpose import permute_kernel
from torchneuron.kernels import tilemath
from torchneuron.ops.base import (DEVICE_DTYPES, HALF_FLOATS, remember, resize_out, rounded_scalar, storage_span,
                                  type_name, Unsupported)
from torchneuron.ops.kernel_call import call_kernel, launch_traced, PlanCache, scalar_operand, traced_kernel
from torchneuron.runtime.launch import launch_slots, slot_layout

Number = (int, float, bool)
_MEMO_LIMIT = 4096     # entries per memo before it starts over (a program that keeps changing shapes)


# ---- copies -------------------------------------------------------------------------------------------

def coalesce(sizes: list, a: list, b: list) -> tuple[tuple, tuple, tuple]:
    """Drop size-1 dims and merge neighbours that are contiguous in both views (fewer DMA dims)."""
    dims = [(n, x, y) for n, x, y in zip(sizes, a, b) if n != 1] or [(1, 1, 1)]
    out = [list(dims[0])]
    for n, x, y in dims[1:]:
        m, px, py = out[-1]
        if px == x * n and py == y * n:
            out[-1] = [m * n, x, y]
        else:
            out.append([n, x, y])
    return tuple(d[0] for d in out), tuple(d[1] for d in out), tuple(d[2] for d in out)


def _words(span: torch.Tensor, sizes: list, strides: list) -> tuple[torch.Tensor, list, list]:
    """Reinterpret a span of a dtype the core lacks as int32 words (one more dim of itemsize/4)."""
    k = span.dtype.itemsize // 4
    return span.view(torch.int32), [*sizes, k], [*(s * k for s in strides), 1]



def can_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``device_copy`` runs this copy on the device."""
    if dst.dtype == src.dtype:
        return dst.dtype in DEVICE_DTYPES or dst.dtype.itemsize % 4 == 0
    if dst.dtype == torch.int64:
        return src.dtype in DEVICE_DTYPES
    if src.dtype == torch.int64:
        return dst.dtype in DEVICE_DTYPES
    if torch.float64 in (dst.dtype, src.dtype):  # to or from a float dtype of the core, by integer work
        other = src.dtype if dst.dtype == torch.float64 else dst.dtype
        return other.is_floating_point and other in DEVICE_DTYPES
    return dst.dtype in DEVICE_DTYPES and src.dtype in DEVICE_DTYPES


def to_int64(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src`` (a device dtype) as int64, on the device: integers via int32, then the sign-extended high words;
    floats by their two words computed from the fp32 value (an int32 cast would saturate at 2**31)."""
    if src.dtype.is_floating_point:
        dst = out if out is not None else torch.empty(src.shape, dtype=torch.int64, device=src.device)
        if src.numel() == 0:
            return dst
        src = src if src.dtype == torch.float32 else src.to(torch.float32)   # exact
        for k, word in ((1, tilemath.f32_int64_high_word), (0, tilemath.f32_int64_low_word)):
            run_pointwise(word, [src], KIND.DEFAULT, _word(dst, k), result_dtype=torch.int32, op="aten::_to_copy")
        return dst
    if src.dtype != torch.int32:
        src32 = torch.empty(src.shape, dtype=torch.int32, device=src.device)
        device_copy(src32, src)
        src = src32
    elif not src.is_contiguous():
        src = src.contiguous()
    dst = out if out is not None and out.is_contiguous() else torch.empty(src.shape, dtype=torch.int64,
                                                                           device=src.device)
    if src.numel():
        call_kernel(widen_int64, {"dst": dst.reshape(-1).view(torch.int32), "src": src.reshape(-1)},
                    op="aten::_to_copy")
    if out is not None and dst is not out:
        device_copy(out, dst)
        return out
    return dst


def _word(src: torch.Tensor, k: int) -> torch.Tensor:
    """Word ``k`` (0: low, 1: high) of each element of an int64 tensor, as an int32 view."""
    words = storage_span(src).view(torch.int32)
    return words.as_strided(src.shape, [2 * st for st in src.stride()], words.storage_offset() + k)


def _int64_to_float(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst = float(src)`` for int64 ``src``: (high word + borrow) * 2**32 + the low word read signed."""
    run_pointwise(tilemath.from_words, [_word(src, 1), _word(src, 0), 4294967296.0],
                  KIND.INT_TO_FLOAT, dst, op="aten::_to_copy")


def _float64_convert(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst = src`` between float64 and a float dtype of the core, through fp32 (as the CPU casts
    half and bfloat16 to and from double): fp32 bits <-> the two words of the float64."""
    if dst.dtype == torch.float64:
        if src.dtype != torch.float32:
            src = src.to(torch.float32)
        bits = src.view(torch.int32)
        run_pointwise(tilemath.f64_high_word, [bits], KIND.DEFAULT, _word(dst, 1), op="aten::_to_copy")
        run_pointwise(tilemath.f64_low_word, [bits], KIND.DEFAULT, _word(dst, 0), op="aten::_to_copy")
        return
    narrow = dst if dst.dtype == torch.float32 else torch.empty(dst.shape, dtype=torch.float32, device=dst.device)
    run_pointwise(tilemath.f64_to_f32_bits, [_word(src, 1), _word(src, 0)], KIND.DEFAULT,
                  narrow.view(torch.int32), op="aten::_to_copy")
    if narrow is not dst:
        device_copy(dst, narrow)


def device_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` (broadcast to dst's shape) on dst's neuron device, through the views' strides."""
    src = src.expand(dst.shape)
    if dst.numel() == 0:
        return
    if dst.dtype != src.dtype and torch.int64 in (dst.dtype, src.dtype):
        if dst.dtype == torch.int64:
            to_int64(src, dst)
        elif dst.dtype.is_floating_point:
            _int64_to_float(dst, src)
        else:  # int64 -> narrower ints: the low words, cast (values beyond int32 wrap, as a C cast does)
            device_copy(dst, _word(src, 0))
        return
    if dst.dtype != src.dtype and torch.float64 in (dst.dtype, src.dtype):
        _float64_convert(dst, src)
        return
    index = dst.get_device()
    key = (index, dst.dtype, src.dtype, dst.shape, dst.stride(), src.stride())
    plan = _COPY_PLANS.get(key)
    if plan is not None:
        # the traced program of this signature: only the spans' starts (storage offsets) differ between calls
        dlen, slen, words = plan.extra
        plan.launch((_span(dst, dlen, words), _span(src, slen, words)), index, "aten::copy_")
        return
    dspan, sspan = storage_span(dst), storage_span(src)
    dlen, slen = dspan.numel(), sspan.numel()
    sizes, dstr, sstr = list(dst.shape), list(dst.stride()), list(src.stride())
    words = dst.dtype not in DEVICE_DTYPES
    if words:  # same dtype (can_copy): move the bytes as int32 words
        dspan, dsizes, dstr = _words(dspan, sizes, dstr)
        sspan, sizes, sstr = _words(sspan, sizes, sstr)
    sizes, dstr, sstr = coalesce(sizes, dstr, sstr)
    inputs = {"dst": dspan, "src": sspan}
    traced = traced_kernel(strided_copy, inputs, {"dst_view": (0, sizes, dstr), "src_view": (0, sizes, sstr)})
    launch_traced(traced, inputs, op="aten::copy_", index=index)
    _COPY_PLANS.keep(key, traced, _COPY_ROLES, extra=(dlen, slen, words))


# (device, dst dtype, src dtype, sizes, dst strides, src strides) -> what ``device_copy`` traced once: the plan of
# operand 0, the destination's span, and 1, the source's; extra: the spans' element counts and whether they move as
# int32 words
_COPY_PLANS = PlanCache(_MEMO_LIMIT)
_COPY_ROLES = {"dst": 0, "src": 1}


def _span(t: torch.Tensor, n: int, words: bool) -> torch.Tensor:
    """The ``n``-element storage run from ``t``'s first element (``storage_span`` with its length known), as int32
    words when ``words``."""
    span = t.as_strided((n,), (1,), t.storage_offset())
    return span.view(torch.int32) if words else span


def copy_parts(parts: list[tuple[torch.Tensor, torch.Tensor]], op: str = "aten::cat") -> tuple | None:
    """``dst[...] = src`` for each (dst, src) pair, the dsts being non-overlapping views of one tensor and
    every src of the dsts' dtype: one ``multi_copy`` launch (``torch.cat`` of many inputs). Returns the launch's
    ``traced_kernel`` and its inputs by slot name (``dst``: the dsts' span, ``src<i>``: pair i's source span),
    None when nothing was copied."""
    parts = [(d, s.expand(d.shape)) for d, s in parts if d.numel()]
    if not parts:
        return None
    base = parts[0][0]
    start = min(d.storage_offset() for d, _ in parts)
    end = max(d.storage_offset() + sum((n - 1) * st for n, st in zip(d.shape, d.stride())) for d, _ in parts)
    dspan = base.as_strided((end - start + 1,), (1,), start)
    words = base.dtype not in DEVICE_DTYPES
    if words:
        dspan = dspan.view(torch.int32)
    inputs, views = {"dst": dspan}, []
    for i, (d, src) in enumerate(parts):
        sspan = storage_span(src)
        sizes, dstr, sstr = list(d.shape), list(d.stride()), list(src.stride())
        if words:
            k = d.dtype.itemsize // 4
            sspan = sspan.view(torch.int32)
            sizes, dstr, sstr = [*sizes, k], [*(x * k for x in dstr), 1], [*(x * k for x in sstr), 1]
        sizes, dstr, sstr = coalesce(sizes, dstr, sstr)
        scale = d.dtype.itemsize // 4 if words else 1
        inputs[f"src{i}"] = sspan
        views.append(((scale * (d.storage_offset() - start), sizes, dstr), (0, sizes, sstr)))
    traced = traced_kernel(multi_copy(len(parts)), inputs, {"views": tuple(views)})
    launch_traced(traced, inputs, op=op)
    return traced, inputs


def write_result(res: torch.Tensor, out: torch.Tensor | None, warn_resize: bool = True) -> torch.Tensor:
    """``res`` itself, or copied into the ``out=`` tensor (resized first when its shape differs, with
    PyTorch's warning for a non-empty one) on the device."""
    if out is None:
        return res
    if tuple(out.shape) != tuple(res.shape):
        resize_out(out, res.shape, warn_resize)
    device_copy(out, res)
    return out


PERMUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int8, torch.uint8, torch.bool)


def _permutation(t: torch.Tensor) -> tuple[int, ...] | None:
    """``perm`` such that ``t == base.permute(perm)`` for a contiguous ``base`` (None if there is none)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    base = t.permute(order)
    if not base.is_contiguous():
        return None
    perm = [0] * t.dim()
    for k, d in enumerate(order):
        perm[d] = k
    return tuple(perm)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` if contiguous, else a contiguous copy made on the device: a transpose of a contiguous tensor
    that moves its last dim by the permute kernel (TensorE transposes), anything else by a DMA kernel
    that reads the view through its strides."""
    if t.is_contiguous():
        return t
    perm = _permutation(t) if t.dtype in PERMUTE_DTYPES and t.numel() > 1 else None
    if perm is not None and perm[-1] != t.dim() - 1:
        inverse = [0] * len(perm)
        for k, d in enumerate(perm):
            inverse[d] = k
        base = t.permute(inverse)
        (flat,) = call_kernel(permute_kernel, {"x": base.reshape(-1)}, {"shape": tuple(base.shape), "perm": perm},
                              op="aten::clone")
        return flat.view(t.shape)
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    device_copy(out, t)
    return out


# ---- element-wise launches ----------------------------------------------------------------------------

def check_target(target: torch.Tensor, shape: tuple, result: torch.dtype, inplace: bool) -> None:
    """TensorIterator's checks of an ``out=`` or in-place target: the result casts to it; in place, its shape is the broadcast shape."""
    if not torch.can_cast(result, target.dtype):
        raise RuntimeError(f"result type {type_name(result)} can't be cast to the desired output type "
                           f"{type_name(target.dtype)}")
    if inplace and tuple(target.shape) != shape:
        raise RuntimeError(f"output with shape {list(target.shape)} doesn't match the broadcast shape {list(shape)}")


def broadcast_shape(shapes: list) -> tuple:
    """The broadcast of ``shapes``, with TensorIterator's error message when they do not broadcast."""
    out: list[int] = []
    for shape in shapes:
        shape = list(shape)
        n = max(len(out), len(shape))
        a, b = [1] * (n - len(out)) + out, [1] * (n - len(shape)) + shape
        # the CPU compares from the last dimension backwards, so of several mismatches it names the last
        for d in reversed(range(n)):
            x, y = a[d], b[d]
            if x != y and x != 1 and y != 1:
                raise RuntimeError(f"The size of tensor a ({x}) must match the size of tensor b ({y}) at "
                                   f"non-singleton dimension {d}")
        out = [y if x == 1 else x for x, y in zip(a, b)]
    return tuple(out)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def aliases_itself(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` share memory (a dim of stride 0 and size > 1: an expanded tensor)."""
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether non-empty ``a`` and ``b`` on one device have overlapping byte spans (so may share elements)."""
    if not a.numel() or not b.numel() or a.device != b.device:
        return False
    (lo, hi), (lo_b, hi_b) = _byte_range(a), _byte_range(b)
    return lo_b < hi and lo < hi_b


def check_no_internal_overlap(target: torch.Tensor) -> None:
    """PyTorch's refusal to write a tensor whose elements alias each other (an expanded ``out=``)."""
    if aliases_itself(target):
        raise RuntimeError("unsupported operation: more than one element of the written-to tensor refers to a single "
                           "memory location. Please clone() the tensor before performing the operation.")


def check_no_overlap(target: torch.Tensor, inputs: list) -> None:
    """PyTorch's ``assert_no_overlap``: ops that write ``target`` while reading ``inputs`` refuse any
    shared byte (``cat``, ``gather``: their kernels do not read each element before writing it)."""
    lo, hi = _byte_range(target)
    for t in inputs:
        if t.numel() and t.device == target.device:
            a, b = _byte_range(t)
            if a < hi and lo < b:
                raise RuntimeError("unsupported operation: some elements of the input tensor and the written-to "
                                   "tensor refer to a single memory location. Please clone() the tensor before "
                                   "performing the operation.")


def check_overlap(target: torch.Tensor, inputs: list) -> None:
    """TensorIterator's refusals: a target whose elements alias each other, or that partly aliases an input."""
    check_no_internal_overlap(target)
    lo, hi = _byte_range(target)
    for t in inputs:
        if t.numel() and not _same_view(t, target):
            a, b = _byte_range(t)
            if a < hi and lo < b:
                raise RuntimeError("unsupported operation: some elements of the input tensor and the written-to "
                                   "tensor refer to a single memory location. Please clone() the tensor before "
                                   "performing the operation.")


_PROMOTIONS: dict = {}
_PLANS: dict = {}      # call signature -> _Plan
_SHAPES: dict = {}     # operand shapes -> their broadcast shape (errors are raised, never cached)
_FOLDS: dict = {}


def promote(operands: list, kind: KIND) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, result dtype) by PyTorch's rules, memoised on what they depend on."""
    key = (kind, *((o.dtype, o.dim() == 0) if isinstance(o, torch.Tensor) else type(o) for o in operands))
    hit = _PROMOTIONS.get(key)
    if hit is None:
        hit = remember(_PROMOTIONS, key, elementwise_dtypes(*operands, type_promotion_kind=kind), _MEMO_LIMIT)
    return hit


def inputs_at_common_dtype(operands: list, keep: tuple[int, ...] = (), keep_scalar: tuple[int, ...] = ()) -> list:
    """``operands`` as PyTorch hands a kernel its inputs when their common dtype is bfloat16 or float16.

    TensorIterator casts every input to the common dtype before the kernel's float32 math (CPU and CUDA alike),
    so an input of another dtype (a Python number, a 0-dim tensor of a wider float, an integer tensor) is rounded
    to it first: ``bf16 + 0.3`` adds 0.30078125, and ``bf16 % 0.3`` takes the remainder of 0.30078125. The tile
    math loads every operand in float32, so without this it would use the unrounded value. ``keep``: positions of
    Scalar arguments the CPU kernel reads in float32 (addcmul's ``value``, lerp's scalar weight); ``keep_scalar``:
    positions read in float32 when they hold a scalar (mul's and div's second operand, which the CPU kernels read
    with ``original_scalar_value``)."""
    first = operands[0]
    if isinstance(first, torch.Tensor):
        dtype = first.dtype
        for o in operands:   # (a loop: a generator in all() costs more than the test on two operands)
            if not isinstance(o, torch.Tensor) or o.dtype != dtype:
                break
        else:
            return operands   # one dtype: nothing to convert
    common = promote([o for i, o in enumerate(operands) if i not in keep], KIND.DEFAULT)[1]
    if common not in HALF_FLOATS:
        return operands
    converted = []
    for i, o in enumerate(operands):
        scalar = not isinstance(o, torch.Tensor) or o.dim() == 0
        if i in keep or (i in keep_scalar and scalar) or isinstance(o, bool):
            converted.append(o)
        elif isinstance(o, torch.Tensor):
            converted.append(o if o.dtype == common else o.to(common))
        elif isinstance(o, (int, float)):
            converted.append(rounded_scalar(o, common))
        else:
            converted.append(o)
    return converted


def _fold(shape: tuple, shapes: tuple) -> tuple[bool, list, int, int]:
    """(materialise broadcasts first, kind of each operand, R, C) of the kernel's [R, C] problem (memoised)."""
    key = (shape, shapes)
    hit = _FOLDS.get(key)
    if hit is None:
        # shapes: a tensor's shape, None for a Python scalar (a (1, 1) operand either way)
        fold = fold_broadcast(shape, [() if s is None else s for s in shapes])
        materialise = fold is None
        if materialise:
            fold = fold_broadcast(shape, [() if s is None else shape for s in shapes])
        k, kinds = fold
        R = C = 1
        for n in shape[:k]:
            R *= n
        for n in shape[k:]:
            C *= n
        hit = remember(_FOLDS, key, (materialise, kinds, R, C), _MEMO_LIMIT)
    return hit


def run_pointwise(fn: Callable, operands: list, kind: KIND, target: torch.Tensor | None = None,
                  inplace: bool = False, result_dtype: torch.dtype | None = None, op: str | None = None) -> torch.Tensor:
    """Apply tile function ``fn`` to ``operands`` (tensors and Python scalars) element-wise on the device.

    ``target``: the ``out=`` tensor, or ``self`` when ``inplace``; ``result_dtype``: overrides the
    promoted result dtype (comparisons: bool). Raises Unsupported for what the device cannot run."""
    # (the kind enters by identity: an Enum member hashes in Python; its members are singletons)
    key = (fn, id(kind), result_dtype, inplace, None if target is None else _signature(target),
           *[(o.dtype, o.shape, o.stride(), o.device) if isinstance(o, torch.Tensor) else type(o) for o in operands])
    plan = _PLANS.get(key)
    if plan is not None:
        return _run_plan(plan, operands, target, op)
    device = None
    args = []
    for o in operands:
        if isinstance(o, torch.Tensor):
            if o.device.type == "neuron":
                device = device or o.device
                if o.device != device:
                    raise Unsupported  # the fallback raises PyTorch's device error
            elif o.dim() == 0 and o.device.type == "cpu":
                o = o.item() if o.dtype != torch.bool else bool(o.item())  # a CPU scalar tensor: a weak scalar
            else:
                raise Unsupported
        args.append(o)
    if device is None or (target is not None and target.device != device):
        raise Unsupported
    compute, result = promote(operands, kind)
    if result_dtype is not None:
        result = result_dtype
    tensors = [o for o in args if isinstance(o, torch.Tensor)]
    if any(t.dtype not in DEVICE_DTYPES for t in tensors) or result not in DEVICE_DTYPES \
            or (target is not None and target.dtype not in DEVICE_DTYPES) or compute.is_complex:
        raise Unsupported
    shapes = tuple(t.shape for t in tensors)
    shape = _SHAPES.get(shapes)
    if shape is None:
        shape = remember(_SHAPES, shapes, broadcast_shape(list(shapes)), _MEMO_LIMIT)
    if len(shape) > 64:
        raise RuntimeError("only tensors with up to 64 dims are supported")
    if target is not None:
        check_target(target, shape, result, inplace)
        if target.numel():
            check_overlap(target, tensors)
        if not inplace and tuple(target.shape) != shape:
            resize_out(target, shape)
        if not inplace and target.dtype != result and result in HALF_FLOATS:
            # the CPU computes in the 2-byte common dtype and casts that into a wider out= tensor: round there first
            device_copy(target, run_pointwise(fn, operands, kind, None, False, result_dtype, op))
            return target
    tile_dtype = nl.float32 if compute.is_floating_point else nl.int32
    out_dtype = target.dtype if target is not None else result
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return target if target is not None else torch.empty(shape, dtype=out_dtype, device=device)
    # the kernel's [R, C] problem: each tensor full, a row, a column or a scalar of it
    materialise, kinds, R, C = _fold(shape, tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in args))
    if materialise:  # a broadcast the [R, C] form cannot express: materialise the broadcast operands
        args = [a.expand(shape) if isinstance(a, torch.Tensor) and tuple(a.shape) != shape else a for a in args]
    two_d = {"full": (R, C), "row": (1, C), "col": (R, 1), "scalar": (1, 1)}
    plan = _Plan(kernel=KERNELS[len(args)], meta={"fn": fn, "out_dtype": out_dtype, "compute": tile_dtype},
                 shape=shape, R=R, C=C, tile_dtype=tile_dtype, materialise=materialise,
                 views=[two_d[kd] if isinstance(a, torch.Tensor) else None for a, kd in zip(args, kinds)],
                 direct=target is not None and target.is_contiguous(), out_dtype=out_dtype, device=device)
    if target is None or tuple(target.shape) == tuple(key[4][1]):  # not when an out= target was resized
        remember(_PLANS, key, plan, _MEMO_LIMIT)
    return _run_plan(plan, operands, target, op, checked=True)


@dataclasses.dataclass
class _Plan:
    """What ``run_pointwise`` decided for one signature of operands: replayed on later calls."""

    kernel: Any
    meta: dict
    shape: tuple
    R: int
    C: int
    tile_dtype: torch.dtype
    materialise: bool
    views: list            # per operand: its [R, C]-problem shape, or None for a scalar
    direct: bool           # the target is written by the kernel itself (contiguous)
    out_dtype: torch.dtype
    device: torch.device
    # once the plan has run: (the kernel's Program, each operand's slot, the result's slot, the slot count,
    # the launch's slot layout: operands bound as they are and the result allocated in the broadcast shape)
    bound: tuple | None = None


def _signature(o: Any) -> Any:
    """What a plan depends on in an operand: dtype, shape, strides and device, or a scalar's type."""
    if isinstance(o, torch.Tensor):
        return (o.dtype, o.shape, o.stride(), o.device)
    return type(o)


def _bind(plan: _Plan, inputs: list[torch.Tensor]) -> tuple:
    """``plan.bound`` from the first call's kernel inputs (traced once: the plan fixes the kernel's device, shapes,
    dtypes and meta)."""
    views = [t.view(v) if v is not None else t for t, v in zip(inputs, plan.views)]
    program, outputs, order, _ = traced_kernel(plan.kernel, dict(zip(NAMES, views)), plan.meta)
    assert len(outputs) == 1, f"an element-wise kernel writes one result, not {outputs}"
    layout = slot_layout(program, {outputs[0]: plan.shape})
    return program, [order.index(n) for n in NAMES[:len(inputs)]], order.index(outputs[0]), len(order), layout


def _run_plan(plan: _Plan, operands: list, target: torch.Tensor | None, op: str | None,
              checked: bool = False) -> torch.Tensor:
    """Launch a planned element-wise op (operand and target checks done unless a plan replays them)."""
    if target is not None and not checked and target.numel():
        check_overlap(target, [o for o in operands if isinstance(o, torch.Tensor) and o.device.type == "neuron"])
    # each operand is bound as it is (contiguous): the launch reads it at its slot's [R, C]-problem shape
    inputs = []
    for o, view in zip(operands, plan.views):
        if view is None:
            if isinstance(o, torch.Tensor):  # a CPU 0-dim tensor: a weak scalar
                o = o.item()
            inputs.append(scalar_operand(o, plan.tile_dtype, plan.device))
            continue
        if plan.materialise and tuple(o.shape) != plan.shape:
            o = o.expand(plan.shape)
        inputs.append(o if o.is_contiguous() else dense(o))
    bound = plan.bound
    if bound is None:
        bound = plan.bound = _bind(plan, inputs)
    program, slots, result_slot, count, layout = bound
    tensors: list = [None] * count
    for slot, t in zip(slots, inputs):
        tensors[slot] = t
    if plan.direct:
        tensors[result_slot] = target
    res = launch_slots(program, tensors, plan.device.index, op, layout)[result_slot]
    if target is None:
        return res
    if not plan.direct:
        device_copy(target, res)
    return target
