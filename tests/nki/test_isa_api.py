"""The ``nki.isa`` entries added for the published API, called from kernels: results against NumPy, the
NeuronCore versions they need (an error naming the chip), and the target queries."""
from __future__ import annotations

import numpy as np
import pytest

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.sim import SimulatorError

RNG = np.random.default_rng(3)


def _exp_kernel(x, m):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    sums = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
    t, mx = nl.load(x), nl.load(m)
    e = nl.ndarray(x.shape, nl.float32)
    s = nl.ndarray((x.shape[0], 1), nl.float32)
    nisa.exponential(dst=e, src=t, max_value=mx, reduce_res=s, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nl.store(out, e)
    nl.store(sums, s)
    return out, sums


def test_exponential_on_trn3_and_refused_on_trn2_naming_the_chip():
    x, m = RNG.standard_normal((64, 128)).astype(np.float32), RNG.standard_normal((64, 1)).astype(np.float32)
    out, sums = nki.simulate(nki.jit(_exp_kernel, platform_target="trn3"))(x, m)
    np.testing.assert_allclose(out, np.exp(x - m), rtol=2**-20)
    np.testing.assert_allclose(sums, np.exp(x - m).sum(1, keepdims=True), rtol=128 * 2**-23)
    with pytest.raises(SimulatorError, match="exponential: needs NeuronCore-v4 or newer; trn2 is NeuronCore-v3"):
        nki.simulate(nki.jit(_exp_kernel, platform_target="trn2"))(x, m)


def test_activate2_example_scale_bias_gelu_needs_trn3():
    @nki.jit
    def act2(data):
        out = nl.ndarray(data.shape, nl.float32, buffer=nl.shared_hbm)
        x = nl.load(data)
        r = nl.ndarray(data.shape, nl.float32)
        nisa.activate2(dst=r, op=nl.gelu, data=x, imm0=2.0, imm1=0.5, op0=nl.multiply, op1=nl.add)
        nl.store(out, r)
        return out

    import torch
    x = RNG.standard_normal((128, 64)).astype(np.float32)
    got = nki.profile(act2, chip="trn3")(x).outputs
    want = torch.nn.functional.gelu(torch.from_numpy(x) * 2.0 + 0.5).numpy()
    np.testing.assert_array_equal(got, want)
    with pytest.raises(SimulatorError, match="activate2: needs NeuronCore-v4 or newer; trn1 is NeuronCore-v2"):
        nki.profile(act2, chip="trn1")(x)


def test_range_select_and_nonzero_need_neuroncore_v3():
    @nki.jit
    def nz(x):
        out = nl.ndarray((x.shape[0], x.shape[1] + 1), nl.int32, buffer=nl.shared_hbm)
        t = nl.load(x)
        o = nl.ndarray(out.shape, nl.int32)
        nisa.memset(dst=o, value=0)
        nisa.nonzero_with_count(dst=o, src=t, index_offset=0, padding_val=-1)
        nl.store(out, o)
        return out

    x = np.zeros((16, 8), np.float32)
    x[0, [1, 2, 5]] = 1
    got = nki.profile(nz, chip="trn2")(x).outputs
    assert got[0].tolist() == [1, 2, 5, -1, -1, -1, -1, -1, 3]
    with pytest.raises(SimulatorError, match="nonzero_with_count: needs NeuronCore-v3 or newer; trn1"):
        nki.profile(nz, chip="trn1")(x)


def _row_reduction(body):
    """A kernel loading x, running ``body(tile, scratch, column)`` and returning the (P, 1) column."""
    @nki.jit
    def k(x):
        out = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        y = nl.ndarray(x.shape, nl.float32)
        r = nl.ndarray((x.shape[0], 1), nl.float32)
        body(t, y, r)
        nl.store(out, r)
        return out
    return k


def test_activation_reduce_is_activation_with_a_reset_reduction():
    k = _row_reduction(lambda t, y, r: nisa.activation_reduce(dst=y, op=nl.exp, data=t, reduce_op=nl.add,
                                                              reduce_res=r, scale=0.5))
    x = RNG.standard_normal((32, 100)).astype(np.float32)
    np.testing.assert_allclose(nki.simulate(k)(x), np.exp(0.5 * x).sum(1, keepdims=True), rtol=100 * 2**-23)


def test_nc_version_queries_follow_the_chip():
    seen = {}

    @nki.jit
    def k(x):
        seen["v"], seen["sub"] = nisa.get_nc_version(), nisa.get_nc_sub_version()
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.load(x))
        return out

    x = np.ones((4, 4), np.float32)
    for chip, v in (("trn1", nisa.nc_version.gen2), ("trn2", nisa.nc_version.gen3), ("trn3", nisa.nc_version.gen4)):
        nki.profile(k, chip=chip)(x)
        assert seen == {"v": v, "sub": 0}
    assert nisa.NkiValidationError is SimulatorError and nisa.dma_engine.dma.value == 1


