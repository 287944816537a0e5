"""int64 ops on the device (ops/int64_elementwise.py): comparisons, maximum/minimum, clamp, neg/abs, bitwise ops and
exact integer sums, in strict mode against the CPU, with values beyond 32 bits and negative ones."""
import pytest
import torch

from tests.ops.conftest import to_n

# edge values: word boundaries, the int64 extremes, equal high words with different low words
A = torch.tensor([0, 1, -1, 2**31, -2**31, 2**32 + 5, -(2**40), 2**62, -2**63, 2**63 - 1, 7, 4294967295,
                  2**32, -2**32 - 1, 123456789012, -5])
B = torch.tensor([0, 2, -1, 2**31 - 1, -2**31 + 1, 2**32 + 4, -(2**40) + 1, -2**62, 2**63 - 1, -2**63, 7,
                  -4294967295, 2**32 + 1, -2**32, 123456789012, 2**33])
CMP = ["eq", "ne", "lt", "le", "gt", "ge"]


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device.type == "neuron"
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu(), want), (got.cpu(), want)


@pytest.mark.parametrize("op", CMP + ["maximum", "minimum", "bitwise_and", "bitwise_or", "bitwise_xor"])
def test_binary_tensor(strict, op):
    fn = getattr(torch, op)
    _same(fn(to_n(A), to_n(B)), fn(A, B))
    _same(fn(to_n(B), to_n(A)), fn(B, A))
    # broadcast: a column against a row, and against a one-element tensor
    _same(fn(to_n(A[:4, None]), to_n(B[None, :5])), fn(A[:4, None], B[None, :5]))
    _same(fn(to_n(A), to_n(B[5:6])), fn(A, B[5:6]))
    # int64 against narrower ints and bools (widened on the device)
    c = torch.tensor([0, -3, 7, 1, 0, 2**31 - 1, -2**31, 5, 0, 1, 7, -1, 0, 9, 2, 3], dtype=torch.int32)
    _same(fn(to_n(A), to_n(c)), fn(A, c))
    _same(fn(to_n(c.to(torch.int8)), to_n(B)), fn(c.to(torch.int8), B))


@pytest.mark.parametrize("op", CMP)
def test_comparison_scalars(strict, op):
    fn = getattr(torch, op)
    for s in (0, -1, 7, 2**32 + 4, -(2**40), 2**63 - 1, -2**63, True):
        _same(fn(to_n(A), s), fn(A, s))
    _same(fn(to_n(A), torch.tensor(2**31)), fn(A, torch.tensor(2**31)))        # a CPU 0-dim tensor: a scalar
    _same(fn(to_n(A), 0.5), fn(A, 0.5))                                         # float scalar: compares in fp32
    _same(getattr(to_n(A), op)(-5), getattr(A, op)(-5))


@pytest.mark.parametrize("op", CMP + ["bitwise_or"])
def test_out_and_inplace(strict, op):
    fn = getattr(torch, op)
    want = fn(A, B)
    out = to_n(torch.empty(0, dtype=want.dtype))
    assert fn(to_n(A), to_n(B), out=out) is out
    _same(out, want)
    x = to_n(A.clone())
    getattr(x, f"{op}_")(to_n(B))
    _same(x, getattr(A.clone(), f"{op}_")(B))
    noncontig = to_n(torch.zeros(16, 2, dtype=torch.int64))[:, 0]
    fn(to_n(A), to_n(B), out=noncontig)
    _same(noncontig, want.to(torch.int64))
    _same(torch.maximum(to_n(A), to_n(B), out=to_n(torch.empty(0, dtype=torch.int32))),
          torch.maximum(A, B, out=torch.empty(0, dtype=torch.int32)))                # Long into Int: wraps


def test_strided_operands(strict):
    x = A.reshape(4, 4)
    _same(torch.gt(to_n(x).t(), to_n(B.reshape(4, 4))), torch.gt(x.t(), B.reshape(4, 4)))
    _same(torch.minimum(to_n(x)[:, ::2], to_n(torch.tensor(3))), torch.minimum(x[:, ::2], torch.tensor(3)))


@pytest.mark.parametrize("op", ["neg", "abs", "bitwise_not"])
def test_unary(strict, op):
    _same(getattr(torch, op)(to_n(A)), getattr(torch, op)(A))
    x = to_n(A.clone())
    getattr(x, f"{op}_")()
    _same(x, getattr(A.clone(), f"{op}_")())


