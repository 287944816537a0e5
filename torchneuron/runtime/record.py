"""LaunchRecord: what one kernel launch did, on the device clock of the stream it ran on.

Times are simulated nanoseconds on the stream's device clock (the clock ``torch.Event``
reads). A launch occupies ``[start_ns, end_ns)`` of its stream: first the runtime's
per-launch overhead (``launch_overhead_ns``, from the chip's spec table), then the kernel
itself (``kernel_start_ns`` to ``end_ns``, its simulated device time).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from torchneuron.sim import Program
from torchneuron.sim.specs import ChipSpec

if TYPE_CHECKING:
    from torchneuron.sim.timing import Timeline


@dataclass(frozen=True)
class InstructionEvent:
    """One instruction of a launched kernel, on the stream clock."""

    index: int          # position in program order
    opcode: str
    engine: str         # Engine value: "tensor", "vector", "scalar", "gpsimd", "dma"
    queue: int          # DMA queue (0 for compute engines)
    start_ns: float
    end_ns: float


@dataclass(frozen=True)
class LaunchRecord:
    """One kernel launch (also the profiler's record of it)."""

    name: str                          # kernel name
    op: str | None                     # the op (e.g. "aten::add.Tensor") the kernel implements, if any
    device: int                        # neuron device index
    stream: int                        # stream id on that device
    start_ns: int                      # stream clock when the launch was queued
    end_ns: int                        # stream clock when the kernel finished
    launch_overhead_ns: float          # runtime overhead per launch (spec.runtime.kernel_launch_overhead_ns)
    device_time_ns: float              # the kernel's simulated time on the core
    engine_busy_ns: dict[str, float]   # busy time per engine (Engine value)
    flops: int
    hbm_bytes_read: int
    hbm_bytes_written: int
    instructions: int                  # instruction count
    program: Program = field(repr=False, compare=False)
    spec: ChipSpec = field(repr=False, compare=False)
    # the output slots' tensors (neuron tensors); dropped from the profiler's copy so that
    # keeping records never keeps device memory alive
    outputs: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def kernel_start_ns(self) -> float:
        """When the kernel's first instruction could start: after the launch overhead."""
        return self.start_ns + self.launch_overhead_ns

    @property
    def duration_ns(self) -> int:
        """Stream time the launch took (overhead plus kernel)."""
        return self.end_ns - self.start_ns

    @classmethod
    def _fast(cls, *, name: str, op: str | None, device: int, stream: int, start_ns: int, end_ns: int,
              launch_overhead_ns: float, device_time_ns: float, program: Program, spec: ChipSpec,
              outputs: dict[str, torch.Tensor], schedule: Timeline | None = None) -> "LaunchRecord":
        """The record of a launch of ``program`` on ``spec``, the program's static facts filled in
        from its caches (``schedule``: the one the launch ran, default ``program.schedule(spec)``).
        Built without the dataclass ``__init__``: a frozen dataclass sets each field through
        ``object.__setattr__``, which is most of a record's cost per launch."""
        if schedule is None:
            schedule = program.schedule(spec)
        record = object.__new__(cls)
        record.__dict__.update(
            name=name, op=op, device=device, stream=stream, start_ns=start_ns, end_ns=end_ns,
            launch_overhead_ns=launch_overhead_ns, device_time_ns=device_time_ns,
            engine_busy_ns=dict(schedule.engine_busy_ns), flops=program.flops,
            hbm_bytes_read=program.hbm_bytes_read, hbm_bytes_written=program.hbm_bytes_written,
            instructions=len(program.instructions), program=program, spec=spec, outputs=outputs)
        return record

    def without_outputs(self) -> "LaunchRecord":
        """This record without references to the output tensors."""
        return self.with_outputs({}) if self.outputs else self

    def with_outputs(self, outputs: dict[str, torch.Tensor]) -> "LaunchRecord":
        """This record with ``outputs`` (a field-for-field copy, see ``_fast``)."""
        record = object.__new__(type(self))
        record.__dict__.update(self.__dict__)
        record.__dict__["outputs"] = outputs
        return record

    def instruction_events(self) -> Iterator[InstructionEvent]:
        """Every instruction's engine, queue and time on the stream clock (from the program's
        schedule, which the program caches per chip)."""
        sched = self.program.schedule(self.spec)
        t0 = self.kernel_start_ns
        for i, (instr, s, e) in enumerate(zip(self.program.instructions, sched.start_ns, sched.end_ns)):
            yield InstructionEvent(i, instr.opcode, instr.engine.value, int(instr.queue), t0 + s, t0 + e)
