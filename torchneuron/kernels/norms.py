"""Layer norm and RMS norm over the last dim, forward and backward (row-wise, with weight/bias).

One row per partition, blocks of 128 rows, the whole row [128, D] in SBUF (fp32):

    layer norm fwd:  even row blocks: bn_stats per 512 columns + bn_aggr   VectorE
                     odd row blocks: mean = sum(x / D), then                ScalarE (two activations with
                       var = sum((mean - x)^2) / D                          their accumulate: exact two-pass)
                     rstd = (var + eps) ** -0.5                            VectorE / GpSimd (tensor_scalar)
                     u = (x - mean) * w                                    VectorE (bf16: its fast mode)
                     u = u * rstd                                          ScalarE
                     y = u + b                                             GpSimd
                     (alternating the statistics leaves each engine about one pass per block)
                     short rows (G per partition): bn_stats, u and u * rstd per row, + b per block
    rms norm fwd:    ss = sum(x^2) fused into a ScalarE activation, rstd = (ss/D + eps) ** -0.5,
                     y = x * rstd (ScalarE), y *= w (VectorE)
    backward:        recompute the statistics, then
                     dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * w   (layer norm)
                     dx = rstd * (g - xhat * mean(g * xhat))                           (rms norm)
                     dw = sum_rows(dy * xhat), db = sum_rows(dy): cross-partition sums on TensorE
                     (ones[rows, 1]^T @ tile, 512 columns per PSUM bank), accumulated in PSUM over
                     the row blocks (no VectorE add per block)

Weight and bias rows are DMA-broadcast to all 128 partitions once. The tiles of the last NBUF
blocks stay alive so DMA and the three engines overlap. The single pass holds whole rows: D fp32 x
(tiles) x NBUF in SBUF (D <= ~4700 forward, ~1700 backward on trn2); bn_stats chunks of <= 512.

The RMS backward from saved statistics has its own one-pass path (``_rms_bwd_saved``: rows up to 4096 bf16,
~2900 fp32), its intermediates in the input dtype where PyTorch's composite rounds them.

Longer rows take several passes over column blocks of W (any D up to ~5 M), on super-blocks of up
to SB x 128 rows whose per-row scalars stay in SBUF:

    pass A (rows outer, columns inner): per block bn_stats/bn_aggr -> (n, mean, n*var) triplets,
            one bn_aggr over the row's triplets (Chan's exact combination) -> rstd, -mean*rstd
            (RMS: sum of squares per block, added up)
    forward, pass B (columns outer, rows inner): w/b blocks loaded once per column block;
            y = xhat * w + b as in the single pass                        x read twice: <= 2/3 of bound
    backward, pass B: c1 = sum(g), c2 = sum(g * xhat) per row, g = dy * w; dw/db column sums
            accumulate in PSUM over the super-block's rows (ones^T @ tile), stored per column block
    backward, pass C: dx = rstd * (g - c1/D - xhat * c2/D)                x 3x, dy 2x: <= 1/2 of bound
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import (PMAX, PSUM_FP32, ROW_ELEMS, as_tensor, cdiv, check_sbuf, grouped_rows, itemsize,
                                         load_grouped, row_blocks, spread, spread_row, tiles)
from torchneuron.kernels.matmul import ChainedProduct, Epilogue, Then, _store_block, chain_bytes, chain_fits

NBUF = 3
PIPELINE_BLOCKS = 4   # the grouped paths' chains of ~10 dependent passes: at least 4 row blocks in flight
BN = 512   # nl.tile_size.bn_stats_fmax
W = 2048   # columns per block of the multi-pass path (forward)
WB = 1024  # ... backward (dw and db accumulate in 2 PSUM banks each)
SB = 1024  # row blocks per super-block of the multi-pass path (their scalars stay in SBUF)


def fwd_fits(D: int) -> bool:
    """Whether a forward row of D elements takes the single-pass path."""
    return (2 + (NBUF + 1) * 2) * D * 4 + 8 * D <= nl.tile_size.sbuf_fmax_bytes


def bwd_fits(D: int, epilogue_extras: int | None = None) -> bool:
    """Whether a backward row of D elements takes the single-pass path (with an epilogue of that many operands)."""
    return (1 + (NBUF + 1) * 7) * D * 4 + 16 * D + _epilogue_bytes(epilogue_extras, D) <= nl.tile_size.sbuf_fmax_bytes


def _row(v, D, dtype=nl.float32):
    """A (D,) HBM vector broadcast over the 128 partitions, in SBUF (fp32 unless told)."""
    t = nl.ndarray((PMAX, D), dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=v.reshape((1, D)).broadcast_to((PMAX, D)))
    return t


def _ln_stats(t, p, D, eps):
    """(rstd, -mean*rstd, mean) columns of the rows of t[:p]: bn_stats/bn_aggr on VectorE."""
    nch = cdiv(D, BN)
    stats = nl.ndarray((PMAX, 6 * nch), nl.float32, buffer=nl.sbuf)
    for c in range(nch):
        nisa.bn_stats(dst=stats[:p, 6 * c:6 * c + 6], data=t[:p, c * BN:min(D, (c + 1) * BN)])
    mv = nl.ndarray((PMAX, 2), nl.float32, buffer=nl.sbuf)
    nisa.bn_aggr(dst=mv[:p], data=stats[:p])
    rstd = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd[:p], data=mv[:p, 1:2], op0=nl.add, operand0=eps, op1=nl.power, operand1=-0.5)
    nmr = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nmr[:p], data=mv[:p, 0:1], op0=nl.multiply, operand0=rstd[:p], op1=nl.multiply,
                       operand1=-1.0)
    return rstd, nmr, mv[:, 0:1]


def _ln_stats_scalar(t, p, D, eps, junk):
    """(rstd, mean) columns of the rows of t[:p] on ScalarE, two passes: the mean (a sum of x / D), then the sum of
    squared deviations from it (exact two-pass variance, no cancellation); ``junk`` [P, D] takes the unused
    element-wise results."""
    mean = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=junk[:p], op=nl.identity, data=t[:p], scale=1.0 / D, reduce_op=nl.add, reduce_res=mean[:p],
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    rstd = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=junk[:p], op=nl.square, data=t[:p], scale=-1.0, bias=mean[:p], reduce_op=nl.add,
                    reduce_res=rstd[:p], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.tensor_scalar(dst=rstd[:p], data=rstd[:p], op0=nl.multiply, operand0=1.0 / D, op1=nl.add, operand1=eps,
                       engine=nisa.gpsimd_engine)
    nisa.tensor_scalar(dst=rstd[:p], data=rstd[:p], op0=nl.power, operand0=-0.5, engine=nisa.gpsimd_engine)
    return rstd, mean


def _saved_stats(mean, rstd, r0, p, sc):
    """(rstd, -mean*rstd) of rows [r0, r0 + p) into sc[:, 0:2], from a forward's saved (N, 1) statistics
    (the backward then uses exactly the forward's values, as PyTorch's CPU kernel does); mean None: RMS."""
    nisa.dma_copy(dst=sc[:p, 0:1], src=rstd[r0:r0 + p, :])
    if mean is None:     # RMS norm: no centring
        nisa.memset(dst=sc[:p, 1:2], value=0.0)
        return
    m = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=m[:p], src=mean[r0:r0 + p, :])
    nisa.tensor_scalar(dst=sc[:p, 1:2], data=m[:p], op0=nl.multiply, operand0=sc[:p, 0:1], op1=nl.multiply,
                       operand1=-1.0)


def _rms_stats(t, p, D, eps):
    """rstd column of the rows of t[:p]: the sum of squares fused into a ScalarE activation."""
    sq = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
    ss = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq[:p], op=nl.square, data=t[:p], reduce_op=nl.add, reduce_res=ss[:p],
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    rstd = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd[:p], data=ss[:p], op0=nl.multiply, operand0=1.0 / D, op1=nl.add, operand1=eps)
    nisa.tensor_scalar(dst=rstd[:p], data=rstd[:p], op0=nl.power, operand0=-0.5)
    return rstd


def _long_stats(x, r0, p, D, eps, rms, sc, mean=None):
    """Pass A for one row block: (rstd, -mean*rstd) into sc[:, 0:2] (RMS: nmr = 0), column blocks of W;
    the mean also into the (P, 1) tile ``mean`` when given."""
    ncb = cdiv(D, W)
    assert ncb * 12 <= 64 * 1024, f"layer_norm: rows of {D} elements exceed the {64 * 1024 // 12 * W} supported"
    trip = nl.ndarray((PMAX, ncb, 3), nl.float32, buffer=nl.sbuf)   # (n, mean, n*var) per column block
    ring = collections.deque(maxlen=NBUF)
    for cb in range(ncb):
        c0 = cb * W
        w = min(W, D - c0)
        t = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:p, :w], src=x[r0:r0 + p, c0:c0 + w])
        if rms:   # sum of squares of the block into the n*var slot (n = 1, mean = 0 are never read)
            sq = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sq[:p, :w], op=nl.square, data=t[:p, :w], reduce_op=nl.add,
                            reduce_res=trip[:p, cb, 2:3], reduce_cmd=nisa.reduce_cmd.reset_reduce)
            ring.append((t, sq))
            continue
        nch = cdiv(w, BN)
        st = nl.ndarray((PMAX, 6 * cdiv(W, BN)), nl.float32, buffer=nl.sbuf)
        for c in range(nch):
            nisa.bn_stats(dst=st[:p, 6 * c:6 * c + 6], data=t[:p, c * BN:min(w, (c + 1) * BN)])
        mv = nl.ndarray((PMAX, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv[:p], data=st[:p, :6 * nch])
        nisa.memset(dst=trip[:p, cb, 0:1], value=float(w))
        nisa.tensor_copy(dst=trip[:p, cb, 1:2], src=mv[:p, 0:1])
        nisa.tensor_scalar(dst=trip[:p, cb, 2:3], data=mv[:p, 1:2], op0=nl.multiply, operand0=float(w))
        ring.append((t, st, mv))
    rstd, nmr = sc[:p, 0:1], sc[:p, 1:2]
    if rms:
        ss = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=ss[:p], op=nl.add, data=trip[:p, :, 2], axis=(1,))
        nisa.tensor_scalar(dst=rstd, data=ss[:p], op0=nl.multiply, operand0=1.0 / D, op1=nl.add, operand1=eps)
        nisa.tensor_scalar(dst=rstd, data=rstd, op0=nl.power, operand0=-0.5)
        nisa.memset(dst=nmr, value=0.0)
        return
    mv = nl.ndarray((PMAX, 2), nl.float32, buffer=nl.sbuf)
    nisa.bn_aggr(dst=mv[:p], data=trip[:p].reshape((p, 3 * ncb)))
    nisa.tensor_scalar(dst=rstd, data=mv[:p, 1:2], op0=nl.add, operand0=eps, op1=nl.power, operand1=-0.5)
    nisa.tensor_scalar(dst=nmr, data=mv[:p, 0:1], op0=nl.multiply, operand0=rstd, op1=nl.multiply, operand1=-1.0)
    if mean is not None:
        nisa.tensor_copy(dst=mean[:p], src=mv[:p, 0:1])


def _blocks(N):
    """Super-blocks: lists of (row block index in the super-block, r0, rows)."""
    rbs = tiles(N)
    for s0 in range(0, len(rbs), SB):
        yield [(i, r0, p) for i, (r0, p) in enumerate(rbs[s0:s0 + SB])]


def _row_block(v, c0, w, Wd):
    """Columns [c0, c0 + w) of a (D,) HBM vector broadcast over the partitions (fp32 SBUF)."""
    t = nl.ndarray((PMAX, Wd), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[:, :w], src=v[c0:c0 + w].reshape((1, w)).broadcast_to((PMAX, w)))
    return t


def _ln_fwd_long(x, weight, bias, out, eps, rms, stats):
    N, D = x.shape
    ring = collections.deque(maxlen=NBUF)
    for blk in _blocks(N):
        sc = nl.ndarray((PMAX, len(blk), 3), nl.float32, buffer=nl.sbuf)    # rstd, -mean*rstd, mean per row block
        for i, r0, p in blk:
            _long_stats(x, r0, p, D, eps, rms, sc[:, i, :], sc[:, i, 2:3] if stats else None)
            if stats:
                _store_stats(stats, r0, p, sc[:, i, 2:3], sc[:, i, 0:1])
        for c0 in range(0, D, W):
            w = min(W, D - c0)
            wt = _row_block(weight, c0, w, W)
            bt = None if rms else _row_block(bias, c0, w, W)
            for i, r0, p in blk:
                t = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=t[:p, :w], src=x[r0:r0 + p, c0:c0 + w])
                y = nl.ndarray((PMAX, W), nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=y[:p, :w], op=nl.identity, data=t[:p, :w], scale=sc[:p, i, 0:1],
                                bias=sc[:p, i, 1:2])
                nisa.tensor_tensor(dst=y[:p, :w], data1=y[:p, :w], data2=wt[:p, :w], op=nl.multiply,
                                   engine=nisa.gpsimd_engine)
                if not rms:
                    nisa.tensor_tensor(dst=y[:p, :w], data1=y[:p, :w], data2=bt[:p, :w], op=nl.add,
                                       engine=nisa.gpsimd_engine)
                nisa.dma_copy(dst=out[r0:r0 + p, c0:c0 + w], src=y[:p, :w])
                ring.append((t, y))
            ring.append((wt, bt))


def grouped(D: int) -> bool:
    """Whether rows of D elements take the grouped path (several rows per partition)."""
    return 2 * D <= ROW_ELEMS


def _grouped_stats(t, p, g, D, eps, rms):
    """(mean or None for RMS, centred rows, rstd) of a grouped [p, g, D] tile: two-pass reductions
    (sum, then the sum of squared deviations), per row [P, g] statistics."""
    mean = None
    xc = t
    if not rms:
        mean = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=mean[:p], op=nl.add, data=t[:p], axis=(2,))
        nisa.tensor_scalar(dst=mean[:p], data=mean[:p], op0=nl.multiply, operand0=1.0 / D)
        xc = nl.ndarray((PMAX, g, D), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=xc[:p], data1=t[:p], data2=spread(mean, p, g, D), op=nl.subtract)
    sq = nl.ndarray((PMAX, g, D), nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=sq[:p], data1=xc[:p], data2=xc[:p], op=nl.multiply, engine=nisa.gpsimd_engine)
    rstd = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=rstd[:p], op=nl.add, data=sq[:p], axis=(2,))
    nisa.tensor_scalar(dst=rstd[:p], data=rstd[:p], op0=nl.multiply, operand0=1.0 / D, op1=nl.add, operand1=eps)
    nisa.tensor_scalar(dst=rstd[:p], data=rstd[:p], op0=nl.power, operand0=-0.5)
    return mean, xc, rstd


def chains_product(N: int, D: int, N2: int, extras2: int, *dtypes) -> bool:
    """Whether ``layer_norm_kernel(then=...)`` can multiply its output [N, D] by a B2 [D, N2] with an epilogue of
    ``extras2`` operands on chip: the grouped path in whole [128, G, D] blocks (row r0 + p * G + j at (p, j): the
    row blocks ``ChainedProduct`` takes) that ``chain_fits`` (``dtypes``: the input's, B2's), its tiles beside."""
    if not (fwd_fits(D) and grouped(D)):
        return False
    G = row_blocks(N, D, PIPELINE_BLOCKS)[1]
    return (N % (PMAX * G) == 0 and chain_fits(G, D, N2, *dtypes)
            and _fwd_grouped_bytes(D, G) + chain_bytes(G, D, N2, extras2) <= nl.tile_size.sbuf_fmax_bytes)


def _fwd_grouped_bytes(D: int, G: int) -> int:
    """SBUF per partition of the grouped forward: w, b, and 3 tiles [G, D] per block in flight."""
    return (2 + (NBUF + 1) * 3 * G) * D * 4 + 8 * G


def _ln_fwd_grouped(x, weight, bias, out, eps, rms, stats, chained: ChainedProduct | None = None):
    """Short rows (``grouped(D)``): G rows per partition, y = (x - mean) * rstd * w + b per [128, G, D] tile;
    ``chained``: each block's y goes on into that product."""
    N, D = x.shape
    blocks, G = row_blocks(N, D, PIPELINE_BLOCKS)
    check_sbuf(_fwd_grouped_bytes(D, G), f"layer_norm D={D}")
    w = _row(weight, D)
    b = None if rms else _row(bias, D)
    if chained is not None:
        chained.load(G)
    ring = collections.deque(maxlen=NBUF)
    for i, (r0, p, g) in enumerate(blocks):
        t = load_grouped(x, r0, p, g)
        y = nl.ndarray((PMAX, g, D), nl.float32, buffer=nl.sbuf)
        if rms:
            mean, xc, rstd = _grouped_stats(t, p, g, D, eps, rms)
            nisa.tensor_tensor(dst=y[:p], data1=xc[:p], data2=spread(rstd, p, g, D), op=nl.multiply)
            nisa.tensor_tensor(dst=y[:p], data1=y[:p], data2=spread_row(w, p, g, D), op=nl.multiply,
                               engine=nisa.gpsimd_engine)
            xc = None
        else:
            # one pass per engine and row, as the one-row-per-partition path: bn_stats and u = (x - mean) * w
            # on VectorE, u * rstd on ScalarE, + b on GpSimd (two-pass statistics and a scaling pass on VectorE
            # left it three passes per block to GpSimd's three and ScalarE's none)
            xc = None
            mean = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
            rstd = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
            for j in range(g):
                rs, _, m = _ln_stats(t[:, j, :], p, D, eps)
                nisa.tensor_copy(dst=mean[:p, j:j + 1], src=m[:p], engine=nisa.gpsimd_engine)
                nisa.tensor_copy(dst=rstd[:p, j:j + 1], src=rs[:p], engine=nisa.gpsimd_engine)
                nisa.scalar_tensor_tensor(dst=y[:p, j, :], data=t[:p, j, :], op0=nl.subtract, operand0=m[:p],
                                          op1=nl.multiply, operand1=w[:p])
                nisa.activation(dst=y[:p, j, :], op=nl.identity, data=y[:p, j, :], scale=rs[:p])
            nisa.tensor_tensor(dst=y[:p], data1=y[:p], data2=spread_row(b, p, g, D), op=nl.add,
                               engine=nisa.gpsimd_engine)
        nisa.dma_copy(dst=grouped_rows(out, r0, p, g), src=y[:p])
        if chained is not None:
            chained.block(i, y, r0, g)
        if stats:
            mean_out, rstd_out = stats
            if mean_out is not None:
                nisa.dma_copy(dst=mean_out[r0:r0 + p * g, :].reshape((p, g)), src=mean[:p])
            nisa.dma_copy(dst=rstd_out[r0:r0 + p * g, :].reshape((p, g)), src=rstd[:p])
        ring.append((t, xc, y))


