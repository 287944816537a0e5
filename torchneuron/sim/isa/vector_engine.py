"""Element-wise, reduction, scan and statistics instructions (VectorE; the element-wise ones also on ScalarE and
GpSimd): ``tensor_copy``, ``tensor_tensor``, ``tensor_scalar``, ``scalar_tensor_tensor``, ``reciprocal``, the
reductions and scans, ``bn_stats`` / ``bn_aggr``, ``max8`` / ``nc_find_index8``."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import torch

from torchneuron.sim.instruction import CostInputs, Engine
from torchneuron.sim.memory import AP, store
from torchneuron.sim.numerics import (BITVEC_OPS, FRACTIONAL_OPS, REDUCE_OPS, UNARY_ALU_OPS, alu_op, apply_alu,
                                      apply_reduce, as_scalar, compute_dtype, dtype_name, reduce_op)
from torchneuron.sim.isa.common import (BN_STATS_FMAX, FUSED_ALU_FN, FUSED_DTYPES, FUSED_OPS, MAX8_FMAX, MAX8_FMIN,
                                        Instr, Operand, Step, apply_ordered, checked_reduce_cmd, copy_step,
                                        disjoint_or_same, fused_into, fused_rhs, has_fractional, load_column, load_tile,
                                        matrix_view, operand_dtypes, planned_alu_step, planned_operand, prepare_cast)
from torchneuron.sim.isa.scalar_engine import (accumulate_registers, engine_registers, reduce_into_registers,
                                               register_init)


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
        self.dst.write(core, prepare_cast(self.src.view(core), self.dst.dtype))

    def step(self, core, slots) -> Step | None:
        return copy_step(core, self.dst, self.src, slots)

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
        # torch's fp32/bf16/fp16 kernels for these ops compute in fp32 and round once, to the operands'
        # promoted dtype, then cast to out=: exactly the engine's semantics (one rounding, to dst) only when
        # that dtype is fp32 or dst's own; two bf16 operands into an fp32 dst would be rounded to bf16 first
        return (self.op in FUSED_OPS and self.data1.shape == self.data2.shape == self.dst.shape
                and {self.data1.dtype, self.data2.dtype, self.dst.dtype} <= FUSED_DTYPES
                # only after the dtype check: torch cannot promote uint32 with int32 (int64 word kernels)
                and torch.promote_types(self.data1.dtype, self.data2.dtype) in (torch.float32, self.dst.dtype)
                and disjoint_or_same(self.dst, self.data1, self.data2))

    def execute(self, core) -> None:
        if self._fused:
            fused_into(self.dst.view(core), FUSED_ALU_FN[self.op], self.data1.view(core), self.data2.view(core))
            return
        c = compute_dtype(self.data1.dtype, self.data2.dtype, fractional=self.op in FRACTIONAL_OPS)
        shape = self.data1.shape
        a = load_tile(core, self.data1, c)
        b = load_tile(core, self.data2, c, shape)
        self.dst.write(core, apply_alu(self.op, a, b))

    def step(self, core, slots) -> Step | None:
        if not self._fused:
            return planned_alu_step(core, self.dst, self.data1, [(self.op, self.data2, False, False)],
                                    compute_dtype(self.data1.dtype, self.data2.dtype,
                                                  fractional=self.op in FRACTIONAL_OPS))
        fn, out, a, b = FUSED_ALU_FN[self.op], self.dst.view(core), self.data1.view(core), self.data2.view(core)
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
        fractional = bool(FRACTIONAL_OPS & {self.op0, self.op1}) or has_fractional(self.operand0, self.operand1)
        c = compute_dtype(self.data.dtype, *operand_dtypes(self.operand0, self.operand1), fractional=fractional)
        scalar = lambda v: v if isinstance(v, AP) else as_scalar(0 if v is None else v, c)  # noqa: E731
        return c, scalar(self.operand0), scalar(self.operand1)

    @cached_property
    def _fused(self) -> bool:
        # all-fp32 with plain (not reversed) arithmetic: op0 straight into dst, op1 in place there; so operand1
        # must not be dst, which op0 has overwritten by the time op1 reads it
        tiles = [v for v in (self.data, self.dst, self.operand0, self.operand1) if isinstance(v, AP)]
        return (all(t.dtype == torch.float32 for t in tiles) and self.data.shape == self.dst.shape
                and {self.op0, self.op1} <= FUSED_OPS | {None} and not self.reverse0 and not self.reverse1
                and disjoint_or_same(self.dst, self.data, self.operand0, self.operand1)
                and not (self.op1 is not None and self.operand1 == self.dst))

    def execute(self, core) -> None:
        c, operand0, operand1 = self._plan
        if self._fused:
            out = self.dst.view(core)
            nd = out.dim()
            fused_into(out, FUSED_ALU_FN[self.op0], self.data.view(core), planned_operand(core, operand0, c, nd))
            if self.op1 is not None:
                fused_into(out, FUSED_ALU_FN[self.op1], out, planned_operand(core, operand1, c, nd))
            return
        x = load_tile(core, self.data, c)
        r = apply_ordered(self.op0, x, planned_operand(core, operand0, c, x.dim()), self.reverse0)
        if self.op1 is not None:
            r = apply_ordered(self.op1, r, planned_operand(core, operand1, c, x.dim()), self.reverse1)
        self.dst.write(core, r)

    def step(self, core, slots) -> Step | None:
        if not self._fused:
            c, operand0, operand1 = self._plan
            ops = [(self.op0, operand0, self.reverse0, True)]
            if self.op1 is not None:
                ops.append((self.op1, operand1, self.reverse1, True))
            return planned_alu_step(core, self.dst, self.data, ops, c)
        _, operand0, operand1 = self._plan
        out, x = self.dst.view(core), self.data.view(core)
        fn0, r0 = FUSED_ALU_FN[self.op0], fused_rhs(core, operand0, out.dim())
        if r0 is None:
            return None
        if self.op1 is None:
            return lambda h: fn0(x, r0, out=out)
        fn1, r1 = FUSED_ALU_FN[self.op1], fused_rhs(core, operand1, out.dim())
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

    @cached_property
    def _compute(self) -> torch.dtype:
        return compute_dtype(self.data.dtype, self.operand1.dtype, *operand_dtypes(self.operand0),
                             fractional=bool(FRACTIONAL_OPS & {self.op0, self.op1}) or has_fractional(self.operand0))

    def execute(self, core) -> None:
        c = self._compute
        x = load_tile(core, self.data, c)
        t = apply_ordered(self.op0, x, load_column(core, self.operand0, c, x.dim()), self.reverse0)
        self.dst.write(core, apply_ordered(self.op1, t, load_tile(core, self.operand1, c, x.shape), self.reverse1))

    def step(self, core, slots) -> Step | None:
        c = self._compute
        operand0 = self.operand0 if isinstance(self.operand0, AP) else as_scalar(self.operand0, c)  # as load_column
        return planned_alu_step(core, self.dst, self.data, [(self.op0, operand0, self.reverse0, True),
                                                            (self.op1, self.operand1, self.reverse1, False)], c)

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
        self.dst.write(core, torch.reciprocal(load_tile(core, self.data, c)))

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, op="reciprocal")



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
        x = load_tile(core, self.data, compute_dtype(self.data.dtype))
        r = apply_reduce(self.op, x, self.axis)
        self.dst.write(core, -r if self.negate else r)

    def step(self, core, slots) -> Step | None:
        c, xv, dv, dst = compute_dtype(self.data.dtype), self.data.view(core), self.dst.view(core), self.dst
        into = self._reduce_into(xv, dv)
        if into is not None:
            return into
        fn, axis, negate, convert = REDUCE_OPS[self.op], self.axis, self.negate, self.data.dtype != c

        # the result is a new tensor unless a bitwise fold of one element returns a view of the data
        alias = not convert and self.op.startswith("bitwise")

        def step(h):
            r = fn(xv.to(c) if convert else xv, axis)
            store(dst, dv, -r if negate else r, may_alias=alias)
        return step

    def _reduce_into(self, xv: torch.Tensor, dv: torch.Tensor) -> Step | None:
        """The fp32 sum/max/min over contiguous trailing elements written straight into dst (negated there), without
        the result's temporary and its copy; None where that is not the step's. The same bits: torch reduces each
        output's contiguous run by itself (the kernel's inner reduction) whatever the output's layout, here one
        ordered like the temporary's."""
        fn = _REDUCE_INTO.get(self.op)
        if fn is None or xv.dtype != torch.float32 or dv.dtype != torch.float32 or self.dst.overlaps(self.data):
            return None
        first = self.axis[0]
        x = xv.flatten(first) if xv.dim() > first + 1 else xv  # the reduced dims merged, as apply_reduce does
        if x.stride(-1) != 1 and x.shape[-1] > 1:
            return None
        try:
            out = dv.view(x.shape[:-1])
        except RuntimeError:
            return None
        big = [st for st, size in zip(out.stride(), out.shape) if size > 1]
        if x.data_ptr() != xv.data_ptr() or any(a <= b for a, b in zip(big, big[1:])):
            return None  # a copy of the data (not a view), or an output ordered unlike a contiguous temporary
        if self.negate:
            def negated(h):
                fn(x, -1, out=out)
                out.neg_()
            return negated
        return lambda h: fn(x, -1, out=out)

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, op=self.op)


