"""Elementwise template: any pointwise expression over broadcast inputs, one pass over HBM.

The expression is a Python callable over ``nl`` tiles (``lambda a, b: nl.relu(a * b + 1.0)``) or a
small expression string over the inputs ``a, b, c`` (``"exp(a) * b - 2"``, any ``nl`` function by name).

The host entry (``elementwise``) folds the broadcast into a 2-D problem [R, C]: every input is full
(R, C), a row (1, C), a column (R, 1) or a scalar (1, 1). The kernel then streams tiles of
[128, F] with F chosen so every DMA moves DMA_ROW_BYTES (8 KiB) per partition (>= 2 KiB):

    all inputs full:  the flat tensor is cut into [128, F] tiles (each partition a contiguous run)
    broadcast:        rows by 128 partitions, columns by F; rows (1, C) are loaded once into SBUF
                      broadcast over partitions, columns (R, 1) are (P, 1) operands of the ops

Each iteration allocates fresh tiles while the previous iteration's are still alive, so the
allocator hands out alternate buffers: the loads of tile i+1 overlap the compute of tile i and
the store of tile i-1 (double buffering through loop structure). Inputs are computed in fp32
(the DMA casts on load) and cast to the output dtype by the store.
"""
from __future__ import annotations

from typing import Callable

import collections

import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import DMA_ROW_BYTES, PMAX, alternating_elementwise, as_tensor, check_sbuf, prod

NAMES = ("a", "b", "c", "d", "e")
MIN_BLOCK = 16                 # elements per partition below which a streamed tile uses fewer partitions
NBUF = 3                       # pipeline depth of the streaming loops (buffers per tile)


def _apply(fn, tiles):
    if isinstance(fn, str):  # a small expression description, evaluated over nl functions and the input tiles
        env = {n: getattr(nl, n) for n in nl.__all__}
        env.update(dict(zip(NAMES, tiles)))
        return eval(fn, {"__builtins__": {}}, env)  # noqa: S307 (kernel author's own expression)
    return fn(*tiles)


