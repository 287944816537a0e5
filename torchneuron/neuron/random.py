"""The neuron random number generators (``torch.neuron.manual_seed`` and friends)."""
from __future__ import annotations

from typing import Any

import torch

from torchneuron import _C
from torchneuron.neuron._utils import resolved_index


class _DefaultGenerators:
    """``torch.neuron.default_generators[i]``: the default generator of device i."""

    def __getitem__(self, index: int) -> torch.Generator:
        if not 0 <= index < _C._device_count():
            raise IndexError(f"neuron device index {index} out of range ({_C._device_count()} devices)")
        return _C._default_generator(index)

    def __len__(self) -> int:
        return _C._device_count()

    def __iter__(self):
        return (self[i] for i in range(len(self)))


default_generators = _DefaultGenerators()


def _generator(device: Any = None) -> torch.Generator:
    return default_generators[resolved_index(device)]


def manual_seed(seed: int) -> None:
    """Seed the current neuron device's generator."""
    _generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every neuron device's generator."""
    for g in default_generators:
        g.manual_seed(int(seed))


def seed() -> None:
    """Seed the current device's generator with a non-deterministic random number."""
    _generator().seed()


def seed_all() -> None:
    """Seed all devices' generators with one non-deterministic random number."""
    s = _generator(0).seed()
    for g in default_generators:
        g.manual_seed(s)


def initial_seed() -> int:
    """The seed of the current device's generator."""
    return _generator().initial_seed()


def get_rng_state(device: Any = "neuron") -> torch.Tensor:
    """The generator state of a device, as a CPU ByteTensor."""
    return _generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "neuron") -> None:
    """Restore a generator state returned by ``get_rng_state``."""
    _generator(device).set_state(new_state.clone(memory_format=torch.contiguous_format))


def get_rng_state_all() -> list[torch.Tensor]:
    """Generator states of all devices."""
    return [g.get_state() for g in default_generators]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    """Restore the states returned by ``get_rng_state_all``."""
    for i, state in enumerate(new_states):
        set_rng_state(state, i)
