"""Row softmax / log_softmax over the last dim, numerically stable (the row max is subtracted).

    for each block of 128 rows (one row per partition, the whole row in the free dim):
        load [128, D] as stored (bf16 stays bf16)                           DMA
        m = -max(x)                      tensor_reduce(negate)              VectorE
        e = exp(x + m), s = sum(e)       one activation with its reduce     ScalarE (fp32 e)
        softmax:     y = e * (1/s)       reciprocal (VectorE), tensor_scalar GpSimd
        log_softmax: y = (x + m) - log s log (ScalarE), one two-op tensor_scalar (GpSimd)
        store [128, D] (y written in the input dtype: one rounding)         DMA

Tiles keep the input's dtype on both DMA sides: a casting DMA moves (and is priced at) the fp32 bytes,
twice the bf16 traffic. The three engines each take one pass over the block (VectorE reduces bf16 to
bf16 at twice the rate), so a bf16 softmax stays under its DMA time.

Tiles of the last NBUF blocks stay alive, so loads, the two engines and stores of consecutive
blocks overlap. The single pass holds the whole row: D fp32 x 3 tiles x (NBUF + 1) must fit SBUF
(D <= ~4700 on trn2). Longer rows take two passes over column blocks of W = 2048:

    pass 1 (online max/sum), per column block:
        bm = -max(x_blk)                                 VectorE
        m' = min(m, bm)  (m is -max so far)              VectorE, (P, 1)
        s  = s * exp(m' - m) + sum(exp(x_blk + m'))      ScalarE (activation + reduce), VectorE (P, 1)
    pass 2, per column block:
        softmax: y = exp(x + m) * (1/s)                  ScalarE activation, GpSimd tensor_scalar
        log_softmax: y = (x + m) - log s                 one two-op tensor_scalar (GpSimd)

``half_logsum`` (log_softmax of bf16/fp16 rows over the last dim) rounds the row sum and its log to the input dtype
before the subtraction, as the CPU's last-dim kernel keeps them in arrays of the input type (its results, off the
exact ones by up to ~2**-9, are matched bit for bit rather than bettered).

Both subtract the max before anything else, as the CPU does: folding m - log s into one bias rounds it at
the max's magnitude, an absolute error of ulp(max) in every log-probability (and a relative one in every
probability).

x is read twice and y written once: at most 2/3 of the bandwidth bound. Any D.
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import (PMAX, ROW_ELEMS, as_tensor, check_sbuf, grouped_rows, load_grouped,
                                         row_blocks, spread)
from torchneuron.kernels.transpose import permute

NBUF = 3
W = 2048        # columns per block of the two-pass path (8 KiB fp32 rows: 1 MiB DMAs)


def one_pass(D: int) -> bool:
    """Whether a row of D elements takes the single-pass path (the whole row in SBUF)."""
    return (NBUF + 1) * 3 * D * 4 + 64 <= nl.tile_size.sbuf_fmax_bytes


def _col():
    return nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)


def _max_dtype(dt):
    """The dtype of a row maximum of ``dt`` data: bf16 holds a bf16 maximum exactly, and VectorE reduces
    bf16 to bf16 at twice the rate."""
    return nl.bfloat16 if dt == nl.bfloat16 else nl.float32


def _log_sum(s, p, dt, half_logsum):
    """log s of a (P, 1) fp32 row sum; ``half_logsum``: s and its log each rounded to ``dt`` (the CPU's last-dim
    log_softmax of half types)."""
    ls = nl.ndarray((PMAX, 1), dt if half_logsum else nl.float32, buffer=nl.sbuf)
    if half_logsum:
        sr = nl.ndarray((PMAX, 1), dt, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sr[:p], src=s[:p])
        nisa.activation(dst=ls[:p], op=nl.log, data=sr[:p])
    else:
        nisa.activation(dst=ls[:p], op=nl.log, data=s[:p])
    return ls


def _softmax_long(x, out, log, half_logsum=False):
    """Two passes over column blocks of W: online max/sum, then the output (any row length)."""
    N, D = x.shape
    ring = collections.deque(maxlen=NBUF)
    for r0 in range(0, N, PMAX):
        p = min(PMAX, N - r0)
        nm = s = None                             # -max and sum(exp(x + nm)) of the columns seen so far
        for c0 in range(0, D, W):
            w = min(W, D - c0)
            t = nl.ndarray((PMAX, W), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t[:p, :w], src=x[r0:r0 + p, c0:c0 + w])
            bm = _col()
            nisa.tensor_reduce(dst=bm[:p], op=nl.maximum, data=t[:p, :w], axis=(1,), negate=True)
            if nm is not None:                    # new running -max, and the factor for the old sum
                nm2 = _col()
                nisa.tensor_tensor(dst=nm2[:p], data1=nm[:p], data2=bm[:p], op=nl.minimum)
                corr = _col()
                nisa.tensor_tensor(dst=corr[:p], data1=nm2[:p], data2=nm[:p], op=nl.subtract)
                nisa.activation(dst=corr[:p], op=nl.exp, data=corr[:p])
                bm = nm2
            e = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)   # exp values are not kept
            bs = _col()
            nisa.activation(dst=e[:p, :w], op=nl.exp, data=t[:p, :w], bias=bm[:p], reduce_op=nl.add,
                            reduce_res=bs[:p], reduce_cmd=nisa.reduce_cmd.reset_reduce)
            if nm is not None:                    # s = s * corr + bs
                nisa.scalar_tensor_tensor(dst=bs[:p], data=s[:p], op0=nl.multiply, operand0=corr[:p],
                                          op1=nl.add, operand1=bs[:p])
            nm, s = bm, bs
            ring.append((t, e))
        # the max is subtracted first and log s (1/s) applied after, as the CPU does: one bias -max - log s
        # would be rounded at the max's magnitude (an absolute error of ulp(max) in every result)
        if log:
            ls = _log_sum(s, p, x.dtype, half_logsum)
        else:
            ls = _col()
            nisa.reciprocal(dst=ls[:p], data=s[:p])
        for c0 in range(0, D, W):
            w = min(W, D - c0)
            t = nl.ndarray((PMAX, W), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t[:p, :w], src=x[r0:r0 + p, c0:c0 + w])
            y = nl.ndarray((PMAX, W), x.dtype, buffer=nl.sbuf)
            e = None
            if log:
                nisa.tensor_scalar(dst=y[:p, :w], data=t[:p, :w], op0=nl.add, operand0=nm[:p], op1=nl.subtract,
                                   operand1=ls[:p], engine=nisa.gpsimd_engine)
            else:
                e = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=e[:p, :w], op=nl.exp, data=t[:p, :w], bias=nm[:p])
                nisa.tensor_scalar(dst=y[:p, :w], data=e[:p, :w], op0=nl.multiply, operand0=ls[:p],
                                   engine=nisa.gpsimd_engine)
            nisa.dma_copy(dst=out[r0:r0 + p, c0:c0 + w], src=y[:p, :w])
            ring.append((t, y, e))


@nki.jit
def softmax_kernel(x, log=False, half_logsum=False):
    """softmax (or log_softmax) of every row of a 2-D [N, D] tensor (any D); ``half_logsum``: see the module
    docstring."""
    N, D = x.shape
    out = nl.ndarray((N, D), x.dtype, buffer=nl.shared_hbm)
    half_logsum = bool(half_logsum and log and x.dtype in (nl.bfloat16, nl.float16))
    if not one_pass(D):
        _softmax_long(x, out, log, half_logsum)
        return out
    check_sbuf((NBUF + 1) * 3 * D * 4 + 64, f"softmax D={D}")
    ring = collections.deque(maxlen=NBUF)
    for r0 in range(0, N, PMAX):
        p = min(PMAX, N - r0)
        y = softmax_rows(x, r0, p, log, half_logsum, ring)
        nisa.dma_copy(dst=out[r0:r0 + p, :], src=y[:p])
    return out


def softmax_rows(x, r0: int, p: int, log: bool, half_logsum: bool, ring):
    """The [128, D] SBUF tile of the softmax (or log-softmax) of rows [r0, r0 + p) of x [N, D], one row per
    partition (``one_pass(D)``); its tiles go to ``ring``. ``softmax_kernel``'s block, and the fused loss's."""
    D = x.shape[1]
    t = nl.ndarray((PMAX, D), x.dtype, buffer=nl.sbuf)     # as stored: a casting DMA moves fp32 bytes
    nisa.dma_copy(dst=t[:p], src=x[r0:r0 + p, :])           # SyncE: the block's rows
    neg_max = nl.ndarray((PMAX, 1), _max_dtype(x.dtype), buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_max[:p], op=nl.maximum, data=t[:p], axis=(1,), negate=True)   # VectorE
    e = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
    s = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e[:p], op=nl.exp, data=t[:p], bias=neg_max[:p], reduce_op=nl.add, reduce_res=s[:p],
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)  # ScalarE: exp(x - max) and its row sums
    y = nl.ndarray((PMAX, D), x.dtype, buffer=nl.sbuf)     # the one rounding to the output dtype
    if log:   # (x - max) - log s, as the CPU: x - (max + log s) rounds the sum at max's magnitude first
        ls = _log_sum(s, p, x.dtype, half_logsum)
        nisa.tensor_scalar(dst=y[:p], data=t[:p], op0=nl.add, operand0=neg_max[:p], op1=nl.subtract,
                           operand1=ls[:p], engine=nisa.gpsimd_engine)
    else:
        rs = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=rs[:p], data=s[:p])
        nisa.tensor_scalar(dst=y[:p], data=e[:p], op0=nl.multiply, operand0=rs[:p], engine=nisa.gpsimd_engine)
    ring.append((t, e, y))
    return y


def softmax(x, dim: int = -1, log: bool = False):
    """softmax (``log=True``: log_softmax) of a tensor over ``dim`` through the simulator. The last dim
    runs in place; another dim is moved last and back by the permute kernel (two extra copies)."""
    x = as_tensor(x)
    if x.dim() == 0 or x.numel() == 0:
        return softmax(x.reshape(1, -1), -1, log).reshape(x.shape) if x.numel() else x.new_empty(x.shape)
    dim = dim % x.dim()
    if dim != x.dim() - 1:
        perm = [d for d in range(x.dim()) if d != dim] + [dim]
        inv = [perm.index(d) for d in range(x.dim())]
        return permute(softmax(permute(x, perm), -1, log), inv)
    shape = x.shape
    return softmax_kernel(x.reshape(-1, shape[-1]), log=log).reshape(shape)


def log_softmax(x, dim: int = -1):
    """log_softmax over ``dim``."""
    return softmax(x, dim, log=True)


# ---- attention probabilities, softmax backward -------------------------------------------------------
# Attention rows are short (S keys, often 64-512): these kernels take grouped rows (kernels._common).

NEG_BIG = -3.0e38   # a finite "minus infinity" for masked scores: exp() of it underflows to exactly 0


def attention_fits(S: int) -> bool:
    """Whether rows of S keys take ``attention_softmax_kernel`` (a grouped tile holds max(S, ROW_ELEMS))."""
    return ((NBUF + 1) * 4 + 5) * max(S, ROW_ELEMS) * 4 + 64 <= nl.tile_size.sbuf_fmax_bytes


def _causal_mask(mask, cols, r0, p, g, L):
    """mask[0][i, k, j] = 1.0 where key j is at or before the query position (r0 + i*g + k) mod L, else 0;
    mask[1] = 0 there, else NEG_BIG (the additive form)."""
    keep, bias = mask
    pos = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=pos[:p], pattern=[[1, g]], offset=r0, channel_multiplier=g)
    nisa.tensor_scalar(dst=pos[:p], data=pos[:p], op0="mod", operand0=float(L))
    S = cols.shape[-1]
    nisa.tensor_tensor(dst=keep[:p], data1=cols[:p, :g, :], data2=spread(pos, p, g, S), op=nl.less_equal)
    nisa.tensor_scalar(dst=bias[:p], data=keep[:p], op0=nl.subtract, operand0=1.0, op1=nl.multiply,
                       operand1=-NEG_BIG)


@nki.jit
def attention_softmax_kernel(x, scale=1.0, causal_len=0):
    """(softmax(scale * x + mask), logsumexp) of the rows of scores [N, S], with the logsumexp as
    (N, 1) fp32. ``causal_len`` L > 0 masks column j of row r where j > r % L (rows are (batch,
    query) pairs of L queries: the top-left causal mask of scaled_dot_product_attention).

    Masked scores never reach exp(): the row max is taken over ``score + bias`` (NEG_BIG where masked),
    then the masked differences are zeroed before exp() and their exponentials zeroed after, so the
    probabilities there are exactly 0 (exp() of hugely negative numbers underflows through denormals,
    which costs the simulator's host ~20x)."""
    N, S = x.shape
    assert attention_fits(S), f"attention softmax: rows of {S} keys do not fit SBUF in one pass"
    blocks, G = row_blocks(N, S)
    out = nl.ndarray((N, S), x.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((N, 1), nl.float32, buffer=nl.shared_hbm)
    cols = shared = None
    if causal_len:
        cols = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.sbuf)     # cols[i, k, j] = j
        nisa.iota(dst=cols, pattern=[[0, G], [1, S]], offset=0)
        if (PMAX * G) % causal_len == 0:   # every grouped block starts at query position 0: one mask serves all
            shared = tuple(nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.sbuf) for _ in range(2))
            _causal_mask(shared, cols, 0, PMAX, G, causal_len)
    ring = collections.deque(maxlen=NBUF)
    for r0, p, g in blocks:
        t = load_grouped(x, r0, p, g)
        if scale != 1.0:
            nisa.tensor_scalar(dst=t[:p], data=t[:p], op0=nl.multiply, operand0=float(scale))
        neg_max = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
        mask = None
        if causal_len:
            mask = shared if g == G and shared is not None else None
            if mask is None:
                mask = tuple(nl.ndarray((PMAX, g, S), nl.float32, buffer=nl.sbuf) for _ in range(2))
                _causal_mask(mask, cols, r0, p, g, causal_len)
            u = nl.ndarray((PMAX, g, S), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=u[:p], data1=t[:p], data2=mask[1][:p], op=nl.add)
            nisa.tensor_reduce(dst=neg_max[:p], op=nl.maximum, data=u[:p], axis=(2,), negate=True)
        else:
            nisa.tensor_reduce(dst=neg_max[:p], op=nl.maximum, data=t[:p], axis=(2,), negate=True)
        nisa.tensor_tensor(dst=t[:p], data1=t[:p], data2=spread(neg_max, p, g, S), op=nl.add)
        if mask is not None:
            nisa.tensor_tensor(dst=t[:p], data1=t[:p], data2=mask[0][:p], op=nl.multiply)
        e = nl.ndarray((PMAX, g, S), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e[:p], op=nl.exp, data=t[:p])
        if mask is not None:
            nisa.tensor_tensor(dst=e[:p], data1=e[:p], data2=mask[0][:p], op=nl.multiply)
        ssum = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=ssum[:p], op=nl.add, data=e[:p], axis=(2,))
        rs = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=rs[:p], data=ssum[:p])
        nisa.tensor_tensor(dst=e[:p], data1=e[:p], data2=spread(rs, p, g, S), op=nl.multiply)
        ls = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)            # logsumexp = log(sum) + max
        nisa.activation(dst=ls[:p], op=nl.log, data=ssum[:p])
        nisa.tensor_tensor(dst=ls[:p], data1=ls[:p], data2=neg_max[:p], op=nl.subtract)
        nisa.dma_copy(dst=grouped_rows(out, r0, p, g), src=e[:p])
        nisa.dma_copy(dst=lse[r0:r0 + p * g, :].reshape((p, g)), src=ls[:p])
        ring.append((t, e))
    return out, lse


