"""Selection and search instructions: predicated copies and selects (``tensor_copy_predicated``,
``select_reduce``, ``range_select``), segment bounds and nonzero indices (``sequence_bounds``,
``nonzero_with_count``, GpSimd), match-and-replace (``nc_match_replace8``, VectorE) and ``topk`` (GpSimd).

Comparisons run in fp32 as on the engines; the VectorE reductions share the per-lane registers of
``tensor_scalar_reduce`` (``core.regs[Engine.VECTOR]``)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from torchneuron.sim.instruction import CostInputs, Engine
from torchneuron.sim.memory import AP, store
from torchneuron.sim.numerics import INT_DTYPES, alu_op, apply_alu, as_scalar, dtype_name, reduce_op
from torchneuron.sim.isa.common import (COMPARE_OPS, MAX8_FMAX, MAX8_FMIN, Instr, Operand, Step, checked_reduce_cmd,
                                        load_column, load_tile, prepare_cast)
from torchneuron.sim.isa.scalar_engine import reduce_into_registers

FP32_MIN = -3.4028234663852886e38   # the only on_false_value range_select accepts (a hardware constraint)
UINT_PREDICATES = frozenset({torch.uint8, torch.uint16, torch.uint32})
SELECT_PREDICATES = frozenset({torch.int8, torch.uint8, torch.int16, torch.uint16})


def _flat(core, ap: AP, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return load_tile(core, ap, dtype, (ap.partitions, ap.free_elems))


def _vector_reduce(instr: Instr, core, values: torch.Tensor, lanes: AP) -> None:
    """Accumulate ``values`` into the VectorE registers per ``reduce_cmd``; write them to ``reduce_res`` if given."""
    reduce_into_registers(instr, core, Engine.VECTOR, instr.reduce_op, values, lanes)


def _max_only(instr: Instr) -> None:
    instr._set("reduce_cmd", checked_reduce_cmd(instr.reduce_cmd))
    instr._set("reduce_op", reduce_op(instr.reduce_op))
    if instr.reduce_op != "maximum":
        raise instr._fail("reduce_op", f"is {instr.reduce_op!r}; only maximum is supported")
    if instr.reduce_cmd == "load_reduce":
        raise instr._fail("reduce_cmd", "load_reduce is not a command of this instruction")
    if instr.reduce_res is not None:
        instr._column("reduce_res", of="dst")
        if not instr.reduce_res.dtype.is_floating_point:
            raise instr._fail("reduce_res", f"is {dtype_name(instr.reduce_res.dtype)}; it must be a float dtype")


@dataclass(frozen=True)
class TensorCopyPredicated(Instr):
    """``nisa.tensor_copy_predicated``: ``dst = src`` where ``predicate`` is nonzero (zero with
    ``reverse_pred``), ``dst`` unchanged elsewhere; ``src`` a tile of dst's dtype or a scalar (VectorE)."""

    dst: AP
    src: Operand
    predicate: AP
    reverse_pred: bool = False
    opcode = "tensor_copy_predicated"
    engine = Engine.VECTOR

    def check(self) -> None:
        self._tiles("dst", "predicate")
        self._same("dst", "predicate")
        if self.predicate.dtype not in UINT_PREDICATES:
            raise self._fail("predicate", f"is {dtype_name(self.predicate.dtype)}; it must be uint8, uint16 or uint32")
        if isinstance(self.src, AP):
            self._tiles("src")
            self._same("dst", "src")
            self._not_both_psum("src", "predicate")
            if self.src.dtype != self.dst.dtype:
                raise self._fail("src", f"is {dtype_name(self.src.dtype)}; it must have dst's dtype "
                                        f"{dtype_name(self.dst.dtype)}")
        elif not isinstance(self.src, (int, float)):
            raise self._fail("src", f"must be a tile or a number, got {type(self.src).__name__}")

    def execute(self, core) -> None:
        p, f = self.dst.partitions, self.dst.free_elems
        take = self.predicate.view(core).reshape(p, f) != 0
        if self.reverse_pred:
            take = ~take
        old = self.dst.view(core).reshape(p, f)
        if isinstance(self.src, AP):
            new = self.src.view(core).reshape(p, f)
        else:  # a scalar goes through the engine's fp32 and is cast to dst's dtype
            new = torch.tensor(as_scalar(self.src, torch.float32)).to(self.dst.dtype)
        self.dst.write(core, torch.where(take, new, old))

    def step(self, core, slots) -> Step | None:
        """``execute`` with the views looked up once, where a tile ``src`` and the predicate have dst's shape
        (the usual case; else None: execute reshapes them)."""
        if not isinstance(self.src, AP):
            return None
        dst, dv, sv, pv = self.dst, self.dst.view(core), self.src.view(core), self.predicate.view(core)
        if not dv.shape == sv.shape == pv.shape:
            return None
        reverse = self.reverse_pred

        def step(h):
            store(dst, dv, torch.where(pv == 0 if reverse else pv != 0, sv, dv), may_alias=False)
        return step

    def price(self) -> CostInputs:
        data = [self.src, self.predicate] if isinstance(self.src, AP) else [self.predicate]
        return self._cost(data, self.dst, main=self.predicate, flops=0)


