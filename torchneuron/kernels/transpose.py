"""Transpose copy: out[b, c, r] = x[b, r, c] (2-D, or batched over leading dims).

    for each batch, each 128-row x 128-column block:
        load x[rows, cols] (contiguous rows)                     DMA
        nc_transpose into PSUM (bit-exact, same dtype)           TensorE
        evict PSUM -> SBUF (Vector/Scalar alternating)           tensor_copy / activation
        store out[cols, rows]                                    DMA

Blocks of the last NBUF iterations stay alive, so loads, transposes and stores overlap.
Limits: 128 x 128 per TensorE transpose (nc_transpose); dtypes bf16/fp16/fp32.
Not yet: wide (>128) row loads per DMA, other permutations than swapping the last two dims.
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, as_tensor, prod

NBUF = 3


@nki.jit
def transpose_kernel(x):
    """[B, R, C] -> [B, C, R]."""
    B, R, C = x.shape
    out = nl.ndarray((B, C, R), x.dtype, buffer=nl.shared_hbm)
    ring = collections.deque(maxlen=NBUF)
    i = 0
    for b in range(B):
        for r0 in range(0, R, PMAX):
            p = min(PMAX, R - r0)
            for c0 in range(0, C, PMAX):
                f = min(PMAX, C - c0)
                t = nl.ndarray((PMAX, PMAX), x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=t[:p, :f], src=x[b, r0:r0 + p, c0:c0 + f])
                tp = nl.ndarray((PMAX, PMAX), x.dtype, buffer=nl.psum)
                nisa.nc_transpose(dst=tp[:f, :p], data=t[:p, :f])
                y = nl.ndarray((PMAX, PMAX), x.dtype, buffer=nl.sbuf)
                if i % 2:
                    nisa.activation(dst=y[:f, :p], op=nl.identity, data=tp[:f, :p])
                else:
                    nisa.tensor_copy(dst=y[:f, :p], src=tp[:f, :p])
                nisa.dma_copy(dst=out[b, c0:c0 + f, r0:r0 + p], src=y[:f, :p])
                ring.append((t, tp, y))
                i += 1
    return out


def transpose(x, dim0: int = -2, dim1: int = -1):
    """``x.transpose(dim0, dim1).contiguous()`` for the last two dims of a >= 2-D tensor."""
    x = as_tensor(x)
    assert {dim0 % x.dim(), dim1 % x.dim()} == {x.dim() - 2, x.dim() - 1}, \
        "transpose kernel swaps the last two dims"
    lead = x.shape[:-2]
    R, C = x.shape[-2:]
    return transpose_kernel(x.reshape(prod(lead), R, C)).reshape(*lead, C, R)


def permute(x, dims):
    """``x.permute(dims).contiguous()`` where ``dims`` keeps the leading dims and swaps the last two."""
    x = as_tensor(x)
    n = x.dim()
    dims = tuple(d % n for d in dims)
    if dims == tuple(range(n)):
        return x.clone()
    assert dims == (*range(n - 2), n - 1, n - 2), "permute: only swapping the last two dims is implemented"
    return transpose(x)
