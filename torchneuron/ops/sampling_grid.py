"""Grid sampling on the device: ``grid_sampler_2d`` (bilinear, nearest, bicubic) and ``grid_sampler_3d``
(trilinear, nearest), every padding mode and ``align_corners``.

Each output point reads a few input pixels (4, 1 or 16 in 2-D, 8 or 1 in 3-D) at positions computed from
its grid coordinates. The coordinate math runs element-wise on the device in fp32 with the CPU kernels'
own formulas, term by term: the 2-D CPU kernel is vectorized (``(g + 1) * s`` unnormalization, reflection
by truncated division), the 3-D one is scalar (``((g + 1) / 2) * (n - 1)``, reflection by ``fmod``), and the
two round differently. The input is laid out as channel rows ``[N*S + 1, C]`` whose extra last row is
zeros: a neighbour outside the input (``zeros`` padding) reads that row, so it contributes exactly
``0 * weight`` as on the CPU; every neighbour is one ``index_select`` of rows (indices exact in fp32 below
2**24), and the weighted sum adds the neighbours in the CPU kernel's order.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from torchneuron.ops.base import device_table, Unsupported
from torchneuron.ops.elementwise import dense, to_int64
from torchneuron.ops.resample import cubic_weights, EXACT, register_resample

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
ZEROS, BORDER, REFLECTION = 0, 1, 2


def grid_check(k: int) -> Any:
    """The CPU's ``check_grid_sampler_common`` and ``check_grid_sampler_{2,3}d`` for ``k`` spatial dims
    (the meta kernels assert instead of raising its ``RuntimeError``)."""
    def check(input: torch.Tensor, grid: torch.Tensor, interpolation_mode: int, *rest: Any) -> None:
        if input.dim() == 0 or grid.dim() == 0:
            return                     # the CPU's own IndexError comes from the fallback
        if input.shape[0] != grid.shape[0]:
            raise RuntimeError("grid_sampler(): expected grid and input to have same batch size, but got input "
                               f"with sizes {list(input.shape)} and grid with sizes {list(grid.shape)}")
        if grid.shape[-1] != input.dim() - 2:
            raise RuntimeError(f"grid_sampler(): expected grid to have size {input.dim() - 2} in last dimension, "
                               f"but got grid with sizes {list(grid.shape)}")
        for i in range(2, input.dim()):
            if input.shape[i] <= 0:
                raise RuntimeError("grid_sampler(): expected input to have non-empty spatial dimensions, but "
                                   f"input has sizes {list(input.shape)} with dimension {i} being empty")
        if input.dim() != k + 2 or grid.dim() != input.dim():
            raise RuntimeError(f"grid_sampler(): expected {k + 2}D input and grid with same number of dimensions, "
                               f"but got input with sizes {list(input.shape)} and grid with sizes "
                               f"{list(grid.shape)}")
        if k == 3 and interpolation_mode == BICUBIC:
            raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    return check


# ---- source coordinates (fp32, element-wise on the device) --------------------------------------------

def _unnormalize(g: torch.Tensor, n: int, align: bool, vec: bool) -> torch.Tensor:
    """Grid values in [-1, 1] to pixel positions, with the 2-D (``vec``) or 3-D kernel's rounding."""
    if vec:
        if align:
            return (g + 1.0) * ((n - 1) / 2)
        return (g + 1.0) * (n / 2) - 0.5
    if align:
        return ((g + 1.0) / 2) * (n - 1)
    return ((g + 1.0) * n - 1.0) / 2


def _clip(c: torch.Tensor, n: int, vec: bool) -> torch.Tensor:
    """Clamp into [0, n - 1]; NaN goes to 0 in the 2-D kernel (``max`` operand order), to n - 1 in the
    3-D one (``std::min(n - 1, std::max(NaN, 0))``)."""
    return torch.nan_to_num(c, nan=0.0 if vec else float(n - 1)).clamp(0.0, float(n - 1))


def _reflect(c: torch.Tensor, n: int, align: bool, vec: bool) -> torch.Tensor:
    """Reflect about the borders (the pixel centres with ``align``, else the image edges) until inside."""
    lo2, hi2 = (0, 2 * (n - 1)) if align else (-1, 2 * n - 1)
    if lo2 == hi2:
        return torch.zeros_like(c)
    lo, span = lo2 / 2, (hi2 - lo2) / 2
    a = (c - lo).abs()
    if vec:
        # the vectorized kernel: drop whole double spans by truncated division, then fold the remainder
        twice = 2 * span
        extra = a - torch.trunc(a / twice) * twice
        r = torch.minimum(extra, twice - extra)
        return r + lo if lo else r
    extra = torch.fmod(a, span)
    odd = torch.fmod(torch.floor(a / span), 2.0) != 0
    return torch.where(odd, (span - extra) + lo, extra + lo)


