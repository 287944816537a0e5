"""GpSimd instructions: generators and selection (``iota``, ``memset``, ``affine_select``) and random numbers
(``rng``, ``set_rng_seed``, ``rand2``, ``dropout``, ``rand_get_state`` / ``rand_set_state``)."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property

import torch

from torchneuron.sim.instruction import CostInputs, Engine
from torchneuron.sim.memory import AP, store
from torchneuron.sim.numerics import INT_DTYPES, alu_op, apply_alu, as_scalar, dtype_name
from torchneuron.sim.isa.common import COMPARE_OPS, Instr, Operand, Scalar, Step, load_column, prepare_cast


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
        return prepare_cast(v, self.dst.dtype).to(self.dst.dtype)  # a constant: generated once

    def execute(self, core) -> None:
        self.dst.write(core, self._values)

    def step(self, core, slots) -> Step | None:
        dst, dv, values = self.dst, self.dst.view(core), self._values
        return lambda h: store(dst, dv, values, may_alias=False)  # (the constant lives outside the core's memory)

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
        x = prepare_cast(self.on_true_tile.view(core).reshape(p, f), self.dst.dtype)
        fill = torch.tensor(as_scalar(self.on_false_value, torch.float32), dtype=torch.float32).to(x.dtype)
        self.dst.write(core, torch.where(self._predicate, x, fill))

    def step(self, core, slots) -> Step | None:
        p, f, dst = self.dst.partitions, self.dst.free_elems, self.dst
        tv, dv, predicate = self.on_true_tile.view(core), dst.view(core), self._predicate
        to_float = prepare_cast(torch.empty(0, dtype=tv.dtype), dst.dtype).dtype != tv.dtype
        compute = torch.float32 if to_float else tv.dtype
        fill = torch.tensor(as_scalar(self.on_false_value, torch.float32), dtype=torch.float32).to(compute)
        if compute == tv.dtype == dv.dtype and tv.shape == dv.shape:
            # no cast: where's result is the tile where the predicate holds and the fill elsewhere, written into dst
            # (elements copied, not computed: the same bits); dst may be the tile itself (each element is read before
            # it is written), not a shifted view of its memory
            shaped = predicate.view(dv.shape)
            if self.on_true_tile == dst or not self.on_true_tile.overlaps(dst):
                return lambda h: torch.where(shaped, tv, fill, out=dv)

        def step(h):  # execute's calls, the predicate and the fill value made once
            x = tv.reshape(p, f)
            store(dst, dv, torch.where(predicate, x.float() if to_float else x, fill))
        return step

    def price(self) -> CostInputs:
        return self._cost([self.on_true_tile], self.dst, op=self.cmp_op)



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
        lo, hi = load_column(core, self.min, torch.float32, 2), load_column(core, self.max, torch.float32, 2)
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
        keep = torch.rand(p, f, generator=core.rng) >= load_column(core, self.prob, torch.float32, 2)
        self.dst.write(core, torch.where(keep, x, torch.zeros((), dtype=x.dtype)))

    def price(self) -> CostInputs:
        return self._cost([self.data], self.dst)


# ---- generator state -----------------------------------------------------------------------------

RAND_STATE_WORDS = {Engine.GPSIMD: 6, Engine.VECTOR: 24}  # uint32 words of XORWOW state per lane


def _state_words(state: torch.Tensor, n: int) -> list[int]:
    """``n`` uint32 words naming a generator state (a digest of its bytes: the same state, the same words)."""
    digest = hashlib.sha512(state.numpy().tobytes()).digest()
    return [int.from_bytes(digest[4 * (k % 16):4 * (k % 16) + 4], "little") for k in range(n)]


def _rand_state_operand(instr: Instr, name: str) -> None:
    ap = getattr(instr, name)
    if ap.dtype != torch.uint32:
        raise instr._fail(name, f"is {dtype_name(ap.dtype)}; generator state words are uint32")
    want = RAND_STATE_WORDS[instr.engine]
    if ap.free_elems != want:
        raise instr._fail(name, f"has {ap.free_elems} elements per partition; the {instr.engine.value} engine's "
                                f"XORWOW state is {want} words")


@dataclass(frozen=True)
class RandGetState(Instr):
    """``nisa.rand_get_state``: the generator state as uint32 words per lane (6 on GpSimd, 24 on VectorE).

    The simulator has one generator per core (torch's, shared by every engine), not per-lane XORWOW: the words
    are a digest naming the current state, the same in every lane; ``rand_set_state`` with them restores it."""

    dst: AP
    engine: Engine = Engine.GPSIMD
    opcode = "rand_get_state"
    ENGINES = (Engine.GPSIMD, Engine.VECTOR)

    def check(self) -> None:
        self._tiles("dst")
        _rand_state_operand(self, "dst")

    def execute(self, core) -> None:
        state = core.rng.get_state()
        words = _state_words(state, self.dst.free_elems)
        core.rng_states[tuple(words)] = state
        self.dst.write(core, torch.tensor(words, dtype=torch.int64).expand(self.dst.partitions, -1))

    def price(self) -> CostInputs:
        return self._cost([], self.dst, flops=0)


@dataclass(frozen=True)
class RandSetState(Instr):
    """``nisa.rand_set_state``: seed the generator from uint32 words per lane. Words ``rand_get_state`` wrote
    restore that state exactly; any other words seed the generator from a digest of all of them (the same
    words, the same sequence). One generator per core, shared by every engine (see ``RandGetState``)."""

    src_seeds: AP
    engine: Engine = Engine.GPSIMD
    opcode = "rand_set_state"
    ENGINES = (Engine.GPSIMD, Engine.VECTOR)
    WRITES = ()

    def check(self) -> None:
        self._ap("src_seeds", ("sbuf",))
        _rand_state_operand(self, "src_seeds")

    def execute(self, core) -> None:
        words = self.src_seeds.view(core).reshape(self.src_seeds.partitions, -1).to(torch.int64)
        saved = core.rng_states.get(tuple(int(w) for w in words[0]))
        if saved is not None and bool((words == words[0]).all()):
            core.rng.set_state(saved)
            return
        digest = hashlib.sha256(words.numpy().tobytes()).digest()
        core.rng.manual_seed(int.from_bytes(digest[:8], "little"))

    def price(self) -> CostInputs:
        return self._cost([self.src_seeds], None, flops=0)
