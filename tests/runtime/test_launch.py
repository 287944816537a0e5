"""Kernel launch: zero-copy binding of neuron tensors, results, stream clocks, devices, errors."""
from __future__ import annotations

import threading

import pytest
import torch

from torchneuron import runtime
from torchneuron.config import CONFIG
from torchneuron.runtime import launch, profiler
from torchneuron.sim import ArgSlot, NeuronCore, Program, tile

from .conftest import F32, SHAPE, add_program, clock, operands

pytestmark = pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")

OVERHEAD = CONFIG.chip.runtime.kernel_launch_overhead_ns


def test_result_matches_cpu_and_is_written_in_place(add):
    a, b, args = operands()
    out = args["out"]
    ptr = out.data_ptr()
    rec = launch(add, args)
    assert out.data_ptr() == ptr and rec.outputs["out"] is out
    assert torch.equal(out.cpu(), a + b)
    assert torch.equal(args["a"].cpu(), a) and torch.equal(args["b"].cpu(), b)  # inputs untouched
    assert rec.name == "add" and rec.op is None and rec.device == 0
    assert rec.stream == torch.neuron.default_stream(0).stream_id
    assert rec.flops == 128 * 512
    assert rec.hbm_bytes_read == 2 * 128 * 512 * 4 and rec.hbm_bytes_written == 128 * 512 * 4
    assert rec.instructions == 4 and rec.device_time_ns > 0
    assert rec.engine_busy_ns["dma"] > 0 and rec.engine_busy_ns["vector"] > 0


def test_program_is_reused_with_new_bindings_and_outputs_are_allocated_on_the_device(add):
    for seed in (1, 2):
        a, b, args = operands(seed=seed)
        del args["out"]
        rec = launch(add, args, name="add_again", op="aten::add.Tensor")
        out = rec.outputs["out"]
        assert out.device == torch.device("neuron", 0) and out.dtype == F32 and tuple(out.shape) == SHAPE
        assert torch.equal(out.cpu(), a + b)
        assert rec.name == "add_again" and rec.op == "aten::add.Tensor"


def test_arguments_in_slot_order_and_the_unchecked_fast_path(add):
    a, b, args = operands(seed=3)
    rec = launch(add, [args["a"], args["b"], args["out"]])  # checked, slot order
    assert torch.equal(args["out"].cpu(), a + b) and rec.outputs["out"] is args["out"]
    rec = launch(add, [args["a"], args["b"], None], op="aten::add.Tensor")  # None: allocate the output
    assert torch.equal(rec.outputs["out"].cpu(), a + b) and rec.outputs["out"].device.type == "neuron"
    s = torch.neuron.Stream()
    before = clock(s)
    out = torch.zeros(SHAPE, device="neuron")
    fast = launch(add, [args["a"], args["b"], out], check=False, stream=s, op="aten::add.Tensor")
    assert torch.equal(out.cpu(), a + b) and fast.outputs["out"] is out
    assert fast.stream == s.stream_id and clock(s) == before + fast.duration_ns
    assert fast.device_time_ns == rec.device_time_ns and fast.engine_busy_ns == rec.engine_busy_ns
    assert (fast.flops, fast.instructions) == (rec.flops, rec.instructions)
    assert profiler.records()[-1] == fast and profiler.records()[-1].outputs == {}
    fast = launch(add, {"a": args["a"], "b": args["b"]}, check=False, device=0)
    assert torch.equal(fast.outputs["out"].cpu(), a + b)
    _, _, args1 = operands("neuron:1")
    assert launch(add, [args1["a"], args1["b"], None], check=False).device == 1  # the tensors' device
    with pytest.raises(TypeError, match="one per slot"):
        launch(add, [args["a"], args["b"]])
    with pytest.raises(TypeError, match="missing input"):
        launch(add, [args["a"], None, None])


def test_records_fields_match_the_programs_static_facts(add):
    _, _, args = operands()
    rec = launch(add, args)
    sched = add.schedule(rec.spec)
    assert rec.engine_busy_ns == sched.engine_busy_ns and rec.engine_busy_ns is not sched.engine_busy_ns
    assert rec.device_time_ns == sched.device_time_ns and rec.flops == add.flops
    assert (rec.hbm_bytes_read, rec.hbm_bytes_written) == (add.hbm_bytes_read, add.hbm_bytes_written)
    assert rec.without_outputs() == rec and rec.without_outputs().outputs == {} and rec.outputs


def test_event_measures_device_time_plus_launch_overhead(add):
    _, _, args = operands()
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    rec = launch(add, args)
    end.record()
    assert rec.launch_overhead_ns == OVERHEAD
    assert rec.end_ns - rec.start_ns == round(rec.device_time_ns + OVERHEAD)
    assert start.elapsed_time(end) == (rec.end_ns - rec.start_ns) / 1e6
    assert start.elapsed_time(end) == pytest.approx((rec.device_time_ns + OVERHEAD) / 1e6, abs=1e-6)
    # a small eager kernel is launch-bound: the overhead dominates its stream time
    assert rec.device_time_ns < OVERHEAD


