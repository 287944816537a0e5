"""Negative log likelihood over class scores [N, C] with class targets: forward and backward, one launch each.

Rows are grouped (``kernels._common.row_blocks``: G rows per partition, [128, G, C] tiles). Targets
arrive as int32 words ([N, 1], or [N, 2] for int64 targets: low and high word) and are compared in
fp32 (exact for classes and ignore_index below 2**24; the host checks those bounds):

    per block:  lo = target (fp32), valid = target != ignore_index
                (int64: also the high word must be the low word's sign extension, else out of range)
                bad = valid and not 0 <= target < C              (counted, the host raises IndexError)
                onehot[i, k, c] = (c == target)                    iota columns vs. the targets, VectorE
                pick = -1 (all bits) where onehot and valid, else 0 (int32)
                w_n = valid (or sum(weight & pick))             the row's class weight
    forward:    loss_n = -w_n * sum(x & pick)                     the picked score: a bitwise select, so
                                                                   an inf/NaN in another class (a masked
                                                                   logit) stays out of the row, as on the CPU
                per-partition sums of loss_n, w_n and bad, then one ones^T @ sums matmul (TensorE)
                gives the totals: sum, mean = sum / sum(w_n)
    backward:   grad = (-w_n * g_n) & pick     (g_n: the row's grad for reduction none, else the
                                                scalar grad, divided by the total weight for mean; an
                                                inf/NaN coefficient, e.g. a total weight of 0, reaches only
                                                the target element of a counted row, as on the CPU)

Rows of more classes than SBUF holds whole (~4000 on trn2: every LLM vocabulary) go one row per partition:
the forward gathers each row's target score (and class weight) by one indirect DMA per row block, at the
flat index i * C + t of the block's view (rows per block keep it below 2**24, exact in fp32); the backward
stores zeros over the rows and writes each row's coefficient to its target element by one indirect DMA.
Rows that read nothing (ignored or out of range) point at their first element and are masked to 0.
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, check_sbuf, grouped_rows, load_grouped, row_blocks, spread
from torchneuron.kernels.softmax import log_softmax_bwd_block, one_pass, softmax_rows

NBUF = 2
EXACT = 2 ** 24   # fp32 holds every integer below this exactly


WC = 2048        # classes per column block of the wide path


def nll_sbuf_bytes(N: int, C: int) -> int:
    """SBUF per partition the whole-row path of the nll kernels needs for N rows of C classes (classes beyond
    ~4000 on trn2 do not fit: they take column blocks of WC, ``wide``)."""
    G = row_blocks(N, C)[1]
    return (NBUF + 1) * 4 * G * C * 4 + 2 * C * 4 + 256


def wide(N: int, C: int) -> bool:
    """Whether N rows of C classes take the column-block path (whole rows do not fit SBUF)."""
    return nll_sbuf_bytes(N, C) > nl.tile_size.sbuf_fmax_bytes


def _col(g: int = 1):
    return nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)


def _class_iota(G: int, C: int):
    """cols[i, k, c] = c: the class index of every column, made once per launch."""
    cols = nl.ndarray((PMAX, G, C), nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=cols, pattern=[[0, G], [1, C]], offset=0)
    return cols


def int_bits(t, p, g, C):
    """The int32 view of the bits of an fp32 [p, g, C] SBUF tile (or of a [p, g] one read as [p, g, C])."""
    if len(t.shape) == 2:
        return t[:p, :g].ap([[g, p], [1, g], [0, C]], dtype=nl.int32)
    return t[:p].ap([[g * C, p], [C, g], [1, C]], dtype=nl.int32)


def _targets(words, weight, cols, r0, p, g, C, ignore_index, blocks=False):
    """(pick [P, g, C] int32 select mask, w_n [P, g], bad [P, g]) of the rows' targets (see the module
    docstring); ``blocks``: of all the rows, row k*128 + i at [i, k] (``row_targets``)."""
    tf, valid, bad = row_targets(words, r0, p, g, C, ignore_index, blocks)
    pick, w = _pick(tf, valid, cols, weight, p, g, C)
    return pick, (valid if w is None else w), bad


def row_targets(words, r0, p, g, C, ignore_index, blocks=False):
    """(targets as fp32 [P, g, S] (the low word first), valid [P, g], bad [P, g]) of the rows' targets; ``blocks``:
    of all g * 128 rows, row k*128 + i at [i, k] (the 128-row blocks side by side: one pass for every block of
    a kernel that takes its rows one per partition)."""
    S = words.shape[1]
    if blocks:
        assert r0 == 0 and p == PMAX and words.shape[0] == g * PMAX, "row_targets: blocks of 128 rows only"
        wd = nl.ndarray((PMAX, g, S), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=wd, src=words.reshape((g * PMAX * S,)).ap([[S, PMAX], [PMAX * S, g], [1, S]], offset=0))
    else:
        wd = load_grouped(words, r0, p, g, nl.int32)
    tf = nl.ndarray((PMAX, g, S), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tf[:p], src=wd[:p])
    lo = tf[:p, :, 0]
    inr = _col(g)   # 1 where 0 <= target < C
    nisa.tensor_scalar(dst=inr[:p], data=lo, op0=nl.greater_equal, operand0=0.0)
    lt = _col(g)
    nisa.tensor_scalar(dst=lt[:p], data=lo, op0=nl.less, operand0=float(C))
    nisa.tensor_tensor(dst=inr[:p], data1=inr[:p], data2=lt[:p], op=nl.multiply)
    ignored = _col(g)
    nisa.tensor_scalar(dst=ignored[:p], data=lo, op0=nl.equal, operand0=float(ignore_index))
    if S == 2:      # int64: the value is the low word only where the high word is its sign extension
        wide = _col(g)
        nisa.tensor_scalar(dst=wide[:p], data=lo, op0=nl.less, operand0=0.0)
        nisa.tensor_tensor(dst=wide[:p], data1=wide[:p], data2=tf[:p, :, 1], op=nl.add)
        nisa.tensor_scalar(dst=wide[:p], data=wide[:p], op0=nl.equal, operand0=0.0)
        nisa.tensor_tensor(dst=inr[:p], data1=inr[:p], data2=wide[:p], op=nl.multiply)
        nisa.tensor_tensor(dst=ignored[:p], data1=ignored[:p], data2=wide[:p], op=nl.multiply)
    valid = _col(g)
    nisa.tensor_scalar(dst=valid[:p], data=ignored[:p], op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
    bad = _col(g)   # valid * (1 - inr)
    nisa.tensor_scalar(dst=bad[:p], data=inr[:p], op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
    nisa.tensor_tensor(dst=bad[:p], data1=bad[:p], data2=valid[:p], op=nl.multiply)
    return tf, valid, bad


def _pick(tf, valid, cols, weight, p, g, W):
    """(pick [P, g, W] int32 select mask of each row's target class, weight[target] [P, g] of the counted
    rows, or None without class weights); ``cols`` holds 0 .. W-1, ``weight`` the class weights on every
    partition."""
    S = tf.shape[2]
    target = tf[:p, :, 0:1].ap([[g * S, p], [S, g], [0, W]])     # the low words spread over the classes
    onehot = nl.ndarray((PMAX, g, W), nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=onehot[:p], data1=cols[:p, :g, :W], data2=target, op=nl.equal)
    pick = nl.ndarray((PMAX, g, W), nl.int32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=pick[:p], data=onehot[:p], op0=nl.multiply, operand0=-1.0, op1=nl.multiply,
                              operand1=spread(valid, p, g, W))
    if weight is None:
        return pick, None
    weighted = nl.ndarray((PMAX, g, W), nl.float32, buffer=nl.sbuf)     # weight[target] of counted rows
    row = weight[:p, :W].ap([[weight.shape[1], p], [0, g], [1, W]], dtype=nl.int32)
    nisa.tensor_tensor(dst=int_bits(weighted, p, g, W), data1=row, data2=pick[:p], op=nl.bitwise_and)
    w = _col(g)
    nisa.tensor_reduce(dst=w[:p], op=nl.add, data=weighted[:p], axis=(2,))
    return pick, w


def _weight_row(weight, C):
    if weight is None:
        return None
    t = nl.ndarray((PMAX, C), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=weight.broadcast_to((PMAX, C)))
    return t


def partition_totals(acc, k, dst):
    """dst[0, :k] = the sums over partitions of acc[:, :k] (ones^T @ acc on TensorE)."""
    ones = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    ps = nl.ndarray((1, k), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=ones, moving=acc[:, :k], accumulate=False)
    nisa.tensor_copy(dst=dst, src=ps)


def _picked_rows(x, words, weight, ignore_index, ring):
    """Per row block of the forward: (r0, p, g, (None, w_n, bad, s)) with s [P, g] each row's picked score (its
    target's, 0 for ignored rows): from whole rows ([128, G, C] tiles), or for wide rows gathered by one
    indirect DMA (one element per row: the rest of the row is never read)."""
    N, C = x.shape
    if not wide(N, C):
        blocks, G = row_blocks(N, C)
        check_sbuf(nll_sbuf_bytes(N, C), f"nll_loss C={C}")
        cols, wrow = _class_iota(G, C), _weight_row(weight, C)
        for r0, p, g in blocks:
            xt = load_grouped(x, r0, p, g)
            pick, w, bad = _targets(words, wrow, cols, r0, p, g, C, ignore_index)
            nisa.tensor_tensor(dst=int_bits(xt, p, g, C), data1=int_bits(xt, p, g, C), data2=pick[:p],
                               op=nl.bitwise_and)
            s = _col(g)
            nisa.tensor_reduce(dst=s[:p], op=nl.add, data=xt[:p], axis=(2,))
            ring.append((xt, pick))
            yield r0, p, g, (None, w, bad, s)
        return
    pr = min(PMAX, EXACT // C)               # rows per block: every flat index below 2**24 (exact in fp32)
    for r0 in range(0, N, pr):
        p = min(pr, N - r0)
        tf, valid, bad = row_targets(words, r0, p, 1, C, ignore_index)
        idx, mask = flat_targets(tf, valid, bad, p, C)
        s = gathered(x[r0:r0 + p, :], idx, mask, p)
        w = valid if weight is None else gathered(weight, weight_index(tf, valid, bad, p), mask, p)
        yield r0, p, 1, (None, w, bad, s)


def flat_targets(tf, valid, bad, p: int, C: int):
    """(int32 [P, 1] index of row i's target in its row block's flat [p * C] view: i * C + t, or i * C where
    the row reads nothing; int32 [P, 1] select mask, all bits set where it reads its target)."""
    use = _col()   # counted and in range
    nisa.tensor_tensor(dst=use[:p], data1=valid[:p], data2=bad[:p], op=nl.subtract)
    f = _col()
    nisa.tensor_tensor(dst=f[:p], data1=tf[:p, :, 0], data2=use[:p], op=nl.multiply)
    base = _col()
    nisa.iota(dst=base[:p], pattern=[[0, 1]], offset=0, channel_multiplier=C)
    nisa.tensor_tensor(dst=f[:p], data1=f[:p], data2=base[:p], op=nl.add)
    idx = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=idx[:p], src=f[:p])
    mask = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mask[:p], data=use[:p], op0=nl.multiply, operand0=-1.0)
    return idx, mask


def weight_index(tf, valid, bad, p: int):
    """int32 [P, 1]: each row's target class where it reads one, else 0 (an index into the class weights)."""
    use, f = _col(), _col()
    nisa.tensor_tensor(dst=use[:p], data1=valid[:p], data2=bad[:p], op=nl.subtract)
    nisa.tensor_tensor(dst=f[:p], data1=tf[:p, :, 0], data2=use[:p], op=nl.multiply)
    idx = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=idx[:p], src=f[:p])
    return idx


