"""The tile math of element-wise ops (``kernels.tilemath``) run through the element-wise kernel, against
PyTorch on the CPU: the single-operation and selection functions bit for bit, the composed ones within the
rounding bounds of their formulas, edge values (+-0, +-inf, NaN, magnitudes near fp32's limits) included."""
from __future__ import annotations

import math

import pytest
import torch

from torchneuron.kernels import elementwise, tilemath as tm

INF, NAN = math.inf, math.nan
EDGES = torch.tensor([0.0, -0.0, INF, -INF, NAN, 1e30, -1e30, 3e38, -3e38, 1e-30, -1e-30, 1.0, -1.0, 0.5, -0.5,
                      2.5, -2.5, 3.0, -3.0, 1e-7, -1e-7, 88.0, -88.0, 1e6, -1e6])
_g = torch.Generator().manual_seed(0)
X = torch.cat([EDGES, torch.randn(150, generator=_g), torch.randn(150, generator=_g) * 30,
               torch.rand(100, generator=_g) * 2 - 1])
# binary operands: every pair of a smaller set, as an [n, 1] column against an [n, n] tensor
PAIR = torch.cat([EDGES, torch.randn(20, generator=_g) * 4])
A2, B2 = PAIR.reshape(-1, 1), PAIR.reshape(1, -1).expand(PAIR.numel(), -1).contiguous()
EPS = torch.finfo(torch.float32).eps


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The fp32 spacing above |t| (float64; the smallest subnormal at 0)."""
    a = t.abs().float()
    return (torch.nextafter(a, torch.tensor(INF)).double() - a.double())


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits (signed zeros included) wherever the reference is not NaN, NaN where it is."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN in other places"
    differ = got.view(torch.int32) != want.view(torch.int32)
    assert not bool((differ & ~nan).any()), \
        f"{int((differ & ~nan).sum())} differ: {want[differ & ~nan][:3].tolist()} -> {got[differ & ~nan][:3].tolist()}"


def assert_within(got: torch.Tensor, want: torch.Tensor, ulps, atol: float = 0.0) -> None:
    """NaN and infinities where the reference has them; finite values within ``ulps`` fp32 units in the last
    place of the reference plus ``atol``."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    nan, inf = torch.isnan(want), torch.isinf(want)
    assert torch.equal(torch.isnan(got), nan), "NaN in other places"
    assert torch.equal(got[inf], want[inf]), "infinities differ"
    ulps = torch.as_tensor(ulps, dtype=torch.float64).expand(want.shape)
    fin = ~nan & ~inf
    err = (got[fin].double() - want[fin].double()).abs()
    bound = ulps[fin] * _ulp(want[fin]) + atol
    assert bool((err <= bound).all()), f"error over the bound by up to {float((err - bound).max()):.3g}"


# one ALU operation, an exact selection or the same operations in the same order as the CPU kernel: the same bits
EXACT_UNARY = {
    "neg": (tm.neg, torch.neg), "abs": (tm.abs_, torch.abs), "floor": (tm.floor, torch.floor),
    "ceil": (tm.ceil, torch.ceil), "trunc": (tm.trunc, torch.trunc),
    "sign": (tm.sign, torch.sign), "frac": (tm.frac, torch.frac), "relu": (tm.relu, torch.relu),
    "reciprocal": (tm.reciprocal, torch.reciprocal), "square": (tm.pow_scalar(2.0), torch.square),
    "clamp": (lambda x: tm.clamp(x, -1.5, 2.0), lambda x: torch.clamp(x, -1.5, 2.0)),
    "hardsigmoid": (tm.hardsigmoid, torch.nn.functional.hardsigmoid),
    "hardswish": (tm.hardswish, torch.nn.functional.hardswish), "logit": (tm.logit, torch.logit),
    "nan_to_num": (lambda x: tm.nan_to_num(x, 0.5, 1e4, -1e4), lambda x: torch.nan_to_num(x, 0.5, 1e4, -1e4)),
    "threshold": (lambda x: tm.threshold(x, 0.5, -7.0), lambda x: torch.threshold(x, 0.5, -7.0)),
    "leaky_relu": (lambda x: tm.leaky_relu(x, 0.125), lambda x: torch.nn.functional.leaky_relu(x, 0.125)),
    "deg2rad": (tm.deg2rad, torch.deg2rad),
}


@pytest.mark.parametrize("name", sorted(EXACT_UNARY))
def test_exact_unary_functions_give_the_cpus_bits(name):
    fn, ref = EXACT_UNARY[name]
    assert_bitwise(elementwise(fn, X), ref(X))


ROUNDINGS = {
    "round": (tm.round_, torch.round), "round_2": (tm.round_decimals(2), lambda x: torch.round(x, decimals=2)),
    "round_-1": (tm.round_decimals(-1), lambda x: torch.round(x, decimals=-1)),
}


