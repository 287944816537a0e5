"""The ``neuron`` torch.distributed backend: collectives on neuron tensors over Gloo.

Registered when ``torchneuron`` is imported, so that::

    dist.init_process_group("neuron")                 # neuron and CPU tensors
    dist.init_process_group()                         # on a neuron machine: neuron tensors
    dist.init_process_group("cpu:gloo,neuron:neuron")

all work, and DDP, FSDP2, DTensor and distributed checkpointing run on neuron tensors.
Gloo moves the bytes (TCP, across hosts); each collective advances the device clock of
the stream it runs on by a cost model of the NeuronLink / EFA topology. See
``docs/distributed.md``.
"""
from __future__ import annotations

from typing import Any

import torch

BACKEND_NAME = "neuron"


def _create(dist_options: Any, backend_options: Any) -> Any:
    """Creator c10d calls for each process group using the ``neuron`` backend."""
    from torchneuron import _C
    from torchneuron.distributed.backend import NeuronBackend

    impl = NeuronBackend(dist_options.store, dist_options.group_rank, dist_options.group_size,
                         dist_options.timeout, dist_options.global_ranks_in_group)
    return _C._ProcessGroupNeuron(dist_options.group_rank, dist_options.group_size, impl)


def register() -> None:
    """Register the ``neuron`` backend with torch.distributed (idempotent)."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    from torchneuron.distributed import dtensor_rng, sparse

    dtensor_rng.install()
    sparse.install()
    # "cpu" too: a group created with "neuron" alone also serves CPU tensors (as "gloo" serves
    # CUDA ones); the default CPU backend stays gloo.
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "neuron"])


__all__ = ["BACKEND_NAME", "register"]
_ = torch  # (torch is imported first so that torch.distributed is importable)
