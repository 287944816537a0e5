"""PSUM forwarding: the pass that lets the readers of a compiler-inserted PSUM -> SBUF copy read PSUM.

A partition broadcast (``x.broadcast_to((P, F))`` of a one-partition row) runs on TensorE, whose output is
in PSUM (the architecture guide's "alternative use case": ``nc_matmul(ones, row)``). The front-end lowers
it as that matmul plus a copy of the PSUM result to an SBUF tile, because the tile it returns may go
anywhere: to DMA or TensorE, which cannot read PSUM, or next to another PSUM operand. Where every reader
of the copy can take the PSUM operand instead (a Vector/Scalar instruction with no other input in PSUM;
the simulator's ISA checks decide), the copy is dropped and the readers read PSUM: the Neuron compiler
keeps the broadcast in PSUM, and the tutorials that broadcast say it costs "a separate instruction on
TensorE", not a copy (``fused_mamba.rst``). A VectorE ``tensor_tensor`` with one PSUM input also streams
at one element per cycle rather than two (the ISA's cost table).

Once the whole kernel is traced, for each copy the front-end marked (``Trace.forwardable``), in program
order, the copy is dropped when all of this holds:

1. the program has no dynamic loop and no cross-core instruction (program order is execution order);
2. the copy does not cast (source and destination dtypes equal), so each reader sees the same values;
3. every later instruction that reads the copy's SBUF box while all of it still holds the copy's values
   reads it through an access pattern equal to the copy's destination, and no other operand of it
   reads the box; the reader with the PSUM source in that operand's place passes the ISA checks;
4. no instruction between the copy and the last such reader writes the PSUM source (the front-end
   holds it for as long as the broadcast tile is held, so its box is not given away meanwhile);
5. later writes into the box (a tile given the box after the broadcast died) are dense, so the parts
   still holding the copy's values are known; once some are overwritten, no
   instruction may read the others (it would be reading part of the broadcast), and the search ends
   when none are left.

The results are the same bit for bit: a reader gets the copy's source values from PSUM instead of
their exact copy from SBUF.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Iterable, Sequence

from torchneuron.sim import AP, SimulatorError
from torchneuron.sim.instruction import Engine, Footprint
from torchneuron.sim.isa import Instr, TensorCopy, TensorScalar, TensorTensor
from torchneuron.sim.isa.control import CONTROL

_READS_PSUM = (Engine.VECTOR, Engine.SCALAR)  # the engines that may read an operand from PSUM
RECOMPUTABLE = (TensorTensor, TensorScalar)   # pure element-wise instructions: the result is a function of the operands
RECOMPUTE_WINDOW = 4096  # instructions back an earlier identical one is looked for (bounds the trace-time scan)


Rect = tuple[tuple[int, int], tuple[int, int]]   # (partitions, bytes), half-open


def _dense_cover(ap: AP, box: Footprint) -> Rect | None:
    """The part of ``box`` that writing ``ap`` overwrites entirely, or None where it cannot be told (a
    strided pattern) or is empty."""
    f = ap.footprint()
    if f.memory != box.memory or ap.free_elems * ap.dtype.itemsize != f.byte_range[1] - f.byte_range[0]:
        return None
    p = max(f.partitions[0], box.partitions[0]), min(f.partitions[1], box.partitions[1])
    b = max(f.byte_range[0], box.byte_range[0]), min(f.byte_range[1], box.byte_range[1])
    return (p, b) if p[0] < p[1] and b[0] < b[1] else None


def _minus(rects: list[Rect], cut: Rect) -> list[Rect]:
    """The rectangles ``rects`` without ``cut``."""
    (cp, cb), out = cut, []
    for (p0, p1), (b0, b1) in rects:
        if cp[0] >= p1 or p0 >= cp[1] or cb[0] >= b1 or b0 >= cb[1]:
            out.append(((p0, p1), (b0, b1)))
            continue
        lo, hi = max(p0, cp[0]), min(p1, cp[1])
        out += [r for r in (((p0, lo), (b0, b1)), ((hi, p1), (b0, b1)),          # partitions above, below
                            ((lo, hi), (b0, max(b0, cb[0]))), ((lo, hi), (min(b1, cb[1]), b1)))  # bytes left, right
                if r[0][0] < r[0][1] and r[1][0] < r[1][1]]
    return out


def _forwarded(instr: Instr, dst: AP, src: AP, box: Footprint) -> Instr | None:
    """``instr`` reading ``src`` where it read ``dst`` (all its reads of ``box`` through ``dst``), or None."""
    if src.kind == "psum" and instr.engine not in _READS_PSUM:
        return None
    names = [n for n, ap in instr.operands() if n not in instr.WRITES and ap.footprint().overlaps(box)]
    if not names or any(getattr(instr, n) != dst for n in names):
        return None
    try:
        new = dataclasses.replace(instr, **{n: src for n in names})
    except SimulatorError:   # e.g. its other input is in PSUM too, or GpSimd
        return None
    if any(f.overlaps(box) for f in new.reads()):  # it reads the box some other way (a non-tile operand)
        return None
    return new


def _plan(program: Sequence[Instr | None], at: int, dst: AP, src: AP) -> dict[int, Instr] | None:
    """The readers of ``dst`` (written by ``program[at]``) rewritten to read ``src``, which holds the same
    values, by index; None if not all can."""
    box, source = dst.footprint(), src.footprint()
    if box.period:   # (the parts still live are tracked as dense rectangles)
        return None
    whole = (box.partitions, box.byte_range)
    live = [whole]   # the parts of the box still holding the values written at ``at``
    rewritten: dict[int, Instr] = {}
    clobbered = False
    for j in range(at + 1, len(program)):
        instr = program[j]
        if instr is None:   # dropped already
            continue
        boxes = [dataclasses.replace(box, partitions=p, byte_range=b) for p, b in live]
        if any(f.overlaps(b) for f in instr.reads() for b in boxes):
            new = None if clobbered or live != [whole] else _forwarded(instr, dst, src, box)
            if new is None or any(f.overlaps(source) for f in instr.writes()):
                return None
            rewritten[j] = new
        if any(f.overlaps(b) for f in instr.writes() for b in boxes):
            for n, ap in instr.operands():
                cut = _dense_cover(ap, box) if n in instr.WRITES else None
                if cut is not None:
                    live = _minus(live, cut)
            boxes = [dataclasses.replace(box, partitions=p, byte_range=b) for p, b in live]
            if any(f.overlaps(b) for f in instr.writes() for b in boxes):
                return None   # it writes part of the values in a way not told apart (a strided pattern)
            if not live:
                return rewritten or None
        clobbered = clobbered or any(f.overlaps(source) for f in instr.writes())
    return rewritten or None


def _same_but_dst(a: Instr, b: Instr) -> bool:
    """Whether two instructions differ at most in their destination's place (same shape and dtype)."""
    return (type(a) is type(b) and a.dst.dtype == b.dst.dtype and a.dst.shape == b.dst.shape
            and all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a) if f.name != "dst"))


