"""The ``torchneuron`` command: look at the devices, profile a script, check a script for fallbacks.

    torchneuron ls                              devices, chip, cores, HBM per core, versions
    torchneuron profile script.py [args...]     run it under torch.profiler; write a trace; print the
                                                top kernels by device time, engine utilization,
                                                fallbacks and the HBM peak
    torchneuron check script.py [args...]       run it, listing every op that fell back to the CPU
                                                with its call site (exit status 1 if any did, as
                                                strict mode would fail), and whether the HBM peak
                                                fits a trn1, trn2 and trn3 core

The script runs in this process as ``__main__`` with ``sys.argv = [script, *args]``, like
``python script.py args``. Runs that last longer than ``--progress`` seconds print a progress line
to stderr at that interval.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata
import platform
import re
import runpy
import sys
import sysconfig
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

import torchneuron
from torchneuron.neuron.memory import format_bytes
from torchneuron.runtime import profiler as launch_log
from torchneuron.runtime.record import LaunchRecord
from torchneuron.sim.specs import CHIPS

_FALLBACK_WARNING = re.compile(r"The operator '([^']+)' has no neuron kernel")
# frames that are not the user's: torch, torchneuron, and the standard library (warnings, runpy)
_NOT_USER = tuple(str(Path(m.__file__).resolve().parent) for m in (torch, torchneuron)) + (
    sysconfig.get_paths()["stdlib"], "<frozen")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def ls_report() -> str:
    """The text ``torchneuron ls`` prints."""
    props = torch.neuron.get_device_properties(0)
    count = torch.neuron.device_count()
    versions = [f"torchneuron {_version('torchneuron') or 'unknown'}", f"torch {torch.__version__}",
                f"python {platform.python_version()}"]
    versions += [f"{p} {v}" for p in ("transformers",) if (v := _version(p))]
    lines = [", ".join(versions),
             f"chip: {props.chip} ({props.core_generation}), {props.cores_per_chip} cores per chip, "
             f"simulated (TORCHNEURON_CHIP)",
             f"{count} device{'s' if count != 1 else ''}:",
             f"  {'device':<10}{'name':<24}{'HBM':>12}{'allocated':>12}{'reserved':>12}"]
    for i in range(count):
        p = torch.neuron.get_device_properties(i)
        lines.append(f"  {'neuron:' + str(i):<10}{p.name:<24}{format_bytes(p.total_memory):>12}"
                     f"{format_bytes(torch.neuron.memory_allocated(i)):>12}{format_bytes(torch.neuron.memory_reserved(i)):>12}")
    return "\n".join(lines)


class _Progress:
    """A daemon thread printing how far a long run is, every ``interval`` seconds (never for short runs)."""

    def __init__(self, records: list[LaunchRecord], interval: float):
        self.records, self.interval = records, interval
        self.start = time.monotonic()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="torchneuron-progress", daemon=True)

    def _run(self) -> None:
        seen, device_ns = 0, 0.0
        while not self.stopped.wait(self.interval):
            n = len(self.records)
            device_ns += sum(r.device_time_ns for r in self.records[seen:n])
            seen = n
            print(f"[torchneuron] {time.monotonic() - self.start:.0f} s: {n:,} kernel launches, "
                  f"{device_ns / 1e6:.3f} ms simulated device time", file=sys.stderr, flush=True)

    def __enter__(self) -> "_Progress":
        if self.interval > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopped.set()


def _run_script(script: str, args: Sequence[str]) -> int:
    """Run ``script`` as ``__main__`` with ``args``; its exit status (a traceback is printed on error)."""
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"no such script: {script}")
    argv, sys_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the report still follows, as after a crashed `python script.py`
        traceback.print_exc()
        return 1
    finally:
        sys.argv = argv
        if sys.path and sys.path[0] == str(path.resolve().parent) and sys.path[0] != sys_path0:
            del sys.path[0]


def _reset_peaks() -> None:
    for i in range(torch.neuron.device_count()):
        torch.neuron.reset_peak_memory_stats(i)


def _hbm_peak() -> tuple[int, int]:
    """(the largest peak of allocated HBM over the devices, that device)."""
    peaks = [(torch.neuron.max_memory_allocated(i), i) for i in range(torch.neuron.device_count())]
    return max(peaks)


def kernel_table(records: Sequence[LaunchRecord], top: int) -> str:
    """The ``top`` kernels by total device time, with calls, share of device time, FLOPs and HBM bytes."""
    total = sum(r.device_time_ns for r in records) or 1.0
    by_name: dict[str, list[LaunchRecord]] = collections.defaultdict(list)
    for r in records:
        by_name[r.name].append(r)
    rows = sorted(by_name.items(), key=lambda kv: -sum(r.device_time_ns for r in kv[1]))
    lines = [f"  {'kernel':<32}{'op':<28}{'calls':>7}{'device ms':>11}{'%':>7}{'avg us':>9}{'GFLOP':>9}{'HBM MiB':>9}"]
    for name, rs in rows[:top]:
        t = sum(r.device_time_ns for r in rs)
        ops = sorted({r.op or "-" for r in rs})
        op = ops[0] + (f" (+{len(ops) - 1})" if len(ops) > 1 else "")
        hbm = sum(r.hbm_bytes_read + r.hbm_bytes_written for r in rs)
        lines.append(f"  {name[:31]:<32}{op[:27]:<28}{len(rs):>7}{t / 1e6:>11.3f}{100 * t / total:>7.1f}"
                     f"{t / len(rs) / 1e3:>9.2f}{sum(r.flops for r in rs) / 1e9:>9.3f}{hbm / 2**20:>9.2f}")
    if len(rows) > top:
        lines.append(f"  ... {len(rows) - top} more kernels")
    return "\n".join(lines)


def engine_utilization(records: Sequence[LaunchRecord]) -> dict[str, float]:
    """Busy time of each engine as a fraction of the kernels' device time."""
    total = sum(r.device_time_ns for r in records)
    busy: collections.Counter[str] = collections.Counter()
    for r in records:
        busy.update(r.engine_busy_ns)
    return {e: (b / total if total else 0.0) for e, b in sorted(busy.items())}


