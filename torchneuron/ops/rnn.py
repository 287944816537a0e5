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
from torch.autograd import forward_ad

from torchneuron.kernels.rnn_cell import (fused_product_fits, gru_cell_backward_kernel, gru_cell_kernel,
                                          lstm_cell_backward_kernel, lstm_cell_kernel)
from torchneuron.kernels.rnn_sequence import (input_fits, lstm_sequence_backward_kernel, lstm_sequence_kernel,
                                              projection_fits, sequence_fits)
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
    """The kernel's inputs (each tensor's storage span) and views ((name, (row, column) strides); a bias
    (0, stride)) of the given tensors, a 2-D one first brought to [N, cols] (a view where its strides allow;
    cols 0: a weight, taken as it is)."""
    inputs, views = {}, []
    for name, t, c in zip(names, tensors, cols):
        if t is None:
            continue
        if t.dim() == 1:
            views.append((name, (0, t.stride(0))))
        else:
            if c and tuple(t.shape) != (N, c):
                t = t.reshape(N, c)
            views.append((name, tuple(t.stride())))
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
    return (*(t if t.shape == prev.shape else t.view(prev.shape) for t in states), workspace)


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


# ---- whole sequences: nn.LSTM / nn.GRU --------------------------------------------------------------------
# ``aten::lstm.input`` / ``aten::gru.input`` are CompositeImplicitAutograd: on an accelerator PyTorch runs them as
# a loop over time steps of two products and a fused cell each, and the autograd engine then differentiates every
# step's products separately and sums each weight's T gradients with T - 1 additions. On neuron their autograd
# kernels instead run the whole sequence a layer at a time, one product for all time steps' input projections first:
#
# - an LSTM whose batch and hidden size fit one kernel's tiles (batch <= 128 rows, hidden <= 128 columns) runs as
#   ``_LstmSequence``: each layer's recurrence is one launch (``kernels.rnn_sequence``: the time loop inside the
#   kernel, W_hh and the state on chip), its backward one launch that also sums every weight's gradient over all
#   steps and forms the layer input's;
# - otherwise ``_FusedSequence`` runs one cell launch per step (a GRU that fits forms the hidden product in it), its
#   backward one cell-backward launch per step (a GRU that fits forms the previous hidden state's gradient through
#   W_hh in it, the output's gradient added to the fp32 sum), then each weight's gradient over all steps as one
#   product of the stacked gate gradients and the bias gradients as one reduction. Beyond one kernel's tiles the
#   hidden product is its own launch (a product besides each cell, forward and backward).
#
# Configurations it does not take (bidirectional, projections, dropout while training, float64, packed sequences,
# autocast, traced or forward-mode-AD tensors, mixed dtypes or devices) run PyTorch's composition unchanged.

_SEQUENCE_LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (kept alive for the process)


def _sequence_fusable(gates: int, input: torch.Tensor, states: list[torch.Tensor], params: list[torch.Tensor],
                      has_biases: bool, num_layers: int, dropout: float, train: bool, bidirectional: bool) -> bool:
    """Whether ``_LstmSequence`` / ``_FusedSequence`` take this call: a unidirectional, unprojected stack of layers over a batched,
    non-empty sequence of a kernel dtype on neuron, states [layers, batch, hidden], every tensor of the input's
    dtype and device, no dropout applied, nothing traced, no autocast and no forward-mode tangents."""
    if bidirectional or (dropout > 0 and train) or num_layers < 1 or input.dim() != 3 or input.numel() == 0:
        return False
    if input.device.type != "neuron" or input.dtype not in KERNEL_DTYPES or torch.is_autocast_enabled("neuron"):
        return False
    if len(params) != num_layers * (4 if has_biases else 2) or len(states) != (2 if gates == 4 else 1):
        return False
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return False
    ts = [input, *states, *params]
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) or t.dtype != input.dtype or t.device != input.device or
           forward_ad.unpack_dual(t).tangent is not None for t in ts):
        return False
    L, B, H = states[0].shape if states[0].dim() == 3 else (0, 0, 0)
    if L != num_layers or H == 0 or any(s.shape != states[0].shape for s in states):
        return False
    per = len(params) // num_layers
    in_size = input.shape[2]
    for layer in range(num_layers):
        w_ih, w_hh, *biases = params[layer * per:(layer + 1) * per]
        if w_ih.shape != (gates * H, in_size) or w_hh.shape != (gates * H, H) or \
                any(b.shape != (gates * H,) for b in biases):
            return False
        in_size = H
    return True


