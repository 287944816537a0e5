"""Train a small transformer on neuron ranks with DDP, FSDP2, tensor parallel or FSDP2 x TP,
and check it against single-device training of the same model on the same batches.

Run under torchrun, one process per NeuronCore::

    torchrun --nproc-per-node 2 examples/distributed/train_parallel.py --parallel ddp
    torchrun --nproc-per-node 2 examples/distributed/train_parallel.py --parallel fsdp
    torchrun --nproc-per-node 2 examples/distributed/train_parallel.py --parallel fsdp-bf16
    torchrun --nproc-per-node 2 examples/distributed/train_parallel.py --parallel tp
    torchrun --nproc-per-node 4 examples/distributed/train_parallel.py --parallel fsdp-tp
    torchrun --nproc-per-node 2 examples/distributed/train_parallel.py --parallel ddp,fsdp,tp  (one after another)

Rank ``r`` uses ``neuron:LOCAL_RANK``. Every rank builds the model from the same seed; the
global batch of each step is the same on every rank, and the data-parallel ranks each take
their slice of it. After training, rank 0 trains the same model on one device on the whole
batch (for ``fsdp-bf16``: in bf16 with fp32 gradient reduction, as the policy does) and
compares the losses of every step and the final parameters; it prints one JSON report and
exits with status 1 if the largest relative difference exceeds ``--tolerance``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")
warnings.filterwarnings("ignore", category=FutureWarning)

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 16, 8


class Attention(nn.Module):
    """Causal multi-head attention; under TP each rank holds ``HEADS / tp`` heads."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = nn.LayerNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (inputs, targets), the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, VOCAB, (steps, BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def build(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return Transformer().to(device)


def tensor_parallel(model: nn.Module, mesh) -> None:
    """Megatron-style column/row sharding with sequence parallel norms (TorchTitan's plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def fully_shard_model(model: nn.Module, mesh, bf16: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def parallelize(model: nn.Module, parallel: str, world: int) -> tuple[nn.Module, int, int]:
    """Apply ``parallel``; return the model, this rank's data-parallel index and the dp size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    if parallel == "ddp":
        return DistributedDataParallel(model, device_ids=[torch.neuron.current_device()]), rank, world
    if parallel in ("fsdp", "fsdp-bf16"):
        fully_shard_model(model, init_device_mesh("neuron", (world,)), parallel == "fsdp-bf16")
        return model, rank, world
    if parallel == "tp":
        tensor_parallel(model, init_device_mesh("neuron", (world,)))
        return model, 0, 1
    if parallel == "fsdp-tp":
        mesh = init_device_mesh("neuron", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        fully_shard_model(model, mesh["dp"], bf16=False)
        return model, mesh["dp"].get_local_rank(), world // 2
    raise ValueError(f"--parallel {parallel!r}: expected ddp, fsdp, fsdp-bf16, tp or fsdp-tp")


def train(model: nn.Module, steps: int, device: torch.device, dp_rank: int, dp_size: int) -> list[float]:
    """AdamW on the dp slice of each global batch; return the global mean loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for x, y in batches(steps):
        x, y = (t.chunk(dp_size)[dp_rank].to(device) for t in (x, y))
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        if dist.is_initialized() and dp_size > 1:
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        losses.append(global_loss.item())
    return losses


def reference_bf16(steps: int, device: torch.device, dp_size: int) -> tuple[list[float], dict]:
    """Single-device emulation of FSDP2's bf16 policy: bf16 compute per dp slice, fp32 gradient mean."""
    model = build(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for x, y in batches(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        total = 0.0
        for i in range(dp_size):
            low = copy.deepcopy(model).to(torch.bfloat16)
            xs, ys = (t.chunk(dp_size)[i].to(device) for t in (x, y))
            loss = F.cross_entropy(low(xs).flatten(0, 1).float(), ys.flatten())
            loss.backward()
            for g, p in zip(grads, low.parameters()):
                g += p.grad.float() / dp_size
            total += loss.item() / dp_size
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full CPU tensor (DTensors gathered); DDP's prefix removed."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.state_dict().items():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.removeprefix("module.")] = full.detach().cpu()
    return out


def max_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| relative to the larger of |b|'s max and 1e-6 (a scale-aware max error)."""
    return float((a.double() - b.double()).abs().max() / max(float(b.double().abs().max()), 1e-6))


def run(parallel: str, steps: int, device: torch.device, references: dict) -> dict:
    """Train with ``parallel``; on rank 0, compare with single-device training (cached per kind)."""
    from torchneuron.runtime import profiler

    world = dist.get_world_size()
    start = torch.neuron.stream_clock_ns(torch.neuron.current_stream())
    with profiler.record() as records:
        model, dp_rank, dp_size = parallelize(build(device), parallel, world)
        losses = train(model, steps, device, dp_rank, dp_size)
    state = full_state(model)
    collectives = [r for r in records if hasattr(r, "wait_ns")]
    report = dict(parallel=parallel, world=world, steps=steps, losses=losses, collectives=len(collectives),
                  levels=sorted({r.level for r in collectives}),
                  device_time_ns=torch.neuron.stream_clock_ns(torch.neuron.current_stream()) - start)
    if dist.get_rank() != 0:
        return report
    kind = "bf16" if parallel == "fsdp-bf16" else "fp32"
    if kind not in references:
        if kind == "bf16":
            references[kind] = reference_bf16(steps, device, dp_size)
        else:
            reference = build(device)
            references[kind] = (train(reference, steps, device, 0, 1),
                                {k: v.cpu() for k, v in reference.state_dict().items()})
    ref_losses, ref_state = references[kind]
    report.update(reference_losses=ref_losses,
                  max_loss_relative_error=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                  max_param_relative_error=max(max_relative(state[k], ref_state[k]) for k in ref_state))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parallel", default="ddp", help="comma-separated: ddp, fsdp, fsdp-bf16, tp, fsdp-tp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--report", default=None, help="also write rank 0's JSON reports to this file")
    args = parser.parse_args()

    import torchneuron  # noqa: F401  (autoloaded by `import torch` too)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.neuron.set_device(local_rank)
    device = torch.device("neuron", local_rank)
    dist.init_process_group("neuron")
    references: dict = {}
    reports = [run(p, args.steps, device, references) for p in args.parallel.split(",")]
    status = 0
    if dist.get_rank() == 0:
        for report in reports:
            print(json.dumps(report))
            if not (report["max_loss_relative_error"] <= args.tolerance
                    and report["max_param_relative_error"] <= args.tolerance):
                status = 1
        if args.report:
            with open(args.report, "w") as f:
                json.dump(reports, f)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
