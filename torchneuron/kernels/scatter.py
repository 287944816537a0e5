"""Row scatter: ``scatter_rows`` (``table[index[i], :] = values[i, :]``), the store side of
``gather_rows`` (``kernels/indexing.py``).

For each block of up to 128 indices, one DMA loads the indices into a [P, 1] SBUF column, one
DMA per column block loads the values, and one indirect DMA writes them into the rows of the
HBM table that the indices name (``.ap(vector_offset=...)`` as the destination). The table is
updated in place. Indices are int32 words (int64 indices as their low words, ``stride=2``).
Duplicate indices: one of the writers wins (no accumulation; callers accumulate by matmul or
reduction instead). Out-of-range indices fail the DMA (``oob_mode=error``); callers check
ranges first to raise PyTorch's errors.
"""
from __future__ import annotations

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import DMA_ROW_BYTES, PMAX, itemsize


@nki.jit
def scatter_rows(table, index, values, stride=1):
    """``table[index[stride * i]] = values[i]`` for a [V, D] table and [N, D] values; returns nothing."""
    V, D = table.shape
    N = index.shape[0] // stride
    assert index.dtype == nl.int32, f"scatter_rows: indices must be int32 words, got {index.dtype}"
    assert tuple(values.shape) == (N, D), f"scatter_rows: values {values.shape} for {N} rows of {D}"
    W = max(1, min(D, 4 * DMA_ROW_BYTES // itemsize(table.dtype)))   # columns per scattered block
    for n0 in range(0, N, PMAX):                                       # 128 indices per block
        p = min(PMAX, N - n0)
        ix = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ix[:p], src=index.ap([[stride, p], [1, 1]], offset=n0 * stride))
        for c0 in range(0, D, W):
            w = min(W, D - c0)
            rows = nl.ndarray((PMAX, w), table.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=rows[:p], src=values[n0:n0 + p, c0:c0 + w])
            nisa.dma_copy(dst=table.ap([[D, p], [1, w]], offset=c0, vector_offset=ix[:p]), src=rows[:p])
