"""Element-wise ATen ops on the device: one launch of the elementwise kernel template per call.

An op is a tile function (its math over ``nl`` tiles, ``tilemath``) plus PyTorch's type
promotion kind. ``run_pointwise`` does what TensorIterator does on CPU: promotes dtypes
(``torch._prims_common.elementwise_dtypes``: Python scalars and 0-dim tensors are weak),
broadcasts, checks ``out=`` / in-place targets (shape and castability, with PyTorch's messages),
and then launches ``kernels.elementwise`` once. Tiles compute in fp32 (ints in int32, exactly);
the loads and the store cast. Python scalars reach the kernel as (1, 1) device tensors, so one
Program serves every scalar value.

Each ATen op registers its functional, in-place and ``out=`` overloads through ``_pointwise``.
Inputs the device cannot compute (int64, float64, complex) go to the CPU fallback.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import elementwise_dtypes

import torchneuron.nki.language as nl
from torchneuron.kernels.elementwise import KERNELS, NAMES, fold_broadcast
from torchneuron.ops import tilemath as tm
from torchneuron.ops.copy import device_copy
from torchneuron.ops.kernel_call import DEVICE_DTYPES, call_kernel, dense, launch_traced, scalar_operand, traced_kernel
from torchneuron.ops.registry import Unsupported, cpu_fallback, lowering

aten = torch.ops.aten
Number = (int, float, bool)


def _type_name(dtype: torch.dtype) -> str:
    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
            torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
            torch.uint8: "Byte", torch.bool: "Bool"}.get(dtype, str(dtype).removeprefix("torch."))


def _check_target(target: torch.Tensor, shape: tuple, result: torch.dtype, inplace: bool) -> None:
    if not torch.can_cast(result, target.dtype):
        raise RuntimeError(f"result type {_type_name(result)} can't be cast to the desired output type "
                           f"{_type_name(target.dtype)}")
    if inplace and tuple(target.shape) != shape:
        raise RuntimeError(f"output with shape {list(target.shape)} doesn't match the broadcast shape {list(shape)}")


def broadcast_shape(shapes: list) -> tuple:
    """The broadcast of ``shapes``, with TensorIterator's error message when they do not broadcast."""
    out: list[int] = []
    for shape in shapes:
        shape = list(shape)
        n = max(len(out), len(shape))
        a, b = [1] * (n - len(out)) + out, [1] * (n - len(shape)) + shape
        for d, (x, y) in enumerate(zip(a, b)):
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


def check_no_internal_overlap(target: torch.Tensor) -> None:
    """PyTorch's refusal to write a tensor whose elements alias each other (an expanded ``out=``)."""
    if any(st == 0 and n > 1 for n, st in zip(target.shape, target.stride())):
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


def _check_overlap(target: torch.Tensor, inputs: list) -> None:
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
_MEMO_LIMIT = 4096     # entries per memo before it starts over (a program that keeps changing shapes)
_FOLDS: dict = {}


def _promote(operands: list, kind: KIND) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, result dtype) by PyTorch's rules, memoised on what they depend on."""
    key = (kind, *((o.dtype, o.dim() == 0) if isinstance(o, torch.Tensor) else type(o) for o in operands))
    hit = _PROMOTIONS.get(key)
    if hit is None:
        if len(_PROMOTIONS) > _MEMO_LIMIT:
            _PROMOTIONS.clear()
        hit = _PROMOTIONS[key] = elementwise_dtypes(*operands, type_promotion_kind=kind)
    return hit


def _fold(shape: tuple, shapes: tuple) -> tuple[bool, list, int, int]:
    """(materialise broadcasts first, kind of each operand, R, C) of the kernel's [R, C] problem (memoised)."""
    key = (shape, shapes)
    hit = _FOLDS.get(key)
    if hit is None:
        if len(_FOLDS) > _MEMO_LIMIT:
            _FOLDS.clear()
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
        hit = _FOLDS[key] = (materialise, kinds, R, C)
    return hit