def _pad(c: torch.Tensor, n: int, padding: int, align: bool, vec: bool) -> torch.Tensor:
    """The padding mode applied to pixel positions (``compute_coordinates``)."""
    if padding == BORDER:
        return _clip(c, n, vec)
    if padding == REFLECTION:
        return _clip(_reflect(c, n, align, vec), n, vec)
    return c


# ---- gathers --------------------------------------------------------------------------------------------

CHUNK = 1 << 15          # output points per pass: programs are traced per shape, so every pass has one shape


def chunk_size(points: int) -> int:
    """Points per pass: ``CHUNK``, or the power of two that holds a smaller grid (few distinct shapes)."""
    return min(CHUNK, 1 << max(8, (points - 1).bit_length()))


def batch_base(N: int, P: int, S: int, padded: int) -> torch.Tensor:
    """fp32 [padded]: the first input row of each output point's batch (padding points read batch 0)."""
    base = torch.zeros(padded, dtype=torch.float32)
    base[:N * P] = (torch.arange(N, dtype=torch.float32) * S).repeat_interleave(P)
    return base


class GridRows:
    """The input as channel rows ``[N*S + 1, C]`` (last row zeros) and the gather of neighbours from it."""

    def __init__(self, input: torch.Tensor) -> None:
        N, C = input.shape[:2]
        self.sizes = [int(v) for v in input.shape[2:]]          # (D,) H, W
        S = math.prod(self.sizes)
        rows = dense(input.reshape(N, C, S).permute(0, 2, 1)).reshape(N * S, C)
        self.rows = torch.cat([rows, torch.zeros(1, C, dtype=input.dtype, device=input.device)])
        self.zero_row = float(N * S)

    def index(self, axes: Sequence[Sequence[torch.Tensor]], base: torch.Tensor, check: bool) -> list[torch.Tensor]:
        """fp32 row indices ``[Q]`` of every combination of integer positions: ``axes[d]`` lists the
        candidate positions ``[Q]`` along spatial dim d (first dim first; the last dim varies fastest).
        With ``check``, a combination with a position outside the input reads the zero row. ``base``: the
        first row of each point's batch. (1-D operands: the element-wise kernels tile them best.)"""
        combos = [base]
        stride = math.prod(self.sizes)
        for taps, n in zip(axes, self.sizes):
            stride //= n
            parts = []
            for p in taps:
                part = p * float(stride) if stride != 1 else p
                if check:
                    # an outside position makes the sum infinite; ``gather`` sends it to the zero row
                    part = torch.where((p >= 0.0) & (p <= float(n - 1)), part, float("inf"))
                parts.append(part)
            combos = [c + part for c in combos for part in parts]
        return combos

    def gather(self, index: Sequence[torch.Tensor]) -> torch.Tensor:
        """[T*Q, C]: the rows at the fp32 indices ``index`` (T tensors ``[Q]``), in one ``index_select``."""
        flat = torch.cat(list(index))
        flat = torch.minimum(flat, torch.tensor(self.zero_row, device=flat.device))
        return self.rows.index_select(0, to_int64(flat))