def _store_stats(stats, r0, p, mean, rstd):
    """DMA the (P, 1) mean and rstd columns of rows [r0, r0 + p) to the (N, 1) HBM outputs ``stats`` (no mean
    output: RMS norm)."""
    mean_out, rstd_out = stats
    if mean_out is not None:
        nisa.dma_copy(dst=mean_out[r0:r0 + p, :], src=mean[:p])
    nisa.dma_copy(dst=rstd_out[r0:r0 + p, :], src=rstd[:p])


@nki.jit
def layer_norm_kernel(x, weight, bias, eps=1e-5, rms=False, stats=False, stats_dtype=None, then: Then | None = None):
    """Forward layer norm (``rms``: RMS norm, ``bias`` ignored) of the rows of [N, D]. With ``stats`` it
    returns (out, mean, rstd) (RMS norm: (out, rstd)), the row statistics as (N, 1) fp32 (or rounded to
    ``stats_dtype`` by their store, as ``native_layer_norm`` returns them for half inputs), which the
    backward takes (``layer_norm_bwd_kernel(..., mean=, rstd=)``). ``then`` (a ``Then``, where
    ``chains_product`` says so): also the output times a B2 [D, N2] (the next linear layer), from the output's
    blocks in SBUF instead of a product kernel loading the stored output back; its [N, N2] result comes last."""
    N, D = x.shape
    out = nl.ndarray((N, D), x.dtype, buffer=nl.shared_hbm)
    sdt = stats_dtype or nl.float32
    saved = (None if rms else nl.ndarray((N, 1), sdt, buffer=nl.shared_hbm),
             nl.ndarray((N, 1), sdt, buffer=nl.shared_hbm)) if stats else None
    result = (out, *[t for t in saved if t is not None]) if stats else out
    if then is not None:
        K2, N2 = then.b.shape[::-1] if then.transpose_b else then.b.shape
        extras2 = 0 if then.epilogue is None else len(then.epilogue.extras)
        assert K2 == D and chains_product(N, D, N2, extras2, x.dtype, then.b.dtype), \
            f"layer_norm: no chained product for [{N}, {D}] rows then {tuple(then.b.shape)} (see chains_product)"
        chained = ChainedProduct(then, D, N)
        _ln_fwd_grouped(x, weight, bias, out, eps, rms, saved, chained)
        return (*result, chained.out) if stats else (out, chained.out)
    if not fwd_fits(D):
        _ln_fwd_long(x, weight, bias, out, eps, rms, saved)
        return result
    if grouped(D):
        _ln_fwd_grouped(x, weight, bias, out, eps, rms, saved)
        return result
    check_sbuf((2 + (NBUF + 1) * 2) * D * 4 + 8 * D, f"layer_norm D={D}")
    # tiles keep the input's dtype on both DMA sides (a casting DMA moves the fp32 bytes); the weight stays
    # in its dtype when it is the input's (VectorE's bf16 rate for (x - mean) * w), else fp32
    w = _row(weight, D, weight.dtype if weight.dtype == x.dtype else nl.float32)
    b = None if rms else _row(bias, D, bias.dtype if bias.dtype == x.dtype else nl.float32)
    ring = collections.deque(maxlen=NBUF)
    for b_i, r0 in enumerate(range(0, N, PMAX)):
        p = min(PMAX, N - r0)
        t = nl.ndarray((PMAX, D), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:p], src=x[r0:r0 + p, :])
        u = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        y = u if x.dtype == nl.float32 else nl.ndarray((PMAX, D), x.dtype, buffer=nl.sbuf)
        # one pass per engine: the statistics and u = (x - mean) * w on VectorE, the scaling on ScalarE
        # (layer norm) or GpSimd (RMS), the bias on GpSimd; y is written once, in the output dtype. Layer norm's
        # VectorE would carry two passes per block to the others' one: every other block takes its statistics
        # on ScalarE instead (two passes: the mean, then the sum of squared deviations from it)
        if rms:
            rstd = _rms_stats(t, p, D, eps)
            nisa.scalar_tensor_tensor(dst=u[:p], data=t[:p], op0=nl.subtract, operand0=0.0, op1=nl.multiply,
                                      operand1=w[:p])
            nisa.tensor_scalar(dst=y[:p], data=u[:p], op0=nl.multiply, operand0=rstd[:p], engine=nisa.gpsimd_engine)
            mean = None
        else:
            rstd, mean = _ln_stats_scalar(t, p, D, eps, y) if b_i % 2 else _ln_stats(t, p, D, eps)[::2]
            nisa.scalar_tensor_tensor(dst=u[:p], data=t[:p], op0=nl.subtract, operand0=mean[:p], op1=nl.multiply,
                                      operand1=w[:p])
            nisa.activation(dst=u[:p], op=nl.identity, data=u[:p], scale=rstd[:p])
            nisa.tensor_tensor(dst=y[:p], data1=u[:p], data2=b[:p], op=nl.add, engine=nisa.gpsimd_engine)
        if stats:
            _store_stats(saved, r0, p, mean, rstd)
        nisa.dma_copy(dst=out[r0:r0 + p, :], src=y[:p])
        ring.append((t, u, y))
    return result


