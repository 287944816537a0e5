"""TorchNeuron's NKI-compatible kernel language (current ``nki`` generation) on the NeuronCore simulator.

    from torchneuron import nki
    import torchneuron.nki.language as nl, torchneuron.nki.isa as nisa

    @nki.jit
    def kernel(a, b): ...          # traced once per (shapes, dtypes, meta-parameters) into a Program

    out = kernel(a_np, b_np)              # simulate
    rep = nki.profile(kernel)(a_np, b_np)  # simulate with timing: rep.device_time_ns, rep.to_chrome_trace(...)
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from torchneuron.nki import collectives, isa, language, multicore, typing
from torchneuron.nki.profile import ProfileReport, make_report
from torchneuron.nki.tracing import NkiTensor, Trace, set_current
from torchneuron.sim import NeuronCore, Program, SimulatorError
from torchneuron.sim.specs import ChipSpec, chip_spec

__all__ = ["jit", "simulate", "profile", "Kernel", "ProfileReport", "SimulatorError", "install_import_aliases",
           "isa", "language", "typing", "collectives"]


def resolve_chip(chip: str | ChipSpec | None = None) -> ChipSpec:
    """The chip: the argument, else ``TORCHNEURON_CHIP``, else trn2."""
    if isinstance(chip, ChipSpec):
        return chip
    return chip_spec((chip or os.environ.get("TORCHNEURON_CHIP") or "trn2").strip().lower())


def _core(spec: ChipSpec) -> NeuronCore:
    return multicore.chip_cores(spec, 1)[0]  # core 0 of the chip multi-core launches use


def _is_array(v: Any) -> bool:
    return isinstance(v, (np.ndarray, torch.Tensor))


def _to_torch(v: Any) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
    return t if t.is_contiguous() else t.contiguous()


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    # NumPy has no bfloat16/fp8 (without ml_dtypes): those come back widened to float32, exactly
    return t.numpy() if t.dtype in (torch.float32, torch.float16, torch.int32, torch.int8, torch.uint8,
                                    torch.int16, torch.bool) else t.float().numpy()


@dataclass(frozen=True)
class Traced:
    """A kernel traced for one argument signature: its Program, inputs and how to rebuild its return value."""

    program: Program
    inputs: tuple[str, ...]      # parameter names bound to HBM inputs
    result: Any                  # the return structure with slot names in place of tensors
    constants: dict = field(default_factory=dict)  # nl.shared_constant slots -> their data (bound every run)
    results: tuple = ()          # per rank of a multi-rank launch (``Kernel.ranks``): its return structure


class Kernel:
    """A ``@nki.jit`` kernel: traced per (shapes, dtypes, meta-parameters, grid, chip) and cached."""

    tensor_cls: type = NkiTensor  # the tensors a trace makes (the legacy front-end uses its own subclass)

    def __init__(self, fn: Callable, grid: tuple[int, ...] = (), cache: dict | None = None, world: int = 1,
                 **options: Any):
        self.fn, self.grid, self.world, self.options = fn, grid, world, options
        self.cache: dict = {} if cache is None else cache
        self.trace_count = 0 if cache is None else None  # counted on the root kernel
        self._root = self
        functools.update_wrapper(self, fn)

    placement: tuple[int, ...] | None = None  # the core of each instance (row-major) when the grid names them

    def __getitem__(self, grid: int | tuple[int, ...]) -> "Kernel":
        """The same kernel launched on an SPMD grid: ``kernel[2](...)`` (LNC=2), ``kernel[gx, gy](...)``."""
        dims = grid if isinstance(grid, tuple) else (grid,)
        k = type(self)(self.fn, tuple(int(d) for d in dims), self.cache, self.world, **self.options)
        k._root = self._root
        k.placement = _placement(dims)
        return k

    def ranks(self, world: int) -> "Kernel":
        """The kernel launched on ``world`` collective ranks at once (``nki.collectives``): each rank runs its
        own instances on its own NeuronCores with its own HBM tensors. Every array argument holds one slice per
        rank along a leading dim of size ``world``; each output comes back stacked the same way."""
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"ranks(world): world is a positive number of ranks, got {world!r}")
        k = type(self)(self.fn, self.grid, self.cache, world, **self.options)
        k._root = self._root
        k.placement = self.placement
        return k

    def _bind(self, args: tuple, kwargs: dict) -> inspect.BoundArguments:
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        return bound

    def trace(self, args: tuple, kwargs: dict, spec: ChipSpec) -> Traced:
        """The traced program for these arguments (from the cache when seen before)."""
        bound = self._bind(args, kwargs)
        key = (self.grid, self.world, self.placement, spec.name, tuple(
            (n, ("array", tuple(v.shape), str(v.dtype)) if _is_array(v) else _hashable(v))
            for n, v in bound.arguments.items()))
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self._trace(bound, spec)
            self._root.trace_count += 1
        return hit

    def _trace(self, bound: inspect.BoundArguments, spec: ChipSpec) -> Traced:
        # one trace per SPMD instance of each rank (each instance runs on its own NeuronCore); the traces share
        # the launch's HBM slots, named per rank when there are several ranks
        inputs = tuple(n for n, v in bound.arguments.items() if _is_array(v))
        for n in inputs if self.world > 1 else ():
            shape = tuple(bound.arguments[n].shape)
            if not shape or shape[0] != self.world:
                raise ValueError(f"kernel {self.fn.__name__!r} launched on {self.world} ranks: argument {n!r} must "
                                 f"hold one slice per rank along dim 0 (size {self.world}), got shape {list(shape)}")
        traces: list[Trace] = []
        results = []
        try:
            for rank in range(self.world):
                result = None
                for pid in np.ndindex(*self.grid) if self.grid else [()]:
                    trace = Trace(spec, self.grid, self.tensor_cls, tuple(int(i) for i in pid),
                                  traces[0] if traces else None, rank, self.world)
                    traces.append(trace)
                    set_current(trace)
                    call = {n: (trace.argument(n, v.shape[1:] if self.world > 1 else v.shape, _to_torch(v).dtype)
                                if n in inputs else v) for n, v in bound.arguments.items()}
                    result = _slots(self.fn(**call))
                results.append(result)
        finally:
            set_current(None)
        outs = [s for r in results for s in _flatten(r)]
        name = self.fn.__name__
        if results[-1] is None:
            _warn_unreturned(name, traces)
        constants = dict(traces[0].constants)
        if len(traces) == 1:
            return Traced(traces[0].program(name, outs), inputs, result, constants)
        program = multicore.launch_program(traces, name, outs, self.world, self.placement)
        return Traced(program, inputs, results[-1], constants, tuple(results) if self.world > 1 else ())

    def run(self, args: tuple, kwargs: dict, chip: str | ChipSpec | None = None, timed: bool = False):
        """Trace (or reuse) and simulate; returns (outputs in the caller's array kind, RunReport, Traced)."""
        spec = resolve_chip(chip or self.options.get("platform_target"))  # (trn3-only kernels name their chip)
        traced = self.trace(args, kwargs, spec)
        bound = self._bind(args, kwargs).arguments
        arrays = {n: bound[n] for n in traced.inputs}
        if self.world > 1:  # rank r's inputs are the slices [r] (views: a kernel's writes reach the caller's arrays)
            bindings = {f"r{r}.{n}": _to_torch(v)[r] for n, v in arrays.items() for r in range(self.world)}
        else:
            bindings = {n: _to_torch(v) for n, v in arrays.items()}
        bindings.update(traced.constants)
        if isinstance(traced.program, multicore.LaunchProgram):
            report = multicore.run(traced.program, bindings, spec, timed=timed)
        else:
            report = _core(spec).run(traced.program, bindings, timed=timed)
        as_numpy = not arrays or any(isinstance(v, np.ndarray) for v in arrays.values())
        convert = _to_numpy if as_numpy else (lambda t: t)
        if traced.results:  # one return structure per rank: stacked along a new leading dim
            outputs = _rebuild(traced.results[0], lambda s: convert(torch.stack(
                [report.bindings[f"r{r}.{s.split('.', 1)[1]}"] for r in range(self.world)])))
        else:
            outputs = _rebuild(traced.result, lambda s: convert(report.bindings[s]))
        return outputs, report, traced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Simulate the kernel on NumPy arrays or CPU tensors and return its outputs; on neuron
        tensors, launch it on their device's current stream (``torchneuron.nki.on_device``).
        Called inside another kernel's trace, it runs inline on that trace (tiles in, tiles out)."""
        from torchneuron.nki import on_device
        from torchneuron.nki import tracing as _tracing
        if getattr(_tracing._state, "trace", None) is not None and not self.grid:
            return self.fn(*args, **kwargs)  # called from a kernel being traced: inline (a sub-kernel helper)
        if on_device.has_neuron_tensor(args, kwargs):
            return on_device.call_on_device(self, args, kwargs)
        return self.run(args, kwargs)[0]


def _placement(dims: tuple) -> tuple[int, ...] | None:
    """The core of each instance of a grid whose dims spread instances over cores (the earlier generation's
    ``nl.spmd_dim`` / ``nl.nc`` factors, which carry ``cores``), row-major; None for plain grids."""
    spread = [(k, d) for k, d in enumerate(dims) if getattr(d, "cores", 1) > 1]
    if not spread:
        return None
    cores = []
    for pid in np.ndindex(*[int(d) for d in dims]):
        core = 0
        for k, d in spread:  # the dims' core indices combined row-major
            core = core * d.cores + d.core(pid[k])
        cores.append(core)
    return tuple(cores)


def _warn_unreturned(name: str, traces: list[Trace]) -> None:
    """Warn when a kernel returns nothing although it wrote shared-HBM tensors it allocated: their values
    are discarded (a forgotten ``return out``). Kernels that write into their inputs return nothing legitimately."""
    written = {f.memory.removeprefix("hbm:") for trace in traces for instr in trace.instructions
               for f in instr.writes() if f.memory.startswith("hbm:")}
    lost = sorted(n for n, kind in traces[0].hbm_kinds.items() if kind == "shared" and n in written
                  and "psum_spill" not in n)
    if lost:
        warnings.warn(f"kernel {name!r} returns nothing, but it writes the nl.shared_hbm tensor(s) "
                      f"{', '.join(lost)} it allocated: their values are discarded; return them (`return out`)",
                      UserWarning, stacklevel=4)


def _hashable(v: Any) -> Any:
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


def _slots(result: Any) -> Any:
    """Replace returned HBM tensors by their slot names (tuples/lists kept)."""
    if isinstance(result, NkiTensor):
        a = result.access
        if a.on_chip or result.base is not None:
            raise SimulatorError("a kernel returns whole HBM tensors allocated with nl.ndarray(..., "
                                 f"buffer=nl.shared_hbm); got {result!r}")
        return a.memory.removeprefix("hbm:")
    if isinstance(result, (tuple, list)):
        return type(result)(_slots(r) for r in result)
    if result is None:
        return None
    raise SimulatorError(f"a kernel returns HBM tensors (or a tuple of them), not {type(result).__name__}")


def _flatten(result: Any) -> list[str]:
    if isinstance(result, str):
        return [result]
    if isinstance(result, (tuple, list)):
        return [s for r in result for s in _flatten(r)]
    return []


def _rebuild(result: Any, get: Callable[[str], Any]) -> Any:
    if isinstance(result, str):
        return get(result)
    if isinstance(result, (tuple, list)):
        return type(result)(_rebuild(r, get) for r in result)
    return None


def jit(fn: Callable | None = None, **options: Any) -> Kernel | Callable[[Callable], Kernel]:
    """``@nki.jit`` / ``@nki.jit(...)``: make a traced, cached kernel (options such as ``mode`` are accepted)."""
    if fn is None:
        return lambda f: Kernel(f, **options)
    return fn if isinstance(fn, Kernel) else Kernel(fn, **options)


def simulate(kernel: Callable) -> Callable[..., Any]:
    """``nki.simulate(kernel)(*arrays)``: run the kernel on the simulator and return its outputs."""
    k = jit(kernel)
    return lambda *args, **kwargs: k.run(args, kwargs)[0]


def profile(kernel: Callable, chip: str | ChipSpec | None = None) -> Callable[..., ProfileReport]:
    """``nki.profile(kernel, chip)(*args)``: simulate with the timing model and return a ProfileReport.

    On neuron tensors the kernel is launched through the runtime exactly as calling it would
    (``on_device.launch_on_device``: the device's current stream advances by device time plus launch
    overhead, one LaunchRecord) and the report is built from that launch record; ``chip``, if given,
    must then be the device's chip. Outputs are neuron tensors."""
    k = jit(kernel)

    def run(*args: Any, **kwargs: Any) -> ProfileReport:
        from torchneuron.nki import on_device
        from torchneuron.nki import tracing as _tracing
        if getattr(_tracing._state, "trace", None) is not None and not k.grid:
            return k.fn(*args, **kwargs)  # called from a kernel being traced: inline (a sub-kernel helper)
        if on_device.has_neuron_tensor(args, kwargs):
            from torchneuron.nki.profile import report_from_launch
            outputs, record = on_device.launch_on_device(k, args, kwargs, chip=chip)
            return report_from_launch(outputs, record)
        spec = resolve_chip(chip or k.options.get("platform_target"))
        outputs, report, traced = k.run(args, kwargs, spec, timed=True)
        return make_report(outputs, report, traced.program, spec)
    return run


_ALIASES = {"nki": "torchneuron.nki", "nki.language": "torchneuron.nki.language", "nki.isa": "torchneuron.nki.isa",
            "nki.typing": "torchneuron.nki.typing", "nki.collectives": "torchneuron.nki.collectives"}
_LEGACY_ALIASES = {"neuronxcc.nki": "torchneuron.nki.legacy", "neuronxcc.nki.language": "torchneuron.nki.legacy.language",
                   "neuronxcc.nki.isa": "torchneuron.nki.legacy.isa"}


def install_import_aliases() -> None:
    """Make ``import nki`` (``nki.language``, ``nki.isa``, ``nki.typing``) resolve to TorchNeuron's current generation and
    ``neuronxcc.nki`` (``.language``, ``.isa``, ``.typing``, ``.compiler``) to the earlier one
    (``torchneuron.nki.legacy``). Refuses if a real NKI or ``neuronxcc`` is already imported."""
    import importlib
    import types
    legacy = importlib.import_module("torchneuron.nki.legacy")
    aliases = {**_ALIASES, **_LEGACY_ALIASES}
    for alias, target in aliases.items():
        mod = sys.modules.get(alias)
        if mod is not None and mod is not sys.modules[target]:
            raise ImportError(f"cannot alias {alias!r} to {target!r}: a real NKI installation is already imported "
                              f"({getattr(mod, '__file__', mod)}); run in a process that has not imported it")
    root = sys.modules.get("neuronxcc")
    if root is not None and not getattr(root, "__torchneuron_alias__", False):
        raise ImportError("cannot alias 'neuronxcc': a real neuronxcc is already imported "
                          f"({getattr(root, '__file__', root)}); run in a process that has not imported it")
    for alias, target in aliases.items():
        sys.modules[alias] = sys.modules[target]
    if root is None:
        root = types.ModuleType("neuronxcc", "TorchNeuron alias: neuronxcc.nki is torchneuron.nki.legacy")
        root.__path__ = []
        root.__torchneuron_alias__ = True
        sys.modules["neuronxcc"] = root
    root.nki = legacy
    sys.modules["neuronxcc.nki.typing"] = legacy.typing
    sys.modules["neuronxcc.nki.compiler"] = legacy.compiler


# NKI kernels as PyTorch custom ops (imported last: torch_op builds on Kernel and jit above)
from torchneuron.nki.torch_op import custom_op  # noqa: E402
__all__.append("custom_op")