def _step_with_product(kernel, op: str, N: int, H: int, **tensors: torch.Tensor | None) -> list[torch.Tensor]:
    """One launch of a cell kernel that also forms its hidden-state product (``w_hh`` among ``tensors``; the
    sequence's checks already made): its results."""
    names = tuple(tensors)
    widths = {"igates": 0, "workspace": 0, "w_hh": 0}      # taken as they lie; the states are [N, H]
    inputs, views = _operands(names, tuple(tensors.values()), N, tuple(widths.get(n, H) for n in names))
    return call_kernel(kernel, inputs, {"N": N, "H": H, "views": views}, op="aten::" + op)


class _FusedSequence(torch.autograd.Function):
    """A stack of LSTM (``gates`` 4) or GRU (3) layers over a whole sequence; see the section comment. Returns
    (output, h_n, c_n) for the LSTM, (output, h_n) for the GRU. A backward that builds a graph (double backward)
    differentiates PyTorch's composition on the saved inputs instead."""

    @staticmethod
    def forward(ctx, gates: int, batch_first: bool, has_biases: bool, x: torch.Tensor, h0: torch.Tensor,
                c0: torch.Tensor | None, *params: torch.Tensor) -> tuple:
        """The layers' outputs step by step; saves each step's cell state and workspace for the backward."""
        tdim = 1 if batch_first else 0
        T, L, H = x.shape[tdim], h0.shape[0], h0.shape[2]
        per = len(params) // L
        # the cells' lowerings called directly (no dispatcher round trip: ~15 us of host time a step and layer)
        cell = fused_lstm_cell if gates == 4 else fused_gru_cell
        layer_in, outs, h_last, c_last, steps = x, [], [], [], []
        for layer in range(L):
            w_ih, w_hh, *biases = params[layer * per:(layer + 1) * per]
            b_ih, b_hh = biases if biases else (None, None)
            # every step's input projection in one product, read back a step at a time (strided for batch_first)
            gi = torch.mm(layer_in.reshape(-1, layer_in.shape[2]), w_ih.t()).view(*layer_in.shape[:2], gates * H)
            h, c = h0[layer], (c0[layer] if c0 is not None else None)
            hs, cs, workspaces = [], [c], []     # the LSTM's cell states c_0 .. c_T
            # a GRU batch and hidden size one kernel's tiles hold: the hidden product inside the cell's launch
            one_launch = c0 is None and fused_product_fits(h.shape[0], H, gates)
            for t in range(T):
                if one_launch:
                    h, ws = _step_with_product(gru_cell_kernel, "_thnn_fused_gru_cell", h.shape[0], H,
                                               igates=gi.select(tdim, t), prev=h, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh)
                    hs.append(h)
                    workspaces.append(ws)
                    continue
                hg = torch.mm(h, w_hh.t())
                if c0 is not None:
                    h, c, ws = cell(gi.select(tdim, t), hg, c, b_ih, b_hh)
                    cs.append(c)
                else:
                    h, ws = cell(gi.select(tdim, t), hg, h, b_ih, b_hh)
                hs.append(h)
                workspaces.append(ws)
            out = torch.stack(hs, tdim)
            outs.append(out)
            # the last layer's hidden states h_1 .. h_{T-1} are saved one by one, not as the returned output: the
            # caller may modify that in place, as PyTorch's composition (which saves none of it) allows
            steps += (hs[:-1] if layer == L - 1 else []) + (cs if c0 is not None else []) + workspaces
            h_last.append(h)
            c_last.append(c)
            layer_in = out
        ctx.meta = (gates, batch_first, has_biases, T, L, per)
        ctx.save_for_backward(x, h0, c0, *params, *outs[:-1], *steps)
        results = (outs[-1], torch.stack(h_last))
        if c0 is not None:
            results += (torch.stack(c_last),)
        ctx.set_materialize_grads(False)
        return results

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, grad_hn: torch.Tensor | None, *grad_cn: torch.Tensor | None):
        """Gradients of the input, the initial states and every weight and bias (see the section comment)."""
        gates, batch_first, has_biases, T, L, per = ctx.meta
        saved = ctx.saved_tensors
        x, h0, c0 = saved[:3]
        params = saved[3:3 + L * per]
        if torch.is_grad_enabled():
            return (None, None, None, *_composed_backward(ctx, gates, batch_first, has_biases, saved[:3 + L * per],
                                                          (grad_out, grad_hn, *grad_cn)))
        grad_cn = grad_cn[0] if grad_cn else None
        outs = saved[3 + L * per:3 + L * per + L - 1]       # the inputs of layers 1 .. L-1
        steps = saved[3 + L * per + L - 1:]
        per_layer_steps = (T + 1 if gates == 4 else 0) + T       # cell states, workspaces
        tdim = 1 if batch_first else 0
        H = h0.shape[2]
        lstm = gates == 4
        need_x, need_h0, need_c0 = ctx.needs_input_grad[3:6]
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        grad_h0, grad_c0 = [None] * L, [None] * L
        grad_in = grad_out          # the gradient of the current layer's output (None: unused)
        for layer in reversed(range(L)):
            w_ih, w_hh = params[layer * per], params[layer * per + 1]
            layer_steps = steps[layer * per_layer_steps:]
            if layer == L - 1:
                hidden, layer_steps = layer_steps[:T - 1], layer_steps[T - 1:]
            layer_in = x if layer == 0 else outs[layer - 1]
            if grad_in is not None and tdim and not grad_in.select(tdim, 0).is_contiguous():
                # time-major once, so that each step's slice is read in place (not copied by every addmm)
                grad_in = grad_in.transpose(0, 1).contiguous().transpose(0, 1)
            dh = None if grad_hn is None else grad_hn[layer]
            dc = None if grad_cn is None else grad_cn[layer]
            g_t = None if grad_in is None else grad_in.select(tdim, T - 1)
            # the last step's hidden-state gradient: the output's plus h_n's; earlier steps' are formed below
            dh = g_t if dh is None else dh if g_t is None else g_t + dh
            d_input_gates, d_hidden_gates = [None] * T, [None] * T
            one_launch = not lstm and fused_product_fits(h0.shape[1], H, gates)
            for t in reversed(range(T)):
                g_t = None if grad_in is None or t == 0 else grad_in.select(tdim, t - 1)
                if one_launch:
                    # the cell's backward and the previous hidden state's gradient (through W_hh, plus the
                    # output's) in one launch
                    if dh is None:
                        dh = torch.zeros_like(h0[layer])
                    d_input_gates[t], d_hidden_gates[t], dh = _step_with_product(
                        gru_cell_backward_kernel, "_thnn_fused_gru_cell_backward", h0.shape[1], H,
                        grad_hy=dh, workspace=layer_steps[t], w_hh=w_hh, grad_next=g_t)
                    continue
                if lstm:
                    if dh is None and dc is None:
                        dh = torch.zeros_like(h0[layer])
                    d_gates, dc, _ = fused_lstm_cell_backward(
                        dh, dc, layer_steps[t], layer_steps[t + 1], layer_steps[T + 1 + t], False)
                    d_input_gates[t] = d_hidden_gates[t] = d_gates
                    direct = None
                else:
                    if dh is None:
                        dh = torch.zeros_like(h0[layer])
                    d_input_gates[t], d_hidden_gates[t], direct, _, _ = \
                        fused_gru_cell_backward(dh, layer_steps[t], False)
                # the previous step's hidden-state gradient: through W_hh, plus the output's (and the GRU's
                # direct path) added at the product's store
                addend = direct if g_t is None else g_t if direct is None else g_t + direct
                dh = torch.mm(d_hidden_gates[t], w_hh) if addend is None else \
                    torch.addmm(addend, d_hidden_gates[t], w_hh)
            grad_h0[layer], grad_c0[layer] = dh, dc
            d_in = torch.stack(d_input_gates, tdim).view(-1, gates * H)
            d_hid = d_in if lstm else torch.stack(d_hidden_gates, tdim).view(-1, gates * H)
            flat_in = layer_in.reshape(-1, layer_in.shape[2])
            needs = ctx.needs_input_grad[6 + layer * per:6 + (layer + 1) * per]   # this layer's weights, biases
            if needs[0]:
                grad_params[layer * per] = torch.mm(d_in.t(), flat_in)
            if needs[1]:
                # the hidden state each step started from
                if T == 1:
                    h_prev = h0[layer].unsqueeze(tdim)
                elif layer == L - 1:
                    h_prev = torch.stack([h0[layer], *hidden], tdim)
                else:
                    h_prev = torch.cat([h0[layer].unsqueeze(tdim), outs[layer].narrow(tdim, 0, T - 1)], tdim)
                grad_params[layer * per + 1] = torch.mm(d_hid.t(), h_prev.reshape(-1, H))
            if has_biases:
                needs_b = needs[2:]
                db_ih = d_in.sum(0) if any(needs_b) else None
                # the LSTM's two biases receive the same gradient: a copy each, never one tensor for both
                db_hh = (db_ih.clone() if lstm else d_hid.sum(0)) if needs_b[1] else None
                grad_params[layer * per + 2], grad_params[layer * per + 3] = db_ih if needs_b[0] else None, db_hh
            grad_in = torch.mm(d_in, w_ih).view(layer_in.shape) if layer > 0 or need_x else None
        return (None, None, None, grad_in if need_x else None, torch.stack(grad_h0) if need_h0 else None,
                torch.stack(grad_c0) if need_c0 and lstm else None, *grad_params)



