"""What every instruction shares: the engines' limits, the ``Instr`` base class (checks at construction,
functional execution, cost description) and the operand loading and per-core step planning the engines use."""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, Sequence

import torch

from torchneuron.sim.instruction import CostInputs, Engine, Footprint
from torchneuron.sim.memory import PMAX, AP, SimulatorError, store
from torchneuron.sim.numerics import (INT_DTYPES, Scratch, apply_alu, as_scalar, dtype_name, fresh_scratch,
                                      torch_name)


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


def checked_reduce_cmd(value) -> str:
    """The reduce_cmd name of ``value`` (a name or an enum member), refused if unknown."""
    name = str(getattr(value, "name", value))
    if name not in REDUCE_CMDS:
        raise SimulatorError(f"unknown reduce_cmd {value!r}; expected one of {REDUCE_CMDS}")
    return name


def ap_dims(ap: AP) -> list[tuple[int | None, int]]:
    """The (stride, size) dims of ``ap``, its partition dim first when on chip (stride None)."""
    return ([(None, ap.partitions)] if ap.on_chip else []) + list(ap.pattern)


def descriptor_count(n: int, run_a: int, run_b: int) -> int:
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

def load_tile(core, ap: AP, compute: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The tile ``ap`` reads, reshaped to ``shape`` if given, in the compute dtype."""
    v = ap.view(core)
    if shape is not None and v.shape != shape:
        v = v.reshape(shape)
    return v if v.dtype == compute else v.to(compute)


def load_column(core, value: Operand, compute: torch.dtype, ndim: int):
    """A scalar operand as the engine sees it, or a (P,1) tile shaped to broadcast over ``ndim`` dims."""
    if isinstance(value, AP):
        v = value.view(core)
        if v.dim() != ndim:
            v = v.reshape(value.partitions, *([1] * (ndim - 1)))
        return v if v.dtype == compute else v.to(compute)
    return as_scalar(value, compute)


def planned_operand(core, value, compute: torch.dtype, ndim: int):
    """A planned operand: a (P,1) tile is read, a scalar was already rounded when the plan was made."""
    return load_column(core, value, compute, ndim) if isinstance(value, AP) else value


# the ALU ops and dtypes an elementwise step computes with one torch call into its destination
# (``FUSED_ALU_FN[op](a, b, out=dst)``, see fused_into)
FUSED_OPS = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum"})
FUSED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
FUSED_ALU_FN = {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "divide": torch.true_divide,
                "maximum": torch.maximum, "minimum": torch.minimum}


def disjoint_or_same(dst: AP, *inputs) -> bool:
    """Whether writing dst while reading the inputs is safe element by element: each input is dst
    itself or touches none of its memory (torch does not detect overlap of strided views)."""
    fp = dst.footprint()
    return all(not isinstance(v, AP) or v == dst or not v.footprint().overlaps(fp) for v in inputs)


def fused_into(out: torch.Tensor, fn, lhs: torch.Tensor, rhs) -> None:
    """``fn(lhs, rhs, out=out)`` (a Python scalar rhs becomes an fp32 0-d tensor)."""
    fn(lhs, rhs if isinstance(rhs, torch.Tensor) else _f32(rhs), out=out)


def _f32(value: float) -> torch.Tensor:
    """``value`` as a shared (never written) fp32 0-d tensor."""
    # keyed by the sign too: -0.0 == 0.0 with equal hashes, so a cache by value alone would hand x + -0.0 the
    # +0.0 tensor (and -0.0 + -0.0 would give +0.0)
    return _f32_signed(value, math.copysign(1.0, value) < 0)


@functools.lru_cache(maxsize=4096)
def _f32_signed(value: float, negative: bool) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def apply_ordered(op: str, x, operand, reverse: bool):
    """``op(x, operand)``, or ``op(operand, x)`` when ``reverse``."""
    return apply_alu(op, operand, x) if reverse else apply_alu(op, x, operand)


def has_fractional(*values) -> bool:
    """Whether any value is a float with a fractional part."""
    return any(isinstance(v, float) and not float(v).is_integer() for v in values)


def operand_dtypes(*values) -> tuple[torch.dtype, ...]:
    """The dtypes of the tile operands among ``values`` (scalars skipped)."""
    return tuple(v.dtype for v in values if isinstance(v, AP))


def prepare_cast(values: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
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
    ``ap.view(core)`` returns), or None where ``ap`` names no slot."""
    entry = slots.get(ap.memory)
    if entry is None:
        return None
    k, slot = entry
    sizes, strides, offset = ap._geometry
    if ap.dtype != slot.dtype:
        # another dtype over the buffer's bytes (a compiled program's arena): ``Memory.hbm`` and ``typed``'s view
        dtype, size = ap.dtype, ap.dtype.itemsize

        def get_typed(h: Sequence[torch.Tensor]) -> torch.Tensor:
            t = h[k]
            flat = t.reshape(-1).view(torch.uint8)
            typed = flat[: flat.numel() - flat.numel() % size].view(dtype)
            return typed.as_strided(sizes, strides, typed.storage_offset() + offset)
        return get_typed
    if offset == 0 and sizes == slot.shape and strides == _dense_strides(slot.shape):
        return operator.itemgetter(k)  # the whole buffer as bound: no view to build

    def get(h: Sequence[torch.Tensor]) -> torch.Tensor:
        t = h[k]
        return t.as_strided(sizes, strides, t.storage_offset() + offset)
    return get


def fused_rhs(core, value, nd: int) -> torch.Tensor | None:
    """A fused step's fp32 right-hand operand: a (P,1) tile's view shaped to broadcast over ``nd``
    dims, or a planned scalar as its cached 0-d tensor (what ``fused_into`` passes); None where
    the tile's view cannot be reshaped without a copy."""
    return column_view(core, value, nd) if isinstance(value, AP) else _f32(value)


def step_scratch(core) -> Scratch:
    """``core``'s shared step scratch (``NeuronCore.scratch``), or fresh buffers for an object without one."""
    return getattr(core, "scratch", None) or fresh_scratch


def matrix_view(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor | None:
    """``t`` as a [rows, cols] view sharing its memory, or None where its strides do not allow one."""
    if t.shape == (rows, cols):
        return t
    try:
        return t.view(rows, cols)
    except RuntimeError:
        return None


def column_view(core, ap: AP, nd: int) -> torch.Tensor | None:
    """A (P,1) tile's view shaped to broadcast over ``nd`` dims (what ``load_column`` reads), or None where
    that needs a copy."""
    v = ap.view(core)
    if v.dim() != nd:
        try:
            v = v.view(ap.partitions, *([1] * (nd - 1)))
        except RuntimeError:
            return None
    return v


LOGICAL_OPS = frozenset({"logical_and", "logical_or", "logical_xor"})
_INT32_EXACT_OPS = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor", *COMPARE_OPS, *LOGICAL_OPS})
# comparisons and logical operators as torch functions writing 1 / 0 into a tensor of any dtype (out=)
_TRUTH_FN = {"equal": torch.eq, "not_equal": torch.ne, "greater": torch.gt, "greater_equal": torch.ge,
             "less": torch.lt, "less_equal": torch.le, "logical_and": torch.logical_and,
             "logical_or": torch.logical_or, "logical_xor": torch.logical_xor}


def int32_exact(data: AP, ops: list) -> bool:
    """Whether an int64 computation of ``ops`` on ``data`` gives the values int32 gives: int32 tiles,
    int32-range scalars, and only bitwise and/or/xor, comparisons and logical operators, whose int64 results
    on sign-extended int32 inputs are the sign-extended int32 results (so any dst dtype stores the same)."""
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


def planned_alu_step(core, dst: AP, data: AP, ops: list, c: torch.dtype) -> Step | None:
    """The step of an unfused tensor_tensor / tensor_scalar execute: ``data`` loaded in compute dtype
    ``c``, then each (op, operand, reverse, column) of ``ops`` applied (an operand: a tile, a (P,1) tile
    when ``column``, or a scalar the plan already rounded) and the result stored into ``dst``. The same
    torch calls as execute with the views resolved once; None where a reshape would copy."""
    xv, dv = data.view(core), dst.view(core)
    nd = xv.dim()
    if c == torch.int64 and int32_exact(data, ops):
        c = torch.int32  # the same values, without widening every operand to int64 and back
    planned = []
    for op, operand, reverse, column in ops:
        if isinstance(operand, AP):
            v = operand.view(core)
            # as load_column (a (P,1) tile broadcast over data's dims) and load_tile (a tile in data's shape)
            # reshape
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
    truth = _truth_into(dst, data, ops, planned, c) if dv.shape == xv.shape else None
    if truth is not None:
        fn, v, reverse = truth
        if reverse:
            return lambda h: fn(v, xv, out=dv)
        return lambda h: fn(xv, v, out=dv)
    chain = _in_place_chain(dst, data, ops, planned, c) if dv.shape == xv.shape else None
    if chain is not None:
        def step(h):  # each op written into dst, the next reading it there: the same values, no temporaries
            cur = xv
            for fn, v, reverse in chain:
                if reverse:
                    fn(v, cur, out=dv)
                else:
                    fn(cur, v, out=dv)
                cur = dv
        return step

    def step(h):
        r = xv.to(c) if convert else xv
        for op, v, conv, reverse in planned:
            v = v.to(c) if conv else v
            r = apply_alu(op, v, r) if reverse else apply_alu(op, r, v)
        store(dst, dv, r)
    return step


def _truth_into(dst: AP, data: AP, ops: list, planned: list, c: torch.dtype) -> tuple | None:
    """A single comparison or logical operator of planned_alu_step as (torch function, operand, reverse) writing
    its 1 / 0 straight into ``dst`` (``fn(a, b, out=dst)``: the values apply_alu makes in the compute dtype and the
    store writes), or None: another op, operands not all in the compute dtype ``c`` (no conversion to do) or not
    dst's dtype, or dst sharing memory with an input other than being it."""
    if len(ops) != 1 or ops[0][0] not in _TRUTH_FN or dst.dtype != c or data.dtype != c:
        return None
    op, operand, _, _ = ops[0]
    _, v, _, reverse = planned[0]
    if isinstance(operand, AP):
        if operand.dtype != c or not disjoint_or_same(dst, data, operand):
            return None
    elif not disjoint_or_same(dst, data):
        return None
    if not isinstance(v, torch.Tensor) and (reverse or op in LOGICAL_OPS):
        v = torch.tensor(v, dtype=c)  # (as apply_alu: these take a Python number on the right only)
    return _TRUTH_FN[op], v, reverse


# the ops an all-fp32 planned step may compute in place in its destination: IEEE operations whose result bits
# (NaN payloads included) do not depend on the memory layout torch's loop runs over (its maximum/minimum
# choose a NaN by code path, so they keep the temporaries)
IN_PLACE_OPS = frozenset({"add", "subtract", "multiply", "divide"})
# powers by these scalar exponents, which torch computes by correctly rounded operations on its vector and
# element-by-element paths alike (x * x, sqrt, 1 / sqrt, 1 / x), so their bits do not depend on the layout either
# (a layer norm's (var + eps) ** -0.5)
EXACT_POWERS = frozenset({2.0, 0.5, -0.5, -1.0})


def _in_place_op(op: str, operand, reverse: bool) -> bool:
    """Whether op with this operand computes the same bits written into dst as into a temporary."""
    return op in IN_PLACE_OPS or (op == "power" and not reverse and not isinstance(operand, AP)
                                  and operand in EXACT_POWERS)


def _in_place_chain(dst: AP, data: AP, ops: list, planned: list, c: torch.dtype) -> list | None:
    """planned_alu_step's ops as (torch function, operand, reverse) writing each result into ``dst`` (``fn(a, b,
    out=dst)``), or None where that could change a bit: any dtype but fp32, an op outside IN_PLACE_OPS (or a
    power but by EXACT_POWERS), or ``dst`` sharing memory with what is read after the first op wrote it (data and
    the first operand may be dst itself: each element is read before it is written)."""
    if c != torch.float32 or dst.dtype != c or data.dtype != c:
        return None
    tiles = [operand for _, operand, _, _ in ops if isinstance(operand, AP)]
    if any(t.dtype != c for t in tiles) or not all(_in_place_op(op, v, rev) for op, v, rev, _ in ops):
        return None
    later = [operand for _, operand, _, _ in ops[1:] if isinstance(operand, AP)]
    if not disjoint_or_same(dst, data, *tiles) or any(t == dst for t in later):
        return None
    # a power takes its exponent as the Python number apply_alu passes (torch's scalar-exponent kernel)
    return [(torch.pow, v, reverse) if op == "power" else
            (FUSED_ALU_FN[op], v if isinstance(v, torch.Tensor) else _f32(v), reverse)
            for (op, _, _, _), (_, v, _, reverse) in zip(ops, planned)]


def copy_step(core, dst: AP, src: AP, slots) -> Step | None:
    """The step of ``dst.write(core, prepare_cast(src.view(core), dst.dtype))`` (dma_copy, tensor_copy)."""
    if not src.on_chip and not dst.on_chip:
        # HBM to HBM: two slots may be bound to one tensor, so keep write's overlap check (store)
        sget, dget = _hbm_getter(src, slots), _hbm_getter(dst, slots)
        if sget is None or dget is None:
            return None
        hbm_float = src.dtype != dst.dtype and not (src.dtype in INT_DTYPES and dst.dtype in INT_DTYPES)
        (ks, src_slot), (kd, dst_slot) = slots[src.memory], slots[dst.memory]
        if ks == kd or hbm_float or src.shape != dst.shape:
            def step(h):
                v = sget(h)
                store(dst, dget(h), v.float() if hbm_float else v)
            return step
        src_bytes, dst_bytes = src_slot.nbytes, dst_slot.nbytes

        def step(h):
            # two slots bound to overlapping memory: write's overlap check (store) decides on a clone; apart (the
            # usual case), the copy store ends in, without its storage lookups
            s_ptr, d_ptr = h[ks].data_ptr(), h[kd].data_ptr()
            if s_ptr < d_ptr + dst_bytes and d_ptr < s_ptr + src_bytes:
                store(dst, dget(h), sget(h))
                return
            try:
                dget(h).copy_(sget(h))
            except RuntimeError as e:
                raise SimulatorError(f"{dst!r}: cannot write through this pattern: {e}") from None
        return step
    # prepare_cast goes through fp32 (a no-op for an fp32 source: .float() returns the tensor itself)
    to_float = (src.dtype != dst.dtype and src.dtype != torch.float32
                and not (src.dtype in INT_DTYPES and dst.dtype in INT_DTYPES))
    if src.on_chip and dst.on_chip:
        sv, dv = src.view(core), dst.view(core)
        if src.overlaps(dst):
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
