"""Element-wise ATen ops on the device: one launch of the elementwise kernel template per call.

An op is a tile function (its math over ``nl`` tiles, ``tilemath``) plus PyTorch's type
promotion kind, launched by ``elementwise.run_pointwise`` (TensorIterator's promotion, broadcasting
and target checks, then one launch of ``kernels.elementwise``).

Each ATen op registers its functional, in-place and ``out=`` overloads through ``register_pointwise``.
int64 operands take the word kernels of ``int64_elementwise`` where it has one (through ``ALTERNATIVES``);
inputs the device cannot compute (float64, complex, the other int64 cases) go to the CPU fallback.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._prims_common import elementwise_dtypes

import torchneuron.nki.language as nl
from torchneuron.kernels import tilemath as tm
from torchneuron.kernels.int64_words import int64_add
from torchneuron.ops.base import (HALF_FLOATS, overload, overload_exists, resize_out, rounded_scalar, type_name,
                                  Unsupported, variants)
from torchneuron.ops.elementwise import dense, device_copy, inputs_at_common_dtype, KIND, Number, run_pointwise
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering


# ---- registration -------------------------------------------------------------------------

def register_pointwise(names: list[str], build: Callable, kind: KIND, result_dtype: torch.dtype | None = None) -> None:
    """Register ATen overloads ``names`` (functional, ``x_`` in-place, ``.out``) computing ``build(*args, **kw)``.

    ``build`` returns ``(tile_fn, operands)`` or raises Unsupported."""
    for name in names:
        op = overload(name)
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
                if res is None:
                    raise   # neither the tile function nor an alternative runs it: the CPU fallback
                return res
        lowering(name)(kernel)


def at_common_dtype(build: Callable, keep: tuple[int, ...] = (), keep_scalar: tuple[int, ...] = ()) -> Callable:
    """``build`` with its operands read at their common dtype, as the CPU reads a kernel's inputs
    (``elementwise.inputs_at_common_dtype``; ``keep``/``keep_scalar`` as there)."""
    def build_at_common_dtype(*args: Any, **kwargs: Any) -> tuple[Callable, list]:
        fn, operands = build(*args, **kwargs)
        return fn, inputs_at_common_dtype(operands, keep, keep_scalar)
    return build_at_common_dtype


# unary ops: tile function and promotion kind
UNARY_FLOAT = {  # int inputs compute in float (INT_TO_FLOAT)
    "exp": tm.exp, "exp2": tm.exp2, "expm1": tm.expm1, "log": tm.log, "log2": tm.log2, "log10": tm.log10,
    "log1p": tm.log1p, "sqrt": tm.sqrt, "rsqrt": tm.rsqrt, "sin": tm.sin, "cos": tm.cos, "tan": tm.tan,
    "tanh": tm.tanh, "sigmoid": tm.sigmoid, "erf": tm.erf, "atan": tm.atan, "reciprocal": tm.reciprocal,
    "sinh": tm.sinh, "cosh": tm.cosh, "asinh": tm.asinh, "acosh": tm.acosh, "atanh": tm.atanh,
    "asin": tm.asin, "acos": tm.acos, "deg2rad": tm.deg2rad, "rad2deg": tm.rad2deg, "sinc": tm.sinc,
}
UNARY_SAME = {  # result keeps the input dtype (DEFAULT); ints stay exact
    "neg": tm.neg, "abs": tm.abs_, "sign": tm.sign, "floor": tm.floor, "ceil": tm.ceil, "trunc": tm.trunc,
    "frac": tm.frac, "relu": tm.relu, "sgn": tm.sign,
}


def unary(fn: Callable) -> Callable:
    def build(x, *_):
        return fn, [x]
    return build


for _name, _fn in UNARY_FLOAT.items():
    register_pointwise(variants(_name, ""), unary(_fn), KIND.INT_TO_FLOAT)
def _neg(x):
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool:
        raise RuntimeError("Negation, the `-` operator, on a bool tensor is not supported. If you are trying to "
                           "invert a mask, use the `~` or `logical_not()` operator instead.")
    return tm.neg, [x]


for _name, _fn in UNARY_SAME.items():
    register_pointwise(variants(_name, ""), _neg if _name == "neg" else unary(_fn), KIND.DEFAULT)
register_pointwise(["signbit", "signbit.out"], unary(tm.signbit), KIND.DEFAULT, torch.bool)
register_pointwise(["isnan"], unary(tm.isnan), KIND.DEFAULT, torch.bool)
register_pointwise(["logical_not", "logical_not_", "logical_not.out"], unary(tm.logical_not), KIND.DEFAULT, torch.bool)


def _round(x, decimals=0):
    if decimals:
        return tm.round_decimals(decimals), [x]
    return tm.round_, [x]


register_pointwise(["round", "round_", "round.out", "round.decimals", "round_.decimals", "round.decimals_out"],
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
        resize_out(target, x.shape)
    device_copy(target, res)
    return target


ALTERNATIVES: dict[str, Callable] = {   # tried before the CPU fallback, by op name
    "add": _int64_add, "sub": lambda a, k, o, i: _int64_add(a, k, o, i, -1),
}
register_pointwise(variants("add", "Tensor", "Scalar"), at_common_dtype(_add), KIND.DEFAULT)
register_pointwise(variants("sub", "Tensor", "Scalar"), at_common_dtype(_sub), KIND.DEFAULT)
register_pointwise(["rsub.Tensor", "rsub.Scalar", "rsub.Tensor_out", "rsub.Scalar_out"], at_common_dtype(_rsub),
                   KIND.DEFAULT)
register_pointwise(variants("mul", "Tensor", "Scalar"),
                   at_common_dtype(lambda x, y: (tm.mul, [x, y]), keep_scalar=(1,)), KIND.DEFAULT)


def _div(x, y, rounding_mode=None):
    fn = {None: tm.div, "trunc": tm.div_trunc, "floor": tm.div_floor}.get(rounding_mode)
    if fn is None:
        raise RuntimeError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found "
                           f"'{rounding_mode}'")
    if rounding_mode is not None and not any(isinstance(v, float) or (isinstance(v, torch.Tensor) and
                                                                       v.is_floating_point()) for v in (x, y)):
        raise Unsupported  # integer floor/trunc division: exact int64 math on the host
    return fn, [x, y]


register_pointwise(variants("div", "Tensor", "Scalar"), at_common_dtype(_div, keep_scalar=(1,)), KIND.INT_TO_FLOAT)
register_pointwise(["div.Tensor_mode", "div_.Tensor_mode", "div.out_mode", "div.Scalar_mode", "div_.Scalar_mode",
            "div.Scalar_mode_out"], at_common_dtype(_div, keep_scalar=(1,)), KIND.DEFAULT)
register_pointwise([n for n in ("floor_divide", "floor_divide_.Tensor", "floor_divide.out", "floor_divide.Scalar",
                        "floor_divide_.Scalar", "floor_divide.Scalar_out") if overload_exists(n)],
           at_common_dtype(lambda x, y: _div(x, y, "floor"), keep_scalar=(1,)), KIND.DEFAULT)
register_pointwise(["maximum", "maximum.out"], at_common_dtype(lambda x, y: (tm.maximum, [x, y])), KIND.DEFAULT)
register_pointwise(["minimum", "minimum.out"], at_common_dtype(lambda x, y: (tm.minimum, [x, y])), KIND.DEFAULT)
register_pointwise(["fmax", "fmax.out"], at_common_dtype(lambda x, y: (tm.fmax, [x, y])), KIND.DEFAULT)
register_pointwise(["fmin", "fmin.out"], at_common_dtype(lambda x, y: (tm.fmin, [x, y])), KIND.DEFAULT)
register_pointwise(["atan2", "atan2_", "atan2.out"], at_common_dtype(lambda x, y: (tm.atan2, [x, y])),
                   KIND.INT_TO_FLOAT)
register_pointwise(["hypot", "hypot_", "hypot.out"], at_common_dtype(lambda x, y: (tm.hypot, [x, y])), KIND.DEFAULT)
register_pointwise(["copysign.Tensor", "copysign_.Tensor", "copysign.out", "copysign.Scalar", "copysign_.Scalar",
            "copysign.Scalar_out"], at_common_dtype(lambda x, y: (tm.copysign, [x, y])), KIND.INT_TO_FLOAT)


@functools.cache
def x_log_half(dtype: torch.dtype, log: Callable) -> Callable:
    """``x * log(y)`` (xlogy; xlog1py with ``log`` = log1p) in ``dtype`` (bf16 or fp16) as the CPU's kernel
    computes it: log(y) rounded to the dtype, then x * that rounded again (``x * std::log(y)`` on 2-byte scalars),
    the operands first taken to the dtype (a Python scalar, an integer tensor) as the CPU's common dtype does.
    The fp32 product of two 2-byte values is exact, so rounding it to the dtype is the CPU's rounding; it is
    rounded here too, not only by the store, for an ``out=`` of a wider dtype. 0 where x == 0 unless y is nan."""
    half = nl.bfloat16 if dtype == torch.bfloat16 else nl.float16

    def rounded(t):
        return nl.copy(nl.copy(t, dtype=half), dtype=nl.float32)

    def x_log_in_half(x, y):
        x, y = rounded(x), rounded(y)   # a scalar or an integer operand, in the dtype as on the CPU
        r = tm.where(nl.equal(x, 0.0), tm._fill(x, y, 0), rounded(nl.multiply(x, rounded(log(y)))))
        return tm.where(tm.isnan(y), y, r)
    x_log_in_half.__name__ = f"x_{log.__name__}_{type_name(dtype)}"
    return x_log_in_half


def x_log(full: Callable, log: Callable) -> Callable:
    """The build of ``x * log(y)``: ``full`` (the fp32 tile function) or, at a bf16/fp16 result, ``x_log_half``."""
    def build(x, y):
        dtype = torch.result_type(x, y)
        return (x_log_half(dtype, log) if dtype in HALF_FLOATS else full), [x, y]
    return build


register_pointwise(["xlogy.Tensor", "xlogy_.Tensor", "xlogy.OutTensor", "xlogy.Scalar_Other", "xlogy_.Scalar_Other",
            "xlogy.OutScalar_Other"], x_log(tm.xlogy, nl.log), KIND.INT_TO_FLOAT)


def float_only(fn: Callable) -> Callable:
    def build(x, y):
        if not any(isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point()) for v in (x, y)):
            raise Unsupported  # integer remainder/fmod: exact int64 math on the host
        return fn, [x, y]
    return build


register_pointwise(variants("remainder", "Tensor", "Scalar"), at_common_dtype(float_only(tm.remainder)), KIND.DEFAULT)
register_pointwise(variants("fmod", "Tensor", "Scalar"), at_common_dtype(float_only(tm.fmod)), KIND.DEFAULT)


def _pow(x, y):
    if isinstance(y, Number) and not isinstance(y, bool) and isinstance(x, torch.Tensor) \
            and x.dtype in HALF_FLOATS:
        # the CPU's kernel takes a scalar exponent in the tensor's dtype (fp16 x ** 3.1 is x ** 3.099609375), with
        # its overflow error for one the dtype cannot hold
        torch.pow(torch.ones(1, dtype=x.dtype), y)
        y = rounded_scalar(float(y), x.dtype)
    if isinstance(y, Number) and not isinstance(y, bool):
        fn = tm.pow_scalar(float(y)) if isinstance(x, torch.Tensor) and (x.is_floating_point() or isinstance(y, float)) \
            else None
        if fn is not None:
            return fn, [x]
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and not (isinstance(y, torch.Tensor) and
                                                                          y.is_floating_point()):
        raise Unsupported  # integer powers: exact on the host
    return tm.pow_, [x, y]


register_pointwise(["pow.Tensor_Tensor", "pow_.Tensor", "pow.Tensor_Tensor_out", "pow.Tensor_Scalar", "pow_.Scalar",
            "pow.Tensor_Scalar_out", "pow.Scalar", "pow.Scalar_out"], at_common_dtype(_pow), KIND.DEFAULT)

# comparisons and logical ops: bool results
_NARROW_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32)


def _in_dtype_of(v: Any, other: Any) -> Any:
    """An int scalar compared with a narrow integer tensor, converted to that dtype as C++ casts it (wrapping):
    the CPU compares in the tensor's dtype, so ``uint8 t == -1`` is ``t == 255`` and ``int8 t == 256`` is
    ``t == 0`` (the engines would compare the unconverted value). Beside a bool tensor (compared in int64) it is
    clamped to [-1, 2], which keeps every comparison with 0 and 1 and fits the engines' int32."""
    if isinstance(v, int) and not isinstance(v, bool) and isinstance(other, torch.Tensor) \
            and other.dtype == torch.bool:
        return min(max(v, -1), 2)
    if isinstance(v, int) and not isinstance(v, bool) and isinstance(other, torch.Tensor) \
            and other.dtype in _NARROW_INTS and -2 ** 63 <= v < 2 ** 63:
        bits = 8 * other.dtype.itemsize
        v &= (1 << bits) - 1
        if other.dtype.is_signed and v >= 1 << (bits - 1):
            v -= 1 << bits
    return v


