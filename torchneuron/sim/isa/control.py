"""Registers and dynamic control flow: the engines' sequencer registers (``register_move``, ``register_load``,
``register_store``) and loops whose trip counts or conditions are read at run time (``loop_begin`` /
``loop_end`` for ``nl.fori_loop`` / ``nl.dynamic_range``, ``while_begin`` / ``while_end`` for ``nl.while_loop``).

A register is a 32-bit integer in the core's register file (``core.registers``); to the timing model it is
4 bytes of the memory ``"reg"``, so a branch waits for the ``register_load`` that feeds it like any read waits for
a write. A control instruction returns the index of the next instruction to run (``next_pc``); the core runs
programs that contain one instruction by instruction and records the executed stream, which the timing model
schedules (each executed branch expands to one ``branch`` per engine of the loop body).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchneuron.sim.instruction import CostInputs, Engine, Footprint
from torchneuron.sim.memory import AP
from torchneuron.sim.numerics import INT_DTYPES, dtype_name
from torchneuron.sim.isa.common import Instr

REGISTERS = 4096          # virtual registers of a program (the compiler maps them onto 64 per engine sequencer)
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def reg_footprint(index: int) -> Footprint:
    """The 4 bytes of register ``index`` in the timing model's ``"reg"`` memory."""
    return Footprint("reg", (0, 1), (4 * index, 4 * index + 4))


def _wrap32(v: int) -> int:
    return (int(v) + 2**31) % 2**32 - 2**31


def _reg_index(instr: Instr, name: str) -> None:
    v = getattr(instr, name)
    if v is not None and not (isinstance(v, int) and 0 <= v < REGISTERS):
        raise instr._fail(name, f"is {v!r}; a register index is an integer in [0, {REGISTERS})")


def _scalar_tile(instr: Instr, name: str) -> None:
    ap = instr._ap(name, ("sbuf", "hbm"))
    if ap.numel != 1:
        raise instr._fail(name, f"has shape {ap.shape}; a register moves exactly one element")
    if ap.dtype not in INT_DTYPES or ap.dtype == torch.bool or ap.dtype.itemsize > 4:
        raise instr._fail(name, f"is {dtype_name(ap.dtype)}; registers hold integers of up to 32 bits")


class _RegisterInstr(Instr):
    """Register reads and writes as footprints of the ``"reg"`` memory (besides any tile operand)."""

    REG_READS: tuple[str, ...] = ()
    REG_WRITES: tuple[str, ...] = ()

    def _regs(self, names: tuple[str, ...]) -> tuple[Footprint, ...]:
        return tuple(reg_footprint(getattr(self, n)) for n in names if getattr(self, n) is not None)

    def reads(self) -> tuple[Footprint, ...]:
        return self._footprints[0] + self._regs(self.REG_READS)

    def writes(self) -> tuple[Footprint, ...]:
        return self._footprints[1] + self._regs(self.REG_WRITES)

    def price(self) -> CostInputs:
        return CostInputs(opcode=self.opcode, engine=self.engine, partitions=1, free_elems=1, flops=0)


@dataclass(frozen=True)
class RegisterMove(_RegisterInstr):
    """``nisa.register_move``: ``reg[dst] = imm`` or ``reg[src]`` (32-bit)."""

    dst: int
    imm: int | None = None
    src: int | None = None
    opcode = "register_move"
    engine = Engine.GPSIMD
    REG_READS, REG_WRITES = ("src",), ("dst",)

    def check(self) -> None:
        _reg_index(self, "dst")
        _reg_index(self, "src")
        if (self.imm is None) == (self.src is None):
            raise self._fail("imm/src", "give exactly one source: an integer or a register")
        if self.imm is not None and not INT32_MIN <= int(self.imm) <= INT32_MAX:
            raise self._fail("imm", f"is {self.imm}; a register holds a 32-bit integer")

    def execute(self, core) -> None:
        core.registers[self.dst] = int(self.imm) if self.imm is not None else core.registers[self.src]


@dataclass(frozen=True)
class RegisterLoad(_RegisterInstr):
    """``nisa.register_load``: ``reg[dst] = src`` for a one-element integer tensor in SBUF or HBM."""

    dst: int
    src: AP
    opcode = "register_load"
    engine = Engine.GPSIMD
    WRITES = ()
    REG_WRITES = ("dst",)

    def check(self) -> None:
        _reg_index(self, "dst")
        _scalar_tile(self, "src")

    def execute(self, core) -> None:
        core.registers[self.dst] = _wrap32(int(self.src.view(core).reshape(-1)[0]))


@dataclass(frozen=True)
class RegisterStore(_RegisterInstr):
    """``nisa.register_store``: write ``reg[src]`` into a one-element integer tensor in SBUF or HBM."""

    dst: AP
    src: int
    opcode = "register_store"
    engine = Engine.GPSIMD
    REG_READS = ("src",)

    def check(self) -> None:
        _reg_index(self, "src")
        _scalar_tile(self, "dst")

    def execute(self, core) -> None:
        self.dst.write(core, torch.tensor([core.registers[self.src]], dtype=torch.int64))


