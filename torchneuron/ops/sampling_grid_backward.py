"""Grid sampling backward on the device: ``grid_sampler_2d_backward`` (bilinear, nearest, bicubic) and
``grid_sampler_3d_backward`` (trilinear, nearest), every padding mode, ``align_corners`` and ``output_mask``.

The forward's device computation (``sampling_grid._points``: coordinates, gathers of channel rows, weighted
sums) is differentiated by autograd, pass by pass: the input gradient is the ``index_select`` backward (an
``index_add`` of the weighted ``grad_output`` into the channel rows; the extra zero row swallows the
contributions of neighbours outside the input), and the grid gradient is the chain of the weights'
derivatives through the padding (clip: 0 or 1, reflection: +-1) and the unnormalization scale, which are
the CPU kernel's ``*_set_grad`` factors. Only the summation order differs from the CPU; at points exactly
on a clip boundary autograd's ``clamp`` passes the gradient where the CPU kernel zeroes it. The 2-D bicubic
grid gradient is computed directly (``_bicubic_grid_grad``): the chain rule through the forward's expanded
cubic polynomials (as the CPU kernel's own formulas) cancels near their roots and left it as far from
float64 as the CPU's but elsewhere; the factored weights and slopes, sums of value differences and a
position carried to twice fp32's precision put it 5-15x closer. The input
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
from torchneuron.ops.resample import CUBIC_A, EXACT
from torchneuron.ops.sampling_grid import (batch_base, BICUBIC, bicubic_taps, chunk_size, grid_check, grid_points,
                                          GridRows, NEAREST)
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


def _cubic_weights_factored(t: torch.Tensor) -> list[torch.Tensor]:
    """The four bicubic tap weights at fraction ``t`` (``resample.cubic_weights``, the sampler's own
    polynomials, which the forward evaluates as the CPU does) in factored form, A t (t - 1)^2,
    (t - 1) ((A + 2) t^2 - t - 1), -t ((A + 2) s^2 - s - 1) and A s t^2 with s = 1 - t (the quadratic has no
    root in [0, 1]): each within a few roundings of its own size, where the expanded forms cancel (an
    absolute error of a few units of 1 on weights near 0), which in the gradient's sums over taps of
    differing values was its largest error."""
    A = CUBIC_A
    s = 1.0 - t
    tm1 = t - 1.0
    return [(t * tm1) * tm1 * A, tm1 * (((A + 2) * t - 1.0) * t - 1.0), -(t * (((A + 2) * s - 1.0) * s - 1.0)),
            (s * t) * t * A]


def _cubic_weight_slopes(t: torch.Tensor) -> list[torch.Tensor]:
    """d/dt of the four bicubic tap weights (``resample.cubic_weights``) at fraction ``t``, in factored form:
    each is exact up to a few roundings of its own size (the expanded polynomials the chain rule or the CPU
    kernel evaluate cancel near their roots, t = 1/3 and 1 for the outer taps, a relative error ~1e-5)."""
    A = CUBIC_A
    s = 1.0 - t
    return [(3.0 * t - 1.0) * (t - 1.0) * A, t * (3 * (A + 2) * t - 2 * (A + 3)),
            -(s * (3 * (A + 2) * s - 2 * (A + 3))), t * (2.0 - 3.0 * t) * A]


def _two_sum(a: torch.Tensor, b: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """(a + b rounded, its rounding error) exactly (Knuth's TwoSum)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a):
    """Dekker's split of fp32 ``a`` into a 12-bit head and the rest (their products with another head are exact)."""
    c = a * 4097.0
    hi = c - (c - a)
    return hi, a - hi


def _exact_fraction(g: torch.Tensor, n: int, align: bool, low: torch.Tensor) -> torch.Tensor:
    """The pixel position's fraction past ``low`` (its floor as the sampler takes it), ``x - low`` for
    ``x = (g + 1) * scale - shift`` carried to twice fp32's precision: the rounded fp32 position is up to half
    a unit of |x| off (1e-6 at x ~ 16), and the gradient, the slope of the interpolant, moves by its
    curvature times that (5e-5 on PyTorch's samples); the error-free sum and product (TwoSum, Dekker) leave
    the rounding of the fraction itself."""
    scale, shift = ((n - 1) / 2, 0.0) if align else (n / 2, 0.5)
    a, ea = _two_sum(g, 1.0)
    p = a * scale
    ah, al = _split(a)
    sh, sl = (float(v) for v in _split(torch.tensor(scale, dtype=torch.float32)))
    ep = ((ah * sh - p) + ah * sl + al * sh) + al * sl
    x, ex = _two_sum(p, -shift)
    return (x - low) + (ex + (ep + ea * scale))


def _bicubic_grid_grad(rows: GridRows, g: torch.Tensor, base: torch.Tensor, go: torch.Tensor, padding: int,
                       align: bool) -> torch.Tensor:
    """[2, Q]: the bicubic sampler's gradient with respect to the grid coordinates ``g [2, Q]`` of Q points
    given ``go [Q, C]``, the sample's: d/dx = (dx/dg) sum_c go_c sum_j wy_j sum_i wx_i'(tx) v_cji (and y
    alike). The tap weights' slopes sum to 0 (the weights to 1), so each sum over the taps along the
    differentiated axis is taken of the values less the value at the floor tap: a point whose four taps
    along an axis read one pixel (clipped past a border) gets exactly 0, as the exact gradient is, where the
    sum of the values (autograd's chain through the forward, the CPU kernel) leaves the rounding of
    ``v sum_i wx_i'``, 1e-5 and more once scaled by dx/dg, and elsewhere the differences are no larger than
    the values. The padding's clip or reflection acts on whole tap positions, so it has no gradient."""
    _, low, vals = bicubic_taps(rows, g, base, padding, align)              # vals [4 (y), 4 (x), Q, C]
    W, H = rows.sizes[::-1]
    tx, ty = (_exact_fraction(g[i], n, align, low[i]) for i, n in enumerate((W, H)))
    wx, wy = _cubic_weights_factored(tx), _cubic_weights_factored(ty)
    sx, sy = _cubic_weight_slopes(tx), _cubic_weight_slopes(ty)
    dx = vals - vals[:, 1:2]
    dy = vals - vals[1:2]
    # sum over the differentiated axis first (the floor tap's term is 0), then the other axis's weights
    along_x = [sum(sx[i].unsqueeze(-1) * dx[j, i] for i in (0, 2, 3)) for j in range(4)]
    along_y = [sum(sy[j].unsqueeze(-1) * dy[j, i] for j in (0, 2, 3)) for i in range(4)]
    gx = sum(wy[j].unsqueeze(-1) * along_x[j] for j in range(4))
    gy = sum(wx[i].unsqueeze(-1) * along_y[i] for i in range(4))
    scale = [(n - 1) / 2 if align else n / 2 for n in (W, H)]               # d(pixel position) / d(grid value)
    return torch.stack([(gx * go).sum(-1) * scale[0], (gy * go).sum(-1) * scale[1]])


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
    explicit = mode == BICUBIC and k == 2     # the grid gradient from the weights' slopes (_bicubic_grid_grad)
    for i in range(0, padded, Q):
        gi = g[:, i:i + Q].detach().requires_grad_(not explicit)
        if explicit:
            grid_parts.append(_bicubic_grid_grad(rows, gi, base[i:i + Q], go[i:i + Q], padding, align))
        if mask[0] or not explicit:
            with torch.enable_grad(), _autograd_on():
                out = grid_points(rows, gi, base[i:i + Q], mode, padding, align)
                wrt = ([leaf] if mask[0] else []) + ([] if explicit else [gi])
                grads = list(torch.autograd.grad(out, wrt, grad_outputs=go[i:i + Q], allow_unused=True))
            if mask[0]:
                d = grads.pop(0)
                if d is not None:
                    row_grad = d if row_grad is None else row_grad + d
            if not explicit:
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
