"""The NeuronCore's memories and the access patterns (tiles) instructions use to touch them.

A ``Memory`` is a 2-D uint8 torch tensor, partitions x bytes: SBUF (128 x 192-256 KiB),
PSUM (128 x 16 KiB in 8 banks of 2 KiB) and, as a single row, each HBM buffer (the bytes
of a host tensor the runtime binds). Reads and writes are zero-copy strided views of the
bytes reinterpreted as the tile's dtype, so a tile costs one ``as_strided`` call.

An ``AP`` (access pattern) names its memory by string ("sbuf", "psum", "hbm:<name>"), not
by object, so an instruction list stays a plain value that can be serialized and run on
any core with any HBM bindings. ``read``/``write``/``view`` take the memory space that
resolves the name: a ``Memory`` or anything with ``memory(name) -> Memory`` (the core).
"""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, Sequence

import torch

from torchneuron.sim.instruction import Footprint
from torchneuron.sim.numerics import dtype_name, to_dtype


def contiguous_run(dims: Sequence[tuple[int | None, int]]) -> int:
    """Elements per physically contiguous chunk of (stride, size) dims, innermost last (stride None: never)."""
    run = 1
    for st, sz in reversed(dims):
        if sz == 1:
            continue
        if st != run:
            break
        run *= sz
    return run

