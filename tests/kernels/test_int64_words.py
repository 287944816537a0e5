"""kernels/int64_words.py against PyTorch's int64 arithmetic (wrapping mod 2**64 where PyTorch's does)."""
import pytest
import torch

from torchneuron.kernels.int64_words import int64_add, int64_compare, int64_mul, int64_unary, int_sum

EDGES = torch.tensor([0, 1, -1, 2 ** 31, -2 ** 31, 2 ** 32 - 1, 2 ** 62, -2 ** 63, 2 ** 63 - 1])


def _values(n: int) -> torch.Tensor:
    return torch.cat([EDGES, torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), dtype=torch.int64)])


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32).view(-1, 2)


def _int64(words: torch.Tensor) -> torch.Tensor:
    return words.contiguous().view(torch.int64).reshape(-1)


def test_add_wraps_like_pytorch():
    a, b = _values(300), _values(300).flip(0)
    assert torch.equal(_int64(int64_add(_words(a), _words(b))), a + b)


def test_add_broadcasts_one_value():
    a = _values(50)
    assert torch.equal(_int64(int64_add(_words(a), _words(torch.tensor([2 ** 40 + 3])))), a + (2 ** 40 + 3))


def test_mul_is_exact_mod_2_pow_64():
    a, b = _values(200), _values(200).roll(3)
    assert torch.equal(_int64(int64_mul(_words(a), _words(b))), a * b)


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparisons(op):
    a, b = _values(100), _values(100).roll(1)
    b[:5] = a[:5]
    assert torch.equal(int64_compare(_words(a), _words(b), op), getattr(torch, op)(a, b))


@pytest.mark.parametrize("op", ["neg", "abs", "sign"])
def test_unary(op):
    a = _values(100)
    assert torch.equal(_int64(int64_unary(_words(a), op)), getattr(torch, op)(a))


def test_int_sum_of_rows_is_exact():
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 5000), dtype=torch.int32)
    assert torch.equal(_int64(int_sum(x, False)), x.sum(1, dtype=torch.int64))
