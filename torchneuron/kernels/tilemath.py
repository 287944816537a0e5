"""The math of element-wise ATen ops over ``nl`` tiles (what ``kernels.elementwise`` applies per tile).

Each function takes tiles (a [P, F] tile or a [P, 1] column holding a broadcast scalar) and
returns a tile; it runs at trace time, so every call below is one or a few engine instructions.
Where the ScalarE has the function (exp, log, tanh, erf, ...) it is one activation. The rest
are composed, following the formulas PyTorch's CPU kernels use where that keeps the results
within a few ulps (``log1p``/``expm1`` use Kahan's forms, which stay accurate near 0).
``where`` is an exact bitwise select on the operands' bits (``b ^ ((a ^ b) & mask)``), so it passes
NaN and inf through.
Functions that bake a constant into the Program (``pow_scalar(2.0)``) are cached per constant.
"""
from __future__ import annotations

import functools
import math

import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

INV_LN2, INV_LN10 = 1 / math.log(2), 1 / math.log(10)


def _float(t) -> bool:
    return t.dtype.is_floating_point


def _bits(t):
    """The int32 view of a 4-byte tile's bits (the same SBUF bytes)."""
    if not _float(t):
        return t
    return t.ap([[0, t.shape[0]], [1, t.access.free_elems]], dtype=nl.int32).reshape(t.shape)


def _from_bits(t, like):
    """An int32 bit tile read back as ``like``'s dtype."""
    if not _float(like):
        return t
    return t.ap([[0, t.shape[0]], [1, t.access.free_elems]], dtype=like.dtype).reshape(t.shape)


def _mask(c):
    """-1 where ``c`` is non-zero, 0 elsewhere (int32): the select mask."""
    m = nl.ndarray(c.shape, nl.int32)
    nisa.tensor_scalar(dst=m, data=c, op0=nl.not_equal, operand0=0, op1=nl.multiply, operand1=-1)
    return m


def where(c, a, b):
    """``c ? a : b`` bit-exactly: ``b ^ ((a ^ b) & m)`` on the operands' bits, m all ones where c."""
    m = _mask(c)
    ba = _bits(b)
    picked = nl.bitwise_and(nl.bitwise_xor(_bits(a), ba), m)
    return _from_bits(nl.bitwise_xor(ba, picked), a if _float(a) else b)


def _const(like, value):
    """A tile shaped like ``like`` filled with ``value``."""
    t = nl.ndarray(like.shape, like.dtype)
    nisa.memset(dst=t, value=value)
    return t


def where_value(c, value, b):
    """``c ? value : b`` for a constant ``value``."""
    return where(c, _const(b, value), b)


def _select_into(dst, src, c):
    """``dst = c ? src : dst`` in place, one instruction: ``c`` a 0/1 fp32 (or int32) tile shaped like ``dst``
    (its bits, read as uint32, are the predicate). ``dst`` must be a tile of the caller's own, not an operand."""
    pred = c.ap([[0, c.shape[0]], [1, c.access.free_elems]], dtype=nl.uint32).reshape(c.shape)
    nisa.tensor_copy_predicated(dst=dst, src=src, predicate=pred)
    return dst


def _stt(data, op0, scalar, op1, tile):
    """``(data <op0> scalar) <op1> tile`` in one instruction (each operation rounded)."""
    out = nl.ndarray(data.shape, data.dtype)
    nisa.scalar_tensor_tensor(dst=out, data=data, op0=op0, operand0=scalar, op1=op1, operand1=tile)
    return out


# ---- arithmetic -------------------------------------------------------------------------------

def identity(x):
    return x


def add(a, b):
    return nl.add(a, b)


def sub(a, b):
    return nl.subtract(a, b)


def mul(a, b):
    return nl.multiply(a, b)


def div(a, b):
    return nl.divide(a, b)


def add_scaled(a, b, alpha):
    return nl.add(a, nl.multiply(b, alpha))


def sub_scaled(a, b, alpha):
    return nl.subtract(a, nl.multiply(b, alpha))


def neg(x):
    return nl.multiply(x, -1)


def abs_(x):
    out = nl.ndarray(x.shape, x.dtype)
    nisa.tensor_scalar(dst=out, data=x, op0="abs", operand0=None)
    return out


def _act(name: str):
    fn = getattr(nl, name)

    def op(x):
        return fn(x)
    op.__name__ = name
    return op


