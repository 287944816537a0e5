"""Hugging Face models on neuron with no vendor code: forward, backward and greedy generate() against the CPU.

GPT-2, Llama (grouped-query heads), BERT, T5, ViT and Whisper are built from small configs with random
weights (nothing is downloaded; ``hf_checks.py`` beside this script builds them), copied to neuron, and
run on both devices from the same inputs: logits and every parameter's gradient must match the CPU
within the float32 bound of the model's depth, and greedy generate() must produce the same tokens
(BERT and ViT: the same predicted tokens and classes). Prints one line per model and exits 1 on any
mismatch. ``tests/test_huggingface.py`` asserts the same comparisons.

    python examples/huggingface_models.py [gpt2 llama bert t5 vit whisper]

It then fine-tunes GPT-2 with ``transformers.Trainer`` for 8 steps on each device and compares the
logged losses. Trainer picks its device through accelerate; the one line that selects neuron is the
environment variable accelerate reads for a device it does not know by name:

    ACCELERATE_TORCH_DEVICE=neuron python train.py     # or os.environ[...] = "neuron" before Trainer
"""
from __future__ import annotations

import argparse
import sys

import torch
import transformers as hf

from hf_checks import MODELS, compare, trainer_losses_on


def check(name: str) -> tuple[bool, str]:
    """Run one model on the CPU and on neuron; (matched, a line describing the comparison)."""
    c = compare(name)
    text = (f"{name:<8} logits {c.logits_error:.2e}, gradients {c.gradient_error:.2e} of the largest "
            f"(fp32 bounds {c.forward_bound:.1e}, {c.backward_bound:.1e})")
    same = "equal" if c.decisions_equal() else "DIFFERENT"
    if MODELS[name].generates:
        text += f", generate {same} ({c.cpu_tokens.shape[1]} tokens)"
    else:
        text += f", predictions {same}"
    fallbacks = sum(c.fallbacks.values()) + sum(c.generate_fallbacks.values())
    text += f", {fallbacks} CPU fallbacks, {c.seconds:.1f} s"
    return c.ok(), text


def check_trainer() -> tuple[bool, str]:
    """Trainer on the CPU and on neuron, each in its own process (accelerate fixes the device per process)."""
    cpu, dev = trainer_losses_on("cpu"), trainer_losses_on("neuron")
    worst = max(abs(a - b) / abs(b) for a, b in zip(dev, cpu))
    ok = len(dev) == len(cpu) > 0 and worst < 1e-4
    return ok, (f"trainer  GPT-2 fine-tuned {len(dev)} steps on neuron, losses {dev[0]:.4f} -> {dev[-1]:.4f}, "
                f"largest relative deviation from the CPU run {worst:.1e}")


def main() -> int:
    """Check the models named on the command line (default: all); exit status 1 if any differs from the CPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"any of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--no-trainer", action="store_true", help="skip the Trainer fine-tuning comparison")
    args = parser.parse_args()
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
