"""NKI kernels in the current style (dst= ISA calls), used by the tests."""
from __future__ import annotations

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl


@nki.jit
def tensor_add(a, b):
    """out = a + b, tile by tile (128 x 512)."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    P, F = nl.tile_size.pmax, 512
    for i in nl.affine_range(a.shape[0] // P):
        for j in nl.affine_range(a.shape[1] // F):
            rows, cols = slice(i * P, (i + 1) * P), nl.ds(j * F, F)
            x = nl.ndarray((P, F), a.dtype, buffer=nl.sbuf)
            y = nl.ndarray((P, F), b.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x, src=a[rows, cols])
            nisa.dma_copy(dst=y, src=b[rows, cols])
            z = nl.ndarray((P, F), a.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=z, data1=x, data2=y, op=nl.add)
            nisa.dma_copy(dst=out[rows, cols], src=z)
    return out


@nki.jit
def matmul(lhsT, rhs):
    """out[M, N] = lhsT[K, M].T @ rhs[K, N]: K accumulated in PSUM, evicted with tensor_copy."""
    K, M = lhsT.shape
    _, N = rhs.shape
    TK, TM, TN = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    assert K % TK == 0 and M % TM == 0 and N % TN == 0, "shapes must be whole tiles"
    out = nl.ndarray((M, N), rhs.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TM):
        for n in nl.affine_range(N // TN):
            acc = nl.ndarray((TM, TN), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TK):
                a = nl.ndarray((TK, TM), lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TK, TN), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)  # first k overwrites, the rest accumulate
            res = nl.ndarray((TM, TN), out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=res)
    return out


@nki.jit
def softmax(x):
    """Row softmax: exp(x - max) with the row sum fused into the activation."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    for i in nl.affine_range(x.shape[0] // P):
        t = nl.load(x[i * P:(i + 1) * P, :])
        neg_max = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=t, axis=(1,), negate=True)
        e = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=t, bias=neg_max, reduce_op=nl.add, reduce_res=s,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        y = nl.multiply(e, nl.reciprocal(s), dtype=x.dtype)
        nl.store(out[i * P:(i + 1) * P, :], y)
    return out


@nki.jit
def layernorm(x, gamma, beta, eps=1e-5):
    """Layer norm over rows with nl convenience ops; gamma/beta (D,) broadcast over partitions by DMA."""
    N, D = x.shape
    P = nl.tile_size.pmax
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    g = nl.load(gamma.broadcast_to((P, D)))
    b = nl.load(beta.broadcast_to((P, D)))
    for i in nl.affine_range(N // P):
        t = nl.load(x[i * P:(i + 1) * P, :], dtype=nl.float32)
        mu = nl.mean(t, axis=1, keepdims=True)
        xc = nl.subtract(t, mu)
        var = nl.mean(nl.square(xc), axis=1, keepdims=True)
        rstd = nl.rsqrt(var + eps)
        y = xc * rstd * g + b
        nl.store(out[i * P:(i + 1) * P, :], y)
    return out


@nki.jit
def layernorm_bn(x):
    """Layer norm without affine via bn_stats/bn_aggr and one fused tensor_scalar."""
    N, D = x.shape
    P = nl.tile_size.pmax
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(N // P):
        t = nl.load(x[i * P:(i + 1) * P, :])
        stats = nl.ndarray((P, 6), nl.float32)
        nisa.bn_stats(dst=stats, data=t)
        mv = nl.ndarray((P, 2), nl.float32)
        nisa.bn_aggr(dst=mv, data=stats)
        rstd = nl.ndarray((P, 1), nl.float32)
        nisa.tensor_scalar(dst=rstd, data=mv[:, 1:2], op0=nl.add, operand0=1e-5, op1="rsqrt")
        y = nl.ndarray(t.shape, x.dtype)
        nisa.tensor_scalar(dst=y, data=t, op0=nl.subtract, operand0=mv[:, 0:1], op1=nl.multiply, operand1=rstd)
        nl.store(out[i * P:(i + 1) * P, :], y)
    return out


@nki.jit
def spmd_scale(x, factor):
    """Each SPMD instance scales its block of rows: x[pid] * factor."""
    pid, n = nl.program_id(0), nl.num_programs(0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    rows = x.shape[0] // n
    t = nl.load(x[pid * rows:(pid + 1) * rows, :])
    nl.store(out[pid * rows:(pid + 1) * rows, :], nl.multiply(t, factor))
    return out
