"""The NeuronCore instruction set: one frozen dataclass per ``nki.isa`` instruction.

Names, argument names and engines follow ``nki.isa`` (``reference/nki-api.md`` section 7.3).
Each instruction states its limits in ``check`` (run at construction, so a kernel fails
where it builds the bad instruction), runs functionally in ``execute(core)`` on torch CPU
tensors, and describes itself to the timing model through the ``Instruction`` protocol of
``instruction.py``: ``engine``, ``queue``, ``reads()``, ``writes()`` and ``cost_inputs()``.

Operands are ``AP`` access patterns; "(P,1) operand" means a tile with the data's partition
count and one element per partition, broadcast along the free dims. Scalars are Python
numbers. ALU operators and activation functions are named as in ``nki.language``
(``"add"``, ``"maximum"``, ``"exp"``, ``"gelu_apprx_tanh"``...); numpy/legacy aliases such as
``np.max`` or ``"max"`` are accepted and stored canonically.
"""
from __future__ import annotations

import functools
import math
import operator
import weakref
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, Sequence

import torch

from torchneuron.sim.instruction import CostInputs, Engine, Footprint
from torchneuron.sim.memory import PMAX, AP, IndexOutOfRange, SimulatorError, contiguous_run, store
from torchneuron.sim.numerics import (ACTIVATIONS_OUT, BITVEC_OPS, FRACTIONAL_OPS, INT_DTYPES, REDUCE_IDENTITY,
                                      REDUCE_OPS,
                                      UNARY_ALU_OPS, activation_fn, alu_op, apply_activation, apply_alu,
                                      apply_reduce, as_scalar, compute_dtype, dtype_name, reduce_op, torch_name)

if TYPE_CHECKING:
    from torchneuron.sim.core import NeuronCore
    from torchneuron.sim.program import ArgSlot

# Limits (sources: reference/nki-api.md section 8, neuroncore-timing.md sections 3 and 7).
FMAX_SBUF = 64 * 1024         # elements per partition of one Vector/Scalar/GpSimd operand read from SBUF (A-v2)
FMAX_PSUM = 4 * 1024          # ... from PSUM (A-v2)
GEMM_STATIONARY_FMAX = 128    # nl.tile_size.gemm_stationary_fmax (M)
GEMM_MOVING_FMAX = 512        # nl.tile_size.gemm_moving_fmax (N), one 2 KiB PSUM bank of fp32 (NC-v2/v3)
PSUM_BANK_BYTES = 2048        # nl.tile_size.psum_bank_fmax_bytes
BN_STATS_FMAX = 512           # nl.tile_size.bn_stats_fmax
TENSOR_TRANSPOSE_MAX = 128    # TensorE nc_transpose input <= [128, 128]
VECTOR_TRANSPOSE_MAX = 32     # VectorE nc_transpose input <= [32, 32]
MAX8_FMIN, MAX8_FMAX = 8, 16384
MATMUL_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32})
COMPARE_OPS = frozenset({"equal", "not_equal", "greater", "greater_equal", "less", "less_equal"})
REDUCE_CMDS = ("idle", "reset", "reduce", "reset_reduce", "load_reduce")
OOB_MODES = ("error", "skip")
DGE_MODES = ("unknown", "swdge", "hwdge", "none")  # nisa.dge_mode: who generates the DMA descriptors

Scalar = float | int
Operand = AP | float | int  # a compile-time scalar or a (P,1) tile


def _engine(value: Engine | str, allowed: tuple[Engine, ...], opcode: str) -> Engine:
    if not isinstance(value, Engine):
        name = str(getattr(value, "name", value)).removesuffix("_engine")
        if name == "unknown":
            return allowed[0]
        try:
            value = Engine(name)
        except ValueError:
            raise SimulatorError(f"{opcode}: unknown engine {name!r}") from None
    if value not in allowed:
        raise SimulatorError(f"{opcode}: runs on {'/'.join(e.value for e in allowed)}, not on {value.value}")
    return value


def _cmd(value) -> str:
    name = str(getattr(value, "name", value))
    if name not in REDUCE_CMDS:
        raise SimulatorError(f"unknown reduce_cmd {value!r}; expected one of {REDUCE_CMDS}")
    return name


def _dims(ap: AP) -> list[tuple[int | None, int]]:
    return ([(None, ap.partitions)] if ap.on_chip else []) + list(ap.pattern)


def _chunks(n: int, run_a: int, run_b: int) -> int:
    """Descriptors to move n elements when source and destination break every run_a / run_b elements."""
    return n // run_a + n // run_b - n // math.lcm(run_a, run_b)


@dataclass(frozen=True)
class Instr:
    """Shared plumbing of every instruction: operand discovery, footprints, checks and costs."""

    opcode = "instr"
    engine = Engine.VECTOR      # a dataclass field instead where NKI lets the kernel pick the engine
    queue = 0                   # DMA queue index; compute engines have one queue each
    ENGINES: ClassVar[tuple[Engine, ...]] = ()   # the engines a kernel may pick (first: the default)
    WRITES: ClassVar[tuple[str, ...]] = ("dst",)  # operands written; the other tile operands are read

    def __post_init__(self):
        try:
            if self.ENGINES:
                self._set("engine", _engine(self.engine, self.ENGINES, self.opcode))
            self.check()
        except SimulatorError:
            raise
        except (ValueError, TypeError) as e:  # an unknown operator or dtype name: say which instruction
            raise SimulatorError(f"{self.opcode}: {e}") from None

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict:
        # only the fields: footprints, costs and per-run constants are rebuilt on demand
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def check(self) -> None:
        """Raise SimulatorError if the instruction breaks a hardware rule (called at construction)."""

    def execute(self, core: "NeuronCore") -> None:
        """Run the instruction functionally on ``core``'s memories."""
        raise NotImplementedError

    def step(self, core: "NeuronCore", slots: Mapping[str, tuple[int, "ArgSlot"]]) -> "Step | None":
        """A function doing what ``execute(core)`` does, with every per-core lookup done now, or None
        where there is none (the core then calls ``execute``).

        The step takes the run's bound HBM tensors in slot order (CPU, contiguous, of the slot's shape
        and dtype); ``slots`` maps ``"hbm:<name>"`` to (position, ArgSlot). A step keeps views of the
        core's SBUF/PSUM, so it belongs to that core (``NeuronCore`` caches steps per program)."""
        return None

    # ---- the Instruction protocol -------------------------------------------------

    @cached_property
    def _operands(self) -> tuple[tuple[str, AP], ...]:
        return tuple((f.name, v) for f in fields(self) if isinstance(v := getattr(self, f.name), AP))

    def operands(self) -> tuple[tuple[str, AP], ...]:
        """(argument name, access pattern) of every tile operand."""
        return self._operands

    def _read_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self._operands if n not in self.WRITES)

    def _footprint(self, name: str) -> Footprint:
        return getattr(self, name).footprint()

    @cached_property
    def _footprints(self) -> tuple[tuple[Footprint, ...], tuple[Footprint, ...]]:
        names = {n for n, _ in self._operands}
        reads = tuple(self._footprint(n) for n in self._read_names())
        writes = tuple(self._footprint(n) for n in self.WRITES if n in names)
        return reads, writes

    def reads(self) -> tuple[Footprint, ...]:
        """Memory the instruction reads."""
        return self._footprints[0]

    def writes(self) -> tuple[Footprint, ...]:
        """Memory the instruction writes."""
        return self._footprints[1]

    @cached_property
    def psum_writes(self) -> tuple[Footprint, ...]:
        """The PSUM boxes this instruction writes (the core closes matmul accumulation groups there)."""
        return tuple(f for f in self.writes() if f.memory == "psum")

    def cost_inputs(self) -> CostInputs:
        """Shape facts the timing model prices (computed once: instructions are immutable)."""
        return self._cost_inputs

    @cached_property
    def _cost_inputs(self) -> CostInputs:
        return self.price()

    def price(self) -> CostInputs:
        """Build this instruction's CostInputs."""
        raise NotImplementedError

    def _cost(self, data: Sequence[AP], out: AP | None, *, op: str | None = None, flops: int | None = None,
              main: AP | None = None, **kw) -> CostInputs:
        # data: the streamed tensor inputs; (P,1) scalar operands are not streamed. main: the
        # input whose partitions and elements per partition size the instruction (default data[0])
        main = main or (data[0] if data else out)
        tensors = [*data, *([out] if out is not None else [])]
        return CostInputs(opcode=self.opcode, engine=self.engine, partitions=main.partitions,
                          free_elems=main.free_elems, in_dtypes=tuple(torch_name(a.dtype) for a in data),
                          out_dtype=torch_name(out.dtype) if out is not None else "float32",
                          in_memories=tuple(a.kind for a in data),
                          out_memory=out.kind if out is not None else "sbuf",
                          contiguous=all(a.inner_contiguous for a in tensors), op=op,
                          flops=main.numel if flops is None else flops, **kw)

    # ---- checks (each names the instruction, the operand and the limit) -----------------

    def _fail(self, operand: str, problem: str, error: type[SimulatorError] = SimulatorError) -> SimulatorError:
        return error(f"{self.opcode}: {operand} {problem}")

    def _ap(self, name: str, memories: tuple[str, ...] = ("sbuf", "psum")) -> AP:
        ap = getattr(self, name)
        if not isinstance(ap, AP):
            raise self._fail(name, f"must be a tile (an AP), got {type(ap).__name__}")
        mem = ap.kind
        if mem not in memories:
            why = {"gpsimd": "; GpSimd cannot access PSUM", "dma": "; DMA cannot access PSUM (evict it with "
                   "tensor_copy or activation)", "tensor": ""}.get(self.engine.value, "")
            raise self._fail(name, f"is in {mem}; {self.opcode} on the {self.engine.value} engine accepts "
                                   f"{'/'.join(memories)}{why}")
        if ap.on_chip:
            if ap.partitions > PMAX:
                raise self._fail(name, f"spans {ap.partitions} partitions; the limit is {PMAX} (nl.tile_size.pmax)")
            if self.engine in (Engine.VECTOR, Engine.SCALAR, Engine.GPSIMD):
                fmax = FMAX_PSUM if mem == "psum" else FMAX_SBUF
                if ap.free_elems > fmax:
                    raise self._fail(name, f"has {ap.free_elems} elements per partition; the limit for one "
                                           f"{self.engine.value} operand in {mem} is {fmax}")
        return ap

    def _tiles(self, *names: str) -> None:
        mems = ("sbuf",) if self.engine == Engine.GPSIMD else ("sbuf", "psum")
        for n in names:
            if getattr(self, n) is not None:
                self._ap(n, mems)

    def _same(self, a: str, b: str) -> None:
        x, y = getattr(self, a), getattr(self, b)
        if x.partitions != y.partitions or x.free_elems != y.free_elems:
            raise self._fail(b, f"has shape {y.shape}; it must match {a} {x.shape} in partitions and "
                                f"elements per partition")

    def _not_both_psum(self, a: str, b: str) -> None:
        if getattr(self, a).kind == "psum" and getattr(self, b).kind == "psum":
            raise self._fail(f"{a} and {b}", "are both in psum; at most one input may be in PSUM")

    def _column(self, name: str, of: str = "data") -> None:
        v = getattr(self, name)
        if isinstance(v, AP):
            self._ap(name, ("sbuf",) if self.engine == Engine.GPSIMD else ("sbuf", "psum"))
            p = getattr(self, of).partitions
            if v.partitions != p or v.free_elems != 1:
                raise self._fail(name, f"has shape {v.shape}; a tile operand must be ({p}, 1)")
        elif v is not None and not isinstance(v, (int, float)):
            raise self._fail(name, f"must be a scalar or a ({getattr(self, of).partitions}, 1) tile")

    def _free(self, name: str, expect: int, what: str = "") -> None:
        ap = getattr(self, name)
        if ap.free_elems != expect:
            raise self._fail(name, f"has {ap.free_elems} elements per partition; {what or f'it must have {expect}'}")

    def _ints(self, names: Sequence[str], why: str) -> None:
        for n in names:
            v = getattr(self, n)
            if isinstance(v, AP) and v.dtype not in INT_DTYPES:
                raise self._fail(n, f"is {dtype_name(v.dtype)}; {why} need integer dtypes")


