"""``neuronxcc.nki.language`` (earlier generation) on top of ``torchneuron.nki.language``.

Adds ``nl.arange``/``nl.mgrid`` index vectors, ``mask=`` on data movement and compute, ``nl.par_dim``
block dims, ``buffer=None`` meaning SBUF, and NumPy dtypes. Every value-returning call allocates its
result in SBUF (``matmul``/``transpose``: PSUM), as the generation did.
"""
from __future__ import annotations

import builtins
import itertools
from typing import Any, Sequence

from torchneuron.nki import isa as _nisa
from torchneuron.nki import language as _nl
from torchneuron.nki.language import *  # noqa: F401,F403
from torchneuron.nki.language import (affine_range, bfloat16, float32, num_programs, program_id,  # noqa: F401
                                      sequential_range, static_range, tile_size)
from torchneuron.nki.legacy._tile import (IndexExpr, ParDim, _Var, block_tile, boxes, contraction_range, fill_masked,
                                          is_box, narrow, narrow_dims, restriction)
from torchneuron.sim import AP
from torchneuron.nki.tracing import NkiTensor, current, psum, sbuf, shared_hbm, hbm, private_hbm  # noqa: F401

Tile = NkiTensor


# ---- index vectors ---------------------------------------------------------------------------

def arange(start: int, stop: int | None = None) -> IndexExpr:
    """A 1-D index vector ``start..stop-1``; place it with ``[:, None]`` (partition) / ``[None, :]`` (free)."""
    lo, hi = (0, start) if stop is None else (start, stop)
    return IndexExpr({_Var(hi - lo, 0, 1): 1}, lo)


class _Grid(tuple):
    """The tuple ``nl.mgrid[...]`` returns; also ``.p`` (dim 0) and ``.x``, ``.y``, ``.z`` (dims 1-3)."""

    p = property(lambda s: s[0])
    x = property(lambda s: s[1])
    y = property(lambda s: s[2])
    z = property(lambda s: s[3])


class _MGrid:
    def __getitem__(self, index: Any) -> _Grid:
        index = index if isinstance(index, tuple) else (index,)
        n = len(index)
        out = []
        for k, s in enumerate(index):
            lo, hi = (s.start or 0), s.stop
            out.append(IndexExpr({_Var(hi - lo, k, n): 1}, lo))
        return _Grid(out)


mgrid = _MGrid()


def par_dim(n: int) -> ParDim:
    """Mark the partition dim of a shape: ``(n_tiles, nl.par_dim(128), 512)`` has one block dim."""
    return ParDim(n)


class SpmdDim(int):
    """A launch-grid dim of ``size`` instances spread over ``cores`` NeuronCores: index ``i`` runs on core
    ``i // (size // cores)`` when the core factor is the major one (``nl.nc(2) * 2``, ``spmd_dim(nl.nc(2), 2)``),
    else on core ``i % cores`` (``spmd_dim(g, nl.nc(2))``)."""

    cores: int = 1
    core_major: bool = True

    @classmethod
    def of(cls, size: int, cores: int, core_major: bool) -> "SpmdDim":
        """The dim of ``size`` instances over ``cores`` cores."""
        dim = cls(size)
        dim.cores, dim.core_major = cores, core_major
        return dim

    def core(self, i: int) -> int:
        """The core instance ``i`` of this dim runs on."""
        return i // (int(self) // self.cores) if self.core_major else i % self.cores

    def __mul__(self, other: Any) -> Any:
        if isinstance(other, SpmdDim) and other.cores > 1 and self.cores > 1:
            return NotImplemented
        if self.cores > 1 and isinstance(other, int):   # nl.nc(2) * 2: the core factor first
            return SpmdDim.of(int(self) * other, self.cores, True)
        if isinstance(other, SpmdDim) and other.cores > 1:  # 2 * ... handled by __rmul__
            return SpmdDim.of(int(self) * int(other), other.cores, False)
        return int(self) * other

    def __rmul__(self, other: Any) -> Any:
        if self.cores > 1 and isinstance(other, int):   # 2 * nl.nc(2): the core factor last
            return SpmdDim.of(other * int(self), self.cores, False)
        return other * int(self)


