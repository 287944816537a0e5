"""DMA instructions: ``dma_copy`` (strided, indirect by a row index vector, or from an HBM row read at run time:
``.ap(scalar_offset=...)``) and ``dma_transpose``."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from torchneuron.sim.instruction import CostInputs, Engine, Footprint
from torchneuron.sim.memory import AP, IndexOutOfRange, contiguous_run, store
from torchneuron.sim.numerics import dtype_name, torch_name
from torchneuron.sim.isa.common import (DGE_MODES, Instr, OOB_MODES, Step, ap_dims, copy_step, descriptor_count,
                                        prepare_cast)


# ---- DMA ----------------------------------------------------------------------------------

def _dge(instr: Instr) -> None:
    instr._set("dge_mode", str(getattr(instr.dge_mode, "name", instr.dge_mode)))
    if instr.dge_mode not in DGE_MODES:
        raise instr._fail("dge_mode", f"is {instr.dge_mode!r}; expected one of {DGE_MODES}")
    if instr.queue < 0:
        raise instr._fail("queue", f"is {instr.queue}; DMA queues are numbered from 0")


def _rows_geometry(ap: AP, total: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(sizes, strides, element offset) of an indirect pattern's rows over a buffer of ``total`` elements of
    ``ap.dtype``: dim 0 is indexed, its stride is the row pitch; only whole rows inside the buffer count."""
    (pitch, _), inner = ap.pattern[0], ap.pattern[1:]
    start = ap.offset // ap.dtype.itemsize
    extent = sum((sz - 1) * st for st, sz in inner) + 1
    rows = 0 if total - start < extent else (total - start - extent) // pitch + 1
    return (rows, *(sz for _, sz in inner)), (pitch, *(st for st, _ in inner)), start


def _rows_view(core, ap: AP) -> torch.Tensor:
    """The HBM buffer as rows of an indirect pattern (``_rows_geometry``)."""
    typed = core.memory(ap.memory).typed(ap.dtype)
    sizes, strides, start = _rows_geometry(ap, typed.shape[1])
    return typed.as_strided(sizes, strides, typed.storage_offset() + start)


def _in_range(idx: torch.Tensor, rows: int) -> bool:
    """Whether every index of ``idx`` (non-empty) is a row of ``rows``: one min/max pass, no masks."""
    lo, hi = torch.aminmax(idx)
    return int(lo) >= 0 and int(hi) < rows


