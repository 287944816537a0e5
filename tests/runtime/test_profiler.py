"""Profiler records of launches, the Chrome trace, and torch.profiler annotations."""
from __future__ import annotations

import collections
import json

import pytest
import torch

from torchneuron.runtime import LaunchRecord, launch, profiler

from .conftest import clock, operands

pytestmark = pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")


def test_records_and_clear(add):
    _, _, args = operands()
    profiler.clear()
    assert profiler.records() == []
    r1 = launch(add, args, op="aten::add.Tensor")
    r2 = launch(add, args, name="add2")
    recs = profiler.records()
    assert recs == [r1, r2] and all(isinstance(r, LaunchRecord) for r in recs)
    assert recs[0].op == "aten::add.Tensor" and recs[1].name == "add2"
    assert recs[0].outputs == {} and r1.outputs["out"] is args["out"]  # records keep no tensors
    assert recs[1].start_ns == recs[0].end_ns
    profiler.clear()
    assert profiler.records() == []


def test_record_collects_only_its_block_and_nests(add):
    _, _, args = operands()
    launch(add, args)
    with profiler.record() as outer:
        r1 = launch(add, args)
        with profiler.record() as inner:
            r2 = launch(add, args)
        r3 = launch(add, args)
    launch(add, args)
    assert outer == [r1, r2, r3] and inner == [r2]


def test_kept_records_are_bounded(add, monkeypatch):
    monkeypatch.setattr(profiler, "_records", collections.deque(maxlen=2))
    _, _, args = operands()
    rs = [launch(add, args) for _ in range(3)]
    assert profiler.records() == rs[1:]


def test_chrome_trace_matches_the_launches(add, tmp_path):
    _, _, args = operands()
    _, _, args1 = operands("neuron:1")
    s = torch.neuron.Stream()
    with profiler.record() as recs:
        launch(add, args, op="aten::add.Tensor")
        with torch.neuron.stream(s):
            launch(add, args)
        launch(add, args1)
    path = tmp_path / "trace.json"
    returned = profiler.to_chrome_trace(path, recs, instructions=True)
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(returned))
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert procs == {0: "neuron:0", 1: "neuron:1"}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(kernels) == 3
    for e, r in zip(kernels, recs):
        assert e["name"] == r.name and e["ph"] == "X" and e["pid"] == r.device
        assert names[(e["pid"], e["tid"])] == f"stream {r.stream}"
        assert e["ts"] == pytest.approx(r.start_ns / 1000) and e["dur"] == pytest.approx(r.duration_ns / 1000)
        assert e["args"]["device_time_ns"] == r.device_time_ns and e["args"]["flops"] == r.flops
        assert e["args"]["hbm_bytes_read"] == r.hbm_bytes_read and e["args"]["op"] == r.op
    assert kernels[0]["tid"] != kernels[1]["tid"]  # two streams, two tracks
    instrs = [e for e in events if e.get("cat") == "instruction"]
    assert len(instrs) == 3 * 4
    for k, r in zip(kernels, recs):
        mine = [e for e in instrs if e["pid"] == r.device and e["args"]["kernel"] == r.name
                and names[(e["pid"], e["tid"])].startswith(f"stream {r.stream} / ")]
        assert [e["name"] for e in sorted(mine, key=lambda e: e["args"]["index"])] == \
            ["dma_copy", "dma_copy", "tensor_tensor", "dma_copy"]
        assert {names[(e["pid"], e["tid"])].split(" / ")[1] for e in mine} == {"dma q0", "dma q1", "vector"}
        for e in mine:  # nested in the kernel's span, after the launch overhead
            assert r.kernel_start_ns / 1000 - 1e-6 <= e["ts"] and e["ts"] + e["dur"] <= k["ts"] + k["dur"] + 1e-3
        assert max(e["ts"] + e["dur"] for e in mine) == pytest.approx((r.kernel_start_ns + r.device_time_ns) / 1000)
    plain = profiler.chrome_trace(recs)
    assert not [e for e in plain["traceEvents"] if e.get("cat") == "instruction"]


def test_instruction_events_match_engine_busy_time(add):
    _, _, args = operands()
    rec = launch(add, args)
    evs = list(rec.instruction_events())
    assert len(evs) == rec.instructions
    busy = collections.Counter()
    for e in evs:
        busy[e.engine] += e.end_ns - e.start_ns
    for engine, ns in rec.engine_busy_ns.items():
        if engine == "dma":  # DMA busy time: while any transfer is in flight (queues overlap)
            spans = sorted((e.start_ns, e.end_ns) for e in evs if e.engine == "dma")
            union, reach = 0.0, float("-inf")
            for s, t in spans:
                union += max(0.0, t - max(s, reach))
                reach = max(reach, t)
            assert union == pytest.approx(ns) and busy[engine] > ns  # the two loads overlap
        else:
            assert busy[engine] == pytest.approx(ns)
    assert rec.start_ns <= min(e.start_ns for e in evs) and max(e.end_ns for e in evs) <= rec.end_ns + 1


def test_launch_shows_up_in_torch_profiler(add):
    _, _, args = operands()
    before = clock(torch.neuron.current_stream())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        launch(add, args, name="add_profiled")
    assert "neuron::add_profiled" in {e.name for e in prof.events()}
    assert clock(torch.neuron.current_stream()) > before


def test_the_fast_paths_records_are_made_when_read_and_keep_each_launchs_schedule():
    # launch_slots keeps a launch's fields and makes its record when records() reads it: the same record as a
    # collected launch's (made at once), the same objects on every read; a program with a dynamic loop is timed
    # per run, so each deferred record keeps the schedule of its own run, not the program's latest
    from torchneuron import runtime
    from torchneuron.runtime.launch import launch_slots
    from tests.nki.test_dynamic_loops import repeat_add
    x = torch.randn(64, 128, device="neuron")
    counts = {n: torch.tensor([[n]], dtype=torch.int32).to("neuron") for n in (1, 4)}
    program = repeat_add.trace((), {"x": x, "count": counts[1]}, runtime.core(0).spec).program
    assert program.dynamic and [s.name for s in program.args][:2] == ["x", "count"]

    def run(n: int) -> torch.Tensor:
        out = launch_slots(program, [x, counts[n], None], 0, "test::repeat_add")[2]
        torch.testing.assert_close(out.cpu(), n * x.cpu(), rtol=0, atol=0)   # n exact additions of x
        return out
    profiler.clear()
    for n in (1, 4):
        run(n)
    deferred = profiler.records()
    assert all(isinstance(r, LaunchRecord) for r in deferred) and len(deferred) == 2
    assert all(a is b for a, b in zip(profiler.records(), deferred))
    with profiler.record() as collected:
        for n in (1, 4):
            run(n)
    assert profiler.records()[2:] == collected
    for d, c in zip(deferred, collected):
        assert (d.name, d.op, d.device, d.stream, d.duration_ns, d.device_time_ns, d.engine_busy_ns) == \
               (c.name, c.op, c.device, c.stream, c.duration_ns, c.device_time_ns, c.engine_busy_ns)
    assert deferred[0].device_time_ns < deferred[1].device_time_ns
    assert deferred[0].end_ns == deferred[1].start_ns and deferred[1].end_ns == collected[0].start_ns