# ---- execution helpers -------------------------------------------------------------------

def _load(core, ap: AP, compute: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    v = ap.view(core)
    if shape is not None and v.shape != shape:
        v = v.reshape(shape)
    return v if v.dtype == compute else v.to(compute)


def _col(core, value: Operand, compute: torch.dtype, ndim: int):
    """A scalar operand as the engine sees it, or a (P,1) tile shaped to broadcast over ``ndim`` dims."""
    if isinstance(value, AP):
        v = value.view(core)
        if v.dim() != ndim:
            v = v.reshape(value.partitions, *([1] * (ndim - 1)))
        return v if v.dtype == compute else v.to(compute)
    return as_scalar(value, compute)


def _operand(core, value, compute: torch.dtype, ndim: int):
    """A planned operand: a (P,1) tile is read, a scalar was already rounded when the plan was made."""
    return _col(core, value, compute, ndim) if isinstance(value, AP) else value


_FUSED_OPS = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum"})
_FUSED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
_ALU_FN = {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "divide": torch.true_divide,
          "maximum": torch.maximum, "minimum": torch.minimum}


def _disjoint_or_same(dst: AP, *inputs) -> bool:
    """Whether writing dst while reading the inputs is safe element by element: each input is dst
    itself or touches none of its memory (torch does not detect overlap of strided views)."""
    fp = dst.footprint()
    return all(not isinstance(v, AP) or v == dst or not v.footprint().overlaps(fp) for v in inputs)


def _fused_into(out: torch.Tensor, fn, lhs: torch.Tensor, rhs) -> None:
    """``fn(lhs, rhs, out=out)`` (a Python scalar rhs becomes an fp32 0-d tensor)."""
    fn(lhs, rhs if isinstance(rhs, torch.Tensor) else _f32(rhs), out=out)


@functools.lru_cache(maxsize=4096)
def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)  # shared and never written: safe to cache


def _apply(op: str, x, operand, reverse: bool):
    return apply_alu(op, operand, x) if reverse else apply_alu(op, x, operand)


def _fractional(*values) -> bool:
    return any(isinstance(v, float) and not float(v).is_integer() for v in values)


def _operand_dtypes(*values) -> tuple[torch.dtype, ...]:
    return tuple(v.dtype for v in values if isinstance(v, AP))


