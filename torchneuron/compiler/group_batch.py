"""Horizontal fusion: fusion groups that compute the same thing on different tensors, streamed as one pass.

A compiled optimizer step is one fusion group per parameter (``partition``): the same tile math over
tensors of many sizes. As passes of their own, a small tensor (a 64-element norm weight) pays a whole
pass's fixed work (every instruction's start-up, a DMA per operand) for a few elements, and a mid-sized
one is spread over 128 partitions in short rows (16384 elements as 512-byte DMA descriptors, two thirds
of a DMA engine's peak; 4096 as 128-byte ones, a third).

Groups of one *signature* (the same ops, constants and dtypes, operands of the same kinds) that follow
each other in a segment are laid out instead as rows of one width, tensor after tensor, over the
partitions of a few [128, F] tiles. Each tile is one evaluation of the group's tile math; each tensor's
rows in a tile move by one DMA per operand. A tensor's last row may be partial: the lanes past its end
hold whatever the tile held before, are computed and never stored. A scalar operand (a parameter's own
step size) becomes a column holding each tensor's value on that tensor's partitions.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.compiler.partition import FusionGroup
from torchneuron.compiler.values import Value, numel
from torchneuron.kernels._common import PMAX, alternating_elementwise, check_sbuf
from torchneuron.kernels.elementwise import NBUF, _widen

ROW_BYTES = 2048      # fp32 row of a packed tile: 512 elements, 2 KiB DMA descriptors (~89 % of an engine's peak)
MAX_TABLE_BYTES = 16384   # per partition: a larger vector of scalars is read column by column instead
MIN_TILES = 2         # rows narrowed (to 256 elements at least) until the tensors fill this many tiles, so one
                      # tile's loads overlap another's math


@dataclass(frozen=True)
class Piece:
    """Rows ``p0 .. p0 + rows`` of a packed tile holding tensor ``j``'s elements ``e0 .. e0 + rows * width``."""

    p0: int
    j: int
    e0: int
    rows: int
    width: int


def signature(g: FusionGroup, values: list) -> tuple | None:
    """What must be equal for groups to share one pass (None: ``g`` is not packable): its ops with their
    constants and dtypes, its wiring, and per operand its kind ("full": a contiguous tensor of the group's
    shape; "scalar": one element) and dtype; host constants by value."""
    if g.kind != "float" or numel(g.shape) <= 1:
        return None
    kinds = []
    for v in values:
        if isinstance(v, Value):
            if tuple(v.shape) == tuple(g.shape) and v.layout.is_contiguous():
                kinds.append(("full", v.dtype))
            elif numel(v.shape) == 1:
                kinds.append(("scalar", v.dtype))
            else:
                return None
        elif isinstance(v, (bool, int, float)):
            kinds.append(("const", type(v).__name__, repr(v)))
        else:
            return None
    if not any(k[0] == "full" for k in kinds):
        return None
    index = {n: ("node", i) for i, n in enumerate(g.nodes)}
    index.update({n: ("operand", i) for i, n in enumerate(g.inputs)})
    ops = tuple((str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda a: index[a])),
                 str(n.meta["val"].dtype)) for n in g.nodes)
    return ops, tuple(index[o] for o in g.outputs), tuple(kinds)


