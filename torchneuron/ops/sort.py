"""Scans and sorts on the device: ``cumsum``, ``cumprod``, ``sort`` (stable), ``topk``, ``kthvalue``
(hence ``argsort``, ``msort``).

- Scans move the dim last and run ``kernels.scan.scan_rows`` (VectorE ``tensor_tensor_scan``, fp32
  for floats, int32 for integers; integer inputs give int64 results like the CPU, widened on the
  device). Their backward ops come from autograd's formulas over lowered ops (flip, cumsum, ...).
- Sorts are a stable rank sort: with the dim last as rows [L, n], element i of a row goes to position
  ``rank[i] = #{j : x[j] before x[i]}``, where "before" is ``x[j] < x[i]`` (``>`` descending), or equal
  with ``j < i`` (the stable tie order), NaN after every number (before, descending) like the CPU.
  The [L*n, n] comparison is one element-wise launch, the count one reduction, and values and
  indices are scattered to their ranks by indirect DMA. ``topk``/``kthvalue`` take the leading
  slice / the (k-1)-th column of that sort (values exact; tie indices in stable order).
  Work is O(L n^2): rows up to ``SORT_LIMIT`` comparisons run on the device, larger ones fall back.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import canonicalize_dim

import torchneuron.nki.language as nl
from torchneuron.kernels.scan import scan_rows
from torchneuron.ops.copy import to_int64
from torchneuron.ops.indexing import arange_values
from torchneuron.ops.kernel_call import call_kernel, dense
from torchneuron.ops.pointwise import run_pointwise
from torchneuron.ops.registry import Unsupported, cpu_fallback, lowering
from torchneuron.ops.scatter import DATA_DTYPES, _into, check_out, _meta, _on_device, _overload, _scatter_into

aten = torch.ops.aten
SORT_LIMIT = 1 << 24       # comparisons (L * n * n) of one device sort
INTS = (torch.bool, torch.int8, torch.int16, torch.int32, torch.uint8)


# ---- scans --------------------------------------------------------------------------------------

def _scan(self: torch.Tensor, dim: int, op: str, dtype: torch.dtype | None) -> torch.Tensor:
    """Cumulative ``op`` along ``dim`` in the result dtype PyTorch picks (ints -> int64)."""
    result = dtype or (torch.int64 if self.dtype in INTS else self.dtype)
    if self.dtype not in DATA_DTYPES or result not in DATA_DTYPES | {torch.int64}:
        raise Unsupported
    d = canonicalize_dim(max(self.dim(), 1), dim)
    if self.numel() == 0:
        return torch.empty(self.shape, dtype=result, device=self.device)
    x = self.reshape(1) if self.dim() == 0 else self
    if x.dtype != result and result.is_floating_point:   # dtype= casts the input before the scan, as the CPU
        x = x.to(result)
    moved = dense(x.movedim(d, -1))
    n = moved.shape[-1]
    integer = not result.is_floating_point
    (res,) = call_kernel(scan_rows, {"x": moved.reshape(-1, n)},
                         {"op": op, "out_dtype": torch.int32 if result == torch.int64 else result,
                          "compute": nl.int32 if integer else nl.float32}, op=f"aten::cum{op}")
    if result == torch.int64:
        res = to_int64(res)
    res = res.reshape(moved.shape).movedim(-1, d)
    return dense(res).reshape(self.shape)


def _scan_lowering(name: str, op: str) -> None:
    overload = _overload(name)
    inplace = name.split(".")[0].endswith("_")

    def kernel(self: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None):
        try:
            if not _on_device(self, out):
                raise Unsupported
            if inplace:
                dtype = dtype or self.dtype
            elif out is not None:
                dtype = dtype or out.dtype
            res = _scan(self, dim, op, dtype)
            return _into(res, self if inplace else out)
        except Unsupported:
            return cpu_fallback(overload, self, dim, dtype=dtype, **({"out": out} if out is not None else {}))
    lowering(name)(kernel)


for _name in ("cumsum", "cumsum_", "cumsum.out"):
    _scan_lowering(_name, "sum")
for _name in ("cumprod", "cumprod_", "cumprod.out"):
    _scan_lowering(_name, "prod")


# ---- sorts --------------------------------------------------------------------------------------

def _before_asc(xj, xi, jj, ii):
    """1 where element j sorts before element i (ascending, stable, NaN last)."""
    earlier = nl.less(jj, ii)
    tie = nl.logical_and(nl.equal(xj, xi), earlier)
    nan_i, nan_j = nl.not_equal(xi, xi), nl.not_equal(xj, xj)
    nan = nl.logical_and(nan_i, nl.logical_or(nl.equal(nan_j, 0), earlier))
    return nl.logical_or(nl.logical_or(nl.less(xj, xi), tie), nan)


def _before_desc(xj, xi, jj, ii):
    """1 where element j sorts before element i (descending, stable, NaN first)."""
    earlier = nl.less(jj, ii)
    tie = nl.logical_and(nl.equal(xj, xi), earlier)
    nan_i, nan_j = nl.not_equal(xi, xi), nl.not_equal(xj, xj)
    nan = nl.logical_and(nan_j, nl.logical_or(nl.equal(nan_i, 0), earlier))
    return nl.logical_or(nl.logical_or(nl.greater(xj, xi), tie), nan)


def _slot(line, rank, n):
    """The flat output position line * n + rank."""
    return nl.add(nl.multiply(line, n), rank)


def lines(x: torch.Tensor, d: int) -> tuple[torch.Tensor, int, int]:
    """``x``'s lines along dim ``d`` as a dense [L, n] tensor, with L and n; Unsupported when the all-pairs
    work (L * n * n elements) of the rank-based sorts and scans is over ``SORT_LIMIT``."""
    moved = dense(x.movedim(d, -1))
    n = moved.shape[-1]
    L = moved.numel() // n
    if L * n * n > SORT_LIMIT:
        raise Unsupported
    return moved.reshape(L, n), L, n


def _sort(self: torch.Tensor, dim: int, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 indices) of a stable sort along ``dim``."""
    if self.dtype not in DATA_DTYPES:
        raise Unsupported
    d = canonicalize_dim(max(self.dim(), 1), dim)
    if self.numel() == 0:
        return self.clone(), torch.empty(self.shape, dtype=torch.int64, device=self.device)
    x = self.reshape(1) if self.dim() == 0 else self
    rows, L, n = lines(x, d)
    key = rows.to(torch.int32) if rows.dtype == torch.bool else rows
    j = arange_values(n, self.device)
    ii = dense(j.reshape(1, n).expand(L, n)).reshape(L * n, 1)      # i of every (line, i)
    xj = dense(key.reshape(L, 1, n).expand(L, n, n)).reshape(L * n, n)   # the line's row, per i
    before = run_pointwise(_before_desc if descending else _before_asc,
                           [xj, key.reshape(L * n, 1), j.reshape(1, n), ii], KIND.DEFAULT,
                           result_dtype=torch.float32, op="aten::sort")
    rank = before.sum(-1, keepdim=True)                                # exact below 2**24
    slots = run_pointwise(_slot, [arange_values(L, self.device).reshape(L, 1), rank.reshape(L, n), n],
                          KIND.DEFAULT, op="aten::sort").to(torch.int32)
    values = torch.empty((L * n, 1), dtype=self.dtype, device=self.device)
    indices = torch.empty((L * n, 1), dtype=torch.int32, device=self.device)
    _scatter_into(values, slots, rows.reshape(L * n, 1))
    _scatter_into(indices, slots, ii)
    moved_shape = x.movedim(d, -1).shape
    back = [dense(t.reshape(moved_shape).movedim(-1, d)).reshape(self.shape) for t in (values, indices)]
    return back[0], to_int64(back[1])


