import pytest
import torch

from torchneuron.nki import SimulatorError
from torchneuron.kernels import matmul
from tests.kernels.conftest import DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (127, 129, 300), (129, 300, 513), (128, 128, 512)])
def test_matmul_matches_torch(mkn, transpose_a, dtype):
    M, K, N = mkn
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    out = matmul(a.T.contiguous() if transpose_a else a, b, transpose_a=transpose_a)
    assert out.dtype == dtype and out.shape == (M, N)
    close(out, (a.float() @ b.float()), dtype, scale=2.0)


def test_matmul_k_beyond_sbuf_budget_is_refused():
    a, b = torch.zeros(1, 128 * 1024), torch.zeros(128 * 1024, 1)
    with pytest.raises(AssertionError, match="SBUF"):
        matmul(a, b)


def test_matmul_mismatched_k():
    with pytest.raises(AssertionError, match="contraction"):
        matmul(torch.zeros(4, 5), torch.zeros(6, 4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("mkn", [(300, 1100, 1700), (384, 256, 3100), (129, 40, 1537)])
def test_matmul_several_panels_and_strips(mkn, transpose_a, dtype):
    # several N panels and M strips (with partial K/M/N tiles): with A as [M, K] the first panel
    # transposes each strip (pipelined) and stores it to an HBM scratch that later panels read
    M, K, N = mkn
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    out = matmul(a.T.contiguous() if transpose_a else a, b, transpose_a=transpose_a)
    assert out.dtype == dtype and out.shape == (M, N)
    close(out, (a.float() @ b.float()), dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (127, 129, 300), (129, 300, 513), (513, 127, 129),
                                 (300, 513, 1), (1, 300, 513), (300, 1100, 1700)])
def test_matmul_transpose_b_matches_torch(mkn, transpose_a, dtype):
    # B given as [N, K] (A @ B.T): each B panel is built by TensorE transposes of [128, K] row blocks
    M, K, N = mkn
    a, b = torch.randn(M, K).to(dtype), torch.randn(N, K).to(dtype)
    out = matmul(a.T.contiguous() if transpose_a else a, b, transpose_a=transpose_a, transpose_b=True)
    assert out.dtype == dtype and out.shape == (M, N)
    close(out, (a.float() @ b.float().T), dtype, scale=2.0)


def test_matmul_transpose_b_mismatched_k():
    with pytest.raises(AssertionError, match="contraction"):
        matmul(torch.zeros(4, 5), torch.zeros(4, 6), transpose_b=True)
