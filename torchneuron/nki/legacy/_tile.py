"""The legacy (``neuronxcc.nki``) tile: affine index vectors (``nl.arange``/``nl.mgrid``), ``mask=``
predicates, ``par_dim`` block dims and ``+=`` accumulation, on top of the current ``NkiTensor``.

An index vector is an affine expression ``const + sum(coeff * var)`` over *axis variables*; each variable
has a size and a broadcast position (``nl.arange(128)[:, None]`` is position 0 of 2). Indexing a tensor
with such expressions becomes one access pattern: position 0 is the partition dim on chip, the other
positions are free dims whose strides are the sums of ``coeff * stride`` over the tensor dims they
appear in. A mask must select a box (a contiguous range per position); it narrows every operand.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from torchneuron.nki.tracing import IndexOutOfBounds, NkiTensor, check_index, current, ds, sbuf
from torchneuron.sim import AP, SimulatorError


class _Var:
    """One axis variable: ``size`` values at broadcast ``pos`` of an ``ndim``-dim index grid."""

    __slots__ = ("size", "pos", "ndim")

    def __init__(self, size: int, pos: int, ndim: int):
        self.size, self.pos, self.ndim = int(size), int(pos), int(ndim)


class IndexExpr:
    """An affine index expression (``nl.arange``/``nl.mgrid`` values and arithmetic on them)."""

    def __init__(self, terms: dict[_Var, int], const: int = 0):
        self.terms = {v: c for v, c in terms.items() if c}
        self.const = int(const)

    # arithmetic (affine only)
    def __add__(self, o: Any) -> "IndexExpr":
        if isinstance(o, IndexExpr):
            terms = dict(self.terms)
            for v, c in o.terms.items():
                terms[v] = terms.get(v, 0) + c
            return IndexExpr(terms, self.const + o.const)
        return IndexExpr(self.terms, self.const + int(o))

    __radd__ = __add__

    def __neg__(self) -> "IndexExpr":
        return IndexExpr({v: -c for v, c in self.terms.items()}, -self.const)

    def __sub__(self, o: Any) -> "IndexExpr":
        return self + (-o)

    def __rsub__(self, o: Any) -> "IndexExpr":
        return (-self) + o

    def __mul__(self, o: Any) -> "IndexExpr":
        if isinstance(o, IndexExpr):
            raise TypeError("index expressions are affine: multiply them by integers only")
        o = int(o)
        return IndexExpr({v: c * o for v, c in self.terms.items()}, self.const * o)

    __rmul__ = __mul__

    def __getitem__(self, index: Any) -> "IndexExpr":
        """``nl.arange(n)[:, None]``: place a 1-variable expression at the slice's position."""
        index = index if isinstance(index, tuple) else (index,)
        slots = [k for k, i in enumerate(index) if isinstance(i, slice)]
        if len(self.terms) != 1 or len(slots) != 1 or any(i is not None for k, i in enumerate(index) if k != slots[0]):
            raise TypeError("index vectors are placed with [:, None] / [None, :] style indexing")
        (v, c), = self.terms.items()
        return IndexExpr({_Var(v.size, slots[0], len(index)): c}, self.const)

    @property
    def ndim(self) -> int:
        return max((v.ndim for v in self.terms), default=0)

    def values(self, ndim: int) -> np.ndarray:
        """The expression evaluated on its grid (broadcast over ``ndim`` positions)."""
        out = np.asarray(self.const, dtype=np.int64)
        for v, c in self.terms.items():
            shape = [1] * ndim
            shape[v.pos] = v.size
            out = out + c * np.arange(v.size).reshape(shape)
        return out

    # comparisons build mask predicates
    def _cmp(self, o: Any, op: str) -> "Pred":
        return Pred([(self, o, op)])

    __lt__ = lambda s, o: s._cmp(o, "lt")  # noqa: E731
    __le__ = lambda s, o: s._cmp(o, "le")  # noqa: E731
    __gt__ = lambda s, o: s._cmp(o, "gt")  # noqa: E731
    __ge__ = lambda s, o: s._cmp(o, "ge")  # noqa: E731

    def __repr__(self) -> str:
        terms = " + ".join(f"{c}*v{v.pos}[{v.size}]" for v, c in self.terms.items())
        return f"IndexExpr({terms} + {self.const})"


