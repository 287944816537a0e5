"""``nki.isa`` (current generation): one function per NeuronCore instruction, ``dst=`` first.

Each call checks the instruction (the simulator's limits, raised as ``SimulatorError``)
and appends it to the kernel's trace. Tensors are ``NkiTensor``; operator arguments take
``nl`` functions (``nl.add``, ``nl.exp``...), NumPy ufuncs or names.
"""
from __future__ import annotations

import enum
import math
import os
from typing import Any

import numpy as np

from torchneuron.sim import SimulatorError, isa as sim
from torchneuron.sim.specs import chip_spec
from torchneuron.nki import multicore, tf32
from torchneuron.nki.forwarding import note_result
from torchneuron.nki.tracing import TENSOR_OPS, IndexOutOfBounds, NkiTensor, as_dtype, current, sbuf

Tile = NkiTensor
Operand = Any  # a Python scalar or a (P, 1) tile


class engine(enum.Enum):
    """``nisa.engine``: where an instruction runs (``unknown``: the default engine)."""
    unknown = "unknown"
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"


vector_engine, scalar_engine, gpsimd_engine, tensor_engine = engine.vector, engine.scalar, engine.gpsimd, engine.tensor
unknown_engine = engine.unknown
reduce_cmd = enum.Enum("reduce_cmd", [("idle", 0), ("reset", 1), ("reduce", 2), ("reset_reduce", 3),
                                      ("load_reduce", 4)])
dge_mode = enum.Enum("dge_mode", ["unknown", "swdge", "hwdge", "none"])
oob_mode = enum.Enum("oob_mode", ["error", "skip"])
matmul_perf_mode = enum.Enum("matmul_perf_mode", ["none", "double_row"])
dma_engine = enum.Enum("dma_engine", [("dma", 1), ("gpsimd_dma", 2)])
NkiValidationError = SimulatorError  # a kernel broke a hardware rule (raised where the instruction is built)


class nc_version(enum.Enum):
    """``nisa.nc_version``: the NeuronCore generation of the target (trn1/inf2, trn2, trn3)."""
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version() -> nc_version:
    """The NeuronCore generation of the chip being traced (``TORCHNEURON_CHIP`` outside a kernel)."""
    return nc_version(_generation())


def get_nc_sub_version() -> int:
    """The silicon revision within the generation: 0 (the simulator models the first revision of each)."""
    return 0


def _generation() -> int:
    try:
        spec = current().spec
    except RuntimeError:  # outside a kernel: the chip TORCHNEURON_CHIP names
        spec = chip_spec(os.environ.get("TORCHNEURON_CHIP", "trn2").strip().lower())
    return int(spec.core_generation.rsplit("v", 1)[1])


def _needs(opcode: str, generation: int) -> None:
    """SimulatorError naming the chip unless the chip being traced is NeuronCore-v<generation> or newer."""
    spec = current().spec
    if _generation() < generation:
        raise SimulatorError(f"{opcode}: needs NeuronCore-v{generation} or newer; {spec.name} is "
                             f"{spec.core_generation}")


def _a(v: Any) -> Any:
    if isinstance(v, NkiTensor):
        if v._oob:  # an index-vector access past a dim of its tensor, used without a mask to confine it
            raise IndexOutOfBounds(v._oob)
        return v.access
    return v


class NkiInstruction:
    """``nisa.NkiInstruction``: the handle an ``nki.isa`` call returns; ``depends_on`` orders it after others."""

    def __init__(self, trace: Any, instr: Any):
        self._trace, self.instruction = trace, instr

    def depends_on(self, *producers: "NkiInstruction") -> "NkiInstruction":
        """Run this instruction after each producer ends (a semaphore wait in the timing model); returns self.
        A producer must have been emitted before this instruction (the program runs in emission order)."""
        for p in producers:
            if not isinstance(p, NkiInstruction) or p._trace is not self._trace:
                raise TypeError(f"depends_on takes instructions of the same kernel trace, got {p!r}")
            self._trace.order_after(self.instruction, p.instruction)
        return self

    def __repr__(self) -> str:
        return f"NkiInstruction({self.instruction.opcode})"


def _emit(cls: type, **kw: Any) -> NkiInstruction:
    trace = current()
    tf = [k for k, v in kw.items() if isinstance(v, NkiTensor) and v.tf32]
    if tf:  # nl.tfloat32 operands: the instruction's TF32 variant (rounds what it writes, prices TF32 matmuls)
        kw.update(tf32_writes=tuple(k for k in tf if k in cls.WRITES), tf32_reads=tuple(k for k in tf if k not in cls.WRITES))
        cls = tf32.variant(cls)
    instr = trace.emit(cls(**{k: _a(v) for k, v in kw.items()}))
    if isinstance(kw.get("dst"), NkiTensor):
        note_result(trace, instr, kw["dst"])   # (a repeat of an earlier result may be dropped: ``forwarding``)
    return NkiInstruction(trace, instr)


