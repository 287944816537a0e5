"""Compile reports and debug dumps.

Every compiled graph keeps a ``GraphReport``: its segments, fusion groups, library kernels and
eager nodes, and per traced program its instruction count, HBM traffic, simulated device time and
the host time each stage took. ``torchneuron.compiler.reports()`` returns them.

With ``TORCHNEURON_DUMP_DIR`` set, each graph writes a folder ``<dir>/<graph name>/`` holding
``graph.txt`` (the ATen FX graph as AOTAutograd gave it), ``fusion.txt`` (segments and fusion
groups), ``program_s<k>.txt`` (each segment program's listing: one instruction per line with its
engine and simulated start/end) and ``report.json`` (this report).
"""
from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchneuron.compiler.partition import FusionGroup, Plan

MAX_REPORTS = 256
_reports: deque = deque(maxlen=MAX_REPORTS)


@dataclass
class ProgramReport:
    """One traced segment program."""

    segment: int
    instructions: int
    hbm_bytes_read: int
    hbm_bytes_written: int
    arena_bytes: int            # the planned HBM intermediates (memory_plan): their peak
    buffer_bytes: int           # the same intermediates unplanned (one buffer each)
    flops: int
    device_time_ns: float
    trace_seconds: float


@dataclass
class GraphReport:
    """What the compiler made of one graph."""

    name: str
    nodes: int
    segments: int
    fusion_groups: int
    fused_nodes: int
    kernels: list[str]
    eager_nodes: list[str]
    partition_seconds: float
    programs: list[ProgramReport] = field(default_factory=list)
    cache_hits: int = 0
    eager_segments: int = 0

    @classmethod
    def of(cls, name: str, plan: Plan, seconds: float) -> "GraphReport":
        """The report of a freshly partitioned graph (programs are added as they are traced)."""
        groups = [it for s in plan.segments for it in s.items if isinstance(it, FusionGroup)]
        kernels = [str(it.target) for s in plan.segments for it in s.items
                   if not isinstance(it, FusionGroup) and plan.roles[it] == "kernel"]
        eager = [str(n.target) for n in plan.steps if not hasattr(n, "items")]
        rep = cls(name, sum(1 for n in plan.graph.nodes if n.op == "call_function"), len(plan.segments), len(groups),
                  sum(len(g.nodes) for g in groups), kernels, eager, seconds)
        _reports.append(rep)
        return rep

    def add_program(self, segment: int, prog: Any, seconds: float, spec: Any) -> None:
        """Record a traced segment program (a SegmentProgram)."""
        program = prog.program
        arena = sum(s.nbytes for s in program.args if s.name == "arena")
        self.programs.append(ProgramReport(segment, len(program.instructions), program.hbm_bytes_read,
                                           program.hbm_bytes_written, arena, prog.buffer_bytes, program.flops,
                                           program.schedule(spec).device_time_ns, seconds))

    @property
    def launches_per_call(self) -> int:
        """Programs launched per call (eager nodes launch their own kernels besides)."""
        return self.segments

    def to_dict(self) -> dict:
        """The report as plain data (``report.json``)."""
        return asdict(self)

    def summary(self) -> str:
        """A few lines for humans."""
        lines = [f"graph {self.name}: {self.nodes} ops -> {self.segments} program(s), {self.fusion_groups} fusion "
                 f"group(s) of {self.fused_nodes} ops, {len(self.kernels)} library kernel(s), "
                 f"{len(self.eager_nodes)} eager op(s)"]
        for p in self.programs:
            lines.append(f"  segment {p.segment}: {p.instructions} instructions, {p.device_time_ns / 1e3:.1f} us "
                         f"simulated, HBM {p.hbm_bytes_read + p.hbm_bytes_written} B, intermediates {p.arena_bytes} B "
                         f"(unplanned {p.buffer_bytes} B), "
                         f"traced in {p.trace_seconds:.2f} s")
        if self.eager_nodes:
            lines.append("  eager: " + ", ".join(sorted(set(self.eager_nodes))))
        return "\n".join(lines)


def reports() -> list[GraphReport]:
    """The reports of the graphs compiled in this process (the latest ``MAX_REPORTS``)."""
    return list(_reports)


def _dump_dir(name: str) -> Path | None:
    root = os.environ.get("TORCHNEURON_DUMP_DIR")
    if not root:
        return None
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def dump_graph(cg: Any) -> None:
    """Write the graph, its fusion groups and its report (``TORCHNEURON_DUMP_DIR`` only)."""
    d = _dump_dir(cg.name)
    if d is None:
        return
    (d / "graph.txt").write_text(cg.gm.code + "\n\n" + str(cg.gm.graph))
    text = []
    for step in cg.plan.steps:
        if hasattr(step, "items"):
            text.append(f"segment {step.index} (one program): inputs {[n.name for n in step.inputs]}, "
                        f"outputs {[n.name for n in step.outputs]}\n{step.describe()}")
        else:
            text.append(f"eager: {step.name} = {step.target}")
    (d / "fusion.txt").write_text("\n".join(text) + "\n")
    (d / "report.json").write_text(json.dumps(cg.report.to_dict(), indent=1))


def dump_segment(cg: Any, seg: Any, prog: Any, spec: Any) -> None:
    """Write a traced segment's program listing on chip ``spec`` and refresh the report (``TORCHNEURON_DUMP_DIR``
    only)."""
    d = _dump_dir(cg.name)
    if d is None:
        return
    sched = prog.program.schedule(spec)
    lines = [f"program {prog.program.name}: {len(prog.program.instructions)} instructions, "
             f"{sched.device_time_ns:.0f} ns simulated on {spec.name}",
             "args: " + ", ".join(f"{s.name}:{s.kind}:{s.describe()}" for s in prog.program.args)]
    for i, ins in enumerate(prog.program.instructions):
        lines.append(f"{i:6d} {sched.start_ns[i]:12.0f} {sched.end_ns[i]:12.0f} {ins.engine.value:8s} {ins.opcode}")
    (d / f"program_s{seg.index}.txt").write_text("\n".join(lines) + "\n")
    (d / "report.json").write_text(json.dumps(cg.report.to_dict(), indent=1))
