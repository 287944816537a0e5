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


def test_stable_for_large_logits():
    x = torch.tensor([[1000.0, 1001.0, 1002.0], [-1000.0, 0.0, 1000.0]])
    out = softmax(x)
    assert torch.isfinite(out).all()
    close(out, torch.softmax(x, -1), torch.float32)


def test_row_beyond_sbuf_is_refused():
    with pytest.raises(AssertionError, match="SBUF"):
        softmax(torch.zeros(1, 64 * 1024))


def test_without_the_budget_assert_the_simulator_refuses(monkeypatch):
    """The kernel's own SBUF assert removed, the simulator's allocator names the overflow."""
    import importlib
    sm = importlib.import_module("torchneuron.kernels.softmax")
    from torchneuron.nki import SimulatorError
    monkeypatch.setattr(sm, "check_sbuf", lambda need, what: None)
    with pytest.raises(SimulatorError, match="sbuf overflow"):
        sm.softmax_kernel(torch.zeros(1, 40 * 1024))
