"""Cholesky factorisation and triangular solves run on the device (strict mode) and match the CPU."""
import warnings

import pytest
import torch

import torchneuron
from tests.ops.conftest import to_n

torch.manual_seed(0)
warnings.filterwarnings("ignore", message="torch.cholesky is deprecated")


def _pd(*shape: int) -> torch.Tensor:
    """A batch of well-conditioned symmetric positive-definite matrices (shape: batch dims, then n)."""
    a = torch.randn(*shape, shape[-1])
    return a @ a.mT + shape[-1] * torch.eye(shape[-1])


@pytest.mark.parametrize("shape", [(5,), (2, 5), (1, 1, 5), (0, 5), (2, 0), (17,)])
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_family_matches_cpu(shape, upper, strict):
    a = _pd(*shape)
    torch.testing.assert_close(torch.cholesky(to_n(a), upper=upper).cpu(), torch.cholesky(a, upper=upper))
    chol = torch.linalg.cholesky(a, upper=upper)
    torch.testing.assert_close(torch.linalg.cholesky(to_n(a), upper=upper).cpu(), chol)
    torch.testing.assert_close(torch.cholesky_inverse(to_n(chol), upper=upper).cpu(),
                               torch.cholesky_inverse(chol, upper=upper), atol=1e-5, rtol=1e-4)
    b = torch.randn(*shape, 3)
    torch.testing.assert_close(torch.cholesky_solve(to_n(b), to_n(chol), upper=upper).cpu(),
                               torch.cholesky_solve(b, chol, upper=upper), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("unit", [False, True])
def test_triangular_solves_match_cpu(upper, transpose, unit, strict):
    tri = torch.randn(2, 5, 5) + 3 * torch.eye(5)
    a = tri.triu() if upper else tri.tril()
    b = torch.randn(2, 5, 3)
    got = torch.triangular_solve(to_n(b), to_n(a), upper=upper, transpose=transpose, unitriangular=unit)
    want = torch.triangular_solve(b, a, upper=upper, transpose=transpose, unitriangular=unit)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w)
    for left, rhs in ((True, b), (False, b.mT)):
        torch.testing.assert_close(
            torch.linalg.solve_triangular(to_n(a), to_n(rhs), upper=upper, left=left, unitriangular=unit).cpu(),
            torch.linalg.solve_triangular(a, rhs, upper=upper, left=left, unitriangular=unit))
    # broadcast batch dims
    torch.testing.assert_close(torch.linalg.solve_triangular(to_n(a[:1]), to_n(b), upper=upper).cpu(),
                               torch.linalg.solve_triangular(a[:1], b, upper=upper))


def test_not_positive_definite_raises_like_cpu():
    bad = torch.stack([torch.eye(3), -_pd(3)])
    for fn in (torch.cholesky, torch.linalg.cholesky):
        with pytest.raises(torch.linalg.LinAlgError, match=r"\(Batch element 1\).*order 1"):
            fn(to_n(bad))
    torch.testing.assert_close(torch.linalg.cholesky_ex(to_n(bad)).info.cpu(), torch.linalg.cholesky_ex(bad).info)
    with pytest.raises(RuntimeError):  # a non-square matrix: the CPU's argument error
        torch.linalg.cholesky(to_n(torch.randn(3, 4)))


def test_cholesky_runs_natively_then_falls_back_only_for_failures():
    torchneuron.reset_fallback_counts()
    torch.linalg.cholesky(to_n(_pd(4)))
    assert torchneuron.fallback_counts() == {}
