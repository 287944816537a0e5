"""Cross-entropy over class scores [N, C] with class targets, fused: each row of logits is read once forward and
once backward (PyTorch composes it of log_softmax and nll_loss, which writes and rereads the [N, C]
log-probabilities).

Targets arrive as int32 words ([N, 1], or [N, 2] for int64: low and high word) and are decoded as the nll
kernels do (``kernels.losses.row_targets``: valid = not ignore_index, bad = valid and out of range, counted
for the host to raise IndexError). One row per partition, row blocks of up to 128 rows, columns in blocks
of W:

    forward, per row block:
        x_t = x[n, t_n], w_n = weight[t_n] (or valid)   one indirect DMA each (one element per row)
        per column block k (no dependency between blocks: the pipeline never waits on a running max):
            load [p, W] as stored                               DMA
            nm_k = -max(x_blk), clamped below +FLT_MAX          VectorE (bf16 reduces at twice the rate)
                   (a block of -inf then adds exp(-inf) = 0, as a masked logit does on the CPU)
            s_k = sum(exp(x_blk + nm_k))                         ScalarE exp with its accumulate
            sx_k = sum(x_blk)   (label smoothing only)           VectorE (fp32 sums)
        nM = min_k nm_k, S = sum_k s_k * exp(nM - nm_k)          [p, nb] ops: Chan-style combination
        lse = log S - nM                                         ScalarE log, VectorE
        loss_n = (1 - eps) w_n (lse - x_t) + eps valid (lse - sum(x) / C)   kept only where the row reads a
                                                                 target (a bitwise select: ignored rows are 0)
        per-partition sums of loss_n, w_n, bad; one ones^T @ sums matmul (TensorE) gives the totals
    backward, per row block (lse saved by the forward, g_n the row's incoming gradient over the total weight
    for mean):
        a_n = g_n ((1 - eps) w_n + eps valid), b_n = g_n (1 - eps) w_n, c_n = g_n eps valid / C
        per column block: dx = a_n exp(x - lse) - c_n            ScalarE exp, VectorE/GpSimdE alternately
                                                                 (one rounding to the output dtype)
        dx[n, t_n] = a_n exp(x_t - lse) - b_n - c_n              one indirect DMA after the block's stores

The probabilities are exp(x - lse) from the fp32 log-sum-exp, not from rounded log-probabilities: bf16/fp16
results are the exact ones rounded once. Class weights with label smoothing are not fused (the ops layer
takes PyTorch's composition for them). Row blocks keep every flat index i * C + t below 2**24 (exact in fp32).
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, cdiv, check_sbuf, itemsize
from torchneuron.kernels.losses import (accumulate_rows, EXACT, flat_targets, gathered, gradient_scale, int_bits,
                                        partition_totals, row_targets, store_totals, weight_index)

NBUF = 3
W = 4096            # columns per block: 8 KiB bf16 / 16 KiB fp32 rows per DMA (full DMA efficiency)
FINITE = 3.0e38     # the clamp of a block's -max: exp(-inf + FINITE) is 0, not NaN


def _col(dtype=nl.float32, n: int = 1):
    return nl.ndarray((PMAX, n), dtype, buffer=nl.sbuf)


def _keep(v, mask, p: int) -> None:
    """v[:p] (fp32 [P, 1]) kept where the int32 ``mask`` has all bits set, else 0 (a NaN stays out)."""
    nisa.tensor_tensor(dst=int_bits(v, p, 1, 1), data1=int_bits(v, p, 1, 1),
                       data2=mask[:p].ap([[1, p], [1, 1], [0, 1]]), op=nl.bitwise_and)


def _sbuf_bytes(C: int, dt) -> int:
    """SBUF per partition: NBUF + 1 live column blocks (logits and exp output in the input's dtype, fp32 dx)."""
    w = min(W, C)
    return (NBUF + 1) * w * (2 * itemsize(dt) + 4) + 64 * cdiv(C, W) + 1024


def _row_block_targets(words, weight, x, r0: int, p: int, C: int, ignore_index: int):
    """(x_t, w_n, valid, bad, mask) [P, 1] of rows [r0, r0 + p): the target logit and weight gathered by indirect
    DMA (0 where the row reads nothing), and the int32 mask of the rows that read a target."""
    tf, valid, bad = row_targets(words, r0, p, 1, C, ignore_index)
    idx, mask = flat_targets(tf, valid, bad, p, C)
    xt = gathered(x[r0:r0 + p, :], idx, mask, p)
    w = valid if weight is None else gathered(weight, weight_index(tf, valid, bad, p), mask, p)
    return xt, w, valid, bad, idx, mask


def _check(C: int, ignore_index: int, smoothing: float, weight) -> None:
    assert 0 < C < EXACT and abs(ignore_index) < EXACT, "cross_entropy: classes and ignore_index must be below 2**24"
    assert 0.0 <= smoothing <= 1.0 and (smoothing == 0.0 or weight is None), \
        "cross_entropy: label smoothing in [0, 1], and not with class weights"


@nki.jit
def cross_entropy_fwd_kernel(x, words, weight=None, ignore_index=-100, reduction=1, smoothing=0.0):
    """(losses [N, 1] (reduction 0) or the reduced loss [1, 1] in x's dtype, log-sum-exp [N, 1] fp32, total weight
    [1, 1] fp32, out-of-range target count [1, 1] fp32) of the cross-entropy of logits x [N, C] at the targets
    ``words``; ``weight`` the class weights [1, C] (x's dtype)."""
    N, C = x.shape
    _check(C, ignore_index, smoothing, weight)
    check_sbuf(_sbuf_bytes(C, x.dtype), f"cross_entropy C={C}")
    losses = nl.ndarray((N, 1) if reduction == 0 else (1, 1), x.dtype, buffer=nl.shared_hbm)
    lse_out = nl.ndarray((N, 1), nl.float32, buffer=nl.shared_hbm)
    total = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    bad_count = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((PMAX, 3), nl.float32, buffer=nl.sbuf)    # per partition: sum loss, sum w, sum bad
    nisa.memset(dst=acc, value=0.0)
    nb = cdiv(C, W)
    # a bf16 maximum is a bf16 value, and VectorE reduces bf16 to bf16 at twice the rate
    mdt = nl.bfloat16 if x.dtype == nl.bfloat16 else nl.float32
    ring = collections.deque(maxlen=NBUF)
    pr = min(PMAX, EXACT // C)
    for r0 in range(0, N, pr):
        p = min(pr, N - r0)
        xt, w, valid, bad, _, mask = _row_block_targets(words, weight, x, r0, p, C, ignore_index)
        nm = _col(mdt, nb)              # -max of each column block
        sk = _col(nl.float32, nb)       # sum(exp(x + nm_k)) of each column block
        sx = _col(nl.float32, nb) if smoothing else None
        for k, c0 in enumerate(range(0, C, W)):
            w_ = min(W, C - c0)
            t = nl.ndarray((PMAX, W), x.dtype, buffer=nl.sbuf)   # as stored: a casting DMA moves fp32 bytes
            nisa.dma_copy(dst=t[:p, :w_], src=x[r0:r0 + p, c0:c0 + w_])
            nisa.tensor_reduce(dst=nm[:p, k:k + 1], op=nl.maximum, data=t[:p, :w_], axis=(1,), negate=True)
            nisa.tensor_scalar(dst=nm[:p, k:k + 1], data=nm[:p, k:k + 1], op0=nl.minimum, operand0=FINITE)
            e = nl.ndarray((PMAX, W), x.dtype, buffer=nl.sbuf)   # never read: only its fp32 sum is kept
            nisa.activation(dst=e[:p, :w_], op=nl.exp, data=t[:p, :w_], bias=nm[:p, k:k + 1], reduce_op=nl.add,
                            reduce_res=sk[:p, k:k + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
            if smoothing:
                nisa.tensor_reduce(dst=sx[:p, k:k + 1], op=nl.add, data=t[:p, :w_], axis=(1,))
            ring.append((t, e))
        # lse = log(sum_k s_k exp(nM - nm_k)) - nM, nM = min_k nm_k (minus the row max)
        nM = _col()
        nisa.tensor_reduce(dst=nM[:p], op=nl.minimum, data=nm[:p, :nb], axis=(1,))
        f = _col(nl.float32, nb)
        nisa.activation(dst=f[:p], op=nl.exp, data=nm[:p, :nb], scale=-1.0, bias=nM[:p])
        nisa.tensor_tensor(dst=f[:p], data1=f[:p], data2=sk[:p], op=nl.multiply)
        lse = _col()
        nisa.tensor_reduce(dst=lse[:p], op=nl.add, data=f[:p], axis=(1,))
        nisa.activation(dst=lse[:p], op=nl.log, data=lse[:p])
        nisa.tensor_tensor(dst=lse[:p], data1=lse[:p], data2=nM[:p], op=nl.subtract)
        nisa.dma_copy(dst=lse_out[r0:r0 + p, :], src=lse[:p])
        # loss_n = (1 - eps) w_n (lse - x_t) [+ eps valid (lse - mean(x))], 0 where the row reads no target
        loss = _col()
        nisa.tensor_tensor(dst=loss[:p], data1=lse[:p], data2=xt[:p], op=nl.subtract)
        nisa.scalar_tensor_tensor(dst=loss[:p], data=loss[:p], op0=nl.multiply, operand0=1.0 - smoothing,
                                  op1=nl.multiply, operand1=w[:p])
        if smoothing:
            mx = _col()
            nisa.tensor_reduce(dst=mx[:p], op=nl.add, data=sx[:p, :nb], axis=(1,))
            nisa.scalar_tensor_tensor(dst=mx[:p], data=mx[:p], op0=nl.multiply, operand0=-1.0 / C,
                                      op1=nl.add, operand1=lse[:p])
            nisa.scalar_tensor_tensor(dst=mx[:p], data=mx[:p], op0=nl.multiply, operand0=float(smoothing),
                                      op1=nl.multiply, operand1=valid[:p])
            nisa.tensor_tensor(dst=loss[:p], data1=loss[:p], data2=mx[:p], op=nl.add)
        _keep(loss, mask, p)
        if reduction == 0:
            nisa.dma_copy(dst=losses[r0:r0 + p, :], src=loss[:p])
        accumulate_rows(acc, (loss, w, bad), p)
    store_totals(acc, reduction, losses, total, bad_count)
    return losses, lse_out, total, bad_count


@nki.jit
def cross_entropy_bwd_kernel(grad, x, words, lse, total, weight=None, ignore_index=-100, reduction=1,
                             smoothing=0.0):
    """(d loss / d x [N, C] in x's dtype, out-of-range target count [1, 1] fp32) of the cross-entropy, from the
    forward's log-sum-exp ``lse`` [N, 1] and total weight ``total`` [1, 1] (fp32); ``grad`` is [N, 1] for
    reduction 0, else [1, 1]."""
    N, C = x.shape
    _check(C, ignore_index, smoothing, weight)
    check_sbuf(_sbuf_bytes(C, x.dtype), f"cross_entropy backward C={C}")
    dx = nl.ndarray((N, C), x.dtype, buffer=nl.shared_hbm)
    bad_count = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    scale = gradient_scale(grad, total, reduction, 1.0)
    acc = _col()
    nisa.memset(dst=acc, value=0.0)
    ring = collections.deque(maxlen=NBUF)
    pr = min(PMAX, EXACT // C)
    blk = 0
    for r0 in range(0, N, pr):
        p = min(pr, N - r0)
        xt, w, valid, bad, idx, mask = _row_block_targets(words, weight, x, r0, p, C, ignore_index)
        g = _col()
        if reduction == 0:
            nisa.dma_copy(dst=g[:p], src=grad[r0:r0 + p, :])
        else:
            nisa.tensor_copy(dst=g[:p], src=scale[:p])
        nl_ = _col()                                   # -lse
        nisa.dma_copy(dst=nl_[:p], src=lse[r0:r0 + p, :])
        nisa.tensor_scalar(dst=nl_[:p], data=nl_[:p], op0=nl.multiply, operand0=-1.0)
        coef = _col(nl.float32, 3)                     # a_n, b_n, c_n
        a, b, c = coef[:, 0:1], coef[:, 1:2], coef[:, 2:3]
        nisa.scalar_tensor_tensor(dst=b[:p], data=w[:p], op0=nl.multiply, operand0=1.0 - smoothing,
                                  op1=nl.multiply, operand1=g[:p])
        nisa.scalar_tensor_tensor(dst=c[:p], data=valid[:p], op0=nl.multiply, operand0=float(smoothing) / C,
                                  op1=nl.multiply, operand1=g[:p])
        nisa.scalar_tensor_tensor(dst=a[:p], data=c[:p], op0=nl.multiply, operand0=float(C), op1=nl.add,
                                  operand1=b[:p])
        for v in (a, b, c):          # rows that read no target get 0, even for an inf/NaN gradient
            _keep(v, mask, p)
        for c0 in range(0, C, W):
            w_ = min(W, C - c0)
            t = nl.ndarray((PMAX, W), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t[:p, :w_], src=x[r0:r0 + p, c0:c0 + w_])
            e = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=e[:p, :w_], op=nl.exp, data=t[:p, :w_], bias=nl_[:p])
            o = nl.ndarray((PMAX, W), x.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=o[:p, :w_], data=e[:p, :w_], op0=nl.multiply, operand0=a[:p], op1=nl.subtract,
                               operand1=c[:p], engine=nisa.gpsimd_engine if blk % 2 else nisa.vector_engine)
            blk += 1
            nisa.dma_copy(dst=dx[r0:r0 + p, c0:c0 + w_], src=o[:p, :w_])
            ring.append((t, e, o))
        # the target element: a_n exp(x_t - lse) - b_n - c_n, written over the stored one
        v = _col()
        nisa.activation(dst=v[:p], op=nl.exp, data=xt[:p], bias=nl_[:p])
        nisa.scalar_tensor_tensor(dst=v[:p], data=v[:p], op0=nl.multiply, operand0=a[:p], op1=nl.subtract,
                                  operand1=b[:p])
        nisa.tensor_tensor(dst=v[:p], data1=v[:p], data2=c[:p], op=nl.subtract)
        _keep(v, mask, p)
        nisa.dma_copy(dst=dx[r0:r0 + p, :].ap([[1, p], [1, 1]], vector_offset=idx[:p]), src=v[:p])
        nisa.tensor_tensor(dst=acc[:p], data1=acc[:p], data2=bad[:p], op=nl.add)
    tot = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
    partition_totals(acc, 1, tot)
    nisa.dma_copy(dst=bad_count, src=tot)
    return dx, bad_count