@pytest.mark.parametrize("name", sorted(ROUNDINGS))
def test_rounding_gives_the_cpus_bits(name):
    fn, ref = ROUNDINGS[name]
    assert_bitwise(elementwise(fn, X), ref(X))


@pytest.mark.parametrize("name,ref", [("isnan", torch.isnan), ("isinf", torch.isinf), ("signbit", torch.signbit),
                                      ("isposinf", torch.isposinf), ("isneginf", torch.isneginf)])
def test_predicates_match_the_cpu(name, ref):
    assert torch.equal(elementwise(getattr(tm, name), X, out_dtype=torch.bool), ref(X))


EXACT_BINARY = {
    "add": (tm.add, torch.add), "sub": (tm.sub, torch.sub), "mul": (tm.mul, torch.mul), "div": (tm.div, torch.div),
    "maximum": (tm.maximum, torch.maximum), "minimum": (tm.minimum, torch.minimum), "fmod": (tm.fmod, torch.fmod),
    "remainder": (tm.remainder, torch.remainder),
    "copysign": (tm.copysign, torch.copysign),
    "div_trunc": (tm.div_trunc, lambda a, b: torch.div(a, b, rounding_mode="trunc")),
}


@pytest.mark.parametrize("name", sorted(EXACT_BINARY))
def test_exact_binary_functions_give_the_cpus_bits(name):
    fn, ref = EXACT_BINARY[name]
    assert_bitwise(elementwise(fn, A2, B2), ref(A2, B2))


@pytest.mark.parametrize("name,ref", [("fmax", torch.fmax), ("fmin", torch.fmin)])
def test_fmax_fmin_give_the_cpus_values(name, ref):
    # values, not bits: of +0 and -0 IEEE 754 lets fmax/fmin return either (the column operand's path differs)
    assert_within(elementwise(getattr(tm, name), A2, B2), ref(A2, B2), 0)


def test_div_floor_gives_the_cpus_bits_where_the_quotient_is_finite():
    finite = torch.isfinite(A2 / B2) | torch.isnan(A2 / B2)
    want = torch.div(A2, B2, rounding_mode="floor")
    assert_bitwise(elementwise(tm.div_floor, A2, B2)[finite], want[finite])


def test_where_selects_bits_exactly():
    cond = (torch.arange(X.numel()) % 3 == 0).float()
    other = X.flip(0)
    got = elementwise(tm.where, cond, X, other)
    assert torch.equal(got.view(torch.int32), torch.where(cond.bool(), X, other).view(torch.int32))  # NaN bits too


# Composed functions: each rounding of an fp32 operation adds at most half an ulp of its result; a bound in
# ulps of the result counts them (scaled by the condition of what follows) plus one ulp for the CPU's own error.
def _in(lo: float, hi: float):
    return lambda x: (x.abs() >= lo) & (x.abs() <= hi) | ~torch.isfinite(x)


