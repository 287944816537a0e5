"""Multi-tensor element-wise kernels: one launch applies a tile function to every tensor of a list
(what ``torch._foreach_*`` ops and the optimizers built on them do), instead of one launch each.

``foreach_kernel(count, arity, kinds)`` is the kernel for ``count`` groups of ``arity`` operands: group
i is the i-th tensor of each list (same shape, given flat as (1, n_i)) or a scalar operand.
``kinds`` says per operand position whether it is a tensor list ("full": one argument per group), one
scalar shared by every group ("shared": one (1, 1) argument, loaded once), or one scalar per group
("each": one (count, 1) argument, row i group i's). A scalar position is one argument so that a launch
binds one slot for it, not one per group.

The groups are packed side by side into [128, W] tiles (W <= 2048 columns): a tensor of n elements
takes n // 128 full columns (partition r holding a contiguous run, as the element-wise template lays
out a flat tensor) and, for the n % 128 left over, one more column of that many rows. Each operand of
a packed tile is loaded by one DMA per tensor segment, the tile function runs once over the whole
tile (a shared scalar as a [128, 1] column, per-group scalars broadcast over their columns), and each
segment is stored back. Element-wise math does not depend on where an element sits, so the results
are bit-identical to the single-tensor ops; a list of small tensors (an optimizer's parameters) costs
a few compute instructions instead of a few per tensor.
"""
from __future__ import annotations

import collections
import functools
import inspect

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import DMA_ROW_BYTES, PMAX, check_sbuf
from torchneuron.kernels.elementwise import NAMES, NBUF, _apply, _widen


def operand_name(group: int, position: int) -> str:
    """The kernel argument holding operand ``position`` of group ``group``."""
    return f"{NAMES[position]}{group}"


FMAX = DMA_ROW_BYTES // 4   # columns of a packed tile (as the element-wise template's tiles)