def test_launches_on_one_stream_serialize(add):
    _, _, args = operands()
    s = torch.neuron.current_stream()
    t0 = clock(s)
    r1 = launch(add, args)
    r2 = launch(add, args)
    assert r1.start_ns == t0 and r2.start_ns == r1.end_ns
    assert clock(s) == r2.end_ns == t0 + r1.duration_ns + r2.duration_ns
    assert r1.duration_ns == r2.duration_ns  # the same program costs the same time


def test_launch_on_a_second_stream_advances_only_that_stream(add):
    _, _, args = operands()
    default = torch.neuron.default_stream()
    s = torch.neuron.Stream()
    t_default, t_s = clock(default), clock(s)
    with torch.neuron.stream(s):
        rec = launch(add, args)
    assert rec.stream == s.stream_id and rec.start_ns == t_s
    assert clock(s) == t_s + rec.duration_ns and clock(default) == t_default
    # an explicit stream argument does the same without making it current
    rec2 = launch(add, args, stream=s)
    assert rec2.stream == s.stream_id and clock(s) == rec2.end_ns and clock(default) == t_default


def test_launch_on_device_1_uses_device_1s_core(add, monkeypatch):
    a, b, args = operands("neuron:1")
    core0, core1 = runtime.core(0), runtime.core(1)
    assert core0 is not core1 and isinstance(core1, NeuronCore) and core1.spec == CONFIG.chip
    assert runtime.core("neuron:1") is core1 and runtime.core(torch.device("neuron", 1)) is core1
    ran = []
    for i, c in ((0, core0), (1, core1)):
        monkeypatch.setattr(c, "run_bound", lambda *x, _i=i, _run=c.run_bound, **k: ran.append(_i) or _run(*x, **k))
    d0, d1 = torch.neuron.current_stream(0), torch.neuron.current_stream(1)
    t0, t1 = clock(d0), clock(d1)
    rec = launch(add, args)
    assert ran == [1] and rec.device == 1 and rec.stream == d1.stream_id
    assert torch.equal(args["out"].cpu(), a + b)
    assert clock(d1) == t1 + rec.duration_ns and clock(d0) == t0
    assert torch.neuron.current_device() == 0
    with pytest.raises(RuntimeError, match="Invalid device index"):
        runtime.core(torch.neuron.device_count())


def _bad_cases():
    def cpu(args):
        args["a"] = args["a"].cpu()

    def dtype(args):
        args["b"] = args["b"].double()

    def out_dtype(args):
        args["out"] = args["out"].half()

    def shape(args):
        args["a"] = torch.zeros(128, 256, device="neuron:0")

    def missing(args):
        del args["b"]

    def unknown(args):
        args["c"] = args["a"]

    def not_tensor(args):
        args["a"] = 1.0

    def mixed_devices(args):
        args["out"] = args["out"].to("neuron:1")

    def non_contiguous(args):
        args["b"] = torch.zeros(512, 128, device="neuron:0").t()

    return [(cpu, RuntimeError, "neuron device.*'a' is on cpu"), (dtype, TypeError, "'b' expects dtype torch.float32"),
            (out_dtype, TypeError, "'out' expects dtype"), (shape, ValueError, r"'a' expects shape \[128, 512\]"),
            (missing, TypeError, "missing input.*'b'"), (unknown, TypeError, "unexpected argument.*'c'"),
            (not_tensor, TypeError, "'a' must be a Tensor"), (mixed_devices, RuntimeError, "same device"),
            (non_contiguous, ValueError, "'b' must be contiguous")]


