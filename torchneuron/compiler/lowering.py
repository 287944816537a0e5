"""What the graph compiler does with each ATen op: one line per op.

Three kinds of lowering, as Inductor's ``lowering.py`` declares them:

- ``register_view(op)``: a view. It moves no data: the compiler applies the op to a meta tensor
  with the operand's real layout and keeps the resulting sizes, strides and offset as an access
  pattern over the same HBM buffer.
- ``register_pointwise(op, build)``: an element-wise op. ``build(*args, **kwargs)`` returns
  ``(tile_fn, operands)``: the op's math over ``nl`` tiles (``kernels.tilemath``, the functions the
  eager kernels use) and its operands (values or Python scalars). Chains of these are fused into
  one pass over HBM (``partition``).
- ``register_kernel(op, lower)``: an op computed by a library kernel (matmul, softmax, norms,
  reductions); ``lower(ctx, node, *args)`` emits it into the graph's program (``codegen``).

Every other op runs as the eager op between programs (``make_fallback`` is the default, not
a list): it keeps its fallback counting, warnings and strict mode.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels import tilemath as tm
from torchneuron.ops.base import HALF_FLOATS, rounded_scalar

aten = torch.ops.aten
prims = torch.ops.prims

VIEWS: set = set()
POINTWISE: dict[Any, Callable] = {}
SCALARS_AT_COMMON_DTYPE: set = set()   # element-wise ops whose Python-number operands PyTorch reads in their dtype
KERNELS: dict[Any, Callable] = {}
SUPPORTS: dict[Any, Callable] = {}   # kernel op -> pred(node, *traced args): may it be lowered here?


def register_view(*ops: Any) -> None:
    """Ops that return a view of their first operand (no data moves)."""
    VIEWS.update(ops)


def register_pointwise(op: Any, build: Callable, scalars_at_common_dtype: bool = False) -> None:
    """An element-wise op: ``build(*args, **kwargs) -> (tile_fn, operands)``. ``scalars_at_common_dtype``: the
    op reads a Python-number operand (and ``alpha``) rounded to a bfloat16 or float16 common dtype first, as
    PyTorch's kernels read every input at the common dtype (``bf16 + 0.3`` adds 0.30078125); ``mul``, ``div``
    and the ops' Scalar arguments (clamp bounds, addcmul's value) read theirs in float32."""
    POINTWISE[op] = build
    if scalars_at_common_dtype:
        SCALARS_AT_COMMON_DTYPE.add(op)


def scalars_at_common_dtype(node: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a ``SCALARS_AT_COMMON_DTYPE`` node with its Python numbers rounded to the
    node's common dtype where that is bfloat16 or float16."""
    typed = [a.meta["val"] if hasattr(a, "meta") else a for a in node.args if hasattr(a, "meta") or
             (isinstance(a, (int, float)) and not isinstance(a, bool))]
    common = elementwise_dtypes(*typed, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]
    if common not in HALF_FLOATS:
        return args, kwargs

    def rounded(v: Any) -> Any:
        return rounded_scalar(v, common) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return tuple(rounded(a) for a in args), {k: rounded(v) for k, v in kwargs.items()}


def register_kernel(op: Any) -> Callable[[Callable], Callable]:
    """Decorator: the op is emitted by the decorated ``lower(ctx, node, *args, **kwargs)``."""
    def register(lower: Callable) -> Callable:
        KERNELS[op] = lower
        return lower
    return register


def supports(op: Any) -> Callable[[Callable], Callable]:
    """Decorator: ``pred(node, *args, **kwargs)`` over the traced (fake) values says whether a kernel op can
    be lowered at those shapes and dtypes; what it refuses runs as the eager op."""
    def register(pred: Callable) -> Callable:
        SUPPORTS[op] = pred
        return pred
    return register


def kind(op: Any) -> str:
    """``"view"``, ``"pointwise"``, ``"kernel"`` or ``"eager"``."""
    if op in VIEWS:
        return "view"
    if op in POINTWISE:
        return "pointwise"
    if op in KERNELS:
        return "kernel"
    return "eager"


# ---- views --------------------------------------------------------------------------------------

register_view(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default,
              aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default,
              aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
              aten.slice.Tensor, aten.select.int, aten.alias.default, aten.as_strided.default,
              aten.diagonal.default, aten.unfold.default, aten.split.Tensor, aten.split_with_sizes.default,
              aten.unbind.int, aten.chunk.default, aten.narrow.default)


# ---- pointwise ----------------------------------------------------------------------------------

def _unary(fn: Callable) -> Callable:
    return lambda x, *_, **__: (fn, [x])


def _binary(fn: Callable) -> Callable:
    return lambda x, y: (fn, [x, y])


def _scaled(plain: Callable, scaled: Callable) -> Callable:
    return lambda x, y, alpha=1: (plain, [x, y]) if alpha == 1 else (scaled, [x, y, alpha])


def _gelu(approximate: str = "none") -> Callable:
    return tm.gelu_tanh if approximate == "tanh" else tm.gelu


def _cast(x: Any, dtype: torch.dtype | None = None, **_: Any) -> tuple[Callable, list]:
    return tm.identity, [x]   # the rounding to ``dtype`` is the codegen's (every node's result dtype is)


