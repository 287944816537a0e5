"""Index kernels: ``iota`` (0, 1, 2, ... for ``arange`` and masks), ``gather_rows``, ``onehot_rows`` and
``onehot_product`` (the one-hot matrix's product with gradient rows, built and multiplied in SBUF).

``iota``: GpSimd's iota writes p * F + j into a [128, F] int32 tile per block; a store writes it out.

``gather_rows``: ``out[i, :] = table[index[i], :]`` by indirect DMA (``index_select``, ``embedding``).

For each block of up to 128 indices, one DMA loads the indices into a [P, 1] SBUF column and
one indirect DMA per column block gathers the rows straight from HBM (``.ap(vector_offset=...)``:
the DMA engine reads row ``index[p]`` for partition p), then a store writes the block out. The
index may be int32, or int64 as int32 word pairs (``stride=2``), whose high word must be 0: row
numbers are below 2**31. Out-of-range indices fail the DMA (``oob_mode=error``) before it moves
anything.

``index_rows``: advanced indexing's row numbers (``x[i, j]``, ``x[idx] = v``) from up to four index
tensors in one launch: per block of 128 indices each dim's words are loaded as [P, 1] columns,
negative values wrapped, the dims combined into flat row numbers, and any value outside its dim (or
an int64 whose high word is not the sign of its low word) turns the row into -1. Then either the
rows are gathered (``gather=True``: the result of ``x[idx]``) or the row numbers are stored, after
an indirect read of one element per row has checked them (so a scatter that follows never starts
with a bad row). Either way a bad row fails an indirect DMA, before anything is written.
"""
from __future__ import annotations

import collections
import math

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import DMA_ROW_BYTES, PMAX, PSUM_FP32, flat_blocks, itemsize
from torchneuron.kernels.elementwise import NBUF


def row_blocks(index, N: int, D: int, dtype, stride: int = 1):
    """The loop nest of an indirect row DMA: per block of up to 128 indices, load them into a [P, 1]
    SBUF column (int32, or int64 as word pairs with ``stride=2``), then yield (n0, p, index column, c0, w)
    per block of columns, W wide so each row DMA moves a few KiB."""
    W = max(1, min(D, 4 * DMA_ROW_BYTES // itemsize(dtype)))
    for n0 in range(0, N, PMAX):
        p = min(PMAX, N - n0)
        ix = nl.ndarray((PMAX, stride), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ix[:p], src=index.ap([[stride, p], [1, stride]], offset=n0 * stride))
        col = ix[:p, 0:1] if stride == 1 else _low_word_if_exact(ix[:p], p)
        for c0 in range(0, D, W):
            yield n0, p, col, c0, min(W, D - c0)


def _low_word_if_exact(words, p: int):
    """[p, 1]: an int64's low word where its high word is 0, else -1, which fails the indirect DMA: the
    row numbers are non-negative int32, so any other high word is out of range (2**32 + 1 is not row 1)."""
    exact = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=exact[:p], data=words[:, 1:2], op0=nl.equal, operand0=0)
    row = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)   # (low + 1) * exact - 1
    nisa.scalar_tensor_tensor(dst=row[:p], data=words[:, 0:1], op0=nl.add, operand0=1, op1=nl.multiply,
                              operand1=exact[:p])
    out = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out[:p], data=row[:p], op0=nl.subtract, operand0=1)
    return out[:p]


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
def iota(n, start=0, step=1, wide=False):
    """The int32 vector [start, start + step, ..., start + (n - 1) * step]; ``wide``: the same values as int64
    word pairs [2n] (low word, high word 0: the values must be non-negative)."""
    last = start + (n - 1) * step
    assert -2**31 <= min(start, last) and max(start, last) < 2**31, "iota: values beyond int32"
    assert not wide or min(start, last) >= 0, "iota: int64 words of negative values"
    words = 2 if wide else 1
    out = nl.ndarray((words * n,), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n):
        t = nl.ndarray((PMAX, w, words), nl.int32, buffer=nl.sbuf)
        if wide:
            nisa.memset(dst=t[:p, :, 1], value=0)
        nisa.iota(dst=t[:p, :, 0], pattern=[[step, w]], offset=start + s * step, channel_multiplier=w * step)
        nisa.dma_copy(dst=out[words * s:words * (s + p * w)].reshape((p, words * w)), src=t[:p].reshape((p, words * w)))
    return out


