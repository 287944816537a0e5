import pytest
import torch

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def close(out, ref, dtype, scale=1.0):
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol["atol"] * scale, rtol=tol["rtol"] * scale)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
