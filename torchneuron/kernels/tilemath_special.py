"""Tile math of special functions (lgamma, digamma, polygamma, erfinv, erfc, Bessel I0/I1, ...).

Each function composes ``nl`` ops over fp32 tiles, as ``tilemath`` does. The formulations are
chosen to stay within PyTorch's float32 OpInfo tolerances against the CPU's own float kernels:
small arguments are shifted up by the recurrence before an asymptotic series, negative ones go
through the reflection formula (the exact ``x - round(x)`` keeps ``sin(pi x)`` accurate), and
special values (inf, nan, poles) are selected bit-exactly with ``tilemath.where``.
"""
from __future__ import annotations

import functools
import math

import torchneuron.nki.language as nl
from torchneuron.kernels import tilemath as tm

INF, NAN = math.inf, math.nan
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
SHIFT = 8          # lgamma: arguments below this are shifted up by the recurrence
PSI_SHIFT = 10     # digamma/polygamma: the same for their asymptotic series


def _c(like, value):
    """A tile shaped like ``like`` holding the constant ``value``."""
    return tm._const(like, value)


def _sel(c, value, b):
    """``c ? value : b`` for a constant ``value`` (bit-exact for the rest)."""
    return tm.where(c, _c(b, value), b)


def _horner(t, coeffs):
    """``sum(coeffs[k] * t**k)`` by Horner's rule (coefficients lowest order first)."""
    acc = nl.add(nl.multiply(t, coeffs[-1]), coeffs[-2])
    for c in reversed(coeffs[:-2]):
        acc = nl.add(nl.multiply(acc, t), c)
    return acc


def _is_int(x):
    """1 where ``x`` is an integer (inf included), else 0."""
    return nl.equal(x, tm.floor(x))


def _sin_pi_reduced(x):
    """``sin(pi * r)`` with ``r = x - round(x)`` (|r| <= 1/2; same magnitude as ``sin(pi x)``, signs may differ)."""
    r = nl.subtract(x, tm._round_even(x))
    return nl.sin(nl.multiply(r, math.pi)), r


def _cos_pi_reduced(r):
    """``cos(pi r)`` for ``|r| <= 1/2`` as ``sin(pi (1/2 - |r|))``: exactly 0 at ``|r| = 1/2``."""
    return nl.sin(nl.multiply(nl.subtract(0.5, tm.abs_(r)), math.pi))


# ---- lgamma -------------------------------------------------------------------------------------

def _lgamma_pos(x):
    """lgamma for ``x >= 0`` (Stirling's series after shifting ``x`` above ``SHIFT``)."""
    small = nl.less(x, float(SHIFT))
    prod = x
    for k in range(1, SHIFT):
        prod = nl.multiply(prod, nl.add(x, float(k)))
    z = tm.where(small, nl.add(x, float(SHIFT)), x)
    logp = nl.log(tm.where(small, prod, _c(x, 1.0)))
    # Stirling: (z - 1/2) log z - z + log(2 pi)/2 + 1/(12 z) - 1/(360 z^3) + 1/(1260 z^5) - 1/(1680 z^7)
    iz = nl.divide(1.0, z)
    iz2 = nl.multiply(iz, iz)
    series = nl.multiply(iz, _horner(iz2, [1 / 12, -1 / 360, 1 / 1260, -1 / 1680]))
    main = nl.multiply(nl.subtract(z, 0.5), nl.subtract(nl.log(z), 1.0))
    r = nl.add(nl.add(main, HALF_LOG_2PI - 0.5), series)
    return nl.subtract(r, logp)


def lgamma(x):
    """``log|Gamma(x)|``: Stirling with the recurrence for x >= 0, reflection
    ``log(pi / |sin(pi x)|) - lgamma(1 - x)`` below 0; inf at poles (every x <= -2**23) and at +-inf."""
    neg = nl.less(x, 0.0)
    y = tm.where(neg, nl.subtract(1.0, x), x)
    pos = _lgamma_pos(y)
    s, _ = _sin_pi_reduced(x)
    refl = nl.subtract(nl.log(nl.divide(math.pi, tm.abs_(s))), pos)
    r = tm.where(neg, refl, pos)
    # from -2**23 down every fp32 is an integer, a pole (the reflection there is inf - inf); +inf comes out of
    # Stirling's series as inf
    return _sel(nl.less_equal(x, -8388608.0), INF, r)


# ---- digamma, polygamma ---------------------------------------------------------------------------