def _col_sums(D: int, rms: bool) -> dict:
    """PSUM accumulators [1, D] fp32 for the column sums of dw and (layer norm: RMS norm has no bias) db, each whole
    banks (so that every 512-column matmul of ``_col_sum`` stays in one bank; D <= 2048: together at most the 8
    banks)."""
    assert D <= 4 * PSUM_FP32, f"layer_norm backward: column sums of {D} > {4 * PSUM_FP32} do not fit PSUM"
    return {k: nl.ndarray((1, cdiv(D, PSUM_FP32) * PSUM_FP32), nl.float32, buffer=nl.psum)
            for k in (("dw",) if rms else ("dw", "db"))}


def _store_col_sums(acc: dict, dw_out, db_out, D: int, slots: int | None = None) -> None:
    """Store dw and db from ``_col_sums``' accumulators: each one's ``slots`` row slots of D columns summed by
    VectorE (the grouped path's [1, slots * D]), or (None) its D columns copied; db zero where there is none."""
    for key, dst in (("dw", dw_out), ("db", db_out)):
        col = nl.ndarray((1, D), nl.float32, buffer=nl.sbuf)
        if key not in acc:
            nisa.memset(dst=col, value=0.0)
        elif slots is None:
            nisa.tensor_copy(dst=col, src=acc[key][:, :D])
        else:
            nisa.tensor_reduce(dst=col, op=nl.add, data=acc[key].ap([[acc[key].shape[1], 1], [1, D], [D, slots]]),
                               axis=(2,))
        nisa.dma_copy(dst=dst, src=col)


