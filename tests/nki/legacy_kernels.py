"""Earlier-generation (neuronxcc.nki-style) kernels for the tests.

Written against whatever ``nki``/``nl``/``nisa`` the caller installs with ``bind``: either
``torchneuron.nki.legacy`` directly or ``from neuronxcc import nki`` after ``install_import_aliases()``.
"""
from __future__ import annotations

import numpy as np


def build(nki, nl, nisa):
    """The kernels, decorated with the given ``nki.jit``."""

    @nki.jit
    def tensor_add(a, b):
        """a + b with arange indexing; the last row tile is ragged (masked)."""
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        rows, cols = a.shape
        i_p = nl.arange(128)[:, None]
        i_f = nl.arange(cols)[None, :]
        for i in nl.affine_range((rows + 127) // 128):
            m = i * 128 + i_p < rows
            x = nl.load(a[i * 128 + i_p, i_f], mask=m)
            y = nl.load(b[i * 128 + i_p, i_f], mask=m)
            nl.store(out[i * 128 + i_p, i_f], value=x + y, mask=m)
        return out

    @nki.jit
    def matmul(lhsT, rhs):
        """lhsT[K, M].T @ rhs[K, N]: nc_matmul results += into an nl.zeros PSUM tile."""
        K, M = lhsT.shape
        _, N = rhs.shape
        TK, TM, TN = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
        out = nl.ndarray((M, N), dtype=rhs.dtype, buffer=nl.shared_hbm)
        i_k = nl.arange(TK)[:, None]
        i_m = nl.arange(TM)[None, :]
        i_n = nl.arange(TN)[None, :]
        i_mp = nl.arange(TM)[:, None]
        for m in nl.affine_range(M // TM):
            for n in nl.affine_range(N // TN):
                acc = nl.zeros((TM, TN), nl.float32, buffer=nl.psum)
                for k in nl.affine_range(K // TK):
                    a = nl.load(lhsT[k * TK + i_k, m * TM + i_m])
                    b = nl.load(rhs[k * TK + i_k, n * TN + i_n])
                    acc += nisa.nc_matmul(a[i_k, i_m], b[i_k, i_n])
                res = nl.copy(acc, dtype=out.dtype)
                nl.store(out[m * TM + i_mp, n * TN + i_n], value=res[i_mp, i_n])
        return out

    @nki.jit
    def matmul_blocks(lhsT, rhs):
        """Same product with par_dim block tiles, psum[...] += and nl.matmul(transpose_x=True)."""
        K, M = lhsT.shape
        _, N = rhs.shape
        KT = K // 128
        out = nl.ndarray((M, N), dtype=np.float32, buffer=nl.shared_hbm)
        a = nl.ndarray((KT, nl.par_dim(128), M), dtype=lhsT.dtype, buffer=nl.sbuf)
        b = nl.ndarray((KT, nl.par_dim(128), N), dtype=rhs.dtype, buffer=nl.sbuf)
        for k in nl.affine_range(KT):
            a[k] = nl.load(lhsT[k * 128:(k + 1) * 128, :])
            b[k, :, :] = nl.load(rhs[k * 128:(k + 1) * 128, :])
        acc = nl.zeros((M, N), np.float32, buffer=nl.psum)
        acc2 = nl.ndarray((M, N), np.float32, buffer=nl.psum)
        for k in nl.sequential_range(KT):
            acc[...] += nisa.nc_matmul(a[k], b[k])
        acc2[...] = nl.matmul(a[0], b[0], transpose_x=True)
        nl.store(out, value=nl.subtract(nl.copy(acc), nl.copy(acc2)))
        return out

    @nki.jit
    def softmax(x):
        """Row softmax with masks on a ragged row count (np ufunc ops, value-returning ISA calls)."""
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        rows, cols = x.shape
        ix = nl.arange(128)[:, None]
        iy = nl.arange(cols)[None, :]
        for i in nl.affine_range((rows + 127) // 128):
            m = i * 128 + ix < rows
            t = nl.load(x[i * 128 + ix, iy], mask=m)
            neg_max = nisa.tensor_reduce(np.max, t, axis=(1,), negate=True, mask=m)
            s = nl.ndarray((128, 1), dtype=np.float32)
            e = nisa.activation(np.exp, t, bias=neg_max, reduce_op=np.add, reduce_res=s, mask=m)
            y = nl.multiply(e, nisa.reciprocal(s, mask=m), mask=m)
            nl.store(out[i * 128 + ix, iy], value=y, mask=m)
        return out

    @nki.jit
    def layernorm(x, gamma, beta, eps=1e-5):
        """Layer norm: nl ops with masks (v1 style) and bn_stats/bn_aggr + tensor_scalar (v2 style)."""
        out1 = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        out2 = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        rows, d = x.shape
        P = nl.tile_size.pmax
        g = nl.load(gamma.reshape((1, d))).broadcast_to((P, d))
        b = nl.load(beta.reshape((1, d))).broadcast_to((P, d))
        i_p = nl.arange(P)[:, None]
        i_f = nl.arange(d)[None, :]
        for i in nl.affine_range((rows + P - 1) // P):
            m = i * P + i_p < rows
            t = nl.load(x[i * P + i_p, i_f], mask=m)
            mu = nl.mean(t, axis=[1], keepdims=True, mask=m)
            xc = nl.subtract(t, mu, mask=m)
            var = nl.mean(nl.square(xc, mask=m), axis=[1], keepdims=True, mask=m)
            rstd = nl.rsqrt(var + eps, mask=m)
            y = nl.add(nl.multiply(xc * rstd, g, mask=m), b, mask=m)
            nl.store(out1[i * P + i_p, i_f], value=y, mask=m)
            stats = nisa.bn_stats(t[i_p, i_f], mask=m, dtype=np.float32)
            mv = nisa.bn_aggr(stats, mask=m)
            r = nisa.tensor_scalar(mv[i_p, 1 + nl.arange(1)[None, :]], np.add, eps, op1="rsqrt", mask=m)
            z = nisa.tensor_scalar(t, op0=np.subtract, operand0=mv[i_p, nl.arange(1)[None, :]],
                                   op1=np.multiply, operand1=r, mask=m)
            nl.store(out2[i * P + i_p, i_f], value=z * g + b, mask=m)
        return out1, out2

    @nki.jit
    def spmd_add(a, b):
        """2-D SPMD grid: instance (x, y) adds the (128 x 256) tile at row block x, column block y."""
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        px, py = nl.program_id(0), nl.program_id(axis=1)
        th = a.shape[0] // nl.num_programs(0)
        tw = a.shape[1] // nl.num_programs(axes=1)
        i = nl.mgrid[0:th, 0:tw]
        rows, cols = px * th + i.p, py * tw + i.x
        t = nisa.tensor_tensor(nl.load(a[rows, cols]), nl.load(b[rows, cols]), op=np.add)
        nl.store(out[rows, cols], value=t)
        return out

    return dict(tensor_add=tensor_add, matmul=matmul, matmul_blocks=matmul_blocks, softmax=softmax,
                layernorm=layernorm, spmd_add=spmd_add)
