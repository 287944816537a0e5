"""Index kernels: ``iota`` (0, 1, 2, ... for ``arange`` and masks) and ``gather_rows``.

``iota``: GpSimd's iota writes p * F + j into a [128, F] int32 tile per block; a store writes it out.

``gather_rows``: ``out[i, :] = table[index[i], :]`` by indirect DMA (``index_select``, ``embedding``).

For each block of up to 128 indices, one DMA loads the indices into a [P, 1] SBUF column and
one indirect DMA per column block gathers the rows straight from HBM (``.ap(vector_offset=...)``:
the DMA engine reads row ``index[p]`` for partition p), then a store writes the block out. The
index may be int32, or int64 read as the low words of its int32 pairs (``stride=2``): row
numbers are below 2**31. Out-of-range indices fail the DMA (``oob_mode=error``) before it moves
anything.
"""
from __future__ import annotations

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import DMA_ROW_BYTES, PMAX, flat_blocks, itemsize


def row_blocks(index, N: int, D: int, dtype, stride: int = 1):
    """The loop nest of an indirect row DMA: per block of up to 128 indices, load them into a [P, 1]
    SBUF column (every ``stride``-th int32 word), then yield (n0, p, index column, c0, w) per block of
    columns, W wide so each row DMA moves a few KiB."""
    W = max(1, min(D, 4 * DMA_ROW_BYTES // itemsize(dtype)))
    for n0 in range(0, N, PMAX):
        p = min(PMAX, N - n0)
        ix = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ix[:p], src=index.ap([[stride, p], [1, 1]], offset=n0 * stride))
        for c0 in range(0, D, W):
            yield n0, p, ix[:p], c0, min(W, D - c0)


@nki.jit
def gather_rows(table, index, stride=1):
    """Rows ``table[index[stride * i]]`` of a [V, D] table for i < len(index) // stride; returns [N, D]."""
    V, D = table.shape
    N = index.shape[0] // stride
    assert index.dtype == nl.int32, f"gather_rows: indices must be int32 words, got {index.dtype}"
    out = nl.ndarray((N, D), table.dtype, buffer=nl.shared_hbm)
    for n0, p, ix, c0, w in row_blocks(index, N, D, table.dtype, stride):
        rows = nl.ndarray((PMAX, w), table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows[:p], src=table.ap([[D, p], [1, w]], offset=c0, vector_offset=ix))
        nisa.dma_copy(dst=out[n0:n0 + p, c0:c0 + w], src=rows[:p])
    return out


@nki.jit
def iota(n):
    """The int32 vector [0, 1, ..., n - 1]."""
    out = nl.ndarray((n,), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n):
        t = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=t[:p], pattern=[[1, w]], offset=s, channel_multiplier=w)
        nisa.dma_copy(dst=out[s:s + p * w].reshape((p, w)), src=t[:p])
    return out
