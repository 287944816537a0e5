"""kernels/optim.py against torch.optim.AdamW's / Adam's update formula (one step, in place)."""
import torch

from torchneuron.kernels.optim import SCALARS, adam_step


def _step_and_check(n, lr, beta1, beta2, eps, wd, step, decoupled):
    """One kernel step against the float64 update: fp32 arithmetic over a handful of operations, a few ulps."""
    param, grad = torch.randn(n), torch.randn(n)
    exp_avg, exp_avg_sq = torch.randn(n) * 0.1, torch.rand(n) * 0.01
    p, g, m, v = (t.double() for t in (param, grad, exp_avg, exp_avg_sq))
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    values = {"decay": 1 - lr * wd if decoupled else 1.0, "one_minus_beta1": 1 - beta1, "beta2": beta2,
              "one_minus_beta2": 1 - beta2, "neg_step_size": -lr / bc1, "inv_bc2": 1 / bc2 ** 0.5, "eps": eps,
              "wd": wd}
    adam_step(param, grad, exp_avg, exp_avg_sq, torch.tensor([values[k] for k in SCALARS]), decoupled=decoupled)
    if decoupled:       # AdamW
        p = p * (1 - lr * wd)
    else:               # Adam's L2 term
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / bc1 * m / ((v / bc2).sqrt() + eps)
    torch.testing.assert_close(exp_avg.double(), m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg_sq.double(), v, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(param.double(), p, rtol=1e-5, atol=1e-6)


def test_adamw_step_matches_the_formula():
    _step_and_check(5000, 1e-2, 0.9, 0.999, 1e-8, 0.1, 3, decoupled=True)


def test_adam_l2_step_over_several_tiles():
    # more elements than one [128, 2048] tile, plus a remainder row
    _step_and_check(128 * 2048 + 777, 1e-3, 0.8, 0.99, 1e-6, 0.05, 2, decoupled=False)
