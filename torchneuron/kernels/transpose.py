"""Permute copy: ``out = x.permute(perm).contiguous()`` for any permutation, rank and dtype.

The host first drops size-1 dims and merges dims that stay adjacent (``[A, B, C, D]`` permuted by
(0, 2, 3, 1) is ``[A, B, CD]`` by (0, 2, 1)), then the kernel takes one of two paths:

    input's last dim stays last:  pure DMA, HBM -> HBM, with the permuted strides as the source
                                  access pattern (contiguous runs of the last dim; <= 5 dims per DMA)
    input's last dim C moves:     a batched 2-D transpose between C and the output's last dim R:
        for each batch index (a leading batch dim folds into the partitions when R < 128),
        each block of 128 rows x 512 columns:
            load [(b, r), 512 c] (rows of 2 KiB fp32)                        DMA
            4 x nc_transpose [(b, r), 128 c] -> one PSUM bank [128 c, 4, (b, r)]   TensorE
            evict PSUM -> SBUF (Vector/Scalar alternating)                   tensor_copy / activation
            store [128 c, 4, (b, r)] (runs of R)                             DMA

Tiles of the last NBUF blocks stay alive, so loads, transposes, evictions and stores overlap.
TensorE transposes are bit-exact: 4-byte dtypes (fp32, int32) move as fp32 bit patterns, 2-byte
ones as bf16, 1-byte ones (int8, uint8, bool) are widened to bf16 by the load DMA (exact) and
narrowed back by the store DMA. Limits: 128 x 128 per nc_transpose, one PSUM bank per group.
"""
from __future__ import annotations

import collections
import itertools

import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, as_tensor, prod

NBUF = 8                  # SBUF tiles of the last 8 loads stay alive (1.3 us DMA fixed cost: many in flight)
PBUF = 6                  # PSUM banks of the last 6 transpose groups
KMAX = 16                 # at most 16 transposes (2048 input columns) per load
DMA_PIECE = 1 << 21       # bytes per pure-DMA piece (several pieces keep several queues busy)
_BITS = {4: torch.float32, 2: torch.bfloat16}   # same-width float views for bit-exact transposes


def _strides(shape) -> list[int]:
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return st[::-1]


