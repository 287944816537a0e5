"""Casts folded into matrix products: autocast's float32 gradients of bf16 products stored widened."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchneuron.compiler import cache, kernel_lowerings, partition


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


def _chains_recorded(monkeypatch, kernel: str) -> list[bool]:
    """Whether each call of the lowerings' ``kernel`` chained a product (``then=``), in call order (the program
    cache off, so every program is traced)."""
    chained = []
    fn = getattr(kernel_lowerings, kernel)
    monkeypatch.setattr(kernel_lowerings, kernel, lambda *a, **k: chained.append(k.get("then") is not None) or fn(*a, **k))
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", "0")
    return chained


@pytest.mark.parametrize("bias", [False, True])
def test_products_of_an_epilogues_result_chain_on_chip(bias, monkeypatch):
    # 256 rows (whole 128-row chunks), fp32: the forward's GELU result goes on into the second linear layer (with
    # its bias and its residual add) and the backward's GELU gradient dH into dH @ W1 in the kernel that computes
    # them, never loaded back; the same instructions per row, so the values equal eager's bit for bit
    torch.manual_seed(0)
    model, x = _Block(bias=bias), torch.randn(2, 128, 96)
    chained = _chains_recorded(monkeypatch, "matmul_kernel")
    for e, c in zip(_grads(model, x, False, autocast=False), _grads(model, x, True, autocast=False)):
        assert torch.equal(c, e)
    assert chained.count(True) == 2   # one chain in the forward, one in the backward


def test_a_chained_product_takes_its_operand_as_it_lies(monkeypatch):
    def f(a, b, c):
        return nn.functional.gelu(a @ b) @ c   # B2 [N, N2] as it is, not a weight's transpose
    torch.manual_seed(0)
    chained = _chains_recorded(monkeypatch, "matmul_kernel")
    args = [t.to("neuron") for t in (torch.randn(128, 64), torch.randn(64, 200), torch.randn(200, 48))]
    assert torch.equal(torch.compile(f, backend="neuron")(*args).cpu(), f(*args).cpu())
    assert chained == [True]


def test_a_layer_norms_output_chains_into_the_next_linear_layer(monkeypatch):
    # 256 rows of 96 (whole [128, G, D] blocks), fp32: the norm's output goes on from SBUF into the linear layer
    # after it (its bias added at the eviction), equal to eager bit for bit, gradients too
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.LayerNorm(96), nn.Linear(96, 200)), torch.randn(2, 128, 96)
    chained = _chains_recorded(monkeypatch, "layer_norm_kernel")
    for e, c in zip(_grads(model, x, False, autocast=False), _grads(model, x, True, autocast=False)):
        assert torch.equal(c, e)
    assert chained == [True]


class _ProjectedPreNorm(nn.Module):
    """Two projections, then a pre-norm residual layer: the norm's output feeds a linear layer, and in the backward
    the norm's dx (with the residual gradient added) feeds the second projection's dX product (the first one's
    input needs no gradient)."""

    def __init__(self, d: int = 96) -> None:
        super().__init__()
        self.pre, self.inp, self.norm, self.fc = nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.pre(x))
        return h + self.fc(self.norm(h))


def test_a_layer_norm_backwards_dx_chains_into_the_product_before_it(monkeypatch):
    # 256 rows of 96, fp32: the backward's dx, its residual gradient added by the epilogue, goes on from SBUF into
    # the projection's dX = dx @ W; the forward's norm output into the linear layer after it; equal to eager
    torch.manual_seed(0)
    model, x = _ProjectedPreNorm(), torch.randn(2, 128, 96)
    forward, backward = (_chains_recorded(monkeypatch, k) for k in ("layer_norm_kernel", "layer_norm_bwd_kernel"))
    for e, c in zip(_grads(model, x, False, autocast=False), _grads(model, x, True, autocast=False)):
        assert torch.equal(c, e)
    assert forward == [True] and backward == [True]


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


class _PreNorm(nn.Module):
    """Two pre-norm residual blocks and a final norm: in the backward each residual add of the gradient reads a
    layer norm's dx (the last one sums the two blocks' paths into the input's gradient)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(3))
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, lin in zip(self.norms, self.lins):
            x = x + lin(norm(x))
        return self.norms[2](x)


def _input_grads(model: nn.Module, x: torch.Tensor, device: str, compiled: bool = False) -> list[torch.Tensor]:
    """The loss, the input's gradient and every parameter's gradient of a copy of ``model`` on ``device``."""
    m = copy.deepcopy(model).to(device)
    xd = x.to(device).requires_grad_()
    run = torch.compile(m, backend="neuron") if compiled else m
    weights = torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype, device=device)   # (a plain mean of the final
    loss = (run(xd) * weights).float().sum()                                       # norm's output has no gradient)
    loss.backward()
    return [loss.detach().cpu(), xd.grad.cpu()] + [p.grad.cpu() for p in m.parameters()]