SEQUENCE_STEPS = 64    # time steps per sequence launch: bounds each program (traced once per length, ~7 ms a step)


def _steps_view(t: torch.Tensor, tdim: int) -> tuple[int, int, int]:
    """The (step, row, column) strides of a 3-D sequence tensor whose time dim is ``tdim``."""
    return t.stride(tdim), t.stride(1 - tdim), t.stride(2)


def _sequence_launch(kernel, named: dict[str, torch.Tensor], tdim: int, meta: dict, outputs: tuple,
                     op: str) -> list[torch.Tensor]:
    """One launch of a sequence kernel on the given tensors, each handed over as its storage span and strides
    (the 3-D ones, "igates" and "grad_out", as (step, row, column); 1-D biases as (0, stride))."""
    views = tuple((n, _steps_view(t, tdim) if t.dim() == 3 else (0, t.stride(0)) if t.dim() == 1
                   else tuple(t.stride())) for n, t in named.items())
    return call_kernel(kernel, {n: storage_span(t) for n, t in named.items()}, {**meta, "views": views},
                       outputs=outputs, op=op)


def _chunks(T: int) -> list[tuple[int, int]]:
    """(first step, steps) of each sequence launch over T steps."""
    return [(s, min(SEQUENCE_STEPS, T - s)) for s in range(0, T, SEQUENCE_STEPS)]


