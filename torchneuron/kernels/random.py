"""Random kernels: ``dropout_kernel`` (the mask drawn by the core's PRNG, the output scaled).

``dropout_kernel(x, seed, p, scale)``: ``mask = rand >= p`` (bool), ``out = x * mask * scale``.

The core's PRNG is seeded once per launch from ``seed`` (a [1, 1] int32 tensor the host draws
from the device's generator), so a launch is a pure function of its inputs and ``manual_seed``
makes dropout reproducible. ``p`` and ``scale`` are [1, 1] fp32 tensors, not constants of the
Program: one Program serves every probability. The flat input streams as [128, F] tiles (then a
[p, q] tail and a last partial row, as the element-wise template does); per tile VectorE's
``dropout`` on a tile of ones gives the keep mask (1.0 kept, 0.0 dropped), one
``scalar_tensor_tensor`` computes ``(x * scale) * mask``, and the stores cast the mask to bool
and the output to x's dtype. Tiles of the last NBUF iterations stay alive so loads, compute and
stores of consecutive tiles overlap.
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import DMA_ROW_BYTES, PMAX, check_sbuf

NBUF = 3


def _tiles(n: int, f: int):
    """(start, partitions, columns) of the blocks covering a flat [n]: whole [128, f] tiles, a [p, q] tail,
    then a single partial row."""
    step = PMAX * f
    whole = n - n % step
    for s in range(0, whole, step):
        yield s, PMAX, f
    r = n - whole
    if r:
        p = min(PMAX, r)
        q = r // p
        yield whole, p, q
        if r - p * q:
            yield whole + p * q, 1, r - p * q


@nki.jit
def dropout_kernel(x, seed, p, scale):
    """(``x * mask * scale``, ``mask``) of a flat [n] ``x``; mask[i] = uniform >= p (bool)."""
    (n,) = x.shape
    assert tuple(seed.shape) == (1, 1) and seed.dtype == nl.int32, "dropout: seed is a [1, 1] int32 tensor"
    assert tuple(p.shape) == (1, 1) and tuple(scale.shape) == (1, 1), "dropout: p and scale are [1, 1] tensors"
    F = DMA_ROW_BYTES // 4                                  # 2048 fp32 per partition row
    check_sbuf(4 * NBUF * F * 4 + 8, "dropout")              # x, ones, mask, out per buffer
    out = nl.ndarray((n,), x.dtype, buffer=nl.shared_hbm)
    mask = nl.ndarray((n,), nl.bool_, buffer=nl.shared_hbm)
    s_t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s_t, src=seed)
    nisa.set_rng_seed(src_seeds=s_t)                         # the launch's stream of random numbers
    p_col = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    k_col = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=p_col, src=p.broadcast_to((PMAX, 1)))
    nisa.dma_copy(dst=k_col, src=scale.broadcast_to((PMAX, 1)))
    f = max(1, min(F, n // PMAX))
    ones = nl.ndarray((PMAX, f), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    ring = collections.deque(maxlen=NBUF)                    # keeps NBUF iterations' tiles alive
    for s, pp, ff in _tiles(n, f):
        xt = nl.ndarray((PMAX, f), nl.float32, buffer=nl.sbuf)
        keep = nl.ndarray((PMAX, f), nl.float32, buffer=nl.sbuf)
        y = nl.ndarray((PMAX, f), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[:pp, :ff], src=x[s:s + pp * ff].reshape((pp, ff)))
        nisa.dropout(dst=keep[:pp, :ff], data=ones[:pp, :ff], prob=p_col[:pp])
        nisa.scalar_tensor_tensor(dst=y[:pp, :ff], data=xt[:pp, :ff], op0=nl.multiply, operand0=k_col[:pp],
                                  op1=nl.multiply, operand1=keep[:pp, :ff])
        nisa.dma_copy(dst=out[s:s + pp * ff].reshape((pp, ff)), src=y[:pp, :ff])
        nisa.dma_copy(dst=mask[s:s + pp * ff].reshape((pp, ff)), src=keep[:pp, :ff])
        ring.append((xt, keep, y))
    return out, mask
