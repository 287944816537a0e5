"""Fused recurrent cells on the device: the LSTM and GRU cell ops ``nn.LSTM`` / ``nn.GRU`` call on
accelerators (``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell`` and their backward ops).

PyTorch picks these fused cells for CUDA and PrivateUse1 devices and has no CPU kernel for them,
so the CPU fallback cannot run them: they must be lowered. Each runs as one launch of a kernel of
``kernels.rnn_cell`` (the CUDA kernels' math, the bias gradients summed in the same launch). Every operand
is handed over as the storage it views plus its strides, so the strided slices the recurrent loop passes
(a time step of the output's gradient) are read in place, not copied first. The workspace keeps what the
backward needs (LSTM: the four activated gates; GRU: r, z, n, hx and the hidden candidate).

float64 (which the CUDA kernels also accept, the NeuronCore's engines do not) is composed from element-wise
ops instead, which take the CPU fallback for float64 (counted and warned about as any fallback is).
"""
from __future__ import annotations

import torch

from torchneuron.kernels.rnn_cell import (gru_cell_backward_kernel, gru_cell_kernel, lstm_cell_backward_kernel,
                                          lstm_cell_kernel)
from torchneuron.ops.base import storage_span, type_name
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtypes(op: str, tensors: list[torch.Tensor | None]) -> None:
    """The CUDA kernels' dtype rules: floating types dispatched on the first tensor, the others of its dtype."""
    ts = [t for t in tensors if t is not None]
    first = ts[0].dtype
    if not first.is_floating_point or first not in KERNEL_DTYPES + (torch.float64,):
        raise NotImplementedError(f'"{op}" not implemented for \'{type_name(first)}\'')
    for t in ts[1:]:
        if t.dtype != first:
            raise RuntimeError(f"expected scalar type {type_name(first)} but found {type_name(t.dtype)}")
    if any(t.device != ts[0].device for t in ts[1:]):
        raise RuntimeError(f"{op}: expected all tensors to be on the same device, but found {ts[0].device} and "
                           f"{next(t.device for t in ts if t.device != ts[0].device)}")


def _check_cell(op: str, input_gates: torch.Tensor, hidden_gates: torch.Tensor, input_bias: torch.Tensor | None,
                hidden_bias: torch.Tensor | None, factor: int, prev: torch.Tensor) -> None:
    """The CUDA cells' size checks (gates [N, factor * H], 1-D biases of the gates' width, a state of N * H)."""
    if input_gates.dim() != 2:
        raise RuntimeError(f"{op}: expected input_gates to have 2 dims, but it has {input_gates.dim()}")
    if input_gates.shape != hidden_gates.shape:
        raise RuntimeError(f"{op}: input_gates {tuple(input_gates.shape)} and hidden_gates "
                           f"{tuple(hidden_gates.shape)} differ in size")
    width = input_gates.shape[1]
    if (input_bias is None) != (hidden_bias is None):
        raise RuntimeError(f"{op}: input_bias and hidden_bias must both be given or both be None")
    if input_bias is not None:
        if input_bias.dim() != 1 or input_bias.numel() != width:
            raise RuntimeError(f"{op}: expected input_bias of shape ({width},), got {tuple(input_bias.shape)}")
        if input_bias.shape != hidden_bias.shape:
            raise RuntimeError(f"{op}: input_bias {tuple(input_bias.shape)} and hidden_bias "
                               f"{tuple(hidden_bias.shape)} differ in size")
    if prev.dim() != 2 or prev.numel() != input_gates.shape[0] * width // factor:
        raise RuntimeError(f"{op}: expected a 2-D state of {input_gates.shape[0]} x {width // factor} elements, "
                           f"got {tuple(prev.shape)}")
    _check_dtypes(op, [input_gates, hidden_gates, prev, input_bias, hidden_bias])


def _operands(names: tuple[str, ...], tensors: tuple, N: int, cols: tuple[int, ...]) -> tuple[dict, tuple]:
    """The kernel's inputs (each tensor's storage span) and views ((row, column) strides; a bias (0, stride)) of
    the given tensors, a 2-D one first brought to [N, cols] (a view where its strides allow)."""
    inputs, views = {}, []
    for name, t, c in zip(names, tensors, cols):
        if t is None:
            continue
        if t.dim() == 1:
            views.append((0, t.stride(0)))
        else:
            if tuple(t.shape) != (N, c):
                t = t.reshape(N, c)
            views.append(tuple(t.stride()))
        inputs[name] = storage_span(t)
    return inputs, tuple(views)


