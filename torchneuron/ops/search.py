"""Searches and counts on the device: ``searchsorted``, ``bucketize``, ``histc``, ``bincount``, ``unique``
(``_unique2``, ``unique_dim``), ``unique_consecutive``.

Where a value v lands in a sorted sequence is a count: the boundaries b with ``b < v`` (left side) or
``b <= v`` (right side). One element-wise launch compares every value with every boundary of its line
([N, B], or [L, m, B] for per-line boundaries) and one reduction counts (fp32, exact below 2**24). A
count needs no order, so ``sorter`` (the argsort of an unsorted sequence) only has its range checked.
A NaN value lands past every boundary, as on the CPU. Up to ``SORT_LIMIT`` comparisons per call run on
the device; larger calls, and int64 data, fall back.

``histc`` and ``bincount`` are one-hot counts: each element's bin compared with every bin number ([N, K],
summed over N; weights by one matmul). Their sizes depend on the data (``bincount``'s length, ``histc``'s
range when none is given): the host reads those with one sync, as the CPU kernels do.

``unique`` sorts (stably), marks where runs of equal values start, and compacts the run heads (the host
reads the count, as ``nonzero`` does); inverse indices are run numbers (a scan of the starts) scattered
back through the sort's permutation, counts the gaps between run starts. ``unique_consecutive`` is the
same without the sort. ``unique_dim`` orders slices lexicographically by all-pairs row comparisons (a
prefix count of differing columns finds the first one) and falls back for NaN data.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import canonicalize_dim

import torchneuron.nki.language as nl
from torchneuron.kernels import tilemath as tm
from torchneuron.ops.base import aten, FLOATS, meta_twin, on_one_device, raise_like_cpu, Unsupported
from torchneuron.ops.elementwise import dense, run_pointwise, to_int64
from torchneuron.ops.indexing import arange_values
from torchneuron.ops.registry import lowering, refuse_other_out_dtypes, register_out
from torchneuron.ops.scatter import (any_outside, compact, DATA_DTYPES, index_int32, match_tile,
                                     scatter_into, slot_tile)
from torchneuron.ops.sort import SORT_LIMIT, sort_lines

INDEX_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _below(b, v):
    """1 where boundary b lies before value v on the left side (NaN values past all)."""
    return nl.logical_or(nl.less(b, v), tm.isnan(v))


def _below_or_at(b, v):
    """1 where boundary b lies before value v on the right side (NaN values past all)."""
    return nl.logical_or(nl.less_equal(b, v), tm.isnan(v))


def _positions(seq: torch.Tensor, values: Any, right: bool, out_int32: bool, shape: torch.Size) -> torch.Tensor:
    """The insertion positions of ``values`` (a tensor, or a Python scalar) in ``seq`` [B] or [*, B]."""
    dtype = torch.int32 if out_int32 else torch.int64
    B = seq.shape[-1] if seq.dim() else 1
    vals = values if isinstance(values, torch.Tensor) else None
    if seq.dtype not in DATA_DTYPES or (vals is not None and vals.dtype not in DATA_DTYPES):
        raise Unsupported
    numel = vals.numel() if vals is not None else 1
    if numel == 0 or B == 0:
        return torch.zeros(shape, dtype=dtype, device=seq.device)
    if numel * B > SORT_LIMIT:
        raise Unsupported
    if seq.dim() <= 1:
        b = dense(seq).reshape(1, B)
        v = dense(vals).reshape(-1, 1) if vals is not None else values
    else:
        L = seq.numel() // B
        b = dense(seq).reshape(L, 1, B)
        v = dense(vals).reshape(L, -1, 1)
    flags = run_pointwise(_below_or_at if right else _below, [b, v], KIND.DEFAULT, result_dtype=torch.float32,
                          op="aten::searchsorted")
    counts = flags.sum(-1).to(torch.int32).reshape(shape)
    return counts if out_int32 else to_int64(counts)


def _both_bool(seq: torch.Tensor, values: Any) -> bool:
    """Whether boundaries and values are both bool tensors, which the CPU kernels refuse (their common dtype has no
    kernel; a bool beside another dtype, or a scalar, is promoted)."""
    return seq.dtype == torch.bool and isinstance(values, torch.Tensor) and values.dtype == torch.bool


def _search(overload: Any, seq: torch.Tensor, values: Any, out_int32: bool, right: bool, side: str | None,
            sorter: torch.Tensor | None) -> torch.Tensor:
    """``searchsorted`` after PyTorch's argument checks (sorter's range checked on the device)."""
    kw = {"out_int32": out_int32, "right": right, "side": side, "sorter": sorter}
    if not isinstance(values, torch.Tensor) and seq.dim() != 1:   # (the meta function fails on this one)
        raise RuntimeError(f"torch.searchsorted(): input value can be a scalar only when boundaries tensor dimension "
                           f"is 1, but we got boundaries tensor dim({seq.dim()}) and input value's dim(0) numel(1)")
    if not on_one_device(seq, sorter, *([values] if isinstance(values, torch.Tensor) else [])):
        raise Unsupported("tensors on more than one device")
    res = overload(meta_twin(seq), meta_twin(values), **{k: meta_twin(a) for k, a in kw.items()})
    if _both_bool(seq, values):
        raise_like_cpu(overload, seq, values, **kw)
    if sorter is not None and any_outside(index_int32(sorter), 0, max(seq.shape[-1] if seq.dim() else 1, 1)):
        raise_like_cpu(overload, seq, values, **kw, with_data=True)
    return _positions(seq, values, right or side == "right", out_int32, res.shape)


def _position_dtype(*args: Any, out_int32: bool = False, **kwargs: Any) -> torch.dtype:
    """The dtype of searchsorted's and bucketize's positions."""
    return torch.int32 if out_int32 else torch.int64


def _searchsorted_lowering(overload_name: str) -> None:
    overload = getattr(aten.searchsorted, overload_name)

    def kernel(sorted_sequence: torch.Tensor, self: Any, *, out_int32: bool = False, right: bool = False,
               side: str | None = None, sorter: torch.Tensor | None = None) -> torch.Tensor:
        """``torch.searchsorted``: a count of the boundaries before each value."""
        return _search(overload, sorted_sequence, self, out_int32, right, side, sorter)
    kernel.__name__ = kernel.__qualname__ = f"searchsorted_{overload_name}"
    lowering(f"searchsorted.{overload_name}")(kernel)
    out_name = f"searchsorted.{overload_name}_out"
    register_out(out_name, kernel, cast=refuse_other_out_dtypes(out_name, _position_dtype))


for _name in ("Tensor", "Scalar"):
    _searchsorted_lowering(_name)


def _bucketize_lowering(overload_name: str) -> None:
    overload = getattr(aten.bucketize, overload_name)

    def kernel(self: Any, boundaries: torch.Tensor, *, out_int32: bool = False, right: bool = False) -> torch.Tensor:
        """``torch.bucketize``: ``searchsorted`` over 1-D boundaries."""
        if boundaries.dim() != 1:
            raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.dim()})")
        if not on_one_device(boundaries, *([self] if isinstance(self, torch.Tensor) else [])):
            raise Unsupported("tensors on more than one device")
        res = overload(meta_twin(self), meta_twin(boundaries), out_int32=out_int32, right=right)
        if _both_bool(boundaries, self):
            raise_like_cpu(overload, self, boundaries, out_int32=out_int32, right=right)
        return _positions(boundaries, self, right, out_int32, res.shape)
    kernel.__name__ = kernel.__qualname__ = f"bucketize_{overload_name}"
    lowering(f"bucketize.{overload_name}")(kernel)
    out_name = f"bucketize.{overload_name}_out"
    register_out(out_name, kernel, cast=refuse_other_out_dtypes(out_name, _position_dtype))


for _name in ("Tensor", "Scalar"):
    _bucketize_lowering(_name)


# ---- counts: histc, bincount --------------------------------------------------------------------

def _one_hot(ids: torch.Tensor, K: int) -> torch.Tensor:
    """[N, K] fp32: 1 where ids[n] == k (ids an int32 or float [N] tensor of whole numbers)."""
    k = arange_values(K, ids.device).reshape(1, K)
    return run_pointwise(match_tile, [dense(ids).reshape(-1, 1), k], KIND.DEFAULT, result_dtype=torch.float32,
                         op="aten::histc")


def _edge(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (the CPU keeps the outer bin edges in the input's dtype)."""
    return torch.tensor(value, dtype=dtype).item()


