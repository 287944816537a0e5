"""embedding_renorm_ (F.embedding / F.embedding_bag with max_norm) in bf16 and fp16 rounds as the CPU: the
row's norm is taken in the row's dtype, the scale max_norm / (norm + 1e-7) is rounded to it, and the product
once more. From the fp32 norm and scale, a quarter of the rescaled fp16 rows had an element a unit off."""
import pytest
import torch

from tests.ops.conftest import to_n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_type,max_norm", [(1.0, 1.0), (2.0, 2.5), (1.5, 0.7)])
def test_renorm_rounds_norm_and_scale_as_the_cpu(strict, dtype, norm_type, max_norm):
    # With the CPU's roundings the two differ only where their fp32 norms (K = 16 terms, in other orders) or
    # fp32 quotients straddle a rounding boundary of the dtype: about K * 2**-24 / 2**-11 < 0.1% per row, and
    # such a row moves by one unit. One row of the 64 is allowed that, and no element beyond one unit.
    gen = torch.Generator().manual_seed(int(norm_type * 10))
    w = (torch.randn(64, 16, generator=gen) * 8).to(dtype)
    idx = torch.randint(0, 64, (100,), generator=gen)
    want = w.clone()
    torch.embedding_renorm_(want, idx, max_norm, norm_type)
    got = to_n(w)
    torch.embedding_renorm_(got, to_n(idx), max_norm, norm_type)
    got = got.cpu()
    off = (got.double() - want.double()).abs()
    unit = torch.finfo(dtype).eps * want.double().abs().clamp_min(torch.finfo(dtype).tiny)
    assert bool((off <= unit).all())
    assert int((off > 0).any(1).sum()) <= 1
