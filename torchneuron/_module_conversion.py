"""``Module.to("neuron")`` converts parameters in place, as it does for CUDA.

PyTorch converts a parameter in place (``param.data = new``) only between backends it
knows share a tensor type, a list that leaves out PrivateUse1; otherwise it makes new
Parameter objects, which unties tied weights (GPT-2's embedding and LM head) and
breaks references held by the user. Swapping the tensors' contents keeps every
Parameter object, so we do that for conversions that involve a neuron device.

Swapping is refused for a tensor that something else holds (an autograd graph that
saved a weight, for instance). Then, checked before anything changes, the conversion
makes new Parameter objects as PyTorch would, and re-ties parameters that were shared.

Uninitialized parameters and buffers of lazy modules (``nn.LazyLinear`` before its first
forward) stay uninitialized, on the new device and dtype, as they do when moved to CUDA:
swapping would turn them into ordinary empty tensors the lazy module no longer fills in.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, is_lazy


def _involves_neuron(module: nn.Module, target: torch.device | None) -> bool:
    if target is not None and target.type == "neuron":
        return True
    return any(t.device.type == "neuron" for t in module.parameters()) or any(
        t.device.type == "neuron" for t in module.buffers())


def _swappable(t: torch.Tensor | None) -> bool:
    """Whether torch.utils.swap_tensors will accept ``t`` (nothing else holds its TensorImpl)."""
    if t is None:
        return True
    count = t._use_count()
    return count <= 1 or (count == 2 and t.is_leaf)


def _convert_retied(module: nn.Module, convert: Callable[[], Any]) -> Any:
    """Run ``convert`` with PyTorch's replacing conversion, then re-tie shared parameters."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, name))
    result = convert()
    for places in slots.values():
        first_module, first_name = places[0]
        for m, name in places[1:]:
            m._parameters[name] = first_module._parameters[first_name]
    return result


def _swapping(method: Callable[..., Any], target_of: Callable[..., torch.device | None],
              dtype_of: Callable[..., torch.dtype | None] = lambda *a, **k: None) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.__future__.get_swap_module_params_on_conversion() or not _involves_neuron(
                self, target_of(*args, **kwargs)):
            return method(self, *args, **kwargs)
        lazy = _uninitialized(self)
        device, dtype = target_of(*args, **kwargs), dtype_of(*args, **kwargs)
        moved = [_moved_uninitialized(t, device, dtype) for _, _, t in lazy]    # (a bad device raises here)
        for store, name, _ in lazy:                      # the conversion skips them
            store[name] = None
        try:
            # The grad is detached from its parameter before the swap, so only the parameter counts.
            if not all(_swappable(p) for p in self.parameters()):
                result = _convert_retied(self, lambda: method(self, *args, **kwargs))
            else:
                torch.__future__.set_swap_module_params_on_conversion(True)
                try:
                    result = method(self, *args, **kwargs)
                finally:
                    torch.__future__.set_swap_module_params_on_conversion(False)
        except BaseException:
            for store, name, t in lazy:                  # a failed conversion changes nothing
                store[name] = t
            raise
        for (store, name, _), t in zip(lazy, moved):
            store[name] = t
        return result

    return wrapper


def _uninitialized(module: nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """(dict, name, tensor) of every uninitialized parameter and buffer of a lazy module."""
    return [(store, name, t) for m in module.modules() for store in (m._parameters, m._buffers)
            for name, t in store.items() if t is not None and is_lazy(t)]


def _moved_uninitialized(t: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None) -> torch.Tensor:
    """A new uninitialized parameter or buffer like ``t`` on ``device``, in ``dtype`` if ``t`` is floating."""
    device = t.device if device is None else device
    dtype = dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
    if isinstance(t, UninitializedParameter):
        return UninitializedParameter(requires_grad=t.requires_grad, device=device, dtype=dtype)
    return UninitializedBuffer(requires_grad=t.requires_grad, device=device, dtype=dtype,
                               persistent=getattr(t, "persistent", True))


def _to_target(*args: Any, **kwargs: Any) -> torch.device | None:
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return None if device is None else torch.device(device)


def _to_dtype(*args: Any, **kwargs: Any) -> torch.dtype | None:
    return torch._C._nn._parse_to(*args, **kwargs)[1]


def _neuron(self: nn.Module, device: Any = None) -> nn.Module:
    """Move all parameters and buffers to a neuron device, in place."""
    target = torch.device("neuron") if device is None else (
        torch.device("neuron", device) if isinstance(device, int) else torch.device(device))
    return self.to(target)


def install() -> None:
    """Route Module.to / cpu / to_empty through tensor swapping when neuron is involved."""
    if getattr(nn.Module.to, "_torchneuron", False):
        return
    nn.Module.to = _swapping(nn.Module.to, _to_target, _to_dtype)
    nn.Module.cpu = _swapping(nn.Module.cpu, lambda *a, **k: torch.device("cpu"))
    nn.Module.to_empty = _swapping(nn.Module.to_empty, lambda *a, device=None, **k: torch.device(device)
                                   if device is not None else None)
    nn.Module.to._torchneuron = True
    nn.Module.neuron = _neuron
