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
A simulator error raised while the kernel runs is mapped to PyTorch's exception by its type
(``TORCH_ERRORS``: an index outside its table is an IndexError); other simulator errors (a
kernel that breaks a NeuronCore rule) stay ``SimulatorError``.

The host cost of a launch is kept small because eager ops launch one cached Program per call:
the program's per-core preparation (``NeuronCore.run_bound``), schedule, roofline and the stream-clock
duration of a launch are computed once (per run for a program with dynamic loops), and
``record_function`` ranges are opened only while a profiler is active.
Callers that have already validated their tensors can pass ``check=False`` and the arguments
as a list in slot order to skip the per-argument checks. The eager op layer takes the fast
path ``launch_slots``: no checks, no ``LaunchRecord`` made unless something reads or collects
it (``profiler.records()`` makes it from the launch's fields), and the output allocation and
host aliases in one C++ call (``slot_layout``, once per program), each slot aliased at its
slot's shape so that a contiguous tensor of the slot's element count needs no view first.

``with timing_only():`` launches schedule their kernels as usual (stream clocks, records, the
profiler) without executing the instructions: outputs keep whatever their memory held. The
schedule depends only on the program, never on the data, so this gives the simulated time of
shapes far too large to execute on the host in reasonable time (benchmarks).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping, Sequence

import torch

from torchneuron import _C
from torchneuron.runtime import device as _device
from torchneuron.runtime import profiler
from torchneuron.runtime.record import LaunchRecord
from torchneuron.sim import IndexOutOfRange, Program, SimulatorError, copies

# the simulator runs consecutive plain copies through the extension's batch runner (it cannot import it itself)
copies.use_copy_batch(_C._CopyBatch)

# simulator error type -> the PyTorch exception type a launch raises for it (same message)
TORCH_ERRORS: dict[type[SimulatorError], type[Exception]] = {IndexOutOfRange: IndexError}


class _Slots:
    """Per-program facts the launch path needs, computed once (cached on the Program)."""

    __slots__ = ("by_name", "names", "inputs", "input_set", "outputs", "layout")

    def __init__(self, program: Program):
        self.by_name = {s.name: s for s in program.args}
        self.names = tuple(s.name for s in program.args)
        self.inputs = tuple(s.name for s in program.args if s.kind == "input")
        self.input_set = frozenset(self.inputs)
        self.outputs = tuple((i, s) for i, s in enumerate(program.args) if s.kind == "output")
        self.layout = slot_layout(program)


def slot_layout(program: Program, output_shapes: Mapping[str, tuple] | None = None) -> Any:
    """How a launch binds ``program``'s slots (``_C._SlotLayout``): each slot's tensor aliased as host memory at
    the slot's shape, and each unbound output allocated on the device, in the shape ``output_shapes`` gives it
    (by slot name; the same element count) or else the slot's."""
    output_shapes = output_shapes or {}
    return _C._SlotLayout([list(s.shape) for s in program.args],
                          [s.dtype if s.kind == "output" else None for s in program.args],
                          [list(output_shapes.get(s.name, s.shape)) for s in program.args])


def _slots(program: Program) -> _Slots:
    meta = program.__dict__.get("_launch_slots")
    if meta is None:
        meta = program.__dict__["_launch_slots"] = _Slots(program)
    return meta


_known: dict[torch.device, int] = {}


def _known_devices() -> dict[torch.device, int]:
    """torch.device("neuron", i) -> i for every neuron device."""
    if not _known:
        _known.update({torch.device("neuron", i): i for i in range(_C._device_count())})
    return _known


def _check_args(program: Program, args: Mapping[str, Any], device: Any) -> int:
    """Check ``args`` against ``program``'s slots; return the device index they run on."""
    meta = _slots(program)
    slots = meta.by_name
    keys = args.keys()
    if not slots.keys() >= keys:
        unknown = [k for k in args if k not in slots]
        raise TypeError(f"launch of {program.name!r}: unexpected argument(s) {unknown}; the program's arguments "
                        f"are {list(meta.names)}")
    if not keys >= meta.input_set:
        missing = [n for n in meta.inputs if n not in args]
        raise TypeError(f"launch of {program.name!r}: missing input argument(s) "
                        + ", ".join(f"{n!r} ({slots[n].describe()})" for n in missing))
    index = None if device is None else _device.device_index(device)
    known = _known_devices()
    first = None
    valid = True  # whether index is known to name an existing device
    for name, t in args.items():
        slot = slots[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"launch of {program.name!r}: argument {name!r} must be a Tensor, not {type(t).__name__}")
        dev = t.device
        at = known.get(dev)  # (device.type costs more than the rest of the checks together)
        if at is None:
            if dev.type != "neuron":
                raise RuntimeError(f"launch of {program.name!r}: expected all tensors to be on a neuron device, "
                                   f"but argument {name!r} is on {t.device}")
            at = dev.index
            valid = False
        if index is None:
            index, first = at, name
        elif at != index:
            other = f"argument {first!r} is on neuron:{index}" if first else f"the launch targets neuron:{index}"
            raise RuntimeError(f"launch of {program.name!r}: expected all tensors to be on the same device, but "
                               f"argument {name!r} is on {t.device} and {other}")
        if t.dtype != slot.dtype:
            raise TypeError(f"launch of {program.name!r}: argument {name!r} expects dtype {slot.dtype}, "
                            f"got {t.dtype}")
        if t.shape != slot.shape:
            raise ValueError(f"launch of {program.name!r}: argument {name!r} expects shape {list(slot.shape)} "
                             f"({slot.describe()}), got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"launch of {program.name!r}: argument {name!r} must be contiguous "
                             f"(strides {t.stride()}); pass .contiguous()")
    return index if valid and index is not None else _device.device_index(index)


def _as_mapping(program: Program, args: Sequence[Any]) -> dict[str, Any]:
    """Slot-ordered arguments as a name mapping (``None``: leave the slot unbound)."""
    names = _slots(program).names
    if len(args) != len(names):
        raise TypeError(f"launch of {program.name!r}: expected a dict of argument tensors, or a list with one "
                        f"per slot {list(names)} in order; got a list of {len(args)}")
    return {n: t for n, t in zip(names, args) if t is not None}


def _check_stream(stream: Any, index: int) -> torch.Stream:
    if stream is None:
        return torch.accelerator.current_stream(index)
    if not isinstance(stream, torch.Stream):
        raise TypeError(f"stream must be a torch.Stream, not {type(stream).__name__}")
    if torch.device(stream.device).type != "neuron" or stream.device_index != index:
        raise RuntimeError(f"the launch runs on neuron:{index} but the stream is on {stream.device}")
    return stream


_current_stream = torch._C._accelerator_getStream
class _Mode(threading.local):
    """Per-thread launch mode (a class default: a missing thread-local attribute costs an exception)."""

    timing_only = False   # schedule without executing


_mode = _Mode()


@contextlib.contextmanager
def timing_only() -> Iterator[None]:
    """Within the block, this thread's launches advance clocks and records without executing instructions."""
    before = _mode.timing_only
    _mode.timing_only = True
    try:
        yield
    finally:
        _mode.timing_only = before


def launch(program: Program, args: Mapping[str, torch.Tensor] | Sequence[torch.Tensor | None], *,
           device: Any = None, stream: Any = None, name: str | None = None, op: str | None = None,
           check: bool = True) -> LaunchRecord:
    """Run ``program`` on a neuron device with ``args`` bound to its HBM argument slots.

    ``args`` maps slot names to neuron tensors of the slot's shape and dtype (contiguous), or
    lists them in slot order (``program.args``) with ``None`` for an output left unbound.
    Every ``input`` slot must be bound; an ``output`` slot left out is allocated on the device
    and returned in ``record.outputs``; ``scratch`` slots are allocated per launch. Outputs
    bound by the caller are written in place. ``device``: the device (default: the tensors'
    device, else the current device); ``stream``: the stream whose clock the launch advances
    (default: the device's current stream); ``name``: the kernel name in records and traces
    (default ``program.name``); ``op``: the op the kernel implements, for the profiler.

    ``check=False`` is the fast path for callers that guarantee what the checks verify (every
    input bound; tensors neuron, on one device, contiguous, of the slots' shapes and dtypes; a
    stream of that device): nothing is checked, and a wrong argument gives wrong results or
    an arbitrary error instead of PyTorch's exception. The default checks every argument.

    Returns the launch's LaunchRecord (also appended to ``torchneuron.runtime.profiler``).
    """
    if not isinstance(program, Program):
        raise TypeError(f"launch expects a torchneuron.sim.Program, not {type(program).__name__}")
    record, tensors = _annotated(program, args, device, stream, name, op, check)
    return record.with_outputs({slot.name: tensors[i] for i, slot in _slots(program).outputs})


def launch_slots(program: Program, tensors: list[torch.Tensor | None], device: int, op: str | None,
                 layout: Any = None) -> list:
    """The eager fast path: ``launch(program, tensors, device=device, op=op, check=False)`` for callers
    that need the tensors, not a record: returns ``tensors`` (slot order) with the unbound outputs
    allocated and the outputs written. A tensor may have another shape than its slot's if it is
    contiguous with the slot's element count (the kernel sees it at the slot's shape); ``layout``
    (``slot_layout``) allocates the unbound outputs in other shapes. The launch's record is made
    only when read (``profiler.records()``) or collected (``profiler.record()``, a recording
    torch.profiler session)."""
    if torch.autograd._profiler_enabled():  # a host range per launch in torch.profiler traces
        with torch.autograd.profiler.record_function(f"neuron::{program.name}"):
            return _launch_slots(program, tensors, device, op, layout)
    return _launch_slots(program, tensors, device, op, layout)


def _launch_slots(program: Program, tensors: list[torch.Tensor | None], device: int, op: str | None,
                  layout: Any) -> list:
    stream_id = _current_stream(device).stream_id
    start, end, overhead, device_time, schedule, spec = _execute(program, tensors, device, stream_id, layout)
    profiler._add_launch(program.name, op, device, stream_id, start, end, overhead, device_time, program, spec,
                         schedule)
    return tensors


def _annotated(program: Program, args: Any, device: Any, stream: Any, name: str | None, op: str | None,
               check: bool) -> tuple[LaunchRecord, list]:
    if torch.autograd._profiler_enabled():  # a host range per launch in torch.profiler traces
        with torch.autograd.profiler.record_function(f"neuron::{name or program.name}"):
            return _launch(program, args, device, stream, name, op, check)
    return _launch(program, args, device, stream, name, op, check)


def _launch(program: Program, args: Any, device: Any, stream: Any, name: str | None, op: str | None,
            check: bool) -> tuple[LaunchRecord, list]:
    """Run the launch; return its record (without outputs, as the profiler keeps it) and the slot tensors."""
    meta = _slots(program)
    if check:
        if not isinstance(args, dict) and not isinstance(args, Mapping):  # (the ABC check is slow)
            if not isinstance(args, (list, tuple)):
                raise TypeError(f"launch expects a dict of argument tensors, not {type(args).__name__}")
            args = _as_mapping(program, args)
        index = _check_args(program, args, device)
        stream = _check_stream(stream, index)
        tensors = [args.get(n) for n in meta.names]
    else:
        tensors = (list(args) if isinstance(args, (list, tuple))
                   else [args.get(n) for n in meta.names])
        if device is None:
            first = next((t for t in tensors if t is not None), None)
            index = _device.device_index(None) if first is None else first.get_device()
        else:
            index = device if type(device) is int else _device.device_index(device)
        if stream is None:   # (what torch.accelerator.current_stream returns, without its argument parsing)
            stream = _current_stream(index)
    start, end, overhead, device_time, schedule, spec = _execute(program, tensors, index, stream.stream_id)
    record = LaunchRecord._fast(
        name=name or program.name, op=op, device=index, stream=stream.stream_id, start_ns=start, end_ns=end,
        launch_overhead_ns=overhead, device_time_ns=device_time, program=program, spec=spec, outputs={},
        schedule=schedule)
    profiler._add(record)
    return record, tensors


def _execute(program: Program, tensors: list[torch.Tensor | None], index: int, stream_id: int,
             layout: Any = None) -> tuple:
    """Allocate ``tensors``' unbound outputs (in place; ``layout``: in the shapes it gives), run ``program`` on
    device ``index``'s core and advance the stream's clock: (start_ns, end_ns, launch overhead ns, device time
    ns, the schedule run, the chip spec)."""
    core = _device._cores.get(index)
    if core is None:
        core = _device.core(index)
    # unbound outputs live on the device, like any result; each slot bound as host memory at the slot's shape
    host = (layout or _slots(program).layout).bind(tensors, index)
    spec = core.spec
    with _device._locks[index]:
        try:
            if not _mode.timing_only:
                core.run_bound(program, host)
        except SimulatorError as e:
            torch_error = TORCH_ERRORS.get(type(e))
            if torch_error is None:
                raise
            raise torch_error(str(e)) from e
        cost = program.__dict__.get("_launch_cost")
        if cost is None or cost[0] is not spec:
            cost = _launch_cost(program, spec)
        _, schedule, device_time, overhead, duration = cost
        start = _C._stream_clock(index, stream_id)
        _C._advance_stream_clock(index, stream_id, duration)
    return start, start + duration, overhead, device_time, schedule, spec


def _launch_cost(program: Program, spec: Any) -> tuple:
    """(spec, schedule, device time ns, launch overhead ns, stream-clock duration ns) of a launch of ``program`` on
    ``spec``, kept on the program for the next launch unless its schedule depends on each run (dynamic loops)."""
    schedule = program.schedule(spec)
    device_time = schedule.device_time_ns
    overhead = float(spec.runtime.kernel_launch_overhead_ns)
    # the stream clock counts whole nanoseconds: the launch takes the nearest one
    cost = (spec, schedule, device_time, overhead, max(0, round(overhead + device_time)))
    if not program.dynamic:
        program.__dict__["_launch_cost"] = cost
    return cost
