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


class Stream(torch.Stream):
    """An in-order queue of work on a neuron device."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        if kwargs:  # wrapping an existing stream: stream_id, device_index, device_type
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device("neuron", resolved_index(device)), priority=priority)

    def __enter__(self) -> "Stream":
        self._previous = current_stream(self.device_index)
        torch.accelerator.set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.accelerator.set_stream(self._previous)

    @property
    def clock_ns(self) -> int:
        """This stream's device clock, in simulated nanoseconds."""
        from torchneuron import _C

        return _C._stream_clock(self.device_index, self.stream_id)


class Event(torch.Event):
    """A marker in a stream; ``elapsed_time`` between two is simulated device time."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> "Event":
        return super().__new__(cls, device="neuron", enable_timing=enable_timing, blocking=blocking,
                               interprocess=interprocess)


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device: Any = None) -> Stream:
    """The stream work on ``device`` is queued to now."""
    return _wrap(torch.accelerator.current_stream(resolved_index(device)))


def default_stream(device: Any = None) -> Stream:
    """The default stream of ``device``."""
    current = torch.accelerator.current_stream(resolved_index(device))
    return Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)


def synchronize(device: Any = None) -> None:
    """Wait for all work on ``device``."""
    torch.accelerator.synchronize(resolved_index(device))


class StreamContext:
    """Context manager that makes ``stream`` current on its device (None: no-op)."""

    def __init__(self, stream: Stream | None) -> None:
        self.stream = stream
        self.previous: torch.Stream | None = None

    def __enter__(self) -> Stream | None:
        if self.stream is not None:
            self.previous = torch.accelerator.current_stream(self.stream.device_index)
            torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            torch.accelerator.set_stream(self.previous)


def stream(stream: Stream | None) -> StreamContext:
    """``with torch.neuron.stream(s):`` queues work to ``s``."""
    return StreamContext(stream)
