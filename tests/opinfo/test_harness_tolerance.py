"""The harness's tolerances: for sums of products, rounding differences of the terms' magnitude pass (the
summation order differs between the device and the CPU, and between CPUs), real errors still fail; bf16/fp16
results at least as exact as the CPU's pass; gradients are compared."""
from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

from tests.opinfo.harness import (ORDER_ULPS, any_index_of_value, at_least_as_exact, broadcast_grad_term_magnitudes,
                                  check_sample_grads, term_magnitudes, tie_order_free, within_summation_order)

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


def test_fft_bound_covers_every_outputs_terms_and_a_wrong_element_fails():
    """An FFT output's terms are the inputs times unit twiddles: the bound is at least sum(|x|) (times two for
    a Hermitian op) at every frequency, computed here from the explicit DFT sum."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (5, 6, 7), generator=gen, dtype=torch.uint8)
    hfft2 = next(o for o in op_db if o.name == "fft.hfft2")
    parts = (x, (), {"dim": (-3, -2, -1)})
    expected = hfft2.op(x, dim=(-3, -2, -1))
    bound = term_magnitudes(hfft2, parts)
    assert bound.shape == expected.shape
    assert (bound >= 2 * x.double().abs().sum()).all()          # the Hermitian expansion counts x twice
    c2c = next(o for o in op_db if o.name == "fft.fftn")
    y = torch.randn(4, 8, generator=gen)
    assert (term_magnitudes(c2c, (y, (), {})) >= y.abs().sum().double()).all()
    eps = torch.finfo(torch.float32).eps / 2
    exact = torch.fft.hfftn(x.double(), dim=(-3, -2, -1)).float()
    assert torch.equal(within_summation_order(exact, expected, bound), exact)
    wrong = exact.clone()
    wrong[1, 2, 3] += 4 * ORDER_ULPS * eps * bound[1, 2, 3].item()
    assert within_summation_order(wrong, expected, bound)[1, 2, 3] == expected[1, 2, 3]


def test_a_reduced_precision_result_at_least_as_exact_as_the_cpus_passes():
    # x + alpha * y in bf16: the CPU rounds alpha * y to bf16 first (-19.875), one rounding gives -19.75,
    # the float64 result is -19.8046875. The device's result passes; one further off than the CPU's fails.
    x, y = torch.tensor([5.78125], dtype=torch.bfloat16), torch.tensor([8.1875], dtype=torch.bfloat16)
    cpu = torch.add(x, y, alpha=-3.125)
    exact = torch.add(x.double(), y.double(), alpha=-3.125)
    once = exact.to(torch.bfloat16)
    assert cpu.item() == -19.875 and once.item() == -19.75
    assert torch.equal(at_least_as_exact(exact, once, cpu), once)
    further = torch.tensor([-19.5], dtype=torch.bfloat16)
    assert torch.equal(at_least_as_exact(exact, further, cpu), cpu)   # the comparison will fail it


def test_gradients_are_compared():
    mm = next(o for o in op_db if o.name == "mm")
    sample = next(iter(mm.sample_inputs("cpu", torch.float32)))
    assert check_sample_grads(mm, sample) == "checked"


def test_a_wrong_gradient_fails(monkeypatch):
    # the device's tanh backward made wrong (1 - y instead of 1 - y^2): the forward still matches
    tanh = next(o for o in op_db if o.name == "tanh")
    sample = next(iter(tanh.sample_inputs("cpu", torch.float32)))
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (dropped at the end of the test)
    lib.impl("tanh_backward", lambda g, y: g * (1 - y), "PrivateUse1")
    try:
        with pytest.raises(AssertionError, match="gradient of input 0"):
            check_sample_grads(tanh, sample)
    finally:
        lib._destroy()


def test_unstable_sort_may_order_ties_either_way_but_not_pick_other_values():
    sort = next(o for o in op_db if o.name == "sort")
    x = torch.tensor([2.0, 1.0, 2.0, 1.0])
    values, indices = torch.sort(x)
    swapped = torch.tensor([3, 1, 2, 0])           # the tied 1.0s and 2.0s in the other order
    got = tie_order_free(sort, (x, (), {}), (values, swapped), (values, indices))
    assert torch.equal(got[1], swapped)
    wrong = torch.tensor([1, 3, 0, 1])             # picks index 1 twice
    assert torch.equal(tie_order_free(sort, (x, (), {}), (values, wrong), (values, indices))[1], indices)
    stable = tie_order_free(sort, (x, (), {"stable": True}), (values, swapped), (values, indices))
    assert torch.equal(stable[1], indices)          # a stable sort's order is specified


def test_a_reductions_index_may_point_at_any_element_holding_the_value():
    mode = next(o for o in op_db if o.name == "mode")
    x = torch.tensor([[1.0, 2.0, 1.0, 2.0, 2.0]])
    values, indices = torch.mode(x, 1)
    other = torch.tensor([3 if indices.item() != 3 else 1])        # another 2.0
    assert torch.equal(any_index_of_value(mode, (x, (1,), {}), (values, other), (values, indices))[1], other)
    wrong = torch.tensor([0])                                        # holds 1.0
    assert torch.equal(any_index_of_value(mode, (x, (1,), {}), (values, wrong), (values, indices))[1], indices)


def test_a_broadcast_inputs_gradient_is_bounded_by_its_terms_and_a_wrong_one_fails():
    # pow's exponent broadcast over 10 rows: its gradient sums 10 terms cot * x**y * log(x), so the bound is
    # sum(|terms|) at 2 (K + 3) = 26 rounding units; a row's worth of error still fails
    pow_op = next(o for o in op_db if o.name == "pow" and not o.variant_test_name)
    gen = torch.Generator().manual_seed(0)
    x, y = 1 + 8 * torch.rand(10, 1, 5, generator=gen), 4 * torch.rand(10, 5, generator=gen)
    cot = torch.randn(10, 10, 5, generator=gen)
    bounds, ulps = broadcast_grad_term_magnitudes(pow_op, (x, (y,), {}), [cot])
    terms = cot.double() * x.double().pow(y.double()) * x.double().log()
    torch.testing.assert_close(bounds[0], (cot.double() * y.double() * x.double().pow(y.double() - 1)).abs()
                               .sum(1, keepdim=True))
    torch.testing.assert_close(bounds[1], terms.abs().sum(0))
    assert ulps[1] == 2 * (10 + 3)
    exact = terms.sum(0)
    expected = exact.float()
    eps = torch.finfo(torch.float32).eps / 2
    nearby = (exact + 20 * eps * bounds[1]).float()
    assert torch.equal(within_summation_order(nearby, expected, bounds[1], ulps[1]), nearby)
    wrong = (exact + terms[0]).float()                            # one term counted twice
    assert not torch.equal(within_summation_order(wrong, expected, bounds[1], ulps[1]), wrong)
    full = x.expand(10, 10, 5).clone()                             # spans the output: the plain tolerance
    assert broadcast_grad_term_magnitudes(pow_op, (full, (y,), {}), [cot])[0][0] is None
    assert broadcast_grad_term_magnitudes(pow_op, (full, (y.expand(10, 10, 5).clone(),), {}), [cot]) is None


def test_normalize_gradient_bound_follows_its_terms():
    from tests.opinfo.harness import GRAD_TERMS

    # One element along dim: y = sign(x), an exact gradient of 0 reached as g/|x| - g/|x|; each side's bf16
    # result is noise of the terms' size, which the bound covers, while a gradient off by a tenth of the terms
    # on a longer dim fails.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 4, 5, generator=gen)
    g = torch.randn(1, 2, 4, 5, generator=gen)
    (terms,), (units,) = GRAD_TERMS["nn.functional.normalize"]((x, (), {"p": 0.5, "dim": 0}), [g])
    torch.testing.assert_close(terms, 2 * g.double().abs() / x.double().abs())
    assert units == 2 * (1 + 8) * 2
    xb = x.bfloat16().requires_grad_()
    (noise,) = torch.autograd.grad(torch.nn.functional.normalize(xb, p=0.5, dim=0), xb, g.bfloat16())
    eps = torch.finfo(torch.bfloat16).eps / 2
    assert (noise.double().abs() <= units * eps * terms).all()
    x2 = x.double().requires_grad_()
    (exact,) = torch.autograd.grad(torch.nn.functional.normalize(x2, dim=1), x2, g.double())
    (terms2,), (units2,) = GRAD_TERMS["nn.functional.normalize"]((x, (), {"dim": 1}), [g])
    wrong = exact + 0.1 * terms2
    kept = within_summation_order(wrong.bfloat16(), exact.bfloat16(), terms2, units2)
    assert not torch.equal(kept, wrong.bfloat16())


def test_an_fp32_result_as_close_to_float64_as_the_cpus_passes_and_a_further_one_fails():
    from tests.opinfo.harness import within_reference_error

    # An ill-conditioned solve: the CPU's fp32 result is ~1e-4 off the float64 one. A device result off by as
    # much in the other direction is as right; one off by 100 times that is not.
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(6, 6, generator=gen).triu() + 0.05 * torch.eye(6)
    B = torch.randn(6, 2, generator=gen) * 100
    cpu = torch.linalg.solve_triangular(A, B, upper=True)
    exact = torch.linalg.solve_triangular(A.double(), B.double(), upper=True)
    err = (cpu.double() - exact).abs()
    assert err.max() > 1e-5                                   # beyond a plain fp32 comparison of the two
    other = (exact - (cpu.double() - exact)).float()          # the same error, the other way
    assert torch.equal(within_reference_error(exact, other, cpu, None, None), other)
    wrong = (exact + 100 * err + 1e-3).float()
    assert not torch.equal(within_reference_error(exact, wrong, cpu, None, None), wrong)