def _shifted(x, order):
    """(z, sum): ``z = x + PSI_SHIFT`` where ``x < PSI_SHIFT`` (else x), and ``sum((x + k) ** -order)``
    over the shifted steps (0 where unshifted)."""
    small = nl.less(x, float(PSI_SHIFT))
    acc = None
    for k in range(PSI_SHIFT):
        t = nl.divide(1.0, nl.add(x, float(k))) if k else nl.divide(1.0, x)
        p = t
        for _ in range(order - 1):
            p = nl.multiply(p, t)
        acc = p if acc is None else nl.add(acc, p)
    z = tm.where(small, nl.add(x, float(PSI_SHIFT)), x)
    return z, tm.where(small, acc, _c(x, 0.0))


def _digamma_pos(x):
    """digamma for ``x > 0``: recurrence, then ``log z - 1/(2z) - sum B_2k / (2k z^2k)``."""
    z, s = _shifted(x, 1)
    iz = nl.divide(1.0, z)
    iz2 = nl.multiply(iz, iz)
    series = nl.multiply(iz2, _horner(iz2, [1 / 12, -1 / 120, 1 / 252, -1 / 240, 1 / 132]))
    r = nl.subtract(nl.subtract(nl.log(z), nl.multiply(iz, 0.5)), series)
    return nl.subtract(r, s)


def digamma(x):
    """digamma: the positive branch, reflection ``psi(1 - x) - pi cot(pi x)`` below 0; ATen's special
    values: -inf at +0, +inf at -0, nan at negative integers."""
    neg = nl.less(x, 0.0)
    y = tm.where(neg, nl.subtract(1.0, x), x)
    pos = _digamma_pos(y)
    s, r = _sin_pi_reduced(x)
    cot = nl.divide(_cos_pi_reduced(r), s)
    res = tm.where(neg, nl.subtract(pos, nl.multiply(cot, math.pi)), pos)
    res = _sel(nl.logical_and(neg, _is_int(x)), NAN, res)
    zero = nl.equal(x, 0.0)
    return tm.where(zero, tm.copysign(_c(x, INF), tm.neg(x)), res)


# Bernoulli numbers B_2k, k = 1..5
_B2K = [1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66]


def _polygamma_pos(n: int, x):
    """psi^(n)(x) for ``x > 0``, n >= 1: recurrence, then the asymptotic series
    ``(-1)^(n+1) [(n-1)!/z^n + n!/(2 z^(n+1)) + sum B_2k (2k+n-1)!/((2k)! z^(2k+n))]``."""
    z, s = _shifted(x, n + 1)
    iz = nl.divide(1.0, z)
    iz2 = nl.multiply(iz, iz)
    coeffs = [math.factorial(n - 1), math.factorial(n) / 2]
    coeffs += [b * math.factorial(2 * k + n - 1) / math.factorial(2 * k) for k, b in enumerate(_B2K, 1)]
    # sum_k c_k / z^(n + k') ordered by powers of 1/z: terms 0, 1 then 2, 4, 6, ... (even powers)
    even = _horner(iz2, coeffs[2:])                       # sum_k c_{k+2} iz^(2k)
    tail = nl.add(nl.multiply(iz, coeffs[1]), nl.multiply(iz2, even))
    head = nl.add(tail, float(coeffs[0]))
    izn = iz
    for _ in range(n - 1):
        izn = nl.multiply(izn, iz)
    series = nl.multiply(head, izn)
    total = nl.add(series, nl.multiply(s, float(math.factorial(n))))
    return total if n % 2 else tm.neg(total)


@functools.cache
def _cot_derivative_poly(n: int) -> tuple:
    """Coefficients (lowest first) of ``P_n`` with ``d^n cot(u) / du^n = P_n(cot u)``: ``P_0 = c``,
    ``P_(k+1) = -(1 + c^2) P_k'(c)``."""
    p = [0.0, 1.0]
    for _ in range(n):
        d = [i * p[i] for i in range(1, len(p))] or [0.0]
        q = [0.0] * (len(d) + 2)
        for i, v in enumerate(d):
            q[i] -= v
            q[i + 2] -= v
        p = q
    return tuple(p)


def _cot_derivative(n: int, s, c):
    """``d^n/dx^n cot(pi x) / pi^n`` from ``s = sin(pi x)``, ``c = cos(pi x)``: ``P_n(cot(pi x))``."""
    cot = nl.divide(c, s)
    coeffs = list(_cot_derivative_poly(n))
    while len(coeffs) > 2 and coeffs[-1] == 0:
        coeffs.pop()
    return _horner(cot, coeffs)


