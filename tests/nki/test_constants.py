"""``nl.shared_constant`` (host data embedded in the program as a read-only HBM tensor), ``nl.static_cast``
(host-side cast) and the names the current generation removed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torchneuron import nki
from torchneuron.nki import legacy
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.nki.legacy import isa as lisa, language as lnl
from torchneuron.sim import SimulatorError

RNG = np.random.default_rng(5)


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@nki.jit
def add_table_kernel(x, table):
    """out = x + table, with ``table`` (a NumPy meta-parameter given as bytes) embedded as a constant."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    c = nl.shared_constant(np.frombuffer(table, dtype=np.float32).reshape(x.shape))
    nl.store(out, nl.add(nl.load(x), nl.load(c)))
    return out


def test_shared_constant_values_reach_the_kernel():
    x, t = randn(128, 64), randn(128, 64)
    np.testing.assert_allclose(add_table_kernel(x, t.tobytes()), x + t, rtol=1e-6)
    rep = nki.profile(add_table_kernel)(x, t.tobytes())            # the cached program, run again
    np.testing.assert_allclose(rep.outputs, x + t, rtol=1e-6)
    assert any(s.name.startswith("shared_constant") and s.kind == "input" for s in rep.program.args)


def test_shared_constant_on_neuron_tensors():
    x, t = randn(128, 64), randn(128, 64)
    out = add_table_kernel(torch.from_numpy(x).to("neuron"), t.tobytes())   # the constant goes to the device
    assert out.device.type == "neuron"
    np.testing.assert_allclose(out.cpu().numpy(), x + t, rtol=1e-6)


@legacy.jit
def transpose_by_identity_kernel(v):
    """The attention tutorials' pattern: an identity built with nl.shared_constant(np.identity, dtype=)
    and TensorE transposes through it (is_transpose matmul)."""
    n = v.shape[0]
    out = lnl.ndarray((n, n), dtype=v.dtype, buffer=lnl.shared_hbm)
    identity = lnl.shared_constant(np.identity(n, dtype=np.int8), dtype=v.dtype)
    ident = lnl.load(identity)
    t = lisa.nc_matmul(lnl.load(v), ident, is_transpose=True, is_moving_onezero=True)
    lnl.store(out, value=lisa.tensor_copy(t))
    return out


def test_legacy_shared_constant_with_dtype_cast():
    v = randn(128, 128)
    np.testing.assert_array_equal(transpose_by_identity_kernel(v), v.T)


@nki.jit
def spmd_constant_kernel(x):
    i = nl.program_id(0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    c = nl.shared_constant(np.arange(x.shape[1], dtype=np.float32)[None, :].repeat(128, 0))
    rows = slice(i * 128, (i + 1) * 128)
    nl.store(out[rows, :], nl.multiply(nl.load(x[rows, :]), nl.load(c)))
    return out


def test_shared_constant_is_one_tensor_for_an_spmd_launch():
    x = randn(256, 16)
    np.testing.assert_allclose(spmd_constant_kernel[2](x), x * np.arange(16, dtype=np.float32), rtol=1e-6)
    (slot,) = [s for s in nki.profile(spmd_constant_kernel[2])(x).program.args if s.name.startswith("shared")
               and s.kind == "input"]
    assert slot.shape == (128, 16)


def test_shared_constant_bad_inputs_raise():
    @nki.jit
    def float64_const(x):
        nl.shared_constant(np.zeros((4, 4)))            # float64 has no NeuronCore dtype: dtype= is needed
        return x

    with pytest.raises(TypeError, match="float64 is not a NeuronCore dtype"):
        float64_const(randn(2, 2))

    @nki.jit
    def writes_const(x):
        c = nl.shared_constant(np.zeros((128, 4), np.float32))
        nl.store(c, nl.load(x))
        return x

    with pytest.raises(SimulatorError, match="shared constant.*read-only"):
        writes_const(randn(128, 4))

    @nki.jit
    def differs_per_instance(x):
        nl.shared_constant(np.full((1, 4), nl.program_id(0), np.float32))
        return x

    with pytest.raises(SimulatorError, match="different values"):
        differs_per_instance[2](randn(2, 2))


def test_static_cast_host_arrays():
    x = (RNG.random((4, 8)) - 0.5) * 2            # float64, as the attention test driver makes them
    f32 = nl.static_cast(x, nl.float32)
    assert isinstance(f32, np.ndarray) and f32.dtype == np.float32
    np.testing.assert_array_equal(f32, x.astype(np.float32))
    bf = nl.static_cast(x, nl.bfloat16)           # NumPy has no bfloat16 here: a CPU tensor
    assert isinstance(bf, torch.Tensor) and bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf, torch.from_numpy(x).to(torch.bfloat16))
    assert lnl.static_cast(np.arange(3), np.int8).dtype == np.int8
    with pytest.raises(TypeError, match="not a NeuronCore dtype"):
        nl.static_cast(x, np.float64)


def test_static_cast_of_a_kernel_tile_is_refused():
    @nki.jit
    def k(x):
        nl.static_cast(nl.load(x), nl.bfloat16)
        return x

    with pytest.raises(TypeError, match="host arrays.*nl.copy"):
        k(randn(4, 4))


def test_removed_current_generation_names_say_what_replaces_them():
    with pytest.raises(AttributeError, match=r"nl.arange is not in the current NKI generation.*slices"):
        nl.arange(128)
    with pytest.raises(AttributeError, match=r"nl.mgrid .*removed in NKI 0.2.0"):
        nl.mgrid[0:128, 0:4]
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        nl.no_such_name  # noqa: B018


def test_ndarray_address_is_a_placement_hint():
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf, address=(0, 4096))
        nisa.dma_copy(dst=t, src=x)
        nl.store(out, t)
        return out

    x = randn(128, 8)
    np.testing.assert_array_equal(k(x), x)
