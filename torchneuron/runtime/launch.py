"""Kernel launch: run a Program on a neuron device's core, on a stream's device clock.

``launch(program, {"a": a, "b": b, "out": out})`` binds each neuron tensor's memory to the
program's HBM argument slot of that name with no copy (the core reads and writes the
tensor's bytes through ``torchneuron._C._alias_as_cpu``), executes the program on the
device's simulated NeuronCore, and advances the stream's device clock by the kernel's
simulated device time plus the runtime's per-launch overhead
(``spec.runtime.kernel_launch_overhead_ns``, an ASSUMPTION of the spec table: 10 us). So a
sequence of small eager kernels is launch-bound, as on the real device.

Every argument is checked before anything runs; a bad argument raises the exception type
PyTorch raises for the same mistake (TypeError: not a tensor, wrong dtype, missing or
unknown argument; RuntimeError: wrong device or stream; ValueError: wrong shape or a
non-contiguous tensor) and leaves device memory and every stream clock as they were.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from torchneuron import _C
from torchneuron.runtime import device as _device
from torchneuron.runtime import profiler
from torchneuron.runtime.record import LaunchRecord
from torchneuron.sim import Program


def _check_args(program: Program, args: Mapping[str, Any], device: Any) -> int:
    """Check ``args`` against ``program``'s slots; return the device index they run on."""
    where = f"launch of {program.name!r}"
    slots = {s.name: s for s in program.args}
    unknown = [k for k in args if k not in slots]
    if unknown:
        raise TypeError(f"{where}: unexpected argument(s) {unknown}; the program's arguments are "
                        f"{[s.name for s in program.args]}")
    missing = [s.name for s in program.args if s.kind == "input" and s.name not in args]
    if missing:
        raise TypeError(f"{where}: missing input argument(s) "
                        + ", ".join(f"{n!r} ({slots[n].describe()})" for n in missing))
    index = None if device is None else _device.device_index(device)
    first = None
    for name, t in args.items():
        slot = slots[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: argument {name!r} must be a Tensor, not {type(t).__name__}")
        if t.device.type != "neuron":
            raise RuntimeError(f"{where}: expected all tensors to be on a neuron device, but argument "
                               f"{name!r} is on {t.device}")
        if index is None:
            index, first = t.device.index, name
        elif t.device.index != index:
            other = f"argument {first!r} is on neuron:{index}" if first else f"the launch targets neuron:{index}"
            raise RuntimeError(f"{where}: expected all tensors to be on the same device, but argument "
                               f"{name!r} is on {t.device} and {other}")
        if t.dtype != slot.dtype:
            raise TypeError(f"{where}: argument {name!r} expects dtype {slot.dtype}, got {t.dtype}")
        if tuple(t.shape) != slot.shape:
            raise ValueError(f"{where}: argument {name!r} expects shape {list(slot.shape)} "
                             f"({slot.describe()}), got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{where}: argument {name!r} must be contiguous (strides {t.stride()}); "
                             f"pass .contiguous()")
    return _device.device_index(index)


def _check_stream(stream: Any, index: int) -> torch.Stream:
    if stream is None:
        return torch.accelerator.current_stream(index)
    if not isinstance(stream, torch.Stream):
        raise TypeError(f"stream must be a torch.Stream, not {type(stream).__name__}")
    if torch.device(stream.device).type != "neuron" or stream.device_index != index:
        raise RuntimeError(f"the launch runs on neuron:{index} but the stream is on {stream.device}")
    return stream


def launch(program: Program, args: Mapping[str, torch.Tensor], *, device: Any = None, stream: Any = None,
           name: str | None = None, op: str | None = None) -> LaunchRecord:
    """Run ``program`` on a neuron device with ``args`` bound to its HBM argument slots.

    ``args`` maps slot names to neuron tensors of the slot's shape and dtype (contiguous).
    Every ``input`` slot must be bound; an ``output`` slot left out is allocated on the device
    and returned in ``record.outputs``; ``scratch`` slots are allocated per launch. Outputs
    bound by the caller are written in place. ``device``: the device (default: the tensors'
    device, else the current device); ``stream``: the stream whose clock the launch advances
    (default: the device's current stream); ``name``: the kernel name in records and traces
    (default ``program.name``); ``op``: the op the kernel implements, for the profiler.

    Returns the launch's LaunchRecord (also appended to ``torchneuron.runtime.profiler``).
    """
    if not isinstance(program, Program):
        raise TypeError(f"launch expects a torchneuron.sim.Program, not {type(program).__name__}")
    if not isinstance(args, Mapping):
        raise TypeError(f"launch expects a dict of argument tensors, not {type(args).__name__}")
    name = name or program.name
    with torch.autograd.profiler.record_function(f"neuron::{name}"):
        index = _check_args(program, args, device)
        stream = _check_stream(stream, index)
        core = _device.core(index)
        dev = torch.device("neuron", index)
        tensors = dict(args)
        for slot in program.args:  # unbound outputs live on the device, like any result
            if slot.kind == "output" and slot.name not in tensors:
                tensors[slot.name] = torch.empty(slot.shape, dtype=slot.dtype, device=dev)
        host = {k: _C._alias_as_cpu(t.detach()) for k, t in tensors.items()}
        with _device.core_lock(index):
            report = core.run(program, host)
            overhead = float(core.spec.runtime.kernel_launch_overhead_ns)
            # the stream clock counts whole nanoseconds: the launch takes the nearest one
            duration = max(0, round(overhead + report.device_time_ns))
            start = _C._stream_clock(index, stream.stream_id)
            _C._advance_stream_clock(index, stream.stream_id, duration)
        record = LaunchRecord(
            name=name, op=op, device=index, stream=stream.stream_id, start_ns=start, end_ns=start + duration,
            launch_overhead_ns=overhead, device_time_ns=report.device_time_ns,
            engine_busy_ns=dict(report.engine_busy_ns), flops=report.flops,
            hbm_bytes_read=report.hbm_bytes_read, hbm_bytes_written=report.hbm_bytes_written,
            instructions=report.instructions, program=program, spec=core.spec,
            outputs={s.name: tensors[s.name] for s in program.args if s.kind == "output"})
        profiler._add(record)
    return record
