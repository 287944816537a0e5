"""kernels/losses.py against torch.nn.functional.nll_loss and its gradient."""
import pytest
import torch

from torchneuron.kernels.losses import nll_bwd_kernel, nll_fwd_kernel


def _targets(N: int, C: int) -> torch.Tensor:
    t = torch.randint(0, C, (N,))
    t[::7] = -100                                          # ignore_index
    return t


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_forward_matches_pytorch(reduction):
    N, C = 300, 65
    x, target, weight = torch.randn(N, C).log_softmax(1), _targets(N, C), torch.rand(C)
    losses, total, bad = nll_fwd_kernel(x, target.view(torch.int32).view(N, 2), weight, -100, reduction)
    name = ["none", "mean", "sum"][reduction]
    expected = torch.nn.functional.nll_loss(x, target, weight, reduction=name)
    torch.testing.assert_close(losses.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
    kept = target != -100
    torch.testing.assert_close(total.reshape(()), weight[target[kept]].sum(), rtol=1e-5, atol=1e-5)
    assert bad.item() == 0


def test_nll_forward_counts_targets_out_of_range():
    x, target = torch.randn(4, 3), torch.tensor([0, 3, -1, 2])
    _, _, bad = nll_fwd_kernel(x, target.view(torch.int32).view(4, 2))
    assert bad.item() == 2


def test_nll_backward_matches_autograd():
    N, C = 200, 33
    x, target, weight = torch.randn(N, C).log_softmax(1), _targets(N, C), torch.rand(C)
    words = target.view(torch.int32).view(N, 2)
    _, total, _ = nll_fwd_kernel(x, words, weight, -100, 1)
    grad, bad = nll_bwd_kernel(torch.ones(1, 1), words, total, weight, C, -100, 1)
    xr = x.clone().requires_grad_()
    torch.nn.functional.nll_loss(xr, target, weight).backward()
    torch.testing.assert_close(grad, xr.grad, rtol=1e-5, atol=1e-7)
    assert bad.item() == 0


@pytest.mark.parametrize("weighted", [False, True])
def test_wide_rows_take_column_blocks(weighted):
    # a vocabulary whose rows do not fit SBUF (5000 classes on trn2): column blocks of WC, forward and backward
    from torchneuron.kernels.losses import WC, wide
    N, C = 130, 5000
    assert wide(N, C) and C > 2 * WC
    x, target = torch.randn(N, C).log_softmax(1), _targets(N, C)
    target[5], target[6] = WC, C - 1                         # targets on a column-block edge and the last class
    weight = torch.rand(C) if weighted else None
    words = target.view(torch.int32).view(N, 2)
    for reduction, name in enumerate(["none", "mean", "sum"]):
        losses, total, bad = nll_fwd_kernel(x, words, weight, -100, reduction)
        expected = torch.nn.functional.nll_loss(x, target, weight, reduction=name)
        torch.testing.assert_close(losses.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
        assert bad.item() == 0
    _, total, _ = nll_fwd_kernel(x, words, weight, -100, 1)
    grad, bad = nll_bwd_kernel(torch.ones(1, 1), words, total, weight, C, -100, 1)
    xr = x.clone().requires_grad_()
    torch.nn.functional.nll_loss(xr, target, weight).backward()
    torch.testing.assert_close(grad, xr.grad, rtol=1e-5, atol=1e-7)
    bad_target = target.clone()
    bad_target[3] = C                                        # out of range: counted, not read
    _, _, bad = nll_fwd_kernel(x, bad_target.view(torch.int32).view(N, 2), weight, -100, 2)
    assert bad.item() == 1


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("N", [1024, 300])
def test_nll_backward_carried_through_log_softmax_backward_is_the_two_kernels(N, reduction):
    # the loss gradient carried on through the log-softmax backward on chip equals the two kernels one after the
    # other (dx stored, then read back), bit for bit: ignored rows, class weights, a partial last block
    from torchneuron.kernels.losses import fuses_log_softmax_bwd
    from torchneuron.kernels.softmax import softmax_bwd_kernel
    C = 65
    assert fuses_log_softmax_bwd(N, C, torch.float32, torch.float32)
    y, target, weight = torch.randn(N, C).log_softmax(1), _targets(N, C), torch.rand(C)
    y[1, 2], y[2, 0] = float("-inf"), float("nan")
    words = target.view(torch.int32).view(N, 2)
    _, total, _ = nll_fwd_kernel(y, words, weight, -100, reduction)
    g = torch.rand(N, 1) if reduction == 0 else torch.full((1, 1), 0.7)
    dx, _ = nll_bwd_kernel(g, words, total, weight, C, -100, reduction)
    want = softmax_bwd_kernel(dx, y, log=True)
    got, bad = nll_bwd_kernel(g, words, total, weight, C, -100, reduction, log_softmax=y)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert bad.item() == 0


def test_nll_backward_through_log_softmax_only_fp32_rows_in_sbuf():
    from torchneuron.kernels.losses import fuses_log_softmax_bwd
    assert not fuses_log_softmax_bwd(1024, 65, torch.bfloat16, torch.bfloat16)
    assert not fuses_log_softmax_bwd(130, 5000, torch.float32, torch.float32)   # wide rows: column blocks


def _loss_bound(terms: torch.Tensor, n: int) -> float:
    """|fp32 sum of n rounded products - exact sum| <= (n + 1) u sum|terms| (u = 2**-24: one rounding per product,
    at most n - 1 additions, each off by u times a partial sum)."""
    return (n + 1) * 2.0 ** -24 * terms.abs().sum().item()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", [1, 2])
@pytest.mark.parametrize("N", [1024, 256])
def test_log_softmax_nll_forward_is_the_log_softmax_kernel_and_the_loss_within_its_sum_order(N, reduction, weighted):
    # y bit for bit the log-softmax kernel's; the loss is the same row losses summed in another order (one row per
    # partition, not grouped): against float64 within the fp32 sum's bound; -inf logits, ignored rows, weights
    from torchneuron.kernels.losses import log_softmax_nll_fwd_kernel
    from torchneuron.kernels.softmax import softmax_kernel
    C = 65
    torch.manual_seed(N + reduction)
    x, target = torch.randn(N, C) * 4, _targets(N, C)
    weight = torch.rand(C) if weighted else None
    x[1, 2], x[3, :] = float("-inf"), 30.0                  # a masked logit; a row of equal large scores
    words = target.view(torch.int32).view(N, 2)
    y, loss, total, bad = log_softmax_nll_fwd_kernel(x, words, weight, -100, reduction)
    torch.testing.assert_close(y, softmax_kernel(x, log=True), rtol=0, atol=0, equal_nan=True)
    kept = target != -100
    w = (weight.double() if weighted else torch.ones(C, dtype=torch.float64))[target.clamp(min=0)] * kept
    terms = -w * y.double().gather(1, target.clamp(min=0)[:, None])[:, 0]
    total64, sum64 = w.sum(), terms.sum()
    if weighted:
        assert abs(total.item() - total64.item()) <= _loss_bound(w, N)
    else:
        assert total.item() == kept.sum().item()               # counts: exact
    if reduction == 2:
        assert abs(loss.item() - sum64.item()) <= _loss_bound(terms, N)
    else:   # the sum and the total each within their bound, then one division and one rounding
        bound = (_loss_bound(terms, N) + abs(sum64.item()) * _loss_bound(w, N) / total64.item()) / total64.item()
        assert abs(loss.item() - (sum64 / total64).item()) <= bound + 2 * 2.0 ** -24 * abs(loss.item())
    assert bad.item() == 0
    bad_target = target.clone()
    bad_target[N - 3] = C                                    # out of range: counted
    _, _, _, bad = log_softmax_nll_fwd_kernel(x, bad_target.view(torch.int32).view(N, 2), weight, -100, reduction)
    assert bad.item() == 1


def test_log_softmax_nll_forward_takes_fp32_blocks_of_128_rows_only():
    from torchneuron.kernels.losses import fuses_log_softmax_fwd
    assert fuses_log_softmax_fwd(1024, 65, torch.float32)
    assert not fuses_log_softmax_fwd(300, 65, torch.float32)     # a partial block: the two kernels
    assert not fuses_log_softmax_fwd(1024, 65, torch.bfloat16)
    assert not fuses_log_softmax_fwd(128, 50257, torch.float32)  # rows the log-softmax does not hold whole