def _eng(e: Any) -> Any:
    return "unknown" if e is None else e


# ---- data movement ----------------------------------------------------------------------

def dma_copy(dst: Tile, src: Tile, priority: int | None = None, oob_mode: Any = oob_mode.error,
             dge_mode: Any = dge_mode.unknown, engine: Any = None, name: str | None = None) -> NkiInstruction:
    """``dst = src`` by DMA (HBM <-> SBUF; never PSUM), converting dtypes."""
    mode = getattr(dge_mode, "name", dge_mode)
    indexed = {f"{side}_index": t.indirect for side, t in (("src", src), ("dst", dst))
               if isinstance(t, NkiTensor) and t.indirect is not None}   # .ap(vector_offset=...)
    dynamic = {f"{side}_offset": t.dynamic for side, t in (("src", src), ("dst", dst))
               if isinstance(t, NkiTensor) and t.dynamic is not None}    # .ap(scalar_offset=<tile>)
    if dynamic:
        if indexed:
            raise SimulatorError("dma_copy: one side has a runtime scalar_offset and the other a vector_offset; "
                                 "a DMA has one indirect side")
        return _emit(sim.DmaCopyDynamic, dst=dst, src=src, oob_mode=getattr(oob_mode, "name", oob_mode),
              dge_mode=mode, queue=current().next_dma_queue(), **dynamic)
    return _emit(sim.DmaCopy, dst=dst, src=src, oob_mode=getattr(oob_mode, "name", oob_mode), dge_mode=mode,
          queue=current().next_dma_queue(), **indexed)


def dma_transpose(dst: Tile, src: Tile, axes: tuple[int, ...] | None = None, priority: int | None = None,
                  dge_mode: Any = dge_mode.unknown, oob_mode: Any = oob_mode.error,
                  name: str | None = None) -> NkiInstruction:
    """``dst = src`` with its axes permuted, by DMA into SBUF (``priority``, the NC-v4 QoS level, is accepted and
    not modelled; ``oob_mode`` concerns indirect transposes, which the simulator does not have)."""
    if priority is not None and not 0 <= int(priority) <= 3:
        raise SimulatorError(f"dma_transpose: priority is {priority}; DMA QoS levels are 0-3")
    return _emit(sim.DmaTranspose, dst=dst, src=src, axes=axes, dge_mode=getattr(dge_mode, "name", dge_mode),
                 queue=current().next_dma_queue())


def tensor_copy(dst: Tile, src: Tile, engine: Any = None, name: str | None = None, dtype: Any = None) -> NkiInstruction:
    """Copy SBUF/PSUM -> SBUF/PSUM on Vector/Scalar/GpSimd, casting to ``dst.dtype``.

    ``dtype=`` (not in the current API's signature, but passed by published tutorial kernels, e.g.
    ``tensor_copy(dst=<fp32 tile>, src=psum, dtype=bf16)`` "to cast to the output dtype"): the values
    are rounded to ``dtype`` and then held in ``dst``'s dtype, modelled as two copies through an SBUF
    tile of ``dtype``."""
    if dtype is not None and as_dtype(dtype) != dst.dtype:
        rounded = current().allocate(tuple(dst.shape), as_dtype(dtype), sbuf)
        _emit(sim.TensorCopy, dst=rounded, src=src, engine=_eng(engine))
        src = rounded
    return _emit(sim.TensorCopy, dst=dst, src=src, engine=_eng(engine))


def memset(dst: Tile, value: float | int, engine: Any = None, name: str | None = None) -> NkiInstruction:
    """Fill ``dst`` with a constant (Vector or GpSimd)."""
    return _emit(sim.Memset, dst=dst, value=value, engine=_eng(engine))


# ---- TensorE ----------------------------------------------------------------------------