for _op, _fn in {aten.exp: tm.exp, aten.log: tm.log, aten.sqrt: tm.sqrt, aten.rsqrt: tm.rsqrt, aten.tanh: tm.tanh,
                 aten.sigmoid: tm.sigmoid, aten.erf: tm.erf, aten.sin: tm.sin, aten.cos: tm.cos,
                 aten.reciprocal: tm.reciprocal, aten.log1p: tm.log1p, aten.expm1: tm.expm1, aten.neg: tm.neg,
                 aten.abs: tm.abs_, aten.relu: tm.relu, aten.silu: tm.silu, aten.sign: tm.sign,
                 aten.floor: tm.floor, aten.ceil: tm.ceil, aten.trunc: tm.trunc, aten.logical_not: tm.logical_not,
                 aten.isnan: tm.isnan, aten.log2: tm.log2, aten.exp2: tm.exp2, aten.atan: tm.atan}.items():
    register_pointwise(_op.default, _unary(_fn))
for _op, _fn in {aten.mul: tm.mul, aten.div: tm.div, aten.maximum: tm.maximum, aten.minimum: tm.minimum,
                 aten.eq: tm.eq, aten.ne: tm.ne, aten.lt: tm.lt, aten.le: tm.le, aten.gt: tm.gt, aten.ge: tm.ge,
                 aten.atan2: tm.atan2}.items():
    for _overload in ("Tensor", "Scalar", "default"):
        if hasattr(_op, _overload):
            register_pointwise(getattr(_op, _overload), _binary(_fn), scalars_at_common_dtype=_op not in (aten.mul,
                                                                                                       aten.div))
register_pointwise(aten.pow.Tensor_Tensor, _binary(tm.pow_), scalars_at_common_dtype=True)
register_pointwise(aten.pow.Tensor_Scalar, lambda x, y: (tm.pow_scalar(float(y)), [x]), scalars_at_common_dtype=True)
register_pointwise(aten.pow.Scalar, lambda x, y: (tm.pow_, [x, y]))   # a scalar base (Adam's bias correction)
register_pointwise(aten.add.Tensor, _scaled(tm.add, tm.add_scaled), scalars_at_common_dtype=True)
register_pointwise(aten.add.Scalar, _scaled(tm.add, tm.add_scaled), scalars_at_common_dtype=True)
register_pointwise(aten.sub.Tensor, _scaled(tm.sub, tm.sub_scaled), scalars_at_common_dtype=True)
register_pointwise(aten.sub.Scalar, _scaled(tm.sub, tm.sub_scaled), scalars_at_common_dtype=True)
register_pointwise(aten.rsub.Scalar, lambda x, y, alpha=1: _scaled(tm.sub, tm.sub_scaled)(y, x, alpha),
                   scalars_at_common_dtype=True)
register_pointwise(aten.logical_and.default, _binary(tm.logical_and))
register_pointwise(aten.logical_or.default, _binary(tm.logical_or))
register_pointwise(aten.where.self, lambda c, x, y: (tm.where, [c, x, y]))
register_pointwise(aten.clamp.default, lambda x, lo=None, hi=None: (
    (tm.clamp, [x, lo, hi]) if lo is not None and hi is not None else
    (tm.maximum_nan, [x, lo]) if lo is not None else (tm.minimum_nan, [x, hi])))
register_pointwise(aten.clamp_min.default, lambda x, lo: (tm.maximum_nan, [x, lo]))
register_pointwise(aten.clamp_max.default, lambda x, hi: (tm.minimum_nan, [x, hi]))
register_pointwise(aten.gelu.default, lambda x, approximate="none": (_gelu(approximate), [x]))
register_pointwise(aten.gelu_backward.default, lambda g, x, approximate="none": (
    tm.gelu_tanh_backward if approximate == "tanh" else tm.gelu_backward, [g, x]))
register_pointwise(aten.silu_backward.default, _binary(tm.silu_backward))
register_pointwise(aten.sigmoid_backward.default, _binary(tm.sigmoid_backward))
register_pointwise(aten.tanh_backward.default, _binary(tm.tanh_backward))
register_pointwise(aten.threshold_backward.default, lambda g, x, t: (tm.threshold_backward, [g, x, t]))
register_pointwise(aten.leaky_relu.default, lambda x, slope=0.01: (tm.leaky_relu, [x, slope]))
# (value 1: a * 1 is a, bit for bit, so no instruction multiplies by it; an optimizer step's addcmul/addcdiv)
register_pointwise(aten.addcmul.default, lambda s, a, b, value=1: (
    (tm.addcmul, [s, a, b, value]) if value != 1 else (lambda s, a, b: nl.add(s, nl.multiply(a, b)), [s, a, b])))
register_pointwise(aten.addcdiv.default, lambda s, a, b, value=1: (
    (tm.addcdiv, [s, a, b, value]) if value != 1 else (lambda s, a, b: nl.add(s, nl.divide(a, b)), [s, a, b])))
register_pointwise(aten.lerp.Scalar, lambda s, e, w: (tm.lerp, [s, e, w]))
register_pointwise(aten.lerp.Tensor, lambda s, e, w: (tm.lerp, [s, e, w]))
def _full_like(x: Any, fill_value: Any, **_: Any) -> tuple[Callable, list]:
    """``full_like``: a constant tile shaped like the template's (in a group it costs one memset per tile)."""
    def fill(t):
        out = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.memset(dst=out, value=fill_value)
        return out
    return fill, [x]


register_pointwise(aten.full_like.default, _full_like)
register_pointwise(prims.convert_element_type.default, _cast)
register_pointwise(aten._to_copy.default, _cast)
register_pointwise(aten.clone.default, _cast)