def test_clamp(strict):
    _same(torch.clamp(to_n(A), -5, 2**33), torch.clamp(A, -5, 2**33))
    _same(torch.clamp(to_n(A), min=-(2**40)), torch.clamp(A, min=-(2**40)))
    _same(torch.clamp(to_n(A), max=2**31), torch.clamp(A, max=2**31))
    _same(torch.clamp(to_n(A), 10, -10), torch.clamp(A, 10, -10))                # min > max: max
    lo, hi = B.clamp(max=0), B.clamp(min=0)
    _same(torch.clamp(to_n(A), to_n(lo), to_n(hi)), torch.clamp(A, lo, hi))
    _same(torch.clamp_min(to_n(A), 2**32), torch.clamp_min(A, 2**32))
    _same(torch.clamp_max(to_n(A), -(2**32)), torch.clamp_max(A, -(2**32)))
    x = to_n(A.clone())
    x.clamp_(-3, 3)
    _same(x, A.clamp(-3, 3))


def test_large_and_empty(strict):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2**62, 2**62, (3, 1000), generator=g)
    y = x.flip(1)
    for op in ("lt", "eq", "maximum", "minimum"):
        _same(getattr(torch, op)(to_n(x), to_n(y)), getattr(torch, op)(x, y))
    e = torch.empty(0, 3, dtype=torch.int64)
    _same(torch.gt(to_n(e), 1), torch.gt(e, 1))
    _same(torch.neg(to_n(e)), torch.neg(e))


def test_errors_like_cpu(strict):
    cases = [
        lambda d: torch.gt(d(A), d(B[:3])),                                      # shapes do not broadcast
        lambda d: torch.maximum(d(A), d(B), out=d(torch.empty(16, dtype=torch.bool))),  # Long into Bool
        lambda d: d(A[:1].clone()).lt_(d(B)),                                    # in-place target too small
        lambda d: d(A).clamp(),                                                  # clamp with no bounds
    ]
    for case in cases:
        with pytest.raises(Exception) as cpu:
            case(lambda t: t)
        with pytest.raises(type(cpu.value)) as dev:
            case(to_n)
        assert str(dev.value) == str(cpu.value)


def test_bitwise_float_error_through_fallback():
    # the device has no float bitwise ops: the CPU fallback raises the CPU's error (not in strict mode)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float'"):
        torch.bitwise_and(to_n(A), 1.5)


