"""The tile math of special functions (``kernels.tilemath_special``) run through the element-wise kernel, against
PyTorch on the CPU within the bound the module promises (PyTorch's float32 OpInfo tolerances against the CPU's
float kernels), special values (+-0, +-inf, NaN, poles, magnitudes near fp32's limits) included."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_tilemath import EDGES, assert_bitwise
from torchneuron.kernels import elementwise, tilemath_special as ts

INF, NAN = math.inf, math.nan
_g = torch.Generator().manual_seed(1)
POLES = torch.tensor([-3.0, -2.0, -1.0, -3.5, -2.5, -0.5, 1.4616, 7.9, 8.0, 10.0, 33.3, 1e4])
X = torch.cat([EDGES, POLES, torch.randn(150, generator=_g) * 5, torch.rand(100, generator=_g) * 20,
               torch.randn(50, generator=_g) * 60])
UNIT = torch.cat([torch.tensor([-1.0, 1.0, 0.0, -0.0, 1.5, -2.0, NAN, INF, 0.9999999, -0.99999994, 1e-30]),
                  torch.rand(200, generator=_g) * 2 - 1])
# PyTorch's float32 tolerances (torch.testing's defaults), which the module's formulations are chosen to meet
OPINFO = {"rtol": 1.3e-6, "atol": 1e-5, "equal_nan": True}

UNARY = {
    "lgamma": (ts.lgamma, torch.lgamma, X),
    "digamma": (ts.digamma, torch.digamma, X),
    "trigamma": (ts.polygamma(1), lambda x: torch.polygamma(1, x), X),
    "polygamma_3": (ts.polygamma(3), lambda x: torch.polygamma(3, x), X),
    "erfc": (ts.erfc, torch.erfc, X), "erfcx": (ts.erfcx, torch.special.erfcx, X),
    "log_ndtr": (ts.log_ndtr, torch.special.log_ndtr, X), "erfinv": (ts.erfinv, torch.erfinv, UNIT),
    "i0": (ts.i0, torch.i0, X), "i0e": (ts.i0e, torch.special.i0e, X), "i1": (ts.i1, torch.special.i1, X),
    "i1e": (ts.i1e, torch.special.i1e, X), "entr": (ts.entr, torch.special.entr, X),
    "log_sigmoid": (ts.log_sigmoid, F.logsigmoid, X),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_special_functions_within_float32_tolerance(name):
    fn, ref, x = UNARY[name]
    torch.testing.assert_close(elementwise(fn, x), ref(x), **OPINFO)


# selections and exact operations on the bits: the CPU's values exactly
def test_frexp_mantissa_gives_the_cpus_bits():
    assert_bitwise(elementwise(ts.frexp_mantissa, X), torch.frexp(X).mantissa)


@pytest.mark.parametrize("lambd", [0.5, 3.0])
def test_shrinks_give_the_cpus_values(lambd):
    # lambda reaches the tile function as a scalar operand, as the lowerings pass it
    lam = torch.tensor(lambd)
    assert_bitwise(elementwise(ts.hardshrink, X, lam), F.hardshrink(X, lambd))
    got, want = elementwise(ts.softshrink, X, lam), F.softshrink(X, lambd)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    # values: the sign of softshrink's zero inside the band differs between the CPU's own vectorized (+0) and
    # scalar (x * 0) paths
    assert torch.equal(got[~torch.isnan(want)], want[~torch.isnan(want)])


def test_frexp_exponent_gives_the_cpus_exponents():
    finite = X[torch.isfinite(X)]            # (the CPU's exponent of inf and NaN is unspecified)
    got = elementwise(ts.frexp_exponent, finite, out_dtype=torch.int32)
    assert torch.equal(got, torch.frexp(finite).exponent)


_PAIR = torch.cat([EDGES, torch.randn(20, generator=_g) * 4])
A2, B2 = _PAIR.reshape(-1, 1), _PAIR.reshape(1, -1).expand(_PAIR.numel(), -1).contiguous()
BINARY = {"logaddexp": (ts.logaddexp, torch.logaddexp), "logaddexp2": (ts.logaddexp2, torch.logaddexp2),
          "xlog1py": (ts.xlog1py, torch.special.xlog1py)}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_special_functions_within_float32_tolerance(name):
    fn, ref = BINARY[name]
    torch.testing.assert_close(elementwise(fn, A2, B2), ref(A2.expand_as(B2), B2), **OPINFO)


def test_nextafter_gives_the_cpus_bits():
    assert_bitwise(elementwise(ts.nextafter, A2, B2), torch.nextafter(A2.expand_as(B2), B2))


def test_heaviside_gives_the_cpus_bits():
    assert_bitwise(elementwise(ts.heaviside, A2, B2), torch.heaviside(A2.expand_as(B2), B2))


@pytest.mark.parametrize("name,ref", [("igamma", torch.special.gammainc), ("igammac", torch.special.gammaincc)])
def test_incomplete_gamma_within_float32_tolerance(name, ref):
    # a over the series, continued-fraction and Temme ranges (up to and past IGAMMA_A_MAX), x around a; with
    # 0, inf and NaN on either side
    a = torch.cat([torch.tensor([0.0, INF, NAN, 0.5, 3.0, 39.0, 41.0, 200.0]), torch.rand(12, generator=_g) * 60])
    x = torch.cat([torch.tensor([0.0, INF, NAN, 0.5, 3.0, 40.0, 250.0]), torch.rand(13, generator=_g) * 80])
    a, x = a.reshape(-1, 1), x.reshape(1, -1).expand(a.numel(), -1).contiguous()
    torch.testing.assert_close(elementwise(getattr(ts, name), a, x), ref(a.expand_as(x), x), **OPINFO)


def test_lgamma_of_huge_negative_arguments_is_infinite_like_the_cpu():
    # every fp32 from -2**23 down is an integer, a pole: the reflection formula alone gives inf - inf there
    x = torch.tensor([-3e38, -1e30, -1e10, -8388608.0, -8388607.5, -4194304.5, -4194305.0, -INF, INF])
    torch.testing.assert_close(elementwise(ts.lgamma, x), torch.lgamma(x), **OPINFO)


def test_heaviside_passes_a_negative_zero_value_through():
    # the value taken at x == 0 is broadcast by adding it to -0.0 (an addition to +0.0 would lose its sign)
    x, v = torch.tensor([0.0, -0.0]), torch.tensor([-0.0, -0.0])
    assert_bitwise(elementwise(ts.heaviside, x, v), torch.heaviside(x, v))