def test_gathers_and_dma_compute_from_a_kernel():
    @nki.jit
    def k(data, idx, other):
        out = nl.ndarray(idx.shape, nl.float32, buffer=nl.shared_hbm)
        summed = nl.ndarray(data.shape, nl.float32, buffer=nl.shared_hbm)
        d, i = nl.load(data), nl.load(idx)
        g = nl.ndarray(idx.shape, nl.float32)
        nisa.nc_n_gather(dst=g, data=d, indices=i)
        nl.store(out, g)
        nisa.dma_compute(dst=summed, srcs=[d, other], reduce_op=nl.add)
        return out, summed

    data = RNG.standard_normal((32, 64)).astype(np.float32)
    idx = RNG.integers(0, 64, (32, 20)).astype(np.uint32)
    other = RNG.standard_normal((32, 64)).astype(np.float32)
    import torch
    out, summed = k(torch.from_numpy(data), torch.from_numpy(idx.astype(np.int64)).to(torch.uint32),
                    torch.from_numpy(other))
    np.testing.assert_array_equal(out.numpy(), np.take_along_axis(data, idx.astype(np.int64), 1))
    np.testing.assert_array_equal(summed.numpy(), data + other)


def _two_independent(order: bool):
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 2048), nl.float32, buffer=nl.shared_hbm)
        a = nl.ndarray((128, 2048), nl.float32)
        b = nl.ndarray((128, 2048), nl.int32)
        first = nisa.memset(dst=a, value=1.0)                         # VectorE
        second = nisa.iota(dst=b, pattern=[[1, 2048]], offset=0)      # GpSimd, independent of the memset
        assert isinstance(first, nisa.NkiInstruction) and repr(second) == "NkiInstruction(iota)"
        if order:
            assert second.depends_on(first) is second
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
        nl.store(out, a)
        return out
    return k


def test_depends_on_orders_independent_instructions_in_the_timing_model():
    x = np.zeros((1, 1), np.float32)
    free, ordered = nki.profile(_two_independent(False), chip="trn2")(x), nki.profile(_two_independent(True))(x)
    np.testing.assert_array_equal(ordered.outputs, free.outputs)
    np.testing.assert_array_equal(free.outputs, np.arange(2048, dtype=np.float32)[None, :].repeat(128, 0) + 1)
    assert free.start_ns[1] == free.start_ns[0] == 0.0   # the two engines start together
    spec = nki.resolve_chip("trn2")
    wait = spec.gpsimd.dependent_overhead_cycles / spec.gpsimd.clock_hz * 1e9
    assert ordered.start_ns[1] == pytest.approx(ordered.end_ns[0] + wait)  # the iota waits for the memset


def test_depends_on_is_serialized_and_checked():
    from torchneuron.sim import Program
    k = _two_independent(True)
    traced = k.trace((np.zeros((1, 1), np.float32),), {}, nki.resolve_chip("trn2"))
    assert traced.program.after == ((1, 0),)
    assert Program.from_bytes(traced.program.to_bytes()).after == ((1, 0),)
    with pytest.raises(SimulatorError, match="must name an earlier instruction"):
        Program(traced.program.instructions, traced.program.args, "p", after=((0, 1),))

    @nki.jit
    def backwards(x):
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        a = nl.ndarray((4, 4), nl.float32)
        first = nisa.memset(dst=a, value=0.0)
        second = nisa.memset(dst=a, value=1.0)
        first.depends_on(second)
        nl.store(out, a)
        return out
    with pytest.raises(SimulatorError, match="a producer must come first"):
        backwards(np.zeros((1, 1), np.float32))