# the fp32 reductions TensorReduce writes straight into dst (REDUCE_OPS' with out=)
_REDUCE_INTO: dict[str, Callable] = {"add": torch.sum, "maximum": torch.amax, "minimum": torch.amin}


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
        x = load_tile(core, self.data, compute_dtype(self.data.dtype))
        self.dst.write(core, apply_reduce(self.op, x, (0,)))

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, op=self.op)


@dataclass(frozen=True)
class TensorScalarReduce(Instr):
    """``nisa.tensor_scalar_reduce``: ``dst = data <op0> operand0`` and the VectorE registers reduce the
    result over the free dims with ``reduce_op`` (add/multiply/maximum/minimum), written to
    ``reduce_res`` ((P,1); negated with ``reduce_res_negate``; None keeps it in the registers).
    ``reduce_cmd``: reset_reduce, reduce or load_reduce (from ``reduce_init``)."""

    dst: AP
    data: AP
    op0: str
    operand0: Operand
    reduce_op: str
    reduce_res: AP | None
    reverse0: bool = False
    reduce_cmd: str = "reset_reduce"
    reduce_init: Operand | None = None
    reduce_res_negate: bool = False
    opcode = "tensor_scalar_reduce"
    engine = Engine.VECTOR
    WRITES = ("dst", "reduce_res")

    def check(self) -> None:
        self._set("op0", alu_op(self.op0))
        self._set("reduce_op", reduce_op(self.reduce_op))
        self._set("reduce_cmd", checked_reduce_cmd(self.reduce_cmd))
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
        c = compute_dtype(self.data.dtype, *operand_dtypes(self.operand0),
                          fractional=self.op0 in FRACTIONAL_OPS or has_fractional(self.operand0))
        x = load_tile(core, self.data, c)
        r = apply_ordered(self.op0, x, load_column(core, self.operand0, c, x.dim()), self.reverse0)
        init = register_init(core, self.reduce_init)  # read before dst is written: the two may share memory
        self.dst.write(core, r)
        regs = engine_registers(core, Engine.VECTOR, self.data)
        accumulate_registers(regs, self.reduce_op, self.reduce_cmd, r, init)
        if self.reduce_res is not None:  # None keeps the result in the registers only
            self.reduce_res.write(core, -regs if self.reduce_res_negate else regs)

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
        c = compute_dtype(self.data0.dtype, self.data1.dtype, *operand_dtypes(self.initial),
                          fractional=bool(FRACTIONAL_OPS & {self.op0, self.op1}) or has_fractional(self.initial))
        a = load_tile(core, self.data0, c, (p, f))
        b = load_tile(core, self.data1, c, (p, f))
        init = load_column(core, self.initial, c, 1)
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