def _on_kernel(*tensors: torch.Tensor | None) -> bool:
    """Whether the cell runs as a kernel: a dtype the engines compute in, neuron tensors, nothing empty."""
    ts = [t for t in tensors if t is not None]
    return ts[0].dtype in KERNEL_DTYPES and ts[0].device.type == "neuron" and all(t.numel() for t in ts)


# ---- LSTM ---------------------------------------------------------------------------------------------

def _forward(kernel, composed, gates: int, input_gates: torch.Tensor, hidden_gates: torch.Tensor,
             prev: torch.Tensor, input_bias: torch.Tensor | None, hidden_bias: torch.Tensor | None) -> tuple:
    """A forward cell's results (``gates`` blocks of H columns; the new states shaped as ``prev``, then the
    workspace): the kernel's, or ``composed``'s for a cell the kernel does not run."""
    op = f"_thnn_fused_{'lstm' if gates == 4 else 'gru'}_cell"
    _check_cell(op, input_gates, hidden_gates, input_bias, hidden_bias, gates, prev)
    if not _on_kernel(input_gates, prev):
        return composed(input_gates, hidden_gates, prev, input_bias, hidden_bias)
    N, H = input_gates.shape[0], input_gates.shape[1] // gates
    inputs, views = _operands(("igates", "hgates", "prev", "b_ih", "b_hh"),
                              (input_gates, hidden_gates, prev, input_bias, hidden_bias), N,
                              (gates * H, gates * H, H, 0, 0))
    *states, workspace = call_kernel(kernel, inputs, {"N": N, "H": H, "views": views}, op="aten::" + op)
    return (*(t.view(prev.shape) for t in states), workspace)


@lowering("_thnn_fused_lstm_cell")
def fused_lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
                    input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None):
    """(hy, cy, workspace) of one LSTM step: i, f, o = sigmoid, g = tanh; cy = f*cx + i*g; hy = o*tanh(cy)."""
    return _forward(lstm_cell_kernel, _lstm_cell_composed, 4, input_gates, hidden_gates, cx, input_bias,
                    hidden_bias)


@lowering("_thnn_fused_lstm_cell_backward_impl")
def fused_lstm_cell_backward(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None, cx: torch.Tensor,
                             cy: torch.Tensor, workspace: torch.Tensor, has_bias: bool):
    """(grad of the gates, grad_cx, grad_bias) of one LSTM step from the saved activated gates."""
    op = "_thnn_fused_lstm_cell_backward_impl"
    if grad_hy is None and grad_cy is None:
        return None, None, None
    grad = grad_hy if grad_hy is not None else grad_cy
    if grad.dim() != 2:
        raise RuntimeError(f"{op}: expected the output gradient to have 2 dims, but it has {grad.dim()}")
    for name, t in (("grad_hy", grad_hy), ("grad_cy", grad_cy), ("cx", cx), ("cy", cy)):
        if t is not None and t.shape != grad.shape:
            raise RuntimeError(f"{op}: expected {name} of size {tuple(grad.shape)}, got {tuple(t.shape)}")
    if workspace.dim() != 2 or workspace.numel() != 4 * grad.numel():
        raise RuntimeError(f"{op}: expected a 2-D workspace of {4 * grad.numel()} elements, got "
                           f"{tuple(workspace.shape)}")
    _check_dtypes(op, [workspace, grad_hy, grad_cy, cx, cy])
    N, H = grad.shape
    if not _on_kernel(workspace, cx):
        return _lstm_cell_backward_composed(grad_hy, grad_cy, cx, cy, workspace, has_bias)
    inputs, views = _operands(("cx", "cy", "workspace", "grad_hy", "grad_cy"),
                              (cx, cy, workspace, grad_hy, grad_cy), N, (H, H, 4 * H, H, H))
    res = call_kernel(lstm_cell_backward_kernel, inputs, {"N": N, "H": H, "views": views, "has_bias": bool(has_bias)},
                      op="aten::" + op)
    return res[0], res[1], res[2] if has_bias else None


