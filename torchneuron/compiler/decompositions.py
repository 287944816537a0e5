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


@functools.cache
def decomposition_table() -> dict:
    """The table (built once): core-ATen decompositions without ``KEEP_WHOLE``'s overloads."""
    table = dict(core_aten_decompositions())
    keep = {ov for packet in KEEP_WHOLE for ov in (getattr(packet, name) for name in packet.overloads())}
    return {op: fn for op, fn in table.items() if op not in keep}
