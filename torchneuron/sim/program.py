"""A program: the instruction list of one kernel plus its named HBM argument slots (our NEFF).

A Program is a value. It runs any number of times with different bindings without
re-running the Python that traced it, and serializes to a small JSON form (stable across
code changes that keep the nki.isa argument names) for the on-disk kernel cache.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import torch

from torchneuron.sim.instruction import Engine
from torchneuron.sim.isa import OPCODES, DmaCopy, DmaCopyDynamic, DmaTranspose, Instr
from torchneuron.sim.isa.control import CONTROL, branches
from torchneuron.sim.memory import AP, NAN_BYTE, SimulatorError
from torchneuron.sim.numerics import dtype_name, to_dtype
from torchneuron.sim.specs import ChipSpec

FORMAT = 1
ARG_KINDS = ("input", "output", "scratch")


@dataclass(frozen=True)
class ArgSlot:
    """One HBM argument of a program. ``input``: the caller binds it. ``output``: bound by the caller
    or allocated by the run and returned. ``scratch``: kernel-private HBM, allocated per run."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "input"

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", to_dtype(self.dtype))
        if self.kind not in ARG_KINDS:
            raise SimulatorError(f"argument {self.name!r}: kind {self.kind!r} is not one of {ARG_KINDS}")

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer."""
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        """``float32[128, 512]``."""
        return f"{dtype_name(self.dtype)}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True, eq=True)
class Program:
    """An instruction list and the HBM argument slots its access patterns name ("hbm:<slot>")."""

    instructions: tuple[Instr, ...]
    args: tuple[ArgSlot, ...] = ()
    name: str = "kernel"
    after: tuple[tuple[int, int], ...] = ()  # (consumer, producer) indices: explicit waits (depends_on)

    def __post_init__(self):
        object.__setattr__(self, "instructions", tuple(self.instructions))
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "after", tuple((int(c), int(p)) for c, p in self.after))
        for c, p in self.after:
            if not 0 <= p < c < len(self.instructions):
                raise SimulatorError(f"program {self.name!r}: explicit dependency ({c} after {p}) must name an "
                                     f"earlier instruction as the producer")
        slots = {s.name: s for s in self.args}
        if len(slots) != len(self.args):
            raise SimulatorError(f"program {self.name!r}: duplicate argument names")
        for i, instr in enumerate(self.instructions):  # HBM bounds are static: check them once, here
            for operand, ap in instr.operands():
                if ap.on_chip:
                    continue
                slot = slots.get(ap.memory.removeprefix("hbm:"))
                if slot is None:
                    raise SimulatorError(f"program {self.name!r}: instruction {i} ({instr.opcode}) {operand} "
                                         f"names {ap.memory}, which is not an argument ({sorted(slots)})")
                indirect = getattr(instr, f"{operand}_index", None) is not None
                if not indirect and ap.byte_range[1] > slot.nbytes:
                    raise SimulatorError(f"program {self.name!r}: instruction {i} ({instr.opcode}) {operand} "
                                         f"reaches bytes [{ap.byte_range[0]}, {ap.byte_range[1]}) of "
                                         f"{ap.memory}, which has {slot.nbytes} bytes")

    # ---- static facts ---------------------------------------------------------------

    @cached_property
    def flops(self) -> int:
        """Arithmetic operations of one run."""
        return sum(i.cost_inputs().flops for i in self.instructions)

    @cached_property
    def _hbm_traffic(self) -> tuple[int, int]:
        read = written = 0
        for i in self.instructions:
            if isinstance(i, (DmaCopy, DmaTranspose, DmaCopyDynamic)):
                read += i.src.nbytes if not i.src.on_chip else 0
                written += i.dst.nbytes if not i.dst.on_chip else 0
        return read, written

    @property
    def hbm_bytes_read(self) -> int:
        """HBM bytes DMA reads in one run."""
        return self._hbm_traffic[0]

    @property
    def hbm_bytes_written(self) -> int:
        """HBM bytes DMA writes in one run."""
        return self._hbm_traffic[1]

    @cached_property
    def dynamic(self) -> bool:
        """Whether the program has dynamic loops (control instructions): its timing depends on each run."""
        return any(isinstance(i, CONTROL) for i in self.instructions)

    def record_run(self, executed: list[int]) -> None:
        """Keep the instruction indices one run executed (programs with dynamic loops are timed per run)."""
        self.__dict__["_executed"] = tuple(executed)

    def schedule(self, spec: ChipSpec):
        """The timing model's schedule of this program on ``spec`` (computed once per chip: it depends
        only on the instructions). A program with dynamic loops is scheduled as its last run executed it
        (each executed control instruction as one branch per engine of its loop body)."""
        if self.dynamic:
            return self._dynamic_schedule(spec)
        last = self.__dict__.get("_last_schedule")
        if last is not None and last[0] is spec:  # the same spec object as last time: skip hashing it
            return last[1]
        cache = self.__dict__.setdefault("_schedules", {})
        if spec not in cache:
            from torchneuron.sim import timing  # imported only when a run is timed
            cache[spec] = timing.schedule(list(self.instructions), spec, after=self.after)
        self.__dict__["_last_schedule"] = (spec, cache[spec])
        return cache[spec]

    def _dynamic_schedule(self, spec: ChipSpec):
        executed = self.__dict__.get("_executed")
        if executed is None:
            raise SimulatorError(f"program {self.name!r} has dynamic loops: it is timed per run, run it first")
        key = (spec, executed)
        last = self.__dict__.get("_last_dynamic")
        if last is not None and last[0] == key:
            return last[1]
        from torchneuron.sim import timing
        stream, after = [], []
        where: dict[int, int] = {}  # program index -> its latest position in the stream (for explicit waits)
        wanted = {}
        for c, p in self.after:
            wanted.setdefault(c, []).append(p)
        for k in executed:
            instr = self.instructions[k]
            if isinstance(instr, CONTROL):
                stream.extend(branches(instr))
                continue
            after += [(len(stream), where[p]) for p in wanted.get(k, ()) if p in where]
            where[k] = len(stream)
            stream.append(instr)
        sched = timing.schedule(stream, spec, after=after)
        self.__dict__["_last_dynamic"] = (key, sched)
        return sched

    def roofline(self, spec: ChipSpec):
        """``timing.roofline`` of this program's schedule on ``spec`` (computed once per chip)."""
        last = self.__dict__.get("_last_roofline")
        if last is not None and last[0] is spec:
            return last[1]
        if self.dynamic:  # timed per run: no cache
            from torchneuron.sim import timing
            return timing.roofline(self.schedule(spec), spec)
        cache = self.__dict__.setdefault("_rooflines", {})
        if spec not in cache:
            from torchneuron.sim import timing
            cache[spec] = timing.roofline(self.schedule(spec), spec)
        self.__dict__["_last_roofline"] = (spec, cache[spec])
        return cache[spec]

    def __getstate__(self) -> dict:
        # only the fields: schedules and static facts are recomputed where the program is loaded
        return {"instructions": self.instructions, "args": self.args, "name": self.name, "after": self.after}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # ---- binding --------------------------------------------------------------------

    def bind(self, bindings: dict[str, torch.Tensor], *, nan_fill: bool = False) -> dict[str, torch.Tensor]:
        """Check the caller's tensors against the slots; allocate unbound outputs and scratch buffers."""
        unknown = set(bindings) - {s.name for s in self.args}
        if unknown:
            raise SimulatorError(f"program {self.name!r}: no argument named {sorted(unknown)}; "
                                 f"arguments: {[s.name for s in self.args]}")
        bound = {}
        for slot in self.args:
            t = bindings.get(slot.name)
            if t is None:
                if slot.kind == "input":
                    raise SimulatorError(f"program {self.name!r}: input {slot.name!r} ({slot.describe()}) is not bound")
                t = self.allocate(slot, nan_fill=nan_fill)
            elif tuple(t.shape) != slot.shape or t.dtype != slot.dtype:
                raise SimulatorError(f"program {self.name!r}: argument {slot.name!r} expects {slot.describe()}, "
                                     f"got {str(t.dtype).removeprefix('torch.')}[{', '.join(map(str, t.shape))}]")
            bound[slot.name] = t
        return bound

    @staticmethod
    def allocate(slot: ArgSlot, *, nan_fill: bool = False) -> torch.Tensor:
        """A host buffer for an unbound output or scratch slot: zeros, or NaN bytes with NaN fill."""
        t = torch.zeros(slot.shape, dtype=slot.dtype)
        if nan_fill and t.numel():
            t.view(-1).view(torch.uint8).fill_(NAN_BYTE)
        return t

    # ---- serialization ----------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """A compact JSON encoding (UTF-8) for the on-disk kernel cache."""
        doc = {"format": FORMAT, "name": self.name, "args": [_encode(s) for s in self.args],
               "instructions": [_encode(i) for i in self.instructions]}
        if self.after:
            doc["after"] = [list(e) for e in self.after]
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Program":
        """Decode ``to_bytes`` output; every instruction is checked again as it is rebuilt."""
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"program format {doc.get('format')!r} is not {FORMAT}: re-trace the kernel")
        memo: dict = {}  # identical patterns decode to one AP object: geometry and views are shared
        return cls(tuple(_decode(i, memo) for i in doc["instructions"]), tuple(_decode(a, memo) for a in doc["args"]),
                   doc["name"], tuple(tuple(e) for e in doc.get("after", ())))


