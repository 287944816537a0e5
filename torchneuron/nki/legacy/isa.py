"""``neuronxcc.nki.isa`` (earlier generation): ISA calls that *return* their result tile.

Each call allocates the result (SBUF; ``nc_matmul``/TensorE ``nc_transpose``: PSUM) and emits the
current-generation instruction into it. ``mask=`` narrows every operand and the result to the mask's box.
``nc_matmul`` results can be accumulated with ``psum[...] += nisa.nc_matmul(...)``.
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron.nki import isa as _isa
from torchneuron.nki.isa import (dge_mode, engine, gpsimd_engine, matmul_perf_mode, oob_mode,  # noqa: F401
                                 reduce_cmd, scalar_engine, tensor_engine, unknown_engine, vector_engine)
from torchneuron.nki.legacy._tile import (IndexExpr, Pred, boxes, contraction_range, fill_masked, is_box, is_empty,
                                          narrow, narrow_dims, restriction)
from torchneuron.sim.numerics import alu_op
from torchneuron.nki.tracing import NkiTensor, as_dtype, current, psum, sbuf

Tile = NkiTensor


def _new(shape: Any, dtype: Any, buffer=sbuf) -> Tile:
    return current().allocate(tuple(int(s) for s in shape), dtype, buffer)


def _n(v: Any, box: Any) -> Any:
    return narrow_dims(v, box) if isinstance(v, NkiTensor) else v


def _dt(dtype: Any, default: torch.dtype) -> torch.dtype:
    return as_dtype(dtype) if dtype is not None else default


def _run(fn, out: Tile, box: Any, **kw: Any) -> Tile:
    if not is_empty(box):
        fn(dst=_n(out, box), **{k: _n(v, box) for k, v in kw.items()})
    return out


# ---- data movement ----------------------------------------------------------------------

def dma_copy(dst: Tile, src: Tile, mask: Any = None, **kw: Any) -> None:
    """``dst = src`` by DMA (``mask=``: the selected elements only, one DMA per box of the mask)."""
    for box in [None] if mask is None else boxes(mask):
        _isa.dma_copy(dst=narrow(dst, box), src=narrow(src, box), **kw)


def tensor_copy(src: Tile, mask: Any = None, dtype: Any = None, engine: Any = None, **_: Any) -> Tile:
    """A new SBUF copy of ``src`` (PSUM eviction, cast to ``dtype``)."""
    out = _new(src.shape, _dt(dtype, src.dtype))
    return _run(lambda dst, src: _isa.tensor_copy(dst=dst, src=src, engine=engine), out, restriction(mask), src=src)


def memset(shape: Any, value: Any, dtype: Any, mask: Any = None, engine: Any = None, **_: Any) -> Tile:
    """A new SBUF tile filled with ``value``."""
    out = _new(shape, dtype)
    return _run(lambda dst: _isa.memset(dst=dst, value=value, engine=engine), out, restriction(mask))


# ---- TensorE ----------------------------------------------------------------------------

def nc_matmul(stationary: Tile, moving: Tile, is_stationary_onezero: bool = False, is_moving_onezero: bool = False,
              is_transpose: bool = False, mask: Any = None, **kw: Any) -> Tile:
    """``stationary[K, M].T @ moving[K, N]`` into a new fp32 PSUM tile ``[M, N]``.

    ``psum[...] += nisa.nc_matmul(a, b)`` accumulates into ``psum`` and ``psum[...] = ...`` overwrites it
    (the matmul is re-targeted; no extra copy)."""
    k = contraction_range(mask, "nc_matmul")  # output elements outside the mask are computed (undefined)
    if k is not None:
        stationary, moving = narrow_dims(stationary, {0: k}), narrow_dims(moving, {0: k})
    kw.pop("dtype", None)
    opts = dict(is_stationary_onezero=is_stationary_onezero, is_moving_onezero=is_moving_onezero,
                is_transpose=is_transpose, **kw)
    M, N = stationary.access.free_elems, moving.access.free_elems
    out = _new((M, N), torch.float32, psum)
    _isa.nc_matmul(dst=out, stationary=stationary, moving=moving, accumulate=False, **opts)
    out._pending = (current().instructions[-1], stationary, moving, opts)
    return out


def nc_transpose(data: Tile, mask: Any = None, dtype: Any = None, engine: Any = None, **_: Any) -> Tile:
    """Partition/free swap: TensorE (default) into a new PSUM tile, VectorE into SBUF."""
    restriction(mask)  # (checks the predicate) a transpose only moves values: outside the mask is undefined
    vector = getattr(engine, "name", engine) == "vector"
    out = _new((data.access.free_elems, data.shape[0]), _dt(dtype, data.dtype), sbuf if vector else psum)
    _isa.nc_transpose(dst=out, data=data, engine=engine)
    return out


# ---- Vector / Scalar / GpSimd ----------------------------------------------------------

def tensor_tensor(data1: Tile, data2: Tile, op: Any, dtype: Any = None, mask: Any = None, engine: Any = None,
                  **_: Any) -> Tile:
    """A new tile ``data1 <op> data2``."""
    out = _new(data1.shape, _dt(dtype, torch.promote_types(data1.dtype, data2.dtype)))
    return _run(lambda dst, data1, data2: _isa.tensor_tensor(dst=dst, data1=data1, data2=data2, op=op,
                                                             engine=engine), out, restriction(mask),
                data1=data1, data2=data2)


def tensor_scalar(data: Tile, op0: Any, operand0: Any, reverse0: bool = False, op1: Any = None, operand1: Any = None,
                  reverse1: bool = False, dtype: Any = None, mask: Any = None, engine: Any = None, **_: Any) -> Tile:
    """A new tile ``(data <op0> operand0) <op1> operand1``."""
    out = _new(data.shape, _dt(dtype, data.dtype))
    return _run(lambda dst, data, operand0, operand1: _isa.tensor_scalar(
        dst=dst, data=data, op0=op0, operand0=operand0, reverse0=reverse0, op1=op1, operand1=operand1,
        reverse1=reverse1, engine=engine), out, restriction(mask), data=data, operand0=operand0, operand1=operand1)


def reciprocal(data: Tile, dtype: Any = None, mask: Any = None, **_: Any) -> Tile:
    """A new tile ``1 / data``."""
    out = _new(data.shape, _dt(dtype, data.dtype))
    return _run(_isa.reciprocal, out, restriction(mask), data=data)


def activation(op: Any, data: Tile, bias: Any = None, scale: Any = 1.0, reduce_op: Any = None,
               reduce_res: Tile | None = None, reduce_cmd: Any = reduce_cmd.idle, mask: Any = None,
               dtype: Any = None, **_: Any) -> Tile:
    """A new tile ``op(data * scale + bias)`` (optionally reducing each row into ``reduce_res``)."""
    out = _new(data.shape, _dt(dtype, data.dtype))
    if reduce_res is not None and reduce_cmd is _isa.reduce_cmd.idle:
        reduce_cmd = _isa.reduce_cmd.reset_reduce
    return _run(lambda dst, data, bias, scale, reduce_res: _isa.activation(
        dst=dst, op=op, data=data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
        reduce_cmd=reduce_cmd), out, restriction(mask), data=data, bias=bias, scale=scale, reduce_res=reduce_res)


def tensor_reduce(op: Any, data: Tile, axis: Any, mask: Any = None, dtype: Any = None, negate: bool = False,
                  keepdims: bool = False, **_: Any) -> Tile:
    """A new tile: ``data`` reduced with ``op`` over trailing free ``axis``."""
    rank = len(data.shape)
    axes = sorted(a % rank for a in ((axis,) if isinstance(axis, int) else axis))
    shape = [1 if i in axes else n for i, n in enumerate(data.shape) if keepdims or i not in axes]
    out = _new(shape if len(shape) > 1 else (*shape, 1), _dt(dtype, data.dtype))
    box = restriction(mask)
    if is_empty(box):
        return out
    obox = {d: r for d, r in (box or {}).items() if d not in axes}
    if not is_box(mask):  # the elements the mask leaves out take the reduction's identity
        identity = _REDUCE_IDENTITY.get(alu_op(op))
        if identity is None:
            raise NotImplementedError(f"tensor_reduce: a mask that is not a box needs an add/max/min reduction, "
                                      f"not {op!r}")
        data, box = fill_masked(data, mask, box or {}, identity), None
    _isa.tensor_reduce(dst=_n(out, obox), op=op, data=_n(data, box), axis=tuple(axes), negate=negate,
                       keepdims=keepdims)
    return out


_REDUCE_IDENTITY = {"add": 0.0, "maximum": float("-inf"), "minimum": float("inf")}


def tensor_scalar_reduce(*, data: Tile, op0: Any, operand0: Any, reduce_op: Any, reduce_res: Tile,
                         reverse0: bool = False, dtype: Any = None, mask: Any = None, **_: Any) -> Tile:
    """A new tile ``data <op0> operand0``; its rows reduced with ``reduce_op`` into ``reduce_res``."""
    out = _new(data.shape, _dt(dtype, data.dtype))
    return _run(lambda dst, data, operand0, reduce_res: _isa.tensor_scalar_reduce(
        dst=dst, data=data, op0=op0, operand0=operand0, reduce_op=reduce_op, reduce_res=reduce_res,
        reverse0=reverse0), out, restriction(mask), data=data, operand0=operand0, reduce_res=reduce_res)


def tensor_tensor_scan(data0: Tile, data1: Tile, initial: Any, op0: Any, op1: Any, reverse0: bool = False,
                       reverse1: bool = False, dtype: Any = None, mask: Any = None, **_: Any) -> Tile:
    """A new tile: per row ``r[i] = (data0[i] <op0> r[i-1]) <op1> data1[i]``."""
    out = _new(data0.shape, _dt(dtype, data0.dtype))
    return _run(lambda dst, data0, data1, initial: _isa.tensor_tensor_scan(
        dst=dst, data0=data0, data1=data1, initial=initial, op0=op0, op1=op1, reverse0=reverse0,
        reverse1=reverse1), out, restriction(mask), data0=data0, data1=data1, initial=initial)


def bn_stats(data: Tile, mask: Any = None, dtype: Any = None, **_: Any) -> Tile:
    """A new ``(P, 6)`` tile of per-row batch-norm statistics."""
    out = _new((data.shape[0], 6), _dt(dtype, torch.float32))
    box = restriction(mask)
    if not is_empty(box):
        _isa.bn_stats(dst=_n(out, {0: box[0]} if box and 0 in box else None), data=_n(data, box))
    return out


def bn_aggr(data: Tile, mask: Any = None, dtype: Any = None, **_: Any) -> Tile:
    """A new ``(P, 2)`` tile of per-row (mean, variance) from ``bn_stats`` outputs."""
    out = _new((data.shape[0], 2), _dt(dtype, torch.float32))
    box = restriction(mask)
    if not is_empty(box):
        pbox = {0: box[0]} if box and 0 in box else None
        _isa.bn_aggr(dst=_n(out, pbox), data=_n(data, pbox))
    return out


def iota(expr: IndexExpr, dtype: Any, mask: Any = None, **_: Any) -> Tile:
    """A new tile holding the values of an affine index expression (GpSimd)."""
    assert mask is None, "iota mask= is not supported"
    ndim = max(expr.ndim, 2)
    sizes, coef = [1] * ndim, [0] * ndim
    for v, c in expr.terms.items():
        sizes[v.pos], coef[v.pos] = v.size, c
    out = _new(sizes, dtype)
    _isa.iota(dst=out, pattern=[[coef[k], sizes[k]] for k in range(1, ndim)], offset=expr.const,
              channel_multiplier=coef[0])
    return out


_CMP = {"lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal"}


def affine_select(pred: Pred, on_true_tile: Tile, on_false_value: float, mask: Any = None, dtype: Any = None,
                  **_: Any) -> Tile:
    """A new tile: ``on_true_tile`` where the affine predicate holds, else ``on_false_value`` (GpSimd)."""
    assert mask is None and len(pred.clauses) == 1, "affine_select takes one comparison and no mask"
    lhs, rhs, op = pred.clauses[0]
    e = lhs - rhs if isinstance(lhs, IndexExpr) else -(rhs - lhs)
    ndim = len(on_true_tile.shape)
    coef = [0] * ndim
    for v, c in e.terms.items():
        coef[v.pos] = c
    out = _new(on_true_tile.shape, _dt(dtype, on_true_tile.dtype))
    _isa.affine_select(dst=out, pattern=[[coef[k], on_true_tile.shape[k]] for k in range(1, ndim)],
                       channel_multiplier=coef[0], on_true_tile=on_true_tile, on_false_value=on_false_value,
                       cmp_op=_CMP[op], offset=e.const)
    return out


__all__ = [n for n in dir() if not n.startswith("_") and n not in (
    "annotations", "Any", "torch", "IndexExpr", "Pred", "is_empty", "narrow", "narrow_dims", "restriction",
    "as_dtype", "current", "psum", "sbuf", "boxes", "fill_masked", "is_box", "alu_op",
    "contraction_range")]