COMPOSED = {
    # log (the CPU's) times a rounded constant, rounded: 1.5 ulps, 1 for the CPU
    "log2": (tm.log2, torch.log2, 3, None), "log10": (tm.log10, torch.log10, 3, None),
    # exp of the rounded x * ln 2: the argument's rounding (|x| ln2 eps/2) becomes a relative error of the result
    # (x * ln2 and ln2 each rounded: |x| ln2 eps, up to 2 |x| ln2 ulps of the result), the exp's and the CPU's
    "exp2": (tm.exp2, torch.exp2, lambda x: 2 + 2 * x.abs() * math.log(2), None),
    # Kahan's forms: a log or exp, a product and a quotient (1.5 ulps), 1 for the CPU
    "log1p": (tm.log1p, torch.log1p, 3, None),
    "expm1": (tm.expm1, torch.expm1, 3, None),
    # two exps and a sum (1.5 ulps, the cancellation of e^-x at most 1.16x from |x| >= 1), 1 for the CPU
    # (from |x| = 88 e^|x| / 2 as exp(|x| - c) times an fp32 within 1e-11 of e^c / 2: no more)
    # (below |x| = 1 sinh is a polynomial within 0.1 half-ulps: x^2, four Horner steps and a product)
    "cosh": (tm.cosh, torch.cosh, 3, None), "sinh": (tm.sinh, torch.sinh, 3, None),
    # a square root and a log whose argument is at least 2 (condition 1 / ln 2 ~ 1.44): 2 x 1.5 + 0.5, 1 for the
    # CPU (below |x| = 3/4 a polynomial within 0.2 half-ulps: x^2, six Horner steps and a product; from 2^11
    # log|x| + ln 2: a log, a rounded constant and a sum)
    "asinh": (tm.asinh, torch.asinh, 5, None),
    # Kahan's log1p (1.5 ulps) of t = (x - 1) + sqrt((x - 1)(x + 1)), whose roundings (x - 1 exact near 1, the
    # product's two halved by the root, the sum) the log1p carries at most 1:1; 1 for the CPU; from 2^11 as asinh
    "acosh": (tm.acosh, torch.acosh, 5, None),
    # two log1p (3 ulps each, no cancellation: opposite signs), a difference, 1 for the CPU
    "atanh": (tm.atanh, torch.atanh, 5, None),
    # 1 - x^2 carries x^2 / (1 - x^2) <= 4.3 half-ulps for |x| <= 0.9, halved by the root; a quotient and atan
    "asin": (tm.asin, torch.asin, 4, lambda x: (x.abs() <= 0.9) | (x.abs() > 1) | x.isnan()),
    # pi x rounded (condition of sin(t)/t <= 2.9 for |x| <= 0.9), sin, a quotient, 1 for the CPU
    "sinc": (tm.sinc, torch.sinc, 4, lambda x: (x.abs() <= 0.9) | ~torch.isfinite(x)),
    # log1p(exp(x)) (3 ulps after the exp's half ulp, condition <= 1), divided by beta = 1, 1 for the CPU
    "softplus": (lambda x: tm.softplus(x, 1.0, 20.0), torch.nn.functional.softplus, 5, None),
    "sigmoid": (tm.sigmoid, torch.sigmoid, 2, None),     # the simulator's 1 / (1 + exp(-x)) and the CPU's
}


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_composed_functions_within_their_rounding_bounds(name):
    fn, ref, ulps, domain = COMPOSED[name]
    x = X if domain is None else X[domain(X)]
    assert_within(elementwise(fn, x), ref(x), ulps(x) if callable(ulps) else ulps)


def test_acos_within_the_absolute_error_of_pi_over_2_minus_asin():
    # pi/2 - asin(x): the difference rounds at pi/2's ulp, whatever the size of the result (near x = 1)
    x = X[(X.abs() <= 0.9) | (X.abs() > 1) | X.isnan()]
    assert_within(elementwise(tm.acos, x), torch.acos(x), 4, atol=2 * float(_ulp(torch.tensor(math.pi / 2))))


def test_mish_within_its_bound_down_to_the_subnormals():
    # x tanh(softplus(x)): 5 ulps as softplus, a tanh and a product; results below fp32's smallest normal
    # keep only an absolute accuracy of that size
    assert_within(elementwise(tm.mish, X), torch.nn.functional.mish(X), 7, atol=torch.finfo(torch.float32).tiny)


COMPOSED_BINARY = {
    # atan of a rounded quotient plus a rounded pi (no cancellation: |atan| < pi/2), 1 for the CPU
    "atan2": (tm.atan2, torch.atan2, 3),
    # two squares and a sum (halved by the root), the root, exact power-of-two scalings, 1 for the CPU
    "hypot": (tm.hypot, torch.hypot, 3),
    "xlogy": (tm.xlogy, torch.xlogy, 3),        # the CPU's log, a product, 1 for the CPU
}


@pytest.mark.parametrize("name", sorted(COMPOSED_BINARY))
def test_composed_binary_functions_within_their_rounding_bounds(name):
    fn, ref, ulps = COMPOSED_BINARY[name]
    assert_within(elementwise(fn, A2, B2), ref(A2, B2), ulps)


def test_lerp_within_the_rounding_of_its_terms():
    # ATen's two branches (s + w (e - s) below |w| = 0.5, e - (e - s)(1 - w) above); the CPU fuses the multiply
    # and add, the device rounds each: three half-ulps of terms at most |w (e - s)| + |s| + |e|, and the CPU's
    finite = PAIR.abs() <= 1e30     # e - s stays finite
    s = PAIR[finite].reshape(-1, 1)
    e = s.reshape(1, -1).expand(s.numel(), -1).contiguous()
    w = torch.rand(e.shape, generator=_g) * 3 - 1
    want = torch.lerp(s.expand_as(e), e, w)
    size = (w * (e - s)).abs() + s.abs() + e.abs()
    err = (elementwise(tm.lerp, s, e, w).double() - want.double()).abs()
    assert bool((err <= 2 * EPS * size.double()).all())


# Known defects: each compares with the CPU at the bound above and fails until the formula is fixed (strict).
def test_expm1_near_the_top_of_fp32_is_finite_like_the_cpu():
    # (u - 1) * x / log(u) overflows its product for x in (~84, 88.7]
    x = torch.tensor([84.0, 85.0, 88.0, 88.7, 88.72, 88.73, 89.0, 100.0])
    assert_within(elementwise(tm.expm1, x), torch.expm1(x), 3)


