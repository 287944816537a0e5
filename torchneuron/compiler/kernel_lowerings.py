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

import math
import operator
from typing import Any, Callable

import torch

import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.compiler.lowering import register_kernel, supports
from torchneuron.compiler.partition import DEVICE_DTYPES
from torchneuron.compiler.values import (HostTensor, NotLowerable, Value, dense, flat, hbm_value, index_words, numel,
                                         strided_value, unexpanded)
from torchneuron.kernels.copy import strided_copy
from torchneuron.kernels.attention import result_views
from torchneuron.kernels.elementwise import fold_broadcast, stream
from torchneuron.kernels.indexing import ONEHOT_LIMIT, gather_rows, iota, low_words
from torchneuron.kernels.losses import (EXACT, fuses_log_softmax_bwd, fuses_log_softmax_fwd, log_softmax_nll_fwd_kernel,
                                        nll_bwd_kernel, nll_fwd_kernel)
from torchneuron.kernels.matmul import (Then, bmm_kernel, chains_product, fuses_bias, fuses_row_sums,
                                        matmul_kernel)
from torchneuron.kernels.packed_attention import attention_kernels, packed_attention_bwd, packed_attention_fwd
from torchneuron.kernels.norms import bwd_chains_product as ln_bwd_chains_product
from torchneuron.kernels.norms import chains_product as ln_chains_product
from torchneuron.kernels.norms import layer_norm_bwd_kernel, layer_norm_kernel
from torchneuron.kernels.reduction import reduce_kernel
from torchneuron.kernels.softmax import attention_fits, attention_softmax_kernel, softmax_bwd_kernel, softmax_kernel
from torchneuron.kernels import tilemath as tm
from torchneuron.ops.base import FLOATS

aten = torch.ops.aten


def pointwise(fn: Callable, values: list, shape: tuple, out_dtype: torch.dtype | tuple,
              dests: tuple | None = None) -> Value | tuple:
    """``fn`` over tiles of ``values`` broadcast to ``shape``: one pass of the element-wise template (a tuple
    ``out_dtype``: ``fn`` returns that many tiles, and so many Values come back; ``dests``: per output, a
    contiguous Value of ``shape`` to write it into, or None)."""
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
    into = tuple(None if d is None else dense(d, (R, C)) for d in dests) if dests else None
    out = stream(args, fn, out_dtype, nl.float32 if floating else nl.int32, into)
    if isinstance(out_dtype, tuple):
        return tuple(hbm_value(o).reshape(shape) for o in out)
    return hbm_value(out).reshape(shape)


DMA_CAST_CHUNK = 1 << 20   # source bytes per DMA of a cast copy: 16 engines' worth of 64 KiB runs, and small enough
                           # that a reader of the first rows starts before the whole tensor is converted