def spmd_dim(*sizes: Any) -> int:
    """``nl.spmd_dim(g, nl.nc(2))``: a grid dim of the product; its ``nl.nc`` factor spreads the instances over
    that many NeuronCores (``SpmdDim``), the core factor major when it comes first."""
    out, cores, major = 1, 1, True
    for k, s in enumerate(sizes):
        if isinstance(s, SpmdDim) and s.cores > 1:
            cores, major = s.cores, k == 0
        out *= int(s)
    return SpmdDim.of(out, cores, major) if cores > 1 else out


def nc(n: int) -> "SpmdDim":
    """``nl.nc(n)``: n NeuronCores, a grid factor whose instances run on cores of their own."""
    return SpmdDim.of(int(n), int(n), True)


# ---- creation --------------------------------------------------------------------------------

def _buf(buffer: Any) -> Any:
    return sbuf if buffer is None else buffer


def ndarray(shape: Sequence[int], dtype: Any, buffer: Any = None, name: str = "", **_: Any) -> Tile:
    """An uninitialised tensor (``buffer=None``: SBUF; a ``par_dim`` after leading dims makes block dims)."""
    shape = tuple(shape)
    if any(isinstance(s, ParDim) for s in shape[1:]):
        return block_tile(shape, dtype, _buf(buffer), name)
    return current().allocate(tuple(int(s) for s in shape), dtype, _buf(buffer), name)


def full(shape: Sequence[int], fill_value: Any, dtype: Any, buffer: Any = None, name: str = "", **_: Any) -> Tile:
    """A tensor filled with ``fill_value``."""
    t = ndarray(shape, dtype, buffer, name)
    if not t._blocks:
        _nisa.memset(dst=t[...], value=fill_value)
        return t
    for index in itertools.product(*(range(n) for n in t.shape[:t._blocks])):
        _nisa.memset(dst=t[index], value=fill_value)  # block tiles are independent: one memset each
    return t


def zeros(shape: Sequence[int], dtype: Any, buffer: Any = None, name: str = "", **_: Any) -> Tile:
    """A zero-filled tensor (in PSUM: a fresh accumulator for ``+=`` matmuls)."""
    return full(shape, 0, dtype, buffer, name)


def ones(shape: Sequence[int], dtype: Any, buffer: Any = None, name: str = "", **_: Any) -> Tile:
    """A tensor of ones."""
    return full(shape, 1, dtype, buffer, name)


def zeros_like(x: Tile, dtype: Any = None, buffer: Any = None, name: str = "") -> Tile:
    """Zeros shaped like ``x``."""
    return zeros(x.shape, dtype or x.dtype, buffer, name)


# ---- data movement ---------------------------------------------------------------------------

def load(src: Tile, mask: Any = None, dtype: Any = None, **_: Any) -> Tile:
    """HBM (or an index-vector view of it) -> a new SBUF tile; ``mask=`` loads only the selected elements
    (one DMA per box of the mask)."""
    if getattr(src, "_column", False):  # `A[c0:c0 + P, j]`: a (P, 1) column, not a (1, P) row
        a = src.access
        src = src._view(AP(a.memory, a.dtype, (*a.pattern, (1, 1)), a.start_partition, a.partitions, a.offset))
    shape = src.shape if len(src.shape) > 1 else (1, *src.shape)
    t = current().allocate(shape, dtype or src.dtype, sbuf)
    for box in _mask_boxes(mask):
        _nisa.dma_copy(dst=narrow_dims(t, box), src=narrow(src, box))
    return t


def _mask_boxes(mask: Any) -> list:
    """Boxes covering exactly the mask's elements (``[None]`` without a mask; ``[]`` when it selects none)."""
    return [None] if mask is None else boxes(mask)


def store(dst: Tile, value: Any, mask: Any = None, **_: Any) -> None:
    """SBUF tile -> HBM; ``mask=`` stores only the selected elements (one DMA per box of the mask)."""
    regions = _mask_boxes(mask)
    if not regions:
        return
    if not isinstance(value, NkiTensor):
        value = full(dst.shape, value, dst.dtype)
    value = _evict(value)
    for box in regions:
        _nisa.dma_copy(dst=narrow(dst, box), src=narrow_dims(value, box))


def _evict(t: Any) -> Any:
    """A PSUM tile copied to SBUF (the compiler inserted this copy where ``nl.store`` / ``nl.matmul`` /
    ``nl.transpose`` got a PSUM tile: DMA and TensorE cannot read PSUM); other values unchanged."""
    if isinstance(t, NkiTensor) and t.buffer.name == "psum":
        out = current().allocate(tuple(t.shape), t.dtype, sbuf)
        _nisa.tensor_copy(dst=out, src=t)
        return out
    return t


