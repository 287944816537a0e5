"""Collectives on sparse neuron tensors raise instead of silently doing nothing.

c10d registers its collectives for dense PrivateUse1 tensors (they reach the ``neuron``
backend) but not for sparse ones, so a sparse neuron tensor would take the generic CPU
fallback: a CPU copy is reduced and the result, which Gloo's sparse all-reduce returns as a
new tensor, never reaches the neuron tensor. Until sparse collectives are implemented, every
c10d op on a sparse neuron tensor raises NotImplementedError naming what to do instead.
"""
from __future__ import annotations

from typing import Any

import torch

_SPARSE_KEYS = ("SparsePrivateUse1", "SparseCsrPrivateUse1")
_libraries: list[torch.library.Library] = []  # kept alive for the process


def _refuse(name: str):
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"c10d::{name}: collectives on sparse neuron tensors are not supported yet; "
            "densify them (t.to_dense()) or move them to the CPU (t.cpu()) first")
    return kernel


def install() -> None:
    """Register the refusing kernels on every c10d op that takes tensors (idempotent)."""
    if _libraries:
        return
    lib = torch.library.Library("c10d", "IMPL")  # noqa: TOR901
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        if not qualified.startswith("c10d::") or qualified in ("c10d::barrier", "c10d::check_for_nan"):
            continue
        name = qualified.removeprefix("c10d::")
        for key in _SPARSE_KEYS:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
                lib.impl(name, _refuse(name), key)
    _libraries.append(lib)
