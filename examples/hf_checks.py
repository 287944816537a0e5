"""Hugging Face models built from small configs, run on the CPU and on neuron and compared.

Shared by ``examples/huggingface_models.py`` (prints the comparison) and ``tests/test_huggingface.py``
(asserts it): each model is built one way, here. Nothing is downloaded; weights are random.

Run as a script with ``--trainer-losses`` it fine-tunes a small GPT-2 with ``transformers.Trainer`` on
the device accelerate picks (``ACCELERATE_TORCH_DEVICE``) and prints the logged losses as JSON; accelerate
fixes its device once per process, so each device's run is its own process (``trainer_losses_on``).
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import transformers as hf
from transformers.pytorch_utils import Conv1D

import torchneuron

VOCAB = 128
NEW_TOKENS = 6
TRAINER_STEPS = 8
# Rounding steps one attention or MLP sub-layer adds on its path: the norm, the input product(s),
# the scores or the activation, the softmax, the output product and the residual add.
ROUNDINGS_PER_SUBLAYER = 6
# Embedding sums, the final norm, the head and the loss's reduction.
ROUNDINGS_OUTSIDE = 4


def _tokens(n: int = 7) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, n))


def _decoder_start() -> torch.Tensor:
    return torch.zeros(2, 3, dtype=torch.long)


@dataclass(frozen=True)
class Spec:
    """How to build one model and its inputs, and the depth its tolerance follows from."""

    build: Callable[[], Any]         # the model, from a small config with random weights
    inputs: Callable[[], dict]       # its inputs (drawn after the model, from the same seed)
    sublayers: int                   # attention and MLP sub-layers on the longest forward path
    generates: bool                  # greedy generate() applies (else: compare the predicted classes)


def _gpt2(**config: Any) -> Any:
    return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                            **config))


def _llama() -> Any:
    return hf.LlamaForCausalLM(hf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _bert() -> Any:
    return hf.BertForMaskedLM(hf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=64))


def _t5() -> Any:
    return hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1))


def _vit() -> Any:
    return hf.ViTForImageClassification(hf.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5))


def _whisper() -> Any:
    return hf.WhisperForConditionalGeneration(hf.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=32,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1))


# An encoder-decoder's longest path runs through the encoder (2 sub-layers a layer) and then the
# decoder (self-attention, cross-attention and MLP: 3 a layer); a convolutional stem (ViT's patches,
# Whisper's two convolutions) counts as one.
MODELS: dict[str, Spec] = {
    "gpt2": Spec(_gpt2, lambda: {"input_ids": _tokens()}, 2 * 2, True),
    "llama": Spec(_llama, lambda: {"input_ids": _tokens()}, 2 * 2, True),
    "bert": Spec(_bert, lambda: {"input_ids": _tokens()}, 2 * 2, False),
    "t5": Spec(_t5, lambda: {"input_ids": _tokens(), "decoder_input_ids": _decoder_start()}, 2 * 2 + 2 * 3, True),
    "vit": Spec(_vit, lambda: {"pixel_values": torch.randn(2, 3, 32, 32)}, 2 * 2 + 1, False),
    "whisper": Spec(_whisper, lambda: {"input_features": torch.randn(2, 16, 64),
                                       "decoder_input_ids": _decoder_start()}, 1 + 1 * 2 + 1 * 3, True),
}


def longest_reduction(model: torch.nn.Module, inputs: dict) -> int:
    """The longest sum in the model's products: a weight's fan-in, fan-out or positions (for its gradient)."""
    longest = [0]

    def record(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        w = module.weight
        fan_in, fan_out = (w.shape[0], w.shape[1]) if isinstance(module, Conv1D) else (w[0].numel(), w.shape[0])
        longest[0] = max(longest[0], fan_in, fan_out, out.numel() // fan_out)

    # attention's sums (over the keys, over a head's width) are no longer than these
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, Conv1D)
    products = [m for m in model.modules() if isinstance(m, kinds)]
    hooks = [m.register_forward_hook(record) for m in products]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return longest[0]


def fp32_bound(sublayers: int, reduction: int) -> float:
    """Error bound, relative to the largest value, of an fp32 forward this deep against another summation order.

    A sum of ``reduction`` fp32 terms in another order differs by about sqrt(reduction) roundings
    (a random walk of the per-term rounding errors); each step on the path adds its own, and the
    steps are added as if they all had the same sign (no layer here amplifies an input error: the
    norms rescale, the residuals add). One bf16 rounding of the logits exceeds it 20-60x.
    """
    steps = ROUNDINGS_PER_SUBLAYER * sublayers + ROUNDINGS_OUTSIDE
    return steps * math.sqrt(reduction) * torch.finfo(torch.float32).eps


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the finite entries, relative to the largest finite |want| (inf if others differ)."""
    got = got.detach().cpu().double()
    want = want.detach().double()
    finite = want.isfinite()
    if not torch.equal(finite, got.isfinite()) or not torch.equal(got[~finite], want[~finite]):
        return math.inf
    scale = want[finite].abs().max().item() if finite.any() else 0.0
    diff = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    return diff / scale if scale > 0 else diff


def smallest_margin(scores: torch.Tensor) -> float:
    """The smallest gap between a row's best and second-best score, relative to the largest finite |score|."""
    scores = scores.detach().double()
    finite = scores.isfinite()
    top2 = scores.masked_fill(~finite, -math.inf).topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).min().item() / scores[finite].abs().max().item()


def _fallbacks_since(before: dict[str, int]) -> dict[str, int]:
    return {op: n - before.get(op, 0) for op, n in torchneuron.fallback_counts().items() if n != before.get(op, 0)}


