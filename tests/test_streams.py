"""Streams and events on the simulated device clock (``torch.neuron.Stream/Event/...``).

Reference: an event's elapsed time is (clock difference in ns) / 1e6 ms; the clocks are
driven explicitly with ``torchneuron._C._advance_stream_clock``.
"""
from __future__ import annotations

import pytest
import torch

import torchneuron  # noqa: F401
from torchneuron import _C

pytestmark = pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")


def advance(stream: torch.Stream, ns: int) -> None:
    _C._advance_stream_clock(stream.device_index, stream.stream_id, ns)


def clock(stream: torch.Stream) -> int:
    return torch.neuron.stream_clock_ns(stream)


@pytest.fixture(autouse=True)
def _restore_device_and_streams(default_device_and_streams):
    """Each test starts as a fresh process does: device 0, default streams current."""
    yield


def test_default_and_new_streams():
    default = torch.neuron.default_stream()
    assert default.device == torch.device("neuron", 0)
    assert torch.neuron.current_stream() == default
    s = torch.neuron.Stream()
    assert s != default
    assert s.device == torch.device("neuron", 0)
    t = torch.neuron.Stream()
    assert t != s and t.stream_id != s.stream_id
    assert isinstance(s, torch.neuron.Stream) and isinstance(s, torch.Stream)
    assert isinstance(torch.neuron.Stream(), torch.neuron.Stream)
    assert isinstance(default, torch.neuron.Stream)
    assert not isinstance(object(), torch.neuron.Stream)
    assert not isinstance(torch.neuron.Event(), torch.neuron.Stream)


def test_stream_on_other_device():
    last = torch.neuron.device_count() - 1
    s = torch.neuron.Stream(device=last)
    assert s.device_index == last
    assert torch.neuron.default_stream(last).device_index == last
    assert torch.neuron.current_stream(f"neuron:{last}").device_index == last


def test_stream_context_makes_current_and_restores():
    default = torch.neuron.current_stream()
    s = torch.neuron.Stream()
    with torch.neuron.stream(s) as entered:
        assert entered == s
        assert torch.neuron.current_stream() == s
        assert torch.accelerator.current_stream() == s
        inner = torch.neuron.Stream()
        with torch.neuron.stream(inner):
            assert torch.neuron.current_stream() == inner
        assert torch.neuron.current_stream() == s
    assert torch.neuron.current_stream() == default
    # Restored on an exception.
    with pytest.raises(KeyError):
        with torch.neuron.stream(s):
            raise KeyError("boom")
    assert torch.neuron.current_stream() == default
    # None is a no-op.
    with torch.neuron.stream(None) as entered:
        assert entered is None
        assert torch.neuron.current_stream() == default


def test_stream_context_on_another_device_restores_current_device():
    last = torch.neuron.device_count() - 1
    if last == 0:
        pytest.skip("needs two neuron devices")
    s = torch.neuron.Stream(device=last)
    assert torch.neuron.current_device() == 0
    default0 = torch.neuron.current_stream(0)
    with torch.neuron.stream(s):
        # As with torch.cuda.stream: the stream's device is current while inside.
        assert torch.neuron.current_device() == last
        assert torch.neuron.current_stream() == s
        assert torch.neuron.current_stream(0) == default0
    assert torch.neuron.current_device() == 0
    assert torch.neuron.current_stream(0) == default0
    assert torch.neuron.current_stream(last) == torch.neuron.default_stream(last)


def test_record_wait_query_synchronize():
    s = torch.neuron.Stream()
    e = torch.neuron.Event()
    assert isinstance(e, torch.neuron.Event) and isinstance(e, torch.Event)
    assert isinstance(torch.neuron.Event(), torch.neuron.Event)
    assert not isinstance(s, torch.neuron.Event)
    e.record(s)
    assert e.query() is True
    e.synchronize()
    torch.neuron.current_stream().wait_event(e)
    assert s.query() is True
    s.synchronize()
    ev = s.record_event()
    assert isinstance(ev, torch.neuron.Event)
    torch.neuron.default_stream().wait_stream(s)
    torch.neuron.synchronize()
    torch.neuron.synchronize(0)
    torch.accelerator.synchronize()
    # Work queued on a side stream is visible afterwards.
    with torch.neuron.stream(s):
        x = torch.arange(5.0, device="neuron") * 2
    torch.neuron.current_stream().wait_stream(s)
    assert torch.equal(x.cpu(), torch.arange(5.0) * 2)