def _col_sum(acc, src, p, D, ones, first: bool) -> None:
    """acc[0, :D] (PSUM) (+)= sum over partitions of src[:p, :D] on TensorE (ones^T @ src, 512 columns per matmul):
    the row blocks' sums accumulate in PSUM in block order (``first``: the first block's overwrites), the same fp32
    additions a VectorE add per block made, without its pass."""
    for c0 in range(0, D, PSUM_FP32):
        w = min(PSUM_FP32, D - c0)
        nisa.nc_matmul(dst=acc[:, c0:c0 + w], stationary=ones[:p, :], moving=src[:p, c0:c0 + w], accumulate=not first)


def _ln_bwd_long(dy, x, weight, dx_out, dw_out, db_out, eps, rms, saved):
    N, D = x.shape
    ones = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    ring = collections.deque(maxlen=NBUF)
    for si, blk in enumerate(_blocks(N)):
        nb = len(blk)
        sc = nl.ndarray((PMAX, nb, 2), nl.float32, buffer=nl.sbuf)     # rstd, -mean*rstd per row block
        cs = nl.ndarray((PMAX, nb, 2), nl.float32, buffer=nl.sbuf)     # sum(g), sum(g * xhat) per row block
        nisa.memset(dst=cs, value=0.0)
        for i, r0, p in blk:
            if saved:
                _saved_stats(*saved, r0, p, sc[:, i, :])
            else:
                _long_stats(x, r0, p, D, eps, rms, sc[:, i, :])
        for phase in ("sums", "dx"):
            for c0 in range(0, D, WB):
                w = min(WB, D - c0)
                wt = _row_block(weight, c0, w, WB)
                if phase == "sums":    # dw, db of this column block accumulate over the rows in PSUM
                    dw_ps = nl.ndarray((1, WB), nl.float32, buffer=nl.psum)
                    db_ps = nl.ndarray((1, WB), nl.float32, buffer=nl.psum)
                for i, r0, p in blk:
                    t = nl.ndarray((PMAX, WB), nl.float32, buffer=nl.sbuf)
                    g = nl.ndarray((PMAX, WB), nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=t[:p, :w], src=x[r0:r0 + p, c0:c0 + w])
                    nisa.dma_copy(dst=g[:p, :w], src=dy[r0:r0 + p, c0:c0 + w])
                    xh = nl.ndarray((PMAX, WB), nl.float32, buffer=nl.sbuf)
                    nisa.activation(dst=xh[:p, :w], op=nl.identity, data=t[:p, :w], scale=sc[:p, i, 0:1],
                                    bias=sc[:p, i, 1:2])
                    if phase == "sums":
                        prod = nl.ndarray((PMAX, WB), nl.float32, buffer=nl.sbuf)
                        nisa.tensor_tensor(dst=prod[:p, :w], data1=g[:p, :w], data2=xh[:p, :w], op=nl.multiply,
                                           engine=nisa.gpsimd_engine)
                        for q0 in range(0, w, PSUM_FP32):
                            q = min(PSUM_FP32, w - q0)
                            nisa.nc_matmul(dst=dw_ps[:, q0:q0 + q], stationary=ones[:p, :],
                                           moving=prod[:p, q0:q0 + q], accumulate=i > 0)
                            if not rms:
                                nisa.nc_matmul(dst=db_ps[:, q0:q0 + q], stationary=ones[:p, :],
                                               moving=g[:p, q0:q0 + q], accumulate=i > 0)
                        # gw = dy * w; c1 += sum(gw) (VectorE reduce), c2 += sum(gw * xhat) (fused reduce)
                        gw = nl.ndarray((PMAX, WB), nl.float32, buffer=nl.sbuf)
                        part = nl.ndarray((PMAX, 2), nl.float32, buffer=nl.sbuf)
                        nisa.tensor_tensor(dst=gw[:p, :w], data1=g[:p, :w], data2=wt[:p, :w], op=nl.multiply)
                        nisa.tensor_reduce(dst=part[:p, 0:1], op=nl.add, data=gw[:p, :w], axis=(1,))
                        nisa.tensor_tensor(dst=prod[:p, :w], data1=gw[:p, :w], data2=xh[:p, :w], op=nl.multiply,
                                           engine=nisa.gpsimd_engine)
                        nisa.tensor_reduce(dst=part[:p, 1:2], op=nl.add, data=prod[:p, :w], axis=(1,))
                        nisa.tensor_tensor(dst=cs[:p, i, :], data1=cs[:p, i, :], data2=part[:p], op=nl.add)
                        ring.append((t, g, xh, prod, gw))
                    else:   # dx = rstd * (gw - c1/D - xhat * c2/D); cs holds -c1/D, -c2/D
                        gw = nl.ndarray((PMAX, WB), nl.float32, buffer=nl.sbuf)
                        nisa.tensor_tensor(dst=gw[:p, :w], data1=g[:p, :w], data2=wt[:p, :w], op=nl.multiply)
                        corr = nl.ndarray((PMAX, WB), nl.float32, buffer=nl.sbuf)
                        nisa.activation(dst=corr[:p, :w], op=nl.identity, data=xh[:p, :w], scale=cs[:p, i, 1:2],
                                        bias=cs[:p, i, 0:1])
                        nisa.tensor_tensor(dst=gw[:p, :w], data1=gw[:p, :w], data2=corr[:p, :w], op=nl.add,
                                           engine=nisa.gpsimd_engine)
                        nisa.activation(dst=corr[:p, :w], op=nl.identity, data=gw[:p, :w], scale=sc[:p, i, 0:1])
                        nisa.dma_copy(dst=dx_out[r0:r0 + p, c0:c0 + w], src=corr[:p, :w])
                        ring.append((t, g, xh, gw, corr))
                if phase == "sums":   # this super-block's dw/db columns (added to earlier super-blocks')
                    for ps, dst in ((dw_ps, dw_out), (db_ps, db_out)):
                        acc = nl.ndarray((1, WB), nl.float32, buffer=nl.sbuf)
                        if rms and dst is db_out:
                            nisa.memset(dst=acc[:, :w], value=0.0)
                        else:
                            nisa.tensor_copy(dst=acc[:, :w], src=ps[:, :w])
                        if si > 0:
                            prev = nl.ndarray((1, WB), nl.float32, buffer=nl.sbuf)
                            nisa.dma_copy(dst=prev[:, :w], src=dst[:, c0:c0 + w])
                            nisa.tensor_tensor(dst=acc[:, :w], data1=acc[:, :w], data2=prev[:, :w], op=nl.add)
                        nisa.dma_copy(dst=dst[:, c0:c0 + w], src=acc[:, :w])
                        ring.append((acc,))
                ring.append((wt,))
            if phase == "sums":       # c1, c2 as the means the dx formula wants (RMS: no c1 term)
                nisa.tensor_scalar(dst=cs, data=cs, op0=nl.multiply, operand0=-1.0 / D)
                if rms:
                    nisa.memset(dst=cs[:, :, 0:1], value=0.0)


