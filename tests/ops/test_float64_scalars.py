"""float64 ops take the CPU fallback with their Python scalars in float64: the fallback runs the CPU's own
kernel on the same operands, so the results are the CPU's bit for bit (a scalar passed as an fp32 tensor
rounded x * sqrt(0.5) by 3e-8, which multi_head_attention_forward's float64 gradients carried to 2e-7)."""
import math

import pytest
import torch

from tests.ops.conftest import to_n

SCALAR = math.sqrt(0.5)   # not an fp32 value


@pytest.mark.parametrize("fn", [lambda t: t * SCALAR, lambda t: t + SCALAR, lambda t: SCALAR - t,
                                lambda t: torch.where(t > 0, t, SCALAR), lambda t: t.float() * SCALAR,
                                lambda t: (t * 10).long() * SCALAR],
                         ids=["mul", "add", "rsub", "where", "fp32_mul", "int_mul"])
def test_python_float_scalars_keep_their_precision(fn):
    x = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want, got = fn(x), fn(to_n(x)).cpu()
    assert got.dtype == want.dtype
    assert torch.equal(got, want)