@functools.cache
def polygamma(n: int):
    """The tile function of ``polygamma(n, x)``: digamma for n = 0; for n >= 1 the positive branch
    and below 0 the reflection ``psi^(n)(x) = (-1)^n psi^(n)(1-x) - pi d^n cot(pi x)/dx^n``."""
    if n == 0:
        return digamma

    def op(x):
        neg = nl.less(x, 0.0)
        y = tm.where(neg, nl.subtract(1.0, x), x)
        pos = _polygamma_pos(n, y)
        if n == 1:
            # ATen's float trigamma reflects with sin(pi x) unreduced: keep its values (finite at
            # negative integers, nan at -inf)
            s = nl.sin(nl.multiply(x, math.pi))
            return tm.where(neg, nl.subtract(nl.divide(math.pi ** 2, nl.multiply(s, s)), pos), pos)
        s, r = _sin_pi_reduced(x)
        d = nl.multiply(_cot_derivative(n, s, _cos_pi_reduced(r)), math.pi ** (n + 1))
        refl = nl.subtract(pos if n % 2 == 0 else tm.neg(pos), d)
        res = tm.where(neg, refl, pos)
        pole = nl.logical_and(nl.less_equal(x, 0.0), _is_int(x))  # ATen's zeta: inf at q <= 0 integers
        res = _sel(pole, INF if n % 2 else -INF, res)
        return _sel(nl.equal(x, INF), NAN, res)                   # and nan at q = inf (0 * inf in its tail)
    op.__name__ = f"polygamma_{n}"
    return op


# ---- error functions --------------------------------------------------------------------------------

# Chebyshev-fitted erfc (Press et al., Numerical Recipes, "erfcc"): fractional error < 1.2e-7 for all x
_ERFC = [-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
         -0.82215223, 0.17087277]


def erfc(x):
    """erfc by the Numerical Recipes fit ``t exp(-z^2 + P(t))``, ``t = 1/(1 + z/2)``; ``z^2`` is split as
    ``h^2 + (z - h)(z + h)`` with ``h`` on a 1/16 grid (``h^2`` exact), so large ``z`` keep ulps;
    ``erfc(-z) = 2 - erfc(z)``."""
    z = nl.minimum(tm.abs_(x), 20.0)  # erfc(20) underflows: keeps the split below finite
    t = nl.divide(1.0, nl.add(nl.multiply(z, 0.5), 1.0))
    h = nl.multiply(tm._round_even(nl.multiply(z, 16.0)), 0.0625)
    low = nl.multiply(nl.subtract(z, h), nl.add(z, h))
    e = nl.add(tm.neg(low), _horner(t, _ERFC))
    r = nl.multiply(nl.multiply(t, nl.exp(e)), nl.exp(tm.neg(nl.multiply(h, h))))
    return tm.where(nl.less(x, 0.0), nl.subtract(2.0, r), r)


def erfcx(x):
    """``exp(x^2) erfc(x)``: the Numerical Recipes fit without its Gaussian, ``t exp(P(t))``, for x >= 0;
    ``2 exp(x^2) - erfcx(-x)`` below 0 (inf past exp's overflow)."""
    z = tm.abs_(x)
    t = nl.divide(1.0, nl.add(nl.multiply(z, 0.5), 1.0))
    r = nl.multiply(t, nl.exp(_horner(t, _ERFC)))
    # exp(x * x) rounded as ATen's float kernel does (its rounding dominates for x < -6)
    neg = nl.subtract(nl.multiply(nl.exp(nl.multiply(x, x)), 2.0), r)
    return tm.where(nl.less(x, 0.0), neg, r)


SQRT1_2 = math.sqrt(0.5)


def log_ndtr(x):
    """``log Phi(x)`` as ATen: ``log(erfcx(-t) / 2) - t^2`` below -1, else ``log1p(-erfc(t) / 2)``, t = x/sqrt 2."""
    t = nl.multiply(x, SQRT1_2)
    low = nl.subtract(nl.log(nl.multiply(erfcx(tm.neg(t)), 0.5)), nl.multiply(t, t))
    high = tm.log1p(nl.multiply(erfc(t), -0.5))
    return tm.where(nl.less(x, -1.0), low, high)


# Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011), single-precision branch
_GILES_LO = [1.50140941, 0.246640727, -0.00417768164, -0.00125372503, 0.00021858087, -4.39150654e-06,
             -3.5233877e-06, 3.43273939e-07, 2.81022636e-08]
_GILES_HI = [2.83297682, 1.00167406, 0.00943887047, -0.0076224613, 0.00573950773, -0.00367342844,
             0.00134934322, 0.000100950558, -0.000200214257]
TWO_OVER_SQRT_PI = 2 / math.sqrt(math.pi)


