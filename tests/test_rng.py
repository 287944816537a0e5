"""Random numbers on neuron: seeding, generator objects, RNG state, and the random ops.

The neuron device has its own generators (one default per device plus user-made
``torch.Generator(device="neuron")``), like CUDA: seeding or drawing from the CPU
generator never changes the neuron stream, and vice versa.
"""
from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchneuron  # noqa: F401  (registers the device even with autoload off)

# Ops that still take the CPU fallback (float64 draws, large randperm) warn once per op: noise here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N = "neuron"


def _cpu(t: torch.Tensor) -> torch.Tensor:
    assert t.device.type == "neuron", f"expected a neuron tensor, got {t.device}"
    return t.cpu()


# Each random op on neuron, drawing from the default generator of its device.
RANDOM_OPS = {
    "randn": lambda: torch.randn(64, device=N),
    "rand": lambda: torch.rand(64, device=N),
    "dropout": lambda: F.dropout(torch.ones(256, device=N), p=0.5, training=True),
    "nn.Dropout": lambda: nn.Dropout(0.3).train()(torch.ones(256, device=N)),
    "bernoulli": lambda: torch.bernoulli(torch.full((256,), 0.5, device=N)),
    "bernoulli_p": lambda: torch.ones(256, device=N).bernoulli_(0.5),
    "randperm": lambda: torch.randperm(100, device=N),
    "normal_": lambda: torch.empty(64, device=N).normal_(2.0, 3.0),
    "uniform_": lambda: torch.empty(64, device=N).uniform_(-1.0, 1.0),
    "randint": lambda: torch.randint(0, 1000, (64,), device=N),
    "multinomial": lambda: torch.multinomial(torch.ones(50, device=N), 20),
}
OP_IDS = list(RANDOM_OPS)


def _seed_cpu_only(seed: int) -> None:
    # torch.manual_seed also seeds neuron; this touches the CPU generator alone.
    torch.default_generator.manual_seed(seed)


# ---- reproducibility and independence from the CPU generator ---------------


@pytest.mark.parametrize("name", OP_IDS)
def test_random_op_reproducible_for_a_seed(name):
    op = RANDOM_OPS[name]
    torch.neuron.manual_seed(1234)
    first = _cpu(op())
    second = _cpu(op())
    torch.neuron.manual_seed(1234)
    again = _cpu(op())
    assert torch.equal(first, again), f"{name}: same seed gave different numbers"
    assert not torch.equal(first, second), f"{name}: the stream did not advance between draws"


@pytest.mark.parametrize("name", OP_IDS)
def test_random_op_independent_of_cpu_generator(name):
    op = RANDOM_OPS[name]
    # Seeding or consuming the CPU generator does not change the neuron stream.
    torch.neuron.manual_seed(7)
    _seed_cpu_only(1)
    a = _cpu(op())
    torch.neuron.manual_seed(7)
    _seed_cpu_only(2)
    torch.randn(1000)
    torch.rand(17)
    b = _cpu(op())
    assert torch.equal(a, b)

    # Drawing on neuron does not change the CPU stream or state.
    _seed_cpu_only(3)
    cpu_state = torch.get_rng_state()
    op()
    op()
    assert torch.equal(torch.get_rng_state(), cpu_state), f"{name} on neuron advanced the CPU generator"
    after = torch.randn(10)
    _seed_cpu_only(3)
    assert torch.equal(after, torch.randn(10))


def test_neuron_draws_do_not_depend_on_cpu_seed_even_with_same_value():
    # The neuron generator is not an alias of the CPU one: after drawing on the
    # CPU with the same seed, neuron still starts at the beginning of its stream.
    torch.manual_seed(11)          # seeds CPU and neuron alike
    torch.randn(100)               # consume CPU only
    a = _cpu(torch.randn(8, device=N))
    torch.manual_seed(11)
    b = _cpu(torch.randn(8, device=N))
    assert torch.equal(a, b)


# ---- seeding API -----------------------------------------------------------