def _encode(v: Any) -> Any:
    if isinstance(v, Instr):
        return {"opcode": v.opcode, "fields": {f.name: _encode(getattr(v, f.name)) for f in fields(v)}}
    if isinstance(v, AP):
        return {"ap": [v.memory, dtype_name(v.dtype), [list(p) for p in v.pattern], v.start_partition,
                       v.partitions, v.offset]}
    if isinstance(v, ArgSlot):
        return {"arg": [v.name, list(v.shape), dtype_name(v.dtype), v.kind]}
    if isinstance(v, Engine):
        return {"engine": v.value}
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, (tuple, list)):
        return [_encode(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"cannot serialize {type(v).__name__} {v!r}")


def _decode(v: Any, memo: dict) -> Any:
    if isinstance(v, list):
        return tuple(_decode(x, memo) for x in v)
    if not isinstance(v, dict):
        return v
    if "opcode" in v:
        cls = OPCODES[v["opcode"]]
        return cls(**{k: _decode(x, memo) for k, x in v["fields"].items()})
    if "ap" in v:
        memory, dtype, pattern, start, parts, offset = v["ap"]
        key = (memory, dtype, tuple(map(tuple, pattern)), start, parts, offset)
        ap = memo.get(key)
        if ap is None:
            ap = memo[key] = AP(memory, to_dtype(dtype), key[2], start, parts, offset)
        return ap
    if "arg" in v:
        name, shape, dtype, kind = v["arg"]
        return ArgSlot(name, tuple(shape), to_dtype(dtype), kind)
    if "engine" in v:
        return Engine(v["engine"])
    if "dtype" in v:
        return to_dtype(v["dtype"])
    raise ValueError(f"cannot decode {v!r}")
