"""The harness's tolerance for sums of products: rounding differences of the terms' magnitude pass (the
summation order differs between the device and the CPU, and between CPUs), real errors still fail."""
from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

from tests.opinfo.harness import ORDER_ULPS, term_magnitudes, within_summation_order

CONV2D = next(o for o in op_db if o.name == "nn.functional.conv2d")


def _case():
    gen = torch.Generator().manual_seed(0)
    x, w = 8 * torch.randn(1, 4, 6, 6, generator=gen), 8 * torch.randn(5, 4, 3, 3, generator=gen)
    expected = torch.nn.functional.conv2d(x, w)
    bound = term_magnitudes(CONV2D, (x, (w,), {}))
    return x, w, expected, bound


def test_bound_is_the_sum_of_absolute_terms():
    x, w, expected, bound = _case()
    assert bound.dtype == torch.float64 and bound.shape == expected.shape
    torch.testing.assert_close(bound, torch.nn.functional.conv2d(x.double().abs(), w.double().abs()))
    assert (bound >= expected.double().abs()).all()


def test_another_summation_order_passes_and_a_wrong_element_fails():
    x, w, expected, bound = _case()
    other_order = torch.nn.functional.conv2d(x.double(), w.double()).float()   # one rounding instead of many
    eps = torch.finfo(torch.float32).eps / 2
    assert ((other_order.double() - expected.double()).abs() <= ORDER_ULPS * eps * bound).all()
    assert torch.equal(within_summation_order(other_order, expected, bound), other_order)
    wrong = other_order.clone()
    wrong[0, 1, 2, 3] += 4 * ORDER_ULPS * eps * bound[0, 1, 2, 3].item() + 1e-3
    kept = within_summation_order(wrong, expected, bound)
    assert kept[0, 1, 2, 3] == expected[0, 1, 2, 3]      # left as the CPU's: the comparison will fail it
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, kept)