def test_manual_seed_sets_initial_seed():
    torch.neuron.manual_seed(123)
    assert torch.neuron.initial_seed() == 123
    torch.neuron.manual_seed(2**40 + 5)
    assert torch.neuron.initial_seed() == 2**40 + 5


def test_manual_seed_seeds_only_current_device():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    torch.neuron.manual_seed_all(5)
    state1 = torch.neuron.get_rng_state(1)
    torch.neuron.manual_seed(99)           # current device is 0
    assert torch.neuron.current_device() == 0
    assert torch.neuron.default_generators[0].initial_seed() == 99
    assert torch.neuron.default_generators[1].initial_seed() == 5
    assert torch.equal(torch.neuron.get_rng_state(1), state1)


def test_manual_seed_all_seeds_every_device():
    torch.neuron.manual_seed_all(31)
    seeds = [g.initial_seed() for g in torch.neuron.default_generators]
    assert seeds == [31] * torch.neuron.device_count()
    # Every device starts the same stream from the same seed.
    draws = [_cpu(torch.randn(16, device=f"neuron:{i}")) for i in range(min(3, torch.neuron.device_count()))]
    for d in draws[1:]:
        assert torch.equal(d, draws[0])


def test_device_streams_are_separate():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    torch.neuron.manual_seed_all(8)
    a1 = _cpu(torch.randn(16, device="neuron:1"))
    torch.neuron.manual_seed_all(8)
    torch.randn(1000, device="neuron:0")    # consuming device 0 leaves device 1 alone
    b1 = _cpu(torch.randn(16, device="neuron:1"))
    assert torch.equal(a1, b1)


def test_torch_manual_seed_also_seeds_neuron():
    torch.neuron.manual_seed_all(1)
    torch.manual_seed(42)
    assert [g.initial_seed() for g in torch.neuron.default_generators] == [42] * torch.neuron.device_count()
    a = _cpu(torch.randn(16, device=N))
    torch.neuron.manual_seed_all(42)
    b = _cpu(torch.randn(16, device=N))
    assert torch.equal(a, b)


def test_torch_seed_seeds_neuron_with_the_returned_seed():
    s = torch.seed()
    assert torch.neuron.initial_seed() == s
    assert torch.initial_seed() == s


def test_neuron_seed_is_nondeterministic_and_recorded():
    torch.neuron.manual_seed(0)
    torch.neuron.seed()
    s1 = torch.neuron.initial_seed()
    torch.neuron.seed()
    s2 = torch.neuron.initial_seed()
    assert s1 != s2 and s1 != 0          # 64-bit random seeds: a collision is practically impossible
    a = _cpu(torch.rand(16, device=N))
    torch.neuron.manual_seed(s2)         # the recorded seed reproduces the stream
    assert torch.equal(a, _cpu(torch.rand(16, device=N)))


def test_seed_all_gives_every_device_one_seed():
    torch.neuron.seed_all()
    seeds = {g.initial_seed() for g in torch.neuron.default_generators}
    assert len(seeds) == 1


# ---- RNG state -------------------------------------------------------------


def test_get_set_rng_state_roundtrip():
    torch.neuron.manual_seed(3)
    torch.randn(5, device=N)
    state = torch.neuron.get_rng_state()
    assert state.device.type == "cpu" and state.dtype == torch.uint8
    a = _cpu(torch.randn(32, device=N))
    b = _cpu(torch.randn(32, device=N))
    torch.neuron.set_rng_state(state)
    assert torch.equal(_cpu(torch.randn(32, device=N)), a)
    assert torch.equal(_cpu(torch.randn(32, device=N)), b)


def test_get_rng_state_is_a_snapshot():
    torch.neuron.manual_seed(3)
    state = torch.neuron.get_rng_state()
    copy_ = state.clone()
    torch.randn(100, device=N)
    assert torch.equal(state, copy_), "the returned state changed when the generator advanced"
    assert not torch.equal(torch.neuron.get_rng_state(), copy_)


