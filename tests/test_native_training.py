"""Training runs natively on the simulated core: a small GPT-style transformer and an LSTM
sequence model train 20 steps on ``neuron`` in strict mode (any CPU fallback is an error) and
their losses follow the CPU's: within 1e-4 relative in fp32, within 2e-2 under
``torch.autocast("neuron", torch.bfloat16)`` (GPT). The CNN's run is in tests/ops/test_cnn.py.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchneuron

STEPS = 20


class TinyGPT(nn.Module):
    """Token and position embeddings, one pre-norm causal attention + GELU MLP block, tied LM head."""

    def __init__(self, vocab: int = 40, block: int = 16, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.ln_f(x))


def _train(device: str, autocast: bool) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        idx = torch.randint(0, 40, (4, 17), generator=gen)
        x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)
        ctx = torch.autocast(device, torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("autocast,rtol", [(False, 1e-4), (True, 2e-2)], ids=["fp32", "bf16-autocast"])
def test_gpt_trains_natively_like_cpu(autocast, rtol):
    cpu = _train("cpu", autocast)
    before = dict(torchneuron.fallback_counts())
    strict = torchneuron.is_strict()
    torchneuron.set_strict(True)
    try:
        dev = _train("neuron", autocast)
    finally:
        torchneuron.set_strict(strict)
    assert torchneuron.fallback_counts() == before            # nothing ran on the CPU
    assert all(math.isfinite(v) for v in dev)
    assert dev[-1] < dev[0]                                   # it learns
    for step, (a, b) in enumerate(zip(dev, cpu)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: neuron {a} vs cpu {b}"


class SeqModel(nn.Module):
    """A two-layer LSTM over a sequence, its last hidden state through a linear head (regression)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def _train_lstm(device: str) -> list[float]:
    torch.manual_seed(0)
    model = SeqModel().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(4, 9, 6, generator=gen), torch.randn(4, 3, generator=gen)
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_lstm_trains_natively_like_cpu():
    cpu = _train_lstm("cpu")
    before = dict(torchneuron.fallback_counts())
    strict = torchneuron.is_strict()
    torchneuron.set_strict(True)
    try:
        dev = _train_lstm("neuron")
    finally:
        torchneuron.set_strict(strict)
    assert torchneuron.fallback_counts() == before
    assert dev[-1] < dev[0]
    for step, (a, b) in enumerate(zip(dev, cpu)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: neuron {a} vs cpu {b}"