SUM_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def _ints(dtype: torch.dtype, shape: tuple, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    lo, hi = (-2**62, 2**62) if dtype == torch.int64 else (info.min, info.max)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", SUM_DTYPES)
def test_sum(strict, dtype):
    x = _ints(dtype, (3, 4, 700))
    for args, kw in [((), {}), ((2,), {}), ((0,), {}), (((0, 2),), {}), ((1,), {"keepdim": True}),
                     ((2,), {"dtype": torch.int32}), ((), {"dtype": torch.int64})]:
        _same(to_n(x).sum(*args, **kw), x.sum(*args, **kw))
    # a long 1-D sum (partial sums per row, then their sum) and one of a prime length
    for n in (2**15, 4099):
        y = _ints(dtype, (n,), seed=n)
        _same(to_n(y).sum(), y.sum())
    _same(to_n(torch.empty(0, 3, dtype=dtype)).sum(0), torch.empty(0, 3, dtype=dtype).sum(0))
    out = to_n(torch.empty(0, dtype=torch.int64))
    torch.sum(to_n(x), 1, out=out)
    _same(out, x.sum(1))


def test_sum_exact_beyond_32_bits(strict):
    x = torch.full((5000,), 2**31 - 1, dtype=torch.int32)                        # sums past int32's range
    _same(to_n(x).sum(), x.sum())
    _same(to_n(-x - 1).sum(), (-x - 1).sum())
    w = torch.tensor([2**63 - 1, 1, -5, 2**62, 2**62])                           # int64 sums wrap as on the CPU
    _same(to_n(w).sum(), w.sum())
    _same(to_n(torch.tensor(-7)).sum(), torch.tensor(-7).sum())                  # 0-dim


@pytest.mark.filterwarnings("ignore:where received a uint8")
def test_where_alternative(strict):
    # registered for where's lowering to call before the CPU fallback; called directly here
    from torchneuron.ops.pointwise import ALTERNATIVES
    where = ALTERNATIVES["where"]
    c = A > B
    _same(where((to_n(c), to_n(A), to_n(B)), {}, None, False), torch.where(c, A, B))
    _same(where((to_n(c[:, None]), to_n(A[:5]), -(2**40)), {}, None, False), torch.where(c[:, None], A[:5], -(2**40)))
    _same(where((to_n(c), to_n(A), to_n(B.to(torch.int32))), {}, None, False), torch.where(c, A, B.to(torch.int32)))
    _same(where((to_n(c.to(torch.uint8)), 7, to_n(B)), {}, None, False), torch.where(c.to(torch.uint8), 7, B))
    out = to_n(torch.empty(0, dtype=torch.int64))
    assert where((to_n(c), to_n(A), to_n(B)), {}, out, False) is out
    _same(out, torch.where(c, A, B))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device.type == "neuron" and got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


C = torch.tensor([0, -3, 7, 1, 0, 2**31 - 1, -2**31, 5, 0, 1, 7, -1, 0, 9, 2, 3], dtype=torch.int32)
PROMOTED = [
    lambda d: torch.sign(d(A)), lambda d: torch.sgn(d(A)),
    lambda d: d(A) + d(C), lambda d: d(A) - d(C), lambda d: d(C) - d(A), lambda d: d(A[:1]) - d(A),
    lambda d: d(A[:1]) + d(A), lambda d: d(A[:4, None]) - d(C[None, :3]), lambda d: d(A) + True,
    lambda d: d(A) - 2**40, lambda d: torch.sub(d(A), 3, alpha=2), lambda d: torch.rsub(d(A), 3),
    lambda d: d(A) / 3, lambda d: d(A) / d(C), lambda d: d(A) * 0.5, lambda d: d(A) + 0.5,          # -> float32
    lambda d: torch.exp(d(A).clamp(-5, 5)), lambda d: d(A).clamp(-5, 5) ** 0.5,
    lambda d: torch.div(d(A), 2.0, rounding_mode="floor"),
]


@pytest.mark.parametrize("case", range(len(PROMOTED)))
def test_promoted_and_mixed(strict, case):
    """sign, int64 add/sub with narrower ints and broadcasts, and int64 operands promoted to float."""
    f = PROMOTED[case]
    _close(f(to_n), f(lambda t: t))


def test_promoted_inplace(strict):
    x, y = to_n(A.clone()), A.clone()
    x += to_n(C)
    y += C
    _same(x, y)
    for case in (lambda d: d(A.clone()).div_(2), lambda d: d(A.clone()).add_(0.5), lambda d: d(A) - True):
        with pytest.raises(RuntimeError) as cpu:
            case(lambda t: t)
        with pytest.raises(RuntimeError) as dev:
            case(to_n)
        assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("dtype", SUM_DTYPES)
def test_max_min(strict, dtype):
    x = _ints(dtype, (3, 5, 2100), seed=1)
    if dtype == torch.int64:  # rows whose values share high words: the low words (unsigned) decide
        g = torch.Generator().manual_seed(2)
        x[0, 0] = 2**40 + torch.randint(0, 2**32, (2100,), generator=g)
        x[1, 1] = -(2**40) + torch.randint(0, 2**32, (2100,), generator=g)
    for f in (lambda t: t.max(), lambda t: t.min(), lambda t: t.amax(2), lambda t: t.amin(0),
              lambda t: t.amax((0, 2), keepdim=True), lambda t: t.reshape(-1).amin(), lambda t: t[:, :, :7].amax(-1)):
        _same(f(to_n(x)), f(x))


def test_mul(strict):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2**63, 2**63 - 1, (3000,), generator=g)
    y = torch.randint(-2**63, 2**63 - 1, (3000,), generator=g)
    _same(to_n(A) * to_n(B), A * B)                                              # wraps mod 2**64 like the CPU
    _same(to_n(x) * to_n(y), x * y)
    _same(to_n(A) * 3, A * 3)
    _same(to_n(A) * -(2**33), A * -(2**33))
    _same(to_n(A) * to_n(C), A * C)
    _same(to_n(A[:1]) * to_n(B), A[:1] * B)
    z = to_n(A.clone())
    z *= to_n(B)
    _same(z, A * B)