def _convert(values: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
    """Prepare values for a cast to ``dst`` the way the engines and DMA cast: through fp32
    between differing dtypes, except integer-to-integer, which we keep exact."""
    if values.dtype == dst or (values.dtype in INT_DTYPES and dst in INT_DTYPES):
        return values
    return values.float()


# ---- steps (per-core executors, see Instr.step) ----------------------------------------------
# A step does what execute does with the lookups that stay the same from run to run done once:
# on-chip views resolved, dtypes and torch functions chosen. Only HBM operands change per run;
# a step reads them from the run's bound tensors. The torch calls are execute's, in its order,
# so results are bit-identical.

Step = Callable[[Sequence[torch.Tensor]], None]


def _dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def _hbm_getter(ap: AP, slots: Mapping[str, tuple[int, "ArgSlot"]]) -> Callable | None:
    """A function of the run's bound tensors that returns ``ap``'s view of its buffer (what
    ``ap.view(core)`` returns), or None where ``ap`` reinterprets the buffer's dtype."""
    entry = slots.get(ap.memory)
    if entry is None:
        return None
    k, slot = entry
    if ap.dtype != slot.dtype:
        return None
    sizes, strides, offset = ap._geometry
    if offset == 0 and sizes == slot.shape and strides == _dense_strides(slot.shape):
        return operator.itemgetter(k)  # the whole buffer as bound: no view to build

    def get(h: Sequence[torch.Tensor]) -> torch.Tensor:
        t = h[k]
        return t.as_strided(sizes, strides, t.storage_offset() + offset)
    return get


def _rhs(core, value, nd: int) -> torch.Tensor | None:
    """A fused step's fp32 right-hand operand: a (P,1) tile's view shaped to broadcast over ``nd``
    dims, or a planned scalar as its cached 0-d tensor (what ``_fused_into`` passes); None where
    the tile's view cannot be reshaped without a copy."""
    if not isinstance(value, AP):
        return _f32(value)
    v = value.view(core)
    if v.dim() != nd:
        try:
            v = v.view(value.partitions, *([1] * (nd - 1)))
        except RuntimeError:
            return None
    return v


_INT32_EXACT_OPS = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor", *COMPARE_OPS})


def _int32_exact(data: AP, ops: list) -> bool:
    """Whether an int64 computation of ``ops`` on ``data`` gives the values int32 gives: int32 tiles,
    int32-range scalars, and only bitwise and/or/xor and comparisons, whose int64 results on
    sign-extended int32 inputs are the sign-extended int32 results (so any dst dtype stores the same)."""
    if data.dtype != torch.int32:
        return False
    for op, operand, _, _ in ops:
        if op not in _INT32_EXACT_OPS:
            return False
        if isinstance(operand, AP):
            if operand.dtype != torch.int32:
                return False
        elif type(operand) is not int or not -2**31 <= operand < 2**31:
            return False
    return True


def _planned_alu_step(core, dst: AP, data: AP, ops: list, c: torch.dtype) -> Step | None:
    """The step of an unfused tensor_tensor / tensor_scalar execute: ``data`` loaded in compute dtype
    ``c``, then each (op, operand, reverse, column) of ``ops`` applied (an operand: a tile, a (P,1) tile
    when ``column``, or a scalar the plan already rounded) and the result stored into ``dst``. The same
    torch calls as execute with the views resolved once; None where a reshape would copy."""
    xv, dv = data.view(core), dst.view(core)
    nd = xv.dim()
    if c == torch.int64 and _int32_exact(data, ops):
        c = torch.int32  # the same values, without widening every operand to int64 and back
    planned = []
    for op, operand, reverse, column in ops:
        if isinstance(operand, AP):
            v = operand.view(core)
            # as _col (a (P,1) tile broadcast over data's dims) and _load (a tile in data's shape) reshape
            want = (operand.partitions, *([1] * (nd - 1))) if column else tuple(xv.shape)
            if (v.dim() != nd) if column else (tuple(v.shape) != want):
                try:
                    v = v.view(want)  # a view, not a copy: the step reads the tile each run
                except RuntimeError:
                    return None
            planned.append((op, v, v.dtype != c, reverse))
        else:
            planned.append((op, operand, False, reverse))
    convert = xv.dtype != c

    def step(h):
        r = xv.to(c) if convert else xv
        for op, v, conv, reverse in planned:
            v = v.to(c) if conv else v
            r = apply_alu(op, v, r) if reverse else apply_alu(op, r, v)
        store(dst, dv, r)
    return step


def _copy_step(core, dst: AP, src: AP, slots) -> Step | None:
    """The step of ``dst.write(core, _convert(src.view(core), dst.dtype))`` (dma_copy, tensor_copy)."""
    if not src.on_chip and not dst.on_chip:
        # HBM to HBM: two slots may be bound to one tensor, so keep write's overlap check (store)
        sget, dget = _hbm_getter(src, slots), _hbm_getter(dst, slots)
        if sget is None or dget is None:
            return None
        hbm_float = src.dtype != dst.dtype and not (src.dtype in INT_DTYPES and dst.dtype in INT_DTYPES)

        def step(h):
            v = sget(h)
            store(dst, dget(h), v.float() if hbm_float else v)
        return step
    # _convert goes through fp32 (a no-op for an fp32 source: .float() returns the tensor itself)
    to_float = (src.dtype != dst.dtype and src.dtype != torch.float32
                and not (src.dtype in INT_DTYPES and dst.dtype in INT_DTYPES))
    if src.on_chip and dst.on_chip:
        sv, dv = src.view(core), dst.view(core)
        if src.memory == dst.memory and src.footprint().overlaps(dst.footprint()):
            def step(h):  # overlapping source and destination: write's checks decide on a clone
                store(dst, dv, sv.float() if to_float else sv)
            return step
        if src.shape != dst.shape:
            def step(h):
                store(dst, dv, sv.float() if to_float else sv, may_alias=False)
            return step

        def step(h):  # disjoint, same shape: the copy write ends in
            try:
                dv.copy_(sv.float() if to_float else sv)
            except RuntimeError as e:
                raise SimulatorError(f"{dst!r}: cannot write through this pattern: {e}") from None
        return step
    # one side in HBM, the other on chip: they never share memory
    if dst.on_chip:
        sget, dv = _hbm_getter(src, slots), dst.view(core)
        if sget is None:
            return None
        if not to_float and src.shape == dst.shape:
            def step(h):
                try:
                    dv.copy_(sget(h))
                except RuntimeError as e:
                    raise SimulatorError(f"{dst!r}: cannot write through this pattern: {e}") from None
            return step

        def step(h):
            v = sget(h)
            store(dst, dv, v.float() if to_float else v, may_alias=False)
        return step
    sv, dget = src.view(core), _hbm_getter(dst, slots)
    if dget is None:
        return None
    if not to_float and src.shape == dst.shape:
        def step(h):
            try:
                dget(h).copy_(sv)
            except RuntimeError as e:
                raise SimulatorError(f"{dst!r}: cannot write through this pattern: {e}") from None
        return step

    def step(h):
        store(dst, dget(h), sv.float() if to_float else sv, may_alias=False)
    return step


# ---- DMA ----------------------------------------------------------------------------------

def _dge(instr: Instr) -> None:
    instr._set("dge_mode", str(getattr(instr.dge_mode, "name", instr.dge_mode)))
    if instr.dge_mode not in DGE_MODES:
        raise instr._fail("dge_mode", f"is {instr.dge_mode!r}; expected one of {DGE_MODES}")
    if instr.queue < 0:
        raise instr._fail("queue", f"is {instr.queue}; DMA queues are numbered from 0")


def _rows_view(core, ap: AP) -> torch.Tensor:
    """The HBM buffer as rows of an indirect pattern: dim 0 is indexed, its stride is the row pitch."""
    mem = core.memory(ap.memory)
    typed = mem.typed(ap.dtype)
    total = typed.shape[1]
    (pitch, _), inner = ap.pattern[0], ap.pattern[1:]
    start = ap.offset // ap.dtype.itemsize
    extent = sum((sz - 1) * st for st, sz in inner) + 1
    rows = 0 if total - start < extent else (total - start - extent) // pitch + 1
    return typed.as_strided((rows, *(sz for _, sz in inner)), (pitch, *(st for st, _ in inner)),
                            typed.storage_offset() + start)


def _indices(core, instr: "DmaCopy", index: AP, rows: int, side: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    idx = index.view(core).reshape(-1).to(torch.int64)
    ok = (idx >= 0) & (idx < rows)
    if bool(ok.all()):
        return idx, None
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
                self.dst.write(core, _convert(table[idx], self.dst.dtype))
                return
            current = self.dst.read(core).reshape(idx.numel(), -1)
            current[ok] = _convert(table[idx[ok]], self.dst.dtype).reshape(int(ok.sum()), -1).to(current.dtype)
            self.dst.write(core, current)
        elif self.dst_index is not None:
            table = _rows_view(core, self.dst)
            idx, ok = _indices(core, self, self.dst_index, table.shape[0], "dst")
            values = _convert(self.src.view(core), self.dst.dtype).reshape(idx.numel(), *table.shape[1:])
            values = values.to(table.dtype)
            if ok is None:
                table[idx] = values  # duplicate indices: one of the writers wins (unspecified, as on hardware)
            else:
                table[idx[ok]] = values[ok]
        else:
            self.dst.write(core, _convert(self.src.view(core), self.dst.dtype))

    def step(self, core, slots) -> Step | None:
        if self.src_index is not None or self.dst_index is not None:
            return None  # gathers and scatters index at run time: execute
        return _copy_step(core, self.dst, self.src, slots)

    def price(self) -> CostInputs:
        onchip = [a for a in (self.dst, self.src) if a.on_chip]
        parts = onchip[0].partitions if onchip else 1
        n = self.src.numel
        run_src = contiguous_run(self.src.pattern[1:] if self.src_index is not None else _dims(self.src))
        run_dst = contiguous_run(self.dst.pattern[1:] if self.dst_index is not None else _dims(self.dst))
        op = "gather" if self.src_index is not None else "scatter" if self.dst_index is not None else None
        return CostInputs(opcode=self.opcode, engine=Engine.DMA, partitions=parts, free_elems=n // parts,
                          in_dtypes=(torch_name(self.src.dtype),), out_dtype=torch_name(self.dst.dtype),
                          in_memories=(self.src.kind,), out_memory=self.dst.kind,
                          contiguous=self.src.inner_contiguous and self.dst.inner_contiguous, op=op,
                          dma_bytes=max(self.src.nbytes, self.dst.nbytes), dma_chunks=_chunks(n, run_src, run_dst),
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
        src_dims = _dims(self.src)
        run_src = contiguous_run([src_dims[a] for a in self.axes])
        return CostInputs(opcode=self.opcode, engine=Engine.DMA, partitions=self.dst.partitions,
                          free_elems=self.dst.free_elems, in_dtypes=(torch_name(self.src.dtype),),
                          out_dtype=torch_name(self.dst.dtype), in_memories=(self.src.kind,), out_memory="sbuf",
                          contiguous=False, op="transpose", dma_bytes=self.src.nbytes,
                          dma_chunks=_chunks(n, run_src, contiguous_run(_dims(self.dst))),
                          dge_mode=None if self.dge_mode == "unknown" else self.dge_mode, flops=0)


# ---- TensorE --------------------------------------------------------------------------------

def _psum_closed(instr: Instr, core, ap: AP) -> torch.Tensor:
    """The group-closed flags (one per 4-byte PSUM word) under an fp32 PSUM pattern (cached per core)."""
    psum = core.memory("psum")
    cached = instr.__dict__.get("_closed")
    if cached is not None and cached[0] is psum:
        return cached[1]
    flags = psum.group_closed
    sizes, strides, elem_offset = ap._geometry
    row = flags.stride(0)
    view = flags.as_strided((ap.partitions, *sizes), (row, *strides), ap.start_partition * row + elem_offset)
    instr.__dict__["_closed"] = (psum, view)
    return view


# Per PSUM group_closed tensor (by id, checked through a weakref): [version, keys], meaning that as of
# ``flags._version`` == version, every PSUM box named in keys has all its flags False (its group open).
# Every write to the flags is a torch in-place op, which bumps the version, so a stale record never
# matches; an unchanged version lets a TensorE write skip re-opening a group that is already open.
_OPEN_GROUPS: dict[int, list] = {}


def _open_record(flags: torch.Tensor) -> list | None:
    """The shared open-group record of a PSUM flags tensor (None where torch tracks no version)."""
    try:
        flags._version
    except RuntimeError:  # an inference-mode tensor: no version counter, so no record
        return None
    key = id(flags)
    entry = _OPEN_GROUPS.get(key)
    if entry is None or entry[0]() is not flags:  # (the callback runs before the id can be reused)
        entry = _OPEN_GROUPS[key] = (weakref.ref(flags, lambda _r: _OPEN_GROUPS.pop(key, None)), [-1, set()])
    return entry[1]


def _view2(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor | None:
    """``t`` as a [rows, cols] view sharing its memory, or None where its strides do not allow one."""
    if t.shape == (rows, cols):
        return t
    try:
        return t.view(rows, cols)
    except RuntimeError:
        return None


def _group_open(rec: list | None, flags: torch.Tensor, box) -> bool:
    """Whether ``box``'s flags are known all False (its accumulation group open) without reading them."""
    return rec is not None and rec[0] == flags._version and box in rec[1]


def _open_group(rec: list | None, flags: torch.Tensor, closed: torch.Tensor, box, opened: dict) -> None:
    """Open the accumulation group under ``closed`` (clear its flags) and remember it in ``rec`` and in
    the PSUM memory's ``opened`` (so that closing every group resets only the flags cleared)."""
    opened[box] = closed
    if rec is None:
        closed.fill_(False)
        return
    before = flags._version
    closed.fill_(False)
    if rec[0] != before:
        rec[1] = set()
    rec[1].add(box)
    rec[0] = flags._version


def _one_bank(instr: Instr, name: str) -> None:
    lo, hi = getattr(instr, name).byte_range
    if lo // PSUM_BANK_BYTES != (hi - 1) // PSUM_BANK_BYTES:
        raise instr._fail(name, f"covers PSUM bytes [{lo}, {hi}) across banks; a TensorE output must fit one "
                                f"{PSUM_BANK_BYTES}-byte bank (nl.tile_size.psum_bank_fmax_bytes)")


@dataclass(frozen=True)
class NcMatmul(Instr):
    """``nisa.nc_matmul``: ``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on TensorE, fp32 accumulation
    into one PSUM bank. ``accumulate``: False overwrites, True adds, None adds where an accumulation
    group is open and overwrites elsewhere. A TensorE write opens the group at a PSUM word; the start
    of a run, allocating the word and any other engine writing it close it. (A kernel front end that
    knows its PSUM tiles' lifetimes should pass True/False.) ``is_transpose``: bit-exact transpose
    mode (NaN/inf pass through; dst may keep the input dtype)."""

    dst: AP
    stationary: AP
    moving: AP
    is_stationary_onezero: bool = False
    is_moving_onezero: bool = False
    is_transpose: bool = False
    accumulate: bool | None = None
    opcode = "nc_matmul"
    engine = Engine.TENSOR

    @cached_property
    def kmn(self) -> tuple[int, int, int]:
        """(K, M, N): contraction, stationary free size, moving free size."""
        return self.stationary.partitions, self.stationary.free_elems, self.moving.free_elems

    def check(self) -> None:
        self._ap("stationary", ("sbuf",))
        self._ap("moving", ("sbuf",))
        k, m, n = self.kmn
        if self.moving.partitions != k:
            raise self._fail("moving", f"has {self.moving.partitions} partitions; stationary has {k} (the "
                                       f"contraction dim K must match)")
        if m > GEMM_STATIONARY_FMAX:
            raise self._fail("stationary", f"has {m} elements per partition (M); the limit is "
                                           f"{GEMM_STATIONARY_FMAX} (nl.tile_size.gemm_stationary_fmax)")
        if n > GEMM_MOVING_FMAX:
            raise self._fail("moving", f"has {n} elements per partition (N); the limit is {GEMM_MOVING_FMAX} "
                                       f"(nl.tile_size.gemm_moving_fmax, one PSUM bank of fp32)")
        self._ap("dst", ("psum",))
        if self.dst.partitions != m or self.dst.free_elems != n:
            raise self._fail("dst", f"has shape {self.dst.shape}; it must be [M={m}, N={n}]")
        _one_bank(self, "dst")
        for name in ("stationary", "moving"):
            dt = getattr(self, name).dtype
            if dt not in MATMUL_DTYPES:
                raise self._fail(name, f"is {dtype_name(dt)}; TensorE takes fp8/bf16/fp16/fp32")
        if (self.stationary.dtype == torch.float32) != (self.moving.dtype == torch.float32):
            raise self._fail("moving", "and stationary mix fp32 with another dtype; fp32 needs fp32 on both sides")
        allowed = {torch.float32} | ({self.stationary.dtype} if self.is_transpose else set())
        if self.dst.dtype not in allowed:
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; matmul output is float32 "
                                    f"(transpose mode may keep the input dtype)")

    def _read_names(self) -> tuple[str, ...]:
        names = ("stationary", "moving")
        return names if self.accumulate is False else (*names, "dst")

    def _state(self, core, sbuf, psum) -> tuple:
        """Per-core constants of execute (cached): [K, M] / [K, N] views of the operands (None where
        their strides allow no view), fp32 scratch they are converted into (None for fp32 operands),
        the fp32 [K, M] operand transposed as the array reads it, the product buffer, [M, N] views of
        dst and of its group flags (None where dst's free dims do not flatten) and the open-group record."""
        k, m, n = self.kmn
        s, mv = _view2(self.stationary.view(sbuf), k, m), _view2(self.moving.view(sbuf), k, n)
        s_f = torch.empty(k, m) if self.stationary.dtype != torch.float32 else None
        mv_f = torch.empty(k, n) if self.moving.dtype != torch.float32 else None
        s_t = s_f.T if s_f is not None else (s.T if s is not None else None)
        mv_use = mv_f if mv_f is not None else mv
        out2 = closed2 = flags = rec = None
        if self.dst.dtype == torch.float32:
            out2, closed2 = _view2(self.dst.view(psum), m, n), _view2(_psum_closed(self, core, self.dst), m, n)
            if out2 is None or closed2 is None:
                out2 = closed2 = None
            flags = psum.group_closed
            rec = _open_record(flags)
        box = (self.dst.start_partition, self.dst.partitions, self.dst._geometry)
        state = (sbuf, psum, s, s_f, s_t, mv, mv_f, mv_use, torch.empty(m, n), out2, closed2, flags, rec, box)
        self.__dict__["_mm"] = state
        return state

    def execute(self, core) -> None:
        sbuf, psum = core.memory("sbuf"), core.memory("psum")
        st = self.__dict__.get("_mm")
        if st is None or st[0] is not sbuf or st[1] is not psum:
            st = self._state(core, sbuf, psum)
        self._multiply(core, st)

    def step(self, core, slots) -> Step | None:
        st = self._state(core, core.memory("sbuf"), core.memory("psum"))
        return lambda h: self._multiply(core, st)

    def _multiply(self, core, st: tuple) -> None:
        sbuf, psum, s, s_f, s_t, mv, mv_f, mv_use, r, out, closed, flags, rec, box = st
        # the array multiplies in fp32 (bf16/fp16/fp8 -> fp32 is exact)
        if s is None:  # operand strides allow no [K, M] view: read a fresh copy
            k, m, _ = self.kmn
            s = self.stationary.view(sbuf).reshape(k, m)
            s_t = None if s_f is not None else s.T
        if s_f is not None:
            s_f.copy_(s)
            s_t = s_f.T if s_t is None else s_t
        if mv is None:
            k, _, n = self.kmn
            mv = self.moving.view(sbuf).reshape(k, n)
            mv_use = mv
        if mv_f is not None:
            mv_use = mv_f.copy_(mv)
        if self.is_transpose:
            # bit-exact: each output is the stationary element a 1 in moving selects; 0 * NaN stays out
            s, mv = s_t.T, mv_use
            r = torch.where(mv.unsqueeze(1) != 0, s.unsqueeze(2) * mv.unsqueeze(1), 0.0).sum(0)
        else:
            r = torch.mm(s_t, mv_use, out=r)
        dst = self.dst
        if dst.dtype != torch.float32:  # transpose mode keeping a 16/8-bit dtype: no accumulation groups
            r = r.view(dst.shape)
            dst.write(core, dst.view(core).float() + r if self.accumulate else r)
            return
        if out is None:  # dst's free dims do not flatten to one: work in its own shape
            out = dst.view(core)
            closed = _psum_closed(self, core, dst)
            r = r.view(dst.shape)
        # PSUM accumulates in place, in fp32, after the array's fp32 dot products
        is_open = _group_open(rec, flags, box)
        if self.accumulate is False:
            out.copy_(r)
        elif self.accumulate or is_open:  # (an open group has no closed flag to clear)
            out.add_(r)
        else:
            out.masked_fill_(closed, 0.0).add_(r)  # overwrite where no group is open (NaN-safe)
        if not is_open:
            _open_group(rec, flags, closed, box, psum.opened)

    def price(self) -> CostInputs:
        k, m, n = self.kmn
        return self._cost([self.stationary, self.moving], self.dst, main=self.moving,
                          op="transpose" if self.is_transpose else None, matmul_kmn=(k, m, n), flops=2 * k * m * n)


@dataclass(frozen=True)
class NcTranspose(Instr):
    """``nisa.nc_transpose``: swap partition and (flattened) free axes. TensorE: <= [128, 128],
    SBUF -> PSUM; VectorE: <= [32, 32], SBUF/PSUM. Bit-exact, same dtype in and out."""

    dst: AP
    data: AP
    engine: Engine = Engine.TENSOR
    opcode = "nc_transpose"
    ENGINES = (Engine.TENSOR, Engine.VECTOR)

    def check(self) -> None:
        tensor = self.engine == Engine.TENSOR
        self._ap("data", ("sbuf",) if tensor else ("sbuf", "psum"))
        limit = TENSOR_TRANSPOSE_MAX if tensor else VECTOR_TRANSPOSE_MAX
        p, f = self.data.partitions, self.data.free_elems
        if p > limit or f > limit:
            raise self._fail("data", f"is [{p}, {f}]; {self.engine.value} engine transposes at most "
                                     f"[{limit}, {limit}]")
        self._ap("dst", ("psum",) if tensor else ("sbuf", "psum"))
        if self.dst.dtype != self.data.dtype:
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; it must equal data's "
                                    f"{dtype_name(self.data.dtype)}")
        if self.dst.partitions != f or self.dst.free_elems != p:
            raise self._fail("dst", f"has shape {self.dst.shape}; the transpose of [{p}, {f}] is [{f}, {p}]")
        if tensor:
            _one_bank(self, "dst")

    def execute(self, core) -> None:
        x = self.data.view(core).reshape(self.data.partitions, self.data.free_elems)
        self.dst.write(core, x.T)
        if self.engine == Engine.TENSOR and self.dst.dtype == torch.float32:
            flags = core.memory("psum").group_closed
            rec = self.__dict__.get("_open")
            if rec is None or rec[0] is not flags:
                box = (self.dst.start_partition, self.dst.partitions, self.dst._geometry)
                rec = self.__dict__["_open"] = (flags, _open_record(flags), box)
            if not _group_open(rec[1], flags, rec[2]):
                _open_group(rec[1], flags, _psum_closed(self, core, self.dst), rec[2], core.memory("psum").opened)

    def step(self, core, slots) -> Step | None:
        dst, data = self.dst, self.data
        if dst.memory == data.memory and dst.footprint().overlaps(data.footprint()):
            return None  # in place or overlapping: write's alias check decides on a clone
        dv = dst.view(core)
        # execute's reshapes, as views of the same memory (a copy here would freeze the tile's values)
        values = _view2(data.view(core), data.partitions, data.free_elems)
        if values is None:
            return None
        values = values.T
        if values.shape != dv.shape:
            try:
                values = values.view(dv.shape)
            except RuntimeError:
                return None

        def copy(h):
            try:
                dv.copy_(values)
            except RuntimeError as e:
                raise SimulatorError(f"{dst!r}: cannot write through this pattern: {e}") from None
        if self.engine != Engine.TENSOR or dst.dtype != torch.float32:
            return copy
        psum = core.memory("psum")
        flags, opened = psum.group_closed, psum.opened
        rec, box = _open_record(flags), (dst.start_partition, dst.partitions, dst._geometry)
        closed = _psum_closed(self, core, dst)

        def step(h):  # the write, then TensorE opens the accumulation group there (as execute)
            copy(h)
            if not _group_open(rec, flags, box):
                _open_group(rec, flags, closed, box, opened)
        return step

    def price(self) -> CostInputs:
        p, f = self.data.partitions, self.data.free_elems
        kmn = (p, f, p) if self.engine == Engine.TENSOR else None  # a matmul against a [p, p] identity
        return self._cost([self.data], self.dst, matmul_kmn=kmn, flops=0)


# ---- elementwise (Vector / Scalar / GpSimd) -----------------------------------------------------

@dataclass(frozen=True)
class TensorCopy(Instr):
    """``nisa.tensor_copy``: copy within SBUF/PSUM; bit-exact for equal dtypes, else cast through fp32."""

    dst: AP
    src: AP
    engine: Engine = Engine.VECTOR
    opcode = "tensor_copy"
    ENGINES = (Engine.VECTOR, Engine.SCALAR, Engine.GPSIMD)

    def check(self) -> None:
        self._tiles("src", "dst")
        self._same("src", "dst")

    def execute(self, core) -> None:
        self.dst.write(core, _convert(self.src.view(core), self.dst.dtype))

    def step(self, core, slots) -> Step | None:
        return _copy_step(core, self.dst, self.src, slots)

    def price(self) -> CostInputs:
        return self._cost([self.src], self.dst, flops=0)


@dataclass(frozen=True)
class TensorTensor(Instr):
    """``nisa.tensor_tensor``: ``dst = data1 <op> data2`` element-wise (same partitions and elements
    per partition; at most one input in PSUM)."""

    dst: AP
    data1: AP
    data2: AP
    op: str
    engine: Engine = Engine.VECTOR
    opcode = "tensor_tensor"
    ENGINES = (Engine.VECTOR, Engine.GPSIMD)

    def check(self) -> None:
        self._set("op", alu_op(self.op))
        if self.op in UNARY_ALU_OPS:
            raise self._fail("op", f"{self.op!r} is unary; tensor_tensor needs a binary operator")
        self._tiles("data1", "data2", "dst")
        self._same("data1", "data2")
        self._same("data1", "dst")
        self._not_both_psum("data1", "data2")
        if self.op in BITVEC_OPS:
            self._ints(("dst", "data1", "data2"), f"bitvec operator {self.op!r}")

    @cached_property
    def _fused(self) -> bool:
        # torch's fp32/bf16/fp16 kernels for these ops compute in fp32 and round once on store:
        # exactly the engine's semantics, in one pass straight into the destination
        return (self.op in _FUSED_OPS and self.data1.shape == self.data2.shape == self.dst.shape
                and {self.data1.dtype, self.data2.dtype, self.dst.dtype} <= _FUSED_DTYPES
                and _disjoint_or_same(self.dst, self.data1, self.data2))

    def execute(self, core) -> None:
        if self._fused:
            _fused_into(self.dst.view(core), _ALU_FN[self.op], self.data1.view(core), self.data2.view(core))
            return
        c = compute_dtype(self.data1.dtype, self.data2.dtype, fractional=self.op in FRACTIONAL_OPS)
        shape = self.data1.shape
        a = _load(core, self.data1, c)
        b = _load(core, self.data2, c, shape)
        self.dst.write(core, apply_alu(self.op, a, b))

    def step(self, core, slots) -> Step | None:
        if not self._fused:
            return _planned_alu_step(core, self.dst, self.data1, [(self.op, self.data2, False, False)],
                                     compute_dtype(self.data1.dtype, self.data2.dtype,
                                                   fractional=self.op in FRACTIONAL_OPS))
        fn, out, a, b = _ALU_FN[self.op], self.dst.view(core), self.data1.view(core), self.data2.view(core)
        return lambda h: fn(a, b, out=out)

    def price(self) -> CostInputs:
        return self._cost([self.data1, self.data2], self.dst, op=self.op)


def _check_ops(instr: Instr, names: Sequence[str]) -> None:
    ops = [getattr(instr, n) for n in names if getattr(instr, n) is not None]
    if len({op in BITVEC_OPS for op in ops}) > 1:
        raise instr._fail(" and ".join(names), f"mix bitvec and arithmetic operators {ops}; use one kind")


@dataclass(frozen=True)
class TensorScalar(Instr):
    """``nisa.tensor_scalar``: ``dst = (data <op0> operand0) <op1> operand1``; operands are scalars or
    (P,1) tiles broadcast along the free dims; ``reverseN`` swaps an operator's inputs."""

    dst: AP
    data: AP
    op0: str
    operand0: Operand | None = None
    reverse0: bool = False
    op1: str | None = None
    operand1: Operand | None = None
    reverse1: bool = False
    engine: Engine = Engine.VECTOR
    opcode = "tensor_scalar"
    ENGINES = (Engine.VECTOR, Engine.SCALAR, Engine.GPSIMD)

    def check(self) -> None:
        self._set("op0", alu_op(self.op0))
        if self.op1 is not None:
            self._set("op1", alu_op(self.op1))
        if (self.op1 is None) != (self.operand1 is None) and not (self.op1 in UNARY_ALU_OPS):
            raise self._fail("op1", "and operand1 must both be set or both be None")
        if self.operand0 is None and self.op0 not in UNARY_ALU_OPS:
            raise self._fail("operand0", f"is None; operator {self.op0!r} needs an operand")
        self._tiles("data", "dst")
        self._same("data", "dst")
        self._column("operand0")
        self._column("operand1")
        _check_ops(self, ("op0", "op1"))
        if self.op0 in BITVEC_OPS:
            if self.engine != Engine.VECTOR:
                raise self._fail("op0", f"{self.op0!r} is a bitvec operator; those run only on the vector engine")
            self._ints(("dst", "data", "operand0", "operand1"), f"bitvec operator {self.op0!r}")
        if self.engine == Engine.SCALAR and (self.op0, self.op1) not in (("multiply", "add"), ("multiply", None),
                                                                          ("add", None)):
            raise self._fail("op0/op1", f"are ({self.op0}, {self.op1}); ScalarE supports (multiply, add), "
                                        f"(multiply, None) and (add, None)")

    @cached_property
    def _plan(self) -> tuple:
        # compute dtype and engine-rounded scalar operands: fixed per instruction, so computed once
        fractional = bool(FRACTIONAL_OPS & {self.op0, self.op1}) or _fractional(self.operand0, self.operand1)
        c = compute_dtype(self.data.dtype, *_operand_dtypes(self.operand0, self.operand1), fractional=fractional)
        scalar = lambda v: v if isinstance(v, AP) else as_scalar(v or 0, c)  # noqa: E731
        return c, scalar(self.operand0), scalar(self.operand1)

    @cached_property
    def _fused(self) -> bool:
        # all-fp32 with plain (not reversed) arithmetic: op0 straight into dst, op1 in place there
        tiles = [v for v in (self.data, self.dst, self.operand0, self.operand1) if isinstance(v, AP)]
        return (all(t.dtype == torch.float32 for t in tiles) and self.data.shape == self.dst.shape
                and {self.op0, self.op1} <= _FUSED_OPS | {None} and not self.reverse0 and not self.reverse1
                and _disjoint_or_same(self.dst, self.data, self.operand0, self.operand1))

    def execute(self, core) -> None:
        c, operand0, operand1 = self._plan
        if self._fused:
            out = self.dst.view(core)
            nd = out.dim()
            _fused_into(out, _ALU_FN[self.op0], self.data.view(core), _operand(core, operand0, c, nd))
            if self.op1 is not None:
                _fused_into(out, _ALU_FN[self.op1], out, _operand(core, operand1, c, nd))
            return
        x = _load(core, self.data, c)
        r = _apply(self.op0, x, _operand(core, operand0, c, x.dim()), self.reverse0)
        if self.op1 is not None:
            r = _apply(self.op1, r, _operand(core, operand1, c, x.dim()), self.reverse1)
        self.dst.write(core, r)

    def step(self, core, slots) -> Step | None:
        if not self._fused:
            c, operand0, operand1 = self._plan
            ops = [(self.op0, operand0, self.reverse0, True)]
            if self.op1 is not None:
                ops.append((self.op1, operand1, self.reverse1, True))
            return _planned_alu_step(core, self.dst, self.data, ops, c)
        _, operand0, operand1 = self._plan
        out, x = self.dst.view(core), self.data.view(core)
        fn0, r0 = _ALU_FN[self.op0], _rhs(core, operand0, out.dim())
        if r0 is None:
            return None
        if self.op1 is None:
            return lambda h: fn0(x, r0, out=out)
        fn1, r1 = _ALU_FN[self.op1], _rhs(core, operand1, out.dim())
        if r1 is None:
            return None

        def step(h):
            fn0(x, r0, out=out)
            fn1(out, r1, out=out)
        return step

    def price(self) -> CostInputs:
        ops = self.op0 if self.op1 is None else f"{self.op0},{self.op1}"
        return self._cost([self.data], self.dst, op=ops, flops=self.data.numel * (1 + (self.op1 is not None)))


@dataclass(frozen=True)
class ScalarTensorTensor(Instr):
    """``nisa.scalar_tensor_tensor``: ``dst = (data <op0> operand0) <op1> operand1`` with operand0 a
    scalar or (P,1) tile and operand1 a tile shaped like data (arithmetic operators only)."""

    dst: AP
    data: AP
    op0: str
    operand0: Operand
    op1: str
    operand1: AP
    reverse0: bool = False
    reverse1: bool = False
    opcode = "scalar_tensor_tensor"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._set("op0", alu_op(self.op0))
        self._set("op1", alu_op(self.op1))
        for n in ("op0", "op1"):
            if getattr(self, n) in BITVEC_OPS:
                raise self._fail(n, f"{getattr(self, n)!r} is a bitvec operator; scalar_tensor_tensor takes "
                                    f"arithmetic operators")
        self._tiles("data", "operand1", "dst")
        self._column("operand0")
        self._same("data", "operand1")
        self._same("data", "dst")
        self._not_both_psum("data", "operand1")

    def execute(self, core) -> None:
        c = compute_dtype(self.data.dtype, self.operand1.dtype, *_operand_dtypes(self.operand0),
                          fractional=bool(FRACTIONAL_OPS & {self.op0, self.op1}) or _fractional(self.operand0))
        x = _load(core, self.data, c)
        t = _apply(self.op0, x, _col(core, self.operand0, c, x.dim()), self.reverse0)
        self.dst.write(core, _apply(self.op1, t, _load(core, self.operand1, c, x.shape), self.reverse1))

    def price(self) -> CostInputs:
        return self._cost([self.data, self.operand1], self.dst, op=f"{self.op0},{self.op1}",
                          flops=2 * self.data.numel)


@dataclass(frozen=True)
class Reciprocal(Instr):
    """``nisa.reciprocal``: ``dst = 1 / data`` on VectorE in fp32."""

    dst: AP
    data: AP
    opcode = "reciprocal"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._tiles("data", "dst")
        self._same("data", "dst")

    def execute(self, core) -> None:
        c = compute_dtype(self.data.dtype, fractional=True)
        self.dst.write(core, torch.reciprocal(_load(core, self.data, c)))

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, op="reciprocal")


# ---- ScalarE activation ------------------------------------------------------------------------

def _identity_out(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """The identity activation written into ``out`` (fp32 to fp32: a bit copy, as execute's store)."""
    return out if x is out else out.copy_(x)


def _regs(core, engine: Engine, ap: AP) -> torch.Tensor:
    """The engine's per-lane fp32 accumulation registers for the lanes (partitions) of ``ap``."""
    return core.regs[engine][ap.start_partition:ap.start_partition + ap.partitions]


def _accumulate(regs: torch.Tensor, op: str, cmd: str, values: torch.Tensor | None, init=None) -> None:
    if cmd in ("reset", "reset_reduce"):
        regs.fill_(REDUCE_IDENTITY[op])
    elif cmd == "load_reduce":
        regs.copy_(init.reshape(-1) if isinstance(init, torch.Tensor) else torch.full_like(regs, init))
    if cmd in ("reduce", "reset_reduce", "load_reduce") and values is not None:
        dims = tuple(range(1, values.dim()))
        part = apply_reduce(op, values, dims).float() if dims else values.float()
        regs.copy_(apply_alu(op, regs, part))


@dataclass(frozen=True)
class Activation(Instr):
    """``nisa.activation``: ``dst = op(data * scale + bias)`` on ScalarE in fp32; ``scale``/``bias`` are
    scalars or (P,1) tiles. With ``reduce_cmd`` the per-lane registers are reset and/or accumulate
    ``reduce_op`` (add; maximum/minimum as on NC-v4) over the free dims of the result;
    ``reduce_res`` (a (P,1) tile) receives the registers afterwards."""

    dst: AP
    op: str
    data: AP
    bias: Operand | None = None
    scale: Operand = 1.0
    reduce_op: str | None = None
    reduce_res: AP | None = None
    reduce_cmd: str = "idle"
    opcode = "activation"
    engine = Engine.SCALAR
    WRITES = ("dst", "reduce_res")

    def check(self) -> None:
        self._set("op", activation_fn(self.op))
        self._set("reduce_cmd", _cmd(self.reduce_cmd))
        if self.reduce_cmd == "load_reduce":
            raise self._fail("reduce_cmd", "load_reduce is not an activation command (idle/reset/reduce/reset_reduce)")
        if self.reduce_op is None and self.reduce_cmd in ("reduce", "reset_reduce"):
            self._set("reduce_op", "add")
        if self.reduce_op is not None:
            self._set("reduce_op", reduce_op(self.reduce_op))
            if self.reduce_op not in ("add", "maximum", "minimum"):
                raise self._fail("reduce_op", f"is {self.reduce_op!r}; ScalarE reduces with add "
                                              f"(maximum/minimum on NC-v4)")
        self._tiles("data", "dst")
        self._same("data", "dst")
        self._column("scale")
        self._column("bias")
        if self.reduce_res is not None:
            self._column("reduce_res")

    @cached_property
    def _plan(self) -> tuple:
        c = compute_dtype(self.data.dtype, fractional=True)
        scale = None if not isinstance(self.scale, AP) and self.scale == 1.0 else (
            self.scale if isinstance(self.scale, AP) else as_scalar(self.scale, c))
        bias = self.bias if self.bias is None or isinstance(self.bias, AP) else as_scalar(self.bias, c)
        return c, scale, bias

    @cached_property
    def _fused(self):
        # all fp32 and a function torch can write into dst: scale, bias and function in place there
        tiles = [v for v in (self.data, self.dst, self.scale, self.bias) if isinstance(v, AP)]
        ok = (all(t.dtype == torch.float32 for t in tiles) and self.data.shape == self.dst.shape
              and _disjoint_or_same(self.dst, self.data, self.scale, self.bias))
        if ok and self.op in ("identity", "copy"):
            # execute reduces its own result's layout: only a run without a reduction takes the copy
            reduce = self.reduce_cmd != "idle" or self.reduce_res is not None
            return None if reduce else _identity_out
        return ACTIVATIONS_OUT.get(self.op) if ok else None

    def execute(self, core) -> None:
        c, scale, bias = self._plan
        if self._fused is not None:
            self._execute_in_place(core, scale, bias)
            return
        x = _load(core, self.data, c)
        if scale is not None:
            x = x * _operand(core, scale, c, x.dim())
        if bias is not None:
            x = x + _operand(core, bias, c, x.dim())
        y = apply_activation(self.op, x)
        self.dst.write(core, y)
        self._reduce(core, y)

    def step(self, core, slots) -> Step | None:
        fn = self._fused
        if fn is None:
            return None
        _, scale, bias = self._plan
        out, x = self.dst.view(core), self.data.view(core)
        nd = out.dim()
        s = None if scale is None else _rhs(core, scale, nd)
        b = None if bias is None else _rhs(core, bias, nd)
        if (scale is not None and s is None) or (bias is not None and b is None):
            return None
        reduce = self.reduce_cmd != "idle" or self.reduce_res is not None
        if s is None and b is None and not reduce:
            return lambda h: fn(x, out=out)

        def step(h):
            y = x
            if s is not None:
                torch.mul(y, s, out=out)
                y = out
            if b is not None:
                torch.add(y, b, out=out)
                y = out
            fn(y, out=out)
            if reduce:
                self._reduce(core, out)
        return step

    def _execute_in_place(self, core, scale, bias) -> None:
        out, x = self.dst.view(core), self.data.view(core)
        nd = out.dim()
        if scale is not None:
            _fused_into(out, torch.mul, x, _operand(core, scale, torch.float32, nd))
            x = out
        if bias is not None:
            _fused_into(out, torch.add, x, _operand(core, bias, torch.float32, nd))
            x = out
        self._fused(x, out=out)
        self._reduce(core, out)

    def _reduce(self, core, y: torch.Tensor) -> None:
        if self.reduce_cmd != "idle" or self.reduce_res is not None:
            regs = _regs(core, Engine.SCALAR, self.data)
            _accumulate(regs, self.reduce_op or "add", self.reduce_cmd, y)
            if self.reduce_res is not None:
                self.reduce_res.write(core, regs)

    def price(self) -> CostInputs:
        n = self.data.numel
        flops = n * (1 + (isinstance(self.scale, AP) or self.scale != 1.0) + (self.bias is not None)
                     + (self.reduce_cmd in ("reduce", "reset_reduce")))
        ci = self._cost([self.data], self.dst, op=self.op, flops=flops)
        if self.reduce_res is not None:  # reading the registers out is a second ISA instruction
            ci = replace(ci, opcode="activation_reduce")
        return ci


# ---- reductions, scans --------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorReduce(Instr):
    """``nisa.tensor_reduce``: reduce the trailing free ``axis`` dims of ``data`` (never the partition
    dim) with add/multiply/maximum/minimum/logical_and/logical_or/bitwise_*; ``negate`` multiplies
    the result by -1."""

    dst: AP
    op: str
    data: AP
    axis: int | tuple[int, ...] = -1
    negate: bool = False
    keepdims: bool = False
    opcode = "tensor_reduce"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._set("op", reduce_op(self.op))
        self._tiles("data", "dst")
        rank = len(self.data.shape)
        axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        axes = tuple(sorted(a % rank for a in axes))
        if not axes or 0 in axes or axes != tuple(range(rank - len(axes), rank)):
            raise self._fail("axis", f"is {self.axis}; reduce trailing free dims of shape {self.data.shape} "
                                     f"ending at the last one (never the partition dim 0)")
        self._set("axis", axes)
        if self.dst.partitions != self.data.partitions:
            raise self._fail("dst", f"has {self.dst.partitions} partitions; data has {self.data.partitions}")
        kept = math.prod(self.data.shape[1:rank - len(axes)])
        self._free("dst", kept, f"reducing axes {axes} of {self.data.shape} leaves {kept}")
        if self.op in BITVEC_OPS:
            self._ints(("dst", "data"), f"bitvec operator {self.op!r}")
            if self.negate:
                raise self._fail("negate", f"applies to arithmetic operators, not {self.op!r}")

    def execute(self, core) -> None:
        x = _load(core, self.data, compute_dtype(self.data.dtype))
        r = apply_reduce(self.op, x, self.axis)
        self.dst.write(core, -r if self.negate else r)

    def step(self, core, slots) -> Step | None:
        c, xv, dv, dst = compute_dtype(self.data.dtype), self.data.view(core), self.dst.view(core), self.dst
        fn, axis, negate, convert = REDUCE_OPS[self.op], self.axis, self.negate, self.data.dtype != c

        # the result is a new tensor unless a bitwise fold of one element returns a view of the data
        alias = not convert and self.op.startswith("bitwise")

        def step(h):
            r = fn(xv.to(c) if convert else xv, axis)
            store(dst, dv, -r if negate else r, may_alias=alias)
        return step

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, op=self.op)


@dataclass(frozen=True)
class TensorPartitionReduce(Instr):
    """``nisa.tensor_partition_reduce``: reduce across partitions on GpSimd; dst is [1, free of data]."""

    dst: AP
    op: str
    data: AP
    opcode = "tensor_partition_reduce"
    engine = Engine.GPSIMD

    def check(self) -> None:
        self._set("op", reduce_op(self.op))
        self._tiles("data", "dst")
        if self.dst.partitions != 1:
            raise self._fail("dst", f"has {self.dst.partitions} partitions; a partition reduction writes 1")
        self._free("dst", self.data.free_elems, f"it must match data's {self.data.free_elems}")
        if self.op in BITVEC_OPS:
            self._ints(("dst", "data"), f"bitvec operator {self.op!r}")

    def execute(self, core) -> None:
        x = _load(core, self.data, compute_dtype(self.data.dtype))
        self.dst.write(core, apply_reduce(self.op, x, (0,)))

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, op=self.op)


