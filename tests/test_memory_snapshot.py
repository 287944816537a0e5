"""torch.neuron.memory._record_memory_history / _snapshot in torch.cuda.memory's format, and
memory_summary laid out like torch.cuda.memory_summary.

References: the snapshot format documented by ``torch.cuda.memory._snapshot`` (segments with
blocks and frames, device_traces of actions), PyTorch's own snapshot readers
(``torch.cuda._memory_viz``), the allocator's counters (``torch.neuron.memory_stats``), and
``torch.cuda.memory.memory_summary`` rendering the same statistics.
"""
from __future__ import annotations

import gc
import pickle
from unittest import mock

import pytest
import torch
import torch.cuda._memory_viz as memory_viz

from torch.neuron import memory

SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
TRACE_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "snapshot"}


@pytest.fixture
def history():
    """Record everything for the test; stop and clear afterwards."""
    memory._record_memory_history("all", stacks="python", clear_history=True)
    yield
    memory._record_memory_history(None, clear_history=True)


def _allocate_here(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device="neuron")


def _check_frames(frames):
    assert isinstance(frames, list)
    for f in frames:
        assert set(f) == {"filename", "line", "name"}
        assert isinstance(f["filename"], str) and isinstance(f["line"], int) and isinstance(f["name"], str)


def _check_format(snapshot):
    assert set(snapshot) >= {"segments", "device_traces"}
    for seg in snapshot["segments"]:
        assert set(seg) == SEGMENT_KEYS
        assert seg["segment_type"] == ("small" if seg["total_size"] <= 1 << 20 else "large")
        assert seg["total_size"] == sum(b["size"] for b in seg["blocks"])
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        _check_frames(seg["frames"])
        for b in seg["blocks"]:
            assert set(b) == BLOCK_KEYS
            assert b["state"] in ("active_allocated", "active_awaiting_free", "inactive")
            assert b["requested_size"] <= b["size"]
            _check_frames(b["frames"])
    assert len(snapshot["device_traces"]) == torch.neuron.device_count()
    for entries in snapshot["device_traces"]:
        for e in entries:
            assert set(e) - {"device_free"} == TRACE_KEYS and e["action"] in ACTIONS
            assert ("device_free" in e) == (e["action"] == "oom")
            _check_frames(e["frames"])


def test_snapshot_matches_the_allocator_counters():
    keep = [_allocate_here(n) for n in (100, 5000, (1 << 20) + 1)]
    cached = _allocate_here(777)
    del cached
    snapshot = memory._snapshot()
    _check_format(snapshot)
    for d in range(torch.neuron.device_count()):
        segs = [s for s in snapshot["segments"] if s["device"] == d]
        stats = torch.neuron.memory_stats(d)
        assert sum(s["total_size"] for s in segs) == torch.neuron.memory_reserved(d)
        assert sum(s["allocated_size"] for s in segs) == torch.neuron.memory_allocated(d)
        assert sum(s["requested_size"] for s in segs) == stats["requested_bytes.all.current"]
        assert len(segs) == stats["segment.all.current"]
        blocks = [b for s in segs for b in s["blocks"] if b["state"] == "active_allocated"]
        assert len(blocks) == stats["allocation.all.current"]
    live = {b["address"]: b for s in snapshot["segments"] for b in s["blocks"]}
    for t in keep:
        assert live[t.untyped_storage().data_ptr()]["state"] == "active_allocated"
        assert live[t.untyped_storage().data_ptr()]["requested_size"] == t.numel()


def test_history_records_stacks_and_actions(history):
    t = _allocate_here(3000)
    addr = t.untyped_storage().data_ptr()
    del t
    u = _allocate_here(50 << 20)  # too large for any cached block: a new segment
    u_addr = u.untyped_storage().data_ptr()
    del u
    torch.neuron.empty_cache()
    snapshot = memory._snapshot()
    _check_format(snapshot)
    entries = snapshot["device_traces"][torch.neuron.current_device()]
    mine = [(e["action"], e["size"]) for e in entries if e["addr"] == addr]
    assert [a for a, _ in mine if a != "segment_free"][-3:] == ["alloc", "free_requested", "free_completed"]
    actions = [e["action"] for e in entries if e["addr"] == u_addr]
    assert actions == ["segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"]
    alloc = next(e for e in entries if e["addr"] == u_addr and e["action"] == "alloc")
    assert alloc["size"] == 50 << 20
    # the allocation's stack names the function that allocated, innermost frame first
    names = [(f["name"], f["filename"]) for f in alloc["frames"]]
    assert ("_allocate_here", __file__) in names
    assert names.index(("_allocate_here", __file__)) < names.index(("test_history_records_stacks_and_actions",
                                                                    __file__))
    assert entries[-1]["action"] == "snapshot"
    times = [e["time_us"] for e in entries]
    assert times == sorted(times)


def test_live_blocks_keep_their_allocation_stack(history):
    t = _allocate_here(12345)
    snapshot = memory._snapshot()
    block = next(b for s in snapshot["segments"] for b in s["blocks"] if b["address"] == t.untyped_storage().data_ptr())
    assert block["frames"][0]["name"] == "_allocate_here"
    assert block["frames"][0]["filename"] == __file__