def test_scaled_add(strict):
    _same(torch.add(to_n(A), to_n(B), alpha=3), torch.add(A, B, alpha=3))
    _same(torch.sub(to_n(A), to_n(C), alpha=-(2**35)), torch.sub(A, C, alpha=-(2**35)))
    _same(torch.rsub(to_n(A), to_n(B), alpha=5), torch.rsub(A, B, alpha=5))


# shift counts: in range, whole-word moves, and the CPU's answers outside [0, 64)
COUNTS = torch.tensor([0, 1, 31, 32, 33, 63, 64, 65, -1, -64, 2**40, 17, 5, 40, 2, -(2**40)])


@pytest.mark.parametrize("op", ["bitwise_left_shift", "bitwise_right_shift"])
def test_shifts(strict, op):
    fn = getattr(torch, op)
    _same(fn(to_n(A), to_n(COUNTS)), fn(A, COUNTS))
    _same(fn(to_n(B), to_n(COUNTS.flip(0))), fn(B, COUNTS.flip(0)))
    _same(fn(to_n(A), 33), fn(A, 33))                                             # Tensor_Scalar
    _same(fn(-(2**40), to_n(COUNTS[:8])), fn(-(2**40), COUNTS[:8]))                # Scalar_Tensor
    _same(fn(to_n(A), to_n(C.clamp(0, 70))), fn(A, C.clamp(0, 70)))               # int32 counts
    _same(fn(to_n(C), to_n(COUNTS)), fn(C, COUNTS))                               # int32 values, promoted
    x = to_n(A.clone())
    getattr(x, f"{op}_")(to_n(COUNTS))
    _same(x, getattr(A.clone(), f"{op}_")(COUNTS))
    out = to_n(torch.empty(0, dtype=torch.int64))
    assert fn(to_n(A[:4, None]), to_n(COUNTS[None, :5]), out=out) is out
    _same(out, fn(A[:4, None], COUNTS[None, :5]))


def test_shift_operators(strict):
    _same(to_n(A) << 3, A << 3)
    _same(to_n(A) >> to_n(COUNTS), A >> COUNTS)
    x = to_n(A.clone())
    x <<= 2
    x >>= to_n(COUNTS)
    y = A.clone()
    y <<= 2
    y >>= COUNTS
    _same(x, y)


def test_shift_float_error_through_fallback():
    with pytest.raises(NotImplementedError, match="not implemented for 'Float'"):
        torch.bitwise_left_shift(to_n(A), to_n(torch.ones(16)))


# divisors: +-1, word boundaries, the extremes (-2**63 // -1 wraps as on the CPU), values of one word
D = torch.tensor([1, -1, 2, -2**63, 2**63 - 1, -(2**32), 3, 2**31, -7, 2**32 + 1, -1, 10, 7, -3, 99, -(2**33) + 1])
DIVISION = {
    "floor_divide": torch.floor_divide, "remainder": torch.remainder, "fmod": torch.fmod,
    "trunc": lambda x, y, **kw: torch.div(x, y, rounding_mode="trunc", **kw),
    "floor": lambda x, y, **kw: torch.div(x, y, rounding_mode="floor", **kw),
}


@pytest.mark.parametrize("op", list(DIVISION))
def test_division(strict, op):
    fn = DIVISION[op]
    _same(fn(to_n(A), to_n(D)), fn(A, D))
    _same(fn(to_n(B), to_n(D.flip(0))), fn(B, D.flip(0)))
    for s in (7, -3, 2**40 + 3):                                                  # one divisor for all
        _same(fn(to_n(A), s), fn(A, s))
    _same(fn(to_n(A[:4, None]), to_n(D[None, :5])), fn(A[:4, None], D[None, :5]))
    _same(fn(to_n(A), to_n(C.clamp(1, 2**31 - 1))), fn(A, C.clamp(1, 2**31 - 1)))  # int32 divisors
    out = to_n(torch.empty(0, dtype=torch.int64))
    assert fn(to_n(A), to_n(D), out=out) is out
    _same(out, fn(A, D))


