"""Hugging Face models built from configs (nothing downloaded) trained under ``torch.compile(backend="neuron")``
against the CPU: GPT-2, Llama and BERT, 20 AdamW steps, losses within 1e-4 relative in fp32 and 2e-2 under
bf16 autocast (bf16's 2**-8 rounding, accumulated over the steps). Dropout is off: the device draws its own
random numbers, so dropout masks could not match the CPU's.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

STEPS = 20
VOCAB = 128


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **small))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, **small))
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small))


def _train(name: str, device: str, compiled: bool, autocast: bool) -> list[float]:
    model = _model(name).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = torch.compile(model, backend="neuron") if compiled else model
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen).to(device)
        ctx = torch.autocast(device, torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = run(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name,autocast,rtol", [("gpt2", False, 1e-4), ("llama", False, 1e-4), ("bert", False, 1e-4),
                                                ("llama", True, 2e-2)])
def test_hf_model_trains_compiled_like_cpu(name, autocast, rtol):
    got = _train(name, "neuron", True, autocast)
    want = _train(name, "cpu", False, autocast)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst <= rtol, f"{name}: largest relative loss deviation {worst:.2e}\n{got}\n{want}"
