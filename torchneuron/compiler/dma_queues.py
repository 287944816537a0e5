"""DMA queue allocation: each transfer of a compiled program on the queue that frees first.

Tracing gives DMA transfers their queues round-robin in program order (``nki.tracing.DMA_QUEUES``).
A queue is first-in first-out, so a transfer that waits for compute (the store of a kernel's result)
holds back every later transfer of its queue, ready or not: in a whole graph's program, loads of the
next kernel sat behind stores of the previous one. This pass allocates queues as a compiler that
knows the schedule can: in program order, each transfer goes to the queue on which it can start
earliest, its ready time (its producers' end) and its duration read off the current schedule,
for a few rounds while the program gets faster. Only the queue numbers change, never the order or
the values.
"""
from __future__ import annotations

import dataclasses

from torchneuron.nki.tracing import DMA_QUEUES
from torchneuron.sim import Engine, Program
from torchneuron.sim.specs import ChipSpec
from torchneuron.sim.timing import Timeline


ROUNDS = 3   # allocations, each from the schedule of the best program so far (ready times move as queues do)


def allocate_dma_queues(program: Program, spec: ChipSpec, rounds: int = ROUNDS) -> Program:
    """``program`` with its DMA transfers on the queues that free first (itself when that is not faster)."""
    best, timeline = program, program.schedule(spec)
    for _ in range(rounds):
        candidate = _allocate(best, timeline)
        scheduled = candidate.schedule(spec)      # each program is scheduled once: the next round reads it
        if scheduled.device_time_ns >= timeline.device_time_ns:
            break
        best, timeline = candidate, scheduled
    return best


def _allocate(program: Program, timeline: Timeline) -> Program:
    """One allocation pass over ``program``, reading ready times and durations off its ``timeline``."""
    free = [0.0] * DMA_QUEUES          # when each queue's last allocated transfer is estimated to end
    moved = list(program.instructions)
    for k, ins in enumerate(program.instructions):
        if ins.engine is not Engine.DMA or not hasattr(ins, "queue"):
            continue
        ready = max((timeline.end_ns[p] for p in timeline.preds[k]), default=0.0)
        # the queue it starts on earliest; among queues idle by then, the one idle longest (ties all went to
        # queue 0, which then held a third of a backward's transfers and ran late when they did)
        q = min(range(DMA_QUEUES), key=lambda j: (max(free[j], ready), free[j]))
        free[q] = max(free[q], ready) + timeline.end_ns[k] - timeline.start_ns[k]
        if q != ins.queue:
            moved[k] = dataclasses.replace(ins, queue=q)
    return Program(moved, program.args, program.name, program.after)
