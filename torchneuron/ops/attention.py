"""Fused scaled dot-product attention: ``torch.nn.functional.scaled_dot_product_attention`` on neuron.

The device's SDPA backend choice (``_csrc/attention.cpp``) sends 4-D floating inputs without an
attention mask, dropout or grouped-query heads here, through PyTorch's "overrideable" backend; the
rest takes PyTorch's math path. Small heads of at most 128 queries and keys run several heads per
instruction (``kernels/packed_attention.py``: one launch per direction). Other sequences of 32 keys or
queries and more whose heads fit the flash kernels (head dims <= 128, a head's Q, K, V in SBUF:
``kernels/attention.py``) run as one launch per direction, reading strided heads in place; the scores never
reach HBM. Both kernel families lay the output and the gradients out as the query is: a query viewed from a
[B, n, H * d] projection gets results of [B, n, H, d] memory, so that merging the heads back (and autograd's
reverse) is a view, not a copy launch. The packed-heads kernels run with or without stacked query groups
(``stack_queries``), whichever the device's timing model prices faster for the operands. Shorter sequences (many small heads: grouped matmuls are faster) and
larger heads are composed per (batch, head) matrix, with
``s`` the scale (1/sqrt(E) unless given) and the top-left causal mask of ``is_causal``:

    forward:   S = Q K^T                      one batched matmul launch
               P, lse = softmax(s S + mask)   one launch (attention_softmax_kernel), lse = logsumexp
               O = P V                        one batched matmul launch
    backward:  P recomputed as above          two launches
               dV = P^T dO,  dP = dO V^T      two batched matmul launches
               dS = s P (dP - rowsum(P dP))   one launch (softmax_bwd_kernel)
               dQ = dS K,  dK = dS^T Q        two batched matmul launches

bf16/fp16 heads on that path round as the CPU's attention kernel does (``_reduced_attention``): the
unnormalized exp(z - max) meet V, the sum of the exponentials divides their fp32 products once, and the
backward applies the scale after rounding dS; against about twenty element-wise, mask and copy launches per direction on the math path (the
composed path makes strided query/key/value views dense on the device first).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from torchneuron import runtime
from torchneuron.kernels.packed_attention import (attention_kernels, packed_attention_bwd, packed_attention_fwd,
                                                  stacked_groups)
from torchneuron.kernels.softmax import attention_fits, attention_softmax_kernel
from torchneuron.ops.base import storage_span
from torchneuron.ops.kernel_call import call_kernel, PlanCache, traced_kernel
from torchneuron.ops.nn import softmax_backward
from torchneuron.ops.registry import lowering


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: torch.Tensor | None,
           dropout_p: float) -> None:
    """The fused path's contract (what the backend choice guarantees), checked for direct calls."""
    if attn_bias is not None or dropout_p != 0.0:
        raise RuntimeError("neuron fused attention: attention masks and dropout take the math path "
                           "(scaled_dot_product_attention chooses it)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise RuntimeError(f"neuron fused attention: expected 4-D query, key and value, got {query.dim()}-D, "
                           f"{key.dim()}-D and {value.dim()}-D")
    B, H, _, E = query.shape
    if tuple(key.shape[:2]) != (B, H) or tuple(value.shape[:2]) != (B, H) or key.shape[3] != E or \
            key.shape[2] != value.shape[2]:
        raise RuntimeError(f"neuron fused attention: incompatible shapes query {list(query.shape)}, key "
                           f"{list(key.shape)}, value {list(value.shape)}")


OP = "aten::_scaled_dot_product_fused_attention_overrideable"


