"""Random and factory ops drawn on the device (``torchneuron/ops/random.py``), in strict mode.

The values differ from the CPU's for the same seed (as CUDA's do): the tests check the contract —
distribution (moments and ranges within statistical bounds), dtype/shape/device, reproducibility,
generator semantics — and that nothing takes the CPU fallback.
"""
from __future__ import annotations

import math

import pytest
import torch

import torchneuron

N = "neuron"


@pytest.fixture(autouse=True)
def strict():
    torchneuron.set_strict(True)
    yield
    torchneuron.set_strict(False)


def _z(x: torch.Tensor, mean: float, std: float) -> float:
    """How many standard errors the sample mean of ``x`` is from ``mean``."""
    return abs(x.double().mean().item() - mean) / (std / math.sqrt(x.numel()))


DRAWS = {
    "normal_": lambda: torch.empty(4096, device=N).normal_(1.0, 2.0),
    "uniform_": lambda: torch.empty(4096, device=N).uniform_(-1.0, 3.0),
    "exponential_": lambda: torch.empty(4096, device=N).exponential_(2.0),
    "geometric_": lambda: torch.empty(4096, device=N).geometric_(0.3),
    "log_normal_": lambda: torch.empty(4096, device=N).log_normal_(0.0, 0.5),
    "cauchy_": lambda: torch.empty(4096, device=N).cauchy_(),
    "bernoulli_": lambda: torch.empty(4096, device=N).bernoulli_(0.3),
    "bernoulli": lambda: torch.bernoulli(torch.full((64, 64), 0.4, device=N)),
    "random_": lambda: torch.empty(4096, dtype=torch.int32, device=N).random_(-7, 7),
    "randint": lambda: torch.randint(0, 100, (4096,), device=N),
    "randperm": lambda: torch.randperm(300, device=N),
    "multinomial": lambda: torch.multinomial(torch.rand(4, 30) .to(N), 10),
    "multinomial_r": lambda: torch.multinomial(torch.rand(4, 30).to(N), 50, replacement=True),
    "normal_TT": lambda: torch.normal(torch.zeros(64, device=N), torch.ones(64, device=N)),
}


@pytest.mark.parametrize("name", list(DRAWS))
def test_draw_runs_natively_and_reproduces(name):
    torch.manual_seed(0)                    # also seeds the CPU generator the multinomial inputs use
    a = DRAWS[name]()
    b = DRAWS[name]()
    torch.manual_seed(0)
    again = DRAWS[name]()
    assert a.device.type == "neuron"
    assert torch.equal(a.cpu(), again.cpu())
    assert not torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_normal_and_uniform_statistics(dtype):
    torch.neuron.manual_seed(1)
    x = torch.empty(50_000, dtype=dtype, device=N).normal_(2.0, 3.0).cpu()
    assert x.dtype == dtype and x.shape == (50_000,)
    assert _z(x, 2.0, 3.0) < 5
    assert abs(x.double().std().item() - 3.0) < 0.05
    u = torch.empty(50_000, dtype=dtype, device=N).uniform_(-2.0, 6.0).cpu()
    assert u.min() >= -2.0 and u.max() < 6.0
    assert _z(u, 2.0, 8 / math.sqrt(12)) < 5


def test_uniform_never_reaches_the_upper_bound_in_bfloat16():
    torch.neuron.manual_seed(2)
    u = torch.empty(100_000, dtype=torch.bfloat16, device=N).uniform_(1.0, 1.0078125).cpu()   # one bf16 ulp wide
    assert bool((u == 1.0).all())
    v = torch.empty(1000, device=N).uniform_(3.0, 3.0).cpu()
    assert bool((v == 3.0).all())