def nc_matmul(dst: Tile, stationary: Tile, moving: Tile, is_stationary_onezero: bool = False,
              is_moving_onezero: bool = False, is_transpose: bool = False, accumulate: bool | None = None,
              tile_position: tuple = (), tile_size: tuple = (), perf_mode: Any = None,
              name: str | None = None) -> NkiInstruction:
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on TensorE into PSUM (fp32 accumulation).

    ``accumulate=None``: overwrite where no accumulation group is open on ``dst``, else add.
    ``tile_position=(row, col)`` with ``tile_size=(rows, cols)`` runs it on that tile of the PE array;
    ``perf_mode=matmul_perf_mode.double_row`` (fp8, NC-v3+) contracts ``[K, 2, M]`` x ``[K, 2, N]``."""
    trace = current()
    mode = str(getattr(perf_mode, "name", perf_mode or "none"))
    tiled = _pe_tiling(trace, tile_position, tile_size, mode)
    if accumulate is None and isinstance(dst, NkiTensor) and dst.buffer.name == "psum" and dst.dtype.itemsize == 4:
        flags = trace.psum_flags(dst.access)
        if bool(flags.all()) != bool(flags.any()):
            raise SimulatorError("nc_matmul: dst partly overlaps an open accumulation group; pass accumulate=")
        accumulate = bool(flags.all())
    if tiled is not None:
        return _emit(sim.NcMatmulTiled, dst=dst, stationary=stationary, moving=moving,
                     is_stationary_onezero=is_stationary_onezero, is_moving_onezero=is_moving_onezero,
                     is_transpose=is_transpose, accumulate=accumulate, tile_position=tiled[0], tile_size=tiled[1],
                     perf_mode=mode)
    return _emit(sim.NcMatmul, dst=dst, stationary=stationary, moving=moving,
                 is_stationary_onezero=is_stationary_onezero, is_moving_onezero=is_moving_onezero,
                 is_transpose=is_transpose, accumulate=accumulate)


def _pe_tiling(trace: Any, tile_position: Any, tile_size: Any, mode: str) -> tuple | None:
    """The (tile_position, tile_size) of a tiled / performance-mode matmul (None: a plain one), after the
    checks that depend on the chip being traced."""
    spec = trace.spec
    if bool(tile_position) != bool(tile_size):
        raise SimulatorError(f"nc_matmul: tile_position={tile_position!r} and tile_size={tile_size!r}: set both "
                             f"to enable PE tiling, or neither (the whole 128x128 array)")
    if mode == "double_row" and not spec.tensor.fp8_double_row:
        raise SimulatorError(f"nc_matmul: perf_mode=double_row (FP8 double-row) needs NeuronCore-v3 or newer; "
                             f"{spec.name} is {spec.core_generation}")
    if not tile_position and mode == "none":
        return None
    position, size = (tuple(tile_position), tuple(tile_size)) if tile_position else ((0, 0), (128, 128))
    if spec.core_generation == "NeuronCore-v2" and any(int(v) not in (64, 128) for v in size):
        raise SimulatorError(f"nc_matmul: tile_size={size}: {spec.name} ({spec.core_generation}) tiles the PE "
                             f"array in 64 or 128 rows/columns (32 needs NeuronCore-v3 or newer)")
    return position, size


def nc_transpose(dst: Tile, data: Tile, engine: Any = None, name: str | None = None) -> NkiInstruction:
    """Swap partition and free axes (TensorE <= 128x128 into PSUM, VectorE <= 32x32)."""
    return _emit(sim.NcTranspose, dst=dst, data=data, engine=_eng(engine))


# ---- Vector / Scalar / GpSimd ----------------------------------------------------------

def tensor_tensor(dst: Tile, data1: Tile, data2: Tile, op: Any, engine: Any = None, name: str | None = None) -> NkiInstruction:
    """``dst = data1 <op> data2`` element-wise."""
    return _emit(sim.TensorTensor, dst=dst, data1=data1, data2=data2, op=op, engine=_eng(engine))


def tensor_scalar(dst: Tile, data: Tile, op0: Any, operand0: Operand, reverse0: bool = False, op1: Any = None,
                  operand1: Operand = None, reverse1: bool = False, engine: Any = None,
                  name: str | None = None) -> NkiInstruction:
    """``dst = (data <op0> operand0) <op1> operand1`` with scalar or (P,1) operands."""
    return _emit(sim.TensorScalar, dst=dst, data=data, op0=op0, operand0=operand0, reverse0=reverse0, op1=op1,
          operand1=operand1, reverse1=reverse1, engine=_eng(engine))


def scalar_tensor_tensor(dst: Tile, data: Tile, op0: Any, operand0: Operand, op1: Any, operand1: Tile,
                         reverse0: bool = False, reverse1: bool = False, name: str | None = None) -> NkiInstruction:
    """``dst = (data <op0> operand0) <op1> operand1`` with operand1 a tile."""
    return _emit(sim.ScalarTensorTensor, dst=dst, data=data, op0=op0, operand0=operand0, op1=op1, operand1=operand1,
          reverse0=reverse0, reverse1=reverse1)


def reciprocal(dst: Tile, data: Tile, name: str | None = None) -> NkiInstruction:
    """``dst = 1 / data`` on VectorE."""
    return _emit(sim.Reciprocal, dst=dst, data=data)


def activation(dst: Tile, op: Any, data: Tile, bias: Operand = None, scale: Operand = 1.0, reduce_op: Any = None,
               reduce_res: Tile | None = None, reduce_cmd: Any = reduce_cmd.idle, name: str | None = None) -> NkiInstruction:
    """``dst = op(data * scale + bias)`` on ScalarE, optionally reducing the result per partition."""
    if bias is not None and not isinstance(bias, NkiTensor) and _generation() < 3:
        spec = current().spec
        raise SimulatorError(f"activation: bias must be an [N, 1] tile on {spec.core_generation} ({spec.name}); a "
                             f"constant scalar bias needs NeuronCore-v3 or newer")
    return _emit(sim.Activation, dst=dst, op=op, data=data, bias=bias, scale=scale, reduce_op=reduce_op,
          reduce_res=reduce_res, reduce_cmd=reduce_cmd)


def tensor_reduce(dst: Tile, op: Any, data: Tile, axis: int | tuple[int, ...], negate: bool = False,
                  keepdims: bool = False, name: str | None = None) -> NkiInstruction:
    """Reduce trailing free axes of ``data`` with ``op`` (never the partition axis)."""
    return _emit(sim.TensorReduce, dst=dst, op=op, data=data, axis=axis, negate=negate, keepdims=keepdims)


def tensor_partition_reduce(dst: Tile, op: Any, data: Tile, name: str | None = None) -> NkiInstruction:
    """Reduce across partitions on GpSimd into a 1-partition ``dst``."""
    return _emit(sim.TensorPartitionReduce, dst=dst, op=op, data=data)


def tensor_scalar_reduce(dst: Tile, data: Tile, op0: Any, operand0: Operand, reduce_op: Any,
                         reduce_res: Tile | None = None, reverse0: bool = False,
                         reduce_cmd: Any = reduce_cmd.reset_reduce, reduce_init: Operand = None,
                         reduce_res_negate: bool = False, name: str | None = None) -> NkiInstruction:
    """``dst = data <op0> operand0`` plus a per-partition ``reduce_op`` of the result into ``reduce_res``
    (negated with ``reduce_res_negate``; None keeps it in the VectorE registers)."""
    return _emit(sim.TensorScalarReduce, dst=dst, data=data, op0=op0, operand0=operand0, reduce_op=reduce_op,
                 reduce_res=reduce_res, reverse0=reverse0, reduce_cmd=reduce_cmd, reduce_init=reduce_init,
                 reduce_res_negate=bool(reduce_res_negate))


def tensor_tensor_scan(dst: Tile, data0: Tile, data1: Tile, initial: Operand, op0: Any, op1: Any,
                       reverse0: bool = False, reverse1: bool = False, name: str | None = None) -> NkiInstruction:
    """Per partition ``r[i] = (data0[i] <op0> r[i-1]) <op1> data1[i]``, ``r[-1] = initial``."""
    return _emit(sim.TensorTensorScan, dst=dst, data0=data0, data1=data1, initial=initial, op0=op0, op1=op1,
          reverse0=reverse0, reverse1=reverse1)


def iota(dst: Tile, pattern: Any, offset: int = 0, channel_multiplier: int = 0, name: str | None = None) -> NkiInstruction:
    """``dst[p, i...] = offset + channel_multiplier * p + sum(step_k * i_k)`` on GpSimd."""
    return _emit(sim.Iota, dst=dst, pattern=tuple(tuple(p) for p in pattern), offset=offset,
          channel_multiplier=channel_multiplier)


def affine_select(dst: Tile, pattern: Any, channel_multiplier: int, on_true_tile: Tile, on_false_value: float,
                  cmp_op: Any = "equal", offset: int = 0, name: str | None = None) -> NkiInstruction:
    """``dst = on_true_tile`` where ``cmp_op(affine index, 0)`` else ``on_false_value`` (GpSimd)."""
    return _emit(sim.AffineSelect, dst=dst, pattern=tuple(tuple(p) for p in pattern), channel_multiplier=channel_multiplier,
          on_true_tile=on_true_tile, on_false_value=on_false_value,
          cmp_op=getattr(cmp_op, "__name__", cmp_op), offset=offset)


def bn_stats(dst: Tile, data: Tile, name: str | None = None) -> NkiInstruction:
    """Per-partition (count, mean, var*count) of even and odd elements (6 values)."""
    return _emit(sim.BnStats, dst=dst, data=data)


def bn_aggr(dst: Tile, data: Tile, name: str | None = None) -> NkiInstruction:
    """Combine ``bn_stats`` triples into per-partition (mean, variance)."""
    return _emit(sim.BnAggr, dst=dst, data=data)


def max8(dst: Tile, src: Tile, name: str | None = None) -> NkiInstruction:
    """The 8 largest values of each partition, descending."""
    return _emit(sim.Max8, dst=dst, src=src)


def nc_find_index8(dst: Tile, data: Tile, vals: Tile, name: str | None = None) -> NkiInstruction:
    """Per partition, the index of each of the 8 ``vals`` in ``data``."""
    return _emit(sim.NcFindIndex8, dst=dst, data=data, vals=vals)


def rng(dst: Tile, engine: Any = None, name: str | None = None) -> NkiInstruction:
    """Random integer bits into ``dst`` (VectorE; GpSimd from NeuronCore-v3)."""
    if str(getattr(engine, "name", engine)).removesuffix("_engine") == "gpsimd":
        _needs("rng on the gpsimd engine", 3)
    return _emit(sim.Rng, dst=dst, engine=_eng(engine))


def set_rng_seed(src_seeds: Tile, name: str | None = None) -> NkiInstruction:
    """Seed the core's PRNG from a [1, 1] tile."""
    return _emit(sim.SetRngSeed, src_seeds=src_seeds)


