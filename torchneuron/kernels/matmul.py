"""Tiled matmul: ``out[M, N] = A @ B`` for any M, K, N, bf16/fp16/fp32, fp32 PSUM accumulation.

A is given as [M, K] (``transpose_a=False``; its tiles are transposed on TensorE) or as
[K, M] (``transpose_a=True``, the layout TensorE's stationary operand wants). B is [K, N], or
[N, K] with ``transpose_b=True`` (``A @ B.T``): each B panel is then loaded as row blocks
[128, K] and transposed on TensorE into the [K, bn*512] panel layout (every B block once, by the
same transpose/eviction code as A's); panel p+1 is built while panel p's matmuls run (its transpose
groups spread evenly over p's K steps, two panels in SBUF), so TensorE never waits on an eviction.

Blocking (the loop nest below):

    for each N panel of bn x 512 columns:           # B panel [K, bn*512] stays in SBUF
        for each M tile of 128 rows:                 # A^T strip [K, 128] streamed (double-buffered)
            for each K tile of 128:                  # stationary A^T[k, m] reused across bn moving tiles
                for each of the bn 512-column tiles: nc_matmul into its own PSUM bank (fp32)
            evict the bn banks (Vector/Scalar alternating) -> one [128, bn*512] store

Every B byte is read from HBM once and every A byte N/(bn*512) times; the output is written
once with rows of bn*512 elements. PSUM: bn banks per M tile, two M tiles in flight. A panel may
take half of SBUF (two with B as [N, K]); where a long contraction leaves less room the panel
narrows in steps of 128 columns (``panel_width``): TensorE's cost per column is the same, only A
is read more often, and 256 bf16 columns (2 x 256 FLOPs per A byte) still keep the DMAs behind
TensorE. ``max_contraction`` says how long K may get before nothing fits (~22k bf16, ~11k fp32
with both operands as they lie); a longer contraction, or one whose narrow panels would re-read A more
than the DMAs hide (``k_passes``, a byte model), runs this nest once per K chunk in the same launch, the
partial sums evicted in fp32 to an HBM scratch and added at the next pass's stores (``_matmul_k_chunks``:
two passes at K = 11008 fp32 add 2 x 4 bytes per output element of HBM traffic to ~2.8k FLOPs each, so
the product stays TensorE-bound). A ``bias`` row ([1, N], e.g.
``linear``'s) is added by VectorE as it evicts the accumulators, so the sum is rounded once.

A as [M, K]: during the first N panel, strip i+1's row block is transposed on TensorE (one PSUM
bank per 8 bf16 / 4 fp32 transposes, the 2 banks left by bn = 3) in groups spread between the K
steps of strip i's matmuls, so the evictions (Scalar/Vector alternating) finish long before
TensorE needs the result; each transposed strip is also stored to an HBM scratch in the SBUF
strip layout, from which later panels load it (every strip is transposed once).

Up to 4 K tiles and one PSUM bank of N (K <= 512, N <= 512, any M; the projections of a small model):
``mm_rows_grouped_into`` loads B once and takes A's rows in groups of up to 4 (fp32) 128-row chunks,
one DMA, one transpose per (chunk, K tile) into one PSUM tile per K tile evicted once, the K tiles
accumulated per chunk into one bank [128, chunks * N], one eviction and one store per group: about
1 + 2 * KT instructions per 128 rows instead of ~3 + 2 * KT.

Batched (``bmm_kernel``): entries larger than one TensorE tile are streamed entry after entry when they
have attention's shapes, so that every DMA moves long rows (per-partition descriptors of 256 B, a
head dim of bf16, reach half the DMA bandwidth; 4-16 KiB, 94-98%):
  * one contraction tile (K <= 128: Q K^T, dO V^T; ``_bmm_short_k``): output rows staged r per
    partition ([128, r, N], rows q*r .. q*r + r - 1 on partition q), one store per row group, A's
    rows loaded the same way and transposed slot by slot on TensorE, B^T built once per entry;
  * a long contraction into a narrow output (N <= 512 with B as [K, N]: P V, P^T dO, dS K;
    ``_bmm_narrow``): k split over partitions as q * KT + t, so B loads as one run per partition;
    A given as [K, M] streams K tile after K tile of whole rows into one PSUM accumulator per row
    slot, A as [M, K] is transposed on TensorE (its strided column sets) row slot by row slot.
Other entries run this loop nest one after the other. Small entries (M, K <= 128, N <= 512: attention in a small transformer) are worked in groups of G, G
as large as one PSUM bank allows (output [M, G*N] fp32; operands transposed on TensorE [K, G*M] /
[K, G*N] in their dtype): per group each operand is one DMA into its K-major SBUF layout [K, G, width]
(A as [B, K, M], B as [B, K, N]), or else (A as [B, M, K], B as [B, N, K]) the group's G*width rows,
contiguous in HBM, are one DMA of 128-row chunks, each chunk transposed on TensorE into one PSUM tile
[K, G*width] whose columns are already in (entry, row) order, evicted once; then G matmuls into one
PSUM bank, one eviction (with the cast) and one store of [M, G, N]. About 2-3 instructions per entry
instead of ~7; the entries share tiles but never a contraction, so inf/NaN stay in their own entry.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, replace
from typing import Callable

from torchneuron import nki
from torchneuron.nki.tracing import current
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, PSUM_FP32, cdiv, itemsize, spread_row, tiles

TM, TK, TN = 128, 128, 512     # stationary M, contraction K, moving N (one fp32 PSUM bank)


@nki.jit
def matmul_kernel(a, b, transpose_a=False, transpose_b=False, bias=None, out_dtype=None, epilogue=None,
                  row_sums=False, then=None):
    """``A @ B`` (A [M, K], or [K, M] with ``transpose_a``; B [K, N], or [N, K] with ``transpose_b``),
    output in A's dtype; plus a [1, N] ``bias`` row added at the PSUM eviction (``linear``).

    ``row_sums`` (where ``fuses_row_sums`` says so): also A's sums over K, [M] in A's dtype, A's product with a
    column of ones (``(product, sums)`` come back): a linear layer's bias gradient ``dY.sum(0)`` from the load of
    dY its weight gradient ``dY^T @ X`` makes anyway, instead of a reduction pass reading dY again.

    ``out_dtype`` (float32, for 2-byte operands): the product rounded to A's dtype as always, then widened
    exactly by the store's DMA, so the result equals the matmul followed by a cast (autocast's fp32
    gradient of a bf16 weight) without that pass's HBM round trip. ``epilogue`` (an ``Epilogue``): element-wise
    work on each block of the product before it is stored (a residual add, an activation's gradient).

    ``then`` (a ``Then``, where ``chains_product`` says so): also the epilogue's result times a B2 [N, N2] (with
    its own bias and epilogue), from the result's blocks in SBUF (transposed on TensorE) instead of a second
    kernel loading the stored result back (an MLP's second product of its activation, the backward's hidden
    gradient dH times the first weight); its [M, N2] result comes back last in the result tuple."""
    M = a.shape[1] if transpose_a else a.shape[0]
    N = b.shape[0] if transpose_b else b.shape[1]
    if out_dtype is not None:
        assert out_dtype == nl.float32 and itemsize(a.dtype) == 2, \
            f"matmul: out_dtype widens 2-byte operands to float32, not {a.dtype} to {out_dtype}"
    assert out_dtype is None or epilogue is None, "matmul: an epilogue sets the output dtype itself"
    if epilogue is not None:
        out_dtype = epilogue.out_dtype
        assert all(tuple(e.shape) == (M, N) for e in epilogue.extras), \
            f"matmul: epilogue operands {[tuple(e.shape) for e in epilogue.extras]} are not the output's [{M}, {N}]"
    out = nl.ndarray((M, N), out_dtype or a.dtype, buffer=nl.shared_hbm)
    if epilogue is not None and epilogue.keep_product:
        epilogue = replace(epilogue, product=nl.ndarray((M, N), a.dtype, buffer=nl.shared_hbm))
    K = a.shape[0] if transpose_a else a.shape[1]
    Kb = b.shape[1] if transpose_b else b.shape[0]
    assert K == Kb, f"matmul: contraction dims differ ({K} vs {Kb})"
    assert a.dtype == b.dtype, f"matmul: operand dtypes differ ({a.dtype} vs {b.dtype})"
    if row_sums:
        assert (fuses_row_sums(M, K, N, a.dtype, transpose_a, transpose_b) and bias is None
                and epilogue is None and out_dtype is None), \
            f"matmul: no row sums for A [{M}, {K}] x B [{K}, {N}] in this layout (see fuses_row_sums)"
        sums = nl.ndarray((M,), a.dtype, buffer=nl.shared_hbm)
        _matmul_pass(a, b, out, transpose_a, transpose_b, row_sums=sums)
        return out, sums
    chained = None
    if then is not None:
        K2, N2 = then.b.shape[::-1] if then.transpose_b else then.b.shape
        assert K2 == N, f"matmul: the chained product contracts the result's {N} columns, not {K2}"
        assert epilogue is not None and chains_product(M, K, N, N2, transpose_a, a.dtype, epilogue.out_dtype,
                                                       then.b.dtype), \
            f"matmul: no chained product for [{M}, {K}] x [{K}, {N}] then {tuple(then.b.shape)} (see chains_product)"
        chained = ChainedProduct(then, K2, M)
    if K <= KMAX_GROUPED and N <= TN:
        mm_rows_grouped_into(a, b, out, transpose_a, transpose_b, bias, epilogue, chained)
    else:
        matmul_into(a, b, out, transpose_a, transpose_b, bias, epilogue)
    res = (out, epilogue.product) if epilogue is not None and epilogue.keep_product else (out,)
    res += () if chained is None else (chained.out,)
    return res if len(res) > 1 else out


def fuses_row_sums(M: int, K: int, N: int, dt, transpose_a: bool, transpose_b: bool, spec=None) -> bool:
    """Whether ``matmul_kernel(row_sums=True)`` can add A's sums over K as one more output column: A given as
    [K, M] and B as [K, N] (a weight gradient ``dY^T @ X``), a product ``matmul_into`` runs as one pass (not
    the K <= 512 grouped path, nor K chunks) over one B panel with a column to spare in its last PSUM bank
    (``spec``: the chip, default the one being traced for)."""
    if not transpose_a or transpose_b or (K <= KMAX_GROUPED and N <= TN) or N % TN == 0:
        return False
    isz = itemsize(dt)
    if k_passes(M, K, N, isz, isz, True, False, False, isz, None, spec) != 1:
        return False
    return panel_width(K, N + 1, isz, True, False, _pass_budget(None), False, isz) > N


def chains_product(M: int, K: int, N: int, N2: int, transpose_a: bool, *dtypes) -> bool:
    """Whether ``matmul_kernel(then=B2)`` can multiply its epilogue's result [M, N] by a B2 [N, N2] on chip: the
    grouped path (K, N <= 512) with A as [M, K] in whole 128-row chunks (its row blocks) and ``chain_fits`` for
    its row blocks (``dtypes``: the operands', the result's, B2's)."""
    if transpose_a or K > KMAX_GROUPED or N > TN or M % PMAX:
        return False
    return chain_fits(_grouped_chunks(N, 4), N, N2, *dtypes)


def chain_bytes(nch: int, K2: int, N2: int, extras: int = 0) -> int:
    """SBUF bytes per partition of a ``ChainedProduct`` over row blocks of ``nch`` chunks (B2, a block's
    transpose, the staging ring, and ``_store_block``'s fp32 tiles of an epilogue with ``extras`` operands), for
    a kernel that chains one to count beside its own tiles."""
    kt2 = cdiv(K2, TK)
    return (kt2 * N2 + kt2 * nch * PMAX + (2 + 2 + extras) * nch * N2) * 4


def chain_fits(nch: int, K2: int, N2: int, *dtypes) -> bool:
    """Whether ``ChainedProduct`` takes row blocks of ``nch`` 128-row chunks of a result [M, K2] into a product of
    N2 columns: the block's transpose [K2, nch * 128] and its product [128, nch * N2] each in one PSUM bank, K2 <=
    512, and ``dtypes`` all fp32 (a 2-byte result is rounded by its store, so its tile is not what a second kernel
    would load)."""
    return (all(dt == nl.float32 for dt in dtypes) and K2 <= KMAX_GROUPED and nch * PMAX <= PSUM_FP32
            and nch * N2 <= PSUM_FP32)


@nki.jit
def bmm_kernel(a, b, transpose_a=False, transpose_b=False):
    """Batched ``A[i] @ B[i]`` over the leading dim of 3-D operands (layouts as ``matmul_kernel``), one launch."""
    assert a.shape[0] == b.shape[0], f"bmm: batch sizes differ ({a.shape[0]} vs {b.shape[0]})"
    assert a.dtype == b.dtype, f"matmul: operand dtypes differ ({a.dtype} vs {b.dtype})"
    M, K = (a.shape[2], a.shape[1]) if transpose_a else (a.shape[1], a.shape[2])
    N, Kb = (b.shape[1], b.shape[2]) if transpose_b else (b.shape[2], b.shape[1])
    assert K == Kb, f"matmul: contraction dims differ ({K} vs {Kb})"
    out = nl.ndarray((a.shape[0], M, N), a.dtype, buffer=nl.shared_hbm)
    if M <= TM and K <= TK and N <= TN:
        bmm_grouped_into(a, b, out, transpose_a, transpose_b)
    else:
        bmm_entries_into(a, b, out, transpose_a, transpose_b)
    return out


def bmm_entries_into(a, b, out, transpose_a: bool = False, transpose_b: bool = False,
                     scaled: Callable | None = None) -> None:
    """Batched ``out[i] = A[i] @ B[i]`` for entries larger than one TensorE tile (``scaled(i)``: entry i's
    ``ScaledSum`` to store instead, or None): one contraction tile (``_bmm_short_k``), a narrow output of B
    given as [K, N] (``_bmm_narrow``), else the 2-D loop nest entry after entry (TensorE works them back to back;
    DMAs overlap)."""
    K = a.shape[1] if transpose_a else a.shape[2]
    N = out.shape[2]
    if K <= TK:
        _bmm_short_k(a, b, out, transpose_a, transpose_b, scaled)
    elif N <= TN and not transpose_b:
        _bmm_narrow(a, b, out, transpose_a, scaled)
    else:
        for i in range(a.shape[0]):
            matmul_into(a[i], b[i], out[i], transpose_a, transpose_b,
                        epilogue=scaled(i).epilogue(a.dtype) if scaled else None)


@nki.jit
def addmm_kernel(a, b, c, transpose_a=False, transpose_b=False, alpha=1.0, beta=1.0):
    """``beta * C + alpha * (A @ B)`` with C of the product's shape, in one launch: 2-D (layouts as
    ``matmul_kernel``) or batched over the leading dim of 3-D operands (entries of more than one tile each).
    The sum is formed in fp32 from the fp32 product (at each block's store; on the streamed batched paths as the
    accumulator leaves PSUM, ``ScaledSum.evict``) and rounded once, as the CPU's GEMM forms it (rounding the
    product to A's dtype first put ~1 in 5 bf16 results a unit off)."""
    if len(a.shape) == 2:
        return matmul_kernel(a, b, transpose_a, transpose_b, epilogue=ScaledSum(c, alpha, beta).epilogue(a.dtype))
    out = nl.ndarray(tuple(c.shape), a.dtype, buffer=nl.shared_hbm)
    bmm_entries_into(a, b, out, transpose_a, transpose_b, lambda i: ScaledSum(c[i], alpha, beta))
    return out


@dataclass(frozen=True)
class ScaledSum:
    """``beta * c + alpha * product`` for a product of c's shape, formed in fp32 from the product as accumulated
    in fp32, rounded once, as the CPU's GEMM forms it (``addmm_kernel``)."""

    c: object
    alpha: float
    beta: float

    def epilogue(self, dtype) -> "Epilogue":
        """As an ``Epilogue`` on fp32 tiles (the loop nest's block stores)."""
        def scaled_sum(prod, inp):   # in place; a factor of 1 is exact: its pass is left out
            if self.beta != 1:
                nisa.tensor_scalar(dst=inp, data=inp, op0=nl.multiply, operand0=float(self.beta))
            if self.alpha == 1:
                nisa.tensor_tensor(dst=prod, data1=prod, data2=inp, op=nl.add)
            else:
                nisa.scalar_tensor_tensor(dst=prod, data=prod, op0=nl.multiply, operand0=float(self.alpha),
                                          op1=nl.add, operand1=inp)
            return prod
        return Epilogue(scaled_sum, (self.c,), dtype, rounds_product=False)

    def addend(self, m0: int, r: int, p: int, N: int):
        """``beta * c`` for rows m0 + q*r + j (partition q < p, slot j < r) of c [M, N] as an SBUF tile [128, r, N]
        (``_rows_ap``'s layout): c in its dtype when beta == 1, else beta * c in fp32 by GpSimd (the engine the
        evictions leave idle)."""
        c = nl.ndarray((PMAX, r, N), self.c.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=c[:p], src=_rows_ap(self.c, m0, r, p, N))
        if self.beta == 1:
            return c
        cb = nl.ndarray((PMAX, r, N), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=cb[:p], data=c[:p], op0=nl.multiply, operand0=float(self.beta),
                           engine=nisa.gpsimd_engine)
        return cb

    def evict(self, dst, acc, addend) -> None:
        """``dst = addend + alpha * acc`` from a PSUM accumulator ``acc`` (``addend``: ``self.addend``'s block of the
        same shape), the sum rounded once as it is written: ScalarE scales the accumulator in place when alpha != 1,
        then one VectorE add that reads PSUM (one element per cycle; a sum of two SBUF tiles costs two)."""
        if self.alpha != 1:
            nisa.activation(dst=acc, op=nl.identity, data=acc, scale=float(self.alpha))
        nisa.tensor_tensor(dst=dst, data1=acc, data2=addend, op=nl.add)


def alternating_evict() -> Callable:
    """A PSUM -> SBUF copy ``evict(dst, src)`` (casting to dst's dtype) alternating ScalarE and VectorE."""
    turn = [0]

    def evict(dst, src):
        if turn[0] % 2 == 0:
            nisa.activation(dst=dst, op=nl.identity, data=src)
        else:
            nisa.tensor_copy(dst=dst, src=src, engine=nisa.vector_engine)
        turn[0] += 1
    return evict


@dataclass(frozen=True)
class Epilogue:
    """Element-wise work applied to each evicted block of a product before its store (the graph compiler's
    fused group that reads the product): ``fn(product, *extras)`` over fp32 tiles returns the result tile
    (it may overwrite its operand tiles). The product is rounded to the operands' dtype first, as a separate
    pass would read it from HBM; each extra is a dense HBM tensor of the output's [M, N] shape, read block by
    block; the result is stored in ``out_dtype``.

    ``keep_product``: the product itself is stored too (``matmul_kernel`` then returns (result, product)), for
    a product the graph still needs (an activation's input saved for the backward): one more store instead
    of a separate pass that reads the product back. ``product`` is that HBM tensor, set by the kernel;
    ``finish`` an in-place step on the block's tiles that completes the product before it is stored and
    ``fn`` runs (the K-chunked loop nest adds its partial sums there). ``rounds_product=False``: ``fn`` gets the
    product as TensorE accumulated it in fp32, not rounded first (the accumulators are staged in fp32): addmm's
    ``beta * C + alpha * (A @ B)``, which the CPU's GEMM rounds once."""

    fn: Callable
    extras: tuple
    out_dtype: object
    keep_product: bool = False
    product: object = None
    finish: Callable | None = None
    rounds_product: bool = True


def product_stage_dtype(epilogue: Epilogue | None, dt):
    """The dtype a loop nest evicts its accumulators to: fp32 for an epilogue that reads the unrounded product
    (``rounds_product=False``), else the operands' ``dt``."""
    return nl.float32 if epilogue is not None and not epilogue.rounds_product else dt


def _store_block(out, res, p: int, f: int, at: Callable, epilogue: Epilogue | None):
    """Store an evicted block ``res`` [p, f] at ``at(out)`` (``at`` maps an [M, N] HBM tensor to the block's
    access), through the epilogue when there is one; returns the SBUF tile stored."""
    if epilogue is None:
        nisa.dma_copy(dst=at(out), src=res)
        return res
    if res.dtype == nl.float32:   # staged in fp32 already (K chunks, addmm): fn works on it in place
        x = res
    else:
        x = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=x, src=res, engine=nisa.gpsimd_engine)   # exact: the rounded product, widened
    tiles = [x]
    for e in epilogue.extras:
        tiles.append(_load_widened(at(e), e.dtype, p, f))
    if epilogue.finish is not None:
        epilogue.finish(*tiles)
    if epilogue.product is not None:   # before fn, which may overwrite x
        # the product as evicted where that is what is kept (a DMA that casts moves the wider side's bytes)
        kept = res if epilogue.finish is None and res.dtype == epilogue.product.dtype else x
        nisa.dma_copy(dst=at(epilogue.product), src=kept)
    result = epilogue.fn(*tiles)
    nisa.dma_copy(dst=at(out), src=result)
    return result


