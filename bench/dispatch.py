"""Host overhead per small op: ``neuron`` against native CPU, measured in the same run.

For each small op the script times many calls on 8x8 float32 tensors, on ``neuron`` and
on the CPU, alternating the two so that both see the same load on a shared machine, and
prints the median microseconds per call, the ratio, and the route each neuron call took
(device kernel launches, CPU-fallback ops per call, or neither for the C++ core view/copy ops).
Small tensors make the arithmetic negligible, so the numbers are dispatch cost.
A benchmark reports; it does not assert.

Run:  python bench/dispatch.py [--reps 200] [--inner 50]   (``make bench``)
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

import torchneuron

warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")


@dataclass
class Case:
    """One benchmarked op: ``make(device)`` returns the zero-argument call to time."""

    name: str
    make: Callable[[torch.device], Callable[[], object]]


def _inputs(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    return a.to(device), b.to(device)


def cases(n: int) -> list[Case]:
    """The ops to time, on ``n`` x ``n`` tensors."""
    cpu = torch.device("cpu")

    def binary(fn: Callable[[torch.Tensor, torch.Tensor], object]) -> Callable[[torch.device], Callable[[], object]]:
        def make(device: torch.device) -> Callable[[], object]:
            a, b = _inputs(device, n)
            return lambda: fn(a, b)
        return make

    def unary(fn: Callable[[torch.Tensor], object]) -> Callable[[torch.device], Callable[[], object]]:
        def make(device: torch.device) -> Callable[[], object]:
            a, _ = _inputs(device, n)
            return lambda: fn(a)
        return make

    def index(device: torch.device) -> Callable[[], object]:
        a, _ = _inputs(device, n)
        idx = torch.tensor([0, 2, 3, n - 1], device=device)
        return lambda: a[idx]

    def copy_to(device: torch.device) -> Callable[[], object]:
        host, _ = _inputs(cpu, n)  # CPU baseline: a host-to-host copy (clone)
        return (lambda: host.to(device)) if device.type != "cpu" else (lambda: host.clone())

    def copy_from(device: torch.device) -> Callable[[], object]:
        a, _ = _inputs(device, n)
        return (lambda: a.cpu()) if device.type != "cpu" else (lambda: a.clone())

    def copy_inplace(device: torch.device) -> Callable[[], object]:
        a, b = _inputs(device, n)
        return lambda: a.copy_(b)

    return [
        Case("add  a + b", binary(torch.add)),
        Case("mul  a * b", binary(torch.mul)),
        Case("sum  a.sum()", unary(torch.sum)),
        Case("relu", unary(torch.relu)),
        Case(f"mm   {n}x{n} @ {n}x{n}", binary(torch.mm)),
        Case("view a.view(-1)", unary(lambda a: a.view(-1))),
        Case("t    a.t()", unary(torch.t)),
        Case("index a[1]", unary(lambda a: a[1])),
        Case("index a[idx] (4 rows)", index),
        Case("copy_ same device", copy_inplace),
        Case("copy cpu -> dev (.to)", copy_to),
        Case("copy dev -> cpu (.cpu)", copy_from),
    ]


def sample_ns(fn: Callable[[], object], inner: int, device: torch.device) -> float:
    """Nanoseconds per call over ``inner`` back-to-back calls (device synchronized at the end)."""
    sync = torch.neuron.synchronize if device.type == "neuron" else (lambda: None)
    sync()
    start = time.perf_counter_ns()
    for _ in range(inner):
        fn()
    sync()
    return (time.perf_counter_ns() - start) / inner


def route(fn: Callable[[], object], calls: int = 10) -> str:
    """How a neuron call ran: device kernel launches, ops sent through the CPU fallback, or neither
    (a C++ core op: views, host transfers)."""
    from torchneuron.runtime import profiler

    torchneuron.reset_fallback_counts()
    with profiler.record() as launches:
        for _ in range(calls):
            fn()
    counts = torchneuron.fallback_counts()
    if not counts:
        if launches:
            names = sorted({r.name for r in launches})
            return f"device kernel x{len(launches) / calls:g} ({', '.join(names)})"
        return "C++ core op (no kernel)"
    return ", ".join(f"{name}" + (f" x{c / calls:g}" if c != calls else "") for name, c in counts.items())


def main() -> None:
    """Time every case on neuron and on the CPU and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8, help="tensor side (default 8: 8x8 float32)")
    parser.add_argument("--reps", type=int, default=200, help="samples per op and device (median taken)")
    parser.add_argument("--inner", type=int, default=50, help="calls per sample")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls per op and device")
    args = parser.parse_args()

    neuron, cpu = torch.device("neuron"), torch.device("cpu")
    print(f"torch {torch.__version__}, torchneuron {torchneuron.__version__}, "
          f"{torch.get_num_threads()} CPU threads; {args.size}x{args.size} float32 inputs; "
          f"median of {args.reps} samples x {args.inner} calls after {args.warmup} warm-up calls\n")
    rows = []
    for case in cases(args.size):
        fn_neuron, fn_cpu = case.make(neuron), case.make(cpu)
        for _ in range(args.warmup):
            fn_neuron()
            fn_cpu()
        t_neuron, t_cpu = [], []
        for _ in range(args.reps):  # alternate, so both see the same background load
            t_neuron.append(sample_ns(fn_neuron, args.inner, neuron))
            t_cpu.append(sample_ns(fn_cpu, args.inner, cpu))
        rows.append((case.name, statistics.median(t_neuron) / 1e3, statistics.median(t_cpu) / 1e3,
                     route(fn_neuron)))

    w = max(len(r[0]) for r in rows)
    header = f"{'op':<{w}}  {'neuron us':>10}  {'cpu us':>8}  {'ratio':>7}  neuron route"
    print(header)
    print("-" * len(header))
    for name, tn, tc, how in rows:
        print(f"{name:<{w}}  {tn:>10.2f}  {tc:>8.2f}  {tn / tc:>6.1f}x  {how}")
    ratios = [tn / tc for _, tn, tc, _ in rows]
    print(f"\ngeometric mean ratio neuron/cpu: {statistics.geometric_mean(ratios):.1f}x "
          "(host time per call; the CPU column is native CPU eager, copies are host clones)")


if __name__ == "__main__":
    main()
