"""A host layout for a static program's SBUF and PSUM tiles: the same program, its tiles packed into few host bytes.

Next-fit allocation spreads a long program's tiles over nearly all of each SBUF partition and every PSUM bank (no
false write-after-read waits on chip), so on the host its instructions read bytes that left the CPU's caches long
ago. Execution is functional and sequential in program order, and the program's timing comes from its own
instructions (``Program.schedule``), so a core may execute an equivalent copy whose on-chip operands sit at other
host offsets: ``packed`` builds it, or returns None where it cannot prove the copy equivalent.

Equivalence. Each SBUF access (an operand of an instruction) belongs to a *unit*; a unit is moved as a whole
(every access by one byte shift), so addresses inside it keep their distances. Accesses join one unit when

- a read may see bytes a live write left (their boxes overlap: the value flows from the write to the read);
- two operands of one instruction overlap on chip (in-place and aliasing behaviour stays as it was);
- they are the same operand of consecutive matmuls the core runs as one batched product (constant steps).

A write that stores every byte of its box (a dense pattern of an instruction that always writes its whole
destination) ends what earlier writes left there: later reads of those bytes join only the new write. A unit's
life runs from its first to its last access; units whose lives and partitions overlap get disjoint host bytes
(first fit), so no other unit's write lands between a write and its reads. A host offset keeps the simulated
offset modulo a cache line (vectorized host code meets the same alignment).

PSUM is packed the same way, each memory on its own, with shifts of whole banks (a TensorE write stays inside one
bank, at its offset there). A matmul accumulating onto its destination (accumulate True, or None: it adds where an
accumulation group is open) reads it: its group flags, one per word, are set by the last write of that word (a
TensorE write opens, any other closes), so they move with the data.

Refused (None) for a memory: programs with dynamic loops, an instruction outside ``WHOLE_WRITES``' classes touching
it, a pattern outside its partitions, a read of bytes no earlier instruction of the program wrote (their value, and
in PSUM their group flags, are whatever the previous kernel left at those addresses), or a packing that would not
fit. The packed copy leaves SBUF's and PSUM's bytes elsewhere than the program's addresses: a run whose on-chip
state is read afterwards (a multi-core segment, NaN-fill debugging) runs the program as it is
(``NeuronCore.run_bound``).
"""
from __future__ import annotations

from bisect import insort
from dataclasses import replace
from typing import Sequence

import torch

from torchneuron.sim.isa import (Activation, AffineSelect, BnAggr, BnStats, DmaCopy, DmaTranspose, Instr, Iota,
                                 Memset, NcMatmul, NcMatmulTiled, NcTranspose, Reciprocal, ScalarTensorTensor,
                                 TensorCopy, TensorReduce, TensorScalar, TensorTensor)
from torchneuron.sim.isa.tensor_engine import extends_matmul_run, run_operands
from torchneuron.sim.memory import AP, PMAX, host_bytes, writes_once
from torchneuron.sim.program import Program

MIN_SPAN = 16 * 1024  # bytes per partition a program's SBUF accesses must reach beyond for packing to pay
HOST_ALIGN = 64       # a host offset equals its simulated offset modulo this (a cache line)

# instructions that write every element of their destination patterns, whatever the data (an indirect DMA
# skipping rows out of range does not: ``_keeps_old``)
WHOLE_WRITES = (Activation, AffineSelect, BnAggr, BnStats, DmaCopy, DmaTranspose, Iota, Memset, NcMatmul,
                NcMatmulTiled, NcTranspose, Reciprocal, ScalarTensorTensor, TensorCopy, TensorReduce, TensorScalar,
                TensorTensor)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WRITTEN = {torch.uint8: 255, torch.int16: -1, torch.int32: -1, torch.int64: -1}  # every byte 0xFF


