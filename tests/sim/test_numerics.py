"""Numerics: NKI dtype names, the compute dtype rule, rounding like PyTorch, the math tables."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from torchneuron.sim import numerics as nx

INF, NAN = float("inf"), float("nan")


def test_nki_dtype_names():
    assert nx.to_dtype("bfloat16") is torch.bfloat16
    assert nx.to_dtype("float8_e4m3") is torch.float8_e4m3fn
    assert nx.to_dtype("float8_e4m3fn") is torch.float8_e4m3fn
    assert nx.to_dtype("float8_e5m2") is torch.float8_e5m2
    assert nx.to_dtype("bool_") is torch.bool and nx.to_dtype("bool") is torch.bool
    assert nx.dtype_name(torch.float8_e4m3fn) == "float8_e4m3"
    assert nx.dtype_name(torch.uint32) == "uint32"
    assert nx.torch_name(torch.bfloat16) == "bfloat16"
    assert nx.bfloat16 is torch.bfloat16 and nx.float8_e5m2 is torch.float8_e5m2
    for name, dt in nx.DTYPES.items():
        assert nx.to_dtype(dt) is dt and nx.dtype_name(dt) == name
    with pytest.raises(TypeError, match="float64"):
        nx.to_dtype(torch.float64)
    with pytest.raises(TypeError, match="tfloat99"):
        nx.to_dtype("tfloat99")


def test_compute_dtype():
    assert nx.compute_dtype(torch.bfloat16, torch.int32) == torch.float32
    assert nx.compute_dtype(torch.float8_e5m2) == torch.float32
    assert nx.compute_dtype(torch.int32, torch.int8) == torch.int64
    assert nx.compute_dtype(torch.int32, fractional=True) == torch.float64
    assert nx.compute_dtype(torch.uint8, torch.bool) == torch.int64


SPECIALS = torch.tensor([0.0, -0.0, 1.0, -1.5, 3.14159265, 1e-8, 65504.0, 70000.0, 448.0, 464.0, 500.0,
                         57344.0, 1e6, -1e6, 1e39, INF, -INF, NAN])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
                                   torch.float32])
def test_round_to_floats_like_torch(dtype):
    values = torch.cat([SPECIALS, torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 100])
    out = nx.round_to(values, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, values.to(dtype), rtol=0, atol=0, equal_nan=True)
    # bit patterns too (NaN payloads and signed zeros included)
    assert torch.equal(out.view(torch.uint8), values.to(dtype).view(torch.uint8))


def test_round_to_fp8_overflow_follows_torch():
    big = torch.tensor([1e6, -1e6, INF])
    assert torch.equal(nx.round_to(big, torch.float8_e4m3fn).float(), big.to(torch.float8_e4m3fn).float())
    assert torch.equal(nx.round_to(big, torch.float8_e5m2).float(), big.to(torch.float8_e5m2).float())
    assert torch.isnan(nx.round_to(torch.tensor([NAN]), torch.float8_e4m3fn).float()).all()


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16,
                                   torch.uint32, torch.bool])
def test_round_to_ints_like_torch(dtype):
    values = torch.tensor([0.0, 1.7, -1.7, 2.5, 100.9, 200.0, -3.0])
    if dtype in (torch.uint8, torch.uint16, torch.uint32):
        values = values.abs()
    assert torch.equal(nx.round_to(values, dtype), values.to(dtype))
    wide = torch.tensor([2 ** 31 - 1, -(2 ** 31), 300, -129], dtype=torch.int64)
    assert torch.equal(nx.round_to(wide, dtype), wide.to(dtype))


def test_scalar_operands_round_to_fp32():
    assert nx.as_scalar(0.1, torch.float32) == float(torch.tensor(0.1, dtype=torch.float32))
    assert nx.as_scalar(3.0, torch.int64) == 3 and isinstance(nx.as_scalar(3.0, torch.int64), int)
    assert nx.as_scalar(0.1, torch.float64) == 0.1


def test_alu_op_names_and_aliases():
    assert nx.alu_op("max") == "maximum" and nx.alu_op("pow") == "power"
    assert nx.alu_op(torch.maximum) == "maximum" and nx.alu_op(torch.add) == "add"
    with pytest.raises(ValueError, match="unknown ALU operator"):
        nx.alu_op("frobnicate")
    with pytest.raises(ValueError, match="not a reduction"):
        nx.reduce_op("divide")


ARITH_REF = {
    "add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "divide": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum, "power": torch.pow, "mod": torch.fmod,
    "equal": lambda a, b: (a == b).float(), "not_equal": lambda a, b: (a != b).float(),
    "greater": lambda a, b: (a > b).float(), "greater_equal": lambda a, b: (a >= b).float(),
    "less": lambda a, b: (a < b).float(), "less_equal": lambda a, b: (a <= b).float(),
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).float(),
    "logical_or": lambda a, b: ((a != 0) | (b != 0)).float(),
    "logical_xor": lambda a, b: ((a != 0) ^ (b != 0)).float(),
    "abs_max": lambda a, b: torch.maximum(a.abs(), b.abs()), "abs_min": lambda a, b: torch.minimum(a.abs(), b.abs()),
}


@pytest.mark.parametrize("op", sorted(ARITH_REF))
def test_arith_ops(op):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    b[::7] = a[::7]  # equal pairs for the comparisons
    if op == "power":
        a = a.abs()
    got = nx.apply_alu(op, a, b)
    torch.testing.assert_close(got, ARITH_REF[op](a, b), equal_nan=True)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("op,ref", [("bitwise_and", lambda a, b: a & b), ("bitwise_or", lambda a, b: a | b),
                                    ("bitwise_xor", lambda a, b: a ^ b), ("left_shift", lambda a, b: a << b),
                                    ("right_shift", lambda a, b: a >> b)])
def test_bitvec_ops(op, ref):
    a = torch.tensor([0, 1, -1, 12345, -(2 ** 31), 2 ** 31 - 1], dtype=torch.int64)
    b = torch.tensor([3, 1, 4, 2, 1, 5], dtype=torch.int64)
    assert torch.equal(nx.apply_alu(op, a, b), ref(a, b))


def test_int_math_is_exact():
    a = torch.tensor([2 ** 30 + 1, -(2 ** 30) - 3, 16777217], dtype=torch.int32)
    got = nx.round_to(nx.apply_alu("add", a.to(torch.int64), a.to(torch.int64) - 1), torch.int32)
    assert torch.equal(got, (a.to(torch.int64) * 2 - 1).to(torch.int32))
    q = nx.apply_alu("divide", a.to(torch.float64), torch.tensor(3.0, dtype=torch.float64))
    assert torch.equal(nx.round_to(q, torch.int32), (a.to(torch.float64) / 3).to(torch.int32))


@pytest.mark.parametrize("op", ["add", "multiply", "maximum", "minimum", "logical_and", "logical_or"])
def test_reductions(op):
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(3))
    x[0, 0, 0] = 0.0
    ref = {"add": lambda t, d: t.sum(d), "multiply": lambda t, d: t.flatten(d[0]).prod(d[0]),
           "maximum": lambda t, d: t.amax(d), "minimum": lambda t, d: t.amin(d),
           "logical_and": lambda t, d: (t != 0).flatten(d[0]).all(d[0]).float(),
           "logical_or": lambda t, d: (t != 0).flatten(d[0]).any(d[0]).float()}[op]
    for dims in [(2,), (1, 2)]:
        torch.testing.assert_close(nx.apply_reduce(op, x, dims), ref(x, dims))


@pytest.mark.parametrize("op,fn", [("bitwise_and", lambda a, b: a & b), ("bitwise_or", lambda a, b: a | b),
                                   ("bitwise_xor", lambda a, b: a ^ b)])
@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_bitwise_reductions(op, fn, n):
    x = torch.randint(-1000, 1000, (3, n), generator=torch.Generator().manual_seed(n))
    want = torch.tensor([functools.reduce(fn, row.tolist()) for row in x])
    assert torch.equal(nx.apply_reduce(op, x, (1,)), want)


def _grad(f, x):
    x = x.clone().requires_grad_(True)
    f(x).sum().backward()
    return x.grad


ACT_REF = {
    "copy": lambda x: x, "identity": lambda x: x, "exp": torch.exp, "log": torch.log, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "relu": F.relu, "gelu": F.gelu,
    "gelu_apprx_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_apprx_sigmoid": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_dx": lambda x: _grad(F.gelu, x),
    "gelu_apprx_tanh_dx": lambda x: _grad(lambda t: F.gelu(t, approximate="tanh"), x),
    "gelu_apprx_sigmoid_dx": lambda x: _grad(lambda t: t * torch.sigmoid(1.702 * t), x),
    "silu": F.silu, "silu_dx": lambda x: _grad(F.silu, x), "softplus": F.softplus, "mish": F.mish,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "square": torch.square,
    "sin": torch.sin, "cos": torch.cos, "tan": torch.tan, "arctan": torch.atan, "abs": torch.abs,
    "sign": torch.sign, "negative": torch.neg, "erf": torch.erf, "erf_dx": lambda x: _grad(torch.erf, x),
    "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc,
}


def test_every_activation_has_a_reference():
    assert set(ACT_REF) == set(nx.ACTIVATIONS)


@pytest.mark.parametrize("fn", sorted(ACT_REF))
def test_activations(fn):
    x = torch.randn(256, generator=torch.Generator().manual_seed(4)) * 2
    if fn in ("log", "sqrt", "rsqrt"):
        x = x.abs() + 0.1
    torch.testing.assert_close(nx.apply_activation(nx.activation_fn(fn), x), ACT_REF[fn](x), rtol=1e-5, atol=1e-6)


def test_activation_names():
    assert nx.activation_fn(torch.exp) == "exp"
    assert nx.activation_fn("atan") == "arctan"
    with pytest.raises(ValueError, match="unknown activation"):
        nx.activation_fn("softmax9")
    assert math.isclose(nx.REDUCE_IDENTITY["maximum"], -math.inf)



def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_gelu_dx_in_place_matches_the_formula_bit_for_bit():
    # the in-place evaluation must round exactly like the plain expression it replaces
    from torchneuron.sim.numerics import _INV_SQRT_2, _INV_SQRT_2PI, apply_activation
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-30, -1e30, 8.5, -8.5])
    for dtype in (torch.float32, torch.float64):
        base = torch.cat([torch.randn(4096, generator=g) * 4, special]).to(dtype)
        for x in (base, base.view(-1, 1).expand(-1, 3)[:, 1], base[::2]):  # dense and strided
            want = 0.5 * (1.0 + torch.erf(x * _INV_SQRT_2)) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI
            before = _bits(x)
            got = apply_activation("gelu_dx", x)
            assert torch.equal(_bits(x), before)  # the input is not written
            assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("fn", ["gelu", "exp", "tanh", "sigmoid", "silu", "gelu_apprx_tanh", "gelu_dx", "log"])
def test_activation_result_depends_on_the_value_alone(fn):
    # PyTorch's CPU kernels round some elements differently by their position (vector blocks, the scalar
    # remainder, strided views): an activation's result must not depend on the tile's width or layout
    g = torch.Generator().manual_seed(0)
    x = torch.rand(128, 384, generator=g) * 8 + 0.01
    whole = nx.apply_activation(fn, x)
    assert torch.equal(nx.apply_activation(fn, x[:, 5:6]), whole[:, 5:6])          # a one-column view
    assert torch.equal(nx.apply_activation(fn, x[3:4, 101:138]), whole[3:4, 101:138])  # a ragged strided block
    assert torch.equal(nx.apply_activation(fn, x.t().contiguous()).t(), whole)      # another element order


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _neg_floats(lo_bits: int, hi_bits: int) -> torch.Tensor:
    """Every negative fp32 whose magnitude's bit pattern is in [lo_bits, hi_bits)."""
    return (torch.arange(lo_bits, hi_bits, dtype=torch.int64) - 2**31).to(torch.int32).view(torch.float32)