@nki.jit
def onehot_rows(index, rows, stride=1, padding_idx=-1, out_dtype=nl.float32):
    """The [rows, n] one-hot matrix of n indices (int32, or the low words of int64 word pairs with ``stride=2``):
    1 at [v, j] where index j is v, unless v is ``padding_idx``, else 0 (an index outside [0, rows): a zero
    column), for ``embedding_dense_backward``'s ``onehot^T @ grad``. The word pairs are read whole (contiguous)
    and their low words compared in SBUF, so an int64 index needs no copy of its low words first."""
    assert stride in (1, 2), f"onehot_rows: index words per index must be 1 or 2, not {stride}"
    n = index.shape[0] // stride
    blocks = -(-rows // PMAX)
    out = nl.ndarray((rows, n), out_dtype, buffer=nl.shared_hbm)
    # GpSimd: each row block's row numbers, v = 128 * block + partition, and (VectorE) 1 where the row is not the
    # padding row, computed once for every column block
    ids = nl.ndarray((PMAX, blocks), nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=ids, pattern=[[PMAX, blocks]], offset=0, channel_multiplier=1)
    keep = None
    if padding_idx >= 0:
        keep = nl.ndarray((PMAX, blocks), nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=keep, data=ids, op0=nl.not_equal, operand0=padding_idx)
    F = DMA_ROW_BYTES // (4 * stride)   # indices per column block: each partition's words one 8 KiB DMA row
    for c0 in range(0, n, F):
        w = min(F, n - c0)
        # DMA: the block's index words, the same on every partition
        words = nl.ndarray((PMAX, w, stride), nl.int32, buffer=nl.sbuf)
        row = index[c0 * stride:(c0 + w) * stride].reshape((1, w * stride))
        nisa.dma_copy(dst=words.reshape((PMAX, w * stride)), src=row.broadcast_to((PMAX, w * stride)))
        for b in range(blocks):
            p = min(PMAX, rows - b * PMAX)
            # VectorE: (index == v) * keep[v], 1 or 0, in one instruction; the store casts it to out_dtype
            hit = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
            if keep is None:
                nisa.tensor_scalar(dst=hit[:p], data=words[:p, :, 0], op0=nl.equal, operand0=ids[:p, b:b + 1])
            else:
                nisa.tensor_scalar(dst=hit[:p], data=words[:p, :, 0], op0=nl.equal, operand0=ids[:p, b:b + 1],
                                   op1=nl.multiply, operand1=keep[:p, b:b + 1])
            nisa.dma_copy(dst=out[b * PMAX:b * PMAX + p, c0:c0 + w], src=hit[:p])
    return out


# Rows of the one-hot product ``onehot_product`` takes (its [128, rows] row numbers and one-hot block in SBUF,
# 16 KiB a partition each at most); larger tables build the one-hot matrix in HBM (``onehot_rows``) for the
# matmul kernel.
ONEHOT_PRODUCT_ROWS = 4096


@nki.jit
def onehot_product(index, grad, rows, stride=1, padding_idx=-1):
    """``onehot_rows(index)^T``'s product with the [n, D] ``grad``: the [rows, D] sums of grad's rows by index
    (``embedding_dense_backward``) in one launch, the one-hot matrix never in HBM. Per block of 128 indices (on
    the partitions, as the product contracts them), VectorE builds the block of the one-hot's transpose, 1 at
    [j, v] where index j is v unless v is ``padding_idx``, else 0 (an index outside [0, rows): a zero row), and
    TensorE accumulates its product with the block's gradient rows in fp32 PSUM, the blocks in index order: each
    output element is the sum of its rows, as ``matmul_kernel`` sums the one-hot matrix's product."""
    n = index.shape[0] // stride
    D = grad.shape[1]
    assert tuple(grad.shape) == (n, D) and n >= 1, f"onehot_product: grad is {grad.shape}, not [{n}, D]"
    assert stride in (1, 2), f"onehot_product: index words per index must be 1 or 2, not {stride}"
    assert 1 <= rows <= ONEHOT_PRODUCT_ROWS, f"onehot_product: {rows} rows (at most {ONEHOT_PRODUCT_ROWS})"
    out = nl.ndarray((rows, D), grad.dtype, buffer=nl.shared_hbm)
    # GpSimd: the row numbers 0 .. rows - 1 along the free axis, the same on every partition
    ids = nl.ndarray((PMAX, rows), nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=ids, pattern=[[1, rows]], offset=0, channel_multiplier=0)
    ring = collections.deque(maxlen=NBUF)
    for v0 in range(0, rows, PMAX):             # output row blocks: PSUM partitions
        vb = min(PMAX, rows - v0)
        for d0 in range(0, D, PSUM_FP32):       # output column blocks: one PSUM bank each
            db = min(PSUM_FP32, D - d0)
            acc = nl.ndarray((PMAX, PSUM_FP32), nl.float32, buffer=nl.psum)
            for kt, k0 in enumerate(range(0, n, PMAX)):
                kk = min(PMAX, n - k0)
                # DMA: the block's index words, one index per partition
                words = nl.ndarray((PMAX, stride), nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(dst=words[:kk], src=index.ap([[stride, kk], [1, stride]], offset=k0 * stride))
                # VectorE: hit[j, v] = (index j == v) (* (index j != padding_idx)), in grad's dtype
                hit = nl.ndarray((PMAX, PMAX), grad.dtype, buffer=nl.sbuf)
                if padding_idx < 0:
                    nisa.tensor_scalar(dst=hit[:kk, :vb], data=ids[:kk, v0:v0 + vb], op0=nl.equal,
                                       operand0=words[:kk, 0:1])
                else:
                    keep = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=keep[:kk], data=words[:kk, 0:1], op0=nl.not_equal, operand0=padding_idx)
                    nisa.tensor_scalar(dst=hit[:kk, :vb], data=ids[:kk, v0:v0 + vb], op0=nl.equal,
                                       operand0=words[:kk, 0:1], op1=nl.multiply, operand1=keep[:kk])
                # DMA: the block's gradient rows
                g = nl.ndarray((PMAX, PSUM_FP32), grad.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=g[:kk, :db], src=grad[k0:k0 + kk, d0:d0 + db])
                # TensorE: acc[v, d] (+)= sum over the block's j of hit[j, v] * g[j, d]
                nisa.nc_matmul(dst=acc[:vb, :db], stationary=hit[:kk, :vb], moving=g[:kk, :db], accumulate=kt > 0)
                ring.append((words, hit, g))
            # VectorE: the sums out of PSUM, rounded to grad's dtype; DMA: stored
            res = nl.ndarray((PMAX, PSUM_FP32), grad.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res[:vb, :db], src=acc[:vb, :db])
            nisa.dma_copy(dst=out[v0:v0 + vb, d0:d0 + db], src=res[:vb, :db])
            ring.append((acc, res))
    return out


@nki.jit
def low_words(words):
    """The [n] int32 low words of n int64 values given as [2n] int32 word pairs: whole pairs loaded as
    contiguous [128, 2f] rows (an HBM access of every other 4-byte word would cost a DMA descriptor per
    element), the low words picked by a strided SBUF copy, stored contiguous."""
    n = words.shape[0] // 2
    out = nl.ndarray((n,), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n):
        pairs = nl.ndarray((PMAX, w, 2), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=pairs[:p].reshape((p, 2 * w)), src=words[2 * s:2 * (s + p * w)].reshape((p, 2 * w)))
        low = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=low[:p], src=pairs[:p, :, 0])
        nisa.dma_copy(dst=out[s:s + p * w].reshape((p, w)), src=low[:p])
    return out