def erfinv(x):
    """erfinv: Giles' approximation in ``w = -log((1 - x)(1 + x))``, refined by one Newton step on
    ``erf`` (on ``erfc`` of |y| in the tail, where ``1 - |x|`` is exact); +-inf at +-1, nan outside."""
    ax = tm.abs_(x)
    one_minus = nl.subtract(1.0, ax)
    w = tm.neg(nl.log(nl.multiply(one_minus, nl.add(ax, 1.0))))
    lo = _horner(nl.subtract(w, 2.5), _GILES_LO)
    hi = _horner(nl.subtract(nl.sqrt(w), 3.0), _GILES_HI)
    y = nl.multiply(tm.where(nl.less(w, 5.0), lo, hi), ax)
    # Newton on f(y) = erf(y) - |x| = (1 - |x|) - erfc(y): the erfc form keeps the tail's residual exact
    resid = tm.where(nl.less(ax, 0.5), nl.subtract(nl.erf(y), ax), nl.subtract(one_minus, erfc(y)))
    deriv = nl.multiply(nl.exp(tm.neg(nl.multiply(y, y))), TWO_OVER_SQRT_PI)
    step = nl.divide(resid, deriv)
    y = tm.where(nl.less(tm.abs_(step), 1.0), nl.subtract(y, step), y)
    y = _sel(nl.equal(ax, 1.0), INF, y)
    y = _sel(nl.greater(ax, 1.0), NAN, y)
    return tm.copysign(y, x)


# ---- modified Bessel functions I0, I1 (and exponentially scaled) -------------------------------------

BESSEL_SWITCH = 10.0     # power series below, Hankel's asymptotic expansion above
_SERIES_TERMS = 28
_ASYM_TERMS = 18


def _bessel_series(x, nu: int):
    """``sum (x^2/4)^k / (k! (k + nu)!)`` (all terms positive: no cancellation)."""
    q = nl.multiply(nl.multiply(x, x), 0.25)
    term = _c(x, 1.0 / math.factorial(nu))
    acc = term
    for k in range(1, _SERIES_TERMS):
        term = nl.multiply(nl.multiply(term, q), 1.0 / (k * (k + nu)))
        acc = nl.add(acc, term)
    return acc


def _bessel_asym(z, nu: int):
    """``sqrt(2 pi z) e^-z I_nu(z)`` by Hankel's expansion ``sum (-1)^k prod_j (4nu^2 - (2j-1)^2) / (k! (8z)^k)``."""
    coeffs, c = [1.0], 1.0
    for k in range(1, _ASYM_TERMS):
        c *= -(4 * nu * nu - (2 * k - 1) ** 2) / (k * 8)
        coeffs.append(c)
    return _horner(nl.divide(1.0, z), coeffs)


def _bessel(x, nu: int, scaled: bool):
    """I_nu(x) (``scaled``: ``e^-|x| I_nu(x)``) for nu in (0, 1)."""
    z = tm.abs_(x)
    big = nl.greater(z, BESSEL_SWITCH)
    zs = tm.where(big, z, _c(z, BESSEL_SWITCH))         # keeps the unused branch finite
    # in ATen's (Cephes) order, e^z * P / sqrt(z): inf past exp's overflow, nan at inf
    p = _bessel_asym(zs, nu) if scaled else nl.multiply(nl.exp(zs), _bessel_asym(zs, nu))
    asym = nl.multiply(nl.divide(p, nl.sqrt(zs)), 1 / math.sqrt(2 * math.pi))
    zsm = tm.where(big, _c(z, 1.0), z)
    series = _bessel_series(zsm, nu)
    if nu == 1:
        series = nl.multiply(series, nl.multiply(zsm, 0.5))
    if scaled:
        series = nl.multiply(series, nl.exp(tm.neg(zsm)))
    r = tm.where(big, asym, series)
    return tm.copysign(r, x) if nu == 1 else r


def i0(x):
    """Modified Bessel I0."""
    return _bessel(x, 0, False)


def i0e(x):
    """``e^-|x| I0(x)``."""
    return _bessel(x, 0, True)


def i1(x):
    """Modified Bessel I1 (odd)."""
    return _bessel(x, 1, False)


def i1e(x):
    """``e^-|x| I1(x)``."""
    return _bessel(x, 1, True)


# ---- log-sum-exp, logs, shrinks ---------------------------------------------------------------------

def logaddexp(a, b):
    """ATen's ``max + log1p(exp(-|a - b|))``; equal infinities give themselves."""
    m = nl.maximum(a, b)
    r = nl.add(m, tm.log1p(nl.exp(tm.neg(tm.abs_(nl.subtract(a, b))))))
    same_inf = nl.logical_and(tm.isinf(a), nl.equal(a, b))
    return tm.where(same_inf, m, r)


