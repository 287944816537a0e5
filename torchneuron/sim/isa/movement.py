"""On-chip data movement without DMA: ``nc_stream_shuffle`` (VectorE, across partitions of a 32-partition
quadrant), ``nc_n_gather`` (GpSimd, within each partition) and ``local_gather`` (GpSimd, the 16 partitions
of one GpSimd core sharing one index list). Values are moved bit-exactly (no casts)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from torchneuron.sim.instruction import CostInputs, Engine
from torchneuron.sim.memory import AP, IndexOutOfRange
from torchneuron.sim.numerics import dtype_name
from torchneuron.sim.isa.common import Instr

QUADRANT = 32                 # partitions a stream shuffle permutes within
SHUFFLE_KEEP = 255            # shuffle_mask value: leave that output partition unchanged
GPSIMD_CORE_PARTITIONS = 16   # SBUF partitions wired to each of the 8 GpSimd cores
LOCAL_GATHER_ELEMS = (1, 2, 4, 8, 16, 32)
LOCAL_GATHER_MAX_INDICES = 4096


def _same_dtype(instr: Instr, a: str, b: str) -> None:
    x, y = getattr(instr, a), getattr(instr, b)
    if x.dtype != y.dtype:
        raise instr._fail(b, f"is {dtype_name(y.dtype)}; it must have {a}'s dtype {dtype_name(x.dtype)} "
                             f"(no casts)")


def _start_rule(instr: Instr, name: str, active: int) -> None:
    start = getattr(instr, name).start_partition
    allowed = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    if start not in allowed:
        raise instr._fail(name, f"starts at partition {start}; with {active} active partitions it must start at "
                                f"{' or '.join(map(str, allowed))}")


@dataclass(frozen=True)
class NcStreamShuffle(Instr):
    """``nisa.nc_stream_shuffle``: in every 32-partition quadrant, output partition i takes input partition
    ``shuffle_mask[i]`` of the same quadrant (255: unchanged); SBUF or PSUM, in place allowed."""

    dst: AP
    src: AP
    shuffle_mask: tuple[int, ...]
    opcode = "nc_stream_shuffle"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._tiles("dst", "src")
        _same_dtype(self, "src", "dst")
        if self.dst.free_elems != self.src.free_elems:
            raise self._fail("dst", f"has {self.dst.free_elems} elements per partition; src has {self.src.free_elems}")
        mask = tuple(int(m) for m in self.shuffle_mask)
        if len(mask) != QUADRANT:
            raise self._fail("shuffle_mask", f"has {len(mask)} entries; it must have {QUADRANT}")
        self._set("shuffle_mask", mask)
        active = -(-max(self.src.partitions, self.dst.partitions) // QUADRANT) * QUADRANT
        _start_rule(self, "src", active)
        _start_rule(self, "dst", active)
        for r in range(self.dst.partitions):
            m = mask[r % QUADRANT]
            if m != SHUFFLE_KEEP and not (0 <= m < QUADRANT and (r // QUADRANT) * QUADRANT + m < self.src.partitions):
                raise self._fail("shuffle_mask", f"[{r % QUADRANT}] = {m} names no partition of src's quadrant "
                                                 f"{r // QUADRANT} ({self.src.partitions} partitions; 255 keeps)")

    def execute(self, core) -> None:
        src = self.src.view(core).reshape(self.src.partitions, -1).clone()  # in place: read everything first
        out = self.dst.view(core).reshape(self.dst.partitions, -1).clone()
        for r in range(self.dst.partitions):
            m = self.shuffle_mask[r % QUADRANT]
            if m != SHUFFLE_KEEP:
                out[r] = src[(r // QUADRANT) * QUADRANT + m]
        self.dst.write(core, out)

    def price(self) -> CostInputs:
        return self._cost([self.src], self.dst, flops=0)


def _bad_index(instr: Instr, name: str, idx: torch.Tensor, ok: torch.Tensor, bound: int) -> IndexOutOfRange:
    p, j = (int(v) for v in torch.nonzero(~ok)[0])
    return instr._fail(f"{name}[{p}, {j}]", f"= {int(idx[p, j])} is outside [0, {bound})", IndexOutOfRange)


@dataclass(frozen=True)
class NcNGather(Instr):
    """``nisa.nc_n_gather`` (GpSimd, SBUF): ``dst[p, j] = data[p].flatten()[indices[p, j]]`` (uint32 indices;
    an index outside the partition's elements raises IndexOutOfRange)."""

    dst: AP
    data: AP
    indices: AP
    opcode = "nc_n_gather"
    engine = Engine.GPSIMD

    def check(self) -> None:
        self._tiles("dst", "data", "indices")
        _same_dtype(self, "data", "dst")
        if self.indices.dtype != torch.uint32:
            raise self._fail("indices", f"is {dtype_name(self.indices.dtype)}; it must be uint32")
        for n in ("dst", "indices"):
            if getattr(self, n).partitions != self.data.partitions:
                raise self._fail(n, f"has {getattr(self, n).partitions} partitions; data has {self.data.partitions}")
        self._free("dst", self.indices.free_elems, "dst has one element per index")

    def execute(self, core) -> None:
        p = self.data.partitions
        data = self.data.view(core).reshape(p, -1)
        idx = self.indices.view(core).reshape(p, -1).to(torch.int64)
        ok = (idx >= 0) & (idx < data.shape[1])
        if not bool(ok.all()):
            raise _bad_index(self, "indices", idx, ok, data.shape[1])
        self.dst.write(core, torch.gather(data, 1, idx))

    def price(self) -> CostInputs:
        return self._cost([self.indices], self.dst, main=self.indices, flops=0)


@dataclass(frozen=True)
class LocalGather(Instr):
    """``nisa.local_gather`` (GpSimd, SBUF): each GpSimd core (16 partitions) flattens its 16 rows of
    ``index`` partition-first into one list (the first ``num_valid_indices``); every partition p of the
    core then reads ``num_elem_per_idx`` contiguous elements at each index, an element offset into its
    flattened row: ``dst[p, k*E:(k+1)*E] = src_buffer[p].flatten()[i_k:i_k+E]`` (uint16 indices)."""

    dst: AP
    src_buffer: AP
    index: AP
    num_elem_per_idx: int = 1
    num_valid_indices: int | None = None
    opcode = "local_gather"
    engine = Engine.GPSIMD

    def check(self) -> None:
        self._tiles("dst", "src_buffer", "index")
        _same_dtype(self, "src_buffer", "dst")
        if self.index.dtype != torch.uint16:
            raise self._fail("index", f"is {dtype_name(self.index.dtype)}; it must be uint16")
        p = self.src_buffer.partitions
        if self.index.partitions != p or p % GPSIMD_CORE_PARTITIONS:
            raise self._fail("index", f"has {self.index.partitions} partitions; it must match src_buffer's {p}, "
                                      f"a multiple of {GPSIMD_CORE_PARTITIONS}")
        if self.src_buffer.start_partition % GPSIMD_CORE_PARTITIONS:
            raise self._fail("src_buffer", f"starts at partition {self.src_buffer.start_partition}; a GpSimd core's "
                                           f"16 partitions start at a multiple of {GPSIMD_CORE_PARTITIONS}")
        if self.num_elem_per_idx not in LOCAL_GATHER_ELEMS:
            raise self._fail("num_elem_per_idx", f"is {self.num_elem_per_idx}; expected one of {LOCAL_GATHER_ELEMS}")
        per_core = GPSIMD_CORE_PARTITIONS * self.index.free_elems
        valid = per_core if self.num_valid_indices is None else int(self.num_valid_indices)
        if not 1 <= valid <= min(per_core, LOCAL_GATHER_MAX_INDICES):
            raise self._fail("num_valid_indices", f"is {valid}; each core has {per_core} indices (at most "
                                                  f"{LOCAL_GATHER_MAX_INDICES})")
        self._set("num_valid_indices", valid)
        if self.dst.partitions != p:
            raise self._fail("dst", f"has {self.dst.partitions} partitions; src_buffer has {p}")
        self._free("dst", valid * self.num_elem_per_idx, f"{valid} indices x {self.num_elem_per_idx} elements")

    def execute(self, core) -> None:
        p, e, k = self.src_buffer.partitions, self.num_elem_per_idx, self.num_valid_indices
        src = self.src_buffer.view(core).reshape(p, -1)
        index = self.index.view(core).reshape(p, -1).to(torch.int64)
        out = torch.empty(p, k * e, dtype=src.dtype)
        offsets = torch.arange(e)
        for g in range(0, p, GPSIMD_CORE_PARTITIONS):
            idx = index[g:g + GPSIMD_CORE_PARTITIONS].t().reshape(-1)[:k]   # partition dim first
            ok = (idx >= 0) & (idx + e <= src.shape[1])
            if not bool(ok.all()):
                j = int(torch.nonzero(~ok)[0])
                raise self._fail(f"index (core {g // GPSIMD_CORE_PARTITIONS}, entry {j})",
                                 f"= {int(idx[j])} reads elements [{int(idx[j])}, {int(idx[j]) + e}) outside the "
                                 f"{src.shape[1]} of a partition", IndexOutOfRange)
            cols = (idx[:, None] + offsets).reshape(-1)
            out[g:g + GPSIMD_CORE_PARTITIONS] = src[g:g + GPSIMD_CORE_PARTITIONS][:, cols]
        self.dst.write(core, out)

    def price(self) -> CostInputs:
        return self._cost([self.index], self.dst, main=self.dst, flops=0)
