"""NKI safety: out-of-bounds indexing is an error naming the dim, the index and the bound (never NumPy's
clamping), index-vector accesses are checked per dim, a kernel that forgets to return its output warns,
language ops legalize two PSUM operands, and ``nki.typing`` exists."""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest

from torchneuron import nki
from torchneuron.nki import legacy
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.nki.legacy import language as lnl
from torchneuron.nki.tracing import IndexOutOfBounds
from torchneuron.sim import SimulatorError

RNG = np.random.default_rng(11)


def test_slice_past_the_rows_is_an_error_not_a_clamp():
    @nki.jit
    def k(a):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), nl.float32)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=out[64:192, :], src=t[0:128, :])  # 64 rows past the end
        return out

    with pytest.raises(IndexOutOfBounds, match=r"slice 64:192 of dim 0 is out of bounds for size 128"):
        k(np.zeros((128, 64), np.float32))


@pytest.mark.parametrize("index,msg", [
    ((slice(0, 129), slice(None)), r"slice 0:129 of dim 0 is out of bounds for size 128"),
    ((slice(None), slice(10, 70)), r"slice 10:70 of dim 1 is out of bounds for size 64"),
    ((5, 64), r"index 64 of dim 1 is out of bounds for size 64"),
    ((-129, 0), r"index -129 of dim 0 is out of bounds for size 128"),
    ((slice(128, None),), r"slice 128: of dim 0 is out of bounds for size 128"),
])
def test_on_chip_and_hbm_indices_are_bounds_checked(index, msg):
    @nki.jit
    def k(a):
        t = nl.ndarray((128, 64), nl.float32)
        with pytest.raises(IndexOutOfBounds, match=msg):
            t[index]
        with pytest.raises(IndexOutOfBounds, match=msg):
            a[index]
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=t, src=a[-128:, :])  # in-range negative indices keep working
        nisa.dma_copy(dst=out, src=t)
        return out

    a = RNG.standard_normal((128, 64)).astype(np.float32)
    np.testing.assert_array_equal(k(a), a)


def test_legacy_index_vectors_are_checked_per_dim():
    @legacy.jit
    def k(a):
        out = lnl.ndarray((128, 64), lnl.float32, buffer=lnl.shared_hbm)
        i_p, i_f = lnl.arange(128)[:, None], lnl.arange(64)[None, :]
        x = lnl.load(a[i_p, 10 + i_f])  # columns 10..73 of a 64-column tensor: would read the next row
        lnl.store(out[i_p, i_f], value=x)
        return out

    with pytest.raises(IndexOutOfBounds, match=r"of dim 1 takes values \[10, 73\], out of bounds for size 64"):
        k(np.zeros((128, 64), np.float32))


def test_legacy_mask_confines_an_index_vector_access():
    @legacy.jit
    def k(a):
        out = lnl.ndarray((128, 64), lnl.float32, buffer=lnl.shared_hbm)
        i_p, i_f = lnl.arange(128)[:, None], lnl.arange(64)[None, :]
        x = lnl.load(a[i_p, 10 + i_f], mask=(10 + i_f < 64))  # elements the mask leaves out are undefined
        lnl.store(out[i_p, i_f], value=x, mask=(10 + i_f < 64))
        return out

    a = RNG.standard_normal((128, 64)).astype(np.float32)
    np.testing.assert_array_equal(k(a)[:, :54], a[:, 10:])