def test_division_variants(strict):
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-2**63, 2**63 - 1, (100,), generator=g)
    y = torch.randint(-2**20, 2**20, (100,), generator=g) | 1
    _same(to_n(x) // to_n(y), x // y)
    _same(to_n(x) % to_n(x.flip(0)), x % x.flip(0))
    _same(7 % to_n(D), 7 % D)                                                     # remainder.Scalar_Tensor
    _same(to_n(A) // 2.5, A // 2.5)                                               # float operands: float path
    _same(to_n(A) % 2.5, A % 2.5)
    z = to_n(A.clone())
    z //= to_n(D)
    _same(z, A // D)
    z = to_n(A.clone())
    z %= 10
    _same(z, A % 10)


def test_division_by_zero_raises_like_cpu(strict):
    for case in (lambda d: d(A) // d(B), lambda d: torch.remainder(d(A), 0), lambda d: torch.fmod(d(A), d(B)),
                 lambda d: torch.div(d(A), d(C), rounding_mode="trunc"), lambda d: 7 % d(B)):
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            case(lambda t: t)
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            case(to_n)
    x = to_n(A.clone())
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        x.floor_divide_(0)
    _same(x, A)                                                                   # nothing written


def test_gcd(strict):
    # gcd with -2**63 follows the CPU's Euclid loop on wrapped abs values: gcd(-2**63, 6) is -2 there
    m = -2**63
    x = torch.tensor([m, m, m, m, m, 0, 0, 12, -18, 2**62, 7 * 2**40, 2**63 - 1, 1, -4, 99, 35])
    y = torch.tensor([0, 6, 12, m, 2**63 - 1, 0, -5, 18, 12, -(2**61), -21 * 2**33, 3, -9, -6, 0, 14])
    _same(torch.gcd(to_n(x), to_n(y)), torch.gcd(x, y))
    _same(torch.gcd(to_n(y), to_n(x)), torch.gcd(y, x))
    _same(torch.gcd(to_n(x), to_n(C)), torch.gcd(x, C))                          # int32 operand
    z = to_n(x.clone())
    z.gcd_(to_n(y))
    _same(z, torch.gcd(x, y))


def test_lcm(strict):
    a = torch.tensor([0, 0, 12, -18, 2**62, 7 * 2**40, 2**63 - 1, 1, -4, 99, 35, 2**40])   # the CPU traps at -2**63
    b = torch.tensor([0, -5, 18, 12, -(2**61), -21 * 2**33, 3, -9, -6, 0, 14, 2**40 + 1])  # the last one wraps
    _same(torch.lcm(to_n(a), to_n(b)), torch.lcm(a, b))
    _same(torch.lcm(to_n(a[:4, None]), to_n(b[None, 1:4])), torch.lcm(a[:4, None], b[None, 1:4]))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_narrow_int_division_and_shifts(strict, dtype):
    # computed on widened int64 values, wrapped back to the dtype: the CPU's narrow results
    g = torch.Generator().manual_seed(5)
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max + 1, (40,), generator=g).to(dtype)
    y = torch.randint(info.min, info.max + 1, (40,), generator=g).to(dtype)
    y[y == 0] = 1
    if dtype != torch.int32:  # the CPU traps on INT32_MIN // -1
        x[0], y[0] = info.min, -1 if info.min else 1
    counts = torch.randint(0 if dtype == torch.uint8 else -3, 40, (40,), generator=g).to(dtype)
    for f in (torch.floor_divide, torch.remainder, torch.fmod, lambda a, b: torch.div(a, b, rounding_mode="trunc"),
              lambda a, b: a // 3, lambda a, b: a % 5):
        _same(f(to_n(x), to_n(y)), f(x, y))
    for f in (torch.bitwise_left_shift, torch.bitwise_right_shift, lambda a, b: a << 3, lambda a, b: a >> b):
        _same(f(to_n(x), to_n(counts)), f(x, counts))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_int64_tensors_keeps_the_half_dtype(dtype, strict):
    # bf16 / int64 is bf16 in PyTorch (the int64 operand is cast to the common dtype, as the CPU does)
    x = torch.randn(4, 3).to(dtype)
    counts = torch.tensor([[1, 2, 3]] * 4)
    for fn in (torch.div, torch.mul, torch.add, torch.sub, torch.maximum, torch.lt):
        for a, b in ((x, counts), (counts, x)):
            want = fn(a, b)
            got = fn(to_n(a), to_n(b))
            assert got.dtype == want.dtype
            torch.testing.assert_close(got.cpu(), want)
    y = x.clone()
    y[0, 1] = float("nan")
    torch.testing.assert_close(torch.nanmean(to_n(y), 1).cpu(), torch.nanmean(y, 1))