class Pred:
    """A mask: a conjunction of comparisons between index expressions (and integers)."""

    def __init__(self, clauses: list):
        self.clauses = clauses

    def __and__(self, o: "Pred") -> "Pred":
        return Pred(self.clauses + o.clauses)

    __rand__ = __and__

    def exprs(self) -> list:
        return [e for lhs, rhs, _ in self.clauses for e in (lhs, rhs) if isinstance(e, IndexExpr)]

    def grid(self) -> np.ndarray:
        """The predicate on the full grid of its variables (dims: positions)."""
        ndim = max(e.ndim for e in self.exprs())
        val = lambda e: e.values(ndim) if isinstance(e, IndexExpr) else np.asarray(e)  # noqa: E731
        out = np.ones([1] * ndim, dtype=bool)
        for lhs, rhs, op in self.clauses:
            out = out & getattr(operator, op)(val(lhs), val(rhs))
        sizes = [1] * ndim
        for e in self.exprs():
            for v in e.terms:
                sizes[v.pos] = max(sizes[v.pos], v.size)
        return np.broadcast_to(out, sizes)


Restriction = dict  # position -> (lo, n): the values of that position's variable the mask keeps


def restriction(mask: Any) -> Restriction | None:
    """The box a mask selects (``None``: no mask); for a mask that is not a box, its bounding box (the
    callers that must not touch the other elements use ``boxes`` or ``fill_masked``)."""
    if mask is None:
        return None
    if isinstance(mask, (bool, np.bool_)):
        return None if mask else {0: (0, 0)}
    g = _grid(mask)
    box: Restriction = {}
    for pos in range(g.ndim):
        keep = np.flatnonzero(g.any(axis=tuple(a for a in range(g.ndim) if a != pos)))
        if len(keep) == 0:
            return {pos: (0, 0)}
        lo, n = int(keep[0]), int(keep[-1] - keep[0] + 1)
        if (lo, n) != (0, g.shape[pos]):
            box[pos] = (lo, n)
    return box


def _grid(mask: Any) -> np.ndarray:
    if not isinstance(mask, Pred):
        raise TypeError(f"mask= takes a comparison of nl.arange/nl.mgrid index expressions, not {mask!r}")
    return mask.grid()


def is_box(mask: Any) -> bool:
    """Whether the mask selects exactly its bounding box (no mask counts as a box)."""
    if not isinstance(mask, Pred):
        return True
    g = _grid(mask)
    box = restriction(mask)
    if is_empty(box):
        return True
    want = np.zeros(g.shape, dtype=bool)
    want[tuple(slice(lo, lo + n) for lo, n in (box.get(p, (0, g.shape[p])) for p in range(g.ndim)))] = True
    return bool(np.array_equal(g, want))


def boxes(mask: Any) -> list[Restriction | None]:
    """The mask as disjoint boxes that cover exactly its elements (one box, or ``[None]``, when it is one):
    runs of equal sub-masks along each axis in turn (a ragged last row of a flattened tensor: two boxes)."""
    if is_box(mask):
        return [] if is_empty(restriction(mask)) else [restriction(mask)]
    g = _grid(mask)
    out = []
    for ranges in _runs(g):
        out.append({p: r for p, r in enumerate(ranges) if r != (0, g.shape[p])})
    return out


def _runs(g: np.ndarray) -> list[list[tuple[int, int]]]:
    if g.ndim == 0:
        return [[]] if bool(g) else []
    out, k, n = [], 0, g.shape[0]
    while k < n:
        j = k + 1
        while j < n and np.array_equal(g[j], g[k]):
            j += 1
        out.extend([(k, j - k), *sub] for sub in _runs(g[k]))
        k = j
    return out


