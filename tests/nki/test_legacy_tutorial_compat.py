"""Legacy (neuronxcc.nki) features the public tutorial kernels rely on, as our own small kernels:
reductions over non-trailing free axes of an index-vector view, ``A[rows, j]`` column loads, PSUM tiles
fed to ``nl.store`` / ``nl.matmul`` / ``nl.transpose`` (the compiler's implicit eviction), and
``nki.compiler.sbuf/psum.mod_alloc`` placement hints."""
from __future__ import annotations

import numpy as np
import pytest

from torchneuron.nki import legacy as nki
from torchneuron.nki.legacy import isa as nisa, language as nl

RNG = np.random.default_rng(7)


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@nki.jit
def window_max_kernel(x, k):
    """out[c, j] = max over all rows h and the k columns of window j of x[c, h, :]."""
    c, h, w = x.shape
    out = nl.ndarray((c, w // k), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    i0, i1, i2, i3 = nl.mgrid[0:c, 0:h, 0:w // k, 0:k]
    r = nl.max(t[i0, i1, k * i2 + i3], axis=[1, 3])   # axes 1 and 3: not the trailing ones
    nl.store(out, value=r)
    return out


@pytest.mark.parametrize("k", [2, 4])
def test_reduce_over_non_trailing_axes_of_index_view(k):
    x = randn(16, 3, 8 * k)
    ref = x.reshape(16, 3, 8, k).max(axis=(1, 3))
    np.testing.assert_array_equal(window_max_kernel(x, k), ref)


@nki.jit
def strided_row_sum_kernel(x):
    """out[p, j] = sum_i x[p, 4*i + j]: reduce the outer (non-trailing) axis of a permuted view."""
    p, f = x.shape
    out = nl.ndarray((p, 4), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    ip, ii, ij = nl.mgrid[0:p, 0:f // 4, 0:4]
    nl.store(out, value=nl.sum(t[ip, 4 * ii + ij], axis=1))
    return out


def test_sum_over_middle_axis():
    x = randn(64, 32)
    np.testing.assert_allclose(strided_row_sum_kernel(x), x.reshape(64, 8, 4).sum(1), rtol=1e-5, atol=1e-5)


@nki.jit
def exp_scaled_by_column_kernel(x, s, j):
    """out = exp(x * s[:, j]) with the per-row scale loaded as a (128, 1) column."""
    n, f = x.shape
    out = nl.ndarray((n, f), dtype=x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(n // 128):
        col = nl.load(s[i * 128:(i + 1) * 128, j])
        assert tuple(col.shape) == (128, 1), col.shape
        xt = nl.load(x[i * 128:(i + 1) * 128, 0:f])
        nl.store(out[i * 128:(i + 1) * 128, 0:f], value=nisa.activation(op=nl.exp, data=xt, scale=col))
    return out


def test_integer_index_on_last_dim_loads_a_column():
    x, s = randn(256, 64) * 0.5, randn(256, 5) * 0.5
    np.testing.assert_allclose(exp_scaled_by_column_kernel(x, s, 3), np.exp(x * s[:, 3:4]), rtol=1e-4, atol=1e-5)


@nki.jit
def psum_operands_kernel(a, b):
    """Two outputs straight from PSUM tiles: a.T @ b (stored from PSUM) and a @ b (nl.transpose result,
    itself in PSUM, used as a matmul operand)."""
    out1 = nl.ndarray((a.shape[1], b.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    out2 = nl.ndarray((a.shape[0], b.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    a_sb, b_sb = nl.load(a), nl.load(b)
    nl.store(out1, value=nl.matmul(a_sb, b_sb, transpose_x=True))
    a_t = nl.transpose(a_sb)                                  # PSUM
    nl.store(out2, value=nl.matmul(a_t, b_sb, transpose_x=True))
    return out1, out2


def test_psum_tiles_to_store_and_matmul():
    a, b = randn(128, 128), randn(128, 256)
    o1, o2 = psum_operands_kernel(a, b)
    np.testing.assert_allclose(o1, a.T @ b, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(o2, a @ b, rtol=1e-4, atol=1e-3)
    ops = [i.opcode for i in nki.profile(psum_operands_kernel)(a, b).program.instructions]
    assert ops.count("tensor_copy") >= 2  # the evictions are real instructions (timed)


@nki.jit
def placed_double_kernel(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nki.compiler.sbuf.mod_alloc(base_addr=0, num_free_tiles=(1,)))
    t[...] = nl.load(x)
    acc = nl.zeros(x.shape, dtype=nl.float32, buffer=nki.compiler.psum.mod_alloc(base_bank=0))
    nl.store(out, value=nl.add(t, t))
    assert acc.buffer is nl.psum and t.buffer is nl.sbuf
    return out


def test_compiler_mod_alloc_placement_hints():
    x = randn(128, 32)
    np.testing.assert_allclose(placed_double_kernel(x), 2 * x, rtol=1e-6)


@nki.jit
def transposed_bf16_load_kernel(x):
    """out = x.T, loaded transposed by DMA into a bf16 tile (the cast happens on chip)."""
    out = nl.ndarray((x.shape[1], x.shape[0]), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.load_transpose2d(x, dtype=nl.bfloat16)
    assert t.dtype == nl.bfloat16
    nl.store(out, value=nl.copy(t, dtype=nl.float32))
    return out


def test_load_transpose2d_with_dtype():
    x = randn(96, 64)
    expect = x.T.astype(np.float32)
    np.testing.assert_allclose(transposed_bf16_load_kernel(x), expect, rtol=1e-2, atol=1e-2)


@nki.jit
def _scale_rows_into(x_tile, s_tile, dst):
    """A helper kernel that writes into a tile its caller allocated."""
    dst[...] = nl.multiply(x_tile, s_tile)


@nki.jit
def calls_helper_kernel(x, s):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    i = nl.program_id(0)
    xt = nl.load(x[i * 128:(i + 1) * 128, :])
    st = nl.load(s[i * 128:(i + 1) * 128, :])
    res = nl.ndarray(xt.shape, dtype=xt.dtype, buffer=nl.sbuf)
    _scale_rows_into(xt, st, res)          # an @nki.jit function called inside a kernel runs inline
    nl.store(out[i * 128:(i + 1) * 128, :], value=res)
    return out


def test_jit_kernel_called_from_a_kernel_inlines():
    x, s = randn(256, 48), randn(256, 48)
    np.testing.assert_allclose(calls_helper_kernel[2](x, s), x * s, rtol=1e-6)
    assert calls_helper_kernel[2].cache  # traced once as one program (the helper left no program of its own)
    assert not _scale_rows_into.cache