def run_pointwise(fn: Callable, operands: list, kind: KIND, target: torch.Tensor | None = None,
                  inplace: bool = False, result_dtype: torch.dtype | None = None, op: str | None = None) -> torch.Tensor:
    """Apply tile function ``fn`` to ``operands`` (tensors and Python scalars) element-wise on the device.

    ``target``: the ``out=`` tensor, or ``self`` when ``inplace``; ``result_dtype``: overrides the
    promoted result dtype (comparisons: bool). Raises Unsupported for what the device cannot run."""
    key = (fn, kind, result_dtype, inplace, None if target is None else _signature(target),
           *(_signature(o) for o in operands))
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
    compute, result = _promote(operands, kind)
    if result_dtype is not None:
        result = result_dtype
    tensors = [o for o in args if isinstance(o, torch.Tensor)]
    if any(t.dtype not in DEVICE_DTYPES for t in tensors) or result not in DEVICE_DTYPES \
            or (target is not None and target.dtype not in DEVICE_DTYPES) or compute.is_complex:
        raise Unsupported
    shapes = tuple(t.shape for t in tensors)
    shape = _SHAPES.get(shapes)
    if shape is None:
        if len(_SHAPES) > _MEMO_LIMIT:
            _SHAPES.clear()
        shape = _SHAPES[shapes] = broadcast_shape(list(shapes))
    if len(shape) > 64:
        raise RuntimeError("only tensors with up to 64 dims are supported")
    if target is not None:
        _check_target(target, shape, result, inplace)
        if target.numel():
            _check_overlap(target, tensors)
        if not inplace and tuple(target.shape) != shape:
            torch._refs._maybe_resize_out(target, shape)
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
    if len(_PLANS) > _MEMO_LIMIT:
        _PLANS.clear()
    if target is None or tuple(target.shape) == tuple(key[4][1]):  # not when an out= target was resized
        _PLANS[key] = plan
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
    traced: Any = None     # the kernel's traced_kernel entry, once the plan has run


def _signature(o: Any) -> Any:
    """What a plan depends on in an operand: dtype, shape, strides and device, or a scalar's type."""
    if isinstance(o, torch.Tensor):
        return (o.dtype, o.shape, o.stride(), o.device)
    return type(o)


def _run_plan(plan: _Plan, operands: list, target: torch.Tensor | None, op: str | None,
              checked: bool = False) -> torch.Tensor:
    """Launch a planned element-wise op (operand and target checks done unless a plan replays them)."""
    if target is not None and not checked and target.numel():
        _check_overlap(target, [o for o in operands if isinstance(o, torch.Tensor) and o.device.type == "neuron"])
    inputs = {}
    for name, o, view in zip(NAMES, operands, plan.views):
        if view is None:
            if isinstance(o, torch.Tensor):  # a CPU 0-dim tensor: a weak scalar
                o = o.item()
            inputs[name] = scalar_operand(o, plan.tile_dtype, plan.device)
        else:
            if plan.materialise and tuple(o.shape) != plan.shape:
                o = o.expand(plan.shape)
            inputs[name] = (o if o.is_contiguous() else dense(o)).view(view)
    out = target.view(plan.R, plan.C) if plan.direct else None
    traced = plan.traced
    if traced is None:  # the plan fixes the kernel's device, shapes, dtypes and meta: look it up once
        traced = plan.traced = traced_kernel(plan.kernel, inputs, plan.meta)
    (res,) = launch_traced(traced, inputs, [out], op=op, index=plan.device.index)
    if target is None:
        return res.view(plan.shape)
    if not plan.direct:
        device_copy(target, res.view(plan.shape))
    return target


# ---- registration -------------------------------------------------------------------------

