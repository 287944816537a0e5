"""Shared helpers of the kernel library: limits, tile sizes and the host-side argument handling."""
from __future__ import annotations

import math

import numpy as np
import torch

import torchneuron.nki.language as nl

PMAX = 128                     # partitions of SBUF/PSUM (nl.tile_size.pmax)
PSUM_FP32 = 512                # fp32 elements in one 2 KiB PSUM bank (nl.tile_size.psum_bank_fmax)
DMA_ROW_BYTES = 8192           # target bytes per partition row of a streaming DMA (>= 2 KiB: ~97 % efficiency)


def sbuf_budget() -> int:
    """SBUF bytes per partition of the chip being traced (224 KiB on trn2)."""
    return nl.tile_size.sbuf_fmax_bytes


def check_sbuf(need: int, what: str) -> None:
    """State a kernel's SBUF budget: ``need`` bytes per partition must fit the chip."""
    have = sbuf_budget()
    assert need <= have, f"{what}: needs {need} B of SBUF per partition; the chip has {have} B"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def as_tensor(x) -> torch.Tensor:
    """Host arguments as CPU torch tensors (NumPy arrays accepted)."""
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def prod(shape) -> int:
    return int(math.prod(shape))


def flat_blocks(n: int, fmax: int = 2048):
    """(start, partitions, width) blocks covering a flat vector of n elements: [128, f] tiles with
    f = min(fmax, n // 128) elements per partition, then the remainder as one row."""
    f = max(1, min(fmax, n // PMAX))
    s = 0
    while s < n:
        p = min(PMAX, (n - s) // f) or 1
        w = f if n - s >= f * p else n - s
        yield s, p, w
        s += p * w
