"""Profiler records of kernel launches, and their Chrome trace.

Every ``torchneuron.runtime.launch`` appends a ``LaunchRecord`` (kernel name, op, device,
stream, start/end on the stream's device clock in simulated ns, per-engine busy time,
FLOPs, HBM bytes read and written). The API::

    from torchneuron.runtime import profiler
    profiler.records()            # the records kept since the last clear(), oldest first
    profiler.clear()              # forget them
    with profiler.record() as rs: # rs: a list that collects the records of the block
        ...
    profiler.to_chrome_trace("trace.json", rs, instructions=True)

The process-wide list keeps the latest ``MAX_RECORDS`` launches (a long eager run does not
grow without bound); ``record()`` keeps every launch of its block. Records never hold the
launch's tensors. While a profiler is active, each launch also shows up in ``torch.profiler``
traces as a host range named ``neuron::<kernel>`` (a ``record_function`` around the launch's
host work; none is opened otherwise, to keep small launches cheap) and, when the profile
records device activity, as a kernel of its simulated device time on the device's stream row,
linked to the launching op (``_csrc/profiler.cpp``, Kineto's PrivateUse1 activity profiler).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
from typing import TYPE_CHECKING, Iterable, Iterator

from torchneuron import _C
from torchneuron.runtime.record import LaunchRecord
from torchneuron.sim import Program
from torchneuron.sim.specs import ChipSpec

if TYPE_CHECKING:
    from torchneuron.sim.timing import Timeline

MAX_RECORDS = 10_000

_lock = threading.Lock()
# records, and launches whose record is not made yet (``_add_launch``: a tuple of its fields)
_records: collections.deque[LaunchRecord | tuple] = collections.deque(maxlen=MAX_RECORDS)
_collectors: list[list[LaunchRecord]] = []


def _add(record: LaunchRecord) -> None:
    record = record.without_outputs()
    if _C._profiler_recording():  # a torch.profiler session records device activity
        _device_activity(record)
    with _lock:
        _records.append(record)
        for c in _collectors:
            c.append(record)


def _add_launch(name: str, op: str | None, device: int, stream: int, start_ns: int, end_ns: int,
                launch_overhead_ns: float, device_time_ns: float, program: Program, spec: ChipSpec,
                schedule: Timeline) -> None:
    """The fast path's ``_add``: a launch's record is only made when something reads it (``records()``),
    or at once while a ``record()`` block collects or a torch.profiler session records device activity.
    ``schedule`` is the program's schedule the launch ran (a dynamic program's changes with each run)."""
    fields = (name, op, device, stream, start_ns, end_ns, launch_overhead_ns, device_time_ns, program, spec,
              schedule)
    if _collectors or _C._profiler_recording():
        _add(_made(fields))
        return
    with _lock:
        _records.append(fields)


def _made(fields: tuple) -> LaunchRecord:
    """The record of a launch ``_add_launch`` kept as its fields."""
    name, op, device, stream, start_ns, end_ns, overhead, device_time, program, spec, schedule = fields
    return LaunchRecord._fast(name=name, op=op, device=device, stream=stream, start_ns=start_ns, end_ns=end_ns,
                              launch_overhead_ns=overhead, device_time_ns=device_time, program=program, spec=spec,
                              outputs={}, schedule=schedule)


def _device_activity(record: LaunchRecord) -> None:
    """Hand the launch to the recording torch.profiler session: a kernel on its stream, linked to the launching op."""
    _C._profiler_add_launch(record.name, record.op or "", record.device, record.stream, record.start_ns,
                            record.end_ns, float(record.launch_overhead_ns), float(record.device_time_ns),
                            int(record.flops), int(record.hbm_bytes_read), int(record.hbm_bytes_written),
                            int(record.instructions))


def records() -> list[LaunchRecord]:
    """The launch records kept since the last ``clear()`` (at most MAX_RECORDS, oldest first)."""
    with _lock:
        if any(type(r) is tuple for r in _records):  # make the deferred records, once (the same objects each call)
            made = [_made(r) if type(r) is tuple else r for r in _records]
            _records.clear()
            _records.extend(made)
        return list(_records)


_kept = records  # chrome_trace's parameter shadows the name


def clear() -> None:
    """Forget the kept launch records (lists handed out by ``record()`` are not touched)."""
    with _lock:
        _records.clear()


@contextlib.contextmanager
def record() -> Iterator[list[LaunchRecord]]:
    """``with record() as rs:`` — ``rs`` receives the record of every launch made in the block
    (by any thread); it stops growing when the block ends. Blocks may nest."""
    collected: list[LaunchRecord] = []
    with _lock:
        _collectors.append(collected)
    try:
        yield collected
    finally:
        with _lock:
            _collectors.remove(collected)


def _us(ns: float) -> float:
    return ns / 1000.0


def chrome_trace(records: Iterable[LaunchRecord] | None = None, *, instructions: bool = False) -> dict:
    """The Chrome trace (``chrome://tracing`` / Perfetto JSON object format) of ``records``
    (default: ``records()``).

    One process per device (``neuron:<i>``), one thread track per stream (``stream <id>``)
    holding one complete ("X") event per launch, spanning launch overhead plus kernel;
    ``args`` carry op, device time, overhead, engine busy ns, FLOPs and HBM bytes. With
    ``instructions=True`` each stream also gets a track per engine (and per DMA queue) with
    one event per instruction, placed after the launch overhead. Timestamps are
    microseconds of the simulated stream clock.
    """
    recs = list(records) if records is not None else _kept()
    events: list[dict] = []
    tracks: dict[tuple[int, str], int] = {}  # (device, track name) -> tid, numbered per device
    devices: set[int] = set()
    per_device: collections.Counter[int] = collections.Counter()

    def tid(device: int, track: str) -> int:
        key = (device, track)
        if key not in tracks:
            tracks[key] = per_device[device]
            per_device[device] += 1
        return tracks[key]

    for r in recs:
        devices.add(r.device)
        stream_track = f"stream {r.stream}"
        events.append({
            "name": r.name, "cat": "kernel", "ph": "X", "pid": r.device, "tid": tid(r.device, stream_track),
            "ts": _us(r.start_ns), "dur": _us(r.end_ns - r.start_ns),
            "args": {"op": r.op, "stream": r.stream, "start_ns": r.start_ns, "end_ns": r.end_ns,
                     "device_time_ns": r.device_time_ns, "launch_overhead_ns": r.launch_overhead_ns,
                     "engine_busy_ns": dict(r.engine_busy_ns), "flops": r.flops,
                     "hbm_bytes_read": r.hbm_bytes_read, "hbm_bytes_written": r.hbm_bytes_written,
                     "instructions": r.instructions},
        })
        if instructions:
            for ev in r.instruction_events():
                engine = f"{ev.engine} q{ev.queue}" if ev.engine == "dma" else ev.engine
                events.append({
                    "name": ev.opcode, "cat": "instruction", "ph": "X", "pid": r.device,
                    "tid": tid(r.device, f"{stream_track} / {engine}"), "ts": _us(ev.start_ns),
                    "dur": _us(ev.end_ns - ev.start_ns), "args": {"kernel": r.name, "index": ev.index},
                })
    meta = [{"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"neuron:{d}"}} for d in sorted(devices)]
    for (d, track), t in tracks.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": d, "tid": t, "args": {"name": track}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": d, "tid": t, "args": {"sort_index": t}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ns",
            "otherData": {"clock": "simulated NeuronCore stream clock"}}


def to_chrome_trace(path: str | os.PathLike, records: Iterable[LaunchRecord] | None = None, *,
                    instructions: bool = False) -> dict:
    """Write ``chrome_trace(records, instructions=...)`` as JSON to ``path``; return the trace."""
    trace = chrome_trace(records, instructions=instructions)
    with open(path, "w") as f:
        json.dump(trace, f)
    return trace