def _load_widened(src, dtype, p: int, f: int):
    """An HBM block [p, f] of ``dtype`` as an fp32 SBUF tile: a narrower dtype is loaded as it is and widened by
    GpSimd (exact), so the DMA moves its own bytes rather than the fp32 tile's (a DMA that casts is priced by
    its wider side)."""
    t = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf)
    if itemsize(dtype) >= 4:
        nisa.dma_copy(dst=t, src=src)
        return t
    low = nl.ndarray((p, f), dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=low, src=src)
    nisa.tensor_copy(dst=t, src=low, engine=nisa.gpsimd_engine)
    return t


def bmm_group_size(M: int, N: int, isz: int, transpose_a: bool, transpose_b: bool) -> int:
    """Batch entries per group of the small-matrix bmm (G: every PSUM tile of a group fits one bank)."""
    # the output [M, G*N] is fp32; an operand transposed on TensorE ([K, G*M] / [K, G*N]) keeps its dtype
    bank_elems = PSUM_FP32 * 4 // isz
    g = PSUM_FP32 // N
    if not transpose_a:
        g = min(g, bank_elems // M)
    if transpose_b:
        g = min(g, bank_elems // N)
    return g


def bmm_grouped_into(a, b, out, transpose_a: bool = False, transpose_b: bool = False) -> None:
    """Small-matrix bmm (M, K <= 128, N <= 512) into ``out`` [B, M, N], G batch entries per group."""
    # per group: one load per operand, G matmuls into one PSUM bank, one eviction and one store
    Bt, M, N = out.shape
    K = a.shape[1] if transpose_a else a.shape[2]
    assert M <= TM and K <= TK and N <= TN, f"bmm_grouped_into: [{M}, {K}] @ [{K}, {N}] exceeds one TensorE tile"
    dt = a.dtype
    G = bmm_group_size(M, N, itemsize(dt), transpose_a, transpose_b)
    evict = alternating_evict()
    groups = [(b0, min(G, Bt - b0)) for b0 in range(0, Bt, G)]

    def load(b0, g):
        """The group's operand loads (DMAs only): [A rows or A^T, B^T rows or B]."""
        return [load_group(a, b0, g, M, K, transpose_a), load_group(b, b0, g, N, K, not transpose_b)]

    # the next group's loads are issued before this group's TensorE work, so their DMAs overlap it
    # (and its tiles are distinct from the ones in use: a 2-deep ring). The output staging tiles are a
    # 2-deep ring for the whole kernel: a store still in flight keeps its tile from being reused.
    stage = [nl.ndarray((M, G * N), dt, buffer=nl.sbuf) for _ in range(2)]
    nxt = load(*groups[0])
    for i, (b0, g) in enumerate(groups):
        cur = nxt
        nxt = load(*groups[i + 1]) if i + 1 < len(groups) else None
        # stationary A^T and moving B, both [K, g*width] with entry j at columns j*width..
        aT = k_major(cur[0], g, M, K, transpose_a, evict)
        bK = k_major(cur[1], g, N, K, not transpose_b, evict)
        acc = nl.ndarray((M, g * N), nl.float32, buffer=nl.psum)
        for j in range(g):
            nisa.nc_matmul(dst=acc[:, j * N:(j + 1) * N], stationary=aT[:, j * M:(j + 1) * M],
                           moving=bK[:, j * N:(j + 1) * N], accumulate=False)
        res = stage[i % 2][:, :g * N]
        evict(res, acc)
        # out[b0 + j, m, n] <- res[m, j*N + n]: one store of the whole group
        nisa.dma_copy(dst=out.ap([[N, M], [M * N, g], [1, N]], offset=b0 * M * N), src=res)


def load_group(src, b0: int, g: int, R: int, K: int, k_major: bool):
    """DMA batch entries [b0, b0 + g) of a 3-D operand (src [B, K, R] if ``k_major``, else [B, R, K]) into SBUF."""
    # K-major: the tile is [K, g*R] (entry j's [K, R] at columns j*R..), one DMA. Otherwise the group's
    # g*R rows are contiguous in HBM and load as 128-row chunks (``_load_rows``)
    if k_major:
        kT = nl.ndarray((K, g * R), src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=kT, src=src.ap([[R, K], [K * R, g], [1, R]], offset=b0 * K * R))
        return kT
    return _load_rows(src, b0 * R, g * R, K, src.dtype)


def k_major(loaded, g: int, R: int, K: int, is_k_major: bool, evict: Callable):
    """A loaded group operand as the SBUF tile [K, g*R] TensorE reads (``loaded`` itself if K-major)."""
    # else the 128-row chunks are transposed on TensorE into one PSUM tile [K, g*R] (columns in
    # (entry, row) order, one bank) and evicted once
    return loaded if is_k_major else _transpose_rows(loaded, g * R, K, evict)[:K, 0, :]


KMAX_GROUPED = 4 * TK   # contraction handled by mm_rows_grouped_into (its K tiles accumulate in one bank)


def fuses_bias(K: int, N: int) -> bool:
    """Whether ``matmul_kernel`` adds a bias row for a contraction of K into N columns (both paths do)."""
    return True


def _load_k_major(src, c0: int, width: int, K: int, dt):
    """Columns [c0, c0 + width) of a K-major HBM matrix [K, C] as SBUF [128, KT, width] (one DMA per K tile)."""
    t = nl.ndarray((TK, cdiv(K, TK), width), dt, buffer=nl.sbuf)
    for kt, (k0, kk) in enumerate(tiles(K, TK)):
        nisa.dma_copy(dst=t[:kk, kt, :], src=src[k0:k0 + kk, c0:c0 + width])
    return t


def _load_rows(src, r0: int, rows: int, K: int, dt):
    """Rows [r0, r0 + rows) of a row-major HBM matrix [R, K] as 128-row chunks [128, chunks, K] (DMAs only)."""
    full, rem = divmod(rows, PMAX)
    chunks = nl.ndarray((PMAX, cdiv(rows, PMAX), K), dt, buffer=nl.sbuf)
    if full:
        nisa.dma_copy(dst=chunks[:, :full, :], src=src.ap([[K, PMAX], [PMAX * K, full], [1, K]], offset=r0 * K))
    if rem:
        nisa.dma_copy(dst=chunks[:rem, full, :], src=src.ap([[K, rem], [1, K]], offset=(r0 + full * PMAX) * K))
    return chunks


def _load_row_blocks(src, r0: int, nch: int, K: int, dt):
    """Rows [r0, r0 + 128 * nch) of a row-major HBM matrix [R, K] as [128, nch, K] with row r0 + p * nch + c at
    (p, c): each partition's rows are one contiguous run of nch * K elements (one DMA descriptor, not nch)."""
    chunks = nl.ndarray((PMAX, nch, K), dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=chunks, src=src.ap([[nch * K, PMAX], [K, nch], [1, K]], offset=r0 * K))
    return chunks


def _row_blocks_ap(t, r0: int, nch: int, N: int):
    """Rows [r0, r0 + 128 * nch) of a contiguous HBM matrix [R, N] as [128, nch * N], partition p holding rows
    r0 + p * nch .. r0 + p * nch + nch - 1 (``_load_row_blocks``' layout)."""
    return t.ap([[nch * N, PMAX], [1, nch * N]], offset=r0 * N)


def _transpose_rows(chunks, rows: int, K: int, evict: Callable):
    """Loaded row chunks (``_load_rows``, rows <= 512 fp32) as K-major SBUF [128, KT, rows]: each (chunk,
    K tile) transposed on TensorE into one PSUM tile per K tile, each evicted once."""
    kT = nl.ndarray((TK, cdiv(K, TK), rows), chunks.dtype, buffer=nl.sbuf)
    for kt, (k0, kk) in enumerate(tiles(K, TK)):
        tp = nl.ndarray((TK, rows), chunks.dtype, buffer=nl.psum)
        for c in range(chunks.shape[1]):
            n = min(PMAX, rows - c * PMAX)
            nisa.nc_transpose(dst=tp[:kk, c * PMAX:c * PMAX + n], data=chunks[:n, c, k0:k0 + kk])
        evict(kT[:kk, kt, :], tp[:kk, :])
    return kT


def _grouped_chunks(N: int, isz: int) -> int:
    """128-row chunks per group of ``mm_rows_grouped_into`` (N columns of the fp32 accumulator per chunk in one
    PSUM bank, and the transposed A rows [K, chunks * 128] of ``isz``-byte elements in one bank)."""
    return max(1, min(PSUM_FP32 // N, PSUM_FP32 * 4 // isz // PMAX))


def _load_k_major_b(b, K: int, N: int, transpose_b: bool, evict: Callable):
    """The whole B of a K <= 512 product as SBUF [128, KT, N]: loaded K-major, or as [N, K] rows transposed on
    TensorE."""
    if transpose_b:
        return _transpose_rows(_load_rows(b, 0, N, K, b.dtype), N, K, evict)
    return _load_k_major(b, 0, N, K, b.dtype)


@dataclass(frozen=True)
class Then:
    """A second product ``Y @ B2 (+ bias)`` of a grouped product's epilogue result Y [M, K2] (``matmul_kernel(then=
    ...)``): B2 [K2, N2], or [N2, K2] with ``transpose_b``; an optional [1, N2] ``bias`` row added at its eviction
    and its own ``epilogue`` (not keeping its product), as a separate kernel of Y would apply them."""

    b: object
    transpose_b: bool = False
    bias: object = None
    epilogue: Epilogue | None = None


class ChainedProduct:
    """``Then``'s product, row block by row block from Y's SBUF tiles (the grouped product's, or a layer norm's:
    ``load`` before the first block, then ``block`` per row block): each block transposed on TensorE as
    ``_transpose_rows`` does a loaded one, then the matmuls, eviction and store of ``mm_rows_grouped_into``
    over the block's chunks, so each row's sums are the ones a separate kernel computes from the stored Y."""

    def __init__(self, then: Then, K2: int, M: int):
        assert then.epilogue is None or not then.epilogue.keep_product, "matmul: a chained product is not kept"
        self.then, self.K2 = then, K2
        self.N2 = then.b.shape[0] if then.transpose_b else then.b.shape[1]
        epi = then.epilogue
        self.out = nl.ndarray((M, self.N2), epi.out_dtype if epi is not None else then.b.dtype, buffer=nl.shared_hbm)
        self.evict = alternating_evict()
        self.bK = self.brow = self.stage = None

    def load(self, chunks: int) -> None:
        """B2 [128, KT2, N2], the bias row and the staging ring, before the first block."""
        then = self.then
        self.bK = _load_k_major_b(then.b, self.K2, self.N2, then.transpose_b, self.evict)
        self.brow = None if then.bias is None else _bias_rows(then.bias, self.N2)
        sdt = product_stage_dtype(then.epilogue, then.b.dtype)
        self.stage = [nl.ndarray((PMAX, chunks * self.N2), sdt, buffer=nl.sbuf) for _ in range(2)]

    def block(self, i: int, y, m0: int, nch: int) -> None:
        """Rows m0 + p * nch + c of the product from Y's row block ``y`` [128, nch * K2] (row m0 + p * nch + c at
        partition p, columns c * K2..), stored in the same row-block layout."""
        N2, rows = self.N2, nch * PMAX
        assert y.dtype == self.then.b.dtype, f"matmul: chained operand dtypes differ ({y.dtype} vs {self.then.b.dtype})"
        yT = _transpose_rows(y.reshape((PMAX, nch, self.K2)), rows, self.K2, self.evict)   # TensorE, [128, KT2, rows]
        acc = nl.ndarray((PMAX, nch * N2), nl.float32, buffer=nl.psum)
        for c in range(nch):   # TensorE: each chunk's K2 tiles accumulated in its columns of one bank
            for kt, (_, kk) in enumerate(tiles(self.K2, TK)):
                nisa.nc_matmul(dst=acc[:, c * N2:(c + 1) * N2], stationary=yT[:kk, kt, c * PMAX:(c + 1) * PMAX],
                               moving=self.bK[:kk, kt, :], accumulate=kt > 0)
        res = self.stage[i % 2][:, :nch * N2]
        _evict_rows(self.evict, self.brow, res, acc, PMAX, nch, N2)   # ScalarE or VectorE
        _store_block(self.out, res, PMAX, nch * N2, lambda t: _row_blocks_ap(t, m0, nch, N2), self.then.epilogue)


def _bias_rows(bias, N: int):
    """A [1, N] bias row on every partition (SBUF [128, N] fp32), for the evictions to add."""
    brow = nl.ndarray((PMAX, N), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=brow, src=bias.broadcast_to((PMAX, N)))
    return brow


def _evict_rows(evict: Callable, brow, dst, src, p: int, nch: int, N: int) -> None:
    """PSUM [p, nch * N] -> SBUF with the cast, plus the bias row ``brow`` (``_bias_rows``, or None) of each chunk
    (VectorE)."""
    if brow is None:
        evict(dst, src)
    else:
        nisa.tensor_tensor(dst=dst.reshape((p, nch, N)), data1=src.reshape((p, nch, N)),
                           data2=spread_row(brow, p, nch, N), op=nl.add)


def mm_rows_grouped_into(a, b, out, transpose_a: bool = False, transpose_b: bool = False, bias=None,
                         epilogue: Epilogue | None = None,
                         chained: ChainedProduct | None = None) -> None:
    """``out[M, N] = A @ B`` for up to 4 K tiles (K <= 512) and one PSUM bank of N (N <= 512), any M:
    B is loaded once as [128, KT, N]; A's rows go in groups of up to 4 (fp32; 8 bf16) 128-row chunks,
    each group one DMA whose (chunk, K tile) blocks are transposed on TensorE into one PSUM tile per K
    tile, evicted once (or, A given as [K, M], one DMA per K tile), the K tiles of every chunk
    accumulated by TensorE into one PSUM bank [128, chunks * N], then one eviction (adding the ``bias``
    row when given) and one store. ``chained``: the epilogue's result blocks go on into a second product
    (``matmul_kernel(then=...)``)."""
    K, M = a.shape if transpose_a else (a.shape[1], a.shape[0])
    N = out.shape[1]
    assert K <= KMAX_GROUPED and N <= TN, f"mm_rows_grouped_into: K={K} > {KMAX_GROUPED} or N={N} > {TN}"
    dt, isz = a.dtype, itemsize(a.dtype)
    evict = alternating_evict()
    chunks_per_group = _grouped_chunks(N, isz)
    step = chunks_per_group * PMAX
    groups = [(m0, min(step, M - m0)) for m0 in range(0, M, step)]
    bK = _load_k_major_b(b, K, N, transpose_b, evict)
    ktiles = tiles(K, TK)

    brow = None if bias is None else _bias_rows(bias, N)   # added by the evictions

    def finish(dst, src, p, nch):
        _evict_rows(evict, brow, dst, src, p, nch, N)

    def blocked(rows):
        """Whether a group of A's rows goes as row blocks (``_load_row_blocks``: chunk c holds rows p * nch + c,
        each partition's rows one run of nch * K elements), not as 128-row chunks (nch runs of K): A as [M, K]
        filling every partition. Its output rows are then stored the same way (runs of nch * N)."""
        return not transpose_a and rows % PMAX == 0

    def load(m0, rows):
        """The group's A loads (DMAs only, issued a group ahead): K-major [128, KT, rows], row blocks or row
        chunks."""
        if transpose_a:
            return _load_k_major(a, m0, rows, K, dt)
        return _load_row_blocks(a, m0, rows // PMAX, K, dt) if blocked(rows) else _load_rows(a, m0, rows, K, dt)

    sdt = product_stage_dtype(epilogue, dt)
    stage = [nl.ndarray((PMAX, chunks_per_group * N), sdt, buffer=nl.sbuf) for _ in range(2)]
    if chained is not None:
        assert epilogue is not None and not transpose_a and M % PMAX == 0, \
            "mm_rows_grouped_into: a chained product reads the epilogue's result in whole row blocks"
        chained.load(chunks_per_group)
    nxt = load(*groups[0])
    for i, (m0, rows) in enumerate(groups):
        cur = nxt
        nxt = load(*groups[i + 1]) if i + 1 < len(groups) else None
        aT = cur if transpose_a else _transpose_rows(cur, rows, K, evict)
        nch, last = cdiv(rows, PMAX), rows - (cdiv(rows, PMAX) - 1) * PMAX
        acc = nl.ndarray((PMAX, nch * N), nl.float32, buffer=nl.psum)
        for c in range(nch):
            n = PMAX if c < nch - 1 else last
            for kt, (_, kk) in enumerate(ktiles):
                nisa.nc_matmul(dst=acc[:n, c * N:(c + 1) * N], stationary=aT[:kk, kt, c * PMAX:c * PMAX + n],
                               moving=bK[:kk, kt, :], accumulate=kt > 0)
        res = stage[i % 2]
        if blocked(rows):   # partition p holds output rows m0 + p * nch .. + nch - 1: one run of nch * N each
            finish(res[:, :nch * N], acc[:, :nch * N], PMAX, nch)
            y = _store_block(out, res[:, :nch * N], PMAX, nch * N,
                             lambda t, m0=m0, nch=nch: _row_blocks_ap(t, m0, nch, N), epilogue)
            if chained is not None:
                chained.block(i, y, m0, nch)
            continue
        full = nch if last == PMAX else nch - 1
        if epilogue is not None:   # chunk by chunk: [128, N] fp32 blocks of the product and the extras
            if full:
                finish(res[:, :full * N], acc[:, :full * N], PMAX, full)
            if full < nch:
                finish(res[:last, full * N:nch * N], acc[:last, full * N:nch * N], last, 1)
            for c in range(nch):
                n, r0 = (PMAX if c < full else last), m0 + c * PMAX
                _store_block(out, res[:n, c * N:(c + 1) * N], n, N, lambda t, r0=r0, n=n: t[r0:r0 + n, :], epilogue)
            continue
        if full:   # out[m0 + c*128 + p, :] <- res[p, c*N:(c+1)*N]: one store of the whole chunks
            finish(res[:, :full * N], acc[:, :full * N], PMAX, full)
            nisa.dma_copy(dst=out.ap([[N, PMAX], [PMAX * N, full], [1, N]], offset=m0 * N), src=res[:, :full * N])
        if full < nch:
            finish(res[:last, full * N:nch * N], acc[:last, full * N:nch * N], last, 1)
            nisa.dma_copy(dst=out[m0 + full * PMAX:m0 + rows, :], src=res[:last, full * N:nch * N])


EPILOGUE_TILE_BYTES = TN * 4   # bytes per partition of one fp32 tile of ``_store_block`` ([128, 512] at most)


def epilogue_reserve(extras: int | None) -> int:
    """SBUF bytes per partition a loop nest leaves outside its own tiles for the fp32 tiles ``_store_block``
    allocates per block (None: no epilogue): the product, each extra, the K-chunked total rounded, one spare
    (next-fit allocation rotates through them)."""
    return 0 if extras is None else (3 + extras) * EPILOGUE_TILE_BYTES


def _pass_budget(epilogue: Epilogue | None) -> int:
    """SBUF bytes per partition one pass of ``matmul_into``'s loop nest may fill with its own tiles."""
    return nl.tile_size.sbuf_fmax_bytes - epilogue_reserve(None if epilogue is None else len(epilogue.extras))


def _sbuf_need(K: int, NW: int, isz: int, transpose_a: bool, transpose_b: bool, bias: bool = False,
               stage_isz: int | None = None) -> int:
    """SBUF bytes per partition of ``matmul_into`` with panels NW columns wide: B panel(s) (two with B as
    [N, K]: the next is built during this one), 2 A^T strips, 2 A row blocks (A as [M, K]), 2 B row blocks
    (B as [N, K]), 2 output staging tiles (``stage_isz`` bytes per element, default the operands') and 2 fp32
    bias rows."""
    KT = cdiv(K, TK)
    return ((2 if transpose_b else 1) * KT * NW * isz + 2 * KT * TM * isz + (0 if transpose_a else 2 * K * isz)
            + (2 * K * isz if transpose_b else 0) + 2 * NW * (stage_isz or isz) + (2 * NW * 4 if bias else 0))


def panel_width(K: int, N: int, isz: int, transpose_a: bool, transpose_b: bool, budget: int,
                bias: bool = False, stage_isz: int | None = None) -> int:
    """Columns of ``matmul_into``'s B panel: up to 4 PSUM banks (3 when 2 banks hold A transposes) while a
    panel fits half of SBUF, narrower (multiples of 128) where everything must fit; 0 if nothing does."""
    # each A^T strip is read from HBM once per panel: a bf16 panel of 256 columns or more keeps TensorE
    # ahead of the DMAs (2 * 256 FLOPs per A byte against the ~215 the peak needs), fp32 needs a quarter
    bn = 3 if not (transpose_a and not transpose_b) else 4
    while bn > 1 and cdiv(K, TK) * bn * TN * isz > budget // 2:   # (B as [N, K] keeps two panels: the need
        bn -= 1                                                     # check below narrows them to fit)
    nw = min(bn, cdiv(N, TN)) * TN
    while nw > 0 and _sbuf_need(K, nw, isz, transpose_a, transpose_b, bias, stage_isz) > budget:
        nw -= TM
    return nw


def max_contraction(isz: int, transpose_a: bool, transpose_b: bool, budget: int, bias: bool = False,
                    stage_isz: int | None = None) -> int:
    """The longest contraction (a multiple of 128) one pass of ``matmul_into``'s loop nest keeps in SBUF of
    ``budget`` B (longer ones run as several passes over K chunks, ``_matmul_k_chunks``)."""
    # _sbuf_need grows with K: bisect over K tiles for the narrowest panel
    lo, hi = 0, budget // TM
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _sbuf_need(mid * TK, TM, isz, transpose_a, transpose_b, bias, stage_isz) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * TK


def matmul_into(a, b, out, transpose_a=False, transpose_b=False, bias=None, epilogue: Epilogue | None = None):
    """``out[M, N] = A @ B`` (plus a [1, N] ``bias`` row, then the ``epilogue``) into an HBM view (called while
    tracing a kernel): one pass of the loop nest below, or, for a contraction longer than SBUF holds or where K
    chunks with wider panels move so many fewer HBM bytes that the DMAs keep behind TensorE (``k_passes``), one
    pass per K chunk with the partial sums kept in fp32 (``_matmul_k_chunks``)."""
    K, M = a.shape if transpose_a else (a.shape[1], a.shape[0])
    N = b.shape[0] if transpose_b else b.shape[1]
    extras = None if epilogue is None else len(epilogue.extras)
    passes = k_passes(M, K, N, itemsize(a.dtype), itemsize(out.dtype), transpose_a, transpose_b, bias is not None,
                      itemsize(product_stage_dtype(epilogue, a.dtype)), extras)
    if passes == 1:
        _matmul_pass(a, b, out, transpose_a, transpose_b, bias, epilogue)
    else:
        _matmul_k_chunks(a, b, out, transpose_a, transpose_b, bias, epilogue, passes)


MAX_K_PASSES = 4    # choices the byte model weighs: one pass, the fewest K chunks that fit and two more (each
                    # one more adds a round trip of the fp32 partial sums)
DMA_HEADROOM = 1.5  # the DMAs must move a choice's HBM bytes in at most 1/1.5 of TensorE's time at peak


def _pass_bytes(M: int, K: int, N: int, NW: int, isz: int, osz: int, transpose_a: bool) -> int:
    """HBM bytes ``matmul_into``'s loop nest moves with panels NW wide (over all K chunks): B once, A once per
    panel (A as [M, K] over several panels: its rows once and the transposed strips stored once, then read by
    each later panel), the output once."""
    panels = cdiv(N, NW)
    a_reads = panels if transpose_a or panels == 1 else panels + 1
    return K * N * isz + a_reads * M * K * isz + M * N * osz


def k_passes(M: int, K: int, N: int, isz: int, osz: int, transpose_a: bool, transpose_b: bool, bias: bool,
             stage_isz: int, extras: int | None, spec=None) -> int:
    """Passes over equal K chunks of ``matmul_into``'s loop nest: the fewest whose HBM bytes (A re-read once per
    panel, the widest panel each chunk's SBUF budget allows; fp32 partial sums written and read back between
    passes) the DMAs move well within TensorE's time (``DMA_HEADROOM``), else the fewest bytes (``spec``: the
    chip, default the one being traced for)."""
    spec = spec or current().spec
    peak = spec.tensor.fp32_flops if isz == 4 else spec.tensor.bf16_flops
    bw = min(spec.hbm_bytes_per_second_per_core, spec.dma_bytes_per_second_per_core)
    tensor_s = 2 * M * K * N / peak
    # K chunks: each pass stages fp32 and its epilogue adds the partial sums (one more operand), the last pass
    # also a bias row
    one_pass = nl.tile_size.sbuf_fmax_bytes - epilogue_reserve(extras)
    chunked = nl.tile_size.sbuf_fmax_bytes - epilogue_reserve((extras or 0) + 1)
    # the fewest equal K chunks the multi-pass nest holds (a contraction may need more than MAX_K_PASSES of them)
    limit = max_contraction(isz, transpose_a, transpose_b, chunked, True, stage_isz=4)
    assert limit, "matmul: not even one K tile of this layout fits SBUF"
    first = max(2, cdiv(K, limit))
    moved = {}
    for n in (1, *range(first, first + MAX_K_PASSES - 1)):
        kc = k_chunk_rows(K, n)
        if n > first and kc == k_chunk_rows(K, n - 1):
            break
        if n == 1:
            nw = panel_width(kc, N, isz, transpose_a, transpose_b, one_pass, bias, stage_isz)
        else:
            nw = panel_width(kc, N, isz, transpose_a, transpose_b, chunked, True, 4)
        if not nw:
            continue
        moved[n] = _pass_bytes(M, K, N, nw, isz, osz, transpose_a) + 2 * (n - 1) * M * N * 4
        if moved[n] * DMA_HEADROOM / bw <= tensor_s:
            return n
    return min(moved, key=moved.get)


def k_chunk_rows(K: int, passes: int) -> int:
    """Rows of each of ``passes`` equal K chunks (a multiple of 128; the last may be shorter)."""
    return cdiv(cdiv(K, passes), TK) * TK


def _matmul_k_chunks(a, b, out, transpose_a=False, transpose_b=False, bias=None, epilogue: Epilogue | None = None,
                     passes: int = 2):
    """``out = A @ B`` for a contraction longer than one pass of the loop nest keeps in SBUF, in one launch: one
    pass per K chunk into an fp32 HBM scratch of partial sums (the PSUM accumulators are evicted in fp32, and each
    later pass adds the partial sums to its block at the store), the last pass storing the total in out's dtype
    (plus the bias row; through the ``epilogue`` from the total rounded to the operands' dtype)."""
    K, M = a.shape if transpose_a else (a.shape[1], a.shape[0])
    N = b.shape[0] if transpose_b else b.shape[1]
    dt = a.dtype
    kc = k_chunk_rows(K, passes)
    part = nl.ndarray((M, N), nl.float32, buffer=nl.hbm)

    def add(prod, partial):   # fp32, in place on the block's tiles
        nisa.tensor_tensor(dst=prod, data1=prod, data2=partial, op=nl.add)
        return prod

    def add_rounded(prod, partial):
        """The last pass's total in out's dtype, rounded once as VectorE writes it: the store then moves out's
        bytes, not fp32's (a DMA that casts is priced by its wider side)."""
        if out.dtype == nl.float32:
            return add(prod, partial)
        total = nl.ndarray(tuple(prod.shape), out.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=total, data1=prod, data2=partial, op=nl.add)
        return total

    def total(prod, partial, *rest):
        """The last pass's block, in place: the total, rounded to the operands' dtype as a stored product is
        (then the caller's epilogue)."""
        add(prod, partial)
        if itemsize(dt) != 4 and epilogue.rounds_product:
            rounded = nl.ndarray(tuple(prod.shape), dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=rounded, src=prod, engine=nisa.vector_engine)
            nisa.tensor_copy(dst=prod, src=rounded, engine=nisa.gpsimd_engine)

    starts = list(range(0, K, kc))
    for i, k0 in enumerate(starts):
        k1 = min(K, k0 + kc)
        ac = a[k0:k1, :] if transpose_a else a[:, k0:k1]
        bc = b[:, k0:k1] if transpose_b else b[k0:k1, :]
        if i == 0:
            _matmul_pass(ac, bc, part, transpose_a, transpose_b, stage_dtype=nl.float32, narrow_first=True)
        elif i < len(starts) - 1:
            _matmul_pass(ac, bc, part, transpose_a, transpose_b, epilogue=Epilogue(add, (part,), nl.float32),
                         stage_dtype=nl.float32, narrow_first=True)
        else:
            last = (Epilogue(add_rounded, (part,), out.dtype) if epilogue is None
                    else replace(epilogue, fn=lambda prod, partial, *rest: epilogue.fn(prod, *rest),
                                 extras=(part, *epilogue.extras), finish=total))
            _matmul_pass(ac, bc, out, transpose_a, transpose_b, bias, last, stage_dtype=nl.float32, narrow_first=True)


def _matmul_pass(a, b, out, transpose_a=False, transpose_b=False, bias=None, epilogue: Epilogue | None = None,
                 stage_dtype=None, narrow_first: bool = False, row_sums=None):
    """The matmul loop nest, one pass over K: ``out[M, N] = A @ B`` (plus a [1, N] ``bias`` row) into an HBM
    view, the PSUM accumulators evicted to ``stage_dtype`` (default the operands'); ``narrow_first``: a first
    B panel one PSUM bank wide in every layout with B as [N, K] (the K-chunked passes); ``row_sums``: an HBM
    [M] tensor that receives A's sums over K, the product of each stationary tile with a column of ones into
    the column after the product's last one (``fuses_row_sums`` says where it fits)."""
    K, M = a.shape if transpose_a else (a.shape[1], a.shape[0])
    N, Kb = b.shape if transpose_b else (b.shape[1], b.shape[0])
    ones = int(row_sums is not None)           # the extra moving column of the row sums
    assert K == Kb, f"matmul: contraction dims differ ({K} vs {Kb})"
    assert a.dtype == b.dtype, f"matmul: operand dtypes differ ({a.dtype} vs {b.dtype})"
    dt, isz = a.dtype, itemsize(a.dtype)
    sdt = stage_dtype or product_stage_dtype(epilogue, dt)
    KT, MT = cdiv(K, TK), cdiv(M, TM)
    full, kr = K // TK, K % TK                 # whole K tiles, rows of the partial last one
    budget = _pass_budget(epilogue)
    NW = panel_width(K, N + ones, isz, transpose_a, transpose_b, budget, bias is not None, itemsize(sdt))
    assert NW, f"matmul: a contraction of K={K} does not fit SBUF (see max_contraction)"
    assert not ones or (transpose_a and not transpose_b and N < NW and N % TN), \
        f"matmul: no room for the row sums' column beside N={N} (panel {NW})"
    GT = max(1, 2048 // (TM * isz))            # A transposes per PSUM bank (8 bf16, 4 fp32)
    NG = cdiv(KT, GT)                          # transpose groups (PSUM banks) per strip
    # [M, K] with several N panels: the first panel transposes each strip once and also stores it
    # to an HBM scratch laid out like the SBUF strip (rows of KT*128 elements); later panels load it
    # N panels; with B as [N, K] (and A as [K, M]) the first is one PSUM bank wide, so it is built (not
    # overlapped) quickly and the next, full-width one is built during its matmuls. (With A as [M, K]
    # the first panel also transposes A; a narrow one leaves too little matmul work to hide A's DMAs,
    # except in a K chunk's pass (``narrow_first``): its start waits on the DMAs of the first panel's long
    # row blocks (3.9 us each at K = 5504 bf16, 2.3 us of transposes), four instead of seven of them.)
    W0 = min(TN, NW) if transpose_b and (transpose_a or narrow_first) and N > NW else NW
    starts = [0] + list(range(W0, N, NW))
    widths = [min(NW if i else W0, N - n0) for i, n0 in enumerate(starts)]
    scratch = nl.ndarray((MT, TK, KT, TM), dt, buffer=nl.hbm) if not transpose_a and len(starts) > 1 else None
    evict = alternating_evict()
    # A^T strips and output staging tiles: 2-deep rings allocated before the B panels, so they hold their
    # boxes while the panels take turns in the rest of SBUF (next-fit allocation, see sim/memory.py)
    # A as [K, M] and a narrow output (N <= 256: little TensorE work per A byte, the loads are the limit,
    # as in attention's P^T dO): GA strips per DMA where SBUF has room, rows of GA * 128 elements (a strip's
    # own rows are 256 B in bf16, and descriptors that short reach half the DMA bandwidth). Wider outputs
    # keep one strip per DMA: their TensorE work hides the loads, and smaller loads start sooner.
    GA = 1
    if transpose_a and N <= 2 * TM:
        base = _sbuf_need(K, NW, isz, transpose_a, transpose_b, bias is not None, itemsize(sdt))
        GA = next((g for g in (4, 2) if base + 2 * (g - 1) * KT * TM * isz <= budget), 1)
        GA = max(1, min(GA, MT))
    strips = [nl.ndarray((TK, KT, GA * TM), dt, buffer=nl.sbuf) for _ in range(2)]
    groups_loaded = 0                          # GA-strip loads so far (their ring index), across panels
    stage = [nl.ndarray((TM, NW), sdt, buffer=nl.sbuf) for _ in range(2)]
    # the bias row of each panel on every partition, in fp32 (a ring of two: a panel's evictions may still
    # read the previous row when the next is loaded); the evictions add it, so the sum is rounded once
    brows = [nl.ndarray((TM, NW), nl.float32, buffer=nl.sbuf) for _ in range(2)] if bias is not None else None
    step = 0                                   # strips processed so far (ring index), across panels
    ones_col = None
    if ones:   # the moving column of ones the row sums are the product with (GpSimd: off the evictions' engines)
        ones_col = nl.ndarray((TK, 1), dt, buffer=nl.sbuf)
        nisa.memset(dst=ones_col, value=1.0, engine=nisa.gpsimd_engine)

    def load_rows(m0, src=a, rows_total=M):
        """DMA the [mm, K] row block of A (the [M, K] layout), or of B ([N, K]), into SBUF."""
        mm = min(TM, rows_total - m0)
        rows = nl.ndarray((TM, K), dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows[:mm, :], src=src[m0:m0 + mm, :])
        return rows

    def transpose_group(rows, aT, mm, q, c0=0):
        """Transpose K tiles [q*GT, q*GT + GT) of a row block on TensorE into one PSUM bank, evict to
        aT[:, kt, c0:c0 + mm] (an A^T strip, or columns of a B panel)."""
        g0 = q * GT
        g = min(GT, KT - g0)
        tp = nl.ndarray((TK, GT, TM), dt, buffer=nl.psum)
        for j in range(g):
            kt = g0 + j
            kk = min(TK, K - kt * TK)
            nisa.nc_transpose(dst=tp[:kk, j, :mm], data=rows[:mm, kt * TK:kt * TK + kk])
        whole = min(g, full - g0)              # whole K tiles in this group
        if whole > 0:
            evict(aT[:, g0:g0 + whole, c0:c0 + mm], tp[:, :whole, :mm])
        if whole < g:                          # the partial last K tile
            evict(aT[:kr, full, c0:c0 + mm], tp[:kr, g - 1, :mm])

    def load_strip(aT, src, mt, mm, kt_major):
        """DMA a stationary strip A^T[K, mm] into SBUF, from A [K, M] or from the scratch."""
        m0 = mt * TM
        if kt_major:   # [K, M] layout: one DMA for all whole K tiles (partition = k within the tile)
            if full:
                s = src.ap([[M, TK], [TK * M, full], [1, mm]], offset=m0)   # (k, kt, m)
                nisa.dma_copy(dst=aT[:, :full, :mm], src=s)
            if kr:
                nisa.dma_copy(dst=aT[:kr, full, :mm], src=src[full * TK:K, m0:m0 + mm])
        else:          # scratch [MT, TK, KT, TM]: the strip's rows are contiguous
            if full:
                nisa.dma_copy(dst=aT[:, :full, :mm], src=src[mt, :, :full, :mm])
            if kr:
                nisa.dma_copy(dst=aT[:kr, full, :mm], src=src[mt, :kr, full, :mm])

    def store_strip(aT, mt, mm):
        if full:
            nisa.dma_copy(dst=scratch[mt, :, :full, :mm], src=aT[:, :full, :mm])
        if kr:
            nisa.dma_copy(dst=scratch[mt, :kr, full, :mm], src=aT[:kr, full, :mm])

    def build_panel(n0, nw):
        """B as [N, K]: a generator that builds the panel of columns [n0, n0 + NW) from row blocks [128, K]
        (prefetched one ahead), each transposed on TensorE into panel columns [c0, c0 + 128) of every K
        tile; it yields the panel first, then once after each transpose group (one PSUM bank)."""
        panel = nl.ndarray((TK, KT, NW), dt, buffer=nl.sbuf)
        yield panel
        nxt = load_rows(n0, b, N)
        for c0 in range(0, nw, TM):
            cur = nxt
            nxt = load_rows(n0 + c0 + TM, b, N) if c0 + TM < nw else None
            for q in range(NG):
                transpose_group(cur, panel, min(TM, nw - c0), q, c0)
                yield None

    # (after the first panel A's row blocks are gone; with B as [N, K] two panels are counted already)
    two_panels_fit = transpose_b or (_sbuf_need(K, NW, isz, True, False, bias is not None, itemsize(sdt))
                                     + 2 * GA * KT * TM * isz - 2 * KT * TM * isz + KT * NW * isz <= budget)
    builder = None
    if transpose_b:                            # the first panel is built up front
        builder = build_panel(0, widths[0])
        next_panel = next(builder)
        for _ in builder:
            pass
    for pi, (n0, nw) in enumerate(zip(starts, widths)):
        if transpose_b:
            # this panel was built during the previous panel's matmuls; start building the next one:
            # its transpose groups are spread evenly over this panel's (M tile, K tile) steps
            panel = next_panel
            more_panels = pi + 1 < len(starts)
            builder = build_panel(starts[pi + 1], widths[pi + 1]) if more_panels else None
            next_panel = next(builder) if more_panels else None
            steps = cdiv(widths[pi + 1], TM) * NG if more_panels else 0
            done = 0
        else:
            # B panel: one large DMA per K tile (rows of nw elements), spread over the DMA queues; loaded while
            # the previous panel's matmuls run where SBUF holds both, else into the box that panel leaves
            if not two_panels_fit:
                panel = None
            panel = nl.ndarray((TK, KT, NW), dt, buffer=nl.sbuf)
            for kt in range(KT):
                kk = min(TK, K - kt * TK)
                nisa.dma_copy(dst=panel[:kk, kt, :nw], src=b[kt * TK:kt * TK + kk, n0:n0 + nw])
        if brows is not None:
            brow = brows[pi % 2]
            nisa.dma_copy(dst=brow[:, :nw], src=bias[:, n0:n0 + nw].broadcast_to((TM, nw)))
        transposing = not transpose_a and pi == 0
        if transposing:
            # software pipeline: strip i+1 is transposed on TensorE between strip i's matmuls (its own
            # PSUM banks), so TensorE never waits for an eviction; row blocks are prefetched 2 ahead
            rows_next = load_rows(0)
            rows_next2 = load_rows(TM) if MT > 1 else None
            aT_next = strips[step % 2]
            for q in range(NG):
                transpose_group(rows_next, aT_next, min(TM, M), q)
            rows_next = None
            if scratch is not None:
                store_strip(aT_next, 0, min(TM, M))
        for mt in range(MT):
            m0 = mt * TM
            mm = min(TM, M - m0)
            if transposing:
                aT = aT_next
                more = mt + 1 < MT
                if more:
                    rows_cur = rows_next2
                    rows_next2 = load_rows(m0 + 2 * TM) if mt + 2 < MT else None
                    mm1 = min(TM, M - m0 - TM)
                    aT_next = strips[(step + 1) % 2]
                    at_kt = {(q * KT) // NG: q for q in range(NG)}   # spread the groups over the K loop
            elif transpose_a:
                if mt % GA == 0:               # this strip and the next GA - 1 in one DMA
                    wide = strips[groups_loaded % 2]
                    groups_loaded += 1
                    load_strip(wide, a, mt, min(GA * TM, M - m0), kt_major=True)
                aT = wide[:, :, (mt % GA) * TM:(mt % GA + 1) * TM]
            else:
                aT = strips[step % 2]
                load_strip(aT, scratch, mt, mm, kt_major=False)
            nwx = nw + ones                         # (the row sums' column shares the last bank: N % 512 != 0)
            accs = [nl.ndarray((TM, TN), nl.float32, buffer=nl.psum) for _ in range(cdiv(nwx, TN))]
            for kt in range(KT):
                kk = min(TK, K - kt * TK)
                for j, acc in enumerate(accs):      # the stationary tile serves every moving tile
                    w = min(TN, nw - j * TN)
                    nisa.nc_matmul(dst=acc[:mm, :w], stationary=aT[:kk, kt, :mm],
                                   moving=panel[:kk, kt, j * TN:j * TN + w], accumulate=kt > 0)
                if ones:   # the row sums: a matmul of its own, so the product's columns are the ones without it
                    w = nw - (len(accs) - 1) * TN
                    nisa.nc_matmul(dst=accs[-1][:mm, w:w + 1], stationary=aT[:kk, kt, :mm], moving=ones_col[:kk, :],
                                   accumulate=kt > 0)
                if transposing and more and kt in at_kt:
                    transpose_group(rows_cur, aT_next, mm1, at_kt[kt])
                if builder is not None:        # next B panel's transpose groups due by this step
                    due = cdiv((mt * KT + kt + 1) * steps, MT * KT)
                    while done < due:
                        next(builder, None)
                        done += 1
            if transposing and more:
                rows_cur = None
                if scratch is not None:
                    store_strip(aT_next, mt + 1, mm1)
            res = stage[step % 2]
            step += 1
            for j, acc in enumerate(accs):          # PSUM -> SBUF eviction with the cast to the output dtype
                w = min(TN, nwx - j * TN)
                if brows is not None:               # (plus the bias: VectorE, the engine that adds rows from PSUM)
                    nisa.tensor_tensor(dst=res[:mm, j * TN:j * TN + w], data1=acc[:mm, :w],
                                       data2=brow[:mm, j * TN:j * TN + w], op=nl.add)
                elif j % 2 == 0:
                    nisa.tensor_copy(dst=res[:mm, j * TN:j * TN + w], src=acc[:mm, :w], engine=nisa.vector_engine)
                else:
                    nisa.activation(dst=res[:mm, j * TN:j * TN + w], op=nl.identity, data=acc[:mm, :w])
            if ones:
                nisa.dma_copy(dst=row_sums.reshape((M, 1))[m0:m0 + mm, :], src=res[:mm, nw:nw + 1])
            if epilogue is None:
                nisa.dma_copy(dst=out[m0:m0 + mm, n0:n0 + nw], src=res[:mm, :nw])
            else:                                   # one PSUM bank's width at a time (bounded fp32 tiles)
                for c0 in range(0, nw, TN):
                    w = min(TN, nw - c0)
                    _store_block(out, res[:mm, c0:c0 + w], mm, w,
                                 lambda t, m0=m0, mm=mm, c=n0 + c0, w=w: t[m0:m0 + mm, c:c + w], epilogue)
        if builder is not None:                # (nothing left unless the M loop was short)
            for _ in builder:
                pass


STAGE_BYTES = 24 * 1024   # SBUF bytes per partition of one output staging tile of the streamed bmm paths


def _stage_rows(N: int, dt, scaled: Callable | None, limit: int) -> int:
    """Output rows per partition (at most ``limit``) of one staging tile [128, r, N] of the streamed bmm paths in
    ``STAGE_BYTES``: the result in dt, plus with a scaled sum its input's rows in dt and beta * input in fp32."""
    per_row = N * itemsize(dt) * (2 if scaled else 1) + (N * 4 if scaled else 0)
    return max(1, min(limit, STAGE_BYTES // per_row))


def _row_groups(M: int, R: int) -> list[tuple[int, int, int]]:
    """Rows [0, M) as groups (m0, r, p): partition q < p holds rows m0 + q*r .. m0 + q*r + r - 1 (r <= R)."""
    groups, m0 = [], 0
    while m0 < M:
        r = min(R, (M - m0) // PMAX)
        p = PMAX if r else M - m0
        r = max(r, 1)
        groups.append((m0, r, p))
        m0 += r * p
    return groups


def _rows_ap(t, m0: int, r: int, p: int, width: int):
    """Rows m0 + q*r + j (q < p, j < r) of a row-major HBM [rows, width] view as [p, r*width]: one descriptor per
    partition (its r rows are consecutive)."""
    return t.ap([[r * width, p], [1, r * width]], offset=m0 * width)


def _store_rows(out, stage, m0: int, r: int, p: int, N: int) -> None:
    """Store the staged block stage[:p, :r, :N] (partition q, slot j = row m0 + q*r + j) to ``out``."""
    nisa.dma_copy(dst=_rows_ap(out, m0, r, p, N), src=stage[:p, :r, :N])


def _addends(scaled: Callable | None, work: list, N: int):
    """Per work item (entry i, (m0, r, p)) of a streamed bmm path, in order: entry i's ``ScaledSum`` and the addend
    tile of the item's rows (``ScaledSum.addend``), each loaded one item ahead so its DMA overlaps the previous
    item's matmuls; (None, None) per item without a scaled sum."""
    if scaled is None:
        yield from itertools.repeat((None, None), len(work))
        return

    def load(k):
        i, (m0, r, p) = work[k]
        return scaled(i), scaled(i).addend(m0, r, p, N)
    nxt = load(0)
    for k in range(len(work)):
        cur, nxt = nxt, (load(k + 1) if k + 1 < len(work) else None)
        yield cur


def _evict_block(evict: Callable, scaled: ScaledSum | None, addend, dst, acc, at: tuple) -> None:
    """A PSUM block into its staging tile: ``evict`` (the cast), or with a scaled sum ``scaled.evict`` with the
    addend tile's block ``addend[at]`` (the rows of dst)."""
    if scaled is None:
        evict(dst, acc)
    else:
        scaled.evict(dst, acc, addend[at])


def _bmm_short_k(a, b, out, transpose_a: bool, transpose_b: bool, scaled: Callable | None) -> None:
    """Batched product of one contraction tile (K <= 128: attention's Q K^T with its head dim) and a large
    output, entry after entry with the next entry's operands loaded ahead.

    The output is what moves: it is staged as row groups [128, r, N] whose partition q holds rows q*r .. q*r + r
    - 1, so each store writes r whole rows per partition (one long descriptor). A's rows are loaded the same way
    (A as [M, K]: r rows per partition, one descriptor each) and transposed on TensorE slot by slot, which puts
    row q*r + j in column q of slot j's stationary tile; A given as [K, M] is loaded as it lies and slot j is
    the strided column set j::r. B^T [K, N] is built once per entry (B as [N, K]: rows loaded c per partition,
    transposed, and evicted into the columns they belong to)."""
    Bt, M, N = out.shape
    K = a.shape[1] if transpose_a else a.shape[2]
    dt, isz = a.dtype, itemsize(a.dtype)
    R = _stage_rows(N, dt, scaled, 8)
    groups = _row_groups(M, R)
    evict = alternating_evict()
    GT = max(1, 2048 // (PMAX * isz))           # transposes per PSUM bank (8 bf16, 4 fp32)
    C, nr = divmod(N, PMAX)                    # B as [N, K]: whole 128-row chunks, leftover rows

    def load_b(i):
        if not transpose_b:
            t = nl.ndarray((K, N), dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=b[i])
            return t
        rows = nl.ndarray((PMAX, C + (1 if nr else 0), K), dt, buffer=nl.sbuf)
        if C:      # partition q holds rows q*C .. q*C + C - 1
            nisa.dma_copy(dst=rows[:, :C, :], src=b[i].ap([[C * K, PMAX], [1, C * K]]))
        if nr:
            nisa.dma_copy(dst=rows[:nr, C, :], src=b[i][C * PMAX:N, :])
        return rows

    def b_transposed(rows):
        """B^T [K, N] in column order from the loaded row chunks (slot c of partition q is row q*C + c)."""
        if not transpose_b:
            return rows
        bT = nl.ndarray((K, N), dt, buffer=nl.sbuf)
        for c0 in range(0, C, GT):
            g = min(GT, C - c0)
            tp = nl.ndarray((K, GT, PMAX), dt, buffer=nl.psum)
            for c in range(g):
                nisa.nc_transpose(dst=tp[:K, c, :], data=rows[:, c0 + c, :K])
            evict(bT.ap([[N, K], [1, g], [C, PMAX]], offset=c0), tp[:K, :g, :])
        if nr:
            tp = nl.ndarray((K, PMAX), dt, buffer=nl.psum)
            nisa.nc_transpose(dst=tp[:K, :nr], data=rows[:nr, C, :K])
            evict(bT[:K, C * PMAX:N], tp[:K, :nr])
        return bT

    def load_a(i, m0, r, p):
        if transpose_a:
            t = nl.ndarray((K, r * p), dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a[i][:, m0:m0 + r * p])
            return t
        t = nl.ndarray((PMAX, r, K), dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:p], src=_rows_ap(a[i], m0, r, p, K))
        return t

    def stationaries(loaded, r, p):
        """Slot j's stationary [K, p] (column q: row m0 + q*r + j), per slot."""
        if transpose_a:
            return [loaded[:K, j::r] for j in range(r)]
        aT = nl.ndarray((K, r, PMAX), dt, buffer=nl.sbuf)
        for j0 in range(0, r, GT):
            g = min(GT, r - j0)
            tp = nl.ndarray((K, GT, PMAX), dt, buffer=nl.psum)
            for j in range(g):
                nisa.nc_transpose(dst=tp[:K, j, :p], data=loaded[:p, j0 + j, :K])
            evict(aT[:K, j0:j0 + g, :p], tp[:K, :g, :p])
        return [aT[:K, j, :p] for j in range(r)]

    # K <= 64 fills half of the PE array's rows: consecutive matmuls take alternate row halves (PE tiling), which
    # run concurrently, so TensorE is not held at half its peak by the head dim
    half_rows = itertools.cycle([dict(tile_position=(0, 0), tile_size=(64, TM)),
                                 dict(tile_position=(64, 0), tile_size=(64, TM))] if K <= 64 else [{}])
    work = [(i, g) for i in range(Bt) for g in groups]
    nxt_a = load_a(0, *groups[0])
    bTs = {0: b_transposed(load_b(0))}
    nxt_b = load_b(1) if Bt > 1 else None
    addends = _addends(scaled, work, N)
    for w, (i, (m0, r, p)) in enumerate(work):
        sc, addend = next(addends)
        cur_a = nxt_a
        nxt_a = load_a(work[w + 1][0], *work[w + 1][1]) if w + 1 < len(work) else None
        stat = stationaries(cur_a, r, p)
        last = w + 1 == len(work) or work[w + 1][0] != i
        if last and i + 1 < Bt:
            # the next entry's B^T is built during this entry's last row group, so its evictions are done
            # before the next entry's first matmul needs it
            bTs[i + 1] = b_transposed(nxt_b)
            nxt_b = load_b(i + 2) if i + 2 < Bt else None
        bT = bTs.pop(i) if last else bTs[i]
        stage = nl.ndarray((PMAX, r, N), dt, buffer=nl.sbuf)
        for j in range(r):
            for n0 in range(0, N, TN):
                w_ = min(TN, N - n0)
                acc = nl.ndarray((PMAX, TN), nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=acc[:p, :w_], stationary=stat[j], moving=bT[:K, n0:n0 + w_], accumulate=False,
                               **next(half_rows))
                _evict_block(evict, sc, addend, stage[:p, j, n0:n0 + w_], acc[:p, :w_],
                             (slice(0, p), j, slice(n0, n0 + w_)))
        _store_rows(out[i], stage, m0, r, p, N)


def _bmm_narrow(a, b, out, transpose_a: bool, scaled: Callable | None) -> None:
    """Batched product with a long contraction (K > 128) into a narrow output (N <= 512: attention's P V, P^T dO
    with the head dim as N), B given as [K, N], entry after entry.

    The contraction is split over partitions as k = q * KT + t for K tile t < KT = K // 128 (the rows left over
    form a last tile of their own), so B loads as one descriptor per partition (its KT rows are consecutive), and
    A's matching rows or columns are strided reads. Output rows are staged as in ``_bmm_short_k`` (r whole rows
    per partition, one descriptor each). A given as [K, M]: K tile after K tile, one load of [128, rows] per tile
    (long rows of the block's columns), every slot of the block accumulating in its own PSUM tile. A as [M, K]:
    r rows per partition loaded at once, each slot's K tiles transposed on TensorE (strided columns of the rows)
    and accumulated in one PSUM tile."""
    Bt, M, N = out.shape
    K = a.shape[1] if transpose_a else a.shape[2]
    dt, isz = a.dtype, itemsize(a.dtype)
    KT, kr = divmod(K, TK)
    ktiles = KT + (1 if kr else 0)
    evict, evict_t = alternating_evict(), alternating_evict()   # products; transposes (each alternating)
    GT = max(1, 2048 // (PMAX * isz))
    per_bank = PSUM_FP32 // N                   # accumulators of N fp32 columns per PSUM bank
    if transpose_a:   # the slots of a block accumulate together: up to 4 PSUM banks of them
        R = _stage_rows(N, dt, scaled, min(4 * per_bank, 16))
    else:             # r rows of K per partition loaded at once
        R = _stage_rows(N, dt, scaled, max(1, min(8, STAGE_BYTES // (K * isz))))
    groups = _row_groups(M, R)

    def load_b(i):
        t = nl.ndarray((TK, ktiles, N), dt, buffer=nl.sbuf)
        if KT:
            nisa.dma_copy(dst=t[:, :KT, :], src=b[i].ap([[KT * N, TK], [1, KT * N]]))
        if kr:
            nisa.dma_copy(dst=t[:kr, KT, :], src=b[i][KT * TK:K, :])
        return t

    def a_tiles(i, kt, u, m0, cols):
        """A given as [K, M]: K tiles kt .. kt + u - 1, columns [m0, m0 + cols), as [128, u, cols] (whole rows,
        u > 1, are one descriptor per partition: tile kt + 1's row follows tile kt's in HBM)."""
        t = nl.ndarray((TK, u, cols), dt, buffer=nl.sbuf)
        if kt < KT:
            nisa.dma_copy(dst=t, src=a[i].ap([[KT * M, TK], [M, u], [1, cols]], offset=kt * M + m0))
        else:
            nisa.dma_copy(dst=t[:kr, 0, :], src=a[i][KT * TK:K, m0:m0 + cols])
        return t

    def a_steps(cols):
        """(first K tile, tiles) per load of A given as [K, M]: several tiles per load when the block is whole
        rows (up to 8 KiB per partition)."""
        u = max(1, min(8, 8192 // (cols * isz))) if cols == M else 1
        steps = [(k0, min(u, KT - k0)) for k0 in range(0, KT, u)]
        return steps + ([(KT, 1)] if kr else [])

    def load_rows(i, m0, r, p):
        """A's rows m0 + q*r + j as [p, r, K], u slots per DMA (u rows of at least 8 KiB per partition): the
        first slot's transposes start when its rows arrive, not the whole group's."""
        t = nl.ndarray((PMAX, r, K), dt, buffer=nl.sbuf)
        u = max(1, min(r, cdiv(8192, K * isz)))
        for j0 in range(0, r, u):
            n = min(u, r - j0)
            nisa.dma_copy(dst=t[:p, j0:j0 + n, :], src=a[i].ap([[r * K, p], [1, n * K]], offset=(m0 + j0) * K))
        return t

    def k_cols(kt):
        """The columns of a row of A (as [M, K]) in K tile kt, and the tile's rows."""
        return (slice(kt, KT * TK, KT), TK) if kt < KT else (slice(KT * TK, K), kr)

    work = [(i, g) for i in range(Bt) for g in groups]
    nxt_b = load_b(0)
    bK = None
    # A as [M, K]: row groups loaded two ahead (TensorE and the DMAs are about equally loaded: one group ahead
    # left each waiting on the other at group boundaries)
    ahead = collections.deque() if transpose_a else collections.deque(
        load_rows(*work[k][:1], *work[k][1]) for k in range(min(2, len(work))))
    addends = _addends(scaled, work, N)
    for w, (i, (m0, r, p)) in enumerate(work):
        sc, addend = next(addends)
        if m0 == 0:
            bK = nxt_b
            nxt_b = load_b(i + 1) if i + 1 < Bt else None
        stage = nl.ndarray((PMAX, r, N), dt, buffer=nl.sbuf)
        if transpose_a:
            banks = [nl.ndarray((PMAX, per_bank, N), nl.float32, buffer=nl.psum) for _ in range(cdiv(r, per_bank))]
            steps = a_steps(r * p)
            cur = a_tiles(i, *steps[0], m0, r * p)
            for s, (k0, u) in enumerate(steps):
                nxt_t = a_tiles(i, *steps[s + 1], m0, r * p) if s + 1 < len(steps) else None
                for t in range(u):
                    kt = k0 + t
                    kk = TK if kt < KT else kr
                    for j in range(r):
                        nisa.nc_matmul(dst=banks[j // per_bank][:p, j % per_bank, :], stationary=cur[:kk, t, j::r],
                                       moving=bK[:kk, kt, :], accumulate=kt > 0)
                cur = nxt_t
            for q, bank in enumerate(banks):
                s = min(per_bank, r - q * per_bank)
                slots = slice(q * per_bank, q * per_bank + s)
                _evict_block(evict, sc, addend, stage[:p, slots, :], bank[:p, :s, :], (slice(0, p), slots))
        else:
            rows = ahead.popleft()
            if w + 2 < len(work):
                ahead.append(load_rows(work[w + 2][0], *work[w + 2][1]))
            for j in range(r):
                aT = nl.ndarray((TK, ktiles, PMAX), dt, buffer=nl.sbuf)
                for k0 in range(0, ktiles, GT):
                    g = min(GT, ktiles - k0)
                    tp = nl.ndarray((TK, GT, PMAX), dt, buffer=nl.psum)
                    for t in range(g):
                        cols, kk = k_cols(k0 + t)
                        nisa.nc_transpose(dst=tp[:kk, t, :p], data=rows[:p, j, cols])
                    whole = min(g, KT - k0)
                    if whole > 0:
                        evict_t(aT[:, k0:k0 + whole, :p], tp[:, :whole, :p])
                    if whole < g:
                        evict_t(aT[:kr, KT, :p], tp[:kr, g - 1, :p])
                acc = nl.ndarray((PMAX, N), nl.float32, buffer=nl.psum)
                for kt in range(ktiles):
                    kk = TK if kt < KT else kr
                    nisa.nc_matmul(dst=acc[:p, :], stationary=aT[:kk, kt, :p], moving=bK[:kk, kt, :],
                                   accumulate=kt > 0)
                _evict_block(evict, sc, addend, stage[:p, j, :], acc[:p, :], (slice(0, p), j))
        _store_rows(out[i], stage, m0, r, p, N)


def matmul(a, b, transpose_a: bool = False, transpose_b: bool = False):
    """Host entry: ``A @ B`` through the simulator (torch tensors or NumPy arrays in, same kind out).
    ``transpose_a``: A given as [K, M]; ``transpose_b``: B given as [N, K] (``A @ B.T``)."""
    return matmul_kernel(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