def test_exponential_geometric_log_normal_cauchy_statistics():
    torch.neuron.manual_seed(3)
    n = 50_000
    e = torch.empty(n, device=N).exponential_(4.0).cpu()
    assert e.min() > 0 and _z(e, 0.25, 0.25) < 5
    g = torch.empty(n, device=N).geometric_(0.25).cpu()
    assert g.min() >= 1 and bool((g == g.round()).all())
    assert _z(g, 4.0, math.sqrt(0.75) / 0.25) < 5
    ln = torch.empty(n, device=N).log_normal_(0.5, 0.25).cpu()
    assert ln.min() > 0 and _z(ln.log(), 0.5, 0.25) < 5
    c = torch.empty(n, device=N).cauchy_(1.0, 2.0).cpu()
    assert abs(c.median().item() - 1.0) < 0.1
    assert abs(((c - 1.0).abs() < 2.0).double().mean().item() - 0.5) < 0.02   # half within one scale


def test_bernoulli_variants():
    torch.neuron.manual_seed(4)
    b = torch.bernoulli(torch.full((100_000,), 0.25, device=N)).cpu()
    assert set(b.unique().tolist()) <= {0.0, 1.0} and abs(b.mean().item() - 0.25) < 0.01
    p = torch.tensor([0.0, 1.0, 0.5]).repeat(10_000).to(N)
    d = torch.bernoulli(p).cpu().view(-1, 3)
    assert bool((d[:, 0] == 0).all()) and bool((d[:, 1] == 1).all()) and abs(d[:, 2].mean().item() - 0.5) < 0.03
    m = torch.empty(300, 4, dtype=torch.bool, device=N).bernoulli_(torch.tensor([0.0, 1.0, 0.0, 1.0], device=N))
    assert m.dtype == torch.bool and torch.equal(m.cpu(), torch.tensor([False, True, False, True]).expand(300, 4))
    out = torch.empty(5, device=N)
    torch.bernoulli(torch.ones(7, 2, device=N), out=out)
    assert out.shape == (7, 2) and bool((out.cpu() == 1).all())
    i = torch.zeros(1000, dtype=torch.int64, device=N).bernoulli_(0.5).cpu()
    assert i.dtype == torch.int64 and set(i.unique().tolist()) == {0, 1}


def test_random_integers():
    torch.neuron.manual_seed(5)
    r = torch.randint(3, 13, (50_000,), device=N)
    assert r.dtype == torch.int64
    rc = r.cpu()
    assert rc.min() == 3 and rc.max() == 12
    counts = torch.bincount(rc - 3, minlength=10).double()
    assert (counts / counts.sum() - 0.1).abs().max() < 0.01
    neg = torch.randint(-1000, -990, (2000,), dtype=torch.int32, device=N).cpu()
    assert neg.min() == -1000 and neg.max() == -991
    f = torch.empty(20_000, device=N).random_().cpu()
    assert f.min() >= 0 and f.max() <= 2 ** 24 and bool((f == f.round()).all())
    u8 = torch.empty(20_000, dtype=torch.uint8, device=N).random_().cpu()
    assert u8.min() == 0 and u8.max() == 255
    bools = torch.empty(1000, dtype=torch.bool, device=N).random_().cpu()
    assert 400 < int(bools.sum()) < 600
    t = torch.empty(3000, dtype=torch.int64, device=N).random_(5).cpu()
    assert set(t.unique().tolist()) == {0, 1, 2, 3, 4}


def test_random_fills_noncontiguous_views():
    torch.neuron.manual_seed(6)
    base = torch.zeros(64, 64, device=N)
    base[:, ::2].uniform_(5.0, 6.0)
    bc = base.cpu()
    assert bool((bc[:, 1::2] == 0).all()) and bc[:, ::2].min() >= 5.0 and bc[:, ::2].max() < 6.0
    x = torch.empty(32, 48, device=N).t().normal_()
    assert x.shape == (48, 32)