def row_width(sizes: list[int]) -> int:
    """Elements per partition row of the packed tiles (see ROW_BYTES, MIN_TILES)."""
    f = ROW_BYTES // 4
    while f > 256 and sum(-(-n // f) for n in sizes) < MIN_TILES * PMAX:
        f //= 2
    return f


def layout(sizes: list[int], f: int) -> list[list[Piece]]:
    """Tensors of ``sizes`` elements as rows of ``f`` (the last one of each partial) packed in order over the
    partitions of consecutive tiles: per tile, its pieces."""
    tiles, cur, p = [], [], 0
    for j, n in enumerate(sizes):
        e = 0
        while e < n:
            if p == PMAX:
                tiles.append(cur)
                cur, p = [], 0
            rows = min((n - e) // f, PMAX - p)
            piece = Piece(p, j, e, rows, f) if rows else Piece(p, j, e, 1, n - e)
            cur.append(piece)
            p += piece.rows
            e += piece.rows * piece.width
    if cur:
        tiles.append(cur)
    return tiles


def packed_stream(fn: Callable, operands: list[list], kinds: list[str], dtypes: tuple, dests: list[tuple],
                  compute=nl.float32, table: tuple | None = None) -> list[tuple]:
    """``fn`` (tiles in operand order -> a tuple of result tiles) over every group's operands in one pass.

    ``operands[j]``: group j's tensor operands, each a flat HBM tensor: [n_j] where ``kinds`` says "full",
    [1, 1] where "scalar". ``dests[j]``: per result, an [n_j] HBM tensor to store it in, or None (a new
    buffer of that result's dtype). ``table``: (an fp32 HBM vector, per group the offset of each of its
    "scalar" operands in it) when all of them lie in that one vector: it is loaded once on every partition and
    each column is copied from it (ScalarE, otherwise idle here) instead of loaded by a DMA per tensor and tile.
    Returns per group its result tensors."""
    full = [i for i, k in enumerate(kinds) if k == "full"]
    sizes = [ops[full[0]].shape[0] for ops in operands]
    f = row_width(sizes)
    check_sbuf((len(full) + len(dtypes) + 1) * NBUF * f * 4 + len(kinds) * NBUF * 4, "packed element-wise pass")
    outs = [tuple(d if d is not None else nl.ndarray((n,), dt, buffer=nl.shared_hbm) for d, dt in zip(ds, dtypes))
            for ds, n in zip(dests, sizes)]
    ring = collections.deque(maxlen=NBUF)         # NBUF tiles' buffers alive: loads of one overlap another's math
    if table is not None and table[0].shape[0] * 4 <= MAX_TABLE_BYTES:
        vec, offsets = table
        n = vec.shape[0]
        everywhere = nl.ndarray((PMAX, n), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=everywhere, src=vec.reshape((1, n)).broadcast_to((PMAX, n)))
    else:
        everywhere = None
    for pieces in layout(sizes, f):
        P = pieces[-1].p0 + pieces[-1].rows
        tiles = []
        for i, kind in enumerate(kinds):
            if kind == "full":
                x = nl.ndarray((P, f), compute, buffer=nl.sbuf)
                for pc in pieces:
                    src = operands[pc.j][i][pc.e0:pc.e0 + pc.rows * pc.width].reshape((pc.rows, pc.width))
                    nisa.dma_copy(dst=x[pc.p0:pc.p0 + pc.rows, 0:pc.width], src=src)
            else:   # one column: each tensor's value on its partitions (its pieces in a tile are adjacent)
                x = nl.ndarray((P, 1), compute, buffer=nl.sbuf)
                s = kinds[:i].count("scalar")
                for j, p0, p1 in _spans(pieces):
                    if everywhere is None:
                        nisa.dma_copy(dst=x[p0:p1, :], src=operands[j][i].broadcast_to((p1 - p0, 1)))
                    else:
                        k = offsets[j][s]
                        nisa.tensor_copy(dst=x[p0:p1, :], src=everywhere[p0:p1, k:k + 1], engine=nisa.scalar_engine)
            tiles.append(x)
        ring.append(tiles)
        with alternating_elementwise():
            ys = fn(*tiles)
        ys = [_widen(y, P, f, compute) for y in ys]
        tiles.extend(ys)
        for pc in pieces:
            for out, y in zip(outs[pc.j], ys):
                nisa.dma_copy(dst=out[pc.e0:pc.e0 + pc.rows * pc.width].reshape((pc.rows, pc.width)),
                              src=y[pc.p0:pc.p0 + pc.rows, 0:pc.width])
    return outs


def _spans(pieces: list[Piece]) -> list[tuple[int, int, int]]:
    """(tensor, first partition, end partition) of each tensor's adjacent pieces in a tile."""
    spans: list[list[int]] = []
    for pc in pieces:
        if spans and spans[-1][0] == pc.j:
            spans[-1][2] = pc.p0 + pc.rows
        else:
            spans.append([pc.j, pc.p0, pc.p0 + pc.rows])
    return [tuple(s) for s in spans]
