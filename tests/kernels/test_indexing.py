"""kernels/indexing.py against PyTorch: iota and row gathers (out-of-range rows raise)."""
import numpy as np
import pytest
import torch

from torchneuron.kernels.indexing import gather_rows, iota, low_words
from torchneuron.sim import IndexOutOfRange


@pytest.mark.parametrize("n", [1, 128, 1000, 70000])
def test_iota_counts_from_zero(n):
    np.testing.assert_array_equal(iota(n), np.arange(n, dtype=np.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_gather_rows_matches_index_select(dtype):
    table = torch.randn(50, 37).to(dtype)
    index = torch.randint(0, 50, (300,), dtype=torch.int32)
    assert torch.equal(gather_rows(table, index), table[index.long()])


def test_gather_rows_reads_every_other_word_with_stride_2():
    table = torch.randn(10, 3)
    index = torch.tensor([7, 2, 9], dtype=torch.int64)
    assert torch.equal(gather_rows(table, index.view(torch.int32), stride=2), table[index])


def test_gather_rows_raises_for_a_row_outside_the_table():
    with pytest.raises(IndexOutOfRange, match="outside the 4 rows"):
        gather_rows(torch.randn(4, 2), torch.tensor([0, 4], dtype=torch.int32))


@pytest.mark.parametrize("bad", [2**32 + 1, 2**31 + 1, -(2**32) + 3, -1])
def test_gather_rows_refuses_an_int64_index_whose_high_word_is_not_zero(bad):
    """An int64 index is its full value, not its low word: 2**32 + 1 must not read row 1."""
    index = torch.tensor([1, bad], dtype=torch.int64)
    with pytest.raises(IndexOutOfRange):
        gather_rows(torch.randn(10, 3), index.view(torch.int32), stride=2)


@pytest.mark.parametrize("n", [1, 127, 128 * 3 + 5, 128 * 2048 + 130])
def test_low_words_are_each_int64s_low_32_bits(n):
    # int64 values beyond int32 (both signs) as little-endian word pairs: each value's low 32 bits, read
    # as a two's-complement int32
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(-2**40, 2**40, (n,), generator=g, dtype=torch.int64)
    low = ids & 0xFFFFFFFF
    want = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
    got = torch.as_tensor(low_words(ids.view(torch.int32)))
    assert got.dtype == torch.int32 and torch.equal(got, want)