@dataclass(frozen=True)
class TensorScalarReduce(Instr):
    """``nisa.tensor_scalar_reduce``: ``dst = data <op0> operand0`` and the VectorE registers reduce the
    result over the free dims with ``reduce_op`` (add/multiply/maximum/minimum), written to
    ``reduce_res`` ((P,1)). ``reduce_cmd``: reset_reduce, reduce or load_reduce (from ``reduce_init``)."""

    dst: AP
    data: AP
    op0: str
    operand0: Operand
    reduce_op: str
    reduce_res: AP
    reverse0: bool = False
    reduce_cmd: str = "reset_reduce"
    reduce_init: Operand | None = None
    opcode = "tensor_scalar_reduce"
    engine = Engine.VECTOR
    WRITES = ("dst", "reduce_res")

    def check(self) -> None:
        self._set("op0", alu_op(self.op0))
        self._set("reduce_op", reduce_op(self.reduce_op))
        self._set("reduce_cmd", _cmd(self.reduce_cmd))
        if self.reduce_op not in ("add", "multiply", "maximum", "minimum"):
            raise self._fail("reduce_op", f"is {self.reduce_op!r}; expected add, multiply, maximum or minimum")
        if self.op0 in BITVEC_OPS:
            raise self._fail("op0", f"{self.op0!r} is a bitvec operator; tensor_scalar_reduce takes arithmetic ones")
        if self.reduce_cmd not in ("reset_reduce", "reduce", "load_reduce"):
            raise self._fail("reduce_cmd", f"is {self.reduce_cmd!r}; expected reset_reduce, reduce or load_reduce")
        if (self.reduce_cmd == "load_reduce") != (self.reduce_init is not None):
            raise self._fail("reduce_init", "is required with reduce_cmd=load_reduce and only then")
        self._tiles("data", "dst")
        self._same("data", "dst")
        self._column("operand0")
        self._column("reduce_res")
        self._column("reduce_init")

    def execute(self, core) -> None:
        c = compute_dtype(self.data.dtype, *_operand_dtypes(self.operand0),
                          fractional=self.op0 in FRACTIONAL_OPS or _fractional(self.operand0))
        x = _load(core, self.data, c)
        r = _apply(self.op0, x, _col(core, self.operand0, c, x.dim()), self.reverse0)
        self.dst.write(core, r)
        regs = _regs(core, Engine.VECTOR, self.data)
        init = self.reduce_init.view(core).float() if isinstance(self.reduce_init, AP) else self.reduce_init
        _accumulate(regs, self.reduce_op, self.reduce_cmd, r, init)
        self.reduce_res.write(core, regs)

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, op=f"{self.op0},{self.reduce_op}", flops=2 * self.data.numel)


