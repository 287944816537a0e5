"""Distributed training on the simulated trn2: step time and scaling efficiency of DDP and FSDP2 on
1, 2, 4 and 8 ranks (one chip), and the host cost of a collective. Prints figures; asserts nothing.

    .venv/bin/python bench/distributed.py            # 1, 2, 4, 8 ranks (8 processes on this machine's cores)
    .venv/bin/python bench/distributed.py --quick    # 1 and 2 ranks

The model is ``examples/distributed/train_parallel.py``'s transformer at width ``--dim``;
each rank takes a batch of the same size (weak scaling), so the ideal step time is
constant and the scaling efficiency is ``step(1 rank) / step(p ranks)``. Step time is the
simulated device time of one training step (kernels plus collectives) on the slowest rank,
averaged over the steps after a warm-up step. The host cost compares one small all-reduce
through the ``neuron`` backend (neuron tensors, metadata exchange, clock accounting) with the
same all-reduce through Gloo on CPU tensors.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "distributed" / "train_parallel.py"


def _example():
    """The example module (the model and parallelization this benchmark times)."""
    spec = importlib.util.spec_from_file_location("train_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(parallel: str, dim: int, steps: int, out: str) -> None:
    """One rank: train ``steps`` steps; rank 0 writes the step times and the host cost."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import torchneuron  # noqa: F401

    ex = _example()
    ex.DIM = dim  # the example's width, read when the model is built
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.neuron.set_device(local_rank)
    device = torch.device("neuron", local_rank)
    dist.init_process_group("neuron")
    world = dist.get_world_size()
    model, _, _ = ex.parallelize(ex.build(device), parallel, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    stream = torch.neuron.current_stream()
    per_step = []
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        data = torch.randint(0, ex.VOCAB, (ex.BATCH, ex.SEQ + 1), generator=g).to(device)
        start = torch.neuron.stream_clock_ns(stream)
        loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()  # the step ends when the slowest rank's does
        per_step.append(torch.neuron.stream_clock_ns(stream) - start)

    # host cost of one small all-reduce: neuron backend vs gloo on CPU
    gloo = dist.new_group(backend="gloo")
    timings = {}
    for label, tensor, group in (("neuron", torch.ones(256, device=device), None), ("gloo-cpu", torch.ones(256), gloo)):
        for _ in range(20):
            dist.all_reduce(tensor, group=group)
        t = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(tensor, group=group)
        timings[label] = (time.perf_counter() - t) / 200
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(dict(step_ns=per_step[1:], host_s=timings)))
    dist.destroy_process_group()


def launch(parallel: str, ranks: int, dim: int, steps: int) -> dict:
    """Run ``ranks`` workers under torchrun; return rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               __file__, "--worker", parallel, "--dim", str(dim), "--steps", str(steps), "--out", str(out)]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TORCHNEURON_CHIP": "trn2"})
        if proc.returncode != 0:
            raise RuntimeError(f"{parallel} on {ranks} ranks failed:\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
        result["wall_s"] = time.perf_counter() - t
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.dim, args.steps, args.out)
        return
    ranks = (1, 2) if args.quick else (1, 2, 4, 8)
    print(f"trn2, width {args.dim}, weak scaling (the same batch per rank); step = simulated device time")
    host = None
    for parallel in ("ddp", "fsdp"):
        base = None
        for p in ranks:
            r = launch(parallel, p, args.dim, args.steps)
            step = sum(r["step_ns"]) / len(r["step_ns"])
            base = base or step
            print(f"{parallel:<5} {p} ranks: step {step / 1e3:9.1f} us   scaling efficiency {base / step:6.1%}"
                  f"   (host wall {r['wall_s']:5.1f} s)", flush=True)
            if p == 2 and host is None:
                host = r["host_s"]
    if host:
        print(f"host cost of a 1 KiB all-reduce on 2 ranks: neuron backend {host['neuron'] * 1e6:7.1f} us, "
              f"gloo on CPU {host['gloo-cpu'] * 1e6:7.1f} us  ({host['neuron'] / host['gloo-cpu']:.1f}x)")


if __name__ == "__main__":
    main()