def test_exp_zero_bound_is_where_torch_exp_underflows():
    # the constants the clamped route relies on, on this torch build: EXP_ZERO_AT is the largest x whose exp is
    # +0.0 (its successor toward zero is not), and EXP_FAST_MIN's exp is a normal number
    z = torch.tensor([nx.EXP_ZERO_AT])
    assert _bits(torch.exp(z)).item() == 0
    assert torch.exp(torch.nextafter(z, torch.zeros(1))).item() > 0
    assert torch.exp(torch.tensor([nx.EXP_FAST_MIN])).item() >= torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_exp_is_zero_below_the_bound(layout):
    # 2**20 values either side of EXP_ZERO_AT, and 4096 random mantissas of every binade from there to -inf:
    # torch.exp gives +0.0 (bits 0) on the vector path (contiguous) and the element-by-element path (strided)
    zbits = _bits(torch.tensor([nx.EXP_ZERO_AT])).item() & 0x7FFFFFFF
    gen = torch.Generator().manual_seed(0)
    parts = [_neg_floats(zbits, zbits + (1 << 20))]
    for exponent in range((zbits >> 23) + 1, 255):
        mant = torch.randint(0, 1 << 23, (4096,), generator=gen, dtype=torch.int64)
        parts.append((((exponent << 23) | mant) - 2**31).to(torch.int32).view(torch.float32))
    x = torch.cat([*parts, torch.tensor([-INF, -torch.finfo(torch.float32).max])])
    if layout == "strided":
        buf = torch.empty(2 * x.numel())
        buf[::2] = x
        x = buf[::2]
    assert bool((x <= nx.EXP_ZERO_AT).all())
    assert bool((_bits(torch.exp(x)) == 0).all())
    assert bool((_bits(nx.exp(x.contiguous())) == 0).all())


