"""Shared helpers of the kernel library: limits, tile sizes and the host-side argument handling."""
from __future__ import annotations

import contextlib
import math
import weakref
from typing import Iterator

import numpy as np
import torch

import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.nki.tracing import current

PMAX = 128                     # partitions of SBUF/PSUM (nl.tile_size.pmax)
PSUM_FP32 = 512                # fp32 elements in one 2 KiB PSUM bank (nl.tile_size.psum_bank_fmax)
DMA_ROW_BYTES = 8192           # target bytes per partition row of a streaming DMA (>= 2 KiB: ~97 % efficiency)


def sbuf_budget() -> int:
    """SBUF bytes per partition of the chip being traced (224 KiB on trn2)."""
    return nl.tile_size.sbuf_fmax_bytes


def check_sbuf(need: int, what: str) -> None:
    """State a kernel's SBUF budget: ``need`` bytes per partition must fit the chip."""
    have = sbuf_budget()
    assert need <= have, f"{what}: needs {need} B of SBUF per partition; the chip has {have} B"


@contextlib.contextmanager
def elementwise_on(engine) -> Iterator[None]:
    """Place the ``nl`` element-wise ops (``nl.add`` ...) traced inside on ``engine`` (VectorE or GpSimdE) where
    their operands allow it, as the compiler places ops a kernel leaves to it: a streaming template spreads
    its tiles over both engines this way."""
    trace = current()
    before, trace.elementwise_engine = trace.elementwise_engine, engine
    try:
        yield
    finally:
        trace.elementwise_engine = before


_turns: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def alternating_elementwise():
    """``elementwise_on`` VectorE and GpSimdE in turn, call by call within a trace: consecutive tiles of a
    streaming template (and of the templates a graph program chains) compute on both engines at once."""
    trace = current()
    n = _turns.get(trace, 0)
    _turns[trace] = n + 1
    return elementwise_on(nisa.gpsimd_engine if n % 2 else None)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tiles(n: int, size: int = PMAX) -> list[tuple[int, int]]:
    """(start, length) of the ``size``-long tiles covering [0, n), the last one partial."""
    return [(t0, min(size, n - t0)) for t0 in range(0, n, size)]


def itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def as_tensor(x) -> torch.Tensor:
    """Host arguments as CPU torch tensors (NumPy arrays accepted)."""
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def prod(shape) -> int:
    return int(math.prod(shape))


def flat_blocks(n: int, fmax: int = 2048):
    """(start, partitions, width) blocks covering a flat vector of n elements: [128, f] tiles with
    f = min(fmax, n // 128) elements per partition, then the remainder as one row."""
    f = max(1, min(fmax, n // PMAX))
    s = 0
    while s < n:
        p = min(PMAX, (n - s) // f) or 1
        w = f if n - s >= f * p else n - s
        yield s, p, w
        s += p * w


# ---- grouped rows: G short rows per partition --------------------------------------------------------
# A row kernel over short rows (a few hundred elements) with one row per partition spends most of each
# instruction on its fixed cost. Grouped, partition i of a [128, G, D] tile holds rows r0 + i*G .. +G-1
# (one contiguous DMA), per-row statistics are [128, G] tiles, and ``spread`` reads them back over the
# D columns through a stride-0 access pattern.

ROW_ELEMS = 2048    # elements per partition of a grouped tile


def row_blocks(N: int, D: int, min_blocks: int = 1) -> tuple[list[tuple[int, int, int]], int]:
    """((first row, partitions, rows per partition) blocks covering N rows of D elements, G): [128, G]
    blocks with G * D <= max(D, ROW_ELEMS), then the rows left over one per partition. ``min_blocks``: G
    small enough that N rows make at least that many full blocks where they can (a kernel whose per-block
    chain of dependent passes is long pipelines its blocks across DMA and the engines)."""
    G = max(1, min(ROW_ELEMS // D, N // PMAX, N // (PMAX * min_blocks)))
    step = PMAX * G
    full = N - N % step
    blocks = [(r0, PMAX, G) for r0 in range(0, full, step)]
    blocks += [(r0, min(PMAX, N - r0), 1) for r0 in range(full, N, PMAX)]
    return blocks, G


def grouped_rows(t, r0: int, p: int, g: int):
    """Rows [r0, r0 + p*g) of an HBM [N, D] tensor as [p, g, D]: partition i holds rows r0 + i*g ..."""
    return t[r0:r0 + p * g, :].reshape((p, g, t.shape[1]))


def load_grouped(t, r0: int, p: int, g: int, dtype=nl.float32):
    """A new SBUF [128, g, D] tile holding rows [r0, r0 + p*g) of an HBM [N, D] tensor (the DMA casts)."""
    tile = nl.ndarray((PMAX, g, t.shape[1]), dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile[:p], src=grouped_rows(t, r0, p, g))
    return tile


def spread(stat, p: int, g: int, D: int):
    """A [p, g] tile of per-row values read as [p, g, D] (stride 0 over the columns)."""
    return stat[:p, :g].ap([[g, p], [1, g], [0, D]])


def spread_row(row, p: int, g: int, D: int):
    """A [P, D] tile (one vector on every partition) read as [p, g, D] (stride 0 over the rows)."""
    return row[:p, :D].ap([[D, p], [0, g], [1, D]])