def gathered(src, idx, mask, p: int):
    """fp32 [P, 1]: element idx[i] of the flat HBM view ``src`` by one indirect DMA, kept where ``mask`` is set
    and 0 elsewhere (a bitwise select: an inf/NaN read for an ignored row stays out)."""
    v = _col()
    nisa.dma_copy(dst=v[:p], src=src.ap([[1, p], [1, 1]], vector_offset=idx[:p]))
    nisa.tensor_tensor(dst=int_bits(v, p, 1, 1), data1=int_bits(v, p, 1, 1), data2=mask[:p].ap([[1, p], [1, 1], [0, 1]]),
                       op=nl.bitwise_and)
    return v


def accumulate_rows(acc, cols, p: int) -> None:
    """acc[:p, k] += the row sums of the [P, g] tiles ``cols`` (the per-partition sums of loss, weight, bad)."""
    part = nl.ndarray((PMAX, len(cols)), nl.float32, buffer=nl.sbuf)
    for k, v in enumerate(cols):
        nisa.tensor_reduce(dst=part[:p, k:k + 1], op=nl.add, data=v[:p], axis=(1,))
    nisa.tensor_tensor(dst=acc[:p], data1=acc[:p], data2=part[:p], op=nl.add)


def store_totals(acc, reduction: int, losses, total, bad_count) -> None:
    """From per-partition sums acc [P, 3] of (loss, weight, bad): the reduced loss into ``losses`` (reduction 1: over
    the total weight, 0 / 0 NaN as on the CPU; 0 stores nothing), the total weight and the bad count."""
    tot = nl.ndarray((1, 3), nl.float32, buffer=nl.sbuf)
    partition_totals(acc, 3, tot)
    if reduction == 1:
        r = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=r, data=tot[:, 1:2])
        nisa.tensor_tensor(dst=tot[:, 0:1], data1=tot[:, 0:1], data2=r, op=nl.multiply)
    if reduction != 0:
        nisa.dma_copy(dst=losses, src=tot[:, 0:1])
    nisa.dma_copy(dst=total, src=tot[:, 1:2])
    nisa.dma_copy(dst=bad_count, src=tot[:, 2:3])