@dataclass(frozen=True)
class SelectReduce(Instr):
    """``nisa.select_reduce``: ``dst = where(predicate, on_true, on_false)`` (``reverse_pred`` flips the
    predicate; ``on_false`` a scalar or (P,1) tile), with an optional per-lane maximum into the VectorE
    registers (``reduce_cmd``) read out into ``reduce_res``."""

    dst: AP
    predicate: AP
    on_true: AP
    on_false: Operand
    reduce_res: AP | None = None
    reduce_cmd: str = "idle"
    reduce_op: str = "maximum"
    reverse_pred: bool = False
    opcode = "select_reduce"
    engine = Engine.VECTOR
    WRITES = ("dst", "reduce_res")

    def check(self) -> None:
        self._tiles("dst", "predicate", "on_true")
        self._same("on_true", "dst")
        self._same("on_true", "predicate")
        self._not_both_psum("on_true", "predicate")
        if self.predicate.dtype not in SELECT_PREDICATES:
            raise self._fail("predicate", f"is {dtype_name(self.predicate.dtype)}; it must be int8, uint8, int16 "
                                          f"or uint16")
        if self.on_true.dtype in (torch.int32, torch.uint32):
            raise self._fail("on_true", f"is {dtype_name(self.on_true.dtype)}; int32/uint32 are not supported")
        self._column("on_false", of="on_true")
        _max_only(self)

    def execute(self, core) -> None:
        p, f = self.dst.partitions, self.dst.free_elems
        take = self.predicate.view(core).reshape(p, f) != 0
        if self.reverse_pred:
            take = ~take
        r = torch.where(take, _flat(core, self.on_true), load_column(core, self.on_false, torch.float32, 2))
        self.dst.write(core, r)
        if self.reduce_cmd != "idle" or self.reduce_res is not None:
            _vector_reduce(self, core, r, self.dst)

    def price(self) -> CostInputs:
        return self._cost([self.on_true, self.predicate], self.dst, main=self.on_true, op="select", flops=0)


