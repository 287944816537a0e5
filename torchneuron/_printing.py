"""Printing a neuron tensor formats a host copy of it.

PyTorch's formatter (``torch._tensor_str``) inspects the values it prints with tensor ops in
float64 (the widest range it can show), run where the tensor lives. On neuron those would be CPU
fallbacks (the NeuronCore has no float64 arithmetic: counted, warned, refused under
``TORCHNEURON_STRICT=1``) and formatting kernels on the simulated device clock. Copying the
values to the host first is one transfer, as the formatter reads every printed element back
anyway; the ``device='neuron:0'`` suffix and ``grad_fn`` still come from the tensor itself.
"""
from __future__ import annotations

import functools

import torch
import torch._tensor_str


def install() -> None:
    """Route the formatting of strided neuron tensors through a CPU copy (once)."""
    original = torch._tensor_str._tensor_str
    if getattr(original, "_torchneuron", False):
        return

    @functools.wraps(original)
    def _tensor_str(self: torch.Tensor, indent: int) -> str:
        if self.device.type == "neuron" and self.layout == torch.strided:
            self = self.detach().cpu()
        return original(self, indent)

    _tensor_str._torchneuron = True
    torch._tensor_str._tensor_str = _tensor_str