def dma_cast(v: Value, dtype: torch.dtype) -> Value:
    """A contiguous float value converted to the float ``dtype`` by DMAs from HBM to HBM (a DMA casts through fp32,
    rounding to nearest even as the engines do): no SBUF round trip and no engine instruction, where the
    element-wise template would load, copy on VectorE and store."""
    assert v.layout.is_contiguous() and v.dtype.is_floating_point and dtype.is_floating_point
    n = numel(v.shape)
    src = dense(v, (n,))
    out = nl.ndarray((n,), dtype, buffer=nl.shared_hbm)
    step = max(1, DMA_CAST_CHUNK // v.dtype.itemsize)
    for i in range(0, n, step):
        nisa.dma_copy(dst=out[i:min(n, i + step)], src=src[i:min(n, i + step)])
    return hbm_value(out).reshape(v.shape)


def _cast(t, shape: tuple, dtype: torch.dtype):
    """A dense HBM tensor viewed as ``shape``, in ``dtype`` (one element-wise pass when it is another dtype): the
    short-sequence attention computes scores and their gradients in fp32, as the eager op and the CPU do, and
    rounds the probabilities and dS to the input dtype before their products; addmm's separate bias pass is
    widened by it when a cast was folded into the product."""
    if t.dtype == dtype:
        return t
    return dense(pointwise(lambda x: x, [hbm_value(t).reshape(shape)], shape, dtype))


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


def _floats(*ts: torch.Tensor) -> bool:
    """Non-empty tensors of one floating dtype the device computes (what every kernel lowering asks)."""
    return all(t.dtype == ts[0].dtype and t.dtype in FLOATS and t.numel() > 0 for t in ts)


def _product(kernel, a: Value, b: Value, **kw: Any) -> Value:
    """``kernel`` (matmul or bmm) on the operands as they lie (transposed ones by the kernel's flags); with an
    epilogue that keeps the product, (the epilogue's result, the product)."""
    A, ta = _matmul_operand(a)
    B, tb = _matmul_operand(b)
    res = kernel(A, B, transpose_a=ta, transpose_b=tb, **kw)
    return tuple(map(hbm_value, res)) if isinstance(res, tuple) else hbm_value(res)


for _op in (aten.mm.default, aten.bmm.default):
    supports(_op)(lambda node, a, b: _floats(a, b))


@register_kernel(aten.mm.default)
def lower_mm(ctx, node, a: Value, b: Value) -> Value:
    """``a @ b`` (2-D) on TensorE (stored widened when the partition folded a cast into it); a weight gradient
    ``dY^T @ X`` whose segment also sums dY over its rows (the bias gradient) computes that sum too; a product
    whose epilogue's result is the A operand of a later ``mm`` computes that product too."""
    wide, epi = ctx.seg.widened.get(node), ctx.epilogue(node)
    if epi is not None:
        chained = _chained_product(ctx, node, a, b, epi)
        if chained is not None:
            return chained
    summed = _bias_gradient_of(ctx, node) if wide is None and epi is None else None
    if summed is not None:
        A, ta = _matmul_operand(a)
        B, tb = _matmul_operand(b)
        (K, M), N = A.shape, B.shape[-1]
        if ta and not tb and fuses_row_sums(M, K, N, A.dtype, ta, tb):
            out, sums = matmul_kernel(A, B, transpose_a=True, row_sums=True)
            ctx.env[summed] = hbm_value(sums).reshape(tuple(summed.meta["val"].shape))
            return hbm_value(out)
    return _product(matmul_kernel, a, b, out_dtype=wide, epilogue=epi)


_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _chained_product(ctx, node, a: Value, b: Value, epi, **kw: Any) -> Value | tuple | None:
    """``node``'s product with its epilogue (``kw``: its bias row), and the later product that reads the epilogue's
    result as its A operand, in one kernel (``matmul_kernel(then=...)``: the result's blocks go on from SBUF
    instead of being loaded back); None where there is no such product or the kernel cannot chain it."""
    A, ta = _matmul_operand(a)
    B, tb = _matmul_operand(b)
    (M, K), N = (A.shape[::-1] if ta else A.shape), (B.shape[0] if tb else B.shape[1])
    hit = _chain_of(ctx, ctx.seg.epilogues[node][0].outputs[0],
                    lambda N2, dt, _: chains_product(M, K, N, N2, ta, A.dtype, epi.out_dtype, dt))
    if hit is None:
        return None
    *res, chained = matmul_kernel(A, B, transpose_a=ta, transpose_b=tb, epilogue=epi, then=hit[1], **kw)
    ctx.bind(hit[0], hbm_value(chained))
    return tuple(map(hbm_value, res)) if len(res) > 1 else hbm_value(res[0])


def _chain_of(ctx, y, fits: Callable[[int, Any, int], bool]) -> tuple[Any, Then] | None:
    """(the later ``mm`` or ``addmm`` reading node ``y`` as its A operand, its ``Then``: B2, its bias row, its
    epilogue) where ``fits(N2, B2's dtype, its epilogue's operand count)`` says the kernel computing y can chain
    it, else None."""
    later = _product_of_result(ctx, y)
    if later is None:
        return None
    if later.target is aten.addmm.default:
        bias, b2 = ctx.value(later.args[0]), ctx.value(later.args[2])
    else:
        bias, b2 = None, ctx.value(later.args[1])
    epi2 = ctx.epilogue(later)
    if not isinstance(b2, Value) or (epi2 is not None and epi2.keep_product):
        return None
    if epi2 is not None and _product_of_result(ctx, ctx.seg.epilogues[later][0].outputs[0]) is not None:
        return None   # its own kernel chains the product of its result (an MLP's: a wider result kept on chip)
    B2, tb2 = _matmul_operand(b2)
    N2 = B2.shape[0] if tb2 else B2.shape[1]
    row = None if bias is None else unexpanded(bias)
    if (row is not None and (numel(row.shape) != N2 or row.shape[-1] != N2 or row.dtype != B2.dtype)
            or not fits(N2, B2.dtype, 0 if epi2 is None else len(epi2.extras))):
        return None
    return later, Then(B2, tb2, None if row is None else dense(row, (1, N2)), epi2)


def _product_of_result(ctx, y) -> Any:
    """The pending ``mm`` or ``addmm`` (alpha = beta = 1) of the segment whose A operand is node ``y`` as [M, N]
    rows (itself or a 2-D reshape of it), its other operands and its own epilogue's computed already and its
    result not widened, or None."""
    rows = [y] + [r for r in y.users if r.target in _RESHAPES and r.args[0] is y and len(r.meta["val"].shape) == 2]
    for r in rows:
        for u in r.users:
            a_at = {aten.mm.default: 0, aten.addmm.default: 1}.get(u.target)
            if (a_at is None or u.args[a_at] is not r or len(u.args) != a_at + 2 or u.kwargs
                    or ctx.roles.get(u) != "kernel" or u not in ctx.seg.items or u in ctx.env
                    or ctx.seg.widened.get(u) is not None):
                continue
            others = [x for i, x in enumerate(u.args) if i != a_at]
            if u in ctx.seg.epilogues:
                g, src, _, _ = ctx.seg.epilogues[u]
                others += [x for x in g.inputs if x is not src]
            if all(_computed(ctx, x) for x in others):
                return u
    return None


def _computed(ctx, n) -> bool:
    """Whether node ``n``'s value exists now (it, or what its chain of views reads, is in the environment)."""
    while n not in ctx.env and ctx.roles.get(n) == "view":
        n = n.args[0]
    return n in ctx.env


def _pending_kernel(ctx, u) -> bool:
    """Whether ``u`` is a kernel node of this segment without an epilogue group of its own, not computed yet: a
    lowering may compute it beside its own node."""
    return ctx.roles.get(u) == "kernel" and u in ctx.seg.items and u not in ctx.seg.epilogues and u not in ctx.env


def _bias_gradient_of(ctx, node) -> Any:
    """The fp32 ``dY.sum(0)`` node of ``node``'s segment not computed yet, when ``node`` is ``mm(dY.t(), X)``
    (``dY`` 2-D): the bias gradient beside a linear layer's weight gradient, or None."""
    a = node.args[0]
    if not (isinstance(a, torch.fx.Node) and a.target is aten.permute.default and list(a.args[1]) == [1, 0]):
        return None
    dy = a.args[0]
    for u in dy.users:
        if (u.target is aten.sum.dim_IntList and u.args[0] is dy and list(u.args[1]) in ([0], [-2])
                and u.kwargs.get("dtype") is None and u.meta["val"].dtype == torch.float32
                and _pending_kernel(ctx, u)):
            return u
    return None


@register_kernel(aten.bmm.default)
def lower_bmm(ctx, node, a: Value, b: Value) -> Value:
    """Batched ``a[i] @ b[i]``, one kernel for the batch."""
    return _product(bmm_kernel, a, b)


@supports(aten.addmm.default)
def _addmm_ok(node, bias, a, b, beta=1, alpha=1) -> bool:
    return _floats(a, b, bias) and beta == 1 and alpha == 1


@register_kernel(aten.addmm.default)
def lower_addmm(ctx, node, bias: Value, a: Value, b: Value, beta=1, alpha=1) -> Value:
    """``bias + a @ b``: the bias row added at the PSUM eviction when the kernel can, else one more pass."""
    (M, K), N = a.shape, b.shape[1]
    row = unexpanded(bias)
    wide, epi = ctx.seg.widened.get(node), ctx.epilogue(node)
    if fuses_bias(K, N) and numel(row.shape) == N and row.shape[-1] == N:
        chained = None if epi is None else _chained_product(ctx, node, a, b, epi, bias=dense(row, (1, N)))
        if chained is not None:
            return chained
        return _product(matmul_kernel, a, b, bias=dense(row, (1, N)), out_dtype=wide, epilogue=epi)
    if epi is not None:
        raise NotLowerable("addmm: an epilogue needs the bias added at the eviction")
    out = pointwise(tm.add, [_product(matmul_kernel, a, b), bias], (M, N), a.dtype)
    return out if wide is None else hbm_value(_cast(dense(out), (M, N), wide))   # the cast folded into it


# ---- softmax ---------------------------------------------------------------------------------------

def _rows(v: Value):
    """A value as dense [N, D] rows over its last dim."""
    D = v.shape[-1] if v.shape else 1
    return dense(v, (numel(v.shape) // D, D))


def _last(dim: int, ndim: int) -> bool:
    return ndim > 0 and dim % ndim == ndim - 1


for _op in (aten._softmax.default, aten._log_softmax.default):
    supports(_op)(lambda node, x, dim, half_to_float: _floats(x) and _last(dim, x.dim()) and not half_to_float)


@register_kernel(aten._softmax.default)
def lower_softmax(ctx, node, x: Value, dim: int, half_to_float: bool) -> Value:
    """Softmax over the last dim, one row per partition."""
    return hbm_value(softmax_kernel(_rows(x))).reshape(x.shape)


@register_kernel(aten._log_softmax.default)
def lower_log_softmax(ctx, node, x: Value, dim: int, half_to_float: bool) -> Value:
    """Log-softmax over the last dim; with the segment's nll loss of it, that loss too (its node's value)."""
    loss = _nll_loss_of(ctx, node)
    if loss is not None:
        target, weight, reduction, ignore_index = map(ctx.value, loss.args[1:])
        words, w = _nll_operands(x, target, weight)
        y, out, total, bad = log_softmax_nll_fwd_kernel(dense(x), words, ignore_index=int(ignore_index),
                                                        reduction=reduction, **w)
        _nll_checked(ctx, bad, x.shape[1], ignore_index)
        ctx.env[loss] = (hbm_value(out).reshape(()), hbm_value(total).reshape(()))
        return hbm_value(y).reshape(x.shape)
    return hbm_value(softmax_kernel(_rows(x), log=True)).reshape(x.shape)


def _nll_loss_of(ctx, node) -> Any:
    """The segment's ``nll_loss_forward`` of the [N, C] log-softmax ``node``, not computed yet, when the fused
    kernel takes them (its other readers load the stored log-softmax as before), or None."""
    val = node.meta["val"]
    for u in node.users:
        if (u.target is aten.nll_loss_forward.default and u.args[0] is node and _pending_kernel(ctx, u)
                and val.dim() == 2
                and fuses_log_softmax_fwd(val.shape[0], val.shape[1], val.dtype)):
            return u
    return None


for _op in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
    supports(_op)(lambda node, g, y, dim, input_dtype: (
        _floats(g, y) and g.dtype == input_dtype and _last(dim, y.dim())
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
    return (w is not None and b is not None and _floats(x, w, b)
            and all(s.dtype == torch.float32 for s in stats) and tuple(w.shape) == tuple(shape))


@register_kernel(aten.native_layer_norm.default)
def lower_layer_norm(ctx, node, x: Value, shape, w: Value, b: Value, eps: float) -> tuple[Value, Value, Value]:
    """Layer norm over the trailing ``shape``, with the row mean and rstd the backward takes; a later product
    of the output (the next linear layer) computed by the same kernel where it can (``layer_norm_kernel(then=)``)."""
    D = numel(tuple(shape))
    N = numel(x.shape) // D
    X = dense(x, (N, D))
    y = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), None)
    hit = None if y is None else _chain_of(ctx, y, lambda N2, dt, e2: ln_chains_product(N, D, N2, e2, X.dtype, dt))
    out, mean, rstd, *chained = layer_norm_kernel(X, dense(w, (1, D)), dense(b, (1, D)), eps=eps, stats=True,
                                                  then=None if hit is None else hit[1])
    if chained:   # the next linear layer of the output, computed from its blocks on chip
        ctx.bind(hit[0], hbm_value(chained[0]))
    stat_shape = tuple(_stats_meta(node)[1].shape)
    return hbm_value(out).reshape(x.shape), hbm_value(mean).reshape(stat_shape), hbm_value(rstd).reshape(stat_shape)


@supports(aten.native_layer_norm_backward.default)
def _ln_bwd_ok(node, dy, x, shape, mean, rstd, w, b, mask) -> bool:
    return (w is not None and b is not None and any(mask) and _floats(dy, x, w, b)
            and mean.dtype == rstd.dtype == torch.float32)


@register_kernel(aten.native_layer_norm_backward.default)
def lower_layer_norm_backward(ctx, node, dy: Value, x: Value, shape, mean: Value, rstd: Value, w: Value, b: Value,
                              mask) -> tuple[Value, Value, Value]:
    """dx, dweight, dbias of layer norm from the forward's saved statistics (None where ``mask`` asks for none:
    the first layer's input needs no gradient; the kernel's one pass computes all three anyway). With an epilogue
    (the residual add of the gradient) the first result is the epilogue's."""
    D = numel(tuple(shape))
    N = numel(x.shape) // D
    epi = ctx.epilogue(node)
    hit = None
    if mask[0]:   # the gradient through the linear layer before the norm: from dx's blocks on chip where it can
        y = (ctx.seg.epilogues[node][0].outputs[0] if epi is not None else
             next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), None))
        extras = None if epi is None else len(epi.extras)
        dtype = x.dtype if epi is None else epi.out_dtype
        hit = None if y is None else _chain_of(
            ctx, y, lambda N2, dt, e2: ln_bwd_chains_product(N, D, N2, extras, e2, x.dtype, dtype, dt))
    dx, dw, db, *chained = layer_norm_bwd_kernel(dense(dy, (N, D)), dense(x, (N, D)), dense(w, (1, D)),
                                                 mean=dense(mean, (N, 1)), rstd=dense(rstd, (N, 1)), epilogue=epi,
                                                 then=None if hit is None else hit[1])
    if chained:
        ctx.bind(hit[0], hbm_value(chained[0]))
    grads = hbm_value(dx).reshape(x.shape), hbm_value(dw).reshape(w.shape), hbm_value(db).reshape(w.shape)
    return tuple(g if wanted else None for g, wanted in zip(grads, mask))


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
    # a float result dtype (a bf16 bias gradient summed in fp32 under autocast): fp32 accumulation either way
    return (_floats(x) and (dtype is None or dtype in FLOATS) and x.dim() > 0
            and _reduced_run(tuple(x.shape), dims) is not None)


def _reduce(op: str) -> Callable:
    def lower(ctx, node, x: Value, dims=None, keepdim=False, dtype=None, **_) -> Value:
        O, R, I = _reduced_run(x.shape, dims)
        out = reduce_kernel(dense(x, (O, R, I)), op=op, out_dtype=dtype)
        return hbm_value(out).reshape(tuple(node.meta["val"].shape))
    lower.__name__ = f"lower_{op}"
    return lower


for _op, _name in REDUCTIONS.items():
    supports(_op)(_reduction_ok)
    register_kernel(_op)(_reduce(_name))
for _op, _name in ((aten.sum.default, "sum"), (aten.mean.default, "mean")):   # over every element
    supports(_op)(lambda node, x, dtype=None: _reduction_ok(node, x, None, False, dtype))
    register_kernel(_op)(_reduce(_name))


# ---- concatenation ---------------------------------------------------------------------------------

@supports(aten.cat.default)
def _cat_ok(node, tensors, dim=0) -> bool:
    out = node.meta["val"]
    return (out.dtype in DEVICE_DTYPES and out.numel() > 0
            and all(t.dtype == out.dtype and t.device == out.device for t in tensors))


@register_kernel(aten.cat.default)
def lower_cat(ctx, node, tensors: list, dim: int = 0) -> Value:
    """Each operand copied by strided DMAs into its slice of the output (read where it lies); no copy at all when
    the operands already lie side by side in one buffer (a kernel wrote them as the slices of the result)."""
    out_meta = node.meta["val"]
    shape = tuple(out_meta.shape)
    dim %= len(shape)
    joined = _adjacent(tensors, shape, dim)
    if joined is not None:
        return joined
    out = hbm_value(nl.ndarray(shape, out_meta.dtype, buffer=nl.shared_hbm))
    start = 0
    for v in tensors:
        if numel(v.shape) == 0:   # (cat skips empty operands, as PyTorch does)
            continue
        part = out.layout.narrow(dim, start, v.shape[dim])
        strided_copy(flat(out), flat(v), (part.storage_offset(), v.shape, part.stride()),
                     (v.layout.storage_offset(), v.shape, v.layout.stride()))
        start += v.shape[dim]
    return out


# ---- indices: positions, embeddings and their gradient ------------------------------------------------
# Token ids and positions are int64 on the host; in a program they are int32 word pairs (``values``). A row
# index outside the table fails the gather's indirect DMA, so a bad token id raises IndexError as eager does.


def _index(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int32, torch.int64) and t.is_contiguous() and t.numel() > 0


@supports(aten.arange.start_step)
def _arange_ok(node, start, end, step=1, *, dtype=None, **_) -> bool:
    out = node.meta["val"]
    if out.dtype not in (torch.int32, torch.int64) or out.numel() == 0 or \
            not all(isinstance(x, int) for x in (start, end, step)):
        return False
    last = start + (out.numel() - 1) * step
    return 0 <= min(start, last) and max(start, last) < 2 ** 31   # non-negative int32 values (positions)


@register_kernel(aten.arange.start_step)
def lower_arange(ctx, node, start: int, end: int, step: int = 1, **_) -> Value:
    """``torch.arange`` of integers: GpSimd's iota (int64 as word pairs)."""
    n = node.meta["val"].numel()
    if node.meta["val"].dtype == torch.int64:
        return strided_value(iota(n, start, step, wide=True), (n,), dtype=torch.int64)
    return hbm_value(iota(n, start, step))


@supports(aten.embedding.default)
def _embedding_ok(node, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False) -> bool:
    return weight.dim() == 2 and weight.dtype in DEVICE_DTYPES and weight.numel() > 0 and _index(indices)


@register_kernel(aten.embedding.default)
def lower_embedding(ctx, node, weight: Value, indices: Value, *_) -> Value:
    """Rows of the table by indirect DMA (``gather_rows``), shaped [*indices, D]."""
    words, stride = index_words(indices)
    return hbm_value(gather_rows(dense(weight), words, stride=stride)).reshape(tuple(node.meta["val"].shape))


@supports(aten.embedding_dense_backward.default)
def _embedding_bwd_ok(node, grad, indices, num_weights, padding_idx, scale_grad_by_freq) -> bool:
    return (_floats(grad) and _index(indices) and not scale_grad_by_freq
            and num_weights * indices.numel() <= ONEHOT_LIMIT and num_weights <= 2 ** 24   # ids exact in fp32
            and grad.numel() == indices.numel() * grad.shape[-1])


@register_kernel(aten.embedding_dense_backward.default)
def lower_embedding_backward(ctx, node, grad: Value, indices: Value, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool) -> Value:
    """Per-row sums of the gradient by index: ``onehot(indices)^T @ grad`` on TensorE (rows summed in index
    order with fp32 accumulation, as the eager op and the CPU sum them)."""
    n, D = indices.layout.numel(), grad.shape[-1]
    onehot = ctx.early_values.pop(node, None)   # built at the program's start (codegen), or here
    if onehot is None:
        onehot = embedding_onehot(indices, num_weights, padding_idx, grad.dtype)
    return _product(matmul_kernel, onehot, hbm_value(dense(grad, (n, D))), out_dtype=ctx.seg.widened.get(node),
                    epilogue=ctx.epilogue(node))


def embedding_onehot(indices: Value, num_weights: int, padding_idx: int, dtype: torch.dtype) -> Value:
    """[num_weights, n] in ``dtype``: 1 where row w is id j's (not ``padding_idx``), else 0; the embedding
    backward's left operand. It reads only the ids, so a program can build it before the gradient exists
    (``codegen``: at the program's start, when the ids are one of its inputs)."""
    n = indices.layout.numel()
    words, stride = index_words(indices)
    low = hbm_value(low_words(words) if stride == 2 else words).reshape((1, n))   # each id's low word
    ids = hbm_value(iota(num_weights)).reshape((num_weights, 1))
    return pointwise(lambda i, x: tm.onehot_rows(i, x, padding_idx), [ids, low], (num_weights, n), dtype)


def _adjacent(tensors: list, shape: tuple, dim: int) -> Value | None:
    """The concatenation as a view, when every operand is the next slice along ``dim`` of one buffer's layout."""
    live = [v for v in tensors if numel(v.shape) > 0]
    first = live[0] if live else None
    if first is None or any(v.buf is not first.buf or v.layout.stride() != first.layout.stride() for v in live):
        return None
    whole = first.layout.as_strided(shape, first.layout.stride(), first.layout.storage_offset())
    if any(st == 0 and n > 1 for n, st in zip(shape, whole.stride())):   # broadcast operands: copies, not a view
        return None
    start = 0
    for v in live:
        part = whole.narrow(dim, start, v.shape[dim])
        if part.storage_offset() != v.layout.storage_offset() or tuple(part.shape) != v.shape:
            return None
        start += v.shape[dim]
    if start != shape[dim] or whole.storage_offset() + 1 + sum(
            (n - 1) * st for n, st in zip(shape, whole.stride())) > numel(tuple(first.buf.shape)):
        return None
    return first.with_layout(whole)


# ---- negative log likelihood (cross-entropy's second half) ----------------------------------------------
# The kernels count targets outside [0, C) (other than ignore_index); the program returns the count as a
# device-side assertion the host reads after the launch, raising IndexError as the eager op does.

def _nll_ok(x, target, weight, reduction, ignore_index) -> bool:
    return (x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and reduction in (1, 2)
            and target.dtype == torch.int64 and target.is_contiguous() and tuple(target.shape) == (x.shape[0],)
            and 0 < x.shape[1] < EXACT and abs(ignore_index) < EXACT and x.numel() > 0
            and (weight is None or (weight.dtype == x.dtype and tuple(weight.shape) == (x.shape[1],))))


def _nll_operands(x: Value, target: Value, weight: Value | None) -> tuple[object, dict]:
    """The targets as [N, 2] int32 words and the optional class weights as a ``weight=`` keyword, as both
    nll kernels take them."""
    N, C = x.shape
    words, _ = index_words(target)
    return words.reshape((N, 2)), ({} if weight is None else {"weight": dense(weight, (1, C))})


def _nll_checked(ctx, bad, C: int, ignore_index: int) -> None:
    ctx.check(bad, "IndexError", f"Target out of bounds: a class index outside [0, {C}) other than the "
                                 f"ignore_index {ignore_index}")


supports(aten.nll_loss_forward.default)(lambda node, x, t, w, reduction, ignore_index: _nll_ok(
    x, t, w, reduction, ignore_index))
supports(aten.nll_loss_backward.default)(lambda node, g, x, t, w, reduction, ignore_index, total: (
    _nll_ok(x, t, w, reduction, ignore_index) and g.dtype == x.dtype and g.numel() == 1 and total.numel() == 1))


@register_kernel(aten.nll_loss_forward.default)
def lower_nll_loss(ctx, node, x: Value, target: Value, weight: Value | None, reduction: int,
                   ignore_index: int) -> tuple[Value, Value]:
    """(loss, total weight) reduced over the rows: the eager op's kernel, its target check a device assertion."""
    words, w = _nll_operands(x, target, weight)
    loss, total, bad = nll_fwd_kernel(dense(x), words, ignore_index=int(ignore_index), reduction=reduction, **w)
    _nll_checked(ctx, bad, x.shape[1], ignore_index)
    return hbm_value(loss).reshape(()), hbm_value(total).reshape(())


@register_kernel(aten.nll_loss_backward.default)
def lower_nll_loss_backward(ctx, node, g: Value, x: Value, target: Value, weight: Value | None, reduction: int,
                            ignore_index: int, total: Value) -> Value:
    """d loss / d x: ``-w[t_n] * g`` (over the total weight for 'mean') at each row's target, zero elsewhere."""
    C = x.shape[1]
    words, w = _nll_operands(x, target, weight)
    then = _log_softmax_backward_of(ctx, node)
    if then is not None:   # dx goes on through the log-softmax backward on chip: that node's value is the result
        y = ctx.value(then.args[1])
        if fuses_log_softmax_bwd(x.shape[0], C, g.dtype, y.dtype):
            res, bad = nll_bwd_kernel(dense(g, (1, 1)), words, dense(total, (1, 1)), num_classes=C,
                                      ignore_index=int(ignore_index), reduction=reduction, log_softmax=_rows(y), **w)
            _nll_checked(ctx, bad, C, ignore_index)
            ctx.env[then] = hbm_value(res).reshape(tuple(then.meta["val"].shape))
            return None
    dx, bad = nll_bwd_kernel(dense(g, (1, 1)), words, dense(total, (1, 1)), num_classes=C,
                             ignore_index=int(ignore_index), reduction=reduction, **w)
    _nll_checked(ctx, bad, C, ignore_index)
    return hbm_value(dx)


def _log_softmax_backward_of(ctx, node) -> Any:
    """The segment's ``_log_softmax_backward_data`` of [N, C] rows, not computed yet, that is the only reader of
    ``node`` (a loss backward's dx [N, C]), or None."""
    if len(node.users) != 1:
        return None
    u = next(iter(node.users))
    ok = (u.target is aten._log_softmax_backward_data.default and u.args[0] is node and _pending_kernel(ctx, u)
          and tuple(u.args[1].meta["val"].shape) == tuple(node.meta["val"].shape))
    return u if ok else None


# ---- input mutation ---------------------------------------------------------------------------------
# AOTAutograd ends a graph that updates its inputs (optimizer state, BatchNorm running statistics) with
# ``copy_(input, new value)``; inside the program that is a DMA into the input's own memory (its slot
# is the input's storage), after every instruction that read the old value.

@supports(aten.copy_.default)
def _copy_ok(node, dst, src, non_blocking=False) -> bool:
    target = node.args[0]
    return (not node.users and target.op == "placeholder" and dst.dtype in DEVICE_DTYPES
            and src.dtype in DEVICE_DTYPES and dst.numel() > 0 and tuple(src.shape) == tuple(dst.shape)
            and (src.dtype == dst.dtype or (src.is_floating_point() and dst.is_floating_point())))


@register_kernel(aten.copy_.default)
def lower_copy_(ctx, node, dst: Value, src: Value, non_blocking=False) -> Value:
    """``dst.copy_(src)`` for a graph input ``dst``: strided DMAs (casting between float dtypes)."""
    strided_copy(flat(dst), flat(src), (dst.layout.storage_offset(), dst.shape or (1,), dst.layout.stride() or (1,)),
                 (src.layout.storage_offset(), src.shape or (1,), src.layout.stride() or (1,)))
    return dst


# ---- attention -------------------------------------------------------------------------------------
# The device's fused SDPA ops (what F.scaled_dot_product_attention dispatches to on neuron), as the eager
# op runs them: long sequences as the flash kernels (scores and probabilities never leave the core, the
# heads' strided views read where they lie, the backward recomputes the probabilities); short ones as
# grouped small matmuls around a row softmax, each step inlined (no launch per step). Small heads of one
# tile of queries and keys go several per instruction (``packed_attention``) before either.

SDPA = aten._scaled_dot_product_fused_attention_overrideable.default
SDPA_BACKWARD = aten._scaled_dot_product_fused_attention_overrideable_backward.default


def _kernels(q, k, v) -> tuple | None:
    """(forward, backward) kernels of these heads, or None for the composed path (as the eager op picks them)."""
    B, H, L, E = q.shape
    return attention_kernels(B, H, L, k.shape[2], E, v.shape[3], q.dtype)


def _in_program(kernel) -> dict:
    """Arguments of an attention kernel inside a program: packed heads stack their groups of queries on the
    partitions (faster there, not as a lone launch: ``packed_attention``)."""
    return dict(stack_queries=True) if kernel in (packed_attention_fwd, packed_attention_bwd) else {}


def _sdpa_ok(q, k, v, bias, dropout_p, scale) -> bool:
    return (bias is None and dropout_p == 0.0 and q.dim() == k.dim() == v.dim() == 4 and _floats(q, k, v)
            and q.dtype == k.dtype == v.dtype
            and tuple(k.shape[:2]) == tuple(v.shape[:2]) == tuple(q.shape[:2]) and k.shape[3] == q.shape[3]
            and k.shape[2] == v.shape[2] and _sdpa_scale(scale, q.shape[3]) > 0
            and (_kernels(q, k, v) is not None or attention_fits(k.shape[2])))


def _sdpa_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _head_view(v: Value) -> tuple:
    """(flat buffer, (element offset, strides)) of a [B, H, n, d] value: the flash kernels read heads in place."""
    return flat(v), (v.layout.storage_offset(), tuple(v.layout.stride()))


def _heads(v: Value):
    """[B, H, n, d] as the dense [B*H, n, d] batch the bmm kernel takes."""
    B, H, n, d = v.shape
    return dense(v, (B * H, n, d))


def _attention_probs(Q, K, L: int, S: int, scale: float, causal: bool):
    """(softmax(scale * Q K^T + causal mask) as fp32 [BH, L, S], its logsumexp as [BH*L, 1] fp32), the scores
    computed from fp32 operands."""
    BH, E = Q.shape[0], Q.shape[2]
    scores = bmm_kernel(_cast(Q, (BH, L, E), torch.float32), _cast(K, (BH, S, E), torch.float32), transpose_b=True)
    probs, lse = attention_softmax_kernel(scores.reshape((BH * L, S)), scale=scale, causal_len=L if causal else 0)
    return probs.reshape((BH, L, S)), lse


@supports(SDPA)
def _sdpa_fwd_ok(node, q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                 *, scale=None) -> bool:
    return _sdpa_ok(q, k, v, attn_bias, dropout_p, scale) and not return_debug_mask


@register_kernel(SDPA)
def lower_sdpa(ctx, node, q: Value, k: Value, v: Value, attn_bias=None, dropout_p=0.0, is_causal=False,
               return_debug_mask=False, *, scale=None) -> tuple:
    """Attention forward: (output, logsumexp, and the op's bookkeeping outputs as host placeholders)."""
    B, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[3]
    s = _sdpa_scale(scale, E)
    kernels = _kernels(q, k, v)
    if kernels:
        (qb, qv), (kb, kv), (vb, vv) = _head_view(q), _head_view(k), _head_view(v)
        out, lse = kernels[0](qb, kb, vb, scale=s, causal=bool(is_causal), q_view=qv, k_view=kv, v_view=vv,
                          shape=(B, H, L, S, E, Ev), out_layout="rows", **_in_program(kernels[0]))
        out = _result(out, (B, H, L, Ev), result_views(B, H, L, Ev, "rows")[1][0])
        return out, hbm_value(lse).reshape((B, H, L)), *_sdpa_placeholders(q, L, S)
    else:
        probs, lse = _attention_probs(_heads(q), _heads(k), L, S, s, is_causal)
        out = bmm_kernel(_cast(probs, (B * H, L, S), v.dtype), _heads(v))
    out, lse = hbm_value(out).reshape((B, H, L, Ev)), hbm_value(lse).reshape((B, H, L))
    return out, lse, *_sdpa_placeholders(q, L, S)


def _sdpa_placeholders(q: Value, L: int, S: int) -> tuple:
    """The fused attention op's bookkeeping outputs (cumulative lengths, max lengths, RNG seed and offset,
    debug mask): host placeholders no program computes."""
    empty, seed = HostTensor((0,), q.dtype), HostTensor((), torch.int64)
    return empty, empty, L, S, seed, seed, empty


def _result(buf, shape: tuple, view: tuple) -> Value:
    """A flash kernel's result ``buf`` seen as ``shape`` through ``view`` (offset, strides: ``result_views``)."""
    off, strides = view
    return strided_value(buf, shape, strides, off)


@supports(SDPA_BACKWARD)
def _sdpa_bwd_ok(node, g, q, k, v, attn_bias, mask, out, lse, *rest, scale=None) -> bool:
    dropout_p = rest[4]
    return _sdpa_ok(q, k, v, attn_bias if attn_bias is not None and attn_bias.numel() else None, dropout_p, scale) \
        and g.dtype == out.dtype == q.dtype and tuple(g.shape) == tuple(out.shape) == tuple(q.shape[:3]) + (v.shape[3],) \
        and lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:3])