def _loss(model: Any, inputs: dict) -> torch.Tensor:
    """A scalar that reaches every logit: the logits' squared mean (labels differ per architecture)."""
    return model(**inputs).logits.float().square().mean()


@dataclass
class Comparison:
    """One model run on the CPU and on neuron from the same weights and inputs."""

    name: str
    forward_bound: float             # fp32_bound of the forward; the backward's path is twice as deep
    logits_error: float              # relative_error of neuron's logits
    gradient_error: float            # the largest gradient difference, relative to the largest gradient
    fallbacks: dict[str, int]        # ops that ran on the CPU fallback in the forward and backward
    cpu_tokens: torch.Tensor | None = None      # greedy generate() output on each device
    neuron_tokens: torch.Tensor | None = None
    scores_error: float = 0.0        # relative_error of generate()'s per-step scores (the logits it chose from)
    margin: float = math.inf         # smallest_margin of the CPU's choices: where a device's error could flip one
    generate_fallbacks: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def backward_bound(self) -> float:
        """The gradients' bound: the backward retraces the forward's path with two products per product."""
        return 2 * self.forward_bound

    def decisions_equal(self) -> bool:
        """Greedy tokens (or for a classifier, its predicted classes) equal to the CPU's."""
        return torch.equal(self.neuron_tokens, self.cpu_tokens)

    def ok(self) -> bool:
        """Everything within the bounds, the same decisions, the decisions not a near tie, no CPU fallback."""
        return (self.logits_error <= self.forward_bound and self.gradient_error <= self.backward_bound
                and self.scores_error <= self.forward_bound and self.decisions_equal()
                and self.margin > 2 * self.forward_bound and not self.fallbacks and not self.generate_fallbacks)


def compare(name: str) -> Comparison:
    """Run ``MODELS[name]`` on the CPU and on neuron: logits, every gradient, greedy generate() (or classes)."""
    spec = MODELS[name]
    torch.manual_seed(0)
    cpu_model = spec.build().eval()  # eval: no dropout, whose masks the devices would draw differently
    inputs = spec.inputs()
    model = copy.deepcopy(cpu_model).to("neuron")
    on_device = {k: v.to("neuron") for k, v in inputs.items()}
    start = time.perf_counter()
    before = torchneuron.fallback_counts()

    ref, out = cpu_model(**inputs).logits, model(**on_device).logits
    _loss(cpu_model, inputs).backward()
    _loss(model, on_device).backward()
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), cpu_model.parameters()) if q.grad is not None]
    # relative to the largest gradient of the model: some gradients are zero in exact arithmetic (an
    # attention key's bias) and both devices leave only rounding noise there
    scale = max(g.abs().max().item() for _, g in pairs)
    grad_err = max((a.cpu() - b).abs().max().item() for a, b in pairs) / scale
    result = Comparison(name, fp32_bound(spec.sublayers, longest_reduction(cpu_model, inputs)),
                        relative_error(out, ref), grad_err, _fallbacks_since(before))

    before = torchneuron.fallback_counts()
    if spec.generates:
        gen_inputs = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
        options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            expected = cpu_model.generate(**gen_inputs, **options)
            got = model.generate(**{k: v.to("neuron") for k, v in gen_inputs.items()}, **options)
        result.cpu_tokens, result.neuron_tokens = expected.sequences, got.sequences.cpu()
        cpu_scores, scores = torch.stack(expected.scores), torch.stack(got.scores)
    else:  # a classifier or a masked LM decides by its logits' argmax
        result.cpu_tokens, result.neuron_tokens = ref.argmax(-1), out.argmax(-1).cpu()
        cpu_scores, scores = ref, out
    if scores.shape == cpu_scores.shape:
        result.scores_error = relative_error(scores, cpu_scores)
    else:  # generate() stopped at a different step: the tokens differ, which decisions_equal reports
        result.scores_error = math.inf
    result.margin = smallest_margin(cpu_scores)
    result.generate_fallbacks = _fallbacks_since(before)
    result.seconds = time.perf_counter() - start
    return result


def trainer_losses() -> tuple[list[float], str]:
    """The losses of TRAINER_STEPS Trainer steps fine-tuning a small GPT-2, and the device type it trained on.

    Dropout is off: the devices draw different masks. The device is accelerate's choice: set
    ACCELERATE_TORCH_DEVICE before the first Trainer of the process.
    """
    torch.manual_seed(0)
    model = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    batch = 4
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (TRAINER_STEPS * batch, 16))]
    with tempfile.TemporaryDirectory() as out:
        args = hf.TrainingArguments(output_dir=out, per_device_train_batch_size=batch, num_train_epochs=1,
                                    logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-3,
                                    disable_tqdm=True)
        trainer = hf.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    device = next(model.parameters()).device.type
    if device != args.device.type:
        raise RuntimeError(f"Trainer left the model on {device}, not on {args.device}")
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], device


def trainer_losses_on(device: str) -> list[float]:
    """trainer_losses() in a new process whose only change is ACCELERATE_TORCH_DEVICE=device."""
    env = {**os.environ, "ACCELERATE_TORCH_DEVICE": device}
    out = subprocess.run([sys.executable, __file__, "--trainer-losses"], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the Trainer run on {device} failed:\n{out.stderr[-4000:]}")
    losses, trained_on = json.loads(out.stdout.strip().splitlines()[-1])
    if trained_on != device:
        raise RuntimeError(f"ACCELERATE_TORCH_DEVICE={device}, but Trainer trained on {trained_on}")
    return losses


if __name__ == "__main__":
    if sys.argv[1:] != ["--trainer-losses"]:
        sys.exit(f"usage: {sys.argv[0]} --trainer-losses  (see examples/huggingface_models.py)")
    print(json.dumps(trainer_losses()))