def _block_recorded(n: int, enabled: str, stacks: str) -> tuple[dict, dict]:
    """(snapshot, the block of a fresh n-byte allocation) with history recording as given, then off."""
    memory._record_memory_history(enabled, stacks=stacks, clear_history=True)
    try:
        t = _allocate_here(n)
        snapshot = memory._snapshot()
    finally:
        memory._record_memory_history(None, clear_history=True)
    addr = t.untyped_storage().data_ptr()
    return snapshot, next(b for s in snapshot["segments"] for b in s["blocks"] if b["address"] == addr)


def test_all_stacks_add_cpp_frames():
    _, block = _block_recorded(999, "state", "all")
    files = [f["filename"] for f in block["frames"]]
    assert __file__ in files
    assert any(not f.endswith(".py") for f in files)


def test_oom_is_recorded_with_the_free_memory(history):
    free, total = torch.neuron.mem_get_info()
    with pytest.raises(torch.OutOfMemoryError):
        _allocate_here(total + 1)
    entries = memory._snapshot()["device_traces"][torch.neuron.current_device()]
    oom = [e for e in entries if e["action"] == "oom"][-1]
    assert oom["size"] == total + 1
    assert oom["device_free"] == torch.neuron.mem_get_info()[0]


def test_max_entries_keeps_the_latest():
    memory._record_memory_history("all", stacks="python", max_entries=4, clear_history=True)
    try:
        ts = [_allocate_here(1000 + i) for i in range(6)]
        last = ts[-1].untyped_storage().data_ptr()
        entries = memory._snapshot()["device_traces"][torch.neuron.current_device()]
    finally:
        memory._record_memory_history(None, clear_history=True)
    assert len(entries) == 4
    assert entries[-1]["action"] == "snapshot"
    assert entries[-2]["action"] == "alloc" and entries[-2]["addr"] == last


def test_recording_off_keeps_no_history_or_stacks():
    memory._record_memory_history(None, clear_history=True)
    t = _allocate_here(4321)
    snapshot = memory._snapshot()
    assert all(entries == [] for entries in snapshot["device_traces"])
    block = next(b for s in snapshot["segments"] for b in s["blocks"] if b["address"] == t.untyped_storage().data_ptr())
    assert block["frames"] == []


def test_state_only_keeps_stacks_without_history():
    snapshot, block = _block_recorded(2222, "state", "python")
    assert all(entries == [] for entries in snapshot["device_traces"])
    assert block["frames"][0]["name"] == "_allocate_here"


def test_pytorch_memory_viz_reads_the_snapshot(history, tmp_path):
    gc.collect()
    torch.neuron.empty_cache()   # a block earlier tests left cached would serve the allocation with no segment_alloc
    keep = _allocate_here(1 << 16)
    path = tmp_path / "snapshot.pickle"
    devices = range(torch.neuron.device_count())

    def totals():
        return (sum(torch.neuron.memory_reserved(d) for d in devices),
                sum(torch.neuron.memory_allocated(d) for d in devices))

    for _ in range(3):   # tensors of earlier tests may be freed meanwhile: compare a snapshot taken while still
        gc.collect()
        before = totals()
        memory._dump_snapshot(str(path))
        if totals() == before:
            break
    snapshot = pickle.loads(path.read_bytes())
    _check_format(snapshot)
    summary = memory_viz.segsum(snapshot)
    reserved, allocated = before
    assert f"total_reserved: {memory_viz._format_size(reserved)}\n" in summary
    # the allocator counts rounded blocks; the visualizer sums what was requested (their difference is the
    # rounding of small allocations that earlier tests in the worker may have left)
    active = [b for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert sum(b["size"] for b in active) == allocated
    requested = sum(b.get("requested_size", b["size"]) for b in active)
    assert f"total_allocated: {memory_viz._format_size(requested)}\n" in summary
    trace = memory_viz.trace(snapshot)
    size = memory_viz._format_size(1 << 16)
    assert "= cudaMalloc(" in trace and f"[0:{size}]" in trace  # its segment_alloc, then its alloc
    assert "<!DOCTYPE html>" in memory_viz.trace_plot(snapshot) or "<html" in memory_viz.trace_plot(snapshot)
    del keep


@pytest.mark.parametrize("kwargs", [{"enabled": "some"}, {"context": "frames"}, {"stacks": "cpp"},
                                    {"max_entries": -1}])
def test_bad_arguments_raise(kwargs):
    error = ValueError if "max_entries" in kwargs else RuntimeError
    with pytest.raises(error):
        memory._record_memory_history(**kwargs)


def test_memory_summary_is_laid_out_like_cuda():
    keep = [_allocate_here(n) for n in (10, 3 << 20)]
    stats = torch.neuron.memory_stats()
    with mock.patch("torch.cuda.memory.memory_stats", return_value=stats):
        cuda = torch.cuda.memory.memory_summary(device=0).splitlines()
        cuda_short = torch.cuda.memory.memory_summary(device=0, abbreviated=True).splitlines()
    for abbreviated, reference in ((False, cuda), (True, cuda_short)):
        ours = torch.neuron.memory_summary(0, abbreviated=abbreviated).splitlines()
        assert all(len(line) == 77 for line in ours)
        assert "PyTorch neuron memory summary, device ID 0" in ours[1]
        assert f"neuron OOMs: {stats['num_ooms']}" in ours[3]
        assert "HBM of neuron:0" in ours[4]
        # the table itself: CUDA's rows with the device's names
        renamed = [line.replace("GPU reserved memory", "Reserved memory    ")
                   .replace("GPU reserved segments", "Reserved segments    ")
                   .replace("Oversize GPU segments", "Oversize segments    ") for line in reference[4:]]
        assert ours[5:] == renamed
    del keep
