"""ScalarE: ``activation`` (a function of ``data * scale + bias``, with an optional reduction along the free dims) and
``activate2`` (NC-v4: two tensor-scalar stages, then the function)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable

import torch

from torchneuron.sim.instruction import CostInputs, Engine
from torchneuron.sim.memory import AP, SimulatorError, store
from torchneuron.sim.numerics import (ACTIVATIONS_OUT, REDUCE_IDENTITY, activation_buffer, activation_fn,
                                      activation_reader, alu_op, apply_activation, apply_alu, apply_reduce, as_scalar,
                                      compute_dtype, dtype_name, exp_buffers, exp_out, reduce_op)
from torchneuron.sim.isa.common import (FUSED_ALU_FN, Instr, Operand, Step, checked_reduce_cmd, column_view,
                                        disjoint_or_same, fused_into, fused_rhs, load_tile, matrix_view,
                                        planned_operand, step_scratch)


# ---- ScalarE activation ------------------------------------------------------------------------

def _identity_out(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """The identity activation written into ``out`` (fp32 to fp32: a bit copy, as execute's store)."""
    return out if x is out else out.copy_(x)


def engine_registers(core, engine: Engine, ap: AP) -> torch.Tensor:
    """The engine's per-lane fp32 accumulation registers for the lanes (partitions) of ``ap``."""
    return core.regs[engine][ap.start_partition:ap.start_partition + ap.partitions]


def _scalar_reduce_args(instr: Instr) -> None:
    """Resolve and check ``reduce_cmd`` / ``reduce_op`` of a ScalarE instruction (reduce_op defaults to add)."""
    instr._set("reduce_cmd", checked_reduce_cmd(instr.reduce_cmd))
    if instr.reduce_cmd == "load_reduce":
        raise instr._fail("reduce_cmd", f"load_reduce is not an {instr.opcode} command (idle/reset/reduce/reset_reduce)")
    if instr.reduce_op is None and instr.reduce_cmd in ("reduce", "reset_reduce"):
        instr._set("reduce_op", "add")
    if instr.reduce_op is not None:
        instr._set("reduce_op", reduce_op(instr.reduce_op))
        if instr.reduce_op not in ("add", "maximum", "minimum"):
            raise instr._fail("reduce_op", f"is {instr.reduce_op!r}; ScalarE reduces with add "
                                           f"(maximum/minimum on NC-v4)")


def reduce_into_registers(instr: Instr, core, engine: Engine, op: str, values: torch.Tensor, lanes: AP,
                          init=None) -> None:
    """Apply ``instr.reduce_cmd`` to the engine's registers for ``lanes`` with ``values``; then write the
    registers to ``instr.reduce_res`` if it is set (the instructions that read the registers out)."""
    regs = engine_registers(core, engine, lanes)
    accumulate_registers(regs, op, instr.reduce_cmd, values, init)
    if instr.reduce_res is not None:
        instr.reduce_res.write(core, regs)


def register_init(core, value: Operand | None):
    """A load_reduce initial value as read now: a (P,1) tile copied out in fp32 (an instruction may overwrite
    its memory before the registers load it), or the scalar itself."""
    return value.view(core).to(torch.float32, copy=True) if isinstance(value, AP) else value


def accumulate_registers(regs: torch.Tensor, op: str, cmd: str, values: torch.Tensor | None, init=None) -> None:
    """Apply reduce command ``cmd`` of ``op`` to the registers: reset or load them, then fold ``values`` in."""
    if cmd == "load_reduce":
        regs.copy_(init.reshape(-1) if isinstance(init, torch.Tensor) else torch.full_like(regs, init))
        cmd = "reduce"
    register_accumulator(regs, op, cmd, 0 if values is None else values.dim())(values)


# the fp32 reductions a reset_reduce writes into the registers (apply_reduce's, with out=); not maximum/minimum:
# torch.maximum(-inf, NaN) is a NaN of another payload than amax's
_REDUCE_INTO: dict[str, Callable] = {"add": torch.sum}


def register_accumulator(regs: torch.Tensor, op: str, cmd: str, ndim: int) -> Callable[[torch.Tensor | None], None]:
    """``accumulate_registers(regs, op, cmd, values)`` for ``values`` of ``ndim`` dims (not load_reduce), with its
    choices made once: reset the registers to op's identity, then fold in op's reduction of values over their free
    dims (written into the registers where torch has an out= form)."""
    reset, fold = cmd in ("reset", "reset_reduce"), cmd in ("reduce", "reset_reduce")
    identity, dims, into = REDUCE_IDENTITY[op], tuple(range(1, ndim)), FUSED_ALU_FN.get(op)
    reduce_into = _REDUCE_INTO.get(op) if reset and fold and dims else None

    def accumulate(values: torch.Tensor | None) -> None:
        if reduce_into is not None and values is not None and values.dtype == torch.float32:
            # 0.0 + the sum is the sum, bit for bit (never -0.0: torch adds the values to a +0.0; a NaN keeps its
            # payload): written straight into the registers
            reduce_into(values.flatten(1) if len(dims) > 1 else values, 1, out=regs)
            return
        if reset:
            regs.fill_(identity)
        if fold and values is not None:
            part = apply_reduce(op, values, dims).float() if dims else values.float()
            if into is not None:  # the operation written into the registers, without a temporary
                into(regs, part.reshape(-1), out=regs)
            else:
                regs.copy_(apply_alu(op, regs, part))
    return accumulate


def register_store(regs: torch.Tensor, res: AP | None, rv: torch.Tensor | None) -> Callable[[], None] | None:
    """A function writing the registers into ``res`` (its view ``rv``), as ``res.write(core, regs)`` does (the
    registers share no memory with SBUF/PSUM), or None without ``res``."""
    if res is None:
        return None
    if rv.numel() != regs.numel():
        raise SimulatorError(f"{res!r}: cannot write {tuple(regs.shape)} values into shape {res.shape}")
    src = regs.view(rv.shape)
    return lambda: rv.copy_(src)


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
        _scalar_reduce_args(self)
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
        # (bias is read after the scale was written into dst, so it must not be dst then)
        ok = (all(t.dtype == torch.float32 for t in tiles) and self.data.shape == self.dst.shape
              and disjoint_or_same(self.dst, self.data, self.scale, self.bias)
              and not (self._plan[1] is not None and self.bias == self.dst))
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
        x = load_tile(core, self.data, c)
        if scale is not None:
            x = x * planned_operand(core, scale, c, x.dim())
        if bias is not None:
            x = x + planned_operand(core, bias, c, x.dim())
        y = apply_activation(self.op, x)
        self.dst.write(core, y)
        self._reduce(core, y)

    def _planned_step(self, core) -> Step | None:
        """execute's unfused route (load, scale, bias, function, store, reduction) with its views resolved once,
        computed in a buffer the step owns (``activation_buffer``: apply_activation's evaluation, in place)."""
        c, scale, bias = self._plan
        xv, dv, dst = self.data.view(core), self.dst.view(core), self.dst
        n, nd = xv.numel(), xv.dim()
        if n == 0:
            return None
        columns = []
        for value in (scale, bias):
            if isinstance(value, AP):  # load_column's view, converted per run where its dtype is not c's
                v = column_view(core, value, nd)
                if v is None:
                    return None
                columns.append((v, v.dtype != c))
            else:
                columns.append((value, False))
        (s, s_conv), (b, b_conv) = columns
        accumulate, write_res = self._register_steps(core, xv.dim())
        if (self.op in ("identity", "copy") and scale is None and bias is None and self.data.dtype == c
                and accumulate is not None):
            identity = self._identity_step(core, xv, dv, write_res)
            if identity is not None:
                return identity

        def finish(y: torch.Tensor) -> None:  # the result (in a buffer of the step's) stored, then reduced
            store(dst, dv, y, may_alias=False)
            if accumulate is not None:
                accumulate(y)
            if write_res is not None:
                write_res()
        scratch = step_scratch(core)  # (buffers shared by the core's steps stay in the CPU's caches)
        reader = (activation_reader(self.op, n, c, scratch) if scale is None and bias is None and xv.dtype == c
                  else None)
        if reader is not None:
            return lambda h: finish(reader(xv))  # the function of the tile's view, without loading it
        buf, activate = activation_buffer(self.op, n, c, scratch)
        x = buf[:n].view(xv.shape)  # the loaded tile, contiguous: the layout apply_activation computes in

        def step(h):
            x.copy_(xv)  # (converting to c: exact, as xv.to(c))
            if scale is not None:
                torch.mul(x, s.to(c) if s_conv else s, out=x)
            if bias is not None:
                torch.add(x, b.to(c) if b_conv else b, out=x)
            finish(activate().view(xv.shape))
        return step

    def _identity_step(self, core, xv: torch.Tensor, dv: torch.Tensor, write_res: Callable | None) -> Step | None:
        """The identity of a tile in its compute dtype with a register reduction, without the loaded copy: the tile
        stored into dst (nothing where dst is the tile: that writes back the bits it read), then the reduction on
        the tile's rows (a sum along contiguous rows has the bits of the same sum on a contiguous copy); None where
        the rows are not contiguous or dst overlaps the tile otherwise."""
        rows = matrix_view(xv, xv.shape[0], xv.numel() // xv.shape[0])
        if rows is None or not (rows.stride(1) == 1 or rows.shape[1] == 1):
            return None
        dst, into_itself = self.dst, self.dst == self.data
        if not into_itself and dst.overlaps(self.data):
            return None
        accumulate = self._register_steps(core, 2)[0]

        def step(h):
            if not into_itself:  # dst shares no memory with the tile: the reduction below reads what it read
                store(dst, dv, xv, may_alias=False)
            accumulate(rows)
            if write_res is not None:
                write_res()
        return step

    def _register_steps(self, core, ndim: int) -> tuple[Callable | None, Callable | None]:
        """The register reduction of results of ``ndim`` dims (None without a reduce_cmd or reduce_res) and the
        write of the registers into reduce_res (None without it), their lookups done once."""
        if self.reduce_cmd == "idle" and self.reduce_res is None:
            return None, None
        regs = engine_registers(core, Engine.SCALAR, self.data)
        res = self.reduce_res
        return (register_accumulator(regs, self.reduce_op or "add", self.reduce_cmd, ndim),
                register_store(regs, res, None if res is None else res.view(core)))

    def step(self, core, slots) -> Step | None:
        fn = self._fused
        if fn is None:
            return self._planned_step(core)
        _, scale, bias = self._plan
        out, x = self.dst.view(core), self.data.view(core)
        if fn is exp_out:
            fn = exp_buffers()  # the same exp_out, its masks in buffers of the step
        nd = out.dim()
        s = None if scale is None else fused_rhs(core, scale, nd)
        b = None if bias is None else fused_rhs(core, bias, nd)
        if (scale is not None and s is None) or (bias is not None and b is None):
            return None
        accumulate, write_res = self._register_steps(core, nd)
        if s is None and b is None and accumulate is None:
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
            if accumulate is not None:  # execute's _reduce (reduce_into_registers) with its lookups done once
                accumulate(out)
                if write_res is not None:
                    write_res()
        return step

    def _execute_in_place(self, core, scale, bias) -> None:
        out, x = self.dst.view(core), self.data.view(core)
        nd = out.dim()
        if scale is not None:
            fused_into(out, torch.mul, x, planned_operand(core, scale, torch.float32, nd))
            x = out
        if bias is not None:
            fused_into(out, torch.add, x, planned_operand(core, bias, torch.float32, nd))
            x = out
        self._fused(x, out=out)
        self._reduce(core, out)

    def _reduce(self, core, y: torch.Tensor) -> None:
        if self.reduce_cmd != "idle" or self.reduce_res is not None:
            reduce_into_registers(self, core, Engine.SCALAR, self.reduce_op or "add", y, self.data)

    def price(self) -> CostInputs:
        n = self.data.numel
        flops = n * (1 + (isinstance(self.scale, AP) or self.scale != 1.0) + (self.bias is not None)
                     + (self.reduce_cmd in ("reduce", "reset_reduce")))
        ci = self._cost([self.data], self.dst, op=self.op, flops=flops)
        if self.reduce_res is not None:  # reading the registers out is a second ISA instruction
            ci = replace(ci, opcode="activation_reduce")
        return ci


_ACTIVATE2_OPS = (("multiply", "add"), ("multiply", "subtract"), ("multiply", "bypass"), ("add", "bypass"),
                  ("subtract", "bypass"), ("bypass", "bypass"))


@dataclass(frozen=True)
class Activate2(Instr):
    """``nisa.activate2`` (ScalarE, NC-v4): ``dst = op((data <op0> imm0) <op1> imm1)`` in fp32 for the six
    (op0, op1) pairs of scale/bias/subtract/bypass (``reverseN`` swaps an operator's inputs); ``op="prelu"``
    uses ``relu_param`` as the negative slope. ``reduce_cmd`` resets and/or accumulates ``reduce_op``
    (add/maximum/minimum) of the results in the ScalarE registers, read out into ``reduce_res``."""

    dst: AP
    op: str
    data: AP
    imm0: Operand
    imm1: Operand
    op0: str
    op1: str
    relu_param: Operand = 0.0
    reverse0: bool = False
    reverse1: bool = False
    reduce_op: str | None = None
    reduce_res: AP | None = None
    reduce_cmd: str = "idle"
    opcode = "activate2"
    engine = Engine.SCALAR
    WRITES = ("dst", "reduce_res")

    def check(self) -> None:
        op = getattr(self.op, "__name__", self.op)
        self._set("op", "prelu" if op == "prelu" else activation_fn(self.op))
        self._set("op0", "bypass" if self.op0 is None else alu_op(self.op0))
        self._set("op1", "bypass" if self.op1 is None else alu_op(self.op1))
        if (self.op0, self.op1) not in _ACTIVATE2_OPS:
            raise self._fail("op0/op1", f"are ({self.op0}, {self.op1}); supported pairs: {_ACTIVATE2_OPS}")
        if (self.reverse0 and self.op0 == "bypass") or (self.reverse1 and self.op1 == "bypass"):
            raise self._fail("reverse0/reverse1", "reverse an operator that is set, not bypass")
        if getattr(self.reduce_op, "__name__", self.reduce_op) in ("abs_max", "abs_min"):
            raise self._fail("reduce_op", f"is {self.reduce_op!r}: abs_max/abs_min register reductions are not "
                                          f"modelled (add, maximum, minimum are)")
        _scalar_reduce_args(self)
        self._tiles("data", "dst")
        self._same("data", "dst")
        for n in ("imm0", "imm1", "relu_param"):
            self._column(n)
        if isinstance(self.imm0, AP) and isinstance(self.imm1, AP) and self.imm0.dtype != self.imm1.dtype:
            raise self._fail("imm1", f"is {dtype_name(self.imm1.dtype)}; both tile immediates need one dtype")
        if self.reduce_res is not None:
            self._column("reduce_res")

    def execute(self, core) -> None:
        x = load_tile(core, self.data, torch.float32)
        nd = x.dim()
        for op, imm, rev in ((self.op0, self.imm0, self.reverse0), (self.op1, self.imm1, self.reverse1)):
            if op != "bypass":
                operand = imm if isinstance(imm, AP) else as_scalar(imm, torch.float32)
                v = planned_operand(core, operand, torch.float32, nd)
                x = apply_alu(op, v, x) if rev else apply_alu(op, x, v)
        if self.op == "prelu":
            slope = planned_operand(core, self.relu_param if isinstance(self.relu_param, AP)
                                    else as_scalar(self.relu_param, torch.float32), torch.float32, nd)
            y = torch.where(x > 0, x, x * slope)
        else:
            y = apply_activation(self.op, x)
        self.dst.write(core, y)
        if self.reduce_cmd != "idle" or self.reduce_res is not None:
            reduce_into_registers(self, core, Engine.SCALAR, self.reduce_op or "add", y, self.data)

    def price(self) -> CostInputs:
        stages = (self.op0 != "bypass") + (self.op1 != "bypass") + 1 + (self.reduce_cmd in ("reduce", "reset_reduce"))
        ci = self._cost([self.data], self.dst, op=self.op, flops=stages * self.data.numel)
        # reading the registers out is a second instruction, as for activation with reduce_res
        return replace(ci, opcode="activation_reduce") if self.reduce_res is not None else ci