MAX_INDEX_DIMS = 4   # index tensors ``index_rows`` takes
# Elements of the [rows, indices] one-hot matrix an index sum builds on TensorE (an embedding's backward, an
# accumulating row put): 256 MiB of fp32, beyond which the callers take another path.
ONEHOT_LIMIT = 1 << 26


def _col(p: int):
    """A fresh int32 [p, 1] SBUF column."""
    return nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)[:p]


def _dim_rows(index, n0: int, p: int, size: int, wide: bool, check_range: bool):
    """One dim's block of indices as [P, 1] tiles: (row within the dim, 1 where valid or None when the row
    alone tells: a wrapped value outside [0, size) is itself out of range). int32 words; ``wide``: int64 as
    (low, high) word pairs, valid only where the high word is the sign of the low one."""
    w = 2 if wide else 1
    words = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=words[:p], src=index.ap([[w, p], [1, w]], offset=n0 * w))
    lo = words[:p, 0:1]
    t = _col(p)   # size where negative
    nisa.tensor_scalar(dst=t, data=lo, op0=nl.less, operand0=0, op1=nl.multiply, operand1=size)
    r = _col(p)
    nisa.tensor_tensor(dst=r, data1=lo, data2=t, op=nl.add)
    ok = None
    if check_range:   # 0 <= r < size  <=>  |2r - (size - 1)| < size (integers)
        u = _col(p)
        nisa.tensor_scalar(dst=u, data=r, op0=nl.multiply, operand0=2, op1=nl.subtract, operand1=size - 1)
        ok = _col(p)
        nisa.tensor_scalar(dst=ok, data=u, op0="abs", operand0=0, op1=nl.less, operand1=size)
    if wide:          # high word -1 or 0 as the low word's sign: -size * high == t
        h = _col(p)
        nisa.tensor_scalar(dst=h, data=words[:p, 1:2], op0=nl.multiply, operand0=-size)
        hk = _col(p)
        nisa.tensor_tensor(dst=hk, data1=h, data2=t, op=nl.equal)
        if ok is None:
            ok = hk
        else:
            both = _col(p)
            nisa.tensor_tensor(dst=both, data1=ok, data2=hk, op=nl.multiply)
            ok = both
    return r, ok


