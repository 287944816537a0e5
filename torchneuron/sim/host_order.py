"""A host execution order for a static program: its instructions reordered so that each runs just before the first
instruction that needs it, every dependency kept.

The core executes a program functionally, one instruction after another (``core.py``); any order that keeps every
dependency leaves every byte of every memory as program order does, so the results, and the program's timing (which
comes from its own instruction list, ``Program.schedule``), are unchanged. A compiled program is ordered for the
chip: loads issued long before their tiles are used, engines' instructions interleaved, a matmul's PSUM result
read out while other products run. On the host a tile is then written long before it is read, and has left the
CPU's caches by then. ``demand_order`` runs the instructions nothing later depends on (stores, a tile's last
value) in program order, each after its ancestors not run yet, depth first: a producer runs right before its
consumer, while its values are still in the caches, and a load issued early runs where its tile is first read.

Dependencies are those of the timing model (``timing.dependencies``: read-after-write, write-after-read and
write-after-write on the boxes of memory instructions touch, every conflict kept: the host has no in-order queues)
and what footprints cannot tell:

- two argument slots may be bound to one tensor (an in-place op's input and output), so their bytes may be the
  same: an instruction writing HBM keeps its order with every instruction touching HBM;
- an engine's accumulation registers: the instructions of one engine with a register reduction (``reduce_cmd``
  or ``reduce_res``) keep their order;
- barriers: an instruction outside ``REORDERABLE`` (random numbers, the sequencer's registers, a DMA whose indices
  decide what it touches and whether it raises) keeps everything before it before it and everything after after.

Errors: an instruction whose error depends on values is a barrier, so a run raising there has done what program
order had done; one whose error does not (a tile beyond the core's SBUF, a layout a step cannot take) is known when
the core prepares the program, which then keeps program order (``core._Plan``).
"""
from __future__ import annotations

from typing import Sequence

from torchneuron.sim import timing
from torchneuron.sim.isa import (Activation, AffineSelect, BnAggr, BnStats, DmaCopy, DmaTranspose, Instr, Iota, Memset,
                                 NcMatmul, NcMatmulTiled, NcTranspose, Reciprocal, ScalarTensorTensor, TensorCopy,
                                 TensorReduce, TensorScalar, TensorTensor)

# the instructions whose effects are their footprints' bytes and, for some, their engine's registers
REORDERABLE = frozenset({Activation, AffineSelect, BnAggr, BnStats, DmaCopy, DmaTranspose, Iota, Memset, NcMatmul,
                         NcMatmulTiled, NcTranspose, Reciprocal, ScalarTensorTensor, TensorCopy, TensorReduce,
                         TensorScalar, TensorTensor})


def _reorderable(instr: Instr) -> bool:
    """Whether ``instr`` may move past others (its kind, and for a DMA: no indirect rows)."""
    if type(instr) not in REORDERABLE:
        return False
    return not (type(instr) is DmaCopy and (instr.src_index is not None or instr.dst_index is not None))


def _uses_registers(instr: Instr) -> bool:
    """Whether ``instr`` reads or writes its engine's accumulation registers."""
    return getattr(instr, "reduce_cmd", "idle") != "idle" or getattr(instr, "reduce_res", None) is not None


def predecessors(instructions: Sequence[Instr]) -> list[list[int]]:
    """For each instruction, the earlier ones it must run after on the host (see the module docstring)."""
    preds = timing.dependencies(instructions, in_order=lambda _queue: False)
    last_registers: dict = {}   # engine -> its latest instruction using the registers
    barrier = -1                # the latest instruction outside REORDERABLE
    hbm_write = -1              # the latest instruction writing HBM
    hbm_since: list[int] = []   # the instructions touching HBM since then
    for i, instr in enumerate(instructions):
        deps = preds[i]
        if not _reorderable(instr):
            deps[:] = range(max(barrier, 0), i)  # after the last barrier and everything since
            barrier = hbm_write = i
            hbm_since = []
            continue
        if barrier >= 0:
            deps.append(barrier)
        writes_hbm = any(f.memory.startswith("hbm") for f in instr.writes())
        if writes_hbm or any(f.memory.startswith("hbm") for f in instr.reads()):
            if hbm_write >= 0:
                deps.append(hbm_write)
            if writes_hbm:
                deps.extend(hbm_since)
                hbm_write, hbm_since = i, []
            else:
                hbm_since.append(i)
        if _uses_registers(instr):
            last = last_registers.get(instr.engine)
            if last is not None:
                deps.append(last)
            last_registers[instr.engine] = i
    return preds


def demand_order(instructions: Sequence[Instr]) -> tuple[Instr, ...]:
    """``instructions`` in demand order: going through them in program order, each one no later instruction depends
    on (a store, the last write of a tile) runs after its ancestors not run yet, depth first (each after its own
    ancestors, earlier ones first): every instruction runs right after what it needs and as late as it can."""
    preds = predecessors(instructions)
    needed = [False] * len(instructions)
    for deps in preds:
        for j in deps:
            needed[j] = True
    done = [False] * len(instructions)
    order: list[int] = []
    for sink in (i for i, n in enumerate(needed) if not n):
        done[sink] = True
        stack = [(sink, iter(sorted(preds[sink])))]
        while stack:  # depth first, without recursion (a chain of dependencies can be thousands long)
            node, deps = stack[-1]
            for j in deps:
                if not done[j]:
                    done[j] = True
                    stack.append((j, iter(sorted(preds[j]))))
                    break
            else:
                stack.pop()
                order.append(node)
    return tuple(instructions[i] for i in order)
