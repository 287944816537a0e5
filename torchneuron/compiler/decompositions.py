"""The decomposition table AOTAutograd applies before the compiler sees a graph.

PyTorch's core-ATen decompositions, minus the ops that have a better form here than their
decomposition: library kernels (layer norm, softmax, and their backward ops, which run as one
pass over rows instead of several reductions and element-wise passes) and the eager ops whose
one-launch neuron kernels beat their decomposition when they run between programs
(``nll_loss`` forward/backward, embedding backward, dropout).
"""
from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions

aten = torch.ops.aten

KEEP_WHOLE = (
    aten.native_layer_norm, aten.native_layer_norm_backward,
    aten._softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
    aten.gelu, aten.gelu_backward, aten.silu, aten.silu_backward, aten.sigmoid_backward, aten.tanh_backward,
    aten.threshold_backward, aten.addcmul, aten.addcdiv, aten.lerp,
    aten.nll_loss_forward, aten.nll_loss_backward, aten.embedding_dense_backward, aten.native_dropout,
    aten.native_dropout_backward,
)


# Multi-tensor (``_foreach_*``) ops of the optimizers, as one element-wise op per tensor: each becomes a
# pointwise node the compiler fuses (an AdamW update per parameter is one pass), all in one program,
# instead of an eager launch per foreach op. name -> (per-tensor op, keyword of a trailing scalar argument)
FOREACH = {
    "add": (aten.add, None), "sub": (aten.sub, None), "mul": (aten.mul, None), "div": (aten.div, None),
    "addcmul": (aten.addcmul, "value"), "addcdiv": (aten.addcdiv, "value"), "lerp": (aten.lerp, None),
    "sqrt": (aten.sqrt, None), "neg": (aten.neg, None), "reciprocal": (aten.reciprocal, None),
    "pow": (aten.pow, None), "maximum": (aten.maximum, None), "minimum": (aten.minimum, None),
    "abs": (aten.abs, None), "exp": (aten.exp, None), "sign": (aten.sign, None),
}


def _per_tensor(op, keyword: str | None):
    """``_foreach_<op>(lists and scalars...)`` as ``[op(elements i...) for each i]``."""
    def decomposed(*args, **kwargs):
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        out = []
        for i in range(n):
            elems = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            kw = dict(kwargs)
            if keyword is not None and len(elems) == 4:   # addcmul/addcdiv's value (kwarg-only per tensor)
                kw[keyword] = elems.pop()
            out.append(op(*elems, **kw))
        return out
    return decomposed


def _foreach_table() -> dict:
    table = {}
    for name, (op, keyword) in FOREACH.items():
        packet = getattr(aten, f"_foreach_{name}", None)
        for overload in (packet.overloads() if packet is not None else ()):
            table[getattr(packet, overload)] = _per_tensor(op, keyword)
    return table


@functools.cache
def decomposition_table() -> dict:
    """The table (built once): core-ATen decompositions without ``KEEP_WHOLE``'s overloads, plus ``FOREACH``."""
    table = dict(core_aten_decompositions())
    keep = {ov for packet in KEEP_WHOLE for ov in (getattr(packet, name) for name in packet.overloads())}
    return {**{op: fn for op, fn in table.items() if op not in keep}, **_foreach_table()}
