"""Less common reductions and scans, composed from lowered ops: ``nansum``, ``std_mean``, ``median`` /
``nanmedian``, ``aminmax``, ``count_nonzero``, ``cummax`` / ``cummin``, ``logcumsumexp``, ``index_reduce``,
``segment_reduce``.

- ``median``/``nanmedian``: a stable ascending sort (NaN last), then the column the CPU picks:
  ``(n - 1) // 2`` (the lower median), the first NaN when ``median`` meets one, and
  ``(n - nans - 1) // 2`` for ``nanmedian``. The stable order gives the CPU's index among ties.
- ``cummax``/``cummin``/``logcumsumexp``: the prefix j <= i of every element of a row is one row of a
  lower-triangular [L*n, n] selection (O(L n^2), like the sorts), reduced by the lowered
  ``amax``/``amin``/``logsumexp``; so NaN and infinities behave like the reductions (and the CPU).
- ``index_reduce``: a ``scatter_reduce`` with the index broadcast along the source.
- ``segment_reduce``: a [segments x length] membership mask from the offsets (a prefix sum of the
  lengths), the data masked with the reduction's identity outside each segment, then the lowered
  sum/prod/amax/amin over the length (O(S n) per row, like the sorts).
Inputs outside what these run on (dtypes, sizes) take the CPU fallback.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch._prims_common import canonicalize_dim

from torchneuron.ops.base import aten, FLOATS, on_one_device, Unsupported
from torchneuron.ops.elementwise import dense, write_result
from torchneuron.ops.indexing import arange_values
from torchneuron.ops.registry import lowering, register_out
from torchneuron.ops.scatter import check_out, DATA_DTYPES
from torchneuron.ops.sort import lines, SORT_LIMIT, sort_lines


# ---- nansum, std_mean, aminmax, count_nonzero ---------------------------------------------------

@lowering("nansum")
def nansum(self: torch.Tensor, dim: Any = None, keepdim: bool = False, *,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """``nansum``: NaNs replaced by zero, then the lowered ``sum``."""
    if self.is_complex():
        raise RuntimeError("nansum does not support complex inputs")
    if not on_one_device(self) or self.dtype == torch.float64 or dtype == torch.float64:
        raise Unsupported("a tensor off the device, or float64")
    if self.is_floating_point() and dtype is not None and not dtype.is_floating_point:
        # the CPU's kernel decides: a result functionally, its not-implemented error into an integer out=
        raise Unsupported("a float input summed in an integer dtype")
    x = torch.where(self.isnan(), 0.0, self) if self.is_floating_point() else self
    return torch.sum(x, dim, keepdim, dtype=dtype)


register_out("nansum.out", nansum, dtype_from_out=True)   # the CPU sums in out's dtype


@lowering("std_mean.correction")
def std_mean(self: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False):
    """(std, mean): the lowered ``var_mean`` and a square root; bf16/fp16 in fp32, each result rounded once as the
    CPU's (a rounded variance's square root rounded again drifted from it)."""
    x = self.to(torch.float32) if self.dtype in (torch.float16, torch.bfloat16) else self
    var, mean = aten.var_mean.correction(x, dim, correction=correction, keepdim=keepdim)
    return var.sqrt().to(self.dtype), mean.to(self.dtype)


@lowering("aminmax")
def aminmax(self: torch.Tensor, *, dim: int | None = None, keepdim: bool = False):
    """(amin, amax) by the lowered reductions."""
    if self.numel() == 0 and self.device.type == "neuron":
        # the CPU's error (no identity) or its empty result, computed on an empty CPU twin
        lo, hi = aten.aminmax.default(torch.empty(self.shape, dtype=self.dtype), dim=dim, keepdim=keepdim)
        return lo.to(self.device), hi.to(self.device)
    if not on_one_device(self) or self.dtype not in DATA_DTYPES:
        raise Unsupported("a tensor off the device, or an unsupported dtype")
    if dim is None:
        x = self.reshape(-1)
        lo, hi = x.amin(0), x.amax(0)
        if keepdim:
            lo, hi = lo.reshape([1] * self.dim()), hi.reshape([1] * self.dim())
    else:
        canonicalize_dim(max_dim(self), dim)
        lo, hi = self.amin(dim, keepdim), self.amax(dim, keepdim)
    return lo, hi


register_out("aminmax.out", aminmax)


def max_dim(t: torch.Tensor) -> int:
    """The rank dims are canonicalized against (a 0-dim tensor takes dims 0 and -1)."""
    return t.dim() if t.dim() else 1


@lowering("count_nonzero.dim_IntList")
def count_nonzero(self: torch.Tensor, dim: list[int]) -> torch.Tensor:
    """The number of non-zeros: an exact integer sum of ``x != 0``."""
    if self.device.type != "neuron" or self.dtype not in DATA_DTYPES:
        raise Unsupported
    return (self != 0).sum(list(dim), dtype=torch.int64)


# ---- median, nanmedian --------------------------------------------------------------------------

def _median_along(x: torch.Tensor, d: int, ignore_nan: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 indices) of the (nan)median along dim ``d`` of ``x`` (dim kept, size 1)."""
    values, indices = sort_lines(x, d, False)
    n = x.shape[d]
    if x.is_floating_point():
        nans = x.isnan().sum(d, keepdim=True, dtype=torch.float32)
        if ignore_nan:
            # (n - nans - 1) // 2, truncated toward zero like the CPU's C++ (0 for an all-NaN line)
            col = ((n - 1 - nans).clamp_min(0) * 0.5).floor()
        else:
            col = torch.where(nans > 0, n - nans, float((n - 1) // 2))  # the first NaN in stable order
        col = col.to(torch.int64)
    else:
        shape = list(x.shape)
        shape[d] = 1
        col = torch.full(shape, (n - 1) // 2, dtype=torch.int64, device=x.device)
    # int64 data has no device gather: pick the int32 positions, widened after
    return values.gather(d, col), indices.to(torch.int32).gather(d, col).to(torch.int64)


def _median_full(name: str, ignore_nan: bool) -> None:
    overload = getattr(aten, name).default

    def kernel(self: torch.Tensor) -> torch.Tensor:
        """The (nan)median of all elements (NaN for an empty input, as the CPU)."""
        if self.device.type != "neuron" or self.dtype not in DATA_DTYPES or self.numel() > SORT_LIMIT ** 0.5:
            raise Unsupported("a tensor off the device, an unsupported dtype, or more elements than the sort handles")
        if self.numel() == 0:
            return overload(torch.empty(0, dtype=self.dtype)).to(self.device)
        v, _ = _median_along(self.reshape(-1), 0, ignore_nan)
        return v.reshape(())
    lowering(name)(kernel)


def _median_dim(name: str, ignore_nan: bool) -> None:
    overload = getattr(aten, name).dim_values

    def kernel(self: torch.Tensor, dim: int, keepdim: bool = False, *, values: torch.Tensor,
               indices: torch.Tensor):
        """(values, indices) of the (nan)median along ``dim``, into ``values``/``indices``."""
        if not on_one_device(self, values, indices) or self.dtype not in DATA_DTYPES:
            raise Unsupported
        d = canonicalize_dim(max_dim(self), dim)
        if self.numel() == 0:   # the CPU's error for an empty dim, or its empty result
            v, i = overload(torch.empty(self.shape, dtype=self.dtype), dim, keepdim,
                            values=torch.empty(0, dtype=values.dtype), indices=torch.empty(0, dtype=torch.int64))
            return write_result(v.to(self.device), values), write_result(i.to(self.device), indices)
        if values.dtype != self.dtype or indices.dtype != torch.int64:
            raise Unsupported   # the CPU's dtype errors
        check_out(values, self)
        check_out(indices, self)
        x = self.reshape(1) if self.dim() == 0 else self
        v, i = _median_along(x, d, ignore_nan)
        if not keepdim or self.dim() == 0:
            v, i = v.squeeze(d), i.squeeze(d)
        if self.dim() == 0:
            v, i = v.reshape(()), i.reshape(())
        return write_result(dense(v), values), write_result(dense(i), indices)
    lowering(f"{name}.dim_values")(kernel)


for _name, _ignore in (("median", False), ("nanmedian", True)):
    _median_full(_name, _ignore)
    _median_dim(_name, _ignore)


# ---- prefix reductions: cummax, cummin, logcumsumexp --------------------------------------------

def _prefixes(x: torch.Tensor, d: int, fill: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The rows of ``x`` along ``d`` as [L*n, n] prefixes (``fill`` after position i), the rows, n."""
    rows, L, n = lines(x, d)
    j = arange_values(n, x.device)
    upto = j.reshape(1, n) <= j.reshape(n, 1)                      # [i, j]: j <= i
    full = dense(rows.reshape(L, 1, n).expand(L, n, n))
    return torch.where(upto, full, fill).reshape(L * n, n), rows, n


def _restore(res: torch.Tensor, like: torch.Tensor, d: int) -> torch.Tensor:
    """A [L*n] result along the moved-last dim back in the layout of ``like``."""
    moved_shape = list(like.movedim(d, -1).shape)
    return dense(res.reshape(moved_shape).movedim(-1, d)).reshape(like.shape)


def _cum_extreme(name: str, is_max: bool) -> None:
    def kernel(self: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, dim: int) -> None:
        """Running max/min with the CPU's index: the last position holding the running value (NaN sticks)."""
        if not on_one_device(self, values, indices) or self.dtype not in DATA_DTYPES or self.numel() == 0:
            raise Unsupported
        if self.dtype == torch.int32 and not (-(1 << 24) <= int(self.amin().item()) and
                                              int(self.amax().item()) <= 1 << 24):
            raise Unsupported   # the fp32 keys would round: a value not in the input could come back
        d = canonicalize_dim(max_dim(self), dim)
        x = self.reshape(1) if self.dim() == 0 else self
        key = x.to(torch.float32) if x.dtype != torch.float32 else x   # exact within +-2**24
        prefix, rows, n = _prefixes(key, d, float("-inf") if is_max else float("inf"))
        run = prefix.amax(-1, keepdim=True) if is_max else prefix.amin(-1, keepdim=True)
        L = rows.shape[0]
        pos = arange_values(n, self.device)
        j = pos.to(torch.float32).reshape(1, 1, n)
        upto = pos.reshape(1, n) <= pos.reshape(n, 1)              # [i, j]: j <= i
        rows_i = rows.reshape(L, 1, n)
        run3 = run.reshape(L, n, 1)
        same = ((rows_i == run3) | (rows_i.isnan() & run3.isnan())) & upto
        last = torch.where(same, j, -1.0).amax(-1).reshape(-1)
        v = _restore(run.reshape(-1), x, d).to(self.dtype).reshape(self.shape)
        idx = _restore(last, x, d).to(torch.int64).reshape(self.shape)
        write_result(v, values)
        write_result(idx, indices)
    lowering(name)(kernel)


_cum_extreme("_cummax_helper", True)
_cum_extreme("_cummin_helper", False)


@lowering("_logcumsumexp")
def logcumsumexp(self: torch.Tensor, dim: int) -> torch.Tensor:
    """log(cumsum(exp(x))) as a stable ``logsumexp`` over every prefix (no running-sum overflow)."""
    if not on_one_device(self) or self.dtype not in FLOATS:
        raise Unsupported
    d = canonicalize_dim(max_dim(self), dim)
    if self.numel() == 0:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)
    x = self.reshape(1) if self.dim() == 0 else self
    prefix, _, _ = _prefixes(x.to(torch.float32), d, float("-inf"))
    return _restore(torch.logsumexp(prefix, -1), x, d).to(self.dtype).reshape(self.shape)


register_out("_logcumsumexp.out", logcumsumexp)


# ---- index_reduce ------------------------------------------------------------------------------

def _index_reduce(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, reduce: str,
                  include_self: bool) -> torch.Tensor:
    """``index_reduce`` as a ``scatter_reduce`` whose index is ``index`` broadcast along ``source``."""
    if not on_one_device(self, index, source) or self.dtype not in FLOATS:
        raise Unsupported
    if self.dim() == 0:   # a scalar is a 1-element vector along dim 0 (after the CPU's own checks)
        meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
        aten.index_reduce.default(meta(self), dim, meta(index), meta(source), reduce, include_self=include_self)
        return _index_reduce(self.reshape(1), 0, index, source.reshape(-1), reduce, include_self).reshape(())
    if reduce not in ("prod", "mean", "amax", "amin"):   # the meta kernel does not check it
        aten.index_reduce.default(self.cpu(), dim, index.cpu(), source.cpu(), reduce, include_self=include_self)
        raise RuntimeError(f"index_reduce(): unknown reduce {reduce}")
    # the CPU's shape/dtype checks, on meta twins
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    aten.index_reduce.default(meta(self), dim, meta(index), meta(source), reduce, include_self=include_self)
    d = canonicalize_dim(self.dim(), dim)
    if index.numel() and bool(((index < 0) | (index >= self.shape[d])).any().item()):
        aten.index_reduce.default(self.cpu(), dim, index.cpu(), source.cpu(), reduce, include_self=include_self)
        raise IndexError("index out of bounds")
    if index.numel() == 0:
        return self.clone()
    shape = [1] * source.dim()
    shape[d] = index.numel()
    idx = dense(index.to(torch.int64).reshape(shape).expand(source.shape))
    return torch.scatter_reduce(self, d, idx, source, reduce, include_self=include_self)


@lowering("index_reduce")
def index_reduce(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, reduce: str, *,
                 include_self: bool = True) -> torch.Tensor:
    """``index_reduce`` (prod, mean, amax, amin), out-of-place (in place: ``index_reduce_``)."""
    return _index_reduce(self, dim, index, source, reduce, include_self)


register_out("index_reduce.out", index_reduce)


@lowering("index_reduce_")
def index_reduce_(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, reduce: str, *,
                  include_self: bool = True) -> torch.Tensor:
    """In-place ``index_reduce_``: the out-of-place result copied back into ``self``."""
    check_out(self, index, source)
    return write_result(_index_reduce(self, dim, index, source, reduce, include_self), self)


# ---- segment_reduce -------------------------------------------------------------------------------

_SEGMENT_FILL = {"sum": 0.0, "mean": 0.0, "prod": 1.0, "max": -float("inf"), "min": float("inf")}
_SEGMENT_NAMES = {"sum": "sum", "mean": "mean", "prod": "prod", "max": "max", "amax": "max", "min": "min",
                  "amin": "min"}
SEGMENT_LIMIT = 1 << 24  # elements of the [segments x length x inner] selection it builds


def _segment_offsets(lengths: torch.Tensor | None, offsets: torch.Tensor | None, n: int,
                     unsafe: bool) -> torch.Tensor:
    """The [B, S + 1] int32 segment boundaries, from ``offsets`` or a prefix sum of ``lengths``
    (checked like the CPU when not ``unsafe``: one device-to-host read of a flag)."""
    if offsets is not None:
        return offsets.to(torch.int32).reshape(-1, offsets.shape[-1])
    lens = lengths.to(torch.int32).reshape(-1, lengths.shape[-1])
    if not unsafe:
        if bool((lens < 0).any()):
            raise RuntimeError("lengths contains negative value!")
        if lens.numel() and not bool((lens.sum(-1) == n).all()):
            raise RuntimeError("segment_reduce(): Expected all rows of lengths along axis to sum to "
                               "data.size(lengths.dim()-1) when !unsafe.")
    return torch.cat([torch.zeros_like(lens[:, :1]), lens.cumsum(-1, dtype=torch.int32)], -1)


@lowering("segment_reduce")
def segment_reduce(data: torch.Tensor, reduce: str, *, lengths: torch.Tensor | None = None,
                   indices: torch.Tensor | None = None, offsets: torch.Tensor | None = None, axis: int = 0,
                   unsafe: bool = False, initial: Any = None) -> torch.Tensor:
    """``segment_reduce``: element n of a row belongs to segment s when offset[s] <= n < offset[s+1];
    each segment reduces the row masked to it (filled with the reduction's identity elsewhere)."""
    bounds = offsets if offsets is not None else lengths
    kind = _SEGMENT_NAMES.get(reduce)
    if (kind is None or indices is not None or bounds is None or data.dtype not in FLOATS
            or bounds.dtype not in (torch.int32, torch.int64) or not on_one_device(data, bounds)
            or data.dim() < bounds.dim() or bounds.dim() == 0 or not -data.dim() <= axis < data.dim()):
        raise Unsupported("an unsupported reduction, dtype or layout")  # the CPU raises its error for bad ones
    axis = canonicalize_dim(data.dim(), axis)
    if axis != bounds.dim() - 1:
        raise Unsupported("an axis other than the bounds' last dim")
    lead, n, rest = data.shape[:axis], data.shape[axis], data.shape[axis + 1:]
    b, inner = math.prod(lead), math.prod(rest)
    bounds_off = _segment_offsets(lengths if offsets is None else None, offsets, n, unsafe)
    s = bounds_off.shape[-1] - 1
    if b * s * n * max(inner, 1) > SEGMENT_LIMIT:
        raise Unsupported("a selection beyond SEGMENT_LIMIT")
    pos = torch.arange(n, dtype=torch.int32, device=data.device)
    member = (pos >= bounds_off[:, :s, None]) & (pos < bounds_off[:, 1:, None])          # [B, S, N]
    # bf16/fp16 reduce in fp32 and round once (rounding the sum, then initial and the mean's division, drifted)
    x = data.reshape(b, 1, n, inner).to(torch.float32)
    masked = torch.where(member[..., None], x, _SEGMENT_FILL[kind])                           # [B, S, N, I]
    if kind in ("sum", "mean"):
        res = masked.sum(2)
    elif kind == "prod":
        res = masked.prod(2)
    else:
        res = masked.amax(2) if kind == "max" else masked.amin(2)
    if initial is not None:
        res = {"sum": torch.add, "mean": torch.add, "prod": torch.mul, "max": torch.maximum,
               "min": torch.minimum}[kind](res, torch.full_like(res, initial))
    if kind == "mean":
        count = (bounds_off[:, 1:] - bounds_off[:, :s]).to(res.dtype)[..., None]
        res = res / count
        if initial is not None:  # an empty segment's mean is the initial value
            res = torch.where(count == 0, torch.full_like(res, initial), res)
    return res.to(data.dtype).reshape(*lead, s, *rest)

