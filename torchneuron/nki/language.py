"""``nki.language`` (current generation): buffers, dtypes, tensor creation, loops, indexing, SPMD ids and
the convenience ops (``nl.load``, ``nl.add``, ``nl.matmul``, ``nl.sum``...), each lowered to ``nki.isa`` calls.

The same ``nl`` functions are operator tokens for ISA calls: ``nisa.tensor_tensor(..., op=nl.add)``.
Convenience ops return new SBUF tiles (``matmul``/``transpose``: PSUM tiles).
"""
from __future__ import annotations

import builtins
import dataclasses
import enum
import math
import os
from typing import Any, Sequence

import numpy as np
import torch

from torchneuron.nki import isa as nisa
from torchneuron.nki.tracing import (TENSOR_OPS, Buffer, MxDtype, NKIObject, Tf32Dtype, NkiTensor, as_dtype, current, ds,  # noqa: F401
                                     hbm, private_hbm, psum, sbuf, shared_hbm)
from torchneuron.sim import SimulatorError
from torchneuron.sim.numerics import BITVEC_OPS, alu_op
from torchneuron.sim import isa as sim_isa
from torchneuron.sim.isa import DevicePrint
from torchneuron.sim.isa import BN_STATS_FMAX, GEMM_MOVING_FMAX, GEMM_STATIONARY_FMAX, PSUM_BANK_BYTES
from torchneuron.sim.memory import PMAX
from torchneuron.sim.specs import chip_spec

Tile = NkiTensor
Value = Any  # a tile or a Python scalar

# ---- dtypes (torch dtypes; nl.float8_e4m3 is e4m3fn on the simulator) ------------------------
bool_, int8, int16, int32 = torch.bool, torch.int8, torch.int16, torch.int32
uint8, uint16, uint32 = torch.uint8, torch.uint16, torch.uint32
float16, bfloat16, float32 = torch.float16, torch.bfloat16, torch.float32
float8_e4m3 = float8_e4m3fn = torch.float8_e4m3fn
float8_e5m2 = torch.float8_e5m2
# MX (NC-v4): 4-packed x4 data, stored as uint32 (fp8) / uint16 (fp4); e8m0 scales are held as their uint8 bits
float8_e5m2_x4, float8_e4m3fn_x4 = MxDtype("float8_e5m2", torch.uint32), MxDtype("float8_e4m3fn", torch.uint32)
float4_e2m1fn_x4 = MxDtype("float4_e2m1fn", torch.uint16)
float8_e8m0fnu = torch.uint8
# TensorFloat-32: fp32 storage, values rounded to a 10-bit mantissa by every instruction that writes them
tfloat32 = Tf32Dtype()