def _summed(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a + b


class _LstmSequence(torch.autograd.Function):
    """A stack of LSTM layers over a whole sequence, each layer one product for all steps' input projections and
    one ``lstm_sequence_kernel`` launch for its recurrence (batch <= 128, hidden <= 128; one per SEQUENCE_STEPS
    steps of a longer sequence, the state handed from one to the next, the outputs concatenated); the backward
    one ``lstm_sequence_backward_kernel`` launch a layer that also forms every weight's gradient over its steps
    and the layer input's (a longer sequence's launches' sums added; an input too wide to sit beside h_t in a
    PSUM row: W_ih's and the input's gradients as two products of the stored gate gradients).
    Returns (output, h_n, c_n). A backward that builds a graph (double backward) differentiates PyTorch's
    composition on the saved inputs instead."""

    @staticmethod
    def forward(ctx, batch_first: bool, has_biases: bool, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor,
                *params: torch.Tensor) -> tuple:
        """Each layer's input projection, then its recurrence; saves each launch's hidden states, cell states and
        workspace (none of the returned tensors, which the caller may modify in place)."""
        tdim = 1 if batch_first else 0
        T, (L, N, H) = x.shape[tdim], h0.shape
        per = len(params) // L
        chunks = _chunks(T)
        # contiguous (launches bind contiguous results), whatever the initial states' strides; each layer's last
        # launch writes its row
        h_n, c_n = (torch.empty(h0.shape, dtype=h0.dtype, device=h0.device) for _ in range(2))
        layer_in, saved = x, []
        for layer in range(L):
            w_ih, w_hh, *biases = params[layer * per:(layer + 1) * per]
            # the input projection inside the launch where x_t^T fits beside h_t^T, else one product for all steps
            I = layer_in.shape[2]
            fold = projection_fits(H, I)
            gi = None if fold else torch.mm(layer_in.reshape(-1, I), w_ih.t()).view(*layer_in.shape[:2], 4 * H)
            h, c, outs = h0[layer], c0[layer], []
            for s, n in chunks:
                named = {"h0": h, "c0": c, "w_hh": w_hh}
                named.update({"x": layer_in.narrow(tdim, s, n), "w_ih": w_ih} if fold else
                             {"igates": gi.narrow(tdim, s, n)})
                if biases:
                    named.update(b_ih=biases[0], b_hh=biases[1])
                last = s + n == T
                out, hs, cs, ws, *_ = _sequence_launch(
                    lstm_sequence_kernel, named, tdim,
                    {"T": n, "N": N, "H": H, "I": I if fold else 0, "L": L, "layer": layer,
                     "batch_first": batch_first},
                    (None, None, None, None, h_n, c_n) if last else (), "aten::lstm")
                saved += [hs, cs, ws]
                h, c = out.select(tdim, n - 1), cs[n]
                outs.append(out)
            layer_in = outs[0] if len(outs) == 1 else torch.cat(outs, tdim)
            if layer < L - 1:
                saved.append(layer_in)                  # the next layer's input
        ctx.meta = (batch_first, has_biases, L, per)
        ctx.save_for_backward(x, h0, c0, *params, *saved)
        ctx.set_materialize_grads(False)
        return layer_in, h_n, c_n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, grad_hn: torch.Tensor | None, grad_cn: torch.Tensor | None):
        """Gradients of the input, the initial states and every weight and bias, a layer at a time."""
        batch_first, has_biases, L, per = ctx.meta
        saved = ctx.saved_tensors
        x, h0, c0 = saved[:3]
        params = saved[3:3 + L * per]
        if torch.is_grad_enabled():
            return (None, None, *_composed_backward(ctx, 4, batch_first, has_biases, saved[:3 + L * per],
                                                    (grad_out, grad_hn, grad_cn)))
        tdim = 1 if batch_first else 0
        T, (_, N, H) = x.shape[tdim], h0.shape
        chunks = _chunks(T)
        per_layer = 3 * len(chunks) + 1                           # each launch's (hs, cs, ws), the next input
        layers_saved = saved[3 + L * per:]
        need_x, need_h0, need_c0 = ctx.needs_input_grad[2:5]
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        # contiguous, as h_n and c_n; each layer's first launch writes its row
        grad_h0, grad_c0 = (torch.empty(h0.shape, dtype=h0.dtype, device=h0.device) for _ in range(2))
        grad_in = grad_out          # the gradient of the current layer's output (None: unused)
        for layer in reversed(range(L)):
            w_ih, w_hh = params[layer * per], params[layer * per + 1]
            mine = layers_saved[layer * per_layer:]
            layer_in = x if layer == 0 else layers_saved[layer * per_layer - 1]
            dh = None if grad_hn is None else grad_hn[layer]
            dc = None if grad_cn is None else grad_cn[layer]
            # W_ih's gradient (and the input's) in the same launches where x_t fits beside h_t in a PSUM row
            fold = input_fits(H, layer_in.shape[2])
            need_in = layer > 0 or need_x
            d_gates, grad_x, grad_w_hh, grad_w_ih, grad_b = [None] * len(chunks), [None] * len(chunks), None, None, \
                [None, None]
            for k in reversed(range(len(chunks))):
                s, n = chunks[k]
                hs, cs, ws = mine[3 * k:3 * k + 3]
                named = {"ws": ws, "cs": cs, "hs": hs, "w_hh": w_hh}
                for name, g in (("x", layer_in.narrow(tdim, s, n) if fold else None),
                                ("w_ih", w_ih if fold and need_in else None),
                                ("grad_out", None if grad_in is None else grad_in.narrow(tdim, s, n)),
                                ("grad_hn", dh), ("grad_cn", dc)):
                    if g is not None:
                        named[name] = g
                gh, gc, gw, *rest = _sequence_launch(
                    lstm_sequence_backward_kernel, named, tdim,
                    {"T": n, "N": N, "H": H, "I": layer_in.shape[2] if fold else 0, "L": L, "layer": layer,
                     "batch_first": batch_first, "has_bias": has_biases},
                    (grad_h0, grad_c0) if k == 0 else (), "aten::lstm_backward")
                gb, rest = rest[:2 if has_biases else 0], rest[2 if has_biases else 0:]
                if fold:
                    grad_w_ih = _summed(grad_w_ih, rest[0])
                    grad_x[k] = rest[1] if need_in else None
                else:
                    d_gates[k] = rest[0]
                dh, dc = gh[layer], gc[layer]
                grad_w_hh = _summed(grad_w_hh, gw)
                grad_b = [_summed(a, b) for a, b in zip(grad_b, gb)]
            needs = ctx.needs_input_grad[5 + layer * per:5 + (layer + 1) * per]   # this layer's weights, biases
            if not fold:
                # rows in the layer input's order
                d_gates = (d_gates[0] if len(chunks) == 1 else torch.cat(d_gates, tdim)).view(-1, 4 * H)
                grad_w_ih = torch.mm(d_gates.t(), layer_in.reshape(-1, layer_in.shape[2])) if needs[0] else None
                grad_x = [torch.mm(d_gates, w_ih).view(layer_in.shape)] if need_in else [None]
            grad_params[layer * per] = grad_w_ih if needs[0] else None
            grad_params[layer * per + 1] = grad_w_hh if needs[1] else None
            for k, g in enumerate(grad_b):
                grad_params[layer * per + 2 + k] = g if needs[2 + k] else None
            grad_in = None if not need_in else grad_x[0] if len(grad_x) == 1 else torch.cat(grad_x, tdim)
        return (None, None, grad_in if need_x else None, grad_h0 if need_h0 else None,
                grad_c0 if need_c0 else None, *grad_params)


