"""On-chip allocation by liveness: the pass that places the SBUF/PSUM tiles a trace could not fit.

While tracing, an on-chip tile occupies its box from its allocation until its Python object dies
(``Trace.allocate``). That keeps the double buffering library kernels get from Python lifetimes
(a deque of NBUF live iterations gets NBUF distinct boxes), but a kernel that merely keeps an
earlier iteration's tile bound to a name would run out of memory although no later instruction
touches that tile. So the trace never refuses for lack of room: a tile that does not fit goes to a
virtual address past the memory's capacity, and once the whole kernel is traced (the future known)
this pass gives each such tile a real box:

1. A tile's *liveness* is the range of instructions from its first to its last access; its
   *hold* is the range over which its Python object held it (widened to cover its liveness).
2. Tiles that fit at trace time keep their boxes. Each overflowed tile, in allocation order, takes
   the first box that is free over its hold while every other tile keeps its hold; failing that,
   over its hold while the others keep only their liveness (reclaiming boxes whose tiles are still
   bound in Python but never touched again); failing that, over its own liveness only.
3. Every instruction operand inside a moved tile is rewritten to the new box.

A tensor of legacy block tiles (``(n, par_dim(128), 512)``) is n independent tiles: each block is
placed by its own liveness.

Liveness covers every later access, reads and writes alike, so a tile whose box was reclaimed is
never touched after it was given away: writing through a reclaimed tile is impossible by
construction. A tile that fits nowhere even by liveness raises the memory's overflow error.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import replace
from typing import Iterable, Sequence

from torchneuron.sim import AP, SimulatorError
from torchneuron.sim.isa import Instr
from torchneuron.sim.memory import Region

_BLOCK = 256  # instructions per bucket of the time index used to find tiles whose ranges overlap


class Alloc:
    """One on-chip tile of a trace: its box and the instructions over which Python held it."""

    __slots__ = ("region", "start", "end", "overflow", "blocks", "first", "last", "offset", "reserved", "pinned")

    def __init__(self, region: Region, start: int, overflow: bool, blocks: int = 1):
        self.region, self.start, self.overflow, self.blocks = region, start, overflow, blocks
        self.end: int | None = None          # when the Python object died (start/end: trace clock, see place_by_liveness)
        self.first = self.last = -1          # first / last instruction that accesses it (-1: none)
        self.offset = region.offset          # the byte offset it ends up at
        self.reserved: tuple[int, int] | None = None  # the instruction range it is placed over
        self.pinned: int | None = None       # nl.ndarray(address=...): the byte offset it must end up at

    @property
    def hold(self) -> tuple[int, int]:
        """Instructions [lo, hi] over which the tile is held (its Python lifetime, covering its accesses)."""
        lo, hi = self.start, (self.end if self.end is not None else self.start) - 1
        if self.first >= 0:
            lo, hi = min(lo, self.first), max(hi, self.last)
        return lo, hi

    @property
    def live(self) -> tuple[int, int] | None:
        """Instructions [first, last] that access the tile (None: never accessed)."""
        return (self.first, self.last) if self.first >= 0 else None


def place_by_liveness(instructions: Sequence[Instr], clocks: Sequence[int], allocs: Sequence[Alloc],
                      capacity: dict[str, int], bank_bytes: dict[str, int], align: int = 4) -> list[Instr]:
    """Give every overflowed tile a box within ``capacity`` and rewrite the instructions that access it.

    ``clocks[i]`` is the trace clock at which instruction i was emitted; tile ``start``/``end`` are on
    that clock and are converted to instruction indices here."""
    for a in allocs:
        a.start = bisect.bisect_left(clocks, a.start)
        a.end = bisect.bisect_left(clocks, a.end)
    allocs = [b for a in allocs for b in _split(a)]
    touches = _accesses(instructions, allocs)
    moved = False
    for memory in capacity:
        mine = [a for a in allocs if a.region.memory == memory]
        if any(a.overflow for a in mine):
            _assign(mine, capacity[memory], bank_bytes.get(memory, 0), align, instructions)
            moved = True
    return _rewrite(instructions, touches) if moved else list(instructions)


def _split(a: Alloc) -> list[Alloc]:
    """A tensor of independent block tiles as one Alloc per block (each has its own liveness)."""
    if a.blocks <= 1:
        return [a]
    r, size = a.region, a.region.nbytes // a.blocks
    out = []
    for b in range(a.blocks):
        part = Alloc(Region(r.memory, r.start_partition, r.partitions, r.offset + b * size, size), a.start,
                     a.overflow)
        part.end = a.end
        out.append(part)
    return out


# ---- which tile each operand touches ----------------------------------------------------------

def _accesses(instructions: Sequence[Instr], allocs: Sequence[Alloc]) -> dict[int, list]:
    """Record each tile's first/last access; return {instruction index: [(operand, ap, tiles)]}."""
    by_start = sorted(allocs, key=lambda a: a.start)
    ending: list[tuple[int, int, Alloc]] = []  # heap of (end, id, alloc)
    live: dict[str, tuple[list[int], list[Alloc]]] = {}  # memory -> (sorted offsets, allocs)
    touches: dict[int, list] = {}
    k = 0
    for t, instr in enumerate(instructions):
        while ending and ending[0][0] <= t:
            _remove(live, heapq.heappop(ending)[2])
        while k < len(by_start) and by_start[k].start <= t:
            a = by_start[k]
            k += 1
            if a.end is None or a.end > t:
                _insert(live, a)
                heapq.heappush(ending, (a.end if a.end is not None else len(instructions) + 1, id(a), a))
        for name, ap in instr.operands():
            if not ap.on_chip or ap.memory not in live:
                continue
            owners = _owners(live[ap.memory], ap)
            for a in owners:
                a.first = t if a.first < 0 else a.first
                a.last = t
            if owners:
                touches.setdefault(t, []).append((name, ap, owners))
    return touches


