"""Numerics of the NeuronCore: the NKI dtypes, the dtype each operation computes in, rounding
to the storage dtype, and the math tables (ALU operators, reductions, activation functions).

The engines cast their inputs to fp32, compute in fp32 and cast the result to the
destination dtype for free (``reference/nki-api.md`` section 7.3). We do the same with torch
CPU tensors. Integers are kept exact: all-integer operands compute in int64, or in float64
when the operator needs fractions (float64 holds every int32/uint32 exactly), so int32 math
does not lose bits above 2**24 the way an fp32 detour would.
"""
from __future__ import annotations

import functools
import math
import struct
from typing import Callable

import torch
import torch.nn.functional as F

# NKI dtype names (nki.language) as torch dtypes. float8_e4m3 is stored as torch's OCP
# float8_e4m3fn (the closest CPU type; trn2's legacy e4m3 differs only near the top of range).
bool_ = torch.bool
int8, int16, int32 = torch.int8, torch.int16, torch.int32
uint8, uint16, uint32 = torch.uint8, torch.uint16, torch.uint32
float16, bfloat16, float32 = torch.float16, torch.bfloat16, torch.float32
float8_e4m3, float8_e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

DTYPES: dict[str, torch.dtype] = {
    "bool_": bool_, "int8": int8, "int16": int16, "int32": int32,
    "uint8": uint8, "uint16": uint16, "uint32": uint32,
    "float16": float16, "bfloat16": bfloat16, "float32": float32,
    "float8_e4m3": float8_e4m3, "float8_e5m2": float8_e5m2,
}
_ALIASES = {"bool": "bool_", "float8_e4m3fn": "float8_e4m3", "fp32": "float32", "bf16": "bfloat16",
            "fp16": "float16", "half": "float16", "float": "float32"}