def _comparison(fn: Callable) -> Callable:
    return lambda x, y: (fn, [_in_dtype_of(x, y), _in_dtype_of(y, x)])


for _name, _fn in {"eq": tm.eq, "ne": tm.ne, "lt": tm.lt, "le": tm.le, "gt": tm.gt, "ge": tm.ge}.items():
    register_pointwise(variants(_name, "Tensor", "Scalar"), at_common_dtype(_comparison(_fn)), KIND.ALWAYS_BOOL,
                       torch.bool)
for _name, _fn in {"logical_and": tm.logical_and, "logical_or": tm.logical_or,
                   "logical_xor": tm.logical_xor}.items():
    register_pointwise([_name, f"{_name}_", f"{_name}.out"], (lambda f: lambda x, y: (f, [x, y]))(_fn), KIND.ALWAYS_BOOL,
               torch.bool)


def _bitwise(fn: Callable) -> Callable:
    def build(x, y):
        if any(isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point()) for v in (x, y)):
            raise Unsupported  # the CPU kernel raises its "not implemented for 'Float'" error
        return fn, [x, y]
    return build


for _name, _fn in {"bitwise_and": tm.bitwise_and, "bitwise_or": tm.bitwise_or, "bitwise_xor": tm.bitwise_xor}.items():
    register_pointwise(variants(_name, "Tensor", "Scalar"), _bitwise(_fn), KIND.DEFAULT)