@dataclass(frozen=True)
class RangeSelect(Instr):
    """``nisa.range_select``: keep ``on_true_tile[p, i]`` where ``comp_op0(range_start + i, bound0[p])`` and
    ``comp_op1(range_start + i, bound1[p])`` (fp32 compares; i the flattened free index), else
    ``on_false_value`` (FP32_MIN); the per-lane maximum goes to the VectorE registers (``reduce_cmd``)."""

    dst: AP
    on_true_tile: AP
    comp_op0: str
    comp_op1: str
    bound0: AP
    bound1: AP
    reduce_cmd: str = "reset_reduce"
    reduce_res: AP | None = None
    reduce_op: str = "maximum"
    range_start: int = 0
    on_false_value: float = FP32_MIN
    opcode = "range_select"
    engine = Engine.VECTOR
    WRITES = ("dst", "reduce_res")

    def check(self) -> None:
        for n in ("comp_op0", "comp_op1"):
            self._set(n, alu_op(getattr(self, n)))
            if getattr(self, n) not in COMPARE_OPS - {"not_equal"}:
                raise self._fail(n, f"is {getattr(self, n)!r}; expected equal, less, less_equal, greater or "
                                    f"greater_equal")
        self._tiles("dst", "on_true_tile")
        self._same("on_true_tile", "dst")
        if not self.on_true_tile.dtype.is_floating_point:
            raise self._fail("on_true_tile", f"is {dtype_name(self.on_true_tile.dtype)}; it must be a float dtype")
        for n in ("bound0", "bound1"):
            self._column(n, of="on_true_tile")
            if not isinstance(getattr(self, n), AP) or getattr(self, n).dtype != torch.float32:
                raise self._fail(n, "must be a float32 (P, 1) tile")
        if float(self.on_false_value) != FP32_MIN:
            raise self._fail("on_false_value", f"is {self.on_false_value}; the hardware requires FP32_MIN "
                                               f"({FP32_MIN:.8g})")
        if int(self.range_start) != self.range_start or not 0 <= self.range_start + self.dst.free_elems <= 1 << 24:
            raise self._fail("range_start", f"is {self.range_start}; range_start + index must be an integer "
                                            f"within 2**24 (fp32-exact)")
        _max_only(self)

    def execute(self, core) -> None:
        f = self.dst.free_elems
        idx = (torch.arange(f, dtype=torch.float32) + float(self.range_start)).unsqueeze(0)
        b0, b1 = (load_column(core, b, torch.float32, 2) for b in (self.bound0, self.bound1))
        keep = (apply_alu(self.comp_op0, idx.expand(b0.shape[0], f), b0) != 0) & (
            apply_alu(self.comp_op1, idx.expand(b1.shape[0], f), b1) != 0)
        r = torch.where(keep, _flat(core, self.on_true_tile), torch.tensor(FP32_MIN, dtype=torch.float32))
        self.dst.write(core, r)
        _vector_reduce(self, core, r, self.dst)

    def price(self) -> CostInputs:
        return self._cost([self.on_true_tile], self.dst, op=f"{self.comp_op0},{self.comp_op1}", flops=0)


@dataclass(frozen=True)
class SequenceBounds(Instr):
    """``nisa.sequence_bounds`` (GpSimd): for segment ids ``[1, n]`` (0 = padding), ``dst[0, 0, i]`` is the
    first index of i's segment and ``dst[0, 1, i]`` one past its last (padding: n and -1); a segment is a
    run of equal ids."""

    dst: AP
    segment_ids: AP
    opcode = "sequence_bounds"
    engine = Engine.GPSIMD

    def check(self) -> None:
        self._tiles("dst", "segment_ids")
        for n in ("dst", "segment_ids"):
            ap = getattr(self, n)
            if ap.partitions != 1:
                raise self._fail(n, f"spans {ap.partitions} partitions; sequence_bounds works on 1")
            if ap.dtype not in (torch.float32, torch.int32):
                raise self._fail(n, f"is {dtype_name(ap.dtype)}; it must be float32 or int32")
        self._free("dst", 2 * self.segment_ids.free_elems, "dst holds (start, end) for every segment id")

    def execute(self, core) -> None:
        ids = _flat(core, self.segment_ids, torch.float64)[0]
        n = ids.numel()
        pad = ids == 0
        new_run = torch.ones(n, dtype=torch.bool)
        new_run[1:] = ids[1:] != ids[:-1]
        run = torch.cumsum(new_run.to(torch.int64), 0) - 1          # run number of each element
        starts = torch.nonzero(new_run).reshape(-1)                  # first index of each run
        ends = torch.cat([starts[1:], torch.tensor([n])])            # one past its last
        lo = torch.where(pad, torch.tensor(n), starts[run]).to(torch.float64)
        hi = torch.where(pad, torch.tensor(-1), ends[run]).to(torch.float64)
        self.dst.write(core, torch.stack([lo, hi]).reshape(1, 2 * n))

    def price(self) -> CostInputs:
        return self._cost([self.segment_ids], self.dst, flops=0)


