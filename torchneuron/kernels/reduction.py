"""Reductions along any dim: sum, mean, max, min, argmax.

The host view is [outer, R, inner] with R the reduced dim. The kernel moves R to the free axis:

    inner == 1: rows of the [outer, R] matrix go to partitions (contiguous loads, [128, R] tiles)
    inner  > 1: for each outer index, 128 inner positions go to partitions and R to the free
                axis through a strided DMA access pattern ([[1, 128], [inner, R]])
    per tile:   tensor_reduce over the free axis (VectorE), or for argmax max8 + nc_find_index8
                (first index of the maximum; rows shorter than 8 are padded with -inf)

Tiles of the last NBUF blocks stay alive so loads overlap the reductions. Limits: R fp32
elements per partition x NBUF in SBUF (R <= ~14 Ki on trn2), argmax R <= 16384 (max8's range).
Not yet: reducing a contiguous inner dim across partitions on TensorE (ones^T @ tile) instead of
the strided DMA, which is slow for large inner sizes.
"""
from __future__ import annotations

import collections

import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, as_tensor, check_sbuf, prod

NBUF = 3
OPS = {"sum": nl.add, "mean": nl.add, "max": nl.maximum, "min": nl.minimum}


@nki.jit
def reduce_kernel(x, op="sum"):
    """Reduce the middle dim of [outer, R, inner]; returns [outer, inner] (argmax: int32 indices)."""
    O, R, I = x.shape
    if op == "argmax":
        assert R <= 16384, f"argmax: the reduced dim has {R} elements; max8 handles at most 16384"
    check_sbuf((NBUF + 1) * (max(R, 8) * 4 + 64), f"reduce R={R}")
    out = nl.ndarray((O, I), nl.int32 if op == "argmax" else x.dtype, buffer=nl.shared_hbm)
    flat = x.reshape((O * I, R)) if I == 1 else None
    blocks = ([(None, r0, min(PMAX, O - r0)) for r0 in range(0, O, PMAX)] if I == 1 else
              [(o, i0, min(PMAX, I - i0)) for o in range(O) for i0 in range(0, I, PMAX)])
    ring = collections.deque(maxlen=NBUF)
    for o, s0, p in blocks:
        W = max(R, 8) if op == "argmax" else R
        t = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
        if W > R:
            nisa.memset(dst=t[:p], value=float("-inf"))
        if I == 1:
            nisa.dma_copy(dst=t[:p, :R], src=flat[s0:s0 + p, :])
            dst = out[s0:s0 + p, :]
        else:   # partitions walk the inner dim (stride 1), the free axis walks R (stride I)
            nisa.dma_copy(dst=t[:p, :R], src=x.ap([[1, p], [I, R]], offset=o * R * I + s0))
            dst = out[o:o + 1, s0:s0 + p].reshape((p, 1))
        r = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
        if op == "argmax":
            m8 = nl.ndarray((PMAX, 8), nl.float32, buffer=nl.sbuf)
            nisa.max8(dst=m8[:p], src=t[:p])
            i8 = nl.ndarray((PMAX, 8), nl.uint32, buffer=nl.sbuf)
            nisa.nc_find_index8(dst=i8[:p], data=t[:p], vals=m8[:p])
            r = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=r[:p], src=i8[:p, 0:1])
        else:
            nisa.tensor_reduce(dst=r[:p], op=OPS[op], data=t[:p], axis=(1,))
            if op == "mean":
                nisa.tensor_scalar(dst=r[:p], data=r[:p], op0=nl.multiply, operand0=1.0 / R)
        nisa.dma_copy(dst=dst, src=r[:p])
        ring.append((t, r))
    return out


def reduce(x, dim: int, op: str = "sum", keepdim: bool = False):
    """``torch.<op>(x, dim)`` (sum, mean, max and min values, argmax) through the simulator."""
    x = as_tensor(x)
    assert op in (*OPS, "argmax"), f"unknown reduction {op!r}"
    dim = dim % x.dim()
    O, R, I = prod(x.shape[:dim]), x.shape[dim], prod(x.shape[dim + 1:])
    r = reduce_kernel(x.reshape(O, R, I), op=op)
    shape = list(x.shape)
    shape[dim] = 1
    r = r.reshape(shape)
    r = r.long() if op == "argmax" else r
    return r if keepdim else r.squeeze(dim)


def sum(x, dim, keepdim=False):  # noqa: A001
    return reduce(x, dim, "sum", keepdim)


def mean(x, dim, keepdim=False):
    return reduce(x, dim, "mean", keepdim)


def amax(x, dim, keepdim=False):
    return reduce(x, dim, "max", keepdim)


def amin(x, dim, keepdim=False):
    return reduce(x, dim, "min", keepdim)


def argmax(x, dim, keepdim=False):
    return reduce(x, dim, "argmax", keepdim)