def _insert(live: dict, a: Alloc) -> None:
    offsets, tiles = live.setdefault(a.region.memory, ([], []))
    i = bisect.bisect_left(offsets, a.region.offset)
    offsets.insert(i, a.region.offset)
    tiles.insert(i, a)


def _remove(live: dict, a: Alloc) -> None:
    offsets, tiles = live[a.region.memory]
    i = bisect.bisect_left(offsets, a.region.offset)
    while tiles[i] is not a:  # (live tiles are byte-disjoint, so this runs at most once)
        i += 1
    del offsets[i], tiles[i]


def _owners(entry: tuple[list[int], list[Alloc]], ap: AP) -> list[Alloc]:
    """The live tiles whose boxes an access pattern overlaps (live tiles never overlap each other)."""
    offsets, tiles = entry
    lo, hi = ap.byte_range
    i = max(bisect.bisect_right(offsets, lo) - 1, 0)
    out = []
    while i < len(tiles) and offsets[i] < hi:
        r = tiles[i].region
        if r.offset + r.nbytes > lo and ap.start_partition < r.start_partition + r.partitions \
                and r.start_partition < ap.start_partition + ap.partitions:
            out.append(tiles[i])
        i += 1
    return out


# ---- placement ---------------------------------------------------------------------------------

def _assign(allocs: list[Alloc], cap: int, bank: int, align: int, instructions: Sequence[Instr]) -> None:
    """Place the overflowed tiles of one memory (the others keep their trace-time boxes)."""
    index: dict[int, list[Alloc]] = {}
    _settle_pinned(allocs, instructions)
    for a in allocs:
        if not a.overflow or a.pinned is not None:
            a.reserved = a.hold
            _index(index, a)
    for a in sorted((a for a in allocs if a.overflow and a.pinned is None), key=lambda a: a.start):
        if a.live is None:
            continue  # never accessed: no instruction names its box
        for mine, others in ((a.hold, "reserved"), (a.hold, "live"), (a.live, "live")):
            offset = _first_fit(a.region, _busy(index, mine, others, a.region), cap, bank, align)
            if offset is not None:
                a.offset, a.reserved = offset, mine
                _index(index, a)
                break
        else:
            raise _overflow(a, _busy(index, a.live, "live", a.region), cap, instructions)


