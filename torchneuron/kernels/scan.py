"""Scans along rows: ``scan_rows`` (cumulative sum or product of each row of [R, N]) and
``scan_int64_rows`` (exact int64 cumulative sums of rows held as int32 word pairs).

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


@nki.jit
def scan_int64_rows(x):
    """Cumulative sum along each row of int64 values given as [R, 2N] int32 words (little-endian pairs);
    returns [R, 2N] words of the sums, wrapped mod 2**64 as PyTorch's int64 cumsum wraps.

    Each block of word pairs moves by one contiguous DMA each way (a DMA of every other word would move
    4-byte pieces); the engines read the low and high words as stride-2 views of the tile. The low words
    are scanned as uint32 (the write wraps mod 2**32). Each step adds less than 2**32, so the running low
    sum passes 2**32 at most once per step, exactly where it comes out below the step before (unsigned):
    that 0/1 carry is added to the step's high word before the high words are scanned.
    """
    R, N2 = x.shape
    N = N2 // 2
    out = nl.ndarray((R, N2), nl.int32, buffer=nl.shared_hbm)
    W = min(N, COLS // 2)
    check_sbuf(4 * NBUF * 2 * W * 4, "scan_int64_rows")
    ring = collections.deque(maxlen=NBUF)                     # keeps NBUF blocks' tiles alive (overlap)

    def word(t, p, w, k, dtype, first=0, count=None):
        """Word k (0 low, 1 high) of pairs first.. of the [p, 2w] tile ``t``, as a [p, count] view."""
        count = w - first if count is None else count
        return t[:p, :2 * w].ap([[2 * w, p], [2, count]], offset=2 * first + k, dtype=dtype)

    for r0 in range(0, R, PMAX):
        p = min(PMAX, R - r0)
        carry_lo, carry_hi = 0, 0                             # the running sum's words entering the block
        for c0 in range(0, N, W):
            w = min(W, N - c0)
            words, sums = (nl.ndarray((PMAX, 2 * W), nl.int32, buffer=nl.sbuf) for _ in range(2))
            wrap, ones = (nl.ndarray((PMAX, W), nl.int32, buffer=nl.sbuf) for _ in range(2))
            ring.append((words, sums, wrap, ones))
            nisa.dma_copy(dst=words[:p, :2 * w], src=x[r0:r0 + p, 2 * c0:2 * (c0 + w)])
            nisa.memset(dst=ones[:p, :w], value=1)
            lo_sum = word(sums, p, w, 0, nl.uint32)
            nisa.tensor_tensor_scan(dst=lo_sum, data0=ones[:p, :w], data1=word(words, p, w, 0, nl.uint32),
                                    initial=carry_lo, op0=nl.multiply, op1=nl.add)
            if w > 1:                                         # carry out of step i: sum[i] < sum[i-1]
                nisa.tensor_tensor(dst=wrap[:p, 1:w], data1=word(sums, p, w, 0, nl.uint32, 1),
                                   data2=word(sums, p, w, 0, nl.uint32, 0, w - 1), op=nl.less)
            if isinstance(carry_lo, int):                     # the row's first step cannot carry
                nisa.memset(dst=wrap[:p, 0:1], value=0)
            else:
                nisa.tensor_tensor(dst=wrap[:p, 0:1], data1=word(sums, p, w, 0, nl.uint32, 0, 1), data2=carry_lo,
                                   op=nl.less)
            hi = word(words, p, w, 1, nl.int32)
            nisa.tensor_tensor(dst=hi, data1=hi, data2=wrap[:p, :w], op=nl.add)            # int32 wraps
            nisa.tensor_tensor_scan(dst=word(sums, p, w, 1, nl.int32), data0=ones[:p, :w], data1=hi,
                                    initial=carry_hi, op0=nl.multiply, op1=nl.add)
            carry_lo = word(sums, p, w, 0, nl.uint32, w - 1, 1)
            carry_hi = word(sums, p, w, 1, nl.int32, w - 1, 1)
            nisa.dma_copy(dst=out[r0:r0 + p, 2 * c0:2 * (c0 + w)], src=sums[:p, :2 * w])
    return out
