"""Scans and sorts on the device: ``cumsum``, ``cumprod``, ``sort`` (stable), ``topk``, ``kthvalue``,
``mode`` (hence ``argsort``, ``msort``).

- Scans move the dim last and run ``kernels.scan.scan_rows`` (VectorE ``tensor_tensor_scan``, fp32
  for floats, int32 for integers; integer inputs give int64 results like the CPU, widened on the
  device). Integer sums whose partial sums could leave int32, and int64 inputs, take
  ``kernels.scan.scan_int64_rows`` (exact mod 2**64 over int32 word pairs); int products whose partial
  products could leave int32, and int64 products, are refused to the fallback. Their backward ops come from autograd's formulas over lowered ops (flip, cumsum, ...).
- Short lines (up to ``RANK_COLS``) sort by a stable rank sort: with the dim last as rows [L, n], element
  i of a row goes to position ``rank[i] = #{j : x[j] before x[i]}``, where "before" is ``x[j] < x[i]``
  (``>`` descending), or equal with ``j < i`` (the stable tie order), NaN after every number (before,
  descending) like the CPU. The [L*n, n] comparison is one element-wise launch, the count one
  reduction, and values and indices are scattered to their ranks by indirect DMA (O(L n^2) work).
- Longer lines (up to ``kernels.sort.MAX_COLS``) sort by a bitonic network in SBUF
  (``kernels.sort.bitonic_sort_rows``, O(n log^2 n)) over (key, tie) pairs: the tie is the position,
  so equal keys keep their input order (stable); floats' NaN becomes +inf with a tie past every
  number's (after them ascending, before them descending), and comes back as NaN from the tie.
  Many lines go in several launches of one program (``BITONIC_LIMIT``).
- Lines longer still (below 2**24) sort by a stable LSD radix sort (``_radix_sort``): order-preserving
  32-bit keys, ``RADIX_BITS`` per pass, each pass a counting sort by one-hot prefix counts. int64 values
  sort as two stable passes over their int32 words (``_sort_int64``).
- ``topk``/``kthvalue`` take the leading slice / the (k-1)-th column of that sort (values exact; tie
  indices in stable order; ``topk`` of lines past one bitonic sort keeps each block's leading k first);
  ``mode`` counts equal neighbours in the sorted lines.
"""
from __future__ import annotations

import math

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import canonicalize_dim

import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX
from torchneuron.kernels.scan import scan_int64_rows, scan_rows
from torchneuron.kernels.sort import MAX_COLS, bitonic_sort_rows
from torchneuron.kernels import tilemath as tm
from torchneuron.ops.base import aten, meta_twin, on_one_device, Unsupported
from torchneuron.ops.elementwise import dense, run_pointwise, to_int64, write_result
from torchneuron.ops.indexing import arange_values
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering, out_dtype_error, register_out, resize_reduced_outs
from torchneuron.ops.scatter import DATA_DTYPES, scatter_into

SORT_LIMIT = 1 << 24       # comparisons (L * n * n) of one device rank sort
RANK_COLS = 16             # longer lines take the bitonic network (faster from about there on)
BITONIC_LIMIT = 1 << 11    # compare-exchange steps (about 24 instructions each) of one bitonic launch
INTS = (torch.bool, torch.int8, torch.int16, torch.int32, torch.uint8)


# ---- scans --------------------------------------------------------------------------------------