def contraction_range(mask: Any, what: str) -> tuple[int, int] | None:
    """The contraction (partition, grid position 0) range a matmul ``mask=`` selects, or None for all of it.
    The contraction must be one range for every output element (a box along position 0)."""
    box = restriction(mask)
    if box is None:
        return None
    if is_empty(box):
        raise SimulatorError(f"{what}: the mask selects no elements")
    g = _grid(mask)
    rows = g.any(axis=tuple(range(1, g.ndim))) if g.ndim > 1 else g
    lo, n = box.get(0, (0, g.shape[0]))
    inside = g[lo:lo + n]
    if not rows[lo:lo + n].all() or not np.array_equal(inside, np.broadcast_to(inside.any(0), inside.shape)):
        raise NotImplementedError(f"{what}: mask= must select one contraction (partition) range for every "
                                  f"output element")
    return box.get(0)


_CMP_NAMES = {"lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal"}


def fill_masked(t: Any, mask: Any, box: Restriction, value: float) -> NkiTensor:
    """A new SBUF copy of ``t``'s part inside the mask's bounding ``box`` with the elements the mask leaves
    out set to ``value`` (one GpSimd ``affine_select`` per comparison of the mask)."""
    from torchneuron.nki import isa as nisa
    src = narrow_dims(t, box)
    out = current().allocate(tuple(src.shape), src.dtype, sbuf)
    nisa.tensor_copy(dst=out, src=src)
    rank = len(out.shape)
    for lhs, rhs, op in mask.clauses:
        e = (lhs if isinstance(lhs, IndexExpr) else IndexExpr({}, lhs)) - rhs
        coef = [0] * rank
        for v, c in e.terms.items():
            if v.pos >= rank:
                raise NotImplementedError(f"mask= names grid position {v.pos} of a rank-{rank} operand")
            coef[v.pos] += c
        offset = e.const + sum(c * box.get(p, (0, 0))[0] for p, c in enumerate(coef))
        nisa.affine_select(dst=out, pattern=[[coef[d], out.shape[d]] for d in range(1, rank)],
                           channel_multiplier=coef[0], on_true_tile=out, on_false_value=value,
                           cmp_op=_CMP_NAMES[op], offset=offset)
    return out


def is_empty(box: Restriction | None) -> bool:
    """Whether the mask selects nothing."""
    return bool(box) and any(n == 0 for _, n in box.values())


def narrow(t: Any, box: Restriction | None) -> Any:
    """The part of a tile (an index-expression view, or a plain tile by its dims) a mask keeps."""
    if not box or not isinstance(t, NkiTensor):
        return t
    if isinstance(t, LegacyTile) and t._adv is not None:
        parent, items = t._adv
        return parent._advanced(items, box)
    index = []
    for d, n in enumerate(t.shape):
        lo, m = box.get(d, (0, n))
        index.append(slice(lo, lo + m) if n > 1 or d == 0 else slice(None))
    return NkiTensor.__getitem__(t, tuple(index))


def narrow_dims(t: Any, box: Restriction | None) -> Any:
    """Narrow a plain tile by its dims (also when it is itself an index-expression view)."""
    if not box or not isinstance(t, NkiTensor):
        return t
    index = []
    for d, n in enumerate(t.shape):
        lo, m = box.get(d, (0, n))
        index.append(slice(lo, lo + m) if n > 1 or d == 0 else slice(None))
    return NkiTensor.__getitem__(t, tuple(index))


