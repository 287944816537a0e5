"""Row sorts: ``bitonic_sort_rows`` (each row of [R, n] sorted by a (key, tie) pair, in SBUF).

Rows go to the partitions (128 per block) and each row, padded to M = the power of two >= n, is
sorted along the free axis by a bitonic network: log2(M) merge phases k = 2, 4, ..., M, each of
compare-exchange steps j = k/2, ..., 1 between the elements i and i + j of every 2j-block. Blocks
of k alternate direction (ascending where ``i & k == 0``), so one step is two groups of
instructions over strided views (``.ap`` patterns [2k, M/2k] x [2j, k/2j] x [1, j]): the up
blocks and the down blocks, each with its own order. O(M log^2 M) work, all on VectorE.

The order is lexicographic on (key, tie), keys ascending (descending with ``descending``) and
ties ascending: with distinct ties (positions) the result is the unique stable order, so the
network need not be stable itself. A compare-exchange takes min/max of the keys (exact, no
select needed) and moves the ties by an arithmetic select ``a + swap * (b - a)`` (int32, exact).
Keys compute in fp32 (floats) or int32 (integers); NaN must have been replaced by the caller
(NaN compares false both ways, which would break the network). Padding elements take the key
that sorts last and tie 2M, above every real tie, so they end up past column n.
"""
from __future__ import annotations

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, check_sbuf

MAX_COLS = 8192          # the longest row (after padding to a power of two) sorted in SBUF
INT_MAX, INT_MIN = 2 ** 31 - 1, -2 ** 31


def _group(v, s, tmp, p, M, k, j, offset, up, descending):
    """Compare-exchange i and i + j over the k-blocks at ``offset`` (every other one unless k == M)."""
    outer = max(1, M // (2 * k))
    pattern = [[0, p], [2 * k, outer], [2 * j, k // (2 * j)], [1, j]]
    shape = (p, outer, k // (2 * j), j)
    av, bv = v.ap(pattern, offset=offset), v.ap(pattern, offset=offset + j)
    as_, bs = s.ap(pattern, offset=offset), s.ap(pattern, offset=offset + j)
    sw, eq, t = (x[:p, :outer * k // 2].reshape(shape) for x in tmp)
    # swap where the hi element comes first (up blocks) or the lo element does (down blocks)
    (xv, yv), (xs, ys) = ((bv, av), (bs, as_)) if up else ((av, bv), (as_, bs))
    nisa.tensor_tensor(dst=sw, data1=xv, data2=yv, op=nl.greater if descending else nl.less)
    nisa.tensor_tensor(dst=eq, data1=xv, data2=yv, op=nl.equal)
    nisa.tensor_tensor(dst=t, data1=xs, data2=ys, op=nl.less)
    nisa.tensor_tensor(dst=eq, data1=eq, data2=t, op=nl.multiply)
    nisa.tensor_tensor(dst=sw, data1=sw, data2=eq, op=nl.add)          # the two cases exclude each other
    first, last = (nl.minimum, nl.maximum) if up != descending else (nl.maximum, nl.minimum)
    tv = tmp[1].ap([[0, p], [1, outer * k // 2]], dtype=v.dtype).reshape(shape)   # eq's memory, free again
    nisa.tensor_tensor(dst=tv, data1=av, data2=bv, op=first)
    nisa.tensor_tensor(dst=bv, data1=av, data2=bv, op=last)
    nisa.tensor_copy(dst=av, src=tv)
    nisa.tensor_tensor(dst=t, data1=bs, data2=as_, op=nl.subtract)
    nisa.tensor_tensor(dst=t, data1=t, data2=sw, op=nl.multiply)
    nisa.tensor_tensor(dst=as_, data1=as_, data2=t, op=nl.add)
    nisa.tensor_tensor(dst=bs, data1=bs, data2=t, op=nl.subtract)


@nki.jit
def bitonic_sort_rows(key, tie=None, descending=False):
    """Sort each row of ``key`` [R, n] by (key, tie) (``tie`` [R, n] int32 below 2n, default the column
    index); returns the sorted keys [R, n] (key's dtype) and ties [R, n] (int32)."""
    R, n = key.shape
    M = 1 << max(1, (n - 1).bit_length())
    assert M <= MAX_COLS, f"bitonic_sort_rows: rows of {n} pad to {M} > {MAX_COLS}"
    assert tie is None or (tuple(tie.shape) == (R, n) and tie.dtype == nl.int32), "bitonic_sort_rows: bad tie"
    floating = key.dtype.is_floating_point
    compute = nl.float32 if floating else nl.int32
    check_sbuf(2 * M * 4 + 3 * (M // 2) * 4, "bitonic_sort_rows")
    if floating:
        pad = float("-inf") if descending else float("inf")
    else:
        pad = INT_MIN if descending else INT_MAX
    out_key = nl.ndarray((R, n), key.dtype, buffer=nl.shared_hbm)
    out_tie = nl.ndarray((R, n), nl.int32, buffer=nl.shared_hbm)
    for r0 in range(0, R, PMAX):
        p = min(PMAX, R - r0)
        v = nl.ndarray((PMAX, M), compute, buffer=nl.sbuf)
        s = nl.ndarray((PMAX, M), nl.int32, buffer=nl.sbuf)
        tmp = [nl.ndarray((PMAX, M // 2), nl.int32, buffer=nl.sbuf) for _ in range(3)]
        nisa.dma_copy(dst=v[:p, :n], src=key[r0:r0 + p, :])
        if tie is None:
            nisa.iota(dst=s[:p, :n], pattern=[[1, n]], offset=0)
        else:
            nisa.dma_copy(dst=s[:p, :n], src=tie[r0:r0 + p, :])
        if M > n:
            nisa.memset(dst=v[:p, n:], value=pad)
            nisa.memset(dst=s[:p, n:], value=2 * M)
        k = 2
        while k <= M:
            j = k // 2
            while j >= 1:
                _group(v, s, tmp, p, M, k, j, 0, True, descending)
                if k < M:
                    _group(v, s, tmp, p, M, k, j, k, False, descending)
                j //= 2
            k *= 2
        nisa.dma_copy(dst=out_key[r0:r0 + p, :], src=v[:p, :n])
        nisa.dma_copy(dst=out_tie[r0:r0 + p, :], src=s[:p, :n])
    return out_key, out_tie