def test_get_set_rng_state_of_a_device_by_index_and_name():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    torch.neuron.manual_seed_all(4)
    s1 = torch.neuron.get_rng_state(1)
    assert torch.equal(s1, torch.neuron.get_rng_state("neuron:1"))
    a = _cpu(torch.rand(8, device="neuron:1"))
    torch.randn(8, device="neuron:0")
    torch.neuron.set_rng_state(s1, "neuron:1")
    assert torch.equal(_cpu(torch.rand(8, device="neuron:1")), a)


def test_get_set_rng_state_all():
    torch.neuron.manual_seed_all(9)
    states = torch.neuron.get_rng_state_all()
    assert len(states) == torch.neuron.device_count()
    devices = [f"neuron:{i}" for i in range(min(2, torch.neuron.device_count()))]
    first = [_cpu(torch.randn(8, device=d)) for d in devices]
    torch.neuron.manual_seed_all(1000)
    torch.neuron.set_rng_state_all(states)
    assert all(torch.equal(_cpu(torch.randn(8, device=d)), f) for d, f in zip(devices, first))


def test_set_rng_state_rejects_garbage():
    good = torch.neuron.get_rng_state()
    with pytest.raises(RuntimeError):
        torch.neuron.set_rng_state(torch.zeros(3, dtype=torch.uint8))
    assert torch.equal(torch.neuron.get_rng_state(), good)


def test_fork_rng_restores_neuron_state():
    torch.neuron.manual_seed(1)
    with torch.random.fork_rng(device_type="neuron"):
        inside = _cpu(torch.randn(8, device=N))
    outside = _cpu(torch.randn(8, device=N))
    assert torch.equal(inside, outside)


# ---- generator objects -----------------------------------------------------


def test_generator_object_is_a_neuron_generator():
    g = torch.Generator(device=N)
    assert g.device == torch.device("neuron", torch.neuron.current_device())
    assert g.manual_seed(77) is g
    assert g.initial_seed() == 77
    assert torch.neuron.default_generators[0].device == torch.device("neuron", 0)


def test_generator_seeded_like_default_gives_same_stream():
    torch.neuron.manual_seed(21)
    a = _cpu(torch.randn(32, device=N))
    g = torch.Generator(device=N).manual_seed(21)
    b = _cpu(torch.randn(32, device=N, generator=g))
    assert torch.equal(a, b)


def test_generator_has_its_own_stream():
    torch.neuron.manual_seed(5)
    default_state = torch.neuron.get_rng_state()
    g = torch.Generator(device=N).manual_seed(6)
    a = _cpu(torch.rand(64, device=N, generator=g))
    assert torch.equal(torch.neuron.get_rng_state(), default_state), "drawing from g advanced the default generator"
    cpu_state = torch.get_rng_state()
    g_state = g.get_state()
    torch.rand(64, device=N)                 # default stream moves, g does not
    assert torch.equal(g.get_state(), g_state)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    g2 = torch.Generator(device=N).manual_seed(6)
    assert torch.equal(_cpu(torch.rand(64, device=N, generator=g2)), a)


def test_generator_state_roundtrip():
    g = torch.Generator(device=N).manual_seed(3)
    state = g.get_state()
    a = _cpu(torch.randn(16, device=N, generator=g))
    g.set_state(state)
    assert torch.equal(_cpu(torch.randn(16, device=N, generator=g)), a)


def test_generator_seed_is_random_and_reproducible():
    g = torch.Generator(device=N)
    s = g.seed()
    assert g.initial_seed() == s
    a = _cpu(torch.rand(8, device=N, generator=g))
    g.manual_seed(s)
    assert torch.equal(_cpu(torch.rand(8, device=N, generator=g)), a)