# ---- statistics, top-8 -------------------------------------------------------------------------

def bn_stats_fn(x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """A function writing bn_stats of fp32 ``x`` [P, F] into ``out`` [P, 6] (its views and the deviations' buffer
    made now, once): per partition the count, the mean and the sum of squared deviations from it of the even, then
    of the odd elements. The counts (and an empty half's zeros) are written now: ``out`` stays the function's.
    ``out`` must not overlap ``x``: each mean is read back from it."""
    p, f = x.shape
    sizes = ((f + 1) // 2, f // 2)
    dev = torch.empty(p, 2, sizes[0])  # each half's deviations in contiguous rows, as a fresh [P, n] tensor has
    for k, n in enumerate(sizes):
        out[:, 3 * k].fill_(float(n))
        if not n:  # an empty half (one element per partition): mean and m2 are zeros
            out[:, 3 * k + 1:3 * k + 3].fill_(0.0)
    if f % 2 == 0:
        return _bn_stats_pairs(x, out, dev)
    halves = [(x[:, k::2], out[:, 3 * k + 1], out[:, 3 * k + 1:3 * k + 2], out[:, 3 * k + 2], dev[:, k, :n])
              for k, n in enumerate(sizes) if n]

    def run() -> None:
        for half, mean_col, mean, m2_col, d in halves:
            torch.mean(half, 1, out=mean_col)
            torch.sum(torch.sub(half, mean, out=d).pow_(2), 1, out=m2_col)
    return run


def _bn_stats_pairs(x: torch.Tensor, out: torch.Tensor, dev: torch.Tensor) -> Callable[[], None]:
    """bn_stats_fn's run for an even F: both halves at once, each torch call on (even, odd) pairs. The same bits as
    one half at a time: a sum over the pairs' axis reduces each half's elements in the order it reduces them alone
    (a strided row sum for the means, a contiguous one for the deviations), the subtraction and square are exact
    element by element."""
    pairs, means, m2s = x.unflatten(1, (-1, 2)), out[:, 1::3], out[:, 2::3]  # [P, F/2, 2], [P, 2], [P, 2]
    dev_pairs, pair_means = dev.transpose(1, 2), means.unsqueeze(1)

    def run() -> None:
        torch.mean(pairs, 1, out=means)
        torch.sub(pairs, pair_means, out=dev_pairs)
        torch.sum(dev.pow_(2), 2, out=m2s)
    return run


def bn_aggr_fn(x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """A function writing bn_aggr of fp32 ``x`` [P, 3G] ((count, mean, m2) triples) into ``out`` [P, 2] (its views
    made now, once): per partition the mean of the groups and their pooled variance (within-group m2 plus the
    groups' spread about the mean, over the total count). ``out`` must not overlap ``x``: the mean is read back
    from it."""
    g = x.reshape(x.shape[0], -1, 3)
    n, mean, m2 = g[..., 0], g[..., 1], g[..., 2]
    mu_col, var_col = out[:, 0], out[:, 1]
    mu = mu_col[:, None]

    def run() -> None:
        total = n.sum(1)
        torch.div((n * mean).sum(1), total, out=mu_col)
        spread = (mean - mu).pow_(2).mul_(n).sum(1)
        torch.div(m2.sum(1).add_(spread), total, out=var_col)
    return run


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
        p = self.data.partitions
        out = torch.empty(p, 6)
        bn_stats_fn(load_tile(core, self.data, torch.float32, (p, self.data.free_elems)), out)()
        self.dst.write(core, out)

    def step(self, core, slots) -> Step | None:
        """execute's bn_stats_fn on the tile's view, written straight into dst, with the views and the
        deviations' buffer made once; None where dst overlaps data (execute reads all of data first)."""
        p, f = self.data.partitions, self.data.free_elems
        xv, dv = matrix_view(self.data.view(core), p, f), matrix_view(self.dst.view(core), p, 6)
        if xv is None or dv is None or self.dst.overlaps(self.data):
            return None
        return _statistics_step(bn_stats_fn, xv, dv)

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
        out = torch.empty(p, 2)
        bn_aggr_fn(load_tile(core, self.data, torch.float32, (p, self.data.free_elems)), out)()
        self.dst.write(core, out)

    def step(self, core, slots) -> Step | None:
        """execute's bn_aggr_into on the tile's view, written straight into dst; None where dst overlaps data."""
        p = self.data.partitions
        xv, dv = matrix_view(self.data.view(core), p, self.data.free_elems), matrix_view(self.dst.view(core), p, 2)
        if xv is None or dv is None or self.dst.overlaps(self.data):
            return None
        return _statistics_step(bn_aggr_fn, xv, dv)

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, flops=4 * self.data.numel)


def _statistics_step(make, xv: torch.Tensor, dv: torch.Tensor) -> Step:
    """The step of ``make(x, out)`` (bn_stats_fn, bn_aggr_fn) from the data view ``xv`` to the dst view
    ``dv``: data converted to fp32 in a buffer where it is not fp32; the statistics computed into a contiguous
    fp32 buffer (torch's reductions write strided SBUF columns slowly, and the statistics read their means back in
    fp32), then stored with dst's rounding, as execute's write does."""
    x = xv if xv.dtype == torch.float32 else torch.empty(xv.shape)
    out = torch.empty(dv.shape)
    run = make(x, out)
    if x is xv:
        def step(h):
            run()
            dv.copy_(out)
        return step

    def step(h):
        x.copy_(xv)  # (exact, as xv.to(torch.float32))
        run()
        dv.copy_(out)
    return step


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
        x = load_tile(core, self.src, torch.float32, (self.src.partitions, self.src.free_elems))
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
        x = load_tile(core, self.data, torch.float32, (p, self.data.free_elems))
        v = load_tile(core, self.vals, torch.float32, (p, 8))
        hit = (x.unsqueeze(1) == v.unsqueeze(2)).to(torch.uint8)
        self.dst.write(core, hit.argmax(2))  # argmax returns the first maximal index

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst)


# ---- cumulative and exponential (VectorE accumulation registers) ---------------------------------

_CUMULATIVE_OPS = ("add", "subtract", "multiply", "maximum", "minimum")
_CUMULATIVE_RESET = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -math.inf, "minimum": math.inf}


