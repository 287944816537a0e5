"""Row softmax / log_softmax over the last dim, numerically stable (the row max is subtracted).

    for each block of 128 rows (one row per partition, the whole row in the free dim):
        load [128, D] (fp32; the DMA casts)                                 DMA
        m = -max(x)                      tensor_reduce(negate)              VectorE
        e = exp(x + m), s = sum(e)       one activation with its reduce     ScalarE
        softmax:     y = e * (1/s)       reciprocal (VectorE), activation scale (ScalarE)
        log_softmax: y = x + (m - log s) one activation with a (P, 1) bias  ScalarE
        store [128, D] (cast to the input dtype)                            DMA

Tiles of the last NBUF blocks stay alive, so loads, the two engines and stores of consecutive
blocks overlap. Limits: D fp32 elements per partition x 3 tiles x NBUF must fit SBUF
(D <= ~4700 on trn2 at NBUF 3; the row is one engine operand, <= 64 Ki elements).
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, as_tensor, check_sbuf

NBUF = 3


@nki.jit
def softmax_kernel(x, log=False):
    """softmax (or log_softmax) of every row of a 2-D [N, D] tensor."""
    N, D = x.shape
    check_sbuf((NBUF + 1) * 3 * D * 4 + 64, f"softmax D={D}")
    out = nl.ndarray((N, D), x.dtype, buffer=nl.shared_hbm)
    ring = collections.deque(maxlen=NBUF)
    for r0 in range(0, N, PMAX):
        p = min(PMAX, N - r0)
        t = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:p], src=x[r0:r0 + p, :])
        neg_max = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max[:p], op=nl.maximum, data=t[:p], axis=(1,), negate=True)
        e = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e[:p], op=nl.exp, data=t[:p], bias=neg_max[:p], reduce_op=nl.add, reduce_res=s[:p],
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        y = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        if log:
            ls = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=ls[:p], op=nl.log, data=s[:p])
            nisa.tensor_tensor(dst=ls[:p], data1=neg_max[:p], data2=ls[:p], op=nl.subtract)
            nisa.activation(dst=y[:p], op=nl.identity, data=t[:p], bias=ls[:p])
        else:
            rs = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(dst=rs[:p], data=s[:p])
            nisa.activation(dst=y[:p], op=nl.identity, data=e[:p], scale=rs[:p])
        nisa.dma_copy(dst=out[r0:r0 + p, :], src=y[:p])
        ring.append((t, e, y))
    return out


def softmax(x, dim: int = -1, log: bool = False):
    """softmax (``log=True``: log_softmax) of a tensor over its last dim through the simulator."""
    x = as_tensor(x)
    assert dim in (-1, x.dim() - 1), "softmax kernels reduce the last dim (permute first)"
    shape = x.shape
    return softmax_kernel(x.reshape(-1, shape[-1]) if x.dim() != 2 else x, log=log).reshape(shape)


def log_softmax(x, dim: int = -1):
    """log_softmax over the last dim."""
    return softmax(x, dim, log=True)
