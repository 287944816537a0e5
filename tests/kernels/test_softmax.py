import math

import pytest
import torch

from torchneuron.kernels import log_softmax, softmax
from tests.kernels.conftest import DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (300, 513), (2, 3, 300)])
def test_softmax_and_log_softmax(shape, dtype):
    x = (torch.randn(shape) * 4).to(dtype)
    close(softmax(x), torch.softmax(x.float(), -1), dtype)
    close(log_softmax(x), torch.log_softmax(x.float(), -1), dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 10000), (130, 4801)])
def test_long_rows_take_the_online_two_pass_path(shape, dtype):
    # rows longer than SBUF holds: online max/sum over column blocks; a late large value forces rescaling
    x = (torch.randn(shape) * 4).to(dtype)
    x[0, -1] = 60.0
    close(softmax(x), torch.softmax(x.float(), -1), dtype)
    close(log_softmax(x), torch.log_softmax(x.float(), -1), dtype, scale=2.0)


@pytest.mark.parametrize("shape,dim", [((5, 7, 9), 1), ((300, 4), 0), ((3, 4, 5), -3), ((7,), 0), ((), 0)])
def test_any_dim(shape, dim):
    x = torch.randn(shape) * 4
    close(softmax(x, dim), torch.softmax(x, dim), torch.float32)
    close(log_softmax(x, dim), torch.log_softmax(x, dim), torch.float32)


def test_stable_for_large_logits():
    x = torch.tensor([[1000.0, 1001.0, 1002.0], [-1000.0, 0.0, 1000.0]])
    out = softmax(x)
    assert torch.isfinite(out).all()
    close(out, torch.softmax(x, -1), torch.float32)


@pytest.mark.parametrize("D", [10, 6000], ids=["one-pass", "two-pass"])
def test_max_subtracted_before_the_log_sum(D):
    # Rows whose max is 1000: the CPU computes (x - max) - log s, exact to a few roundings of those two
    # terms. Folding max + log s into one value rounds it at ulp(1000) = 6e-5 first, an absolute error
    # in every log-probability (and a relative one in every probability) far above those roundings.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, D, generator=gen) * 3 + 1000.0
    x64 = x.double()
    shifted = x64 - x64.max(-1, keepdim=True).values
    logs = torch.logsumexp(shifted, -1, keepdim=True)
    eps = torch.finfo(torch.float32).eps
    # (x - max) and the subtraction round once each; log s carries the sum's relative error (exp's rounding
    # and D terms summed pairwise: eps * (1 + log2 D)) as an absolute one, plus its own rounding
    lsm_tol = eps * (shifted.abs() + (shifted - logs).abs() + 2 + math.log2(D))
    assert ((log_softmax(x).double() - (shifted - logs)).abs() <= lsm_tol).all()
    # exp() turns its argument's absolute error into a relative one; exp, 1/s and the product round once each
    sm_tol = eps * (shifted.abs() + 5 + math.log2(D))
    ref = torch.exp(shifted - logs)
    assert ((softmax(x).double() - ref).abs() <= sm_tol * ref).all()


def test_without_the_budget_assert_the_simulator_refuses(monkeypatch):
    """Forced onto the single-pass path with its SBUF assert removed, the simulator's allocator names
    the overflow."""
    import importlib
    sm = importlib.import_module("torchneuron.kernels.softmax")
    from torchneuron.nki import SimulatorError
    monkeypatch.setattr(sm, "check_sbuf", lambda need, what: None)
    monkeypatch.setattr(sm, "one_pass", lambda D: True)
    with pytest.raises(SimulatorError, match="sbuf overflow"):
        sm.softmax_kernel(torch.zeros(1, 40 * 1024 + 1))


def _masked_scores(x, scale, L):
    z = x.float() * scale
    if L:
        pos = (torch.arange(x.shape[0]) % L)[:, None]
        z = z.masked_fill(torch.arange(x.shape[1])[None, :] > pos, float("-inf"))
    return z


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,S,L", [(4096, 64, 64), (300, 100, 150), (130, 33, 0), (1000, 64, 128), (4096, 64, 48),
                                   (5, 2500, 5), (1, 1, 1)])
def test_attention_softmax_rows(N, S, L, dtype):
    # grouped rows per partition, the causal mask by query position (shared or per block), the logsumexp
    from torchneuron.kernels.softmax import attention_softmax_kernel
    x = (torch.randn(N, S) * 3).to(dtype)
    probs, lse = attention_softmax_kernel(x, scale=0.25, causal_len=L)
    z = _masked_scores(x, 0.25, L)
    assert probs.dtype == dtype and lse.shape == (N, 1) and lse.dtype == torch.float32
    close(probs, torch.softmax(z, -1), dtype)
    close(lse, torch.logsumexp(z, -1, keepdim=True), torch.float32)
    if L:   # masked probabilities are exactly zero
        assert bool((probs.float()[torch.isinf(z)] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,D", [(4096, 64), (300, 100), (130, 3000), (7, 1), (130, 5000)])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward_rows(N, D, log, dtype):
    from torchneuron.kernels.softmax import softmax_bwd_kernel
    z = torch.randn(N, D) * 2
    y = (torch.log_softmax(z, -1) if log else torch.softmax(z, -1)).to(dtype)
    g = torch.randn(N, D).to(dtype)
    backward = torch._log_softmax_backward_data if log else torch._softmax_backward_data
    want = backward(g.float(), y.float(), -1, torch.float32) * 0.5
    close(softmax_bwd_kernel(g, y, log=log, scale=0.5), want, dtype, scale=2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [3, 100, 1000, 6000])
def test_half_log_softmax_over_the_last_dim_rounds_as_the_cpu(dtype, D):
    """The CPU's last-dim log_softmax of half types keeps the row sum and its log in the input type: x - max -
    round(log(round(sum))). The device rounds them alike, so its results are the CPU's bit for bit (whole rows) or,
    on the two-pass path (D = 6000), within one unit in the last place (a row sum accumulated in another order can
    round to the neighbouring half value); another dim is exact on both."""
    import torchneuron  # noqa: F401  (registers the device)
    x = (torch.randn(300, D) * 3).to(dtype)
    got, want = torch.log_softmax(x.to("neuron"), 1).cpu(), torch.log_softmax(x, 1)
    if D <= 1000:
        assert torch.equal(got, want)
    else:
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=1.0)
        assert ((got.float() - want.float()).abs() <= ulp).all()
    exact = (x.float() - torch.logsumexp(x.float(), 0, keepdim=True)).to(dtype)
    got0 = torch.log_softmax(x.to("neuron"), 0).cpu()
    assert ((got0.float() - exact.float()).abs() <= torch.finfo(dtype).eps * exact.float().abs().clamp(min=1.0)).all()
