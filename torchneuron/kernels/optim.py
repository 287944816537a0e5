"""Optimizer steps: AdamW / Adam on one parameter tensor, in place, one pass over HBM.

Every tile of [128, F] elements of the parameter, its gradient and the two moment estimates is
loaded once, updated on VectorE (the two-input updates), ScalarE (the single-input passes) and GpSimd
(g - m), and stored back in place:

    p = p * (1 - lr * wd)                         (AdamW; Adam adds wd * p to g instead)
    m = m + (1 - beta1) * (g - m)                  (torch's lerp form)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - step_size * m / (sqrt(v) * inv_bc2 + eps)

The per-step scalars (``1 - lr*wd``, ``1 - beta1``, ``beta2``, ``1 - beta2``, ``-step_size``,
``1/sqrt(bias_correction2)``, ``eps``, ``wd``) come in a small fp32 HBM vector loaded once,
broadcast over the partitions, so one Program serves every step. The loop keeps NBUF iterations'
tiles alive, so loads of tile i+1 overlap the math of tile i.
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, flat_blocks

NBUF = 3
F = 2048                                     # elements per partition per tile (8 KiB fp32 rows: ~97 % DMA efficiency)
SCALARS = ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "neg_step_size", "inv_bc2", "eps", "wd")


@nki.jit
def adam_step(param, grad, exp_avg, exp_avg_sq, scalars, decoupled=True):
    """One Adam(W) step on flat fp32/bf16 tensors, in place; ``scalars``: fp32 [len(SCALARS)]."""
    (n,) = param.shape
    assert grad.shape == exp_avg.shape == exp_avg_sq.shape == param.shape, "adam_step: shapes differ"
    k = len(SCALARS)
    sc = nl.ndarray((PMAX, k), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sc, src=scalars.reshape((1, k)).broadcast_to((PMAX, k)))
    c = {name: sc[:, i:i + 1] for i, name in enumerate(SCALARS)}
    ring = collections.deque(maxlen=NBUF)
    for s, p, w in flat_blocks(n, F):
        tiles = [nl.ndarray((PMAX, w), nl.float32, buffer=nl.sbuf) for _ in range(4)]
        ring.append(tiles)
        pt, gt, mt, vt = tiles
        for t, src in zip(tiles, (param, grad, exp_avg, exp_avg_sq)):
            nisa.dma_copy(dst=t[:p], src=src[s:s + p * w].reshape((p, w)))
        pt, gt, mt, vt = pt[:p], gt[:p], mt[:p], vt[:p]
        col = {name: v[:p] for name, v in c.items()}
        # three engines, each in program order: ScalarE the single-input passes, GpSimd g - m, VectorE the
        # two-input updates (VectorE alone, 15 passes, was the limit: 16 us per tile against 10 us of DMA)
        S, G = nisa.scalar_engine, nisa.gpsimd_engine
        d = nl.ndarray((PMAX, w), nl.float32, buffer=nl.sbuf)[:p]
        q = nl.ndarray((PMAX, w), nl.float32, buffer=nl.sbuf)[:p]
        if decoupled:
            nisa.tensor_scalar(dst=pt, data=pt, op0=nl.multiply, operand0=col["decay"], engine=S)
        else:                                    # Adam's L2 term: g = g + wd * p
            nisa.scalar_tensor_tensor(dst=gt, data=pt, op0=nl.multiply, operand0=col["wd"], op1=nl.add, operand1=gt)
        nisa.tensor_tensor(dst=d, data1=gt, data2=mt, op=nl.subtract, engine=G)          # g - m
        nisa.activation(dst=q, op=nl.square, data=gt)                                     # g * g
        nisa.tensor_scalar(dst=q, data=q, op0=nl.multiply, operand0=col["one_minus_beta2"], engine=S)
        nisa.scalar_tensor_tensor(dst=mt, data=d, op0=nl.multiply, operand0=col["one_minus_beta1"],
                                  op1=nl.add, operand1=mt)                              # m += (1-b1)(g-m)
        nisa.scalar_tensor_tensor(dst=vt, data=vt, op0=nl.multiply, operand0=col["beta2"], op1=nl.add,
                                  operand1=q)                                           # v = b2 v + (1-b2) g^2
        nisa.activation(dst=d, op=nl.sqrt, data=vt)
        nisa.tensor_scalar(dst=d, data=d, op0=nl.multiply, operand0=col["inv_bc2"], op1=nl.add,
                           operand1=col["eps"], engine=S)                               # sqrt(v)/sqrt(bc2) + eps
        nisa.tensor_tensor(dst=d, data1=mt, data2=d, op=nl.divide)                      # m / denom
        nisa.scalar_tensor_tensor(dst=pt, data=d, op0=nl.multiply, operand0=col["neg_step_size"], op1=nl.add,
                                  operand1=pt)                                          # p -= step_size * ...
        ring.append((d, q))
        for t, dst in zip((pt, mt, vt), (param, exp_avg, exp_avg_sq)):
            nisa.dma_copy(dst=dst[s:s + p * w].reshape((p, w)), src=t)
