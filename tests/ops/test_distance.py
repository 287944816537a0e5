"""Pairwise distances (cdist, pdist) run on the device (strict mode) and match the CPU."""
import pytest
import torch

from tests.ops.conftest import to_n

torch.manual_seed(0)
MODES = ["use_mm_for_euclid_dist_if_necessary", "use_mm_for_euclid_dist", "donot_use_mm_for_euclid_dist"]


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, float("inf")])
def test_cdist_matches_cpu(p, strict):
    # broadcast batch dims, the >25-row switch to the matmul form, empty sides
    for a, b in [((4, 5), (3, 5)), ((2, 1, 4, 3), (3, 6, 3)), ((30, 4), (7, 4)), ((0, 3), (4, 3)), ((3, 0), (4, 0))]:
        x, y = torch.randn(a), torch.randn(b)
        for mode in MODES:
            torch.testing.assert_close(torch.cdist(to_n(x), to_n(y), p, mode).cpu(), torch.cdist(x, y, p, mode))


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 1.5, float("inf")])
def test_pdist_matches_cpu(p, strict):
    for shape in [(6, 4), (1, 3), (5, 0)]:
        x = torch.randn(shape)
        torch.testing.assert_close(torch.pdist(to_n(x), p).cpu(), torch.pdist(x, p))


def test_distance_errors_match_cpu():
    x = torch.randn(3, 5)
    for fn in (lambda t: torch.cdist(t, t[:, :4]), lambda t: torch.cdist(t, t, p=-1.0),
               lambda t: torch.cdist(t[0], t), lambda t: torch.pdist(t, p=-1), lambda t: torch.pdist(t[None])):
        with pytest.raises(RuntimeError) as cpu_err:
            fn(x)
        with pytest.raises(RuntimeError, match=str(cpu_err.value).split(".")[0][:30]):
            fn(to_n(x))