_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}
_F32 = struct.Struct("f")
FLOAT_DTYPES = frozenset(dt for dt in DTYPES.values() if dt.is_floating_point)
INT_DTYPES = frozenset(dt for dt in DTYPES.values() if not dt.is_floating_point)


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Resolve an NKI dtype name or a torch dtype to a supported torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _NAMES:
            raise TypeError(f"dtype {dtype} is not a NeuronCore dtype; supported: {sorted(DTYPES)}")
        return dtype
    name = _ALIASES.get(str(dtype), str(dtype))
    if name not in DTYPES:
        raise TypeError(f"unknown NeuronCore dtype {dtype!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The NKI name of a dtype (``torch.float8_e4m3fn`` -> ``"float8_e4m3"``)."""
    return _NAMES[to_dtype(dtype)]


def torch_name(dtype: torch.dtype) -> str:
    """The torch name of a dtype without the ``torch.`` prefix, as CostInputs carries it."""
    return str(dtype).removeprefix("torch.")


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return dtype.itemsize


def compute_dtype(*dtypes: torch.dtype, fractional: bool = False) -> torch.dtype:
    """The dtype an operation on these operand dtypes computes in.

    fp32 as soon as one operand is floating point (what the engines do); otherwise int64,
    exact for every integer dtype, or float64 when ``fractional`` (divide, pow, activation
    functions, a non-integral scalar), which is exact for 32-bit integers too.
    """
    if any(dt.is_floating_point for dt in dtypes):
        return torch.float32
    return torch.float64 if fractional else torch.int64


def round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round computed values to a storage dtype exactly like PyTorch's CPU cast.

    Round-to-nearest-even for floats, NaN/inf kept, fp8 overflow as torch converts it
    (e4m3fn saturates to +-448, e5m2 overflows to inf); float -> int truncates toward zero.
    """
    return values.to(to_dtype(dtype))


def as_scalar(value: float | int, compute: torch.dtype) -> float | int:
    """A Python scalar operand as the engine sees it: fp32-rounded when computing in fp32."""
    if compute == torch.float32:
        try:
            return _F32.unpack(_F32.pack(float(value)))[0]
        except OverflowError:  # beyond fp32's range: rounds to +-inf
            return math.copysign(math.inf, value)
    if compute == torch.int64:
        return int(value)
    return float(value)


# ---------------------------------------------------------------------------------------
# ALU operators (nki.language names). Binary: f(lhs, rhs) on tensors/scalars of the compute
# dtype. Comparisons and logical ops return 1/0 in the compute dtype, as the ALU does, so
# they chain into a second op.

@functools.lru_cache(maxsize=1024)
def _broadcast_shape(a: torch.Size, b: torch.Size) -> torch.Size:
    # torch.broadcast_shapes costs ~15 us a call; a run meets the same few shape pairs again and again
    return torch.broadcast_shapes(a, b)


def _cmp(fn: Callable) -> Callable:
    def op(a, b):
        if not isinstance(a, torch.Tensor):
            a = torch.tensor(a, dtype=b.dtype)
        same = not isinstance(b, torch.Tensor) or b.shape == a.shape
        shape = a.shape if same else _broadcast_shape(a.shape, b.shape)
        # Written straight into the compute dtype: a bool result converted afterwards costs ~10x more.
        return fn(a, b, out=torch.empty(shape, dtype=a.dtype))
    return op


def _logical(fn: Callable) -> Callable:
    def op(a, b):
        r = fn(torch.as_tensor(a) != 0, torch.as_tensor(b) != 0)
        return r.to(a.dtype if isinstance(a, torch.Tensor) else b.dtype)
    return op


ARITH_OPS: dict[str, Callable] = {
    "add": torch.add,
    "subtract": torch.sub,
    "multiply": torch.mul,
    "divide": torch.true_divide,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "power": torch.pow,
    "mod": torch.fmod,
    "abs_max": lambda a, b: torch.maximum(torch.as_tensor(a).abs(), torch.as_tensor(b).abs()),
    "abs_min": lambda a, b: torch.minimum(torch.as_tensor(a).abs(), torch.as_tensor(b).abs()),
    "equal": _cmp(torch.eq),
    "not_equal": _cmp(torch.ne),
    "greater": _cmp(torch.gt),
    "greater_equal": _cmp(torch.ge),
    "less": _cmp(torch.lt),
    "less_equal": _cmp(torch.le),
    "logical_and": _logical(torch.logical_and),
    "logical_or": _logical(torch.logical_or),
    "logical_xor": _logical(torch.logical_xor),
    # unary ALU ops usable as tensor_scalar op0 (the operand is ignored)
    "bypass": lambda a, b: a,
    "abs": lambda a, b: torch.abs(a),
    "rsqrt": lambda a, b: torch.rsqrt(a),
}
BITVEC_OPS: dict[str, Callable] = {
    "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor,
    "left_shift": torch.bitwise_left_shift,
    "right_shift": torch.bitwise_right_shift,
}
ALU_OPS = {**ARITH_OPS, **BITVEC_OPS}
UNARY_ALU_OPS = frozenset({"bypass", "abs", "rsqrt"})
_TENSOR_RHS = frozenset({"maximum", "minimum", "abs_max", "abs_min", "logical_and", "logical_or", "logical_xor"})
FRACTIONAL_OPS = frozenset({"divide", "power", "rsqrt"})  # need a float compute dtype for ints
# numpy / legacy NKI tokens that name the same operators
_OP_ALIASES = {"max": "maximum", "min": "minimum", "pow": "power", "sub": "subtract", "mul": "multiply",
               "sum": "add", "true_divide": "divide", "amax": "maximum", "amin": "minimum", "fmod": "mod"}


def _canonical(op: str | Callable, aliases: dict[str, str], known, kind: str) -> str:
    # a name, alias, or callable with a ``__name__`` (nl / numpy functions) -> its canonical name
    name = op if isinstance(op, str) else getattr(op, "__name__", str(op))
    name = aliases.get(name, name)
    if name not in known:
        raise ValueError(f"unknown {kind} {op!r}; supported: {sorted(known)}")
    return name


def alu_op(op: str | Callable) -> str:
    """Canonical NKI name of an ALU operator given a name, alias or callable with a ``__name__``."""
    return _canonical(op, _OP_ALIASES, ALU_OPS, "ALU operator")


def apply_alu(op: str, lhs, rhs):
    """Apply a canonical ALU operator to compute-dtype operands (tensors or Python scalars)."""
    # some torch ops take a Python number only on the right, some not at all: make it a 0-d tensor
    if not isinstance(lhs, torch.Tensor):
        lhs = torch.tensor(lhs, dtype=rhs.dtype)
    elif not isinstance(rhs, torch.Tensor) and op in _TENSOR_RHS:
        rhs = torch.tensor(rhs, dtype=lhs.dtype)
    return ALU_OPS[op](lhs, rhs)


# ---------------------------------------------------------------------------------------
# Reductions over trailing axes. Identity values seed accumulation registers.

def _fold(fn: Callable, x: torch.Tensor, d: int) -> torch.Tensor:
    # bitwise reductions have no torch kernel: fold halves pairwise (log2(n) torch calls)
    while x.shape[d] > 1:
        n = x.shape[d]
        half = n // 2
        folded = fn(x.narrow(d, 0, half), x.narrow(d, half, half))
        x = torch.cat([folded, x.narrow(d, 2 * half, n - 2 * half)], d) if n % 2 else folded
    return x.squeeze(d)


def _merged(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Callable:
    # the reduced dims are consecutive: merge them into one and reduce that
    def reduce(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        return fn(x.flatten(dims[0], dims[-1]) if len(dims) > 1 else x, dims[0])
    return reduce


REDUCE_OPS: dict[str, Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]] = {
    "add": _merged(lambda x, d: x.sum(d, dtype=x.dtype)),
    "multiply": _merged(lambda x, d: x.prod(d, dtype=x.dtype)),
    "maximum": _merged(lambda x, d: x.amax(d)),
    "minimum": _merged(lambda x, d: x.amin(d)),
    "logical_and": _merged(lambda x, d: (x != 0).all(d).to(x.dtype)),
    "logical_or": _merged(lambda x, d: (x != 0).any(d).to(x.dtype)),
    "bitwise_and": _merged(lambda x, d: _fold(torch.bitwise_and, x, d)),
    "bitwise_or": _merged(lambda x, d: _fold(torch.bitwise_or, x, d)),
    "bitwise_xor": _merged(lambda x, d: _fold(torch.bitwise_xor, x, d)),
}
REDUCE_OPS["average"] = _merged(lambda x, d: x.mean(d) if x.is_floating_point() else x.double().mean(d))
REDUCE_IDENTITY = {"add": 0.0, "multiply": 1.0, "maximum": -math.inf, "minimum": math.inf,
                   "logical_and": 1.0, "logical_or": 0.0, "bitwise_and": -1, "bitwise_or": 0, "bitwise_xor": 0}


def reduce_op(op: str | Callable) -> str:
    """Canonical name of a reduction operator (``np.max``/``nl.max`` -> ``"maximum"``)."""
    if (op if isinstance(op, str) else getattr(op, "__name__", None)) == "average":
        return "average"  # a reduction only (the mean), not an ALU operator
    name = alu_op(op)
    if name not in REDUCE_OPS:
        raise ValueError(f"{name!r} is not a reduction operator; supported: {sorted(REDUCE_OPS)}")
    return name


def apply_reduce(op: str, x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Reduce ``x`` over ``dims`` (consecutive, ascending) with a canonical reduction operator."""
    return REDUCE_OPS[op](x, dims)


# ---------------------------------------------------------------------------------------
# Activation functions (ScalarE), on fp32 (or float64 for integer inputs) tensors.

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


_HALF, _ZERO = torch.tensor(0.5), torch.tensor(0.0)  # 0-d: broadcast operands of the fused forms below


def _gelu_dx_into(x: torch.Tensor, cdf: torch.Tensor, pdf: torch.Tensor) -> torch.Tensor:
    """d/dx [x * Phi(x)] = Phi(x) + x * phi(x) into ``cdf`` (returned), ``pdf`` a scratch of x's shape: the
    formula 0.5 * (1.0 + erf(x * _INV_SQRT_2)) + x * exp(-0.5 * x * x) * _INV_SQRT_2PI with its roundings, in
    place on the two buffers (a large tile made ten temporaries), in 8 passes over them. ``x`` is neither buffer:
    it is read until the last operation."""
    torch.mul(x, _INV_SQRT_2, out=cdf)
    torch.erf(cdf, out=cdf)
    # 0.5 + 0.5 * erf in one pass: halving is exact and commutes with rounding (no result is subnormal), so this is
    # 0.5 * (1 + erf) bit for bit, +0 where erf is -1
    torch.add(_HALF, cdf, alpha=0.5, out=cdf)
    # -0.5 * x * x in one pass (+ 0: exact, but for the sign of a zero, which exp maps to 1 either way)
    torch.addcmul(_ZERO, x, x, value=-0.5, out=pdf)
    torch.exp(pdf, out=pdf)
    return cdf.add_(pdf.mul_(x).mul_(_INV_SQRT_2PI))


def _gelu_dx(x: torch.Tensor) -> torch.Tensor:
    return _gelu_dx_into(x, torch.empty_like(x), torch.empty_like(x))


def _gelu_tanh_dx(x: torch.Tensor) -> torch.Tensor:
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)
    t = torch.tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)


