"""Compiled training and inference against the CPU: a GPT-style transformer (fp32 and bf16 autocast), a CNN
with BatchNorm (its running statistics are input mutations), an LSTM (traced with Dynamo's ``allow_rnn``), a
compiled optimizer step, and ``no_grad`` inference. 20 training steps each; losses within 1e-4 relative of the CPU in fp32 (the
transformers match eager to ~1e-7; the CPU's own 1-vs-2-thread runs differ by ~1e-5 over such runs) and
2e-2 under bf16 autocast (bf16's 2**-8 relative rounding, accumulated over the steps).
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchneuron
from torchneuron.compiler import reports

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_native_training import SeqModel, TinyGPT  # noqa: E402
from test_training import SmallCNN  # noqa: E402

STEPS = 20


def _gpt_batch(gen):
    idx = torch.randint(0, 40, (4, 17), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _gpt_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def _cnn_batch(gen):
    return torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def _lstm_batch(gen):
    return torch.randn(4, 9, 6, generator=gen), torch.randn(4, 3, generator=gen)


CASES = {
    "gpt": (TinyGPT, _gpt_batch, _gpt_loss),
    "cnn": (SmallCNN, _cnn_batch, F.cross_entropy),
    "lstm": (SeqModel, _lstm_batch, F.mse_loss),
}


def _train(case: str, device: str, compiled: bool, autocast: bool = False, compile_step: bool = False):
    # Dynamo traces into ``nn.LSTM`` only with ``allow_rnn`` (off by default: the module then runs eagerly)
    with torch._dynamo.config.patch(allow_rnn=case == "lstm"):
        return _train_steps(case, device, compiled, autocast, compile_step)


def _train_steps(case: str, device: str, compiled: bool, autocast: bool, compile_step: bool):
    build, batch, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = build().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    fwd = torch.compile(model, backend="neuron") if compiled else model
    step = torch.compile(opt.step, backend="neuron") if compile_step else opt.step
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = batch(gen)
        x, y = x.to(device), y.to(device)
        ctx = torch.autocast(device, torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(fwd(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        step()
        losses.append(loss.item())
    return losses, model


def _assert_curves_close(got: list, want: list, rtol: float) -> None:
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
    assert worst <= rtol, f"largest relative loss deviation {worst:.2e} > {rtol:.0e}\n{got}\n{want}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_training_matches_cpu(case):
    torchneuron.reset_fallback_counts()
    before = {id(r) for r in reports()}
    got, model = _train(case, "neuron", compiled=True)
    compiled = any(r.segments for r in reports() if id(r) not in before)   # this test's graphs only
    want, ref = _train(case, "cpu", compiled=False)
    _assert_curves_close(got, want, 1e-4)
    assert compiled, "nothing was compiled"
    assert torchneuron.fallback_counts() == {}
    for (name, b), (_, b_ref) in zip(model.named_buffers(), ref.named_buffers()):  # BatchNorm running stats
        torch.testing.assert_close(b.cpu(), b_ref, rtol=1e-4, atol=1e-5, msg=name)


def test_lstm_without_allow_rnn_trains_eagerly():
    """Dynamo's default leaves ``nn.LSTM`` out of the graph (as with any backend): the model trains as eager ops."""
    torch.manual_seed(0)
    model = torch.nn.LSTM(6, 8, batch_first=True)
    x = torch.randn(2, 5, 6)
    dev = torch.nn.LSTM(6, 8, batch_first=True)
    dev.load_state_dict(model.state_dict())
    dev = dev.to("neuron")
    before = {id(r) for r in reports()}
    torch._dynamo.reset()
    got, _ = torch.compile(dev, backend="neuron")(x.to("neuron"))
    assert not any(r.segments for r in reports() if id(r) not in before)
    # outputs in (-1, 1); each step's gates sum 6 + 8 products and two biases (2**-23 per term, both sides),
    # compounding over the 5 steps
    torch.testing.assert_close(got.cpu(), model(x)[0], rtol=0, atol=5 * 16 * 2**-23)


def test_compiled_gpt_under_bf16_autocast_matches_cpu():
    got, _ = _train("gpt", "neuron", compiled=True, autocast=True)
    want, _ = _train("gpt", "cpu", compiled=False, autocast=True)
    _assert_curves_close(got, want, 2e-2)


def test_compiled_optimizer_step_matches_cpu():
    got, model = _train("gpt", "neuron", compiled=True, compile_step=True)
    want, ref = _train("gpt", "cpu", compiled=False)
    # (losses, not parameters: the k bias's gradient is zero up to rounding, and Adam scales that noise to lr)
    _assert_curves_close(got, want, 1e-4)


def test_no_grad_inference_and_eval_batchnorm():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(4, 3, 16, 16)
    dev = SmallCNN().eval()
    dev.load_state_dict(model.state_dict())
    dev = dev.to("neuron")
    with torch.no_grad():
        got = torch.compile(dev, backend="neuron")(x.to("neuron"))
    assert any(r.name.endswith("inference") for r in reports())
    torch.testing.assert_close(got.cpu(), model(x), rtol=1e-4, atol=1e-5)