def logaddexp2(a, b):
    """``max + log1p(2^-|a - b|) / ln 2``; equal infinities give themselves."""
    m = nl.maximum(a, b)
    d = tm.neg(tm.abs_(nl.subtract(a, b)))
    r = nl.add(m, nl.multiply(tm.log1p(nl.exp(nl.multiply(d, math.log(2)))), 1 / math.log(2)))
    same_inf = nl.logical_and(tm.isinf(a), nl.equal(a, b))
    return tm.where(same_inf, m, r)


def heaviside(x, v):
    """``x == 0 ? v : (x > 0)``."""
    return tm.where(nl.equal(x, 0), tm._fill(x, v, v), nl.greater(x, 0))


def log1p_wide(y):
    """log1p over the whole range: Kahan's form (``tilemath.log1p``) overflows its product for huge ``y``
    and gives -inf at -inf; ``log(1 + y)`` is exact enough once ``|y| > 1e6``."""
    return tm.where(nl.greater(tm.abs_(y), 1e6), nl.log(nl.add(y, 1.0)), tm.log1p(y))


def xlog1py(x, y):
    """``x * log1p(y)``, 0 where x == 0 unless y is nan."""
    r = tm.where(nl.equal(x, 0.0), tm._fill(x, y, 0), nl.multiply(x, log1p_wide(y)))
    return tm.where(tm.isnan(y), nl.add(tm._fill(x, y, 0), y), r)


def entr(x):
    """``-x log x`` for x > 0, 0 at 0, -inf below, nan for nan."""
    r = tm.neg(nl.multiply(x, nl.log(x)))
    r = _sel(nl.equal(x, 0.0), 0.0, r)
    return _sel(nl.less(x, 0.0), -INF, r)


def log_sigmoid(x):
    """``min(x, 0) - log1p(exp(-|x|))``."""
    return nl.subtract(nl.minimum(x, 0.0), tm.log1p(nl.exp(tm.neg(tm.abs_(x)))))


def log_sigmoid_buffer(x):
    """The CPU kernel's saved buffer ``exp(-|x|)``."""
    return nl.exp(tm.neg(tm.abs_(x)))


def log_sigmoid_backward(g, x):
    """``g * (max_deriv - sign * z / (1 + z))``, ``z = exp(-|x|)``, as ATen's CPU kernel."""
    z = nl.exp(tm.neg(tm.abs_(x)))
    q = nl.divide(z, nl.add(z, 1.0))
    negx = nl.less(x, 0.0)
    d = tm.where(negx, nl.subtract(1.0, q), q)
    return nl.multiply(g, d)


def softshrink(x, lambd):
    """``x - l`` above l, ``x + l`` below -l, else ``x * 0`` (nan stays nan)."""
    r = tm.where(nl.less(x, nl.multiply(lambd, -1.0)), nl.add(x, lambd), nl.multiply(x, 0.0))
    return tm.where(nl.greater(x, lambd), nl.subtract(x, lambd), r)


def _inside(x, lambd):
    return nl.logical_and(nl.greater_equal(x, nl.multiply(lambd, -1.0)), nl.less_equal(x, lambd))


def hardshrink(x, lambd):
    """0 inside [-l, l], else x."""
    return tm.where(_inside(x, lambd), tm._fill(x, x, 0), x)


def shrink_backward(g, x, lambd):
    """The gradient outside [-l, l], else 0 (both shrinks; nan inputs get 0, as on the CPU)."""
    outside = nl.logical_or(nl.less(x, nl.multiply(lambd, -1.0)), nl.greater(x, lambd))
    return tm.where(outside, g, tm._fill(g, x, 0))


def logit_backward(g, x):
    """``g / (x (1 - x))``, nan outside [0, 1]."""
    r = nl.divide(g, nl.multiply(x, nl.subtract(1.0, x)))
    out = nl.logical_or(nl.less(x, 0.0), nl.greater(x, 1.0))
    return _sel(out, NAN, r)


def logit_backward_eps(g, x, lo, hi):
    """``g / (x (1 - x))`` inside [lo, hi], else 0 (nan included, as the CPU's vectorized kernel)."""
    r = nl.divide(g, nl.multiply(x, nl.subtract(1.0, x)))
    inside = nl.logical_and(nl.greater_equal(x, lo), nl.less_equal(x, hi))
    return tm.where(inside, r, tm._fill(g, x, 0))