def _overload(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")


def _pointwise(names: list[str], build: Callable, kind: KIND, result_dtype: torch.dtype | None = None) -> None:
    """Register ATen overloads ``names`` (functional, ``x_`` in-place, ``.out``) computing ``build(*args, **kw)``.

    ``build`` returns ``(tile_fn, operands)`` or raises Unsupported."""
    for name in names:
        op = _overload(name)
        inplace = name.split(".")[0].endswith("_")

        def kernel(*args: Any, _op=op, _inplace=inplace, _name=str(op), **kwargs: Any) -> torch.Tensor:
            out = kwargs.pop("out", None)
            try:
                fn, operands = build(*args, **kwargs)
                target = args[0] if _inplace else out
                return run_pointwise(fn, operands, kind, target, _inplace, result_dtype, op=_name)
            except Unsupported:
                alternative = ALTERNATIVES.get(_op._schema.name.removeprefix("aten::").rstrip("_"))
                res = alternative(args, kwargs, out, _inplace) if alternative is not None else None
                if res is not None:
                    return res
                if out is not None:
                    kwargs["out"] = out
                return cpu_fallback(_op, *args, **kwargs)
        lowering(name)(kernel)


def _exists(name: str) -> bool:
    try:
        _overload(name)
        return True
    except AttributeError:
        return False


def _variants(base: str, *overloads: str) -> list[str]:
    """The functional, in-place and ``out=`` overloads of ``base`` for each overload ("" = default):
    ``add.Tensor``, ``add_.Tensor``, ``add.out``; ``add.Scalar``, ``add_.Scalar``, ``add.Scalar_out``."""
    names = []
    for i, ov in enumerate(overloads):
        suffix = f".{ov}" if ov else ""
        outs = [f"{base}.{ov}_out"] if ov else []
        if i == 0:
            outs.append(f"{base}.out")
        names += [n for n in (f"{base}{suffix}", f"{base}_{suffix}") if _exists(n)]
        names += [n for n in outs if _exists(n)][:1]
    return names


# unary ops: tile function and promotion kind
_UNARY_FLOAT = {  # int inputs compute in float (INT_TO_FLOAT)
    "exp": tm.exp, "exp2": tm.exp2, "expm1": tm.expm1, "log": tm.log, "log2": tm.log2, "log10": tm.log10,
    "log1p": tm.log1p, "sqrt": tm.sqrt, "rsqrt": tm.rsqrt, "sin": tm.sin, "cos": tm.cos, "tan": tm.tan,
    "tanh": tm.tanh, "sigmoid": tm.sigmoid, "erf": tm.erf, "atan": tm.atan, "reciprocal": tm.reciprocal,
    "sinh": tm.sinh, "cosh": tm.cosh, "asinh": tm.asinh, "acosh": tm.acosh, "atanh": tm.atanh,
    "asin": tm.asin, "acos": tm.acos, "deg2rad": tm.deg2rad, "rad2deg": tm.rad2deg, "sinc": tm.sinc,
}
_UNARY_SAME = {  # result keeps the input dtype (DEFAULT); ints stay exact
    "neg": tm.neg, "abs": tm.abs_, "sign": tm.sign, "floor": tm.floor, "ceil": tm.ceil, "trunc": tm.trunc,
    "frac": tm.frac, "relu": tm.relu, "sgn": tm.sign,
}


def _unary(fn: Callable) -> Callable:
    def build(x, *_):
        return fn, [x]
    return build


for _name, _fn in _UNARY_FLOAT.items():
    _pointwise(_variants(_name, ""), _unary(_fn), KIND.INT_TO_FLOAT)
def _neg(x):
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool:
        raise RuntimeError("Negation, the `-` operator, on a bool tensor is not supported. If you are trying to "
                           "invert a mask, use the `~` or `logical_not()` operator instead.")
    return tm.neg, [x]


for _name, _fn in _UNARY_SAME.items():
    _pointwise(_variants(_name, ""), _neg if _name == "neg" else _unary(_fn), KIND.DEFAULT)
_pointwise(["signbit", "signbit.out"], _unary(tm.signbit), KIND.DEFAULT, torch.bool)
_pointwise(["isnan"], _unary(tm.isnan), KIND.DEFAULT, torch.bool)
_pointwise(["logical_not", "logical_not_", "logical_not.out"], _unary(tm.logical_not), KIND.DEFAULT, torch.bool)


def _round(x, decimals=0):
    if decimals:
        return tm.round_decimals(decimals), [x]
    return tm.round_, [x]


_pointwise(["round", "round_", "round.out", "round.decimals", "round_.decimals", "round.decimals_out"],
           _round, KIND.DEFAULT)


# binary arithmetic
def _add(x, y, alpha=1):
    if alpha == 1 or alpha is True:
        return tm.add, [x, y]
    return tm.add_scaled, [x, y, alpha]


def _sub(x, y, alpha=1):
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool and isinstance(y, torch.Tensor) and y.dtype == torch.bool:
        raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. Use the `^` or "
                           "`logical_xor()` operator instead.")
    if alpha == 1:
        return tm.sub, [x, y]
    return tm.sub_scaled, [x, y, alpha]