def _kernels(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> tuple | None:
    """(forward, backward) kernels for these heads (``attention_kernels``: packed heads, flash, or None for the
    composed path), for one dtype, a positive scale and at least one head."""
    B, H, L, E = query.shape
    if not (query.dtype == key.dtype == value.dtype and scale > 0 and B * H > 0):
        return None
    return attention_kernels(B, H, L, key.shape[2], E, value.shape[3], query.dtype)


def _views(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Each [B, H, n, d] operand's (offset 0, strides) view over the flat span of memory it covers
    (``storage_span``): the flash kernels read strided heads where they lie."""
    return {f"{name}_view": (0, tuple(t.stride())) for name, t in tensors.items()}


# (direction, device index, scale, causal, each operand's shape, strides and dtype) -> the plan of a fused launch:
# an attention called again with the same geometry (each layer of a training step, every step) launches its traced
# program without choosing the kernel, the result layout and the stacking again (extra: the result layout)
_PLANS = PlanCache()


def _geometry(*ts: torch.Tensor) -> tuple:
    """What a fused launch's trace depends on in its operands: their shapes, strides and dtypes."""
    return tuple((t.shape, t.stride(), t.dtype) for t in ts)


def _traced(kernel, inputs: dict[str, torch.Tensor], meta: dict, index: int) -> tuple:
    """The traced program of an attention kernel; for the packed-heads kernels, with or without query groups
    stacked on the partitions (``stack_queries``, with ``pass_dmas``: a lone launch has no other DMAs to share
    with), whichever the device's timing model prices faster for these operands (which wins depends on the shape
    and on how the heads lie in memory: the demo's forward from a fused projection is faster stacked, its
    backward not)."""
    B, H, L, S = meta["shape"][:4]
    if kernel not in (packed_attention_fwd, packed_attention_bwd) or stacked_groups(L, S) == 1:
        return traced_kernel(kernel, inputs, meta)
    spec = runtime.core(index).spec
    traced = [traced_kernel(kernel, inputs, {**meta, "stack_queries": stack, "pass_dmas": stack})
              for stack in (False, True)]
    return min(traced, key=lambda t: t[0].schedule(spec).device_time_ns)


def _launch(plan_key: tuple, operands: list[torch.Tensor], build: Callable[[], tuple], op: str
            ) -> tuple[tuple[torch.Tensor, ...], str]:
    """Launch the fused kernel of ``plan_key`` (its second item the device index) on ``operands``; return its
    results and their layout. On the first call with this key, ``build()`` gives (kernel, the operands' slot names,
    meta, layout) for the trace; later calls replay the kept plan."""
    plan = _PLANS.get(plan_key)
    if plan is None:
        kernel, names, meta, layout = build()
        plan = _PLANS.keep(plan_key, _traced(kernel, dict(zip(names, operands)), meta, plan_key[1]),
                           {n: i for i, n in enumerate(names)}, extra=layout)
    return plan.launch(operands, plan_key[1], op), plan.extra


def _layout(t: torch.Tensor) -> str:
    """The kernel result layout matching a [B, H, n, d] operand's: "rows" when its heads lie side by side in
    each row of a batch-major tensor (a view of a [B, n, H * d] projection), so that the caller's
    ``transpose(1, 2).reshape(B, n, H * d)`` of the result (and autograd's of the gradient) is a view rather than
    a copy launch; else "heads" (also for sequence-major operands such as ``nn.MultiheadAttention``'s, a view of
    [n, B * H, d], whose gradients the rows layout would make autograd copy)."""
    B, H, n = t.shape[:3]
    rows = H > 1 and n > 1 and t.stride(1) < t.stride(2)
    return "rows" if rows and (B == 1 or t.stride(0) >= n * t.stride(2)) else "heads"


def _matrices(t: torch.Tensor) -> torch.Tensor:
    """[B, H, n, d] as the [B*H, n, d] batch the matmul kernel takes (a device copy when strided)."""
    return t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])