@dataclass(frozen=True)
class TensorTensorScan(Instr):
    """``nisa.tensor_tensor_scan``: per partition ``r[i] = (data0[i] <op0> r[i-1]) <op1> data1[i]`` along
    the flattened free dim, ``r[-1] = initial`` (a scalar or (P,1) tile), in fp32."""

    dst: AP
    data0: AP
    data1: AP
    initial: Operand
    op0: str
    op1: str
    reverse0: bool = False
    reverse1: bool = False
    opcode = "tensor_tensor_scan"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._set("op0", alu_op(self.op0))
        self._set("op1", alu_op(self.op1))
        for n in ("op0", "op1"):
            if getattr(self, n) in BITVEC_OPS or getattr(self, n) in UNARY_ALU_OPS:
                raise self._fail(n, f"{getattr(self, n)!r} is not a binary arithmetic operator")
        self._tiles("data0", "data1", "dst")
        self._same("data0", "data1")
        self._same("data0", "dst")
        self._not_both_psum("data0", "data1")
        self._column("initial", of="data0")

    def execute(self, core) -> None:
        p, f = self.data0.partitions, self.data0.free_elems
        c = compute_dtype(self.data0.dtype, self.data1.dtype, *_operand_dtypes(self.initial),
                          fractional=bool(FRACTIONAL_OPS & {self.op0, self.op1}) or _fractional(self.initial))
        a = _load(core, self.data0, c, (p, f))
        b = _load(core, self.data1, c, (p, f))
        init = _col(core, self.initial, c, 1)
        state = init if isinstance(init, torch.Tensor) else torch.full((p,), init, dtype=c)
        out = torch.empty(p, f, dtype=c)
        op0, op1 = self.op0, self.op1
        for i in range(f):  # sequential on purpose: the engine rounds every step to fp32
            t = apply_alu(op0, state, a[:, i]) if self.reverse0 else apply_alu(op0, a[:, i], state)
            state = apply_alu(op1, b[:, i], t) if self.reverse1 else apply_alu(op1, t, b[:, i])
            out[:, i] = state
        self.dst.write(core, out)

    def price(self) -> CostInputs:
        return self._cost([self.data0, self.data1], self.dst, op=f"{self.op0},{self.op1}",
                          flops=2 * self.data0.numel)