def _writes_any(program: Sequence[Instr | None], lo: int, hi: int, boxes: Sequence[Footprint]) -> bool:
    """Whether an instruction in ``program[lo:hi]`` writes into one of ``boxes``."""
    return any(i is not None and any(f.overlaps(b) for f in i.writes() for b in boxes) for i in program[lo:hi])


def _in_place(instr: Instr) -> bool:
    """Whether the instruction writes where it reads (its result is then not a function of its inputs' values
    before it)."""
    return any(w.overlaps(r) for w in instr.writes() for r in instr.reads())


def forward(program: Sequence[Instr], copies: Iterable[int],
            recomputations: Iterable[tuple[int, int]] = ()) -> tuple[list[Instr], list[int]]:
    """The program without the redundant instructions the front-end marked, where sound (see the module
    docstring), and the original index of each instruction kept. ``copies``: indices of PSUM -> SBUF
    ``tensor_copy`` instructions the front-end inserted; ``recomputations``: (index, index of the earlier
    instruction it may repeat)."""
    from torchneuron.nki.multicore import CrossCore  # (multicore builds on the tracer)
    marked, again = set(copies), dict(recomputations)
    if (not marked and not again) or any(isinstance(i, (CONTROL, CrossCore)) for i in program):
        return list(program), list(range(len(program)))
    out: list[Instr | None] = list(program)
    checked: dict[int, int] = {}   # first instruction -> nothing in (it, checked) writes its operands or result
    for at in sorted(marked | set(again)):
        instr = out[at]
        if at in marked:
            if (not isinstance(instr, TensorCopy) or instr.src.kind != "psum" or instr.dst.kind != "sbuf"
                    or instr.src.dtype != instr.dst.dtype):
                continue
            src = instr.src
        else:
            root = again[at]
            first = out[root]
            if (first is None or not isinstance(instr, RECOMPUTABLE) or not _same_but_dst(first, instr)
                    or _in_place(first) or _in_place(instr)
                    or _writes_any(out, checked.get(root, root + 1), at, [*instr.reads(), first.dst.footprint()])):
                continue
            checked[root] = at
            src = first.dst
        plan = _plan(out, at, instr.dst, src)
        if plan is None:
            continue
        for j, new in plan.items():
            out[j] = new
        out[at] = None
    kept = [k for k, i in enumerate(out) if i is not None]
    return [out[k] for k in kept], kept


def note_result(trace, instr: Instr, dst) -> None:
    """At trace time: remember the result ``dst`` (a whole tile) of a pure element-wise ``instr``; when an
    earlier instruction computed the same from the same operands and its result tile is still held and
    unwritten, with the operands unwritten since, mark ``instr`` as a recomputation of it and keep that
    result allocated while ``dst`` is held (so the pass finds it unchanged)."""
    if not isinstance(instr, RECOMPUTABLE) or dst.base is not None or not dst.buffer.on_chip or _in_place(instr):
        return
    key = (type(instr), dst.dtype, tuple(dst.shape),
           tuple(getattr(instr, f.name) for f in dataclasses.fields(instr) if f.name != "dst"))
    here = len(trace.instructions) - 1
    seen = trace.results.get(key)
    if seen is not None:
        root_ref, first, checked = seen   # checked: nothing in (first, checked) writes its operands or result
        root = root_ref()
        if (root is not None and here - checked <= RECOMPUTE_WINDOW
                and not _writes_any(trace.instructions, checked, here, [*instr.reads(), first.dst.footprint()])):
            dst._same_value_as = root
            trace.recomputations.append((instr, first))
            trace.results[key] = (root_ref, first, here)
            return
    trace.results[key] = (weakref.ref(dst), instr, here + 1)
