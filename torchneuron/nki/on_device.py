"""Running ``@nki.jit`` kernels on neuron tensors.

When a kernel is called with ``torch.Tensor``s on a ``neuron`` device, it is traced for the
device's chip (cached per shapes, dtypes, meta-parameters and grid, as on the CPU path) and
launched with ``torchneuron.runtime.launch`` on the tensors' device and that device's current
stream: inputs are bound zero-copy, outputs are allocated on the device and returned as neuron
tensors, and the stream's device clock advances by the kernel's simulated time plus the launch
overhead (one ``LaunchRecord`` per call in ``torchneuron.runtime.profiler``). ``nki.profile`` on
neuron tensors takes the same path (``launch_on_device``) and reports from the launch record.

Every array argument must then be a neuron tensor on one device: a CPU tensor or a NumPy array
mixed in raises ``RuntimeError`` (PyTorch's "Expected all tensors to be on the same device").
Non-contiguous tensors are made contiguous first (on the device); if the kernel writes into such
an input, the result is copied back into the caller's tensor.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchneuron import runtime


def has_neuron_tensor(args: tuple, kwargs: dict) -> bool:
    """Whether any top-level argument is a tensor on a neuron device."""
    return any(isinstance(v, torch.Tensor) and v.device.type == "neuron" for v in (*args, *kwargs.values()))


def _device_of(kernel_name: str, arrays: dict[str, Any]) -> int:
    """The one neuron device index of ``arrays``; RuntimeError (like PyTorch) when they are mixed."""
    neuron = [(n, v.device) for n, v in arrays.items() if isinstance(v, torch.Tensor) and v.device.type == "neuron"]
    first_name, first = neuron[0]
    for name, v in arrays.items():
        where = "a NumPy array (host memory)" if isinstance(v, np.ndarray) else str(v.device)
        if where != str(first):
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{first} and {where}! (arguments {first_name!r} and {name!r} of kernel "
                               f"{kernel_name!r})")
    return runtime.device_index(first)


def call_on_device(kernel: Any, args: tuple, kwargs: dict, *, stream: Any = None, op: str | None = None) -> Any:
    """Trace ``kernel`` (a ``torchneuron.nki.Kernel``) for ``args`` and launch it on their neuron device.

    Returns the kernel's return structure with neuron tensors in place of its HBM outputs.
    ``stream``: the stream whose clock advances (default: the device's current stream);
    ``op``: the op name recorded in the launch record.
    """
    return launch_on_device(kernel, args, kwargs, stream=stream, op=op)[0]


def launch_on_device(kernel: Any, args: tuple, kwargs: dict, *, stream: Any = None,
                     op: str | None = None, chip: Any = None) -> tuple[Any, runtime.LaunchRecord]:
    """``call_on_device`` that also returns the launch's ``LaunchRecord`` (what ``nki.profile`` reports).

    ``chip``: if given (a name or ChipSpec), it must be the device's chip, else ValueError (a launch
    runs on the device's modelled chip; profile on CPU tensors to model another one).
    """
    from torchneuron.nki import _is_array, _rebuild  # the kernel-language package (imported lazily: no cycle)

    name = kernel.fn.__name__
    bound = kernel._bind(args, kwargs).arguments
    arrays = {n: v for n, v in bound.items() if _is_array(v)}
    index = _device_of(name, arrays)
    spec = runtime.core(index).spec
    if chip is not None:
        from torchneuron.nki import resolve_chip
        want = resolve_chip(chip)
        if want.name != spec.name:
            raise ValueError(f"kernel {name!r}: its tensors are on neuron:{index}, a {spec.name} device, but "
                             f"chip={want.name!r} was asked for; profile CPU tensors to model another chip")
    # contiguous device copies of strided inputs (launch binds memory zero-copy: it needs dense tensors)
    dense = {n: (v if v.is_contiguous() else v.contiguous()) for n, v in arrays.items()}
    call = {**bound, **dense}
    if getattr(kernel, "world", 1) > 1:
        raise NotImplementedError(f"kernel {name!r}: a launch on several collective ranks (.ranks(n)) runs on NumPy "
                                  f"arrays or CPU tensors; on neuron tensors each process launches its own rank")
    traced = kernel.trace((), call, spec)
    launch_args = {n: dense[n].detach() for n in traced.inputs}
    device = torch.device("neuron", index)
    launch_args.update({slot: torch.as_tensor(data).to(device) for slot, data in traced.constants.items()})
    record = runtime.launch(traced.program, launch_args, device=index, stream=stream, name=name, op=op)
    for n, v in arrays.items():  # a kernel may store into an input: keep the caller's strided tensor in step
        if dense[n] is not v and _is_written(traced.program, n):
            with torch.no_grad():
                v.copy_(dense[n])
    return _rebuild(traced.result, lambda s: record.outputs[s] if s in record.outputs else dense[s]), record


def _is_written(program: Any, slot: str) -> bool:
    """Whether any instruction of ``program`` writes the HBM argument ``slot``."""
    memory = f"hbm:{slot}"
    return any(f.memory == memory for i in program.instructions for f in i.writes())