def packed(program: Program, capacity: int, instructions: Sequence[Instr] | None = None, *,
           psum: tuple[int, int] | None = None) -> tuple[Instr, ...] | None:
    """``program``'s instructions (or ``instructions``: them in the order the core runs them, ``host_order``) with
    their SBUF tiles packed on the host (see the module docstring) into ``capacity`` bytes a partition, and with
    ``psum`` = (bytes a partition, bank bytes) their PSUM tiles too, whole banks at a time; None where the program is
    not eligible or the packing changes nothing."""
    if program.dynamic:
        return None
    instructions = program.instructions if instructions is None else instructions
    spaces = [("sbuf", capacity, HOST_ALIGN, MIN_SPAN)]
    if psum is not None:
        spaces.append(("psum", psum[0], psum[1], psum[1]))  # (pays where a program's tiles reach a second bank)
    moves = []
    for memory, room, align, min_span in spaces:
        accesses = _accesses(instructions, memory)
        if accesses is None:
            continue
        span = max((ap.byte_range[1] for _, _, ap, _ in accesses), default=0)
        if span <= min_span or span > room:
            continue
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # (the written-bytes mask's tiles are too small for threads to pay)
        try:
            units = _units(accesses, span, instructions)
        finally:
            torch.set_num_threads(threads)
        if units is None:
            continue
        shifts = _host_shifts(units, len(accesses), room, align)
        if shifts is not None and any(shifts):
            moves.extend(zip(accesses, shifts))
    return _shifted(instructions, moves) if moves else None


def _accesses(instructions, memory: str) -> list[tuple[int, str, AP, str]] | None:
    """(instruction index, operand name, pattern, how) of every operand in ``memory`` ("sbuf" or "psum"), ``how``
    one of "read", "write" and "update" (a write that may leave elements as they were); a destination the
    instruction also reads (a matmul accumulating in PSUM, whose group flags say where it adds) is a read and an
    update. None where an instruction touching ``memory`` is not one ``packed`` knows or a pattern leaves the
    partitions."""
    out = []
    for t, instr in enumerate(instructions):
        ops = [(name, ap) for name, ap in instr.operands() if ap.memory == memory]
        if not ops:
            continue
        if not isinstance(instr, WHOLE_WRITES):
            return None
        write = "update" if _keeps_old(instr) else "write"
        reads = instr._read_names()
        for name, ap in ops:
            if ap.start_partition + ap.partitions > PMAX:
                return None
            if name not in instr.WRITES:
                out.append((t, name, ap, "read"))
            elif name in reads:
                out.extend(((t, name, ap, "read"), (t, name, ap, "update")))
            else:
                out.append((t, name, ap, write))
    return out


def _keeps_old(instr: Instr) -> bool:
    """Whether a write of ``instr`` may leave elements of its destination as they were."""
    return isinstance(instr, DmaCopy) and instr.oob_mode == "skip" and (instr.src_index is not None
                                                                         or instr.dst_index is not None)


def _dense(ap: AP) -> bool:
    """Whether ``ap`` covers every byte of its box (partitions x byte range) exactly once."""
    lo, hi = ap.byte_range
    sizes, strides, _ = ap._geometry
    return ap.free_elems * ap.dtype.itemsize == hi - lo and writes_once(sizes, strides)