def _rsub(x, y, alpha=1):
    return _sub(y, x, alpha)


def _int64_add(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool, sign: int = 1):
    """``add``/``sub`` of int64 tensors (no 64-bit ALU): the two-word kernel; None when not that case."""
    from torchneuron.kernels.int64 import int64_add
    x, y = args[0], args[1]
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    target = x if inplace else out
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.device.type == "neuron"
            and isinstance(alpha, int) and (target is None or (target.dtype == torch.int64 and target.device == x.device))):
        return None
    if isinstance(y, int) and not isinstance(y, bool):
        y = torch.tensor([sign * alpha * y], dtype=torch.int64).to(x.device)
    elif not (isinstance(y, torch.Tensor) and y.dtype == torch.int64 and y.device == x.device and sign * alpha == 1
              and (y.numel() == 1 or y.shape == x.shape)):
        return None
    if x.numel() == 0:
        return target if target is not None else torch.empty_like(x)
    words = lambda t: dense(t).reshape(-1).view(torch.int32).view(-1, 2)  # noqa: E731
    (res,) = call_kernel(int64_add, {"a": words(x), "b": words(y)}, op="aten::add")
    res = res.view(torch.int64).view(x.shape)
    if target is None:
        return res
    if tuple(target.shape) != tuple(x.shape):
        if inplace:
            return None
        torch._refs._maybe_resize_out(target, x.shape)
    device_copy(target, res)
    return target


ALTERNATIVES: dict[str, Callable] = {   # tried before the CPU fallback, by op name
    "add": _int64_add, "sub": lambda a, k, o, i: _int64_add(a, k, o, i, -1),
}
_pointwise(_variants("add", "Tensor", "Scalar"), _add, KIND.DEFAULT)
_pointwise(_variants("sub", "Tensor", "Scalar"), _sub, KIND.DEFAULT)
_pointwise(["rsub.Tensor", "rsub.Scalar", "rsub.Tensor_out", "rsub.Scalar_out"], _rsub, KIND.DEFAULT)
_pointwise(_variants("mul", "Tensor", "Scalar"), lambda x, y: (tm.mul, [x, y]), KIND.DEFAULT)


def _div(x, y, rounding_mode=None):
    fn = {None: tm.div, "trunc": tm.div_trunc, "floor": tm.div_floor}.get(rounding_mode)
    if fn is None:
        raise RuntimeError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found "
                           f"'{rounding_mode}'")
    if rounding_mode is not None and not any(isinstance(v, float) or (isinstance(v, torch.Tensor) and
                                                                       v.is_floating_point()) for v in (x, y)):
        raise Unsupported  # integer floor/trunc division: exact int64 math on the host
    return fn, [x, y]


_pointwise(_variants("div", "Tensor", "Scalar"), _div, KIND.INT_TO_FLOAT)
_pointwise(["div.Tensor_mode", "div_.Tensor_mode", "div.out_mode", "div.Scalar_mode", "div_.Scalar_mode",
            "div.Scalar_mode_out"], _div, KIND.DEFAULT)
_pointwise([n for n in ("floor_divide", "floor_divide_.Tensor", "floor_divide.out", "floor_divide.Scalar",
                        "floor_divide_.Scalar", "floor_divide.Scalar_out") if _exists(n)],
           lambda x, y: _div(x, y, "floor"), KIND.DEFAULT)