def _fallback_lines(counts: dict[str, int], sites: dict[str, str] | None = None) -> list[str]:
    if not counts:
        return ["  none: every op ran on the device"]
    return [f"  {op:<44}{n:>7} call{'s' if n != 1 else ' '}" + (f"  at {sites[op]}" if sites and op in sites else "")
            for op, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def _profile(args: argparse.Namespace) -> int:
    from torch.profiler import ProfilerActivity, profile

    torchneuron.reset_fallback_counts()
    _reset_peaks()
    start = time.perf_counter()
    with launch_log.record() as records, _Progress(records, args.progress):
        if args.device_only:
            status = _run_script(args.script, args.args)
        else:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
                status = _run_script(args.script, args.args)
    wall = time.perf_counter() - start
    trace = Path(args.trace)
    trace.parent.mkdir(parents=True, exist_ok=True)
    if args.device_only:
        launch_log.to_chrome_trace(trace, records)
    else:
        prof.export_chrome_trace(str(trace))
    device_ns = sum(r.device_time_ns for r in records)
    peak, peak_device = _hbm_peak()
    out = [f"torchneuron profile: {args.script} ({wall:.1f} s host time, exit status {status})",
           f"trace: {trace} (open in https://ui.perfetto.dev or chrome://tracing)",
           f"{len(records):,} kernel launches, {device_ns / 1e6:.3f} ms simulated device time "
           f"on {torch.neuron.get_device_name()}",
           "", "top kernels by device time:", kernel_table(records, args.top),
           "", "engine utilization (busy time / kernel device time):"]
    out += [f"  {e:<8}{100 * u:6.1f}%" for e, u in engine_utilization(records).items()]
    out += ["", "CPU fallbacks:", *_fallback_lines(torchneuron.fallback_counts()),
            "", f"HBM peak: {format_bytes(peak)} allocated on neuron:{peak_device} "
                f"(of {format_bytes(torch.neuron.get_device_properties(peak_device).total_memory)})"]
    print("\n".join(out))
    return status


@contextlib.contextmanager
def _fallback_sites() -> Iterator[dict[str, str]]:
    """Within the block, ``sites`` maps each op that falls back to the CPU to the first call site outside
    torch and torchneuron (the user's line), read from the stack when the fallback's warning is raised."""
    sites: dict[str, str] = {}
    show = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        match = _FALLBACK_WARNING.search(str(message))
        if not match:
            show(message, category, filename, lineno, file, line)
            return
        stack = traceback.extract_stack()[:-1]
        user = [f for f in stack if not f.filename.startswith(_NOT_USER)]
        frame = user[-1] if user else stack[-1]
        sites.setdefault(match.group(1), f"{frame.filename}:{frame.lineno} ({frame.name})")

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=_FALLBACK_WARNING.pattern)
        warnings.showwarning = record
        yield sites


def _check(args: argparse.Namespace) -> int:
    # The run goes on past a fallback (even under TORCHNEURON_STRICT=1) so that every op is listed;
    # the exit status fails the check as strict mode would.
    torchneuron.set_strict(False)
    torchneuron.reset_fallback_counts()  # every op warns again at its first fallback, where its site is read
    _reset_peaks()
    with launch_log.record() as records, _Progress(records, args.progress), _fallback_sites() as sites:
        status = _run_script(args.script, args.args)
    counts = torchneuron.fallback_counts()
    peak, peak_device = _hbm_peak()
    out = [f"torchneuron check: {args.script} (exit status {status}, {len(records):,} kernel launches)",
           "", f"CPU fallbacks ({len(counts)} op{'s' if len(counts) != 1 else ''}; TORCHNEURON_STRICT=1 would "
               f"{'stop at the first' if counts else 'pass'}):", *_fallback_lines(counts, sites),
           "", f"HBM peak: {format_bytes(peak)} allocated on neuron:{peak_device}"]
    for name, chip in CHIPS.items():
        cap = chip.hbm_bytes_per_core
        verdict = "fits" if peak <= cap else "does NOT fit"
        out.append(f"  {name} ({chip.core_generation}, {format_bytes(cap)} HBM per core): {verdict}")
    print("\n".join(out))
    if status:
        return status
    return 1 if counts else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchneuron", description="TorchNeuron's tools for the neuron device.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="devices, chip, cores, HBM per core, versions")
    for name, text in (("profile", "run a script under the profiler and report its kernels"),
                       ("check", "run a script and list the ops that fell back to the CPU")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--progress", type=float, default=10.0, metavar="SECONDS",
                       help="print a progress line at this interval (0: never; default 10)")
        if name == "profile":
            p.add_argument("--trace", default="torchneuron_trace.json", help="trace file to write (Chrome JSON)")
            p.add_argument("--top", type=int, default=15, help="kernels to list (default 15)")
            p.add_argument("--device-only", action="store_true",
                           help="trace only the kernels (the runtime's launch log), without torch.profiler's host ops")
        p.add_argument("script", help="the Python script to run")
        p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchneuron`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "ls":
        print(ls_report())
        return 0
    if not Path(args.script).is_file():
        print(f"torchneuron {args.command}: no such script: {args.script}", file=sys.stderr)
        return 2
    return _profile(args) if args.command == "profile" else _check(args)


if __name__ == "__main__":
    sys.exit(main())