def load_transpose2d(src: Tile, mask: Any = None, dtype: Any = None) -> Tile:
    """HBM [F, P] -> SBUF [P, F] with the axes swapped (DMA transpose)."""
    assert mask is None, "load_transpose2d mask= is not supported"
    t = current().allocate((src.shape[1], src.shape[0]), src.dtype, sbuf)
    _nisa.dma_transpose(dst=t, src=src)
    if dtype is None or _nl.as_dtype(dtype) == t.dtype:
        return t
    out = current().allocate(tuple(t.shape), dtype, sbuf)  # DMA transposes do not cast: cast on chip
    _nisa.tensor_copy(dst=out, src=t)
    return out


def _masked(fn, box, tiles: list, *rest: Any, narrowed: bool = False, full_shape: Any = None, **kw: Any) -> Tile:
    """Run ``fn`` on the mask's box of each tile and place the result in a full-size tile (``narrowed``:
    the tiles are already the box, ``full_shape`` the shape they came from). A mask that is not a box
    computes its bounding box: the elements it leaves out are undefined, as on the hardware."""
    if not box:
        return fn(*tiles, *rest, **kw)
    if full_shape is None:
        full_shape = next(t.shape for t in tiles if isinstance(t, NkiTensor))
    r = fn(*[t if narrowed else narrow_dims(t, box) for t in tiles], *rest, **kw)
    out_shape = [full_shape[d] if r.shape[d] == narrow_dims_size(box, d, full_shape) else r.shape[d]
                 for d in range(len(r.shape))]
    out = current().allocate(out_shape, r.dtype, sbuf if r.buffer.name != "psum" else psum)
    _nisa.tensor_copy(dst=narrow_dims(out, box), src=r)
    return out


def narrow_dims_size(box, d: int, shape) -> int:
    return box.get(d, (0, shape[d] if d < len(shape) else 1))[1]


def copy(x: Tile, mask: Any = None, dtype: Any = None) -> Tile:
    """A new SBUF copy (PSUM eviction)."""
    return _masked(_nl.copy, restriction(mask), [x], dtype=dtype)


def broadcast_to(x: Tile, shape: Sequence[int]) -> Tile:
    """Broadcast size-1 dims (a (1, F) row over partitions, a (P, 1) column over the free dim)."""
    return _nl.broadcast_to(x, tuple(shape))


# ---- element-wise ----------------------------------------------------------------------------

def _binary(name: str):
    base = getattr(_nl, name)

    def op(x: Any, y: Any, dtype: Any = None, mask: Any = None, **_: Any) -> Tile:
        box = restriction(mask)
        if not box:
            return base(x, y, dtype=dtype)
        return _masked(lambda a, b: base(a, b, dtype=dtype), box, [x, y])
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``{name}`` element-wise (``mask=`` computes the selected box); also an ``op=`` token."
    return op