@pytest.mark.parametrize("mutate,exc,match", _bad_cases(), ids=lambda v: getattr(v, "__name__", None))
def test_bad_inputs_raise_and_change_nothing(add, mutate, exc, match):
    _, _, args = operands()
    mutate(args)
    streams = [torch.neuron.current_stream(i) for i in range(2)]
    before = [clock(s) for s in streams]
    outs = {k: v.cpu().clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    n = len(profiler.records())
    with pytest.raises(exc, match=match):
        launch(add, args)
    assert [clock(s) for s in streams] == before
    for k, v in outs.items():
        assert torch.equal(args[k].cpu(), v)
    assert len(profiler.records()) == n


def test_bad_launch_arguments(add):
    _, _, args = operands()
    before = clock(torch.neuron.current_stream(0))
    with pytest.raises(TypeError, match="Program"):
        launch("add", args)
    with pytest.raises(TypeError, match="dict"):
        launch(add, [args["a"], args["b"]])
    with pytest.raises(RuntimeError, match="stream is on neuron:1"):
        launch(add, args, stream=torch.neuron.default_stream(1))
    with pytest.raises(RuntimeError, match="same device"):
        launch(add, args, device="neuron:1")
    with pytest.raises(ValueError, match="neuron device"):
        launch(add, args, device="cpu")
    assert clock(torch.neuron.current_stream(0)) == before


def test_scratch_and_program_without_inputs():
    prog = Program([], [ArgSlot("tmp", (4,), F32, "scratch"), ArgSlot("o", (2, 2), F32, "output")], "empty")
    rec = launch(prog, {})  # no tensors: the current device
    assert rec.device == torch.neuron.current_device() and rec.device_time_ns == 0
    assert rec.duration_ns == round(OVERHEAD) and rec.outputs["o"].device.type == "neuron"
    assert set(rec.outputs) == {"o"}
    prog2 = add_program(name="add_bf16", dtype=torch.bfloat16)
    a, b, args = operands(dtype=torch.bfloat16)
    launch(prog2, args)
    torch.testing.assert_close(args["out"].cpu(), a + b)


def test_a_simulator_error_is_raised_as_the_pytorch_exception_of_its_type():
    from torchneuron.kernels.indexing import gather_rows
    from torchneuron.sim import IndexOutOfRange
    table = torch.arange(12, dtype=torch.float32).reshape(4, 3).to("neuron")
    index = torch.tensor([1, 4], dtype=torch.int32).to("neuron")      # row 4 of a 4-row table
    program = gather_rows.trace((), {"table": table, "index": index}, runtime.core(0).spec).program
    with pytest.raises(IndexError, match="is outside the 4 rows") as e:
        launch(program, {"table": table, "index": index})
    assert isinstance(e.value.__cause__, IndexOutOfRange)
    index = torch.tensor([3, 0], dtype=torch.int32).to("neuron")      # the next launch is unharmed
    rec = launch(program, {"table": table, "index": index})
    torch.testing.assert_close(next(iter(rec.outputs.values())).cpu(), table.cpu()[[3, 0]])


def test_a_neuron_tensors_memory_binds_to_a_core_without_a_copy():
    x = torch.zeros(2, 4).to("neuron")
    core = NeuronCore("trn2")
    core.bind("x", runtime.host_memory(x))
    tile("hbm:x", torch.float32, (2, 4)).write(core, torch.arange(8.0).reshape(2, 4))
    assert torch.equal(x.cpu(), torch.arange(8.0).reshape(2, 4))


def test_timing_only_advances_clocks_and_records_without_executing(add):
    # the schedule does not depend on the data: the same clock advance and record, the output untouched
    a, b, args = operands(seed=5)
    rec = launch(add, args)
    out = torch.zeros(SHAPE, device="neuron")
    s = torch.neuron.current_stream()
    before = clock(s)
    with runtime.timing_only():
        timed = launch(add, {"a": args["a"], "b": args["b"], "out": out})
        # (per thread: another thread's launches execute)
        seen = []
        th = threading.Thread(target=lambda: seen.append(launch(add, args).outputs["out"].cpu()))
        th.start()
        th.join()
    assert torch.equal(out.cpu(), torch.zeros(SHAPE)) and torch.equal(seen[0], a + b)
    assert timed.device_time_ns == rec.device_time_ns and clock(s) >= before + timed.duration_ns
    assert profiler.records()[-2] == timed.without_outputs()
    launch(add, {"a": args["a"], "b": args["b"], "out": out})   # executes again after the block
    assert torch.equal(out.cpu(), a + b)


def test_the_fast_path_binds_a_tensor_of_the_slots_element_count_at_the_slots_shape(add):
    # launch_slots binds a contiguous tensor of another shape with the slot's element count as the slot's shape
    # (an element-wise operand read as [R, C]); a layout allocates an unbound output in another shape; a
    # non-contiguous tensor or another element count is refused before anything runs
    from torchneuron.runtime.launch import launch_slots, slot_layout
    a, b, args = operands(seed=6)
    out = launch_slots(add, [args["a"].reshape(-1), args["b"].view(512, 128), None], 0, "test::add")[2]
    assert out.device == torch.device("neuron", 0) and tuple(out.shape) == SHAPE
    assert torch.equal(out.cpu(), a + b)
    flat = slot_layout(add, {"out": (128 * 512,)})
    out = launch_slots(add, [args["a"], args["b"], None], 0, "test::add", flat)[2]
    assert tuple(out.shape) == (128 * 512,) and torch.equal(out.cpu(), (a + b).reshape(-1))
    given = torch.zeros(SHAPE, device="neuron")
    s = torch.neuron.current_stream()
    before, kept = clock(s), len(profiler.records())
    with pytest.raises(RuntimeError, match="contiguous"):
        launch_slots(add, [args["a"].t(), args["b"], given], 0, None)
    with pytest.raises(RuntimeError, match="cannot hold"):
        launch_slots(add, [args["a"][:64], args["b"], given], 0, None)
    assert clock(s) == before and len(profiler.records()) == kept and not given.cpu().any()
