"""A simulated NeuronCore: its memories and engine state, executing programs in order.

Execution is functional and sequential (an in-order core with perfect dependency tracking produces the
same values); the timing model then schedules the same
instruction list onto the engine queues to say how long it took on the modelled chip.

A program is prepared once per core (``_Plan``): each instruction's step (``Instr.step``) does
what its ``execute`` does with the per-core lookups (views of SBUF/PSUM, dtypes, torch
functions) already made, so running a cached kernel again costs little more than its torch
calls. HBM buffers are the run's bound tensors, passed to the steps in slot order; a
``Memory`` is made for one only when an instruction without a step asks for it. PSUM
accumulation-group flags are reset at the start of a run only where groups were opened.

A static program's instructions run in demand order (``host_order``: each just before the first instruction that
needs it, every dependency kept), and a long one as an equivalent copy whose SBUF and PSUM tiles are packed into few
host bytes (``host_layout``): its tiles stay in the CPU's caches between the instructions that use them. Its
simulated addresses, schedule and results are the program's; only the order the host computes them in and the host
bytes on-chip values sit in differ.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

from torchneuron.sim import host_layout, host_order
from torchneuron.sim.copies import batch_copies
from torchneuron.sim.instruction import Engine
from torchneuron.sim.isa import Instr
from torchneuron.sim.isa.control import REGISTERS
from torchneuron.sim.isa.tensor_engine import batch_matmuls
from torchneuron.sim.memory import (Memory, SimulatorError, SIM_THREADS, check_host_binding, nan_fill_enabled,
                                    NAN_BYTE)
from torchneuron.sim.program import Program
from torchneuron.sim.specs import ChipSpec, chip_spec
from torchneuron.sim.timing import Roofline

MAX_DYNAMIC_STEPS = 1 << 24  # instructions one run of a program with dynamic loops may execute


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

    @classmethod
    def of(cls, program: Program, bound: dict[str, torch.Tensor], spec: ChipSpec, timed: bool) -> "RunReport":
        """The report of a run of ``program`` (or a multi-core launch) on ``bound`` arguments, priced on ``spec``
        when ``timed``."""
        report = cls(outputs={s.name: bound[s.name] for s in program.args if s.kind == "output"}, bindings=bound,
                     device_time_ns=None, flops=program.flops, hbm_bytes_read=program.hbm_bytes_read,
                     hbm_bytes_written=program.hbm_bytes_written, instructions=len(program.instructions))
        if timed:
            sched = program.schedule(spec)
            report.device_time_ns = sched.device_time_ns
            report.start_ns, report.end_ns = list(sched.start_ns), list(sched.end_ns)
            report.engine_busy_ns = dict(sched.engine_busy_ns)
            report.roofline = program.roofline(spec)
        return report


class _Plan:
    """A program prepared for one core: per instruction its step (None: ``execute``) and, for a
    non-TensorE instruction writing PSUM, the group-closed flag views it closes. A static program's
    instructions run in ``host_order.demand_order`` where ``order`` (in program order where one of them will raise:
    the run then stops where it did, with the same instructions done); with ``pack``, they are those of
    ``host_layout.packed`` where it gives them (``originals`` maps each moved instruction back to the
    program's, which errors name)."""

    __slots__ = ("program", "sbuf", "psum", "keys", "entries", "batched", "fills", "originals")

    def __init__(self, core: "NeuronCore", program: Program, pack: bool = False, order: bool = False):
        self.program = weakref.ref(program)
        self.sbuf, self.psum = core.sbuf, core.psum
        self.keys = tuple(f"hbm:{s.name}" for s in program.args)
        slots = {k: (i, s) for i, (k, s) in enumerate(zip(self.keys, program.args))}
        ordered = (host_order.demand_order(program.instructions) if order and not program.dynamic
                   else program.instructions)
        entries, raises, originals = self._prepare(core, program, ordered, pack, slots)
        if raises and ordered is not program.instructions:
            entries, _, originals = self._prepare(core, program, program.instructions, pack, slots)
        self.entries, self.originals = entries, originals
        # what a run executes: runs of plain copies, and of independent matmuls of one layout,
        # as one call each (a dynamic program's control instructions jump between ``entries``, so it runs those)
        self.batched = (self.entries if program.dynamic
                        else batch_copies(core, batch_matmuls(core, self.entries), slots))
        # scratch slots, and output slots a run may leave unbound: allocated per run
        self.fills = tuple(i for i, s in enumerate(program.args) if s.kind != "input")

    @staticmethod
    def _prepare(core: "NeuronCore", program: Program, ordered: Sequence[Instr], pack: bool,
                 slots: dict) -> tuple[tuple, bool, dict]:
        """The entries (instr, step, closes) of ``ordered`` (packed with ``pack`` where ``host_layout`` gives a
        packing), whether an instruction failed to prepare (its ``execute`` will raise), and each moved
        instruction's original by id (``originals``)."""
        instructions = (host_layout.packed(program, core.sbuf.bytes_per_partition, ordered,
                                           psum=(core.psum.bytes_per_partition, core.psum.bank_bytes))
                        if pack else None)
        originals = ({id(new): old for new, old in zip(instructions, ordered) if new is not old}
                     if instructions is not None else {})
        entries, raises = [], False
        for instr in instructions or ordered:
            make = getattr(instr, "step", None)
            try:
                step = make(core, slots) if make is not None else None
            except (SimulatorError, RuntimeError):
                step, raises = None, True  # e.g. a tile beyond this core's SBUF: execute raises it
            closes = None
            if step is not None and instr.engine is not Engine.TENSOR and instr.psum_writes:
                flags = core.psum.group_closed
                closes = tuple(flags[f.partitions[0]:f.partitions[1], f.byte_range[0] // 4:-(-f.byte_range[1] // 4)]
                               for f in instr.psum_writes)
            entries.append((instr, step, closes))
        return tuple(entries), raises, originals


class NeuronCore:
    """One NeuronCore: SBUF, PSUM, bound HBM buffers, per-engine accumulation registers and a PRNG.

    ``pack_tiles``: run long static programs with their SBUF and PSUM tiles packed on the host (``host_layout``);
    off where on-chip bytes are read after a run at the program's addresses (a multi-core launch's exchanges between
    segments) and with NaN fill (a debugging run shows the program's own layout). ``host_order``: run static
    programs' instructions in demand order (``host_order``: every dependency kept, so every byte ends as in
    program order)."""

    def __init__(self, spec: ChipSpec | str, *, nan_fill: bool | None = None, seed: int = 0,
                 pack_tiles: bool = True, host_order: bool = True):
        self.spec = chip_spec(spec) if isinstance(spec, str) else spec
        self.nan_fill = nan_fill_enabled(nan_fill)
        self.pack_tiles = pack_tiles and not self.nan_fill
        self.host_order = host_order
        parts = self.spec.sbuf_partitions
        self.sbuf = Memory("sbuf", parts, self.spec.sbuf_bytes_per_partition, nan_fill=self.nan_fill)
        self.psum = Memory("psum", parts, self.spec.psum_bytes_per_partition, nan_fill=self.nan_fill,
                           bank_bytes=self.spec.psum_bytes_per_partition // self.spec.psum_banks)
        self._memories: dict[str, Memory] = {"sbuf": self.sbuf, "psum": self.psum}
        # ScalarE activation and VectorE reduce registers: one fp32 value per lane (partition)
        self.regs: dict[Engine, torch.Tensor] = {Engine.SCALAR: torch.zeros(parts), Engine.VECTOR: torch.zeros(parts)}
        self.rng = torch.Generator().manual_seed(seed)
        self.rng_states: dict[tuple[int, ...], torch.Tensor] = {}  # generator states rand_get_state named
        self.registers = [0] * REGISTERS  # the sequencers' registers (32-bit integers), by virtual index
        # the HBM tensors of the run in progress, by memory name; their Memory objects are made
        # only when an instruction without a step asks for one (most never do)
        self._run_hbm: dict[str, torch.Tensor] = {}
        self._plans: dict[tuple[int, bool], _Plan] = {}  # by (id(program), packed); entries leave with it
        self._scratch: dict[tuple, torch.Tensor] = {}

    # ---- memories -----------------------------------------------------------------

    def memory(self, name: str) -> Memory:
        """The memory an access pattern names: "sbuf", "psum" or "hbm:<buffer>"."""
        mem = self._memories.get(name)
        if mem is None:
            t = self._run_hbm.get(name)
            if t is None:
                names = sorted({n for n in self._memories if n.startswith("hbm:")} | set(self._run_hbm))
                raise SimulatorError(f"no memory {name!r} on this core (HBM buffers: {names})")
            mem = self._memories[name] = Memory.hbm(name[4:], t)
        return mem

    def bind(self, name: str, tensor: torch.Tensor) -> Memory:
        """Make ``tensor``'s bytes HBM buffer ``hbm:<name>`` (no copy: writes land in the tensor)."""
        mem = Memory.hbm(name, tensor)
        self._memories[mem.name] = mem
        return mem

    def unbind(self, name: str) -> None:
        """Forget HBM buffer ``hbm:<name>``."""
        self._memories.pop(f"hbm:{name}", None)

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, tag: str = "") -> torch.Tensor:
        """A host buffer of ``shape`` for the steps of every program this core runs, one per (shape, dtype, tag): a
        step uses its scratch only within its own call and steps run one at a time (under the device's lock), so
        instructions of one shape share a buffer, which stays in the CPU's caches between them (a buffer of each
        instruction's own had left them by its next run). ``tag`` tells apart buffers one step uses together."""
        key = (tuple(shape), dtype, tag)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty(shape, dtype=dtype)
        return buf

    # ---- execution ----------------------------------------------------------------

    def execute(self, instr: Instr) -> None:
        """Execute one instruction functionally."""
        try:
            instr.execute(self)
        except SimulatorError as e:
            raise self._locate(instr, e) from None
        if instr.engine is not Engine.TENSOR and instr.psum_writes and self.psum.groups_open:
            # a non-matmul write ends the accumulation group there (nc_matmul accumulate=None);
            # with no group open anywhere every flag is already set
            flags = self.psum.group_closed
            self.psum.close([flags[p0:p1, b0 // 4:-(-b1 // 4)]
                             for (p0, p1), (b0, b1) in ((f.partitions, f.byte_range) for f in instr.psum_writes)])

    def _locate(self, instr: Instr, error: SimulatorError) -> SimulatorError:
        # name the instruction and the operand behind an out-of-bounds or unbound access
        if str(error).startswith(f"{instr.opcode}:"):
            return error
        for name, ap in instr.operands():
            try:
                ap.check_bounds(self.memory(ap.memory))
            except SimulatorError as inner:
                return type(inner)(f"{instr.opcode}: {name} {inner}")
        return type(error)(f"{instr.opcode}: {error}")

    def begin_run(self) -> None:
        """Start a kernel: no PSUM accumulation group is open; with NaN fill, on-chip memory is all NaN."""
        self.psum.close_groups()
        if self.nan_fill:
            self.sbuf.data.fill_(NAN_BYTE)
            self.psum.data.fill_(NAN_BYTE)

    def _plan(self, program: Program, pack: bool = False) -> _Plan:
        """``program`` prepared for this core, its tiles packed on the host with ``pack`` where that is
        equivalent (cached while the program lives)."""
        key = (id(program), pack)
        plan = self._plans.get(key)
        if plan is None or plan.program() is not program or plan.sbuf is not self.sbuf or plan.psum is not self.psum:
            plan = _Plan(self, program, pack, self.host_order)
            plans = self._plans
            # forget the plan when the program goes (its id may then be reused)
            plan.program = weakref.ref(program, lambda _r, key=key, plans=plans: plans.pop(key, None))
            plans[key] = plan
        return plan

    def run_bound(self, program: Program, tensors: Sequence[torch.Tensor | None],
                  fresh: bool = True) -> list[torch.Tensor]:
        """Execute ``program`` on HBM tensors given in slot order, unchecked: the caller guarantees
        each is a contiguous CPU tensor (a neuron tensor's ``_alias_as_cpu``) of its slot's shape
        and dtype. ``None`` for an output or scratch slot allocates it (zeros; NaN with NaN fill).
        Returns the tensors used, in slot order. No timing: see ``Program.schedule``.
        ``fresh=False`` continues the kernel the core ran last (on-chip state and open accumulation
        groups kept): a multi-core launch runs each core's program in segments between exchanges. A program
        with its own ``run_on(core, tensors)`` (a launch over several cores) runs through it when that
        returns the tensors."""
        if type(program) is not Program and hasattr(program, "run_on"):
            ran = program.run_on(self, tensors)  # a launch over several cores runs on its own cores
            if ran is not None:
                return ran
        # a continued kernel reads the on-chip state at the program's own addresses: never packed
        plan = self._plan(program, fresh and self.pack_tiles)
        for i in plan.fills:
            if tensors[i] is None:
                if not isinstance(tensors, list):
                    tensors = list(tensors)
                tensors[i] = program.allocate(program.args[i], nan_fill=self.nan_fill)
        mems = self._memories
        keys = plan.keys
        # run bindings shadow persistent ``bind``s of the same name for the run
        shadowed = {k: mems.pop(k) for k in keys if k in mems} if len(mems) > 2 else None
        self._run_hbm = dict(zip(keys, tensors))
        instr = None
        # one intra-op thread while the instructions run: tiles are at most [128, 2048], too small for
        # torch's threads to pay for their wake-ups (bench/eager.py: a GPT step about 20% faster)
        threads = torch.get_num_threads()
        if threads != SIM_THREADS:
            torch.set_num_threads(SIM_THREADS)
        try:
            if fresh:
                self.begin_run()
            if program.dynamic:
                instr = self._run_dynamic(program, plan, tensors)
            else:
                psum = self.psum
                for instr, step, closes in plan.batched:
                    if step is None:
                        self.execute(instr)
                        continue
                    step(tensors)
                    if closes is not None and psum.groups_open:
                        psum.close(closes)
        except SimulatorError as e:
            if instr is None:  # raised by the run itself (a dynamic loop's step limit), not an instruction
                raise
            raise self._locate(plan.originals.get(id(instr), instr), e) from None
        finally:
            if threads != SIM_THREADS:
                torch.set_num_threads(threads)
            self._run_hbm = {}
            if len(mems) > 2:  # Memory objects made during the run (or bindings to restore)
                for k in keys:
                    mems.pop(k, None)
            if shadowed:
                mems.update(shadowed)
        return tensors

    def _run_dynamic(self, program: Program, plan: _Plan, tensors) -> Instr | None:
        """Run a program with dynamic loops instruction by instruction, following its control instructions;
        record the executed stream on the program (its schedule is that run's). Returns the last instruction."""
        entries, n, pc, executed, instr = plan.entries, len(plan.entries), 0, [], None
        psum = self.psum
        while pc < n:
            if len(executed) >= MAX_DYNAMIC_STEPS:
                raise SimulatorError(f"program {program.name!r}: {MAX_DYNAMIC_STEPS} instructions executed and its "
                                     f"dynamic loops still run (an endless loop?)")
            instr, step, closes = entries[pc]
            executed.append(pc)
            if getattr(instr, "control", False):
                pc = instr.next_pc(self, pc)
                continue
            try:
                if step is None:
                    self.execute(instr)
                else:
                    step(tensors)
            except SimulatorError as e:
                raise self._locate(instr, e) from None
            if step is not None and closes is not None and psum.groups_open:
                psum.close(closes)
            pc += 1
        program.record_run(executed)
        return instr

    def run(self, program: Program, bindings: dict[str, torch.Tensor] | None = None, *,
            timed: bool = True) -> RunReport:
        """Bind the arguments, execute every instruction in program order, then price the run."""
        bound = program.bind(bindings or {}, nan_fill=self.nan_fill)
        self.run_bound(program, [host_binding(s.name, bound[s.name]) for s in program.args])
        return RunReport.of(program, bound, self.spec, timed)


def host_binding(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A bound tensor as the core reads it: detached, on the host, contiguous (what Memory.hbm checks)."""
    check_host_binding(name, tensor)
    return tensor.detach()