class LegacyTile(NkiTensor):
    """A tensor of a legacy kernel: adds index-vector indexing, block dims (``par_dim``) and ``+=``."""

    _blocks = 0       # leading block dims (shape (B..., par_dim(P), F...)): stored as (P, B..., F...)
    _adv = None       # (parent, items) for a view made with index expressions (so a mask can narrow it)
    _pending = None   # for an nc_matmul result: (instruction, stationary, moving, options)
    _column = False   # an HBM view left 1-D by an integer index on the last dim: loads as (N, 1)

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.access.shape
        if self._blocks:
            return (*s[1:1 + self._blocks], s[0], *s[1 + self._blocks:])
        return s

    def _items(self, index: Any) -> tuple:
        items = tuple(index) if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in items):
            at = items.index(Ellipsis)
            items = items[:at] + (slice(None),) * (len(self.shape) - len(items) + 1) + items[at + 1:]
        items = tuple(i.as_slice() if isinstance(i, ds) else i for i in items)
        if self._blocks:
            k = self._blocks
            items = items + (slice(None),) * (len(self.shape) - len(items))
            items = (items[k], *items[:k], *items[k + 1:])
        return items

    def __getitem__(self, index: Any) -> "LegacyTile":
        items = self._items(index)
        if any(isinstance(i, IndexExpr) for i in items):
            return self._plain()._advanced(items, None)
        items = tuple(int(i) if isinstance(i, np.integer) else i for i in items)
        check_index(self.access.shape, items, self)
        t = self._plain()._view(self.access[items])
        if (not t.access.on_chip and len(items) == len(self.shape) >= 2 and len(t.shape) == 1
                and isinstance(items[-1], (int, np.integer))):
            t._column = True  # `A[c0:c0 + 128, j]`: the remaining dim loads onto partitions, as (128, 1)
        return t

    def _plain(self) -> "LegacyTile":
        if not self._blocks:
            return self
        t = LegacyTile(self.access, self.buffer, self.name, self.base)
        t._keep = self  # the storage stays alive while views exist
        return t

    def _advanced(self, items: tuple, box: Restriction | None) -> "LegacyTile":
        """One access pattern for index-expression (and integer) items; ``box`` narrows the variables."""
        a = self.access
        if len(items) != len(a.shape):
            raise IndexError(f"index vectors must index every dim of a {a.shape} tensor, got {len(items)}")
        exprs = [i if isinstance(i, IndexExpr) else IndexExpr({}, _int(i)) for i in items]
        ndim = max([e.ndim for e in exprs] + [1])
        box = box or {}
        sizes = [1] * ndim
        for e in exprs:
            for v in e.terms:
                sizes[v.pos] = v.size
        lo = [box.get(p, (0, sizes[p]))[0] for p in range(ndim)]
        sizes = [box.get(p, (0, sizes[p]))[1] for p in range(ndim)]
        item = a.dtype.itemsize
        strides = [st for st, _ in a.pattern]
        offset, start_p, parts = a.offset, a.start_partition, a.partitions
        dims = list(enumerate(exprs))
        if a.on_chip:
            (_, p), dims = dims[0], dims[1:]
            if any(v.pos != 0 or c != 1 for v, c in p.terms.items()) or any(
                    v.pos == 0 for _, e in dims for v in e.terms):
                raise NotImplementedError("on chip the partition index must be position 0 of the grid "
                                          "(e.g. nl.arange(128)[:, None]) and appear only in dim 0")
            start_p = start_p + p.const + (lo[0] if p.terms else 0)
            parts = sizes[0] if p.terms else 1
        free = [0] * ndim
        for d, e in dims:
            st = strides[d - 1] if a.on_chip else strides[d]
            offset += e.const * st * item
            for v, c in e.terms.items():
                free[v.pos] += c * st
                offset += c * lo[v.pos] * st * item
        first = 1 if a.on_chip else 0
        pattern = tuple((free[p], sizes[p]) for p in range(first, ndim))
        if any(n == 0 for n in sizes):
            raise SimulatorError("a mask selects no elements of this access")
        oob = _out_of_bounds(exprs, a.shape, lo, sizes, self)
        if oob and box:
            raise IndexOutOfBounds(oob)
        t = self._view(AP(a.memory, a.dtype, pattern, start_p, parts, offset))
        if not box:
            t._adv = (self, items)
            # without a mask this access reaches outside the tensor; a mask may still confine it (load/store
            # narrow the view to the mask's boxes), so the error is raised where it is used unmasked
            t._oob = oob
        return t

    def __setitem__(self, index: Any, value: Any) -> None:
        dst = self[index]
        if isinstance(value, NkiTensor) and value.access == dst.access:
            return  # the write-back of `t[idx] += x` (already done in place)
        if isinstance(value, LegacyTile) and value._pending is not None and dst.buffer.name == "psum":
            value._retarget(dst, accumulate=False)
            return
        NkiTensor.__setitem__(self, index, value)

    def __iadd__(self, other: Any) -> "LegacyTile":
        if isinstance(other, LegacyTile) and other._pending is not None and self.buffer.name == "psum":
            other._retarget(self, accumulate=True)
            return self
        from torchneuron.nki import isa as nisa
        if isinstance(other, NkiTensor) and tuple(other.shape) == tuple(self.shape):
            if self.buffer.name == "psum" and other.buffer.name == "psum":  # the engines read one PSUM input
                staged = current().allocate(tuple(other.shape), other.dtype, sbuf)
                nisa.tensor_copy(dst=staged, src=other)
                other = staged
            nisa.tensor_tensor(dst=self, data1=self, data2=other, op="add")
        else:
            nisa.tensor_scalar(dst=self, data=self, op0="add", operand0=other)
        return self

    def _retarget(self, dst: NkiTensor, accumulate: bool) -> None:
        """Emit this pending matmul into ``dst`` (``+=``: accumulate) instead of its own PSUM tile."""
        from torchneuron.nki import isa as nisa
        instr, stationary, moving, options = self._pending
        trace = current()
        if trace.instructions and trace.instructions[-1] is instr:
            trace.retract(instr)  # its own tile was never read: drop the first emission
        if accumulate and dst.dtype.itemsize == 4 and not bool(trace.psum_flags(dst.access, written=True).any()):
            accumulate = False  # `+=` into a never-written PSUM tile starts the group (the compiler zeroed it)
        nisa.nc_matmul(dst=dst, stationary=stationary, moving=moving, accumulate=accumulate, **options)


