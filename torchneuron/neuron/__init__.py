"""``torch.neuron``: the device module, mirroring ``torch.cuda`` where it makes sense."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchneuron import _C
from torchneuron.config import CONFIG
from torchneuron.neuron.memory import (
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
)
from torchneuron.neuron.random import (
    default_generators,
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_rng_state,
    set_rng_state_all,
)
from torchneuron.neuron.streams import (
    Event,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    stream,
    stream_clock_ns,
    synchronize,
)
from torchneuron.neuron._utils import device_index as _device_index

__all__ = [
    "Event", "Stream", "StreamContext", "current_device", "current_stream", "default_generators", "default_stream",
    "device", "device_count", "device_of", "empty_cache", "get_amp_supported_dtype", "get_device_capability",
    "get_device_name", "get_device_properties", "get_rng_state", "get_rng_state_all", "init", "initial_seed",
    "is_available", "is_bf16_supported", "is_initialized", "manual_seed", "manual_seed_all", "max_memory_allocated",
    "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_reserved", "memory_stats", "memory_summary",
    "reset_accumulated_memory_stats", "reset_peak_memory_stats", "seed", "seed_all", "set_device", "set_rng_state",
    "set_rng_state_all", "stream", "synchronize",
]


def is_available() -> bool:
    """Whether neuron devices exist (always, since the simulator is built in)."""
    return _C._device_count() > 0


def is_initialized() -> bool:
    """Whether the device runtime is initialized (it is, once torchneuron is imported)."""
    return True


def init() -> None:
    """Initialize the device runtime (nothing left to do; kept for torch.cuda parity)."""


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """Number of neuron devices (NeuronCores) visible to this process."""
    return _C._device_count()


def current_device() -> int:
    """Index of the current neuron device."""
    return _C._current_device()


def set_device(device: Any) -> None:
    """Select the current neuron device; ``device`` is an index, a string or a torch.device. A negative index is
    a no-op, as ``torch.cuda.set_device`` documents."""
    index = _device_index(device)
    if index >= 0:
        _C._set_device(index)


class device:
    """Context manager that makes ``device`` the current neuron device while it is active."""

    def __init__(self, device: Any) -> None:
        self.index = _device_index(device, optional=True)
        self.previous = -1

    def __enter__(self) -> None:
        self.previous = _C._current_device()
        if self.index >= 0 and self.index != self.previous:
            _C._set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.index >= 0 and self.index != self.previous:
            _C._set_device(self.previous)


class device_of(device):
    """Context manager that makes the device of ``tensor`` current (no-op for CPU tensors)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor.get_device() if tensor.device.type == "neuron" else -1)


@dataclass(frozen=True)
class NeuronDeviceProperties:
    """What ``get_device_properties`` reports for one NeuronCore."""

    name: str
    chip: str
    core_generation: str
    total_memory: int            # HBM bytes of this core (chip HBM / cores per chip)
    cores_per_chip: int
    sbuf_bytes: int
    psum_bytes: int
    tensor_engine_bf16_tflops: float

    def __repr__(self) -> str:
        return (f"NeuronDeviceProperties(name='{self.name}', chip='{self.chip}', "
                f"core_generation='{self.core_generation}', total_memory={self.total_memory // 2**20}MB)")


def get_device_properties(device: Any = None) -> NeuronDeviceProperties:
    """Properties of a neuron device, from the chip spec table."""
    index = _checked_index(device)
    spec = CONFIG.chip
    return NeuronDeviceProperties(
        name=f"{spec.core_generation} ({spec.name})",
        chip=spec.name,
        core_generation=spec.core_generation,
        total_memory=_C._hbm_capacity(index),
        cores_per_chip=spec.cores_per_chip,
        sbuf_bytes=spec.sbuf_partitions * spec.sbuf_bytes_per_partition,
        psum_bytes=spec.sbuf_partitions * spec.psum_bytes_per_partition,
        tensor_engine_bf16_tflops=spec.tensor_bf16_flops_per_core / 1e12,
    )


def get_device_name(device: Any = None) -> str:
    """Name of a neuron device, e.g. ``'NeuronCore-v3 (trn2)'``."""
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """The NeuronCore generation as a (major, minor) pair, e.g. (3, 0) on trn2."""
    _checked_index(device)
    return int(CONFIG.chip.core_generation.rsplit("v", 1)[1]), 0


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """bfloat16 is a native NeuronCore dtype."""
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes ``torch.autocast("neuron", dtype=...)`` accepts."""
    return [torch.bfloat16, torch.float16]


def _checked_index(device: Any) -> int:
    index = _device_index(device, optional=True)
    if index < 0:
        index = current_device()
    if index >= device_count():
        raise RuntimeError(f"Invalid device index neuron:{index}: this process has {device_count()} neuron device(s)")
    return index