def test_normal_overloads():
    torch.neuron.manual_seed(7)
    mean = torch.tensor([0.0, 10.0, -5.0]).repeat(5000).to(N)
    a = torch.normal(mean, 2.0).cpu().view(-1, 3)
    assert _z(a[:, 1], 10.0, 2.0) < 5 and abs(a[:, 2].std().item() - 2.0) < 0.1
    std = torch.tensor([0.0, 1.0, 3.0]).repeat(5000).to(N)
    b = torch.normal(1.0, std).cpu().view(-1, 3)
    assert bool((b[:, 0] == 1.0).all()) and abs(b[:, 2].std().item() - 3.0) < 0.15
    c = torch.normal(torch.zeros(4, 1, device=N), torch.ones(1, 5, device=N))
    assert c.shape == (4, 5) and c.device.type == "neuron"
    out = torch.empty(0, device=N)
    torch.normal(torch.ones(6, device=N), torch.ones(6, device=N), out=out)
    assert out.shape == (6,)
    torch.normal(torch.ones(3, device=N), 0.0, out=out)
    assert torch.equal(out.cpu(), torch.ones(3))
    r = torch.randn(2, 3, dtype=torch.bfloat16, device=N)
    assert r.dtype == torch.bfloat16 and torch.randn_like(r).shape == (2, 3)


def test_randperm_and_multinomial():
    torch.neuron.manual_seed(8)
    for n in (0, 1, 2, 127, 1000):
        p = torch.randperm(n, device=N)
        assert p.dtype == torch.int64 and torch.equal(p.cpu().sort().values, torch.arange(n))
    p32 = torch.randperm(50, dtype=torch.int32, device=N).cpu()
    assert p32.dtype == torch.int32 and torch.equal(p32.sort().values, torch.arange(50, dtype=torch.int32))
    # each position of a uniform permutation of 4 holds each value a quarter of the time
    first = torch.stack([torch.randperm(4, device=N) for _ in range(400)]).cpu()[:, 0]
    assert (torch.bincount(first, minlength=4).double() / 400 - 0.25).abs().max() < 0.1

    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 0.0, 1.0]], device=N)
    s = torch.multinomial(probs, 4000, replacement=True).cpu()
    assert s.shape == (2, 4000) and s.dtype == torch.int64
    freq = torch.bincount(s[0], minlength=4).double() / 4000
    assert freq[1] == 0 and (freq - torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)).abs().max() < 0.03
    assert bool((s[1] == 3).all())
    w = torch.multinomial(torch.tensor([1.0, 0.0, 2.0, 3.0, 0.5], device=N), 4).cpu()
    assert sorted(w.tolist()) == [0, 2, 3, 4]
    one = torch.multinomial(torch.tensor([0.0, 0.0, 5.0], device=N), 1)
    assert one.shape == (1,) and one.item() == 2


def test_argument_errors_match_pytorch_and_draw_nothing():
    torch.neuron.manual_seed(9)
    state = torch.neuron.get_rng_state()
    x = torch.empty(8, device=N)
    for call, msg in [(lambda: x.normal_(0.0, -1.0), "normal expects std >= 0.0"),
                      (lambda: x.uniform_(2.0, 1.0), r"uniform_ expects to return a \[from, to\) range"),
                      (lambda: x.exponential_(0.0), "exponential_ expects lambda > 0.0"),
                      (lambda: x.geometric_(1.0), r"geometric_ expects p to be in \(0, 1\)"),
                      (lambda: x.bernoulli_(1.5), r"bernoulli_ expects p to be in \[0, 1\]"),
                      (lambda: torch.empty(3, dtype=torch.int64, device=N).random_(5, 3), "random_ expects 'from'"),
                      (lambda: torch.normal(1.0, -torch.ones(3, device=N)), "normal expects all elements of std"),
                      (lambda: torch.multinomial(torch.tensor([1.0, -1.0], device=N), 1), "element < 0"),
                      (lambda: torch.multinomial(torch.zeros(3, device=N), 1), "sum of probabilities <= 0"),
                      (lambda: torch.multinomial(torch.ones(3, device=N), 4), "without replacement")]:
        with pytest.raises(RuntimeError, match=msg):
            call()
    assert torch.equal(torch.neuron.get_rng_state(), state), "a refused call advanced the generator"