@lowering("sort.stable", "sort.values_stable")
def sort(self: torch.Tensor, *, stable: bool | None = None, dim: int = -1, descending: bool = False,
         values: torch.Tensor | None = None, indices: torch.Tensor | None = None):
    """``torch.sort`` (always stable): a rank sort on the device."""
    outs = values is not None
    overload = aten.sort.values_stable if outs else aten.sort.stable
    try:
        if not _on_device(self, values, indices):
            raise Unsupported
        overload(_meta(self), stable=stable, dim=dim, descending=descending,
                 **({"values": _meta(values), "indices": _meta(indices)} if outs else {}))
        check_out(values, self)
        check_out(indices, self)
        v, i = _sort(self, dim, descending)
        if outs:
            return _into(v, values), _into(i, indices)
        return v, i
    except Unsupported:
        return cpu_fallback(overload, self, stable=stable, dim=dim, descending=descending,
                            **({"values": values, "indices": indices} if outs else {}))


@lowering("topk", "topk.values")
def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True, *,  # noqa: A002
         values: torch.Tensor | None = None, indices: torch.Tensor | None = None):
    """``torch.topk``: the leading ``k`` of a stable sort (exact values, stable tie order)."""
    outs = values is not None
    overload = aten.topk.values if outs else aten.topk.default
    kw = {"values": values, "indices": indices} if outs else {}
    try:
        if not _on_device(self, values, indices):
            raise Unsupported
        d = canonicalize_dim(max(self.dim(), 1), dim)
        if not 0 <= k <= (self.shape[d] if self.dim() else 1):
            raise RuntimeError("selected index k out of range")   # the CPU's words (the meta check's differ)
        overload(_meta(self), k, dim, largest, sorted, **{a: _meta(b) for a, b in kw.items()})
        check_out(values, self)
        check_out(indices, self)
        v, i = _sort(self, dim, largest)
        if self.dim():
            v, i = dense(v.narrow(d, 0, k)), dense(i.narrow(d, 0, k))
        if outs:
            return _into(v, values), _into(i, indices)
        return v, i
    except Unsupported:
        return cpu_fallback(overload, self, k, dim, largest, sorted, **kw)


@lowering("kthvalue.values")
def kthvalue(self: torch.Tensor, k: int, dim: int = -1, keepdim: bool = False, *, values: torch.Tensor,
             indices: torch.Tensor):
    """``torch.kthvalue``: column k - 1 of an ascending stable sort."""
    try:
        if not _on_device(self, values, indices):
            raise Unsupported
        aten.kthvalue.values(_meta(self), k, dim, keepdim, values=_meta(values), indices=_meta(indices))
        check_out(values, self)
        check_out(indices, self)
        d = canonicalize_dim(max(self.dim(), 1), dim)
        v, i = _sort(self, dim, False)
        if self.dim():
            v, i = v.narrow(d, k - 1, 1), i.narrow(d, k - 1, 1)
            if not keepdim:
                v, i = v.squeeze(d), i.squeeze(d)
        return _into(dense(v), values), _into(dense(i), indices)
    except Unsupported:
        return cpu_fallback(aten.kthvalue.values, self, k, dim, keepdim, values=values, indices=indices)