def test_a_kernel_that_forgets_to_return_its_output_warns():
    @nki.jit
    def forgot(a):
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a))

    @nki.jit
    def in_place(a):
        nl.store(a, nl.exp(nl.load(a)))

    with pytest.warns(UserWarning, match=r"'forgot' returns nothing, but it writes the nl.shared_hbm tensor"):
        forgot(np.ones((4, 4), np.float32))
    x = np.zeros((4, 4), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        in_place(x)
    np.testing.assert_array_equal(x, np.ones((4, 4), np.float32))


def test_language_ops_legalize_two_psum_operands():
    @nki.jit
    def k(a, b):
        out = nl.ndarray((128, 128), nl.float32, buffer=nl.shared_hbm)
        x, y = nl.load(a), nl.load(b)
        p1, p2 = nl.matmul(x, y, transpose_x=True), nl.matmul(y, x, transpose_x=True)  # both in PSUM
        nl.store(out, nl.add(p1, p2))
        return out

    a, b = RNG.standard_normal((128, 128)).astype(np.float32), RNG.standard_normal((128, 128)).astype(np.float32)
    # fp32 matmuls: 128-term dot products, rounding relative to the sum of |terms|
    bound = 2 * 128 * 2.0 ** -23 * (np.abs(a).T @ np.abs(b) + np.abs(b).T @ np.abs(a))
    got = k(a, b)
    assert (np.abs(got - (a.T @ b + b.T @ a)) <= bound).all()
    with pytest.raises(SimulatorError, match="both in psum"):  # the ISA itself still refuses
        @nki.jit
        def raw(a, b):
            out = nl.ndarray((128, 128), nl.float32, buffer=nl.shared_hbm)
            x, y = nl.load(a), nl.load(b)
            p1, p2 = nl.matmul(x, y, transpose_x=True), nl.matmul(y, x, transpose_x=True)
            r = nl.ndarray((128, 128), nl.float32)
            nisa.tensor_tensor(dst=r, data1=p1, data2=p2, op=nl.add)
            nl.store(out, r)
            return out
        raw(a, b)


def test_legacy_tiles_added_from_psum():
    @legacy.jit
    def k(a, b):
        out = lnl.ndarray((128, 128), lnl.float32, buffer=lnl.shared_hbm)
        x, y = lnl.load(a), lnl.load(b)
        lnl.store(out, value=lnl.matmul(x, y, transpose_x=True) + lnl.matmul(y, x, transpose_x=True))
        return out

    a, b = RNG.integers(-3, 4, (128, 128)).astype(np.float32), RNG.integers(-3, 4, (128, 128)).astype(np.float32)
    np.testing.assert_array_equal(k(a, b), a.T @ b + b.T @ a)  # small integers: every sum is exact in fp32


def test_nki_typing_exists_under_every_name():
    import torchneuron.nki.typing as nt
    assert repr(nt.tensor[128, 512]) == "nki.typing.tensor[(128, 512)]"
    assert legacy.typing is nt
    code = ("import torchneuron.nki as tn; tn.install_import_aliases(); import nki.typing, neuronxcc.nki.typing; "
            "from nki.typing import tensor; from neuronxcc.nki.typing import tensor as t2; "
            "assert tensor is t2; print(tensor[4, 4])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "nki.typing.tensor[(4, 4)]"


def test_legacy_tiled_matmul_accumulates_with_plus_equals_in_psum():
    @legacy.jit
    def tiled(lhsT, rhs):
        k_dim, m_dim = lhsT.shape
        n_dim = rhs.shape[1]
        result = lnl.ndarray((m_dim, n_dim), dtype=lhsT.dtype, buffer=lnl.shared_hbm)
        g_l, g_r, g_o = lnl.mgrid[0:128, 0:m_dim], lnl.mgrid[0:128, 0:n_dim], lnl.mgrid[0:m_dim, 0:n_dim]
        acc = lnl.zeros((m_dim, n_dim), lnl.float32, buffer=lnl.psum)
        for k in lnl.affine_range(k_dim // 128):
            a = lnl.load(lhsT[k * 128 + g_l.p, g_l.x])
            b = lnl.load(rhs[k * 128 + g_r.p, g_r.x])
            acc += lnl.matmul(a, b, transpose_x=True)      # a PSUM result added into a PSUM accumulator
        acc += lnl.transpose(lnl.transpose(lnl.copy(acc)))  # and a PSUM tile added to it: staged through SBUF
        lnl.store(result[g_o.p, g_o.x], value=lnl.copy(acc, dtype=result.dtype))
        return result

    a = RNG.integers(-4, 5, (384, 64)).astype(np.float32)
    b = RNG.integers(-4, 5, (384, 128)).astype(np.float32)
    np.testing.assert_array_equal(tiled(a, b), 2 * (a.T @ b))  # small integers: exact in fp32
