"""Instructions beyond the base set of ``isa.py``: TensorE tiling and FP8 double-row matmuls, DMAs
whose HBM start row is read from SBUF at run time (``.ap(scalar_offset=...)``), and the NC-v4 MX
(OCP microscaling) pair ``quantize_mx`` / ``nc_matmul_mx``.

Each class follows the ``Instr`` contract of ``isa.py`` (checks at construction, ``execute``,
``step``, ``price``) and is listed in ``EXTRA_OPCODES``, where program deserialization looks up opcodes
that ``isa.OPCODES`` (the base set) lacks, so programs holding them serialize like any other.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from torchneuron.sim.instruction import CostInputs, Engine, Footprint
from torchneuron.sim.isa import DmaCopy, Instr, NcMatmul, Step, _convert, _rows_view, dma_modes
from torchneuron.sim.memory import PMAX, AP, IndexOutOfRange
from torchneuron.sim.numerics import dtype_name

PE_ROWS = PE_COLS = PMAX       # the TensorE systolic array is 128 x 128 processing elements
PE_TILE_SIZES = (32, 64, 128)  # row / column tile sizes of the tiling modes (NC-v2 allows 64 and 128 only)
FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
PERF_MODES = ("none", "double_row")


@dataclass(frozen=True)
class NcMatmulTiled(Instr):
    """``nisa.nc_matmul`` with TensorE tiling or a performance mode: ``dst[M, N] (+)= stationary.T @ moving``.

    ``tile_position=(start_row, start_col)`` / ``tile_size=(rows, cols)``: the matmul uses only that
    ``rows x cols`` tile of the 128 x 128 PE array (K <= rows, M <= cols), so several such matmuls on
    disjoint tiles run concurrently; the timing model charges the tile's share of the array.
    ``perf_mode="double_row"`` (FP8 only, no column tiling): the contraction is 2K, laid out as
    ``stationary[K, 2, M]`` / ``moving[K, 2, N]``, at twice the FP8 matmul throughput. Functionally the
    result equals the plain matmul; ``accumulate`` as in ``NcMatmul``."""

    dst: AP
    stationary: AP
    moving: AP
    is_stationary_onezero: bool = False
    is_moving_onezero: bool = False
    is_transpose: bool = False
    accumulate: bool | None = None
    tile_position: tuple[int, int] = (0, 0)
    tile_size: tuple[int, int] = (PE_ROWS, PE_COLS)
    perf_mode: str = "none"
    opcode = "nc_matmul_tiled"
    engine = Engine.TENSOR

    def check(self) -> None:
        self._set("perf_mode", str(getattr(self.perf_mode, "name", self.perf_mode)))
        if self.perf_mode not in PERF_MODES:
            raise self._fail("perf_mode", f"is {self.perf_mode!r}; expected one of {PERF_MODES}")
        pos, size = tuple(int(v) for v in self.tile_position), tuple(int(v) for v in self.tile_size)
        self._set("tile_position", pos)
        self._set("tile_size", size)
        if len(pos) != 2 or len(size) != 2:
            raise self._fail("tile_position/tile_size", f"are {pos}/{size}; each is a (row, column) pair")
        for axis, p, s, extent in (("row", pos[0], size[0], PE_ROWS), ("column", pos[1], size[1], PE_COLS)):
            if s not in PE_TILE_SIZES:
                raise self._fail("tile_size", f"has {axis} size {s}; PE tiles are {PE_TILE_SIZES}")
            if p < 0 or p % s or p + s > extent:
                raise self._fail("tile_position", f"has start {axis} {p}; it must be a multiple of the {axis} "
                                                  f"tile size {s} with start + size <= {extent}")
        k, m = self.stationary.partitions, self.stationary.free_elems
        if self.perf_mode == "double_row":
            for name in ("stationary", "moving"):
                ap = getattr(self, name)
                if ap.dtype not in FP8:
                    raise self._fail(name, f"is {dtype_name(ap.dtype)}; perf_mode=double_row takes fp8 "
                                           f"(float8_e4m3 / float8_e5m2) on both sides")
                if len(ap.shape) < 3 or ap.shape[1] != 2:
                    raise self._fail(name, f"has shape {ap.shape}; perf_mode=double_row splits the contraction "
                                           f"as [K, 2, free] (the first free dim must be 2)")
            if size[1] != PE_COLS:
                raise self._fail("perf_mode", "double_row cannot be combined with column tiling "
                                              f"(tile_size column {size[1]} < {PE_COLS})")
            if self.is_transpose:
                raise self._fail("perf_mode", "double_row cannot be combined with is_transpose")
            m //= 2
        if k > size[0]:
            raise self._fail("stationary", f"has {k} partitions (K); the PE tile has {size[0]} rows")
        if m > size[1]:
            raise self._fail("stationary", f"has {m} elements per partition (M); the PE tile has {size[1]} columns")
        self._parts  # the equivalent plain matmuls check the operands (PSUM dst, one bank, dtypes, shapes)

    @cached_property
    def _parts(self) -> tuple[NcMatmul, ...]:
        """Plain matmuls computing the same result (double row: one per half of the contraction, the second
        accumulating onto the first in fp32 PSUM, as the array's fp32 partial sums do)."""
        flags = dict(is_stationary_onezero=self.is_stationary_onezero, is_moving_onezero=self.is_moving_onezero,
                     is_transpose=self.is_transpose)
        if self.perf_mode != "double_row":
            return (NcMatmul(self.dst, self.stationary, self.moving, accumulate=self.accumulate, **flags),)
        return tuple(NcMatmul(self.dst, self.stationary[:, j], self.moving[:, j],
                              accumulate=self.accumulate if j == 0 else True, **flags) for j in (0, 1))

    @cached_property
    def kmn(self) -> tuple[int, int, int]:
        """(K, M, N): the whole contraction (2K with double row), stationary and moving free sizes."""
        k, m, n = self._parts[0].kmn
        return k * len(self._parts), m, n

    @property
    def pe_fraction(self) -> float:
        """The share of the PE array the matmul occupies."""
        return self.tile_size[0] * self.tile_size[1] / (PE_ROWS * PE_COLS)

    def _read_names(self) -> tuple[str, ...]:
        names = ("stationary", "moving")
        return names if self.accumulate is False else (*names, "dst")

    def execute(self, core) -> None:
        for part in self._parts:
            part.execute(core)

    def step(self, core, slots) -> Step | None:
        steps = [part.step(core, slots) for part in self._parts]
        if any(s is None for s in steps):
            return None
        if len(steps) == 1:
            return steps[0]
        first, second = steps
        return lambda h: (first(h), second(h))

    def price(self) -> CostInputs:
        k, m, n = self.kmn
        return self._cost([self.stationary, self.moving], self.dst, main=self.moving,
                          op="transpose" if self.is_transpose else None, matmul_kmn=(k, m, n),
                          flops=2 * k * m * n, pe_fraction=self.pe_fraction)


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
                self.dst.write(core, _convert(table[idx], self.dst.dtype))
                return
            current = self.dst.read(core).reshape(idx.numel(), -1)
            current[ok] = _convert(table[idx[ok]], self.dst.dtype).reshape(int(ok.sum()), -1).to(current.dtype)
            self.dst.write(core, current)
        else:
            table = _rows_view(core, self.dst)
            idx, ok = self._rows(core, table.shape[0])
            values = _convert(self.src.view(core), self.dst.dtype).reshape(idx.numel(), *table.shape[1:])
            values = values.to(table.dtype)
            if ok is None:
                table[idx] = values
            else:
                table[idx[ok]] = values[ok]

    def price(self) -> CostInputs:
        ci = self._static.price()
        return replace(ci, opcode=self.opcode, dge_mode=None if self.dge_mode == "unknown" else self.dge_mode)


# ---- MX (microscaling) formats, NC-v4 -----------------------------------------------------------
#
# An "x4" element packs 4 quantized values (fp8: 4 bytes, fp4: 2 bytes, value j in byte j / nibble j from
# the low end); the simulator stores it as an unsigned integer of that size and the instruction names
# the format. The 4 values of an element are consecutive along the matmul contraction, so a [P, F] x4
# tile holds [P, F, 4] values contracted over (P, 4). A scale (uint8 / float8_e8m0fnu: 2^(s - 127); 255 is
# NaN) covers 8 partitions x 1 x4 element (32 values). Scales live in the partition quadrant of their data:
# the scale of data partitions [8g, 8g + 8) is row (g // 4) * 32 + g % 4 of the scale tile.

MX_FORMATS = {"float8_e5m2": (torch.uint32, 15, 57344.0), "float8_e4m3fn": (torch.uint32, 8, 448.0),
              "float4_e2m1fn": (torch.uint16, 2, 6.0)}   # storage, Emax, largest finite value (OCP MX)
MX_GROUP_PARTITIONS = 8
_FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mx_format(instr: Instr, name: str, fmt: str) -> None:
    if fmt not in MX_FORMATS:
        raise instr._fail(name, f"has MX format {fmt!r}; expected one of {tuple(MX_FORMATS)}")
    storage = MX_FORMATS[fmt][0]
    if getattr(instr, name).dtype != storage:
        raise instr._fail(name, f"is {dtype_name(getattr(instr, name).dtype)}; {fmt}_x4 data is stored as "
                                f"{dtype_name(storage)} (4 packed values per element)")


def _scale_rows(partitions: int) -> list[int]:
    """Scale-tile rows of the 8-partition groups of ``partitions`` data partitions (quadrant layout)."""
    return [(g // 4) * 32 + g % 4 for g in range(partitions // MX_GROUP_PARTITIONS)]


def _check_scale(instr: Instr, name: str, data: AP) -> None:
    scale = getattr(instr, name)
    instr._ap(name, ("sbuf",))
    if scale.dtype not in (torch.uint8,):
        raise instr._fail(name, f"is {dtype_name(scale.dtype)}; MX scales are uint8 (float8_e8m0fnu bits)")
    need = _scale_rows(data.partitions)[-1] + 1
    if scale.partitions < need:
        raise instr._fail(name, f"has {scale.partitions} partitions; {data.partitions} data partitions need "
                                f"{need} (the scales of each 32-partition quadrant sit in its first 4 partitions)")
    if scale.free_elems < data.free_elems:
        raise instr._fail(name, f"has {scale.free_elems} elements per partition; the data has {data.free_elems}")


def mx_unpack(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """The fp32 values [..., 4] of x4 elements stored as ``packed`` (uint32 / uint16)."""
    raw = packed.contiguous().view(torch.uint8)
    if fmt == "float4_e2m1fn":
        nibbles = torch.stack([raw & 0xF, raw >> 4], -1).reshape(*packed.shape, 4)
        return _FP4_VALUES[nibbles.long()]
    return raw.view(getattr(torch, fmt)).float().reshape(*packed.shape, 4)


def mx_scales(scale: torch.Tensor, partitions: int, free: int) -> torch.Tensor:
    """The fp32 factors [groups, free] of a scale tile in quadrant layout."""
    s = scale[_scale_rows(partitions), :free].to(torch.int32)
    return torch.where(s == 255, torch.tensor(float("nan")), torch.exp2((s - 127).float()))


@dataclass(frozen=True)
class QuantizeMx(Instr):
    """``nisa.quantize_mx``: VectorE quantizes bf16/fp16 ``src[P, 4F]`` (P a multiple of 32) to MX fp8 ``dst[P, F]``
    (x4: 4 consecutive values per element) and its ``dst_scale``: per 8 partitions x 4 values the scale is
    ``2^(e - Emax)``, e the largest fp32 exponent in the group (Emax 8 for e4m3fn, 15 for e5m2; an all-zero
    group gets 2^-127); values are divided by it, clipped to the format's largest value and rounded."""

    dst: AP
    src: AP
    dst_scale: AP
    dst_format: str = "float8_e4m3fn"
    opcode = "quantize_mx"
    engine = Engine.VECTOR
    WRITES = ("dst", "dst_scale")

    def check(self) -> None:
        self._ap("src", ("sbuf",))
        self._ap("dst", ("sbuf",))
        if self.dst_format == "float4_e2m1fn":
            raise self._fail("dst", "is float4_e2m1fn_x4; quantize_mx produces fp8 MX data (e5m2 / e4m3fn)")
        _mx_format(self, "dst", self.dst_format)
        if self.src.dtype not in (torch.bfloat16, torch.float16):
            raise self._fail("src", f"is {dtype_name(self.src.dtype)}; quantize_mx takes bfloat16 or float16")
        p, f = self.src.partitions, self.src.free_elems
        if p % 32 or f % 4:
            raise self._fail("src", f"is [{p}, {f}]; the partitions must be a multiple of 32 and the free size of 4")
        if self.dst.partitions != p or self.dst.free_elems * 4 != f:
            raise self._fail("dst", f"has {self.dst.partitions} partitions x {self.dst.free_elems} x4 elements; "
                                    f"src [{p}, {f}] quantizes to [{p}, {f // 4}]")
        _check_scale(self, "dst_scale", self.dst)

    def execute(self, core) -> None:
        p, f = self.src.partitions, self.src.free_elems // 4
        _, emax, fmax = MX_FORMATS[self.dst_format]
        x = self.src.view(core).float().reshape(p // 8, 8, f, 4)
        exp = ((x.view(torch.int32) >> 23) & 0xFF).amax(dim=(1, 3))          # biased fp32 exponents
        scale = (exp - emax).clamp(min=0)                                      # [groups, f]
        factor = torch.exp2((scale - 127).double())[:, None, :, None]
        q = (x.double() / factor).clamp(-fmax, fmax).float().to(getattr(torch, self.dst_format))
        self.dst.write(core, q.reshape(p, f, 4).view(torch.uint8).view(torch.uint32).reshape(p, f))
        table = self.dst_scale.read(core).reshape(self.dst_scale.partitions, -1)
        table[_scale_rows(p), :f] = scale.to(torch.uint8)
        self.dst_scale.write(core, table.reshape(self.dst_scale.shape))

    def price(self) -> CostInputs:
        return self._cost([self.src], self.dst, op="quantize_mx")


@dataclass(frozen=True)
class NcMatmulMx(Instr):
    """``nisa.nc_matmul_mx``: ``dst[M, N] (+)= sum over (p, j) of S[p, m, j] s_S[p, m] * V[p, n, j] s_V[p, n]`` on
    TensorE with MX x4 ``stationary[K, M]`` / ``moving[K, N]`` (contraction 4K) and their quadrant-layout
    scales; fp32 accumulation into PSUM, ``dst`` fp32 or bf16. K a multiple of 32 (<= the tile's rows), M
    even <= 128, N <= 512 (fp32 dst) / 1024 (bf16 dst). Row tiling only (``tile_size`` column 128)."""

    dst: AP
    stationary: AP
    moving: AP
    stationary_scale: AP
    moving_scale: AP
    stationary_format: str = "float8_e4m3fn"
    moving_format: str = "float8_e4m3fn"
    accumulate: bool | None = None
    tile_position: tuple[int, int] = (0, 0)
    tile_size: tuple[int, int] = (PE_ROWS, PE_COLS)
    opcode = "nc_matmul_mx"
    engine = Engine.TENSOR

    def check(self) -> None:
        for name in ("stationary", "moving"):
            self._ap(name, ("sbuf",))
            _mx_format(self, name, getattr(self, f"{name}_format"))
        self._ap("dst", ("psum",))
        k, m, n = self.stationary.partitions, self.stationary.free_elems, self.moving.free_elems
        pos, size = tuple(int(v) for v in self.tile_position), tuple(int(v) for v in self.tile_size)
        self._set("tile_position", pos)
        self._set("tile_size", size)
        if size[1] != PE_COLS or pos[1] != 0 or size[0] not in PE_TILE_SIZES or pos[0] % size[0]                 or pos[0] + size[0] > PE_ROWS:
            raise self._fail("tile_position/tile_size", f"are {pos}/{size}; nc_matmul_mx tiles rows only: row size "
                                                        f"32/64/128 at a multiple of it, column (0, 128)")
        if self.moving.partitions != k:
            raise self._fail("moving", f"has {self.moving.partitions} partitions; stationary has {k}")
        if k % 32 or k > size[0]:
            raise self._fail("stationary", f"has {k} partitions; MX data takes a multiple of 32 up to the tile's "
                                           f"{size[0]} rows")
        if m % 2 or m > PE_COLS:
            raise self._fail("stationary", f"has {m} x4 elements per partition (M); it must be even and <= {PE_COLS}")
        if self.dst.dtype not in (torch.float32, torch.bfloat16):
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; nc_matmul_mx writes float32 or bfloat16")
        nmax = 512 if self.dst.dtype == torch.float32 else 1024
        if n > nmax:
            raise self._fail("moving", f"has {n} x4 elements per partition (N); the limit is {nmax} with a "
                                       f"{dtype_name(self.dst.dtype)} dst")
        if self.dst.partitions != m or self.dst.free_elems != n:
            raise self._fail("dst", f"has shape {self.dst.shape}; it must be [M={m}, N={n}]")
        _check_scale(self, "stationary_scale", self.stationary)
        _check_scale(self, "moving_scale", self.moving)

    def _read_names(self) -> tuple[str, ...]:
        names = ("stationary", "moving", "stationary_scale", "moving_scale")
        return names if self.accumulate is False else (*names, "dst")

    def execute(self, core) -> None:
        k, m, n = self.stationary.partitions, self.stationary.free_elems, self.moving.free_elems
        sides = []
        for name, free in (("stationary", m), ("moving", n)):
            vals = mx_unpack(getattr(self, name).view(core).reshape(k, free), getattr(self, f"{name}_format"))
            scale = getattr(self, f"{name}_scale")
            factors = mx_scales(scale.view(core).reshape(scale.partitions, -1), k, free)
            sides.append(vals * factors.repeat_interleave(MX_GROUP_PARTITIONS, 0)[:, :, None])
        r = torch.einsum("pmj,pnj->mn", sides[0], sides[1]).reshape(self.dst.shape)
        if self.accumulate:
            r = self.dst.view(core).float() + r
        self.dst.write(core, r.to(self.dst.dtype))

    def price(self) -> CostInputs:
        k, m, n = self.stationary.partitions, self.stationary.free_elems, self.moving.free_elems
        kind = lambda fmt: "mxfp4" if fmt.startswith("float4") else "mxfp8"  # noqa: E731
        return CostInputs(opcode=self.opcode, engine=Engine.TENSOR, partitions=k, free_elems=n,
                          in_dtypes=(kind(self.stationary_format), kind(self.moving_format)),
                          out_dtype=dtype_name(self.dst.dtype), in_memories=("sbuf", "sbuf"), out_memory="psum",
                          matmul_kmn=(4 * k, m, n), flops=2 * 4 * k * m * n,
                          pe_fraction=self.tile_size[0] / PE_ROWS)


# Looked up by program deserialization after ``isa.OPCODES`` (kept apart: OPCODES is the base set).
EXTRA_OPCODES: dict[str, type[Instr]] = {cls.opcode: cls for cls in (NcMatmulTiled, DmaCopyDynamic, QuantizeMx,
                                                                       NcMatmulMx)}
nc_matmul_tiled, dma_copy_dynamic, quantize_mx, nc_matmul_mx = NcMatmulTiled, DmaCopyDynamic, QuantizeMx, NcMatmulMx
