"""Casts folded into matrix products: autocast's float32 gradients of bf16 products stored widened."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn


def _grads(model: nn.Module, x: torch.Tensor, compiled: bool, autocast: bool = True) -> list[torch.Tensor]:
    """The loss and every parameter's gradient of a copy of ``model`` on neuron, eager or compiled."""
    m = copy.deepcopy(model).to("neuron")
    run = torch.compile(m, backend="neuron") if compiled else m
    with torch.autocast("neuron", torch.bfloat16, enabled=autocast):
        loss = run(x.to("neuron")).float().square().mean()
    loss.backward()
    return [loss.detach().cpu()] + [p.grad.cpu() for p in m.parameters()]


@pytest.mark.parametrize("bias", [False, True])
def test_widened_weight_gradients_equal_eager_bit_for_bit(bias, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path / "dump"))
    torch.manual_seed(0)
    # 600 outputs: a bias row wider than the kernel fuses (its own pass, then the cast folded into it)
    model = nn.Sequential(nn.Linear(200, 300, bias=bias), nn.GELU(), nn.Linear(300, 600, bias=bias))
    x = torch.randn(64, 200)
    eager, compiled = _grads(model, x, False), _grads(model, x, True)
    for e, c in zip(eager, compiled):
        assert c.dtype == e.dtype == torch.float32
        assert torch.equal(c, e)   # the same roundings: the product to bf16, then exactly to float32
    backward = next(p for p in (tmp_path / "dump").iterdir() if p.name.endswith("_backward"))
    widened = [ln for ln in (backward / "fusion.txt").read_text().splitlines() if "widened:" in ln]
    assert len(widened) >= 2, "both weight gradients' casts should fold into their products"


def test_a_product_read_elsewhere_is_not_widened(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path / "dump"))
    torch.manual_seed(0)

    def f(a, b):
        p = a @ b                    # read in bf16 by the add and widened by the cast: stored once, as bf16
        return p.float(), p + 1
    a, b = torch.randn(64, 96).bfloat16(), torch.randn(96, 80).bfloat16()
    got = torch.compile(f, backend="neuron")(a.to("neuron"), b.to("neuron"))
    eager = f(a.to("neuron"), b.to("neuron"))
    for e, g in zip(eager, got):
        assert g.dtype == e.dtype and torch.equal(g.cpu(), e.cpu())
    text = "".join((d / "fusion.txt").read_text() for d in (tmp_path / "dump").iterdir())
    assert "widened:" not in text


class _Block(nn.Module):
    """Residual adds after two products and a GELU between two more: each add, GELU, and GELU's backward can
    be the epilogue of the product it reads."""

    def __init__(self, d: int = 96, bias: bool = True) -> None:
        super().__init__()
        self.proj, self.fc, self.out = nn.Linear(d, d, bias=bias), nn.Linear(d, 4 * d, bias=bias), nn.Linear(4 * d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(x)
        return x + self.out(nn.functional.gelu(self.fc(x)))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_epilogues_equal_eager_bit_for_bit(bias, autocast, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path / "dump"))
    torch.manual_seed(0)
    model, x = _Block(bias=bias), torch.randn(2, 70, 96)
    for e, c in zip(_grads(model, x, False, autocast), _grads(model, x, True, autocast)):
        assert torch.equal(c, e)   # the product rounded as stored, then the group's math, rounded once
    fusion = {d.name.split("_")[1]: (d / "fusion.txt").read_text() for d in (tmp_path / "dump").iterdir()}
    assert fusion["forward"].count("with epilogue [add") >= 1   # (under autocast the first add also feeds a cast)
    assert "with epilogue [gelu_backward" in fusion["backward"]
    # GELU's input is saved for the backward: its product stores it beside the activation (no pass reading it)
    assert "with epilogue [gelu=gelu.default] -> gelu (product kept)" in fusion["forward"]
    assert "runs as eager ops" not in "".join(fusion.values())


def test_a_product_two_groups_read_keeps_its_own_store(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path / "dump"))

    def f(a, b, c):
        p = a @ b
        return p + c, (p * 2).sum(0)
    torch.manual_seed(0)
    a, b, c = torch.randn(64, 96), torch.randn(96, 80), torch.randn(64, 80)
    args = [t.to("neuron") for t in (a, b, c)]
    for e, g in zip(f(*args), torch.compile(f, backend="neuron")(*args)):
        assert torch.equal(g.cpu(), e.cpu())
    text = "".join((d / "fusion.txt").read_text() for d in (tmp_path / "dump").iterdir())
    assert "epilogue" not in text


class _TiedLM(nn.Module):
    """Token embedding tied to the output projection: the weight's gradient is the embedding backward's product
    plus the projection's; the sum is the epilogue of the product computed last (the embedding backward)."""

    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(vocab, d), nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids)))


def test_tied_weights_gradient_sum_is_the_embedding_backwards_epilogue(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path / "dump"))
    torch.manual_seed(0)
    model, ids = _TiedLM(), torch.randint(0, 50, (4, 24))
    for e, c in zip(_grads(model, ids, False, autocast=False), _grads(model, ids, True, autocast=False)):
        assert torch.equal(c, e)   # the same fp32 product, then the same one add
    backward = next(d for d in (tmp_path / "dump").iterdir() if d.name.endswith("_backward"))
    text = (backward / "fusion.txt").read_text()
    assert "embedding_dense_backward.default with epilogue [add" in text