def _rand_state_engine(opcode: str, engine: Any) -> Any:
    _needs(opcode, 3)
    if getattr(engine, "name", engine) in ("vector", "vector_engine"):
        _needs(f"{opcode} on the vector engine", 4)
    return engine


def rand_get_state(dst: Tile, engine: Any = engine.gpsimd, name: str | None = None) -> NkiInstruction:
    """The generator state as uint32 words per lane (6 on GpSimd, 24 on VectorE; NC-v3+, VectorE NC-v4+)."""
    return _emit(sim.RandGetState, dst=dst, engine=_rand_state_engine("rand_get_state", engine))


def rand_set_state(src_seeds: Tile, engine: Any = engine.gpsimd, name: str | None = None) -> NkiInstruction:
    """Seed the generator from uint32 words per lane (a ``rand_get_state`` result restores that state)."""
    return _emit(sim.RandSetState, src_seeds=src_seeds, engine=_rand_state_engine("rand_set_state", engine))


def rand2(dst: Tile, min: Operand, max: Operand, name: str | None = None) -> NkiInstruction:
    """Uniform random values in [min, max] (VectorE, NeuronCore-v4 and newer)."""
    _needs("rand2", 4)
    return _emit(sim.Rand2, dst=dst, min=min, max=max)


def dropout(dst: Tile, data: Tile, prob: Operand, name: str | None = None) -> NkiInstruction:
    """Zero each element of ``data`` with probability ``prob`` (no rescaling)."""
    return _emit(sim.Dropout, dst=dst, data=data, prob=prob)