@register_kernel(SDPA_BACKWARD)
def lower_sdpa_backward(ctx, node, g: Value, q: Value, k: Value, v: Value, attn_bias, mask, out, lse, cum_q, cum_k,
                        max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None) -> tuple:
    """Attention backward: (dq, dk, dv, None); the probabilities are recomputed from q, k and the logsumexp."""
    B, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[3]
    s = _sdpa_scale(scale, E)
    kernels = _kernels(q, k, v)
    if kernels:
        (qb, qv), (kb, kv), (vb, vv), (ob, ov), (gb, gv) = (_head_view(x) for x in (q, k, v, out, g))
        # self-attention's gradients as the rows of the fused QKV projection's gradient: ``cat`` of them is a view
        layout = "packed" if L == S and E == Ev else "rows"
        grads = kernels[1](qb, kb, vb, ob, gb, dense(lse), scale=s, causal=bool(is_causal), q_view=qv, k_view=kv,
                       v_view=vv, o_view=ov, do_view=gv, shape=(B, H, L, S, E, Ev), out_layout=layout,
                       **_in_program(kernels[1]))
        if layout == "packed":
            views = result_views(B, H, L, E, layout, parts=3)[1]
            return (*(_result(grads, (B, H, L, E), w) for w in views), None)
        return (*(_result(g, (B, H, n, d), result_views(B, H, n, d, layout)[1][0])
                  for g, n, d in zip(grads, (L, S, S), (E, E, Ev))), None)
    Q, K, V, dO = _heads(q), _heads(k), _heads(v), _heads(g)
    probs, _ = _attention_probs(Q, K, L, S, s, is_causal)            # fp32
    BH = B * H
    Ev = v.shape[3]
    dv = bmm_kernel(_cast(probs, (BH, L, S), g.dtype), dO, transpose_a=True)             # P^T dO
    dp = bmm_kernel(_cast(dO, (BH, L, Ev), torch.float32), _cast(V, (BH, S, Ev), torch.float32),
                    transpose_b=True)                                   # dO V^T in fp32
    ds = softmax_bwd_kernel(dp.reshape((BH * L, S)), probs.reshape((BH * L, S)), scale=s)
    ds = _cast(ds, (BH * L, S), q.dtype).reshape((BH, L, S))
    dq = bmm_kernel(ds, K)                                              # dS K
    dk = bmm_kernel(ds, Q, transpose_a=True)                            # dS^T Q
    return (hbm_value(dq).reshape(q.shape), hbm_value(dk).reshape(k.shape), hbm_value(dv).reshape(v.shape), None)