@nki.jit
def softmax_bwd_kernel(grad, y, log=False, scale=1.0):
    """The input gradient of softmax (or log_softmax) over the rows of [N, D], given the output ``y``:
    ``scale * y * (g - sum(g * y))`` (log: ``scale * (g - exp(y) * sum(g))``)."""
    N, D = y.shape
    if not one_pass(D):
        out = nl.ndarray((N, D), y.dtype, buffer=nl.shared_hbm)
        _softmax_bwd_long(grad, y, out, log, scale)
        return out
    blocks, G = row_blocks(N, D)
    check_sbuf((NBUF + 1) * 3 * G * D * 4 + 64, f"softmax backward D={D}")
    out = nl.ndarray((N, D), y.dtype, buffer=nl.shared_hbm)
    ring = collections.deque(maxlen=NBUF)
    for r0, p, g in blocks:
        gr, t = load_grouped(grad, r0, p, g), load_grouped(y, r0, p, g)
        s = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
        w = nl.ndarray((PMAX, g, D), nl.float32, buffer=nl.sbuf)
        if log:   # dx = g - exp(y) * sum(g)
            log_softmax_bwd_block(gr, t, s, w, p, g, D)
        else:     # dx = (g - sum(g * y)) * y
            nisa.tensor_tensor(dst=w[:p], data1=gr[:p], data2=t[:p], op=nl.multiply)
            nisa.tensor_reduce(dst=s[:p], op=nl.add, data=w[:p], axis=(2,))
            nisa.tensor_tensor(dst=w[:p], data1=gr[:p], data2=spread(s, p, g, D), op=nl.subtract)
            nisa.tensor_tensor(dst=w[:p], data1=w[:p], data2=t[:p], op=nl.multiply)
        if scale != 1.0:
            nisa.tensor_scalar(dst=w[:p], data=w[:p], op0=nl.multiply, operand0=float(scale))
        nisa.dma_copy(dst=grouped_rows(out, r0, p, g), src=w[:p])
        ring.append((gr, t, w))
    return out