@pytest.mark.parametrize("draw", [
    lambda g: torch.randn(16, device=N, generator=g),
    lambda g: torch.rand(16, device=N, generator=g),
    lambda g: torch.randperm(30, device=N, generator=g),
    lambda g: torch.randint(0, 50, (16,), device=N, generator=g),
    lambda g: torch.empty(16, device=N).normal_(generator=g),
    lambda g: torch.empty(16, device=N).uniform_(generator=g),
    lambda g: torch.bernoulli(torch.full((64,), 0.3, device=N), generator=g),
    lambda g: torch.normal(torch.zeros(16, device=N), torch.ones(16, device=N), generator=g),
    lambda g: torch.multinomial(torch.ones(40, device=N), 10, generator=g),
], ids=["randn", "rand", "randperm", "randint", "normal_", "uniform_", "bernoulli", "normal", "multinomial"])
def test_generator_argument_reproduces(draw):
    g = torch.Generator(device=N)
    torch.neuron.manual_seed(1)
    before = torch.neuron.get_rng_state()
    g.manual_seed(2024)
    a = _cpu(draw(g))
    g.manual_seed(2024)
    b = _cpu(draw(g))
    assert torch.equal(a, b)
    assert torch.equal(torch.neuron.get_rng_state(), before), "an explicit generator drew from the default one"


def test_generator_on_second_device():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    g = torch.Generator(device="neuron:1").manual_seed(12)
    assert g.device == torch.device("neuron", 1)
    a = torch.randn(8, device="neuron:1", generator=g)
    assert a.device == torch.device("neuron", 1)
    g.manual_seed(12)
    assert torch.equal(_cpu(torch.randn(8, device="neuron:1", generator=g)), a.cpu())


def test_generator_deepcopy_and_pickle():
    g = torch.Generator(device=N).manual_seed(10)
    torch.rand(3, device=N, generator=g)
    g2 = copy.deepcopy(g)
    g3 = pickle.loads(pickle.dumps(g))
    ref = _cpu(torch.rand(8, device=N, generator=g))
    assert g2.device.type == "neuron" and g3.device.type == "neuron"
    assert torch.equal(_cpu(torch.rand(8, device=N, generator=g2)), ref)
    assert torch.equal(_cpu(torch.rand(8, device=N, generator=g3)), ref)


def test_cpu_generator_with_neuron_tensor_raises_like_cuda():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match="generator"):
        torch.randn(4, device=N, generator=g)


def test_neuron_generator_with_cpu_tensor_error_names_generator():
    g = torch.Generator(device=N).manual_seed(0)
    with pytest.raises(RuntimeError, match="generator"):
        torch.randn(4, generator=g)


# ---- statistics of the random ops (formula references) ---------------------


def test_randn_rand_statistics():
    torch.neuron.manual_seed(0)
    n = 200_000
    x = _cpu(torch.randn(n, device=N)).double()
    assert abs(x.mean().item()) < 5 / math.sqrt(n)
    assert abs(x.std().item() - 1.0) < 0.01
    u = _cpu(torch.rand(n, device=N)).double()
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)


def test_normal_uniform_inplace_statistics():
    torch.neuron.manual_seed(0)
    n = 200_000
    x = _cpu(torch.empty(n, device=N).normal_(2.0, 3.0)).double()
    assert abs(x.mean().item() - 2.0) < 5 * 3 / math.sqrt(n)
    assert abs(x.std().item() - 3.0) < 0.03
    u = _cpu(torch.empty(n, device=N).uniform_(-2.0, 6.0)).double()
    assert u.min() >= -2.0 and u.max() < 6.0
    assert abs(u.mean().item() - 2.0) < 5 * math.sqrt(64 / 12 / n)


def test_randint_randperm_bernoulli_properties():
    torch.neuron.manual_seed(0)
    r = torch.randint(3, 13, (50_000,), device=N)
    assert r.dtype == torch.int64
    rc = _cpu(r)
    assert rc.min() == 3 and rc.max() == 12
    counts = torch.bincount(rc - 3, minlength=10).double()
    assert (counts / counts.sum() - 0.1).abs().max() < 0.01
    p = torch.randperm(1000, device=N)
    assert p.dtype == torch.int64
    assert torch.equal(_cpu(p).sort().values, torch.arange(1000))
    b = _cpu(torch.bernoulli(torch.full((100_000,), 0.25, device=N)))
    assert set(b.unique().tolist()) <= {0.0, 1.0}
    assert abs(b.mean().item() - 0.25) < 0.01


