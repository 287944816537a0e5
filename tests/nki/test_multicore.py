"""Multi-core kernels: each SPMD instance on its own NeuronCore sharing HBM, the launch timed as its slowest core
plus its synchronisations, ``nisa.sendrecv`` / ``nisa.core_barrier`` between the cores, and ``nl.tfloat32``."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.distributed.cost import collective_ns
from torchneuron.distributed.topology import links, placement
from torchneuron.nki.multicore import LaunchProgram
from torchneuron.nki.tf32 import round_tf32
from torchneuron.sim import NeuronCore, SimulatorError
from torchneuron.sim.specs import chip_spec
from tests.nki import kernels as K

RNG = np.random.default_rng(18)
TRN2 = chip_spec("trn2")


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@nki.jit
def split_matmul(a, b):
    """out[:, part r] = a.T @ b[:, part r] on core r (K = 128 rows), 512 columns (a PSUM bank) at a time."""
    r, n = nl.program_id(0), nl.num_programs()
    cols = b.shape[1] // n
    out = nl.ndarray((a.shape[1], b.shape[1]), nl.float32, buffer=nl.shared_hbm)
    at = nl.load(a)
    for c in range(r * cols, (r + 1) * cols, 512):
        bt = nl.load(b[:, c:c + 512])
        acc = nl.ndarray((a.shape[1], 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=at, moving=bt)
        nl.store(out[:, c:c + 512], nl.copy(acc))
    return out


def test_two_core_matmul_split_equals_the_one_core_product():
    a, b = _f32(128, 128), _f32(128, 1024)
    whole = split_matmul(a, b)
    halves = split_matmul[2](a, b)
    np.testing.assert_array_equal(halves, whole)  # the same per-column products, each core its half
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    bound = 128 * 2**-24 * (np.abs(a).T @ np.abs(b))  # fp32 accumulation of 128 products
    assert np.all(np.abs(whole - ref) <= bound)


@pytest.mark.parametrize("grid", [2, 4, (2, 2), 12])
def test_instances_on_their_own_cores_equal_the_one_core_run(grid):
    x = _f32(64 * math.prod(grid if isinstance(grid, tuple) else (grid,)), 64)
    kernel = K.spmd_scale[grid]
    out, report, traced = kernel.run((x, 3.0), {})
    assert isinstance(traced.program, LaunchProgram)
    one = NeuronCore(TRN2).run(traced.program, {"x": torch.from_numpy(x)}, timed=False)  # one after another
    np.testing.assert_array_equal(out, one.bindings[traced.result].numpy())
    np.testing.assert_array_equal(out, 3 * x)


def test_launch_time_is_the_slowest_core_not_the_sum():
    a, b = _f32(128, 128), _f32(128, 1024)
    launch = nki.profile(split_matmul[2])(a, b)
    program = launch.program
    per_core = [p.schedule(TRN2).device_time_ns for p in program.instances]
    assert launch.device_time_ns == max(per_core)
    assert launch.device_time_ns < 0.75 * sum(per_core)
    assert program.flops == sum(p.flops for p in program.instances)


def test_instances_beyond_the_chip_cores_wait_for_their_core():
    x = _f32(8 * 16, 64)
    rep = nki.profile(K.spmd_scale[8], chip="trn1")(x, 2.0)  # trn1: 2 cores, so 4 instances on each
    times = [p.schedule(chip_spec("trn1")).device_time_ns for p in rep.program.instances]
    assert rep.device_time_ns == pytest.approx(max(sum(times[0::2]), sum(times[1::2])))
    np.testing.assert_array_equal(rep.outputs, 2 * x)


@nki.jit
def swap_halves(x):
    """Core r sends its half of x (in SBUF) to the other core and stores what it receives at its own half."""
    r = nl.program_id(0)
    half = x.shape[0] // 2
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    mine = nl.load(x[r * half:(r + 1) * half, :])
    got = nl.ndarray(mine.shape, mine.dtype, buffer=nl.sbuf)
    nisa.sendrecv(src=mine, dst=got, send_to_rank=1 - r, recv_from_rank=1 - r, pipe_id=0)
    nl.store(out[r * half:(r + 1) * half, :], got)
    return out


def _segments_time(program: LaunchProgram, spec, k: int) -> float:
    return max(parts[k][0].schedule(spec).device_time_ns for parts in program.segments)


def test_sendrecv_swaps_tiles_between_the_two_cores_in_the_time_of_one_message():
    x = _f32(256, 64)
    rep = nki.profile(swap_halves[2])(x)
    np.testing.assert_array_equal(rep.outputs, np.concatenate([x[128:], x[:128]]))
    program = rep.program
    message = collective_ns("send", 128 * 64 * 4, placement([0, 1], TRN2, 128), TRN2, links(TRN2))
    assert message == round(128 * 64 * 4 / TRN2.hbm_bytes_per_second_per_core * 1e9 + links(TRN2).core_latency_ns)
    assert rep.device_time_ns == pytest.approx(_segments_time(program, TRN2, 0) + message
                                               + _segments_time(program, TRN2, 1))


def test_sendrecv_errors():
    x = _f32(256, 64)
    with pytest.raises(SimulatorError, match="sendrecv: needs NeuronCore-v3 or newer; trn1 is NeuronCore-v2"):
        nki.profile(swap_halves[2], chip="trn1")(x)

    @nki.jit
    def wrong_ring(x):  # everyone sends to the next core but says it receives from the next one too
        r, n = nl.program_id(0), nl.num_programs()
        t = nl.load(x[0:32, :])
        got = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.sendrecv(src=t, dst=got, send_to_rank=(r + 1) % n, recv_from_rank=(r + 1) % n, pipe_id=0)
        out = nl.ndarray((32, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
        nl.store(out, got)
        return out

    with pytest.raises(SimulatorError, match="sendrecv: core 0 sends to core 1, which receives from core 2"):
        wrong_ring[4](x)

    @nki.jit
    def bad_shapes(x):
        t = nl.load(x[0:32, :])
        got = nl.ndarray((32, 8), t.dtype, buffer=nl.sbuf)
        nisa.sendrecv(src=t, dst=got, send_to_rank=1, recv_from_rank=1, pipe_id=0)

    with pytest.raises(SimulatorError, match="must have the same shape and dtype"):
        bad_shapes[2](x)

    @nki.jit
    def off_launch(x):
        t = nl.load(x[0:32, :])
        got = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.sendrecv(src=t, dst=got, send_to_rank=2, recv_from_rank=1, pipe_id=0)

    with pytest.raises(ValueError, match=r"send_to_rank=2 is not a core of the launch \(program ids 0..1\)"):
        off_launch[2](x)


@nki.jit
def doubled_then_other_half(x):
    """Each core writes 2*x for its half of a shared tensor, waits at the barrier, then reads the other half."""
    r = nl.program_id(0)
    half = x.shape[0] // 2
    shared = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(shared[r * half:(r + 1) * half, :], nl.multiply(nl.load(x[r * half:(r + 1) * half, :]), 2.0))
    nisa.core_barrier(data=shared, cores=(0, 1))
    nl.store(out[r * half:(r + 1) * half, :], nl.load(shared[(1 - r) * half:(2 - r) * half, :]))
    return out


def test_core_barrier_orders_the_shared_writes_and_costs_one_latency():
    x = _f32(256, 64)
    rep = nki.profile(doubled_then_other_half[2])(x)
    np.testing.assert_array_equal(rep.outputs, 2 * np.concatenate([x[128:], x[:128]]))
    barrier = collective_ns("barrier", 0, placement([0, 1], TRN2, 128), TRN2, links(TRN2))
    assert barrier == math.ceil(math.log2(2)) * links(TRN2).core_latency_ns
    program = rep.program
    assert rep.device_time_ns == pytest.approx(_segments_time(program, TRN2, 0) + barrier
                                               + _segments_time(program, TRN2, 1))


def test_core_barrier_errors():
    x = _f32(256, 64)

    @nki.jit
    def on_sbuf(x):
        nisa.core_barrier(data=nl.load(x[0:8, :]), cores=(0, 1))

    with pytest.raises(SimulatorError, match="core_barrier: data must be a shared-HBM tensor"):
        on_sbuf[2](x)

    @nki.jit
    def far_core(x):
        shared = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.core_barrier(data=shared, cores=(0, 3))

    with pytest.raises(ValueError, match="rank 3 .* is not a rank of the launch.*program ids"):
        far_core[2](x)
    with pytest.raises(SimulatorError, match="core_barrier: needs NeuronCore-v3"):
        nki.profile(doubled_then_other_half[2], chip="trn1")(x)


def test_cross_core_kernels_refuse_what_they_cannot_model():
    x = _f32(256, 64)

    @nki.jit
    def divergent(x):  # the instances disagree on the cross-core instructions they issue
        shared = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        if nl.program_id(0) == 0:
            nisa.core_barrier(data=shared, cores=(0, 1))

    with pytest.raises(SimulatorError, match="instances of the launch disagree: instance 0 issues 1"):
        divergent[2](x)
    @nki.jit
    def barrier_only(x):
        nisa.core_barrier(data=nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm), cores=(0, 1))

    with pytest.raises(SimulatorError, match="needs a core per instance; a trn2 chip has 8"):
        barrier_only[16](x)


# ---- nl.tfloat32 --------------------------------------------------------------------------------


def _tf32_reference(v: float) -> float:
    """``v`` rounded to a 10-bit mantissa with fp32's exponent range, ties to even (Python's round is)."""
    if math.isnan(v) or math.isinf(v) or v == 0:
        return v
    e = max(math.frexp(abs(v))[1] - 1, -126)  # binary exponent; subnormals share the lowest one
    q = math.ldexp(round(math.ldexp(abs(v), 10 - e)), e - 10)
    return math.copysign(q if q < 2.0**128 else math.inf, v)


def test_tf32_rounding_edges():
    ulp = 2.0**-10
    edges = [1.0, 1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2**-20, -(1 + ulp / 2), 2 - ulp / 4,
             3.4028234663852886e38, 3.3895313892515355e38, 1.1754943508222875e-38, 1e-40, 2.0**-149,
             2.0**-149 * 4097, -0.0, math.inf, -math.inf]
    x = torch.tensor(edges, dtype=torch.float32)
    got = round_tf32(x).tolist()
    want = [_tf32_reference(struct.unpack("f", struct.pack("f", v))[0]) for v in edges]
    assert got == want
    assert got[1] == 1.0 and got[2] == 1 + 2 * ulp  # ties go to the even mantissa
    assert math.isinf(got[6])                      # past the largest TF32 value: inf, as RNE overflows
    assert math.copysign(1, got[12]) < 0           # -0.0 stays negative
    nan = torch.tensor([float("nan"), -float("nan")]).view(torch.int32) | 1  # payload only in the dropped bits
    rounded = round_tf32(nan.view(torch.float32))
    assert torch.isnan(rounded).all() and (rounded.view(torch.int32) & 0x1FFF == 0).all()
    many = torch.from_numpy(_f32(4096) * 1e3)
    assert round_tf32(many).tolist() == [_tf32_reference(v) for v in many.tolist()]


@nki.jit
def tf32_matmul(a, b, dtype):
    out = nl.ndarray((a.shape[1], b.shape[1]), nl.float32, buffer=nl.shared_hbm)
    at = nl.ndarray(a.shape, dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=at, src=a)
    bt = nl.ndarray(b.shape, dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=bt, src=b)
    acc = nl.ndarray((a.shape[1], b.shape[1]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=at, moving=bt)
    nl.store(out, nl.copy(acc))
    return out


def test_tf32_matmul_rounds_its_inputs_and_runs_at_the_bf16_rate():
    a, b = _f32(128, 128), _f32(128, 512)
    rep = nki.profile(tf32_matmul)(a, b, nl.tfloat32)
    ta, tb = round_tf32(torch.from_numpy(a)).double(), round_tf32(torch.from_numpy(b)).double()
    ref = (ta.T @ tb).numpy()
    bound = 128 * 2**-24 * (ta.abs().T @ tb.abs()).numpy()  # exact products, fp32 accumulation
    assert np.all(np.abs(rep.outputs - ref) <= bound)
    assert np.abs(rep.outputs - a.astype(np.float64).T @ b).max() > 100 * bound.max() / 128  # not the fp32 product

    def matmul_ns(dtype):
        rep = nki.profile(tf32_matmul)(a, b, dtype)
        (i,) = [k for k, ins in enumerate(rep.program.instructions) if ins.opcode == "nc_matmul"]
        return rep.end_ns[i] - rep.start_ns[i]

    assert matmul_ns(nl.tfloat32) == matmul_ns(nl.bfloat16)
    assert matmul_ns(nl.float32) == pytest.approx(4 * matmul_ns(nl.tfloat32))  # fp32_factor: 20 vs 79 TFLOPS


def test_tf32_tiles_hold_tf32_values_written_by_any_engine():
    @nki.jit
    def scaled(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, nl.tfloat32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=t, data=nl.load(x), op0=nl.multiply, operand0=3.0)
        nl.store(out, t)
        return out

    x = _f32(64, 256)
    want = round_tf32(torch.from_numpy(x) * 3.0).numpy()
    np.testing.assert_array_equal(scaled(x), want)


def test_a_launch_pickles_and_traces_one_process_per_core(tmp_path):
    import json
    import pickle

    a, b = _f32(128, 128), _f32(128, 1024)
    rep = nki.profile(split_matmul[2])(a, b)
    again = pickle.loads(pickle.dumps(rep.program))
    assert again.schedule(TRN2).device_time_ns == rep.device_time_ns
    trace = json.load(open(rep.to_chrome_trace(str(tmp_path / "t.json"))))["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {"trn2 NeuronCore 0", "trn2 NeuronCore 1"}
    assert {e["pid"] for e in trace if e.get("ph") == "X"} == {0, 1}


@pytest.mark.skipif(not torch.neuron.is_available(), reason="needs the neuron device")
def test_on_neuron_tensors_a_grid_is_one_launch_timed_as_the_multi_core_one():
    a, b = _f32(128, 128), _f32(128, 1024)
    cpu = nki.profile(split_matmul[2])(a, b)
    dev = nki.profile(split_matmul[2])(torch.from_numpy(a).to("neuron"), torch.from_numpy(b).to("neuron"))
    assert dev.device_time_ns == pytest.approx(cpu.device_time_ns)
    np.testing.assert_array_equal(dev.outputs.cpu().numpy(), cpu.outputs)
    x = _f32(256, 64)
    for kernel in (swap_halves[2], doubled_then_other_half[2]):  # data moved between the cores
        cpu = nki.profile(kernel)(x)
        dev = nki.profile(kernel)(torch.from_numpy(x).to("neuron"))
        assert dev.device_time_ns == pytest.approx(cpu.device_time_ns)
        np.testing.assert_array_equal(dev.outputs.cpu().numpy(), cpu.outputs)
    with pytest.raises(NotImplementedError, match="on several collective ranks"):
        K.spmd_scale.ranks(2)(torch.from_numpy(_f32(2, 64, 8)).to("neuron"), 2.0)


def test_dynamic_loops_on_two_cores_time_each_core_by_its_own_run():
    from tests.nki.test_dynamic_loops import repeat_add as shared

    repeat_add = nki.jit(shared.fn)  # a kernel object of its own (that test counts the shared one's traces)
    x = _f32(64, 128)
    one = nki.profile(repeat_add)(x, np.array([[3]], np.int32))
    two = nki.profile(repeat_add[2])(x, np.array([[3]], np.int32))
    np.testing.assert_array_equal(two.outputs, one.outputs)
    assert two.device_time_ns == pytest.approx(one.device_time_ns)  # the same loop on each core, concurrently
