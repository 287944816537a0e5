"""The earlier NKI generation (``neuronxcc.nki``) on top of TorchNeuron's current-generation tracer.

    from torchneuron.nki import legacy as nki
    from torchneuron.nki.legacy import language as nl, isa as nisa

    @nki.jit
    def add(a, b):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        i_p, i_f = nl.arange(128)[:, None], nl.arange(a.shape[1])[None, :]
        for i in nl.affine_range((a.shape[0] + 127) // 128):
            m = i * 128 + i_p < a.shape[0]
            x = nl.load(a[i * 128 + i_p, i_f], mask=m)
            nl.store(out[i * 128 + i_p, i_f], value=x + nl.load(b[i * 128 + i_p, i_f], mask=m), mask=m)
        return out

``torchneuron.nki.install_import_aliases()`` makes ``import neuronxcc.nki`` resolve here.
"""
from __future__ import annotations

import types
from typing import Any, Callable

from torchneuron.nki import Kernel as _Kernel
from torchneuron.nki import ProfileReport, SimulatorError, profile as _profile  # noqa: F401
from torchneuron.nki import typing as _typing
from torchneuron.nki.legacy import isa, language
from torchneuron.nki.legacy._tile import LegacyTile
from torchneuron.nki.tracing import psum as _psum, sbuf as _sbuf

__all__ = ["jit", "simulate_kernel", "benchmark", "baremetal", "profile", "Kernel", "isa", "language", "typing",
           "compiler", "SimulatorError"]


class Kernel(_Kernel):
    """A legacy ``@nki.jit`` kernel: tensors are ``LegacyTile`` (index vectors, masks, ``+=``)."""

    tensor_cls = LegacyTile


def jit(func: Callable | None = None, mode: str = "auto", **options: Any) -> Any:
    """``@nki.jit`` / ``nki.jit(fn, mode=...)``: every mode simulates (``benchmark`` also times)."""
    if func is None:
        return lambda f: jit(f, mode=mode, **options)
    if mode == "benchmark":
        return benchmark(func, **options)
    return func if isinstance(func, Kernel) else Kernel(getattr(func, "fn", func), mode=mode, **options)


def simulate_kernel(kernel: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run a (legacy) kernel on NumPy arrays on the simulator and return its outputs."""
    return jit(kernel).run(args, kwargs)[0]


def baremetal(kernel: Callable | None = None, **options: Any) -> Any:
    """Run with NumPy in/out (here: the simulator). Compile options are accepted and ignored."""
    if kernel is None:
        return lambda f: baremetal(f, **options)
    return jit(kernel)


class _Latency:
    def __init__(self, ns: float):
        self.ns = ns

    def get_latency_percentile(self, p: int) -> float:
        """Latency in microseconds (the simulator is deterministic: every percentile is the same)."""
        return self.ns / 1e3


class _BenchmarkResult:
    def __init__(self, report: ProfileReport):
        self.report, self.nc_latency = report, _Latency(report.device_time_ns)


class _Benchmarked:
    """A kernel whose calls are simulated with timing; the last result is ``.benchmark_result``."""

    def __init__(self, kernel: Kernel, options: dict):
        self.kernel, self.options, self.benchmark_result = kernel, options, None

    def __getitem__(self, grid: Any) -> "_Benchmarked":
        return _Benchmarked(self.kernel[grid], self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rep = _profile(self.kernel, self.options.get("chip"))(*args, **kwargs)
        self.benchmark_result = _BenchmarkResult(rep)
        return rep.outputs


def benchmark(kernel: Callable | None = None, **options: Any) -> Any:
    """``nki.benchmark(warmup=, iters=, ...)``: simulate with the timing model;
    ``f.benchmark_result.nc_latency.get_latency_percentile(50)`` is the modelled latency in microseconds."""
    if kernel is None:
        return lambda f: benchmark(f, **options)
    return _Benchmarked(jit(kernel), options)


def profile(func: Callable | None = None, chip: Any = None, **options: Any) -> Any:
    """Simulate with timing and return TorchNeuron's ``ProfileReport`` (NEFF/NTFF options are ignored)."""
    if func is None:
        return lambda f: profile(f, chip, **options)
    return _profile(jit(func), chip)


typing = _typing  # the same annotations module as the current generation (``nki.typing``)
compiler = types.ModuleType(__name__ + ".compiler", "``nki.compiler``: directives accepted as no-ops.")
compiler.skip_middle_end_transformations = lambda f: f
compiler.no_reorder = lambda *a, **k: None


class _AllocSpace:
    """``nki.compiler.sbuf`` / ``.psum``: placement allocators; ``mod_alloc(...)`` returns the plain buffer
    (the simulator places tensors itself, so addresses and buffer counts are hints only)."""

    def __init__(self, buffer: Any):
        self._buffer = buffer

    def mod_alloc(self, *_: Any, **__: Any) -> Any:
        return self._buffer

    alloc = mod_alloc


compiler.sbuf = _AllocSpace(_sbuf)
compiler.psum = _AllocSpace(_psum)
