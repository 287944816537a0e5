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
from torchneuron.kernels._common import PMAX
from torchneuron.kernels.indexing import row_blocks


@nki.jit
def scatter_rows(table, index, values, stride=1):
    """``table[index[stride * i]] = values[i]`` for a [V, D] table and [N, D] values; returns nothing."""
    V, D = table.shape
    N = index.shape[0] // stride
    assert index.dtype == nl.int32, f"scatter_rows: indices must be int32 words, got {index.dtype}"
    assert tuple(values.shape) == (N, D), f"scatter_rows: values {values.shape} for {N} rows of {D}"
    for n0, p, ix, c0, w in row_blocks(index, N, D, table.dtype, stride):
        rows = nl.ndarray((PMAX, w), table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows[:p], src=values[n0:n0 + p, c0:c0 + w])
        nisa.dma_copy(dst=table.ap([[D, p], [1, w]], offset=c0, vector_offset=ix), src=rows[:p])