def _products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of [BH, n, d] batches in fp32: the CPU's attention keeps scores (and their gradients) in fp32;
    rounded to bf16 first, a score of 30 loses up to 0.06 before exp(), a 6% error in its probability."""
    if a.dtype in (torch.bfloat16, torch.float16):
        a, b = a.float(), b.float()
    return torch.bmm(a, b)


def _probabilities(scores: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(scale * scores + causal mask), logsumexp in fp32) over the last dim of [BH, L, S] scores, the
    probabilities in the scores' dtype."""
    BH, L, S = scores.shape
    if attention_fits(S):
        probs, lse = call_kernel(attention_softmax_kernel, {"x": scores.reshape(BH * L, S)},
                                 {"scale": scale, "causal_len": L if causal else 0},
                                 op=OP)
        return probs.reshape(BH, L, S), lse.reshape(BH, L)
    z = scores.float() * scale                      # rows too long for one pass: the same math as separate ops
    if causal:
        keep = torch.ones((L, S), dtype=torch.bool, device=scores.device).tril()
        z = z.masked_fill(~keep, float("-inf"))
    return torch.softmax(z, -1).to(scores.dtype), torch.logsumexp(z, -1)


def _reduced_attention(scores: torch.Tensor, value: torch.Tensor, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in V's dtype, logsumexp) of bf16/fp16 attention from fp32 [BH, L, S] scores, rounded as the CPU's
    attention kernel rounds: the unnormalized exp(z - max) meet V in its dtype, the products accumulate in fp32,
    and the sum of the exponentials divides them once, in fp32, before the one rounding of the output.
    Normalized first and rounded (the fp32 path's form), the probabilities carry a second rounding into every
    term: twice the CPU's error, 6% of the outputs a unit or more away from its."""
    L, S = scores.shape[1:]
    z = scores * scale
    if causal:
        keep = torch.ones((L, S), dtype=torch.bool, device=scores.device).tril()
        z = z.masked_fill(~keep, float("-inf"))
    top = z.amax(-1, keepdim=True)
    weights = (z - top).exp()
    total = weights.sum(-1, keepdim=True)
    out = torch.bmm(weights.to(value.dtype).float(), value.float()) / total
    return out.to(value.dtype), (top + total.log()).squeeze(-1)


def _reduced_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                                out: torch.Tensor, scale: float, causal: bool, mask: Sequence[bool]):
    """(dq, dk, dv) of bf16/fp16 attention over [BH, n, d] matrices, rounded as the CPU's attention backward
    rounds: the probabilities and dS = P (dP - rowsum(dO * O)) (O the rounded output) each meet their matmul
    rounded to the dtype, the scale multiplies the fp32 products of dS, and each gradient is rounded once."""
    probs, _ = _probabilities(_products(q, k.transpose(1, 2)), scale, causal)
    dq = dk = dv = None
    if mask[2]:
        dv = _products(probs.to(q.dtype).transpose(1, 2), do).to(q.dtype)
    if mask[0] or mask[1]:
        row = (do.float() * out.float()).sum(-1, keepdim=True)
        ds = (probs * (_products(do, v.transpose(1, 2)) - row)).to(q.dtype)
        if mask[0]:
            dq = (_products(ds, k) * scale).to(q.dtype)
        if mask[1]:
            dk = (_products(ds.transpose(1, 2), q) * scale).to(q.dtype)
    return dq, dk, dv


@lowering("_scaled_dot_product_fused_attention_overrideable")
def sdpa_fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, return_debug_mask: bool = False, *,
               scale: float | None = None):
    """Attention forward: (output, logsumexp, and the flash-attention bookkeeping outputs, empty here)."""
    _check(query, key, value, attn_bias, dropout_p)
    B, H, L, E = query.shape
    S, Ev = key.shape[2], value.shape[3]
    s = _scale(scale, E)
    plan_key = ("fwd", query.get_device(), s, bool(is_causal), _geometry(query, key, value))
    if _PLANS.get(plan_key) is not None or _kernels(query, key, value, s):
        def build() -> tuple:
            layout = _layout(query)
            return (_kernels(query, key, value, s)[0], ("q", "k", "v"),
                    {"scale": s, "causal": bool(is_causal), **_views({"q": query, "k": key, "v": value}),
                     "shape": (B, H, L, S, E, Ev), "out_layout": layout}, layout)
        (out, lse), layout = _launch(plan_key, [storage_span(t) for t in (query, key, value)], build, OP)
        if layout == "rows":
            out = out.transpose(1, 2)
    elif query.dtype in (torch.bfloat16, torch.float16):
        out, lse = _reduced_attention(_products(_matrices(query), _matrices(key).transpose(1, 2)), _matrices(value),
                                      s, is_causal)
        out = out.view(B, H, L, Ev)
    else:
        probs, lse = _probabilities(_products(_matrices(query), _matrices(key).transpose(1, 2)), s, is_causal)
        out = torch.bmm(probs, _matrices(value)).view(B, H, L, Ev)
    empty = query.new_empty(0)
    # no dropout, so no random state to record: the philox seed/offset are placeholders (never read)
    seed, offset = (torch.empty((), dtype=torch.int64, device=query.device) for _ in range(2))
    return out, lse.view(B, H, L), empty, empty, L, S, seed, offset, empty