class _TileSize:
    """``nl.tile_size``: hardware tile limits of the chip being traced (else ``TORCHNEURON_CHIP``)."""

    pmax = PMAX
    psum_fmax = psum_bank_fmax = GEMM_MOVING_FMAX
    psum_bank_fmax_bytes = PSUM_BANK_BYTES
    gemm_stationary_fmax = GEMM_STATIONARY_FMAX
    gemm_moving_fmax = GEMM_MOVING_FMAX
    bn_stats_fmax = BN_STATS_FMAX
    psum_min_align = sbuf_min_align = 4

    @staticmethod
    def _spec():
        try:
            return current().spec
        except RuntimeError:
            return chip_spec(os.environ.get("TORCHNEURON_CHIP", "trn2"))

    psum_num_banks = property(lambda self: self._spec().psum_banks)
    sbuf_fmax_bytes = total_available_sbuf_size = property(lambda self: self._spec().sbuf_bytes_per_partition)
    sbuf_fmax = property(lambda self: self._spec().sbuf_bytes_per_partition // 4)
    sbuf_size_bytes = property(lambda self: self._spec().sbuf_bytes_per_partition * self._spec().sbuf_partitions)


tile_size = _TileSize()


# ---- creation -------------------------------------------------------------------------------

def ndarray(shape: Sequence[int], dtype: Any, buffer: Buffer = sbuf, name: str = "", address: Any = None) -> Tile:
    """An uninitialised tensor on ``buffer`` (on chip, dim 0 is the partition dim, <= 128). On chip,
    ``address=(partition_offset, free_offset_bytes)`` places it at that box (SimulatorError if it does not
    fit); the allocator keeps other tiles out of the box while it is held."""
    if address is not None and isinstance(buffer, Buffer) and not buffer.on_chip:
        raise SimulatorError(f"nl.ndarray: address= places SBUF/PSUM tensors; {buffer!r} tensors have no address")
    return current().allocate(shape, dtype, buffer, name, address=address)


def full(shape: Sequence[int], fill_value: float | int, dtype: Any, buffer: Buffer = sbuf, name: str = "") -> Tile:
    """A tensor filled with ``fill_value`` (memset; on-chip buffers only)."""
    t = ndarray(shape, dtype, buffer, name)
    assert t.buffer.on_chip, "nl.full/nl.zeros fill SBUF/PSUM tensors (memset cannot write HBM)"
    nisa.memset(dst=t, value=fill_value)
    return t


def zeros(shape: Sequence[int], dtype: Any, buffer: Buffer = sbuf, name: str = "") -> Tile:
    """A zero-filled tensor."""
    return full(shape, 0, dtype, buffer, name)


def shared_constant(constant: Any, dtype: Any = None) -> Tile:
    """A read-only shared-HBM tensor holding ``constant`` (a NumPy array, tensor or nested list), cast to
    ``dtype`` if given; embedded in the program (bound with the inputs at every run)."""
    if isinstance(constant, NkiTensor):
        raise TypeError("nl.shared_constant takes host data (a NumPy array or tensor), not a kernel tensor")
    data = constant.detach().cpu() if isinstance(constant, torch.Tensor) else _host_tensor(constant)
    target = as_dtype(dtype if dtype is not None else data.dtype)  # (a float64 array needs dtype=)
    data = data.to(target).contiguous()
    return current().constant(data.reshape(1) if data.dim() == 0 else data)


def _host_tensor(value: Any) -> torch.Tensor:
    arr = np.ascontiguousarray(np.asarray(value))
    if arr.dtype == object:
        raise TypeError(f"expected numeric host data, got {type(value).__name__} of objects")
    return torch.from_numpy(arr.copy())


_TORCH_TO_NP = {torch.bool: np.bool_, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
                torch.uint8: np.uint8, torch.uint16: np.uint16, torch.uint32: np.uint32,
                torch.float16: np.float16, torch.float32: np.float32}


def static_cast(value: Any, dtype: Any) -> Any:
    """Host-side cast of a NumPy array (or tensor) to an NKI dtype: a NumPy array where NumPy has the dtype,
    else (bf16, fp8: NumPy has none here) a CPU tensor of that dtype; kernels accept both as inputs."""
    if isinstance(value, NkiTensor):
        raise TypeError("nl.static_cast casts host arrays; inside a kernel cast a tile with nl.copy(x, dtype=...) "
                        "or the dtype= of the instruction that produces it")
    target = as_dtype(dtype)
    if isinstance(value, torch.Tensor):
        return value.to(target)
    np_dtype = _TORCH_TO_NP.get(target)
    if np_dtype is not None:
        return np.asarray(value).astype(np_dtype)
    return _host_tensor(value).to(target)


# ---- loops (every loop is unrolled at trace time) ------------------------------------------

def affine_range(start: int, stop: int | None = None, step: int = 1, **directives: Any) -> range:
    """A loop with no loop-carried dependency (unrolled)."""
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = static_range = affine_range

MAX_TRACED_TRIPS = 1 << 20  # a while_loop still running after this many traced iterations is taken as endless


def _trace_time_int(value: Any, what: str) -> int:
    """A loop bound or condition known at trace time (a Python/NumPy integer), else a clear error."""
    if isinstance(value, NkiTensor):
        raise NotImplementedError(
            f"{what} is a tensor: for a trip count read from device data at run time load it into a register "
            f"(r = nisa.register_alloc(); nisa.register_load(r, tile)) and pass the register")
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    try:
        return int(value.__index__())
    except (AttributeError, TypeError):
        raise TypeError(f"{what} must be a trace-time integer, got {type(value).__name__}") from None


def _positive_step(step: Any) -> int:
    step = _trace_time_int(step, "step")
    if step <= 0:
        raise ValueError(f"step must be a compile-time positive integer, got {step}")
    return step


def _is_reg(v: Any) -> bool:
    return isinstance(v, nisa.VirtualRegister)


def _body_engines(trace: Any, first: int) -> tuple[str, ...]:
    """The compute engines of the instructions emitted since ``first`` (each branches at a loop's end)."""
    return tuple(sorted({i.engine.value for i in trace.instructions[first:] if i.engine.value != "dma"}))


def _dynamic_loop(start: Any, stop: Any, step: int):
    """A loop the program runs with bounds read at run time: yields the iteration register once (the body is
    traced once), then closes the loop. ``start``/``stop`` are registers or integers."""
    trace = current()
    counter, limit = trace.new_register(), trace.new_register()
    bounds = {("start" if k == 0 else "stop") + ("" if _is_reg(v) else "_imm"): (v.register_index if _is_reg(v)
              else _trace_time_int(v, "start" if k == 0 else "stop")) for k, v in enumerate((start, stop))}
    at = len(trace.instructions)
    trace.emit(sim_isa.LoopBegin(counter=counter, limit=limit, end=at, **bounds))
    trace.open_loops.append(at)
    i = nisa.register_alloc()
    nisa.register_move(i, nisa.VirtualRegister(counter))  # the body gets the index by value
    yield i
    engines = _body_engines(trace, at + 1)
    end = len(trace.instructions)
    trace.emit(sim_isa.LoopEnd(counter=counter, limit=limit, stride=step, begin=at, engines=engines))
    trace.replace(at, dataclasses.replace(trace.instructions[at], end=end, engines=engines))
    trace.open_loops.pop()


def dynamic_range(start: Any, stop: Any = None, step: int = 1) -> Any:
    """A loop with runtime bounds: with a ``VirtualRegister`` bound the program runs it as a real loop (the body
    traced once; the iteration value is a register); with integer bounds it is a ``range`` whose body is traced
    once per iteration (like ``sequential_range``)."""
    if stop is None:
        start, stop = 0, start
    step = _positive_step(step)
    if _is_reg(start) or _is_reg(stop):
        return _dynamic_loop(start, stop, step)
    return range(_trace_time_int(start, "start"), _trace_time_int(stop, "stop"), step)


def fori_loop(lower: Any, upper: Any, body_fun: Any, step: int = 1) -> None:
    """Call ``body_fun(i)`` for ``i`` in ``range(lower, upper, step)``: a real loop of the program when a bound
    is a ``VirtualRegister`` (``i`` a register), else traced once per iteration. Returns None."""
    if not callable(body_fun):
        raise TypeError(f"body_fun must be callable, got {type(body_fun).__name__}")
    for i in dynamic_range(lower, upper, step):
        body_fun(i)


def while_loop(init: Any, body_fun: Any) -> None:
    """``r = init; while r != 0: r = body_fun(r)``: a real loop of the program when ``init`` is a
    ``VirtualRegister`` (the body returns the next condition register), else with the condition known at trace
    time (the body returns an integer, traced once per iteration). Returns None."""
    if not callable(body_fun):
        raise TypeError(f"body_fun must be callable, got {type(body_fun).__name__}")
    if _is_reg(init):
        trace = current()
        cond = init.register_index
        at = len(trace.instructions)
        trace.emit(sim_isa.WhileBegin(cond=cond, end=at))
        trace.open_loops.append(at)
        r = nisa.register_alloc()
        nisa.register_move(r, init)  # the body gets the condition by value
        nxt = body_fun(r)
        if not _is_reg(nxt):
            raise TypeError(f"a while_loop body on a register returns the next condition register, got "
                            f"{type(nxt).__name__}")
        if nxt.register_index != cond:
            nisa.register_move(init, nxt)
        engines = _body_engines(trace, at + 1)
        end = len(trace.instructions)
        trace.emit(sim_isa.WhileEnd(cond=cond, begin=at, engines=engines))
        trace.replace(at, dataclasses.replace(trace.instructions[at], end=end, engines=engines))
        trace.open_loops.pop()
        return
    r = _trace_time_int(init, "while_loop init")
    trips = 0
    while r != 0:
        if trips >= MAX_TRACED_TRIPS:
            raise RuntimeError(f"nl.while_loop: the condition is still nonzero after {MAX_TRACED_TRIPS} traced "
                               f"iterations (an endless loop?)")
        r = _trace_time_int(body_fun(r), "the condition returned by the while_loop body")
        trips += 1


# ---- SPMD -----------------------------------------------------------------------------------

def program_id(axis: int = 0) -> int:
    """This instance's index along launch-grid ``axis``."""
    pid = current().program_id
    return pid[axis] if axis < len(pid) else 0


def num_programs(axes: int | Sequence[int] | None = None) -> int:
    """Instances along ``axes`` (default: all) of the launch grid."""
    grid = current().grid or (1,)
    axes = range(len(grid)) if axes is None else [axes] if isinstance(axes, int) else axes
    return math.prod(grid[a] if a < len(grid) else 1 for a in axes)


def program_ndim() -> int:
    """Dims of the launch grid."""
    return len(current().grid)


# ---- data movement --------------------------------------------------------------------------

def load(src: Tile, dtype: Any = None) -> Tile:
    """HBM -> a new SBUF tile of the same shape (1-D becomes one partition) by DMA."""
    shape = src.shape if len(src.shape) > 1 else (1, *src.shape)
    t = ndarray(shape, dtype or src.dtype, sbuf)
    nisa.dma_copy(dst=t, src=src)
    return t


def store(dst: Tile, value: Tile) -> None:
    """SBUF tile -> HBM by DMA (a PSUM tile is first copied to SBUF: DMA cannot read PSUM)."""
    nisa.dma_copy(dst=dst, src=_in_sbuf(value))


def copy(x: Tile, dtype: Any = None) -> Tile:
    """A new SBUF copy of an SBUF/PSUM tile (PSUM eviction), optionally cast."""
    t = ndarray(x.shape, dtype or x.dtype, sbuf)
    nisa.tensor_copy(dst=t, src=x)
    return t


def broadcast_to(x: Tile, shape: Sequence[int], dtype: Any = None) -> Tile:
    """Broadcast size-1 dims: an HBM stride-0 view, or on chip a new SBUF tile (free and partition dims);
    ``dtype`` casts the on-chip result."""
    out = _broadcast(x, tuple(shape))
    if dtype is None or as_dtype(dtype) == out.dtype:
        return out
    if not out.buffer.on_chip:
        raise SimulatorError("nl.broadcast_to(dtype=...): an HBM view cannot change dtype; broadcast on chip")
    return copy(out, dtype)


def _broadcast(x: Tile, shape: Sequence[int]) -> Tile:
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    a = x.access
    if not a.on_chip:  # HBM: a stride-0 access pattern, no data movement
        full_shape = (1,) * (len(shape) - len(a.shape)) + tuple(a.shape)
        strides = [0] * (len(shape) - len(a.pattern)) + [st for st, _ in a.pattern]
        pattern = [[0 if n == 1 else st, want] for st, n, want in zip(strides, full_shape, shape)]
        return x.ap(pattern)
    p, f = shape[0], math.prod(shape[1:])
    out = ndarray(shape, x.dtype, sbuf)
    if x.shape[0] == 1 and p > 1:  # partition broadcast: ones[1, P].T @ x[1, F] on TensorE
        ones = _ones_row(p, x.dtype if x.dtype in (bfloat16, float16, float32) else float32)
        row = x.reshape((1, x.access.free_elems)) if x.dtype == ones.dtype else copy(x, ones.dtype).reshape((1, -1))
        flat = out.reshape((p, f))
        trace = current()
        for n0 in range(0, f, GEMM_MOVING_FMAX):
            n = builtins.min(GEMM_MOVING_FMAX, f - n0)
            acc = ndarray((p, n), float32, psum)
            nisa.nc_matmul(dst=acc, stationary=ones, moving=row[:, n0:n0 + n], accumulate=False)
            nisa.tensor_copy(dst=flat[:, n0:n0 + n], src=acc)
            if out.dtype == float32 and f <= GEMM_MOVING_FMAX:
                # an exact copy of one PSUM bank: its readers may read acc instead (``forwarding``), so acc
                # stays allocated while the broadcast is held, as where the compiler keeps it in PSUM
                trace.forwardable.append(trace.instructions[-1])
                out._psum_result = acc
        return out
    assert x.access.free_elems == 1, f"broadcast_to: cannot broadcast {x.shape} to {shape}"
    nisa.memset(dst=out, value=0)
    nisa.tensor_scalar(dst=out, data=out, op0=add, operand0=x)
    return out


def _ones_row(p: int, dtype: torch.dtype) -> Tile:
    """The [1, p] row of ones a partition broadcast multiplies by: a constant of the program (the
    architecture guide's "compile-time constant matrix"), set once per trace, dtype and loop nest (a row
    set inside a dynamic loop is not known to be set after it)."""
    trace = current()
    key = (p, dtype, tuple(trace.open_loops))
    row = trace.ones_rows.get(key)
    if row is None:
        row = trace.ones_rows[key] = full((1, p), 1.0, dtype)
    return row


# ---- element-wise ops -----------------------------------------------------------------------

def _result_dtype(x: Value, y: Value, dtype: Any) -> torch.dtype:
    if dtype is not None:
        return as_dtype(dtype)
    dts = [v.dtype for v in (x, y) if isinstance(v, NkiTensor)]
    return dts[0] if len(dts) == 1 else torch.promote_types(*dts)


def _is_column(t: NkiTensor, of: NkiTensor) -> bool:
    return t.access.free_elems == 1 and t.shape[0] == of.shape[0] and of.access.free_elems > 1


def _in_sbuf(t: Value) -> Value:
    """``t`` itself, or an SBUF copy of it when it is a PSUM tile an instruction cannot take from PSUM (the
    copy the compiler inserts: DMA and TensorE cannot read PSUM, two-input ALU ops take one PSUM input)."""
    return copy(t) if isinstance(t, NkiTensor) and t.buffer is psum else t


def _placed(op: str, *operands: Value) -> Any:
    """The engine of element-wise ``op`` on ``operands``: the trace's ``elementwise_engine`` where the op and
    operands allow it (bitvec operators run on VectorE only, GpSimdE reads no PSUM), else None (the default,
    VectorE): the compiler's choice for ops a kernel places on no engine."""
    engine = current().elementwise_engine
    if (engine is None or alu_op(op) in BITVEC_OPS
            or any(isinstance(v, NkiTensor) and v.buffer is psum for v in operands)):
        return None
    return engine


def _binary(op: str, x: Value, y: Value, dtype: Any) -> Tile:
    tiles = [v for v in (x, y) if isinstance(v, NkiTensor)]
    assert tiles, f"nl.{op} needs at least one tile"
    if len(tiles) == 2 and x.buffer is psum and y.buffer is psum:
        y = _in_sbuf(y)  # the engines read at most one operand from PSUM
    if len(tiles) == 2 and tuple(x.shape) == tuple(y.shape):
        out = ndarray(x.shape, _result_dtype(x, y, dtype))
        nisa.tensor_tensor(dst=out, data1=x, data2=y, op=op, engine=_placed(op, x, y))
        return out
    reverse = not isinstance(x, NkiTensor) or (isinstance(y, NkiTensor) and _is_column(x, y))
    data, operand = (y, x) if reverse else (x, y)
    if isinstance(operand, NkiTensor) and not _is_column(operand, data):
        raise SimulatorError(f"nl.{op}: shapes {x.shape} and {y.shape} do not broadcast on one instruction "
                             f"(use (P, F) with (P, F), (P, 1) or a scalar; nl.broadcast_to for rows)")
    out = ndarray(data.shape, _result_dtype(x, y, dtype))
    nisa.tensor_scalar(dst=out, data=data, op0=op, operand0=operand, reverse0=reverse, engine=_placed(op, data, operand))
    return out


def add(x: Value, y: Value, dtype: Any = None) -> Tile:
    """``x + y`` element-wise (VectorE)."""
    return _binary("add", x, y, dtype)


def subtract(x: Value, y: Value, dtype: Any = None) -> Tile:
    """``x - y`` element-wise (VectorE)."""
    return _binary("subtract", x, y, dtype)


def multiply(x: Value, y: Value, dtype: Any = None) -> Tile:
    """``x * y`` element-wise (VectorE)."""
    return _binary("multiply", x, y, dtype)


def divide(x: Value, y: Value, dtype: Any = None) -> Tile:
    """``x / y`` element-wise (VectorE)."""
    return _binary("divide", x, y, dtype)


def maximum(x: Value, y: Value, dtype: Any = None) -> Tile:
    """Element-wise maximum (VectorE)."""
    return _binary("maximum", x, y, dtype)


def minimum(x: Value, y: Value, dtype: Any = None) -> Tile:
    """Element-wise minimum (VectorE)."""
    return _binary("minimum", x, y, dtype)


def power(x: Value, y: Value, dtype: Any = None) -> Tile:
    """``x ** y`` element-wise (VectorE)."""
    return _binary("power", x, y, dtype)


def _unary(fn: str, x: Tile, dtype: Any) -> Tile:
    out = ndarray(x.shape, dtype or x.dtype)
    nisa.activation(dst=out, op=fn, data=x)
    return out


def _activation(fn: str):
    def op(x: Tile, dtype: Any = None) -> Tile:
        return _unary(fn, x, dtype)
    op.__name__ = op.__qualname__ = fn
    op.__doc__ = f"``{fn}(x)`` element-wise (ScalarE activation); also an ``op=`` token."
    return op


exp, log, tanh, sigmoid, relu, gelu, silu, sqrt, rsqrt, square, sin, cos, erf, softplus = (
    _activation(n) for n in ("exp", "log", "tanh", "sigmoid", "relu", "gelu", "silu", "sqrt", "rsqrt", "square",
                             "sin", "cos", "erf", "softplus"))
gelu_apprx_tanh, gelu_apprx_sigmoid, negative, sign, identity = (
    _activation(n) for n in ("gelu_apprx_tanh", "gelu_apprx_sigmoid", "negative", "sign", "identity"))


def abs(x: Tile, dtype: Any = None) -> Tile:  # noqa: A001 (NKI's name)
    """``|x|`` element-wise (ScalarE)."""
    return _unary("abs", x, dtype)


def reciprocal(x: Tile, dtype: Any = None) -> Tile:
    """``1 / x`` element-wise (VectorE)."""
    out = ndarray(x.shape, dtype or x.dtype)
    nisa.reciprocal(dst=out, data=x)
    return out


# comparison / bitwise operator tokens for ISA calls (nl.equal, nl.bitwise_and...)
def _token(name: str):
    def op(x: Value, y: Value, dtype: Any = None) -> Tile:
        return _binary(name, x, y, dtype)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``{name}`` element-wise (VectorE); also an ``op=`` token."
    return op


equal, not_equal, greater, greater_equal, less, less_equal = (
    _token(n) for n in ("equal", "not_equal", "greater", "greater_equal", "less", "less_equal"))
bitwise_and, bitwise_or, bitwise_xor, left_shift, right_shift = (
    _token(n) for n in ("bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift"))
logical_and, logical_or, logical_xor = (_token(n) for n in ("logical_and", "logical_or", "logical_xor"))


# ---- reductions over free axes (VectorE tensor_reduce) ------------------------------------

def _reduce(op: str, x: Tile, axis: int | Sequence[int], dtype: Any, keepdims: bool) -> Tile:
    rank = len(x.shape)
    axes = sorted(a % rank for a in ((axis,) if isinstance(axis, int) else axis))
    shape = [1 if i in axes else n for i, n in enumerate(x.shape) if keepdims or i not in axes]
    out = ndarray(shape if len(shape) > 1 else (*shape, 1), dtype or x.dtype)
    nisa.tensor_reduce(dst=out, op=op, data=x, axis=tuple(axes), keepdims=keepdims)
    return out


def sum(x: Tile, axis: int | Sequence[int], dtype: Any = None, keepdims: bool = False) -> Tile:  # noqa: A001
    """Sum over trailing free axes; also the ``add`` reduce token."""
    return _reduce("add", x, axis, dtype, keepdims)


def max(x: Tile, axis: int | Sequence[int], dtype: Any = None, keepdims: bool = False) -> Tile:  # noqa: A001
    """Maximum over trailing free axes."""
    return _reduce("maximum", x, axis, dtype, keepdims)


def min(x: Tile, axis: int | Sequence[int], dtype: Any = None, keepdims: bool = False) -> Tile:  # noqa: A001
    """Minimum over trailing free axes."""
    return _reduce("minimum", x, axis, dtype, keepdims)


def mean(x: Tile, axis: int | Sequence[int], dtype: Any = None, keepdims: bool = False) -> Tile:
    """Mean over trailing free axes (sum, then a multiply by 1/n)."""
    s = _reduce("add", x, axis, dtype or float32, keepdims)
    rank = len(x.shape)
    n = math.prod(x.shape[a % rank] for a in ((axis,) if isinstance(axis, int) else axis))
    nisa.tensor_scalar(dst=s, data=s, op0="multiply", operand0=1.0 / n)
    return s


# ---- TensorE --------------------------------------------------------------------------------

def transpose(x: Tile, dtype: Any = None) -> Tile:
    """Swap partition and free dims of a 2-D SBUF tile on TensorE; the result is a PSUM tile."""
    x = _in_sbuf(x)
    out = ndarray((x.access.free_elems, x.shape[0]), x.dtype, psum)
    nisa.nc_transpose(dst=out, data=x)
    return out if dtype is None or as_dtype(dtype) == x.dtype else copy(out, dtype)


def matmul(x: Tile, y: Tile, transpose_x: bool = False) -> Tile:
    """``x @ y`` (``x.T @ y`` with ``transpose_x``) on TensorE; the result is an fp32 PSUM tile."""
    x, y = _in_sbuf(x), _in_sbuf(y)
    if not transpose_x:  # TensorE contracts over partitions: bring x to [K, M] first
        x = copy(transpose(x))
    out = ndarray((x.access.free_elems, y.access.free_elems), float32, psum)
    nisa.nc_matmul(dst=out, stationary=x, moving=y)
    return out


# ---- the rest of the published language: predicates, math, composites, creation ------------------

class MemoryRegion(enum.Enum):
    """``nl.MemoryRegion``: the memory kinds a tensor can live in."""
    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"


DType = torch.dtype  # the type of nl dtypes here (torch dtypes; MX x4 dtypes are MxDtype)
# operator tokens: the ALU's pass-through, the parametric ReLU activation (activate2's relu_param) and the
# averaging reduction (tensor_partition_reduce)
bypass, prelu, average = "bypass", "prelu", "average"


def _region(buffer: Any) -> str:
    if isinstance(buffer, NkiTensor):
        buffer = buffer.buffer
    name = getattr(buffer, "name", None) if isinstance(buffer, (Buffer, MemoryRegion)) else buffer
    if name not in ("sbuf", "psum", "private_hbm", "shared_hbm"):
        raise TypeError(f"expected a memory region (nl.sbuf, nl.psum, nl.hbm, nl.private_hbm, nl.shared_hbm), "
                        f"got {buffer!r}")
    return name


def is_hbm(buffer: Any) -> bool:
    """Whether ``buffer`` is an HBM region (private or shared)."""
    return _region(buffer).endswith("hbm")


def is_on_chip(buffer: Any) -> bool:
    """Whether ``buffer`` is SBUF or PSUM."""
    return _region(buffer) in ("sbuf", "psum")


def is_psum(buffer: Any) -> bool:
    """Whether ``buffer`` is PSUM."""
    return _region(buffer) == "psum"


def is_sbuf(buffer: Any) -> bool:
    """Whether ``buffer`` is SBUF."""
    return _region(buffer) == "sbuf"


gelu_dx, gelu_apprx_sigmoid_dx, silu_dx, mish, erf_dx = (
    _activation(n) for n in ("gelu_dx", "gelu_apprx_sigmoid_dx", "silu_dx", "mish", "erf_dx"))
tan, arctan, ceil, floor, trunc = (_activation(n) for n in ("tan", "arctan", "ceil", "floor", "trunc"))


def fmod(x: Value, y: Value, dtype: Any = None) -> Tile:
    """Remainder of ``x / y`` with the sign of ``x`` (C fmod), element-wise (VectorE)."""
    return _binary("mod", x, y, dtype)


def mod(x: Value, y: Value, dtype: Any = None) -> Tile:
    """Remainder of ``x / y`` with the sign of ``y`` (Python's %): fmod, then ``+ y`` where the signs differ."""
    r = fmod(x, y, float32)
    flipped = multiply(sign(r, float32), y, float32)   # r * y < 0 exactly where the signs differ (r != 0)
    wrong = less(flipped, 0.0, float32)
    fix = multiply(wrong, y, float32)
    return add(r, fix, dtype or _result_dtype(x, y, None))


def _by_magnitude(what: str, x: Value, y: Value, larger: bool, dtype: Any) -> Tile:
    nisa._needs(f"nl.{what}", 4)
    if not isinstance(x, NkiTensor):
        raise SimulatorError(f"nl.{what}: x must be a tile (y may be a tile, a (P, 1) tile or a scalar)")
    out = ndarray(x.shape, dtype or _result_dtype(x, y, None))
    ax, ay = abs(x, float32), (abs(y, float32) if isinstance(y, NkiTensor) else builtins.abs(float(y)))
    pick_x = ndarray(x.shape, uint8)
    cmp = "greater" if larger else "less"
    if isinstance(ay, NkiTensor) and tuple(ay.shape) == tuple(ax.shape):
        nisa.tensor_tensor(dst=pick_x, data1=ax, data2=ay, op=cmp)
    else:
        nisa.tensor_scalar(dst=pick_x, data=ax, op0=cmp, operand0=ay)
    if isinstance(y, NkiTensor) and tuple(y.shape) == tuple(x.shape):
        nisa.tensor_copy(dst=out, src=y)
    else:  # a (P, 1) tile or a scalar: spread over the free dims
        nisa.memset(dst=out, value=0)
        nisa.tensor_scalar(dst=out, data=out, op0="add", operand0=y)
    nisa.tensor_copy_predicated(dst=out, src=x if x.dtype == out.dtype else copy(x, out.dtype), predicate=pick_x)
    return out


def abs_max(x: Value, y: Value, dtype: Any = None) -> Tile:
    """The input of larger magnitude, sign kept (``y`` on ties), element-wise (NC-v4)."""
    return _by_magnitude("abs_max", x, y, True, dtype)


def abs_min(x: Value, y: Value, dtype: Any = None) -> Tile:
    """The input of smaller magnitude, sign kept (``y`` on ties), element-wise (NC-v4)."""
    return _by_magnitude("abs_min", x, y, False, dtype)


def invert(x: Tile, dtype: Any = None) -> Tile:
    """Bitwise NOT of an integer tile (XOR with all ones, VectorE)."""
    if x.dtype.is_floating_point:
        raise SimulatorError(f"nl.invert: needs an integer tile, got {x.dtype}")
    ones = torch.iinfo(x.dtype).max if x.dtype in (uint8, uint16, uint32) else -1
    out = ndarray(x.shape, dtype or x.dtype)
    nisa.tensor_scalar(dst=out, data=x, op0="bitwise_xor", operand0=ones)
    return out


def logical_not(x: Tile, dtype: Any = None) -> Tile:
    """Logical NOT of a 0/1 tile (XOR with 1, VectorE)."""
    out = ndarray(x.shape, dtype or x.dtype)
    op = "logical_xor" if x.dtype.is_floating_point or out.dtype.is_floating_point else "bitwise_xor"
    nisa.tensor_scalar(dst=out, data=x, op0=op, operand0=1)
    return out


def prod(x: Tile, axis: int | Sequence[int], dtype: Any = None, keepdims: bool = False) -> Tile:
    """Product over trailing free axes (VectorE)."""
    return _reduce("multiply", x, axis, dtype, keepdims)


def all(x: Tile, axis: int | Sequence[int], dtype: Any = None) -> Tile:  # noqa: A001 (NKI's name)
    """1 where every element over the trailing free axes is nonzero, else 0 (VectorE)."""
    return _reduce("logical_and", x, axis, dtype, False)


def _spread(t: Tile, shape: Sequence[int]) -> Tile:
    """A keepdims reduction result seen with ``shape`` (stride 0 along the reduced axes): no data moves."""
    a = t.access
    dims = list(a.pattern)
    pattern = [(0, n) if sz == 1 and n != 1 else (st, sz) for (st, sz), n in zip(dims, shape[1:])]
    return t._view(type(a)(a.memory, a.dtype, tuple(pattern), a.start_partition, a.partitions, a.offset))


def _axes(x: Tile, axis: int | Sequence[int]) -> tuple[int, ...]:
    rank = len(x.shape)
    return tuple(sorted(a % rank for a in ((axis,) if isinstance(axis, int) else axis)))


def var(x: Tile, axis: int | Sequence[int], dtype: Any = None, keepdims: bool = True) -> Tile:
    """Population variance over trailing free axes in fp32: the mean of squared deviations (keepdims shape)."""
    m = mean(x, axis, float32, keepdims=True)
    d = ndarray(x.shape, float32)
    nisa.tensor_tensor(dst=d, data1=x, data2=_spread(m, x.shape), op="subtract")
    nisa.tensor_tensor(dst=d, data1=d, data2=d, op="multiply")
    return mean(d, axis, dtype or x.dtype, keepdims=True)


def softmax(x: Tile, axis: int | Sequence[int] = -1, dtype: Any = None) -> Tile:
    """``exp(x - max) / sum(exp(x - max))`` over trailing free axes, in fp32."""
    axes = _axes(x, axis)
    m = max(x, axes, float32, keepdims=True)
    e = ndarray(x.shape, float32)
    nisa.tensor_tensor(dst=e, data1=x, data2=_spread(m, x.shape), op="subtract")
    nisa.activation(dst=e, op="exp", data=e)
    s = sum(e, axes, float32, keepdims=True)
    nisa.reciprocal(dst=s, data=s)
    out = ndarray(x.shape, dtype or x.dtype)
    nisa.tensor_tensor(dst=out, data1=e, data2=_spread(s, x.shape), op="multiply")
    return out


def rms_norm(x: Tile, w: Tile, axis: int | Sequence[int], n: int, epsilon: float = 1e-6, dtype: Any = None,
             compute_dtype: Any = None) -> Tile:
    """``x / sqrt(sum(x^2 over axis) / n + epsilon) * w`` (``w`` shaped like ``x`` or a (P, 1) column)."""
    c = as_dtype(compute_dtype) if compute_dtype is not None else float32
    axes = _axes(x, axis)
    sq = ndarray(x.shape, c)
    nisa.tensor_tensor(dst=sq, data1=x, data2=x, op="multiply")
    ss = sum(sq, axes, c, keepdims=True)
    nisa.tensor_scalar(dst=ss, data=ss, op0="multiply", operand0=1.0 / n, op1="add", operand1=float(epsilon))
    nisa.activation(dst=ss, op="rsqrt", data=ss)
    y = ndarray(x.shape, c)
    nisa.tensor_tensor(dst=y, data1=x, data2=_spread(ss, x.shape), op="multiply")
    return multiply(y, w, dtype or x.dtype)


def where(condition: Tile, x: Value, y: Value, dtype: Any = None) -> Tile:
    """``x`` where ``condition`` is nonzero, else ``y`` (a predicated copy on VectorE)."""
    like = next((v for v in (x, y) if isinstance(v, NkiTensor)), condition)
    out = ndarray(condition.shape, dtype or like.dtype)
    if isinstance(y, NkiTensor) and tuple(y.shape) == tuple(condition.shape):
        nisa.tensor_copy(dst=out, src=y)
    else:
        nisa.memset(dst=out, value=y if not isinstance(y, NkiTensor) else 0)
        if isinstance(y, NkiTensor):
            nisa.tensor_scalar(dst=out, data=out, op0="add", operand0=y)
    pred = ndarray(condition.shape, uint8)
    nisa.tensor_scalar(dst=pred, data=condition, op0="not_equal", operand0=0)
    if isinstance(x, NkiTensor) and x.dtype != out.dtype:
        x = copy(x, out.dtype)
    nisa.tensor_copy_predicated(dst=out, src=x, predicate=pred)
    return out


def dropout(x: Tile, rate: Value, dtype: Any = None) -> Tile:
    """Zero each element with probability ``rate`` (a scalar or (P, 1) tile); no rescaling (VectorE)."""
    out = ndarray(x.shape, x.dtype)
    nisa.dropout(dst=out, data=x, prob=rate)
    return out if dtype is None or as_dtype(dtype) == x.dtype else copy(out, dtype)


def ones(shape: Sequence[int], dtype: Any, buffer: Buffer = sbuf, name: str = "") -> Tile:
    """A tensor filled with ones."""
    return full(shape, 1, dtype, buffer, name)


def empty_like(x: Tile, dtype: Any = None, buffer: Buffer | None = None, name: str = "") -> Tile:
    """An uninitialised tensor shaped like ``x`` (its dtype and buffer unless given)."""
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def zeros_like(x: Tile, dtype: Any = None, buffer: Buffer | None = None, name: str = "") -> Tile:
    """A zero-filled tensor shaped like ``x`` (its dtype; SBUF unless given)."""
    return zeros(x.shape, dtype or x.dtype, buffer or sbuf, name)


def rand(shape: Sequence[int], dtype: Any, buffer: Buffer = sbuf, name: str = "") -> Tile:
    """A tensor of uniform random values in [0, 1) from the core's generator: 24 of VectorE ``rng``'s random bits
    scaled by 2**-24, as the ISA reference suggests (``rand2`` exists only from NeuronCore-v4)."""
    t = ndarray(shape, dtype, buffer, name)
    bits = ndarray(shape, uint32, buffer)
    nisa.rng(dst=bits)
    nisa.tensor_scalar(dst=bits, data=bits, op0=right_shift, operand0=8)
    nisa.tensor_scalar(dst=t, data=bits, op0="multiply", operand0=2.0 ** -24)
    return t


def random_seed(seed: Tile) -> None:
    """Seed the core's random generator from a [1, 1] 32-bit tile (``rand`` then repeats its sequence)."""
    nisa.set_rng_seed(src_seeds=seed)


def expand_dims(x: Tile, axis: int) -> Tile:
    """A view of ``x`` with a new size-1 axis at ``axis`` (never before the partition dim of an on-chip tile)."""
    rank = len(x.shape) + 1
    axis = axis % rank if axis < 0 else axis
    if not 0 <= axis < rank or (x.buffer.on_chip and axis == 0):
        raise SimulatorError(f"nl.expand_dims: axis {axis} is not a free position of a {rank}-dim result"
                             + (" (dim 0 of an on-chip tile is the partition dim)" if axis == 0 else ""))
    shape = list(x.shape)
    shape.insert(axis, 1)
    return x.reshape(tuple(shape))


class no_reorder:
    """``with nl.no_reorder():`` — instructions in the block keep program order. The simulator executes every
    instruction in program order; its timing lets each compute engine issue the ready instruction earliest in
    program order (the compiler's reordering, ``docs/hardware-model.md``), and the block is not yet exempt
    from that: it marks nothing and adds no ordering."""

    def __enter__(self) -> "no_reorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def load_transpose2d(src: Tile, dtype: Any = None) -> Tile:
    """HBM ``[A, B]`` -> a new SBUF ``[B, A]`` tile by DMA transpose (a cast, if any, on chip after it)."""
    if src.buffer.on_chip or len(src.shape) != 2:
        raise SimulatorError(f"nl.load_transpose2d: src must be a 2-D HBM tensor, got {src!r}")
    t = ndarray((src.shape[1], src.shape[0]), src.dtype, sbuf)
    nisa.dma_transpose(dst=t, src=src)
    return t if dtype is None or as_dtype(dtype) == t.dtype else copy(t, dtype)


def gather_flattened(data: Tile, indices: Tile, axis: int = 0, dtype: Any = None) -> Tile:
    """``out[p, j] = data[p].flatten()[indices[p, j]]`` on GpSimd (``nc_n_gather``; int indices become uint32)."""
    if axis != 0:
        raise SimulatorError(f"nl.gather_flattened: axis={axis}; the gather indexes each partition's flattened "
                             f"free dims (axis=0)")
    if indices.dtype != uint32:
        indices = copy(indices, uint32)
    out = ndarray(indices.shape, data.dtype)
    nisa.nc_n_gather(dst=out, data=data, indices=indices)
    return out if dtype is None or as_dtype(dtype) == out.dtype else copy(out, dtype)


def shared_identity_matrix(n: int, dtype: Any = uint8, dst: Tile | None = None) -> Tile:
    """An ``n`` x ``n`` identity matrix in SBUF (into ``dst`` if given): GpSimd iota of ``j - p``, then ``== 0``."""
    if not 1 <= n <= PMAX:
        raise SimulatorError(f"nl.shared_identity_matrix: n={n}; an SBUF tile has at most {PMAX} partitions")
    diff = ndarray((n, n), int32)
    nisa.iota(dst=diff, pattern=[[1, n]], offset=0, channel_multiplier=-1)
    out = dst if dst is not None else ndarray((n, n), dtype)
    nisa.tensor_scalar(dst=out, data=diff, op0="equal", operand0=0)
    return out


def device_print(print_prefix: str, tensor: Tile) -> None:
    """Print ``print_prefix`` and the tensor's values when the kernel runs (an instruction of the program)."""
    current().emit(DevicePrint(prefix=print_prefix, tensor=tensor.access, queue=current().next_dma_queue()))


# removed from the current generation (NKI 0.2.0): say what replaces them instead of a bare AttributeError
_REMOVED = {
    "arange": "index with slices (t[0:128, 0:512], steps allowed), nl.ds(start, size) or a raw .ap(pattern)",
    "mgrid": "index with slices (t[0:128, 0:8, 0:64]), nl.ds(start, size) or a raw .ap(pattern)",
    "par_dim": "use a Python list of tiles or fold the block dims into a free dim",
    "spmd_dim": "launch kernel[lnc] (lnc 1 or 2)",
    "nc": "launch kernel[lnc] (lnc 1 or 2)",
}


def __getattr__(name: str) -> Any:
    if name in _REMOVED:
        raise AttributeError(f"nl.{name} is not in the current NKI generation (removed in NKI 0.2.0): "
                             f"{_REMOVED[name]}; earlier-generation kernels run with torchneuron.nki.legacy "
                             f"(neuronxcc.nki after install_import_aliases())")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# NkiTensor's operators and broadcast (tracing, the layer below, calls them through this table)
TENSOR_OPS.update(add=add, subtract=subtract, multiply=multiply, divide=divide, broadcast_to=broadcast_to)


__all__ = [n for n in dir() if not n.startswith("_") and n not in (
    "annotations", "builtins", "dataclasses", "enum", "math", "sim_isa", "np", "os", "torch", "Any", "Sequence", "SimulatorError", "PMAX", "chip_spec",
    "TENSOR_OPS")]