# ---- MX (microscaling) on NeuronCore-v4 --------------------------------------------------

def _mx_chip(opcode: str) -> None:
    spec = current().spec
    if not spec.tensor.mx_contraction:
        raise SimulatorError(f"{opcode}: MX formats need NeuronCore-v4 (trn3); {spec.name} is {spec.core_generation}")


def _mx_of(t: Any, name: str, opcode: str) -> str:
    fmt = getattr(t, "mx", None)
    if fmt is None:
        raise SimulatorError(f"{opcode}: {name} must be MX x4 data (nl.float8_e5m2_x4, nl.float8_e4m3fn_x4 or "
                             f"nl.float4_e2m1fn_x4: allocate it with that dtype or view it with .ap(dtype=...))")
    return fmt.element


def quantize_mx(dst: Tile, src: Tile, dst_scale: Tile, name: str | None = None) -> NkiInstruction:
    """Quantize bf16/fp16 ``src[P, 4F]`` into MX fp8 x4 ``dst[P, F]`` and its scales (VectorE, trn3)."""
    _mx_chip("quantize_mx")
    return _emit(sim.QuantizeMx, dst=dst, src=src, dst_scale=dst_scale,
          dst_format=_mx_of(dst, "dst", "quantize_mx"))


def nc_matmul_mx(dst: Tile, stationary: Tile, moving: Tile, stationary_scale: Tile, moving_scale: Tile,
                 tile_position: tuple | None = None, tile_size: tuple | None = None, accumulate: bool | None = None,
                 name: str | None = None) -> NkiInstruction:
    """``dst[M, N] (+)= `` the dequantized MX ``stationary[K, M].T @ moving[K, N]`` (contraction 4K) on TensorE (trn3)."""
    _mx_chip("nc_matmul_mx")
    trace = current()
    if bool(tile_position) != bool(tile_size):
        raise SimulatorError("nc_matmul_mx: set both tile_position and tile_size to enable row tiling, or neither")
    if accumulate is None:
        accumulate = False
        if dst.buffer.name == "psum" and dst.dtype.itemsize == 4:  # same rule as nc_matmul
            flags = trace.psum_flags(dst.access)
            if bool(flags.all()) != bool(flags.any()):
                raise SimulatorError("nc_matmul_mx: dst partly overlaps an open accumulation group; pass accumulate=")
            accumulate = bool(flags.all())
    tiling = dict(tile_position=tuple(tile_position), tile_size=tuple(tile_size)) if tile_position else {}
    return _emit(sim.NcMatmulMx, dst=dst, stationary=stationary, moving=moving, stationary_scale=stationary_scale,
          moving_scale=moving_scale, stationary_format=_mx_of(stationary, "stationary", "nc_matmul_mx"),
          moving_format=_mx_of(moving, "moving", "nc_matmul_mx"), accumulate=accumulate, **tiling)


# ---- registers -----------------------------------------------------------------------------------

class VirtualRegister:
    """``nisa.VirtualRegister``: a 32-bit integer register of the engine sequencers, read and written when the
    kernel runs (loop bounds, loop conditions, runtime offsets). Its value is unknown while the kernel is
    traced, so Python control flow on it (``if``/``while``/``int()``/``range()``) raises TypeError."""

    def __init__(self, index: int):
        self.register_index = index

    def _unknown(self, *_: Any) -> Any:
        raise TypeError("a VirtualRegister's value is known only when the kernel runs: use nl.fori_loop, "
                        "nl.while_loop or nl.dynamic_range for control flow on it, nisa.register_store to read it")

    __bool__ = __int__ = __index__ = __float__ = __iter__ = _unknown

    def __repr__(self) -> str:
        return f"VirtualRegister(r{self.register_index})"