def _weighted_sum(vals: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_i vals[i] * weights[i]`` (``vals [T*Q, C]``, T weights ``[Q]``) added left to right, as the CPU
    kernels accumulate; ``[Q, C]``."""
    T = len(weights)
    prods = (vals * torch.cat(list(weights)).unsqueeze(-1)).view(T, -1)
    acc = prods[0]
    for i in range(1, T):
        acc = acc + prods[i]
    return acc.view(-1, vals.shape[1])


# ---- the samplers ---------------------------------------------------------------------------------------

def bicubic_taps(rows: GridRows, g: torch.Tensor, base: torch.Tensor, padding: int, align: bool
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """2-D bicubic sampling's ([tx, ty] fractions ``[Q]`` of the points past their floor pixels, those floor
    pixels [x, y], the 16 tap values ``[4 (y), 4 (x), Q, C]``): taps at floor - 1 .. floor + 2 along each axis, each padded on its own
    (clip or reflect; outside the input with ``zeros`` padding, the zero row)."""
    sizes = rows.sizes[::-1]                 # W, H: the order of the grid's coordinates
    coords = [_unnormalize(g[i], sizes[i], align, True) for i in range(2)]
    low = [torch.floor(c) for c in coords]
    tx, ty = [[_pad(f + float(t - 1), n, padding, align, True) for t in range(4)] for f, n in zip(low, sizes)]
    vals = rows.gather(rows.index([ty, tx], base, padding == ZEROS)).view(4, 4, -1, rows.rows.shape[1])
    return [c - f for c, f in zip(coords, low)], low, vals


def grid_points(rows: GridRows, g: torch.Tensor, base: torch.Tensor, mode: int, padding: int, align: bool
            ) -> torch.Tensor:
    """[Q, C]: the samples at ``Q`` points whose grid coordinates are the rows of ``g [k, Q]`` (x first)."""
    k = g.shape[0]
    vec = k == 2                             # the 2-D CPU kernel is the vectorized one
    sizes = rows.sizes[::-1]                 # W, H (, D): the order of the grid's coordinates
    check = padding == ZEROS
    if mode == BICUBIC:
        (tx, ty), _, vals = bicubic_taps(rows, g, base, padding, align)
        cx, cy = cubic_weights(tx), cubic_weights(ty)
        across = [_weighted_sum(vals[j].flatten(0, 1), cx) for j in range(4)]   # each y tap j: its 4 x taps
        return _weighted_sum(torch.cat(across), cy)
    coords = [_pad(_unnormalize(g[i], sizes[i], align, vec), sizes[i], padding, align, vec) for i in range(k)]
    if mode == NEAREST:
        return rows.gather(rows.index([[torch.round(c)] for c in coords[::-1]], base, check))
    low = [torch.floor(c) for c in coords]
    frac = [c - f for c, f in zip(coords, low)]
    if vec:     # the 2-D kernel: fractions and their complements
        near = [1.0 - f for f in frac]
    else:       # the 3-D kernel: distances to the far corner, as (floor + 1) - x
        near = [(f + 1.0) - c for c, f in zip(coords, low)]
    # corners with x fastest, then y, then z: the CPU kernels' summation order; the far corners can fall
    # off the input in every padding mode
    index = rows.index([[f, f + 1.0] for f in low[::-1]], base, True)
    if vec:     # 2-D weights are (y part) * (x part)
        weights = [wy * wx for wy in (near[1], frac[1]) for wx in (near[0], frac[0])]
    else:       # 3-D ones (x part) * (y part) * (z part)
        xy = [wx * wy for wy in (near[1], frac[1]) for wx in (near[0], frac[0])]
        weights = [w * wz for wz in (near[2], frac[2]) for w in xy]
    return _weighted_sum(rows.gather(index), weights)


def _sample(input: torch.Tensor, grid: torch.Tensor, mode: int, padding: int, align: bool) -> torch.Tensor:
    """The grid sampler's result, computed over the output points in passes of one shape."""
    k = input.dim() - 2
    N, C = input.shape[:2]
    out_sizes = [int(v) for v in grid.shape[1:-1]]
    P = math.prod(out_sizes)
    rows = GridRows(input)
    Q = chunk_size(N * P)
    padded = -(-(N * P) // Q) * Q
    g = torch.zeros(k, padded, dtype=grid.dtype, device=grid.device)     # row 0: x (last input dim), 1: y, 2: z
    g[:, :N * P] = grid.reshape(N * P, k).t()
    base = device_table(input.device, batch_base, N, P, math.prod(rows.sizes), padded)
    parts = [grid_points(rows, g[:, i:i + Q], base[i:i + Q], mode, padding, align) for i in range(0, padded, Q)]
    res = (torch.cat(parts) if len(parts) > 1 else parts[0])[:N * P]
    return dense(res.view(N, P, C).permute(0, 2, 1)).view(N, C, *out_sizes)


def _grid_sampler(k: int) -> Any:
    def run(input: torch.Tensor, grid: torch.Tensor, interpolation_mode: int, padding_mode: int,
            align_corners: bool) -> torch.Tensor:
        """``grid_sampler_{k}d`` on the device (fp32; other dtypes round differently on the CPU)."""
        N = input.shape[0]
        S = math.prod(input.shape[2:])
        if (input.dtype != torch.float32 or N * S + 1 >= EXACT or interpolation_mode not in (0, 1, 2)
                or padding_mode not in (0, 1, 2)):
            raise Unsupported("a dtype other than float32, EXACT input elements or more, or an unknown mode")
        return _sample(input, grid, int(interpolation_mode), int(padding_mode), bool(align_corners))

    return run


for _k in (2, 3):
    register_resample(f"grid_sampler_{_k}d", "out", _grid_sampler(_k), 2, grid_check(_k))