# ---- generators and selection (GpSimd) -----------------------------------------------------------

def _affine(pattern: tuple[tuple[int, int], ...], partitions: int, offset: int,
            channel_multiplier: int) -> torch.Tensor:
    """offset + channel_multiplier * p + sum(step_k * i_k), int32 arithmetic, shape (P, *nums)."""
    nd = len(pattern)
    v = torch.arange(partitions, dtype=torch.int64).reshape(partitions, *([1] * nd)) * channel_multiplier + offset
    for k, (step, num) in enumerate(pattern):
        shape = [1] * (nd + 1)
        shape[k + 1] = num
        v = v + torch.arange(num, dtype=torch.int64).reshape(shape) * step
    return v.to(torch.int32)  # wraps like the engine's 32-bit integers


def _pattern(instr: Instr, name: str, of: str) -> None:
    pattern = tuple((int(st), int(n)) for st, n in getattr(instr, name))
    if len(pattern) > 4 or any(n < 1 for _, n in pattern):
        raise instr._fail(name, f"{pattern} must be up to 4 [step, num] pairs with num >= 1")
    instr._set(name, pattern)
    if math.prod(n for _, n in pattern) != getattr(instr, of).free_elems:
        raise instr._fail(name, f"covers {math.prod(n for _, n in pattern)} elements; {of} has "
                                f"{getattr(instr, of).free_elems} per partition")