def _composition(op: torch._ops.OpOverload, *args) -> tuple:
    """PyTorch's own C++ composition of ``op`` (``decompose`` would take the Python decomposition registered
    for export, which differentiates unfused cells)."""
    return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args)


def _composed_backward(ctx, gates: int, batch_first: bool, has_biases: bool, inputs: tuple, grads: tuple) -> tuple:
    """A differentiable backward (``create_graph``): PyTorch's composition rerun on the saved inputs, then
    differentiated with a graph; the gradients of (x, h0, c0, *params), the Function's last inputs."""
    x, h0, c0, *params = inputs
    needs = ctx.needs_input_grad[-len(inputs):]
    L = h0.shape[0]
    with torch.enable_grad():
        if gates == 4:
            results = _composition(torch.ops.aten.lstm.input, x, [h0, c0], params, has_biases, L, 0.0, False, False,
                                                          batch_first)
        else:
            results = _composition(torch.ops.aten.gru.input, x, h0, params, has_biases, L, 0.0, False, False, batch_first)
    wanted = [(i, t) for i, t in enumerate((x, h0, c0, *params)) if needs[i]]
    pairs = [(r, g) for r, g in zip(results, grads) if g is not None]
    found = torch.autograd.grad([r for r, _ in pairs], [t for _, t in wanted], [g for _, g in pairs],
                                create_graph=True, allow_unused=True) if pairs and wanted else []
    out: list[torch.Tensor | None] = [None] * (3 + len(params))
    for (i, _), g in zip(wanted, found):
        out[i] = g
    return tuple(out)


