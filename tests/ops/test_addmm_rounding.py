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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batched,M,K,N,beta,alpha", [
    (False, 32, 16, 24, 1, 1),        # rows grouped into one PSUM bank
    (False, 130, 600, 600, 0.5, 2.0),  # the tiled loop nest
    (False, 32, 14600, 24, 1, -1.0),   # a contraction longer than one pass (K chunks)
    (True, 130, 64, 600, 1, 1),        # batched: one contraction tile, large entries
    (True, 130, 300, 64, 2.0, 1),      # batched: a long contraction into a narrow output
    (True, 130, 300, 600, 1, 0.5),     # batched: entries through the tiled loop nest
])
def test_full_shape_input_rounds_once(strict, dtype, batched, M, K, N, beta, alpha):
    # An input of the result's shape (the chunked linear_cross_entropy's addmm into its gradient): the CPU's GEMM
    # adds beta * input to the fp32 product and rounds once. Against float64 of the same rounded operands the
    # error is then one rounding of the result (eps/2 of it) plus the fp32 accumulation (a random-walk bound,
    # 4 sqrt(K) eps32 of the terms' magnitudes). The product rounded to the dtype first adds eps/2 of the product,
    # which where input and product cancel is far more: the bound fails it.
    gen = torch.Generator().manual_seed(K)
    lead = (3,) if batched else ()
    inp = torch.randn(*lead, M, N, generator=gen)
    a, b = torch.randn(*lead, M, K, generator=gen) / K ** 0.5, torch.randn(*lead, K, N, generator=gen)
    inp, a, b = (inp * 4).to(dtype), (a * 4).to(dtype), (b * 4).to(dtype)
    op = torch.baddbmm if batched else torch.addmm
    got = op(to_n(inp), to_n(a), to_n(b), beta=beta, alpha=alpha).cpu().double()
    exact = beta * inp.double() + alpha * (a.double() @ b.double())
    terms = abs(beta) * inp.double().abs() + abs(alpha) * (a.double().abs() @ b.double().abs())
    fi = torch.finfo(dtype)
    bound = fi.eps / 2 * exact.abs() + 4 * K ** 0.5 * torch.finfo(torch.float32).eps * terms + fi.tiny
    assert bool(((got - exact).abs() <= bound).all()), float(((got - exact).abs() / bound).max())
