"""Devices: each neuron device index owns one simulated NeuronCore.

The core is created the first time the device runs a kernel, for the chip in
``torchneuron.config.CONFIG.chip`` (``TORCHNEURON_CHIP``). A core executes one program at a
time: its SBUF, PSUM and registers are shared by everything launched on it, so launches on
one device are serialized by the device's lock (different devices run independently).
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from torchneuron import _C
from torchneuron.sim import NeuronCore

_cores: dict[int, NeuronCore] = {}
_locks: dict[int, threading.Lock] = {}
_create_lock = threading.Lock()


def device_index(device: Any = None) -> int:
    """The neuron device index ``device`` names (int, "neuron:1", torch.device; None: the current
    device). Raises ValueError for a non-neuron device and RuntimeError for an index out of range."""
    if device is None:
        return _C._current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"Expected a neuron device, but got: {device}")
        index = _C._current_device() if device.index is None else device.index
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        raise ValueError(f"Expected a neuron device, got {device!r}")
    count = _C._device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"Invalid device index neuron:{index}: there are {count} neuron devices")
    return index


def core(device: Any = None) -> NeuronCore:
    """The simulated NeuronCore of ``device`` (created on first use)."""
    index = device_index(device)
    c = _cores.get(index)
    if c is None:
        with _create_lock:
            c = _cores.get(index)
            if c is None:
                from torchneuron.config import CONFIG
                _locks[index] = threading.Lock()
                c = _cores[index] = NeuronCore(CONFIG.chip)
    return c


def host_memory(tensor: torch.Tensor) -> torch.Tensor:
    """The host tensor aliasing a neuron tensor's device memory (no copy): what a core binds as HBM."""
    return _C._alias_as_cpu(tensor)


def core_lock(device: Any = None) -> threading.Lock:
    """The lock that serializes launches on ``device``'s core."""
    index = device_index(device)
    core(index)
    return _locks[index]


def created_cores() -> dict[int, NeuronCore]:
    """The cores created so far, by device index."""
    return dict(_cores)
