"""Memory planning: a traced program's HBM intermediates packed into one arena by liveness.

Library kernels called inside a segment allocate their results in HBM (``nl.shared_hbm``); the ones
the segment does not return are scratch buffers, each alive from the first instruction that touches
it to the last. Buffers whose lives do not overlap share bytes: each is placed, in order of first
use, at the lowest 64-byte-aligned offset not held by a buffer still alive (first fit), and every
access pattern into it is rewritten to address the arena at that offset. The arena is one input
slot the runtime binds to a device allocation per call (``ARENA``), so the caching allocator and
``torch.neuron.memory_stats`` see it; the report gives its size (the planned peak) beside the sum
of the buffers it replaces.

A reused region orders the instructions of its two tenants (the timing model sees the shared bytes),
which is the price of the smaller peak, as on the device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from torchneuron.sim import Program
from torchneuron.sim.program import ArgSlot

ARENA = "arena"
ALIGN = 64


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of the arena (the planned peak of the intermediates) and the sum of the buffers it holds."""

    arena_bytes: int
    buffer_bytes: int
    buffers: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_memory(program: Program) -> tuple[Program, MemoryPlan]:
    """``program`` with its scratch buffers placed in one arena slot, and the plan's figures."""
    scratch = {s.name: s for s in program.args if s.kind == "scratch"}
    if not scratch or ARENA in {s.name for s in program.args}:
        return program, MemoryPlan(0, 0, 0)
    life: dict[str, list[int]] = {}
    for i, instr in enumerate(program.instructions):
        for _, ap in instr.operands():
            name = ap.memory.removeprefix("hbm:")
            if not ap.on_chip and name in scratch:
                span = life.setdefault(name, [i, i])
                span[1] = i
    base: dict[str, int] = {}
    live: list[tuple[int, int, int]] = []          # (offset, end, last use) of placed buffers
    top = 0
    for name in sorted(life, key=lambda n: life[n][0]):
        first, last = life[name]
        live = [b for b in live if b[2] >= first]
        size = _align(scratch[name].nbytes)
        offset = 0
        for lo, hi, _ in sorted(live):
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        base[name] = offset
        live.append((offset, offset + size, last))
        top = max(top, offset + size)
    instructions = tuple(_rebased(instr, base) for instr in program.instructions)
    args = tuple(s for s in program.args if s.name not in scratch) + (ArgSlot(ARENA, (max(top, 1),), torch.uint8),)
    plan = MemoryPlan(top, sum(scratch[n].nbytes for n in life), len(life))
    return Program(instructions, args, program.name), plan


def _rebased(instr, base: dict[str, int]):
    changes = {}
    for field, ap in instr.operands():
        name = ap.memory.removeprefix("hbm:")
        if not ap.on_chip and name in base:
            changes[field] = dataclasses.replace(ap, memory=f"hbm:{ARENA}", offset=ap.offset + base[name])
    return dataclasses.replace(instr, **changes) if changes else instr