def _reg(v: Any, what: str) -> int:
    if not isinstance(v, VirtualRegister):
        raise TypeError(f"{what} must be a VirtualRegister (from nisa.register_alloc), got {type(v).__name__}")
    return v.register_index


def register_alloc(x: int | None = None) -> VirtualRegister:
    """A new register, set to the integer ``x`` when given (an instruction), else uninitialised."""
    reg = VirtualRegister(current().new_register())
    if x is not None:
        if isinstance(x, VirtualRegister) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"register_alloc(x): x is a compile-time integer or None, got {type(x).__name__}")
        register_move(reg, int(x))
    return reg


def register_move(dst: VirtualRegister, src: "VirtualRegister | int") -> NkiInstruction:
    """``dst = src`` (a register or a compile-time integer)."""
    if isinstance(src, VirtualRegister):
        return _emit(sim.RegisterMove, dst=_reg(dst, "dst"), src=src.register_index)
    return _emit(sim.RegisterMove, dst=_reg(dst, "dst"), imm=int(src))


def register_load(dst: VirtualRegister, src: Tile) -> NkiInstruction:
    """Load a one-element integer tensor (SBUF or HBM) into ``dst`` when the kernel runs."""
    return _emit(sim.RegisterLoad, dst=_reg(dst, "dst"), src=src)


def register_store(dst: Tile, src: VirtualRegister) -> NkiInstruction:
    """Store register ``src`` into a one-element integer tensor (SBUF or HBM) when the kernel runs."""
    return _emit(sim.RegisterStore, dst=dst, src=_reg(src, "src"))


def _register_tile(reg: VirtualRegister) -> Tile:
    """An SBUF [1, 1] int32 tile holding the register (a runtime offset read by a DMA)."""
    t = current().allocate((1, 1), "int32", sbuf)
    register_store(t, reg)
    return t


# ---- selection, search and on-chip movement ---------------------------------------------------

def tensor_copy_predicated(dst: Tile, src: Tile | float, predicate: Tile, reverse_pred: bool = False,
                           name: str | None = None) -> NkiInstruction:
    """``dst = src`` where ``predicate`` (uint8/16/32) is nonzero (zero with ``reverse_pred``), else unchanged (VectorE)."""
    return _emit(sim.TensorCopyPredicated, dst=dst, src=src, predicate=predicate, reverse_pred=reverse_pred)


def select_reduce(dst: Tile, predicate: Tile, on_true: Tile, on_false: Operand, reduce_res: Tile | None = None,
                  reduce_cmd: Any = reduce_cmd.idle, reduce_op: Any = "maximum", reverse_pred: bool = False,
                  name: str | None = None) -> NkiInstruction:
    """``dst = where(predicate, on_true, on_false)`` with an optional per-partition max into ``reduce_res`` (VectorE)."""
    return _emit(sim.SelectReduce, dst=dst, predicate=predicate, on_true=on_true, on_false=on_false, reduce_res=reduce_res,
          reduce_cmd=reduce_cmd, reduce_op=reduce_op, reverse_pred=reverse_pred)


FP32_MIN = sim.selection.FP32_MIN


def range_select(dst: Tile, on_true_tile: Tile, comp_op0: Any, comp_op1: Any, bound0: Tile, bound1: Tile,
                 reduce_cmd: Any = reduce_cmd.reset_reduce, reduce_res: Tile | None = None, reduce_op: Any = "maximum",
                 range_start: int = 0, on_false_value: float = FP32_MIN, name: str | None = None) -> NkiInstruction:
    """Keep ``on_true_tile`` where both comparisons of ``range_start + free index`` with the bounds hold, else
    FP32_MIN, with a per-partition max (VectorE, NC-v3+)."""
    _needs("range_select", 3)
    return _emit(sim.RangeSelect, dst=dst, on_true_tile=on_true_tile, comp_op0=comp_op0, comp_op1=comp_op1, bound0=bound0,
          bound1=bound1, reduce_cmd=reduce_cmd, reduce_res=reduce_res, reduce_op=reduce_op, range_start=range_start,
          on_false_value=on_false_value)


def sequence_bounds(dst: Tile, segment_ids: Tile, name: str | None = None) -> NkiInstruction:
    """Per element of ``segment_ids`` ([1, n], 0 = padding), the start and end of its segment into ``dst`` [1, 2, n] (GpSimd)."""
    return _emit(sim.SequenceBounds, dst=dst, segment_ids=segment_ids)


