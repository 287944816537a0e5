"""``native_layer_norm`` in eager mode: one launch, its saved statistics returned in the input's dtype as on the
CPU (rounded once from fp32 by the kernel's store)."""
import pytest
import torch

from tests.ops.conftest import to_n
from torchneuron.runtime import profiler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [700, 5003])   # the one-pass and the multi-pass paths
def test_layer_norm_is_one_launch_with_statistics_like_cpu(D, dtype, strict):
    torch.manual_seed(0)
    x = (torch.randn(300, D) * 3 + 5).to(dtype)
    w, b = torch.randn(D).to(dtype), torch.randn(D).to(dtype)
    xn, wn, bn = to_n(x), to_n(w), to_n(b)
    with profiler.record() as recs:
        got = torch.native_layer_norm(xn, [D], wn, bn, 1e-5)
    assert [r.name for r in recs] == ["layer_norm_kernel"]
    # float64 statistics of the same rounded input, rounded once to the dtype: within its eps and the fp32
    # statistics' error (a random walk over D terms)
    xd = x.double()
    mean, rstd = xd.mean(-1, keepdim=True), (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    eps = torch.finfo(dtype).eps
    bound = eps + 8 * D ** 0.5 * torch.finfo(torch.float32).eps
    for t, ref in ((got[1], mean), (got[2], rstd)):
        assert t.dtype == dtype and t.shape == (300, 1)
        assert bool(((t.cpu().double() - ref).abs() <= bound * ref.abs()).all())
