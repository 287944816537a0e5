"""Streams and events on the simulated device clock.

Work on neuron executes when it is launched, in stream order, so waiting never
blocks. Each stream carries a device clock in simulated nanoseconds, advanced by the
device time of the kernels queued on it; an event records its stream's clock, and
``Event.elapsed_time`` is the difference in milliseconds. While every op runs through
the CPU fallback no device time accrues, so elapsed times are 0.0.
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron.neuron._utils import resolved_index


class _NeuronKind(type):
    """isinstance(x, torch.neuron.Stream) holds for any torch.Stream on a neuron device.

    Streams and events are plain torch.Stream / torch.Event objects: several torch
    methods accept only those exact types, so a subclass would not be usable.
    """

    base: type

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, cls.base) and torch.device(obj.device).type == "neuron"


class Stream(metaclass=_NeuronKind):
    """An in-order queue of work on a neuron device (a ``torch.Stream``)."""

    base = torch.Stream

    def __new__(cls, device: Any = None, priority: int = 0) -> torch.Stream:
        return torch.Stream(torch.device("neuron", resolved_index(device)), priority=priority)


class Event(metaclass=_NeuronKind):
    """A marker in a stream (a ``torch.Event``); ``elapsed_time`` is simulated device time."""

    base = torch.Event

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:
        return torch.Event("neuron", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def stream_clock_ns(stream: torch.Stream) -> int:
    """A stream's device clock, in simulated nanoseconds."""
    from torchneuron import _C

    return _C._stream_clock(stream.device_index, stream.stream_id)


def current_stream(device: Any = None) -> torch.Stream:
    """The stream work on ``device`` is queued to now."""
    return torch.accelerator.current_stream(resolved_index(device))


def default_stream(device: Any = None) -> torch.Stream:
    """The default stream of ``device``."""
    current = torch.accelerator.current_stream(resolved_index(device))
    return torch.Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)


def synchronize(device: Any = None) -> None:
    """Wait for all work on ``device``."""
    torch.accelerator.synchronize(resolved_index(device))


class StreamContext:
    """Context manager that makes ``stream`` current on its device (None: no-op).

    Like ``torch.cuda.StreamContext``: while active, the stream's device is the current
    device; on exit the previous stream of that device and the previous current device
    (with its stream) are restored.
    """

    def __init__(self, stream: Stream | None) -> None:
        self.stream = stream
        self.src_previous: torch.Stream | None = None  # current stream of the current device
        self.dst_previous: torch.Stream | None = None  # current stream of the stream's device

    def __enter__(self) -> Stream | None:
        if self.stream is not None:
            self.src_previous = torch.accelerator.current_stream()
            if self.src_previous.device_index != self.stream.device_index:
                self.dst_previous = torch.accelerator.current_stream(self.stream.device_index)
            # set_stream also makes the stream's device the current device.
            torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        if self.dst_previous is not None:
            torch.accelerator.set_stream(self.dst_previous)
        if self.src_previous is not None:
            torch.accelerator.set_stream(self.src_previous)  # restores the current device too
        self.src_previous = self.dst_previous = None


def stream(stream: Stream | None) -> StreamContext:
    """``with torch.neuron.stream(s):`` queues work to ``s``."""
    return StreamContext(stream)


def _record_stream(tensor: torch.Tensor, stream: torch.Stream) -> None:
    """``Tensor.record_stream`` on neuron: nothing to defer, since work runs in stream order
    when it is launched and memory is reused only after that; a non-neuron stream is refused."""
    if torch.device(stream.device).type != "neuron":
        raise RuntimeError(f"record_stream: expected a neuron stream for a tensor on {tensor.device}, "
                           f"got a stream on {stream.device}")


_LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (kept alive for the process)
_LIB.impl("record_stream", _record_stream, "PrivateUse1")
