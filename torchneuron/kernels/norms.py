"""Layer norm and RMS norm over the last dim, forward and backward (row-wise, with weight/bias).

One row per partition, blocks of 128 rows, the whole row [128, D] in SBUF (fp32):

    layer norm fwd:  bn_stats per 512 columns + bn_aggr -> mean, var      VectorE
                     rstd = (var + eps) ** -0.5                            VectorE (one tensor_scalar)
                     xhat = x * rstd + (-mean * rstd)                      ScalarE (activation scale/bias)
                     y = xhat * w + b                                      GpSimd (two tensor_tensor)
                     (VectorE stays free for the next block's statistics: no in-order stall)
    rms norm fwd:    ss = sum(x^2) fused into a ScalarE activation, rstd = (ss/D + eps) ** -0.5,
                     y = x * rstd (ScalarE), y *= w (VectorE)
    backward:        recompute the statistics, then
                     dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * w   (layer norm)
                     dx = rstd * (g - xhat * mean(g * xhat))                           (rms norm)
                     dw = sum_rows(dy * xhat), db = sum_rows(dy): cross-partition sums on TensorE
                     (ones[rows, 1]^T @ tile, 512 columns per PSUM bank), accumulated in SBUF fp32.

Weight and bias rows are DMA-broadcast to all 128 partitions once. The tiles of the last NBUF
blocks stay alive so DMA and the three engines overlap. Limits: D fp32 x (tiles) x NBUF in SBUF
(D <= ~4700 forward, ~1700 backward on trn2); bn_stats chunks of <= 512 (nl.tile_size.bn_stats_fmax).
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, PSUM_FP32, as_tensor, cdiv, check_sbuf

NBUF = 3
BN = 512   # nl.tile_size.bn_stats_fmax


def _row(v, D):
    """A (D,) HBM vector broadcast over the 128 partitions, in fp32 SBUF."""
    t = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=v.reshape((1, D)).broadcast_to((PMAX, D)))
    return t


def _ln_stats(t, p, D, eps):
    """(rstd, -mean*rstd) columns of the rows of t[:p]: bn_stats/bn_aggr on VectorE."""
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
    return rstd, nmr


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


@nki.jit
def layer_norm_kernel(x, weight, bias, eps=1e-5, rms=False):
    """Forward layer norm (``rms``: RMS norm, ``bias`` ignored) of the rows of [N, D]."""
    N, D = x.shape
    check_sbuf((2 + (NBUF + 1) * 2) * D * 4 + 8 * D, f"layer_norm D={D}")
    out = nl.ndarray((N, D), x.dtype, buffer=nl.shared_hbm)
    w = _row(weight, D)
    b = None if rms else _row(bias, D)
    ring = collections.deque(maxlen=NBUF)
    for r0 in range(0, N, PMAX):
        p = min(PMAX, N - r0)
        t = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:p], src=x[r0:r0 + p, :])
        y = xh = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)     # xhat, then y in place
        if rms:
            rstd = _rms_stats(t, p, D, eps)
            nisa.activation(dst=xh[:p], op=nl.identity, data=t[:p], scale=rstd[:p])
            nisa.tensor_tensor(dst=y[:p], data1=xh[:p], data2=w[:p], op=nl.multiply)
        else:
            rstd, nmr = _ln_stats(t, p, D, eps)
            nisa.activation(dst=xh[:p], op=nl.identity, data=t[:p], scale=rstd[:p], bias=nmr[:p])
            nisa.tensor_tensor(dst=y[:p], data1=xh[:p], data2=w[:p], op=nl.multiply, engine=nisa.gpsimd_engine)
            nisa.tensor_tensor(dst=y[:p], data1=y[:p], data2=b[:p], op=nl.add, engine=nisa.gpsimd_engine)
        nisa.dma_copy(dst=out[r0:r0 + p, :], src=y[:p])
        ring.append((t, y))
    return out


def _col_sum(acc, src, p, D, ones):
    """acc[0, :] += sum over partitions of src[:p, :], on TensorE (ones^T @ src), 512 columns per bank."""
    for c0 in range(0, D, PSUM_FP32):
        w = min(PSUM_FP32, D - c0)
        ps = nl.ndarray((1, PSUM_FP32), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps[:, :w], stationary=ones[:p, :], moving=src[:p, c0:c0 + w], accumulate=False)
        nisa.tensor_tensor(dst=acc[:, c0:c0 + w], data1=acc[:, c0:c0 + w], data2=ps[:, :w], op=nl.add)


@nki.jit
def layer_norm_bwd_kernel(dy, x, weight, eps=1e-5, rms=False):
    """Backward of layer norm (``rms``: RMS norm): returns (dx, dweight, dbias) (dbias zero for RMS)."""
    N, D = x.shape
    check_sbuf((1 + (NBUF + 1) * 7) * D * 4 + 16 * D, f"layer_norm backward D={D}")
    dx_out = nl.ndarray((N, D), x.dtype, buffer=nl.shared_hbm)
    dw_out = nl.ndarray((1, D), weight.dtype, buffer=nl.shared_hbm)
    db_out = nl.ndarray((1, D), weight.dtype, buffer=nl.shared_hbm)
    w = _row(weight, D)
    ones = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    dw = nl.ndarray((1, D), nl.float32, buffer=nl.sbuf)
    db = nl.ndarray((1, D), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=dw, value=0.0)
    nisa.memset(dst=db, value=0.0)
    ring = collections.deque(maxlen=NBUF)
    for r0 in range(0, N, PMAX):
        p = min(PMAX, N - r0)
        t = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        g = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:p], src=x[r0:r0 + p, :])
        nisa.dma_copy(dst=g[:p], src=dy[r0:r0 + p, :])
        xh = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        if rms:
            rstd = _rms_stats(t, p, D, eps)
            nisa.activation(dst=xh[:p], op=nl.identity, data=t[:p], scale=rstd[:p])
        else:
            rstd, nmr = _ln_stats(t, p, D, eps)
            nisa.activation(dst=xh[:p], op=nl.identity, data=t[:p], scale=rstd[:p], bias=nmr[:p])
        # weight/bias gradients: column sums of dy * xhat and dy over the rows of this block
        prod = nl.ndarray((PMAX, D), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[:p], data1=g[:p], data2=xh[:p], op=nl.multiply, engine=nisa.gpsimd_engine)
        _col_sum(dw, prod, p, D, ones)
        if not rms:
            _col_sum(db, g, p, D, ones)
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
        nisa.activation(dst=corr[:p], op=nl.identity, data=gw[:p], scale=rstd[:p])
        nisa.dma_copy(dst=dx_out[r0:r0 + p, :], src=corr[:p])
        ring.append((t, g, xh, prod, gw, corr, junk))
    nisa.dma_copy(dst=dw_out, src=dw)
    nisa.dma_copy(dst=db_out, src=db)
    return dx_out, dw_out, db_out


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
