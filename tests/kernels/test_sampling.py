"""kernels/sampling.py: draws have their distribution's moments; counts match a comparison on the CPU."""
import torch

from torchneuron.kernels.sampling import count_kernel, sample_kernel


def _draw(dist: str, params: list[float], n: int = 200000, seed: int = 3) -> torch.Tensor:
    return sample_kernel(torch.tensor([[seed]], dtype=torch.int32), torch.tensor([params + [0.0] * (4 - len(params))]),
                         n, dist, torch.float32)


def test_uniform_and_normal_moments():
    n = 200000
    cap = torch.nextafter(torch.tensor(5.0), torch.tensor(0.0)).item()   # the largest fp32 below hi
    u = _draw("uniform", [2.0, 5.0, cap], n)
    assert u.min() >= 2.0 and u.max() < 5.0
    assert abs(u.mean().item() - 3.5) < 5 * (9 / 12 / n) ** 0.5
    z = _draw("normal", [1.0, 2.0], n)
    assert abs(z.mean().item() - 1.0) < 5 * 2 / n ** 0.5
    assert abs(z.std().item() - 2.0) < 0.02


def test_the_same_seed_draws_the_same_numbers():
    assert torch.equal(_draw("exponential", [1.5], 1000), _draw("exponential", [1.5], 1000))


def test_count_kernel_counts_like_a_comparison():
    table, values = torch.randn(5, 300).sort(1).values, torch.randn(5, 40)
    for strict in (False, True):
        expected = ((table.unsqueeze(1) < values.unsqueeze(2)) if strict
                    else (table.unsqueeze(1) <= values.unsqueeze(2))).sum(2).to(torch.int32)
        assert torch.equal(count_kernel(table, values, strict), expected)