@dataclass(frozen=True)
class LoopBegin(_RegisterInstr):
    """Start of a counted loop: ``reg[counter] = start``, ``reg[limit] = stop`` (immediates or registers, read
    once); when ``counter >= limit`` the body is skipped (to after instruction ``end``)."""

    counter: int
    limit: int
    end: int
    start_imm: int | None = None
    start: int | None = None
    stop_imm: int | None = None
    stop: int | None = None
    engines: tuple[str, ...] = ()
    opcode = "loop_begin"
    engine = Engine.GPSIMD
    control = True
    REG_READS, REG_WRITES = ("start", "stop"), ("counter", "limit")

    def check(self) -> None:
        for n in ("counter", "limit", "start", "stop"):
            _reg_index(self, n)
        if (self.start_imm is None) == (self.start is None) or (self.stop_imm is None) == (self.stop is None):
            raise self._fail("start/stop", "each is an integer or a register")

    def next_pc(self, core, pc: int) -> int:
        """Set the counter and limit; the next instruction (the body, or past the loop)."""
        regs = core.registers
        regs[self.counter] = int(self.start_imm) if self.start is None else regs[self.start]
        regs[self.limit] = int(self.stop_imm) if self.stop is None else regs[self.stop]
        return pc + 1 if regs[self.counter] < regs[self.limit] else self.end + 1


@dataclass(frozen=True)
class LoopEnd(_RegisterInstr):
    """End of a counted loop body: ``counter += stride``; back to after instruction ``begin`` while
    ``counter < limit``."""

    counter: int
    limit: int
    stride: int
    begin: int
    engines: tuple[str, ...] = ()
    opcode = "loop_end"
    engine = Engine.GPSIMD
    control = True
    REG_READS, REG_WRITES = ("counter", "limit"), ("counter",)

    def check(self) -> None:
        _reg_index(self, "counter")
        _reg_index(self, "limit")
        if not isinstance(self.stride, int) or self.stride < 1:
            raise self._fail("stride", f"is {self.stride!r}; a loop step is a positive compile-time integer")

    def next_pc(self, core, pc: int) -> int:
        """Advance the counter; the next instruction (the body again, or past the loop)."""
        regs = core.registers
        regs[self.counter] = _wrap32(regs[self.counter] + self.stride)
        return self.begin + 1 if regs[self.counter] < regs[self.limit] else pc + 1


@dataclass(frozen=True)
class _WhileControl(_RegisterInstr):
    """The two ends of a while loop: both test ``reg[cond]``."""

    cond: int
    engines: tuple[str, ...] = field(default=(), kw_only=True)
    engine = Engine.GPSIMD
    control = True
    REG_READS = ("cond",)

    def check(self) -> None:
        _reg_index(self, "cond")


@dataclass(frozen=True)
class WhileBegin(_WhileControl):
    """Start of a while loop: skip the body (to after instruction ``end``) when ``reg[cond] == 0``."""

    end: int
    opcode = "while_begin"

    def next_pc(self, core, pc: int) -> int:
        """The body when the condition is nonzero, else past the loop."""
        return pc + 1 if core.registers[self.cond] != 0 else self.end + 1


@dataclass(frozen=True)
class WhileEnd(_WhileControl):
    """End of a while loop body: back to after instruction ``begin`` while ``reg[cond] != 0``."""

    begin: int
    opcode = "while_end"

    def next_pc(self, core, pc: int) -> int:
        """The body again while the condition is nonzero, else past the loop."""
        return self.begin + 1 if core.registers[self.cond] != 0 else pc + 1


@dataclass(frozen=True)
class Branch(_RegisterInstr):
    """One engine sequencer's branch of a dynamic loop, as the timing model sees an executed control
    instruction (never in a program: the core makes them for the executed stream)."""

    engine: Engine
    reg_reads: tuple[int, ...] = ()
    opcode = "branch"

    def reads(self) -> tuple[Footprint, ...]:
        return tuple(reg_footprint(r) for r in self.reg_reads)

    def writes(self) -> tuple[Footprint, ...]:
        return ()


CONTROL = (LoopBegin, LoopEnd, WhileBegin, WhileEnd)


def branches(instr: Instr) -> list[Branch]:
    """The per-engine branches an executed control instruction stands for in the timing model (at least one,
    on the engine that reads the register, so an empty body still costs its branches)."""
    regs = tuple(getattr(instr, n) for n in instr.REG_READS + instr.REG_WRITES if getattr(instr, n) is not None)
    engines = instr.engines or (Engine.GPSIMD.value,)
    return [Branch(engine=Engine(e), reg_reads=regs) for e in engines]
