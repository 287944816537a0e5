"""Special functions and less common activations run on the device (strict mode) and match the CPU,
special values (inf, nan, +-0, poles, negatives) and bad-argument errors included."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import to_n

torch.manual_seed(0)
INF, NAN = float("inf"), float("nan")
SPECIAL = torch.tensor([-3.5, -2.5, -2.0, -1.2, -0.5, -1e-3, -0.0, 0.0, 1e-30, 1e-3, 0.3, 1.0, 1.4616, 2.0, 2.5,
                        7.9, 8.0, 10.0, 33.3, 1e4, 3e38, INF, -INF, NAN])
X = torch.cat([SPECIAL, torch.randn(300) * 5, torch.rand(100) * 20, torch.randn(100) * 60])
UNIT = torch.cat([torch.tensor([-1.0, 1.0, 0.0, -0.0, 1.5, -2.0, NAN, 0.5, -0.5, 0.9999999, -0.99999994, 1e-30]),
                  torch.rand(400) * 2 - 1, 1 - torch.rand(50) * 1e-3])
Y = X[torch.randperm(X.numel())]
TOL = {"atol": 1e-5, "rtol": 1.3e-6, "equal_nan": True}


def _bw(fn):
    def grad(t):
        t = t.detach().requires_grad_()
        y = fn(t)
        return torch.autograd.grad(y, t, torch.ones_like(y))[0]
    return grad


UNARY = {
    "lgamma": (torch.lgamma, X), "digamma": (torch.digamma, X), "erfinv": (torch.erfinv, UNIT),
    "erfc": (torch.erfc, X), "i0": (torch.i0, X), "i0e": (torch.special.i0e, X), "i1": (torch.special.i1, X),
    "i1e": (torch.special.i1e, X), "entr": (torch.special.entr, X), "logsigmoid": (F.logsigmoid, X),
    "erfcx": (torch.special.erfcx, X), "log_ndtr": (torch.special.log_ndtr, X),
    "logsigmoid_bw": (_bw(F.logsigmoid), X), "softshrink": (F.softshrink, X),
    "softshrink_3": (lambda t: F.softshrink(t, 3.0), X), "hardshrink": (F.hardshrink, X),
    "softshrink_bw": (_bw(F.softshrink), X), "hardshrink_bw": (_bw(lambda t: F.hardshrink(t, 2.0)), X),
    "logit_bw": (_bw(torch.logit), UNIT.abs()), "logit_bw_eps": (_bw(lambda t: torch.logit(t, 0.1)), UNIT.abs()),
    "rrelu_eval": (lambda t: F.rrelu(t, training=False), X), "mvlgamma": (lambda t: torch.mvlgamma(t, 3), X.abs() + 1),
    "lgamma_int32": (torch.lgamma, torch.arange(-3, 10, dtype=torch.int32)),
}
UNARY.update({f"polygamma_{n}": ((lambda k: lambda t: torch.polygamma(k, t))(n), X) for n in range(4)})


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, strict):
    fn, x = UNARY[name]
    torch.testing.assert_close(fn(to_n(x)).cpu(), fn(x), **TOL)


BINARY = {
    "logaddexp": torch.logaddexp, "logaddexp2": torch.logaddexp2, "nextafter": torch.nextafter,
    "xlog1py": lambda a, b: torch.special.xlog1py(torch.where(a.abs() < 1, 0, a), b),
    "heaviside": lambda a, b: torch.heaviside(torch.where(a.abs() < 1, 0, a), b),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name, strict):
    fn = BINARY[name]
    for a, b in ((X, Y), (SPECIAL, SPECIAL), (SPECIAL, SPECIAL.flip(0))):
        torch.testing.assert_close(fn(to_n(a), to_n(b)).cpu(), fn(a, b), **TOL)


def test_nextafter_zeros_and_frexp(strict):
    a, b = torch.tensor([0.0, 0.0, -0.0, 1.0, 1e-45]), torch.tensor([-0.0, 1.0, 0.0, 1.0, -1.0])
    got = torch.nextafter(to_n(a), to_n(b)).cpu()
    assert torch.equal(got.view(torch.int32), torch.nextafter(a, b).view(torch.int32))
    x = torch.cat([X, torch.tensor([1e-40, -3e-42])])
    m, e = torch.frexp(to_n(x))
    cm, ce = torch.frexp(x)
    torch.testing.assert_close(m.cpu(), cm, **TOL)
    assert torch.equal(e.cpu(), ce)


def test_glu_prelu(strict):
    x = torch.randn(4, 6, 8)
    for dim in (-1, 1):
        torch.testing.assert_close(F.glu(to_n(x), dim).cpu(), F.glu(x, dim))
        torch.testing.assert_close(_bw(lambda t: F.glu(t, dim))(to_n(x)).cpu(), _bw(lambda t: F.glu(t, dim))(x))
    w = torch.randn(6)

    def prelu_grads(t, w):
        t, w = t.detach().requires_grad_(), w.detach().requires_grad_()
        y = F.prelu(t, w)
        return (y, *torch.autograd.grad(y, (t, w), torch.ones_like(y)))
    for got, want in zip(prelu_grads(to_n(x), to_n(w)), prelu_grads(x, w)):
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call", [
    lambda t: torch.polygamma(-1, t), lambda t: F.softshrink(t, -1.0), lambda t: torch.heaviside(t, t.int()),
    lambda t: F.glu(t[:5]), lambda t: F.glu(t[:4].reshape(2, 2), 3),
])
def test_errors_match_cpu(call, strict):
    with pytest.raises(Exception) as cpu:
        call(X)
    with pytest.raises(type(cpu.value)) as dev:
        call(to_n(X))
    assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("call, dtype", [
    (torch.special.erfcx, torch.bfloat16), (torch.special.log_ndtr, torch.float16),
    (lambda t: torch.logaddexp(t, t), torch.int32), (lambda t: torch.nextafter(t, t), torch.int32),
    (F.logsigmoid, torch.int32), (F.softshrink, torch.int32), (F.hardshrink, torch.uint8), (F.glu, torch.int32),
])
def test_dtype_errors_match_cpu(call, dtype, strict):
    t = torch.ones(4, dtype=dtype)
    with pytest.raises(Exception) as cpu:
        call(t)
    with pytest.raises(type(cpu.value)) as dev:
        call(to_n(t))
    assert str(dev.value) == str(cpu.value)


# incomplete gamma: every pair of special values, random (a, x) over the series / continued-fraction
# split, and large a (Temme's expansion; against float64 there, where the CPU's float kernel is less
# accurate): one tensor, so one kernel trace per function
_GS = torch.tensor([0.0, -0.0, 1e-30, 1e-3, 0.5, 1.0, 2.5, 8.0, 8.5, 33.0, 99.0, 150.0, 1e4, INF, -INF, NAN, -1.0])
_GA = torch.cat([_GS.repeat_interleave(17), torch.rand(200) * 12, torch.rand(100) * 100, torch.rand(50) * 0.01])
_GX = torch.cat([_GS.repeat(17), torch.rand(200) * 14, _GA[-150:-50] * (0.7 + 0.6 * torch.rand(100)),
                 torch.rand(50) * 3])
_BIG_A = 10 ** (2 + torch.rand(200) * 5)
_BIG_X = torch.cat([_BIG_A[:100] + torch.randn(100) * _BIG_A[:100].sqrt() * 3, _BIG_A[100:] * torch.rand(100) * 3])
GAMMA_A, GAMMA_X = torch.cat([_GA, _BIG_A]), torch.cat([_GX, _BIG_X])


@pytest.mark.parametrize("fn", [torch.igamma, torch.igammac])
def test_incomplete_gamma(fn, strict):
    k = _GA.numel()
    got = fn(to_n(GAMMA_A), to_n(GAMMA_X)).cpu()
    torch.testing.assert_close(got[:k], fn(_GA, _GX), **TOL)
    torch.testing.assert_close(got[k:], fn(_BIG_A.double(), _BIG_X.double()).float(), atol=1e-6, rtol=1e-5)
    out = to_n(torch.empty_like(GAMMA_A))   # out= and in-place reuse the kernel
    fn(to_n(GAMMA_A), to_n(GAMMA_X), out=out)
    torch.testing.assert_close(out.cpu(), got, atol=0, rtol=0, equal_nan=True)
    inplace = to_n(GAMMA_A)
    getattr(inplace, fn.__name__ + "_")(to_n(GAMMA_X))
    torch.testing.assert_close(inplace.cpu(), got, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_incomplete_gamma_dtype_errors(dtype, strict):
    t = torch.ones(3, dtype=dtype)   # the CPU's "not implemented for 'Int'"
    with pytest.raises(Exception) as cpu:
        torch.igamma(t, t)
    with pytest.raises(type(cpu.value)) as dev:
        torch.igamma(to_n(t), to_n(t))
    assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_float_glu_and_its_gradient_round_once(dtype, strict):
    # computed in fp32 and rounded once (as the CPU's kernel): each element is the float64 result rounded to the
    # dtype, to within fp32's rounding of a few operations; edges: fp16's 65504, +-inf and NaN gates, -0.0
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 8, generator=gen) * 4).to(dtype)
    x[0, :4] = torch.tensor([65504.0, -65504.0, -0.0, float("nan")]).to(dtype)
    x[0, 4:] = torch.tensor([float("inf"), -float("inf"), 3.0, 0.0]).to(dtype)
    g = (torch.randn(6, 4, generator=gen) * 4).to(dtype)
    exact = torch.nn.functional.glu(x.double(), -1)
    got = torch.nn.functional.glu(to_n(x), -1).cpu()
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=2 * torch.finfo(dtype).eps, atol=0,
                               equal_nan=True)
    exact_g = torch.ops.aten.glu_backward(g.double(), x.double(), -1)
    got_g = torch.ops.aten.glu_backward(to_n(g), to_n(x), -1).cpu()
    torch.testing.assert_close(got_g.double(), exact_g.to(dtype).double(), rtol=2 * torch.finfo(dtype).eps, atol=0,
                               equal_nan=True)