def _bwd_grouped_bytes(D: int, G: int) -> int:
    """SBUF per partition of the grouped backward: w, two accumulators, and 6 tiles [G, D] per block in flight
    (two rows of 1024 do not fit trn1's 192 KiB: those take one row per partition)."""
    return (3 + (NBUF + 1) * 6 * G) * D * 4 + 16 * G


def _bwd_takes_grouped(N: int, D: int, extras: int | None, chained: int = 0) -> bool:
    """Whether the backward takes the grouped path for [N, D] (with an epilogue of ``extras`` operands, None: none,
    and ``chained`` bytes per partition of a chained product's tiles)."""
    G = row_blocks(N, D, PIPELINE_BLOCKS)[1]
    return (bwd_fits(D) and grouped(D)
            and _bwd_grouped_bytes(D, G) + _epilogue_bytes(extras, G * D) + chained <= nl.tile_size.sbuf_fmax_bytes)


def bwd_chains_product(N: int, D: int, N2: int, extras: int | None, extras2: int, *dtypes) -> bool:
    """Whether ``layer_norm_bwd_kernel(then=...)`` (layer norm, its dx epilogue of ``extras`` operands or None) can
    multiply dx (the epilogue's result) by a B2 [D, N2] with an epilogue of ``extras2`` operands on chip: the grouped
    path in whole [128, G, D] blocks that ``chain_fits`` (``dtypes``: the input's, dx's, B2's), its tiles beside."""
    G = row_blocks(N, D, PIPELINE_BLOCKS)[1]
    return (N % (PMAX * G) == 0 and chain_fits(G, D, N2, *dtypes)
            and _bwd_takes_grouped(N, D, extras, chain_bytes(G, D, N2, extras2)))