def _bitwise_not(x):
    if x.is_floating_point():
        raise Unsupported
    return (tm.logical_not if x.dtype == torch.bool else tm.bitwise_not), [x]


register_pointwise(variants("bitwise_not", ""), _bitwise_not, KIND.DEFAULT)
register_pointwise(["isneginf", "isneginf.out"], unary(tm.isneginf), KIND.DEFAULT, torch.bool)
register_pointwise(["isposinf", "isposinf.out"], unary(tm.isposinf), KIND.DEFAULT, torch.bool)


def _where(cond, x, y):
    if isinstance(cond, torch.Tensor) and cond.dtype not in (torch.bool, torch.uint8):
        raise RuntimeError(f"where expected condition to be a boolean tensor, but got a tensor with dtype "
                           f"{type_name(cond.dtype)}")
    return tm.where, [cond, x, y]


def where_lowering(name: str) -> None:
    op = overload(name)

    def kernel(cond, x, y, *, out=None):
        try:
            fn, operands = _where(cond, x, y)
            _, result = elementwise_dtypes(x, y, type_promotion_kind=KIND.NO_OPMATH)
            return run_pointwise(fn, operands, KIND.NO_OPMATH, out, False, result, op=str(op))
        except Unsupported:
            alternative = ALTERNATIVES.get("where")
            res = alternative((cond, x, y), {}, out, False) if alternative is not None else None
            if res is None:
                raise   # neither the tile function nor an alternative runs it: the CPU fallback
            return res
    lowering(name)(kernel)


