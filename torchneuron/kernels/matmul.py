"""Tiled matmul: ``out[M, N] = A @ B`` for any M, K, N, bf16/fp16/fp32, fp32 PSUM accumulation.

A is given as [M, K] (``transpose_a=False``; its tiles are transposed on TensorE) or as
[K, M] (``transpose_a=True``, the layout TensorE's stationary operand wants). B is [K, N].

Blocking (the loop nest below):

    for each N panel of bn x 512 columns:           # B panel [K, bn*512] stays in SBUF
        for each M tile of 128 rows:                 # A^T strip [K, 128] streamed (double-buffered)
            for each K tile of 128:                  # stationary A^T[k, m] reused across bn moving tiles
                for each of the bn 512-column tiles: nc_matmul into its own PSUM bank (fp32)
            evict the bn banks (Vector/Scalar alternating) -> one [128, bn*512] store

Every B byte is read from HBM once and every A byte N/(bn*512) times; the output is written
once with rows of bn*512 elements. PSUM: bn banks per M tile, two M tiles in flight.
"""
from __future__ import annotations

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, PSUM_FP32, cdiv, check_sbuf, itemsize

TM, TK, TN = 128, 128, 512     # stationary M, contraction K, moving N (one fp32 PSUM bank)


@nki.jit
def matmul_kernel(a, b, transpose_a=False):
    """``A @ B`` (A [M, K], or [K, M] with ``transpose_a``), output in A's dtype."""
    K, M = a.shape if transpose_a else (a.shape[1], a.shape[0])
    Kb, N = b.shape
    assert K == Kb, f"matmul: contraction dims differ ({K} vs {Kb})"
    assert a.dtype == b.dtype, f"matmul: operand dtypes differ ({a.dtype} vs {b.dtype})"
    dt, isz = a.dtype, itemsize(a.dtype)
    KT = cdiv(K, TK)
    budget = nl.tile_size.sbuf_fmax_bytes
    # widest B panel (up to 4 PSUM banks; 3 when 2 banks hold A transposes) that fits half of SBUF
    bn = 3 if not transpose_a else 4
    while bn > 1 and KT * bn * TN * isz > budget // 2:
        bn -= 1
    bn = min(bn, cdiv(N, TN))
    NW = bn * TN
    # SBUF per partition: B panel + 2 A^T strips + 2 A row blocks + 2 output staging tiles
    need = KT * NW * isz + 2 * KT * TM * isz + (0 if transpose_a else 2 * K * isz) + 2 * NW * isz
    check_sbuf(need, f"matmul K={K}")
    out = nl.ndarray((M, N), dt, buffer=nl.shared_hbm)
    GT = max(1, 2048 // (TM * isz))            # A transposes per PSUM bank (8 bf16, 4 fp32)

    for n0 in range(0, N, NW):
        nw = min(NW, N - n0)
        # B panel: one large DMA per K tile (rows of nw elements), spread over the DMA queues
        panel = nl.ndarray((TK, KT, NW), dt, buffer=nl.sbuf)
        for kt in range(KT):
            kk = min(TK, K - kt * TK)
            nisa.dma_copy(dst=panel[:kk, kt, :nw], src=b[kt * TK:kt * TK + kk, n0:n0 + nw])
        for m0 in range(0, M, TM):
            mm = min(TM, M - m0)
            aT = nl.ndarray((TK, KT, TM), dt, buffer=nl.sbuf)     # stationary strip A^T[K, m-tile]
            if transpose_a:
                full = K // TK
                if full:   # [K, M] layout: one DMA for all whole K tiles (partition = k within the tile)
                    src = a.ap([[M, TK], [TK * M, full], [1, mm]], offset=m0)   # (k, kt, m)
                    nisa.dma_copy(dst=aT[:, :full, :mm], src=src)
                if K % TK:
                    kk = K % TK
                    nisa.dma_copy(dst=aT[:kk, full, :mm], src=a[full * TK:K, m0:m0 + mm])
            else:          # [M, K] layout: contiguous row block, transposed 128x128 at a time on TensorE
                rows = nl.ndarray((TM, K), dt, buffer=nl.sbuf)
                nisa.dma_copy(dst=rows[:mm, :], src=a[m0:m0 + mm, :])
                for g0 in range(0, KT, GT):
                    g = min(GT, KT - g0)
                    tp = nl.ndarray((TK, GT, TM), dt, buffer=nl.psum)
                    for j in range(g):
                        kt = g0 + j
                        kk = min(TK, K - kt * TK)
                        nisa.nc_transpose(dst=tp[:kk, j, :mm], data=rows[:mm, kt * TK:kt * TK + kk])
                    if K - g0 * TK >= g * TK:
                        nisa.activation(dst=aT[:, g0:g0 + g, :mm], op=nl.identity, data=tp[:, :g, :mm])
                    else:  # last group has a partial K tile: copy the whole tiles, then the partial one
                        if g > 1:
                            nisa.activation(dst=aT[:, g0:g0 + g - 1, :mm], op=nl.identity, data=tp[:, :g - 1, :mm])
                        kk = K - (g0 + g - 1) * TK
                        nisa.activation(dst=aT[:kk, g0 + g - 1, :mm], op=nl.identity, data=tp[:kk, g - 1, :mm])
            accs = [nl.ndarray((TM, TN), nl.float32, buffer=nl.psum) for _ in range(cdiv(nw, TN))]
            for kt in range(KT):
                kk = min(TK, K - kt * TK)
                for j, acc in enumerate(accs):      # the stationary tile serves every moving tile
                    w = min(TN, nw - j * TN)
                    nisa.nc_matmul(dst=acc[:mm, :w], stationary=aT[:kk, kt, :mm],
                                   moving=panel[:kk, kt, j * TN:j * TN + w], accumulate=kt > 0)
            res = nl.ndarray((TM, NW), dt, buffer=nl.sbuf)
            for j, acc in enumerate(accs):          # PSUM -> SBUF eviction with the cast to the output dtype
                w = min(TN, nw - j * TN)
                if j % 2 == 0:
                    nisa.tensor_copy(dst=res[:mm, j * TN:j * TN + w], src=acc[:mm, :w], engine=nisa.vector_engine)
                else:
                    nisa.activation(dst=res[:mm, j * TN:j * TN + w], op=nl.identity, data=acc[:mm, :w])
            nisa.dma_copy(dst=out[m0:m0 + mm, n0:n0 + nw], src=res[:mm, :nw])
    return out


def matmul(a, b, transpose_a: bool = False):
    """Host entry: ``A @ B`` through the simulator (torch tensors or NumPy arrays in, same kind out)."""
    return matmul_kernel(a, b, transpose_a=transpose_a)
