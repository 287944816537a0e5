"""Hugging Face models on neuron with no vendor code: forward, backward and greedy generate() against the CPU.

GPT-2, Llama (grouped-query heads), BERT, T5, ViT and Whisper are built from small configs with random
weights (nothing is downloaded), copied to neuron, and run on both devices from the same inputs:
logits and every parameter's gradient must match the CPU within a float32 tolerance, and greedy
generate() must produce the same tokens. Prints one line per model and exits 1 on any mismatch.

    python examples/huggingface_models.py [gpt2 llama bert t5 vit whisper]

It then fine-tunes GPT-2 with ``transformers.Trainer`` for 8 steps on each device and compares the
logged losses. Trainer picks its device through accelerate; the one line that selects neuron is the
environment variable accelerate reads for a device it does not know by name:

    ACCELERATE_TORCH_DEVICE=neuron python train.py     # or os.environ[...] = "neuron" before Trainer
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import transformers as hf

import torchneuron

RTOL, ATOL = 1e-4, 1e-5


def _tokens(n: int = 7) -> torch.Tensor:
    return torch.randint(3, 128, (2, n))


def _decoder_start() -> torch.Tensor:
    return torch.zeros(2, 3, dtype=torch.long)


# name -> (model from a small config, its inputs with labels, whether it generates)
MODELS: dict[str, Callable[[], tuple[Any, dict, bool]]] = {
    "gpt2": lambda: (hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                                                      n_head=4)), {"input_ids": _tokens()}, True),
    "llama": lambda: (hf.LlamaForCausalLM(hf.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)), {"input_ids": _tokens()}, True),
    "bert": lambda: (hf.BertForMaskedLM(hf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=4, intermediate_size=64)),
                     {"input_ids": _tokens()}, False),
    "t5": lambda: (hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1)), {"input_ids": _tokens(), "decoder_input_ids": _decoder_start()}, True),
    "vit": lambda: (hf.ViTForImageClassification(hf.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5)), {"pixel_values": torch.randn(2, 3, 32, 32)}, False),
    "whisper": lambda: (hf.WhisperForConditionalGeneration(hf.WhisperConfig(
        vocab_size=128, num_mel_bins=16, encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=32,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1)),
                        {"input_features": torch.randn(2, 16, 64), "decoder_input_ids": _decoder_start()}, True),
}


def _loss(model: Any, inputs: dict) -> torch.Tensor:
    """A scalar that reaches every logit: the logits' squared mean (labels differ per architecture)."""
    return model(**inputs).logits.float().square().mean()


def check(name: str) -> tuple[bool, str]:
    """Run one model on the CPU and on neuron; (matched, a line describing the comparison)."""
    torch.manual_seed(0)
    cpu_model, inputs, generates = MODELS[name]()
    cpu_model.eval()
    model = copy.deepcopy(cpu_model).to("neuron")
    on_device = {k: v.to("neuron") for k, v in inputs.items()}
    before = sum(torchneuron.fallback_counts().values())
    start = time.perf_counter()

    ref, out = cpu_model(**inputs).logits, model(**on_device).logits.cpu()
    logits_ok = torch.allclose(out, ref, rtol=RTOL, atol=ATOL)
    _loss(cpu_model, inputs).backward()
    _loss(model, on_device).backward()
    # relative to the largest gradient of the model: some gradients are zero in exact arithmetic (an
    # attention key's bias) and both devices leave only rounding noise there
    pairs = [(p.grad.cpu(), q.grad) for p, q in zip(model.parameters(), cpu_model.parameters()) if q.grad is not None]
    scale = max(g.abs().max().item() for _, g in pairs)
    grad_err = max((a - b).abs().max().item() for a, b in pairs) / scale
    grads_ok = grad_err < 1e-4
    text = (f"{name:<8} logits max diff {(out - ref).abs().max().item():.2e}, gradients max diff "
            f"{grad_err:.2e} of the largest")
    same = True
    if generates:
        gen_inputs = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
        with torch.no_grad():
            expected = cpu_model.generate(**gen_inputs, max_new_tokens=6, do_sample=False)
            got = model.generate(**{k: v.to("neuron") for k, v in gen_inputs.items()}, max_new_tokens=6,
                                 do_sample=False).cpu()
        same = torch.equal(got, expected)
        text += f", generate {'equal' if same else 'DIFFERENT'} ({got.shape[1]} tokens)"
    fallbacks = sum(torchneuron.fallback_counts().values()) - before
    text += f", {fallbacks} CPU fallbacks, {time.perf_counter() - start:.1f} s"
    return logits_ok and grads_ok and same, text


def trainer_losses() -> list[float]:
    """The losses of 8 Trainer steps fine-tuning a small GPT-2 (dropout off, so both devices draw nothing)."""
    torch.manual_seed(0)
    model = hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (32, 16))]
    args = hf.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_train_epochs=1,
                                logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-3,
                                disable_tqdm=True)
    trainer = hf.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert next(model.parameters()).device.type == args.device.type
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def check_trainer() -> tuple[bool, str]:
    """Trainer on the CPU and on neuron, each in its own process (accelerate fixes the device per process)."""
    losses = {}
    for device in ("cpu", "neuron"):
        env = {**os.environ, "ACCELERATE_TORCH_DEVICE": device}
        out = subprocess.run([sys.executable, __file__, "--trainer-losses"], env=env, capture_output=True,
                             text=True, check=True)
        losses[device] = json.loads(out.stdout.strip().splitlines()[-1])
    cpu, dev = losses["cpu"], losses["neuron"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(dev, cpu))
    ok = len(dev) == len(cpu) > 0 and worst < 1e-4
    return ok, (f"trainer  GPT-2 fine-tuned {len(dev)} steps on neuron, losses {dev[0]:.4f} -> {dev[-1]:.4f}, "
                f"largest relative deviation from the CPU run {worst:.1e}")


def main() -> int:
    """Check the models named on the command line (default: all); exit status 1 if any differs from the CPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"any of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--no-trainer", action="store_true", help="skip the Trainer fine-tuning comparison")
    parser.add_argument("--trainer-losses", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer_losses:  # one Trainer run on ACCELERATE_TORCH_DEVICE's device; its losses as JSON
        print(json.dumps(trainer_losses()))
        return 0
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}: choose from {', '.join(MODELS)}")
    print(f"transformers {hf.__version__} on {torch.neuron.get_device_name()}")
    failed = []
    for name in args.models or list(MODELS):
        ok, text = check(name)
        print(("ok    " if ok else "FAIL  ") + text, flush=True)
        if not ok:
            failed.append(name)
    if not args.no_trainer:
        ok, text = check_trainer()
        print(("ok    " if ok else "FAIL  ") + text, flush=True)
        if not ok:
            failed.append("trainer")
    if failed:
        print(f"differs from the CPU: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
