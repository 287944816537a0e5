"""CTC loss (``_ctc_loss`` and its backward) on the device (strict mode) against the CPU: padded and
concatenated targets, repeated labels, impossible targets, empty inputs, the reductions and
``zero_infinity``, and the CPU's errors for invalid lengths."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import to_n

torch.manual_seed(0)
T, N, C, S = 12, 5, 6, 5
LOG_PROBS = torch.randn(T, N, C).log_softmax(2)
TARGETS = torch.randint(1, C, (N, S))
TARGETS[3, 1] = TARGETS[3, 0]                      # a repeat: needs a blank between, no skip
INPUT_LENGTHS = [12, 0, 2, 12, 9]                  # 0: empty input; 2 < 4 labels: impossible
TARGET_LENGTHS = [0, 2, 4, 5, 3]
CONCAT = torch.cat([TARGETS[b, :n] for b, n in enumerate(TARGET_LENGTHS)])


def _loss_and_grad(log_probs, targets, reduction, zero_infinity):
    x = log_probs.detach().requires_grad_()
    loss = F.ctc_loss(x, targets, INPUT_LENGTHS, TARGET_LENGTHS, reduction=reduction, zero_infinity=zero_infinity)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return loss, grad


@pytest.mark.parametrize("concat", [False, True])
@pytest.mark.parametrize("reduction, zero_infinity", [("none", False), ("mean", True), ("sum", False)])
def test_ctc_loss(concat, reduction, zero_infinity, strict):
    targets = CONCAT if concat else TARGETS
    got = _loss_and_grad(to_n(LOG_PROBS), to_n(targets), reduction, zero_infinity)
    want = _loss_and_grad(LOG_PROBS, targets, reduction, zero_infinity)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, equal_nan=True)


def test_ctc_loss_tensor_lengths_and_alphas(strict):
    args = (torch.tensor(INPUT_LENGTHS), torch.tensor(TARGET_LENGTHS), 0, False)
    nll, alpha = torch.ops.aten._ctc_loss.Tensor(to_n(LOG_PROBS), to_n(TARGETS), *args)
    cnll, calpha = torch.ops.aten._ctc_loss.Tensor(LOG_PROBS, TARGETS, *args)
    torch.testing.assert_close(nll.cpu(), cnll)
    assert alpha.shape == calpha.shape
    for b, (il, tl) in enumerate(zip(INPUT_LENGTHS, TARGET_LENGTHS)):   # the part the CPU writes
        torch.testing.assert_close(alpha[b, :il, :2 * tl + 1].cpu(), calpha[b, :il, :2 * tl + 1])


@pytest.mark.parametrize("input_lengths, target_lengths", [
    ([12, 0, 2, 13, 9], TARGET_LENGTHS), (INPUT_LENGTHS, [0, 2, 4, 6, 3]), (INPUT_LENGTHS[:4], TARGET_LENGTHS),
])
def test_ctc_loss_errors_match_cpu(input_lengths, target_lengths, strict):
    with pytest.raises(Exception) as cpu:
        torch.ops.aten._ctc_loss(LOG_PROBS, TARGETS, input_lengths, target_lengths)
    with pytest.raises(type(cpu.value)) as dev:
        torch.ops.aten._ctc_loss(to_n(LOG_PROBS), to_n(TARGETS), input_lengths, target_lengths)
    assert str(dev.value) == str(cpu.value)


def test_ctc_loss_gradient_as_exact_as_the_cpus(strict):
    """The input gradient against float64 on the same inputs, element by element, as the conformance harness
    compares it: the device's error within the CPU's plus fp32's default tolerances. Both run the recursion
    in log space; the CPU (and the device's first version) rounds each step at the magnitude of log alpha,
    which grows to the whole sequence's |log likelihood| (~300 here), so after T = 100 steps the
    probabilities carry relative errors of ~1e-4, in directions that differ between the two. The device's
    backward runs the recursions scaled (each row less the previous row's maximum) and normalizes the
    posterior at each time step, so its steps round at the magnitude of the scaled values, a few units."""
    torch.manual_seed(3)
    t_max, n, c, s = 100, 8, 20, 40
    log_probs = (torch.randn(t_max, n, c) * 2).log_softmax(2)
    targets = torch.randint(1, c, (n, s))
    input_lengths, target_lengths = [t_max] * n, torch.randint(20, s + 1, (n,)).tolist()
    cot = torch.randn(n)
    grads = []
    for x in (to_n(log_probs), log_probs, log_probs.double()):
        x = x.detach().requires_grad_()
        loss = F.ctc_loss(x, targets.to(x.device), input_lengths, target_lengths, reduction="none")
        (g,) = torch.autograd.grad(loss, x, cot.to(x.device, x.dtype))
        grads.append(g.cpu().double())
    dev, cpu, exact = grads
    rtol, atol = 1.3e-6, 1e-5                         # torch.testing's fp32 defaults, as the harness uses
    assert ((dev - exact).abs() <= (cpu - exact).abs() + atol + rtol * exact.abs()).all()


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss_with_impossible_emissions(zero_infinity, strict):
    """log_probs of -inf (a blank never emitted; one class only at a time step): the losses stay finite and
    the gradient is the CPU's, nan where log_probs is -inf (its exp(lp) - exp(log occupancy + nll - lp))
    and the posterior of the other classes unchanged."""
    torch.manual_seed(0)
    log_probs = torch.randn(12, 3, 6).log_softmax(2)
    log_probs[:, 0, 0] = float("-inf")
    log_probs[5, 1, :] = float("-inf")
    log_probs[5, 1, 2] = 0.0
    targets = torch.tensor([[1, 2, 3], [2, 2, 4], [5, 1, 1]])
    got, want = [], []
    for x, out in ((to_n(log_probs), got), (log_probs, want)):
        x = x.detach().requires_grad_()
        loss = F.ctc_loss(x, targets.to(x.device), [12, 12, 7], [3, 3, 2], reduction="none",
                          zero_infinity=zero_infinity)
        out += [loss.detach().cpu(), torch.autograd.grad(loss.sum(), x)[0].cpu()]
    assert want[0].isfinite().all()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True)