@dataclass(frozen=True)
class NonzeroWithCount(Instr):
    """``nisa.nonzero_with_count`` (GpSimd, NC-v3+): on SBUF partitions 0, 16, ..., 112 only (the row each
    GpSimd core owns), ``dst[p] = [indices of nonzero src[p] + index_offset, padding_val..., count]``;
    other partitions of dst are left unchanged."""

    dst: AP
    src: AP
    index_offset: int = 0
    padding_val: int = -1
    opcode = "nonzero_with_count"
    engine = Engine.GPSIMD

    def check(self) -> None:
        self._tiles("dst", "src")
        if self.src.dtype not in (torch.float32, torch.int32):
            raise self._fail("src", f"is {dtype_name(self.src.dtype)}; it must be float32 or int32")
        if self.dst.dtype != torch.int32:
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; it must be int32")
        if self.dst.partitions != self.src.partitions:
            raise self._fail("dst", f"has {self.dst.partitions} partitions; src has {self.src.partitions}")
        self._free("dst", self.src.free_elems + 1, "dst has one more element than src (the count)")
        for n in ("index_offset", "padding_val"):
            if not -2**31 <= int(getattr(self, n)) < 2**31 or int(getattr(self, n)) != getattr(self, n):
                raise self._fail(n, f"is {getattr(self, n)}; it must be an int32")

    def execute(self, core) -> None:
        src = self.src.view(core).reshape(self.src.partitions, -1)
        out = self.dst.view(core).reshape(self.dst.partitions, -1).clone()
        t = src.shape[1]
        for row in range(self.src.partitions):
            if (self.src.start_partition + row) % 16:
                continue  # only the first partition of each GpSimd core's 16
            nz = torch.nonzero(src[row] != 0).reshape(-1)
            out[row].fill_(int(self.padding_val))
            out[row, :nz.numel()] = (nz + int(self.index_offset)).to(torch.int32)
            out[row, t] = nz.numel()
        self.dst.write(core, out)

    def price(self) -> CostInputs:
        return self._cost([self.src], self.dst, flops=0)


@dataclass(frozen=True)
class NcMatchReplace8(Instr):
    """``nisa.nc_match_replace8`` (VectorE): per partition, for each of the 8 ``vals`` taken in reverse order
    (7 down to 0), the first element of ``data`` still equal to it (fp32 compare) is replaced by ``imm``
    and its index written to ``dst_idx`` (0 when absent: the hardware leaves it undefined)."""

    dst: AP
    data: AP
    vals: AP
    imm: float
    dst_idx: AP | None = None
    opcode = "nc_match_replace8"
    engine = Engine.VECTOR
    WRITES = ("dst", "dst_idx")

    def check(self) -> None:
        self._tiles("dst", "data", "vals")
        self._same("data", "dst")
        f = self.data.free_elems
        if not MAX8_FMIN <= f <= MAX8_FMAX:
            raise self._fail("data", f"has {f} elements per partition; the range is [{MAX8_FMIN}, {MAX8_FMAX}]")
        if self.vals.partitions != self.data.partitions:
            raise self._fail("vals", f"has {self.vals.partitions} partitions; data has {self.data.partitions}")
        self._free("vals", 8, "it must have 8")
        if self.dst_idx is not None:
            self._tiles("dst_idx")
            if self.dst_idx.partitions != self.data.partitions:
                raise self._fail("dst_idx", f"has {self.dst_idx.partitions} partitions; data has "
                                            f"{self.data.partitions}")
            self._free("dst_idx", 8, "it must have 8")
            if self.dst_idx.dtype not in INT_DTYPES or self.dst_idx.dtype == torch.bool:
                raise self._fail("dst_idx", f"is {dtype_name(self.dst_idx.dtype)}; indices need an integer dtype")

    def execute(self, core) -> None:
        # copies: x is rewritten below, and neither data nor vals (which may share its memory) may change
        x = _flat(core, self.data).clone()
        v = _flat(core, self.vals).clone()
        p, f = x.shape
        imm = as_scalar(self.imm, torch.float32)
        idx = torch.zeros(p, 8, dtype=torch.int64)
        rows = torch.arange(p)
        for i in range(7, -1, -1):  # reverse order: duplicates pair with ascending positions from the top slot
            hit = x == v[:, i:i + 1]
            found = hit.any(1)
            first = hit.to(torch.uint8).argmax(1)
            idx[:, i] = torch.where(found, first, 0)
            x[rows[found], first[found]] = imm
        self.dst.write(core, prepare_cast(x, self.dst.dtype))
        if self.dst_idx is not None:
            self.dst_idx.write(core, idx)

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst, flops=0)