# 32: rows grouped several per partition (and a partial block); 1100: one row per partition
@pytest.mark.parametrize("d", [32, 1100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_gradient_sum_is_the_layer_norm_backwards_epilogue(d, dtype, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, x = _PreNorm(d).to(dtype), torch.randn(3, 140 if d < 128 else 20, d, dtype=dtype)
    with monkeypatch.context() as m:   # the same graph with the adds as passes of their own
        m.setattr(partition, "_FIRST_RESULT_EPILOGUES", ())
        m.setenv("TORCHNEURON_CACHE_DIR", "0")
        unfolded = _input_grads(model, x, "neuron", compiled=True)
    torch._dynamo.reset()
    cache.clear()   # (a program's cache key is its graph's, which the fold does not change)
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path / "dump"))
    compiled = _input_grads(model, x, "neuron", compiled=True)
    for u, c in zip(unfolded, compiled):
        # the same dx, rounded to its dtype as the pass would read it, then the same one add, rounded once
        assert c.dtype == u.dtype and torch.equal(c, u)
    if dtype == torch.float32:   # (bf16: the compiled graph and eager differ without the fold too)
        # (at d = 1100 the linears' bias gradients are a column of their weight gradients' products, summed in
        # another order than the eager reduction: the float64 bound below covers them)
        summed = {2 + i for i, (n, _) in enumerate(model.named_parameters()) if n.startswith("lins") and
                  n.endswith("bias") and d > 512}
        for i, (e, c) in enumerate(zip(_input_grads(model, x, "neuron"), compiled)):
            assert i in summed or torch.equal(c, e)
    # and right: no further from float64 than the CPU in the same dtype (plus a few roundings of the largest value)
    want, cpu = _input_grads(copy.deepcopy(model).double(), x.double(), "cpu"), _input_grads(model, x, "cpu")
    eps = torch.finfo(dtype).eps
    for w, c, got in zip(want, cpu, compiled):
        err, cpu_err = (got.double() - w).abs().max().item(), (c.double() - w).abs().max().item()
        assert err <= 2 * cpu_err + 4 * eps * w.abs().max().item()
    backward = next(p for p in (tmp_path / "dump").iterdir() if p.name.endswith("_backward"))
    folded = (backward / "fusion.txt").read_text().count("native_layer_norm_backward.default with epilogue [add")
    assert folded == 2   # each block's residual add (the final norm's dx is the first add's other operand)


def test_bias_gradient_is_a_column_of_the_weight_gradients_product(monkeypatch):
    # 600 tokens (a contraction past the grouped path's 512): the weight gradient dY^T @ X sums dY over the tokens
    # as one more output column, and no reduction pass reads dY again. The loss weighs the output by g, so dY is
    # g exactly and the bias gradient is g summed over the tokens
    torch.manual_seed(0)
    lin, x, g = nn.Linear(96, 80), torch.randn(600, 96), torch.randn(600, 80)
    reduced = []
    reduce_kernel = kernel_lowerings.reduce_kernel
    monkeypatch.setattr(kernel_lowerings, "reduce_kernel", lambda *a, **k: reduced.append(a) or reduce_kernel(*a, **k))
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", "0")

    def grads(compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        m = copy.deepcopy(lin).to("neuron")
        run = torch.compile(m, backend="neuron") if compiled else m
        (run(x.to("neuron")) * g.to("neuron")).sum().backward()
        return m.weight.grad.cpu(), m.bias.grad.cpu()
    (w_eager, _), (w, b) = grads(False), grads(True)
    assert not reduced
    assert torch.equal(w, w_eager)   # the product's own columns as without the sums
    want = g.double().sum(0)
    bound = g.shape[0] * 2.0 ** -24 * g.double().abs().sum(0)   # a sum of n fp32 terms: n u sum |g|
    assert bool(((b.double() - want).abs() <= bound).all())


def test_loss_backward_carried_through_the_log_softmax_backward(monkeypatch):
    # cross entropy's backward: nll_loss_backward's dx read only by the log-softmax backward goes on through it on
    # chip (no store and reload of dx); the same instructions as the two kernels, so the gradients equal eager's
    torch.manual_seed(0)
    head, x = nn.Linear(32, 65), torch.randn(300, 32)
    target = torch.randint(0, 65, (300,))
    target[::7] = -100
    carried = []
    nll_bwd = kernel_lowerings.nll_bwd_kernel
    monkeypatch.setattr(kernel_lowerings, "nll_bwd_kernel",
                        lambda *a, **k: carried.append(k.get("log_softmax") is not None) or nll_bwd(*a, **k))
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", "0")

    def grads(compiled: bool) -> list[torch.Tensor]:
        m = copy.deepcopy(head).to("neuron")
        run = torch.compile(lambda v, t: nn.functional.cross_entropy(m(v), t), backend="neuron") if compiled else (
            lambda v, t: nn.functional.cross_entropy(m(v), t))
        loss = run(x.to("neuron"), target.to("neuron"))
        loss.backward()
        return [loss.detach().cpu(), m.weight.grad.cpu(), m.bias.grad.cpu()]
    eager, compiled = grads(False), grads(True)
    assert carried == [True]
    for e, c in zip(eager, compiled):
        assert torch.equal(c, e)
