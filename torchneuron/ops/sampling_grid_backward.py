"""Grid sampling backward on the device: ``grid_sampler_2d_backward`` (bilinear, nearest, bicubic) and
``grid_sampler_3d_backward`` (trilinear, nearest), every padding mode, ``align_corners`` and ``output_mask``.

The forward's device computation (``sampling_grid._points``: coordinates, gathers of channel rows, weighted
sums) is differentiated by autograd, pass by pass: the input gradient is the ``index_select`` backward (an
``index_add`` of the weighted ``grad_output`` into the channel rows; the extra zero row swallows the
contributions of neighbours outside the input), and the grid gradient is the chain of the weights'
derivatives through the padding (clip: 0 or 1, reflection: +-1) and the unnormalization scale, which are
the CPU kernel's ``*_set_grad`` factors. Only the summation order differs from the CPU; at points exactly
on a clip boundary autograd's ``clamp`` passes the gradient where the CPU kernel zeroes it. The input
grad's ``index_add`` builds a one-hot matrix of (input rows) x (gathered rows), so passes shrink to keep it
within ``ONEHOT_LIMIT``; inputs too large for even one point per pass (over 2**26 / taps rows: ~4M
bicubic, ~8M trilinear), or whose one-hot matrices together pass ``ONEHOT_WORK_LIMIT`` elements, take the
CPU fallback, as do dtypes other than fp32.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from torchneuron.ops.base import device_table, floats_on_one_device, Unsupported
from torchneuron.ops.elementwise import dense
from torchneuron.ops.registry import lowering
from torchneuron.ops.resample import EXACT
from torchneuron.ops.sampling_grid import batch_base, BICUBIC, chunk_size, grid_check, grid_points, GridRows, NEAREST
from torchneuron.kernels.indexing import ONEHOT_LIMIT



# Elements of all the input grad's one-hot matrices together ((input rows + 1) x points x taps) beyond which the
# CPU fallback takes the backward: the one-hot products grow with the input size times the points, where the
# CPU's scatter grows with the points alone (a 20x21x22x23x24 input sampled at 26,400 points: 5e10 elements,
# minutes of launches for one sample).
ONEHOT_WORK_LIMIT = 1 << 28


def _autograd_on() -> Any:
    """A guard that lifts the autograd keys a backend kernel runs without (its caller excludes them), so
    the forward's device ops record a graph again."""
    K = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (K.AutogradFunctionality, K.ADInplaceOrView, K.AutogradOther, K.AutogradNestedTensor):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _taps(k: int, mode: int) -> int:
    """Input rows each output point reads (4/1/16 in 2-D, 8/1 in 3-D)."""
    return 1 if mode == NEAREST else 16 if mode == BICUBIC else 1 << k


def _row_chunk(rows: int, taps: int) -> int:
    """Points per pass that keep the one-hot matrix of the input grad's ``index_add`` (rows x gathered
    rows) within ``ONEHOT_LIMIT`` (a power of two; 0 when not even one point fits)."""
    fit = ONEHOT_LIMIT // (rows * taps)
    return 1 << (fit.bit_length() - 1) if fit else 0