def _out_of_bounds(exprs: list, shape: tuple, lo: list, sizes: list, what: object) -> str | None:
    """The message for the first dim an index expression reaches outside of (its range over the grid
    positions ``[lo, lo + size)``), or None when every dim stays inside the tensor."""
    for d, (e, bound) in enumerate(zip(exprs, shape)):
        low = high = e.const
        for v, c in e.terms.items():
            first, last = c * lo[v.pos], c * (lo[v.pos] + sizes[v.pos] - 1)
            low, high = low + min(first, last), high + max(first, last)
        if low < 0 or high >= bound:
            return (f"{what}: index {e!r} of dim {d} takes values [{low}, {high}], out of bounds for size {bound} "
                    f"(each dim is bounds-checked on its own; use mask= to leave elements out)")
    return None


def _int(i: Any) -> int:
    if isinstance(i, slice):
        # neuronxcc.nki rejects this too (err_unsupported_mixing_basic_advanced_tensor_indexing), so a kernel
        # that runs here keeps compiling there
        raise NotImplementedError("Mixing basic tensor indexing and advanced tensor indexing is not supported: "
                                  "use nl.arange/nl.mgrid index vectors for every dim (e.g. a[i_p, i_f] with "
                                  "i_f = nl.arange(n)[None, :]) or slices/integers for every dim")
    return int(i)


def block_tile(shape: tuple, dtype: Any, buffer: Any, name: str) -> LegacyTile:
    """A tensor with leading block dims ``(B..., par_dim(P), F...)`` (stored as (P, B..., F...))."""
    k = next(i for i, s in enumerate(shape) if isinstance(s, ParDim))
    stored = (shape[k], *shape[:k], *shape[k + 1:])
    t = current().allocate(stored, dtype, buffer, name, blocks=math.prod(int(s) for s in shape[:k]))
    t._blocks = k
    return t


class ParDim(int):
    """``nl.par_dim(n)``: marks the partition dim in a shape."""