add, subtract, multiply, divide, maximum, minimum, power = (
    _binary(n) for n in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power"))
equal, not_equal, greater, greater_equal, less, less_equal = (
    _binary(n) for n in ("equal", "not_equal", "greater", "greater_equal", "less", "less_equal"))


def _unary(name: str):
    base = getattr(_nl, name)

    def op(x: Tile, dtype: Any = None, mask: Any = None, **_: Any) -> Tile:
        return _masked(lambda a: base(a, dtype=dtype), restriction(mask), [x])
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``{name}(x)`` element-wise (ScalarE); also an ``op=`` token."
    return op


exp, log, tanh, sigmoid, relu, gelu, silu, sqrt, rsqrt, square, sin, cos, erf, softplus, reciprocal, negative = (
    _unary(n) for n in ("exp", "log", "tanh", "sigmoid", "relu", "gelu", "silu", "sqrt", "rsqrt", "square",
                        "sin", "cos", "erf", "softplus", "reciprocal", "negative"))
abs = _unary("abs")  # noqa: A001


def _trailing(x: Any, axis: Any, keepdims: bool) -> tuple:
    """Reorder an on-chip tile's free dims so the reduced ones come last (a free access-pattern
    permutation, as the compiler did for e.g. ``nl.sum(t[i0, 2*i1+i2, 2*i3+i4], axis=[2, 4])``).
    Returns ``(x, axis)``, unchanged when the reduced axes already trail or keep their dims."""
    if not isinstance(x, NkiTensor) or getattr(x, "_blocks", 0) or not x.access.on_chip:
        return x, axis
    rank = len(x.shape)
    axes = sorted({a % rank for a in ((axis,) if isinstance(axis, int) else axis)})
    if keepdims or 0 in axes or axes == list(range(rank - len(axes), rank)):
        return x, axis
    a = x.access
    kept = [d for d in range(1, rank) if d not in axes]
    pattern = tuple(a.pattern[d - 1] for d in kept + axes)
    view = x._view(AP(a.memory, a.dtype, pattern, a.start_partition, a.partitions, a.offset))
    return view, tuple(range(rank - len(axes), rank))


def _reduction(name: str):
    base = getattr(_nl, name)

    def op(x: Tile, axis: Any, dtype: Any = None, keepdims: bool = False, mask: Any = None, **_: Any) -> Tile:
        box = restriction(mask)
        if not box:
            x, axis = _trailing(x, axis, keepdims)
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        if not is_box(mask) and name != "mean":
            # the mask is not a box: the elements it leaves out get the reduction's identity first
            filled = fill_masked(x, mask, box, _IDENTITY[name])
            if any(d in box for d in axes):
                return base(filled, axis, dtype=dtype, keepdims=keepdims)
            return _masked(lambda a: base(a, axis, dtype=dtype, keepdims=keepdims), box, [filled], narrowed=True,
                           full_shape=x.shape)
        if not is_box(mask):
            raise NotImplementedError("nl.mean with a mask that is not a box (a per-row count) is not supported; "
                                      "use nl.sum with the mask and divide")
        if box and any(d in box for d in axes):
            # the reduced dims shrink: reduce the box directly, only the kept dims need the full tile
            return base(narrow_dims(x, box), axis, dtype=dtype, keepdims=keepdims)
        return _masked(lambda a: base(a, axis, dtype=dtype, keepdims=keepdims), box, [x])
    op.__name__ = op.__qualname__ = name
    op.__doc__ = (f"``{name}`` over free axes (non-trailing ones are moved last by reordering the access "
                  f"pattern; ``mask=`` reduces the selected box); also a reduce token.")
    return op


_IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}
sum, max, min, mean = (_reduction(n) for n in ("sum", "max", "min", "mean"))  # noqa: A001


# ---- TensorE ---------------------------------------------------------------------------------

def matmul(x: Tile, y: Tile, transpose_x: bool = False, mask: Any = None, **_: Any) -> Tile:
    """``x @ y`` (``x.T @ y`` with ``transpose_x=True``): a new fp32 PSUM tile. ``mask=`` narrows the
    contraction to the range its position 0 (``y``'s partitions) selects; output elements outside the
    mask are computed too (their values are undefined, as on the hardware)."""
    k = contraction_range(mask, "nl.matmul")
    x, y = _evict(x), _evict(y)
    if k is not None:
        x, y = narrow_dims(x, {0 if transpose_x else 1: k}), narrow_dims(y, {0: k})
    out = _nl.matmul(x, y, transpose_x=transpose_x)
    instr = current().instructions[-1]
    if instr.opcode == "nc_matmul" and instr.dst == out.access:
        # `acc += nl.matmul(...)` accumulates the matmul into acc's PSUM tile, as the compiler lowers it
        out._pending = (instr, instr.stationary, instr.moving, {})
    return out


def transpose(x: Tile, dtype: Any = None, mask: Any = None, **_: Any) -> Tile:
    """Partition/free swap on TensorE: a new PSUM tile (``mask=``: elements outside it are undefined; a
    transpose only moves values, so the whole tile is moved)."""
    restriction(mask)  # (checks the predicate)
    return _nl.transpose(_evict(x), dtype=dtype)


__all__ = [n for n in dir() if not n.startswith("_") and n not in (
    "annotations", "builtins", "itertools", "Any", "Sequence", "IndexExpr", "LegacyTile", "ParDim", "block_tile",
    "is_empty", "narrow", "narrow_dims", "restriction", "narrow_dims_size", "AP", "boxes", "fill_masked", "is_box",
    "contraction_range")]
del builtins
