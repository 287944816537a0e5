"""Fused recurrent cells on the device: the LSTM and GRU cell ops ``nn.LSTM`` / ``nn.GRU`` call on
accelerators (``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell`` and their backward ops).

PyTorch picks these fused cells for CUDA and PrivateUse1 devices and has no CPU kernel for them,
so the CPU fallback cannot run them: they must be lowered. Each is composed from element-wise
launches (sigmoid, tanh, products) following the CUDA kernels' math; the workspace keeps what
the backward needs (LSTM: the four activated gates; GRU: r, z, n, hx and the hidden candidate).
"""
from __future__ import annotations

import torch

from torchneuron.ops.registry import lowering


def _sum_gates(input_gates, hidden_gates, input_bias, hidden_bias):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    return gates


@lowering("_thnn_fused_lstm_cell")
def fused_lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
                    input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None):
    """(hy, cy, workspace) of one LSTM step: i, f, o = sigmoid, g = tanh; cy = f*cx + i*g; hy = o*tanh(cy)."""
    i, f, g, o = _sum_gates(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


@lowering("_thnn_fused_lstm_cell_backward_impl")
def fused_lstm_cell_backward(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None, cx: torch.Tensor,
                             cy: torch.Tensor, workspace: torch.Tensor, has_bias: bool):
    """(grad of the gates, grad_cx, grad_bias) of one LSTM step from the saved activated gates."""
    i, f, g, o = workspace.chunk(4, 1)
    tcy = cy.tanh()
    gcx = torch.zeros_like(cx) if grad_cy is None else grad_cy
    if grad_hy is not None:
        gcx = gcx + grad_hy * o * (1 - tcy * tcy)
        d_o = grad_hy * tcy * o * (1 - o)
    else:
        d_o = torch.zeros_like(o)
    d_i = gcx * g * i * (1 - i)
    d_f = gcx * cx * f * (1 - f)
    d_g = gcx * i * (1 - g * g)
    grad_gates = torch.cat([d_i, d_f, d_g, d_o], 1)
    return grad_gates, gcx * f, grad_gates.sum(0) if has_bias else None


@lowering("_thnn_fused_gru_cell")
def fused_gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
                   input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None):
    """(hy, workspace) of one GRU step: r, z = sigmoid; n = tanh(i_n + r * h_n); hy = n + z * (hx - n)."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, i_n = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (i_n + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hx, hn], 1)


@lowering("_thnn_fused_gru_cell_backward")
def fused_gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool):
    """(grad input gates, grad hidden gates, grad_hx, grad input bias, grad hidden bias) of one GRU step."""
    r, z, n, hx, hn = workspace.chunk(5, 1)
    d_n = grad_hy * (1 - z) * (1 - n * n)
    d_z = grad_hy * (hx - n) * z * (1 - z)
    d_r = d_n * hn * r * (1 - r)
    grad_input = torch.cat([d_r, d_z, d_n], 1)
    grad_hidden = torch.cat([d_r, d_z, d_n * r], 1)
    bias = (grad_input.sum(0), grad_hidden.sum(0)) if has_bias else (None, None)
    return grad_input, grad_hidden, grad_hy * z, *bias