# ---- dropout ---------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_keep_fraction_and_scale(p):
    torch.neuron.manual_seed(0)
    n = 100_000
    x = torch.rand(n) + 0.5                       # nonzero, so a zero output means dropped
    y = _cpu(F.dropout(x.to(N), p=p, training=True))
    mask = y != 0
    keep = mask.double().mean().item()
    assert abs(keep - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    torch.testing.assert_close(y, x * mask / (1 - p))


def test_dropout_bfloat16_matches_mask_times_scale():
    torch.neuron.manual_seed(0)
    x = torch.rand(4096).add_(0.5).bfloat16()
    y = F.dropout(x.to(N), p=0.25, training=True)
    assert y.dtype == torch.bfloat16
    yc = _cpu(y)
    mask = yc != 0
    torch.testing.assert_close(yc, (x.float() * mask / 0.75).bfloat16())


def test_native_dropout_mask_matches_output():
    torch.neuron.manual_seed(0)
    x = torch.randn(64, 33) + 10.0
    out, mask = torch.native_dropout(x.to(N), 0.4, True)
    assert out.device.type == "neuron" and mask.device.type == "neuron"
    assert mask.dtype == torch.bool and mask.shape == x.shape
    torch.testing.assert_close(_cpu(out), x * _cpu(mask) / 0.6)


def test_dropout_on_noncontiguous_input():
    torch.neuron.manual_seed(0)
    x = torch.rand(64, 48) + 0.5
    xt = x.to(N).t()
    y = _cpu(F.dropout(xt, p=0.5, training=True))
    assert y.shape == (48, 64)
    torch.testing.assert_close(y, x.t() * (y != 0) / 0.5)


@pytest.mark.parametrize("p", [0.2, 0.6])
def test_nn_dropout_backward_is_mask_times_scale(p):
    torch.neuron.manual_seed(0)
    x0 = torch.rand(200, 50) + 0.5
    x = x0.to(N).requires_grad_()
    layer = nn.Dropout(p).train()
    y = layer(x)
    g = torch.randn(200, 50)
    y.backward(g.to(N))
    yc = _cpu(y.detach())
    mask = (yc != 0).float()
    scale = 1.0 / (1 - p)
    torch.testing.assert_close(yc, x0 * mask * scale)
    assert x.grad.device.type == "neuron"
    torch.testing.assert_close(_cpu(x.grad), g * mask * scale)


def test_dropout_eval_mode_and_training_false_are_identity():
    x = torch.randn(100, device=N)
    assert torch.equal(_cpu(nn.Dropout(0.5).eval()(x)), x.cpu())
    assert torch.equal(_cpu(F.dropout(x, 0.5, training=False)), x.cpu())
    out, mask = torch.native_dropout(x, 0.5, False)
    assert torch.equal(_cpu(out), x.cpu()) and bool(_cpu(mask).all())


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_edge_probabilities_match_cpu(p):
    x = torch.randn(1000)
    torch.testing.assert_close(_cpu(F.dropout(x.to(N), p=p, training=True)), F.dropout(x, p=p, training=True))


def test_dropout_reproducible_and_independent_of_cpu():
    x = torch.ones(4096, device=N)
    torch.neuron.manual_seed(17)
    _seed_cpu_only(0)
    a = _cpu(F.dropout(x, 0.5))
    torch.neuron.manual_seed(17)
    _seed_cpu_only(99)
    torch.rand(500)
    b = _cpu(F.dropout(x, 0.5))
    assert torch.equal(a, b)


def test_dropout_on_second_device_uses_that_devices_generator():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    x = torch.ones(2048, device="neuron:1")
    torch.neuron.manual_seed_all(3)
    a = F.dropout(x, 0.5)
    assert a.device == torch.device("neuron", 1)
    torch.neuron.manual_seed_all(3)
    torch.neuron.manual_seed(100)             # re-seeds device 0 only
    b = F.dropout(x, 0.5)
    assert torch.equal(a.cpu(), b.cpu())