for _name in ("where.self", "where.self_out"):
    where_lowering(_name)


def _bounds_in_dtype(x: Any, *bounds: Any) -> list:
    """Scalar clamp bounds as the CPU takes them for a narrow integer or 2-byte float ``x``: converted to its
    dtype with the CPU's overflow check (its error, from the CPU's clamp of one zero element) and, for the
    integers, wrapping as C++ casts (a uint8 ``max=-1`` is 255)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (*_NARROW_INTS, torch.float16, torch.bfloat16) \
            or not any(isinstance(b, Number) for b in bounds):
        return list(bounds)
    torch.clamp(torch.zeros(1, dtype=x.dtype), *(b if isinstance(b, Number) else None for b in bounds))
    return [_in_dtype_of(b, x) for b in bounds]


def _clamp(x, min=None, max=None):  # noqa: A002 (ATen's names)
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    min, max = _bounds_in_dtype(x, min, max)  # noqa: A001
    if min is None:
        return tm.minimum_nan, [x, max]
    if max is None:
        return tm.maximum_nan, [x, min]
    return tm.clamp, [x, min, max]


register_pointwise(["clamp", "clamp_", "clamp.out", "clamp.Tensor", "clamp_.Tensor", "clamp.Tensor_out"], _clamp, KIND.DEFAULT)
register_pointwise(["clamp_min", "clamp_min_", "clamp_min.out", "clamp_min.Tensor", "clamp_min_.Tensor",
            "clamp_min.Tensor_out"], lambda x, m: (tm.maximum_nan, [x, *_bounds_in_dtype(x, m)]), KIND.DEFAULT)
register_pointwise(["clamp_max", "clamp_max_", "clamp_max.out", "clamp_max.Tensor", "clamp_max_.Tensor",
            "clamp_max.Tensor_out"], lambda x, m: (tm.minimum_nan, [x, _bounds_in_dtype(x, None, m)[1]]),
                   KIND.DEFAULT)

# ternary
register_pointwise(["addcmul", "addcmul_", "addcmul.out"],
                   at_common_dtype(lambda s, a, b, value=1: (tm.addcmul, [s, a, b, value]), keep=(3,)), KIND.DEFAULT)
register_pointwise(["addcdiv", "addcdiv_", "addcdiv.out"],
                   at_common_dtype(lambda s, a, b, value=1: (tm.addcdiv, [s, a, b, value]), keep=(3,)), KIND.DEFAULT)
register_pointwise(["lerp.Scalar", "lerp_.Scalar", "lerp.Scalar_out"],
                   at_common_dtype(lambda s, e, w: (tm.lerp, [s, e, w]), keep=(2,)), KIND.DEFAULT)
register_pointwise(["lerp.Tensor", "lerp_.Tensor", "lerp.Tensor_out"],
                   at_common_dtype(lambda s, e, w: (tm.lerp, [s, e, w])), KIND.DEFAULT)

# activations and their backward ops
def _approximate(approximate: str) -> bool:
    if approximate not in ("none", "tanh"):
        raise RuntimeError("approximate argument must be either none or tanh.")
    return approximate == "tanh"


register_pointwise(["gelu", "gelu_", "gelu.out"], lambda x, approximate="none": (
    tm.gelu_tanh if _approximate(approximate) else tm.gelu, [x]), KIND.DEFAULT)
register_pointwise(["gelu_backward", "gelu_backward.grad_input"], lambda g, x, approximate="none": (
    tm.gelu_tanh_backward if _approximate(approximate) else tm.gelu_backward, [g, x]), KIND.DEFAULT)
register_pointwise(["silu", "silu_", "silu.out"], lambda x: (tm.silu, [x]), KIND.DEFAULT)
register_pointwise(["silu_backward.grad_input"], lambda g, x: (tm.silu_backward, [g, x]), KIND.DEFAULT)
register_pointwise(["sigmoid_backward", "sigmoid_backward.grad_input"], lambda g, y: (tm.sigmoid_backward, [g, y]),
           KIND.DEFAULT)
register_pointwise(["tanh_backward", "tanh_backward.grad_input"], lambda g, y: (tm.tanh_backward, [g, y]), KIND.DEFAULT)
register_pointwise(["threshold", "threshold_", "threshold.out"], lambda x, t, v: (tm.threshold, [x, t, v]), KIND.DEFAULT)
register_pointwise(["threshold_backward", "threshold_backward.grad_input"], lambda g, x, t: (tm.threshold_backward, [g, x, t]),
           KIND.DEFAULT)
register_pointwise(["leaky_relu", "leaky_relu_", "leaky_relu.out"], lambda x, slope=0.01: (tm.leaky_relu, [x, slope]),
           KIND.DEFAULT)
register_pointwise(["leaky_relu_backward", "leaky_relu_backward.grad_input"],
           lambda g, x, slope, self_is_result: (tm.leaky_relu_backward, [g, x, slope]), KIND.DEFAULT)
def _hardtanh(x: Any, lo: Any = -1, hi: Any = 1) -> tuple:
    """hardtanh keeps the input's dtype: an integer input clamps at the bounds converted to it (truncated, as
    the CPU's kernel casts them), where clamp's promotion would make a float result."""
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dtype != torch.bool:
        lo, hi = int(lo), int(hi)
    return tm.clamp, [x, lo, hi]


register_pointwise(["hardtanh", "hardtanh_", "hardtanh.out"], _hardtanh, KIND.DEFAULT)
register_pointwise(["hardtanh_backward", "hardtanh_backward.grad_input"],
           lambda g, x, lo, hi: (tm.hardtanh_backward, [g, x, lo, hi]), KIND.DEFAULT)
register_pointwise(["hardsigmoid", "hardsigmoid_", "hardsigmoid.out"], lambda x: (tm.hardsigmoid, [x]), KIND.DEFAULT)
register_pointwise(["hardswish", "hardswish_", "hardswish.out"], lambda x: (tm.hardswish, [x]), KIND.DEFAULT)
register_pointwise(["softplus", "softplus.out"], lambda x, beta=1, threshold=20: (tm.softplus, [x, beta, threshold]),
           KIND.DEFAULT)
register_pointwise(["hardsigmoid_backward", "hardsigmoid_backward.grad_input"], lambda g, x: (tm.hardsigmoid_backward, [g, x]),
           KIND.DEFAULT)
register_pointwise(["hardswish_backward", "hardswish_backward.out"], lambda g, x: (tm.hardswish_backward, [g, x]), KIND.DEFAULT)
register_pointwise(["softplus_backward", "softplus_backward.grad_input"], lambda g, x, beta, threshold: (
    tm.softplus_backward, [g, x, beta, threshold]), KIND.DEFAULT)
register_pointwise(["elu_backward", "elu_backward.grad_input"], lambda g, alpha, scale, input_scale, is_result, x: (
    tm.elu_backward_result if is_result else tm.elu_backward, [g, x, float(alpha) * float(scale), scale, input_scale]),
    KIND.DEFAULT)
register_pointwise(["mish", "mish_", "mish.out"], lambda x: (tm.mish, [x]), KIND.DEFAULT)
register_pointwise(["elu", "elu_", "elu.out"], lambda x, alpha=1, scale=1, input_scale=1: (
    tm.elu, [x, alpha, scale, input_scale]), KIND.DEFAULT)
register_pointwise(["logit", "logit_", "logit.out"], lambda x, eps=None: (
    (tm.logit, [x]) if eps is None else (tm.logit_eps, [x, eps, 1 - eps])), KIND.INT_TO_FLOAT)
register_pointwise(["nan_to_num", "nan_to_num_", "nan_to_num.out"], lambda x, nan=None, posinf=None, neginf=None: (
    tm.nan_to_num, [x, 0.0 if nan is None else nan,
                    torch.finfo(x.dtype).max if posinf is None else posinf,
                    torch.finfo(x.dtype).min if neginf is None else neginf]) if x.is_floating_point()
    else (tm.identity, [x]), KIND.DEFAULT)