@dataclass(frozen=True)
class Iota(Instr):
    """``nisa.iota``: ``dst[p, i...] = offset + channel_multiplier * p + sum(step_k * i_k)`` (int32 math,
    cast to dst's dtype) on GpSimd into SBUF."""

    dst: AP
    pattern: tuple[tuple[int, int], ...]
    offset: int = 0
    channel_multiplier: int = 0
    opcode = "iota"
    engine = Engine.GPSIMD

    def check(self) -> None:
        self._tiles("dst")
        _pattern(self, "pattern", "dst")

    @cached_property
    def _values(self) -> torch.Tensor:
        v = _affine(self.pattern, self.dst.partitions, self.offset, self.channel_multiplier)
        return _convert(v, self.dst.dtype).to(self.dst.dtype)  # a constant: generated once

    def execute(self, core) -> None:
        self.dst.write(core, self._values)

    def price(self) -> CostInputs:
        return self._cost([], self.dst, flops=self.dst.numel)


@dataclass(frozen=True)
class Memset(Instr):
    """``nisa.memset``: fill dst with a constant (integral for integer dtypes) on Vector or GpSimd."""

    dst: AP
    value: Scalar
    engine: Engine = Engine.VECTOR
    opcode = "memset"
    ENGINES = (Engine.VECTOR, Engine.GPSIMD)

    def check(self) -> None:
        self._tiles("dst")
        if self.dst.dtype in INT_DTYPES and not float(self.value).is_integer():
            raise self._fail("value", f"{self.value!r} is not an integer; dst is {dtype_name(self.dst.dtype)}")

    def execute(self, core) -> None:
        self.dst.view(core).fill_(self.value)

    def step(self, core, slots) -> Step | None:
        dv, value = self.dst.view(core), self.value
        return lambda h: dv.fill_(value)

    def price(self) -> CostInputs:
        return self._cost([], self.dst, op="zero" if self.value == 0 else None, flops=0)


@dataclass(frozen=True)
class AffineSelect(Instr):
    """``nisa.affine_select``: ``dst = on_true_tile`` where ``cmp_op(affine, 0)`` else ``on_false_value``,
    with affine = offset + channel_multiplier * p + sum(step_k * i_k) (GpSimd, SBUF only)."""

    dst: AP
    pattern: tuple[tuple[int, int], ...]
    channel_multiplier: int
    on_true_tile: AP
    on_false_value: float
    cmp_op: str = "equal"
    offset: int = 0
    opcode = "affine_select"
    engine = Engine.GPSIMD

    def check(self) -> None:
        self._set("cmp_op", alu_op(self.cmp_op))
        if self.cmp_op not in COMPARE_OPS:
            raise self._fail("cmp_op", f"is {self.cmp_op!r}; expected a comparison {sorted(COMPARE_OPS)}")
        self._tiles("on_true_tile", "dst")
        self._same("on_true_tile", "dst")
        _pattern(self, "pattern", "dst")

    @cached_property
    def _predicate(self) -> torch.Tensor:
        p, f = self.dst.partitions, self.dst.free_elems
        affine = _affine(self.pattern, p, self.offset, self.channel_multiplier).reshape(p, f).to(torch.int64)
        return apply_alu(self.cmp_op, affine, torch.zeros((), dtype=torch.int64)) != 0

    def execute(self, core) -> None:
        p, f = self.dst.partitions, self.dst.free_elems
        x = _convert(self.on_true_tile.view(core).reshape(p, f), self.dst.dtype)
        fill = torch.tensor(as_scalar(self.on_false_value, torch.float32), dtype=torch.float32).to(x.dtype)
        self.dst.write(core, torch.where(self._predicate, x, fill))

    def price(self) -> CostInputs:
        return self._cost([self.on_true_tile], self.dst, op=self.cmp_op)


# ---- statistics, top-8 -------------------------------------------------------------------------

