"""Ops the graph compiler emits as library kernels inside a graph's program.

Each lowering is ``lower(ctx, node, *args)``: operands arrive as ``Value`` (or Python scalars),
the kernel is called inline in the program's trace (``nki.jit`` kernels called during a trace
emit their instructions into it), and the result is a ``Value`` (a tuple for multi-output ops).
``supports(node)`` decides, from the traced shapes and dtypes, whether the partitioner may put
the node in a program at all; what it refuses runs as the eager op.

Matrix products take transposed operands as they lie: a value whose layout is the transpose of a
contiguous tensor is handed to the matmul kernel with its ``transpose_a``/``transpose_b`` flag
(TensorE transposes tiles as it loads them), so ``x @ W.T`` copies nothing.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

import torchneuron.nki.language as nl
from torchneuron.compiler.lowering import register_kernel, supports
from torchneuron.compiler.values import NotLowerable, Value, dense, hbm_value, numel, unexpanded
from torchneuron.kernels.elementwise import fold_broadcast, stream
from torchneuron.kernels.matmul import bmm_kernel, fuses_bias, matmul_kernel
from torchneuron.kernels.norms import layer_norm_bwd_kernel, layer_norm_kernel
from torchneuron.kernels.reduction import reduce_kernel
from torchneuron.kernels.softmax import fits_one_pass, softmax_bwd_kernel, softmax_kernel
from torchneuron.ops import tilemath as tm

aten = torch.ops.aten
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

def pointwise(fn: Callable, values: list, shape: tuple, out_dtype: torch.dtype | tuple) -> Value | tuple:
    """``fn`` over tiles of ``values`` broadcast to ``shape``: one pass of the element-wise template (a tuple
    ``out_dtype``: ``fn`` returns that many tiles, and so many Values come back)."""
    ins = [unexpanded(v) for v in values]
    fold = fold_broadcast(shape, [i.shape for i in ins])
    if fold is None:  # a broadcast the [R, C] form cannot express: expand those operands in HBM first
        ins = [v.with_layout(v.layout.expand(shape)) for v in values]
        fold = (len(shape), ["full"] * len(ins))
    k, kinds = fold
    R, C = numel(shape[:k]), numel(shape[k:])
    rows = R == 1 or any(kd in ("full", "col") for kd in kinds)
    cols = C == 1 or any(kd in ("full", "row") for kd in kinds)
    if not (rows and cols):  # the template takes its [R, C] from the inputs: one of them must span it
        ins[0], kinds[0] = values[0].with_layout(values[0].layout.expand(shape)), "full"
    two_d = {"full": (R, C), "row": (1, C), "col": (R, 1), "scalar": (1, 1)}
    args = [dense(v, two_d[kd]) for v, kd in zip(ins, kinds)]
    dtypes = out_dtype if isinstance(out_dtype, tuple) else (out_dtype,)
    floating = any(v.dtype.is_floating_point for v in values) or any(d.is_floating_point for d in dtypes)
    out = stream(args, fn, out_dtype, nl.float32 if floating else nl.int32)
    if isinstance(out_dtype, tuple):
        return tuple(hbm_value(o).reshape(shape) for o in out)
    return hbm_value(out).reshape(shape)


# ---- matrix products -------------------------------------------------------------------------

def _matmul_operand(v: Value) -> tuple[Any, bool]:
    """(a contiguous HBM tensor, whether it is the transpose of ``v``) for the last two dims."""
    lay = v.layout
    if lay.is_contiguous():
        return dense(v), False
    t = lay.transpose(-1, -2)
    if t.is_contiguous():
        return dense(v.with_layout(t)), True
    return dense(v), False


def _float_pair(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.dtype in FLOATS


def _product(kernel, a: Value, b: Value, **kw: Any) -> Value:
    """``kernel`` (matmul or bmm) on the operands as they lie (transposed ones by the kernel's flags)."""
    A, ta = _matmul_operand(a)
    B, tb = _matmul_operand(b)
    return hbm_value(kernel(A, B, transpose_a=ta, transpose_b=tb, **kw))


for _op in (aten.mm.default, aten.bmm.default):
    supports(_op)(lambda node, a, b: _float_pair(a, b))


@register_kernel(aten.mm.default)
def lower_mm(ctx, node, a: Value, b: Value) -> Value:
    """``a @ b`` (2-D) on TensorE."""
    return _product(matmul_kernel, a, b)


@register_kernel(aten.bmm.default)
def lower_bmm(ctx, node, a: Value, b: Value) -> Value:
    """Batched ``a[i] @ b[i]``, one kernel for the batch."""
    return _product(bmm_kernel, a, b)


@supports(aten.addmm.default)
def _addmm_ok(node, bias, a, b, beta=1, alpha=1) -> bool:
    return _float_pair(a, b) and bias.dtype == a.dtype and beta == 1 and alpha == 1


@register_kernel(aten.addmm.default)
def lower_addmm(ctx, node, bias: Value, a: Value, b: Value, beta=1, alpha=1) -> Value:
    """``bias + a @ b``: the bias row added at the PSUM eviction when the kernel can, else one more pass."""
    (M, K), N = a.shape, b.shape[1]
    row = unexpanded(bias)
    if fuses_bias(K, N) and numel(row.shape) == N and row.shape[-1] == N:
        return _product(matmul_kernel, a, b, bias=dense(row, (1, N)))
    return pointwise(tm.add, [_product(matmul_kernel, a, b), bias], (M, N), a.dtype)


# ---- softmax ---------------------------------------------------------------------------------------

def _rows(v: Value):
    """A value as dense [N, D] rows over its last dim."""
    D = v.shape[-1] if v.shape else 1
    return dense(v, (numel(v.shape) // D, D))


def _last(dim: int, ndim: int) -> bool:
    return ndim > 0 and dim % ndim == ndim - 1


for _op in (aten._softmax.default, aten._log_softmax.default):
    supports(_op)(lambda node, x, dim, half_to_float: x.dtype in FLOATS and _last(dim, x.dim()) and not half_to_float)


@register_kernel(aten._softmax.default)
def lower_softmax(ctx, node, x: Value, dim: int, half_to_float: bool) -> Value:
    """Softmax over the last dim, one row per partition."""
    return hbm_value(softmax_kernel(_rows(x))).reshape(x.shape)


@register_kernel(aten._log_softmax.default)
def lower_log_softmax(ctx, node, x: Value, dim: int, half_to_float: bool) -> Value:
    """Log-softmax over the last dim."""
    return hbm_value(softmax_kernel(_rows(x), log=True)).reshape(x.shape)


for _op in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
    supports(_op)(lambda node, g, y, dim, input_dtype: (
        g.dtype == y.dtype == input_dtype and g.dtype in FLOATS and _last(dim, y.dim()) and fits_one_pass(y.shape[-1])
        and tuple(g.shape) == tuple(y.shape)))


@register_kernel(aten._softmax_backward_data.default)
def lower_softmax_backward(ctx, node, g: Value, y: Value, dim: int, input_dtype) -> Value:
    """The softmax input gradient from the output."""
    return hbm_value(softmax_bwd_kernel(_rows(g), _rows(y))).reshape(y.shape)


@register_kernel(aten._log_softmax_backward_data.default)
def lower_log_softmax_backward(ctx, node, g: Value, y: Value, dim: int, input_dtype) -> Value:
    """The log-softmax input gradient from the output."""
    return hbm_value(softmax_bwd_kernel(_rows(g), _rows(y), log=True)).reshape(y.shape)


# ---- layer norm --------------------------------------------------------------------------------------

def _stats_meta(node) -> list:
    return [v for v in node.meta["val"] if isinstance(v, torch.Tensor)]


@supports(aten.native_layer_norm.default)
def _ln_ok(node, x, shape, w, b, eps) -> bool:
    stats = _stats_meta(node)[1:]
    return (w is not None and b is not None and x.dtype in FLOATS and w.dtype == b.dtype == x.dtype
            and all(s.dtype == torch.float32 for s in stats) and tuple(w.shape) == tuple(shape))


@register_kernel(aten.native_layer_norm.default)
def lower_layer_norm(ctx, node, x: Value, shape, w: Value, b: Value, eps: float) -> tuple[Value, Value, Value]:
    """Layer norm over the trailing ``shape``, with the row mean and rstd the backward takes."""
    D = numel(tuple(shape))
    N = numel(x.shape) // D
    out, mean, rstd = layer_norm_kernel(dense(x, (N, D)), dense(w, (1, D)), dense(b, (1, D)), eps=eps, stats=True)
    stat_shape = tuple(_stats_meta(node)[1].shape)
    return hbm_value(out).reshape(x.shape), hbm_value(mean).reshape(stat_shape), hbm_value(rstd).reshape(stat_shape)


@supports(aten.native_layer_norm_backward.default)
def _ln_bwd_ok(node, dy, x, shape, mean, rstd, w, b, mask) -> bool:
    return (w is not None and b is not None and all(mask) and x.dtype in FLOATS
            and dy.dtype == w.dtype == b.dtype == x.dtype and mean.dtype == rstd.dtype == torch.float32)


@register_kernel(aten.native_layer_norm_backward.default)
def lower_layer_norm_backward(ctx, node, dy: Value, x: Value, shape, mean: Value, rstd: Value, w: Value, b: Value,
                              mask) -> tuple[Value, Value, Value]:
    """dx, dweight, dbias of layer norm from the forward's saved statistics."""
    D = numel(tuple(shape))
    N = numel(x.shape) // D
    dx, dw, db = layer_norm_bwd_kernel(dense(dy, (N, D)), dense(x, (N, D)), dense(w, (1, D)),
                                       mean=dense(mean, (N, 1)), rstd=dense(rstd, (N, 1)))
    return hbm_value(dx).reshape(x.shape), hbm_value(dw).reshape(w.shape), hbm_value(db).reshape(w.shape)


# ---- reductions ------------------------------------------------------------------------------------

def _reduced_run(shape: tuple, dims: list | None) -> tuple[int, int, int] | None:
    """(outer, reduced, inner) when ``dims`` is one run of adjacent dims (all dims when None; an explicit empty
    list, whose meaning differs between reductions, is left to the eager op)."""
    nd = len(shape)
    if dims is not None and len(dims) == 0:
        return None
    ds = sorted({d % nd for d in dims}) if dims is not None else list(range(nd))
    if ds != list(range(ds[0], ds[-1] + 1)):
        return None
    return numel(shape[:ds[0]]), numel(shape[ds[0]:ds[-1] + 1]), numel(shape[ds[-1] + 1:])


REDUCTIONS = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "max", aten.amin.default: "min"}


def _reduction_ok(node, x, dims=None, keepdim=False, dtype=None, **_) -> bool:
    return (x.dtype in FLOATS and (dtype is None or dtype == x.dtype) and x.dim() > 0
            and _reduced_run(tuple(x.shape), dims) is not None)


def _reduce(op: str) -> Callable:
    def lower(ctx, node, x: Value, dims=None, keepdim=False, dtype=None, **_) -> Value:
        O, R, I = _reduced_run(x.shape, dims)
        out = reduce_kernel(dense(x, (O, R, I)), op=op)
        return hbm_value(out).reshape(tuple(node.meta["val"].shape))
    lower.__name__ = f"lower_{op}"
    return lower


for _op, _name in REDUCTIONS.items():
    supports(_op)(_reduction_ok)
    register_kernel(_op)(_reduce(_name))
supports(aten.sum.default)(lambda node, x, dtype=None: _reduction_ok(node, x, None, False, dtype))
register_kernel(aten.sum.default)(_reduce("sum"))
