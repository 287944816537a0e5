"""Tracing: the kernel's tensors (``NkiTensor``) and the trace that records its instructions.

A kernel runs once as ordinary Python. Every tensor it makes is an access pattern (``AP``)
into a simulated memory: SBUF/PSUM boxes come from first-fit allocators sized by the chip
spec (freed when the Python tensor dies, so loop bodies reuse them), HBM tensors are the
program's argument slots. Every ``nki.isa`` call appends one simulator instruction.

A tile that does not fit while earlier tiles are still bound in Python is given a virtual box past
the capacity; when the trace ends, ``liveness.place_by_liveness`` moves it into memory whose tiles no
later instruction touches (the compiler allocates by liveness), or raises the overflow error.

Spilling is done there too, in that one place, because only that pass knows that a tile fits nowhere:
a PSUM tensor larger than PSUM (even a single tile, which here gets a virtual box instead of raising)
that cannot be placed is backed by SBUF or a private HBM scratch buffer (``spill_scratch``), and the
instructions that touch it are rewritten to go through temporary boxes; SBUF tiles that cannot all be
placed leave SBUF for HBM scratch between their accesses, by DMA stores and loads added to the program. A
kernel whose tiles can be placed never reaches that code, so its instructions are exactly those it emitted.
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

from torchneuron.nki.forwarding import forward
from torchneuron.nki.liveness import Alloc, place_by_liveness
from torchneuron.sim import AP, Memory, SimulatorError, tile
from torchneuron.sim.memory import Region
from torchneuron.sim.instruction import Engine
from torchneuron.sim.isa import Instr
from torchneuron.sim.isa.control import CONTROL, REGISTERS
from torchneuron.sim.numerics import to_dtype
from torchneuron.sim.program import ArgSlot, Program
from torchneuron.sim.specs import ChipSpec

DMA_QUEUES = 16  # DMA instructions are spread round-robin over this many in-order queues
# SBUF spill stores and loads back alternate over queues of their own, numbered after the kernel's: the
# profiles of spilling kernels show two (qSyncSpillReload0, qVectorSpillReload0; docs/nki.md, "SBUF spilling")
SPILL_DMA_QUEUES = 2
VIRTUAL_BYTES = 1 << 40  # trace-time on-chip address space: overflowed tiles live past the capacity


class Buffer:
    """A memory region kind (``nl.sbuf``, ``nl.psum``, ``nl.shared_hbm``, ``nl.private_hbm``)."""

    def __init__(self, name: str):
        self.name = name

    @property
    def on_chip(self) -> bool:
        """Whether tensors of this buffer live in SBUF/PSUM."""
        return self.name in ("sbuf", "psum")

    def __repr__(self) -> str:
        return f"nl.{self.name}"


sbuf, psum, shared_hbm, private_hbm = Buffer("sbuf"), Buffer("psum"), Buffer("shared_hbm"), Buffer("private_hbm")
hbm = private_hbm

_NP_TO_TORCH = {np.dtype(k): v for k, v in {
    "bool": torch.bool, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "uint8": torch.uint8,
    "uint16": torch.uint16, "uint32": torch.uint32, "float16": torch.float16, "float32": torch.float32}.items()}


class MxDtype:
    """An MX 4-packed dtype (``nl.float8_e5m2_x4``, ``nl.float8_e4m3fn_x4``, ``nl.float4_e2m1fn_x4``): each element
    holds 4 quantized values, stored as an unsigned integer of its size (the tensor remembers the format)."""

    def __init__(self, element: str, storage: torch.dtype):
        self.element, self.storage = element, storage

    def __repr__(self) -> str:
        return f"nl.{self.element}_x4"


class Tf32Dtype:
    """``nl.tfloat32``: TensorFloat-32 (1 sign, 8 exponent, 10 mantissa bits) held in an fp32 container with the
    13 low mantissa bits zero; every instruction writing such a tensor rounds its values to TF32 (``nki.tf32``)."""

    storage = torch.float32

    def __repr__(self) -> str:
        return "nl.tfloat32"


def as_dtype(dtype: Any) -> torch.dtype:
    """Resolve an ``nl`` dtype, torch dtype, NumPy dtype or dtype name to a NeuronCore torch dtype."""
    if isinstance(dtype, (MxDtype, Tf32Dtype)):
        return dtype.storage
    if isinstance(dtype, torch.dtype):
        return to_dtype(dtype)
    try:
        npd = np.dtype(dtype)
    except TypeError:
        return to_dtype(str(dtype))
    if npd not in _NP_TO_TORCH:
        raise TypeError(f"dtype {npd} is not a NeuronCore dtype")
    return _NP_TO_TORCH[npd]


class ds:
    """``nl.ds(start, size)``: the dynamic slice ``start:start+size``."""

    def __init__(self, start: int, size: int):
        self.start, self.size = int(start), int(size)

    def as_slice(self) -> slice:
        """The equivalent Python slice."""
        return slice(self.start, self.start + self.size)


def _index(i: Any) -> Any:
    if isinstance(i, ds):
        return i.as_slice()
    if isinstance(i, (np.integer, torch.Tensor)):
        return int(i)
    return i


class IndexOutOfBounds(SimulatorError, IndexError):
    """A kernel indexed a tensor outside its shape (an error, not NumPy's clamping of slices)."""


def check_index(shape: Sequence[int], index: tuple, what: object = "tensor") -> None:
    """Raise IndexOutOfBounds naming the dim, the index and the bound when an integer or slice of ``index``
    reaches outside ``shape`` (negative values count from the end, as in Python, down to -size). ``what`` (the
    tensor itself, or a name) is formatted only into an error: its repr costs more than the check."""
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    for d, (i, size) in enumerate(zip(index, shape)):
        if isinstance(i, slice):
            bad = [v for v in (i.start, i.stop) if v is not None and not -size <= int(v) <= size]
            if i.start is not None and int(i.start) == size and (i.stop is None or int(i.stop) > size):
                bad.append(i.start)
            if bad:
                raise IndexOutOfBounds(
                    f"{what}: slice {_slice_text(i)} of dim {d} is out of bounds for size {size} (index {bad[0]}; "
                    f"slices are not clamped)")
        elif isinstance(i, (int, np.integer)) and not -size <= int(i) < size:
            raise IndexOutOfBounds(f"{what}: index {int(i)} of dim {d} is out of bounds for size {size}")


def _slice_text(s: slice) -> str:
    text = f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"
    return text + (f":{s.step}" if s.step not in (None, 1) else "")


class NKIObject:
    """``nl.NKIObject``: the base class of NKI kernel objects (tensors, configuration objects)."""


class NkiTensor(NKIObject):
    """A kernel tensor: an access pattern into SBUF, PSUM or an HBM argument, with NumPy-like views."""

    mx: "MxDtype | None" = None  # the MX format of x4 data (the AP holds its storage integers)
    tf32: bool = False           # allocated as nl.tfloat32: fp32 storage holding TF32 values
    _oob: str | None = None      # why this view reaches outside its tensor (raised when an instruction uses it)

    def __init__(self, access: AP, buffer: Buffer, name: str = "", base: "NkiTensor | None" = None):
        self.access, self.buffer, self.name, self.base = access, buffer, name, base  # access: the simulator AP

    shape = property(lambda self: self.access.shape, doc="The tensor's shape (dim 0 is the partition dim on chip).")
    dtype = property(lambda self: self.access.dtype, doc="The element dtype (a torch dtype).")
    ndim = property(lambda self: len(self.access.shape), doc="Number of dims.")

    def _view(self, ap: AP) -> "NkiTensor":
        view = type(self)(ap, self.buffer, self.name, self.base or self)
        if self.mx is not None and ap.dtype == self.access.dtype:
            view.mx = self.mx
        if self.tf32 and ap.dtype == self.access.dtype:
            view.tf32 = True
        return view

    def __getitem__(self, index: Any) -> "NkiTensor":
        index = tuple(_index(i) for i in (index if isinstance(index, tuple) else (index,)))
        check_index(self.shape, index, self)
        return self._view(self.access[index])

    def __setitem__(self, index: Any, value: Any) -> None:
        dst = self[index]
        if not isinstance(value, NkiTensor):
            TENSOR_OPS["memset"](dst=dst, value=value)
        elif dst.buffer.on_chip and value.buffer.on_chip:
            TENSOR_OPS["tensor_copy"](dst=dst, src=value)
        else:
            TENSOR_OPS["dma_copy"](dst=dst, src=value)

    def reshape(self, shape: Sequence[int]) -> "NkiTensor":
        """A view with another shape (on chip, dim 0 stays the partition dim)."""
        return self._view(self.access.reshape(tuple(shape)))

    indirect: "NkiTensor | None" = None  # ``.ap(vector_offset=...)``: the row indices of an indirect DMA
    dynamic: "NkiTensor | None" = None   # ``.ap(scalar_offset=<tile>)``: the runtime start row of a DMA

    def ap(self, pattern: Sequence[Sequence[int]], offset: int | None = 0, scalar_offset: Any = None,
           vector_offset: "NkiTensor | None" = None, indirect_dim: int = 0, dtype: Any = None) -> "NkiTensor":
        """A raw access pattern: ``pattern`` is [stride, count] pairs in elements (on chip the first pair
        is the partition pair), ``offset`` an element offset from this view's start. On HBM,
        ``vector_offset`` (an SBUF [P, 1] int tile) makes it indirect: dim 0 is indexed by those rows
        (a DMA gather as ``src``, a scatter as ``dst``; ``indirect_dim`` must be 0). ``scalar_offset`` moves
        the start of dim ``indirect_dim`` by that many steps: a trace-time integer, or on HBM an SBUF [1, 1]
        int tile read when a DMA runs (``indirect_dim`` 0)."""
        offset = 0 if offset is None else offset
        if hasattr(scalar_offset, "register_index"):  # a VirtualRegister: stored to a tile the DMA reads
            scalar_offset = TENSOR_OPS["register_tile"](scalar_offset)
        if scalar_offset is not None and vector_offset is not None:
            raise SimulatorError("ap(): scalar_offset and vector_offset cannot be combined on one access pattern")
        if isinstance(scalar_offset, NkiTensor):
            if indirect_dim != 0 or self.access.on_chip:
                raise SimulatorError("ap(scalar_offset=<tile>): a runtime offset moves dim 0 of an HBM tensor "
                                     "(indirect_dim=0) in a dma_copy; on-chip access patterns take trace-time "
                                     "integers only")
            view = self.ap(pattern, offset, dtype=dtype)
            view.dynamic = scalar_offset
            return view
        if scalar_offset is not None:  # known at trace time: a static shift of the indirect dim's start
            dims = [(int(st), int(c)) for st, c in pattern]
            dims = dims[1:] if self.access.on_chip else dims
            if not 0 <= indirect_dim < len(dims):
                raise SimulatorError(f"ap(scalar_offset=...): indirect_dim {indirect_dim} is not a free dim of "
                                     f"the pattern {list(map(list, pattern))}")
            offset = int(offset) + int(scalar_offset) * dims[indirect_dim][0]
        if vector_offset is not None:
            if indirect_dim != 0 or self.access.on_chip:
                raise SimulatorError("ap(vector_offset=...): only dim 0 of an HBM tensor can be indirect")
            view = self.ap(pattern, offset, dtype=dtype)
            view.indirect = vector_offset
            return view
        dt = as_dtype(dtype) if dtype is not None else self.dtype
        pairs = [(int(s), int(c)) for s, c in pattern]
        a = self.access
        offset = int(offset)
        if a.on_chip:
            (pitch, parts), pairs = pairs[0], pairs[1:]
            # the offset counts elements of the [partitions, pitch] layout: whole rows move the start partition
            rows, offset = divmod(offset, pitch) if pitch > 0 else (0, offset)
            view = self._view(AP(a.memory, dt, tuple(pairs), a.start_partition + rows, parts,
                                 a.offset + offset * dt.itemsize))
        else:
            view = self._view(AP(a.memory, dt, tuple(pairs), 0, 1, a.offset + offset * dt.itemsize))
        if isinstance(dtype, MxDtype):  # reinterpreted as MX x4 data
            view.mx = dtype
        elif dtype is not None:
            view.mx = None
        if dtype is not None:
            view.tf32 = isinstance(dtype, Tf32Dtype)
        return view

    def broadcast_to(self, shape: Sequence[int]) -> "NkiTensor":
        """Broadcast size-1 dims (an HBM view with stride 0; on chip see ``nl.broadcast_to``)."""
        return TENSOR_OPS["broadcast_to"](self, tuple(shape))

    # operators lower to the nl element-wise functions
    def _bin(self, other: Any, op: str, reverse: bool = False) -> "NkiTensor":
        fn = TENSOR_OPS[op]
        return fn(other, self) if reverse else fn(self, other)

    __add__ = lambda s, o: s._bin(o, "add")  # noqa: E731
    __radd__ = lambda s, o: s._bin(o, "add", True)  # noqa: E731
    __sub__ = lambda s, o: s._bin(o, "subtract")  # noqa: E731
    __rsub__ = lambda s, o: s._bin(o, "subtract", True)  # noqa: E731
    __mul__ = lambda s, o: s._bin(o, "multiply")  # noqa: E731
    __rmul__ = lambda s, o: s._bin(o, "multiply", True)  # noqa: E731
    __truediv__ = lambda s, o: s._bin(o, "divide")  # noqa: E731
    __rtruediv__ = lambda s, o: s._bin(o, "divide", True)  # noqa: E731
    __neg__ = lambda s: s._bin(-1.0, "multiply")  # noqa: E731

    def __repr__(self) -> str:
        return f"NkiTensor({self.name or '?'}: {self.buffer!r} {self.access!r})"


class Trace:
    """The instructions and HBM argument slots of one SPMD instance of a kernel launch being traced. The
    instances of one launch share their HBM slots (``shared``: the first instance's trace); each has its own
    instructions and on-chip allocators, as each runs on its own NeuronCore (``nki.multicore``)."""

    def __init__(self, spec: ChipSpec, grid: tuple[int, ...] = (), tensor_cls: type | None = None,
                 program_id: tuple[int, ...] | None = None, shared: "Trace | None" = None, rank: int = 0,
                 world: int = 1):
        self.spec, self.grid = spec, grid
        # the collective rank this instance belongs to (``Kernel.ranks``); each rank has its own HBM tensors,
        # named with this prefix when there are several
        self.rank, self.world = rank, world
        self.prefix = f"r{rank}." if world > 1 else ""
        self.tensor_cls = tensor_cls or NkiTensor  # the class of every tensor the trace makes (legacy: LegacyTile)
        self.instructions: list[Instr] = []
        # emission times: tile lifetimes are measured on this clock, which a retracted instruction does not rewind
        self.clock, self.clocks = 0, []
        self.slots: dict[str, ArgSlot] = {} if shared is None else shared.slots
        # nl.shared_constant data, bound as inputs at each run
        self.constants: dict[str, torch.Tensor] = {} if shared is None else shared.constants
        self.hbm_kinds: dict[str, str] = {} if shared is None else shared.hbm_kinds  # slot -> "shared"/"private"
        self.program_id: tuple[int, ...] = ()
        self._dma_queue = 0
        self._spill_queue = 0
        self.allocs: list[Alloc] = []   # every on-chip tile of the trace (for the liveness pass)
        self.ordering: list[tuple[Instr, Instr]] = []  # (consumer, producer) edges of NkiInstruction.depends_on
        self.registers = 0               # virtual registers allocated (nisa.register_alloc, dynamic loops)
        self.open_loops: list[int] = []  # instruction indices of dynamic loops whose body is being traced
        # where nl's element-wise ops go (the compiler's choice for ops the kernel places on no engine):
        # None is VectorE; a template may spread its tiles over VectorE and GpSimdE (nl.elementwise_on)
        self.elementwise_engine: str | None = None
        # PSUM -> SBUF copies the front-end inserted whose readers may read PSUM instead (``forwarding``)
        self.forwardable: list[Instr] = []
        # constant rows of ones partition broadcasts multiply by, set once: (partitions, dtype, loops) -> tile
        self.ones_rows: dict[tuple, NkiTensor] = {}
        # element-wise results by what computed them, and (instruction, earlier one it repeats) (``forwarding``)
        self.results: dict[tuple, tuple] = {}
        self.recomputations: list[tuple[Instr, Instr]] = []
        self.overflowed = False         # whether some tile only fit past the capacity
        self.capacity = {"sbuf": spec.sbuf_bytes_per_partition, "psum": spec.psum_bytes_per_partition}
        self.bank_bytes = {"psum": spec.psum_bytes_per_partition // spec.psum_banks}
        self.begin_instance(tuple(0 for _ in grid) if program_id is None else program_id)

    @property
    def instance(self) -> int:
        """This instance's row-major index in the launch grid (its NeuronCore within the rank's cores)."""
        return int(np.ravel_multi_index(self.program_id, self.grid)) if self.grid else 0

    @property
    def instances(self) -> int:
        """Instances of the launch grid (per rank)."""
        return math.prod(self.grid) if self.grid else 1

    def begin_instance(self, program_id: tuple[int, ...]) -> None:
        """Start an SPMD instance: fresh on-chip allocators and HBM allocation counter."""
        self._close_allocs()  # the previous instance's tiles end here (its allocators are dropped)
        self.program_id = program_id
        self.sbuf = self._memory("sbuf")
        self.psum = self._memory("psum")
        # per 4-byte PSUM word: an accumulation group is open / written since its tile was allocated. Made at
        # the first PSUM access (``_grow_psum_flags``): most kernels use no PSUM, and filling two 512K-element
        # tensors per traced instance cost more than many small kernels' whole trace (torch runs such fills on
        # its intra-op threads, which wait for a free core on a busy machine)
        self.psum_open = self.psum_written = torch.zeros(self.spec.sbuf_partitions, 0, dtype=torch.bool)
        self._hbm_count = self._const_count = 0

    def _memory(self, name: str) -> Memory:
        """An allocation-only memory (no data) whose first-fit allocator reaches past the capacity."""
        none = torch.empty((self.spec.sbuf_partitions, 0), dtype=torch.uint8)
        mem = Memory(name, self.spec.sbuf_partitions, self.capacity[name], nan_fill=False, data=none,
                     bank_bytes=self.bank_bytes.get(name, 0), group_flags=False)
        # first fit prefers low offsets, so a box past the capacity is given only when none fits below it
        mem.bytes_per_partition = VIRTUAL_BYTES
        return mem

    def _close_allocs(self) -> None:
        for a in self.allocs:
            if a.end is None:
                a.end = self.clock

    # ---- tensors -------------------------------------------------------------------

    def argument(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> NkiTensor:
        """An HBM input of the kernel."""
        self.slots[self.prefix + name] = ArgSlot(self.prefix + name, tuple(shape), dtype, "input")
        return self.tensor_cls(tile(f"hbm:{self.prefix}{name}", dtype, shape), shared_hbm, name)

    def allocate(self, shape: Sequence[int], dtype: Any, buffer: Buffer, name: str = "", blocks: int = 1,
                 address: Any = None) -> NkiTensor:
        """A new tensor on ``buffer`` (on chip: dim 0 is the partition dim). ``blocks``: the tensor is that many
        independent tiles laid out one after another in each partition (legacy block dims), each placed by its
        own liveness when the tensor does not fit. ``address=(partition_offset, free_offset_bytes)`` pins an
        on-chip tensor at that box (``nl.ndarray(address=...)``)."""
        mx = dtype if isinstance(dtype, MxDtype) else None
        tf32 = isinstance(dtype, Tf32Dtype)
        shape, dtype = tuple(int(s) for s in shape), as_dtype(dtype)
        if buffer is None:
            buffer = sbuf
        if not isinstance(buffer, Buffer):
            raise TypeError(f"buffer must be nl.sbuf, nl.psum, nl.shared_hbm or nl.private_hbm, got {buffer!r}")
        if not buffer.on_chip:
            t = self._allocate_hbm(shape, dtype, buffer, name)
            t.mx, t.tf32 = mx, tf32
            return t
        assert shape, "an on-chip tensor needs a partition dim"
        mem = self.sbuf if buffer is sbuf else self.psum
        nbytes, cap = max(math.prod(shape[1:]) * dtype.itemsize, 1), self.capacity[mem.name]
        # no liveness can help an SBUF tile larger than the memory (a PSUM one gets a virtual box: it is spilled)
        if nbytes // blocks > cap and buffer is not psum:
            raise SimulatorError(f"{mem.name} overflow: cannot allocate {shape[0]} partitions x {nbytes // blocks} "
                                 f"bytes: the capacity is {mem.partitions} partitions x {cap} bytes")
        if address is not None:
            region, pinned = self._pinned_region(mem, shape, nbytes, address, blocks)
        else:
            region, pinned = mem.allocate(shape[0], nbytes), None
        record = Alloc(region, self.clock, region.offset + region.nbytes > cap, blocks)
        record.pinned = pinned
        self.overflowed |= record.overflow
        self.allocs.append(record)
        t = self.tensor_cls(region.tile(dtype, shape[1:]), buffer, name)
        t.mx, t.tf32 = mx, tf32
        weakref.finalize(t, _free, mem, region, record, self)
        if buffer is psum:  # a fresh PSUM tile holds no open accumulation group and nothing written
            self._grow_psum_flags(region.offset + region.nbytes)
            box = (slice(region.start_partition, region.start_partition + region.partitions),
                   slice(region.offset // 4, -(-(region.offset + region.nbytes) // 4)))
            self.psum_open[box] = False
            self.psum_written[box] = False
        return t

    def _pinned_region(self, mem: Memory, shape: tuple[int, ...], nbytes: int, address: Any,
                       blocks: int) -> tuple[Region, int]:
        """The trace-time box of a tile pinned at ``address``, and the byte offset it must end up at.

        The box is the requested one when no tile held in Python overlaps it now; otherwise a virtual box at
        the same partitions (past the capacity), moved to the requested offset by the liveness pass, which
        also moves any other tile whose box and lifetime collide with it."""
        try:
            p0, off = (int(v) for v in address)
        except (TypeError, ValueError):
            raise TypeError(f"address must be (partition_offset, free_offset_bytes), got {address!r}") from None
        cap, parts = self.capacity[mem.name], shape[0]
        if blocks != 1:
            raise SimulatorError(f"{mem.name}: address= cannot place a tensor of legacy block tiles")
        if p0 < 0 or off < 0 or p0 + parts > mem.partitions or off + nbytes > cap:
            raise SimulatorError(
                f"{mem.name} overflow: address=({p0}, {off}) asks for partitions [{p0}, {p0 + parts}) x bytes "
                f"[{off}, {off + nbytes}) for a {list(shape)} tile; the {mem.name} has {mem.partitions} partitions "
                f"x {cap} bytes per partition")
        itemsize = max(nbytes // max(math.prod(shape[1:]), 1), 1)
        if off % itemsize:
            raise SimulatorError(f"{mem.name}: address=({p0}, {off}): the byte offset must be a multiple of the "
                                 f"element size ({itemsize} bytes)")
        bank = self.bank_bytes.get(mem.name, 0)
        if bank and nbytes <= bank and off // bank != (off + nbytes - 1) // bank:
            raise SimulatorError(f"{mem.name}: address=({p0}, {off}): a {nbytes}-byte tile there crosses a "
                                 f"{bank}-byte PSUM bank boundary")
        held = [r for r in mem._regions if r.start_partition < p0 + parts and p0 < r.start_partition + r.partitions
                and r.offset < off + nbytes and off < r.offset + r.nbytes]
        if held:  # a tile still bound in Python sits there now: place virtually, settle by liveness
            self.overflowed = True
            top = max([cap, *(r.offset + r.nbytes for r in mem._regions)])
            region = Region(mem.name, p0, parts, -(-top // (1 << 16)) * (1 << 16) + off, nbytes)
        else:
            region = Region(mem.name, p0, parts, off, nbytes)
        mem._regions.append(region)  # the trace-time first-fit allocator keeps other tiles out of it
        return region, off

    def _grow_psum_flags(self, end: int) -> None:
        """Widen the PSUM flags to cover bytes [0, end): at least the whole PSUM, and virtual boxes past it."""
        have = self.psum_open.shape[1]
        need = -(-end // 4)
        if need > have:
            width = max(need, 2 * have, self.capacity["psum"] // 4)
            self.psum_open, self.psum_written = (
                torch.cat([f, torch.zeros(f.shape[0], width - have, dtype=torch.bool)], 1)
                for f in (self.psum_open, self.psum_written))

    def _allocate_hbm(self, shape, dtype, buffer: Buffer, name: str) -> NkiTensor:
        # the j-th shared_hbm allocation of every SPMD instance is the same tensor
        kind = "shared" if buffer is shared_hbm else "private"
        slot_name = self.prefix + f"{kind}{self._hbm_count}" + (
            "" if kind == "shared" else f"_{'_'.join(map(str, self.program_id))}")
        self._hbm_count += 1
        old = self.slots.get(slot_name)
        if old is not None and (old.shape != shape or old.dtype != dtype):
            raise SimulatorError(f"SPMD instances allocate shared_hbm tensor #{self._hbm_count - 1} with different "
                                 f"shapes/dtypes: {old.describe()} vs {dtype}{list(shape)}")
        self.slots[slot_name] = ArgSlot(slot_name, shape, dtype, "scratch")
        self.hbm_kinds[slot_name] = kind
        return self.tensor_cls(tile(f"hbm:{slot_name}", dtype, shape), buffer, name or slot_name)

    def constant(self, data: torch.Tensor) -> NkiTensor:
        """A read-only HBM tensor holding ``data`` (``nl.shared_constant``); the j-th constant of every SPMD
        instance is the same tensor."""
        name = f"{self.prefix}shared_constant{self._const_count}"
        while name in self.slots and name not in self.constants:  # a kernel argument already has the name
            name += "_"
        self._const_count += 1
        old = self.constants.get(name)
        if old is not None and (old.shape != data.shape or old.dtype != data.dtype or not torch.equal(old, data)):
            raise SimulatorError(f"SPMD instances make shared constant #{self._const_count - 1} with different "
                                 f"values; a shared constant is one tensor for the whole launch")
        self.constants[name] = data
        self.slots[name] = ArgSlot(name, tuple(data.shape), data.dtype, "input")
        return self.tensor_cls(tile(f"hbm:{name}", data.dtype, data.shape), shared_hbm, name)

    def psum_flags(self, ap: AP, written: bool = False) -> torch.Tensor:
        """The trace-time "accumulation group open" flags (``written``: "written since allocated") under an
        fp32 PSUM pattern (one per element)."""
        assert ap.dtype.itemsize == 4, "accumulation groups are tracked for fp32 PSUM tiles"
        self._grow_psum_flags(ap.byte_range[1])
        flags = self.psum_written if written else self.psum_open
        st = [s for s, _ in ap.pattern]
        sizes = [n for _, n in ap.pattern]
        row = flags.stride(0)
        return flags.as_strided((ap.partitions, *sizes), (row, *st), ap.start_partition * row + ap.offset // 4)

    # ---- instructions ----------------------------------------------------------------

    def next_dma_queue(self) -> int:
        """The DMA queue for the next transfer (round-robin)."""
        q = self._dma_queue
        self._dma_queue = (q + 1) % DMA_QUEUES
        return q

    def caller_buffers(self) -> set[str]:
        """The memory names of the HBM buffers the caller binds (the kernel's arguments and shared constants)."""
        return {f"hbm:{name}" for name, slot in self.slots.items() if slot.kind == "input"}

    def spill_dma_queue(self) -> int:
        """The DMA queue for the next SBUF spill store or load back (round-robin over the spill queues)."""
        q = self._spill_queue
        self._spill_queue = (q + 1) % SPILL_DMA_QUEUES
        return DMA_QUEUES + q

    def retract(self, instr: Instr) -> None:
        """Drop ``instr``, the last instruction emitted (legacy ``+=`` re-targets a matmul)."""
        assert self.instructions and self.instructions[-1] is instr, "only the last instruction can be retracted"
        self.instructions.pop()
        self.clocks.pop()

    def new_register(self) -> int:
        """The index of a fresh virtual register."""
        self.registers += 1
        if self.registers > REGISTERS:
            raise SimulatorError(f"a kernel allocates more than {REGISTERS} virtual registers")
        return self.registers - 1

    def replace(self, index: int, instr: Instr) -> None:
        """Put ``instr`` in place of emitted instruction ``index`` (a loop start learns where its loop ends)."""
        self.instructions[index] = instr

    def order_after(self, consumer: Instr, producer: Instr) -> None:
        """Make ``consumer`` wait for ``producer`` in the timing model (``NkiInstruction.depends_on``)."""
        pos = {id(i): k for k, i in enumerate(self.instructions)}
        if id(consumer) not in pos or id(producer) not in pos:
            raise SimulatorError("depends_on: both instructions must belong to this kernel's program")
        if pos[id(producer)] >= pos[id(consumer)]:
            raise SimulatorError(f"depends_on: {producer.opcode} (instruction {pos[id(producer)]}) is emitted after "
                                 f"{consumer.opcode} (instruction {pos[id(consumer)]}); a producer must come first")
        self.ordering.append((consumer, producer))

    def emit(self, instr: Instr) -> Instr:
        """Append an instruction and update the PSUM accumulation-group state it leaves behind."""
        self.instructions.append(instr)
        self.clocks.append(self.clock)
        self.clock += 1
        for f in instr.psum_writes:
            (p0, p1), (b0, b1) = f.partitions, f.byte_range
            self._grow_psum_flags(b1)
            self.psum_open[p0:p1, b0 // 4:-(-b1 // 4)] = instr.engine is Engine.TENSOR
            self.psum_written[p0:p1, b0 // 4:-(-b1 // 4)] = True
        return instr

    def program(self, name: str, outputs: Sequence[str]) -> Program:
        """The traced Program; ``outputs`` are the returned HBM slots. Tiles that overflowed are placed by
        liveness first (spilling PSUM tensors larger than PSUM and SBUF tiles to HBM where even that cannot
        fit them; raising the memory's overflow error where spilling cannot help either)."""
        instructions = self.instructions
        self._check_constants_unwritten()
        if self.open_loops:
            raise SimulatorError("a dynamic loop's body did not finish (a `break` or exception out of "
                                 "nl.dynamic_range?): the program would have no loop end")
        if self.overflowed and any(isinstance(i, CONTROL) for i in instructions):
            raise NotImplementedError("a kernel with dynamic loops whose tiles overflow SBUF/PSUM: placing tiles by "
                                      "liveness across loop iterations is not modelled; free tiles earlier")
        pos = {id(i): k for k, i in enumerate(instructions)}
        after = tuple(sorted({(pos[id(c)], pos[id(p)]) for c, p in self.ordering}))
        # the front-end's PSUM evictions and the recomputations that forwarding may drop (not those a
        # depends_on pair names)
        ordered = {k for pair in after for k in pair}
        copies = {pos[id(c)] for c in self.forwardable if id(c) in pos} - ordered
        again = [(pos[id(r)], pos[id(f)]) for r, f in self.recomputations
                 if id(r) in pos and id(f) in pos and pos[id(r)] not in ordered]
        if self.overflowed:
            self._close_allocs()
            instructions = place_by_liveness(instructions, self.clocks, self.allocs, self.capacity, self.bank_bytes,
                                             host=self)
            self.instructions, self.overflowed = instructions, False  # placed once
            if len(instructions) != len(pos):
                if after:
                    raise NotImplementedError("depends_on in a kernel whose tiles are spilled (the spill adds "
                                              "instructions) is not supported")
                copies, again = set(), []  # (the spill moved the instructions: the indices are gone)
        instructions, kept = forward(instructions, copies, again)
        if len(kept) != len(self.instructions):
            self.instructions = instructions
            new_index = {k: n for n, k in enumerate(kept)}
            after = tuple(sorted((new_index[c], new_index[p]) for c, p in after))
        # (after placement: spilling may add scratch slots)
        args = [ArgSlot(s.name, s.shape, s.dtype, "output") if s.name in outputs else s for s in self.slots.values()]
        return Program(tuple(instructions), tuple(args), name, after)

    def spill_scratch(self, memory: str, partitions: int, nbytes: int) -> str:
        """A new kernel-private HBM scratch buffer of ``partitions`` rows of ``nbytes`` bytes (a multiple of 4)
        for tiles spilled out of ``memory`` (see ``liveness``); its memory name."""
        kind = f"{self.prefix}{memory}_spill"
        name = f"{kind}{sum(k.startswith(kind) for k in self.slots)}"
        while name in self.slots:  # a kernel argument already has the name
            name += "_"
        self.slots[name] = ArgSlot(name, (partitions, nbytes // 4), torch.float32, "scratch")
        self.hbm_kinds[name] = "private"
        return f"hbm:{name}"


    def _check_constants_unwritten(self) -> None:
        if not self.constants:
            return
        names = {f"hbm:{n}" for n in self.constants}
        for instr in self.instructions:
            for f in instr.writes():
                if f.memory in names:
                    raise SimulatorError(f"{instr.opcode}: writes {f.memory.removeprefix('hbm:')}, a shared constant "
                                         f"(nl.shared_constant tensors are read-only)")


def _free(mem: Memory, region, record: Alloc, trace: Trace) -> None:
    if record.end is None:
        record.end = trace.clock
    if region in mem.regions:
        mem.free(region)


_state = threading.local()

# What NkiTensor's stores (``t[i] = v``), operators and ``broadcast_to`` run: instructions and language
# functions of the layers above this one, which install them on import (nki.isa, nki.language).
TENSOR_OPS: dict[str, Callable] = {}


def current() -> Trace:
    """The trace in progress (raise outside a kernel)."""
    trace = getattr(_state, "trace", None)
    if trace is None:
        raise RuntimeError("this nki call is only valid inside a kernel being traced by nki.jit / nki.simulate")
    return trace


def set_current(trace: Trace | None) -> None:
    """Install (or clear) the trace in progress."""
    _state.trace = trace
