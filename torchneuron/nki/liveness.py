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

4. Spilling (PSUM only, where step 2 would raise): a PSUM tensor larger than the whole PSUM whose tiles
   fit nowhere is left out of PSUM and lives in a spill buffer instead: an SBUF box free over its
   liveness, else a private HBM scratch buffer. Each instruction that writes it writes a temporary
   PSUM box and is followed by a copy out (tensor_copy to SBUF, plus a DMA to HBM when backed there);
   each instruction that reads it reads the SBUF backing, or a temporary SBUF box a DMA loads first.
   Accumulating into a spilled tensor is refused. Kernels that fit never reach this step.

5. Spilling SBUF (where step 2 would raise): the SBUF tiles are split where they have to leave SBUF, as the
   Neuron compiler spills to HBM when the live data overflows SBUF. A pass over the instructions in order
   (``_Eviction``; Belady's rule: the tile needed furthest in the future leaves first) keeps the bytes live at
   every instruction within a budget (SBUF's capacity, lowered if step 2 then finds no box for a piece). Each
   stretch of a tile between two evictions is placed like an overflowed tile. A tile that leaves holding what a
   DMA of the kernel loaded from HBM that nothing writes comes back by that DMA issued again (no store; such a
   load whose tile would leave before anything reads it is issued later instead); any other tile is stored to
   a private HBM scratch buffer after its last access if it was written since its last store, and loaded back
   from there. Loads back are issued as early as they do no harm (after each instruction, the missing tile
   needed first comes back as soon as there is room or a tile needed after it can leave), and the spill DMAs
   run on queues of their own. Kernels that fit never reach this step.

Liveness covers every later access, reads and writes alike, so a tile whose box was reclaimed is
never touched after it was given away: writing through a reclaimed tile is impossible by
construction. A tile that fits nowhere even by liveness raises the memory's overflow error, unless the
trace allows spilling (``host``); then only an instruction whose own operands need more SBUF than there is
raises.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field, replace
from typing import Iterable, Protocol, Sequence

import numpy as np
import torch

from torchneuron.nki.multicore import CrossCore
from torchneuron.sim import AP, SimulatorError
from torchneuron.sim.isa import DmaCopy, Instr, TensorCopy
from torchneuron.sim.memory import Region

_BLOCK = 256  # instructions per bucket of the time index used to find tiles whose ranges overlap
# instructions a spill's temporary box stays reserved from its use: consecutive spilled accesses rotate
# through that many boxes, so TensorE can write the next tile while the previous one is copied out
SPILL_WINDOW = 4
VIRTUAL_HBM_BYTES = 1 << 40  # bytes per row the layout of a spill scratch buffer may reach (it is sized after)


class Alloc:
    """One on-chip tile of a trace: its box and the instructions over which Python held it."""

    __slots__ = ("region", "start", "end", "overflow", "blocks", "first", "last", "offset", "reserved", "pinned",
                 "tensor")

    def __init__(self, region: Region, start: int, overflow: bool, blocks: int = 1):
        self.region, self.start, self.overflow, self.blocks = region, start, overflow, blocks
        self.end: int | None = None          # when the Python object died (start/end: trace clock, see place_by_liveness)
        self.first = self.last = -1          # first / last instruction that accesses it (-1: none)
        self.offset = region.offset          # the byte offset it ends up at
        self.reserved: tuple[int, int] | None = None  # the instruction range it is placed over
        self.pinned: int | None = None       # nl.ndarray(address=...): the byte offset it must end up at
        self.tensor = self                   # the whole tensor (a legacy block tile: the tensor it is a block of)

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


class SpillHost(Protocol):
    """What the pass needs from the trace to spill: HBM scratch and DMA queues."""

    def spill_scratch(self, memory: str, partitions: int, nbytes: int) -> str:
        """A new kernel-private HBM buffer of ``partitions`` rows of ``nbytes`` bytes for tiles spilled out of
        ``memory``; its memory name."""

    def next_dma_queue(self) -> int:
        """The DMA queue for the next transfer."""

    def spill_dma_queue(self) -> int:
        """The DMA queue for the next SBUF spill store or load back (queues of their own)."""

    def caller_buffers(self) -> set[str]:
        """The memory names of the HBM buffers the caller binds (the kernel's arguments)."""


def place_by_liveness(instructions: Sequence[Instr], clocks: Sequence[int], allocs: Sequence[Alloc],
                      capacity: dict[str, int], bank_bytes: dict[str, int], align: int = 4,
                      host: SpillHost | None = None) -> list[Instr]:
    """Give every overflowed tile a box within ``capacity`` and rewrite the instructions that access it;
    with ``host``, spill what fits nowhere instead of raising: the PSUM tensors larger than PSUM (step 4),
    SBUF tiles to HBM (step 5).

    ``clocks[i]`` is the trace clock at which instruction i was emitted; tile ``start``/``end`` are on
    that clock and are converted to instruction indices here."""
    for a in allocs:
        a.start = bisect.bisect_left(clocks, a.start)
        a.end = bisect.bisect_left(clocks, a.end)
    allocs = [b for a in allocs for b in _split(a)]
    touches = _accesses(instructions, allocs)
    boxes: dict[str, _Boxes] = {}
    spilled: set[Alloc] = set()
    sbuf_spill = _SbufSpill()
    for memory in sorted(capacity, key=lambda m: m != "psum"):  # PSUM first: its spills need SBUF room
        mine = [a for a in allocs if a.region.memory == memory]
        if not (any(a.overflow for a in mine) or (spilled and memory == "sbuf")):
            continue
        if memory == "sbuf" and host is not None:
            boxes[memory], sbuf_spill = _place_sbuf(mine, capacity[memory], align, instructions, touches, host)
        else:
            boxes[memory], lost = _place(mine, capacity[memory], bank_bytes.get(memory, 0), align, instructions,
                                         spill=host is not None and memory == "psum")
            spilled |= lost
    if not boxes:
        return list(instructions)
    spills = _plan_spills(instructions, touches, spilled, boxes, host) if spilled else {}
    return _rewrite(instructions, touches, spills, host, sbuf_spill)


def _split(a: Alloc) -> list[Alloc]:
    """A tensor of independent block tiles as one Alloc per block (each has its own liveness)."""
    if a.blocks <= 1:
        return [a]
    r, size = a.region, a.region.nbytes // a.blocks
    out = []
    for b in range(a.blocks):
        part = Alloc(Region(r.memory, r.start_partition, r.partitions, r.offset + b * size, size), a.start,
                     a.overflow)
        part.end, part.tensor = a.end, a
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

class _Boxes:
    """The tiles placed in one memory, indexed by instruction range, and first-fit queries among them."""

    def __init__(self, cap: int, bank: int, align: int):
        self.cap, self.bank, self.align = cap, bank, align
        self.index: dict[int, list[Alloc]] = {}  # bucket of _BLOCK instructions -> tiles reserved there

    def add(self, a: Alloc, span: tuple[int, int]) -> None:
        """Record ``a`` at its offset over instructions ``span``."""
        a.reserved = span
        for b in range(span[0] // _BLOCK, span[1] // _BLOCK + 1):
            self.index.setdefault(b, []).append(a)

    def busy(self, span: tuple[int, int], others: str, region: Region) -> list[tuple[int, int]]:
        """Byte ranges of placed tiles that share partitions with ``region`` over instructions ``span``
        (``others``: "reserved" counts each tile over its reservation, "live" over its accesses only)."""
        lo, hi = span
        first, out = lo // _BLOCK, []
        for b in range(first, hi // _BLOCK + 1):
            for o in self.index.get(b, ()):
                # a tile is listed in every bucket its reservation covers: take it in the first one queried
                if b != max(o.reserved[0] // _BLOCK, first):
                    continue
                when = o.reserved if others == "reserved" else o.live
                if when is None or when[1] < lo or hi < when[0]:
                    continue
                r = o.region
                if r.start_partition < region.start_partition + region.partitions \
                        and region.start_partition < r.start_partition + r.partitions:
                    out.append((o.offset, o.offset + r.nbytes))
        return sorted(out)

    def place(self, a: Alloc, tiers: Sequence[tuple[tuple[int, int], str]]) -> bool:
        """Put ``a`` at the first box free under the first tier (its span, how others count) that has one."""
        for mine, others in tiers:
            offset = _first_fit(a.region, self.busy(mine, others, a.region), self.cap, self.bank, self.align)
            if offset is not None:
                a.offset = offset
                self.add(a, mine)
                return True
        return False


def _place(allocs: list[Alloc], cap: int, bank: int, align: int, instructions: Sequence[Instr],
           spill: bool) -> tuple[_Boxes, set[Alloc]]:
    """Place one memory's overflowed tiles; return its boxes and the tensors spilled out of it.

    With ``spill``, a tensor larger than the memory one of whose tiles fits nowhere is spilled whole (that
    rule names the tensor to move unambiguously) and the placement redone without it; otherwise, and for
    any other tile that fits nowhere, the memory's overflow error is raised as before."""
    spilled: set[Alloc] = set()
    while True:
        boxes = _Boxes(cap, bank, align)
        failed = _assign([a for a in allocs if a.tensor not in spilled], boxes, instructions)
        if failed is None:
            return boxes, spilled
        if not (spill and failed.tensor.region.nbytes > cap):
            raise _overflow(failed, boxes.busy(failed.live, "live", failed.region), cap, instructions)
        spilled.add(failed.tensor)


def _assign(allocs: list[Alloc], boxes: _Boxes, instructions: Sequence[Instr]) -> Alloc | None:
    """Place the overflowed tiles of one memory (the others keep their trace-time boxes); return the first
    tile that fits nowhere (None: all placed)."""
    _settle_pinned(allocs, instructions)
    for a in allocs:
        if not a.overflow or a.pinned is not None:
            boxes.add(a, a.hold)
    for a in sorted((a for a in allocs if a.overflow and a.pinned is None), key=lambda a: a.start):
        if a.live is None:
            continue  # never accessed: no instruction names its box
        if not boxes.place(a, ((a.hold, "reserved"), (a.hold, "live"), (a.live, "live"))):
            return a
        if isinstance(a, _Stretch) and a.reload:
            # the load back into the box is written where the box becomes free: an access of the tile from
            # there on, which the tiles placed after it must respect
            a.first = a.reserved[0]
    return None


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


def _first_fit(region: Region, busy: list[tuple[int, int]], cap: int, bank: int, align: int) -> int | None:
    """The lowest offset where ``region``'s bytes fit between ``busy`` ranges (PSUM: never across a bank
    unless it needs more than one), or None.

    The candidates are 0 and each busy range's aligned end (moved to the next bank start if the tile would
    cross a bank). A candidate ``c`` fits if no range ``[s, e)`` has ``s < c + n`` and ``c < e``: with the
    ranges sorted by start, the ranges starting below ``c + n`` are a prefix, so ``c`` fits iff that
    prefix's largest end is at most ``c`` (one bisection per candidate instead of a scan of every range,
    which made placement quadratic in the number of tiles)."""
    n = region.nbytes
    starts = [s for s, _ in busy]            # busy is sorted by start (``_Boxes.busy``)
    reach, top = [], 0                       # reach[i]: the largest end among busy[0..i]
    for _, e in busy:
        top = max(top, e)
        reach.append(top)
    cands = set()
    for cand in [0, *(-(-end // align) * align for _, end in busy)]:
        if bank and (n > bank or cand // bank != (cand + n - 1) // bank):
            cand = -(-cand // bank) * bank
        cands.add(cand)
    for cand in sorted(cands):
        if cand + n > cap:
            return None                      # every later candidate is larger still
        below = bisect.bisect_left(starts, cand + n)
        if below == 0 or reach[below - 1] <= cand:
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


# ---- spilling -----------------------------------------------------------------------------------

@dataclass
class _Backing:
    """Where a spilled PSUM tensor lives: a box of SBUF (``sbuf_offset``) or an HBM scratch buffer (``hbm``)
    holding each partition's bytes of the tensor as one row of ``row_bytes``."""

    tensor: Alloc
    sbuf_offset: int | None = None
    hbm: str | None = None
    row_bytes: int = 0

    def of(self, ap: AP) -> AP:
        """``ap`` (inside the tensor's PSUM box) as the same bytes of the backing."""
        r = self.tensor.region
        rel = ap.offset - r.offset
        if self.hbm is None:
            return AP("sbuf", ap.dtype, ap.pattern, ap.start_partition, ap.partitions, self.sbuf_offset + rel)
        row = self.row_bytes // ap.dtype.itemsize
        first = (ap.start_partition - r.start_partition) * self.row_bytes
        return AP(self.hbm, ap.dtype, ((row, ap.partitions), *ap.pattern), offset=first + rel)


@dataclass
class _SpillAccess:
    """One operand of one instruction that touches a spilled tensor, and the temporary boxes it goes through:
    a write goes to ``psum_temp`` (then, HBM-backed, through ``sbuf_temp``); an HBM-backed read is loaded
    into ``sbuf_temp``."""

    t: int
    name: str
    ap: AP
    backing: _Backing
    write: bool
    psum_temp: int = -1
    sbuf_temp: int = -1

    @property
    def in_hbm(self) -> bool:
        """Whether the tensor is backed in HBM."""
        return self.backing.hbm is not None

    def lower(self, host: SpillHost) -> tuple[list[Instr], dict[str, AP], list[Instr]]:
        """The instructions to emit before the access, its operand's replacement, and those to emit after."""
        ap, backing = self.ap, self.backing
        if self.write:  # write a PSUM box, then copy it out (through SBUF to HBM)
            temp = _at(ap, "psum", self.psum_temp)
            if not self.in_hbm:
                return [], {self.name: temp}, [TensorCopy(dst=backing.of(ap), src=temp)]
            staged = _at(ap, "sbuf", self.sbuf_temp)
            return [], {self.name: temp}, [TensorCopy(dst=staged, src=temp),
                                           DmaCopy(dst=backing.of(ap), src=staged, queue=host.spill_dma_queue())]
        if not self.in_hbm:  # the data is in SBUF already: read it there
            return [], {self.name: backing.of(ap)}, []
        # load every byte the operand spans (a dense box: no broadcast or gaps in the DMA's destination)
        dense = AP(ap.memory, ap.dtype, ((1, _span(ap) // ap.dtype.itemsize),), ap.start_partition, ap.partitions,
                   ap.offset)
        load = DmaCopy(dst=_at(dense, "sbuf", self.sbuf_temp), src=backing.of(dense), queue=host.spill_dma_queue())
        return [load], {self.name: _at(ap, "sbuf", self.sbuf_temp)}, []


def _at(ap: AP, memory: str, offset: int) -> AP:
    """``ap``'s pattern over the same partitions, starting at byte ``offset`` of ``memory``."""
    return AP(memory, ap.dtype, ap.pattern, ap.start_partition, ap.partitions, offset)


def _span(ap: AP) -> int:
    """Bytes per partition from the first to the last byte ``ap`` touches."""
    lo, hi = ap.byte_range
    return hi - lo


def _plan_spills(instructions: Sequence[Instr], touches: dict[int, list], spilled: set[Alloc],
                 boxes: dict[str, _Boxes], host: SpillHost) -> dict[tuple[int, str], _SpillAccess]:
    """Back each spilled tensor (SBUF if a box is free over its liveness, else HBM) and give each access
    its temporary boxes; {(instruction index, operand name): access}."""
    accesses = _spill_accesses(instructions, touches, spilled)
    for backing in {id(a.backing): a.backing for a in accesses}.values():
        _back(backing, [a for a in accesses if a.backing is backing], boxes["sbuf"], host)
    for a in accesses:
        window = (a.t, min(a.t + SPILL_WINDOW, len(instructions)) - 1)
        if a.write:
            a.psum_temp = _temp(a, "psum", window, boxes["psum"], instructions)
        if a.in_hbm:
            a.sbuf_temp = _temp(a, "sbuf", window, boxes["sbuf"], instructions)
    return {(a.t, a.name): a for a in accesses}


def _spill_accesses(instructions: Sequence[Instr], touches: dict[int, list],
                    spilled: set[Alloc]) -> list[_SpillAccess]:
    """Every operand that touches a spilled tensor, in instruction order (raising for what cannot be spilled)."""
    backings = {id(t): _Backing(t) for t in spilled}
    out = []
    for t in sorted(touches):
        instr = instructions[t]
        for name, ap, owners in touches[t]:
            tensors = {id(o.tensor) for o in owners}
            if not tensors & backings.keys():
                continue
            if len(tensors) > 1:
                raise SimulatorError(f"{instr.opcode}: {name} {ap!r} spans a spilled PSUM tensor and other tiles; "
                                     f"access one tile per operand")
            write = name in type(instr).WRITES
            # the instructions that also read what they write are the accumulating matmuls (accumulate=True,
            # or None: add where a group is open); a sum spread over instructions cannot live in a spill buffer
            if write and getattr(instr, "accumulate", False) is not False:
                raise SimulatorError(
                    f"{instr.opcode} (instruction {t}): accumulates into {name} {ap!r}, a PSUM tensor larger than "
                    f"PSUM that was spilled to SBUF/HBM; accumulation into a spilled PSUM tensor is not "
                    f"supported: accumulate in a PSUM tile that fits, then copy it into the large tensor")
            out.append(_SpillAccess(t, name, ap, backings[tensors.pop()], write))
    return out


def _back(backing: _Backing, accesses: list[_SpillAccess], sbuf: _Boxes, host: SpillHost) -> None:
    """Put a spilled tensor in an SBUF box free from its first to its last access, else in HBM scratch."""
    r = backing.tensor.region
    box = Region("sbuf", r.start_partition, r.partitions, 0, r.nbytes)
    backing.sbuf_offset = _new_box(sbuf, box, (accesses[0].t, accesses[-1].t))
    if backing.sbuf_offset is None:
        backing.row_bytes = -(-r.nbytes // 4) * 4
        backing.hbm = host.spill_scratch("psum", r.partitions, backing.row_bytes)


def _temp(access: _SpillAccess, memory: str, window: tuple[int, int], boxes: _Boxes,
          instructions: Sequence[Instr]) -> int:
    """The offset of a temporary ``memory`` box for ``access``, free over ``window`` (raise if none is)."""
    ap = access.ap
    box = Region(memory, ap.start_partition, ap.partitions, 0, _span(ap))
    offset = _new_box(boxes, box, window)
    if offset is None:
        in_use = sum(e - s for s, e in boxes.busy(window, "live", box))
        raise SimulatorError(
            f"{memory} overflow: no box of {box.partitions} partitions x {box.nbytes} bytes is free at instruction "
            f"{access.t} ({instructions[access.t].opcode}) to stage {access.name} of a spilled PSUM tensor: "
            f"{in_use} bytes per partition are live there and the capacity is {boxes.cap} bytes per partition")
    return offset


def _new_box(boxes: _Boxes, region: Region, span: tuple[int, int]) -> int | None:
    """The offset at which a new tile of ``region``'s size is placed among ``boxes`` over instructions ``span``
    (None: no box is free)."""
    box = Alloc(region, span[0], True)
    box.first, box.last = span
    return box.offset if boxes.place(box, ((span, "reserved"), (span, "live"))) else None


# ---- SBUF spilling ------------------------------------------------------------------------------

class _Stretch(Alloc):
    """One stretch of an SBUF tile's life in SBUF between evictions (step 5), placed like an overflowed tile.
    Unless it is the tile's first, it begins with a load (``reload``): from the tile's HBM copy, or, when the
    tile holds what a DMA of the kernel loaded from HBM that nothing writes (``source``: that DMA's index),
    by that DMA again. It ends with a store to the copy when the tile was written otherwise since its last
    store and is needed again (``store``)."""

    __slots__ = ("reload", "store", "source")

    def __init__(self, tile: Alloc, hold_start: int, first: int, reload: bool, source: int | None = None):
        super().__init__(tile.region, hold_start, True)
        self.end = hold_start                  # (the hold is widened to cover the stretch's accesses)
        self.first = self.last = first
        self.reload, self.store, self.source = reload, False, source


@dataclass
class _SbufSpill:
    """The DMAs step 5 adds: ``loads[t]`` go right before instruction t, ``stores[t]`` right after it."""

    loads: dict[int, list[Instr]] = field(default_factory=dict)
    stores: dict[int, list[Instr]] = field(default_factory=dict)
    deferred: set[int] = field(default_factory=set)  # the kernel's loads issued later instead (as a stretch's load)


class _NoRoom(Exception):
    """The eviction pass met an instruction whose own tiles (with the pinned ones) exceed the budget."""

    def __init__(self, t: int, needed: int):
        super().__init__(t, needed)
        self.t, self.needed = t, needed


def _place_sbuf(allocs: list[Alloc], cap: int, align: int, instructions: Sequence[Instr], touches: dict[int, list],
                host: SpillHost) -> tuple[_Boxes, _SbufSpill]:
    """Place SBUF's overflowed tiles (step 2); if one fits nowhere, spill (step 5): evict within a budget,
    place the stretches, and while a stretch finds no box lower the budget by its size and start again."""
    boxes = _Boxes(cap, 0, align)
    failed = _assign(allocs, boxes, instructions)
    if failed is None:
        return boxes, _SbufSpill()
    accesses = _tile_accesses(instructions, touches, allocs, host.caller_buffers())
    budget = cap
    while True:
        try:
            stretches, deferred = _evict(accesses, budget)
        except _NoRoom as e:
            if budget < cap:  # no budget low enough leaves a box for every stretch: report the last that found none
                raise _overflow(failed, boxes.busy(failed.live, "live", failed.region), cap, instructions) from None
            raise SimulatorError(
                f"sbuf overflow: instruction {e.t} ({instructions[e.t].opcode}) needs {e.needed} bytes per partition "
                f"of tiles in SBUF at once (its operands' tiles and any placed with address=), more than the "
                f"capacity of {cap} bytes per partition: spilling other tiles to HBM cannot make room; use smaller "
                f"tiles") from None
        pieces = [s for a in allocs for s in stretches.get(a, (a,))]
        boxes = _Boxes(cap, 0, align)
        failed = _assign(pieces, boxes, instructions)
        if failed is None:
            return boxes, _spill_dmas(stretches, deferred, touches, instructions, host)
        budget -= failed.region.nbytes


def _tile_accesses(instructions: Sequence[Instr], touches: dict[int, list], allocs: list[Alloc],
                   arguments: set[str]) -> dict[Alloc, list[tuple[int, bool, bool]]]:
    """(instruction index, whether it writes the tile, whether it is a load of the whole tile that can be
    issued again: ``_reissuable``) of each access of each SBUF tile, in order."""
    written = _written_hbm(instructions, arguments)
    out: dict[Alloc, list[tuple[int, bool, bool]]] = {a: [] for a in allocs if a.live is not None}
    for t in sorted(touches):
        writes = type(instructions[t]).WRITES
        seen: dict[Alloc, bool] = {}
        for name, _, owners in touches[t]:
            for a in owners:
                if a in out:
                    seen[a] = seen.get(a, False) or name in writes
        for a, wrote in seen.items():
            out[a].append((t, wrote, wrote and len(seen) == 1 and _reissuable(instructions[t], a, written)))
    return out


def _written_hbm(instructions: Sequence[Instr], arguments: set[str]) -> set[str] | None:
    """The HBM memories the kernel may change: those some instruction writes, and every argument if one is written
    (the caller may pass one tensor as two arguments); None where other cores may write HBM while it runs (a
    cross-core instruction cuts it into segments that interleave with theirs)."""
    if any(isinstance(ins, CrossCore) for ins in instructions):
        return None
    written = {fp.memory for ins in instructions for fp in ins.writes() if fp.memory.startswith("hbm:")}
    return written | arguments if written & arguments else written


def _reissuable(instr: Instr, tile: Alloc, written: set[str] | None) -> bool:
    """Whether ``instr`` loads all of ``tile`` from HBM that nothing writes while the kernel runs, so that issuing
    it again later loads the same values (a plain ``dma_copy``: no runtime indices or offsets)."""
    if written is None or type(instr) is not DmaCopy or instr.src_index is not None or instr.dst_index is not None:
        return False
    src, dst, r = instr.src, instr.dst, tile.region
    return (not src.on_chip and src.memory not in written and dst.memory == "sbuf"
            and (dst.start_partition, dst.partitions) == (r.start_partition, r.partitions)
            and dst.byte_range == (r.offset, r.offset + r.nbytes) and dst.free_elems * dst.dtype.itemsize == r.nbytes)


def _evict(accesses: dict[Alloc, list[tuple[int, bool, bool]]],
           budget: int) -> tuple[dict[Alloc, list[_Stretch]], set[int]]:
    """Walk the instructions in order keeping every tile an instruction accesses in SBUF and the bytes of the
    tiles in SBUF within ``budget`` per partition (``_Eviction``). {tile: its stretches} of the tiles that leave
    SBUF before their last access or whose load was issued later, and the instructions of the loads issued
    later."""
    walk = _Eviction(accesses, budget)
    for t in sorted(walk.by_time):
        walk.step(t)
    return {a: s for a, s in walk.stretches.items() if len(s) > 1 or s[0].reload}, walk.deferred


class _Eviction:
    """The state of the eviction walk (step 5), one accessing instruction at a time.

    * Which tiles leave: when a tile must come in and the bytes would exceed the budget, the tiles whose next
      access is furthest away (Belady's rule; among equals, those needing no store). A tile leaves SBUF for good
      after its last access.
    * Stores: a tile leaving is stored to its HBM copy unless that copy, or the HBM a load of the kernel filled
      it from and nothing writes (its ``source``), holds its value: then it comes back by that load issued again.
    * Loads back, as early as they do no harm: after each instruction, the tile not in SBUF whose next access
      comes first is loaded back as soon as there is room for it, or a tile in SBUF whose next access comes
      after it can leave to make room (the "aggressive" integrated prefetching and caching rule of Cao, Felten,
      Karlin and Li, SIGMETRICS 1995: prefetch the next missing block at the first opportunity, replacing the
      block referenced furthest in the future, never one referenced before the block fetched). A tile needed
      before such a load could be issued comes in at its access, its box reserved as early as the bytes taken
      before it leave room (``taken[u]``: the most any partition holds at instruction u, lowered after the
      fact where a tile that left was no longer touched; a tile on some partitions only is counted on all).
    * Deferred loads: a load of the kernel that fills a whole tile not in SBUF from HBM nothing writes, when
      bringing the tile in would take the room of tiles needed before it, is issued later instead, as the
      load of the tile's next stretch (nothing reads the tile in between)."""

    def __init__(self, accesses: dict[Alloc, list[tuple[int, bool, bool]]], budget: int):
        self.accesses, self.budget = accesses, budget
        self.by_time: dict[int, list[Alloc]] = {}
        for a, acc in accesses.items():
            for t, _, _ in acc:
                self.by_time.setdefault(t, []).append(a)
        self.usage = np.zeros(max(a.region.start_partition + a.region.partitions for a in accesses), dtype=np.int64)
        self.taken = np.zeros(max(self.by_time) + 2, dtype=np.int64)
        self.level, self.last_t = 0, -1             # the most taken after the previous accessing instruction
        self.rank = {a: k for k, a in enumerate(accesses)}
        self.position = dict.fromkeys(accesses, 0)  # index of the tile's next access
        self.resident: dict[Alloc, _Stretch] = {}
        self.saved: set[Alloc] = set()              # tiles whose HBM copy or source holds their current value
        self.source: dict[Alloc, int] = {}          # tiles holding what a reissuable load (its index) loaded
        self.since: dict[Alloc, int] = {}           # tiles whose load was deferred: its index
        self.deferred: set[int] = set()
        self.stretches: dict[Alloc, list[_Stretch]] = {}
        self.leaving: list[tuple[int, bool, int, Alloc]] = []  # heap: (-next access, store needed, rank, tile)
        self.missing: list[tuple[int, int, Alloc]] = []        # heap: (next access, rank, tile) of tiles out

    def next_access(self, a: Alloc) -> int | None:
        k = self.position[a]
        return self.accesses[a][k][0] if k < len(self.accesses[a]) else None

    def furthest(self) -> tuple[Alloc, int] | None:
        """The tile in SBUF whose next access is furthest away (and that access), dropping outdated entries."""
        while self.leaving:
            _, _, _, v = self.leaving[0]
            if v in self.resident and self.next_access(v) == -self.leaving[0][0]:
                return v, -self.leaving[0][0]
            heapq.heappop(self.leaving)
        return None

    def room(self, x: Alloc) -> bool:
        return int(self.usage[_rows(x)].max()) + x.region.nbytes <= self.budget

    def leave(self, v: Alloc, t: int) -> None:
        """Take ``v`` out of SBUF at instruction ``t`` (stored if its value is nowhere in HBM)."""
        gone = self.resident.pop(v)
        self.usage[_rows(v)] -= v.region.nbytes
        if gone.last < gone.first:  # loaded back ahead and not used yet: that load is not made
            self.stretches[v].pop()
        elif not gone.reload and gone.first == gone.last == self.source.get(v):
            # nothing read what the kernel's load brought in before it left: that load is issued later instead
            self.stretches[v].pop()
            self.deferred.add(gone.last)
            self.since[v] = gone.last
            if v.region.partitions == len(self.usage):
                self.taken[gone.last:t] -= v.region.nbytes
        else:
            k = self.position[v]  # (a tile whose next access loads all of it needs no copy of its value)
            gone.store = v not in self.saved and not self.accesses[v][k][2]
            self.saved.add(v)
            if v.region.partitions == len(self.usage):  # (on some partitions only: the others may be the most)
                self.taken[gone.last + 1:t] -= v.region.nbytes
        heapq.heappush(self.missing, (self.next_access(v), self.rank[v], v))

    def bring(self, x: Alloc, start: int, first: int, reload: bool) -> None:
        """Put ``x`` in SBUF from instruction ``start`` for its access at ``first``."""
        stretch = _Stretch(x, start, first, reload, self.source.get(x) if reload else None)
        if reload and first > start:
            stretch.last = start - 1  # (not accessed yet)
        self.stretches.setdefault(x, []).append(stretch)
        self.resident[x] = stretch
        self.usage[_rows(x)] += x.region.nbytes

    def defer(self, x: Alloc, t: int) -> bool:
        """Whether the kernel's load of ``x`` at ``t`` waits for the tile's next access (then recorded)."""
        acc, k = self.accesses[x], self.position[x]
        if x.pinned is not None or not acc[k][2] or k + 1 == len(acc) or self.room(x):
            return False
        top = self.furthest()
        if top is not None and top[1] > acc[k + 1][0]:
            return False  # a tile needed after it can leave instead
        self.source[x], self.since[x] = t, t
        self.saved.add(x)
        self.deferred.add(t)
        self.position[x] = k + 1
        heapq.heappush(self.missing, (acc[k + 1][0], self.rank[x], x))
        return True

    def demand(self, x: Alloc, t: int) -> None:
        """Bring ``x``, accessed at ``t``, into SBUF, the tiles needed furthest away leaving for room."""
        rows, n = _rows(x), x.region.nbytes
        aside = []
        while int(self.usage[rows].max()) + n > self.budget:
            if not self.leaving:
                raise _NoRoom(t, int(self.usage[rows].max()) + n)
            entry = heapq.heappop(self.leaving)
            v = entry[3]
            if v not in self.resident or self.next_access(v) != -entry[0]:
                continue  # an outdated entry: the tile was accessed or left since
            if -entry[0] == t or not _rows_meet(v, x):
                aside.append(entry)  # needed now, or holds none of the bytes short
                continue
            self.leave(v, t)
        for entry in aside:
            heapq.heappush(self.leaving, entry)
        earlier = self.stretches.get(x)
        if self.accesses[x][self.position[x]][2] and (earlier or x in self.since):
            self.since.pop(x, None)  # loaded whole here: nothing to load back
            self.bring(x, t, t, reload=False)
        elif not earlier and x not in self.since:
            self.bring(x, min(x.hold[0], t), t, reload=False)
        else:
            lo = max(earlier[-1].last + 1 if earlier else 0, self.since.pop(x, 0))
            short = np.flatnonzero(self.taken[lo:t] + n > self.budget)
            start = lo + int(short[-1]) + 1 if len(short) else lo
            self.taken[start:t] += n
            self.bring(x, start, t, reload=True)

    def prefetch(self, t: int) -> None:
        """After instruction ``t``: load back, in the order of their next accesses, the tiles out of SBUF for which
        there is room or a tile needed after them can leave."""
        while self.missing:
            tn, _, x = self.missing[0]
            if x in self.resident or self.next_access(x) != tn or tn <= t + 1:
                heapq.heappop(self.missing)  # outdated, or due now: its access brings it
                continue
            if self.accesses[x][self.position[x]][2] or x not in self.saved:
                heapq.heappop(self.missing)  # its next access loads it whole: nothing to load back
                continue
            while not self.room(x):
                top = self.furthest()
                if top is None or top[1] <= tn or not _rows_meet(top[0], x):
                    return  # no harm done: nothing needed after it can leave
                self.leave(top[0], t + 1)
            heapq.heappop(self.missing)
            self.since.pop(x, None)
            self.bring(x, t + 1, tn, reload=True)
            heapq.heappush(self.leaving, (-tn, x not in self.saved, self.rank[x], x))

    def step(self, t: int) -> None:
        """Account instruction ``t``'s accesses."""
        self.taken[self.last_t + 1:t] = self.level
        needed = [x for x in self.by_time[t] if x in self.resident or not self.defer(x, t)]
        for x in needed:
            if x not in self.resident:
                self.demand(x, t)
        self.taken[t] = self.usage.max()
        for x in needed:
            k = self.position[x]
            self.resident[x].last = t
            _, wrote, reissuable = self.accesses[x][k]
            if reissuable:
                self.source[x] = t
                self.saved.add(x)
            elif wrote:
                self.source.pop(x, None)
                self.saved.discard(x)
            self.position[x] = k + 1
            if k + 1 == len(self.accesses[x]):
                del self.resident[x]
                self.usage[_rows(x)] -= x.region.nbytes
            elif x.pinned is None:
                heapq.heappush(self.leaving, (-self.accesses[x][k + 1][0], x not in self.saved, self.rank[x], x))
        self.prefetch(t)
        self.level, self.last_t = int(self.usage.max()), t


def _rows(a: Alloc) -> slice:
    """The partitions of a tile."""
    return slice(a.region.start_partition, a.region.start_partition + a.region.partitions)


def _rows_meet(a: Alloc, b: Alloc) -> bool:
    """Whether two tiles share a partition."""
    ra, rb = a.region, b.region
    return ra.start_partition < rb.start_partition + rb.partitions and rb.start_partition < ra.start_partition + \
        ra.partitions


def _spill_dmas(stretches: dict[Alloc, list[_Stretch]], deferred: set[int], touches: dict[int, list],
                instructions: Sequence[Instr], host: SpillHost) -> _SbufSpill:
    """Point each access of a spilled tile at its stretch's box, lay out the tiles' HBM copies in one scratch
    buffer (tiles whose copies are never needed at the same time share bytes), and make the stores and loads:
    a load by a reissued kernel load is that DMA into the stretch's box, on its own queue the first time after
    it was deferred (it is the kernel's load, issued later), else like the other spill DMAs on the spill
    queues (``SpillHost.spill_dma_queue``)."""
    lasts = {a: [s.last for s in ss] for a, ss in stretches.items()}
    for t, entries in touches.items():
        if any(o in stretches for _, _, owners in entries for o in owners):
            touches[t] = [(name, ap, [stretches[o][bisect.bisect_left(lasts[o], t)] if o in stretches else o
                                      for o in owners]) for name, ap, owners in entries]
    scratch = _Boxes(VIRTUAL_HBM_BYTES, 0, 4)
    copies: dict[Alloc, int] = {}
    for a, ss in stretches.items():
        stores = [s.last for s in ss if s.store]
        if stores:
            span = (stores[0], max(s.first for s in ss if s.reload and s.source is None))
            copies[a] = _new_box(scratch, Region("hbm", a.region.start_partition, a.region.partitions, 0,
                                                 a.region.nbytes), span)
    if copies:
        row = -(-max(copies[a] + a.region.nbytes for a in copies) // 4) * 4
        memory = host.spill_scratch("sbuf", max(_rows(a).stop for a in copies), row)
    moves = sorted([(s.last, 1, a, s) for a, ss in stretches.items() for s in ss if s.store]
                   + [(s.first, 0, a, s) for a, ss in stretches.items() for s in ss if s.reload],
                   key=lambda m: m[:2])  # program order: a load goes before its instruction, a store after
    out = _SbufSpill(deferred=set(deferred))
    reissued: set[int] = set()  # the kernel's loads issued again so far
    for t, after, a, s in moves:
        r = a.region
        on_chip = AP("sbuf", torch.uint8, ((1, r.nbytes),), r.start_partition, r.partitions, s.offset)
        if not after and s.source is not None:
            load = instructions[s.source]
            dst = AP(load.dst.memory, load.dst.dtype, load.dst.pattern, load.dst.start_partition, load.dst.partitions,
                     load.dst.offset + s.offset - r.offset)
            own = s.source in deferred and s.source not in reissued
            reissued.add(s.source)
            dma = replace(load, dst=dst, queue=load.queue if own else host.spill_dma_queue())
        else:
            copy = AP(memory, torch.uint8, ((row, r.partitions), (1, r.nbytes)),
                      offset=r.start_partition * row + copies[a])
            dma = DmaCopy(dst=copy, src=on_chip, queue=host.spill_dma_queue()) if after else \
                DmaCopy(dst=on_chip, src=copy, queue=host.spill_dma_queue())
        (out.stores if after else out.loads).setdefault(t, []).append(dma)
    return out


# ---- rewriting ---------------------------------------------------------------------------------

def _replaced(instr: Instr, changes: dict) -> Instr:
    """``instr`` with operands replaced by name (an instruction whose operands are not all fields, such as
    ``dma_compute``'s list of sources, says how through ``replace_operands``)."""
    custom = getattr(instr, "replace_operands", None)
    return custom(changes) if custom is not None else replace(instr, **changes)


def _rewrite(instructions: Sequence[Instr], touches: dict[int, list], spills: dict[tuple[int, str], _SpillAccess],
             host: SpillHost | None, sbuf_spill: "_SbufSpill") -> list[Instr]:
    """The instructions with every operand inside a moved tile shifted to its new box, every access to a
    spilled PSUM tensor going through its temporary boxes, and the spilled SBUF tiles' stores and loads
    around them (between two instructions: the stores after the first, then the loads for the second)."""
    out: list[Instr] = []
    for t, instr in enumerate(instructions):
        out += sbuf_spill.loads.get(t, ())
        if t in sbuf_spill.deferred:  # a kernel load issued later instead, by a stretch's load
            continue
        before, changes, after = [], {}, []
        for name, ap, owners in touches.get(t, ()):
            spill = spills.get((t, name))
            if spill is not None:
                pre, change, post = spill.lower(host)
                before, after = before + pre, after + post
                changes.update(change)
                continue
            moved = _moved(instr, name, ap, owners)
            if moved is not None:
                changes[name] = moved
        out += [*before, _replaced(instr, changes) if changes else instr, *after]
        out += sbuf_spill.stores.get(t, ())
    return out


def _moved(instr: Instr, name: str, ap: AP, owners: list[Alloc]) -> AP | None:
    """``ap`` shifted with the tile it lies in (None: that tile kept its box)."""
    deltas = {a.offset - a.region.offset for a in owners}
    if deltas == {0}:
        return None
    if len(deltas) > 1:
        raise SimulatorError(f"{instr.opcode}: {name} {ap!r} spans several tiles and the liveness "
                             f"allocator placed them apart; access one tile per operand")
    return AP(ap.memory, ap.dtype, ap.pattern, ap.start_partition, ap.partitions, ap.offset + deltas.pop())
