"""Indexing and shape ops on the device: ``index_select`` (so ``embedding``), its backward,
``arange``, ``tril``/``triu``, ``cat`` and ``flip``.

- ``index_select`` gathers rows by indirect DMA (``kernels.indexing.gather_rows``); another dim
  is moved first. int64 indices are read as the low words of their int32 pairs.
- ``embedding_dense_backward`` sums gradient rows per index as a one-hot matrix product on
  TensorE: ``onehot(indices)^T @ grad`` (fp32 accumulation, rows summed in index order, as the
  CPU kernel does); the one-hot matrix is built from the row numbers (a table uploaded once) and a comparison.
- ``arange`` is GpSimd's iota then ``start + i * step`` element-wise (int64 results widened); into a contiguous
  int32 result, or an int64 one of non-negative values (position ids), it is one iota of that start and step (int64:
  writing the word pairs); not the row-number table: a user's ``arange`` allocates its result and nothing kept
  (``memory_allocated`` counts only what they made).
- ``tril``/``triu`` keep elements by comparing column - row with the diagonal (from the row numbers).
- ``select_backward``/``slice_backward`` (the gradient of ``x[:, -1]``, of a fused projection's q/k/v): zeros with
  the gradient in its slice, as one launch copying the gradient and zero-filling the rest around it.
- ``cat`` copies each input into its slice of the output with the strided DMA kernel.
- ``flip`` gathers rows in reversed order along each flipped dim.
- ``index_rows_launch``: the one-launch core of advanced indexing by integer index tensors
  (``x[idx]``, ``x[i, j] = v``; the lowerings are in ``ops/scatter.py``): wrapping, bounds and the
  int64 words checked, the dims combined into flat rows and the rows gathered, by one kernel.
  ``mask_rows_launch``: ``x[mask]`` in two launches (a scan ranks the set elements, the host reads
  the count, one kernel moves the selected rows).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import canonicalize_dim

from torchneuron.kernels.indexing import (ONEHOT_LIMIT, ONEHOT_PRODUCT_ROWS, gather_rows, index_rows, iota, mask_rows,
                                         MAX_INDEX_DIMS, onehot_product, onehot_rows)
from torchneuron.kernels.scan import scan_rows
import torchneuron.nki.language as nl
from torchneuron.kernels import tilemath as tm
from torchneuron.ops.base import (aten, DEVICE_DTYPES, FLOATS, raise_like_cpu, type_name,
                                   Unsupported)
from torchneuron.ops.elementwise import can_copy, copy_parts, dense, device_copy, run_pointwise
from torchneuron.ops.kernel_call import call_kernel, PlanCache, scalar_operand
from torchneuron.ops.registry import lowering, register_out


def index_words(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous int index as int32 words and the stride between its values (2 for int64)."""
    index = dense(index.reshape(-1))
    if index.dtype == torch.int64:
        return index.view(torch.int32), 2
    if index.dtype != torch.int32:
        index = index.to(torch.int32)
    return index, 1


def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of a 2-D table; IndexError like PyTorch's for an index out of range."""
    words, stride = index_words(index)
    try:
        (rows,) = call_kernel(gather_rows, {"table": dense(table), "index": words}, {"stride": stride},
                              op="aten::index_select")
    except IndexError:   # the launch's error for an index outside the table, in the CPU's words
        raise IndexError("index out of range in self") from None
    return rows


