"""Legacy ``mask=`` predicates that are not boxes (a ragged flattened tail, triangles) and ``mask=`` on
matmul/transpose, against NumPy."""
from __future__ import annotations

import numpy as np
import pytest

from torchneuron.nki import legacy as nki
from torchneuron.nki.legacy import isa as nisa, language as nl

RNG = np.random.default_rng(3)


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@nki.jit
def flat_scale_kernel(a, f):
    """out = 2 * a for a 1-D ``a`` viewed as rows of ``f``: the last row is ragged (a mask that is two boxes;
    its bounding box would reach past the end of ``a``)."""
    n = a.shape[0]
    out = nl.ndarray((n,), dtype=a.dtype, buffer=nl.shared_hbm)
    i_p, i_f = nl.arange(128)[:, None], nl.arange(f)[None, :]
    m = i_p * f + i_f < n
    t = nl.load(a[i_p * f + i_f], mask=m)
    nl.store(out[i_p * f + i_f], value=nl.multiply(t, 2.0, mask=m), mask=m)
    return out


@pytest.mark.parametrize("n", [1000, 1024, 17])
def test_ragged_flattened_tail(n):
    a = randn(n)
    np.testing.assert_allclose(flat_scale_kernel(a, 8), 2 * a, rtol=1e-6)


@nki.jit
def triangle_reduce_kernel(x):
    """Row-wise max and sum over the lower triangle (j <= i) of a square tile, by nl and by nisa."""
    n = x.shape[0]
    out = nl.ndarray((n, 3), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    i_p, i_f = nl.arange(n)[:, None], nl.arange(n)[None, :]
    low = i_f <= i_p
    nl.store(out[i_p, nl.arange(1)[None, :]], value=nl.max(t[i_p, i_f], axis=1, keepdims=True, mask=low))
    nl.store(out[i_p, 1 + nl.arange(1)[None, :]], value=nl.sum(t[i_p, i_f], axis=1, keepdims=True, mask=low))
    nl.store(out[i_p, 2 + nl.arange(1)[None, :]], value=nisa.tensor_reduce(np.min, t[i_p, i_f], axis=1,
                                                                           keepdims=True, mask=low))
    return out


def test_triangular_mask_reductions():
    x = randn(64, 64)
    low = np.tril(np.ones((64, 64), bool))
    out = triangle_reduce_kernel(x)
    np.testing.assert_allclose(out[:, 0], np.where(low, x, -np.inf).max(1), rtol=1e-6)
    np.testing.assert_allclose(out[:, 1], np.where(low, x, 0).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 2], np.where(low, x, np.inf).min(1), rtol=1e-6)


@nki.jit
def triangle_store_kernel(x):
    """out = lower triangle of x (the store writes only the masked elements; the rest stays zero)."""
    n = x.shape[0]
    out = nl.ndarray((n, n), dtype=x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.zeros((n, n), dtype=x.dtype))
    i_p, i_f = nl.arange(n)[:, None], nl.arange(n)[None, :]
    nl.store(out[i_p, i_f], value=nl.load(x), mask=(i_f <= i_p))
    return out


def test_triangular_masked_store_writes_only_the_triangle():
    x = randn(32, 32)
    np.testing.assert_array_equal(triangle_store_kernel(x), np.tril(x))


@nki.jit
def masked_contraction_kernel(a, b, k):
    """a[:k].T @ b[:k] from 128-row tiles whose rows k.. hold garbage: mask= narrows the contraction."""
    m, n = a.shape[1], b.shape[1]
    out = nl.ndarray((2, m, n), dtype=nl.float32, buffer=nl.shared_hbm)
    at, bt = nl.load(a), nl.load(b)
    i_k, i_m, i_n = nl.arange(128)[:, None], nl.arange(m)[None, :], nl.arange(n)[None, :]
    valid = i_k < k
    nl.store(out[0], value=nisa.nc_matmul(at[i_k, i_m], bt[i_k, i_n], mask=valid))
    acc = nl.zeros((m, n), dtype=nl.float32, buffer=nl.psum)
    acc += nisa.nc_matmul(at[i_k, i_m], bt[i_k, i_n], mask=valid)
    nl.store(out[1], value=nl.add(nl.matmul(at, bt, transpose_x=True, mask=valid), nl.copy(acc)))
    return out


def test_mask_narrows_matmul_contraction():
    a, b = randn(128, 64), randn(128, 96)
    a[100:], b[100:] = 1e30, np.nan                       # what the mask must keep out
    out = masked_contraction_kernel(a, b, 100)
    ref = a[:100].T @ b[:100]
    np.testing.assert_allclose(out[0], ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(out[1], 2 * ref, rtol=1e-4, atol=1e-3)


@nki.jit
def masked_transpose_kernel(x):
    out = nl.ndarray((x.shape[1], x.shape[0]), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p, i_f = nl.arange(x.shape[0])[:, None], nl.arange(x.shape[1])[None, :]
    t = nl.load(x)
    tt = nisa.nc_transpose(t, mask=(i_p < x.shape[0]) & (i_f < x.shape[1]))
    nl.store(out, value=nl.transpose(nl.transpose(tt, mask=(i_p < 64)), mask=(i_p < 64)))
    return out


def test_transpose_accepts_a_mask():
    x = randn(64, 48)
    np.testing.assert_array_equal(masked_transpose_kernel(x), x.T)


def test_bad_masks_raise_clearly():
    @nki.jit
    def mean_triangle(x):
        out = nl.ndarray((x.shape[0], 1), dtype=x.dtype, buffer=nl.shared_hbm)
        i_p, i_f = nl.arange(x.shape[0])[:, None], nl.arange(x.shape[1])[None, :]
        nl.store(out, value=nl.mean(nl.load(x), axis=1, keepdims=True, mask=(i_f <= i_p)))
        return out

    with pytest.raises(NotImplementedError, match="nl.mean with a mask that is not a box"):
        mean_triangle(randn(8, 8))

    @nki.jit
    def ragged_contraction(a, b):
        out = nl.ndarray((a.shape[1], b.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
        i_k, i_m = nl.arange(128)[:, None], nl.arange(a.shape[1])[None, :]
        i_n = nl.arange(b.shape[1])[None, :]
        nl.store(out, value=nisa.nc_matmul(nl.load(a)[i_k, i_m], nl.load(b)[i_k, i_n], mask=(i_k < i_m)))
        return out

    with pytest.raises(NotImplementedError, match="one contraction .*range for every output element"):
        ragged_contraction(randn(128, 64), randn(128, 64))

    @nki.jit
    def not_a_predicate(x):
        nl.load(x, mask=x)
        return x

    with pytest.raises(TypeError, match="mask= takes a comparison"):
        not_a_predicate(randn(4, 4))
