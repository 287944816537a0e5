"""Engine balance: element-wise instructions of a compiled program moved to the engine that frees first.

Tracing places each element-wise instruction where its kernel said: most on VectorE, streaming templates'
tiles alternating VectorE and GpSimd, ScalarE mostly running activations. In a whole graph's program one
engine can then run behind while another idles (the demo's AdamW pass: VectorE busy 12 of its 15 us, ScalarE
4). Several instructions compute the same on more than one engine: ``tensor_scalar`` on VectorE, GpSimd or
ScalarE (ScalarE only for multiply and add), ``tensor_copy`` on the three, ``tensor_tensor`` on VectorE or
GpSimd; GpSimd reads no PSUM. This pass moves them as a compiler that knows the schedule can: in order of
their start, each goes to the allowed engine on which it ends earliest (in the first gap of that engine's work
from its ready time, its producers' end read off the current schedule), for a few rounds while the program gets
faster; the result is kept only when it is. Only engines change, never the
order, the operands or the values (an instruction's result does not depend on the engine that computes it).
"""
from __future__ import annotations

import bisect
import dataclasses

from torchneuron.sim import Engine, Program
from torchneuron.sim.memory import SimulatorError
from torchneuron.sim.specs import ChipSpec
from torchneuron.sim.timing import Timeline, instruction_cost_ns

ROUNDS = 3   # allocations, each from the schedule of the best program so far
SWEEPS = 3   # passes over KINDS while one makes the program faster
STREAM = (Engine.VECTOR, Engine.GPSIMD, Engine.SCALAR)
# the instructions that compute the same on several engines, and those engines (before PSUM and operator limits)
MOVABLE = {"tensor_scalar": STREAM, "tensor_copy": STREAM, "tensor_tensor": (Engine.VECTOR, Engine.GPSIMD)}
# Which instructions may move, each set tried in turn from the best program so far, and the sets swept again
# while a sweep gains: the greedy allocation reads ready times off a schedule its own moves change, so moving
# fewer kinds is at times the faster (the demo's backward: 178.2 us, 177.9 with the sets tried once, 176.7 swept)
KINDS = (MOVABLE,
         {op: tuple(e for e in engines if e is not Engine.SCALAR) for op, engines in MOVABLE.items()},
         {"tensor_copy": MOVABLE["tensor_copy"]},
         {"tensor_tensor": MOVABLE["tensor_tensor"]})


def balance_engines(program: Program, spec: ChipSpec, rounds: int = ROUNDS) -> Program:
    """``program`` with its movable element-wise instructions on the engines that free first (itself when that
    is not faster)."""
    if program.dynamic:
        return program
    best, timeline = program, program.schedule(spec)
    for _ in range(SWEEPS):
        start = timeline.device_time_ns
        for movable in KINDS:
            for _ in range(rounds):
                candidate = _allocate(best, timeline, spec, movable)
                if candidate is None:
                    break
                scheduled = candidate.schedule(spec)
                if scheduled.device_time_ns >= timeline.device_time_ns:
                    break
                best, timeline = candidate, scheduled
        if timeline.device_time_ns >= start:
            break
    return best


def _allocate(program: Program, timeline: Timeline, spec: ChipSpec, movable: dict) -> Program | None:
    """One allocation pass over ``program``'s stream-engine instructions in order of their start in ``timeline``,
    those of ``movable`` (opcode -> engines) free to move (None: nothing moves)."""
    instructions = program.instructions
    busy: dict = {e: [] for e in STREAM}   # per engine, the (start, end) intervals allocated so far, sorted
    moved = list(instructions)
    order = sorted((k for k, ins in enumerate(instructions) if ins.engine in STREAM), key=lambda k: timeline.start_ns[k])
    for k in order:
        ready = max((timeline.end_ns[p] for p in timeline.preds[k]), default=0.0)
        options = [(ins, instruction_cost_ns(ins.cost_inputs(), spec)) for ins in _placements(instructions[k], movable)]
        # the engine it ends on earliest (an engine runs what is ready: a gap before later work is used); ties keep
        # it where it is (the first option)
        starts = [_first_gap(busy[ins.engine], ready, cost) for ins, cost in options]
        j = min(range(len(options)), key=lambda i: starts[i] + options[i][1])
        ins, cost = options[j]
        bisect.insort(busy[ins.engine], (starts[j], starts[j] + cost))
        moved[k] = ins
    if all(a is b for a, b in zip(moved, instructions)):
        return None
    return Program(moved, program.args, program.name, program.after)


def _first_gap(intervals: list, ready: float, length: float) -> float:
    """The earliest start at or after ``ready`` of ``length`` ns that overlaps none of the sorted ``intervals``."""
    t = ready
    # (intervals do not overlap: of those starting before ``ready`` only the last can reach past it)
    for start, end in intervals[max(bisect.bisect_left(intervals, (ready,)) - 1, 0):]:
        if start >= t + length:
            break
        t = max(t, end)
    return t


def _placements(ins, movable: dict) -> list:
    """``ins`` and the same instruction on each other engine of ``movable`` that can run it."""
    out = [ins]
    for engine in movable.get(getattr(ins, "opcode", None), ()):
        if engine is ins.engine:
            continue
        try:
            out.append(dataclasses.replace(ins, engine=engine))
        except SimulatorError:   # what the engine cannot run (GpSimd: PSUM; ScalarE: other than multiply, add)
            continue
    return out