@dataclass(frozen=True)
class BnStats(Instr):
    """``nisa.bn_stats``: per partition (count, mean, variance*count) of the even and then the odd
    elements of data (<= 512 per partition), fp32, 6 outputs."""

    dst: AP
    data: AP
    opcode = "bn_stats"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._tiles("data", "dst")
        if self.data.free_elems > BN_STATS_FMAX:
            raise self._fail("data", f"has {self.data.free_elems} elements per partition; the limit is "
                                     f"{BN_STATS_FMAX} (nl.tile_size.bn_stats_fmax)")
        if self.dst.partitions != self.data.partitions:
            raise self._fail("dst", f"has {self.dst.partitions} partitions; data has {self.data.partitions}")
        self._free("dst", 6, "bn_stats writes 6 (count, mean, var*count for even and odd elements)")

    def execute(self, core) -> None:
        x = _load(core, self.data, torch.float32, (self.data.partitions, self.data.free_elems))
        stats = []
        for half in (x[:, 0::2], x[:, 1::2]):
            n = half.shape[1]
            mean = half.mean(1) if n else torch.zeros(x.shape[0])
            m2 = ((half - mean[:, None]) ** 2).sum(1)
            stats += [torch.full_like(mean, float(n)), mean, m2]
        self.dst.write(core, torch.stack(stats, 1))

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, flops=3 * self.data.numel)


@dataclass(frozen=True)
class BnAggr(Instr):
    """``nisa.bn_aggr``: combine (count, mean, variance*count) triples per partition into (mean, variance)."""

    dst: AP
    data: AP
    opcode = "bn_aggr"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._tiles("data", "dst")
        if self.data.free_elems % 3:
            raise self._fail("data", f"has {self.data.free_elems} elements per partition; bn_aggr needs a "
                                     f"multiple of 3 (count, mean, var*count triples)")
        if self.dst.partitions != self.data.partitions:
            raise self._fail("dst", f"has {self.dst.partitions} partitions; data has {self.data.partitions}")
        self._free("dst", 2, "bn_aggr writes 2 (mean, variance)")

    def execute(self, core) -> None:
        p = self.data.partitions
        g = _load(core, self.data, torch.float32, (p, self.data.free_elems)).reshape(p, -1, 3)
        n, mean, m2 = g[..., 0], g[..., 1], g[..., 2]
        total = n.sum(1)
        mu = (n * mean).sum(1) / total
        var = (m2.sum(1) + (n * (mean - mu[:, None]) ** 2).sum(1)) / total
        self.dst.write(core, torch.stack([mu, var], 1))

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, flops=4 * self.data.numel)


def _max8_sizes(instr: Instr, name: str) -> None:
    f = getattr(instr, name).free_elems
    if not MAX8_FMIN <= f <= MAX8_FMAX:
        raise instr._fail(name, f"has {f} elements per partition; the range is [{MAX8_FMIN}, {MAX8_FMAX}]")


@dataclass(frozen=True)
class Max8(Instr):
    """``nisa.max8``: the 8 largest values of each partition (fp32 compare), descending."""

    dst: AP
    src: AP
    opcode = "max8"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._tiles("src", "dst")
        _max8_sizes(self, "src")
        if self.dst.partitions != self.src.partitions:
            raise self._fail("dst", f"has {self.dst.partitions} partitions; src has {self.src.partitions}")
        self._free("dst", 8, "max8 writes 8")

    def execute(self, core) -> None:
        x = _load(core, self.src, torch.float32, (self.src.partitions, self.src.free_elems))
        self.dst.write(core, torch.topk(x, 8, dim=1).values)

    def price(self) -> CostInputs:
        return self._cost([self.src], self.dst)


@dataclass(frozen=True)
class NcFindIndex8(Instr):
    """``nisa.nc_find_index8``: per partition, the index of the first element of data equal to each of
    the 8 ``vals`` (fp32 compare; 0 when a value is absent, which the hardware leaves undefined)."""

    dst: AP
    data: AP
    vals: AP
    opcode = "nc_find_index8"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._tiles("data", "vals", "dst")
        _max8_sizes(self, "data")
        for n in ("dst", "vals"):
            if getattr(self, n).partitions != self.data.partitions:
                raise self._fail(n, f"has {getattr(self, n).partitions} partitions; data has {self.data.partitions}")
            self._free(n, 8, "it must have 8")
        if self.dst.dtype not in (torch.uint16, torch.uint32, torch.int32):
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; indices are uint16 or uint32")

    def execute(self, core) -> None:
        p = self.data.partitions
        x = _load(core, self.data, torch.float32, (p, self.data.free_elems))
        v = _load(core, self.vals, torch.float32, (p, 8))
        hit = (x.unsqueeze(1) == v.unsqueeze(2)).to(torch.uint8)
        self.dst.write(core, hit.argmax(2))  # argmax returns the first maximal index

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst)


# ---- random numbers ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Rng(Instr):
    """``nisa.rng``: 32 random bits per element, truncated to dst's integer dtype (low bits)."""

    dst: AP
    engine: Engine = Engine.VECTOR
    opcode = "rng"
    ENGINES = (Engine.VECTOR, Engine.GPSIMD)

    def check(self) -> None:
        self._tiles("dst")
        if self.dst.dtype not in INT_DTYPES or self.dst.dtype == torch.bool:
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; rng writes integer dtypes")

    def execute(self, core) -> None:
        bits = torch.randint(0, 1 << 32, (self.dst.partitions, self.dst.free_elems), dtype=torch.int64,
                             generator=core.rng)
        self.dst.write(core, bits.to(self.dst.dtype))  # integral conversion keeps the low bits

    def price(self) -> CostInputs:
        return self._cost([], self.dst)


@dataclass(frozen=True)
class SetRngSeed(Instr):
    """``nisa.set_rng_seed``: seed the core's PRNG from a [1, 1] 32-bit tile."""

    src_seeds: AP
    opcode = "set_rng_seed"
    engine = Engine.VECTOR
    WRITES = ()

    def check(self) -> None:
        self._tiles("src_seeds")
        if self.src_seeds.numel != 1 or self.src_seeds.dtype.itemsize != 4:
            raise self._fail("src_seeds", f"is {dtype_name(self.src_seeds.dtype)} {self.src_seeds.shape}; "
                                          f"it must be a [1, 1] 32-bit tile")

    def execute(self, core) -> None:
        seed = self.src_seeds.view(core).reshape(-1)[0]
        core.rng.manual_seed(int(seed.view(torch.int32) if seed.is_floating_point() else seed) & 0xFFFFFFFF)

    def price(self) -> CostInputs:
        return self._cost([self.src_seeds], None, flops=0)


@dataclass(frozen=True)
class Rand2(Instr):
    """``nisa.rand2``: uniform random values in [min, max] (scalars or (P,1) tiles), cast to dst's dtype."""

    dst: AP
    min: Operand
    max: Operand
    opcode = "rand2"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._tiles("dst")
        self._column("min", of="dst")
        self._column("max", of="dst")
        if not isinstance(self.min, AP) and not isinstance(self.max, AP) and not self.min < self.max:
            raise self._fail("min", f"{self.min} must be below max {self.max}")

    def execute(self, core) -> None:
        u = torch.rand(self.dst.partitions, self.dst.free_elems, generator=core.rng)
        lo, hi = _col(core, self.min, torch.float32, 2), _col(core, self.max, torch.float32, 2)
        self.dst.write(core, lo + u * (hi - lo))

    def price(self) -> CostInputs:
        return self._cost([], self.dst)


@dataclass(frozen=True)
class Dropout(Instr):
    """``nisa.dropout``: zero each element with probability ``prob`` (scalar or (P,1) tile); no rescaling."""

    dst: AP
    data: AP
    prob: Operand
    opcode = "dropout"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._tiles("data", "dst")
        self._same("data", "dst")
        self._column("prob")
        if self.dst.dtype != self.data.dtype:
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; dropout keeps data's "
                                    f"{dtype_name(self.data.dtype)}")
        if not isinstance(self.prob, AP) and not 0.0 <= self.prob <= 1.0:
            raise self._fail("prob", f"is {self.prob}; a probability is in [0, 1]")

    def execute(self, core) -> None:
        p, f = self.data.partitions, self.data.free_elems
        x = self.data.view(core).reshape(p, f)
        keep = torch.rand(p, f, generator=core.rng) >= _col(core, self.prob, torch.float32, 2)
        self.dst.write(core, torch.where(keep, x, torch.zeros((), dtype=x.dtype)))

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst)


# The instruction set, by nki.isa name (serialization and the kernel language look classes up here).
OPCODES: dict[str, type[Instr]] = {cls.opcode: cls for cls in (
    DmaCopy, DmaTranspose, NcMatmul, NcTranspose, TensorCopy, TensorTensor, TensorScalar, ScalarTensorTensor,
    Reciprocal, Activation, TensorReduce, TensorPartitionReduce, TensorScalarReduce, TensorTensorScan, Iota,
    Memset, AffineSelect, BnStats, BnAggr, Max8, NcFindIndex8, Rng, SetRngSeed, Rand2, Dropout)}

# nki.isa-style lowercase aliases: isa.nc_matmul(dst=..., stationary=..., moving=...) builds the instruction
dma_copy, dma_transpose, nc_matmul, nc_transpose = DmaCopy, DmaTranspose, NcMatmul, NcTranspose
tensor_copy, tensor_tensor, tensor_scalar = TensorCopy, TensorTensor, TensorScalar
scalar_tensor_tensor, reciprocal, activation = ScalarTensorTensor, Reciprocal, Activation
tensor_reduce, tensor_partition_reduce, tensor_scalar_reduce = TensorReduce, TensorPartitionReduce, TensorScalarReduce
tensor_tensor_scan, iota, memset, affine_select = TensorTensorScan, Iota, Memset, AffineSelect
bn_stats, bn_aggr, max8, nc_find_index8 = BnStats, BnAggr, Max8, NcFindIndex8
rng, set_rng_seed, rand2, dropout = Rng, SetRngSeed, Rand2, Dropout