def _scan(self: torch.Tensor, dim: int, op: str, dtype: torch.dtype | None) -> torch.Tensor:
    """Cumulative ``op`` along ``dim`` in the result dtype PyTorch picks (ints -> int64)."""
    result = dtype or (torch.int64 if self.dtype in INTS + (torch.int64,) else self.dtype)
    if self.dtype not in DATA_DTYPES | {torch.int64} or result not in DATA_DTYPES | {torch.int64}:
        raise Unsupported
    if self.dtype == torch.int64 and not (op == "sum" or result.is_floating_point):
        raise Unsupported       # int64 products have no device scan: the CPU fallback's
    d = canonicalize_dim(max(self.dim(), 1), dim)
    if self.numel() == 0:
        return torch.empty(self.shape, dtype=result, device=self.device)
    x = self.reshape(1) if self.dim() == 0 else self
    # dtype= casts the input before the scan, as the CPU; int64 to a narrower int keeps the low bits,
    # all an int scan of that width depends on
    if x.dtype != result and (result.is_floating_point or x.dtype == torch.int64):
        x = x.to(result)
    moved = dense(x.movedim(d, -1))
    n = moved.shape[-1]
    integer = not result.is_floating_point
    if result == torch.int64 and op == "sum" and (moved.dtype == torch.int64 or not _int32_sums_fit(moved)):
        # exact mod 2**64 (the CPU wraps there), no host read of the data
        wide = moved if moved.dtype == torch.int64 else to_int64(moved)
        (res,) = call_kernel(scan_int64_rows, {"x": wide.reshape(-1, n).view(torch.int32)}, op="aten::cumsum")
        res = res.view(torch.int64)
    else:
        # an int32 result wraps as the kernel's int32 tiles do; a wider or narrower one needs every
        # partial result inside int32 (else the CPU fallback, which accumulates in int64)
        if integer and result != torch.int32 and not _int32_scan_exact(moved, op):
            raise Unsupported
        (res,) = call_kernel(scan_rows, {"x": moved.reshape(-1, n)},
                             {"op": op, "out_dtype": torch.int32 if result == torch.int64 else result,
                              "compute": nl.int32 if integer else nl.float32}, op=f"aten::cum{op}")
        if result == torch.int64:
            res = to_int64(res)
    res = res.reshape(moved.shape).movedim(-1, d)
    return dense(res).reshape(self.shape)


def _int32_sums_fit(moved: torch.Tensor) -> bool:
    """Whether every partial sum of lines of ``moved``'s last dim fits int32 whatever the values (dtype bound)."""
    largest = 255 if moved.dtype == torch.uint8 else 1 << 8 * moved.element_size() - 1
    return moved.shape[-1] * largest < 1 << 31


def _int32_scan_exact(moved: torch.Tensor, op: str) -> bool:
    """Whether no partial sum/product of the integer lines (the last dim of ``moved``) can leave int32,
    so the kernel's int32 scan is exact: |partial sum| <= n * max|x|, |partial product| <= the product of
    max(|x|, 1) over the line (bounded through fp32 log2 sums, with a margin of one power of two)."""
    n = moved.shape[-1]
    if op == "sum":
        if _int32_sums_fit(moved):
            return True
        big = max(abs(int(moved.amax().item())), abs(int(moved.amin().item())))
        return n * big < 1 << 31
    logs = moved.to(torch.float32).abs().clamp_min(1.0).log2().sum(-1)
    return float(logs.amax().item()) <= 30.0