def log_softmax_bwd_block(gr, t, s, w, p: int, g: int, D: int) -> None:
    """w[:p] = gr - exp(t) * sum(gr) over each of the g rows of D per partition (a grouped block of the
    log-softmax gradient ``gr`` and output ``t``), fp32; ``s`` [128, g] takes the row sums."""
    nisa.tensor_reduce(dst=s[:p], op=nl.add, data=gr[:p], axis=(2,))     # VectorE: sum(g) per row
    nisa.activation(dst=w[:p], op=nl.exp, data=t[:p])                    # ScalarE: exp(y)
    nisa.tensor_tensor(dst=w[:p], data1=w[:p], data2=spread(s, p, g, D), op=nl.multiply)
    nisa.tensor_tensor(dst=w[:p], data1=gr[:p], data2=w[:p], op=nl.subtract)


def _softmax_bwd_long(grad, y, out, log: bool, scale: float) -> None:
    """Rows beyond SBUF, two passes over column blocks of W: s = sum(g) (log) or sum(g * y) per row, then
    dx = g - exp(y) * s (log) or (g - s) * y, times ``scale``; fp32 on chip, dx rounded once."""
    N, D = y.shape
    ring = collections.deque(maxlen=NBUF)

    def load(src, r0, p, c0, w):
        t = nl.ndarray((PMAX, W), src.dtype, buffer=nl.sbuf)     # as stored (a casting DMA moves fp32 bytes)
        nisa.dma_copy(dst=t[:p, :w], src=src[r0:r0 + p, c0:c0 + w])
        return t

    for r0 in range(0, N, PMAX):
        p = min(PMAX, N - r0)
        s = _col()
        nisa.memset(dst=s[:p], value=0.0)
        for c0 in range(0, D, W):                 # pass 1: the row sums
            w = min(W, D - c0)
            g = load(grad, r0, p, c0, w)
            bs = _col()
            if log:
                nisa.tensor_reduce(dst=bs[:p], op=nl.add, data=g[:p, :w], axis=(1,))
                ring.append((g,))
            else:
                t = load(y, r0, p, c0, w)
                gy = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=gy[:p, :w], data1=g[:p, :w], data2=t[:p, :w], op=nl.multiply,
                                   engine=nisa.gpsimd_engine)
                nisa.tensor_reduce(dst=bs[:p], op=nl.add, data=gy[:p, :w], axis=(1,))
                ring.append((g, t, gy))
            nisa.tensor_tensor(dst=s[:p], data1=s[:p], data2=bs[:p], op=nl.add)
        for c0 in range(0, D, W):                 # pass 2: dx
            w = min(W, D - c0)
            g, t = load(grad, r0, p, c0, w), load(y, r0, p, c0, w)
            dx = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
            res = dx if scale == 1.0 else nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
            if log:   # g - exp(y) * s
                nisa.activation(dst=dx[:p, :w], op=nl.exp, data=t[:p, :w])
                nisa.scalar_tensor_tensor(dst=res[:p, :w], data=dx[:p, :w], op0=nl.multiply, operand0=s[:p],
                                          op1=nl.subtract, operand1=g[:p, :w], reverse1=True)
            else:     # (g - s) * y
                nisa.scalar_tensor_tensor(dst=res[:p, :w], data=g[:p, :w], op0=nl.subtract, operand0=s[:p],
                                          op1=nl.multiply, operand1=t[:p, :w])
            o = nl.ndarray((PMAX, W), y.dtype, buffer=nl.sbuf)
            if scale != 1.0:
                nisa.activation(dst=o[:p, :w], op=nl.identity, data=res[:p, :w], scale=float(scale))
            else:
                nisa.tensor_copy(dst=o[:p, :w], src=res[:p, :w], engine=nisa.gpsimd_engine)
            nisa.dma_copy(dst=out[r0:r0 + p, c0:c0 + w], src=o[:p, :w])
            ring.append((g, t, dx, res, o))
