import pytest
import torch

from torchneuron.kernels import log_softmax, softmax
from tests.kernels.conftest import DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (300, 513), (2, 3, 300)])
def test_softmax_and_log_softmax(shape, dtype):
    x = (torch.randn(shape) * 4).to(dtype)
    close(softmax(x), torch.softmax(x.float(), -1), dtype)
    close(log_softmax(x), torch.log_softmax(x.float(), -1), dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 10000), (130, 4801)])
def test_long_rows_take_the_online_two_pass_path(shape, dtype):
    # rows longer than SBUF holds: online max/sum over column blocks; a late large value forces rescaling
    x = (torch.randn(shape) * 4).to(dtype)
    x[0, -1] = 60.0
    close(softmax(x), torch.softmax(x.float(), -1), dtype)
    close(log_softmax(x), torch.log_softmax(x.float(), -1), dtype, scale=2.0)


@pytest.mark.parametrize("shape,dim", [((5, 7, 9), 1), ((300, 4), 0), ((3, 4, 5), -3), ((7,), 0), ((), 0)])
def test_any_dim(shape, dim):
    x = torch.randn(shape) * 4
    close(softmax(x, dim), torch.softmax(x, dim), torch.float32)
    close(log_softmax(x, dim), torch.log_softmax(x, dim), torch.float32)


def test_stable_for_large_logits():
    x = torch.tensor([[1000.0, 1001.0, 1002.0], [-1000.0, 0.0, 1000.0]])
    out = softmax(x)
    assert torch.isfinite(out).all()
    close(out, torch.softmax(x, -1), torch.float32)


def test_without_the_budget_assert_the_simulator_refuses(monkeypatch):
    """Forced onto the single-pass path with its SBUF assert removed, the simulator's allocator names
    the overflow."""
    import importlib
    sm = importlib.import_module("torchneuron.kernels.softmax")
    from torchneuron.nki import SimulatorError
    monkeypatch.setattr(sm, "check_sbuf", lambda need, what: None)
    monkeypatch.setattr(sm, "fits_one_pass", lambda D: True)
    with pytest.raises(SimulatorError, match="sbuf overflow"):
        sm.softmax_kernel(torch.zeros(1, 40 * 1024 + 1))
