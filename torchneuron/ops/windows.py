"""Sliding windows over the spatial dims of a batch, the geometry convolution and pooling share.

``im2col_patches`` gathers the patches ``cols[C, *K, B, *O]`` of a padded input by strided DMA copies of one
window view (split into pieces of at most 5 access-pattern dims); ``col2im_patches`` adds columns back into
a zero-padded gradient: the columns of all kernel offsets whose windows cannot overlap are copied (or
added) into a strided window view at once, the offsets along dims whose windows overlap one at a time.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch

from torchneuron.ops.elementwise import coalesce, dense, device_copy


def int_tuple(v: Any, n: int, default: Sequence[int] | None = None) -> tuple[int, ...]:
    """``v`` (an int, or a sequence of 1 or n ints; empty means ``default``) as n ints."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        v = default
    v = [v] if isinstance(v, int) else list(v)
    return tuple(int(v[min(i, len(v) - 1)]) for i in range(n))


def padded_size(n: int, k: int, s: int, p: int, d: int, out: int) -> int:
    """Padded extent that holds the input and every window (ceil_mode windows may end past the padding)."""
    return max(n + 2 * p, (out - 1) * s + (k - 1) * d + 1)


def fit_dma_dims(fn: Callable[[torch.Tensor, torch.Tensor], Any], dst: torch.Tensor, src: torch.Tensor) -> None:
    """``fn(dst, src)`` (a copy or an in-place add of same-shaped views) on slices small enough for one DMA
    access pattern (at most 5 dims once the views are coalesced), splitting the smallest outer dim first."""
    if len(coalesce(list(dst.shape), list(dst.stride()), list(src.stride()))[0]) <= 5:
        fn(dst, src)
        return
    # never the innermost dim: its contiguous runs are what makes a DMA cheap
    i = min((j for j in range(dst.dim() - 1) if dst.shape[j] > 1), key=lambda j: dst.shape[j])
    for j in range(dst.shape[i]):
        fit_dma_dims(fn, dst.select(i, j), src.select(i, j))


def add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` (the accumulating step of col2im)."""
    dst.add_(src)


def pad_input(x: torch.Tensor, p: Sequence[int], sizes: Sequence[int], fill: float) -> torch.Tensor:
    """x [B, C, *S] inside a [B, C, *sizes] tensor filled with ``fill``, at offset p."""
    S = tuple(x.shape[2:])
    if not any(p) and tuple(sizes) == S:
        return x
    out = torch.full((*x.shape[:2], *sizes), fill, dtype=x.dtype, device=x.device)
    fit_dma_dims(device_copy, out[(slice(None), slice(None), *(slice(pp, pp + n) for pp, n in zip(p, S)))], x)
    return out


def window_view(xp: torch.Tensor, sizes: tuple, strides: tuple, offset: int) -> torch.Tensor:
    """An as_strided view of the padded tensor ``xp`` (strides in elements of xp)."""
    return xp.as_strided(sizes, strides, xp.storage_offset() + offset)


def window_layout(xp: torch.Tensor, k: tuple, s: tuple, d: tuple, o: tuple, batch_first: bool) -> tuple:
    """(sizes, strides) of the patch view of the padded [B, C, *S] tensor ``xp``: ``[C, *K, B, *O]``, or
    ``[B, C, *K, *O]`` when ``batch_first``."""
    sB, sC, *sS = xp.stride()
    kst = tuple(dd * st for dd, st in zip(d, sS))
    ost = tuple(ss * st for ss, st in zip(s, sS))
    B, C = xp.shape[:2]
    if batch_first:
        return (B, C, *k, *o), (sB, sC, *kst, *ost)
    return (C, *k, B, *o), (sC, *kst, sB, *ost)


def im2col_patches(x: torch.Tensor, k: tuple, s: tuple, p: tuple, d: tuple, o: tuple, fill: float = 0.0,
            batch_first: bool = False) -> torch.Tensor:
    """Patches ``cols[C, *K, B, *O]`` (``[B, C, *K, *O]`` when ``batch_first``) of x [B, C, *S] (1 to 3 spatial
    dims): strided DMA copies of window views of the padded input."""
    S = x.shape[2:]
    xp = pad_input(x, p, [padded_size(*g) for g in zip(S, k, s, p, d, o)], fill)
    sizes, strides = window_layout(xp, k, s, d, o, batch_first)
    cols = torch.empty(sizes, dtype=x.dtype, device=x.device)
    fit_dma_dims(device_copy, cols, window_view(xp, sizes, strides, 0))
    return cols


def col2im_patches(cols: torch.Tensor, shape: tuple, k: tuple, s: tuple, p: tuple, d: tuple) -> torch.Tensor:
    """The adjoint of ``im2col_patches``: sum ``cols[C, *K, B, *O]`` (any strides) into a [B, C, *S] gradient."""
    B, C, *S = shape
    n = len(S)
    O = tuple(cols.shape[-n:])
    Sp = [padded_size(*g) for g in zip(S, k, s, p, d, O)]
    gp = torch.zeros((B, C, *Sp), dtype=cols.dtype, device=cols.device)
    sB, sC, *sS = gp.stride()
    # windows of different offsets along a dim overlap when its stride is below the dilated kernel extent:
    # those dims' offsets are added one at a time, the other dims' offsets all at once (disjoint targets)
    loop = [i for i in range(n) if k[i] > 1 and s[i] < (k[i] - 1) * d[i] + 1]
    at_once = [i for i in range(n) if i not in loop]
    sizes = (C, *(k[i] for i in at_once), B, *O)
    strides = (sC, *(d[i] * sS[i] for i in at_once), sB, *(s[i] * sS[i] for i in range(n)))
    for offs in itertools.product(*(range(k[i]) for i in loop)):
        pick = dict(zip(loop, offs))
        src = cols[(slice(None), *(pick.get(i, slice(None)) for i in range(n)))]
        dst = window_view(gp, sizes, strides, sum(pick[i] * d[i] * sS[i] for i in loop))
        fit_dma_dims(device_copy if not loop else add_into, dst, src)
    if tuple(Sp) == tuple(S):
        return gp
    return dense(gp[(slice(None), slice(None), *(slice(pp, pp + m) for pp, m in zip(p, S)))])


def as_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 (itself when it is)."""
    return t if t.dtype == torch.float32 else t.to(torch.float32)
