"""DMA ordering: each transfer of a compiled program placed in program order by when it can start.

A DMA queue runs its transfers first in, first out, in program order, and tracing emits them in the order
the kernels were called: a load that is ready at the start of the program (a later kernel's weights) is
queued behind transfers that wait for compute, so a whole graph's late kernels wait for loads that could
have been done long before. This pass moves each transfer towards the place in program order its ready
time (its producers' end in the current schedule) gives it, and compute instructions to the place their
start gives them, so queues take transfers closer to the order they become ready. Moved all the way, ready
transfers also take DMA engines and HBM bandwidth from the ones already on the critical path, so half way
(and a quarter, three quarters) is tried too (a backward that keeps the DMA engines busy throughout gains from
none and is left as it is).

Values never change: the new order keeps every pair of instructions that touch common bytes (read after
write, write after read, write after write) and every explicit wait in their original order; a program
with control instructions (dynamic loops) is left as it is. The queue allocation pass then runs on the
new order, and the result is kept only when the program schedules faster.
"""
from __future__ import annotations

from torchneuron.compiler.dma_queues import allocate_dma_queues
from torchneuron.sim import Engine, Program
from torchneuron.sim.specs import ChipSpec
from torchneuron.sim.timing import Timeline, dependencies


ROUNDS = 3   # orderings, each from the schedule of the best program so far
# How far each transfer moves from its start in the current schedule towards its ready time: all the way
# suits an optimizer step's independent updates, half way a forward's chain of kernels; the faster is kept.
# Then, from the best order so far, LATEST (each transfer at its latest start, not before it is ready nor after
# its start): for a program whose DMA engines are busy throughout, the transfers with the least slack go first
# (tried first, it led the demo's forward to a worse order than the other two find). Transfers placed at the
# same time (queued together at the start) go by latest start, or in program order (LATEST_IN_ORDER): of the two,
# neither is always the faster (the demo's backward: 183.8 and 185.5 us from 188.0; the first is tried first).
LATEST, LATEST_IN_ORDER = "latest", "latest, ties in program order"
# A quarter and three quarters of the way are tried after those (the demo's forward: 121.3 -> 120.7 us).
STAGES = ((1.0, 0.5, 0.25, 0.75), (LATEST_IN_ORDER, LATEST))


def order_dma(program: Program, spec: ChipSpec) -> Program:
    """``program`` with its transfers ordered by ready time and queues allocated again (itself when not faster)."""
    if program.dynamic:
        return program
    best, timeline = program, program.schedule(spec)
    preds = conflicts(program)
    for placements in STAGES:
        for _ in range(ROUNDS):
            improved = False
            for placement in placements:
                moved = order_transfers(best, timeline, preds, placement)
                if moved is None:
                    continue
                ordered, position = moved
                candidate = allocate_dma_queues(ordered, spec, rounds=1)
                scheduled = candidate.schedule(spec)
                if scheduled.device_time_ns < timeline.device_time_ns:
                    best, timeline, improved = candidate, scheduled, True
                    preds = _renumbered(preds, position)
            if not improved:
                break
    return best


def order_transfers(program: Program, timeline: Timeline, preds: list[list[int]],
                    placement: float | str = 1.0) -> tuple[Program, list[int]] | None:
    """``program`` (whose instructions must follow ``preds``, its ``conflicts``) with each transfer placed
    ``placement`` of the way from its start in ``timeline`` to its ready time (LATEST, LATEST_IN_ORDER: at its latest
    start, between the two), compute instructions at their start, and each old instruction's new position (None:
    nothing moves)."""
    instructions = program.instructions
    start, end = timeline.start_ns, timeline.end_ns
    latest = latest_starts(timeline, preds) if placement in (LATEST, LATEST_IN_ORDER) else None

    def key(i: int) -> tuple[float, float, int]:
        # (LATEST: ties, such as transfers queued together at the start, go by latest start: the least slack first)
        tie = latest[i] if placement == LATEST else 0.0
        if instructions[i].engine is Engine.DMA:
            ready = max((end[p] for p in preds[i]), default=0.0)
            if latest is not None:
                return min(start[i], max(ready, latest[i])), tie, i
            return start[i] - placement * (start[i] - ready), tie, i
        return start[i], tie, i

    order = sorted(range(len(instructions)), key=key)
    if order == list(range(len(instructions))):
        return None
    position = [0] * len(order)
    for new, old in enumerate(order):
        position[old] = new
    # the schedule met every dependency, so this holds; checked because a broken order would change values
    if any(position[p] >= position[i] for i, ps in enumerate(preds) for p in ps):
        return None
    after = [(position[c], position[p]) for c, p in program.after]
    return Program([instructions[i] for i in order], program.args, program.name, after), position


def latest_starts(timeline: Timeline, preds: list[list[int]]) -> list[float]:
    """Each instruction's latest start that keeps the program's length: its length minus the longest chain of
    durations (as ``timeline`` ran them) from the instruction through its dependents ``preds`` to the end."""
    n = len(preds)
    tail = [timeline.end_ns[i] - timeline.start_ns[i] for i in range(n)]
    for i in range(n - 1, -1, -1):   # dependents come later in program order: each tail is final when reached
        for p in preds[i]:
            tail[p] = max(tail[p], timeline.end_ns[p] - timeline.start_ns[p] + tail[i])
    return [timeline.device_time_ns - t for t in tail]


def _renumbered(preds: list[list[int]], position: list[int]) -> list[list[int]]:
    """``preds`` of a program whose instruction i moved to ``position[i]``: the same pairs, so still every
    conflict (computed once: queue allocation and reordering change no instruction's bytes)."""
    out: list[list[int]] = [[] for _ in preds]
    for i, ps in enumerate(preds):
        out[position[i]] = sorted(position[p] for p in ps)
    return out


def conflicts(program: Program) -> list[list[int]]:
    """For each instruction, every earlier one it must follow whatever the queues: the instructions touching
    common bytes (the timing model's dependencies with no queue taken as in order) and explicit waits."""
    preds = dependencies(program.instructions, in_order=lambda key: False)
    for c, p in program.after:
        if p not in preds[c]:
            preds[c] = sorted({*preds[c], p})
    return preds