@nki.jit
def nll_fwd_kernel(x, words, weight=None, ignore_index=-100, reduction=1):
    """(losses [N, 1] (reduction 0) or the reduced loss [1, 1], total weight [1, 1], out-of-range target
    count [1, 1] fp32) of the negative log likelihood of scores x [N, C] at the targets ``words``."""
    N, C = x.shape
    assert C < EXACT and abs(ignore_index) < EXACT, "nll_loss: classes and ignore_index must be below 2**24"
    losses = nl.ndarray((N, 1) if reduction == 0 else (1, 1), x.dtype, buffer=nl.shared_hbm)
    total = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    bad_count = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((PMAX, 3), nl.float32, buffer=nl.sbuf)    # per partition: sum loss, sum w, sum bad
    nisa.memset(dst=acc, value=0.0)
    ring = collections.deque(maxlen=NBUF)
    for r0, p, g, picked in _picked_rows(x, words, weight, ignore_index, ring):
        _, w, bad, picked_sum = picked
        _add_losses(acc, losses if reduction == 0 else None, picked_sum, w, bad, r0, p, g)
    store_totals(acc, reduction, losses, total, bad_count)
    return losses, total, bad_count


def _add_losses(acc, losses, picked_sum, w, bad, r0: int, p: int, g: int) -> None:
    """loss_n = -w_n * (picked score) of a row block [p, g] (stored per row into ``losses`` unless None), its
    per-partition sums of loss, weight and bad added to ``acc``."""
    loss = _col(g)
    nisa.scalar_tensor_tensor(dst=loss[:p], data=picked_sum[:p], op0=nl.multiply, operand0=-1.0,
                              op1=nl.multiply, operand1=w[:p])
    if losses is not None:
        nisa.dma_copy(dst=losses[r0:r0 + p * g, :].reshape((p, g)), src=loss[:p])
    accumulate_rows(acc, (loss, w, bad), p)