@nki.jit
def index_rows(table, i0, i1=None, i2=None, i3=None, sizes=(), wide=(), gather=True):
    """Advanced indexing over the leading dims (``sizes``) of ``table`` [V, D] (V = prod(sizes) <= 2**24) by
    index tensors ``i0``.. (int32 words, int64 as word pairs where ``wide``; all of n indices): the
    gathered rows [n, D], or (``gather=False``) the checked int32 flat row numbers [n]."""
    V, D = table.shape
    idx = [t for t in (i0, i1, i2, i3) if t is not None]
    assert len(idx) == len(sizes) == len(wide), "index_rows: one size and width per index tensor"
    assert V == math.prod(sizes), "index_rows: the table's rows are the indexed dims"
    N = idx[0].shape[0] // (2 if wide[0] else 1)
    out = nl.ndarray((N, D) if gather else (N,), table.dtype if gather else nl.int32, buffer=nl.shared_hbm)
    W = max(1, min(D, 4 * DMA_ROW_BYTES // itemsize(table.dtype)))
    for n0 in range(0, N, PMAX):
        p = min(PMAX, N - n0)
        row = ok = None
        for t, size, wd in zip(idx, sizes, wide):
            # (one dim: a wrapped row outside [0, size) fails the indirect DMA by itself)
            r, v = _dim_rows(t, n0, p, size, wd, check_range=len(idx) > 1)
            if row is None:
                row = r
            else:
                nxt = _col(p)
                nisa.scalar_tensor_tensor(dst=nxt, data=row, op0=nl.multiply, operand0=size, op1=nl.add, operand1=r)
                row = nxt
            if v is not None and ok is not None:
                both = _col(p)
                nisa.tensor_tensor(dst=both, data1=ok, data2=v, op=nl.multiply)
                v = both
            ok = v if v is not None else ok
        if ok is not None:   # row where valid, else -1: (row + 1) * ok - 1
            fixed, final = _col(p), _col(p)
            nisa.scalar_tensor_tensor(dst=fixed, data=row, op0=nl.add, operand0=1, op1=nl.multiply, operand1=ok)
            nisa.tensor_scalar(dst=final, data=fixed, op0=nl.subtract, operand0=1)
            row = final
        if gather:
            for c0 in range(0, D, W):
                w = min(W, D - c0)
                rows = nl.ndarray((PMAX, w), table.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=rows[:p], src=table.ap([[D, p], [1, w]], offset=c0, vector_offset=row))
                nisa.dma_copy(dst=out[n0:n0 + p, c0:c0 + w], src=rows[:p])
        else:
            probe = nl.ndarray((PMAX, 1), table.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=probe[:p], src=table.ap([[D, p], [1, 1]], vector_offset=row))
            nisa.dma_copy(dst=out[n0:n0 + p].reshape((p, 1)), src=row)
    return out


@nki.jit
def mask_rows(table, flags, rank, count=0):
    """The rows of ``table`` [V, D] whose ``flags`` [V] are set, in order (``x[mask]``): row i goes to
    ``out[rank[i] - 1]`` (``rank``: the inclusive count of set flags, int32), the others to a spare last
    row; returns [count + 1, D]."""
    V, D = table.shape
    out = nl.ndarray((count + 1, D), table.dtype, buffer=nl.shared_hbm)
    W = max(1, min(D, 4 * DMA_ROW_BYTES // itemsize(table.dtype)))
    for n0 in range(0, V, PMAX):
        p = min(PMAX, V - n0)
        f, r = _col(p), _col(p)
        nisa.dma_copy(dst=f, src=flags.ap([[1, p], [1, 1]], offset=n0))
        nisa.dma_copy(dst=r, src=rank.ap([[1, p], [1, 1]], offset=n0))
        # slot = rank - 1 where set, else count: flag * (rank - count - 1) + count
        s, slot = _col(p), _col(p)
        nisa.scalar_tensor_tensor(dst=s, data=r, op0=nl.subtract, operand0=count + 1, op1=nl.multiply, operand1=f)
        nisa.tensor_scalar(dst=slot, data=s, op0=nl.add, operand0=count)
        for c0 in range(0, D, W):
            w = min(W, D - c0)
            rows = nl.ndarray((PMAX, w), table.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=rows[:p], src=table[n0:n0 + p, c0:c0 + w])
            nisa.dma_copy(dst=out.ap([[D, p], [1, w]], offset=c0, vector_offset=slot), src=rows[:p])
    return out
