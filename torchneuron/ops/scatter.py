"""Gathers, scatters and data-dependent selections on the device.

Element-wise along a dim (``gather``, ``scatter``, ``scatter_add``, ``scatter_reduce``): the dim is
moved last and the tensors are seen as lines [L, S] (self) and [L, I] (index, src), L being the
index's other dims. A position of line l is the flat element ``l * S + index`` of the dense line
block, so ``gather`` is a one-element-row gather (``kernels.indexing.gather_rows``) and ``scatter``
a one-element-row scatter (``kernels.scatter.scatter_rows``, indirect DMA as the destination).
Accumulating scatters build ``where(index == s, src, identity)`` over [L, S, I] and reduce the last
dim on the device (sum, prod, amax, amin, mean), so duplicate indices combine like the CPU's.

Rows (``index_select``-like ops: ``index.Tensor``, ``index_put_``, ``index_copy_``, ``index_add_``,
``index_fill_``, ``take``): the indexed dims are moved first and flattened into one row number per
index; gathers and plain puts move whole rows by indirect DMA; accumulating puts sum rows as a
one-hot matrix product on TensorE (``onehot(rows)^T``-style, fp32 accumulation).

Data-dependent sizes (``nonzero``, ``masked_select``, boolean-mask indexing, ``masked_scatter_``):
the device scans the mask (``kernels.scan.scan_rows``), the host reads the count (one sync, as
CUDA does), then each selected element is scattered to its rank.

Index dtypes int32/int64 (int64 read as their low words); ranges are checked on the device and an
error is raised by re-running the op on CPU copies, so the exception and message are the CPU's.
Shapes and dtypes are checked by running the op on ``meta`` tensors (the CPU's checks), before any
fallback, and ``out=`` overlaps after its resize (as the CPU does). 8-32-bit integer data accumulates
exactly mod 2**32 and wraps to its width as the CPU's does: scatter reductions select and reduce in
int32 (products by pairwise int32 multiplies), row sums are one-hot products on TensorE per byte of the
values (each byte's sums exact in fp32), recombined in int32. int64 accumulates on the int64 word kernels
(exact mod 2**64): scatter reductions select and reduce there, row sums recombine their 8 byte products with
int64 shifts and adds. int64/float64 data moves (gather, plain scatter, take, put, masked_fill_) as pairs of
int32 words; float64 takes the CPU fallback where it would accumulate.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import canonicalize_dim

import torchneuron.nki.language as nl
from torchneuron.kernels.indexing import ONEHOT_LIMIT, gather_rows
from torchneuron.kernels.scan import scan_rows
from torchneuron.kernels.scatter import scatter_rows
from torchneuron.kernels import tilemath as tm
from torchneuron.ops import base
from torchneuron.ops.base import (aten, DEVICE_DTYPES, FLOATS, meta_twin, on_one_device, raise_like_cpu, type_name,
                                  resize_out, Unsupported)
from torchneuron.ops.elementwise import (broadcast_shape, check_no_internal_overlap, check_no_overlap, dense,
                                         device_copy, run_pointwise, to_int64)
from torchneuron.ops.indexing import arange_values, index_rows_launch, mask_rows_launch
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering, refuse_other_out_dtypes, register_out

INDEX_DTYPES = (torch.int32, torch.int64)
DATA_DTYPES = DEVICE_DTYPES - {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32}
# ops that only move elements (gather, plain scatter, take, put): 8-byte ones move as int32 word pairs
MOVE_DTYPES = DATA_DTYPES | {torch.int64, torch.float64}
LINES_LIMIT = 1 << 24      # elements of the [L, S, I] selection an accumulating scatter builds
# integer data accumulated exactly mod 2**32 in int32 (as the CPU's own-width arithmetic, wrapped after)
EXACT_INTS = (torch.int8, torch.int16, torch.int32, torch.uint8)
BYTE_ROWS = 1 << 16        # rows of one byte product: 255 * BYTE_ROWS < 2**24, exact in fp32


# ---- tile functions (per element of the element-wise kernel) -----------------------------------

def _outside(x, lo, hi):
    """1 where x < lo or x >= hi."""
    return nl.logical_or(nl.less(x, lo), nl.greater_equal(x, hi))


def _wrap(x, n):
    """A negative index counted from the end: x + n where x < 0."""
    return nl.add(x, nl.multiply(nl.less(x, 0), n))


def _fma(a, b, s):
    """a * s + b (row numbers from per-dim indices)."""
    return nl.add(nl.multiply(a, s), b)


def _pick(idx, ids, v, identity):
    """v where idx == id, else the reduction's identity (an exact select: NaN/inf pass through)."""
    return tm.where(nl.equal(idx, ids), v, identity)


def match_tile(idx, ids):
    """1.0 where idx == id."""
    return nl.equal(idx, ids)


def byte_tile(v, shift):
    """Byte ``shift // 8`` of an int's two's complement bits (0..255)."""
    return nl.bitwise_and(nl.right_shift(v, shift), 255)


def slot_tile(flag, rank, dummy):
    """The output row of a selected element (its rank - 1), or the spare row ``dummy``."""
    return tm.where(flag, nl.subtract(rank, 1), dummy)


# ---- helpers ------------------------------------------------------------------------------------

def index_int32(index: torch.Tensor) -> torch.Tensor:
    """A contiguous int32 copy of an integer index tensor's values (int64: its low words)."""
    index = dense(index)
    if index.dtype == torch.int64:
        return dense(index.reshape(-1).view(torch.int32)[0::2]).reshape(index.shape)
    return index if index.dtype == torch.int32 else index.to(torch.int32)