def fuses_log_softmax_fwd(N: int, C: int, dt) -> bool:
    """Whether ``log_softmax_nll_fwd_kernel`` takes these scores: fp32 rows the log-softmax holds whole in SBUF,
    whole blocks of 128 rows whose targets' tiles fit beside it."""
    return (dt == nl.float32 and N >= PMAX and N % PMAX == 0 and 0 < C < EXACT and one_pass(C)
            and (NBUF + 1) * 3 * C * 4 + 4 * (N // PMAX) * C * 4 <= nl.tile_size.sbuf_fmax_bytes)


@nki.jit
def log_softmax_nll_fwd_kernel(x, words, weight=None, ignore_index=-100, reduction=1):
    """(y = log_softmax(x) [N, C], then ``nll_fwd_kernel(y, ...)``'s three results) in one pass: each block of
    rows is the log-softmax kernel's (one row per partition, the same instructions: y is bit-identical), stored,
    and its targets' scores picked from SBUF, so the loss does not load y back. The rows sit one per partition
    instead of nll_fwd_kernel's grouped rows, so the loss total adds the same row losses in another order."""
    N, C = x.shape
    assert fuses_log_softmax_fwd(N, C, x.dtype), f"log_softmax + nll_loss: fp32 blocks of 128 rows of C={C} only"
    assert abs(ignore_index) < EXACT, "nll_loss: ignore_index must be below 2**24"
    assert reduction in (1, 2), "log_softmax + nll_loss: a reduced loss (mean or sum) only"
    nb = N // PMAX
    y_out = nl.ndarray((N, C), x.dtype, buffer=nl.shared_hbm)
    loss = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    total = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    bad_count = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((PMAX, 3), nl.float32, buffer=nl.sbuf)    # per partition: sum loss, sum w, sum bad
    nisa.memset(dst=acc, value=0.0)
    # VectorE: every block's targets in one pass, block k's rows in column k (as softmax_rows lays them out)
    pick, w, bad = _targets(words, _weight_row(weight, C), _class_iota(nb, C), 0, PMAX, nb, C, ignore_index, True)
    picked = _col(nb)
    ring = collections.deque(maxlen=NBUF)
    for k in range(nb):
        r0 = k * PMAX
        y = softmax_rows(x, r0, PMAX, True, False, ring)           # ScalarE/VectorE/GpSimd: the rows' y
        nisa.dma_copy(dst=y_out[r0:r0 + PMAX, :], src=y)           # SyncE: y stored (the backward reads it)
        sel = nl.ndarray((PMAX, 1, C), nl.float32, buffer=nl.sbuf)
        # VectorE: the target's score kept bit for bit (a select: an inf/NaN elsewhere in the row stays out)
        nisa.tensor_tensor(dst=int_bits(sel, PMAX, 1, C), data1=y.ap([[C, PMAX], [C, 1], [1, C]], dtype=nl.int32),
                           data2=pick[:, k:k + 1, :], op=nl.bitwise_and)
        nisa.tensor_reduce(dst=picked[:, k:k + 1], op=nl.add, data=sel, axis=(2,))
        ring.append(sel)
    _add_losses(acc, None, picked, w, bad, 0, PMAX, nb)
    store_totals(acc, reduction, loss, total, bad_count)        # TensorE: the totals over the partitions
    return y_out, loss, total, bad_count


def _bwd_rows(words, weight, C, ignore_index, coefficient, spread_coef, dx):
    """Per row block of the backward, after writing its dx rows: (r0, p, g, bad). Whole rows, or for wide
    rows zero stores of WC columns and one indirect DMA writing each row's target element."""
    N = words.shape[0]
    if not wide(N, C):
        blocks, G = row_blocks(N, C)
        check_sbuf(nll_sbuf_bytes(N, C), f"nll_loss backward C={C}")
        cols, wrow = _class_iota(G, C), _weight_row(weight, C)
        for r0, p, g in blocks:
            pick, w, bad = _targets(words, wrow, cols, r0, p, g, C, ignore_index)
            spread_coef(coefficient(w, r0, p, g), pick, p, g, C, grouped_rows(dx, r0, p, g), r0)
            yield r0, p, g, bad
        return
    pr = min(PMAX, EXACT // C)
    zeros = nl.ndarray((PMAX, WC), dx.dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    for r0 in range(0, N, pr):
        p = min(pr, N - r0)
        tf, valid, bad = row_targets(words, r0, p, 1, C, ignore_index)
        idx, mask = flat_targets(tf, valid, bad, p, C)
        w = valid if weight is None else gathered(weight, weight_index(tf, valid, bad, p), mask, p)
        coef = coefficient(w, r0, p, 1)
        for c0 in range(0, C, WC):            # the block's rows zeroed, then each target element written
            wc = min(WC, C - c0)
            nisa.dma_copy(dst=dx[r0:r0 + p, c0:c0 + wc], src=zeros[:p, :wc])
        nisa.tensor_tensor(dst=int_bits(coef, p, 1, 1), data1=int_bits(coef, p, 1, 1),
                           data2=mask[:p].ap([[1, p], [1, 1], [0, 1]]), op=nl.bitwise_and)
        nisa.dma_copy(dst=dx[r0:r0 + p, :].ap([[1, p], [1, 1]], vector_offset=idx[:p]), src=coef[:p])
        yield r0, p, 1, bad


def fuses_log_softmax_bwd(N: int, C: int, dt, y_dt) -> bool:
    """Whether ``nll_bwd_kernel(log_softmax=...)`` can carry dx through the log-softmax backward on chip: fp32
    (dx as the separate kernel would read it back), whole rows in SBUF with the backward's tiles beside."""
    if dt != nl.float32 or y_dt != nl.float32 or wide(N, C):
        return False
    G = row_blocks(N, C)[1]
    return nll_sbuf_bytes(N, C) + 3 * NBUF * G * C * 4 <= nl.tile_size.sbuf_fmax_bytes


def gradient_scale(grad, total, reduction: int, sign: float):
    """fp32 [P, 1]: ``sign`` times the scalar incoming gradient [1, 1] on every partition, over the total weight
    [1, 1] for the mean; None for reduction 0 (a gradient per row)."""
    if reduction == 0:
        return None
    scale = _col()
    nisa.dma_copy(dst=scale, src=grad.broadcast_to((PMAX, 1)))
    if sign != 1.0:
        nisa.tensor_scalar(dst=scale, data=scale, op0=nl.multiply, operand0=sign)
    if reduction == 1:
        tw = _col()
        nisa.dma_copy(dst=tw, src=total.broadcast_to((PMAX, 1)))
        nisa.reciprocal(dst=tw, data=tw)
        nisa.tensor_tensor(dst=scale, data1=scale, data2=tw, op=nl.multiply)
    return scale


@nki.jit
def nll_bwd_kernel(grad, words, total, weight=None, num_classes=1, ignore_index=-100, reduction=1,
                   log_softmax=None):
    """(d loss / d x [N, C] in grad's dtype, out-of-range target count [1, 1] fp32); ``grad`` is [N, 1] for
    reduction 0, else [1, 1]; ``total`` the forward's total weight [1, 1].

    ``log_softmax`` (where ``fuses_log_softmax_bwd`` says so): the fp32 [N, C] log-softmax output x was; each
    block of dx then goes on through its backward on chip (``log_softmax_bwd_block``, the eager kernel's
    instructions) and the kernel returns that gradient instead of dx: no store of dx and no reload of it."""
    N, C = words.shape[0], num_classes
    assert C < EXACT and abs(ignore_index) < EXACT, "nll_loss: classes and ignore_index must be below 2**24"
    if log_softmax is not None:
        assert fuses_log_softmax_bwd(N, C, grad.dtype, log_softmax.dtype) and tuple(log_softmax.shape) == (N, C), \
            f"nll_loss backward: no log-softmax backward of [{N}, {C}] {log_softmax.dtype} on chip"
    dx = nl.ndarray((N, C), grad.dtype, buffer=nl.shared_hbm)
    bad_count = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    scale = gradient_scale(grad, total, reduction, -1.0)
    acc = _col()
    nisa.memset(dst=acc, value=0.0)
    ring = collections.deque(maxlen=NBUF)

    def coefficient(w, r0, p, g):
        """-w_n * g_n (reduction none) or w_n * (-g / total weight) per row: the value at its target."""
        coef = _col(g)
        if reduction == 0:
            nisa.dma_copy(dst=coef[:p], src=grad[r0:r0 + p * g, :].reshape((p, g)))
            nisa.scalar_tensor_tensor(dst=coef[:p], data=coef[:p], op0=nl.multiply, operand0=-1.0,
                                      op1=nl.multiply, operand1=w[:p])
        else:
            nisa.tensor_scalar(dst=coef[:p], data=w[:p], op0=nl.multiply, operand0=scale[:p])
        return coef

    def spread_coef(coef, pick, p, g, W, dst, r0):
        """dst[:, :, :W] = coef at each row's target column, 0 elsewhere (a bitwise select), then store it (or
        its log-softmax backward)."""
        d = nl.ndarray((PMAX, g, W), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=int_bits(d, p, g, W), data1=int_bits(coef, p, g, W), data2=pick[:p], op=nl.bitwise_and)
        if log_softmax is not None:
            t, s = load_grouped(log_softmax, r0, p, g), nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
            w = nl.ndarray((PMAX, g, W), nl.float32, buffer=nl.sbuf)
            log_softmax_bwd_block(d, t, s, w, p, g, W)
            ring.append((t, s, w))
            d = w
        nisa.dma_copy(dst=dst, src=d[:p])
        ring.append((pick, d))

    for r0, p, g, bad in _bwd_rows(words, weight, C, ignore_index, coefficient, spread_coef, dx):
        part = _col()
        nisa.tensor_reduce(dst=part[:p], op=nl.add, data=bad[:p], axis=(1,))
        nisa.tensor_tensor(dst=acc[:p], data1=acc[:p], data2=part[:p], op=nl.add)
    tot = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
    partition_totals(acc, 1, tot)
    nisa.dma_copy(dst=bad_count, src=tot)
    return dx, bad_count
