"""kernels/random.py: the dropout mask is reproducible from its seed, keeps about 1 - p, and scales what it keeps."""
import torch

from torchneuron.kernels.random import dropout_kernel


def _dropout(x: torch.Tensor, seed: int, p: float):
    scalar = lambda v, dt: torch.tensor([[v]], dtype=dt)   # noqa: E731
    return dropout_kernel(x, scalar(seed, torch.int32), scalar(p, torch.float32), scalar(1 / (1 - p), torch.float32))


def test_dropout_mask_and_scale():
    x, p = torch.randn(100000), 0.3
    out, mask = _dropout(x, 7, p)
    kept = mask.float().mean().item()
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / x.numel()) ** 0.5        # five standard deviations
    torch.testing.assert_close(out, torch.where(mask, x / (1 - p), 0.0), rtol=1e-6, atol=0)
    again, mask_again = _dropout(x, 7, p)
    assert torch.equal(mask, mask_again) and torch.equal(out, again)
    assert not torch.equal(mask, _dropout(x, 8, p)[1])