TOPK_GROUP = 16  # partitions of one top-k snake (one GpSimd core)


@dataclass(frozen=True)
class TopK(Instr):
    """``nisa.topk`` (GpSimd, SBUF): per group of 16 partitions, the ``n`` bf16 values of the group's snake
    (snake position ``s`` is ``src[16 g + s % 16, s // 16]``) give their K largest (K = ``val_dst``'s elements
    per partition), in ascending order, written as a snake too: output position ``q`` is
    ``[16 g + q % 16, q // 16]`` of ``val_dst`` (values) and ``idx_dst`` (their snake positions, uint32).
    Positions from K on are left unchanged. Equal values take the lower snake position first (the hardware's
    order among equal values, and its output order in general, is not published)."""

    val_dst: AP
    idx_dst: AP
    src: AP
    n: int
    opcode = "topk"
    engine = Engine.GPSIMD
    WRITES = ("val_dst", "idx_dst")

    def check(self) -> None:
        self._tiles("val_dst", "idx_dst", "src")
        if self.src.dtype != torch.bfloat16 or self.val_dst.dtype != torch.bfloat16:
            raise self._fail("src/val_dst", "must be bfloat16")
        if self.idx_dst.dtype != torch.uint32:
            raise self._fail("idx_dst", f"is {dtype_name(self.idx_dst.dtype)}; it must be uint32")
        p = self.src.partitions
        if p % TOPK_GROUP or any(getattr(self, n).partitions != p for n in ("val_dst", "idx_dst")):
            raise self._fail("src", f"spans {p} partitions; src, val_dst and idx_dst span the same multiple of "
                                    f"{TOPK_GROUP}")
        self._same("val_dst", "idx_dst")
        k, n = self.val_dst.free_elems, int(self.n)
        if not 8 <= n < 65536:
            raise self._fail("n", f"is {n}; the range is [8, 65536)")
        if not 1 <= k < 32768 or k > n:
            raise self._fail("val_dst", f"asks for K = {k} values; 1 <= K < 32768 and K <= n ({n})")
        if self.src.free_elems < -(-n // TOPK_GROUP):
            raise self._fail("src", f"has {self.src.free_elems} columns; a snake of {n} needs {-(-n // TOPK_GROUP)}")

    def execute(self, core) -> None:
        p, k, n = self.src.partitions, self.val_dst.free_elems, int(self.n)
        groups = p // TOPK_GROUP
        src = self.src.view(core).reshape(groups, TOPK_GROUP, -1).float()
        snake = src.transpose(1, 2).reshape(groups, -1)[:, :n]            # snake position s = p + 16 c
        order = torch.sort(snake, dim=1, descending=True, stable=True).indices[:, :k]
        top = torch.gather(snake, 1, order)
        asc = torch.flip(top, [1])                                          # the K largest, ascending
        pos = torch.flip(order, [1])
        rows = (torch.arange(k) % TOPK_GROUP) + TOPK_GROUP * torch.arange(groups)[:, None]
        cols = (torch.arange(k) // TOPK_GROUP).expand(groups, k)
        vals = self.val_dst.view(core).reshape(p, -1).clone()
        idx = self.idx_dst.view(core).reshape(p, -1).to(torch.int64)
        vals[rows, cols] = asc.to(vals.dtype)
        idx[rows, cols] = pos
        self.val_dst.write(core, vals)
        self.idx_dst.write(core, idx)

    def price(self) -> CostInputs:
        # ISA: 4 n + K GpSimd cycles; carried as the elements per partition of the cost
        ci = self._cost([self.src], self.val_dst, flops=0)
        return replace(ci, free_elems=4 * int(self.n) + self.val_dst.free_elems)