def nextafter(a, b):
    """The next float after ``a`` towards ``b``: its bits +-1 (a signed smallest denormal from 0)."""
    ia = tm._bits(a)
    up = nl.equal(nl.less(a, b), nl.greater(a, 0.0))        # moving away from 0: bits + 1
    moved = tm._from_bits(tm.where(up, nl.add(ia, 1), nl.subtract(ia, 1)), a)
    tiny = tm.copysign(tm._fill(a, b, 1.401298464324817e-45), b)
    r = tm.where(nl.equal(a, 0.0), tiny, moved)
    r = tm.where(nl.equal(a, b), b, r)
    return tm.where(nl.logical_or(tm.isnan(a), tm.isnan(b)), nl.add(a, b), r)


def _frexp_parts(x):
    """(x scaled into the normal range, 1 where it was a denormal, 1 where frexp passes x through)."""
    sub = nl.less(tm.abs_(x), 1.1754943508222875e-38)
    y = tm.where(sub, nl.multiply(x, 16777216.0), x)
    special = nl.logical_or(nl.equal(x, 0.0), nl.logical_or(tm.isinf(x), tm.isnan(x)))
    return y, sub, special


def frexp_mantissa(x):
    """frexp's mantissa in [0.5, 1): the exponent field set to 126 (denormals scaled by 2^24 first)."""
    y, _, special = _frexp_parts(x)
    bits = nl.bitwise_or(nl.bitwise_and(tm._bits(y), -0x7F800001), 126 << 23)
    return tm.where(special, x, tm._from_bits(bits, y))


def frexp_exponent(x):
    """frexp's exponent: the exponent field - 126 (- 24 more for denormals; 0 for 0, inf, nan)."""
    y, sub, special = _frexp_parts(x)
    e = nl.right_shift(nl.bitwise_and(tm._bits(y), 0x7F800000), 23)
    e = tm.where(sub, nl.subtract(e, 150), nl.subtract(e, 126))
    return tm.where(special, _c(e, 0), e)


def prelu(x, w):
    """``x > 0 ? x : w * x``."""
    return tm.where(nl.greater(x, 0.0), x, nl.multiply(x, w))


def prelu_grad_input(g, x, w):
    """``x > 0 ? g : w * g``."""
    return tm.where(nl.greater(x, 0.0), g, nl.multiply(g, w))


def prelu_grad_weight(g, x):
    """``x > 0 ? 0 : x * g`` (summed over the non-channel dims afterwards)."""
    return tm.where(nl.greater(x, 0.0), tm._fill(g, x, 0), nl.multiply(g, x))


# ---- regularized incomplete gamma P(a, x), Q(a, x) --------------------------------------------------

IGAMMA_SERIES_TERMS = 48    # sum x^n / ((a+1)...(a+n)) for x < a + 1: converged for a <= IGAMMA_A_MAX
IGAMMA_CF_TERMS = 32        # Lentz steps of Legendre's continued fraction for x >= a + 1
IGAMMA_A_MAX = 40.0         # above: Temme's uniform expansion (the two above would need more terms)
# lgamma(a+1) - ((a+1/2) log a - a + log(2 pi)/2) = sum B_2k / (2k (2k-1) a^(2k-1)): within 5e-8 for a >= 3
_STIRLING_TAIL = [1 / 12, -1 / 360, 1 / 1260, -1 / 1680, 1 / 1188]
IGAMMA_STIRLING_A = 3.0
# d - log1p(d) = d^2 sum (-1)^k d^k / (k + 2) for |d| < 1/4 (14 terms: 4^-14 below fp32's ulp)
_DM_LOG1P = [(-1) ** k / (k + 2) for k in range(14)]
# Temme's coefficients c0, c1 of eta (DLMF 8.12) as Taylor series about eta = 0, where their closed
# forms cancel; derived by reverting eta^2 / 2 = lambda - 1 - log(lambda)
_TEMME_C0 = [-1 / 3, 1 / 12, -2 / 135, 1 / 864, 1 / 2835, -139 / 777600, 1 / 25515, -571 / 261273600]
_TEMME_C1 = [-1 / 540, -1 / 288, 1 / 378, -77 / 77760, 1 / 4860, -1 / 2488320]
TEMME_TAYLOR_ETA = 0.5


# lgamma(2 + e) = (1 - gamma) e + sum_k>=2 (-1)^k (zeta(k) - 1) e^k / k: for |e| <= 1/2 the terms fall as 4^-k
_ZETA_M1 = [0.6449340668482264, 0.2020569031595943, 0.08232323371113819, 0.03692775514336993,
            0.01734306198444914, 0.008349277381922827, 0.00407735619794434, 0.0020083928260822143,
            0.0009945751278180853, 0.0004941886041194645, 0.0002460865533080483, 0.00012271334757848915,
            6.124813505870483e-05]                                       # zeta(k) - 1, k = 2..14
