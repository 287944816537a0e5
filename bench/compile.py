"""torch.compile(backend="neuron") against eager, on the trn2 model: simulated step time, launches, host time.

Prints, in one run:

- the demo's GPT (examples/shakespeare_gpt.py) training step, eager and compiled (the model and the AdamW
  step): simulated device time
  per step (torch.neuron.Event, launch overheads included), its model FLOPs utilization of one core's
  fp32 TensorE peak, kernel launches per step, host time per step (wall, and the process's CPU time, which
  a shared machine's load moves less; the two steps alternate, so both meet the same conditions), and the
  compiled/eager ratios;
- a GPT-2-small-shaped transformer block (d=768, 12 heads, sequence 1024, bf16 autocast), one compiled
  training step: simulated time and MFU of one core's bf16 TensorE peak, launches, HBM bytes moved
  compiled vs eager;
- cold compile time (empty program cache) and warm start (the on-disk cache of the first run), each
  as the wall time of a fresh process's first compiled step.

Run:  python bench/compile.py   (``make bench``)
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import torchneuron
from torchneuron.runtime import profiler

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import shakespeare_gpt as demo  # noqa: E402

STEPS = 8
ROUNDS = 3   # host time: rounds over the batches, the eager and the compiled step alternating


def _stepper(model, device, compiled: bool):
    """A training step of ``model`` (compiled: the model and the AdamW step both under torch.compile) returning its
    simulated ms, host wall and CPU ms, launches and HBM bytes."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = torch.compile(opt.step, backend="neuron") if compiled else opt.step

    def run(x, y) -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
        start.record()
        with profiler.record() as records:
            _, loss = model(x.to(device), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            step()
            loss.item()
        end.record()
        return {"sim_ms": start.elapsed_time(end), "host_ms": (time.perf_counter() - t0) * 1e3,
                "cpu_ms": (time.process_time() - c0) * 1e3, "launches": len(records),
                "hbm": sum(r.program.hbm_bytes_read + r.program.hbm_bytes_written for r in records)}
    return run


def demo_step() -> None:
    """The demo model, eager vs compiled: their steps alternate (one process, the same batches), so that the host
    times compare under the same conditions; medians of each, and the median of the paired ratios."""
    text = demo.load_text()
    chars = sorted(set(text))
    data = torch.tensor([{c: i for i, c in enumerate(chars)}[c] for c in text])
    cfg = demo.Config(vocab_size=len(chars), steps=STEPS)
    batches = demo.make_batches(data, cfg, 0)[:STEPS]
    n_params = sum(p.numel() for p in demo.build_model(cfg, 0).parameters())
    peak = torchneuron.runtime.core(0).spec.tensor_peak_flops("float32")
    flops = demo.step_flops(cfg, n_params)
    steps = {}
    for name in ("eager", "compiled"):
        model = demo.build_model(cfg, 0).to("neuron")
        steps[name] = _stepper(torch.compile(model, backend="neuron") if name == "compiled" else model, "neuron",
                               compiled=name == "compiled")
        steps[name](*batches[0])   # the first step compiles
    samples: dict[str, list[dict]] = {name: [] for name in steps}
    for i in range(ROUNDS * (STEPS - 1)):
        for name in (("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")):
            samples[name].append(steps[name](*batches[1 + i % (STEPS - 1)]))
    rows = {name: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for name, runs in samples.items()}
    print(f"demo GPT ({n_params:,} parameters), training step on {torchneuron.runtime.core(0).spec.name}:")
    for name, r in rows.items():
        mfu = flops / (r["sim_ms"] * 1e-3) / peak
        print(f"  {name:>8}: simulated {r['sim_ms']:.3f} ms/step (MFU {mfu:.2%}), {r['launches']:.0f} launches, "
              f"HBM {r['hbm'] / 2**20:.1f} MiB, host {r['host_ms']:.0f} ms/step (CPU {r['cpu_ms']:.0f} ms)")
    e, c = rows["eager"], rows["compiled"]
    paired = statistics.median(b["cpu_ms"] / a["cpu_ms"] for a, b in zip(samples["eager"], samples["compiled"]))
    print(f"  compiled vs eager: simulated step {e['sim_ms'] / c['sim_ms']:.2f}x faster (target 5x), launches "
          f"{e['launches']:.0f} -> {c['launches']:.0f}, host time {c['host_ms'] / e['host_ms']:.2f}x of eager (CPU "
          f"time {c['cpu_ms'] / e['cpu_ms']:.2f}x, paired {paired:.3f}x; {len(samples['eager'])} steps each, "
          f"alternating; target <= 1)")


class Block(nn.Module):
    """A GPT-2 block: pre-norm causal attention and a 4x GELU MLP."""

    def __init__(self, d: int = 768, heads: int = 12) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def gpt2_block(seq: int = 1024, d: int = 768) -> None:
    """One compiled bf16 training step of a GPT-2-small block; eager beside it for HBM traffic."""
    torch.manual_seed(0)
    spec = torchneuron.runtime.core(0).spec
    x = torch.randn(1, seq, d, device="neuron")
    n_params = 12 * d * d + 13 * d
    flops = 6 * n_params * seq + 12 * d * seq * seq   # matmuls fwd+bwd and attention's
    for name in ("eager", "compiled"):
        block = Block(d).to("neuron")

        def loss(x: torch.Tensor) -> torch.Tensor:
            return block(x).float().square().mean()

        # the step's forward and loss are one compiled function, as a training loop compiles its step
        run = torch.compile(loss, backend="neuron") if name == "compiled" else loss
        for i in range(2):
            block.zero_grad(set_to_none=True)   # as a training step does: no accumulation into old gradients
            start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
            start.record()
            with profiler.record() as records, torch.autocast("neuron", torch.bfloat16):
                run(x).backward()
            end.record()
        ms = start.elapsed_time(end)
        hbm = sum(r.program.hbm_bytes_read + r.program.hbm_bytes_written for r in records)
        print(f"GPT-2-small block (d={d}, 12 heads, seq {seq}, bf16), {name} training step: simulated {ms:.3f} ms, "
              f"MFU {flops / (ms * 1e-3) / spec.tensor_peak_flops('bfloat16'):.2%} of bf16 TensorE peak (target "
              f">= 50% compiled), {len(records)} launches, HBM {hbm / 2**20:.1f} MiB")


FIRST_STEP = """
import json, time
t0 = time.perf_counter()
import torch, torchneuron
from torch._dynamo.utils import compilation_time_metrics as dynamo
from torchneuron.compiler import cache_stats, reports
t1 = time.perf_counter()
m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256), torch.nn.Linear(256, 64))
m = torch.compile(m.to("neuron"), backend="neuron")
m(torch.randn(32, 64, device="neuron")).sum().backward()
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "step": t2 - t1, "dynamo": sum(dynamo.get("_compile.compile_inner", [])),
                  "partition": sum(r.partition_seconds for r in reports()),
                  "trace": sum(p.trace_seconds for r in reports() for p in r.programs),
                  "disk": cache_stats["disk_read_seconds"], "misses": cache_stats["misses"],
                  "disk_hits": cache_stats["disk_hits"]}))
"""


def cold_and_warm() -> None:
    """Wall time of a fresh process's first compiled step: empty cache, then the cache it left; and what it is
    made of: TorchDynamo and AOTAutograd capturing the graphs (our partition of each graph runs inside them),
    programs traced (cold) or read from disk (warm), and the rest (the step itself, first-use imports)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHNEURON_CACHE_DIR": cache}
        runs = [json.loads(subprocess.run([sys.executable, "-c", FIRST_STEP], env=env, capture_output=True, text=True,
                                          check=True).stdout.split("\n")[-2]) for _ in range(2)]
    print("first compiled step of a fresh process (MLP, forward+backward; import torch+torchneuron before it):")
    for name, r in zip(("cold (empty program cache)", "warm (on-disk program cache)"), runs):
        rest = r["step"] - r["dynamo"] - r["trace"] - r["disk"]
        print(f"  {name}: {r['step']:.2f} s = Dynamo+AOTAutograd {r['dynamo']:.2f} s (our partition "
              f"{r['partition']:.3f} s inside) + programs traced {r['trace']:.2f} s ({r['misses']}) + read from disk "
              f"{r['disk']:.3f} s ({r['disk_hits']}) + the rest {rest:.2f} s; import {r['import']:.2f} s")


if __name__ == "__main__":
    demo_step()
    cold_and_warm()
    if "--no-block" not in sys.argv:
        gpt2_block()