def _settle_pinned(allocs: list[Alloc], instructions: Sequence[Instr]) -> None:
    """Put pinned tiles (``address=``) at their requested offsets; a tile the tracer left at a box that a
    pinned tile claims while both are held is re-placed like an overflowed one. Two pinned tiles may share
    a box only if no instruction range touches both (else SimulatorError: the kernel aliased them)."""
    pinned = [a for a in allocs if a.pinned is not None]
    if not pinned:
        return
    for a in pinned:
        a.offset = a.pinned
    for i, a in enumerate(pinned):
        for b in pinned[i + 1:]:
            if _boxes_meet(a, b) and a.live and b.live and a.live[0] <= b.live[1] and b.live[0] <= a.live[1]:
                first = max(a.live[0], b.live[0])
                raise SimulatorError(
                    f"{a.region.memory}: two tiles placed with address= share partitions and bytes at offset "
                    f"{a.offset} while both are in use (instruction {first}, {instructions[first].opcode}); "
                    f"give them disjoint addresses or let the allocator place one")
    virtual = [a for a in pinned if a.region.offset != a.pinned]  # only these can collide with traced boxes
    for b in allocs:
        if b.pinned is not None or b.overflow:
            continue
        for a in virtual:
            (alo, ahi), (blo, bhi) = a.hold, b.hold
            if alo <= bhi and blo <= ahi and _boxes_meet(a, b):
                b.overflow = True
                break


def _boxes_meet(a: Alloc, b: Alloc) -> bool:
    """Whether two tiles share a byte at their final offsets."""
    ra, rb = a.region, b.region
    return (ra.start_partition < rb.start_partition + rb.partitions and rb.start_partition < ra.start_partition
            + ra.partitions and a.offset < b.offset + rb.nbytes and b.offset < a.offset + ra.nbytes)


def _index(index: dict[int, list[Alloc]], a: Alloc) -> None:
    lo, hi = a.reserved
    for b in range(lo // _BLOCK, hi // _BLOCK + 1):
        index.setdefault(b, []).append(a)


def _busy(index: dict[int, list[Alloc]], span: tuple[int, int], others: str, region: Region) -> list[tuple[int, int]]:
    """Byte ranges of placed tiles that share partitions with ``region`` over instructions ``span``."""
    lo, hi = span
    seen, out = set(), []
    for b in range(lo // _BLOCK, hi // _BLOCK + 1):
        for o in index.get(b, ()):
            if id(o) in seen:
                continue
            seen.add(id(o))
            when = o.reserved if others == "reserved" else o.live
            if when is None or when[1] < lo or hi < when[0]:
                continue
            r = o.region
            if r.start_partition < region.start_partition + region.partitions \
                    and region.start_partition < r.start_partition + r.partitions:
                out.append((o.offset, o.offset + r.nbytes))
    return sorted(out)


def _first_fit(region: Region, busy: list[tuple[int, int]], cap: int, bank: int, align: int) -> int | None:
    """The lowest offset where ``region``'s bytes fit between ``busy`` ranges (PSUM: never across a bank
    unless it needs more than one), or None."""
    n = region.nbytes
    for cand in [0, *(-(-end // align) * align for _, end in busy)]:
        if bank and (n > bank or cand // bank != (cand + n - 1) // bank):
            cand = -(-cand // bank) * bank
        if cand + n <= cap and all(cand + n <= s or e <= cand for s, e in busy):
            return cand
    return None


def _overflow(a: Alloc, busy: Iterable[tuple[int, int]], cap: int, instructions: Sequence[Instr]) -> SimulatorError:
    r = a.region
    first, last = a.live
    in_use = sum(e - s for s, e in busy)
    return SimulatorError(
        f"{r.memory} overflow: cannot allocate {r.partitions} partitions x {r.nbytes} bytes for the tile accessed "
        f"from instruction {first} ({instructions[first].opcode}) to {last} ({instructions[last].opcode}), even "
        f"reusing the boxes of tiles no later instruction touches: {in_use} bytes per partition are live there "
        f"and the capacity is {cap} bytes per partition")


# ---- rewriting ---------------------------------------------------------------------------------

def _rewrite(instructions: Sequence[Instr], touches: dict[int, list]) -> list[Instr]:
    """The instructions with every operand inside a moved tile shifted to its new box."""
    out = list(instructions)
    for t, ops in touches.items():
        changes = {}
        for name, ap, owners in ops:
            deltas = {a.offset - a.region.offset for a in owners}
            if deltas == {0}:
                continue
            if len(deltas) > 1:
                raise SimulatorError(f"{out[t].opcode}: {name} {ap!r} spans several tiles and the liveness "
                                     f"allocator placed them apart; access one tile per operand")
            changes[name] = AP(ap.memory, ap.dtype, ap.pattern, ap.start_partition, ap.partitions,
                               ap.offset + deltas.pop())
        if changes:
            out[t] = replace(out[t], **changes)
    return out
