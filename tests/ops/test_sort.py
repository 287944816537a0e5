"""Scans and sorts run on the device (strict mode) and match the CPU."""
import pytest
import torch

from tests.ops.conftest import to_n

torch.manual_seed(0)


def same(dev, cpu, **kw):
    torch.testing.assert_close(dev.cpu(), cpu, equal_nan=True, **kw)


def test_cumsum_cumprod(strict):
    x = torch.randn(3, 4, 70)
    for dim in (0, 1, -1):
        same(to_n(x).cumsum(dim), x.cumsum(dim), atol=1e-5, rtol=1e-5)
        same(to_n(x * 0.1 + 1).cumprod(dim), (x * 0.1 + 1).cumprod(dim), atol=1e-5, rtol=1e-5)
    xi = torch.randint(-5, 5, (4, 6), dtype=torch.int32)
    same(to_n(xi).cumsum(1), xi.cumsum(1))                      # int64 result, like the CPU
    same(to_n(xi > 0).cumsum(0), (xi > 0).cumsum(0))
    same(to_n(xi).cumprod(0, dtype=torch.float32), xi.cumprod(0, dtype=torch.float32))
    a = to_n(x)
    a.cumsum_(1)
    same(a, x.cumsum(1), atol=1e-5, rtol=1e-5)
    out = to_n(torch.empty(0))
    torch.cumsum(to_n(x), 2, out=out)
    same(out, x.cumsum(2), atol=1e-5, rtol=1e-5)
    same(to_n(torch.tensor(3.0)).cumsum(0), torch.tensor(3.0).cumsum(0))


def test_cumsum_long_rows(strict):
    x = torch.rand(2, 5000)
    same(to_n(x).cumsum(1), x.cumsum(1), atol=1e-3, rtol=1e-5)


def test_scan_backward(strict):
    x = torch.rand(3, 6) + 0.5
    for fn in (lambda t: t.cumsum(1), lambda t: t.cumprod(1)):
        a, b = x.clone().requires_grad_(), to_n(x).requires_grad_()
        g = torch.randn(3, 6)
        fn(a).backward(g)
        fn(b).backward(to_n(g))
        same(b.grad, a.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_stable_with_ties_and_nan(dtype, descending, strict):
    x = torch.randint(-3, 4, (5, 9)).to(dtype)
    if dtype.is_floating_point:
        x[1, 2] = x[3, 0] = float("nan")
    for dim in (1, 0):
        v, i = torch.sort(to_n(x), dim=dim, descending=descending, stable=True)
        cv, ci = torch.sort(x, dim=dim, descending=descending, stable=True)
        same(v, cv, atol=0, rtol=0)
        same(i, ci, atol=0, rtol=0)
    same(to_n(x).argsort(dim=0, descending=descending), x.argsort(dim=0, descending=descending, stable=True))
    same(to_n(x).msort(), x.msort())


def test_topk_kthvalue(strict):
    x = torch.randn(4, 10)
    for k, largest in ((3, True), (1, False), (10, True)):
        v, i = torch.topk(to_n(x), k, largest=largest)
        cv, ci = torch.topk(x, k, largest=largest)
        same(v, cv, atol=0, rtol=0)
        same(to_n(x).gather(1, i).cpu(), cv, atol=0, rtol=0)    # the indices point at those values
    v, i = torch.topk(to_n(x), 2, dim=0)
    same(v, torch.topk(x, 2, dim=0).values, atol=0, rtol=0)
    for k, dim, keepdim in ((3, 1, False), (1, 0, True)):
        v, i = torch.kthvalue(to_n(x), k, dim, keepdim)
        cv, ci = torch.kthvalue(x, k, dim, keepdim)
        same(v, cv, atol=0, rtol=0)
        same(i, ci)


def test_errors_match_cpu():
    x = torch.randn(3, 4)
    for cpu, dev in ((lambda: torch.topk(x, 5), lambda: torch.topk(to_n(x), 5)),
                     (lambda: torch.kthvalue(x, 5), lambda: torch.kthvalue(to_n(x), 5)),
                     (lambda: torch.sort(x, dim=2), lambda: torch.sort(to_n(x), dim=2)),
                     (lambda: x.cumsum(3), lambda: to_n(x).cumsum(3))):
        with pytest.raises(Exception) as c:
            cpu()
        with pytest.raises(c.type) as d:
            dev()
        assert str(d.value) == str(c.value)