_pointwise(["maximum", "maximum.out"], lambda x, y: (tm.maximum, [x, y]), KIND.DEFAULT)
_pointwise(["minimum", "minimum.out"], lambda x, y: (tm.minimum, [x, y]), KIND.DEFAULT)
_pointwise(["fmax", "fmax.out"], lambda x, y: (tm.fmax, [x, y]), KIND.DEFAULT)
_pointwise(["fmin", "fmin.out"], lambda x, y: (tm.fmin, [x, y]), KIND.DEFAULT)
_pointwise(["atan2", "atan2_", "atan2.out"], lambda x, y: (tm.atan2, [x, y]), KIND.INT_TO_FLOAT)
_pointwise(["hypot", "hypot_", "hypot.out"], lambda x, y: (tm.hypot, [x, y]), KIND.DEFAULT)
_pointwise(["copysign.Tensor", "copysign_.Tensor", "copysign.out", "copysign.Scalar", "copysign_.Scalar",
            "copysign.Scalar_out"], lambda x, y: (tm.copysign, [x, y]), KIND.INT_TO_FLOAT)
_pointwise(["xlogy.Tensor", "xlogy_.Tensor", "xlogy.OutTensor", "xlogy.Scalar_Other", "xlogy_.Scalar_Other",
            "xlogy.OutScalar_Other"], lambda x, y: (tm.xlogy, [x, y]), KIND.INT_TO_FLOAT)


def _float_only(fn: Callable) -> Callable:
    def build(x, y):
        if not any(isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point()) for v in (x, y)):
            raise Unsupported  # integer remainder/fmod: exact int64 math on the host
        return fn, [x, y]
    return build


_pointwise(_variants("remainder", "Tensor", "Scalar"), _float_only(tm.remainder), KIND.DEFAULT)
_pointwise(_variants("fmod", "Tensor", "Scalar"), _float_only(tm.fmod), KIND.DEFAULT)


def _pow(x, y):
    if isinstance(y, Number) and not isinstance(y, bool):
        fn = tm.pow_scalar(float(y)) if isinstance(x, torch.Tensor) and (x.is_floating_point() or isinstance(y, float)) \
            else None
        if fn is not None:
            return fn, [x]
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and not (isinstance(y, torch.Tensor) and
                                                                          y.is_floating_point()):
        raise Unsupported  # integer powers: exact on the host
    return tm.pow_, [x, y]


_pointwise(["pow.Tensor_Tensor", "pow_.Tensor", "pow.Tensor_Tensor_out", "pow.Tensor_Scalar", "pow_.Scalar",
            "pow.Tensor_Scalar_out", "pow.Scalar", "pow.Scalar_out"], _pow, KIND.DEFAULT)

# comparisons and logical ops: bool results
for _name, _fn in {"eq": tm.eq, "ne": tm.ne, "lt": tm.lt, "le": tm.le, "gt": tm.gt, "ge": tm.ge}.items():
    _pointwise(_variants(_name, "Tensor", "Scalar"), (lambda f: lambda x, y: (f, [x, y]))(_fn), KIND.ALWAYS_BOOL,
               torch.bool)
for _name, _fn in {"logical_and": tm.logical_and, "logical_or": tm.logical_or,
                   "logical_xor": tm.logical_xor}.items():
    _pointwise([_name, f"{_name}_", f"{_name}.out"], (lambda f: lambda x, y: (f, [x, y]))(_fn), KIND.ALWAYS_BOOL,
               torch.bool)


def _bitwise(fn: Callable) -> Callable:
    def build(x, y):
        if any(isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point()) for v in (x, y)):
            raise Unsupported  # the CPU kernel raises its "not implemented for 'Float'" error
        return fn, [x, y]
    return build


for _name, _fn in {"bitwise_and": tm.bitwise_and, "bitwise_or": tm.bitwise_or, "bitwise_xor": tm.bitwise_xor}.items():
    _pointwise(_variants(_name, "Tensor", "Scalar"), _bitwise(_fn), KIND.DEFAULT)