def _gelu_sigmoid_dx(x: torch.Tensor) -> torch.Tensor:
    # d/dx [x * sigmoid(1.702 x)] = s + 1.702 x s (1 - s)
    s = torch.sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1.0 - s)


def _silu_dx(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


# torch's fp32 exp is fast where its result is a normal number and 10-40x slower below that (denormal or zero
# results: the masked entries of a causal softmax's scores, -3e38 or -inf). Every x <= EXP_ZERO_AT gives exactly
# +0.0 (on the vector and the element-by-element path: tests/sim/test_numerics.py checks the boundary and every
# binade below it; all 1.0e9 fp32 values from there to -inf were checked once), so a tile whose values are each
# either >= EXP_FAST_MIN or <= EXP_ZERO_AT is computed as exp of the values clamped to EXP_FAST_MIN, times 1 where
# the input was kept and 0 where it was below: the same bits (a positive result times 1 or 0 is exact), the same
# torch call on the kept values (same tensor geometry), without the slow path. Float arithmetic does the masking:
# torch's boolean kernels on strided tiles cost more than the exp they would save.
EXP_ZERO_AT = -103.97208404541016   # the largest fp32 x whose torch.exp is +0.0
EXP_FAST_MIN = -87.0                # exp's result is a normal fp32 number from here up (fast)
_EXP_GAP = EXP_FAST_MIN - EXP_ZERO_AT  # exact (Sterbenz: the bounds are within a factor of 2)


class ExpScratch:
    """What a step's exp keeps between runs (its inputs have one shape): the clamped route's two fp32 mask buffers,
    made when the route first applies, and whether it applied last run: its input then held masked values, as the
    next one most likely does (a causal softmax's scores), so the test for a value below EXP_FAST_MIN is skipped
    (the route gives torch.exp's bits without one too, only slower)."""

    def __init__(self) -> None:
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.masked = False

    def masks(self, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """The two buffers, made on the first call."""
        if self.buffers is None:
            self.buffers = (torch.empty(shape), torch.empty(shape))
        return self.buffers


def _exp_keep(x: torch.Tensor, scratch: ExpScratch | None = None) -> torch.Tensor | None:
    """1.0 where ``x`` >= EXP_FAST_MIN and 0.0 where ``x`` <= EXP_ZERO_AT (fp32), when the clamped route gives
    torch.exp's bits for ``x``; None where it does not apply: fp32 values all >= EXP_FAST_MIN (nothing to gain;
    not tested where ``scratch`` saw masked values last run), NaN, or a value between the bounds (only torch's own
    evaluation gives its denormal or small result). ``scratch``: the buffers to compute in (else temporaries); the
    result is its first."""
    if x.dtype != torch.float32 or x.numel() == 0:
        return None
    if scratch is None:
        scratch = ExpScratch()
    if not scratch.masked and not x.amin().item() < EXP_FAST_MIN:  # (NaN: not <)
        return None
    keep, band = scratch.masks(x.shape)
    # x clamped to [ZERO_AT, FAST_MIN] into a contiguous buffer, and from it (cheaper than from a strided tile) the
    # mask: a value is >= FAST_MIN iff its clamp is (NaN: neither). A comparison written straight into fp32 gives
    # 1.0 / 0.0 (a bool result converted costs far more)
    torch.clamp(x, EXP_ZERO_AT, EXP_FAST_MIN, out=band)
    torch.ge(band, EXP_FAST_MIN, out=keep)
    # the clamp less the gap where kept: ZERO_AT for every value outside the band (FAST_MIN - _EXP_GAP is ZERO_AT
    # exactly), the value itself inside it, so the band is empty iff the maximum is ZERO_AT (and NaN, which the
    # amin test above may not have seen, makes the maximum NaN: not <=)
    scratch.masked = band.sub_(keep, alpha=_EXP_GAP).amax().item() <= EXP_ZERO_AT
    return keep if scratch.masked else None


def exp_out(x: torch.Tensor, *, out: torch.Tensor, scratch: ExpScratch | None = None) -> torch.Tensor:
    """``torch.exp(x, out=out)``, bit for bit, without torch's slow path on large negative inputs. ``scratch``: a
    step's ExpScratch (else temporaries)."""
    if x.shape == out.shape and x.stride() == out.stride():
        keep = _exp_keep(x, scratch)
        if keep is not None:
            # out has x's shape and strides: the kept values' exp runs with the geometry exp(x, out=out) has
            torch.clamp_min(x, EXP_FAST_MIN, out=out)
            torch.exp(out, out=out)
            return out.mul_(keep)
    return torch.exp(x, out=out)


def exp_buffers() -> Callable[..., torch.Tensor]:
    """``exp_out`` with an ExpScratch of its own (a step's exp)."""
    scratch = ExpScratch()
    return lambda x, *, out: exp_out(x, out=out, scratch=scratch)


def exp(x: torch.Tensor) -> torch.Tensor:
    """``torch.exp(x)``, bit for bit, without torch's slow path on large negative inputs."""
    if x.is_contiguous():  # (the result torch allocates then has x's strides too)
        return exp_out(x, out=torch.empty_like(x))
    return torch.exp(x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "copy": lambda x: x,
    "identity": lambda x: x,
    "exp": exp,
    "log": torch.log,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_apprx_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_apprx_sigmoid": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_dx": _gelu_dx,
    "gelu_apprx_tanh_dx": _gelu_tanh_dx,
    "gelu_apprx_sigmoid_dx": _gelu_sigmoid_dx,
    "silu": F.silu,
    "silu_dx": _silu_dx,
    "softplus": F.softplus,
    "mish": F.mish,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "square": torch.square,
    "sin": torch.sin,
    "cos": torch.cos,
    "tan": torch.tan,
    "arctan": torch.atan,
    "abs": torch.abs,
    "sign": torch.sign,
    "negative": torch.neg,
    "erf": torch.erf,
    "erf_dx": lambda x: (2.0 / math.sqrt(math.pi)) * torch.exp(-x * x),
    "floor": torch.floor,
    "ceil": torch.ceil,
    "trunc": torch.trunc,
}
# the functions torch can write straight into an fp32 destination (``fn(x, out=out)``)
ACTIVATIONS_OUT: dict[str, Callable] = {
    "exp": exp_out, "log": torch.log, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "square": torch.square, "sin": torch.sin,
    "cos": torch.cos, "tan": torch.tan, "arctan": torch.atan, "abs": torch.abs, "sign": torch.sign,
    "negative": torch.neg, "erf": torch.erf, "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc,
}
_ACT_ALIASES = {"gelu_dx_apprx_tanh": "gelu_apprx_tanh_dx", "atan": "arctan", "neg": "negative"}


def activation_fn(op: str | Callable) -> str:
    """Canonical name of an activation function given a name or an ``nl``/numpy callable."""
    return _canonical(op, _ACT_ALIASES, ACTIVATIONS, "activation function")


# PyTorch's CPU kernels evaluate contiguous elements in vector blocks (of at most 64 fp32 lanes with
# unrolling) and the remainder, and strided tensors, one element at a time, with different implementations
# of erf, exp, tanh, ...: a few ulp apart. Evaluated on whole blocks, an activation's result depends on the
# value alone, not on where the tile lies in SBUF or how wide it is (the hardware's function tables don't).
_VECTOR_BLOCK = 64


Scratch = Callable[[tuple[int, ...], torch.dtype, str], torch.Tensor]  # NeuronCore.scratch: shared step buffers


def fresh_scratch(shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
    """A ``Scratch`` of a step's own (where no core shares its buffers): a new buffer per call."""
    return torch.empty(shape, dtype=dtype)


def _in_place(op: str, n: int, dtype: torch.dtype, scratch: Scratch | None = None) -> Callable[[torch.Tensor],
                                                                                                torch.Tensor]:
    """A function computing activation ``op`` of a contiguous buffer of n values in place (returning the buffer,
    or for gelu_dx a scratch it owns, or ``scratch``'s): the torch calls of ``ACTIVATIONS[op]``, written into the
    buffer."""
    if op in ("identity", "copy"):
        return lambda buf: buf
    fn_out = exp_buffers() if op == "exp" else ACTIVATIONS_OUT.get(op)
    if fn_out is not None:
        return lambda buf: fn_out(buf, out=buf)
    if op in ("gelu", "gelu_apprx_tanh"):  # F.gelu is torch._C._nn.gelu: the same kernel writes into out=
        approximate = "none" if op == "gelu" else "tanh"
        return lambda buf: torch._C._nn.gelu(buf, approximate=approximate, out=buf)
    if op == "gelu_dx":
        buffers: list[torch.Tensor] = []  # its two buffers, made on the first run

        def gelu_dx(buf: torch.Tensor) -> torch.Tensor:
            if not buffers:
                buffers.extend(_gelu_dx_buffers(n, dtype, scratch))
            return _gelu_dx_into(buf, *buffers)
        return gelu_dx
    fn = ACTIVATIONS[op]
    return lambda buf: buf.copy_(fn(buf))


def _gelu_dx_buffers(n: int, dtype: torch.dtype, scratch: Scratch | None) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu_dx's two buffers of n values: ``scratch``'s (shared by the steps of one core), else its own."""
    scratch = scratch or fresh_scratch
    return scratch((n,), dtype, "gelu_dx cdf"), scratch((n,), dtype, "gelu_dx pdf")


def activation_buffer(op: str, n: int, dtype: torch.dtype,
                      scratch: Scratch | None = None) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """A buffer for ``n`` values of ``dtype`` (its first n elements: the caller fills them) and a function
    returning activation ``op`` of them, as ``apply_activation`` computes it, bit for bit: on whole vector
    blocks of a contiguous buffer, in place (no temporaries where torch has an out= form). The padding past n
    starts as zeros and then holds what the function made of it: each element's result depends on its value
    alone, so what the padding holds changes no bit of the n values. ``scratch``: the buffers are a core's shared
    step scratch where n fills whole blocks (a padded buffer stays the step's own: its padding then holds only
    what this function left there, which keeps exp's choice of path)."""
    m = -(-n // _VECTOR_BLOCK) * _VECTOR_BLOCK
    shared = scratch if m == n else None
    buf = shared((m,), dtype, "activation") if shared is not None else torch.zeros(m, dtype=dtype)
    fn = _in_place(op, m, dtype, shared)
    return buf, (lambda: fn(buf)) if m == n else (lambda: fn(buf)[:n])


def activation_reader(op: str, n: int, dtype: torch.dtype,
                      scratch: Scratch | None = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function computing activation ``op`` of a tile of ``n`` values of ``dtype`` read straight from its view
    (any strides), into buffers of its own (the result: contiguous, in the tile's shape), with the bits of
    ``activation_buffer``'s evaluation without loading the tile first; None for the functions where that does not
    hold. gelu_dx of whole vector blocks: its formula reads x only in exact element-wise products, and its erf and
    exp run on contiguous buffers of the n values, as on the loaded buffer."""
    if op != "gelu_dx" or n % _VECTOR_BLOCK:
        return None
    cdf, pdf = _gelu_dx_buffers(n, dtype, scratch)
    return lambda x: _gelu_dx_into(x, cdf.view(x.shape), pdf.view(x.shape))


def apply_activation(op: str, x: torch.Tensor) -> torch.Tensor:
    """Apply a canonical activation function to a floating-point tensor, element by element."""
    n = x.numel()
    if n == 0:
        return ACTIVATIONS[op](x)
    if n % _VECTOR_BLOCK == 0 and op not in ("identity", "copy"):
        # whole blocks already: the same blocks, evaluated out of place without a padded copy (identity and copy
        # would return x itself)
        return ACTIVATIONS[op](x.contiguous().view(-1)).view(x.shape)
    buf, run = activation_buffer(op, n, x.dtype)
    buf[:n].view(x.shape).copy_(x)
    return run().view(x.shape)
