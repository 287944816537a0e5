"""Turning the many ways users name a neuron device into an index."""
from __future__ import annotations

from typing import Any

import torch


def device_index(device: Any, optional: bool = False) -> int:
    """Index of ``device`` (int, str, torch.device or None); -1 for 'current' when optional."""
    if device is None:
        if optional:
            return -1
        raise ValueError("Expected a neuron device, got None")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"Expected a neuron device, but got: {device}")
        if device.index is None:
            if optional:
                return -1
            raise ValueError(f"Expected a neuron device with a specified index, got: {device}")
        return device.index
    raise ValueError(f"Expected a neuron device, got {device!r}")


def resolved_index(device: Any = None) -> int:
    """Index of ``device``, the current device when None or unindexed."""
    from torchneuron import _C

    index = device_index(device, optional=True)
    return _C._current_device() if index < 0 else index