def _segments(sizes: list[int]) -> list[list[tuple[int, int, int, int, int]]]:
    """Packed tiles, each a list of (group, first element, rows, columns, first column) segments."""
    tiles, cur, width = [], [], 0
    for i, n in enumerate(sizes):
        q, r = divmod(n, PMAX)
        pieces = [(i, e0, PMAX, min(FMAX, q - e0 // PMAX)) for e0 in range(0, q * PMAX, PMAX * FMAX)]
        if r:
            pieces.append((i, q * PMAX, r, 1))
        for i_, e0, p, f in pieces:
            if width + f > FMAX:
                tiles.append(cur)
                cur, width = [], 0
            cur.append((i_, e0, p, f, width))
            width += f
    if cur:
        tiles.append(cur)
    return tiles


def _region(flat, e0: int, p: int, f: int):
    """Elements [e0, e0 + p*f) of a (1, n) HBM tensor as [p, f] (each partition a contiguous run)."""
    return flat.reshape((flat.shape[1],))[e0:e0 + p * f].reshape((p, f))


def _packed(groups: list[list], kinds: tuple[str, ...], fn, out_dtype, compute=nl.float32,
            into_first: bool = False) -> tuple:
    """Apply ``fn`` to every group's operands through packed tiles (see the module docstring); ``into_first``: write
    each group's result over its first operand (in place: each segment is stored after it is loaded)."""
    n_in = sum(k != "shared" for k in kinds)
    check_sbuf((n_in + 2) * NBUF * FMAX * 4 + PMAX * 4 * len(kinds), "foreach")
    outs = [g[0] if into_first else nl.ndarray(g[0].shape, out_dtype, buffer=nl.shared_hbm) for g in groups]
    shared = {}
    for j, kind in enumerate(kinds):
        if kind == "shared":   # one [128, 1] column for every group
            shared[j] = nl.ndarray((PMAX, 1), compute, buffer=nl.sbuf)
            nisa.dma_copy(dst=shared[j], src=groups[0][j].broadcast_to((PMAX, 1)))
    ring = collections.deque(maxlen=NBUF)
    for segs in _segments([g[0].shape[1] for g in groups]):
        W = segs[-1][4] + segs[-1][3]
        tiles = []
        for j, kind in enumerate(kinds):
            if kind == "shared":
                tiles.append(shared[j])
                continue
            x = nl.ndarray((PMAX, W), compute, buffer=nl.sbuf)
            for i, e0, p, f, c in segs:
                src = groups[i][j]
                src = _region(src, e0, p, f) if kind == "full" else src.broadcast_to((p, f))
                nisa.dma_copy(dst=x[:p, c:c + f], src=src)
            tiles.append(x)
        y = _widen(_apply(fn, tiles), PMAX, W, compute)
        for i, e0, p, f, c in segs:
            nisa.dma_copy(dst=_region(outs[i], e0, p, f), src=y[:p, c:c + f])
        ring.append(tiles + [y])
    return tuple(outs)


@functools.cache
def foreach_kernel(count: int, arity: int, kinds: tuple[str, ...], inplace: bool = False) -> nki.Kernel:
    """The kernel over ``count`` groups of ``arity`` operands of ``kinds`` (arguments ``a0, b0, ..., a1,
    ...``, plus ``fn``, the tile function, and ``out_dtype``); it returns one output per group, or with ``inplace``
    writes each group's result over its first operand (of ``out_dtype``) and returns nothing: a launch binds each
    such tensor once, not as an input and again as an output."""
    assert 1 <= arity <= len(NAMES), f"foreach_kernel: {arity} operands per group (at most {len(NAMES)})"
    assert len(kinds) == arity and kinds[0] == "full" and set(kinds) <= {"full", "shared", "each"}, kinds
    # a scalar position is one argument (named as group 0's), bound once per launch instead of once per group
    names = [operand_name(i, j) for i in range(count) for j in range(arity) if i == 0 or kinds[j] == "full"]

    def operand(kw: dict, i: int, j: int):
        """Group ``i``'s operand ``j``: its tensor, the shared (1, 1) scalar, or row i of the (count, 1) scalars."""
        kind = kinds[j]
        if kind == "full":
            return kw[operand_name(i, j)]
        arg = kw[operand_name(0, j)]
        assert arg.shape == ((1, 1) if kind == "shared" else (count, 1)), f"foreach: {kind} operand {j} is {arg.shape}"
        return arg if kind == "shared" else arg[i:i + 1, :]

    def body(**kw):
        groups = [[operand(kw, i, j) for j in range(arity)] for i in range(count)]
        outs = _packed(groups, kinds, kw["fn"], kw["out_dtype"], into_first=inplace)
        return None if inplace else outs

    kind = inspect.Parameter.KEYWORD_ONLY
    body.__signature__ = inspect.Signature(
        [inspect.Parameter(n, kind) for n in names] + [inspect.Parameter("fn", kind),
                                                       inspect.Parameter("out_dtype", kind, default=nl.float32)])
    body.__name__ = body.__qualname__ = f"foreach{arity}_x{count}" + ("_inplace" if inplace else "")
    return nki.jit(body)


@functools.cache
def foreach_norm_kernel(count: int) -> nki.Kernel:
    """The 2-norm of each of ``count`` flat float tensors (arguments ``a0, a1, ...``, each (1, n_i); ``out_dtype``:
    the norms' dtype), in one launch instead of ``_foreach_norm``'s one per tensor: each tensor's norm by the
    instructions ``norm2_kernel`` runs for a whole tensor (``linalg_vector_norm``) on its [n_i, 1] view (VectorE
    squares in fp32, the sum over 128 partitions, ScalarE's square root rounded once to ``out_dtype``), so each
    norm is bit-identical to the per-tensor op's. One (1, 1) output per tensor."""
    from torchneuron.kernels.reduction import norm2_into

    def body(**kw):
        norms = []
        for i in range(count):
            x = kw[operand_name(i, 0)]
            out = nl.ndarray((1, 1), kw["out_dtype"], buffer=nl.shared_hbm)
            norm2_into(x.reshape((x.shape[1], 1)), out)
            norms.append(out)
        return tuple(norms)

    kind = inspect.Parameter.KEYWORD_ONLY
    body.__signature__ = inspect.Signature([inspect.Parameter(operand_name(i, 0), kind) for i in range(count)] +
                                           [inspect.Parameter("out_dtype", kind, default=nl.float32)])
    body.__name__ = body.__qualname__ = f"foreach_norm_x{count}"
    return nki.jit(body)