def _backward(grad_out: torch.Tensor, input: torch.Tensor, grid: torch.Tensor, mode: int, padding: int,
              align: bool, mask: Sequence[bool]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(input grad, grid grad) of the grid sampler, over the output points in passes of one shape (the
    CPU kernel computes the grid grad whatever ``mask[1]`` says, and the input grad only for ``mask[0]``)."""
    k = input.dim() - 2
    N, C = input.shape[:2]
    P = math.prod(int(v) for v in grid.shape[1:-1])
    rows = GridRows(input)
    leaf = rows.rows.detach().requires_grad_(bool(mask[0]))
    rows.rows = leaf
    Q = chunk_size(N * P)
    if mask[0]:
        Q = min(Q, _row_chunk(N * math.prod(rows.sizes) + 1, _taps(k, mode)))
    padded = -(-(N * P) // Q) * Q
    g = torch.zeros(k, padded, dtype=grid.dtype, device=grid.device)
    g[:, :N * P] = grid.reshape(N * P, k).t()
    # grad_output as [point, channel] rows; padding points get zero gradient
    go = torch.zeros(padded, C, dtype=grad_out.dtype, device=grad_out.device)
    go[:N * P] = dense(grad_out.reshape(N, C, P).permute(0, 2, 1)).reshape(N * P, C)
    base = device_table(input.device, batch_base, N, P, math.prod(rows.sizes), padded)
    row_grad = None
    grid_parts = []
    for i in range(0, padded, Q):
        gi = g[:, i:i + Q].detach().requires_grad_()
        with torch.enable_grad(), _autograd_on():
            out = grid_points(rows, gi, base[i:i + Q], mode, padding, align)
            wrt = [leaf, gi] if mask[0] else [gi]
            grads = torch.autograd.grad(out, wrt, grad_outputs=go[i:i + Q], allow_unused=True)
        grads = list(grads)
        if mask[0]:
            d = grads.pop(0)
            if d is not None:
                row_grad = d if row_grad is None else row_grad + d
        d = grads.pop(0)
        grid_parts.append(torch.zeros_like(gi) if d is None else d)
    grad_input = None
    if mask[0]:
        S = math.prod(rows.sizes)
        if row_grad is None:
            grad_input = torch.zeros_like(input)
        else:
            grad_input = dense(row_grad[:N * S].reshape(N, S, C).permute(0, 2, 1)).reshape(input.shape)
    gg = torch.cat(grid_parts, 1) if len(grid_parts) > 1 else grid_parts[0]
    return grad_input, dense(gg[:, :N * P].t()).reshape(grid.shape)


def _grid_sampler_backward(k: int) -> Any:
    check = grid_check(k)

    def run(grad_output: torch.Tensor, input: torch.Tensor, grid: torch.Tensor, interpolation_mode: int,
            padding_mode: int, align_corners: bool, output_mask: Sequence[bool]) -> tuple[Any, Any]:
        """``grid_sampler_{k}d_backward`` on the device (fp32; other dtypes round differently on the CPU)."""
        N = input.shape[0] if input.dim() else 0
        S = math.prod(input.shape[2:])
        if (not floats_on_one_device(grad_output, input, grid) or any(t.dtype != torch.float32 for t in (grad_output, input, grid))
                or N * S + 1 >= EXACT or interpolation_mode not in (0, 1, 2) or padding_mode not in (0, 1, 2)):
            raise Unsupported("a dtype other than float32, EXACT input elements or more, or an unknown mode")
        check(input, grid, interpolation_mode)
        mask = [bool(m) for m in output_mask]
        want = [N, input.shape[1], *grid.shape[1:-1]]
        taps = _taps(k, int(interpolation_mode))
        P = math.prod(int(v) for v in grid.shape[1:-1])
        if (list(grad_output.shape) != want or input.numel() == 0 or grid.numel() == 0
                or (output_mask[0] and (not _row_chunk(N * S + 1, taps)
                                        or (N * S + 1) * N * P * taps > ONEHOT_WORK_LIMIT))):
            # the CPU's own result for these (empty operands, an unchecked grad_output shape), and inputs too
            # large for the input grad's one-hot accumulation, or whose one-hot products, quadratic in the size
            # (input rows x gathered rows), outgrow ONEHOT_WORK_LIMIT
            raise Unsupported("empty operands, an unchecked grad_output shape, or a too large input gradient")
        gi, gg = _backward(grad_output, input, grid, int(interpolation_mode), int(padding_mode),
                           bool(align_corners), mask)
        return gi, gg

    return run


for _k in (2, 3):
    lowering(f"grid_sampler_{_k}d_backward")(_grid_sampler_backward(_k))
