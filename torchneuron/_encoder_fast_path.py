"""``nn.TransformerEncoder``'s inference fast path without nested tensors.

In eval mode without autograd, with a padding mask, ``TransformerEncoder.forward`` packs the batch into a
nested tensor (neuron is one of its supported devices), runs the layers on it and pads the result back
with zeros. The device has no nested tensors, so for neuron inputs the same result is computed dense: the
layers run with the padding mask (the kept positions get the same values) and the padded positions are
zeroed, as ``to_padded_tensor(0.0)`` leaves them.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn


def _takes_nested_path(encoder: nn.TransformerEncoder, src: torch.Tensor, mask: torch.Tensor | None,
                       padding: torch.Tensor | None) -> bool:
    """Whether ``TransformerEncoder.forward`` would pack ``src`` into a nested tensor (its sparsity fast
    path, PyTorch 2.13's conditions in its order)."""
    first = encoder.layers[0]
    params = (first.self_attn.in_proj_weight, first.self_attn.in_proj_bias, first.self_attn.out_proj.weight,
              first.self_attn.out_proj.bias, first.norm1.weight, first.norm1.bias, first.norm2.weight,
              first.norm2.bias, first.linear1.weight, first.linear1.bias, first.linear2.weight, first.linear2.bias)
    return (torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor", False)
            and not first.training and src.dim() == 3 and padding is not None and not src.is_nested
            and mask is None and not torch.is_autocast_enabled() and not torch.compiler.is_compiling()
            and (not getattr(encoder, "mask_check", True)
                 or torch._nested_tensor_from_mask_left_aligned(src, padding.logical_not()))
            and not torch.overrides.has_torch_function((src, *params))
            and not (torch.is_grad_enabled() and any(p.requires_grad for p in (src, *params))))


def _dense_encoder(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``TransformerEncoder.forward`` computing the nested-tensor path dense for neuron inputs."""
    @functools.wraps(forward)
    def wrapper(self: nn.TransformerEncoder, src: torch.Tensor, mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None, is_causal: bool | None = None) -> torch.Tensor:
        if src.device.type != "neuron" or not _takes_nested_path(self, src, mask, src_key_padding_mask):
            return forward(self, src, mask, src_key_padding_mask, is_causal)
        norm, self.norm, self.use_nested_tensor = self.norm, None, False
        try:
            out = forward(self, src, mask, src_key_padding_mask, is_causal)
        finally:
            self.norm, self.use_nested_tensor = norm, True
        out = out.masked_fill(src_key_padding_mask.to(torch.bool).unsqueeze(-1), 0.0)
        return out if norm is None else norm(out)
    return wrapper


def install() -> None:
    """Route ``TransformerEncoder.forward`` through ``_dense_encoder`` (once)."""
    if getattr(nn.TransformerEncoder.forward, "_torchneuron", False):
        return
    nn.TransformerEncoder.forward = _dense_encoder(nn.TransformerEncoder.forward)
    nn.TransformerEncoder.forward._torchneuron = True