def test_synchronize_invalid_device():
    n = torch.neuron.device_count()
    with pytest.raises(RuntimeError, match=f"neuron:{n}"):
        torch.neuron.synchronize(n)


@pytest.mark.parametrize("ns, ms", [(2_000_000, 2.0), (1_500, 0.0015), (0, 0.0), (123_456_789, 123.456789)])
def test_elapsed_time_is_clock_difference(ns, ms):
    s = torch.neuron.Stream()
    start = torch.neuron.Event(enable_timing=True)
    end = torch.neuron.Event(enable_timing=True)
    start.record(s)
    t0 = clock(s)
    advance(s, ns)
    assert clock(s) - t0 == ns
    end.record(s)
    assert start.elapsed_time(end) == pytest.approx(ms, rel=1e-12, abs=0)
    assert end.elapsed_time(start) == pytest.approx(-ms, rel=1e-12, abs=0)


def test_elapsed_time_on_current_stream():
    cur = torch.neuron.current_stream()
    start = torch.neuron.Event(enable_timing=True)
    end = torch.neuron.Event(enable_timing=True)
    start.record()
    advance(cur, 3_000_000)
    end.record()
    assert start.elapsed_time(end) == 3.0


def test_wait_event_moves_clock_forward():
    a = torch.neuron.Stream()
    b = torch.neuron.Stream()
    advance(a, 5_000_000)
    e = torch.neuron.Event()
    e.record(a)
    assert clock(a) > clock(b)
    target = clock(a)
    b.wait_event(e)
    assert clock(b) == target
    # Waiting on an event in the past never moves a clock backwards.
    advance(b, 1_000)
    b.wait_event(e)
    assert clock(b) == target + 1_000
    # Waiting on an unrecorded event is a no-op.
    before = clock(b)
    b.wait_event(torch.neuron.Event())
    assert clock(b) == before


def test_wait_stream_moves_clock_forward():
    a = torch.neuron.Stream()
    b = torch.neuron.Stream()
    advance(a, 700_000)
    b.wait_stream(a)
    assert clock(b) == clock(a)


def test_new_stream_starts_at_device_present_time():
    a = torch.neuron.Stream()
    advance(a, 9_000_000)
    latest = max(clock(a), clock(torch.neuron.default_stream()))
    fresh = torch.neuron.Stream()
    assert clock(fresh) == latest


def test_negative_advance_rejected():
    s = torch.neuron.Stream()
    before = clock(s)
    with pytest.raises(RuntimeError, match="backwards"):
        advance(s, -1)
    assert clock(s) == before


# PyTorch's generic torch.Event (c10/core/impl/InlineEvent.h) and torch.cuda.Event both
# raise ValueError for these misuses (TORCH_CHECK_VALUE), so neuron matches them.

def test_elapsed_time_requires_enable_timing():
    s = torch.neuron.Stream()
    plain, timed = torch.neuron.Event(), torch.neuron.Event(enable_timing=True)
    plain.record(s)
    timed.record(s)
    with pytest.raises(ValueError, match="enable_timing=True"):
        plain.elapsed_time(timed)
    with pytest.raises(ValueError, match="enable_timing=True"):
        timed.elapsed_time(plain)


def test_elapsed_time_requires_recorded_events():
    s = torch.neuron.Stream()
    recorded = torch.neuron.Event(enable_timing=True)
    unrecorded = torch.neuron.Event(enable_timing=True)
    recorded.record(s)
    with pytest.raises(ValueError, match="recorded"):
        recorded.elapsed_time(unrecorded)
    with pytest.raises(ValueError, match="recorded"):
        unrecorded.elapsed_time(recorded)
