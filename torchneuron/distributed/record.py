"""CollectiveRecord: one collective on a stream's device clock, as the profiler keeps it.

It has the fields ``torchneuron.runtime.profiler`` reads from a kernel launch's record
(name, op, device, stream, start/end, device time, engine busy time, FLOPs, HBM bytes,
instruction events), so collectives appear in ``profiler.records()`` and in Chrome traces
on the stream they ran on, next to the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective on one rank: ``[start_ns, end_ns)`` of its stream's clock."""

    name: str                  # e.g. "all_reduce"
    op: str                    # e.g. "c10d::allreduce_ (SUM)"
    device: int
    stream: int
    start_ns: int              # the stream clock when this rank issued the collective
    end_ns: int                # when the collective completed (the same on every rank)
    wait_ns: int               # time spent waiting for the slowest rank to issue it
    device_time_ns: float      # the collective's own time (the cost model)
    bytes: int                 # the size the cost model was given
    ranks: int                 # group size
    level: str                 # widest level spanned: "core", "chip" or "node"
    launch_overhead_ns: float = 0.0
    engine_busy_ns: dict[str, float] = field(default_factory=dict)
    flops: int = 0
    hbm_bytes_read: int = 0
    hbm_bytes_written: int = 0
    instructions: int = 0

    @property
    def duration_ns(self) -> int:
        """Stream time the collective took (waiting included)."""
        return self.end_ns - self.start_ns

    def without_outputs(self) -> "CollectiveRecord":
        """This record (it never holds tensors)."""
        return self

    def instruction_events(self) -> Iterator:
        """None: a collective runs on the collective-communication cores, not the engines."""
        return iter(())