def _bitwise_not(x):
    if x.is_floating_point():
        raise Unsupported
    return (tm.logical_not if x.dtype == torch.bool else tm.bitwise_not), [x]


_pointwise(_variants("bitwise_not", ""), _bitwise_not, KIND.DEFAULT)
_pointwise(["isneginf", "isneginf.out"], _unary(tm.isneginf), KIND.DEFAULT, torch.bool)
_pointwise(["isposinf", "isposinf.out"], _unary(tm.isposinf), KIND.DEFAULT, torch.bool)


def _where(cond, x, y):
    if isinstance(cond, torch.Tensor) and cond.dtype not in (torch.bool, torch.uint8):
        raise RuntimeError(f"where expected condition to be a boolean tensor, but got a tensor with dtype "
                           f"{_type_name(cond.dtype)}")
    return tm.where, [cond, x, y]


def _where_kernel_dtypes(cond, x, y):
    return x, y


def _where_lowering(name: str) -> None:
    op = _overload(name)

    def kernel(cond, x, y, *, out=None):
        try:
            fn, operands = _where(cond, x, y)
            _, result = elementwise_dtypes(x, y, type_promotion_kind=KIND.NO_OPMATH)
            return run_pointwise(fn, operands, KIND.NO_OPMATH, out, False, result, op=str(op))
        except Unsupported:
            alternative = ALTERNATIVES.get("where")
            res = alternative((cond, x, y), {}, out, False) if alternative is not None else None
            if res is not None:
                return res
            return cpu_fallback(op, cond, x, y, **({"out": out} if out is not None else {}))
    lowering(name)(kernel)


for _name in ("where.self", "where.self_out"):
    _where_lowering(_name)


def _clamp(x, min=None, max=None):  # noqa: A002 (ATen's names)
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    if min is None:
        return tm.minimum_nan, [x, max]
    if max is None:
        return tm.maximum_nan, [x, min]
    return tm.clamp, [x, min, max]


_pointwise(["clamp", "clamp_", "clamp.out", "clamp.Tensor", "clamp_.Tensor", "clamp.Tensor_out"], _clamp, KIND.DEFAULT)
_pointwise(["clamp_min", "clamp_min_", "clamp_min.out", "clamp_min.Tensor", "clamp_min_.Tensor",
            "clamp_min.Tensor_out"], lambda x, m: (tm.maximum_nan, [x, m]), KIND.DEFAULT)
_pointwise(["clamp_max", "clamp_max_", "clamp_max.out", "clamp_max.Tensor", "clamp_max_.Tensor",
            "clamp_max.Tensor_out"], lambda x, m: (tm.minimum_nan, [x, m]), KIND.DEFAULT)

# ternary
_pointwise(["addcmul", "addcmul_", "addcmul.out"], lambda s, a, b, value=1: (tm.addcmul, [s, a, b, value]),
           KIND.DEFAULT)
_pointwise(["addcdiv", "addcdiv_", "addcdiv.out"], lambda s, a, b, value=1: (tm.addcdiv, [s, a, b, value]),
           KIND.DEFAULT)
_pointwise(["lerp.Scalar", "lerp_.Scalar", "lerp.Scalar_out", "lerp.Tensor", "lerp_.Tensor", "lerp.Tensor_out"],
           lambda s, e, w: (tm.lerp, [s, e, w]), KIND.DEFAULT)

# activations and their backward ops
def _approximate(approximate: str) -> bool:
    if approximate not in ("none", "tanh"):
        raise RuntimeError("approximate argument must be either none or tanh.")
    return approximate == "tanh"


_pointwise(["gelu", "gelu_", "gelu.out"], lambda x, approximate="none": (
    tm.gelu_tanh if _approximate(approximate) else tm.gelu, [x]), KIND.DEFAULT)
_pointwise(["gelu_backward", "gelu_backward.grad_input"], lambda g, x, approximate="none": (
    tm.gelu_tanh_backward if _approximate(approximate) else tm.gelu_backward, [g, x]), KIND.DEFAULT)