# ---- GRU ----------------------------------------------------------------------------------------------

@lowering("_thnn_fused_gru_cell")
def fused_gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
                   input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None):
    """(hy, workspace) of one GRU step: r, z = sigmoid; n = tanh(i_n + r * h_n); hy = n + z * (hx - n)."""
    return _forward(gru_cell_kernel, _gru_cell_composed, 3, input_gates, hidden_gates, hx, input_bias, hidden_bias)


@lowering("_thnn_fused_gru_cell_backward")
def fused_gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool):
    """(grad input gates, grad hidden gates, grad_hx, grad input bias, grad hidden bias) of one GRU step."""
    op = "_thnn_fused_gru_cell_backward"
    if grad_hy.dim() != 2:
        raise RuntimeError(f"{op}: expected grad_hy to have 2 dims, but it has {grad_hy.dim()}")
    if workspace.numel() != 5 * grad_hy.numel():
        raise RuntimeError(f"{op}: expected a workspace of {5 * grad_hy.numel()} elements, got "
                           f"{tuple(workspace.shape)}")
    _check_dtypes(op, [workspace, grad_hy])
    N, H = grad_hy.shape
    if not _on_kernel(workspace, grad_hy):
        return _gru_cell_backward_composed(grad_hy, workspace, has_bias)
    inputs, views = _operands(("grad_hy", "workspace"), (grad_hy, workspace), N, (H, 5 * H))
    res = call_kernel(gru_cell_backward_kernel, inputs, {"N": N, "H": H, "views": views, "has_bias": bool(has_bias)},
                      op="aten::" + op)
    return (*res,) if has_bias else (*res, None, None)


# ---- float64 and empty cells: composed from element-wise ops ------------------------------------------

def _blocks(t: torch.Tensor, k: int, N: int, H: int) -> list[torch.Tensor]:
    """The k column blocks of H of ``t`` seen as [N, k * H] (slices: chunk cannot split an empty tensor in k)."""
    t = t.reshape(N, k * H)
    return [t[:, j * H:(j + 1) * H] for j in range(k)]


def _lstm_cell_composed(input_gates, hidden_gates, cx, input_bias, hidden_bias):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = _blocks(gates, 4, gates.shape[0], gates.shape[1] // 4)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx.reshape(i.shape) + i * g
    hy = o * cy.tanh()
    return hy.view(cx.shape), cy.view(cx.shape), torch.cat([i, f, g, o], 1)


def _lstm_cell_backward_composed(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = _blocks(workspace, 4, *cx.shape)
    tcy = cy.tanh()
    gcx = torch.zeros_like(cx) if grad_cy is None else grad_cy
    if grad_hy is not None:
        gcx = gcx + grad_hy * o * (1 - tcy * tcy)
        d_o = grad_hy * tcy * o * (1 - o)
    else:
        d_o = torch.zeros_like(o)
    grad_gates = torch.cat([gcx * g * i * (1 - i), gcx * cx * f * (1 - f), gcx * i * (1 - g * g), d_o], 1)
    return grad_gates, gcx * f, grad_gates.sum(0) if has_bias else None


def _gru_cell_composed(input_gates, hidden_gates, hx, input_bias, hidden_bias):
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    N, H = input_gates.shape[0], input_gates.shape[1] // 3
    (ir, iz, i_n), (hr, hz, hn) = _blocks(input_gates, 3, N, H), _blocks(hidden_gates, 3, N, H)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (i_n + r * hn).tanh()
    h = hx.reshape(n.shape)
    hy = n + z * (h - n)
    return hy.view(hx.shape), torch.cat([r, z, n, h, hn], 1)


def _gru_cell_backward_composed(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = _blocks(workspace, 5, *grad_hy.shape)
    d_n = grad_hy * (1 - z) * (1 - n * n)
    d_z = grad_hy * (hx - n) * z * (1 - z)
    d_r = d_n * hn * r * (1 - r)
    grad_input = torch.cat([d_r, d_z, d_n], 1)
    grad_hidden = torch.cat([d_r, d_z, d_n * r], 1)
    bias = (grad_input.sum(0), grad_hidden.sum(0)) if has_bias else (None, None)
    return grad_input, grad_hidden, grad_hy * z, *bias
