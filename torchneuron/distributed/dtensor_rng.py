"""DTensor random ops on neuron meshes draw from each rank's own generator, as on CPU meshes.

DTensor's ``OffsetBasedRNGTracker`` coordinates random ops across shards by moving a Philox
generator's (seed, offset) state, a 16-byte layout only CUDA-like generators have. A neuron
generator wraps the CPU's Mersenne Twister (``torch.neuron.get_rng_state`` is its state), so
the tracker's offset arithmetic cannot apply and fails on the first sharded random op
(``nn.init`` of an FSDP2/TP parameter). PyTorch does not use the tracker for CPU meshes: there
each rank draws its local shard from its own generator. ``install()`` makes neuron meshes
behave the same way, by answering False for them where DTensor asks whether a mesh supports
its RNG tracker.
"""
from __future__ import annotations

from typing import Any, Callable

_installed = False


def _neuron_aware(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def is_rng_supported_mesh(device_mesh: Any) -> bool:
        """False for neuron meshes (no Philox generator); otherwise DTensor's own answer."""
        if device_mesh.device_type == "neuron":
            return False
        return check(device_mesh)

    is_rng_supported_mesh.__wrapped__ = check  # type: ignore[attr-defined]
    return is_rng_supported_mesh


def install() -> None:
    """Route DTensor's RNG-support check through ``_neuron_aware`` (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.distributed.tensor import _dispatch, _random

    patched = _neuron_aware(_random.is_rng_supported_mesh)
    _random.is_rng_supported_mesh = patched  # read as random.is_rng_supported_mesh by DTensor's API
    _dispatch.is_rng_supported_mesh = patched  # imported by name into the dispatcher
    _installed = True