def test_sinh_of_small_arguments_keeps_its_relative_accuracy():
    # e^x - e^-x alone cancels (1e-5 was 0.14% off, 1e-30 gave 0); signed zeros as the CPU's
    x = torch.tensor([1e-30, 1e-5, -1e-3, 0.3, -0.99, 1e-40, 0.0, -0.0])
    assert_within(elementwise(tm.sinh, x), torch.sinh(x), 3)
    assert_bitwise(elementwise(tm.sinh, x[-2:]), torch.sinh(x[-2:]))


@pytest.mark.parametrize("name", ["cosh", "sinh"])
def test_cosh_and_sinh_just_below_their_overflow_are_finite_like_the_cpu(name):
    # e^x alone overflows from 88.7; cosh and sinh only from 89.4. The reference is float64 rounded (the CPU's
    # float kernel gives these finite values on a few elements, but inf from 88.7 in its long-vector path)
    x = torch.tensor([87.9, 88.0, 88.01, 88.5, 88.72, 88.73, 89.0, 89.4, 89.41, 89.42, 89.5, 1e3])
    fn, ref, ulps, _ = COMPOSED[name]
    x = torch.cat([x, -x])
    want = ref(x.double()).float()
    assert bool(torch.isfinite(want[x.abs() <= 89.41]).all())
    assert_within(elementwise(fn, x), want, ulps)


def test_asinh_of_small_and_huge_arguments_like_the_cpu():
    # log(1 + small) alone cancels for small |x| (1e-30 gave 0); x * x overflows beyond 1.8e19 (1e30 gave inf)
    x = torch.tensor([1e-5, 1e-30, 1e30, -1e30, 0.49, -0.5, 0.749, -0.75, 2047.9, 2048.0, 3e38, -3e38, 1e-40, 0.0,
                      -0.0])
    assert_within(elementwise(tm.asinh, x), torch.asinh(x), 5)
    assert_bitwise(elementwise(tm.asinh, x[-2:]), torch.asinh(x[-2:]))


def test_acosh_near_1_keeps_its_accuracy():
    # log(x + sqrt(x^2 - 1)) magnified its rounding near 1 (26 ulps at 1.0066)
    x = torch.cat([torch.linspace(1.0, 1.01, 2001), torch.tensor([1.0000001, 1.0065752, 1.4999999])])
    assert_within(elementwise(tm.acosh, x), torch.acosh(x), 5)


def test_acosh_of_huge_arguments_like_the_cpu():
    # x * x - 1 alone overflows beyond 1.8e19: acosh(1e30) was inf, acosh(-1e30) inf instead of NaN
    x = torch.tensor([1e30, -1e30, -1e10, 3e38, -3e38, 1.8e19, 2e19, 2047.9, 2048.0, -2048.0, 3000.0, -3000.0,
                      -6063.0, INF, -INF])
    assert_within(elementwise(tm.acosh, x), torch.acosh(x), 5)


def test_div_floor_of_an_overflowing_quotient_is_infinite_like_the_cpu():
    # (a - fmod(a, b)) / b alone gives NaN there (with a column operand the ALU's fmod is NaN); the whole
    # table, division by zero and infinite operands included, bit for bit
    overflow = torch.isinf(A2 / B2) & torch.isfinite(A2) & (B2 != 0)
    assert int(overflow.sum()) >= 8
    assert_bitwise(elementwise(tm.div_floor, A2, B2), torch.div(A2, B2, rounding_mode="floor"))


def test_round_of_halves_up_to_2_to_the_23_rounds_to_even():
    # (adding and subtracting 1.5 * 2**23 rounded only below 2**22: 4194304.5 stayed 4194304.5)
    x = torch.tensor([4194303.5, 4194304.5, 4194305.5, 6291456.5, 8388607.5, 8388608.0, 16777215.0, 2.5, 3.5])
    x = torch.cat([x, -x])
    assert_bitwise(elementwise(tm.round_, x), torch.round(x))


def test_round_keeps_the_sign_of_a_zero_result():
    # x + 1.5 * 2**23 - 1.5 * 2**23 alone rounds -0.3 to +0.0; the CPU gives -0.0
    x = torch.tensor([-0.3, -0.0, -0.001])
    assert_bitwise(elementwise(tm.round_, x), torch.round(x))


def test_div_floor_keeps_the_sign_of_a_zero_quotient():
    # the CPU gives a zero quotient the sign of a / b (0 / -1 floors to -0.0)
    a, b = torch.tensor([0.0, 0.0, -0.0, -0.0, 0.0]), torch.tensor([-1.0, -2.5, 2.0, -2.0, 3.0])
    assert_bitwise(elementwise(tm.div_floor, a, b), torch.div(a, b, rounding_mode="floor"))