_LGAMMA2_SERIES = [0.0, 0.42278433509846713] + [(-1) ** k * z / k for k, z in enumerate(_ZETA_M1, 2)]


def _lgamma1p_small(a):
    """``lgamma(1 + a)`` for ``0 <= a <= IGAMMA_STIRLING_A``, accurate in absolute terms near its zeros
    (a = 0, 1), unlike the shifted Stirling of ``lgamma``: the series of ``lgamma(2 + e)`` at
    ``e = a - 1 - m``, ``m = floor(a + 1/2) - 1``, and the recurrence's logs for the shift m."""
    m = nl.subtract(tm.floor(nl.add(a, 0.5)), 1.0)
    e = nl.subtract(nl.subtract(a, 1.0), m)
    r = _horner(e, _LGAMMA2_SERIES)
    r = tm.where(nl.less(m, 0.0), nl.subtract(r, tm.log1p(a)), r)
    r = tm.where(nl.equal(m, 1.0), nl.add(r, nl.log(a)), r)
    return tm.where(nl.greater(m, 1.0), nl.add(r, nl.log(nl.multiply(a, nl.subtract(a, 1.0)))), r)


def _d_minus_log1p(d):
    """``d - log1p(d)`` (>= 0), by its series near 0 where the difference cancels."""
    near = nl.less(tm.abs_(d), 0.25)
    dn = tm.where(near, d, _c(d, 0.0))
    series = nl.multiply(nl.multiply(dn, dn), _horner(dn, _DM_LOG1P))
    return tm.where(near, series, nl.subtract(d, log1p_wide(d)))


def _igamma_log_prefactor(a, x):
    """``log(x^a e^-x / Gamma(a + 1))``: directly for small a; for larger a as ``-a (d - log1p d)`` with
    ``d = (x - a) / a`` minus Stirling's rest, which keeps the cancelling a log x and lgamma out of fp32."""
    big = nl.greater(a, IGAMMA_STIRLING_A)
    a_small = tm.where(big, _c(a, 1.0), a)
    small = nl.subtract(nl.subtract(nl.multiply(a, nl.log(x)), x), _lgamma1p_small(a_small))
    ab = tm.where(big, a, _c(a, IGAMMA_STIRLING_A))      # keeps the unused branch finite
    lead = nl.multiply(_d_minus_log1p(nl.divide(nl.subtract(x, ab), ab)), ab)
    iz = nl.divide(1.0, ab)
    tail = nl.multiply(iz, _horner(nl.multiply(iz, iz), _STIRLING_TAIL))
    large = tm.neg(nl.add(nl.add(lead, nl.multiply(nl.log(nl.multiply(ab, 2 * math.pi)), 0.5)), tail))
    return tm.where(big, large, small)


def _igamma_temme(a, x):
    """(P, Q) for large a by Temme's uniform expansion: ``Q = erfc(eta sqrt(a/2)) / 2 + R``,
    ``R = e^(-a eta^2 / 2) / sqrt(2 pi a) (c0(eta) + c1(eta) / a)``, ``eta = sign(x - a) sqrt(2 (d - log1p d))``
    (the next term, c2 / a^2, is below fp32's resolution for a > 40: c2(0) / a^2 / sqrt(2 pi a) < 3e-7)."""
    d = nl.divide(nl.subtract(x, a), a)
    half_eta2 = _d_minus_log1p(d)
    eta = tm.copysign(nl.sqrt(nl.multiply(half_eta2, 2.0)), d)
    near = nl.less(tm.abs_(eta), TEMME_TAYLOR_ETA)
    en = tm.where(near, eta, _c(eta, 0.0))
    ef = tm.where(near, _c(eta, 1.0), eta)               # the closed forms, kept away from eta = 0
    u = tm.where(near, _c(d, 1.0), d)                    # lambda - 1
    iu = nl.divide(1.0, u)
    ie = nl.divide(1.0, ef)
    c0 = tm.where(near, _horner(en, _TEMME_C0), nl.subtract(iu, ie))
    c1_far = nl.subtract(nl.multiply(nl.multiply(ie, ie), ie),
                         nl.add(nl.multiply(nl.multiply(iu, iu), nl.add(iu, 1.0)), nl.multiply(iu, 1 / 12)))
    c1 = tm.where(near, _horner(en, _TEMME_C1), c1_far)
    ia = nl.divide(1.0, a)
    r = nl.multiply(nl.exp(nl.multiply(half_eta2, tm.neg(a))), nl.multiply(nl.sqrt(ia), 1 / math.sqrt(2 * math.pi)))
    r = nl.multiply(r, nl.add(c0, nl.multiply(c1, ia)))
    half = nl.multiply(erfc(nl.multiply(tm.abs_(eta), nl.sqrt(nl.multiply(a, 0.5)))), 0.5)
    upper = nl.greater_equal(eta, 0.0)
    q_up = nl.add(half, r)
    p_low = nl.subtract(half, r)
    return (tm.where(upper, nl.subtract(1.0, q_up), p_low), tm.where(upper, q_up, nl.subtract(1.0, p_low)))