@dataclass(frozen=True)
class TensorScalarCumulative(Instr):
    """``nisa.tensor_scalar_cumulative``: per partition, along the flattened free dim,
    ``reg = op1(op0(src[i], imm0), reg); dst[i] = reg`` in fp32 with the VectorE register as the running
    value (``reduce_cmd``: reset_reduce starts from op1's identity, reduce from the register, load_reduce
    from ``imm1``)."""

    dst: AP
    src: AP
    op0: str
    op1: str
    imm0: Operand
    imm1: Operand | None = None
    reduce_cmd: str = "reset_reduce"
    opcode = "tensor_scalar_cumulative"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._set("op0", alu_op(self.op0))
        self._set("op1", alu_op(self.op1))
        self._set("reduce_cmd", checked_reduce_cmd(self.reduce_cmd))
        if self.op0 in BITVEC_OPS:
            raise self._fail("op0", f"{self.op0!r} is a bitvec operator; op0 must be arithmetic")
        if self.op1 not in _CUMULATIVE_OPS:
            raise self._fail("op1", f"is {self.op1!r}; the cumulative operator is one of {_CUMULATIVE_OPS}")
        if self.reduce_cmd not in ("reset_reduce", "reduce", "load_reduce"):
            raise self._fail("reduce_cmd", f"is {self.reduce_cmd!r}; expected reset_reduce, reduce or load_reduce")
        if (self.reduce_cmd == "load_reduce") != (self.imm1 is not None):
            raise self._fail("imm1", "is the initial value of reduce_cmd=load_reduce, required then and only then")
        self._tiles("src", "dst")
        self._same("src", "dst")
        for n in ("src", "dst"):
            if getattr(self, n).dtype in (torch.int32, torch.uint32):
                raise self._fail(n, f"is {dtype_name(getattr(self, n).dtype)}; int32/uint32 are not supported")
        self._column("imm0", of="src")
        self._column("imm1", of="src")

    def execute(self, core) -> None:
        p, f = self.src.partitions, self.src.free_elems
        x = load_tile(core, self.src, torch.float32, (p, f))
        v = apply_alu(self.op0, x, load_column(core, self.imm0, torch.float32, 2))
        regs = engine_registers(core, Engine.VECTOR, self.src)
        if self.reduce_cmd == "reset_reduce":
            regs.fill_(_CUMULATIVE_RESET[self.op1])
        elif self.reduce_cmd == "load_reduce":
            init = load_column(core, self.imm1, torch.float32, 1)
            regs.copy_(init.reshape(-1) if isinstance(init, torch.Tensor) else torch.full_like(regs, init))
        out = torch.empty(p, f)
        reg = regs.clone()
        for i in range(f):  # sequential on purpose: every step rounds to fp32 as the engine does
            reg = apply_alu(self.op1, v[:, i], reg)
            out[:, i] = reg
        regs.copy_(reg)
        self.dst.write(core, out)

    def price(self) -> CostInputs:
        return self._cost([self.src], self.dst, op=f"{self.op0},{self.op1}", flops=2 * self.src.numel)


