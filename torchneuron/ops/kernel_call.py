"""Launching library kernels from eager ATen kernels.

``call_kernel(kernel, inputs, meta, outputs)`` traces ``kernel`` once per (device chip, input
shapes and dtypes, meta-parameters) and keeps the Program in a cache keyed the same way, then
launches it with ``torchneuron.runtime.launch`` on the inputs' device and current stream. The
caller may bind the kernel's outputs to existing tensors (``out=`` and in-place variants write
straight into them); the rest are allocated on the device.

The operands are contiguous (``torchneuron.ops.elementwise.dense`` makes them so).
``scalar_operand(v, dtype, device)`` turns a Python scalar into a (1, 1) device tensor, so a
kernel's code does not depend on scalar values (one Program serves every learning rate).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from torchneuron import _C, runtime
from torchneuron.runtime.launch import launch_slots

# cache key -> (Program, output slot names, the program's slot names in order)
_programs: dict[tuple, tuple[Any, tuple[str, ...], tuple[str, ...]]] = {}


def cache_size() -> int:
    """Number of kernel programs traced for eager ops so far."""
    return len(_programs)


def _output_slots(result: Any) -> tuple[str, ...]:
    if result is None:
        return ()
    if isinstance(result, str):
        return (result,)
    return tuple(s for r in result for s in _output_slots(r))


def call_kernel(kernel: Any, inputs: dict[str, torch.Tensor], meta: dict[str, Any] | None = None,
                outputs: Sequence[torch.Tensor | None] = (), op: str | None = None,
                device: torch.device | None = None) -> list[torch.Tensor]:
    """Launch ``kernel`` on ``inputs`` (contiguous neuron tensors on one device); return its outputs.

    ``meta``: the kernel's other (hashable) arguments; ``outputs``: tensors to write the kernel's
    outputs into, in return order (``None`` or a short list: allocate the rest); ``device``: the
    device of a kernel without inputs (else the inputs')."""
    index = _device_index(inputs, device)
    return launch_traced(_traced_on(kernel, inputs, meta, index), inputs, outputs, op, index)


def _device_index(inputs: dict[str, torch.Tensor], device: torch.device | None) -> int:
    if device is not None:
        return runtime.device_index(device)
    return next(iter(inputs.values())).get_device()   # (a neuron tensor's index, without making its torch.device)


def traced_kernel(kernel: Any, inputs: dict[str, torch.Tensor], meta: dict[str, Any] | None = None,
                  device: torch.device | None = None) -> tuple:
    """``call_kernel``'s (Program, output slot names, slot order) for these inputs and meta (traced once)."""
    # a caller that knows the device, shapes, dtypes and meta stay the same (an element-wise plan)
    # may keep the result and skip this key-building lookup with ``launch_traced``
    return _traced_on(kernel, inputs, meta, _device_index(inputs, device))


def _traced_on(kernel: Any, inputs: dict[str, torch.Tensor], meta: dict[str, Any] | None, index: int) -> tuple:
    """``traced_kernel`` on device ``index``."""
    meta = meta or {}
    # (a torch.Size hashes and compares as the tuple of its sizes)
    key = (kernel, index, tuple([(n, t.shape, t.dtype) for n, t in inputs.items()]), tuple(meta.items()))
    hit = _programs.get(key)
    if hit is None:
        traced = kernel.trace((), {**inputs, **meta}, runtime.core(index).spec)
        hit = _programs[key] = (traced.program, _output_slots(traced.result),
                                tuple(s.name for s in traced.program.args))
    return hit


def launch_traced(traced: tuple, inputs: dict[str, torch.Tensor], outputs: Sequence[torch.Tensor | None] = (),
                  op: str | None = None, index: int | None = None) -> list[torch.Tensor]:
    """Launch a ``traced_kernel`` result on inputs of the device (``index``), shapes and dtypes it was traced for."""
    program, slots, order = traced
    if index is None:
        index = next(iter(inputs.values())).get_device()
    args = dict(inputs)
    for slot, t in zip(slots, outputs):
        if t is not None:
            args[slot] = t
    # the arguments are what the trace saw (contiguous, one device): the unchecked fast path
    tensors = launch_slots(program, [args.get(n) for n in order], index, op)
    return [tensors[order.index(s)] if s not in args else args[s] for s in slots]


def scalar_operand(value: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (1, 1) neuron tensor holding ``value`` in ``dtype``, made for one launch and freed after it
    (the value is written straight into the device memory, as a host-to-device transfer would)."""
    t = torch.empty((1, 1), dtype=dtype, device=device)
    _C._alias_as_cpu(t).fill_(value)
    return t


def host_operand(values: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A neuron tensor of ``dtype`` holding the host tensor ``values``, for a kernel's operands (the values are
    written straight into the device memory, as a host-to-device transfer would, without a copy kernel)."""
    t = torch.empty(values.shape, dtype=dtype, device=device)
    _C._alias_as_cpu(t).copy_(values)
    return t
