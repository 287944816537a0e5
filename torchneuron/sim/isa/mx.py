"""The NC-v4 MX (OCP microscaling) pair: ``quantize_mx`` (VectorE) and ``nc_matmul_mx`` (TensorE)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from torchneuron.sim.instruction import CostInputs, Engine
from torchneuron.sim.memory import AP
from torchneuron.sim.numerics import dtype_name
from torchneuron.sim.isa.common import Instr
from torchneuron.sim.isa.tensor_engine import PE_COLS, PE_ROWS, PE_TILE_SIZES


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