def nonzero_with_count(dst: Tile, src: Tile, index_offset: int = 0, padding_val: int = -1,
                       name: str | None = None) -> NkiInstruction:
    """Indices of nonzero elements, padding and their count, on partitions 0, 16, ..., 112 (GpSimd, NC-v3+)."""
    _needs("nonzero_with_count", 3)
    return _emit(sim.NonzeroWithCount, dst=dst, src=src, index_offset=index_offset, padding_val=padding_val)


def nc_match_replace8(dst: Tile, data: Tile, vals: Tile, imm: float, dst_idx: Tile | None = None,
                      name: str | None = None) -> NkiInstruction:
    """Replace the first match of each of 8 values per partition by ``imm``; their indices into ``dst_idx`` (VectorE)."""
    return _emit(sim.NcMatchReplace8, dst=dst, data=data, vals=vals, imm=imm, dst_idx=dst_idx)


def nc_stream_shuffle(dst: Tile, src: Tile, shuffle_mask: Any, name: str | None = None) -> NkiInstruction:
    """Per 32-partition quadrant, output partition i takes input partition ``shuffle_mask[i]`` (255 keeps; VectorE)."""
    return _emit(sim.NcStreamShuffle, dst=dst, src=src, shuffle_mask=tuple(int(m) for m in shuffle_mask))


def nc_n_gather(dst: Tile, data: Tile, indices: Tile, name: str | None = None) -> NkiInstruction:
    """``dst[p, j] = data[p].flatten()[indices[p, j]]`` with uint32 indices (GpSimd, SBUF)."""
    return _emit(sim.NcNGather, dst=dst, data=data, indices=indices)


def local_gather(dst: Tile, src_buffer: Tile, index: Tile, num_elem_per_idx: int = 1,
                 num_valid_indices: int | None = None, name: str | None = None) -> NkiInstruction:
    """Gather ``num_elem_per_idx`` elements per uint16 index, one index list per 16-partition GpSimd core (GpSimd)."""
    return _emit(sim.LocalGather, dst=dst, src_buffer=src_buffer, index=index, num_elem_per_idx=num_elem_per_idx,
          num_valid_indices=num_valid_indices)


def topk(val_dst: Tile, idx_dst: Tile, src: Tile, n: int, name: str | None = None) -> NkiInstruction:
    """Per 16-partition snake of ``n`` bf16 values, the K largest (ascending) and their snake positions (GpSimd)."""
    return _emit(sim.TopK, val_dst=val_dst, idx_dst=idx_dst, src=src, n=n)


# ---- accumulating Vector / Scalar instructions ---------------------------------------------------

def tensor_scalar_cumulative(dst: Tile, src: Tile, op0: Any, op1: Any, imm0: Operand, imm1: Operand = None,
                             reduce_cmd: Any = reduce_cmd.reset_reduce, name: str | None = None) -> NkiInstruction:
    """Per partition the running ``op1`` of ``src <op0> imm0`` along the free dim into ``dst`` (VectorE)."""
    return _emit(sim.TensorScalarCumulative, dst=dst, src=src, op0=op0, op1=op1, imm0=imm0, imm1=imm1,
          reduce_cmd=reduce_cmd)


def exponential(dst: Tile, src: Tile, max_value: Operand = 0.0, reduce_res: Tile | None = None,
                reduce_cmd: Any = reduce_cmd.idle, reduce_init: Operand = 0.0, name: str | None = None) -> NkiInstruction:
    """``dst = exp(src - max_value)`` with an optional running sum per partition (VectorE, NC-v4)."""
    _needs("exponential", 4)
    return _emit(sim.Exponential, dst=dst, src=src, max_value=max_value, reduce_res=reduce_res, reduce_cmd=reduce_cmd,
          reduce_init=reduce_init)


def activation_reduce(dst: Tile, op: Any, data: Tile, reduce_op: Any, reduce_res: Tile | None,
                      bias: Operand = None, scale: Operand = 1.0, name: str | None = None) -> NkiInstruction:
    """``activation`` that resets the ScalarE registers and reduces its result into ``reduce_res`` (add only on NC-v2)."""
    if _generation() < 3 and reduce_op is not None and getattr(reduce_op, "__name__", reduce_op) not in ("add", "sum"):
        raise SimulatorError(f"activation_reduce: reduce_op must be add on {current().spec.core_generation} "
                             f"({current().spec.name})")
    return activation(dst=dst, op=op, data=data, bias=bias, scale=scale, reduce_op=reduce_op,
                      reduce_res=reduce_res, reduce_cmd=reduce_cmd.reset_reduce)


def activate2(dst: Tile, op: Any, data: Tile, imm0: Operand, imm1: Operand, op0: Any, op1: Any,
              relu_param: Operand = 0.0, reverse0: bool = False, reverse1: bool = False, reduce_op: Any = None,
              reduce_res: Tile | None = None, reduce_cmd: Any = reduce_cmd.idle, name: str | None = None) -> NkiInstruction:
    """``dst = op((data <op0> imm0) <op1> imm1)`` with an optional register reduction (ScalarE, NC-v4)."""
    _needs("activate2", 4)
    return _emit(sim.Activate2, dst=dst, op=op, data=data, imm0=imm0, imm1=imm1, op0=op0, op1=op1, relu_param=relu_param,
          reverse0=reverse0, reverse1=reverse1, reduce_op=reduce_op, reduce_res=reduce_res, reduce_cmd=reduce_cmd)


