"""Pairwise distances on the device: ``_cdist_forward`` (``torch.cdist``) and ``_pdist_forward``
(``torch.nn.functional.pdist``), composed from lowered ops.

The direct form takes every pair's difference ([..., P, R, M]) and the lowered
``linalg_vector_norm`` of it, so p = 0, inf and fractional p behave as that norm does (and as the
CPU's kernels). For p = 2 the CPU switches to a matmul form when asked (compute_mode 1) or when
either side has more than 25 rows (compute_mode 0/None): ``sqrt(max(|x|^2 + |y|^2 - 2 x.y, 0))``.
It is followed here too, so results carry the same rounding as the CPU's, and large problems run
on TensorE instead of as a broadcast difference. Inputs beyond ``DIRECT_LIMIT`` elements in the
direct form, and dtypes the core lacks, take the CPU fallback.
"""
from __future__ import annotations

import math

import torch

from torchneuron.ops.base import FLOATS, Unsupported
from torchneuron.ops.registry import lowering

DIRECT_LIMIT = 1 << 24   # elements of the [..., P, R, M] difference the direct form builds
MM_ROWS = 25             # above this many rows on either side, the CPU's p = 2 uses the matmul form


def _pair_norms(x1: torch.Tensor, x2: torch.Tensor, p: float) -> torch.Tensor:
    """``|x1[..., i, :] - x2[..., j, :]|_p`` for every pair, as a [..., P, R] tensor."""
    return torch.linalg.vector_norm(x1.unsqueeze(-2) - x2.unsqueeze(-3), p, dim=-1)


def _euclid_by_mm(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """p = 2 distances through one batched matmul: [-2 x, |x|^2, 1] . [y, 1, |y|^2]."""
    n1, n2 = x1.pow(2).sum(-1, keepdim=True), x2.pow(2).sum(-1, keepdim=True)
    a = torch.cat([x1 * -2, n1, torch.ones_like(n1)], -1)
    b = torch.cat([x2, torch.ones_like(n2), n2], -1)
    return (a @ b.transpose(-1, -2)).clamp_min(0).sqrt()


@lowering("_cdist_forward")
def cdist_forward(x1: torch.Tensor, x2: torch.Tensor, p: float, compute_mode: int | None) -> torch.Tensor:
    """``torch.cdist``: batch dims broadcast, then the direct or the matmul form (as the CPU picks)."""
    if x1.dim() < 2 or x2.dim() < 2 or x1.dtype not in FLOATS or x2.dtype != x1.dtype or p < 0 \
            or x1.size(-1) != x2.size(-1) or compute_mode not in (None, 0, 1, 2) or x1.device != x2.device:
        raise Unsupported
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    (r1, m), r2 = x1.shape[-2:], x2.size(-2)
    if r1 == 0 or r2 == 0 or math.prod(batch) == 0:
        return x1.new_empty((*batch, r1, r2))
    if m == 0:
        return x1.new_zeros((*batch, r1, r2))
    x1, x2 = x1.expand(*batch, r1, m), x2.expand(*batch, r2, m)
    if p == 2 and (compute_mode == 1 or (compute_mode in (None, 0) and (r1 > MM_ROWS or r2 > MM_ROWS))):
        return _euclid_by_mm(x1, x2)
    if math.prod(batch) * r1 * r2 * m > DIRECT_LIMIT:
        raise Unsupported
    return _pair_norms(x1, x2, p)


@lowering("_pdist_forward")
def pdist_forward(self: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    """``pdist``: the pairs i < j of the rows, in row-major order, from the direct form."""
    n, m = self.shape if self.dim() == 2 else (0, 0)
    if self.dim() != 2 or self.dtype not in FLOATS or p < 0 or n * n * m > DIRECT_LIMIT:
        raise Unsupported
    if n < 2:
        return self.new_empty((0,))
    if m == 0:
        return self.new_zeros((n * (n - 1) // 2,))
    i, j = torch.triu_indices(n, n, 1, device=self.device)
    return _pair_norms(self, self, p)[i, j]