@pytest.mark.parametrize("p", [[0.5, 1.5], [-0.1, 0.2], [0.3, math.nan], [-math.inf, 0.0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bernoulli_tensor_p_outside_unit_interval_raises_like_cpu(p, dtype):
    # a probability tensor with an element outside [0, 1] (or NaN) raises the CPU's error instead of
    # sampling, for torch.bernoulli, bernoulli_ and the out= form, and draws nothing
    probs = torch.tensor(p, dtype=dtype)
    calls = [lambda q: torch.bernoulli(q), lambda q: torch.empty(2, device=q.device).bernoulli_(q),
             lambda q: torch.bernoulli(q, out=torch.empty(2, dtype=dtype, device=q.device))]
    torch.neuron.manual_seed(3)
    state = torch.neuron.get_rng_state()
    for call in calls:
        with pytest.raises(Exception) as cpu:
            call(probs)
        with pytest.raises(type(cpu.value)) as dev:
            call(probs.to(N))
        assert str(dev.value) == str(cpu.value)
    assert torch.equal(torch.neuron.get_rng_state(), state), "a refused call advanced the generator"
    ok = torch.bernoulli(torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=dtype, device=N)).cpu()
    assert torch.equal(ok, torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=dtype))


def test_generator_argument_and_cpu_generator_refusal():
    g = torch.Generator(device=N).manual_seed(11)
    torch.neuron.manual_seed(0)
    default = torch.neuron.get_rng_state()
    a = torch.empty(100, device=N).exponential_(generator=g).cpu()
    g.manual_seed(11)
    assert torch.equal(torch.empty(100, device=N).exponential_(generator=g).cpu(), a)
    assert torch.equal(torch.neuron.get_rng_state(), default)
    with pytest.raises(RuntimeError, match="Expected a 'neuron' device type for generator but found 'cpu'"):
        torch.empty(4, device=N).uniform_(generator=torch.Generator())


def test_rng_state_roundtrip_replays_every_distribution():
    torch.neuron.manual_seed(12)
    state = torch.neuron.get_rng_state()
    first = [f().cpu() for f in DRAWS.values() if f is not DRAWS["multinomial"] and f is not DRAWS["multinomial_r"]]
    torch.neuron.set_rng_state(state)
    again = [f().cpu() for f in DRAWS.values() if f is not DRAWS["multinomial"] and f is not DRAWS["multinomial_r"]]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linspace_logspace_match_cpu(dtype):
    for start, end, steps in [(0, 1, 7), (-3.5, 5, 10), (2, 2, 1), (0, 1, 2), (1, 1000, 33), (5, -5, 0)]:
        torch.testing.assert_close(torch.linspace(start, end, steps, dtype=dtype, device=N).cpu(),
                                   torch.linspace(start, end, steps, dtype=dtype))
        torch.testing.assert_close(torch.logspace(start / 100, end / 100, steps, base=2.0, dtype=dtype, device=N).cpu(),
                                   torch.logspace(start / 100, end / 100, steps, base=2.0, dtype=dtype))
    ends = torch.linspace(-1.0, 7.0, 1001, dtype=dtype, device=N).cpu()
    assert ends[0] == -1.0 and ends[-1] == 7.0
    out = torch.empty(2, 2, device=N)[:, 0]
    torch.linspace(0, 1, 2, out=out)
    assert torch.equal(out.cpu(), torch.tensor([0.0, 1.0]))


def _linspace_in_dtype(start: float, end: float, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's linspace formula evaluated in ``dtype`` arithmetic (each operation rounded to it, as its CPU
    kernel's scalar_t does): the step from the rounded difference over the rounded count, then start + step * i
    up to the middle and end - step * (steps - 1 - i) after it."""
    one = lambda v: torch.tensor(v, dtype=dtype)  # noqa: E731
    s, e = one(start), one(end)
    step = (e - s) / one(steps - 1)
    return torch.stack([s + step * one(i) if i < steps // 2 else e - step * one(steps - 1 - i) for i in range(steps)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_float_linspace_rounds_each_step_in_its_dtype(dtype):
    # fp32 intermediates rounded once land on the other neighbour of many values (4.3 -> -3 in 50 bf16 steps:
    # 14 of 50); the CPU rounds every operation to the dtype, and so must the device. fp16's +-65504 overflows
    # the difference to inf, giving the CPU's NaN and infinities.
    for start, end, steps in [(4.3, -3, 50), (-2.5, 7.1, 300), (-10, 10, 999), (0.1, 0.2, 3), (-65504, 65504, 5)]:
        got = torch.linspace(start, end, steps, dtype=dtype, device=N).cpu()
        torch.testing.assert_close(got, _linspace_in_dtype(start, end, steps, dtype), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_eye_matches_cpu(dtype):
    for args in [(3,), (3, 5), (6, 2), (0, 4)]:
        assert torch.equal(torch.eye(*args, dtype=dtype, device=N).cpu(), torch.eye(*args, dtype=dtype))
    with pytest.raises(RuntimeError, match="n must be greater or equal to 0"):
        torch.eye(-1, device=N)


def test_float64_draws_are_made_in_fp32_and_widened():
    # the core has no float64: fp32 draws widened by copy_ (native), so still no CPU fallback
    torch.neuron.manual_seed(7)
    x = torch.empty(20_000, dtype=torch.float64, device=N).normal_(1.0, 2.0).cpu()
    assert x.dtype == torch.float64 and _z(x, 1.0, 2.0) < 5 and abs(x.std().item() - 2.0) < 0.05
    assert torch.equal(x, x.float().double())                                  # fp32 values
    u = torch.rand(20_000, dtype=torch.float64, device=N).cpu()
    assert u.min() >= 0 and u.max() < 1 and _z(u, 0.5, 1 / math.sqrt(12)) < 5
    r = torch.randint(2, 10, (5000,), dtype=torch.float64, device=N).cpu()
    assert set(r.unique().tolist()) == set(range(2, 10))
    like = torch.randn_like(torch.zeros(3, 4, dtype=torch.float64, device=N))
    assert like.dtype == torch.float64 and like.shape == (3, 4)
    b = torch.empty(5000, dtype=torch.float64, device=N).bernoulli_(0.25).cpu()
    assert set(b.unique().tolist()) == {0.0, 1.0} and abs(b.mean().item() - 0.25) < 0.03
    e = torch.empty(5000, dtype=torch.float64, device=N).exponential_(2.0).cpu()
    assert e.min() > 0 and _z(e, 0.5, 0.5) < 5
    torch.neuron.manual_seed(7)
    assert torch.equal(torch.empty(20_000, dtype=torch.float64, device=N).normal_(1.0, 2.0).cpu(), x)


def test_float64_draws_beyond_fp32_take_the_fallback():
    # bounds fp32 cannot hold, integers beyond 2**24: the CPU draws them in float64
    torchneuron.set_strict(False)
    before = dict(torchneuron.fallback_counts())
    u = torch.empty(1000, dtype=torch.float64, device=N).uniform_(0.1, 0.2).cpu()
    assert u.min() >= 0.1 and u.max() < 0.2
    r = torch.empty(1000, dtype=torch.float64, device=N).random_(0, 2 ** 40).cpu()
    assert r.max() < 2 ** 40 and bool((r == r.round()).all())
    after = torchneuron.fallback_counts()
    assert after.get("aten::uniform_", 0) == before.get("aten::uniform_", 0) + 1
    assert after.get("aten::random_.from", 0) == before.get("aten::random_.from", 0) + 1


def test_random_fills_refuse_an_expanded_target_like_cpu():
    for fill in (lambda t: t.bernoulli_(0.5), lambda t: t.uniform_(), lambda t: t.normal_(),
                 lambda t: t.bernoulli_(torch.full((3,), 0.5, device=t.device)),
                 lambda t: torch.bernoulli(torch.full((3,), 0.5, device=t.device), out=t)):
        for device in ("cpu", "neuron"):
            with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
                fill(torch.zeros(1, device=device).expand(3))
