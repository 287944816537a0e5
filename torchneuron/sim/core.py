"""A simulated NeuronCore: its memories and engine state, executing programs in order.

Execution is functional and sequential in program order (an in-order core with perfect
dependency tracking produces the same values); the timing model then schedules the same
instruction list onto the engine queues to say how long it took on the modelled chip.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchneuron.sim.instruction import Engine
from torchneuron.sim.isa import Instr
from torchneuron.sim.memory import Memory, SimulatorError, nan_fill_enabled, NAN_BYTE
from torchneuron.sim.program import Program
from torchneuron.sim.specs import ChipSpec, chip_spec
from torchneuron.sim.timing import Roofline, roofline


@dataclass
class RunReport:
    """What one run of a program did: its tensors, its simulated time and its traffic."""

    outputs: dict[str, torch.Tensor]         # the "output" argument slots
    bindings: dict[str, torch.Tensor]        # every bound argument (inputs are updated in place if written)
    device_time_ns: float | None             # None when run with timed=False
    start_ns: list[float] = field(default_factory=list)   # per instruction, program order
    end_ns: list[float] = field(default_factory=list)
    engine_busy_ns: dict[str, float] = field(default_factory=dict)  # keyed by Engine value
    flops: int = 0
    hbm_bytes_read: int = 0
    hbm_bytes_written: int = 0
    instructions: int = 0
    roofline: Roofline | None = None       # fractions of TensorE peak and DMA/HBM bandwidth reached


class NeuronCore:
    """One NeuronCore: SBUF, PSUM, bound HBM buffers, per-engine accumulation registers and a PRNG."""

    def __init__(self, spec: ChipSpec | str | None = None, *, nan_fill: bool | None = None, seed: int = 0):
        if spec is None:
            from torchneuron.config import CONFIG
            spec = CONFIG.chip
        self.spec = chip_spec(spec) if isinstance(spec, str) else spec
        self.nan_fill = nan_fill_enabled(nan_fill)
        parts = self.spec.sbuf_partitions
        self.sbuf = Memory("sbuf", parts, self.spec.sbuf_bytes_per_partition, nan_fill=self.nan_fill)
        self.psum = Memory("psum", parts, self.spec.psum_bytes_per_partition, nan_fill=self.nan_fill,
                           bank_bytes=self.spec.psum_bytes_per_partition // self.spec.psum_banks)
        self._memories: dict[str, Memory] = {"sbuf": self.sbuf, "psum": self.psum}
        # ScalarE activation and VectorE reduce registers: one fp32 value per lane (partition)
        self.regs: dict[Engine, torch.Tensor] = {Engine.SCALAR: torch.zeros(parts), Engine.VECTOR: torch.zeros(parts)}
        self.rng = torch.Generator().manual_seed(seed)

    # ---- memories -----------------------------------------------------------------

    def memory(self, name: str) -> Memory:
        """The memory an access pattern names: "sbuf", "psum" or "hbm:<buffer>"."""
        try:
            return self._memories[name]
        except KeyError:
            raise SimulatorError(f"no memory {name!r} on this core (HBM buffers: "
                                 f"{sorted(n for n in self._memories if n.startswith('hbm:'))})") from None

    def bind(self, name: str, tensor: torch.Tensor) -> Memory:
        """Make ``tensor``'s bytes HBM buffer ``hbm:<name>`` (no copy: writes land in the tensor)."""
        mem = Memory.hbm(name, tensor)
        self._memories[mem.name] = mem
        return mem

    def unbind(self, name: str) -> None:
        """Forget HBM buffer ``hbm:<name>``."""
        self._memories.pop(f"hbm:{name}", None)

    # ---- execution ----------------------------------------------------------------

    def execute(self, instr: Instr) -> None:
        """Execute one instruction functionally."""
        try:
            instr.execute(self)
        except SimulatorError as e:
            raise self._locate(instr, e) from None
        if instr.engine is not Engine.TENSOR and instr.psum_writes:
            # a non-matmul write ends the accumulation group there (nc_matmul accumulate=None)
            for f in instr.psum_writes:
                (p0, p1), (b0, b1) = f.partitions, f.byte_range
                self.psum.group_closed[p0:p1, b0 // 4:-(-b1 // 4)] = True

    def _locate(self, instr: Instr, error: SimulatorError) -> SimulatorError:
        # name the instruction and the operand behind an out-of-bounds or unbound access
        if str(error).startswith(f"{instr.opcode}:"):
            return error
        for name, ap in instr.operands():
            try:
                ap.check_bounds(self.memory(ap.memory))
            except SimulatorError as inner:
                return SimulatorError(f"{instr.opcode}: {name} {inner}")
        return SimulatorError(f"{instr.opcode}: {error}")

    def begin_run(self) -> None:
        """Start a kernel: no PSUM accumulation group is open; with NaN fill, on-chip memory is all NaN."""
        self.psum.group_closed.fill_(True)
        if self.nan_fill:
            self.sbuf.data.fill_(NAN_BYTE)
            self.psum.data.fill_(NAN_BYTE)

    def run(self, program: Program, bindings: dict[str, torch.Tensor] | None = None, *,
            timed: bool = True) -> RunReport:
        """Bind the arguments, execute every instruction in program order, then price the run."""
        bound = program.bind(bindings or {}, nan_fill=self.nan_fill)
        for name, tensor in bound.items():
            self.bind(name, tensor)
        try:
            self.begin_run()
            for instr in program.instructions:
                self.execute(instr)
        finally:
            for name in bound:
                self.unbind(name)
        report = RunReport(outputs={s.name: bound[s.name] for s in program.args if s.kind == "output"},
                           bindings=bound, device_time_ns=None, flops=program.flops,
                           hbm_bytes_read=program.hbm_bytes_read, hbm_bytes_written=program.hbm_bytes_written,
                           instructions=len(program.instructions))
        if timed:
            sched = program.schedule(self.spec)
            report.device_time_ns = sched.device_time_ns
            report.start_ns, report.end_ns = list(sched.start_ns), list(sched.end_ns)
            report.engine_busy_ns = dict(sched.engine_busy_ns)
            report.roofline = roofline(sched, self.spec)
        return report