def _ln_bwd_grouped(dy, x, weight, dx_out, dw_out, db_out, eps, rms, saved, epilogue=None,
                    chained: ChainedProduct | None = None):
    """Short rows (``grouped(D)``): G rows per partition. dw/db column sums run on TensorE over the
    [p, G*D] tiles into a [1, G, D] accumulator, summed over G at the end. ``chained``: each block's dx (the
    epilogue's result) goes on into that product."""
    N, D = x.shape
    blocks, G = row_blocks(N, D, PIPELINE_BLOCKS)
    check_sbuf(_bwd_grouped_bytes(D, G), f"layer_norm backward D={D}")
    if chained is not None:
        chained.load(G)
    w = _row(weight, D)
    ones = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    acc = _col_sums(G * D, rms)
    ring = collections.deque(maxlen=NBUF)
    for b, (r0, p, g) in enumerate(blocks):
        t, gr = load_grouped(x, r0, p, g), load_grouped(dy, r0, p, g)
        if saved:   # xhat = x * rstd - mean * rstd: one ScalarE pass per row slot (its statistics are columns)
            rstd = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=rstd[:p], src=saved[1][r0:r0 + p * g, :].reshape((p, g)))
            nmr = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
            xh = nl.ndarray((PMAX, g, D), nl.float32, buffer=nl.sbuf)
            if saved[0] is None:   # RMS norm: no centring
                nisa.memset(dst=nmr[:p], value=0.0)
            else:
                mean = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=mean[:p], src=saved[0][r0:r0 + p * g, :].reshape((p, g)))
                nisa.scalar_tensor_tensor(dst=nmr[:p], data=mean[:p], op0=nl.multiply, operand0=-1.0,
                                          op1=nl.multiply, operand1=rstd[:p])
            for k in range(g):
                nisa.activation(dst=xh[:p, k, :], op=nl.identity, data=t[:p, k, :], scale=rstd[:p, k:k + 1],
                                bias=nmr[:p, k:k + 1])
        else:
            _, xc, rstd = _grouped_stats(t, p, g, D, eps, rms)
            # layer norm scales its centred copy in place; RMS (xc is the loaded x) a new tile
            xh = nl.ndarray((PMAX, g, D), nl.float32, buffer=nl.sbuf) if rms else xc
            nisa.tensor_tensor(dst=xh[:p], data1=xc[:p], data2=spread(rstd, p, g, D), op=nl.multiply)
        # weight/bias gradients: column sums of dy * xhat and dy over this block's rows
        prod = nl.ndarray((PMAX, g, D), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[:p], data1=gr[:p], data2=xh[:p], op=nl.multiply, engine=nisa.gpsimd_engine)
        _col_sum(acc["dw"], prod.reshape((PMAX, g * D)), p, g * D, ones, first=b == 0)
        if not rms:
            _col_sum(acc["db"], gr.reshape((PMAX, g * D)), p, g * D, ones, first=b == 0)
        # dx = rstd * gw - u,  u = (rstd * c2) * xhat + rstd * c1,  gw = dy * w, c1 = mean(gw), c2 = mean(gw * xhat):
        # the passes spread over VectorE (dx; gw unless it has the statistics' passes or an epilogue's), GpSimdE
        # (products) and ScalarE (xhat, c1, c2, u)
        gw = nl.ndarray((PMAX, g, D), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gw[:p], data1=gr[:p], data2=spread_row(w, p, g, D), op=nl.multiply,
                           engine=nisa.gpsimd_engine if saved and epilogue is not None else None)
        gx = nl.ndarray((PMAX, g, D), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gx[:p], data1=gw[:p], data2=xh[:p], op=nl.multiply, engine=nisa.gpsimd_engine)
        c2 = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
        for k in range(g):   # the row sums of gx ride on a ScalarE copy in place (VectorE has the most passes)
            nisa.activation(dst=gx[:p, k, :], op=nl.identity, data=gx[:p, k, :], reduce_op=nl.add,
                            reduce_res=c2[:p, k:k + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.scalar_tensor_tensor(dst=c2[:p], data=c2[:p], op0=nl.multiply, operand0=1.0 / D, op1=nl.multiply,
                                  operand1=rstd[:p])
        c1 = None
        if not rms:
            c1 = nl.ndarray((PMAX, g), nl.float32, buffer=nl.sbuf)
            for k in range(g):   # the row sums of gw ride on a ScalarE copy (into gx, no longer needed)
                nisa.activation(dst=gx[:p, k, :], op=nl.identity, data=gw[:p, k, :], reduce_op=nl.add,
                                reduce_res=c1[:p, k:k + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
            nisa.scalar_tensor_tensor(dst=c1[:p], data=c1[:p], op0=nl.multiply, operand0=1.0 / D, op1=nl.multiply,
                                      operand1=rstd[:p])
        u = prod                 # its column sums are taken: reused (SBUF holds 6 tiles per block of D <= 1024)
        for k in range(g):
            nisa.activation(dst=u[:p, k, :], op=nl.identity, data=xh[:p, k, :], scale=c2[:p, k:k + 1],
                            bias=None if rms else c1[:p, k:k + 1])
            nisa.scalar_tensor_tensor(dst=gw[:p, k, :], data=gw[:p, k, :], op0=nl.multiply, operand0=rstd[:p, k:k + 1],
                                      op1=nl.subtract, operand1=u[:p, k, :])
        y = _store_dx(dx_out, gw.reshape((PMAX, g * D))[:p], x.dtype,
                      lambda t, r0=r0, p=p, g=g: t[r0:r0 + p * g, :].reshape((p, g * D)), epilogue)
        if chained is not None:
            chained.block(b, y, r0, g)
        ring.append((t, gr, xh, prod, gw, gx))
    _store_col_sums(acc, dw_out, db_out, D, slots=G)   # the G row slots of each column summed


RMS_RING = 1       # earlier row blocks whose tiles stay live in the RMS backward from saved statistics
PSUM_BANKS = 8     # dw accumulates over all row blocks in PSUM: rows of up to 8 x 512 fp32


def _rms_bwd_bytes(D: int, size: int) -> int:
    """SBUF bytes per partition of the RMS backward from saved statistics: the weight row and, per live row block,
    six tiles in the input's dtype (``size`` bytes) and two fp32 ones."""
    return size * D + (RMS_RING + 1) * (6 * size + 8) * D


def rms_bwd_fits(D: int, size: int) -> bool:
    """Whether an RMS backward row of D elements of ``size`` bytes takes the one-pass path on saved statistics."""
    return D <= PSUM_BANKS * PSUM_FP32 and _rms_bwd_bytes(D, size) <= nl.tile_size.sbuf_fmax_bytes


def _rms_bwd_saved(dy, x, weight, dx_out, dw_out, db_out, rstd_in):
    """RMS backward from the forward's 1/rms (x, dy, w of one dtype), one pass over each row block. With
    g = dy * w and xh = x * rstd rounded to that dtype, as PyTorch's composite rounds them:

        g = dy * w, xh = x * rstd, p = dy * xh      VectorE, in the input dtype (bf16: its fast modes)
        dw += ones^T @ p                            TensorE, accumulated in PSUM over all rows (fp32), rounded once
        c = sum(x * g)                              VectorE fp32 products (scalar_tensor_tensor), ScalarE sum
        dx = rstd * g - (rstd^3 c / D) * x          ScalarE x * k, GpSimd rstd * g and the sum, rounded once
    (dx = rstd * (g - xh * mean(g * xh)) with xh = x * rstd.) x and dy stay in their dtype; db is zero."""
    N, D = x.shape
    dt = x.dtype
    check_sbuf(_rms_bwd_bytes(D, itemsize(dt)), f"rms_norm backward D={D}")
    w = _row(weight, D, dt)
    ones = nl.ndarray((PMAX, 1), dt, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    banks = [nl.ndarray((1, PSUM_FP32), nl.float32, buffer=nl.psum) for _ in range(cdiv(D, PSUM_FP32))]
    ring = collections.deque(maxlen=RMS_RING)
    for i, r0 in enumerate(range(0, N, PMAX)):
        p = min(PMAX, N - r0)
        t = nl.ndarray((PMAX, D), dt, buffer=nl.sbuf)
        d = nl.ndarray((PMAX, D), dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:p], src=x[r0:r0 + p, :])
        nisa.dma_copy(dst=d[:p], src=dy[r0:r0 + p, :])
        sc = nl.ndarray((PMAX, 3), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sc[:p, 0:1], src=rstd_in[r0:r0 + p, :])
        rs, c, k = sc[:, 0:1], sc[:, 1:2], sc[:, 2:3]
        g = nl.ndarray((PMAX, D), dt, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=g[:p], data1=d[:p], data2=w[:p], op=nl.multiply)
        xh = nl.ndarray((PMAX, D), dt, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=xh[:p], data=t[:p], op0=nl.multiply, operand0=rs[:p])
        prod = nl.ndarray((PMAX, D), dt, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[:p], data1=d[:p], data2=xh[:p], op=nl.multiply)
        for b, c0 in enumerate(range(0, D, PSUM_FP32)):
            cw = min(PSUM_FP32, D - c0)
            nisa.nc_matmul(dst=banks[b][:, :cw], stationary=ones[:p, :], moving=prod[:p, c0:c0 + cw],
                           accumulate=i > 0)
        xg = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=xg[:p], data=t[:p], op0=nl.subtract, operand0=0.0, op1=nl.multiply,
                                  operand1=g[:p])
        nisa.activation(dst=xg[:p], op=nl.identity, data=xg[:p], reduce_op=nl.add, reduce_res=c[:p],
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        # k = -rstd^3 * c / D, then xg = x * k (its products no longer needed)
        nisa.tensor_scalar(dst=k[:p], data=c[:p], op0=nl.multiply, operand0=rs[:p], op1=nl.multiply,
                           operand1=rs[:p])
        nisa.tensor_scalar(dst=k[:p], data=k[:p], op0=nl.multiply, operand0=rs[:p], op1=nl.multiply,
                           operand1=-1.0 / D)
        nisa.activation(dst=xg[:p], op=nl.identity, data=t[:p], scale=k[:p])
        gr = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=gr[:p], data=g[:p], op0=nl.multiply, operand0=rs[:p], engine=nisa.gpsimd_engine)
        out = nl.ndarray((PMAX, D), dx_out.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=out[:p], data1=gr[:p], data2=xg[:p], op=nl.add, engine=nisa.gpsimd_engine)
        nisa.dma_copy(dst=dx_out[r0:r0 + p, :], src=out[:p])
        ring.append((t, d, g, xh, prod, xg, gr, out))
    dw = nl.ndarray((1, D), dw_out.dtype, buffer=nl.sbuf)
    for b, c0 in enumerate(range(0, D, PSUM_FP32)):
        cw = min(PSUM_FP32, D - c0)
        nisa.tensor_copy(dst=dw[:, c0:c0 + cw], src=banks[b][:, :cw])
    nisa.dma_copy(dst=dw_out, src=dw)
    nisa.memset(dst=dw, value=0.0)
    nisa.dma_copy(dst=db_out, src=dw)


@nki.jit
def layer_norm_bwd_kernel(dy, x, weight, eps=1e-5, rms=False, mean=None, rstd=None, epilogue=None,
                          then: Then | None = None):
    """Backward of layer norm (``rms``: RMS norm): returns (dx, dweight, dbias) (dbias zero for RMS).
    Given the forward's saved ``mean`` and ``rstd`` (N, 1) (RMS norm: ``rstd`` only), it uses them instead
    of recomputing the row statistics. ``epilogue`` (a matmul ``Epilogue`` over [N, D], single-pass layer norm
    only): dx goes through it block by block before its store and the first result is the epilogue's (the
    graph compiler's residual add of the gradient: no round trip of dx through HBM). ``then`` (a ``Then``, layer
    norm, where ``bwd_chains_product`` says so): also dx times a B2 [D, N2] (the gradient through the linear
    layer before the norm), from dx's blocks in SBUF; its [N, N2] result comes last."""
    N, D = x.shape
    extras = None if epilogue is None else len(epilogue.extras)
    assert epilogue is None or (not rms and bwd_fits(D, extras) and not epilogue.keep_product
                                and all(tuple(e.shape) == (N, D) for e in epilogue.extras)), \
        "layer_norm backward: an epilogue needs the single-pass layer norm and operands of dx's [N, D] shape"
    assert then is None or not rms, "layer_norm backward: a chained product follows layer norm's dx only"
    saved = None
    if mean is not None or rstd is not None:
        assert rstd is not None and (mean is None) == rms, \
            "layer_norm backward: saved stats are mean and rstd (RMS norm: rstd only)"
        assert tuple(rstd.shape) == (N, 1) and (mean is None or tuple(mean.shape) == (N, 1)), \
            f"layer_norm backward: stats are not ({N}, 1)"
        saved = (mean, rstd)
    dx_out = nl.ndarray((N, D), x.dtype if epilogue is None else epilogue.out_dtype, buffer=nl.shared_hbm)
    dw_out = nl.ndarray((1, D), weight.dtype, buffer=nl.shared_hbm)
    db_out = nl.ndarray((1, D), weight.dtype, buffer=nl.shared_hbm)
    if rms and saved and dy.dtype == x.dtype == weight.dtype and rms_bwd_fits(D, itemsize(x.dtype)):
        _rms_bwd_saved(dy, x, weight, dx_out, dw_out, db_out, saved[1])
        return dx_out, dw_out, db_out
    if not bwd_fits(D):
        _ln_bwd_long(dy, x, weight, dx_out, dw_out, db_out, eps, rms, saved)
        return dx_out, dw_out, db_out
    if then is not None:
        K2, N2 = then.b.shape[::-1] if then.transpose_b else then.b.shape
        extras2 = 0 if then.epilogue is None else len(then.epilogue.extras)
        assert K2 == D and bwd_chains_product(N, D, N2, extras, extras2, x.dtype, dx_out.dtype,
                                                          then.b.dtype), \
            f"layer_norm backward: no chained product for [{N}, {D}] rows then {tuple(then.b.shape)}"
        chained = ChainedProduct(then, D, N)
        _ln_bwd_grouped(dy, x, weight, dx_out, dw_out, db_out, eps, rms, saved, epilogue, chained)
        return dx_out, dw_out, db_out, chained.out
    if _bwd_takes_grouped(N, D, extras):
        _ln_bwd_grouped(dy, x, weight, dx_out, dw_out, db_out, eps, rms, saved, epilogue)
        return dx_out, dw_out, db_out
    check_sbuf((1 + (NBUF + 1) * 7) * D * 4 + 16 * D + _epilogue_bytes(extras, D), f"layer_norm backward D={D}")
    w = _row(weight, D)
    ones = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    acc = _col_sums(D, rms)
    ring = collections.deque(maxlen=NBUF)
    for r0 in range(0, N, PMAX):
        p = min(PMAX, N - r0)
        t = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        g = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:p], src=x[r0:r0 + p, :])
        nisa.dma_copy(dst=g[:p], src=dy[r0:r0 + p, :])
        xh = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        if saved:
            sc = nl.ndarray((PMAX, 2), nl.float32, buffer=nl.sbuf)
            _saved_stats(*saved, r0, p, sc)
            rs, nmr = sc[:, 0:1], sc[:, 1:2]
            nisa.activation(dst=xh[:p], op=nl.identity, data=t[:p], scale=rs[:p], bias=nmr[:p])
        elif rms:
            rs = _rms_stats(t, p, D, eps)
            nisa.activation(dst=xh[:p], op=nl.identity, data=t[:p], scale=rs[:p])
        else:
            rs, nmr, _ = _ln_stats(t, p, D, eps)
            nisa.activation(dst=xh[:p], op=nl.identity, data=t[:p], scale=rs[:p], bias=nmr[:p])
        # weight/bias gradients: column sums of dy * xhat and dy over the rows of this block
        prod = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[:p], data1=g[:p], data2=xh[:p], op=nl.multiply, engine=nisa.gpsimd_engine)
        _col_sum(acc["dw"], prod, p, D, ones, first=r0 == 0)
        if not rms:
            _col_sum(acc["db"], g, p, D, ones, first=r0 == 0)
        # dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)),  gw = dy * w
        gw = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gw[:p], data1=g[:p], data2=w[:p], op=nl.multiply)
        c2 = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
        junk = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=junk[:p], data1=gw[:p], data2=xh[:p], op=nl.multiply, engine=nisa.gpsimd_engine)
        nisa.tensor_reduce(dst=c2[:p], op=nl.add, data=junk[:p], axis=(1,))
        nisa.tensor_scalar(dst=c2[:p], data=c2[:p], op0=nl.multiply, operand0=1.0 / D)
        corr = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        if rms:
            nisa.activation(dst=corr[:p], op=nl.identity, data=xh[:p], scale=c2[:p])
        else:
            c1 = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=c1[:p], op=nl.add, data=gw[:p], axis=(1,))
            nisa.tensor_scalar(dst=c1[:p], data=c1[:p], op0=nl.multiply, operand0=1.0 / D)
            nisa.activation(dst=corr[:p], op=nl.identity, data=xh[:p], scale=c2[:p], bias=c1[:p])
        nisa.tensor_tensor(dst=gw[:p], data1=gw[:p], data2=corr[:p], op=nl.subtract)
        nisa.activation(dst=corr[:p], op=nl.identity, data=gw[:p], scale=rs[:p])
        _store_dx(dx_out, corr[:p], x.dtype, lambda t, r0=r0, p=p: t[r0:r0 + p, :], epilogue)
        ring.append((t, g, xh, prod, gw, corr, junk))
    _store_col_sums(acc, dw_out, db_out, D)
    return dx_out, dw_out, db_out


