"""Tracing: the kernel's tensors (``NkiTensor``) and the trace that records its instructions.

A kernel runs once as ordinary Python. Every tensor it makes is an access pattern (``AP``)
into a simulated memory: SBUF/PSUM boxes come from first-fit allocators sized by the chip
spec (freed when the Python tensor dies, so loop bodies reuse them), HBM tensors are the
program's argument slots. Every ``nki.isa`` call appends one simulator instruction.
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Sequence

import numpy as np
import torch

from torchneuron.sim import AP, Memory, SimulatorError, tile
from torchneuron.sim.instruction import Engine
from torchneuron.sim.isa import Instr
from torchneuron.sim.numerics import to_dtype
from torchneuron.sim.program import ArgSlot, Program
from torchneuron.sim.specs import ChipSpec

DMA_QUEUES = 16  # DMA instructions are spread round-robin over this many in-order queues


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


def as_dtype(dtype: Any) -> torch.dtype:
    """Resolve an ``nl`` dtype, torch dtype, NumPy dtype or dtype name to a NeuronCore torch dtype."""
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


class NkiTensor:
    """A kernel tensor: an access pattern into SBUF, PSUM or an HBM argument, with NumPy-like views."""

    def __init__(self, access: AP, buffer: Buffer, name: str = "", base: "NkiTensor | None" = None):
        self.access, self.buffer, self.name, self.base = access, buffer, name, base  # access: the simulator AP

    shape = property(lambda self: self.access.shape, doc="The tensor's shape (dim 0 is the partition dim on chip).")
    dtype = property(lambda self: self.access.dtype, doc="The element dtype (a torch dtype).")
    ndim = property(lambda self: len(self.access.shape), doc="Number of dims.")

    def _view(self, ap: AP) -> "NkiTensor":
        return type(self)(ap, self.buffer, self.name, self.base or self)

    def __getitem__(self, index: Any) -> "NkiTensor":
        index = tuple(_index(i) for i in (index if isinstance(index, tuple) else (index,)))
        return self._view(self.access[index])

    def __setitem__(self, index: Any, value: Any) -> None:
        from torchneuron.nki import isa as nisa
        dst = self[index]
        if not isinstance(value, NkiTensor):
            nisa.memset(dst=dst, value=value)
        elif dst.buffer.on_chip and value.buffer.on_chip:
            nisa.tensor_copy(dst=dst, src=value)
        else:
            nisa.dma_copy(dst=dst, src=value)

    def reshape(self, shape: Sequence[int]) -> "NkiTensor":
        """A view with another shape (on chip, dim 0 stays the partition dim)."""
        return self._view(self.access.reshape(tuple(shape)))

    def ap(self, pattern: Sequence[Sequence[int]], offset: int = 0, dtype: Any = None) -> "NkiTensor":
        """A raw access pattern: ``pattern`` is [stride, count] pairs in elements (on chip the first pair
        is the partition pair), ``offset`` an element offset from this view's start."""
        dt = as_dtype(dtype) if dtype is not None else self.dtype
        pairs = [(int(s), int(c)) for s, c in pattern]
        a = self.access
        byte_offset = a.offset + int(offset) * dt.itemsize
        if a.on_chip:
            (_, parts), pairs = pairs[0], pairs[1:]
            return self._view(AP(a.memory, dt, tuple(pairs), a.start_partition, parts, byte_offset))
        return self._view(AP(a.memory, dt, tuple(pairs), 0, 1, byte_offset))

    def broadcast_to(self, shape: Sequence[int]) -> "NkiTensor":
        """Broadcast size-1 dims (an HBM view with stride 0; on chip see ``nl.broadcast_to``)."""
        from torchneuron.nki import language as nl
        return nl.broadcast_to(self, shape)

    # operators lower to the nl element-wise functions
    def _bin(self, other: Any, op: str, reverse: bool = False) -> "NkiTensor":
        from torchneuron.nki import language as nl
        fn = getattr(nl, op)
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
    """The instructions and HBM argument slots of one kernel launch being traced (all SPMD instances)."""

    def __init__(self, spec: ChipSpec, grid: tuple[int, ...] = (), tensor_cls: type | None = None):
        self.spec, self.grid = spec, grid
        self.tensor_cls = tensor_cls or NkiTensor  # the class of every tensor the trace makes (legacy: LegacyTile)
        self.instructions: list[Instr] = []
        self.slots: dict[str, ArgSlot] = {}
        self.hbm_kinds: dict[str, str] = {}   # slot name -> "shared" / "private"
        self.program_id: tuple[int, ...] = ()
        self._dma_queue = 0
        self.begin_instance(tuple(0 for _ in grid))

    def begin_instance(self, program_id: tuple[int, ...]) -> None:
        """Start an SPMD instance: fresh on-chip allocators and HBM allocation counter."""
        self.program_id = program_id
        spec = self.spec
        none = torch.empty((spec.sbuf_partitions, 0), dtype=torch.uint8)  # allocation only: no data
        self.sbuf = Memory("sbuf", spec.sbuf_partitions, spec.sbuf_bytes_per_partition, nan_fill=False, data=none)
        self.psum = Memory("psum", spec.sbuf_partitions, spec.psum_bytes_per_partition, nan_fill=False, data=none,
                           bank_bytes=spec.psum_bytes_per_partition // spec.psum_banks)
        self.psum_open = torch.zeros(spec.sbuf_partitions, spec.psum_bytes_per_partition // 4, dtype=torch.bool)
        self._hbm_count = 0

    # ---- tensors -------------------------------------------------------------------

    def argument(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> NkiTensor:
        """An HBM input of the kernel."""
        self.slots[name] = ArgSlot(name, tuple(shape), dtype, "input")
        return self.tensor_cls(tile(f"hbm:{name}", dtype, shape), shared_hbm, name)

    def allocate(self, shape: Sequence[int], dtype: Any, buffer: Buffer, name: str = "") -> NkiTensor:
        """A new tensor on ``buffer`` (on chip: dim 0 is the partition dim)."""
        shape, dtype = tuple(int(s) for s in shape), as_dtype(dtype)
        if buffer is None:
            buffer = sbuf
        if not isinstance(buffer, Buffer):
            raise TypeError(f"buffer must be nl.sbuf, nl.psum, nl.shared_hbm or nl.private_hbm, got {buffer!r}")
        if not buffer.on_chip:
            return self._allocate_hbm(shape, dtype, buffer, name)
        assert shape, "an on-chip tensor needs a partition dim"
        mem = self.sbuf if buffer is sbuf else self.psum
        region = mem.allocate(shape[0], max(math.prod(shape[1:]) * dtype.itemsize, 1))
        t = self.tensor_cls(region.tile(dtype, shape[1:]), buffer, name)
        weakref.finalize(t, _free, mem, region)
        if buffer is psum:  # a fresh PSUM tile holds no open accumulation group
            self.psum_open[region.start_partition:region.start_partition + region.partitions,
                           region.offset // 4:-(-(region.offset + region.nbytes) // 4)] = False
        return t

    def _allocate_hbm(self, shape, dtype, buffer: Buffer, name: str) -> NkiTensor:
        # the j-th shared_hbm allocation of every SPMD instance is the same tensor
        kind = "shared" if buffer is shared_hbm else "private"
        slot_name = f"{kind}{self._hbm_count}" + ("" if kind == "shared" else f"_{'_'.join(map(str, self.program_id))}")
        self._hbm_count += 1
        old = self.slots.get(slot_name)
        if old is not None and (old.shape != shape or old.dtype != dtype):
            raise SimulatorError(f"SPMD instances allocate shared_hbm tensor #{self._hbm_count - 1} with different "
                                 f"shapes/dtypes: {old.describe()} vs {dtype}{list(shape)}")
        self.slots[slot_name] = ArgSlot(slot_name, shape, dtype, "scratch")
        self.hbm_kinds[slot_name] = kind
        return self.tensor_cls(tile(f"hbm:{slot_name}", dtype, shape), buffer, name or slot_name)

    def psum_flags(self, ap: AP) -> torch.Tensor:
        """The trace-time "accumulation group open" flags under an fp32 PSUM pattern (one per element)."""
        assert ap.dtype.itemsize == 4, "accumulation groups are tracked for fp32 PSUM tiles"
        st = [s for s, _ in ap.pattern]
        sizes = [n for _, n in ap.pattern]
        row = self.psum_open.stride(0)
        return self.psum_open.as_strided((ap.partitions, *sizes), (row, *st),
                                         ap.start_partition * row + ap.offset // 4)

    # ---- instructions ----------------------------------------------------------------

    def next_dma_queue(self) -> int:
        """The DMA queue for the next transfer (round-robin)."""
        q = self._dma_queue
        self._dma_queue = (q + 1) % DMA_QUEUES
        return q

    def emit(self, instr: Instr) -> Instr:
        """Append an instruction and update the PSUM accumulation-group state it leaves behind."""
        self.instructions.append(instr)
        for f in instr.psum_writes:
            (p0, p1), (b0, b1) = f.partitions, f.byte_range
            self.psum_open[p0:p1, b0 // 4:-(-b1 // 4)] = instr.engine is Engine.TENSOR
        return instr

    def program(self, name: str, outputs: Sequence[str]) -> Program:
        """The traced Program; ``outputs`` are the returned HBM slots."""
        args = [ArgSlot(s.name, s.shape, s.dtype, "output") if s.name in outputs else s for s in self.slots.values()]
        return Program(tuple(self.instructions), tuple(args), name)


def _free(mem: Memory, region) -> None:
    if region in mem.regions:
        mem.free(region)


_state = threading.local()


def current() -> Trace:
    """The trace in progress (raise outside a kernel)."""
    trace = getattr(_state, "trace", None)
    if trace is None:
        raise RuntimeError("this nki call is only valid inside a kernel being traced by nki.jit / nki.simulate")
    return trace


def set_current(trace: Trace | None) -> None:
    """Install (or clear) the trace in progress."""
    _state.trace = trace
