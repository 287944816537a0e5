import pytest
import torch

import torchneuron.nki.language as nl
from torchneuron.kernels import elementwise
from tests.kernels.conftest import DTYPES, close

SHAPES = [((1,), (1,)), ((127, 129), (127, 129)), ((300,), (300,)), ((3, 129, 5), (129, 1)),
          ((300, 1), (1, 513)), ((2, 3, 4), (1,)), ((5, 1, 7), (1, 6, 1))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sa,sb", SHAPES)
def test_callable_over_broadcast_inputs(sa, sb, dtype):
    a, b = torch.randn(sa).to(dtype), torch.randn(sb).to(dtype)
    out = elementwise(lambda x, y: nl.maximum(x * y + 1.0, 0.0), a, b)
    assert out.dtype == dtype and out.shape == torch.broadcast_shapes(sa, sb)
    close(out, torch.clamp(a.float() * b.float() + 1, min=0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_expression_string_three_inputs(dtype):
    a, b, c = torch.randn(129, 300).to(dtype), torch.randn(300).to(dtype), torch.randn(129, 1).to(dtype)
    out = elementwise("exp(a) * b - c", a, b, c)
    close(out, torch.exp(a.float()) * b.float() - c.float(), dtype)


def test_add_large_flat_tail():
    a, b = torch.randn(128 * 600 + 77), torch.randn(128 * 600 + 77)
    close(elementwise(nl.add, a, b), a + b, torch.float32)