exp, log, sqrt, rsqrt, sin, cos, tanh, sigmoid, erf = (
    _act(n) for n in ("exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "erf"))


def _activation(name: str):
    def op(x):
        out = nl.ndarray(x.shape, x.dtype)
        nisa.activation(dst=out, op=name, data=x)
        return out
    op.__name__ = name
    return op


tan, atan, _floor, _ceil, _trunc, _sign, _relu, gelu, gelu_tanh, silu = (
    _activation(n) for n in ("tan", "arctan", "floor", "ceil", "trunc", "sign", "relu", "gelu", "gelu_apprx_tanh",
                             "silu"))


def _float_only(fn, int_fn=identity):
    def op(x):
        return fn(x) if _float(x) else int_fn(x)
    op.__name__ = fn.__name__
    return op


floor, ceil, trunc = _float_only(_floor), _float_only(_ceil), _float_only(_trunc)
relu = _float_only(_relu, lambda x: nl.maximum(x, 0))
sign = _float_only(_sign, lambda x: nl.subtract(nl.greater(x, 0), nl.less(x, 0)))


def reciprocal(x):
    return nl.divide(1.0, x)


def frac(x):
    return nl.subtract(x, trunc(x)) if _float(x) else nl.multiply(x, 0)


def exp2(x):
    return nl.exp(nl.multiply(x, math.log(2)))


def log2(x):
    return nl.multiply(nl.log(x), INV_LN2)


def log10(x):
    return nl.multiply(nl.log(x), INV_LN10)


def isnan(x):
    return nl.not_equal(x, x)


def isinf(x):
    return nl.equal(abs_(x), math.inf)


def log1p(x):
    """Kahan: ``log(u) * x / (u - 1)`` with ``u = 1 + x`` (exact where ``u`` rounds to 1); for |x| > 1e6,
    where 1 + x loses nothing that matters and the product would overflow, plain ``log(1 + x)``."""
    u = nl.add(x, 1.0)
    d = nl.subtract(u, 1.0)
    r = nl.divide(nl.multiply(nl.log(u), x), d)
    r = where(nl.equal(d, 0.0), x, r)
    return where(nl.greater(abs_(x), 1e6), nl.log(u), r)


def expm1(x):
    """Kahan: ``(u - 1) * (x / log(u))`` with ``u = exp(x)`` (the quotient first: ``(u - 1) * x`` overflows
    from x ~ 84, where expm1 is finite up to 88.7)."""
    u = nl.exp(x)
    d = nl.subtract(u, 1.0)
    r = nl.multiply(d, nl.divide(x, nl.log(u)))
    r = where(nl.equal(u, 1.0), x, r)
    r = where(nl.equal(d, -1.0), d, r)
    return where(isinf(u), u, r)


def _exp_neg(x):
    """``exp(-x)`` in one activation (its input scale -1)."""
    out = nl.ndarray(x.shape, x.dtype)
    nisa.activation(dst=out, op="exp", data=x, scale=-1.0)
    return out


# e^a / 2 as exp(a - c) * (e^c / 2) with c = 3719 / 256: a - c is exact for a >= c, and e^c / 2 is an fp32
# within 1e-11 (relative) of its value, so the product is as accurate as exp; it stays finite up to a ~ 89.4
# (cosh's and sinh's overflow), where e^a itself overflows from 88.7
HALF_EXP_SHIFT, HALF_EXP_SCALE = 14.52734375, 1018861.6875
WIDE_EXP = 88.0        # cosh and sinh take the scaled form above this |x|


def _half_exp_abs(x, times=None):
    """``e^|x| / 2`` (times the tile ``times``) for ``|x| >= HALF_EXP_SHIFT``, in the scaled form."""
    t = nl.ndarray(x.shape, x.dtype)
    nisa.tensor_scalar(dst=t, data=x, op0="abs", operand0=None, op1=nl.subtract, operand1=HALF_EXP_SHIFT)
    e = nl.exp(t)
    return nl.multiply(e, HALF_EXP_SCALE) if times is None else _stt(e, nl.multiply, HALF_EXP_SCALE, nl.multiply,
                                                                      times)


def _odd_series(x, z, coeffs):
    """``x (1 + z (c0 + c1 z + c2 z^2 + ...))`` for ``z = x * x`` by Horner's rule, one instruction a step."""
    acc = nl.multiply(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = _stt(acc, nl.add, c, nl.multiply, z)
    return _stt(acc, nl.add, 1.0, nl.multiply, x)


# sinh(x) = x (1 + z P(z)), z = x^2 <= 1: P fitted for an equal relative error of sinh on [0, 1] (Taylor's
# 1/6, 1/120, 1/5040 adjusted; 0.1 of fp32's half ulp with the coefficients rounded to fp32)
SINH_SERIES = (0.16666667, 0.00833335, 0.00019836178, 2.8168636e-06)


def sinh(x):
    """``(e^x - e^-x) / 2``, which cancels below |x| = 1: there a polynomial in x (sinh(1e-30) = 1e-30, and
    -0.0 stays -0.0); above |x| = 88 ``sign(x) e^|x| / 2`` in the scaled form (finite up to 89.4)."""
    r = nl.multiply(nl.subtract(nl.exp(x), _exp_neg(x)), 0.5)
    _select_into(r, _odd_series(x, nl.multiply(x, x), SINH_SERIES), _abs_cmp(x, nl.less, 1.0))
    return _select_into(r, _half_exp_abs(x, sign(x)), _abs_cmp(x, nl.greater, WIDE_EXP))


def cosh(x):
    """``(e^x + e^-x) / 2``; above |x| = 88 ``e^|x| / 2`` in the scaled form (finite up to 89.4)."""
    r = nl.multiply(nl.add(nl.exp(x), _exp_neg(x)), 0.5)
    return _select_into(r, _half_exp_abs(x), _abs_cmp(x, nl.greater, WIDE_EXP))


# asinh(x) = x (1 + z Q(z)), z = x^2 <= 9/16: Q fitted for an equal relative error of asinh on [0, 3/4]
# (0.2 of fp32's half ulp with the coefficients rounded to fp32)
ASINH_SERIES = (-0.16666585, 0.07496999, -0.04426835, 0.028174214, -0.01537796, 0.0047044144)


def asinh(x):
    """``sign(x) log(|x| + sqrt(x^2 + 1))``; below |x| = 3/4, where the log's argument nears 1 and the log
    magnifies its rounding (4 ulps at 1/2), a polynomial in x; from |x| = 2^11 ``log|x| + ln 2`` (x^2
    overflows beyond 1.8e19)."""
    ax = abs_(x)
    z = nl.multiply(x, x)
    a = nl.add(ax, nl.sqrt(nl.add(z, 1.0)))
    wide = nl.greater_equal(ax, WIDE_LOG)
    _select_into(a, ax, wide)
    r = _stt(wide, nl.multiply, math.log(2), nl.add, nl.log(a))
    _select_into(r, _odd_series(ax, z, ASINH_SERIES), nl.less(ax, 0.75))
    return _with_sign_of(r, x)


# from |x| = 2^11 asinh and acosh take log(2 |x|) = log|x| + ln 2 (what they leave out, 1/(4 x^2), is below
# 0.07 ulp), where x^2 would overflow beyond 1.8e19; acosh's x + sqrt(x^2 - 1) is negative (its log NaN, as
# acosh below 1) for every x in (-2^11, -1] (from -2896.3 down it can round to 0)
WIDE_LOG = 2048.0


def acosh(x):
    """``log1p(t)`` with ``t = (x - 1) + sqrt((x - 1)(x + 1))`` (``log(x + sqrt(x^2 - 1))`` cancels near
    x = 1), the log1p as Kahan's ``log(u) * (t / (u - 1))``, ``u = 1 + t`` (u - 1 is 0 only at x = 1, where t
    is 0: the divisor is kept from 0); below 1 t or u is negative or NaN, and so the result. From |x| = 2^11
    ``log(x) + ln 2`` (NaN for x <= -2^11, as acosh's)."""
    d = nl.subtract(x, 1.0)
    t = nl.add(d, nl.sqrt(_stt(x, nl.add, 1.0, nl.multiply, d)))
    u = nl.add(t, 1.0)
    ratio = nl.ndarray(x.shape, x.dtype)
    nisa.scalar_tensor_tensor(dst=ratio, data=nl.subtract(u, 1.0), op0=nl.maximum, operand0=1e-30,
                              op1=nl.divide, operand1=t, reverse1=True)
    r = nl.multiply(nl.log(u), ratio)
    return _select_into(r, nl.add(nl.log(x), math.log(2)), _abs_cmp(x, nl.greater_equal, WIDE_LOG))


def atanh(x):
    return nl.multiply(nl.subtract(log1p(x), log1p(neg(x))), 0.5)


def asin(x):
    return atan(nl.divide(x, nl.sqrt(nl.subtract(1.0, nl.multiply(x, x)))))


def acos(x):
    return nl.subtract(math.pi / 2, asin(x))


def deg2rad(x):
    return nl.multiply(x, math.pi / 180)


def rad2deg(x):
    return nl.multiply(x, 180 / math.pi)


def sinc(x):
    px = nl.multiply(x, math.pi)
    r = nl.divide(nl.sin(px), px)
    return where(nl.equal(x, 0.0), _const(r, 1.0), r)


def _abs_cmp(x, op, value):
    """``|x| <op> value`` (1.0 or 0.0) in one instruction."""
    out = nl.ndarray(x.shape, x.dtype)
    nisa.tensor_scalar(dst=out, data=x, op0="abs", operand0=None, op1=op, operand1=value)
    return out


def _with_sign_of(r, x):
    """``r`` with ``x``'s sign bit or-ed in: ``copysign(r, x)`` where ``r`` is ``x``'s sign or a zero."""
    return _from_bits(nl.bitwise_or(_bits(r), nl.bitwise_and(_bits(x), -0x80000000)), r)


def _round_even(x):
    # adding and subtracting 2**23 rounds |x| < 2**23 to an integer, ties to even (the sum's ulp is 1); the
    # result takes x's sign (-0.3 rounds to -0.0, as the CPU's); from 2**23 on every fp32 is an integer
    r = nl.ndarray(x.shape, x.dtype)
    nisa.tensor_scalar(dst=r, data=x, op0="abs", operand0=None, op1=nl.add, operand1=8388608.0)
    r = _with_sign_of(nl.subtract(r, 8388608.0), x)
    return where(_abs_cmp(x, nl.less, 8388608.0), r, x)


def round_(x):
    return _round_even(x) if _float(x) else x


@functools.cache
def round_decimals(decimals: int):
    ten = 10.0 ** abs(decimals)

    def op(x):
        if decimals < 0:
            return nl.multiply(_round_even(nl.divide(x, ten)), ten)
        return nl.divide(_round_even(nl.multiply(x, ten)), ten)
    return op


def signbit(x):
    if _float(x):
        return nl.less(_bits(x), 0)
    return nl.less(x, 0)


def logical_not(x):
    return nl.equal(x, 0)


def maximum(a, b):
    return nl.maximum(a, b)


def minimum(a, b):
    return nl.minimum(a, b)


maximum_nan, minimum_nan = maximum, minimum  # NaN-propagating, as torch.maximum / clamp


def fmax(a, b):
    m = nl.maximum(a, b)
    return where(isnan(a), b, where(isnan(b), a, m))


def fmin(a, b):
    m = nl.minimum(a, b)
    return where(isnan(a), b, where(isnan(b), a, m))


def clamp(x, lo, hi):
    return nl.minimum(nl.maximum(x, lo), hi)


def fmod(a, b):
    return _alu(a, b, "mod")


def _alu(a, b, op):
    out = nl.ndarray(a.shape if a.access.free_elems >= b.access.free_elems else b.shape, a.dtype)
    if tuple(a.shape) == tuple(b.shape):
        nisa.tensor_tensor(dst=out, data1=a, data2=b, op=op)
    elif b.access.free_elems == 1:
        nisa.tensor_scalar(dst=out, data=a, op0=op, operand0=b)
    else:
        nisa.tensor_scalar(dst=out, data=b, op0=op, operand0=a, reverse0=True)
    return out


def remainder(a, b):
    """Python's modulo (sign of the divisor), as ATen: fmod, then add b where the signs differ."""
    m = _alu(a, b, "mod")
    fix = nl.logical_and(nl.not_equal(m, 0.0), nl.not_equal(nl.less(b, 0.0), nl.less(m, 0.0)))
    return where(fix, nl.add(m, b), m)


def div_trunc(a, b):
    return trunc(nl.divide(a, b))


def div_floor(a, b):
    """ATen's floor division for floats: from fmod, so that ``a == b * q + remainder(a, b)`` holds."""
    m = _alu(a, b, "mod")
    q = nl.divide(nl.subtract(a, m), b)
    fix = nl.logical_and(nl.not_equal(m, 0.0), nl.not_equal(nl.less(b, 0.0), nl.less(m, 0.0)))
    q = nl.subtract(q, fix)
    fq = floor(q)
    fq = nl.add(fq, nl.greater(nl.subtract(q, fq), 0.5))
    plain = nl.divide(a, b)
    zero = _from_bits(nl.bitwise_and(_bits(plain), -0x80000000), plain)      # a zero signed like a / b
    r = where(nl.equal(q, 0.0), zero, fq)
    # a / b where it is infinite and a * b is not: a quotient that overflows (the ALU's fmod of such operands
    # can be NaN) and division by zero (inf / 0 too: inf * 0 is NaN); where a is infinite and b finite and not
    # zero, a * b is infinite and r keeps fmod's NaN. (0 / 0 gives NaN either way.)
    over = nl.logical_and(_abs_cmp(plain, nl.equal, math.inf), _abs_cmp(nl.multiply(a, b), nl.not_equal, math.inf))
    return where(over, plain, r)


def atan2(y, x):
    """The quadrant from the signs (of zeros too: ``atan2(-0.0, -1) == -pi``); both zero or both infinite
    take the C library's values, ``copysign(0 or pi, y)`` and ``copysign(pi/4 or 3*pi/4, y)``."""
    r = atan(nl.divide(y, x))
    yneg, xneg = nl.less(_bits(y), 0), nl.less(_bits(x), 0)
    r = where(xneg, nl.add(r, where(yneg, _const_like(r, -math.pi), _const_like(r, math.pi))), r)
    both0 = nl.logical_and(nl.equal(x, 0.0), nl.equal(y, 0.0))
    bothinf = nl.logical_and(isinf(x), isinf(y))
    r = where(both0, where(xneg, _const_like(r, math.pi), _const_like(r, 0.0)), r)
    r = where(bothinf, where(xneg, _const_like(r, 0.75 * math.pi), _const_like(r, 0.25 * math.pi)), r)
    return where(nl.logical_or(both0, bothinf), copysign(r, y), r)


def _const_like(t, value):
    return _const(t, value)


def _fill(a, b, value):
    """A tile of the broadcast shape of ``a`` and ``b`` holding ``value`` (a constant or a column)."""
    big = a if a.access.free_elems >= b.access.free_elems else b
    if isinstance(value, (int, float)):
        return _const(big, value)
    return nl.add(_const(big, -0.0), value)       # -0 + v is v for every v, -0 included


HYPOT_BIG, HYPOT_SMALL = 2.0 ** 60, 2.0 ** -60   # beyond these the squares overflow or lose the smaller operand


def hypot(a, b):
    """sqrt(a^2 + b^2) without overflow or underflow of the squares: both operands scaled by a power of two
    (exact) when the larger is above 2^60 (by 2^-70) or below 2^-60 (by 2^90), the result scaled back; an
    infinite operand gives +inf even beside a NaN, as C's hypot."""
    big = nl.maximum(abs_(a), abs_(b))
    large, small = nl.greater_equal(big, HYPOT_BIG), nl.less(big, HYPOT_SMALL)
    like = _fill(a, b, 0)                                              # a tile of the broadcast shape
    one = _const(like, 1.0)
    scale = where(large, _const(like, 2.0 ** -70), where(small, _const(like, 2.0 ** 90), one))
    back = where(large, _const(like, 2.0 ** 70), where(small, _const(like, 2.0 ** -90), one))
    sa, sb = nl.multiply(a, scale), nl.multiply(b, scale)
    r = nl.multiply(nl.sqrt(nl.add(nl.multiply(sa, sa), nl.multiply(sb, sb))), back)
    return where(nl.logical_or(isinf(a), isinf(b)), _const(like, math.inf), r)


def copysign(a, b):
    mag = nl.bitwise_and(_bits(a), 0x7FFFFFFF)
    sgn = nl.bitwise_and(_bits(b), -0x80000000)
    return _from_bits(nl.bitwise_or(mag, sgn), a)


def xlogy(x, y):
    r = where(nl.equal(x, 0.0), _fill(x, y, 0), nl.multiply(x, nl.log(y)))
    return where(isnan(y), y, r)


@functools.cache
def pow_scalar(exponent: float):
    def op(x):
        if exponent == 2.0:
            return nl.multiply(x, x)
        if exponent == 1.0:
            return nl.multiply(x, 1.0)
        return nl.power(x, exponent)
    op.__name__ = f"pow_{exponent}"
    return op


def pow_(a, b):
    return nl.power(a, b)


def _int64_words(x):
    """(high word, low word read signed) of ``int64(x)`` for fp32 ``x``, as fp32 integers: ``trunc(x)`` below
    2**31 in magnitude is its own low word; above, ``floor(t / 2**32)`` and the remainder (both exact: such a t
    is a multiple of 2**8). NaN and magnitudes from 2**63 give INT64_MIN, as the CPU's x86 conversion."""
    t = trunc(x)
    a = nl.abs(t)
    hi = floor(nl.multiply(t, 2.0 ** -32))
    r = nl.subtract(t, nl.multiply(hi, 2.0 ** 32))
    lo = nl.subtract(r, nl.multiply(nl.greater_equal(r, 2.0 ** 31), 2.0 ** 32))
    small = nl.less(a, 2.0 ** 31)      # 0 for NaN
    hi = where(small, nl.multiply(nl.less(t, 0.0), -1.0), hi)
    lo = where(small, t, lo)
    beyond = nl.subtract(1.0, nl.less(a, 2.0 ** 63))   # 1 for NaN too
    return where_value(beyond, -2.0 ** 31, hi), where_value(beyond, 0.0, lo)


def f32_int64_high_word(x):
    """The high int32 word of ``int64(x)`` (fp32 ``x``), as an fp32 integer."""
    return _int64_words(x)[0]


def f32_int64_low_word(x):
    """The low int32 word (read signed) of ``int64(x)`` (fp32 ``x``), as an fp32 integer."""
    return _int64_words(x)[1]


def from_words(hi, lo, two32):
    """An int64 from its int32 high and low words, in fp32: ``(hi + (lo < 0)) * 2**32 + lo``
    (the low word read signed, which fp32 holds more exactly than the unsigned value)."""
    return nl.add(nl.multiply(nl.add(hi, nl.less(lo, 0.0)), two32), lo)


# ---- float64 words (the core has no fp64: conversions are integer work on the IEEE fields) ---

def _f32_fields_as_f64(b):
    """(biased fp64 exponent, 23-bit fraction) of the fp32 value with bits ``b``: normals rebias
    (+896), subnormals are normalised through an exact int -> fp32 cast of their fraction (the
    cast's exponent, rebiased by +747), zeros keep 0, inf/NaN get 2047."""
    e = nl.bitwise_and(nl.right_shift(b, 23), 255)
    m = nl.bitwise_and(b, 0x7FFFFF)
    mf = _bits(nl.copy(m, dtype=nl.float32))  # exact: m < 2**23
    sub = nl.equal(e, 0)
    frac = where(sub, nl.bitwise_and(mf, 0x7FFFFF), m)
    exp = where(sub, nl.subtract(nl.bitwise_and(nl.right_shift(mf, 23), 255), 149), e)
    exp = nl.add(nl.add(exp, 896), nl.multiply(nl.equal(e, 255), 896))
    return where_value(nl.equal(nl.bitwise_and(b, 0x7FFFFFFF), 0), 0, exp), frac


def f64_high_word(b):
    """The high int32 word of float64(x), from fp32 bits ``b``: sign, 11-bit exponent, 20 fraction bits."""
    exp, frac = _f32_fields_as_f64(b)
    return nl.bitwise_or(nl.bitwise_or(nl.bitwise_and(b, -0x80000000), nl.left_shift(exp, 20)),
                         nl.right_shift(frac, 3))


def f64_low_word(b):
    """The low int32 word of float64(x), from fp32 bits ``b``: the last 3 fraction bits, at the top."""
    _, frac = _f32_fields_as_f64(b)
    return nl.left_shift(nl.bitwise_and(frac, 7), 29)


def f64_to_f32_bits(hi, lo):
    """The fp32 bits of a float64 given as int32 words, rounded to nearest-even like a C cast:
    normals round their 29 dropped bits; results below 2**-126 shift the 24-bit significand right
    by 1..25 with guard and sticky bits; overflow gives inf; NaN stays a quiet NaN with its payload."""
    exp = nl.bitwise_and(nl.right_shift(hi, 20), 0x7FF)
    top = nl.bitwise_or(nl.left_shift(nl.bitwise_and(hi, 0xFFFFF), 3), nl.bitwise_and(nl.right_shift(lo, 29), 7))
    rest = nl.bitwise_and(lo, 0x1FFFFFFF)  # the 29 fraction bits fp32 drops
    half = 0x10000000
    odd = nl.bitwise_and(top, 1)
    up = nl.bitwise_or(nl.greater(rest, half), nl.bitwise_and(nl.equal(rest, half), odd))
    normal = nl.add(nl.bitwise_or(nl.left_shift(nl.subtract(exp, 896), 23), top), up)
    # subnormal results: q = significand >> j, rounded on the guard bit and the bits below it
    sig = nl.bitwise_or(top, 0x800000)
    j = nl.minimum(nl.maximum(nl.subtract(897, exp), 1), 25)
    j1 = nl.subtract(j, 1)
    q = nl.right_shift(sig, j)
    upper = nl.right_shift(sig, j1)
    guard = nl.bitwise_and(upper, 1)
    below = nl.subtract(sig, nl.left_shift(upper, j1))
    sticky = nl.bitwise_or(nl.not_equal(below, 0), nl.not_equal(rest, 0))
    tiny = nl.add(q, nl.bitwise_and(guard, nl.bitwise_or(sticky, nl.bitwise_and(q, 1))))
    r = where(nl.greater_equal(exp, 897), normal, tiny)
    r = where_value(nl.greater_equal(exp, 1151), 0x7F800000, r)
    nan = nl.bitwise_and(nl.equal(exp, 2047), nl.not_equal(nl.bitwise_or(nl.bitwise_and(hi, 0xFFFFF), lo), 0))
    r = where(nan, nl.bitwise_or(top, 0x7FC00000), r)
    return nl.bitwise_or(r, nl.bitwise_and(hi, -0x80000000))


def tri_keep_lower(cols, rows, diagonal):
    """``tril``'s mask: column - row <= diagonal."""
    return nl.less_equal(nl.subtract(cols, rows), diagonal)


def tri_keep_upper(cols, rows, diagonal):
    """``triu``'s mask: column - row >= diagonal."""
    return nl.greater_equal(nl.subtract(cols, rows), diagonal)


def onehot_rows(ids, idx, padding_idx):
    """1 where row id == index (and the index is not ``padding_idx``), else 0."""
    return nl.logical_and(nl.equal(ids, idx), nl.not_equal(idx, padding_idx))


# ---- comparisons, logic -----------------------------------------------------------------------

eq, ne, lt, le, gt, ge = nl.equal, nl.not_equal, nl.less, nl.less_equal, nl.greater, nl.greater_equal
logical_and, logical_or, logical_xor = nl.logical_and, nl.logical_or, nl.logical_xor


bitwise_and, bitwise_or, bitwise_xor = nl.bitwise_and, nl.bitwise_or, nl.bitwise_xor


def bitwise_not(x):
    return nl.bitwise_xor(x, -1)


def isneginf(x):
    return nl.equal(x, -math.inf)


def isposinf(x):
    return nl.equal(x, math.inf)


# ---- ternary ------------------------------------------------------------------------------------

def addcmul(s, a, b, value):
    return nl.add(s, nl.multiply(nl.multiply(a, value), b))


def addcdiv(s, a, b, value):
    return nl.add(s, nl.divide(nl.multiply(a, value), b))


def addmm_epilogue(prod, inp, alpha, beta):
    return nl.add(nl.multiply(prod, alpha), nl.multiply(inp, beta))


def lerp(s, e, w):
    """ATen's lerp: ``s + w * (e - s)`` for ``|w| < 0.5``, else ``e - (e - s) * (1 - w)``."""
    d = nl.subtract(e, s)
    lo = nl.add(s, nl.multiply(w, d))
    hi = _lerp_from_end(e, d, w)
    return where(nl.less(abs_(w), 0.5), lo, hi)


def _lerp_from_end(e, d, w):
    return nl.subtract(e, nl.multiply(d, nl.subtract(1.0, w)))


def lerp_small_weight(s, e, w):
    """``lerp`` for a weight known (when tracing) to be under 0.5 in magnitude: its first branch alone, the same
    instructions (bit-identical), without the other branch and the select."""
    return nl.add(s, nl.multiply(w, nl.subtract(e, s)))


def lerp_large_weight(s, e, w):
    """``lerp`` for a weight known (when tracing) to be 0.5 or more in magnitude (or NaN): its second branch alone."""
    return _lerp_from_end(e, nl.subtract(e, s), w)


# ---- activations and their gradients -----------------------------------------------------------

def _act_grad(name: str, g, x):
    d = nl.ndarray(x.shape, x.dtype)
    nisa.activation(dst=d, op=name, data=x)
    return nl.multiply(g, d)


def gelu_backward(g, x):
    return _act_grad("gelu_dx", g, x)


def gelu_tanh_backward(g, x):
    return _act_grad("gelu_apprx_tanh_dx", g, x)


def silu_backward(g, x):
    return _act_grad("silu_dx", g, x)


def sigmoid_backward(g, y):
    return nl.multiply(nl.multiply(g, nl.subtract(1.0, y)), y)


def tanh_backward(g, y):
    return nl.multiply(g, nl.subtract(1.0, nl.multiply(y, y)))


def threshold(x, t, v):
    return where(nl.less_equal(x, t), _fill(x, x, v), x)


def threshold_backward(g, x, t):
    return where(nl.less_equal(x, t), _fill(g, x, 0), g)


def leaky_relu(x, slope):
    return where(nl.greater(x, 0.0), x, nl.multiply(x, slope))


def leaky_relu_backward(g, x, slope):
    return where(nl.greater(x, 0.0), g, nl.multiply(g, slope))


def hardtanh_backward(g, x, lo, hi):
    out = nl.logical_or(nl.less_equal(x, lo), nl.greater_equal(x, hi))
    return where(out, _fill(g, x, 0), g)


def hardsigmoid(x):
    return nl.divide(nl.minimum(nl.maximum(nl.add(x, 3.0), 0.0), 6.0), 6.0)


def hardswish(x):
    return nl.divide(nl.multiply(x, nl.minimum(nl.maximum(nl.add(x, 3.0), 0.0), 6.0)), 6.0)


def softplus(x, beta, threshold_):
    xb = nl.multiply(x, beta)
    soft = nl.divide(log1p(nl.exp(xb)), beta)
    return where(nl.greater(xb, threshold_), x, soft)


def hardsigmoid_backward(g, x):
    """ATen's: g / 6 strictly inside (-3, 3), else 0."""
    inside = nl.logical_and(nl.greater(x, -3.0), nl.less(x, 3.0))
    return where(inside, nl.divide(g, 6.0), _fill(g, x, 0))


def hardswish_backward(g, x):
    """ATen's: 0 up to -3, g * (x / 3 + 0.5) inside, g from 3 (NaN stays NaN)."""
    mid = where(nl.less_equal(x, -3.0), _fill(g, x, 0), nl.multiply(g, nl.add(nl.divide(x, 3.0), 0.5)))
    return where(nl.greater_equal(x, 3.0), g, mid)


def softplus_backward(g, x, beta, threshold_):
    """ATen's: z = exp(x * beta); g where x * beta > threshold, else g * z / (z + 1)."""
    xb = nl.multiply(x, beta)
    z = nl.exp(xb)
    return where(nl.greater(xb, threshold_), g, nl.divide(nl.multiply(g, z), nl.add(z, 1.0)))


def elu_backward(g, x, negcoef, poscoef, negiptcoef):
    """ATen's ELU gradient from the input: g * negiptcoef * negcoef * exp(x * negiptcoef) where x <= 0."""
    neg = nl.multiply(nl.multiply(nl.multiply(g, negiptcoef), negcoef), nl.exp(nl.multiply(x, negiptcoef)))
    return where(nl.greater(x, 0.0), nl.multiply(g, poscoef), neg)          # NaN takes the NaN branch


def elu_backward_result(g, y, negcoef, poscoef, negiptcoef):
    """ATen's ELU gradient from the output y: g * negiptcoef * (y + negcoef) where y <= 0."""
    neg = nl.multiply(nl.multiply(g, negiptcoef), nl.add(y, negcoef))
    return where(nl.greater(y, 0.0), nl.multiply(g, poscoef), neg)


def mish(x):
    return nl.multiply(x, nl.tanh(log1p(nl.exp(x))))


def elu(x, alpha, scale, input_scale):
    neg_part = nl.multiply(expm1(nl.multiply(x, input_scale)), nl.multiply(alpha, scale))
    return where(nl.less_equal(x, 0.0), neg_part, nl.multiply(x, scale))


def logit(x):
    return nl.log(nl.divide(x, nl.subtract(1.0, x)))


def logit_eps(x, lo, hi):
    return logit(clamp(x, lo, hi))


def nan_to_num(x, nan, posinf, neginf):
    r = where(isnan(x), _fill(x, x, nan), x)
    r = where(nl.equal(x, math.inf), _fill(x, x, posinf), r)
    return where(nl.equal(x, -math.inf), _fill(x, x, neginf), r)