def _state_kernel(engine_name: str, words: int):
    @nki.jit
    def k(seeds):
        out = nl.ndarray((2, 32, 64), nl.float32, buffer=nl.shared_hbm)
        eng = getattr(nisa.engine, engine_name)
        saved = nl.ndarray((32, words), nl.uint32)
        nisa.rand_get_state(dst=saved, engine=eng)
        a, b = nl.rand((32, 64), nl.float32), None
        nisa.rand_set_state(src_seeds=saved, engine=eng)        # back to the saved state: the same draws
        b = nl.rand((32, 64), nl.float32)
        nl.store(out[0], a)
        nl.store(out[1], b)
        return out
    return k


@pytest.mark.parametrize("engine_name,words,chip", [("gpsimd", 6, "trn2"), ("vector", 24, "trn3")])
def test_rand_get_state_then_set_state_replays_the_sequence(engine_name, words, chip):
    out = nki.profile(_state_kernel(engine_name, words), chip=chip)(np.zeros((1, 1), np.float32)).outputs
    assert (out[0] == out[1]).all() and 0 <= out.min() and out.max() <= 1 and out[0].std() > 0.2


def test_rand_set_state_from_seeds_is_deterministic_and_needs_neuroncore_v3():
    @nki.jit
    def k(seeds):
        out = nl.ndarray((32, 16), nl.float32, buffer=nl.shared_hbm)
        s = nl.load(seeds)
        nisa.rand_set_state(src_seeds=s)
        nl.store(out, nl.rand((32, 16), nl.float32))
        return out

    import torch
    seeds = torch.arange(32 * 6, dtype=torch.int64).reshape(32, 6).to(torch.uint32)
    a, b = nki.profile(k, chip="trn2")(seeds).outputs, nki.profile(k, chip="trn2")(seeds).outputs
    c = nki.profile(k, chip="trn2")((seeds.to(torch.int64) + 1).to(torch.uint32)).outputs
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(SimulatorError, match="rand_set_state: needs NeuronCore-v3 or newer; trn1"):
        nki.profile(k, chip="trn1")(seeds)
    with pytest.raises(SimulatorError, match="on the vector engine: needs NeuronCore-v4 or newer; trn2"):
        nki.profile(_state_kernel("vector", 24), chip="trn2")(np.zeros((1, 1), np.float32))
    with pytest.raises(SimulatorError, match="XORWOW state is 6 words"):
        nki.profile(_state_kernel("gpsimd", 24), chip="trn2")(np.zeros((1, 1), np.float32))


def test_rng_on_gpsimd_needs_neuroncore_v3():
    @nki.jit
    def k(x):
        out = nl.ndarray((16, 32), nl.int32, buffer=nl.shared_hbm)
        bits = nl.ndarray((16, 32), nl.int32)
        nisa.rng(dst=bits, engine=nisa.engine.gpsimd)
        nl.store(out, bits)
        return out

    x = np.zeros((1, 1), np.float32)
    bits = nki.profile(k, chip="trn2")(x).outputs
    assert len(np.unique(bits)) > 500  # 512 draws of 32 random bits: collisions are negligible
    with pytest.raises(SimulatorError, match="rng on the gpsimd engine: needs NeuronCore-v3 or newer; trn1"):
        nki.profile(k, chip="trn1")(x)