@lowering("histc")
def histc(self: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> torch.Tensor:  # noqa: A002
    """``torch.histc``: bin = trunc((x - lo) * bins / (hi - lo)) in the input's dtype, as the CPU rounds
    it, then a one-hot count; a range of (0, 0) is the data's (one host sync)."""
    if not on_one_device(self) or self.dtype not in FLOATS:
        raise Unsupported   # integer inputs: the CPU's NotImplementedError
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    lo, hi = float(min), float(max)
    if lo > hi:
        raise RuntimeError("torch.histc: max must be larger than min")
    if lo == hi and self.numel():
        lo, hi = (float(v) for v in torch.stack([self.min(), self.max()]).cpu())   # the one host sync
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise RuntimeError(f"torch.histc: range of [{lo:g}, {hi:g}] is not finite")
    N = self.numel()
    if N == 0:
        return torch.zeros(bins, dtype=self.dtype, device=self.device)
    if N * bins > SORT_LIMIT or (self.dtype != torch.float32 and N > 256):
        raise Unsupported   # too much work / counts the CPU's half-precision histogram would round
    lo, hi = _edge(lo, self.dtype), _edge(hi, self.dtype)
    width = _edge((torch.tensor(hi, dtype=self.dtype) - torch.tensor(lo, dtype=self.dtype)).item(), self.dtype)
    x = dense(self).reshape(-1)
    q = (((x - lo) * bins) / width).clamp_max(bins - 1)   # each step rounded to the dtype, as the CPU's
    bin_of = run_pointwise(_bin, [x, q, lo, hi], KIND.DEFAULT, result_dtype=torch.float32,
                           op="aten::histc")
    return _one_hot(bin_of, bins).sum(0).to(self.dtype)


register_out("histc.out", histc)


def _bin(x, q, lo, hi):
    """The bin of x: trunc(q) (q already clamped to the last bin, for x == hi); -1 (no bin) outside
    [lo, hi] or for NaN."""
    b = tm.trunc(q)
    inside = nl.logical_and(nl.greater_equal(x, lo), nl.less_equal(x, hi))
    return tm.where_value(nl.equal(inside, 0), -1.0, b)


@lowering("bincount")
def bincount(self: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """``torch.bincount``: a one-hot count (or weighted sum, one matmul); the length is read from the
    data's maximum (one host sync)."""
    if not on_one_device(self, weights) or self.dtype not in INDEX_INTS:
        raise Unsupported   # the CPU's NotImplementedError for other dtypes
    if self.dim() != 1:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != self.shape[0]):
        raise RuntimeError("weights should be 1-d and have the same length as input")
    exact_ints = weights is None or weights.dtype in INDEX_INTS
    if weights is not None and weights.dtype not in INDEX_INTS + (torch.float32,):
        raise Unsupported   # float64 sums (and half weights, which the CPU sums in float64)
    result = torch.int64 if weights is None else torch.float32 if weights.dtype == torch.float32 else torch.float64
    N = self.shape[0]
    if N == 0:
        return torch.zeros(minlength, dtype=result, device=self.device)
    stats = [self.min(), self.max()]
    if weights is not None and exact_ints:
        stats.append(weights.abs().max().to(self.dtype))
    stats = [int(v) for v in torch.stack(stats).cpu()]                 # the one host sync
    if stats[0] < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    K = max(stats[1] + 1, minlength)
    if N * K > SORT_LIMIT or (len(stats) == 3 and stats[2] * N >= 1 << 24):
        raise Unsupported   # too much work / integer sums past fp32's exact range
    hot = _one_hot(index_int32(self), K)                                      # [N, K]
    if weights is None:
        return to_int64(hot.sum(0).to(torch.int32))
    sums = torch.mm(weights.to(torch.float32).reshape(1, N), hot).reshape(K)
    return sums.to(result)


# ---- unique, unique_consecutive -----------------------------------------------------------------

def _lex_less(a, b, before):
    """1 at the column where row a is first below row b (no difference in the columns before it)."""
    return nl.logical_and(nl.less(a, b), nl.equal(before, 0))


def _starts(rows: torch.Tensor) -> torch.Tensor:
    """bool [N]: where each run of equal consecutive rows of ``rows`` [N, R] starts."""
    N = rows.shape[0]
    head = torch.ones(1, dtype=torch.bool, device=rows.device)
    if N == 1:
        return head
    diff = run_pointwise(tm.ne, [rows[1:], rows[:-1]], KIND.DEFAULT, result_dtype=torch.bool,
                         op="aten::unique").any(-1)
    return torch.cat([head, diff])


def _runs(rows: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the first row of each run [U, R], each row's run number int32 [N], the runs' lengths int64 [U]) of
    ``rows`` [N, R] cut where ``starts``; the run count is read by the host (two syncs)."""
    N = rows.shape[0]
    first_rows = compact(starts, rows)
    positions = compact(starts, arange_values(N, rows.device).reshape(N, 1)).reshape(-1)
    ends = torch.cat([positions[1:], torch.full((1,), N, dtype=torch.int32, device=rows.device)])
    run = starts.to(torch.int32).cumsum(0, dtype=torch.int32) - 1
    return first_rows, run, to_int64(ends - positions)


def _nothing(device: torch.device) -> torch.Tensor:
    """The empty int64 tensor a unique op returns for an output not asked for."""
    return torch.empty(0, dtype=torch.int64, device=device)


def _slices(self: torch.Tensor, dim: int) -> torch.Tensor:
    """``self`` with ``dim`` moved first (dense), after the CPU's checks of a unique op's dim."""
    if self.dim() == 0:
        raise IndexError(f"Dimension specified as {dim} but tensor has no dimensions")
    d = canonicalize_dim(self.dim(), dim)
    if self.numel() == 0 and self.shape[d] != 0:
        raise RuntimeError("There are 0 sized dimensions, and they aren't selected, so unique cannot be applied")
    return dense(dense(self).movedim(d, 0))


@lowering("_unique2")
def unique2(self: torch.Tensor, sorted: bool = True, return_inverse: bool = False,  # noqa: A002
            return_counts: bool = False):
    """``torch.unique`` (no dim; sorted, as the CPU always is): a stable sort, run starts, compaction."""
    if not on_one_device(self) or self.dtype not in DATA_DTYPES | {torch.int64}:
        raise Unsupported
    N = self.numel()
    none = _nothing(self.device)
    if N == 0:
        inverse = torch.empty(self.shape, dtype=torch.int64, device=self.device) if return_inverse else none
        return self.reshape(0).clone(), inverse, none.clone()
    values, order = sort_lines(self.reshape(N), 0, False)
    rows = values.reshape(N, 1)
    if rows.dtype == torch.int64:            # compared and compacted as rows of two int32 words
        rows = rows.view(torch.int32)
    first, run, counts = _runs(rows, _starts(rows))
    first = first.view(self.dtype)
    inverse = none
    if return_inverse:     # each element's run number, scattered back to its input position
        inv = torch.empty((N, 1), dtype=torch.int32, device=self.device)
        scatter_into(inv, index_int32(order), run.reshape(N, 1))
        inverse = to_int64(inv).reshape(self.shape)
    return first.reshape(-1), inverse, counts if return_counts else none.clone()


@lowering("unique_consecutive")
def unique_consecutive(self: torch.Tensor, return_inverse: bool = False, return_counts: bool = False,
                       dim: int | None = None):
    """``torch.unique_consecutive``: run starts of the elements (or of the slices along ``dim``), compacted."""
    if not on_one_device(self) or self.dtype not in DATA_DTYPES:
        raise Unsupported
    none = _nothing(self.device)
    if dim is None or (self.dim() == 1 and dim == 0):   # as the CPU: dim 0 of a 1-D tensor is no dim
        N = self.numel()
        if N == 0:
            inverse = torch.empty(self.shape, dtype=torch.int64, device=self.device) if return_inverse else none
            return self.reshape(0).clone(), inverse, none.clone()
        rows = dense(self).reshape(N, 1)
        first, run, counts = _runs(rows, _starts(rows))
        inverse = to_int64(run).reshape(self.shape) if return_inverse else none
        return first.reshape(-1), inverse, counts if return_counts else none.clone()
    moved = _slices(self, dim)
    S = moved.shape[0]
    if S == 0:
        return self.clone(), none, none.clone()
    rows = moved.reshape(S, -1)
    first, run, counts = _runs(rows, _starts(rows))
    values = dense(first.reshape(-1, *moved.shape[1:]).movedim(0, canonicalize_dim(self.dim(), dim)))
    return values, to_int64(run), counts      # with a dim both come back, asked for or not (as the CPU)


@lowering("unique_dim")
def unique_dim(self: torch.Tensor, dim: int, sorted: bool = True, return_inverse: bool = False,  # noqa: A002
               return_counts: bool = False):
    """``torch.unique(dim=)``: the distinct slices along ``dim`` in lexicographic order, from all-pairs row
    comparisons (the first differing column decides; up to ``SORT_LIMIT`` element pairs)."""
    if not on_one_device(self) or self.dtype not in DATA_DTYPES:
        raise Unsupported
    moved = _slices(self, dim)
    d = canonicalize_dim(self.dim(), dim)
    S = moved.shape[0]
    none = _nothing(self.device)
    if S == 0:
        return self.clone(), none, none.clone()
    R = moved.numel() // S
    if S * S * R > SORT_LIMIT:
        raise Unsupported
    rows = moved.reshape(S, R)
    a, b = rows.reshape(S, 1, R), rows.reshape(1, S, R)
    ne = run_pointwise(tm.ne, [a, b], KIND.DEFAULT, result_dtype=torch.float32, op="aten::unique_dim")
    before = ne.cumsum(-1) - ne                                   # differences left of each column
    less = run_pointwise(_lex_less, [a, b, before], KIND.DEFAULT, result_dtype=torch.float32,
                         op="aten::unique_dim").amax(-1)          # [i, j]: row i sorts before row j
    same = ne.amax(-1) == 0
    first = same.triu(1).any(0).logical_not()                     # no equal row before it
    inverse = (less * first.to(torch.float32).reshape(S, 1)).sum(0)   # distinct rows sorting before
    U, nans = (int(v) for v in torch.stack([first.sum(), rows.isnan().any().to(torch.int64)]).cpu()) \
        if rows.is_floating_point() else (int(first.sum().item()), 0)
    if nans:
        raise Unsupported   # NaN slices: the CPU's comparator has no order for them
    inv32 = inverse.to(torch.int32)
    out = torch.empty((U + 1, R), dtype=self.dtype, device=self.device)
    scatter_into(out, run_pointwise(slot_tile, [first, inv32 + 1, U], KIND.DEFAULT, op="aten::unique_dim"), rows)
    values = dense(out[:U].reshape(U, *moved.shape[1:]).movedim(0, d))
    counts = to_int64(_one_hot(inv32, U).sum(0).to(torch.int32))
    return values, to_int64(inv32), counts       # both come back, asked for or not (as the CPU)