def simplify(shape, perm) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Drop size-1 dims and merge dims that stay adjacent: the smallest (shape, perm) with the same copy."""
    keep = [d for d in perm if shape[d] != 1]
    groups: list[list[int]] = []
    for d in keep:                               # output order; merge runs of consecutive input dims
        if groups and groups[-1][-1] + 1 == d:
            groups[-1].append(d)
        else:
            groups.append([d])
    order = sorted(range(len(groups)), key=lambda g: groups[g][0])   # groups in input order
    new_shape = tuple(prod(shape[d] for d in groups[g]) for g in order)
    pos = {g: i for i, g in enumerate(order)}
    return new_shape, tuple(pos[g] for g in range(len(groups)))


def _dma_permute(x, out, shape, perm):
    """The input's last dim stays last: HBM -> HBM DMAs with permuted source strides."""
    ist, ost = _strides(shape), _strides([shape[d] for d in perm])
    dims = [(ist[d], shape[d], ost[k]) for k, d in enumerate(perm)]   # (in stride, size, out stride), output order
    lead, tail = dims[:-4], dims[-4:]            # <= 4 dims per DMA pattern; loop over the rest
    # split the outermost pattern dim so each DMA moves about DMA_PIECE bytes
    inner = prod(n for _, n, _ in tail[1:]) * x.dtype.itemsize
    step = max(1, DMA_PIECE // max(inner, 1))
    for idx in itertools.product(*(range(n) for _, n, _ in lead)):
        ioff = sum(i * s for i, (s, _, _) in zip(idx, lead))
        ooff = sum(i * o for i, (_, _, o) in zip(idx, lead))
        s0, n0, o0 = tail[0]
        for a in range(0, n0, step):
            na = min(step, n0 - a)
            src = x.ap([[s0, na]] + [[s, n] for s, n, _ in tail[1:]], offset=ioff + a * s0)
            dst = out.ap([[o0, na]] + [[o, n] for _, n, o in tail[1:]], offset=ooff + a * o0)
            nisa.dma_copy(dst=dst, src=src)


@nki.jit
def permute_kernel(x, shape, perm):
    """The flat [numel] tensor ``x`` seen as ``shape``, permuted by ``perm``: returns the flat result.
    (Flat in and out: HBM access patterns have at most 5 dims, a permuted tensor may have more.)"""
    r = len(shape)
    assert sorted(perm) == list(range(r)), f"permute: {perm} is not a permutation of {r} dims"
    assert tuple(x.shape) == (prod(shape),), f"permute: x must be flat with {prod(shape)} elements"
    out = nl.ndarray((prod(shape),), x.dtype, buffer=nl.shared_hbm)
    _permute(x, out, shape, perm)
    return out


def _permute(x, out, shape, perm):
    """The loop nest of ``permute_kernel``: flat HBM ``x`` (as ``shape``) permuted into flat ``out``."""
    r = len(shape)
    if perm[-1] == r - 1:
        _dma_permute(x, out, shape, perm)
        return
    isz = x.dtype.itemsize
    vt = _BITS.get(isz)                           # bit view of the HBM data, or None: widen 1-byte types
    tdt = vt if vt is not None else nl.bfloat16   # dtype on chip
    xv = x if vt is None else x.ap([[1, prod(shape)]], dtype=vt)
    ov = out if vt is None else out.ap([[1, prod(shape)]], dtype=vt)
    ist, ost = _strides(shape), _strides([shape[d] for d in perm])
    ostride = {d: ost[k] for k, d in enumerate(perm)}   # output stride of each input dim
    c, j = r - 1, perm[-1]                       # the input's last dim and the output's last dim
    C, R = shape[c], shape[j]
    batch = [d for d in perm if d not in (c, j)]
    # fold one batch dim into the partitions when R leaves most of the 128 unused
    fold = batch[-1] if batch and R < PMAX else None
    NB = min(shape[fold], PMAX // R) if fold is not None else 1
    loops = [d for d in batch if d != fold]
    # k transposes per PSUM bank: partition p of the result then holds the k consecutive input
    # columns c0 + p*k + s (s < k), so each store row is k*R contiguous output elements when R is short
    K = max(1, min(KMAX, 2048 // ((NB * min(R, PMAX)) * tdt.itemsize)))
    ring, pring = collections.deque(maxlen=NBUF), collections.deque(maxlen=PBUF)
    turn = 0
    for idx in itertools.product(*(range(shape[d]) for d in loops)):
        ioff = sum(i * ist[d] for i, d in zip(idx, loops))
        ooff = sum(i * ostride[d] for i, d in zip(idx, loops))
        for b0 in range(0, shape[fold] if fold is not None else 1, NB):
            nb = min(NB, shape[fold] - b0) if fold is not None else 1
            sb_in, sb_out = (ist[fold], ostride[fold]) if fold is not None else (0, 0)
            for r0 in range(0, R, PMAX):
                pr = min(PMAX, R - r0)
                rows = nb * pr                   # partitions of the loaded tile: (b, r)
                for c0 in range(0, C, K * PMAX):
                    cw = min(K * PMAX, C - c0)
                    # load [(b, r), cw]: rows are contiguous runs of the input's last dim
                    t = nl.ndarray((PMAX, K * PMAX), tdt, buffer=nl.sbuf)
                    src = xv.ap([[sb_in, nb], [ist[j], pr], [1, cw]], offset=ioff + b0 * sb_in + r0 * ist[j] + c0)
                    nisa.dma_copy(dst=t[:rows, :cw], src=src)
                    if cw == K * PMAX:           # whole group: K interleaved 128-column slices
                        units = [(PMAX, K, K, c0, [t[:rows, sl::K] for sl in range(K)])]
                    else:                        # ragged tail: contiguous slices, one unit each
                        units = [(min(PMAX, cw - q), 1, 1, c0 + q, [t[:rows, q:q + min(PMAX, cw - q)]])
                                 for q in range(0, cw, PMAX)]
                    keep = [t]
                    for pp, k, pstep, cb, slices in units:
                        # k transposes [(b, r), pp] -> one PSUM bank [pp, k, (b, r)]
                        tp = nl.ndarray((PMAX, k, rows), tdt, buffer=nl.psum)
                        for sl, data in enumerate(slices):
                            nisa.nc_transpose(dst=tp[:pp, sl, :], data=data)
                        # evict into the output's order [p, b, s, r] (a same-dtype copy is a bit copy on either
                        # engine: alternate Vector and Scalar)
                        y = nl.ndarray((PMAX, nb, k, pr), tdt, buffer=nl.sbuf)
                        yv = y[:pp].ap([[0, pp], [pr, k], [k * pr, nb], [1, pr]])
                        nisa.tensor_copy(dst=yv, src=tp[:pp].reshape((pp, k, nb, pr)),
                                         engine=nisa.scalar_engine if turn % 2 else nisa.vector_engine)
                        turn += 1
                        # store: partition p is input column cb + p*pstep (+ s), runs of k*R when c precedes r
                        oc = ostride[c]
                        pat = [[pstep * oc, pp], [sb_out, nb], [oc, k], [1, pr]]
                        nisa.dma_copy(dst=ov.ap(pat, offset=ooff + b0 * sb_out + r0 + cb * oc), src=y[:pp])
                        keep.append(y)
                        pring.append(tp)
                    ring.append(keep)


def permute(x, dims):
    """``x.permute(dims).contiguous()`` for any permutation of any rank (fp32/bf16/fp16/int32/int8/uint8/bool)."""
    x = as_tensor(x)
    n = x.dim()
    dims = tuple(d % n for d in dims) if n else ()
    assert sorted(dims) == list(range(n)), f"permute: {tuple(dims)} is not a permutation of {n} dims"
    out_shape = tuple(x.shape[d] for d in dims)
    if x.numel() == 0:
        return x.new_empty(out_shape)
    shape, perm = simplify(tuple(x.shape), dims)
    if not shape:                                # a single element (or all dims of size 1)
        shape, perm = (1,), (0,)
    return permute_kernel(x.reshape(-1), shape=shape, perm=perm).reshape(out_shape)


def transpose(x, dim0: int = -2, dim1: int = -1):
    """``x.transpose(dim0, dim1).contiguous()`` for any two dims of a >= 1-D tensor."""
    x = as_tensor(x)
    dims = list(range(x.dim()))
    dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
    return permute(x, dims)


@nki.jit
def transpose_kernel(x):
    """[B, R, C] -> [B, C, R] (kept for callers of the earlier kernel; same code as ``permute_kernel``)."""
    B, R, C = x.shape
    out = nl.ndarray((B, C, R), x.dtype, buffer=nl.shared_hbm)
    n = B * R * C
    _permute(x.ap([[1, n]]), out.ap([[1, n]]), (B, R, C), (0, 2, 1))
    return out