_pointwise(["silu", "silu_", "silu.out"], lambda x: (tm.silu, [x]), KIND.DEFAULT)
_pointwise(["silu_backward.grad_input"], lambda g, x: (tm.silu_backward, [g, x]), KIND.DEFAULT)
_pointwise(["sigmoid_backward", "sigmoid_backward.grad_input"], lambda g, y: (tm.sigmoid_backward, [g, y]),
           KIND.DEFAULT)
_pointwise(["tanh_backward", "tanh_backward.grad_input"], lambda g, y: (tm.tanh_backward, [g, y]), KIND.DEFAULT)
_pointwise(["threshold", "threshold_", "threshold.out"], lambda x, t, v: (tm.threshold, [x, t, v]), KIND.DEFAULT)
_pointwise(["threshold_backward", "threshold_backward.grad_input"], lambda g, x, t: (tm.threshold_backward, [g, x, t]),
           KIND.DEFAULT)
_pointwise(["leaky_relu", "leaky_relu_", "leaky_relu.out"], lambda x, slope=0.01: (tm.leaky_relu, [x, slope]),
           KIND.DEFAULT)
_pointwise(["leaky_relu_backward", "leaky_relu_backward.grad_input"],
           lambda g, x, slope, self_is_result: (tm.leaky_relu_backward, [g, x, slope]), KIND.DEFAULT)
_pointwise(["hardtanh", "hardtanh_", "hardtanh.out"], lambda x, lo=-1, hi=1: (tm.clamp, [x, lo, hi]), KIND.DEFAULT)
_pointwise(["hardtanh_backward", "hardtanh_backward.grad_input"],
           lambda g, x, lo, hi: (tm.hardtanh_backward, [g, x, lo, hi]), KIND.DEFAULT)
_pointwise(["hardsigmoid", "hardsigmoid_", "hardsigmoid.out"], lambda x: (tm.hardsigmoid, [x]), KIND.DEFAULT)
_pointwise(["hardswish", "hardswish_", "hardswish.out"], lambda x: (tm.hardswish, [x]), KIND.DEFAULT)
_pointwise(["softplus", "softplus.out"], lambda x, beta=1, threshold=20: (tm.softplus, [x, beta, threshold]),
           KIND.DEFAULT)
_pointwise(["hardsigmoid_backward", "hardsigmoid_backward.grad_input"], lambda g, x: (tm.hardsigmoid_backward, [g, x]),
           KIND.DEFAULT)
_pointwise(["hardswish_backward", "hardswish_backward.out"], lambda g, x: (tm.hardswish_backward, [g, x]), KIND.DEFAULT)
_pointwise(["softplus_backward", "softplus_backward.grad_input"], lambda g, x, beta, threshold: (
    tm.softplus_backward, [g, x, beta, threshold]), KIND.DEFAULT)
_pointwise(["elu_backward", "elu_backward.grad_input"], lambda g, alpha, scale, input_scale, is_result, x: (
    tm.elu_backward_result if is_result else tm.elu_backward, [g, x, float(alpha) * float(scale), scale, input_scale]),
    KIND.DEFAULT)
_pointwise(["mish", "mish_", "mish.out"], lambda x: (tm.mish, [x]), KIND.DEFAULT)
_pointwise(["elu", "elu_", "elu.out"], lambda x, alpha=1, scale=1, input_scale=1: (
    tm.elu, [x, alpha, scale, input_scale]), KIND.DEFAULT)
_pointwise(["logit", "logit_", "logit.out"], lambda x, eps=None: (
    (tm.logit, [x]) if eps is None else (tm.logit_eps, [x, eps, 1 - eps])), KIND.INT_TO_FLOAT)
_pointwise(["nan_to_num", "nan_to_num_", "nan_to_num.out"], lambda x, nan=None, posinf=None, neginf=None: (
    tm.nan_to_num, [x, 0.0 if nan is None else nan,
                    torch.finfo(x.dtype).max if posinf is None else posinf,
                    torch.finfo(x.dtype).min if neginf is None else neginf]) if x.is_floating_point()
    else (tm.identity, [x]), KIND.DEFAULT)
