"""Training on ``neuron`` is as precise as training on the CPU, measured against float64.

A ResNet-18-shaped network (BasicBlocks with batch norm, widths 16-128, 32x32 inputs, batch 8)
is the case: deep batch-norm networks amplify rounding, so two fp32 runs of the same training
(even the CPU with 1 and with 2 threads) part ways within steps. Comparing neuron's loss curve
to one CPU run therefore measures that amplification, not neuron's precision. The yardstick here
is computed in each test: the CPU's own deviation from the float64 run of the same computation,
over its run-to-run variants (1 and 2 intra-op threads, whose reduction splits differ).

* Gradients (not chaotic): at points along a float64 AdamW trajectory, each parameter's gradient
  from neuron (fp32, and bf16 autocast) must be within ``FACTOR`` times the CPU's error of the
  float64 gradient. An op less precise than the CPU's (a bf16 rounding, a long sum in fp32 in a
  bad order) is orders of magnitude off; two valid summation orders differ by a small factor.
* Trajectories: AdamW and LBFGS parameters after a few steps, against float64, within
  ``FACTOR`` times the CPU variants' deviation (the early steps, before the deviations saturate).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchneuron  # noqa: F401  (registers the device even with autoload off)

# Summation orders of the same length give errors of the same size up to a small factor (their
# expected sizes are equal, the observed ones scatter about it); a precision defect is >= 100x.
FACTOR = 4.0
# Below one fp32 rounding of the result there is nothing to compare: the CPU can be exact by luck.
FLOOR = torch.finfo(torch.float32).eps
BF16_FLOOR = torch.finfo(torch.bfloat16).eps


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")
        yield


class BasicBlock(nn.Module):
    """ResNet's two 3x3 conv / batch-norm stages with an identity or 1x1-conv shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A 3x3 stem, one BasicBlock per width 16, 32, 64, 128 (stride 2 from the second), pooled linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.blocks = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2),
                                    BasicBlock(64, 128, 2))
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """8 random 32x32 RGB images (fp32 values held in float64, on the CPU) and their labels."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, 32, 32, generator=gen).double(), torch.randint(10, (8,), generator=gen)


def fresh_model(state: dict[str, torch.Tensor] | None = None) -> SmallResNet:
    """The model with seed-0 weights (or ``state``) in float64 on the CPU, the weights fp32 values (so
    the fp32 runs start where the reference does)."""
    torch.manual_seed(0)
    model = SmallResNet()
    if state is not None:
        model.load_state_dict(state)
    return model.double()


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the CPU's intra-op work on ``n`` threads, restoring the count after."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# (name, device, dtype, CPU threads, variant): the reference, the CPU's runs, and neuron. The CPU's fp32
# runs differ only in their summation orders: thread count (reduction splits), the batch given in reverse
# order (the loss is a mean over it, so only the order of each batch sum changes) and channels-last
# layout (other convolution algorithms). The float64 run whose inputs, weights and logits are each off
# by one fp32 rounding (up to eps/2, random sign) is what any fp32 implementation may give
# (each sample's gradient passes many roundings): where the CPU's rounding errors happen to cancel in a
# sum (the head's bias gradient sums softmax gradients p - 1 that cancel), it keeps the yardstick
# honest.
REFERENCE = ("cpu fp64", "cpu", torch.float64, 2, "")
CPU_VARIANTS = [("cpu fp64, inputs off by fp32 rounding", "cpu", torch.float64, 2, "perturbed"),
                ("cpu fp32, 1 thread", "cpu", torch.float32, 1, ""),
                ("cpu fp32, 2 threads", "cpu", torch.float32, 2, ""),
                ("cpu fp32, batch reversed", "cpu", torch.float32, 2, "reversed"),
                ("cpu fp32, channels last", "cpu", torch.float32, 2, "channels_last")]
NEURON = ("neuron fp32", "neuron", torch.float32, 2, "")


def nudge(t: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """``t`` with each element off by a relative error of up to eps/2 (fp32), a random sign (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return t * (1 + (torch.rand(t.shape, generator=gen, dtype=t.dtype) - 0.5) * FLOOR)


def loss_of(run: tuple, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy; for the perturbed run, of logits each off by one fp32 rounding."""
    return F.cross_entropy(nudge(logits, seed=3) if run[4] == "perturbed" else logits, y)


def prepare(run: tuple, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """(model, x, y) on ``run``'s device and dtype, in its variant's batch order and layout."""
    _, device, dtype, _, variant = run
    model = model.to(device, dtype)
    x, y = x.to(device, dtype), y.to(device)
    if variant == "reversed":
        x, y = x.flip(0), y.flip(0)
    if variant == "perturbed":
        x = nudge(x)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(nudge(p))
    if variant == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return model, x, y


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against the reference ``b`` (norms; 0 when both are 0)."""
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale else (a - b).norm().item()


def assert_within_cpu_variation(errors: dict[str, list[float]], names: list[str], floor: float, what: str) -> None:
    """Each of neuron's errors is within FACTOR times the CPU variants' largest (or the floor)."""
    cpu = [max(e[i] for run, e in errors.items() if run != NEURON[0]) for i in range(len(names))]
    bad = [(n, e, c) for n, e, c in zip(names, errors[NEURON[0]], cpu) if e > FACTOR * max(c, floor)]
    assert not bad, f"{what}: neuron's error vs float64 beyond {FACTOR} x the CPU's: " + ", ".join(
        f"{n} {e:.2e} (cpu {c:.2e})" for n, e, c in bad)


def gradients(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, run: tuple,
              autocast: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each parameter's gradient of the loss of ``state`` on (x, y), computed as ``run`` says, in float64."""
    device, nthreads = run[1], run[3]
    model, x, y = prepare(run, fresh_model(state), x, y)
    with threads(nthreads), torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = loss_of(run, model(x), y)
    with threads(nthreads):
        loss.backward()
    return [p.grad.cpu().double() for p in model.parameters()]


def trajectory_points(steps: tuple[int, ...]) -> Iterator[dict[str, torch.Tensor]]:
    """The float64 model's state (rounded to fp32, so every run starts from the same weights) at ``steps``
    of AdamW (lr 1e-3) on one batch."""
    model = fresh_model()
    x, y = batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(max(steps) + 1):
        if step in steps:
            yield {k: v.float().double() if v.is_floating_point() else v for k, v in model.state_dict().items()}
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_resnet_gradients_as_precise_as_cpu(autocast: torch.dtype | None) -> None:
    """Every parameter's gradient, at the start and after 6 AdamW steps, within the CPU's precision."""
    x, y = batch()
    names = [n for n, _ in fresh_model().named_parameters()]
    for step, state in zip((0, 6), trajectory_points((0, 6))):
        exact = gradients(state, x, y, REFERENCE)
        errors = {run[0]: [rel(g, e) for g, e in zip(gradients(state, x, y, run, autocast), exact)]
                  for run in (*CPU_VARIANTS, NEURON)}
        floor = FLOOR if autocast is None else BF16_FLOOR
        assert_within_cpu_variation(errors, names, floor, f"gradients at step {step} ({autocast or 'fp32'})")
        if autocast is not None:   # the stem's weight gradient sums 8192 bf16 products per element
            i = names.index("stem.weight")
            assert errors[NEURON[0]][i] <= FACTOR * max(max(errors[v[0]][i] for v in CPU_VARIANTS), BF16_FLOOR)


def train(run: tuple, make_opt: Callable, closure_steps: int, model_fn: Callable[[], nn.Module],
          data: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """How far each parameter moved (float64, on the CPU) in ``closure_steps`` optimizer steps taken as ``run``
    says (the move, not the parameter: its rounding would hide the move's error)."""
    model, x, y = prepare(run, model_fn(), *data)
    start = [p.detach().cpu().double().clone() for p in model.parameters()]
    opt = make_opt(model.parameters())

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(run, model(x), y)
        loss.backward()
        return loss

    with threads(run[3]):
        for _ in range(closure_steps):
            opt.step(closure)
    return [p.detach().cpu().double() - p0 for p, p0 in zip(model.parameters(), start)]


@pytest.mark.parametrize("optimizer", ["adamw", "lbfgs", "lbfgs-strong-wolfe"])
def test_resnet_training_as_precise_as_cpu(optimizer: str) -> None:
    """Parameters after AdamW (5 steps, lr 1e-3) or LBFGS (2 steps of up to 5 iterations) within the CPU's
    own deviation from float64."""
    make_opt, steps = {
        "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3), 5),
        "lbfgs": (lambda ps: torch.optim.LBFGS(ps, lr=1, max_iter=5), 2),
        "lbfgs-strong-wolfe": (lambda ps: torch.optim.LBFGS(ps, lr=1, max_iter=5, line_search_fn="strong_wolfe"), 2),
    }[optimizer]
    data = batch()
    exact = train(REFERENCE, make_opt, steps, fresh_model, data)
    # LBFGS views each gradient flat: it needs contiguous parameters, so no channels-last run there
    runs = [run for run in CPU_VARIANTS if optimizer == "adamw" or run[4] != "channels_last"]
    errors = {run[0]: [rel(p, e) for p, e in zip(train(run, make_opt, steps, fresh_model, data), exact)]
              for run in (*runs, NEURON)}
    names = [n for n, _ in fresh_model().named_parameters()]
    assert_within_cpu_variation(errors, names, FLOOR, f"parameters after {steps} {optimizer} steps")
