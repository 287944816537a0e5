"""The inference fast path of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` on the device.

In eval mode without autograd, PyTorch sends those modules (neuron is one of their supported devices) to
fused ATen ops with no CPU-independent decomposition: ``_native_multi_head_attention``,
``_transformer_encoder_layer_fwd`` and the ``_masked_softmax`` they use. Each is composed here from
lowered ops, following the CPU kernels step by step (``transformers/attention.cpp``,
``transformer.cpp``): the in-projection (one linear for self-attention), the bias and the 1/sqrt(head_dim)
scale applied to q, q k^T, the masked softmax, the weighted sum of v and the out-projection; the encoder
layer adds the residuals, the two layer norms (before or after, ``norm_first``) and the ReLU/GELU
feed-forward block.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from torchneuron.ops.base import aten, FLOATS, Unsupported
from torchneuron.ops.registry import lowering



def _full_mask(self: torch.Tensor, mask: torch.Tensor, mask_type: int | None) -> torch.Tensor | None:
    """The mask broadcastable to ``self`` the CPU kernel derives from (mask, mask_type), after its checks;
    None where the CPU's handling is not reproduced here (the fallback takes it)."""
    if mask.dtype != torch.bool:
        raise RuntimeError("Mask should be a boolean tensor")
    if mask.dim() != 2 or self.dim() != 4:       # types 0 and 1 are for 2-D masks of 4-D inputs only
        mask_type = 2
    if mask_type == 2:
        if tuple(self.shape) != tuple(mask.shape):
            raise RuntimeError("For mask_type == 2 mask shape should match input shape")
        return mask
    B, L = self.shape[0], self.shape[2]
    if mask_type == 1:
        if self.shape[0] != mask.shape[0] or self.shape[2] != mask.shape[1]:
            raise RuntimeError("For mask_type == 1 mask shape should be (B, L)")
        return mask.view(B, 1, 1, L)
    if mask_type == 0:
        if self.shape[2] != mask.shape[0] or self.shape[2] != mask.shape[1]:
            raise RuntimeError("For mask_type == 0 mask shape should be (L, L)")
        return mask.view(1, 1, L, L)
    return None


@lowering("_masked_softmax")
def masked_softmax(self: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                   mask_type: int | None = None) -> torch.Tensor:
    """Softmax along ``dim`` (default the last) over the elements the mask leaves (True masks out; a row
    with nothing left is NaN, as on the CPU)."""
    full = _full_mask(self, mask, mask_type) if self.device.type == "neuron" else None
    if full is None or self.dtype not in FLOATS or mask.device != self.device:
        # named: the attention lowerings call this directly, and their inputs stay on the device
        raise Unsupported("a mask type the device does not take, a dtype the engines lack, or a mask elsewhere",
                          fallback=(aten._masked_softmax.default, (self, mask, dim, mask_type), {}))
    d = self.dim() - 1 if dim is None else dim
    return self.masked_fill(full, float("-inf")).softmax(d)


def _projection(query, key, value, D: int, w: torch.Tensor, b: torch.Tensor):
    """(q, k, v) [B, T, D] in-projections with their biases: one linear when the three inputs are one tensor."""
    if query is key and key is value:
        return F.linear(query, w, b).split(D, dim=-1)
    if key is value:
        k, v = F.linear(key, w[D:], b[D:]).split(D, dim=-1)
        return F.linear(query, w[:D], b[:D]), k, v
    return (F.linear(query, w[:D], b[:D]), F.linear(key, w[D:2 * D], b[D:2 * D]),
            F.linear(value, w[2 * D:], b[2 * D:]))


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:
    B, T, D = t.shape
    return t.reshape(B, T, H, D // H).transpose(1, 2)


def _attention(query, key, value, D: int, H: int, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
               need_weights: bool, average_attn_weights: bool, mask_type):
    """``_native_multi_head_attention`` as lowered ops: (out [B, T, D], weights or an empty tensor)."""
    q, k, v = _projection(query, key, value, D, qkv_weight, qkv_bias)
    q = _heads(q, H) * (1.0 / math.sqrt(D // H))          # the CPU scales q after adding its bias
    scores = q @ _heads(k, H).transpose(-2, -1)            # [B, H, T, S]
    if mask is not None and mask.dtype != torch.bool:    # (an additive float mask: non-zero masks out)
        warnings.warn("Converting mask without torch.bool dtype to bool; this will negatively affect "
                      "performance. Prefer to use a boolean mask directly.")
        mask = mask.to(torch.bool)
    probs = masked_softmax(scores, mask, scores.dim() - 1, mask_type) if mask is not None else scores.softmax(-1)
    ctx = (probs @ _heads(v, H)).transpose(1, 2).reshape(query.shape[0], query.shape[1], D)
    out = F.linear(ctx, proj_weight, proj_bias)
    if not need_weights:
        return out, out.new_empty(0)
    return out, (probs.sum(dim=1) / H if average_attn_weights else probs)


def _supported(*tensors: torch.Tensor | None) -> bool:
    first = tensors[0]
    return first.device.type == "neuron" and first.dim() == 3 and not first.is_nested and all(
        t is None or (t.device == first.device and (t.dtype == first.dtype or t.dtype == torch.bool)
                      and not t.is_nested) for t in tensors) and first.dtype in FLOATS


@lowering("_native_multi_head_attention")
def native_multi_head_attention(query, key, value, embed_dim: int, num_head: int, qkv_weight, qkv_bias,
                                proj_weight, proj_bias, mask=None, need_weights: bool = True,
                                average_attn_weights: bool = True, mask_type: int | None = None):
    """``nn.MultiheadAttention``'s inference fast path: in-projection, scaled masked attention, out-projection."""
    if not _supported(query, key, value, qkv_weight, qkv_bias, proj_weight, proj_bias, mask) or \
            embed_dim % num_head or query.shape[-1] != embed_dim:
        raise Unsupported
    return _attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                      need_weights, average_attn_weights, mask_type)


@lowering("_transformer_encoder_layer_fwd")
def transformer_encoder_layer_fwd(src, embed_dim: int, num_heads: int, qkv_weight, qkv_bias, proj_weight,
                                  proj_bias, use_gelu: bool, norm_first: bool, eps: float, norm_weight_1,
                                  norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2,
                                  ffn_bias_2, mask=None, mask_type: int | None = None):
    """``nn.TransformerEncoderLayer``'s inference fast path: attention and feed-forward blocks with their
    residuals and layer norms, in the order ``norm_first`` picks."""
    params = (qkv_weight, qkv_bias, proj_weight, proj_bias, norm_weight_1, norm_bias_1, norm_weight_2,
              norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2)
    if not _supported(src, *params, mask) or embed_dim % num_heads or src.shape[-1] != embed_dim:
        raise Unsupported("tensors the device does not take, or heads that do not divide the embedding")
    D = (embed_dim,)

    def attend(x):
        return _attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                          False, False, mask_type)[0]

    def feed_forward(x):
        hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(hidden) if use_gelu else F.relu(hidden), ffn_weight_2, ffn_bias_2)

    x = src
    if norm_first:
        x = x + attend(F.layer_norm(x, D, norm_weight_1, norm_bias_1, eps))
        return x + feed_forward(F.layer_norm(x, D, norm_weight_2, norm_bias_2, eps))
    x = F.layer_norm(x + attend(x), D, norm_weight_1, norm_bias_1, eps)
    return F.layer_norm(x + feed_forward(x), D, norm_weight_2, norm_bias_2, eps)
