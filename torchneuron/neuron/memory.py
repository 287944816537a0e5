"""Device memory statistics of the HBM caching allocator (``torch.neuron.memory_*``)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

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


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A human-readable table of the allocator's statistics for a device."""
    index = resolved_index(device)
    stats = memory_stats(index)
    free, total = mem_get_info(index)
    rows = [
        ("Allocated memory", "allocated_bytes.all", _fmt),
        ("Requested memory", "requested_bytes.all", _fmt),
        ("Reserved memory", "reserved_bytes.all", _fmt),
        ("Allocations", "allocation.all", str),
        ("Device segments", "segment.all", str),
    ]
    lines = [f"neuron:{index} memory summary (HBM {_fmt(total)}, {_fmt(free)} not reserved)",
             f"{'metric':<20}{'current':>14}{'peak':>14}{'total alloc':>14}{'total freed':>14}"]
    for label, key, fmt in rows:
        values = [stats.get(f"{key}.{k}", 0) for k in ("current", "peak", "allocated", "freed")]
        lines.append(f"{label:<20}" + "".join(f"{fmt(v):>14}" for v in values))
    if not abbreviated:
        lines.append(f"{'Alloc retries':<20}{stats.get('num_alloc_retries', 0):>14}")
        lines.append(f"{'OOMs':<20}{stats.get('num_ooms', 0):>14}")
    return "\n".join(lines)