@dataclass(frozen=True)
class Exponential(Instr):
    """``nisa.exponential`` (VectorE, NC-v4): ``dst = exp(src - max_value)`` in fp32 (``max_value`` a scalar
    or (P,1) tile); ``reduce_cmd`` sums the results into the VectorE registers (load_reduce starts from
    ``reduce_init``), read out into ``reduce_res`` when given."""

    dst: AP
    src: AP
    max_value: Operand = 0.0
    reduce_res: AP | None = None
    reduce_cmd: str = "idle"
    reduce_init: Operand = 0.0
    opcode = "exponential"
    engine = Engine.VECTOR
    WRITES = ("dst", "reduce_res")

    def check(self) -> None:
        self._set("reduce_cmd", checked_reduce_cmd(self.reduce_cmd))
        self._tiles("src", "dst")
        self._same("src", "dst")
        self._column("max_value", of="src")
        self._column("reduce_init", of="src")
        if self.reduce_res is not None:
            self._column("reduce_res", of="src")
        if self.reduce_cmd != "load_reduce" and not (not isinstance(self.reduce_init, AP) and self.reduce_init == 0):
            raise self._fail("reduce_init", "must be unset (0.0) unless reduce_cmd is load_reduce")

    def execute(self, core) -> None:
        x = load_tile(core, self.src, torch.float32)
        y = torch.exp(x - load_column(core, self.max_value, torch.float32, x.dim()))
        init = register_init(core, self.reduce_init)  # read before dst is written: the two may share memory
        self.dst.write(core, y)
        if self.reduce_cmd != "idle" or self.reduce_res is not None:
            reduce_into_registers(self, core, Engine.VECTOR, "add", y, self.src, init)

    def price(self) -> CostInputs:
        return self._cost([self.src], self.dst, op="exp", flops=2 * self.src.numel)
