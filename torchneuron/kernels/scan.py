"""Scans along rows: ``scan_rows`` (cumulative sum or product of each row of [R, N]).

Rows go to the partitions (128 per block) and each row is scanned along the free axis by one
VectorE ``tensor_tensor_scan`` per column block of up to ``COLS`` elements:

    sum:   r[i] = (1 * r[i-1]) + x[i]      (data0 = ones, data1 = x)
    prod:  r[i] = (x[i] * r[i-1]) * 1      (data0 = x,    data1 = ones)

A long row carries its running value from one column block to the next as the scan's (P, 1)
``initial`` operand (the previous block's last column), so any N fits. Tiles compute in fp32
(floats) or int32 (integers, exact with wraparound) and the store casts to the output dtype;
the last NBUF blocks' tiles stay alive so the loads of block i+1 overlap the scan of block i.
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, check_sbuf

COLS = 2048      # scanned elements per block (8 KiB of fp32 per partition)
NBUF = 3


@nki.jit
def scan_rows(x, op, out_dtype, compute):
    """Cumulative ``op`` ("sum" or "prod") along each row of ``x`` [R, N]; returns [R, N] of ``out_dtype``."""
    assert op in ("sum", "prod"), f"scan_rows: op must be sum or prod, got {op}"
    R, N = x.shape
    out = nl.ndarray((R, N), out_dtype, buffer=nl.shared_hbm)
    W = min(N, COLS)
    check_sbuf(3 * NBUF * W * 4, "scan_rows")
    ring = collections.deque(maxlen=NBUF)                     # keeps NBUF blocks' tiles alive (overlap)
    for r0 in range(0, R, PMAX):                              # 128 rows per block
        p = min(PMAX, R - r0)
        carry = 0.0 if op == "sum" else 1.0                   # the running value entering the block
        for c0 in range(0, N, W):                             # column blocks, carried left to right
            w = min(W, N - c0)
            t = nl.ndarray((PMAX, w), compute, buffer=nl.sbuf)
            ones = nl.ndarray((PMAX, w), compute, buffer=nl.sbuf)
            res = nl.ndarray((PMAX, w), compute, buffer=nl.sbuf)
            ring.append((t, ones, res))
            nisa.dma_copy(dst=t[:p], src=x[r0:r0 + p, c0:c0 + w])
            nisa.memset(dst=ones[:p], value=1)
            data0, data1 = (ones[:p], t[:p]) if op == "sum" else (t[:p], ones[:p])
            op1 = nl.add if op == "sum" else nl.multiply
            nisa.tensor_tensor_scan(dst=res[:p], data0=data0, data1=data1, initial=carry, op0=nl.multiply,
                                    op1=op1)
            carry = res[:p, w - 1:w]
            nisa.dma_copy(dst=out[r0:r0 + p, c0:c0 + w], src=res[:p])
    return out
