"""The published NKI entries no other test exercises by name, each against the reference's documented
behaviour: the deprecated engine constants, ``VirtualRegister``, ``nl.static_range``, ``nl.program_ndim``,
``nl.float8_e8m0fnu`` as the MX scale type, and the collectives' ``priority`` and multi-channel ring."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torchneuron import nki
import torchneuron.nki.collectives as ncc
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.sim import SimulatorError

RNG = np.random.default_rng(21)


def test_deprecated_engine_constants_are_the_engine_members():
    # the reference: ``tensor_engine: engine`` "(deprecated: use engine.tensor)", and so on
    for old, member in (("tensor_engine", "tensor"), ("vector_engine", "vector"), ("scalar_engine", "scalar"),
                        ("gpsimd_engine", "gpsimd"), ("unknown_engine", "unknown")):
        assert getattr(nisa, old) is getattr(nisa.engine, member)

    @nki.jit
    def copy_on(x, engine):
        t = nl.load(x)
        r = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=t, engine=engine)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, r)
        return out

    x = RNG.standard_normal((64, 32)).astype(np.float32)
    for engine in (nisa.vector_engine, nisa.scalar_engine, nisa.gpsimd_engine):
        rep = nki.profile(copy_on)(x, engine)
        np.testing.assert_array_equal(np.asarray(rep.outputs), x)
        (copy,) = [i for i in rep.program.instructions if i.opcode == "tensor_copy"]
        assert copy.engine.name.lower().startswith(engine.name[:3])   # the constant picked the engine


def test_virtual_register_holds_a_runtime_scalar_only():
    @nki.jit
    def count(x):
        reg = nisa.register_alloc(7)
        assert isinstance(reg, nisa.VirtualRegister)
        with pytest.raises(TypeError, match="known only when the kernel runs"):
            bool(reg)
        nisa.register_move(dst=reg, src=11)
        out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.register_store(dst=t, src=reg)
        nl.store(out, t)
        return out

    assert np.asarray(count(np.zeros((1, 1), np.float32))).tolist() == [[11]]


def test_static_range_is_python_range_unrolled():
    # "an alias for Python's range()": the same indices, start/stop/step as range takes them
    assert list(nl.static_range(5)) == list(range(5))
    assert list(nl.static_range(2, 11, 3)) == list(range(2, 11, 3))

    @nki.jit
    def rows(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        for i in nl.static_range(1, x.shape[0], 2):
            nl.store(out[i:i + 1, :], nl.multiply(nl.load(x[i:i + 1, :]), 2.0))
        for i in nl.static_range(0, x.shape[0], 2):
            nl.store(out[i:i + 1, :], nl.load(x[i:i + 1, :]))
        return out

    x = RNG.standard_normal((6, 16)).astype(np.float32)
    want = x.copy()
    want[1::2] *= 2
    np.testing.assert_array_equal(np.asarray(rows(x)), want)


@nki.jit
def grid_shape(x):
    out = nl.ndarray((1, 2), nl.int32, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=t[0:1, 0:1], value=nl.program_ndim())
    nisa.memset(dst=t[0:1, 1:2], value=nl.num_programs())
    if all(nl.program_id(a) == 0 for a in range(max(nl.program_ndim(), 1))):
        nl.store(out, t)
    return out


@pytest.mark.parametrize("grid,ndim,total", [(None, 0, 1), ((4,), 1, 4), ((2, 3), 2, 6)])
def test_program_ndim_is_the_grid_rank_and_zero_without_a_grid(grid, ndim, total):
    # "the number of axes. 0 if no grid"; num_programs() with no axes: "the total number of programs"
    kernel = grid_shape if grid is None else grid_shape[grid]
    out = np.asarray(kernel(np.zeros((1, 1), np.float32)))
    assert out.tolist() == [[ndim, total]]


def test_float8_e8m0fnu_scales_are_the_mx_scale_exponents():
    # the power-of-two shared scale of MX quantization: 2**(e - 127), NaN as 0xFF; quantize_mx writes
    # exactly the exponents a uint8 scale tile receives
    @nki.jit(platform_target="trn3")
    def scales_as(x, dtype):
        k, m = x.shape[0], x.shape[1] // 4
        q = nl.ndarray((k, m), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        s = nl.ndarray((k, m), dtype, buffer=nl.sbuf)
        nisa.memset(dst=s, value=0)
        nisa.quantize_mx(dst=q, src=nl.load(x), dst_scale=s)
        out = nl.ndarray((k, m), dtype, buffer=nl.shared_hbm)
        nl.store(out, s)
        return out

    x = torch.from_numpy(RNG.standard_normal((32, 64)).astype(np.float32) * 3).bfloat16()
    e8 = np.asarray(nki.profile(scales_as, chip="trn3")(x, nl.float8_e8m0fnu).outputs)
    u8 = np.asarray(nki.profile(scales_as, chip="trn3")(x, nl.uint8).outputs)
    np.testing.assert_array_equal(e8.view(np.uint8), u8)
    assert (u8 != 0).any()                                          # real exponents, not the memset


def _ring2(x, y, priority=None):
    g = ncc.ReplicaGroup([[0, 1, 2]])
    a = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    b = nl.ndarray(y.shape, y.dtype, buffer=nl.shared_hbm)
    ncc.collective_permute_implicit(srcs_by_channel=[[x], [y]], dsts_by_channel=[[a], [b]], replica_group=g,
                                    channel_ids=[0, 1], priority=priority)
    return a, b


def test_two_channel_ring_moves_each_channel_to_the_successor():
    x = RNG.integers(-99, 99, (3, 8, 4)).astype(np.float32)
    y = RNG.integers(-99, 99, (3, 16, 4)).astype(np.float32)
    a, b = nki.jit(_ring2).ranks(3)(x, y)
    for r in range(3):
        np.testing.assert_array_equal(a[r], x[(r - 1) % 3])
        np.testing.assert_array_equal(b[r], y[(r - 1) % 3])
    with pytest.raises(ValueError, match="channel_ids must be consecutive from 0"):
        nki.jit(lambda x, y: ncc.collective_permute_implicit(
            [[x], [y]], [[x], [y]], ncc.ReplicaGroup([[0, 1, 2]]), channel_ids=[1, 2])).ranks(3)(x, y)


def test_collective_priority_is_neuroncore_v4_only_and_0_to_3():
    # "DMA quality-of-service priority level 0-3 ... (NeuronCore-v4+ only)"
    x = RNG.integers(-99, 99, (3, 8, 4)).astype(np.float32)
    with pytest.raises(SimulatorError, match="trn2"):
        nki.jit(lambda x, y: _ring2(x, y, priority=1)).ranks(3)(x, x)
    a, _ = nki.profile(nki.jit(lambda x, y: _ring2(x, y, priority=1)).ranks(3), chip="trn3")(x, x).outputs
    np.testing.assert_array_equal(a[0], x[2])
    with pytest.raises(ValueError, match="priority is 4; DMA QoS levels are 0-3"):
        nki.profile(nki.jit(lambda x, y: _ring2(x, y, priority=4)).ranks(3), chip="trn3")(x, x)