def stream_tile_width(n: int, cols: int) -> int:
    """Elements per partition of the streaming loops' tiles for an [n / cols, cols] result: at most 2048 (8 KiB
    rows), narrower for small tensors (the flat loop's n / 128, or under 2 * MIN_BLOCK elements for a tensor too
    small for rows of MIN_BLOCK on every partition; the row loop's column block; the larger)."""
    return min(DMA_ROW_BYTES // 4, max(1, n // PMAX, min(cols, n), min(n, 2 * MIN_BLOCK - 1)))


def _body(ins, fn, out_dtype, compute=nl.float32, dests=None):
    """The streaming loops; ``fn`` may return a tuple of tiles, one per dtype of a tuple ``out_dtype`` (a fused
    group with several results): then the outputs are a tuple too. ``dests``: per output, an [R, C] HBM tensor
    to write it into (or None: a new one)."""
    R, C = max(t.shape[0] for t in ins), max(t.shape[1] for t in ins)
    multi = isinstance(out_dtype, tuple)
    dtypes = out_dtype if multi else (out_dtype,)
    dests = dests or (None,) * len(dtypes)
    outs = tuple(d if d is not None else nl.ndarray((R, C), dt, buffer=nl.shared_hbm) for d, dt in zip(dests, dtypes))
    F = DMA_ROW_BYTES // 4                                    # 4-byte compute tiles: 2048 elements, 8 KiB rows
    # SBUF: (full inputs + results + one temporary) x NBUF buffers of the tile width, plus the broadcast rows
    # loaded once per column block; scalars and columns are [128, 1] tiles
    full = sum(tuple(t.shape) == (R, C) for t in ins)
    rows = sum(t.shape[0] == 1 and t.shape[1] > 1 for t in ins)
    width = stream_tile_width(R * C, C)
    check_sbuf((full + len(outs) + 1) * NBUF * width * 4 + rows * min(C, F) * 4 + len(ins) * NBUF * 4, "elementwise")

    def results(tiles, p, f):
        with alternating_elementwise():
            ys = _apply(fn, tiles)
        ys = ys if multi else (ys,)
        assert len(ys) == len(outs), f"elementwise: {len(ys)} results for {len(outs)} output dtypes"
        return [_widen(y, p, f, compute) for y in ys]
    if all(tuple(t.shape) in ((R, C), (1, 1)) for t in ins):   # full inputs and scalars: stream the flat tensor
        n = R * C
        flat = [t.reshape((n,)) if tuple(t.shape) == (R, C) else None for t in ins]
        # tiles of at least MIN_BLOCK elements per partition: a small tensor goes on fewer partitions rather than
        # in rows of a few bytes, each a DMA descriptor of its own (an optimizer's bias or norm weight update)
        f = min(F, n // PMAX)
        step = PMAX * f if f >= MIN_BLOCK else n + 1
        parts = PMAX if f >= MIN_BLOCK else max(1, min(PMAX, n // MIN_BLOCK))   # partitions the tiles use
        scalars = {}                                          # (1, 1) operands: one column, loaded once
        for i, t in enumerate(ins):
            if flat[i] is None:
                scalars[i] = nl.ndarray((parts, 1), compute, buffer=nl.sbuf)
                nisa.dma_copy(dst=scalars[i], src=t.broadcast_to((parts, 1)))
        oflats = [o.reshape((n,)) for o in outs]
        ring = collections.deque(maxlen=NBUF)                # keeps NBUF iterations' tiles alive: NBUF-deep pipeline
        for s in range(0, n - n % step, step):               # whole [128, f] tiles
            tiles = []
            ring.append(tiles)
            for i, t in enumerate(flat):
                if t is None:
                    tiles.append(scalars[i])
                    continue
                x = nl.ndarray((PMAX, f), compute, buffer=nl.sbuf)
                nisa.dma_copy(dst=x, src=t[s:s + step].reshape((PMAX, f)))
                tiles.append(x)
            ys = results(tiles, PMAX, f)
            tiles.extend(ys)
            for oflat, y in zip(oflats, ys):
                nisa.dma_copy(dst=oflat[s:s + step].reshape((PMAX, f)), src=y)
        s = n - n % step
        if s < n:                                             # the tail: [p, f'] then a single partial row
            r = n - s
            p = parts if f < MIN_BLOCK else min(PMAX, r)
            q = r // p
            for s0, pp, ff in ((s, p, q), (s + p * q, 1, r - p * q)):
                if pp * ff == 0:
                    continue
                tiles = []
                for i, t in enumerate(flat):
                    if t is None:
                        tiles.append(scalars[i][:pp, :])
                        continue
                    x = nl.ndarray((pp, ff), compute, buffer=nl.sbuf)
                    nisa.dma_copy(dst=x, src=t[s0:s0 + pp * ff].reshape((pp, ff)))
                    tiles.append(x)
                for oflat, y in zip(oflats, results(tiles, pp, ff)):
                    nisa.dma_copy(dst=oflat[s0:s0 + pp * ff].reshape((pp, ff)), src=y)
        return outs if multi else outs[0]
    kinds = ["full" if tuple(t.shape) == (R, C) else "scalar" if t.shape == (1, 1) else
             "row" if t.shape[0] == 1 else "col" for t in ins]
    assert all(k == "full" or tuple(t.shape) in ((1, C), (R, 1), (1, 1)) for k, t in zip(kinds, ins)), \
        f"elementwise: inputs {[tuple(t.shape) for t in ins]} are not (R, C), (1, C), (R, 1) or (1, 1)"
    results_2d = outs
    k = _column_fold(R, C, kinds)
    if k > 1:   # few long rows: each row's k column blocks on k partitions ([R, C] as [R*k, C/k])
        ins = [t.reshape((R * k, C // k)) if kd == "full" else t for t, kd in zip(ins, kinds)]
        outs = tuple(o.reshape((R * k, C // k)) for o in outs)
        R, C = R * k, C // k
    f = min(F, C)
    for c0 in range(0, C, f):
        fw = min(f, C - c0)
        pre = {}
        for i, (kd, t) in enumerate(zip(kinds, ins)):        # broadcast operands: loaded once per column block
            if kd == "row" and k > 1:   # folded: row r's partitions r*k .. hold the row's k column blocks
                pre[i] = nl.ndarray((PMAX, fw), compute, buffer=nl.sbuf)
                blocks = t.reshape((k, C))[:, c0:c0 + fw]
                for r in range(R // k):
                    nisa.dma_copy(dst=pre[i][r * k:(r + 1) * k, :], src=blocks)
            elif kd == "row":
                pre[i] = nl.ndarray((PMAX, fw), compute, buffer=nl.sbuf)
                nisa.dma_copy(dst=pre[i], src=t[0:1, c0:c0 + fw].broadcast_to((PMAX, fw)))
            elif kd == "scalar":
                pre[i] = nl.ndarray((PMAX, 1), compute, buffer=nl.sbuf)
                nisa.dma_copy(dst=pre[i], src=t.broadcast_to((PMAX, 1)))
        for r0 in range(0, R, PMAX):
            p = min(PMAX, R - r0)
            tiles = []
            for i, (kd, t) in enumerate(zip(kinds, ins)):
                if i in pre:
                    tiles.append(pre[i][:p, :])
                    continue
                x = nl.ndarray((PMAX, fw if kd == "full" else 1), compute, buffer=nl.sbuf)
                src = t[r0:r0 + p, c0:c0 + fw] if kd == "full" else t[r0:r0 + p, 0:1]
                nisa.dma_copy(dst=x[:p, :], src=src)
                tiles.append(x[:p, :])
            for out, y in zip(outs, results(tiles, p, fw)):
                nisa.dma_copy(dst=out[r0:r0 + p, c0:c0 + fw], src=y)
    return results_2d if multi else results_2d[0]


def _column_fold(R: int, C: int, kinds: list) -> int:
    """k > 1 when [R, C] operands with R < 128 rows go better as [R * k, C / k] (the most partitions, blocks
    of at least 64 elements): full operands and rows only (a column would repeat over k partitions)."""
    if R >= PMAX or "col" in kinds:
        return 1
    return max((k for k in range(1, PMAX // R + 1) if C % k == 0 and C // k >= 64), default=1)


def _widen(y, p: int, f: int, compute):
    """The expression's result as a [p, f] tile: an expression over columns only yields a column."""
    if tuple(y.shape) == (p, f):
        return y
    assert y.shape[0] == p and y.access.free_elems == 1, f"elementwise: result {y.shape} is not [{p}, {f}]"
    wide = nl.ndarray((p, f), compute, buffer=nl.sbuf)
    nisa.memset(dst=wide, value=0)
    nisa.tensor_scalar(dst=wide, data=wide, op0=nl.add, operand0=y)
    return wide


@nki.jit
def elementwise1(a, fn, out_dtype, compute=nl.float32):
    return _body([a], fn, out_dtype, compute)


@nki.jit
def elementwise2(a, b, fn, out_dtype, compute=nl.float32):
    return _body([a, b], fn, out_dtype, compute)


@nki.jit
def elementwise3(a, b, c, fn, out_dtype, compute=nl.float32):
    return _body([a, b, c], fn, out_dtype, compute)


@nki.jit
def elementwise4(a, b, c, d, fn, out_dtype, compute=nl.float32):
    return _body([a, b, c, d], fn, out_dtype, compute)


@nki.jit
def elementwise5(a, b, c, d, e, fn, out_dtype, compute=nl.float32):
    return _body([a, b, c, d, e], fn, out_dtype, compute)


def stream(ins: list, fn: Callable, out_dtype, compute=nl.float32, dests: tuple | None = None):
    """The template inline in a larger kernel's trace (the graph compiler's fused groups): any number of
    [R, C], (1, C), (R, 1) or (1, 1) HBM inputs; ``fn`` returns a tile, or a tuple of tiles with a tuple
    ``out_dtype``. Returns the output HBM tensor(s). ``dests`` (per output, an [R, C] HBM tensor or None)
    writes results in place: tile by tile, each after the same tile of every input was read, so a
    destination may be a full input of the same layout."""
    return _body(ins, fn, out_dtype, compute, dests)


KERNELS = {1: elementwise1, 2: elementwise2, 3: elementwise3, 4: elementwise4, 5: elementwise5}


def fold_broadcast(shape: tuple, shapes: list[tuple]) -> tuple[int, list[str]] | None:
    """A split k of the broadcast shape such that every input is full, a row, a column or a scalar."""
    nd = len(shape)
    for k in range(nd, -1, -1):
        kinds = []
        for s in shapes:
            s = (1,) * (nd - len(s)) + tuple(s)
            lead_full, lead_one = s[:k] == shape[:k], all(d == 1 for d in s[:k])
            tail_full, tail_one = s[k:] == shape[k:], all(d == 1 for d in s[k:])
            kind = ("full" if lead_full and tail_full else "scalar" if lead_one and tail_one else
                    "row" if lead_one and tail_full else "col" if lead_full and tail_one else None)
            if kind is None:
                break
            kinds.append(kind)
        else:
            return k, kinds
    return None


def elementwise(fn: Callable | str, *inputs, out_dtype=None, profile: bool = False, chip=None):
    """Apply ``fn`` element-wise over broadcast inputs (torch tensors) in one kernel launch.

    ``fn``: a callable over nl tiles or an expression string over ``a, b, c, d``. Returns a tensor
    of the broadcast shape in ``out_dtype`` (default: the inputs' promoted dtype); with
    ``profile=True`` the ``nki.profile`` report (its ``outputs`` hold the result)."""
    ts = [as_tensor(t) for t in inputs]
    assert 1 <= len(ts) <= 4, "elementwise takes 1 to 4 inputs"
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in ts)))
    if out_dtype is None:
        out_dtype = ts[0].dtype
        for t in ts[1:]:
            out_dtype = torch.promote_types(out_dtype, t.dtype)
    fold = fold_broadcast(shape, [tuple(t.shape) for t in ts])
    if fold is None:  # a broadcast the [R, C] form cannot express: materialise those inputs (extra HBM traffic)
        ts = [t.expand(shape).contiguous() for t in ts]
        fold = (len(shape), ["full"] * len(ts))
    k, kinds = fold
    R, C = prod(shape[:k]), prod(shape[k:])
    args = [t.reshape({"full": (R, C), "row": (1, C), "col": (R, 1), "scalar": (1, 1)}[kd])
            for t, kd in zip(ts, kinds)]
    kern = KERNELS[len(args)]
    if profile:
        rep = nki.profile(kern, chip)(*args, fn=fn, out_dtype=out_dtype)
        rep.outputs = rep.outputs.reshape(shape)
        return rep
    return kern(*args, fn=fn, out_dtype=out_dtype).reshape(shape)
