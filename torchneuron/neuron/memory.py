"""Device memory statistics of the HBM caching allocator (``torch.neuron.memory_*``)."""
from __future__ import annotations

import pickle
import sys
from collections import OrderedDict
from typing import Any, Literal

import torch

from torchneuron import _C
from torchneuron.neuron._utils import resolved_index


def memory_stats(device: Any = None) -> OrderedDict[str, Any]:
    """The allocator's statistics for a device, keyed like ``torch.cuda.memory_stats``."""
    return torch.accelerator.memory_stats(resolved_index(device))


def memory_allocated(device: Any = None) -> int:
    """Bytes of HBM occupied by tensors on a device."""
    return torch.accelerator.memory_allocated(resolved_index(device))


def max_memory_allocated(device: Any = None) -> int:
    """Peak of ``memory_allocated`` since start or the last ``reset_peak_memory_stats``."""
    return torch.accelerator.max_memory_allocated(resolved_index(device))


def memory_reserved(device: Any = None) -> int:
    """Bytes of HBM held by the caching allocator (allocated plus cached)."""
    return torch.accelerator.memory_reserved(resolved_index(device))


def max_memory_reserved(device: Any = None) -> int:
    """Peak of ``memory_reserved``."""
    return torch.accelerator.max_memory_reserved(resolved_index(device))


def reset_peak_memory_stats(device: Any = None) -> None:
    """Restart peak tracking from the current values."""
    torch.accelerator.reset_peak_memory_stats(resolved_index(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Zero the cumulative counters (allocations and frees so far)."""
    torch.accelerator.reset_accumulated_memory_stats(resolved_index(device))


def empty_cache() -> None:
    """Return cached, unused HBM blocks so ``memory_reserved`` drops to ``memory_allocated``."""
    torch.accelerator.empty_cache()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) HBM bytes of a device; free counts what the allocator has not reserved."""
    return torch.accelerator.get_memory_info(resolved_index(device))


def format_bytes(n: float) -> str:
    """A byte count for people: ``512 B``, ``1.50 KiB``, ``12.00 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _scaled(value: int, scale: float, units: tuple[str, ...], step: int, threshold: int) -> tuple[int, str]:
    """``value`` in the unit that fits ``scale`` (the row's first value), as CUDA's summary picks it."""
    unit = 0
    while unit + 1 < len(units) and scale >= threshold:
        value //= step
        scale /= step
        unit += 1
    return value, units[unit]


def _size_cell(value: int, scale: int) -> str:
    value, unit = _scaled(value, scale, ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB"), 1024, 768 * 1024)
    return f"{value:6d} {unit}"


def _count_cell(value: int, scale: int) -> str:
    value, unit = _scaled(value, scale, (" ", "K", "M"), 1000, 750 * 1000)
    return f"{value:7d} {unit} "


# (stat key, row label, cell format): the rows of torch.cuda.memory_summary, named for the device
_SUMMARY_ROWS = (
    ("allocated_bytes", "Allocated memory", _size_cell),
    ("active_bytes", "Active memory", _size_cell),
    ("requested_bytes", "Requested memory", _size_cell),
    ("reserved_bytes", "Reserved memory", _size_cell),
    ("inactive_split_bytes", "Non-releasable memory", _size_cell),
    ("allocation", "Allocations", _count_cell),
    ("active", "Active allocs", _count_cell),
    ("segment", "Reserved segments", _count_cell),
    ("inactive_split", "Non-releasable allocs", _count_cell),
)
_SUMMARY_TOTALS = (("oversize_allocations", "Oversize allocations"), ("oversize_segments", "Oversize segments"))
_WIDTH = 75


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """The allocator's statistics for a device as a table laid out like ``torch.cuda.memory_summary``."""
    index = resolved_index(device)
    stats = memory_stats(index)
    free, total = mem_get_info(index)

    def cells(key: str, fmt: Any, scale_key: str) -> str:
        return " | ".join(fmt(stats.get(f"{key}.{k}", 0), stats.get(f"{scale_key}.{k}", 0))
                          for k in ("current", "peak", "allocated", "freed"))

    title = f"PyTorch neuron memory summary, device ID {index}"
    lines = ["=" * _WIDTH, f"{title:^{_WIDTH}}", "-" * _WIDTH,
             f"{'neuron OOMs: ' + str(stats.get('num_ooms', 0)):^37}|"
             f"{'alloc retries: ' + str(stats.get('num_alloc_retries', 0)):^37}",
             f"{f'HBM of neuron:{index}: {format_bytes(total)}, {format_bytes(free)} not reserved':^{_WIDTH}}",
             "=" * _WIDTH, "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    for key, label, fmt in _SUMMARY_ROWS:
        lines.append("-" * _WIDTH)
        pools = [("all", label)]
        if not abbreviated:
            pools += [("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
        for pool, name in pools:
            lines.append(f" {name:<21} | {cells(f'{key}.{pool}', fmt, f'{key}.all')} ")
    for key, label in _SUMMARY_TOTALS:
        lines.append("-" * _WIDTH)
        lines.append(f" {label:<21} | {cells(key, _count_cell, key)} ")
    lines.append("=" * _WIDTH)
    return "".join(f"|{line}|\n" for line in lines)


_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "snapshot")


def _record_memory_history(enabled: Literal["state", "all"] | None = "all", context: Literal["state", "alloc", "all"]
                           | None = "all", stacks: Literal["python", "all"] = "all", max_entries: int = sys.maxsize,
                           device: Any = None, clear_history: bool = False) -> None:
    """Record allocation stacks and a history of allocator actions for ``_snapshot``, as ``torch.cuda.memory`` does.

    ``enabled``: None stops recording; "state" keeps the stacks of live allocations; "all" also keeps
    a history of every alloc, free, segment alloc/free and OOM (the latest ``max_entries`` per device).
    ``context``: which stacks to keep (None, "state": live allocations, "alloc": also alloc entries,
    "all": also free entries). ``stacks``: "python" frames, or "all" to add C++ frames. Applies to
    every neuron device (``device`` is accepted for torch.cuda parity).
    """
    if enabled not in (None, "state", "all"):
        raise RuntimeError(f"expected enabled to be 'state', 'all', or None, got {enabled!r}")
    if context not in (None, "state", "alloc", "all"):
        raise RuntimeError(f"expected context to be 'state', 'alloc', 'all', or None, got {context!r}")
    if stacks not in ("python", "all"):
        raise RuntimeError(f"expected stacks to be 'python' or 'all', got {stacks!r}")
    if not isinstance(max_entries, int) or max_entries < 0:
        raise ValueError(f"max_entries must be a non-negative int, got {max_entries!r}")
    if device is not None:
        resolved_index(device)  # a wrong device is an error, as elsewhere
    on = enabled is not None
    context = context if on else None
    _C._record_memory_history(enabled == "all", context is not None, context in ("alloc", "all"), context == "all",
                              stacks == "all", clear_history, min(max_entries, sys.maxsize))


def _snapshot(device: Any = None) -> dict[str, Any]:
    """The allocator's state in ``torch.cuda.memory._snapshot()``'s format: ``segments`` (each with its
    ``blocks`` and the allocating stack's ``frames``) and ``device_traces`` (one list per device of
    recorded actions), which PyTorch's memory visualizer reads (``torch.cuda._memory_viz``)."""
    return _C._memory_snapshot()


def _dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """Pickle ``_snapshot()`` to ``filename`` (open it at pytorch.org/memory_viz)."""
    snapshot = _snapshot()
    with open(filename, "wb") as f:
        pickle.dump(snapshot, f)