def _exp_tile(values: list[float], n: int = 4096, seed: int = 0) -> torch.Tensor:
    """A [64, n // 64] fp32 tile of normal(0, 4) values with ``values`` scattered through it."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 4
    where = torch.randperm(n, generator=gen)[:len(values)]
    x[where] = torch.tensor(values)
    return x.view(64, -1)


_MASKED = [-1e30, -INF, -torch.finfo(torch.float32).max, nx.EXP_ZERO_AT, -104.0, -1e4, -0.0, 0.0, INF, 88.0, 89.0,
           nx.EXP_FAST_MIN, -86.9, 1e-30, -1e-30]


@pytest.mark.parametrize("extra", [[], [NAN], [-87.5], [-100.0], [nx.EXP_ZERO_AT * (1 - 2**-23)], [-87.0 - 2**-17]],
                         ids=["masked", "nan", "denormal-result", "denormal-result2", "just-above-zero-bound",
                              "just-below-fast-min"])
def test_exp_matches_torch_bit_for_bit(extra):
    # tiles mixing ordinary scores with the masked values a causal softmax sees (-1e30, -inf, the fp32 minimum), the
    # bounds and their neighbours, signed zeros, overflow and NaN: exp and exp_out (in place in a strided view, as
    # the ScalarE step runs it, and from a same-layout source) give torch.exp's bits
    x = _exp_tile(_MASKED + extra)
    want = torch.exp(x)
    assert torch.equal(_bits(nx.exp(x)), _bits(want))
    sbuf = torch.full((64, 1000), NAN)  # a partition pitch wider than the tile, like SBUF
    view = sbuf[:, 100:100 + x.shape[1]]
    view.copy_(x)
    assert torch.equal(_bits(nx.exp_out(view, out=view)), _bits(want))
    src = torch.full((64, 1000), NAN)[:, 7:7 + x.shape[1]]
    src.copy_(x)
    out = torch.full((64, 1000), NAN)[:, 7:7 + x.shape[1]]
    nx.exp_out(src, out=out)
    assert torch.equal(_bits(out), _bits(torch.exp(src))) and torch.equal(_bits(src), _bits(x))


def test_exp_route_taken_only_where_exact():
    # the clamped route runs for masked tiles and steps aside for values whose exp is denormal, NaN tiles, other
    # dtypes and layouts
    assert nx._exp_keep(_exp_tile(_MASKED)) is not None
    assert nx._exp_keep(_exp_tile([-1e30, -100.0])) is None
    assert nx._exp_keep(_exp_tile([-1e30, NAN])) is None
    assert nx._exp_keep(_exp_tile([1.0])) is None
    assert nx._exp_keep(_exp_tile([-1e30]).double()) is None


@pytest.mark.filterwarnings("error")
def test_comparisons_broadcast_through_the_shape_cache():
    """The cached result shapes: right on a repeated pair and on new ones (an ``out`` of another shape would be
    resized with a warning, an error here), incompatible shapes still refused."""
    a, col = torch.tensor([[1, 5, 3], [4, 4, 0]]), torch.tensor([[3], [4]])
    for _ in range(2):  # the second call finds the pair cached
        assert torch.equal(nx.apply_alu("greater_equal", a, col), (a >= col).to(a.dtype))
        assert torch.equal(nx.apply_alu("equal", col, a), (col == a).to(a.dtype))
    row = torch.tensor([[0, 5, 3]])
    assert torch.equal(nx.apply_alu("not_equal", a, row), (a != row).to(a.dtype))
    with pytest.raises(RuntimeError):
        nx.apply_alu("less", a, torch.tensor([[1, 2]]))