@lowering("_scaled_dot_product_fused_attention_overrideable_backward")
def sdpa_fused_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_bias: torch.Tensor | None, grad_input_mask: Sequence[bool], out: torch.Tensor,
                        logsumexp: torch.Tensor, cum_seq_q: torch.Tensor, cum_seq_k: torch.Tensor, max_q: int,
                        max_k: int, dropout_p: float, is_causal: bool, philox_seed: torch.Tensor,
                        philox_offset: torch.Tensor, *, scale: float | None = None):
    """Attention backward: (grad_query, grad_key, grad_value, grad_attn_bias = None)."""
    _check(query, key, value, attn_bias if attn_bias is not None and attn_bias.numel() else None, dropout_p)
    s = _scale(scale, query.shape[3])
    lse = logsumexp.contiguous()
    plan_key = ("bwd", query.get_device(), s, bool(is_causal), _geometry(query, key, value, out, grad_out, lse))
    if grad_out.dtype == out.dtype == query.dtype and (_PLANS.get(plan_key) is not None
                                                       or _kernels(query, key, value, s)):
        def build() -> tuple:
            B, H, L, E = query.shape
            layout = _layout(query)
            views = _views({"q": query, "k": key, "v": value, "o": out, "do": grad_out})
            return (_kernels(query, key, value, s)[1], ("q", "k", "v", "o", "do", "lse"),
                    {"scale": s, "causal": bool(is_causal), **views, "out_layout": layout,
                     "shape": (B, H, L, key.shape[2], E, value.shape[3])}, layout)
        grads, layout = _launch(plan_key, [*(storage_span(t) for t in (query, key, value, out, grad_out)), lse],
                                build, OP + "_backward")
        dq, dk, dv = (g.transpose(1, 2) for g in grads) if layout == "rows" else grads
        return (dq if grad_input_mask[0] else None, dk if grad_input_mask[1] else None,
                dv if grad_input_mask[2] else None, None)
    q, k, v, do = _matrices(query), _matrices(key), _matrices(value), _matrices(grad_out)
    if query.dtype in (torch.bfloat16, torch.float16) and grad_out.dtype == out.dtype == query.dtype:
        grads = _reduced_attention_backward(q, k, v, do, _matrices(out), s, is_causal, grad_input_mask)
        return (*(g if g is None else g.view(t.shape) for g, t in zip(grads, (query, key, value))), None)
    probs, _ = _probabilities(_products(q, k.transpose(1, 2)), s, is_causal)   # fp32 for bf16/fp16 inputs
    dq = dk = dv = None
    if grad_input_mask[2]:
        dv = torch.bmm(probs.to(do.dtype).transpose(1, 2), do).view(value.shape)
    if grad_input_mask[0] or grad_input_mask[1]:
        ds = softmax_backward(_products(do, v.transpose(1, 2)), probs, -1, log=False, scale=s).to(q.dtype)
        if grad_input_mask[0]:
            dq = torch.bmm(ds, k).view(query.shape)
        if grad_input_mask[1]:
            dk = torch.bmm(ds.transpose(1, 2), q).view(key.shape)
    return dq, dk, dv, None
