"""Eager mode on the simulated core: host cost and simulated device time, measured in one run.

Prints
  1. the host wall time of a GPT training step (the demo's model: forward, backward, gradient
     clipping, AdamW) on neuron against the CPU, as a ratio (target <= 5x);
  2. the host cost of one small op whose kernel is cached (8x8 ``a + b``): the total per call,
     the part spent executing the kernel's instructions in the simulator, and the rest, which
     is dispatch (PyTorch dispatcher, lowering, kernel cache, launch bookkeeping; target <= 30 us);
  3. the simulated trn2 time of one training step, its kernel launches, and the model FLOPs
     utilization that time implies on one core;
  4. a table of eager matrix products at large shapes (squares, an LLM MLP projection and the
     products its backward computes, attention's batched products) in bf16 and fp32: kernel
     launches per call, simulated time, TFLOPS, % of TensorE peak and % of the op's roofline
     (the larger of its FLOPs at peak and its operands and result moved once at DMA bandwidth).
     These shapes are far too large to execute on the host, so the table is measured under
     ``runtime.timing_only()``: each launch is traced and scheduled as usual (the schedule does
     not depend on the data) but its instructions are not executed.
A benchmark reports; it does not assert.

Run:  python bench/eager.py [--steps 5] [--only products|host] [--quick]   (``make bench``)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

import torchneuron
from torchneuron import runtime
from torchneuron.runtime import profiler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import shakespeare_gpt as demo  # noqa: E402  (the demo's model and training step)

warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")


def training_setup(device: torch.device, cfg: demo.Config, batches: list) -> tuple:
    """The demo's model and AdamW on ``device``, and a function running one training step."""
    model = demo.build_model(cfg, 0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    def step(i: int) -> float:
        x, y = (t.to(device) for t in batches[i % len(batches)])
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()
    return model, step


def time_steps(steps: dict, n: int) -> tuple[dict, dict]:
    """Per device, the median host wall seconds per step and the least process CPU seconds per step
    (the devices alternating; CPU time is what a shared, loaded machine distorts least)."""
    wall: dict = {k: [] for k in steps}
    cpu: dict = {k: [] for k in steps}
    for i in range(n):
        for name, fn in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn(i)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {k: statistics.median(v) for k, v in wall.items()}, {k: min(v) for k, v in cpu.items()}


def small_op_cost(reps: int = 2000, rounds: int = 5) -> tuple[float, float, float]:
    """(total, instruction execution, dispatch) host microseconds of one cached 8x8 ``a + b``: the
    round of ``reps`` calls with the least total (a shared machine only ever adds time)."""
    a, b = torch.randn(8, 8, device="neuron"), torch.randn(8, 8, device="neuron")
    for _ in range(200):
        a + b
    core = runtime.core(0)
    spent = [0.0]
    run_bound = core.run_bound

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run_bound(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    core.run_bound = timed
    best = None
    try:
        for _ in range(rounds):
            spent[0] = 0.0
            start = time.perf_counter()
            for _ in range(reps):
                a + b
            total = (time.perf_counter() - start) / reps * 1e6
            sim = spent[0] / reps * 1e6
            if best is None or total < best[0]:
                best = (total, sim, total - sim)
    finally:
        del core.run_bound
    return best


def _bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def product_cases(dtype: torch.dtype, quick: bool) -> list[tuple[str, str, Callable, int, int]]:
    """(op, shape, call, FLOPs, bytes of operands and result) per matrix product of the table."""
    def mk(*shape: int) -> torch.Tensor:   # contents never read: the table only schedules
        return torch.empty(shape, dtype=dtype, device="neuron")
    cases = []
    for n in (1024, 2048) if quick else (1024, 2048, 4096, 8192):
        a, b = mk(n, n), mk(n, n)
        cases.append(("mm", f"{n}x{n} @ {n}x{n}", lambda a=a, b=b: torch.mm(a, b), 2 * n ** 3, 3 * _bytes(a)))
    T, D, F = (2048, 1024, 3584) if quick else (8192, 4096, 14336)   # tokens, model width, MLP width
    x, w, bias, dy = mk(T, D), mk(F, D), mk(F), mk(T, F)
    fl, io = 2 * T * D * F, _bytes(x, w, dy)
    cases += [
        ("linear", f"x {T}x{D}, W {F}x{D}", lambda: torch.nn.functional.linear(x, w), fl, io),
        ("linear+bias", f"x {T}x{D}, W {F}x{D}", lambda: torch.nn.functional.linear(x, w, bias), fl, io),
        ("matmul dy@W", f"{T}x{F} @ {F}x{D}", lambda: dy @ w, fl, io),
        ("matmul dy.T@x", f"({T}x{F}).T @ {T}x{D}", lambda: dy.t() @ x, fl, io),
    ]
    B, S, hd = (8, 1024, 128) if quick else (32, 2048, 128)           # heads, sequence, head dim
    q, k, v, p = mk(B, S, hd), mk(B, S, hd), mk(B, S, hd), mk(B, S, S)
    fl = 2 * B * S * S * hd
    cases += [
        ("bmm q@k.T", f"{B}x{S}x{hd} @ ({B}x{S}x{hd}).T", lambda: torch.bmm(q, k.transpose(1, 2)), fl,
         _bytes(q, k, p)),
        ("bmm p@v", f"{B}x{S}x{S} @ {B}x{S}x{hd}", lambda: torch.bmm(p, v), fl, _bytes(p, v, q)),
        ("bmm p.T@dO", f"({B}x{S}x{S}).T @ {B}x{S}x{hd}", lambda: torch.bmm(p.transpose(1, 2), v), fl,
         _bytes(p, v, q)),
        ("baddbmm", f"{B}x{S}x{hd} @ ({B}x{S}x{hd}).T", lambda: torch.baddbmm(p, q, k.transpose(1, 2)), fl,
         _bytes(q, k, p, p)),
    ]
    return cases


def products_table(quick: bool) -> None:
    """Print the matrix-product table (simulated trn2 time per op call, launch overhead included)."""
    spec = runtime.core(0).spec
    bw = min(spec.hbm_bytes_per_second_per_core, spec.dma_bytes_per_second_per_core)
    print(f"\neager matrix products on the simulated {spec.name} core (time per op call incl. launch overhead; "
          f"roofline: max(FLOPs at peak, bytes once at {bw / 1e9:.0f} GB/s)):")
    print(f"  {'op':<14} {'dtype':<8} {'shape':<32} {'launches':>8} {'time us':>10} {'TFLOPS':>7} "
          f"{'% peak':>7} {'% roofline':>10}   host s")
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        peak = spec.tensor_peak_flops(name)
        for op, shape, fn, flops, nbytes in product_cases(dtype, quick):
            t0 = time.perf_counter()
            with runtime.timing_only(), profiler.record() as rs:
                fn()
            host = time.perf_counter() - t0
            ns = sum(r.end_ns - r.start_ns for r in rs)
            bound = max(flops / peak, nbytes / bw) * 1e9
            print(f"  {op:<14} {name:<8} {shape:<32} {len(rs):>8} {ns / 1e3:>10.1f} "
                  f"{flops / ns / 1e3:>7.1f} {flops / ns / peak * 1e9:>7.1%} {bound / ns:>10.1%}   {host:6.1f}",
                  flush=True)


def main() -> None:
    """Measure and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per device")
    parser.add_argument("--only", choices=("host", "products"), help="print only this part")
    parser.add_argument("--quick", action="store_true", help="smaller matrix products")
    args = parser.parse_args()
    if args.only != "host":
        products_table(args.quick)
    if args.only == "products":
        return
    torch.manual_seed(0)
    cfg = demo.Config(vocab_size=65)
    data = torch.randint(0, 65, (20000,))
    batches = demo.make_batches(data, cfg, 0)[:8]
    neuron, cpu = torch.device("neuron"), torch.device("cpu")
    model, step_neuron = training_setup(neuron, cfg, batches)
    _, step_cpu = training_setup(cpu, cfg, batches)
    torchneuron.reset_fallback_counts()
    for i in range(2):  # warm-up: traces every kernel once
        step_neuron(i)
        step_cpu(i)
    med, least_cpu = time_steps({"neuron": step_neuron, "cpu": step_cpu}, args.steps)
    print(f"GPT training step ({cfg.n_layer} layers, d_model {cfg.d_model}, batch {cfg.batch_size}x{cfg.block_size}), "
          f"host wall time, median of {args.steps}:")
    print(f"  neuron {med['neuron'] * 1e3:8.1f} ms   cpu {med['cpu'] * 1e3:8.1f} ms   "
          f"ratio {med['neuron'] / med['cpu']:.1f}x (target <= 5x)")
    print(f"  process CPU time, least of {args.steps}: neuron {least_cpu['neuron'] * 1e3:.1f} ms   "
          f"cpu {least_cpu['cpu'] * 1e3:.1f} ms   ratio {least_cpu['neuron'] / least_cpu['cpu']:.1f}x")
    fb = sum(torchneuron.fallback_counts().values())
    print(f"  CPU fallbacks in the neuron steps: {fb}; eager kernel programs cached: {torchneuron.ops.cache_size()}")

    total, sim, dispatch = small_op_cost()
    print("\nsmall op with a cached kernel (8x8 a + b), host time per call (least of 5 rounds):")
    print(f"  total {total:6.1f} us = instruction execution {sim:6.1f} us + dispatch {dispatch:6.1f} us "
          f"(target <= 30 us)")

    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    with profiler.record() as records:
        start.record()
        step_neuron(0)
        end.record()
    device_ms = start.elapsed_time(end)
    spec = runtime.core(0).spec
    n_params = sum(p.numel() for p in model.parameters())
    flops = demo.step_flops(cfg, n_params)
    busy = sum(r.device_time_ns for r in records) / 1e6
    print(f"\nsimulated {spec.name} training step: {device_ms:.3f} ms over {len(records)} kernel launches "
          f"({busy:.3f} ms executing kernels, the rest launch overhead)")
    print(f"  model FLOPs {flops / 1e9:.3f} GFLOP -> MFU {flops / (device_ms * 1e-3) / spec.tensor_peak_flops('float32'):.2%} "
          f"of one core's fp32 TensorE peak")


if __name__ == "__main__":
    main()