def dma_compute(dst: Tile, srcs: list, reduce_op: Any, scales: Any = None, unique_indices: bool = True,
                oob_mode: Any = oob_mode.error, name: str | None = None) -> NkiInstruction:
    """``dst = sum(srcs)`` element-wise by the DMA engines (add only, unit scales; HBM or SBUF)."""
    if any(isinstance(t, NkiTensor) and (t.indirect is not None or t.dynamic is not None) for t in (dst, *srcs)):
        raise NotImplementedError("dma_compute: read-modify-write through vector_offset/scalar_offset is not "
                                  "modelled; use dma_copy gathers/scatters and tensor_tensor")
    return _emit(sim.DmaCompute, dst=dst, srcs=tuple(_a(t) for t in srcs), reduce_op=reduce_op,
          scales=None if scales is None else tuple(scales), queue=current().next_dma_queue())


# ---- across NeuronCores (multi-core launches, nki.multicore) -------------------------------------

def core_barrier(data: Tile, cores: Any, engine: Any = engine.gpsimd, name: str | None = None) -> NkiInstruction:
    """Wait until every NeuronCore in ``cores`` (ranks of the launch) has reached this barrier on ``data``, a
    shared-HBM tensor they write (NC-v3+); only ``engine``'s queue blocks on the hardware, here the core."""
    _needs("core_barrier", 3)
    trace = current()
    if not isinstance(data, NkiTensor) or data.buffer.name != "shared_hbm":
        raise SimulatorError(f"core_barrier: data must be a shared-HBM tensor the cores synchronize on, got {data!r}")
    try:
        group = multicore.check_group([tuple(cores)], trace.instances, "core_barrier")[0]
    except ValueError as e:
        raise ValueError(f"{e}: cores are the program ids of the launch") from None
    if len(group) < 2:
        raise ValueError(f"core_barrier: cores={tuple(cores)}: a barrier synchronizes at least two cores")
    eng = str(getattr(engine, "name", engine)).removesuffix("_engine")
    return _emit(multicore.CrossCore, kind="core_barrier", rank=trace.rank, lane=trace.instance, groups=(group,), srcs=(data.access,),
                 engine="gpsimd" if eng in ("unknown", "None") else eng)


def sendrecv(src: Tile, dst: Tile, send_to_rank: int, recv_from_rank: int, pipe_id: int,
             dma_engine: Any = dma_engine.dma, name: str | None = None) -> NkiInstruction:
    """Send the SBUF tile ``src`` to ``dst`` on core ``send_to_rank`` while receiving ``recv_from_rank``'s ``src``
    into this core's ``dst`` (NC-v3+; same shape and dtype on both sides)."""
    _needs("sendrecv", 3)
    trace = current()
    for side, t in (("src", src), ("dst", dst)):
        if not isinstance(t, NkiTensor) or t.buffer.name != "sbuf":
            raise SimulatorError(f"sendrecv: {side} must be an SBUF tile, got {t!r}")
    if src.dtype != dst.dtype or tuple(src.shape) != tuple(dst.shape):
        raise SimulatorError(f"sendrecv: src {src.dtype}{list(src.shape)} and dst {dst.dtype}{list(dst.shape)} must "
                             f"have the same shape and dtype")
    mode = getattr(dma_engine, "name", dma_engine)
    if mode == "gpsimd_dma":  # the GpSimd internal DMA's limit per partition (reference: sendrecv)
        limit = {4: 1024, 2: 512, 1: 256}[src.dtype.itemsize]
        per_partition = math.prod(src.shape[1:]) * src.dtype.itemsize
        if per_partition > limit:
            raise SimulatorError(f"sendrecv: dma_engine=gpsimd_dma moves at most {limit} bytes per partition of "
                                 f"{src.dtype}; src has {per_partition}")
    for what, r in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        if not isinstance(r, (int, np.integer)) or not 0 <= int(r) < trace.instances:
            raise ValueError(f"sendrecv: {what}={r!r} is not a core of the launch (program ids 0.."
                             f"{trace.instances - 1})")
    return _emit(multicore.CrossCore, kind="sendrecv", rank=trace.rank, lane=trace.instance, srcs=(src.access,), dsts=(dst.access,),
                 pairs=((int(send_to_rank), int(recv_from_rank)),), pipe=int(pipe_id),
                 engine="gpsimd" if mode == "gpsimd_dma" else "dma")


TENSOR_OPS.update(memset=memset, tensor_copy=tensor_copy, dma_copy=dma_copy, register_tile=_register_tile)   # NkiTensor's stores (t[i] = v)