@lowering("index_select")
def index_select(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``self.index_select(dim, index)`` by indirect-DMA row gathers."""
    ok = (self.device.type == "neuron" and index.device == self.device and can_copy(self, self)
          and self.dtype in DEVICE_DTYPES and index.dtype in (torch.int32, torch.int64) and index.dim() <= 1
          and (self.numel() > 0 or self.dim() > 0))
    if not ok:
        raise Unsupported("a tensor off the device, or an unsupported dtype or index")
    d = canonicalize_dim(max(self.dim(), 1), dim)
    src = self.reshape(1) if self.dim() == 0 else self
    moved = src.movedim(d, 0)
    n = index.numel()
    if n == 0 or moved.numel() == 0:  # nothing to gather: an empty result of the gathered shape
        res = torch.empty((n, *moved.shape[1:]), dtype=self.dtype, device=self.device)
    else:
        rows = _gather(moved.reshape(moved.shape[0], -1), index)
        res = rows.reshape(n, *moved.shape[1:])
    res = res.movedim(0, d)
    if self.dim() == 0:
        res = res.reshape(())
    return res if res.is_contiguous() else dense(res)


register_out("index_select.out", index_select)


def index_rows_launch(self: torch.Tensor, indices: Sequence[torch.Tensor | None], gather: bool, op: Any,
                      args: tuple) -> tuple[list[int], tuple[int, ...], torch.Tensor] | None:
    """Advanced indexing of ``self`` by int32/int64 index tensors in one launch: (indexed dims, broadcast index
    shape B, result), the result being the gathered rows [n, rest] with the indexed dims moved first
    (``gather``) or the int32 flat row numbers [n] over those dims (then they are leading dims of a
    contiguous ``self``). None where it does not apply (masks, empty, more than 4 or over 2**24 rows:
    the caller's general path). An index out of range raises the CPU's IndexError (``op`` on ``args``)."""
    idx = list(indices) + [None] * (self.dim() - len(indices))
    dims = [k for k, i in enumerate(idx) if i is not None]
    ts = [idx[k] for k in dims]
    if not dims or len(dims) > MAX_INDEX_DIMS or any(t.dtype not in (torch.int32, torch.int64) for t in ts):
        return None
    sizes = tuple(self.shape[k] for k in dims)
    V = math.prod(sizes)
    try:
        B = tuple(torch.broadcast_shapes(*(t.shape for t in ts)))
    except RuntimeError:   # the CPU's IndexError (its message names the shapes)
        raise_like_cpu(op, *args)
    if V == 0 or V > 1 << 24 or math.prod(B) == 0 or self.numel() == 0:
        return None
    leading = dims == list(range(len(dims))) and self.is_contiguous()
    if not gather and not leading:
        return None
    others = [k for k in range(self.dim()) if k not in dims]
    table = (self if leading else dense(self.permute(dims + others))).reshape(V, -1)
    if table.element_size() == 8:   # 8-byte elements move as pairs of int32 words
        table = table.view(torch.int32)
    # each index as int32 words in B's order (int64: word pairs, read without a copy)
    words = [dense(t.expand(B)).reshape(-1).view(torch.int32) for t in ts]
    inputs = {"table": table, **{f"i{j}": w for j, w in enumerate(words)}}
    meta = {"sizes": sizes, "wide": tuple(t.dtype == torch.int64 for t in ts), "gather": gather}
    try:
        (res,) = call_kernel(index_rows, inputs, meta, op=op.name() if hasattr(op, "name") else None)
    except IndexError:   # the CPU's message, from the same call on host copies
        raise_like_cpu(op, *args, with_data=True)
    if gather and self.element_size() == 8:
        res = res.view(self.dtype)
    return dims, B, res


def mask_rows_launch(self: torch.Tensor, indices: Sequence[torch.Tensor | None]) -> tuple[int, torch.Tensor] | None:
    """``self[mask]`` for one bool mask over leading dims of a contiguous ``self``, in two launches: a scan of
    the mask ranks the set elements, the host reads the count (the result's size, one sync as on CUDA), then
    one kernel moves each selected row to its rank. (mask dims, result [count, rest]), or None where it
    does not apply (the caller's general path)."""
    if len(indices) != 1 or indices[0] is None or indices[0].dtype != torch.bool:
        return None
    mask = indices[0]
    k = mask.dim()
    V = mask.numel()
    if (k == 0 or k > self.dim() or tuple(mask.shape) != tuple(self.shape[:k]) or not self.is_contiguous()
            or V == 0 or V >= 1 << 24 or self.numel() == 0 or mask.device != self.device):
        return None
    flags = dense(mask).reshape(-1)
    (rank,) = call_kernel(scan_rows, {"x": flags.reshape(1, V)},
                          {"op": "sum", "out_dtype": torch.int32, "compute": nl.int32}, op="aten::index")
    count = int(rank[0, V - 1].item())
    table = self.reshape(V, -1)
    if table.element_size() == 8:   # 8-byte elements move as pairs of int32 words
        table = table.view(torch.int32)
    (out,) = call_kernel(mask_rows, {"table": table, "flags": flags, "rank": rank.reshape(-1)}, {"count": count},
                         op="aten::index")
    res = out[:count]
    if self.element_size() == 8:
        res = res.view(self.dtype)
    return k, res.reshape(count, *self.shape[k:])


def arange_values(n: int, device: torch.device) -> torch.Tensor:
    """int32 [0, 1, ..., n - 1] on the device (GpSimd iota)."""
    if n == 0:
        return torch.empty(0, dtype=torch.int32, device=device)
    (values,) = call_kernel(iota, {}, {"n": n}, op="aten::arange", device=device)
    return values


NUMBERS_TABLE_MAX = 1 << 16   # longest run of row numbers kept as a device table (256 KiB of int32)
# device index -> int32 [0, 1, ..., m - 1] (m a power of two): the row numbers every length up to m reads a prefix of
_NUMBER_TABLES: dict[int, torch.Tensor] = {}


def row_numbers(n: int, device: torch.device) -> torch.Tensor:
    """int32 [0, 1, ..., n - 1] on the device, to be read only: for n up to NUMBERS_TABLE_MAX the first n entries
    of the device's one table (no iota launch each call; the table, uploaded when a length first exceeds it, holds
    the next power of two: at most twice the longest run used, 256 KiB), else ``arange_values``."""
    if n > NUMBERS_TABLE_MAX:
        return arange_values(n, device)
    table = _NUMBER_TABLES.get(device.index)
    if table is None or table.numel() < n:
        rows = 1 << max(n - 1, 0).bit_length()
        table = _NUMBER_TABLES[device.index] = torch.arange(rows, dtype=torch.int32).to(device)
    return table[:n]


def _one_iota(out: torch.Tensor, first: Any, last: Any) -> bool:
    """Whether iota alone writes an integer arange from ``first`` to ``last`` into ``out``: a contiguous int32
    result, or an int64 one of values none negative (iota writes their word pairs, the high word 0)."""
    if not out.is_contiguous():
        return False
    return out.dtype == torch.int32 or (out.dtype == torch.int64 and min(first, last) >= 0)


@lowering("arange.start_out")
def arange_out(start: Any, end: Any, step: Any = 1, *, out: torch.Tensor) -> torch.Tensor:
    """``torch.arange(start, end, step, out=out)``: iota, then ``start + i * step``."""
    if out.device.type != "neuron" or not can_copy(out, out) or out.dtype.is_complex:
        raise Unsupported
    if step == 0:
        raise RuntimeError("step must be nonzero")
    if ((step > 0 and start > end) or (step < 0 and start < end)):
        raise RuntimeError("upper bound and lower bound inconsistent with step sign")
    if out.dtype == torch.bool or (out.dtype.is_floating_point and out.dtype not in DEVICE_DTYPES):
        raise Unsupported
    n = max(0, math.ceil((float(end) - float(start)) / float(step)))
    if not out.dtype.is_floating_point:
        # integer results: start and step truncated to integers first, as the CPU's kernel does
        first, delta = int(start), int(step)
        if out.dtype == torch.int64:   # whose length comes from the truncated integers too
            if delta == 0:
                raise ValueError("step must be nonzero")
            span = int(end) - first + delta - (1 if delta > 0 else -1)
            n = max(0, abs(span) // abs(delta) if (span >= 0) == (delta > 0) else 0)
        info = torch.iinfo(out.dtype)
        lo, hi = sorted((first, first + (max(n, 1) - 1) * delta))
        if lo < max(info.min, -2 ** 24) or hi > min(info.max, 2 ** 24):   # exact in the fp32 lanes, no wrapping
            raise Unsupported
        start, step = first, delta
    if tuple(out.shape) != (n,):
        out.resize_(n)
    if n == 0:
        return out
    if _one_iota(out, start, start + (n - 1) * step):
        # start, start + step, ... as int32, or as int64 (position ids) when none is negative: iota writes them
        # (int64: the word pairs) itself, one launch, no element-wise step nor widening
        wide = out.dtype == torch.int64
        call_kernel(iota, {}, {"n": n, "start": start, "step": step, "wide": wide},
                    [out.view(torch.int32) if wide else out], op="aten::arange", device=out.device)
        return out
    i = arange_values(n, out.device)
    if not out.dtype.is_floating_point:
        vals = run_pointwise(tm.add_scaled, [start, i, step], KIND.DEFAULT, op="aten::arange") \
            if (start, step) != (0, 1) else i
        device_copy(out, vals)
        return out
    run_pointwise(tm.add_scaled, [float(start), i, float(step)], KIND.DEFAULT, out, op="aten::arange")
    return out


def _triangle(name: str, lower: bool) -> None:
    packet = name.partition(".")[0]

    def kernel(self: torch.Tensor, diagonal: int = 0) -> torch.Tensor:
        inplace = packet.endswith("_")
        if self.dim() < 2:
            raise RuntimeError(f"{packet.rstrip('_')}: input tensor must have at least 2 dimensions")
        if self.dtype not in DEVICE_DTYPES or self.numel() == 0:
            raise Unsupported("a dtype the device lacks, or an empty input")
        M, N = self.shape[-2], self.shape[-1]
        rows = row_numbers(M, self.device).reshape(M, 1)
        cols = row_numbers(N, self.device).reshape(1, N)
        keep = run_pointwise(tm.tri_keep_lower if lower else tm.tri_keep_upper, [cols, rows, diagonal],
                             KIND.ALWAYS_BOOL, result_dtype=torch.bool, op=f"aten::{packet}")
        zero = False if self.dtype == torch.bool else 0
        return run_pointwise(tm.where, [keep, self, zero], KIND.NO_OPMATH, self if inplace else None, inplace,
                             self.dtype, op=f"aten::{packet}")
    kernel.__name__ = kernel.__qualname__ = packet
    lowering(name)(kernel)
    if not packet.endswith("_"):
        register_out(f"{packet}.out", kernel)


for _name, _lower in (("tril", True), ("tril_", True), ("triu", False), ("triu_", False)):
    _triangle(_name, _lower)


@lowering("embedding_dense_backward")
def embedding_dense_backward(grad_output: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool) -> torch.Tensor:
    """Per-row sums of ``grad_output`` by index: ``onehot(indices)^T @ grad`` on TensorE, in one launch for tables
    of up to ONEHOT_PRODUCT_ROWS rows (the one-hot blocks never in HBM; bit for bit the two launches' product)."""
    D = grad_output.shape[-1]
    n = indices.numel()
    if (scale_grad_by_freq or grad_output.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or num_weights * n > ONEHOT_LIMIT or n == 0 or indices.dtype not in (torch.int32, torch.int64)):
        raise Unsupported
    words, stride = index_words(indices)
    meta = {"rows": num_weights, "stride": stride, "padding_idx": padding_idx}
    if num_weights <= ONEHOT_PRODUCT_ROWS:   # one launch: the one-hot blocks built in SBUF, multiplied there
        (grad,) = call_kernel(onehot_product, {"index": words, "grad": dense(grad_output.reshape(n, D))}, meta,
                              op="aten::embedding_dense_backward")
        return grad
    (onehot,) = call_kernel(onehot_rows, {"index": words}, {**meta, "out_dtype": grad_output.dtype},
                            op="aten::embedding_dense_backward")
    return onehot @ grad_output.reshape(n, D)


# (device, dtype, dim, the inputs' shapes) -> the plan of a call whose inputs are contiguous, non-empty and of one
# dtype (operand 0: the result, i + 1: input i; extra: the result's shape): a repeated cat (``torch.stack`` of the
# per-tensor norms in ``clip_grad_norm_``) launches its traced program without the checks, views and spans
# (~12 us an input)
_CAT_PLANS = PlanCache()


def _cat_key(ts: list, dim: int) -> tuple | None:
    """``_CAT_PLANS``' key of a call, or None where its inputs are not all contiguous, non-empty neuron tensors of
    one device dtype (another, int64, moves as int32 words: its slots do not bind the tensors) on one device."""
    first = ts[0]
    device, dtype = first.device, first.dtype
    if device.type != "neuron" or dtype not in DEVICE_DTYPES:
        return None
    shapes = []
    for t in ts:
        if t.device != device or t.dtype != dtype or not t.is_contiguous() or not t.numel():
            return None
        shapes.append(tuple(t.shape))
    return device.index, dtype, dim, tuple(shapes)


@lowering("cat")
def cat(tensors: Sequence[torch.Tensor], dim: int = 0, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.cat``: each input copied into its slice of the result by strided DMAs. ``dtype``: the result's
    dtype, where it is not the inputs' promoted one (``cat.out`` writes an ``out=`` tensor's dtype: each input
    is cast into it directly, as the CPU casts it, refused where the promoted dtype cannot be cast to it)."""
    ts = list(tensors)
    key = _cat_key(ts, dim) if ts and dtype in (None, ts[0].dtype) else None
    plan = _CAT_PLANS.get(key)
    if plan is not None:   # these shapes passed the checks below before, and ran as one multi_copy launch
        out = torch.empty(plan.extra, dtype=key[1], device=ts[0].device)
        plan.launch([out, *ts], key[0], "aten::cat")
        return out
    dev = ts[0].device if ts else None
    live = [t for t in ts if not (t.dim() == 1 and t.numel() == 0)]   # legacy empty inputs are skipped
    if not ts or any(t.device != dev for t in ts) or dev.type != "neuron":
        raise Unsupported("no inputs, or inputs on more than one device")
    for i, t in enumerate(ts):     # the CPU's checks, in its order, whatever then runs the op
        if t.dim() == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")
    d = canonicalize_dim(live[0].dim(), dim) if live else dim
    promoted = ts[0].dtype
    for t in ts[1:]:
        promoted = torch.promote_types(promoted, t.dtype)
    if dtype is not None and not torch.can_cast(promoted, dtype):
        raise TypeError(f"torch.cat(): input types can't be cast to the desired output type {type_name(dtype)}")
    dtype = promoted if dtype is None else dtype
    if not live:                   # only legacy empty inputs: an empty result
        return torch.empty((0,), dtype=dtype, device=dev)
    ref = live[0].shape
    for i, t in enumerate(ts):
        if t.dim() == 1 and t.numel() == 0:
            continue
        if t.dim() != len(ref):
            raise RuntimeError(f"Tensors must have same number of dimensions: got {len(ref)} and {t.dim()}")
        for k in range(t.dim()):
            if k != d and t.shape[k] != ref[k]:
                raise RuntimeError(f"Sizes of tensors must match except in dimension {d}. Expected size {ref[k]} but "
                                   f"got size {t.shape[k]} for tensor number {i} in the list.")
    shape = list(ref)
    shape[d] = sum(t.shape[d] for t in live)
    out = torch.empty(shape, dtype=dtype, device=dev)
    if any(not can_copy(out, t) for t in live):
        # the result is already allocated and sized: the CPU fills it
        raise Unsupported("a dtype conversion the device lacks", fallback=(aten.cat.out, (tensors, dim), {"out": out}))
    parts, o = [], 0
    for t in live:
        n = t.shape[d]
        if n:
            parts.append((out.narrow(d, o, n), t))
        o += n
    if len(parts) > 1 and all(t.dtype == out.dtype for _, t in parts):
        copied = copy_parts(parts)      # one launch for all the inputs (none when every part is empty)
        if copied is not None and key is not None and len(parts) == len(ts):
            # the result and every input are bound whole (contiguous, each part non-empty): keep the plan
            _CAT_PLANS.keep(key, copied[0], {"dst": 0, **{f"src{i}": i + 1 for i in range(len(ts))}},
                            extra=tuple(shape))
    else:
        for dst, t in parts:
            device_copy(dst, t)
    return out


# the CPU writes each input into the out= tensor cast to its dtype: the functional kernel makes the result in it
register_out("cat.out", cat, dtype_from_out=True)


# (device, dtype, sizes, dim, start, end) -> the plan (operand 0: the result, 1: the gradient, 2: the zero) of a
# contiguous gradient: a repeated select/slice backward launches its traced program without the views and spans
_AROUND_PLANS = PlanCache()


def _zeros_around(grad: torch.Tensor, sizes: Sequence[int], d: int, start: int, end: int, op: str) -> torch.Tensor:
    """Zeros of ``sizes`` holding ``grad`` at [start, end) of dim ``d``: one multi_copy launch writing the gradient
    and zeros into the parts before and after it (what ``zeros`` then ``copy_`` into the slice write, in two)."""
    out = torch.empty(sizes, dtype=grad.dtype, device=grad.device)
    zero = scalar_operand(False if grad.dtype == torch.bool else 0, grad.dtype, grad.device).view(())
    key = (grad.device.index, grad.dtype, tuple(sizes), d, start, end) if grad.is_contiguous() else None
    plan = _AROUND_PLANS.get(key)
    if plan is not None:
        plan.launch((out, grad, zero), key[0], op)
        return out
    parts = [(out.narrow(d, 0, start), 2), (out.narrow(d, start, end - start), 1),
             (out.narrow(d, end, sizes[d] - end), 2)]
    parts = [(dst, role) for dst, role in parts if dst.numel()]
    copied = copy_parts([(dst, grad.expand(dst.shape) if role == 1 else zero) for dst, role in parts], op)
    if copied is not None and key is not None and tuple(grad.shape) == tuple(out.narrow(d, start, end - start).shape):
        # the result bound whole (its span starts at element 0 and covers it), the gradient as it is
        traced, inputs = copied
        if inputs["dst"].numel() == out.numel() and inputs["dst"].storage_offset() == out.storage_offset():
            _AROUND_PLANS.keep(key, traced, {"dst": 0, **{f"src{i}": role for i, (_, role) in enumerate(parts)}})
    return out


def _one_launch_embedding(grad: torch.Tensor, sizes: Sequence[int]) -> bool:
    """Whether ``_zeros_around`` can embed ``grad`` (a device dtype the copies move as they are)."""
    return grad.device.type == "neuron" and grad.dtype in DEVICE_DTYPES and len(sizes) > 0


@lowering("select_backward")
def select_backward(grad_output: torch.Tensor, input_sizes: Sequence[int], dim: int, index: int) -> torch.Tensor:
    """The gradient of ``x.select(dim, index)``: zeros of ``x``'s shape with ``grad_output`` at ``index``."""
    sizes = [int(n) for n in input_sizes]
    d = canonicalize_dim(len(sizes), dim)
    i = index + sizes[d] if index < 0 else index
    if not _one_launch_embedding(grad_output, sizes) or not 0 <= i < sizes[d]:
        out = torch.zeros(sizes, dtype=grad_output.dtype, device=grad_output.device)   # ATen's own steps
        out.select(d, index).copy_(grad_output)
        return out
    return _zeros_around(grad_output.unsqueeze(d), sizes, d, i, i + 1, "aten::select_backward")


@lowering("slice_backward")
def slice_backward(grad_output: torch.Tensor, input_sizes: Sequence[int], dim: int, start: int, end: int,
                   step: int) -> torch.Tensor:
    """The gradient of ``x[..., start:end:step, ...]``: zeros of ``x``'s shape with ``grad_output`` in the slice."""
    sizes = [int(n) for n in input_sizes]
    d = canonicalize_dim(len(sizes), dim)
    if step != 1 or not _one_launch_embedding(grad_output, sizes):
        out = torch.zeros(sizes, dtype=grad_output.dtype, device=grad_output.device)   # ATen's own steps
        out[(slice(None),) * d + (slice(start, end, step),)].copy_(grad_output)
        return out
    span = range(sizes[d])[start:end]   # the slice's bounds as ATen's slice wraps and clamps them
    return _zeros_around(grad_output, sizes, d, span.start, max(span.start, span.stop), "aten::slice_backward")


@lowering("flip")
def flip(self: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``torch.flip``: one reversed-index row gather per flipped dim."""
    ds = [canonicalize_dim(max(self.dim(), 1), d) for d in dims]
    for d in ds:
        if ds.count(d) > 1:
            raise RuntimeError(f"dim {d} appears multiple times in the list of dims")
    if self.dtype not in DEVICE_DTYPES:
        raise Unsupported("a dtype the device lacks")
    res = self
    for d in ds:
        n = self.shape[d] if self.dim() else 1
        if n > 1:
            rev = run_pointwise(tm.sub, [n - 1, arange_values(n, self.device)], KIND.DEFAULT, op="aten::flip")
            res = index_select(res, d, rev)
    res = dense(res) if res is self else res
    return res.clone() if res is self else res


register_out("flip.out", flip)


@lowering("embedding_renorm_")
def embedding_renorm_(self: torch.Tensor, indices: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
    """Rescale the rows ``indices`` of ``self`` whose ``norm_type``-norm exceeds ``max_norm`` (in place),
    as the CPU kernel does: ``scale = max_norm / (norm + 1e-7)``."""
    if self.dtype not in (torch.float32, torch.bfloat16, torch.float16) or self.dim() != 2 or \
            indices.device != self.device or indices.dtype not in (torch.int32, torch.int64):
        raise Unsupported
    if indices.numel() == 0:
        return self
    idx = indices.reshape(-1)
    rows = index_select(self, 0, idx)
    # the CPU takes each row's norm in the row's dtype and multiplies the row by a scale in its dtype (a
    # bf16/fp16 norm and scale rounded; from fp32 values, fp16 rows came out a unit off)
    norms = torch.linalg.vector_norm(rows.float(), norm_type, dim=1, keepdim=True).to(self.dtype).float()
    scale = torch.where(norms > max_norm, (max_norm / (norms + 1e-7)).to(self.dtype).float(), 1.0)
    self.index_copy_(0, idx, (rows.float() * scale).to(self.dtype))
    return self


@lowering("_embedding_bag_forward_only", "_embedding_bag")   # (autograd's forward: the same outputs)
def embedding_bag_forward_only(weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                               scale_grad_by_freq: bool = False, mode: int = 0, sparse: bool = False,
                               per_sample_weights: torch.Tensor | None = None, include_last_offset: bool = False,
                               padding_idx: int = -1):
    """Sum / mean bags of embedding rows (inference): a row gather, then ``onehot(bag)^T``-style sums on
    TensorE; ``max`` bags: the rows outside a bag masked to -inf, then amax / argmax over the bag's rows. The
    bag boundaries are read on the host (one sync). Returns (output, offset2bag, bag_size, max_indices) shaped
    as the CPU kernel's."""
    ok = (mode in (0, 1, 2) and weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
          and indices.dim() == 1 and offsets.dim() == 1 and indices.device == weight.device == offsets.device
          and (per_sample_weights is None or per_sample_weights.device == weight.device))
    if not ok:
        raise Unsupported("an unsupported mode, shape or dtype, or inputs on more than one device")
    # the CPU's argument checks (index range, offsets order ...) on host copies of the small integer inputs
    idx_cpu, off_cpu = indices.cpu(), offsets.cpu()
    aten._embedding_bag_forward_only(torch.zeros((weight.shape[0], 1), dtype=weight.dtype), idx_cpu, off_cpu,
                                     scale_grad_by_freq, mode,
                                     sparse, None if per_sample_weights is None else per_sample_weights.cpu(),
                                     include_last_offset, padding_idx)
    n, D = indices.numel(), weight.shape[1]
    starts = off_cpu[:-1] if include_last_offset else off_cpu
    B = starts.numel()
    bag = torch.bucketize(torch.arange(n), starts, right=True) - 1          # the bag of each index
    keep = idx_cpu != padding_idx if padding_idx >= 0 else torch.ones(n, dtype=torch.bool)
    counts = torch.zeros(B, dtype=torch.int64).index_add_(0, bag[keep], torch.ones(int(keep.sum()), dtype=torch.int64))
    onehot = torch.zeros(B, n, dtype=torch.float32)
    if n:
        onehot[bag[keep], torch.arange(n)[keep]] = 1.0
    if B * n * D > ONEHOT_LIMIT // 4 and mode == 2:
        raise Unsupported("max bags beyond the one-hot limit")
    dev = weight.device
    if mode == 2:
        return _embedding_bag_max(weight, indices, onehot, bag, counts)
    rows = _gather(weight, indices) if n else torch.empty((0, D), dtype=weight.dtype, device=weight.device)
    rows = rows.float()
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.float().reshape(n, 1)
    if not n:
        out = torch.zeros((B, D), dtype=torch.float32, device=dev)
    elif B * n * D <= ONEHOT_LIMIT // 4:
        # a masked sum: a NaN or inf row reaches only its own bags (0 * inf in a matmul would reach them all)
        out = torch.where(onehot.to(dev).reshape(B, n, 1) > 0, rows.reshape(1, n, D), 0.0).sum(1)
    else:
        out = onehot.to(dev) @ rows
    if mode == 1:
        out = out / counts.clamp(min=1).to(torch.float32).to(dev).reshape(B, 1)
    out = out.to(weight.dtype)
    if mode == 0:   # (the CPU fills offset2bag only when it needed it for padding)
        extra = off_cpu.numel()
        o2b = bag.to(dev) if padding_idx >= 0 else torch.empty(0, dtype=torch.int64, device=dev)
        return out, o2b, torch.zeros(extra, dtype=torch.int64, device=dev), \
            torch.zeros(extra, dtype=torch.int64, device=dev)
    return out, bag.to(dev), counts.to(dev), counts.to(dev)


def _embedding_bag_max(weight: torch.Tensor, indices: torch.Tensor, member: torch.Tensor, bag: torch.Tensor,
                       counts: torch.Tensor):
    """``max`` bags: per bag and column the largest row value (NaN wins, ties to the first row, as the CPU
    kernel scans) and the embedding index it came from; empty bags give 0 and index 0. ``member``: the
    host-built [B, n] 0/1 matrix of the rows each bag takes (padding left out); ``bag``, ``counts``: host
    offset2bag and bag sizes."""
    dev = weight.device
    B, n = member.shape
    D = weight.shape[1]
    if n == 0:
        zeros = torch.zeros((B, D), dtype=torch.int64, device=dev)
        return torch.zeros((B, D), dtype=weight.dtype, device=dev), bag.to(dev), counts.to(dev), zeros
    rows = _gather(weight, indices)
    inside = (member.to(dev) > 0).reshape(B, n, 1)
    masked = torch.where(inside, rows.reshape(1, n, D), float("-inf"))
    filled = (counts > 0).to(dev).reshape(B, 1)
    out = torch.where(filled, masked.amax(1), 0).to(weight.dtype)
    pos = masked.argmax(1)                                   # [B, D] positions in ``indices``
    words, stride = index_words(indices)
    idx32 = words if stride == 1 else dense(words.view(n, 2)[:, 0])
    which = torch.where(filled, torch.take(idx32, pos), 0).to(torch.int64)
    return out, bag.to(dev), counts.to(dev), which


def _bags(offset2bag: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """The bag of each of the ``n`` indices: ``offset2bag``, or, where the forward left it empty (sum mode),
    rebuilt from the offsets (host ints) as the CPU does: ones at the bag starts, cumulated."""
    if offset2bag.numel() == n:
        return offset2bag
    marks = torch.zeros(n + 1, dtype=torch.int64).index_add_(0, offsets.cpu(),
                                                             torch.ones(offsets.numel(), dtype=torch.int64))
    marks[0] -= 1
    return marks.cumsum(0)[:n].to(offsets.device)


@lowering("_embedding_bag_backward")
def embedding_bag_backward(grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, offset2bag: torch.Tensor,
                           bag_size: torch.Tensor, maximum_indices: torch.Tensor, num_weights: int,
                           scale_grad_by_freq: bool, mode: int, sparse: bool,
                           per_sample_weights: torch.Tensor | None = None, padding_idx: int = -1) -> torch.Tensor:
    """The dense weight gradient of ``embedding_bag``, as the CPU kernel forms it: sum/mean bags add each
    member's bag gradient (times its sample weight, over the bag size for mean) into its row; max bags add
    each column's gradient into the row that gave the maximum. The bag of each index is rebuilt on the host
    from the offsets when the forward left it empty (sum mode), as the CPU does."""
    ok = (not sparse and not scale_grad_by_freq and mode in (0, 1, 2) and grad.dim() == 2
          and grad.dtype in (torch.float32, torch.bfloat16, torch.float16) and indices.dim() == 1
          and all(t.device == grad.device for t in (indices, offsets, offset2bag, bag_size, maximum_indices))
          and (per_sample_weights is None or per_sample_weights.device == grad.device))
    if not ok:
        raise Unsupported("sparse or frequency-scaled gradients, an unsupported mode or dtype, or several devices")
    n, D = indices.numel(), grad.shape[1]
    out = torch.zeros((num_weights, D), dtype=torch.float32, device=grad.device)
    if n == 0 or grad.shape[0] == 0:
        return out.to(grad.dtype)
    g = grad.float()
    if mode == 2:                                   # max: column d of bag b goes to row maximum_indices[b, d]
        filled = (bag_size > 0).reshape(-1, 1)
        flat = (maximum_indices * D + torch.arange(D, device=grad.device)).reshape(-1)
        out.view(-1).index_add_(0, flat, torch.where(filled, g, 0.0).reshape(-1))
        return out.to(grad.dtype)
    bag = _bags(offset2bag, offsets, n)
    rows = g.index_select(0, bag)
    if mode == 1:
        rows = rows / bag_size.float().clamp(min=1).index_select(0, bag).reshape(n, 1)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.float().reshape(n, 1)
    if padding_idx >= 0:
        rows = torch.where((indices != padding_idx).reshape(n, 1), rows, 0.0)
    out.index_add_(0, indices, rows)
    return out.to(grad.dtype)


@lowering("_embedding_bag_per_sample_weights_backward")
def embedding_bag_per_sample_weights_backward(grad: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor,
                                              offsets: torch.Tensor, offset2bag: torch.Tensor, mode: int,
                                              padding_idx: int = -1) -> torch.Tensor:
    """d loss / d per_sample_weights (sum mode): each member's bag gradient dotted with its embedding row."""
    if mode != 0 or grad.dim() != 2 or any(t.device != grad.device for t in (weight, indices, offsets, offset2bag)) \
            or grad.dtype not in FLOATS or weight.dtype not in FLOATS:
        # (float64 computed in fp32 lost half its digits: the CPU computes it)
        raise Unsupported("a mode other than sum, inputs on more than one device, or a dtype beyond fp32")
    n = indices.numel()
    bag = _bags(offset2bag, offsets, n)
    dots = (grad.float().index_select(0, bag) * weight.float().index_select(0, indices)).sum(1)
    if padding_idx >= 0:
        dots = torch.where(indices != padding_idx, dots, 0.0)
    return dots.to(grad.dtype).reshape(n)
