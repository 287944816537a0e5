"""The kernel library's shared tiling helpers (``kernels._common``): every cover of rows or elements they plan
holds each index exactly once, within the partition and width limits they promise."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchneuron.kernels._common import PMAX, ROW_ELEMS, as_tensor, cdiv, flat_blocks, grouped_rows, row_blocks, tiles

SIZES = [1, 5, 127, 128, 129, 1000, 128 * 2048, 128 * 2048 + 77, 300_001]


@pytest.mark.parametrize("n", SIZES)
def test_tiles_cover_the_range_once_with_only_the_last_partial(n):
    got = tiles(n, 128)
    assert [i for s, k in got for i in range(s, s + k)] == list(range(n))
    assert all(k == 128 for _, k in got[:-1]) and 0 < got[-1][1] <= 128
    assert len(got) == cdiv(n, 128) == math.ceil(n / 128)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmax", [2048, 512])
def test_flat_blocks_cover_the_vector_once_within_the_tile_limits(n, fmax):
    covered, expected_start = 0, 0
    for start, partitions, width in flat_blocks(n, fmax):
        assert start == expected_start and 1 <= partitions <= PMAX and 1 <= width <= fmax
        expected_start = start + partitions * width
        covered += partitions * width
    assert covered == n


@pytest.mark.parametrize("N,D,min_blocks", [(1, 64, 1), (128, 64, 1), (5000, 64, 1), (5000, 64, 4), (300, 4096, 1),
                                            (128 * 40 + 3, 32, 2), (77, 2049, 1)])
def test_row_blocks_hold_every_row_once_within_the_grouped_tile(N, D, min_blocks):
    blocks, G = row_blocks(N, D, min_blocks)
    rows = [r0 + i for r0, p, g in blocks for i in range(p * g)]
    assert rows == list(range(N))
    assert G * D <= max(D, ROW_ELEMS)
    assert all(p <= PMAX and g in (G, 1) for _, p, g in blocks)
    full = [b for b in blocks if b[2] == G and b[1] == PMAX]
    if G > 1:
        assert len(full) >= min_blocks       # grouping never leaves fewer full blocks than asked for


def test_grouped_rows_put_consecutive_rows_on_each_partition():
    t = torch.arange(40 * 3).reshape(40, 3)
    got = grouped_rows(t, 4, 6, 5)                         # rows 4 .. 33 as [6, 5, 3]
    for i in range(6):
        for j in range(5):
            assert torch.equal(got[i, j], t[4 + i * 5 + j])


def test_as_tensor_takes_numpy_arrays_strided_too():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    got = as_tensor(a)
    assert isinstance(got, torch.Tensor) and torch.equal(got, torch.from_numpy(a.copy()))
    t = torch.ones(2)
    assert as_tensor(t) is t