def _igamma_main(a, x):
    """(P, Q) for finite a > 0, x > 0: the series of P below x = a + 1, the continued fraction of Q above,
    Temme's expansion for a > IGAMMA_A_MAX."""
    big = nl.greater(a, IGAMMA_A_MAX)
    a_s = tm.where(big, _c(a, 1.0), a)                   # each branch kept finite where unused
    x_s = tm.where(big, _c(x, 1.0), x)
    a_t = tm.where(big, a, _c(a, 2 * IGAMMA_A_MAX))
    pre = nl.exp(_igamma_log_prefactor(a_s, x_s))
    term = _c(x, 1.0)
    acc = term
    den = a_s
    for _ in range(IGAMMA_SERIES_TERMS):
        den = nl.add(den, 1.0)
        term = nl.multiply(term, nl.divide(x_s, den))
        acc = nl.add(acc, term)
    p_series = nl.multiply(pre, acc)
    # modified Lentz on Q = pre * a / (x + 1 - a - 1 (1 - a) / (x + 3 - a - 2 (2 - a) / ...)); in this
    # branch b >= 2 and the denominators stay away from 0, so no tiny-value guards are needed
    b = nl.subtract(nl.add(x_s, 1.0), a_s)
    c = _c(x, 1e30)
    d = nl.divide(1.0, b)
    h = d
    for i in range(1, IGAMMA_CF_TERMS + 1):
        an = nl.multiply(nl.subtract(a_s, float(i)), float(i))       # -i (i - a)
        b = nl.add(b, 2.0)
        d = nl.divide(1.0, nl.add(nl.multiply(d, an), b))
        c = nl.add(b, nl.divide(an, c))
        h = nl.multiply(h, nl.multiply(d, c))
    q_cf = nl.multiply(nl.multiply(pre, a_s), h)
    series = nl.less(x_s, nl.add(a_s, 1.0))
    p_t, q_t = _igamma_temme(a_t, tm.where(big, x, _c(x, 2 * IGAMMA_A_MAX)))
    p = tm.where(series, p_series, nl.subtract(1.0, q_cf))
    q = tm.where(series, nl.subtract(1.0, p_series), q_cf)
    return tm.where(big, p_t, p), tm.where(big, q_t, q)


def _igamma_edges(a, x, r, lower: bool):
    """The CPU's boundary values over ``r``, in its order of precedence (the last select wins)."""
    one, zero = (1.0, 0.0) if lower else (0.0, 1.0)
    r = _sel(tm.isinf(x), one, r)
    r = _sel(nl.equal(a, INF), zero, r)
    r = _sel(nl.logical_and(nl.equal(a, INF), tm.isinf(x)), NAN, r)
    r = _sel(nl.equal(x, 0.0), zero, r)
    r = _sel(nl.equal(a, 0.0), one, r)
    r = _sel(nl.logical_and(nl.equal(a, 0.0), tm.logical_not(nl.greater(x, 0.0))), NAN, r)
    return _sel(nl.logical_or(nl.less(x, 0.0), nl.less(a, 0.0)), NAN, r)


def igamma(a, x):
    """Regularized lower incomplete gamma ``P(a, x)``."""
    return _igamma_edges(a, x, _igamma_main(a, x)[0], True)


def igammac(a, x):
    """Regularized upper incomplete gamma ``Q(a, x)``."""
    return _igamma_edges(a, x, _igamma_main(a, x)[1], False)


# ---- CTC ---------------------------------------------------------------------------------------------

def ctc_alpha_step(stay, step, skip, emit):
    """One time step of CTC's forward recursion in log space: ``emit + log(e^stay + e^step + e^skip)``
    (``skip`` already -inf where the transition from two positions back is not allowed); -inf where no
    predecessor is reachable (the shift of the log-sum-exp is then 0, not -inf, to avoid inf - inf)."""
    m = nl.maximum(nl.maximum(stay, step), skip)
    m = tm.where(tm.isinf(m), _c(m, 0.0), m)
    total = nl.add(nl.add(nl.exp(nl.subtract(stay, m)), nl.exp(nl.subtract(step, m))),
                   nl.exp(nl.subtract(skip, m)))
    return nl.add(nl.add(nl.log(total), m), emit)