def _scan_lowering(name: str, op: str) -> None:

    def functional(self: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not on_one_device(self) or dtype == torch.bool:
            raise Unsupported("a tensor off the device, or a bool result (the CPU kernel refuses it)")
        return _scan(self, dim, op, dtype)
    functional.__name__ = functional.__qualname__ = name
    lowering(name)(functional)

    def inplace(self: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        return write_result(functional(self, dim, dtype=dtype or self.dtype), self)
    lowering(f"{name}_")(inplace)

    def out_checks(outs: list[torch.Tensor], self: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None):
        """The CPU's: the dim, then an out= unlike the dtype= given (it computes in out='s dtype otherwise)."""
        canonicalize_dim(max(self.dim(), 1), dim)
        if dtype is not None and dtype != outs[0].dtype:
            raise out_dtype_error(dtype, outs[0].dtype)
    register_out(f"{name}.out", functional, dtype_from_out=True, cast=out_checks)


_scan_lowering("cumsum", "sum")
_scan_lowering("cumprod", "prod")


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


def _rank_sort(rows: torch.Tensor, L: int, n: int, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int32 indices) [L * n, 1] of the stable rank sort of the dense lines ``rows`` [L, n]."""
    key = rows.to(torch.int32) if rows.dtype == torch.bool else rows
    j = arange_values(n, rows.device)
    ii = dense(j.reshape(1, n).expand(L, n)).reshape(L * n, 1)      # i of every (line, i)
    xj = dense(key.reshape(L, 1, n).expand(L, n, n)).reshape(L * n, n)   # the line's row, per i
    before = run_pointwise(_before_desc if descending else _before_asc,
                           [xj, key.reshape(L * n, 1), j.reshape(1, n), ii], KIND.DEFAULT,
                           result_dtype=torch.float32, op="aten::sort")
    rank = before.sum(-1, keepdim=True)                                # exact below 2**24
    slots = run_pointwise(_slot, [arange_values(L, rows.device).reshape(L, 1), rank.reshape(L, n), n],
                          KIND.DEFAULT, op="aten::sort").to(torch.int32)
    values = torch.empty((L * n, 1), dtype=rows.dtype, device=rows.device)
    indices = torch.empty((L * n, 1), dtype=torch.int32, device=rows.device)
    scatter_into(values, slots, rows.reshape(L * n, 1))
    scatter_into(indices, slots, ii)
    return values, indices


def _nan_largest(x):
    """NaN as +inf: the bitonic keys (the tie then tells NaN from inf)."""
    return tm.where_value(tm.isnan(x), math.inf, x)


def _tie_asc(x, j, m):
    """Position j, plus m for NaN: NaN after +inf, in input order."""
    return nl.add(j, nl.multiply(tm.isnan(x), m))


def _tie_desc(x, j, m):
    """Position j, plus m unless NaN: NaN before +inf (descending puts NaN first), in input order."""
    return nl.add(j, nl.multiply(nl.equal(tm.isnan(x), 0), m))


def _nan_back(v, t, m):
    """NaN again where the tie marks one (ascending: t >= m)."""
    return tm.where_value(nl.greater_equal(t, m), math.nan, v)


def _nan_back_desc(v, t, m):
    """NaN again where the tie marks one (descending: t < m)."""
    return tm.where_value(nl.less(t, m), math.nan, v)


def _bitonic_sort(rows: torch.Tensor, L: int, n: int, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int32 indices) [L, n] of a stable sort of the dense lines ``rows`` [L, n] by the bitonic
    kernel: (key, tie) pairs, floats' NaN as +inf with a tie past every number's (m = the padded width)."""
    m = 1 << max(1, (n - 1).bit_length())
    key = rows.to(torch.int32) if rows.dtype == torch.bool else rows
    if not key.is_floating_point():
        v, t = _bitonic_launches(key, None, descending)
        return (v.to(torch.bool) if rows.dtype == torch.bool else v), t
    j = arange_values(n, rows.device).reshape(1, n)
    tie = run_pointwise(_tie_desc if descending else _tie_asc, [key, j, m], KIND.DEFAULT,
                        result_dtype=torch.int32, op="aten::sort")
    key = run_pointwise(_nan_largest, [key], KIND.DEFAULT, op="aten::sort")
    v, t = _bitonic_launches(key, tie, descending)
    v = run_pointwise(_nan_back_desc if descending else _nan_back, [v, t, m], KIND.DEFAULT,
                      result_dtype=rows.dtype, op="aten::sort")
    # the position a tie encodes: its bits below m
    return v, run_pointwise(tm.bitwise_and, [t, m - 1], KIND.DEFAULT, result_dtype=torch.int32, op="aten::sort")


def _bitonic_launches(key: torch.Tensor, tie: torch.Tensor | None, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The bitonic kernel over the lines ``key`` [L, n], in launches of at most ``BITONIC_LIMIT``
    compare-exchange steps (one per (k, j) per block of 128 lines) so each program stays short to trace."""
    L, n = key.shape
    lg = max(1, (n - 1).bit_length())
    chunk = PMAX * max(1, BITONIC_LIMIT // (lg * (lg + 1) // 2))
    v = torch.empty((L, n), dtype=key.dtype, device=key.device)
    t = torch.empty((L, n), dtype=torch.int32, device=key.device)
    for r0 in range(0, L, chunk):
        r1 = min(L, r0 + chunk)
        inputs = {"key": key[r0:r1]} if tie is None else {"key": key[r0:r1], "tie": tie[r0:r1]}
        call_kernel(bitonic_sort_rows, inputs, {"descending": descending}, outputs=[v[r0:r1], t[r0:r1]],
                    op="aten::sort")
    return v, t


RADIX_BITS = 4           # key bits per pass of the radix sort (one-hot counts over 16 digits)


def _order_key(rows: torch.Tensor, descending: bool) -> torch.Tensor:
    """int32 keys whose unsigned order is the sort's order: floats by their IEEE bits (negatives flipped,
    -0 as +0, NaN last), integers with the sign bit flipped; all bits inverted for descending."""
    if rows.is_floating_point():
        x = rows.to(torch.float32) + 0.0                     # (-0.0 + 0.0 = +0.0: equal zeros stay in order)
        bits = x.view(torch.int32)
        key = torch.where(bits < 0, torch.bitwise_not(bits), torch.bitwise_xor(bits, torch.iinfo(torch.int32).min))
        key = torch.where(torch.isnan(x), -1, key)           # the largest unsigned key
    else:
        key = torch.bitwise_xor(rows.to(torch.int32), torch.iinfo(torch.int32).min)
    return torch.bitwise_not(key) if descending else key


def _radix_sort(rows: torch.Tensor, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [L, n] of a stable LSD radix sort of lines longer than one bitonic sort: 32-bit order
    keys, ``RADIX_BITS`` per pass, each pass a stable counting sort (an element's place is the count of
    smaller digits in its line plus the count of equal digits before it: one-hot prefix counts, fp32-exact)."""
    L, n = rows.shape
    key = _order_key(rows, descending)
    buckets = 1 << RADIX_BITS
    digits = arange_values(buckets, rows.device).to(torch.int32)
    perm = dense(torch.arange(n, device=rows.device).reshape(1, n).expand(L, n))
    for shift in range(0, 32, RADIX_BITS):
        digit = torch.bitwise_and(torch.bitwise_right_shift(torch.gather(key, 1, perm), shift), buckets - 1)
        onehot = (digit.unsqueeze(-1) == digits).to(torch.float32)            # [L, n, buckets]
        before = (onehot.cumsum(1) - onehot).mul_(onehot).sum(-1)            # equal digits earlier in the line
        counts = onehot.sum(1)
        starts = counts.cumsum(-1) - counts                                  # first place of each digit
        place = (before + torch.gather(starts, 1, digit.to(torch.int64))).to(torch.int64)
        perm = torch.empty_like(perm).scatter_(1, place, perm)
    return torch.gather(rows, 1, perm), perm


def sort_lines(self: torch.Tensor, dim: int, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 indices) of a stable sort along ``dim``: the rank sort for short lines, the bitonic
    network for longer ones (up to ``MAX_COLS``), the radix sort below 2**24; Unsupported beyond.
    int64: ``_sort_int64``."""
    if self.dtype == torch.int64:
        return _sort_int64(self, dim, descending)
    if self.dtype not in DATA_DTYPES:
        raise Unsupported
    d = canonicalize_dim(max(self.dim(), 1), dim)
    if self.numel() == 0:
        return self.clone(), torch.empty(self.shape, dtype=torch.int64, device=self.device)
    x = self.reshape(1) if self.dim() == 0 else self
    moved = dense(x.movedim(d, -1))
    n = moved.shape[-1]
    L = moved.numel() // n
    if n <= RANK_COLS and L * n * n <= SORT_LIMIT:
        values, indices = _rank_sort(moved.reshape(L, n), L, n, descending)
    elif n <= MAX_COLS:
        values, indices = _bitonic_sort(moved.reshape(L, n), L, n, descending)
    elif n < 1 << 24:
        values, indices = _radix_sort(moved.reshape(L, n), descending)
    else:
        raise Unsupported
    back = [dense(t.reshape(moved.shape).movedim(-1, d)).reshape(self.shape) for t in (values, indices)]
    return back[0], to_int64(back[1])


def _sort_int64(self: torch.Tensor, dim: int, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A stable int64 sort as two stable int32 passes, least significant word first (an LSD radix sort):
    by the low word with its sign bit flipped (unsigned order as signed int32), then by the high word;
    equal values keep their input order through both passes."""
    d = canonicalize_dim(max(self.dim(), 1), dim)
    x = dense(self.reshape(1) if self.dim() == 0 else self)
    words = x.view(torch.int32).view(*x.shape, 2)                 # little-endian (low, high) pairs
    low = torch.bitwise_xor(words[..., 0], torch.iinfo(torch.int32).min)
    _, first = sort_lines(low, d, descending)
    _, second = sort_lines(torch.gather(words[..., 1], d, first), d, descending)
    order = torch.gather(first, d, second)
    return torch.gather(x, d, order).reshape(self.shape), order.reshape(self.shape)


@lowering("sort.stable")
def sort(self: torch.Tensor, *, stable: bool | None = None, dim: int = -1,
         descending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort`` (always stable): a rank sort, bitonic network or radix sort by line length."""
    if not on_one_device(self):
        raise Unsupported
    aten.sort.stable(meta_twin(self), stable=stable, dim=dim, descending=descending)
    return sort_lines(self, dim, descending)


register_out("sort.values_stable", sort)


@lowering("topk")
def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
         sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: A002
    """``torch.topk``: the leading ``k`` of a stable sort (exact values, stable tie order)."""
    if not on_one_device(self):
        raise Unsupported
    d = canonicalize_dim(max(self.dim(), 1), dim)
    if not 0 <= k <= (self.shape[d] if self.dim() else 1):
        raise RuntimeError("selected index k out of range")   # the CPU's words (the meta check's differ)
    aten.topk.default(meta_twin(self), k, dim, largest, sorted)
    return _leading(self, k, d, largest) if self.dim() else sort_lines(self, dim, largest)


register_out("topk.values", topk)


def _leading(x: torch.Tensor, k: int, d: int, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 indices) of the first ``k`` of a stable sort along ``d``. A line longer than one sort
    (``MAX_COLS``) keeps the leading k of each block of it, then sorts those candidates: they stay in block
    order, so equal values still come out in index order."""
    n = x.shape[d]
    if n <= MAX_COLS or 2 * k > MAX_COLS:
        v, i = sort_lines(x, d, descending)
        return dense(v.narrow(d, 0, k)), dense(i.narrow(d, 0, k))
    parts = [_leading(x.narrow(d, s, min(MAX_COLS, n - s)), min(k, n - s), d, descending)
             for s in range(0, n, MAX_COLS)]
    values = torch.cat([v for v, _ in parts], d)
    indices = torch.cat([i + s for (_, i), s in zip(parts, range(0, n, MAX_COLS))], d)
    v, j = _leading(values, k, d, descending)
    return v, torch.gather(indices, d, j)


@lowering("kthvalue")
def kthvalue(self: torch.Tensor, k: int, dim: int = -1, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.kthvalue``: column k - 1 of an ascending stable sort."""
    if not on_one_device(self) or self.dtype == torch.bool:
        raise Unsupported("a tensor off the device, or bool (the CPU kernel refuses it)")
    aten.kthvalue.default(meta_twin(self), k, dim, keepdim)
    d = canonicalize_dim(max(self.dim(), 1), dim)
    v, i = sort_lines(self, dim, False)
    if self.dim():
        v, i = v.narrow(d, k - 1, 1), i.narrow(d, k - 1, 1)
        if not keepdim:
            v, i = v.squeeze(d), i.squeeze(d)
    return dense(v), dense(i)


def _kthvalue_out_checks(outs: list[torch.Tensor], self: torch.Tensor, k: int, dim: int = -1,
                         keepdim: bool = False) -> None:
    """The CPU's checks of kthvalue's arguments, then of its out= dtypes (it casts into neither)."""
    aten.kthvalue.default(meta_twin(self), k, dim, keepdim)
    values, indices = outs
    if values.dtype != self.dtype:
        raise RuntimeError("output values must be of same type as input")
    if indices.dtype != torch.int64:
        raise RuntimeError("output indices must be of scalar type Long")


register_out("kthvalue.values", kthvalue, cast=_kthvalue_out_checks,
             resize=lambda outs, self, k, dim=-1, keepdim=False: resize_reduced_outs(outs, self, dim, keepdim))


def _same(xj, xi):
    """1 where two elements are equal (NaN equal to NaN: one run in a sorted line)."""
    return nl.logical_or(nl.equal(xj, xi), nl.logical_and(tm.isnan(xj), tm.isnan(xi)))


def _mode(x: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 indices) of the mode along ``d`` (dim kept): the smallest of the most frequent values
    (NaN counts as one value, the largest) and the last index holding it."""
    sv, si = sort_lines(x, d, False)
    rows, L, n = lines(sv, d)                    # sorted lines: each value's copies are one run
    key = rows.to(torch.int32) if rows.dtype == torch.bool else rows
    xj = dense(key.reshape(L, 1, n).expand(L, n, n)).reshape(L * n, n)
    count = run_pointwise(_same, [xj, key.reshape(L * n, 1)], KIND.DEFAULT, result_dtype=torch.float32,
                          op="aten::mode").sum(-1).reshape(L, n)          # the length of each one's run
    most = count.amax(-1, keepdim=True)
    j = arange_values(n, x.device).reshape(1, n).to(torch.float32)
    first = torch.where(count == most, j, float(n)).amin(-1, keepdim=True)  # the smallest such value's run
    last = first + most - 1                                                 # its last copy, stably sorted
    values = rows.gather(1, to_int64(first.to(torch.int32)))
    # int64 data has no device gather: pick the int32 positions, widened after
    positions, _, _ = lines(si.to(torch.int32), d)
    indices = to_int64(positions.gather(1, to_int64(last.to(torch.int32))))
    shape = list(x.movedim(d, -1).shape)
    shape[-1] = 1
    return (dense(t.reshape(shape).movedim(-1, d)) for t in (values, indices))


@lowering("mode")
def mode(self: torch.Tensor, dim: int = -1, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.mode``: run lengths of a stable sort (lines up to ``SORT_LIMIT`` pairs)."""
    if not on_one_device(self) or self.dtype not in DATA_DTYPES:
        raise Unsupported
    d = canonicalize_dim(max(self.dim(), 1), dim)
    if self.numel() == 0:       # the CPU's error for an empty dim, or its empty result
        v, i = aten.mode.default(torch.empty(self.shape, dtype=self.dtype), dim, keepdim)
        return v.to(self.device), i.to(self.device)
    x = self.reshape(1) if self.dim() == 0 else self
    v, i = _mode(x, d)
    if not keepdim or self.dim() == 0:
        v, i = v.squeeze(d), i.squeeze(d)
    if self.dim() == 0:
        v, i = v.reshape(()), i.reshape(())
    return v, i


register_out("mode.values", mode)
