"""What ``nki.profile`` reports: simulated time, traffic, engine busy time, roofline, and a Chrome trace."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from torchneuron.sim import Program, RunReport
from torchneuron.sim.specs import ChipSpec
from torchneuron.sim.timing import roofline

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


@dataclass
class ProfileReport:
    """One simulated, timed run of a kernel on a modelled chip."""

    chip: str
    device_time_ns: float
    flops: int
    hbm_bytes_read: int
    hbm_bytes_written: int
    engine_busy_ns: dict[str, float]
    achieved_tflops: float             # flops / device time
    achieved_gbps: float               # HBM bytes (read + written) / device time
    roofline_fraction: float           # roofline lower bound / device time (1.0: at the roofline)
    bound: str                         # "compute" or "memory"
    instructions: int
    program: Program = field(repr=False)
    outputs: Any = field(default=None, repr=False)  # the kernel's return value (arrays of the caller's kind)
    start_ns: list[float] = field(default_factory=list, repr=False)   # per instruction, from the kernel's start
    end_ns: list[float] = field(default_factory=list, repr=False)
    launch: Any = field(default=None, repr=False)   # the runtime LaunchRecord (profiles of neuron tensors), else None

    def to_chrome_trace(self, path: str) -> str:
        """Write the instruction timeline as Chrome trace JSON (open in Perfetto / chrome://tracing)."""
        events: list[dict] = []
        tids: dict[tuple[int, str], int] = {}
        cores = _instruction_cores(self.program)  # a multi-core launch: one process track per core
        for i, (ins, s, e) in enumerate(zip(self.program.instructions, self.start_ns, self.end_ns)):
            lane = ins.engine.value + (f".q{ins.queue}" if ins.engine.value == "dma" else "")
            pid = cores[i]
            tid = tids.setdefault((pid, lane), len(tids))
            args = {name: f"{ap!r}" for name, ap in ins.operands()}
            events.append({"name": ins.opcode, "cat": ins.engine.value, "ph": "X", "pid": pid, "tid": tid,
                           "ts": s / 1e3, "dur": max(e - s, 0.0) / 1e3, "args": {"index": i, **args}})
        meta = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": lane}}
                for (pid, lane), t in tids.items()]
        meta += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{self.chip} NeuronCore"
                  + (f" {pid}" if len(set(cores)) > 1 else "")}} for pid in sorted(set(cores))]
        with open(path, "w") as f:
            json.dump({"traceEvents": events + meta, "displayTimeUnit": "ns"}, f)
        return path


def _instruction_cores(program: Program) -> list[int]:
    """The physical core of each instruction of ``program`` (0 for all but a multi-core launch's)."""
    instances = getattr(program, "instances", None)
    if not instances:
        return [0] * len(program.instructions)
    return [program.core_of(i) for i, p in enumerate(instances) for _ in p.instructions]


def _report(outputs: Any, source: Any, program: Program, spec: ChipSpec, roof: Any, start_ns: list[float],
            end_ns: list[float], launch: Any = None) -> ProfileReport:
    # ``source`` is a RunReport or a LaunchRecord: both carry time, busy, flops, bytes and a count
    t = max(source.device_time_ns or 0.0, 1e-9)
    busy = {e: float(source.engine_busy_ns.get(e, 0.0)) for e in ENGINES}
    traffic = source.hbm_bytes_read + source.hbm_bytes_written
    return ProfileReport(outputs=outputs, chip=spec.name, device_time_ns=source.device_time_ns, flops=source.flops,
                         hbm_bytes_read=source.hbm_bytes_read, hbm_bytes_written=source.hbm_bytes_written,
                         engine_busy_ns=busy, achieved_tflops=source.flops / t / 1e3, achieved_gbps=traffic / t,
                         roofline_fraction=roof.lower_bound_ns / t, bound=roof.bound,
                         instructions=source.instructions, program=program, start_ns=start_ns, end_ns=end_ns,
                         launch=launch)


def make_report(outputs: Any, run: RunReport, program: Program, spec: ChipSpec) -> ProfileReport:
    """Build the profile of a timed run."""
    return _report(outputs, run, program, spec, run.roofline, run.start_ns, run.end_ns)


def report_from_launch(outputs: Any, record: Any) -> ProfileReport:
    """Build the profile of a runtime launch (``torchneuron.runtime.LaunchRecord``): time, busy, flops
    and bytes from the record (what the stream clock advanced by, less the launch overhead); the
    per-instruction timeline (trace) and roofline from the program's schedule on the device's chip."""
    program, spec = record.program, record.spec
    sched = program.schedule(spec)
    return _report(outputs, record, program, spec, roofline(sched, spec), list(sched.start_ns),
                   list(sched.end_ns), launch=record.without_outputs())
