"""torch.profiler on neuron: each kernel launch is a device event of its simulated device time.

The reference is the runtime's own launch log (``torchneuron.runtime.profiler.record()``): every
launch made inside ``torch.profiler.profile`` must appear once as a PrivateUse1 device event on its
stream, lasting the recorded device time, linked to the op that launched it; the exported trace
must follow the Chrome trace event format (JSON object, ``traceEvents`` with ph/ts/dur/pid/tid).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

import torchneuron._C as _C
from torchneuron.runtime import profiler as launch_log

# the trace stores microseconds with three decimals and the kernel's end is placed on whole ns
TOL_US = 2e-3


def _workload() -> torch.Tensor:
    x = torch.randn(64, 64, device="neuron")
    return (x @ x).relu().sum()


def _profiled(activities=None, **kwargs):
    _workload()  # kernels built before profiling: the profile holds launches, not compilation
    with launch_log.record() as records:
        with profile(activities=activities, **kwargs) as prof:
            _workload()
    return prof, records


def _device_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == DeviceType.PrivateUse1]


def test_each_launch_is_a_device_event_of_its_device_time():
    prof, records = _profiled()
    assert records, "the workload launched no kernel"
    events = sorted(_device_events(prof), key=lambda e: e.time_range.start)
    assert [e.name for e in events] == [r.name for r in records]
    for e, r in zip(events, records):
        assert e.time_range.elapsed_us() == pytest.approx(r.device_time_ns / 1000, abs=TOL_US)
        assert e.device_index == r.device


def test_kernels_are_linked_to_the_launching_op():
    prof, records = _profiled()
    linked = {k.name: fe.name for fe in prof.events() if fe.device_type == DeviceType.CPU for k in fe.kernels}
    assert set(linked) == {r.name for r in records}
    for r in records:
        # the record names the op as the kernel registration does (aten::mm or aten.relu.default)
        op = r.op.replace(".", "::", 1).rsplit(".", 1)[0]
        assert linked[r.name] == op, (r.name, r.op, linked[r.name])


def test_key_averages_have_neuron_device_time_columns():
    prof, records = _profiled()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=20)
    header = table.splitlines()[1]
    for column in ("Self NEURON", "Self NEURON %", "NEURON total", "NEURON time avg"):
        assert column in header
    averages = {a.key: a for a in prof.key_averages()}
    for r in records:
        assert averages[r.name].self_device_time_total == pytest.approx(r.device_time_ns / 1000, abs=TOL_US)
    total = sum(r.device_time_ns for r in records) / 1000
    assert f"Self NEURON time total: {total:.3f}us" in table


def _check_chrome_trace(path: Path, records) -> dict:
    trace = json.loads(path.read_text())
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    for e in trace["traceEvents"]:
        assert {"ph", "pid", "name"} <= e.keys(), e
        if e["ph"] == "X":
            assert {"ts", "dur", "tid"} <= e.keys(), e
            assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    assert [k["name"] for k in kernels] == [r.name for r in records]
    cpu_ops = {e["args"]["External id"]: e for e in trace["traceEvents"]
               if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    for k, r in zip(kernels, records):
        assert k["dur"] == pytest.approx(r.device_time_ns / 1000, abs=TOL_US)
        assert (k["pid"], k["tid"]) == (r.device, r.stream)
        assert k["args"]["device time ns"] == pytest.approx(r.device_time_ns)
        assert k["args"]["device"] == r.device  # an int, as on CUDA (TensorBoard's plugin reads it)
        launcher = cpu_ops[k["args"]["External id"]]
        assert launcher["ts"] <= k["ts"]  # a kernel starts after the op that launched it began
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert (0, "neuron:0") in names
    return trace


def test_export_chrome_trace_format(tmp_path):
    prof, records = _profiled()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    _check_chrome_trace(path, records)


def test_tensorboard_trace_handler_writes_a_trace(tmp_path):
    _workload()
    with profile(schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(tmp_path), worker_name="w0")) as prof:
        _workload()  # warmup step: not in the trace
        prof.step()
        with launch_log.record() as records:
            _workload()
        prof.step()
    files = list(tmp_path.glob("w0.*.pt.trace.json"))
    assert len(files) == 1, list(tmp_path.iterdir())
    _check_chrome_trace(files[0], records)


def test_tensorboard_profiler_plugin_reads_the_kernels(tmp_path):
    """TensorBoard's PyTorch profiler plugin (torch-tb-profiler) parses the trace and lists the kernels."""
    pytest.importorskip("torch_tb_profiler")
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    _workload()
    with profile(schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(tmp_path), worker_name="w0")) as prof:
        _workload()
        prof.step()
        with launch_log.record() as records:
            _workload()
        prof.step()
    (path,) = tmp_path.glob("w0.*.pt.trace.json")
    data = RunProfileData.parse("w0", None, str(path), str(tmp_path / "cache"))
    data.analyze()
    run = RunGenerator("w0", None, data).generate_run_profile()
    assert "kernel" in {v.name for v in run.views}
    kernels = {k.name: k for k in data.kernel_list_groupby_name_op}
    expected: dict[str, list[float]] = {}
    for r in records:
        expected.setdefault(r.name, []).append(r.device_time_ns / 1000)
    assert set(kernels) == set(expected)
    for name, times in expected.items():
        assert kernels[name].calls == len(times)
        assert kernels[name].total_duration == pytest.approx(sum(times), abs=TOL_US * len(times))


def test_kernels_stay_in_order_on_their_stream():
    _workload()
    side = torch.Stream(device="neuron")
    with launch_log.record() as records:
        with profile() as prof:
            _workload()
            with side:
                _workload()
            _workload()
    events = _device_events(prof)
    assert len(events) == len(records)
    by_stream: dict[int, list] = {}
    for e, r in zip(sorted(events, key=lambda e: e.time_range.start), records):
        by_stream.setdefault(r.stream, []).append(e)
    assert set(by_stream) == {torch.neuron.current_stream().stream_id, side.stream_id}
    for evs in by_stream.values():
        for a, b in zip(evs, evs[1:]):
            assert b.time_range.start >= a.time_range.end


def test_cpu_only_profile_records_no_device_activity():
    _workload()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert not _C._profiler_recording()
        _workload()
    assert _device_events(prof) == []
    assert not _C._profiler_recording()


def test_legacy_autograd_profiler_times_ops_on_the_stream_clock():
    """torch.autograd.profiler.profile(use_device="neuron"): an op's device time is how far its launches
    advanced the stream clock (kernel plus launch overhead), in whole microseconds as the profiler keeps it."""
    _workload()
    with launch_log.record() as records:
        with torch.autograd.profiler.profile(use_device="neuron") as prof:
            _workload()
    ranges = sorted((e for e in prof.function_events if e.name.startswith("neuron::")), key=lambda e: e.time_range.start)
    assert [e.name for e in ranges] == [f"neuron::{r.name}" for r in records]
    for e, r in zip(ranges, records):
        assert e.self_device_time_total == pytest.approx((r.end_ns - r.start_ns) // 1000, abs=1)
    assert "Self NEURON" in prof.key_averages().table()