def writes_once(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a pattern reaches each element at most once (a sufficient test: sorted by stride, each dim's
    stride clears the span of the dims inside it)."""
    span = 1   # offsets [0, span) reached by the dims taken so far
    for stride, size in sorted((st, s) for s, st in zip(sizes, strides) if s > 1):
        if stride < span:
            return False
        span += stride * (size - 1)
    return True


PMAX = 128          # partitions of SBUF/PSUM and of any engine instruction (nl.tile_size.pmax)
MAX_FREE_DIMS = 4   # free-dim access pattern entries of an engine operand (A-v2)
MAX_HBM_DIMS = 5    # an HBM (DMA) pattern also carries the dimension that maps to partitions
NAN_BYTE = 0xFF     # 0xFF.. is NaN in fp32/bf16/fp16/fp8 e4m3fn/e5m2 and -1 in signed ints
ROW_PAD = 64        # host bytes between the end of one on-chip partition row and the next (cache sets)
# torch intra-op threads the simulator executes instructions with (core.run_bound): tiles are at most [128, 2048],
# too small for torch's threads to pay for their wake-ups; and a BLAS call's bits can depend on its thread count
SIM_THREADS = 1


HUGE_PAGE = 2 << 20  # bytes of a host huge page (x86-64, arm64 with 4 KiB pages)


def host_bytes(n: int) -> torch.Tensor:
    """``n`` uninitialized host bytes for an on-chip memory, in huge pages where the host grants them.

    A tile reads each of its partitions' rows from another 4 KiB page (rows lie 192-256 KiB apart), so with
    small pages every row of every access is a TLB miss (SBUF's 24+ MiB are far beyond the TLB's reach); in
    2 MiB pages SBUF is a dozen pages. Anonymous private memory asked for huge pages (MADV_HUGEPAGE; the
    kernel's transparent huge pages in "madvise" or "always" mode), aligned to a huge page; elsewhere (no
    madvise, THP off) the same bytes in small pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # (Linux only)
        return torch.empty(n, dtype=torch.uint8)
    area = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP unavailable: small pages
    whole = torch.frombuffer(area, dtype=torch.uint8)  # (keeps the mapping alive)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + n]


class SimulatorError(ValueError):
    """A kernel broke a NeuronCore rule or limit; the message names the instruction, operand and limit."""


class IndexOutOfRange(SimulatorError):
    """A data-dependent index (an indirect DMA's row, a dynamic offset) fell outside its table, with
    ``oob_mode="error"``: the data was wrong, not the kernel (the runtime raises it as an IndexError)."""


def check_host_binding(name: str, tensor: torch.Tensor) -> None:
    """SimulatorError unless ``tensor`` can back HBM buffer ``hbm:<name>``: a contiguous host (CPU) tensor. (A
    device tensor's memory is bound by the runtime, which hands the core the host tensor aliasing it.)"""
    if tensor.device.type != "cpu":
        raise SimulatorError(f"hbm:{name}: a bound tensor must be a host (CPU) tensor, not one on {tensor.device}; "
                             "torchneuron.runtime.host_memory(t) is a neuron tensor's memory as one")
    if not tensor.is_contiguous():
        raise SimulatorError(f"hbm:{name}: a bound tensor must be contiguous (got strides {tensor.stride()})")


def nan_fill_enabled(flag: bool | None = None) -> bool:
    """The NaN-fill debug option: ``flag`` when given, else env ``TORCHNEURON_SIM_NAN_FILL=1``."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("TORCHNEURON_SIM_NAN_FILL", "0").strip().lower() in ("1", "true", "yes", "on")


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class Region:
    """An allocated box of an on-chip memory: partitions [start, start+partitions) x bytes [offset, offset+nbytes)."""

    memory: str
    start_partition: int
    partitions: int
    offset: int
    nbytes: int

    def tile(self, dtype: torch.dtype | str, free_shape: Sequence[int] = ()) -> "AP":
        """A dense row-major tile of this region: shape (partitions, *free_shape)."""
        dtype = to_dtype(dtype)
        if math.prod(free_shape) * dtype.itemsize > self.nbytes:
            raise SimulatorError(f"{self.memory}: a {dtype_name(dtype)} tile of free shape {tuple(free_shape)} "
                                 f"needs {math.prod(free_shape) * dtype.itemsize} bytes per partition; "
                                 f"the region has {self.nbytes}")
        return tile(self.memory, dtype, (self.partitions, *free_shape),
                    start_partition=self.start_partition, offset=self.offset)


class Memory:
    """A byte-addressed memory of ``partitions`` rows with a next-fit allocator of [partitions, bytes] boxes."""

    def __init__(self, name: str, partitions: int, bytes_per_partition: int, *, bank_bytes: int = 0,
                 align: int = 4, nan_fill: bool | None = None, data: torch.Tensor | None = None,
                 group_flags: bool = True):
        self.name = name
        self.partitions = partitions
        self.bytes_per_partition = bytes_per_partition
        self.bank_bytes = bank_bytes  # PSUM: an allocation never straddles a bank unless it needs more than one
        self.align = align
        self.nan_fill = nan_fill_enabled(nan_fill)
        if data is None:
            # Rows are laid out ROW_PAD bytes apart beyond their length: SBUF's 192 KiB rows (a multiple
            # of 64 KiB) would otherwise put every partition's row of a tile into the same few host
            # cache sets, and copying a tile would miss the cache on nearly every row.
            pitch = bytes_per_partition + (ROW_PAD if partitions > 1 else 0)
            data = host_bytes(partitions * pitch).view(partitions, pitch)[:, :bytes_per_partition]
            data.fill_(NAN_BYTE if self.nan_fill else 0)
        self.data = data
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._regions: list[Region] = []
        # On chip, allocation is next fit: it resumes after the box given last and wraps around at the
        # capacity, so a freed box is reused as late as possible. First fit would hand the box a tile just
        # released to the next tile at once, and that tile's writer would wait for the last reader of the
        # old one (a false write-after-read dependency that serializes engines). HBM buffers are never
        # allocated here.
        self.rotate_below = bytes_per_partition if partitions > 1 else 0
        self._cursor = 0
        # PSUM only: per 4-byte word, True where no matmul accumulation group is open, so the next
        # nc_matmul with accumulate=None overwrites instead of adding (not kept by an allocation-only
        # memory, ``group_flags=False``: a trace tracks groups itself; the groups in ``pending`` are open
        # without their flags cleared in this memory; read through ``group_closed``, which first writes the
        # pending openings below)
        self._flags = torch.ones(partitions, bytes_per_partition // 4, dtype=torch.bool) \
            if bank_bytes and group_flags else None
        # PSUM only: the flag views TensorE instructions cleared (opened a group in), by box. Only
        # these can hold False, so closing every group resets them instead of the whole 512 KiB
        # flag tensor.
        self.opened: dict = {}
        # PSUM only: the groups opened (by box, their flag views) whose flags are not cleared yet. Most are
        # closed again, at the next run's start, before anything reads their flags (only an nc_matmul with
        # accumulate=None outside an open box does): so opening a group records it here, and its flags are
        # cleared only when read (materialize), saving the clearing and the resetting fill of each.
        self.pending: dict = {}
        # PSUM only: the boxes known open (all their flags False), so that a TensorE write there skips
        # re-opening its group. Every write setting flags True forgets them all (close_groups, close,
        # allocate): the flags' torch version counter cannot tell, since in-place ops inside a device
        # op's kernel run below autograd's ADInplaceOrView key, which is what bumps it.
        self.open_boxes: set = set()

    @property
    def group_closed(self) -> torch.Tensor | None:
        """PSUM's group-closed flags (one per 4-byte word; None in other memories), every open group's cleared."""
        self.materialize()
        return self._flags

    @property
    def groups_open(self) -> bool:
        """Whether any accumulation group may be open (else every group-closed flag is True)."""
        return bool(self.opened or self.pending)

    def materialize(self) -> None:
        """Clear the flags of the groups opened since they were last read (see ``pending``)."""
        pending = self.pending
        if pending:
            for box, view in pending.items():
                view.fill_(False)
                self.opened[box] = view
            pending.clear()

    def close_groups(self) -> None:
        """Close every PSUM accumulation group (set every group-closed flag True)."""
        self.pending.clear()  # (their flags were never cleared)
        self.open_boxes.clear()
        opened = self.opened
        if not opened:
            return
        if len(opened) > 32:  # many small boxes: one fill of the whole tensor is cheaper
            self._flags.fill_(True)
        else:
            for view in opened.values():
                view.fill_(True)
        opened.clear()

    def close(self, views: Sequence[torch.Tensor]) -> None:
        """Close the accumulation groups under these views of ``group_closed`` (a non-TensorE write to PSUM)."""
        self.materialize()  # a pending group keeps its flags outside these views cleared
        for view in views:
            view.fill_(True)
        self.open_boxes.clear()

    @classmethod
    def hbm(cls, name: str, tensor: torch.Tensor) -> "Memory":
        """Wrap a contiguous host tensor's bytes (a neuron tensor's: ``runtime.host_memory``) as buffer ``hbm:<name>``."""
        check_host_binding(name, tensor)
        t = tensor.detach()
        # (as_strided: a contiguous tensor's size-1 dims may carry any stride, which view() refuses)
        flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        # nan_fill only affects allocation, which HBM buffers never do: skip the environment lookup
        return cls(f"hbm:{name}", 1, flat.numel(), align=1, nan_fill=False, data=flat.unsqueeze(0))

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The memory as a [partitions, bytes // itemsize] tensor of ``dtype`` (cached; shares storage)."""
        view = self._typed.get(dtype)
        if view is None:
            size = dtype.itemsize
            if self.partitions == 1:  # HBM: tolerate a byte length that is not a multiple of the itemsize
                flat = self.data[0]
                view = flat[: flat.numel() - flat.numel() % size].view(dtype).unsqueeze(0)
            else:
                view = self.data.view(dtype)
            self._typed[dtype] = view
        return view

    # ---- allocation ---------------------------------------------------------------

    def allocate(self, partitions: int, nbytes: int, *, start_partition: int = 0) -> Region:
        """Reserve a [partitions, nbytes] box (next fit by byte offset); raise SimulatorError when it does not fit."""
        cap = self.bytes_per_partition
        request = f"{partitions} partitions x {nbytes} bytes"
        if partitions < 1 or nbytes < 1:
            raise SimulatorError(f"{self.name}: cannot allocate {request}: sizes must be positive")
        if start_partition < 0 or start_partition + partitions > self.partitions:
            raise SimulatorError(f"{self.name}: cannot allocate {request} from partition {start_partition}: "
                                 f"the memory has {self.partitions} partitions")
        end_p = start_partition + partitions
        others = [r for r in self._regions
                  if r.start_partition < end_p and start_partition < r.start_partition + r.partitions]
        cands = {0, *(_align_up(r.offset + r.nbytes, self.align) for r in others)}
        if self.rotate_below:
            cur, lim = self._cursor, self.rotate_below
            cands.add(cur)
            order = sorted(cands, key=lambda c: (c + nbytes > lim, c < cur, c))
        else:
            order = sorted(cands)
        for cand in order:
            if self.bank_bytes and (nbytes > self.bank_bytes
                                    or cand // self.bank_bytes != (cand + nbytes - 1) // self.bank_bytes):
                cand = _align_up(cand, self.bank_bytes)
            if cand + nbytes > cap:
                continue
            if all(cand + nbytes <= r.offset or r.offset + r.nbytes <= cand for r in others):
                region = Region(self.name, start_partition, partitions, cand, nbytes)
                self._regions.append(region)
                if self.rotate_below and cand + nbytes <= self.rotate_below:
                    self._cursor = _align_up(cand + nbytes, self.align)
                box = self.data[start_partition:end_p, cand:cand + nbytes]
                if self.nan_fill:
                    box.fill_(NAN_BYTE)
                if self._flags is not None:
                    self.close([self._flags[start_partition:end_p, cand // 4:_align_up(cand + nbytes, 4) // 4]])
                return region
        in_use = sum(r.nbytes for r in others)
        raise SimulatorError(f"{self.name} overflow: cannot allocate {request} at partitions "
                             f"[{start_partition}, {end_p}); {in_use} bytes per partition are in use there "
                             f"and the capacity is {self.partitions} partitions x {cap} bytes")

    def free(self, region: Region) -> None:
        """Release a region returned by ``allocate``."""
        try:
            self._regions.remove(region)
        except ValueError:
            raise SimulatorError(f"{self.name}: {region} is not allocated") from None

    def free_all(self) -> None:
        """Release every region."""
        self._regions.clear()

    @property
    def regions(self) -> tuple[Region, ...]:
        """The regions currently allocated."""
        return tuple(self._regions)

    def __repr__(self) -> str:
        return f"Memory({self.name!r}, {self.partitions} x {self.bytes_per_partition} bytes)"


class MemorySpace(Protocol):
    """Anything that resolves a memory name ("sbuf", "psum", "hbm:<name>") to a Memory (the core)."""

    def memory(self, name: str) -> Memory: ...


def tile(memory: str, dtype: torch.dtype | str, shape: Sequence[int], *, start_partition: int = 0,
         offset: int = 0) -> "AP":
    """A dense row-major tile. On-chip ``shape`` is (partitions, *free); an HBM ``shape`` is the tensor's shape."""
    dtype = to_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    on_chip = not memory.startswith("hbm:")
    if on_chip and not shape:
        raise SimulatorError(f"{memory}: an on-chip tile needs a partition dimension")
    dims = shape[1:] if on_chip else shape
    strides, acc = [], 1
    for size in reversed(dims):
        strides.append(acc)
        acc *= size
    pattern = tuple(zip(reversed(strides), dims))
    return AP(memory, dtype, pattern, start_partition=start_partition,
              partitions=shape[0] if on_chip else 1, offset=offset)


@dataclass(frozen=True)
class AP:
    """An access pattern: which elements of one memory an instruction operand covers.

    On-chip (SBUF/PSUM): partitions [start_partition, start_partition + partitions), and in
    each partition the elements ``offset + sum(i_k * stride_k) * itemsize`` for the free
    ``pattern`` ((stride in elements, size), outermost first, at most 4 dims); shape is
    (partitions, *sizes). HBM: no partition dim; the pattern (at most 5 dims) addresses the
    buffer from byte ``offset``; shape is the sizes.
    """

    memory: str
    dtype: torch.dtype
    pattern: tuple[tuple[int, int], ...]
    start_partition: int = 0
    partitions: int = 1
    offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "dtype", to_dtype(self.dtype))
        object.__setattr__(self, "pattern", tuple((int(st), int(sz)) for st, sz in self.pattern))
        limit = MAX_FREE_DIMS if self.on_chip else MAX_HBM_DIMS
        if len(self.pattern) > limit:
            raise SimulatorError(f"{self!r}: {len(self.pattern)} pattern dims; the limit is {limit}")
        if any(st < 0 or sz < 1 for st, sz in self.pattern):
            raise SimulatorError(f"{self!r}: pattern strides must be >= 0 and sizes >= 1")
        if self.offset < 0 or self.offset % self.dtype.itemsize:
            raise SimulatorError(f"{self!r}: byte offset {self.offset} is not a non-negative multiple of "
                                 f"{dtype_name(self.dtype)}'s {self.dtype.itemsize} bytes")
        if self.on_chip and (self.partitions < 1 or self.start_partition < 0):
            raise SimulatorError(f"{self!r}: partitions must be >= 1 and start at >= 0")
        if not self.on_chip and (self.partitions != 1 or self.start_partition != 0):
            raise SimulatorError(f"{self!r}: an HBM access pattern has no partition range")

    # ---- geometry (cached: an AP is immutable) -------------------------------------

    @cached_property
    def on_chip(self) -> bool:
        """Whether the memory is SBUF or PSUM."""
        return not self.memory.startswith("hbm:")

    @cached_property
    def kind(self) -> str:
        """ "sbuf", "psum" or "hbm" (CostInputs memory names)."""
        return self.memory if self.on_chip else "hbm"

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """Logical shape: (partitions, *free sizes) on chip, the sizes in HBM."""
        sizes = tuple(sz for _, sz in self.pattern)
        return (self.partitions, *sizes) if self.on_chip else sizes

    @cached_property
    def free_elems(self) -> int:
        """Elements per partition (on chip) or in total (HBM)."""
        return math.prod(sz for _, sz in self.pattern)

    @cached_property
    def numel(self) -> int:
        """Total elements."""
        return self.free_elems * self.partitions

    @cached_property
    def nbytes(self) -> int:
        """Bytes the pattern moves (elements x itemsize)."""
        return self.numel * self.dtype.itemsize

    @cached_property
    def byte_range(self) -> tuple[int, int]:
        """Half-open byte range touched inside each partition (HBM: inside the buffer)."""
        last = sum((sz - 1) * st for st, sz in self.pattern)
        return self.offset, self.offset + (last + 1) * self.dtype.itemsize

    @cached_property
    def contiguous_run(self) -> int:
        """Elements per physically contiguous chunk (partitions are never contiguous with each other)."""
        return contiguous_run(self.pattern)

    @cached_property
    def inner_contiguous(self) -> bool:
        """Whether the innermost non-trivial free dim has stride 1."""
        inner = [st for st, sz in self.pattern if sz > 1]
        return not inner or inner[-1] == 1

    def footprint(self) -> Footprint:
        """The box of memory this pattern touches, for dependency tracking."""
        return self._footprint

    def overlaps(self, other: "AP") -> bool:
        """Whether the two patterns may share a byte (their footprints overlap)."""
        return self._footprint.overlaps(other._footprint)

    @cached_property
    def _footprint(self) -> Footprint:
        parts = (self.start_partition, self.start_partition + self.partitions) if self.on_chip else (0, 1)
        if self.on_chip:
            return Footprint(self.memory, parts, self.byte_range)
        return Footprint(self.memory, parts, self.byte_range, *self._period())

    def _period(self) -> tuple[int, int]:
        """(period, run) in bytes of an HBM pattern's contiguous chunks (``Footprint``), or (0, 0): chunks of
        ``contiguous_run`` elements whose starts differ by multiples of the gcd of the outer strides."""
        run, outer = 1, []
        inner = True
        for st, sz in reversed(self.pattern):
            if sz == 1:
                continue
            if inner and st == run:
                run *= sz
            else:
                inner = False
                outer.append(abs(st))
        period = math.gcd(*outer) if outer else 0
        if not period or run >= period:
            return 0, 0
        return period * self.dtype.itemsize, run * self.dtype.itemsize

    @cached_property
    def _geometry(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        return (tuple(sz for _, sz in self.pattern), tuple(st for st, _ in self.pattern),
                self.offset // self.dtype.itemsize)

    # ---- data access ----------------------------------------------------------------

    def check_bounds(self, mem: Memory) -> None:
        """Raise SimulatorError if the pattern reaches outside ``mem``."""
        end = self.byte_range[1]
        if end > mem.bytes_per_partition or self.start_partition + self.partitions > mem.partitions:
            if self.on_chip:
                raise SimulatorError(
                    f"{self!r} reaches partitions [{self.start_partition}, {self.start_partition + self.partitions}) "
                    f"x bytes [{self.offset}, {end}); {mem.name} has {mem.partitions} partitions x "
                    f"{mem.bytes_per_partition} bytes")
            raise SimulatorError(f"{self!r} reaches bytes [{self.offset}, {end}) of {mem.name}, "
                                 f"which has {mem.bytes_per_partition} bytes")

    def view(self, space: Memory | MemorySpace) -> torch.Tensor:
        """A zero-copy strided tensor over the memory (writes through it change the memory)."""
        mem = space if isinstance(space, Memory) else space.memory(self.memory)
        cached = self.__dict__.get("_view")
        if cached is not None and cached[0] is mem:
            return cached[1]
        if self.byte_range[1] > mem.bytes_per_partition or self.start_partition + self.partitions > mem.partitions:
            self.check_bounds(mem)
        typed = mem.typed(self.dtype)
        sizes, strides, elem_offset = self._geometry
        base = typed.storage_offset() + elem_offset
        if not self.on_chip:  # not cached: it would keep a bound tensor alive after its run
            return typed.as_strided(sizes, strides, base)
        row = typed.stride(0)
        view = typed.as_strided((self.partitions, *sizes), (row, *strides), base + self.start_partition * row)
        # SBUF/PSUM live as long as their core: keep the view (as_strided costs ~1.5 us per call)
        self.__dict__["_view"] = (mem, view)
        return view

    def read(self, space: Memory | MemorySpace) -> torch.Tensor:
        """A copy of the elements, shape ``self.shape``, dtype ``self.dtype``."""
        return self.view(space).clone()

    def write(self, space: Memory | MemorySpace, values: torch.Tensor | float | int) -> None:
        """Store values (same element count; cast to ``self.dtype`` like a PyTorch CPU cast)."""
        dst = self.view(space)
        if not isinstance(values, torch.Tensor):
            dst.fill_(values)
            return
        store(self, dst, values)

    def __getstate__(self) -> dict:
        # only the fields: cached geometry and views are rebuilt on demand
        return {"memory": self.memory, "dtype": self.dtype, "pattern": self.pattern,
                "start_partition": self.start_partition, "partitions": self.partitions, "offset": self.offset}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # ---- derived patterns -------------------------------------------------------------

    def __getitem__(self, index) -> "AP":
        """Slice with ints and slices (positive steps). On chip, an int on dim 0 keeps a 1-partition dim."""
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in index):
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (len(self.shape) - len(index) + 1) + index[at + 1:]
        if len(index) > len(self.shape):
            raise IndexError(f"{self!r}: too many indices ({len(index)}) for shape {self.shape}")
        start_p, parts, offset = self.start_partition, self.partitions, self.offset
        dims = list(self.pattern)
        if self.on_chip and index:
            first, index = index[0], index[1:]
            if isinstance(first, slice):
                lo, hi, step = first.indices(parts)
                if step != 1:
                    raise SimulatorError(f"{self!r}: a partition range must be contiguous (step {step})")
                start_p, parts = start_p + lo, max(hi - lo, 0)
            else:
                i = _index(first, parts)
                start_p, parts = start_p + i, 1
        pattern = []
        for k, (st, sz) in enumerate(dims):
            if k >= len(index):
                pattern.append((st, sz))
                continue
            sel = index[k]
            if isinstance(sel, slice):
                lo, hi, step = sel.indices(sz)
                if step < 1:
                    raise SimulatorError(f"{self!r}: negative slice steps are not supported")
                n = len(range(lo, hi, step))
                offset += lo * st * self.dtype.itemsize
                pattern.append((st * step, n))
            else:
                offset += _index(sel, sz) * st * self.dtype.itemsize
        return AP(self.memory, self.dtype, tuple(pattern), start_partition=start_p, partitions=parts, offset=offset)

    def reshape(self, shape: Sequence[int]) -> "AP":
        """The same elements seen with another shape (on chip the partition dim stays); must be a view."""
        shape = tuple(int(s) for s in shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.numel // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel or (self.on_chip and shape[0] != self.partitions):
            raise SimulatorError(f"{self!r}: cannot reshape {self.shape} to {shape}")
        sizes = tuple(sz for _, sz in self.pattern)
        strides = tuple(st for st, _ in self.pattern)
        new = shape[1:] if self.on_chip else shape
        try:
            meta = torch.empty_strided(sizes, strides, device="meta").view(new)
        except RuntimeError:
            raise SimulatorError(f"{self!r}: reshape to {shape} is not expressible as one access pattern") from None
        return AP(self.memory, self.dtype, tuple(zip(meta.stride(), new)), start_partition=self.start_partition,
                  partitions=self.partitions, offset=self.offset)

    def bitcast(self, dtype: torch.dtype | str) -> "AP":
        """Reinterpret a dense innermost dim as another dtype (sizes scale with the itemsize ratio)."""
        dtype = to_dtype(dtype)
        old, new = self.dtype.itemsize, dtype.itemsize
        if old == new:
            return AP(self.memory, dtype, self.pattern, self.start_partition, self.partitions, self.offset)
        if not self.pattern or self.pattern[-1][0] != 1 or (self.pattern[-1][1] * old) % new:
            raise SimulatorError(f"{self!r}: cannot bitcast to {dtype_name(dtype)}: innermost dim must be dense "
                                 f"and a whole number of {new}-byte elements")
        inner = (1, self.pattern[-1][1] * old // new)
        outer = []
        for st, sz in self.pattern[:-1]:
            if (st * old) % new:
                raise SimulatorError(f"{self!r}: stride {st} is not a whole number of {dtype_name(dtype)} elements")
            outer.append((st * old // new, sz))
        return AP(self.memory, dtype, (*outer, inner), self.start_partition, self.partitions, self.offset)

    def __repr__(self) -> str:
        pat = ",".join(f"{st}x{sz}" for st, sz in self.pattern)
        where = (f"{self.memory}[{self.start_partition}:{self.start_partition + self.partitions}]"
                 if self.on_chip else self.memory)
        return f"{where}+{self.offset}<{dtype_name(self.dtype)} {pat}>"


def store(ap: AP, dst: torch.Tensor, values: torch.Tensor, *, may_alias: bool = True) -> None:
    """``ap.write`` into ``dst`` (``ap``'s view, already looked up): reshape, clone a shifted view of
    the same memory, copy. ``may_alias=False``: the caller knows ``values`` shares no memory with dst."""
    if values.shape != dst.shape:
        if values.numel() != dst.numel():
            raise SimulatorError(f"{ap!r}: cannot write {tuple(values.shape)} values into shape {ap.shape}")
        values = values.reshape(ap.shape)
    if (may_alias and values.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr()
            and (values.storage_offset(), values.stride()) != (dst.storage_offset(), dst.stride())):
        values = values.clone()  # a view of the same memory, shifted: torch cannot see the overlap
    try:
        dst.copy_(values)
    except RuntimeError as e:
        raise SimulatorError(f"{ap!r}: cannot write through this pattern: {e}") from None


def _index(i, size: int) -> int:
    i = int(i)
    if i < 0:
        i += size
    if not 0 <= i < size:
        raise IndexError(f"index {i} is out of range for a dim of size {size}")
    return i