def any_outside(idx: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether any index lies outside [lo, hi) (computed on the device, read by the host)."""
    if idx.numel() == 0:
        return False
    flags = run_pointwise(_outside, [idx, lo, hi], KIND.ALWAYS_BOOL, result_dtype=torch.bool, op="aten::index")
    return bool(flags.any().item())


def _gather_elems(table: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``table.reshape(-1)[flat]`` for int32 ``flat`` (any shape); one-element-row indirect DMAs (8-byte
    elements: rows of two int32 words)."""
    src = dense(table).reshape(-1)      # 1-D first: see scatter_into
    wide = src.element_size() == 8
    src = src.view(torch.int32).view(-1, 2) if wide else src.view(-1, 1)
    (rows,) = call_kernel(gather_rows, {"table": src,
                                        "index": dense(flat).reshape(-1)}, {"stride": 1}, op="aten::gather")
    return (rows.view(table.dtype) if wide else rows).reshape(flat.shape)


def scatter_into(table: torch.Tensor, flat: torch.Tensor, values: torch.Tensor) -> None:
    """``table.view(V, D)[flat] = values`` in place (a contiguous table; rows of D elements)."""
    n = flat.numel()
    if n == 0:
        return
    D = values.numel() // n
    # through 1-D views: a dense [n, 1] tensor may carry any stride on its size-1 dim, which a dtype view refuses
    rows, vals = table.view(-1), dense(values).reshape(-1)
    if table.element_size() == 8:   # 8-byte elements move as pairs of int32 words
        rows, vals, D = rows.view(torch.int32), vals.view(torch.int32), 2 * D
    rows, vals = rows.view(-1, D), vals.view(n, D)
    call_kernel(scatter_rows, {"table": rows, "index": dense(flat).reshape(-1), "values": vals}, {"stride": 1},
                op="aten::scatter")


def check_out(out: torch.Tensor | None, *inputs: Any, shape: Sequence[int] | None = None) -> None:
    """Resize an ``out=`` tensor to the result's ``shape`` when known (PyTorch's warning when it had elements),
    then the CPU's refusals for one that overlaps itself or an input (after the resize, as the CPU checks)."""
    if out is None:
        return
    if shape is not None and tuple(out.shape) != tuple(shape):
        resize_out(out, shape)
    if out.numel():
        check_no_internal_overlap(out)
        check_no_overlap(out, [t for t in inputs if isinstance(t, torch.Tensor)])


def _write(target: torch.Tensor, view_of_target: torch.Tensor, block: torch.Tensor) -> None:
    """Store a computed dense block into a view of ``target`` (skipped when it is that view's storage)."""
    if block.data_ptr() != view_of_target.data_ptr() or block.stride() != view_of_target.stride():
        device_copy(view_of_target, block)


def _lines(t: torch.Tensor, ishape: Sequence[int], d: int) -> torch.Tensor:
    """The view of ``t`` with dim ``d`` last, cut to the index's sizes in the other dims."""
    moved = t.movedim(d, -1)
    return moved[tuple(slice(0, n) for n in ishape)]


def _line_setup(self: torch.Tensor, dim: int, index: torch.Tensor):
    """(d, index moved last, L, S, I, int32 index [L, I]) of an along-dim op (0-dim seen as 1-dim)."""
    d = canonicalize_dim(max(self.dim(), 1), dim)
    index_m = index.reshape(1) if index.dim() == 0 else index.movedim(d, -1)
    S = self.shape[d] if self.dim() else 1
    I = index_m.shape[-1]
    L = index_m.numel() // max(I, 1)
    return d, index_m, L, S, I, index_int32(index_m).reshape(L, I)


def _flat(idx: torch.Tensor, L: int, S: int) -> torch.Tensor:
    """Flat element numbers ``l * S + idx[l, i]`` of the dense [L, S] line block."""
    return run_pointwise(_fma, [arange_values(L, idx.device).reshape(L, 1), idx, S], KIND.DEFAULT, op="aten::gather")


@lowering("gather")
def gather(self: torch.Tensor, dim: int, index: torch.Tensor, *, sparse_grad: bool = False) -> torch.Tensor:
    """``torch.gather``: element gathers along ``dim`` by indirect DMA."""
    res_meta = aten.gather.default(meta_twin(self), dim, meta_twin(index), sparse_grad=sparse_grad)
    if not on_one_device(self, index) or (index.numel() and (self.dtype not in MOVE_DTYPES
                                                          or index.dtype not in INDEX_DTYPES)):
        raise Unsupported("tensors on more than one device, or a dtype the DMA gather lacks")
    if index.numel() == 0:
        return torch.empty(res_meta.shape, dtype=self.dtype, device=self.device)
    d, index_m, L, S, I, idx = _line_setup(self, dim, index)
    if any_outside(idx, 0, S):
        raise_like_cpu(aten.gather.default, self, dim, index, with_data=True)
    src = self.reshape(1) if self.dim() == 0 else _lines(self, index_m.shape[:-1], d)
    vals = _gather_elems(dense(src), _flat(idx, L, S))
    res = vals.reshape(index_m.shape)
    return res.reshape(res_meta.shape) if index.dim() == 0 else dense(res.movedim(-1, d))


# the CPU kernel refuses an out= unlike the input ("Expected out tensor to have dtype ...")
register_out("gather.out", gather, cast=refuse_other_out_dtypes("gather.out", lambda self, *a, **k: self.dtype))


def _scatter_impl(target: torch.Tensor, dim: int, index: torch.Tensor, src: Any, reduce: str | None,
                  include_self: bool, check_op: Any, check_args: tuple) -> None:
    """``target.scatter_*(dim, index, src)`` in place: a plain scatter by indirect DMA, or a reduction."""
    if index.numel() == 0:
        return
    d, index_m, L, S, I, idx = _line_setup(target, dim, index)
    if any_outside(idx, 0, S):
        raise_like_cpu(check_op, *check_args, with_data=True)
    view = target.reshape(1) if target.dim() == 0 else _lines(target, index_m.shape[:-1], d)
    if isinstance(src, torch.Tensor):
        vals = src.reshape(1) if src.dim() == 0 else _lines(src, index_m.shape[:-1], d)[..., :I]
    else:
        vals = torch.full(index_m.shape, src, dtype=target.dtype, device=target.device)
    block = dense(view)
    if reduce is None:
        scatter_into(block, _flat(idx, L, S), vals.to(target.dtype))
        _write(target, view, block)
        return
    if L * S * I > LINES_LIMIT:
        raise Unsupported
    # integers reduce in int32 (exact mod 2**32, which is all a result of 32 bits or fewer keeps) or int64 (its
    # word kernels: exact mod 2**64), the rest in fp32 (bools: nonzero sums and products are their or/and)
    exact = target.dtype in EXACT_INTS + (torch.int64,)
    compute = (torch.int64 if target.dtype == torch.int64 else torch.int32) if exact else torch.float32
    x = block.reshape(L, S).to(compute)
    v = dense(vals).reshape(L, 1, I).to(compute)
    ids = arange_values(S, target.device).reshape(1, S, 1)
    ix = idx.reshape(L, 1, I)
    lowest, highest = ((torch.iinfo(compute).min, torch.iinfo(compute).max) if exact
                       else (float("-inf"), float("inf")))
    identity = {"sum": 0, "mean": 0, "prod": 1, "amax": lowest, "amin": highest}[reduce]
    if compute == torch.int64:   # the int64 select (the element-wise kernels take no 8-byte data)
        picked = torch.where(ix == ids, v, identity)
    else:
        picked = run_pointwise(_pick, [ix, ids, v, identity], KIND.DEFAULT, op="aten::scatter_reduce")
    if exact:
        red = {"sum": lambda t: t.sum(-1, dtype=compute), "mean": lambda t: t.sum(-1, dtype=compute),
               "prod": _int_prod_last, "amax": lambda t: t.amax(-1), "amin": lambda t: t.amin(-1)}[reduce](picked)
    else:
        red = {"sum": torch.sum, "mean": torch.sum, "prod": torch.prod, "amax": torch.amax,
               "amin": torch.amin}[reduce](picked, -1)
    if reduce == "mean" or not include_self:
        count = run_pointwise(match_tile, [ix, ids], KIND.DEFAULT, result_dtype=torch.float32,
                              op="aten::scatter_reduce").sum(-1)
    if reduce == "mean":
        total = red + x if include_self else red
        if exact:   # the CPU sums and counts in the data's dtype (both wrap at its width), a count of 0 taken
            # as 1, and divides with floor
            n = (count + 1 if include_self else count).to(torch.int32).to(target.dtype)
            n = n.masked_fill(n == 0, 1)
            new = torch.div(total.to(target.dtype), n, rounding_mode="floor")
        else:
            new = total / (count + 1 if include_self else count.clamp(min=1))
    elif include_self:
        new = {"sum": torch.add, "prod": torch.mul, "amax": torch.maximum, "amin": torch.minimum}[reduce](x, red)
    else:
        new = red
    if not include_self or reduce == "mean":
        new = torch.where(count > 0, new, x) if not include_self else new
    _write(target, view, new.to(target.dtype).reshape(view.shape))


def _int_prod_last(t: torch.Tensor) -> torch.Tensor:
    """Products of int32/int64 ``t`` over its last dim, exact mod 2**32/2**64: halves multiplied pairwise
    (the products wrap exactly), log2 of the length launches."""
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        head = t[..., :h] * t[..., h:2 * h]
        t = torch.cat([head, t[..., 2 * h:]], -1) if t.shape[-1] % 2 else head
    return t[..., 0]


def _int32(k: Any) -> int:
    """A Python int as the int32 it is mod 2**32."""
    return (int(k) + (1 << 31)) % (1 << 32) - (1 << 31)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an accumulation into ``dtype`` data computes in: int32 for 8-32-bit ints (exact mod 2**32),
    int64 for int64, else fp32."""
    return torch.int32 if dtype in EXACT_INTS else torch.int64 if dtype == torch.int64 else torch.float32


def _onehot_sums(onehot: torch.Tensor, vals: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``onehot [S, n] @ vals [n, R]``: fp32 on TensorE for floats and bools; for ``EXACT_INTS`` int32 sums
    exact mod 2**32, one product per byte of the values (each exact in fp32, BYTE_ROWS rows at a time)."""
    if dtype not in EXACT_INTS + (torch.int64,):
        return onehot @ vals.to(torch.float32)
    v32 = vals.to(torch.int32) if dtype != torch.int64 else vals
    n = v32.shape[0]
    total = None
    for shift in range(0, 8 * dtype.itemsize, 8):
        if dtype == torch.int64:   # the word kernels' shift and mask, then a cast of 0..255
            byte = ((v32 >> shift) & 255).to(torch.float32)
        else:
            byte = run_pointwise(byte_tile, [v32, shift], KIND.DEFAULT, result_dtype=torch.float32,
                                 op="aten::index_add")
        for r0 in range(0, n, BYTE_ROWS):
            part = (onehot[:, r0:r0 + BYTE_ROWS] @ byte[r0:r0 + BYTE_ROWS]).to(accumulate_dtype(dtype))
            term = (part << shift if dtype == torch.int64 else part * (1 << shift)) if shift else part
            total = term if total is None else total + term
    return total


def _like_self(self: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Size, torch.dtype]:
    """``register_out``'s ``into=`` for the scatters and row puts: their result is ``self``'s shape and dtype."""
    return self.shape, self.dtype


def _self_dtype(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.dtype:
    """The dtype of a scatter's or row put's result: ``self``'s."""
    return self.dtype


def _start(self: torch.Tensor, inplace: bool, into: torch.Tensor | None) -> torch.Tensor:
    """The tensor a scatter or row put writes into: ``self`` in place, else a copy of it (made in ``into``,
    ``register_out``'s destination, when given)."""
    if inplace:
        return self
    if into is None:
        return self.clone()
    device_copy(into, self)
    return into


def _scatter_lowering(name: str, kind: str, out_name: str | None = None) -> None:
    """Register one overload of scatter (src/value), scatter_add or scatter_reduce, and from a functional one its
    ``out=`` overload ``out_name`` (the CPU refuses an ``out=`` unlike ``self``)."""
    overload = base.overload(name)
    inplace = name.split(".")[0].endswith("_")

    def kernel(self: torch.Tensor, dim: int, index: torch.Tensor, src: Any, *args: Any,
               into: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        reduce = None if kind == "scatter" else "sum" if kind == "add" else (args[0] if args else kwargs["reduce"])
        if kind == "legacy":   # scatter(..., reduce="add" | "multiply"): self always included
            reduce = {"add": "sum", "multiply": "prod"}.get(reduce, reduce)
        include_self = kwargs.get("include_self", args[1] if len(args) > 1 else True) if kind == "reduce" else True
        overload(*meta_twin((self, dim, index, src)), *args, **{k: meta_twin(v) for k, v in kwargs.items()})
        tensors = [self, index] + ([src] if isinstance(src, torch.Tensor) else [])
        if not on_one_device(*tensors) or index.dtype not in INDEX_DTYPES or \
                self.dtype not in (MOVE_DTYPES if reduce is None else DATA_DTYPES | {torch.int64}):
            raise Unsupported
        if isinstance(src, torch.Tensor) and src.dtype != self.dtype:
            raise Unsupported
        if reduce is not None and reduce not in ("sum", "mean", "prod", "amax", "amin"):
            raise Unsupported
        if reduce == "mean" and self.dtype not in FLOATS + EXACT_INTS + (torch.int64,):
            raise Unsupported
        target = _start(self, inplace, into)
        # the functional op re-run on CPU copies when an index is out of range
        tensor_src = isinstance(src, torch.Tensor)
        check = {"scatter": aten.scatter.src if tensor_src else aten.scatter.value,
                 "legacy": aten.scatter.reduce if tensor_src else aten.scatter.value_reduce,
                 "add": aten.scatter_add.default, "reduce": aten.scatter_reduce.two}[kind]
        check_args = (self, dim, index, src) + ((args[0] if args else kwargs["reduce"],)
                                                if kind in ("reduce", "legacy") else ())
        _scatter_impl(target, dim, index, src, reduce, include_self, check, check_args)
        return target
    kernel.__name__ = kernel.__qualname__ = name.replace(".", "_")
    lowering(name)(kernel)
    if out_name is not None:
        register_out(out_name, kernel, cast=refuse_other_out_dtypes(out_name, _self_dtype), into=_like_self)


for _kind, _functional, _inplace, _out in (
        ("scatter", "scatter.src", "scatter_.src", "scatter.src_out"),
        ("scatter", "scatter.value", "scatter_.value", "scatter.value_out"),
        ("legacy", "scatter.reduce", "scatter_.reduce", "scatter.reduce_out"),
        ("legacy", "scatter.value_reduce", "scatter_.value_reduce", "scatter.value_reduce_out"),
        ("add", "scatter_add", "scatter_add_", "scatter_add.out"),
        ("reduce", "scatter_reduce.two", "scatter_reduce_.two", "scatter_reduce.two_out")):
    _scatter_lowering(_functional, _kind, _out)
    _scatter_lowering(_inplace, _kind)


# ---- row ops along one dim: index_copy, index_add, index_fill ----------------------------------

def _rows_of(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` with dim ``d`` first (a view)."""
    return t.reshape(1) if t.dim() == 0 else t.movedim(d, 0)


def _row_put(target: torch.Tensor, d: int, rows: torch.Tensor, source: torch.Tensor, accumulate: bool,
             alpha: Any = 1) -> None:
    """``target.movedim(d, 0)[rows] = source`` (or ``+= alpha * source``) for int32 in-range rows [n]."""
    view = _rows_of(target, d)
    S = view.shape[0]
    n = rows.numel()
    block = dense(view)
    vals = dense(_rows_of(source, d) if source.dim() else source.reshape(1)).reshape(n, -1)
    if not accumulate:
        scatter_into(block, rows, vals.to(target.dtype))
        _write(target, view, block)
        return
    if S * n > ONEHOT_LIMIT:
        raise Unsupported
    # sums of the rows per destination: onehot [S, n] @ values [n, R] on TensorE
    onehot = run_pointwise(match_tile, [arange_values(S, target.device).reshape(S, 1), rows.reshape(1, n)], KIND.DEFAULT,
                           result_dtype=torch.float32, op="aten::index_add")
    sums = _onehot_sums(onehot, vals, target.dtype)
    if target.dtype == torch.int64:
        new = block.reshape(S, -1).add(sums, alpha=alpha)
    elif target.dtype in EXACT_INTS:   # int32 arithmetic wraps mod 2**32, as the CPU's narrower one does
        new = run_pointwise(tm.add_scaled, [block.reshape(S, -1).to(torch.int32), sums, _int32(alpha)],
                            KIND.DEFAULT, op="aten::index_add")
    else:
        new = run_pointwise(tm.add_scaled, [block.reshape(S, -1).to(torch.float32), sums, alpha], KIND.DEFAULT,
                            op="aten::index_add")
        if not target.dtype.is_floating_point:
            new = new.round()
    _write(target, view, new.to(target.dtype).reshape(view.shape))


def _row_lowering(name: str, kind: str, out_name: str | None = None) -> None:
    """Register one overload of index_copy, index_add or index_fill_, and from a functional one its ``out=``
    overload ``out_name`` (the CPU refuses an ``out=`` unlike ``self``)."""
    overload = base.overload(name)
    packet = name.split(".")[0]
    inplace = packet.endswith("_")
    fn_op = {"copy": aten.index_copy.default, "add": aten.index_add.default, "fill": aten.index_fill.int_Scalar,
             "fillt": aten.index_fill.int_Tensor}[kind]

    def kernel(self: torch.Tensor, dim: int, index: torch.Tensor, source: Any, *args: Any,
               into: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        alpha = kwargs.get("alpha", args[0] if args else 1)
        tensors = [self, index] + ([source] if isinstance(source, torch.Tensor) and kind != "fillt" else [])
        ok = DATA_DTYPES | ({torch.int64} if kind == "add" else set())   # int64 sums: exact by bytes
        if (not on_one_device(*tensors) or index.dtype not in INDEX_DTYPES or self.dtype not in ok
                or (isinstance(source, torch.Tensor) and source.dtype not in ok)):
            raise Unsupported
        overload(*meta_twin((self, dim, index, source)), *args, **{k: meta_twin(v) for k, v in kwargs.items()})
        if kind == "add" and self.dim() > 1:   # a check the meta function leaves out
            d0 = canonicalize_dim(self.dim(), dim)
            if source.dim() != self.dim() or any(source.shape[k] != self.shape[k] for k in range(self.dim())
                                                 if k != d0):
                raise RuntimeError("source tensor shape must match self tensor shape, excluding the specified "
                                   f"dimension. Got self.shape = {list(self.shape)} source.shape = "
                                   f"{list(source.shape)}")
        if kind == "fillt":
            if source.device.type == "cpu":
                source = source.item()
            elif source.device != self.device:
                raise Unsupported
        target = _start(self, inplace, into)
        if index.numel() == 0 or self.numel() == 0:
            return target
        d = canonicalize_dim(max(self.dim(), 1), dim)
        S = self.shape[d] if self.dim() else 1
        rows = index_int32(index).reshape(-1)
        lo = -S if kind in ("fill", "fillt") else 0
        if any_outside(rows, lo, S):
            raise_like_cpu(fn_op, self, dim, index, source, *args, **kwargs, with_data=True)
        if kind in ("fill", "fillt"):
            rows = run_pointwise(_wrap, [rows, S], KIND.DEFAULT, op="aten::index_fill")
            hit = run_pointwise(match_tile, [arange_values(S, self.device).reshape(S, 1), rows.reshape(1, -1)],
                                KIND.DEFAULT, result_dtype=torch.float32, op="aten::index_fill")
            selected = hit.amax(-1) > 0
            shape = [1] * self.dim()
            if self.dim():
                shape[d] = S
            mask = selected.reshape(shape)
            value = source if isinstance(source, torch.Tensor) else source
            run_pointwise(tm.where, [mask, value, target], KIND.NO_OPMATH, target, True, target.dtype,
                          op="aten::index_fill_")
            return target
        _row_put(target, d, rows, source, kind == "add", alpha)
        return target
    kernel.__name__ = kernel.__qualname__ = name.replace(".", "_")
    lowering(name)(kernel)
    if out_name is not None:
        register_out(out_name, kernel, cast=refuse_other_out_dtypes(out_name, _self_dtype), into=_like_self)


for _packet, _kind in (("index_copy", "copy"), ("index_add", "add")):
    _row_lowering(_packet, _kind, f"{_packet}.out")
    _row_lowering(f"{_packet}_", _kind)
_row_lowering("index_fill_.int_Scalar", "fill")
_row_lowering("index_fill_.int_Tensor", "fillt")


@lowering("take")
def take(self: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``torch.take``: elements of the flattened tensor by indirect DMA (negative indices from the end)."""
    aten.take.default(meta_twin(self), meta_twin(index))
    if not on_one_device(self, index) or self.dtype not in MOVE_DTYPES or index.dtype not in INDEX_DTYPES:
        raise Unsupported("tensors on more than one device, or a dtype the DMA gather lacks")
    if index.numel() == 0:
        return torch.empty(index.shape, dtype=self.dtype, device=self.device)
    n = self.numel()
    flat = index_int32(index)
    if any_outside(flat, -n, n):
        raise_like_cpu(aten.take.default, self, index, with_data=True)
    flat = run_pointwise(_wrap, [flat, n], KIND.DEFAULT, op="aten::take")
    return _gather_elems(dense(self), flat)


register_out("take.out", take)


@lowering("put_")
def put_(self: torch.Tensor, index: torch.Tensor, source: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """``self.put_(index, source, accumulate)``: elements of the flattened tensor written by indirect DMA, or
    summed in as a one-hot matrix product (negative indices from the end)."""
    # the CPU's checks, in its order (the meta function has none of them)
    if index.dtype != torch.int64:
        raise RuntimeError(f"put_(): Expected a long tensor for index, but got {type_name(index.dtype)}")
    if self.dtype != source.dtype:
        raise RuntimeError(f"put_(): self and source expected to have the same dtype, but got self.dtype = "
                           f"{type_name(self.dtype)} and source.dtype = {type_name(source.dtype)}")
    if source.numel() != index.numel():
        raise IndexError(f"put_(): Expected source and index to have the same number of elements, but got "
                         f"source.numel() = {source.numel()}, index.numel() = {index.numel()}")
    if not on_one_device(self, index, source) or self.dtype not in (DATA_DTYPES | {torch.int64} if accumulate else MOVE_DTYPES):
        raise Unsupported
    if index.numel() == 0:
        return self
    n = self.numel()
    flat = index_int32(index).reshape(-1)
    if any_outside(flat, -n, n):
        raise_like_cpu(aten.put.default, self, index, source, accumulate, with_data=True)
    flat = run_pointwise(_wrap, [flat, n], KIND.DEFAULT, op="aten::put_")
    block = dense(self).reshape(-1)
    _row_put(block, 0, flat, source.reshape(-1), accumulate)
    _write(self, self, block.reshape(self.shape))
    return self


# ---- data-dependent sizes: nonzero, masked_select ------------------------------------------------

def compact(flags: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The rows of ``values`` [N, D] whose ``flags`` [N] (bool) are set, in order: a device scan of the
    flags gives each selected row its rank; the host reads the count; rows are scattered to their ranks."""
    N = flags.numel()
    D = values.numel() // max(N, 1)
    if N == 0:
        return torch.empty((0, D), dtype=values.dtype, device=values.device)
    (rank,) = call_kernel(scan_rows, {"x": dense(flags).reshape(1, N)},
                          {"op": "sum", "out_dtype": torch.int32, "compute": nl.int32}, op="aten::nonzero")
    count = int(rank[0, N - 1].item())   # the one host sync: the result's size
    out = torch.empty((count + 1, D), dtype=values.dtype, device=values.device)
    slots = run_pointwise(slot_tile, [flags.reshape(-1), rank.reshape(-1), count], KIND.DEFAULT, op="aten::nonzero")
    scatter_into(out, slots, values.reshape(N, D))
    return out[:count]


def _nonzero32(self: torch.Tensor) -> torch.Tensor:
    """int32 [count, ndim] coordinates of the non-zero elements, in row-major order."""
    flags = self != 0 if self.dtype != torch.bool else self
    nd = self.dim()
    N = self.numel()
    if N == 0:
        return torch.empty((0, nd), dtype=torch.int32, device=self.device)
    coords = torch.empty((N, max(nd, 1)), dtype=torch.int32, device=self.device)
    for k in range(nd):   # column k: the k-th coordinate of every element (an arange broadcast by DMA)
        shape = [1] * nd
        shape[k] = self.shape[k]
        device_copy(coords[:, k].view(self.shape), arange_values(self.shape[k], self.device).reshape(shape))
    res = compact(flags.reshape(-1), coords)
    return res[:, :nd]


@lowering("nonzero")
def nonzero(self: torch.Tensor) -> torch.Tensor:
    """``torch.nonzero``: the mask scanned on the device, the count read by the host, coordinates scattered."""
    if not on_one_device(self) or self.dtype not in DATA_DTYPES or self.numel() >= 1 << 24:
        raise Unsupported("a tensor off the device, an unsupported dtype, or 2**24 elements or more")
    return to_int64(dense(_nonzero32(self)))


register_out("nonzero.out", nonzero)


@lowering("nonzero_static")
def nonzero_static(self: torch.Tensor, *, size: int, fill_value: int = -1) -> torch.Tensor:
    """``torch.nonzero_static``: the first ``size`` coordinates of ``nonzero`` (device scan and scatter), the
    remaining rows ``fill_value``."""
    if size < 0:
        raise RuntimeError("nonzero_static: 'size' must be an non-negative integer")
    if not on_one_device(self) or self.dtype not in DATA_DTYPES or self.numel() >= 1 << 24:
        raise Unsupported("several devices, an unsupported dtype, or 2**24 elements or more")
    nd = self.dim()
    res = torch.full((size, nd), fill_value, dtype=torch.int64, device=self.device)
    coords = _nonzero32(self)
    k = min(size, coords.shape[0])
    if k and nd:
        device_copy(res[:k], to_int64(dense(coords[:k])))
    return res


register_out("nonzero_static.out", nonzero_static)


@lowering("masked_select")
def masked_select(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``torch.masked_select``: the selected elements compacted on the device (one host sync for the count)."""
    if mask.dtype != torch.bool:
        raise RuntimeError("masked_select: expected BoolTensor for mask")
    if not on_one_device(self, mask) or self.dtype not in MOVE_DTYPES:
        raise Unsupported("several devices, or a dtype the DMA lacks")
    shape = broadcast_shape([mask.shape, self.shape])   # the CPU's order: its size errors name the mask "a"
    if _numel(shape) >= 1 << 24:
        raise Unsupported("2**24 elements or more")
    x = dense(self.expand(shape)).reshape(-1, 1)
    if x.element_size() == 8:                # int64/float64 elements move as rows of two int32 words
        x = x.view(torch.int32)
    res = compact(dense(mask.expand(shape)).reshape(-1), x).reshape(-1)
    return dense(res.view(self.dtype))


register_out("masked_select.out", masked_select)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- advanced indexing: index.Tensor, index_put_ ------------------------------------------------

def _expand_masks(self: torch.Tensor, indices: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Index tensors as int32 (bool/uint8 masks become their nonzero coordinates, one tensor per dim),
    with the CPU's errors for masks of the wrong shape."""
    out: list[torch.Tensor | None] = []
    for i in indices:
        if i is None:
            out.append(None)
            continue
        if i.dtype in (torch.bool, torch.uint8):
            k = len(out)
            for j in range(i.dim()):
                if k + j >= self.dim() or i.shape[j] != self.shape[k + j]:
                    raise IndexError(f"The shape of the mask {list(i.shape)} at index {j} does not match the shape of "
                                     f"the indexed tensor {list(self.shape)} at index {k + j}")
            coords = _nonzero32(i)
            out.extend(dense(coords[:, j]) for j in range(i.dim()))
        elif i.dtype in INDEX_DTYPES:
            out.append(index_int32(i))
        else:
            raise Unsupported
    return out


def _row_numbers(self: torch.Tensor, idx: list[torch.Tensor | None], op: Any, args: tuple):
    """(indexed dims, their broadcast index shape B, int32 flat row numbers [n] over the indexed dims)."""
    dims = [k for k, i in enumerate(idx) if i is not None]
    B = torch.broadcast_shapes(*(idx[k].shape for k in dims))
    flat = None
    for k in dims:
        S = self.shape[k]
        if any_outside(idx[k], -S, S):
            raise_like_cpu(op, *args, with_data=True)
        w = run_pointwise(_wrap, [idx[k], S], KIND.DEFAULT, op="aten::index")
        flat = w if flat is None else run_pointwise(_fma, [flat, w, S], KIND.DEFAULT, op="aten::index")
    return dims, tuple(B), dense(flat.expand(B)).reshape(-1)


def _layout(self: torch.Tensor, dims: list[int], B: tuple):
    """(permutation putting the indexed dims first, the shape in that order, where B lands in the result)."""
    others = [k for k in range(self.dim()) if k not in dims]
    perm = dims + others
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    at = dims[0] if adjacent else 0
    return perm, others, at


@lowering("index.Tensor")
def index(self: torch.Tensor, indices: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Advanced indexing ``x[idx]``: indexed dims flattened to row numbers, rows gathered by indirect DMA."""
    if not on_one_device(self, *indices) or self.dtype not in MOVE_DTYPES or self.dim() == 0:
        raise Unsupported
    if len(indices) > self.dim():   # (the CPU's error, before the fast path looks at the indices)
        aten.index.Tensor(meta_twin(self), meta_twin(list(indices)))
    fast = index_rows_launch(self, indices, True, aten.index.Tensor, (self, indices))
    res_meta = None
    masked = None if fast is not None else mask_rows_launch(self, indices)
    if fast is not None:   # integer indices: one launch (8-byte elements move as int32 word pairs)
        dims, B, got = fast
    elif masked is not None:   # one bool mask over leading dims: two launches
        return masked[1]
    elif self.dtype not in DATA_DTYPES:
        raise Unsupported
    else:
        idx = _expand_masks(self, indices)
        if not any(i is not None for i in idx):
            raise Unsupported
        res_meta = aten.index.Tensor(meta_twin(self), meta_twin(idx))
        dims, B, rows = _row_numbers(self, idx + [None] * (self.dim() - len(idx)), aten.index.Tensor,
                                     (self, indices))
        if rows.numel() == 0 or self.numel() == 0:
            return torch.empty(res_meta.shape, dtype=self.dtype, device=self.device)
        V = _numel(self.shape[k] for k in dims)
        table = dense(self.permute(_layout(self, dims, B)[0])).reshape(V, -1)
        (got,) = call_kernel(gather_rows, {"table": table, "index": rows}, {"stride": 1}, op="aten::index")
    perm, others, at = _layout(self, dims, B)
    res = got.reshape(*B, *(self.shape[k] for k in others))
    if at:
        nb = len(B)
        order = list(range(nb, nb + at)) + list(range(nb)) + list(range(nb + at, res.dim()))
        res = dense(res.permute(order))
    assert res_meta is None or tuple(res.shape) == tuple(res_meta.shape), (res.shape, res_meta.shape)
    return res


register_out("index.Tensor_out", index, warn_resize=False)   # the CPU kernel resizes quietly


def _put(self: torch.Tensor, indices: Sequence[torch.Tensor | None], values: torch.Tensor, accumulate: bool,
         check: tuple) -> None:
    """``self[indices] = values`` (``+=`` when ``accumulate``) in place on the device."""
    if values.dtype != self.dtype:
        raise RuntimeError(f"Index put requires the source and destination dtypes match, got "
                           f"{type_name(self.dtype)} for the destination and {type_name(values.dtype)} for the "
                           "source.")
    ind = list(indices)
    moves_only = self.dtype not in DATA_DTYPES   # 8-byte elements: only the row-number path moves them
    # x[mask] = scalar: a select, no sync
    if (not accumulate and not moves_only and len(ind) == 1 and ind[0] is not None and ind[0].dtype == torch.bool
            and values.numel() == 1 and tuple(ind[0].shape) == tuple(self.shape[:ind[0].dim()])):
        mask = ind[0].reshape(*ind[0].shape, *([1] * (self.dim() - ind[0].dim())))
        run_pointwise(tm.where, [mask, values.reshape(()), self], KIND.NO_OPMATH, self, True, self.dtype,
                      op="aten::index_put_")
        return
    # integer indices keep their dtype until ``index_rows_launch`` (no conversion launch); masks expand here
    integer = not accumulate and all(i is None or i.dtype in (torch.int32, torch.int64) for i in ind)
    if moves_only and not integer and not (accumulate and self.dtype == torch.int64):
        raise Unsupported
    idx = ind if integer else _expand_masks(self, ind)
    if not any(i is not None for i in idx):
        raise Unsupported
    res_meta = aten.index.Tensor(meta_twin(self), meta_twin(idx))
    try:
        vshape = torch.broadcast_shapes(values.shape, res_meta.shape)
        assert tuple(vshape) == tuple(res_meta.shape)
    except (RuntimeError, AssertionError):
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                           f"indexing result of shape {list(res_meta.shape)}") from None
    fast = index_rows_launch(self, ind, False, *check) if integer else None
    if fast is not None:   # integer indices into leading dims: the row numbers in one launch
        dims, B, rows = fast
    elif moves_only and not accumulate:
        raise Unsupported
    else:
        idx = _expand_masks(self, ind) if integer else idx
        dims, B, rows = _row_numbers(self, idx + [None] * (self.dim() - len(idx)), *check)
    if rows.numel() == 0 or self.numel() == 0:
        return
    perm, others, at = _layout(self, dims, B)
    vals = values.expand(res_meta.shape)
    if at:  # the result has B at position ``at``: bring it first, like the rows
        nb = len(B)
        order = list(range(at, at + nb)) + list(range(at)) + list(range(at + nb, vals.dim()))
        vals = vals.permute(order)
    n = rows.numel()
    view = self.permute(perm)
    V = _numel(self.shape[k] for k in dims)
    block = dense(view)
    table = block.reshape(V, -1)
    v2 = dense(vals).reshape(n, -1)
    if not accumulate:
        scatter_into(table, rows, v2)
    else:
        if V * n > ONEHOT_LIMIT or self.dtype not in (DATA_DTYPES - {torch.bool}) | {torch.int64}:
            raise Unsupported
        onehot = run_pointwise(match_tile, [arange_values(V, self.device).reshape(V, 1), rows.reshape(1, n)], KIND.DEFAULT,
                               result_dtype=torch.float32, op="aten::index_put_")
        new = table.to(accumulate_dtype(self.dtype)) + _onehot_sums(onehot, v2, self.dtype)
        block = new.to(self.dtype).reshape(view.shape)
    _write(self, view, block)


@lowering("_index_put_impl_")
def index_put_impl_(self: torch.Tensor, indices: Sequence[torch.Tensor | None], values: torch.Tensor,
                    accumulate: bool = False, unsafe: bool = False) -> torch.Tensor:
    """``self[indices] = values`` / ``index_put_(..., accumulate=True)``: row scatter or one-hot matmul."""
    if not on_one_device(self, values, *indices) or self.dtype not in MOVE_DTYPES or self.dim() == 0:
        raise Unsupported
    _put(self, indices, values, accumulate, (aten.index_put.default, (self, indices, values, accumulate)))
    return self


# ---- masks: masked_fill_, masked_scatter_ ---------------------------------------------------------

def _masked_fill(name: str) -> None:
    def kernel(self: torch.Tensor, mask: torch.Tensor, value: Any) -> torch.Tensor:
        """``self.masked_fill_(mask, value)``: an exact select on the device."""
        if mask.dtype != torch.bool:
            raise RuntimeError(f"masked_fill_ only supports boolean masks, but got mask with dtype {mask.dtype}"
                               .replace("torch.", "").replace("int32", "int").replace("int64", "long"))
        if isinstance(value, torch.Tensor):
            if value.dim() != 0:
                raise RuntimeError("masked_fill_ only supports a 0-dimensional value tensor, but got tensor with "
                                   f"{value.dim()} dimension(s).")
            if value.device.type == "cpu":
                value = value.item()
        tensors = [self, mask] + ([value] if isinstance(value, torch.Tensor) else [])
        if not on_one_device(*tensors) or self.dtype not in MOVE_DTYPES:
            raise Unsupported("tensors on more than one device, or a dtype the select lacks")
        shape = broadcast_shape([self.shape, mask.shape])
        if tuple(shape) != tuple(self.shape):
            raise RuntimeError(f"output with shape {list(self.shape)} doesn't match the broadcast shape {list(shape)}")
        if isinstance(value, torch.Tensor) and value.dtype != self.dtype:
            if self.dtype not in DATA_DTYPES:
                raise Unsupported("a value tensor of another dtype into 8-byte elements")
        elif not isinstance(value, torch.Tensor):
            # the CPU's scalar conversion (overflow errors, int truncation), on a one-element host tensor
            value = torch.zeros(1, dtype=self.dtype).masked_fill_(torch.ones(1, dtype=torch.bool), value)
            value = value if self.dtype not in DATA_DTYPES else value.item()
        if not self.numel():
            return self
        if self.dtype in DATA_DTYPES:
            run_pointwise(tm.where, [mask, value, self], KIND.NO_OPMATH, self, True, self.dtype,
                          op="aten::masked_fill_")
        else:
            _masked_fill_words(self, mask, value)
        return self
    lowering(name)(kernel)


def _masked_fill_words(self: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> None:
    """masked_fill_ of 8-byte elements (int64, float64) as a select of their int32 word pairs: exact bits."""
    flat = self.reshape(1) if self.dim() == 0 else self
    # a view's words are adjacent only when its last dim is dense: else a dense copy, written back
    work = flat if flat.stride(-1) == 1 else dense(flat)
    words = work.view(torch.int32).unflatten(-1, (work.shape[-1], 2))
    # the value's two words, on the device (a one-element host tensor is copied there)
    pair = value.reshape(1).to(self.device).view(torch.int32)
    run_pointwise(tm.where, [mask.unsqueeze(-1), pair, words], KIND.NO_OPMATH, words, True, torch.int32,
                  op="aten::masked_fill_")
    if work is not flat:
        device_copy(flat, work)


_masked_fill("masked_fill_.Scalar")
_masked_fill("masked_fill_.Tensor")


@lowering("masked_scatter_")
def masked_scatter_(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``self.masked_scatter_(mask, source)``: the masked positions (compacted on the device) take the
    leading elements of ``source`` by row scatter."""
    if mask.dtype != torch.bool:   # the CPU's check, before its device checks
        raise RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with dtype "
                           f"{type_name(mask.dtype)}")
    if not on_one_device(self, mask, source) or self.dtype not in DATA_DTYPES or mask.dtype != torch.bool \
            or source.dtype != self.dtype:
        raise Unsupported
    aten.masked_scatter_(meta_twin(self), meta_twin(mask), meta_twin(source))
    if self.numel() == 0:
        return self
    m = dense(mask.expand(self.shape)).reshape(-1)
    N = m.numel()
    positions = compact(m, arange_values(N, self.device).reshape(N, 1)).reshape(-1)
    n = positions.numel()
    if source.numel() < n:
        raise RuntimeError("Number of elements of source < number of ones in mask")
    if n:
        block = dense(self)
        scatter_into(block, positions, dense(source).reshape(-1)[:n].reshape(n, 1))
        _write(self, self, block)
    return self