def _indices(core, instr: "DmaCopy", index: AP, rows: int, side: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    idx = index.view(core).reshape(-1).to(torch.int64)
    if not idx.numel() or _in_range(idx, rows):
        return idx, None
    ok = (idx >= 0) & (idx < rows)
    if instr.oob_mode == "error":
        p = int((~ok).nonzero()[0])
        raise instr._fail(f"{side}_index[{p}]", f"= {int(idx[p])} is outside the {rows} rows of "
                                               f"{getattr(instr, side).memory} (oob_mode=error)", IndexOutOfRange)
    return idx, ok


def dma_modes(instr: Instr) -> None:
    """The mode checks every DMA makes: ``oob_mode`` one of OOB_MODES, ``dge_mode`` resolved (``_dge``)."""
    instr._set("oob_mode", str(getattr(instr.oob_mode, "name", instr.oob_mode)))
    if instr.oob_mode not in OOB_MODES:
        raise instr._fail("oob_mode", f"is {instr.oob_mode!r}; expected one of {OOB_MODES}")
    _dge(instr)


@dataclass(frozen=True)
class DmaCopy(Instr):
    """``nisa.dma_copy``: ``dst = src`` by the DMA engines between HBM and SBUF (not PSUM), casting
    through fp32 when dtypes differ. Indirect rows: with ``src_index`` (an SBUF (P,1) int tile)
    the HBM ``src`` pattern's dim 0 is indexed: element (p, ...) comes from row ``src_index[p]``
    at dim-0 stride (a gather, NKI ``src.ap(vector_offset=idx, indirect_dim=0)``); ``dst_index``
    likewise scatters (indirect DMAs use software DGE). ``oob_mode="skip"`` leaves out-of-range
    rows untouched. ``queue``: the DMA queue (in-order) the transfer is issued on."""

    dst: AP
    src: AP
    src_index: AP | None = None
    dst_index: AP | None = None
    oob_mode: str = "error"
    dge_mode: str = "unknown"
    queue: int = 0
    opcode = "dma_copy"
    engine = Engine.DMA

    def check(self) -> None:
        dma_modes(self)
        if self.src_index is not None or self.dst_index is not None:
            if self.dge_mode not in ("unknown", "swdge"):
                raise self._fail("dge_mode", f"is {self.dge_mode}; indirect (gather/scatter) DMAs need swdge")
            self._set("dge_mode", "swdge")
        self._ap("dst", ("sbuf", "hbm"))
        self._ap("src", ("sbuf", "hbm"))
        if self.src_index is not None and self.dst_index is not None:
            raise self._fail("src_index and dst_index", "are both set; a DMA indexes one side")
        for side in ("src", "dst"):
            index = getattr(self, f"{side}_index")
            if index is None:
                continue
            self._ap(f"{side}_index", ("sbuf",))
            self._ints([f"{side}_index"], "indices")
            ap = getattr(self, side)
            if ap.on_chip or not ap.pattern:
                raise self._fail(side, "must be an HBM pattern whose dim 0 is the indexed dim")
            if index.numel != ap.shape[0]:
                raise self._fail(f"{side}_index", f"has {index.numel} indices; {side} dim 0 has {ap.shape[0]}")
            if ap.pattern[0][0] == 0:
                raise self._fail(side, "has row pitch 0 on its indexed dim")
        if self.src.numel != self.dst.numel:
            raise self._fail("dst", f"has {self.dst.numel} elements; src has {self.src.numel} (they must match)")

    def _footprint(self, name: str) -> Footprint:
        ap = getattr(self, name)
        if getattr(self, f"{name}_index", None) is not None:  # rows known only at run time: the whole buffer
            return Footprint(ap.memory, (0, 1), (0, 1 << 62))
        return ap.footprint()

    def execute(self, core) -> None:
        if self.src_index is not None:
            table = _rows_view(core, self.src)
            idx, ok = _indices(core, self, self.src_index, table.shape[0], "src")
            if ok is None:
                self.dst.write(core, prepare_cast(table[idx], self.dst.dtype))
                return
            current = self.dst.read(core).reshape(idx.numel(), -1)
            current[ok] = prepare_cast(table[idx[ok]], self.dst.dtype).reshape(int(ok.sum()), -1).to(current.dtype)
            self.dst.write(core, current)
        elif self.dst_index is not None:
            table = _rows_view(core, self.dst)
            idx, ok = _indices(core, self, self.dst_index, table.shape[0], "dst")
            values = prepare_cast(self.src.view(core), self.dst.dtype).reshape(idx.numel(), *table.shape[1:])
            values = values.to(table.dtype)
            if ok is None:
                table[idx] = values  # duplicate indices: one of the writers wins (unspecified, as on hardware)
            else:
                table[idx[ok]] = values[ok]
        else:
            self.dst.write(core, prepare_cast(self.src.view(core), self.dst.dtype))

    def step(self, core, slots) -> Step | None:
        if self.src_index is not None:
            return self._gather_step(core, slots)
        if self.dst_index is not None:
            return None  # scatters index at run time: execute
        return copy_step(core, self.dst, self.src, slots)

    def _gather_step(self, core, slots) -> Step | None:
        """The step of a gather from an HBM slot of the same dtype into an on-chip tile: the table's rows and
        the index and destination views resolved once; a run with an index outside the table executes (it
        raises, or skips those rows)."""
        entry = slots.get(self.src.memory)
        if (entry is None or not self.dst.on_chip or entry[1].dtype != self.src.dtype
                or self.src_index.dtype not in (torch.int32, torch.int64)):  # index_select's index dtypes
            return None
        k, slot = entry
        sizes, strides, start = _rows_geometry(self.src, slot.nbytes // slot.dtype.itemsize)
        rows, iv, dv, dst, dtype = sizes[0], self.src_index.view(core), self.dst.view(core), self.dst, self.dst.dtype

        def step(h):
            idx = iv.reshape(-1)
            if not _in_range(idx, rows):
                self.execute(core)
                return
            t = h[k]
            table = t.as_strided(sizes, strides, t.storage_offset() + start)
            # index_select returns new memory: no overlap with dst to look for
            store(dst, dv, prepare_cast(torch.index_select(table, 0, idx), dtype), may_alias=False)
        return step

    def price(self) -> CostInputs:
        onchip = [a for a in (self.dst, self.src) if a.on_chip]
        parts = onchip[0].partitions if onchip else 1
        n = self.src.numel
        run_src = contiguous_run(self.src.pattern[1:] if self.src_index is not None else ap_dims(self.src))
        run_dst = contiguous_run(self.dst.pattern[1:] if self.dst_index is not None else ap_dims(self.dst))
        op = "gather" if self.src_index is not None else "scatter" if self.dst_index is not None else None
        return CostInputs(opcode=self.opcode, engine=Engine.DMA, partitions=parts, free_elems=n // parts,
                          in_dtypes=(torch_name(self.src.dtype),), out_dtype=torch_name(self.dst.dtype),
                          in_memories=(self.src.kind,), out_memory=self.dst.kind,
                          contiguous=self.src.inner_contiguous and self.dst.inner_contiguous, op=op,
                          dma_bytes=max(self.src.nbytes, self.dst.nbytes),
                          dma_chunks=descriptor_count(n, run_src, run_dst),
                          dge_mode=None if self.dge_mode == "unknown" else self.dge_mode, flops=0)


_DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


@dataclass(frozen=True)
class DmaTranspose(Instr):
    """``nisa.dma_transpose``: ``dst = src.permute(axes)`` by DMA into SBUF (2-D: (1, 0); 3-D: (2, 1, 0);
    4-D: (3, 1, 2, 0), NKI's defaults). Same dtype on both sides."""

    dst: AP
    src: AP
    axes: tuple[int, ...] | None = None
    dge_mode: str = "unknown"
    queue: int = 0
    opcode = "dma_transpose"
    engine = Engine.DMA

    def check(self) -> None:
        _dge(self)
        self._ap("dst", ("sbuf",))
        self._ap("src", ("sbuf", "hbm"))
        rank = len(self.src.shape)
        if rank not in _DMA_TRANSPOSE_AXES:
            raise self._fail("src", f"has rank {rank}; dma_transpose takes 2-, 3- or 4-D tiles")
        axes = tuple(self.axes) if self.axes is not None else _DMA_TRANSPOSE_AXES[rank]
        if sorted(axes) != list(range(rank)):
            raise self._fail("axes", f"{axes} is not a permutation of the {rank} src dims")
        self._set("axes", axes)
        if self.src.dtype != self.dst.dtype:
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; src is {dtype_name(self.src.dtype)} "
                                    f"(dma_transpose does not cast)")
        want = tuple(self.src.shape[a] for a in axes)
        if self.dst.shape != want:
            raise self._fail("dst", f"has shape {self.dst.shape}; src {self.src.shape} permuted by {axes} is {want}")

    def execute(self, core) -> None:
        self.dst.write(core, self.src.view(core).permute(self.axes))

    def price(self) -> CostInputs:
        n = self.src.numel
        src_dims = ap_dims(self.src)
        run_src = contiguous_run([src_dims[a] for a in self.axes])
        return CostInputs(opcode=self.opcode, engine=Engine.DMA, partitions=self.dst.partitions,
                          free_elems=self.dst.free_elems, in_dtypes=(torch_name(self.src.dtype),),
                          out_dtype=torch_name(self.dst.dtype), in_memories=(self.src.kind,), out_memory="sbuf",
                          contiguous=False, op="transpose", dma_bytes=self.src.nbytes,
                          dma_chunks=descriptor_count(n, run_src, contiguous_run(ap_dims(self.dst))),
                          dge_mode=None if self.dge_mode == "unknown" else self.dge_mode, flops=0)



@dataclass(frozen=True)
class DmaCopyDynamic(Instr):
    """``nisa.dma_copy`` with a runtime start on one HBM side: ``src_offset`` (or ``dst_offset``), an SBUF
    [1, 1] integer tile, holds the row where dim 0 of the HBM pattern ``src`` (``dst``) starts, added to the
    pattern's own offset (NKI ``.ap(..., scalar_offset=t)``). The rows are indexed like an indirect DMA
    (``DmaCopy.src_index``) with indices ``value + arange(rows)``. A dynamic start needs software or hardware
    descriptor generation; ``oob_mode="skip"`` leaves the rows that fall outside the tensor untouched."""

    dst: AP
    src: AP
    src_offset: AP | None = None
    dst_offset: AP | None = None
    oob_mode: str = "error"
    dge_mode: str = "unknown"
    queue: int = 0
    opcode = "dma_copy_dynamic"
    engine = Engine.DMA

    def check(self) -> None:
        dma_modes(self)
        if self.dge_mode == "none":
            raise self._fail("dge_mode", "is none; a runtime start address needs swdge or hwdge descriptors")
        if (self.src_offset is None) == (self.dst_offset is None):
            raise self._fail("src_offset/dst_offset", "exactly one side of a dynamic DMA has a runtime offset")
        side = "src" if self.src_offset is not None else "dst"
        name = f"{side}_offset"
        self._ap(name, ("sbuf",))
        self._ints([name], "scalar offsets")
        if getattr(self, name).numel != 1:
            raise self._fail(name, f"has shape {getattr(self, name).shape}; a scalar offset is one [1, 1] value")
        ap = getattr(self, side)
        if ap.on_chip or not ap.pattern:
            raise self._fail(side, "must be an HBM pattern (a runtime offset moves dim 0 of an HBM tensor)")
        if ap.pattern[0][0] == 0:
            raise self._fail(side, "has row pitch 0 on dim 0; a runtime offset needs a nonzero pitch")
        self._static  # the same copy at offset 0 checks memories, partitions and element counts

    @property
    def side(self) -> str:
        """The HBM side whose start is dynamic (``"src"`` or ``"dst"``)."""
        return "src" if self.src_offset is not None else "dst"

    @cached_property
    def _static(self) -> DmaCopy:
        """The copy with the runtime offset taken as 0 (its checks and its price)."""
        return DmaCopy(self.dst, self.src, oob_mode=self.oob_mode, dge_mode=self.dge_mode, queue=self.queue)

    def _footprint(self, name: str) -> Footprint:
        if name == self.side:  # the rows are known only at run time: the whole buffer
            return Footprint(getattr(self, name).memory, (0, 1), (0, 1 << 62))
        return getattr(self, name).footprint()

    def _rows(self, core, table_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        ap = getattr(self, self.side)
        start = int(getattr(self, f"{self.side}_offset").view(core).reshape(-1)[0])
        idx = start + torch.arange(ap.shape[0])
        ok = (idx >= 0) & (idx < table_rows)
        if bool(ok.all()):
            return idx, None
        if self.oob_mode == "error":
            raise self._fail(f"{self.side}_offset", f"= {start} moves rows [{start}, {start + ap.shape[0]}) of "
                                                     f"{ap.memory} outside its {table_rows} rows (oob_mode=error)",
                             IndexOutOfRange)
        return idx, ok

    def execute(self, core) -> None:
        if self.side == "src":
            table = _rows_view(core, self.src)
            idx, ok = self._rows(core, table.shape[0])
            if ok is None:
                self.dst.write(core, prepare_cast(table[idx], self.dst.dtype))
                return
            current = self.dst.read(core).reshape(idx.numel(), -1)
            current[ok] = prepare_cast(table[idx[ok]], self.dst.dtype).reshape(int(ok.sum()), -1).to(current.dtype)
            self.dst.write(core, current)
        else:
            table = _rows_view(core, self.dst)
            idx, ok = self._rows(core, table.shape[0])
            values = prepare_cast(self.src.view(core), self.dst.dtype).reshape(idx.numel(), *table.shape[1:])
            values = values.to(table.dtype)
            if ok is None:
                table[idx] = values
            else:
                table[idx[ok]] = values[ok]

    def price(self) -> CostInputs:
        ci = self._static.price()
        return replace(ci, opcode=self.opcode, dge_mode=None if self.dge_mode == "unknown" else self.dge_mode)


DMA_COMPUTE_MAX_SRCS = 16


@dataclass(frozen=True)
class DmaCompute(Instr):
    """``nisa.dma_compute``: ``dst = srcs[0] + srcs[1] + ...`` element-wise by the DMA engines' compute
    logic (fp32, cast to dst's dtype), HBM or SBUF operands of equal element counts, up to 16 sources.
    Only ``reduce_op=add`` with unit scales exists (as published); indirect read-modify-write is not
    modelled."""

    dst: AP
    srcs: tuple[AP, ...]
    reduce_op: str = "add"
    scales: tuple[float, ...] | None = None
    queue: int = 0
    dge_mode: str = "none"
    opcode = "dma_compute"
    engine = Engine.DMA

    def check(self) -> None:
        _dge(self)
        srcs = tuple(self.srcs)
        self._set("srcs", srcs)
        if not 1 <= len(srcs) <= DMA_COMPUTE_MAX_SRCS:
            raise self._fail("srcs", f"has {len(srcs)} tensors; 1 to {DMA_COMPUTE_MAX_SRCS} are allowed")
        name = str(getattr(self.reduce_op, "__name__", self.reduce_op))
        if name not in ("add", "sum"):
            raise self._fail("reduce_op", f"is {name!r}; only add is supported")
        self._set("reduce_op", "add")
        if self.scales is not None:
            if len(self.scales) != len(srcs) or any(float(s) != 1.0 for s in self.scales):
                raise self._fail("scales", f"are {list(self.scales)}; they must be one 1.0 per source")
            self._set("scales", tuple(float(s) for s in self.scales))
        self._ap("dst", ("sbuf", "hbm"))
        for i, src in enumerate(srcs):
            if not isinstance(src, AP):
                raise self._fail(f"srcs[{i}]", f"must be a tensor, got {type(src).__name__}")
            if src.kind not in ("sbuf", "hbm"):
                raise self._fail(f"srcs[{i}]", f"is in {src.kind}; DMA cannot access PSUM")
            if src.numel != self.dst.numel:
                raise self._fail(f"srcs[{i}]", f"has {src.numel} elements; dst has {self.dst.numel}")

    @property
    def _operands(self) -> tuple[tuple[str, AP], ...]:
        return (("dst", self.dst), *((f"srcs[{i}]", s) for i, s in enumerate(self.srcs)))

    def _footprint(self, name: str) -> Footprint:
        return dict(self._operands)[name].footprint()

    def replace_operands(self, changes: dict) -> "DmaCompute":
        """A copy with operands replaced by name (``"dst"``, ``"srcs[i]"``, as ``operands()`` names them)."""
        srcs, rest = list(self.srcs), {}
        for name, ap in changes.items():
            if name.startswith("srcs["):
                srcs[int(name[5:-1])] = ap
            else:
                rest[name] = ap
        return replace(self, srcs=tuple(srcs), **rest)

    def execute(self, core) -> None:
        total = None
        for src in self.srcs:
            v = src.view(core).reshape(self.dst.shape).float()
            total = v.clone() if total is None else total.add_(v)
        self.dst.write(core, total)

    def price(self) -> CostInputs:
        onchip = [a for a in (self.dst, *self.srcs) if a.on_chip]
        parts = onchip[0].partitions if onchip else 1
        n = self.dst.numel
        run_dst = contiguous_run(ap_dims(self.dst))
        chunks = max(descriptor_count(n, contiguous_run(ap_dims(s)), run_dst) for s in self.srcs)
        return CostInputs(opcode=self.opcode, engine=Engine.DMA, partitions=parts, free_elems=n // parts,
                          in_dtypes=tuple(torch_name(s.dtype) for s in self.srcs), out_dtype=torch_name(self.dst.dtype),
                          in_memories=tuple(s.kind for s in self.srcs), out_memory=self.dst.kind, op="add",
                          dma_bytes=sum(s.nbytes for s in self.srcs) + self.dst.nbytes, dma_chunks=chunks,
                          dge_mode=None if self.dge_mode in ("unknown", "none") else self.dge_mode,
                          flops=n * (len(self.srcs) - 1))


@dataclass(frozen=True)
class DevicePrint(Instr):
    """``nl.device_print``: when the program runs, print ``prefix`` and the tensor's values (SBUF or HBM) to the
    host's stdout, as the runtime's debug stream exports them; timed as a DMA of the tensor to HBM."""

    prefix: str
    tensor: AP
    queue: int = 0
    opcode = "device_print"
    engine = Engine.DMA
    WRITES = ()

    def check(self) -> None:
        self._ap("tensor", ("sbuf", "hbm"))
        if not isinstance(self.prefix, str):
            raise self._fail("prefix", f"must be a constant string, got {type(self.prefix).__name__}")

    def execute(self, core) -> None:
        print(f"{self.prefix} {self.tensor.read(core).tolist()}", flush=True)

    def price(self) -> CostInputs:
        ap = self.tensor
        return CostInputs(opcode=self.opcode, engine=Engine.DMA, partitions=ap.partitions,
                          free_elems=ap.free_elems, in_dtypes=(torch_name(ap.dtype),), out_dtype=torch_name(ap.dtype),
                          in_memories=(ap.kind,), out_memory="hbm", dma_bytes=ap.nbytes,
                          dma_chunks=max(1, ap.numel // contiguous_run(ap_dims(ap))),
                          flops=0)