def _epilogue_bytes(extras: int | None, f: int) -> int:
    """SBUF bytes per partition of the tiles ``_store_dx`` allocates per block of ``f`` elements for an epilogue of
    ``extras`` operands (None: no epilogue): dx rounded, dx widened, each operand, one spare (next-fit allocation
    rotates through them)."""
    return 0 if extras is None else (3 + extras) * f * 4


def _store_dx(dx_out, dx, dtype, at, epilogue: Epilogue | None):
    """Store a block ``dx`` [p, f] (fp32) of the input gradient at ``at(dx_out)``, or through ``epilogue``: dx is
    rounded to ``dtype`` first, as the separate pass the epilogue replaces would read it from HBM; returns the
    SBUF tile stored."""
    if epilogue is None:
        nisa.dma_copy(dst=at(dx_out), src=dx)
        return dx
    p, f = dx.shape
    if dtype != nl.float32:
        low = nl.ndarray((p, f), dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=low, src=dx)
        dx = low
    return _store_block(dx_out, dx, p, f, at, epilogue)


def _rows(x):
    x = as_tensor(x)
    return x.reshape(-1, x.shape[-1])


def layer_norm(x, weight, bias, eps: float = 1e-5):
    """``torch.nn.functional.layer_norm(x, (D,), weight, bias, eps)`` through the simulator."""
    x = as_tensor(x)
    return layer_norm_kernel(_rows(x), as_tensor(weight), as_tensor(bias), eps=eps).reshape(x.shape)


def rms_norm(x, weight, eps: float = 1e-6):
    """``torch.nn.functional.rms_norm(x, (D,), weight, eps)`` through the simulator."""
    x = as_tensor(x)
    w = as_tensor(weight)
    return layer_norm_kernel(_rows(x), w, w, eps=eps, rms=True).reshape(x.shape)


def layer_norm_backward(dy, x, weight, eps: float = 1e-5):
    """(dx, dweight, dbias) of layer norm."""
    x = as_tensor(x)
    dx, dw, db = layer_norm_bwd_kernel(_rows(dy), _rows(x), as_tensor(weight), eps=eps)
    return dx.reshape(x.shape), dw.reshape(-1), db.reshape(-1)


def rms_norm_backward(dy, x, weight, eps: float = 1e-6):
    """(dx, dweight) of RMS norm."""
    x = as_tensor(x)
    dx, dw, _ = layer_norm_bwd_kernel(_rows(dy), _rows(x), as_tensor(weight), eps=eps, rms=True)
    return dx.reshape(x.shape), dw.reshape(-1)
