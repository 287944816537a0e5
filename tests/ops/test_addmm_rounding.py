"""bf16/fp16 addmm and baddbmm with a broadcast input round once, as the CPU: beta * input + alpha * (a @ b)
formed in fp32 from the fp32 products. Rounding the product to the dtype before the addition is a second
rounding, off by up to a unit wherever the input is large against the result (attention scores plus a mask)."""
import pytest
import torch

from tests.ops.conftest import to_n


def _units_off(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the dtype at the larger of the two magnitudes."""
    fi = torch.finfo(want.dtype)
    scale = torch.maximum(got.double().abs(), want.double().abs()).clamp_min(fi.tiny)
    return (got.double() - want.double()).abs() / (fi.eps * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batched,K,beta,alpha", [(True, 1, 1, 1), (True, 8, 0.5, 2.0), (False, 1, 1, 1),
                                                  (False, 16, 2.0, -1.0)])
def test_broadcast_input_rounds_once(strict, dtype, batched, K, beta, alpha):
    # The two sides differ only in the order of their fp32 sums (K terms, at most K units of fp32 of the terms'
    # magnitude ~ the result here): a rounding boundary of the dtype straddled for a fraction of about
    # K * 2**-24 / 2**-11 < 1% of the elements, each then one unit away. Rounded twice, ~40% were.
    gen = torch.Generator().manual_seed(K)
    if batched:
        inp, a, b = torch.randn(1, 16, 24, generator=gen), torch.randn(4, 16, K, generator=gen), \
            torch.randn(4, K, 24, generator=gen)
        op = torch.baddbmm
    else:
        inp, a, b = torch.randn(32, 1, generator=gen), torch.randn(32, K, generator=gen), \
            torch.randn(K, 24, generator=gen)
        op = torch.addmm
    inp, a, b = (inp * 50).to(dtype), (a * 20).to(dtype), (b * 20).to(dtype)
    want = op(inp, a, b, beta=beta, alpha=alpha)
    got = op(to_n(inp), to_n(a), to_n(b), beta=beta, alpha=alpha).cpu()
    off = _units_off(got, want)
    assert float((off > 0).double().mean()) <= 0.01
    assert float(off.max()) <= 1
