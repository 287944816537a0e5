"""Training on ``neuron`` matches training on the CPU.

A small CNN (conv, batch norm, ReLU, max-pool, linear) and a small transformer
(``nn.TransformerEncoderLayer`` under token and position embeddings) are trained 20 steps
with AdamW on ``neuron`` and on the CPU from one seed and the same batches. The losses
must agree at every step and the final parameters, buffers and optimizer states must be
close. Module conversion and optimizer state placement follow the CUDA contract.
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchneuron  # noqa: F401  (registers the device even with autoload off)

NEURON = torch.device("neuron")
STEPS = 20
LOSS_RTOL = 1e-6
LR = 1e-2
# Adam divides by sqrt(v): where a gradient is tiny, an ulp of difference in it can move
# a parameter by a visible fraction of the learning rate, so parameters get a looser
# bound (measured: up to 6e-6 for the transformer; the CNN comes out bit-identical).
PARAM_RTOL, PARAM_ATOL = 1e-4, 5e-3 * LR

Batch = tuple[torch.Tensor, torch.Tensor]


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")
        yield


class SmallCNN(nn.Module):
    """Two conv / batch-norm / ReLU / max-pool stages and a linear classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            # No conv bias: batch norm cancels it, so its gradient would be rounding noise.
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class TinyTransformerLM(nn.Module):
    """Token + position embeddings, two causal pre-norm encoder layers, tied LM head."""

    def __init__(self, vocab: int = 32, d_model: int = 32, context: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.1)  # unit-variance embeddings would make huge tied logits
        nn.init.normal_(self.pos.weight, std=0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        return self.head(self.norm(self.encoder(x, mask=mask, is_causal=True)))


def cnn_batches(gen: torch.Generator) -> list[Batch]:
    """16x16 RGB images: one fixed random template per class plus noise (drawn on the CPU)."""
    templates = torch.randn(10, 3, 16, 16, generator=gen)
    out = []
    for _ in range(STEPS):
        y = torch.randint(10, (16,), generator=gen)
        out.append((templates[y] + torch.randn(16, 3, 16, 16, generator=gen), y))
    return out


def lm_batches(gen: torch.Generator) -> list[Batch]:
    """Arithmetic progressions mod 32 (random start and stride); the target is the next token."""
    out = []
    for _ in range(STEPS):
        start = torch.randint(32, (8, 1), generator=gen)
        stride = torch.randint(1, 4, (8, 1), generator=gen)
        seq = (start + stride * torch.arange(17)) % 32
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def comparable(name: str, t: torch.Tensor) -> torch.Tensor:
    """The part of a parameter (or its optimizer state) whose training is not noise.

    Attention's key bias adds the same amount to every score of a query's row, which
    softmax cancels: its gradient is zero up to rounding on either device, and AdamW
    turns that rounding into steps of the learning rate's size. It is left out.
    """
    if name.endswith("self_attn.in_proj_bias"):
        d = t.shape[0] // 3
        return torch.cat([t[:d], t[2 * d:]])
    return t


def cnn_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


CASES = {
    "cnn": (SmallCNN, cnn_batches, cnn_loss),
    "transformer": (TinyTransformerLM, lm_batches, lm_loss),
}


def train(model: nn.Module, batches: list[Batch], loss_fn: Callable[..., torch.Tensor],
          device: torch.device) -> tuple[list[float], torch.optim.Optimizer]:
    """Train ``model`` (already on ``device``) on ``batches``; return losses and optimizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.05)
    model.train()
    losses = []
    for x, y in batches:
        loss = loss_fn(model, x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_matches_cpu(case: str) -> None:
    build, make_batches, loss_fn = CASES[case]
    torch.manual_seed(0)
    model_cpu = build()
    model_neuron = copy.deepcopy(model_cpu)
    batches = make_batches(torch.Generator().manual_seed(1))

    params_before = list(model_neuron.parameters())
    assert model_neuron.to(NEURON) is model_neuron
    params_after = list(model_neuron.parameters())
    assert len(params_after) == len(params_before)
    assert all(a is b for a, b in zip(params_after, params_before)), ".to('neuron') replaced Parameter objects"
    assert all(p.device.type == "neuron" and type(p) is nn.Parameter for p in params_after)
    assert all(b.device.type == "neuron" for b in model_neuron.buffers())
    if case == "transformer":
        assert model_neuron.head.weight is model_neuron.tok.weight, "tied weights came apart"

    losses_neuron, opt_neuron = train(model_neuron, batches, loss_fn, NEURON)
    losses_cpu, opt_cpu = train(model_cpu, batches, loss_fn, torch.device("cpu"))

    for step, (n, c) in enumerate(zip(losses_neuron, losses_cpu), 1):
        assert abs(n - c) <= LOSS_RTOL * abs(c), f"step {step}: neuron loss {n!r} vs cpu loss {c!r}"
    assert losses_cpu[-1] < losses_cpu[0], "the model did not learn; the comparison would be vacuous"

    names = [name for name, _ in model_neuron.named_parameters()]
    for name, pn, pc in zip(names, params_after, model_cpu.parameters()):
        assert pn.device.type == "neuron" and pn.grad.device.type == "neuron", name
        torch.testing.assert_close(comparable(name, pn.detach().cpu()), comparable(name, pc.detach()),
                                   rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"parameter {name}: {m}")
    for (name, bn), bc in zip(model_neuron.named_buffers(), model_cpu.buffers()):
        assert bn.device.type == "neuron", name
        if name.endswith(("running_mean", "running_var")):
            continue  # see test_batchnorm_running_stats_match_cpu
        torch.testing.assert_close(bn.cpu(), bc, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"buffer {name}: {m}")

    # Optimizer state lives with the parameters; like on CUDA, AdamW's (non-capturable)
    # step counter is a CPU scalar tensor.
    for p in params_after:
        state = opt_neuron.state[p]
        assert state["exp_avg"].device.type == "neuron"
        assert state["exp_avg_sq"].device.type == "neuron"
        assert state["step"].item() == STEPS
    for name, pn, pc in zip(names, params_after, model_cpu.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(comparable(name, opt_neuron.state[pn][key].cpu()),
                                       comparable(name, opt_cpu.state[pc][key]), rtol=PARAM_RTOL,
                                       atol=PARAM_ATOL, msg=lambda m, name=name, key=key: f"{key} of {name}: {m}")


def test_batchnorm_running_stats_match_cpu() -> None:
    torch.manual_seed(0)
    bn_cpu = nn.BatchNorm2d(4)
    bn_neuron = copy.deepcopy(bn_cpu).to(NEURON)
    for _ in range(3):
        x = torch.randn(8, 4, 5, 5) * 2 + 1
        torch.testing.assert_close(bn_neuron(x.to(NEURON)).cpu(), bn_cpu(x))
    assert bn_neuron.num_batches_tracked.item() == bn_cpu.num_batches_tracked.item() == 3
    torch.testing.assert_close(bn_neuron.running_mean.cpu(), bn_cpu.running_mean)
    torch.testing.assert_close(bn_neuron.running_var.cpu(), bn_cpu.running_var)
    bn_cpu.eval()
    bn_neuron.eval()
    x = torch.randn(8, 4, 5, 5)
    torch.testing.assert_close(bn_neuron(x.to(NEURON)).cpu(), bn_cpu(x))


def test_backward_of_neuron_ops_runs_on_the_calling_thread() -> None:
    """A Python autograd Function's backward on neuron tensors runs on the thread calling backward(),
    as CPU backward does: autograd's device thread freed Python-owned tensors after backward()
    returned, which aborted a program that ended at that moment."""
    import threading

    seen: list[int] = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> torch.Tensor:
            seen.append(threading.get_ident())
            return g * 2

    x = torch.ones(4, device=NEURON, requires_grad=True)
    Double.apply(Double.apply(x)).sum().backward()
    assert seen == [threading.get_ident()] * 2
    torch.testing.assert_close(x.grad.cpu(), torch.full((4,), 4.0))