def lstm_input(input: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor], has_biases: bool,
               num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple:
    """``aten::lstm.input`` on neuron: ``_FusedSequence`` where it applies, else PyTorch's composition."""
    if _sequence_fusable(4, input, list(hx), list(params), has_biases, num_layers, dropout, train, bidirectional):
        if sequence_fits(hx[0].shape[1], hx[0].shape[2]):
            return _LstmSequence.apply(batch_first, has_biases, input, hx[0], hx[1], *params)
        return _FusedSequence.apply(4, batch_first, has_biases, input, hx[0], hx[1], *params)
    return _composition(torch.ops.aten.lstm.input, input, hx, params, has_biases, num_layers, dropout, train,
                                               bidirectional, batch_first)


def gru_input(input: torch.Tensor, hx: torch.Tensor, params: list[torch.Tensor], has_biases: bool,
              num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple:
    """``aten::gru.input`` on neuron: ``_FusedSequence`` where it applies, else PyTorch's composition."""
    if _sequence_fusable(3, input, [hx], list(params), has_biases, num_layers, dropout, train, bidirectional):
        return _FusedSequence.apply(3, batch_first, has_biases, input, hx, None, *params)
    return _composition(torch.ops.aten.gru.input, input, hx, params, has_biases, num_layers, dropout, train,
                                              bidirectional, batch_first)


_SEQUENCE_LIB.impl("lstm.input", lstm_input, "AutogradPrivateUse1")
_SEQUENCE_LIB.impl("gru.input", gru_input, "AutogradPrivateUse1")