class _Sets:
    """Union-find over access indices."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        """The representative of ``i``'s set."""
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        """Join the sets of ``i`` and ``j``."""
        a, b = self.find(i), self.find(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def _box(ap: AP) -> tuple[int, int, int, int]:
    """(p0, p1, b0, b1): the partitions and bytes ``ap`` reaches."""
    lo, hi = ap.byte_range
    return ap.start_partition, ap.start_partition + ap.partitions, lo, hi


def _meets(a: tuple, b: tuple) -> bool:
    """Whether boxes (p0, p1, b0, b1, ...) ``a`` and ``b`` share a byte."""
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


class _Live:
    """The boxes (p0, p1, b0, b1, access index, whole) where the bytes earlier writes left may still be read
    (``whole``: the write stored every byte of the box), found through the 4 KiB byte columns they reach."""

    COLUMN = 12  # log2 bytes

    def __init__(self):
        self.boxes: dict[int, tuple] = {}
        self.columns: dict[int, set[int]] = {}
        self.count = 0

    def _columns(self, box: tuple) -> range:
        return range(box[2] >> self.COLUMN, ((box[3] - 1) >> self.COLUMN) + 1)

    def add(self, box: tuple) -> None:
        """Keep ``box``."""
        key, self.count = self.count, self.count + 1
        self.boxes[key] = box
        for c in self._columns(box):
            self.columns.setdefault(c, set()).add(key)

    def meeting(self, box: tuple) -> list[int]:
        """The keys of the boxes sharing a byte with ``box``."""
        keys = set().union(*(self.columns.get(c, ()) for c in self._columns(box)))
        return [k for k in keys if _meets(self.boxes[k], box)]

    def cut(self, box: tuple) -> None:
        """Drop the parts of every box inside ``box`` (a write stored every byte there)."""
        for key in self.meeting(box):
            old = self.boxes.pop(key)
            for c in self._columns(old):
                self.columns[c].discard(key)
            for part in _minus(old, box):
                self.add(part)


def _minus(rec: tuple, cut: tuple) -> list[tuple]:
    """The parts of box ``rec`` (p0, p1, b0, b1, ...) outside box ``cut``, as boxes with ``rec``'s other fields."""
    p0, p1, b0, b1 = rec[:4]
    c0, c1, d0, d1 = cut[:4]
    q0, q1 = max(p0, c0), min(p1, c1)
    parts = ((p0, min(p1, c0), b0, b1), (max(p0, c1), p1, b0, b1),   # partitions beside the cut
             (q0, q1, b0, min(b1, d0)), (q0, q1, max(b0, d1), b1))   # bytes beside it, on the shared partitions
    return [(*p, *rec[4:]) for p in parts if p[0] < p[1] and p[2] < p[3]]


def _covered(box: tuple, boxes: list[tuple]) -> bool:
    """Whether the union of ``boxes`` covers ``box`` (every cell of the grid their edges cut it into)."""
    ps = sorted({box[0], box[1], *(v for b in boxes for v in b[:2] if box[0] < v < box[1])})
    bs = sorted({box[2], box[3], *(v for b in boxes for v in b[2:4] if box[2] < v < box[3])})
    return all(any(b[0] <= p < b[1] and b[2] <= q < b[3] for b in boxes) for p in ps[:-1] for q in bs[:-1])


class _Written:
    """The SBUF bytes a program's writes so far stored, exactly (pattern by pattern): kept as the patterns until a
    read asks (whole writes' boxes answer most reads), then as a [128, bytes] mask of 0xFF where written."""

    def __init__(self, span: int):
        self.span = -(-span // 8) * 8
        self.patterns: list[AP] = []
        self.mask: torch.Tensor | None = None

    def add(self, ap: AP) -> None:
        """Note a write of ``ap``."""
        if self.mask is None:
            self.patterns.append(ap)
        else:
            self._mark(ap)

    def holds(self, ap: AP) -> bool:
        """Whether every byte ``ap`` reads was written."""
        if self.mask is None:
            # (in huge pages: zeroing faults a dozen pages in, not thousands)
            self.mask = host_bytes(PMAX * self.span).view(PMAX, self.span).zero_()
            for w in self.patterns:
                self._mark(w)
        view = self._view(ap)
        return bool((view == _WRITTEN[view.dtype]).all())

    def _mark(self, ap: AP) -> None:
        view = self._view(ap)
        view.fill_(_WRITTEN[view.dtype])

    def _view(self, ap: AP) -> torch.Tensor:
        """``ap``'s elements in the mask, as integers of the element's size."""
        typed = self.mask.view(_INT_OF_SIZE[ap.dtype.itemsize])
        sizes, strides, offset = ap._geometry
        row = typed.stride(0)
        return typed.as_strided((ap.partitions, *sizes), (row, *strides), offset + ap.start_partition * row)


def _units(accesses: list, span: int, instructions) -> list[tuple] | None:
    """Per unit (see the module docstring): (first, last instruction, p0, p1, b0, b1, member access indices);
    None where a read finds bytes no earlier instruction wrote."""
    sets = _Sets(len(accesses))
    written = _Written(span)
    live = _Live()
    by_instr: dict[int, list[int]] = {}
    for k, access in enumerate(accesses):
        by_instr.setdefault(access[0], []).append(k)
    for members in by_instr.values():
        for k in members:  # reads first: an instruction reads its inputs before it writes
            ap, how = accesses[k][2:]
            if how == "read" and not _read_from_live(sets, live, k, ap, written):
                return None
        for i, k in enumerate(members):  # operands overlapping on chip move together
            for j in members[i + 1:]:
                if accesses[k][2].overlaps(accesses[j][2]):
                    sets.union(k, j)
        for k in members:
            ap, how = accesses[k][2:]
            if how == "read":
                continue
            box = _box(ap)
            whole = how == "write" and _dense(ap)
            if whole:  # no later read sees an earlier write's bytes here
                live.cut(box)
            else:      # the bytes it leaves are still the earlier writes': reading them joins their units
                for key in live.meeting(box):
                    sets.union(k, live.boxes[key][4])
            live.add((*box, k, whole))
            written.add(ap)
    _keep_matmul_runs(sets, accesses, by_instr, instructions)
    groups: dict[int, list[int]] = {}
    for k in range(len(accesses)):
        groups.setdefault(sets.find(k), []).append(k)
    units = []
    for members in groups.values():
        boxes = [_box(accesses[k][2]) for k in members]
        times = [accesses[k][0] for k in members]
        units.append((min(times), max(times), min(b[0] for b in boxes), max(b[1] for b in boxes),
                      min(b[2] for b in boxes), max(b[3] for b in boxes), members))
    return units


def _keep_matmul_runs(sets: _Sets, accesses: list, by_instr: dict[int, list[int]], instructions) -> None:
    """Join the operands (in the memory ``accesses`` are of: SBUF, or PSUM's results) of the matmuls the core runs as
    one batched product (``tensor_engine.batch_matmuls``: consecutive matmuls continuing a run, ``extends_matmul_run``),
    side by side: moving them apart would break the run into single products."""
    run: list[int] = []
    for t, instr in enumerate(instructions):
        if run_operands(instr) is None:
            run = []
            continue
        if run and not extends_matmul_run([instructions[i] for i in run], instr):
            run = []
        if run:
            before = {accesses[k][1]: k for k in by_instr.get(run[-1], ())}
            for k in by_instr.get(t, ()):
                if accesses[k][1] in before:
                    sets.union(k, before[accesses[k][1]])
        run.append(t)


def _read_from_live(sets: _Sets, live: _Live, k: int, ap: AP, written: _Written) -> bool:
    """Put read ``k`` (of ``ap``) in the units of the writes whose bytes it may read; False where it may read a
    byte no write stored (boxes of whole writes covering it answer at once, else ``written``)."""
    box = _box(ap)
    found = [live.boxes[key] for key in live.meeting(box)]
    for rec in found:
        sets.union(k, rec[4])
    return _covered(box, [rec for rec in found if rec[5]]) or written.holds(ap)


def _host_shifts(units: list[tuple], n: int, capacity: int, align: int) -> list[int] | None:
    """Per access, the bytes its unit moves by on the host: units by first use, each at the lowest host offset
    (congruent to its own modulo ``align``) clear of the units placed before whose lives and partitions overlap
    its own; None where one would end beyond ``capacity``."""
    shifts = [0] * n
    placed: list[tuple] = []  # (host b0, host b1, p0, p1, last), by host offset
    for first, last, p0, p1, b0, b1, members in sorted(units, key=lambda u: u[0]):
        placed = [u for u in placed if u[4] >= first]
        at = b0 % align
        for h0, h1, q0, q1, _ in placed:
            if q0 >= p1 or p0 >= q1 or h1 <= at:
                continue
            if at + (b1 - b0) <= h0:
                break
            at = h1 + (b0 - h1) % align
        if at + (b1 - b0) > capacity:
            return None
        insort(placed, (at, at + b1 - b0, p0, p1, last))
        for k in members:
            shifts[k] = at - b0
    return shifts


def _shifted(instructions, moves: list[tuple[tuple, int]]) -> tuple[Instr, ...]:
    """``instructions`` with each operand of ``moves`` (access, shift) moved by its shift (unchanged instructions
    stay the same objects)."""
    changes: dict[int, dict[str, AP]] = {}
    made: dict[tuple[AP, int], AP] = {}  # one object per moved pattern: its views are made once
    for (t, name, ap, _), shift in moves:
        if shift:
            key = (ap, shift)
            if key not in made:
                made[key] = AP(ap.memory, ap.dtype, ap.pattern, ap.start_partition, ap.partitions, ap.offset + shift)
            changes.setdefault(t, {})[name] = made[key]
    return tuple(replace(instr, **changes[t]) if t in changes else instr for t, instr in enumerate(instructions))
