import pytest
import torch
import torch.nn.functional as F

from torchneuron.kernels import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward
from tests.kernels.conftest import DTYPES, close

SHAPES = [(1, 1), (127, 129), (300, 513), (2, 3, 300)]


def _inputs(shape, dtype):
    D = shape[-1]
    return ((torch.randn(shape) * 2 + 1).to(dtype), torch.randn(D).to(dtype), torch.randn(D).to(dtype),
            torch.randn(shape).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward(shape, dtype):
    x, w, b, _ = _inputs(shape, dtype)
    D = shape[-1]
    close(layer_norm(x, w, b), F.layer_norm(x.float(), (D,), w.float(), b.float()), dtype, scale=2.0)
    close(rms_norm(x, w), F.rms_norm(x.float(), (D,), w.float(), 1e-6), dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward(shape, dtype):
    x, w, b, dy = _inputs(shape, dtype)
    D = shape[-1]
    xr, wr, br = (t.float().requires_grad_() for t in (x, w, b))
    F.layer_norm(xr, (D,), wr, br).backward(dy.float())
    dx, dw, db = layer_norm_backward(dy, x, w)
    rows = x.numel() // D   # weight grads sum over rows: scale the tolerance with the row count
    close(dx, xr.grad, dtype, scale=2.0)
    close(dw, wr.grad, dtype, scale=max(2.0, rows / 50))
    close(db, br.grad, dtype, scale=max(2.0, rows / 50))
    xr.grad = wr.grad = None
    F.rms_norm(xr, (D,), wr, 1e-6).backward(dy.float())
    dx, dw = rms_norm_backward(dy, x, w)
    close(dx, xr.grad, dtype, scale=2.0)
    close(dw, wr.grad, dtype, scale=max(2.0, rows / 50))


def test_row_beyond_sbuf_is_refused():
    with pytest.raises(AssertionError, match="SBUF"):
        layer_norm(torch.zeros(1, 32 * 1024), torch.ones(32 * 1024), torch.zeros(32 * 1024))