def test_topk_of_rows_through_the_blocked_snake_layout():
    import torch

    @nki.jit
    def k(inp):
        rows, vocab = inp.shape
        n_cols = vocab // 16
        vals = nl.ndarray((rows * 16, 16), nl.bfloat16, buffer=nl.shared_hbm)
        idxs = nl.ndarray((rows * 16, 16), nl.uint32, buffer=nl.shared_hbm)
        snake = nl.ndarray((rows * 16, n_cols), nl.bfloat16)
        nisa.dma_copy(dst=snake, src=inp.reshape((rows * 16, n_cols)))   # partition p holds p*n_cols..+n_cols
        v = nl.zeros((rows * 16, 16), nl.bfloat16)
        i = nl.zeros((rows * 16, 16), nl.uint32)
        nisa.topk(val_dst=v, idx_dst=i, src=snake, n=vocab)
        nl.store(vals, v)
        nl.store(idxs, i)
        return vals, idxs

    inp = torch.randperm(2 * 64).reshape(2, 64).to(torch.bfloat16)
    vals, idxs = k(inp)
    for r in range(2):
        q = torch.arange(16)
        pos = idxs[16 * r + q % 16, q // 16].to(torch.int64)
        vocab_index = (pos % 16) * 4 + pos // 16                 # snake position -> the row's element
        got = vals[16 * r + q % 16, q // 16]
        assert torch.equal(got, inp[r, vocab_index])
        assert torch.equal(got.flip(0), torch.topk(inp[r].float(), 16).values.to(torch.bfloat16))


def test_tensor_scalar_reduce_chains_in_registers_and_negates():
    def body(t, y, r):
        half = t.shape[1] // 2
        nisa.tensor_scalar_reduce(dst=y[:, :half], data=t[:, :half], op0=nl.multiply, operand0=2.0,
                                  reduce_op=nl.add)                     # reduce_res=None: kept in the registers
        nisa.tensor_scalar_reduce(dst=y[:, half:], data=t[:, half:], op0=nl.multiply, operand0=2.0,
                                  reduce_op=nl.add, reduce_res=r, reduce_cmd=nisa.reduce_cmd.reduce,
                                  reduce_res_negate=True)
    k = _row_reduction(body)
    x = RNG.integers(-8, 9, (16, 40)).astype(np.float32)   # small integers: the sums are exact in fp32
    np.testing.assert_array_equal(k(x), -(2 * x).sum(1, keepdims=True))


def test_dma_transpose_takes_the_published_priority_and_oob_mode():
    @nki.jit
    def k(a):
        out = nl.ndarray((a.shape[1], a.shape[0]), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((a.shape[1], a.shape[0]), nl.float32)
        nisa.dma_transpose(dst=t, src=a, priority=1, oob_mode=nisa.oob_mode.error)
        nl.store(out, t)
        return out

    a = RNG.standard_normal((32, 64)).astype(np.float32)
    np.testing.assert_array_equal(k(a), a.T)


def test_rand2_is_neuroncore_v4_only_and_draws_within_its_bounds():
    # "Available only on NeuronCore-v4 and newer": refused on trn2 naming the chip
    @nki.jit
    def k(x):
        out = nl.ndarray((64, 128), nl.float32, buffer=nl.shared_hbm)
        r = nl.ndarray((64, 128), nl.float32)
        nisa.rand2(dst=r, min=-2.0, max=3.0)
        nl.store(out, r)
        return out

    with pytest.raises(SimulatorError, match="rand2: needs NeuronCore-v4 or newer; trn2 is NeuronCore-v3"):
        nki.profile(k, chip="trn2")(np.zeros((1, 1), np.float32))
    u = np.asarray(nki.profile(k, chip="trn3")(np.zeros((1, 1), np.float32)).outputs)
    assert -2.0 <= u.min() and u.max() <= 3.0 and abs(u.mean() - 0.5) < 0.1   # mean 0.5, std 5/sqrt(12 * 8192)


def test_activation_bias_is_a_column_on_neuroncore_v2():
    # "In NeuronCore-v2, the bias must be a [N, 1] vector, but starting NeuronCore-v3, bias can either be a
    # compile-time constant scalar or a [N, 1] vector"
    @nki.jit
    def k(x, scalar_bias):
        t = nl.load(x)
        r = nl.ndarray(x.shape, nl.float32)
        if scalar_bias:
            nisa.activation(dst=r, op=nl.exp, data=t, bias=0.5)
        else:
            b = nl.full((x.shape[0], 1), 0.5, nl.float32)
            nisa.activation(dst=r, op=nl.exp, data=t, bias=b)
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, r)
        return out

    x = np.random.default_rng(3).standard_normal((16, 8)).astype(np.float32)
    want = np.exp(x.astype(np.float64) + 0.5)
    for chip, scalar in (("trn1", False), ("trn2", True), ("trn2", False)):
        got = np.asarray(nki.profile(k, chip=chip)(x, scalar).outputs)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(SimulatorError, match=r"bias must be an \[N, 1\] tile on NeuronCore-v2 \(trn1\)"):
        nki.profile(k, chip="trn1")(x, True)
