"""Launching library kernels from eager ATen kernels.

``call_kernel(kernel, inputs, meta, outputs)`` traces ``kernel`` once per (device chip, input
shapes and dtypes, meta-parameters) and keeps the Program in a cache keyed the same way, then
launches it with ``torchneuron.runtime.launch`` on the inputs' device and current stream. The
caller may bind the kernel's outputs to existing tensors (``out=`` and in-place variants write
straight into them); the rest are allocated on the device.

The operands are contiguous (``torchneuron.ops.elementwise.dense`` makes them so).
``scalar_operand(v, dtype, device)`` turns a Python scalar into a (1, 1) device tensor, so a
kernel's code does not depend on scalar values (one Program serves every learning rate).

An op called again and again with the same signature (a training step's) can skip even the trace key and the
slot names: a ``PlanCache`` keeps, per signature the caller chooses, a ``Plan`` (the traced Program and which of
the caller's operands binds each slot) that ``Plan.launch`` replays with ``launch_slots``.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Mapping, Sequence

import torch

from torchneuron import _C, runtime
from torchneuron.ops.base import remember
from torchneuron.runtime.launch import launch_slots, slot_layout

# cache key -> (Program, output slot names, the program's slot names in order, each output's slot index)
_programs: dict[tuple, tuple[Any, tuple[str, ...], tuple[str, ...], tuple[int, ...]]] = {}


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
    """``call_kernel``'s (Program, output slot names, slot order, each output's slot index) for these inputs and
    meta (traced once)."""
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
        slots, order = _output_slots(traced.result), tuple(s.name for s in traced.program.args)
        hit = _programs[key] = (traced.program, slots, order, tuple(order.index(s) for s in slots))
    return hit


def launch_traced(traced: tuple, inputs: dict[str, torch.Tensor], outputs: Sequence[torch.Tensor | None] = (),
                  op: str | None = None, index: int | None = None) -> list[torch.Tensor]:
    """Launch a ``traced_kernel`` result on inputs of the device (``index``), shapes and dtypes it was traced for."""
    program, slots, order, at = traced
    if index is None:
        index = next(iter(inputs.values())).get_device()
    args = inputs
    if outputs:
        args = dict(inputs)
        for slot, t in zip(slots, outputs):
            if t is not None:
                args[slot] = t
    # the arguments are what the trace saw (contiguous, one device): the unchecked fast path; the launch returns
    # the slots' tensors, the outputs bound or allocated
    tensors = launch_slots(program, [args.get(n) for n in order], index, op)
    return [tensors[i] for i in at]


class Plan:
    """A traced Program replayed on a caller's operands: which operand binds each slot, the launch's output layout,
    the slots of the results it returns, and whatever else the caller needs at replay (``extra``)."""

    __slots__ = ("program", "roles", "layout", "results", "extra", "_bind", "_pick")

    def __init__(self, program: Any, roles: tuple[int | None, ...], layout: Any, results: tuple[int, ...],
                 extra: Any):
        self.program = program
        self.roles = roles        # per slot in program order: the index of its operand, None: allocated by the launch
        self.layout = layout      # launch_slots' layout (the allocated outputs' shapes), None: the slots' own
        self.results = results    # the slots of the kernel's outputs, in its return order
        self.extra = extra
        # the slots' tensors gathered from (*operands, None) in one C call (index -1: an allocated output's None),
        # and the results from the launch's slots: a 56-slot foreach launch binds in ~1 us instead of ~4
        self._bind = _gather([-1 if r is None else r for r in roles])
        self._pick = _gather(list(results))

    def launch(self, operands: Sequence[torch.Tensor], index: int, op: str | None) -> tuple[torch.Tensor, ...]:
        """Bind ``operands`` (contiguous, of the element counts, dtypes and device ``index`` the plan was traced
        for) to their slots unchecked and launch; return the kernel's outputs."""
        return self._pick(launch_slots(self.program, list(self._bind((*operands, None))), index, op, self.layout))


def _gather(indices: list[int]) -> Callable[[Sequence], tuple]:
    """A function taking a sequence's items at ``indices`` as a tuple (``operator.itemgetter``, whose one-index
    form returns the item itself, made to return a tuple whatever the count)."""
    if len(indices) == 1:
        at = indices[0]
        return lambda items: (items[at],)
    return operator.itemgetter(*indices) if indices else (lambda items: ())


class PlanCache:
    """Plans by a key naming everything their trace depends on (device, dtypes, shapes, meta), traced once by a
    first call through ``call_kernel``'s path and replayed by later ones; past ``limit`` plans it starts over (a
    program whose shapes keep changing must not grow it without bound)."""

    def __init__(self, limit: int = 1024):
        self._plans: dict[tuple, Plan] = {}
        self._limit = limit

    def get(self, key: tuple | None) -> Plan | None:
        """The plan kept under ``key`` (None: none, or no key)."""
        return self._plans.get(key) if key is not None else None

    def keep(self, key: tuple, traced: tuple, roles: Mapping[str, int],
             output_shapes: Sequence[tuple] | None = None, extra: Any = None) -> Plan:
        """Keep and return the plan of ``traced`` (a ``traced_kernel`` result) under ``key``: ``roles`` gives the
        operand index of each bound slot by name (a slot it leaves out is an output the launch allocates);
        ``output_shapes``: the shapes the launch allocates the outputs in, in return order (default: the slots')."""
        program, out_slots, order, at = traced
        layout = None if output_shapes is None else slot_layout(program, dict(zip(out_slots, output_shapes)))
        plan = Plan(program, tuple(roles.get(n) for n in order), layout, at, extra)
        return remember(self._plans, key, plan, self._limit)

    def keys(self) -> list[tuple]:
        """The keys of the plans kept."""
        return list(self._plans)


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
