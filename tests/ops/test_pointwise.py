"""Element-wise ATen ops run on the device (strict mode: no CPU fallback) and match the CPU."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import to_n

torch.manual_seed(0)
X = torch.randn(5, 33)
Y = torch.randn(33)
POS = X.abs() + 0.1
UNIT = torch.rand(5, 33) * 1.8 - 0.9

UNARY = {
    "exp": (torch.exp, X), "log": (torch.log, POS), "log1p": (torch.log1p, POS), "expm1": (torch.expm1, X),
    "exp2": (torch.exp2, X), "log2": (torch.log2, POS), "log10": (torch.log10, POS), "sqrt": (torch.sqrt, POS),
    "rsqrt": (torch.rsqrt, POS), "sin": (torch.sin, X), "cos": (torch.cos, X), "tan": (torch.tan, UNIT),
    "tanh": (torch.tanh, X), "sigmoid": (torch.sigmoid, X), "erf": (torch.erf, X), "atan": (torch.atan, X),
    "asin": (torch.asin, UNIT), "acos": (torch.acos, UNIT), "atanh": (torch.atanh, UNIT), "sinh": (torch.sinh, X),
    "cosh": (torch.cosh, X), "asinh": (torch.asinh, X), "acosh": (torch.acosh, POS + 1),
    "reciprocal": (torch.reciprocal, POS), "neg": (torch.neg, X), "abs": (torch.abs, X), "sign": (torch.sign, X),
    "floor": (torch.floor, X * 3), "ceil": (torch.ceil, X * 3), "trunc": (torch.trunc, X * 3),
    "round": (torch.round, X * 3), "frac": (torch.frac, X * 3), "relu": (torch.relu, X), "gelu": (F.gelu, X),
    "gelu_tanh": (lambda t: F.gelu(t, approximate="tanh"), X), "silu": (F.silu, X), "mish": (F.mish, X),
    "softplus": (F.softplus, X), "elu": (F.elu, X), "leaky_relu": (F.leaky_relu, X),
    "hardswish": (F.hardswish, X), "hardsigmoid": (F.hardsigmoid, X), "logit": (torch.logit, torch.rand(4, 9)),
    "isnan": (torch.isnan, X), "signbit": (torch.signbit, X), "logical_not": (torch.logical_not, X.round()),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, strict):
    fn, x = UNARY[name]
    torch.testing.assert_close(fn(to_n(x)).cpu(), fn(x), atol=1e-5, rtol=2e-6)


BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
    "minimum": torch.minimum, "pow": lambda a, b: torch.pow(a.abs(), b), "atan2": torch.atan2,
    "fmod": torch.fmod, "remainder": torch.remainder, "floor_divide": torch.floor_divide,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"), "hypot": torch.hypot,
    "copysign": torch.copysign, "xlogy": lambda a, b: torch.xlogy(a, b.abs()), "fmax": torch.fmax,
    "eq": torch.eq, "lt": torch.lt, "ge": torch.ge, "ne": torch.ne, "logical_xor": torch.logical_xor,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=-0.5),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcast(name, strict):
    fn = BINARY[name]
    torch.testing.assert_close(fn(to_n(X), to_n(Y)).cpu(), fn(X, Y), atol=1e-5, rtol=2e-6)


@pytest.mark.parametrize("scalar", [2, -0.75])
def test_python_scalars_and_promotion(scalar, strict):
    i = torch.arange(-6, 6, dtype=torch.int32).reshape(3, 4)
    for fn in (lambda a, s: a + s, lambda a, s: s - a, lambda a, s: a * s, lambda a, s: a / s if s else a):
        for x in (X, i):
            got, want = fn(to_n(x), scalar), fn(x, scalar)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got.cpu(), want)


def test_broadcasts_the_kernel_cannot_fold(strict):
    a, b, s = torch.randn(2, 1, 3), torch.randn(1, 4, 1), torch.tensor(2.5)
    torch.testing.assert_close((to_n(a) + to_n(b)).cpu(), a + b)
    torch.testing.assert_close(torch.addcmul(to_n(s), to_n(a), to_n(b)).cpu(), torch.addcmul(s, a, b))
    torch.testing.assert_close(torch.where(to_n(a) > 0, to_n(b), to_n(s)).cpu(), torch.where(a > 0, b, s))


def test_cpu_scalar_tensor_operand(strict):
    s = torch.tensor(1.5)
    torch.testing.assert_close((to_n(X) * s).cpu(), X * s)


def test_dtypes_and_mixed_precision(strict):
    b = X.bfloat16()
    torch.testing.assert_close((to_n(b) * to_n(Y)).cpu(), b * Y)          # bf16 * fp32 -> fp32
    torch.testing.assert_close((to_n(b) + 1).cpu(), b + 1)                  # stays bf16
    h = X.half()
    torch.testing.assert_close(to_n(h).exp().cpu(), h.exp())
    big = torch.tensor([2 ** 30 + 1, -7], dtype=torch.int32)
    torch.testing.assert_close((to_n(big) + 2).cpu(), big + 2)              # ints stay exact above 2**24


def test_where_and_clamp(strict):
    c = X > 0
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0])
    torch.testing.assert_close(torch.where(to_n(c), to_n(X), to_n(Y)).cpu(), torch.where(c, X, Y))
    m = torch.tensor([True, False, True, False, True, False])
    torch.testing.assert_close(torch.where(to_n(m), to_n(special), 2.0).cpu(), torch.where(m, special, 2.0),
                               equal_nan=True)
    torch.testing.assert_close(to_n(X).clamp(-0.5, 0.25).cpu(), X.clamp(-0.5, 0.25))
    torch.testing.assert_close(to_n(X).clamp(min=to_n(Y)).cpu(), X.clamp(min=Y))
    torch.testing.assert_close(to_n(special).clamp(-1, 1).cpu(), special.clamp(-1, 1), equal_nan=True)


def test_ternary(strict):
    a, b, c = X, torch.randn(5, 33), POS
    torch.testing.assert_close(torch.addcmul(to_n(a), to_n(b), to_n(c), value=0.5).cpu(),
                               torch.addcmul(a, b, c, value=0.5))
    torch.testing.assert_close(torch.addcdiv(to_n(a), to_n(b), to_n(c), value=-2).cpu(),
                               torch.addcdiv(a, b, c, value=-2))
    torch.testing.assert_close(torch.lerp(to_n(a), to_n(b), 0.3).cpu(), torch.lerp(a, b, 0.3))


def test_inplace_out_and_views(strict):
    x = to_n(X)
    x.mul_(2).add_(to_n(Y))
    torch.testing.assert_close(x.cpu(), X * 2 + Y)
    out = torch.empty(0, device="neuron")
    torch.exp(to_n(X), out=out)
    torch.testing.assert_close(out.cpu(), X.exp())
    t = to_n(X).t()                                       # non-contiguous input and in-place target
    t.add_(1)
    torch.testing.assert_close(t.cpu(), X.t() + 1)
    base = to_n(X)
    base[:, 3].mul_(0)                                    # writes through the strided view into base
    ref = X.clone()
    ref[:, 3] = 0
    torch.testing.assert_close(base.cpu(), ref)


def test_backward_ops(strict):
    for fn in (torch.sigmoid, torch.tanh, F.gelu, F.silu, torch.relu, lambda t: F.leaky_relu(t, 0.1),
               F.hardtanh, lambda t: F.gelu(t, approximate="tanh")):
        x = X.clone().requires_grad_()
        xn = to_n(X).requires_grad_()
        fn(x).mul(Y).sum().backward()
        fn(xn).mul(to_n(Y)).sum().backward()
        torch.testing.assert_close(xn.grad.cpu(), x.grad, atol=1e-5, rtol=1e-5)


ACTIVATIONS = {
    "elu": lambda t: F.elu(t, 0.7), "selu": F.selu, "celu": lambda t: F.celu(t, 1.3),
    "elu_inplace": lambda t: F.elu(t * 1, inplace=True),     # the gradient from the result
    "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "softplus": lambda t: F.softplus(t, 2.0, 5.0),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_backward_at_boundaries_and_non_finite(name, strict):
    # the branch points (+-3, 0) and NaN/inf take the CPU kernels' branches
    x = torch.randn(130, 9) * 4
    x[0] = torch.tensor([-3.0, 3.0, 0.0, -0.0, float("nan"), float("inf"), float("-inf"), 20.0, -20.0])
    g = torch.randn_like(x)
    a, b = x.clone().requires_grad_(), to_n(x).requires_grad_()
    ACTIVATIONS[name](a).backward(g)
    ACTIVATIONS[name](b).backward(to_n(g))
    torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-5, rtol=1e-5, equal_nan=True)


ERRORS = {
    "broadcast": lambda x: x + torch.ones(7, device=x.device),
    "inplace_broadcast": lambda x: x.add_(torch.ones(2, 5, 33, device=x.device)),
    "inplace_cast": lambda x: torch.ones(3, dtype=torch.int32, device=x.device).add_(0.5),
    "out_cast": lambda x: torch.add(x, 1, out=torch.empty(5, 33, dtype=torch.int32, device=x.device)),
    "bool_sub": lambda x: (x > 0) - (x > 1),
    "bool_neg": lambda x: -(x > 0),
    "partial_overlap": lambda x: torch.add(x[:-1], 1, out=x[1:]),
    "where_cond": lambda x: torch.where(x, x, x),
    "clamp_none": lambda x: torch.clamp(x),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_bad_input_errors_match_cpu(name):
    fn = ERRORS[name]
    with pytest.raises(Exception) as cpu:
        fn(X.clone())
    x = to_n(X)
    with pytest.raises(type(cpu.value)) as dev:
        fn(x)
    assert str(dev.value).split("\n")[0] == str(cpu.value).split("\n")[0]
    torch.testing.assert_close(x.cpu(), X)                # the failed call changed nothing


def test_mixed_devices_raise_like_cpu():
    with pytest.raises(RuntimeError, match="same device"):
        to_n(X) + Y.reshape(1, 33).expand(5, 33).clone()


def test_int64_add_and_sub_carry_across_words(strict):
    x = torch.tensor([0, 1, -1, 2 ** 32 - 1, 2 ** 31, -(2 ** 40), 2 ** 63 - 1], dtype=torch.int64)
    n = to_n(x)
    torch.testing.assert_close((n + 1).cpu(), x + 1)                 # wraps at 2**63 like the CPU
    torch.testing.assert_close((n - 7).cpu(), x - 7)
    y = x.flip(0)
    torch.testing.assert_close((n + to_n(y)).cpu(), x + y)
    n.add_(2, alpha=3)
    torch.testing.assert_close(n.cpu(), x + 6)
    bn = torch.nn.BatchNorm1d(3).to("neuron")                      # num_batches_tracked += 1 on the device
    bn(to_n(torch.randn(4, 3)))
    assert int(bn.num_batches_tracked.item()) == 1


def test_a_plan_replays_its_kernel_program_on_every_device(strict):
    # a replayed element-wise plan launches the program it kept: same results, no new trace, and
    # tensors of another device get their own plan (and program)
    from torchneuron.ops import cache_size
    from torchneuron.ops.elementwise import _PLANS
    from torchneuron.runtime import profiler
    a, b = torch.randn(5, 7), torch.randn(5, 7)
    for device in ("neuron:0", "neuron:1"):
        x, y = a.to(device), b.to(device)
        torch.testing.assert_close((x * y + 0.5).cpu(), a * b + 0.5, rtol=0, atol=0)
        size = cache_size()
        with profiler.record() as records:
            for k in range(3):
                out = x * y + (0.5 + k)
                assert out.device == torch.device(device)
                torch.testing.assert_close(out.cpu(), a * b + (0.5 + k), rtol=0, atol=0)
        assert cache_size() == size
        assert records and {r.device for r in records} == {torch.device(device).index}
    assert any(p.bound is not None for p in _PLANS.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_atan2_signed_zeros_and_infinities_match_cpu(dtype, strict):
    # every pair of signed zeros, infinities, NaN and finite values: the quadrant follows the signs of
    # zeros (atan2(-0.0, -1) == -pi), both infinite gives +-pi/4 or +-3pi/4, and the sign of a zero result
    # is the CPU's; default tolerances of the dtype cover atan's rounding on the finite pairs
    v = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), 2.5, -3.0], dtype=dtype)
    y, x = (t.contiguous() for t in torch.meshgrid(v, v, indexing="ij"))
    ref = torch.atan2(y, x)
    got = torch.atan2(to_n(y), to_n(x)).cpu()
    torch.testing.assert_close(got, ref, equal_nan=True)
    finite = ~ref.isnan()
    assert torch.equal(torch.signbit(got)[finite], torch.signbit(ref)[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hypot_neither_overflows_nor_underflows(dtype, strict):
    # sqrt(a^2 + b^2) squared naively overflows at 1e20 and underflows at 1e-20 in fp32 (hypot(1e30, 1e30) was
    # inf, hypot(1e-30, 1e-30) 0); an infinity beside a NaN gives inf as C's hypot does. Every pair of these
    # values, within two ulps of the dtype (the scaled sum of squares and its square root round twice)
    v = torch.tensor([0.0, -0.0, 1.0, -3.0, 4.0, 1e30, -1e30, 3e38, 1e-30, 1e-40, 1e-45, 1e19, 1e-19, 2.0 ** 60,
                      2.0 ** -60, 65504.0, float("inf"), -float("inf"), float("nan")]).to(dtype)
    a, b = (t.contiguous() for t in torch.meshgrid(v, v, indexing="ij"))
    ref, got = torch.hypot(a, b), torch.hypot(to_n(a), to_n(b)).cpu()
    assert torch.equal(ref.isnan(), got.isnan()) and torch.equal(ref.isinf(), got.isinf())
    torch.testing.assert_close(got, ref, rtol=2 * torch.finfo(dtype).eps, atol=0, equal_nan=True)
    big = torch.tensor([1e30, 3e-30, 1e-38]).to(dtype)
    torch.testing.assert_close(torch.hypot(to_n(big), to_n(big)).cpu(), torch.hypot(big, big),
                               rtol=2 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8])
def test_hardtanh_of_integers_keeps_the_dtype(dtype):
    # the CPU casts the bounds to the input's dtype (truncating); clamp's promotion would give a float result
    x = torch.arange(-5, 5, dtype=dtype)
    for lo, hi in ((-2.7, 3.9), (-0.5, 0.5), (-2, 3)):
        got = torch.nn.functional.hardtanh(x.to("neuron"), lo, hi)
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), torch.nn.functional.hardtanh(x, lo, hi))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.bool])
def test_comparisons_with_scalars_beyond_the_dtype_wrap_like_cpu(dtype, strict):
    # the CPU converts an int scalar to a narrow integer tensor's dtype (a wrapping cast) before comparing:
    # uint8 t == -1 is t == 255 (cosine_embedding_loss's target == -1 on uint8 targets); bool compares in int64
    x = torch.tensor([0, 1, 127, 255, -1, 100, -128, 2 ** 31 - 1]).to(dtype)
    for v in (-1, 255, 256, -129, 2 ** 32, 2 ** 32 + 1, -2 ** 40, 2 ** 62):
        for cmp in (torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge):
            assert torch.equal(cmp(to_n(x), v).cpu(), cmp(x, v)), (cmp, v)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16])
def test_clamp_scalar_bounds_convert_to_the_dtype_like_cpu(dtype, strict):
    # a bound the dtype cannot hold raises the CPU's error (int8 min=200 came back as -56); uint8 max=-1 wraps to 255
    x = torch.tensor([0, 1, 100, 120]).to(dtype)
    calls = (lambda t, v: torch.clamp(t, min=v), lambda t, v: torch.clamp(t, max=v), lambda t, v: t.clone().clamp_(v, 127),
             lambda t, v: torch.clamp_min(t, v), lambda t, v: torch.clamp_max(t, v))
    for v in (-1, 3, 200, 300, 2 ** 40, 70000.0, 1e39, 2.5):
        for call in calls:
            try:
                want = call(x, v)
            except RuntimeError as e:
                with pytest.raises(RuntimeError) as dev:
                    call(to_n(x), v)
                assert "without overflow" not in str(e) or str(dev.value) == str(e)
                continue
            assert torch.equal(call(to_n(x), v).cpu(), want), (v, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_float_pow_takes_its_scalar_exponent_in_the_dtype(dtype, strict):
    # the CPU converts a scalar exponent to the tensor's dtype (fp16 3.1 is 3.099609375): x ** 3.1 is then
    # x ** rnd(3.1), rounded once; an exponent the dtype cannot hold raises the CPU's overflow error
    x = torch.tensor([3.60546875, 0.19055, 8.8125, 2.5, 1.0, 0.0, 65504.0, float("inf"), float("nan")]).to(dtype)
    for e in (3.1, -3.1, -2.1, 1.7, 0.1, 2, 3000):
        rounded = torch.tensor(float(e), dtype=torch.float64).to(dtype).item()
        want = x.double().pow(rounded).to(dtype)
        got = torch.pow(to_n(x), e).cpu()
        # fp32's exp/log of the power: the result or its neighbour
        torch.testing.assert_close(got.double(), want.double(), rtol=2 * torch.finfo(dtype).eps, atol=0,
                                   equal_nan=True)
    if dtype == torch.float16:
        with pytest.raises(RuntimeError, match="without overflow"):
            torch.pow(to_n(x), 1e6)
