"""Legacy (neuronxcc.nki style) indexing with nl.arange/nl.mgrid index vectors next to basic indices. As in
neuronxcc.nki (err_unsupported_mixing_basic_advanced_tensor_indexing), a slice next to an index vector is
refused with a clear error; integers next to index vectors and the all-index-vector forms run (vs. NumPy)."""
from __future__ import annotations

import numpy as np
import pytest

from torchneuron.nki import legacy as nki
from torchneuron.nki.legacy import language as nl

RNG = np.random.default_rng(1)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@nki.jit
def _load_slice_free(a):
    """Partition index vector + a slice on the free dim (load), then a plain store."""
    out = nl.ndarray((128, 256), dtype=a.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(128)[:, None]
    t = nl.load(a[i_p, 64:320])
    nl.store(out, value=t)
    return out


@nki.jit
def _load_vectors(a):
    """The all-index-vector form of ``_load_slice_free``."""
    out = nl.ndarray((128, 256), dtype=a.dtype, buffer=nl.shared_hbm)
    i_p, i_f = nl.arange(128)[:, None], nl.arange(256)[None, :]
    nl.store(out, value=nl.load(a[i_p, 64 + i_f]))
    return out


def test_load_all_index_vectors_matches_numpy():
    a = randn(128, 512)
    np.testing.assert_array_equal(nki.simulate_kernel(_load_vectors, a), a[:, 64:320])


MIXED = "Mixing basic tensor indexing and advanced tensor indexing is not supported: use nl.arange"


def test_load_index_vector_with_slice_raises():
    with pytest.raises(NotImplementedError, match=MIXED):
        nki.simulate_kernel(_load_slice_free, randn(128, 512))


@nki.jit
def _store_mixed(a):
    """Slice on the partition dim + index vector on the free dim (store), with an integer on a 3-D output."""
    out = nl.ndarray((2, 128, 64), dtype=a.dtype, buffer=nl.shared_hbm)
    i_f = nl.arange(64)[None, :]
    t = nl.load(a)
    nl.store(out[1, 0:128, i_f], value=t)
    nl.store(out[0, 0:128, i_f], value=t)
    return out


@nki.jit
def _store_int_vectors(a):
    """Integer + index vectors on a store (supported): the fixed form of ``_store_mixed``."""
    out = nl.ndarray((2, 128, 64), dtype=a.dtype, buffer=nl.shared_hbm)
    i_p, i_f = nl.arange(128)[:, None], nl.arange(64)[None, :]
    t = nl.load(a)
    nl.store(out[1, i_p, i_f], value=t)
    nl.store(out[0, i_p, i_f], value=t)
    return out


def test_store_integer_and_index_vectors():
    a = randn(128, 64)
    np.testing.assert_array_equal(nki.simulate_kernel(_store_int_vectors, a), np.stack([a, a]))


def test_store_slice_with_index_vector_raises():
    with pytest.raises(NotImplementedError, match=MIXED):
        nki.simulate_kernel(_store_mixed, randn(128, 64))


@nki.jit
def _sbuf_mixed(a):
    """An on-chip (SBUF) read with a partition index vector and a strided free slice; masked row tile."""
    out = nl.ndarray((a.shape[0], 32), dtype=a.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(128)[:, None]
    for i in nl.affine_range((a.shape[0] + 127) // 128):
        m = i * 128 + i_p < a.shape[0]
        t = nl.load(a[i * 128 + i_p, 0:64], mask=m)
        s = nl.copy(t[i_p, 1:64:2], mask=m)
        nl.store(out[i * 128 + i_p, 0:32], value=s, mask=m)
    return out


@nki.jit
def _sbuf_vectors(a):
    """The all-index-vector form of ``_sbuf_mixed`` (strided SBUF read, masked ragged row tile)."""
    out = nl.ndarray((a.shape[0], 32), dtype=a.dtype, buffer=nl.shared_hbm)
    i_p, i_f, i_h = nl.arange(128)[:, None], nl.arange(64)[None, :], nl.arange(32)[None, :]
    for i in nl.affine_range((a.shape[0] + 127) // 128):
        m = i * 128 + i_p < a.shape[0]
        t = nl.load(a[i * 128 + i_p, i_f], mask=m)
        s = nl.copy(t[i_p, 1 + 2 * i_h], mask=m)
        nl.store(out[i * 128 + i_p, i_h], value=s, mask=m)
    return out


def test_sbuf_strided_index_vectors_with_mask():
    a = randn(200, 64)
    np.testing.assert_array_equal(nki.simulate_kernel(_sbuf_vectors, a), a[:, 1:64:2])


def test_sbuf_access_mixing_slice_raises():
    with pytest.raises(NotImplementedError, match=MIXED):
        nki.simulate_kernel(_sbuf_mixed, randn(200, 64))


@nki.jit
def _mgrid_with_int(a):
    """nl.mgrid vectors with an integer fixing the middle dim of a 3-D input."""
    out = nl.ndarray((128, 96), dtype=a.dtype, buffer=nl.shared_hbm)
    g = nl.mgrid[0:128, 0:96]
    t = nl.load(a[g.p, 2, g.x])
    nl.store(out[g.p, g.x], value=t)
    return out


def test_mgrid_with_integer():
    a = randn(128, 4, 96)
    np.testing.assert_array_equal(nki.simulate_kernel(_mgrid_with_int, a), a[:, 2, :])


@nki.jit
def _reversed_slice(a):
    out = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(128)[:, None]
    nl.store(out, value=nl.load(a[i_p, ::-1]))
    return out


def test_reversed_slice_with_index_vector_raises():
    with pytest.raises(NotImplementedError, match=MIXED):
        nki.simulate_kernel(_reversed_slice, randn(128, 64))
