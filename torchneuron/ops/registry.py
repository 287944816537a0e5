"""The registry of eager ATen kernels for the ``neuron`` device.

``@lowering("add.Tensor", "add_.Tensor", "add.out")`` installs a Python kernel for those ATen
overloads on PyTorch's PrivateUse1 dispatch key (``torch.library``), below autograd: a kernel
sees plain tensors and every op it calls re-dispatches without recording a graph. A kernel that
meets inputs it cannot run on the device (a dtype the NeuronCore lacks, a CPU tensor argument)
calls ``cpu_fallback``: the same boxed CPU fallback unregistered operators take, so it is
counted, warned about once, refused under ``TORCHNEURON_STRICT=1``, and checks devices the way
PyTorch does.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from torchneuron import _C

class Unsupported(Exception):
    """A lowering cannot run this call on the device: the caller takes the CPU fallback."""


_LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (kept alive for the process)
LOWERED: dict[str, Callable] = {}             # overload name ("add.Tensor") -> its neuron kernel


def lowering(*names: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the neuron kernel of the ATen overloads ``names``."""
    def register(fn: Callable) -> Callable:
        for name in names:
            qualified = f"aten::{name}" if "." in name else f"aten::{name}"
            if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"):
                # it decomposes before reaching a backend; a backend kernel would bypass its autograd
                raise RuntimeError(f"aten::{name} is CompositeImplicitAutograd: lower what it decomposes into")
            if name in LOWERED:
                raise RuntimeError(f"aten::{name} already has a neuron kernel ({LOWERED[name].__qualname__})")
            _LIB.impl(name, fn, "PrivateUse1")
            LOWERED[name] = fn
        return fn
    return register


def cpu_fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Run ``op`` through the CPU fallback (counted; an error naming the op in strict mode)."""
    schema = op._schema
    # a Python kernel receives wrapped-number operands as Python scalars: the schema wants tensors
    tensor_args = {a.name for a in schema.arguments if str(a.type) == "Tensor"}
    args = tuple(torch.tensor(v) if a.name in tensor_args and isinstance(v, (int, float, bool, complex)) else v
                 for a, v in zip(schema.arguments, args))
    kwargs = {k: torch.tensor(v) if k in tensor_args and isinstance(v, (int, float, bool, complex)) else v
              for k, v in kwargs.items()}
    return _C._cpu_fallback(schema.name, schema.overload_name, *args, **kwargs)


def meta_twin(x: Any) -> Any:
    """A meta tensor standing for a device tensor (shape, strides, dtype; lists and tuples mapped), to run
    PyTorch's own argument checks without touching data."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(meta_twin(v) for v in x)
    return x
