"""Fused optimizer steps on the device: ``_fused_adamw_`` and ``_fused_adam_`` (``torch.optim.AdamW(...,
fused=True)`` / ``Adam(..., fused=True)``), one ``kernels.optim.adam_step`` launch per parameter;
``_fused_sgd_`` and ``_fused_adagrad_`` (``SGD``/``Adagrad(..., fused=True)``) as the CPU kernels' formulas
in a few multi-tensor ``_foreach_*`` launches.

The step count lives in a device tensor (``state_steps``, incremented by the optimizer before the
call); it is read on the host to form the bias corrections, which reach the kernel with the other
per-step scalars as a small device vector, so the Program does not change from step to step.
``amsgrad``, ``maximize``, gradient scaling and non-contiguous or non-fp32/bf16 tensors take the
CPU fallback. The default (``foreach``) optimizers run their ``_foreach_*`` ops as multi-tensor
launches (``ops/foreach.py``).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from torchneuron.kernels.optim import SCALARS, adam_step
from torchneuron.ops.base import aten, Unsupported
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering



def _runs_on_device(tensors: Sequence[Sequence[torch.Tensor]]) -> bool:
    first = tensors[0][0] if tensors[0] else None
    return first is not None and all(
        t.device == first.device and t.is_contiguous() and t.dtype in (torch.float32, torch.bfloat16)
        and t.dtype == group[i].dtype for group in tensors for i, t in enumerate(group))


def _step(decoupled: bool, op: torch._ops.OpOverload):
    def kernel(self: list, grads: list, exp_avgs: list, exp_avg_sqs: list, max_exp_avg_sqs: list,
               state_steps: list, *, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float,
               amsgrad: bool, maximize: bool, grad_scale: torch.Tensor | None = None,
               found_inf: torch.Tensor | None = None) -> None:
        if amsgrad or maximize or grad_scale is not None or found_inf is not None or \
                not _runs_on_device([self, grads, exp_avgs, exp_avg_sqs]):
            raise Unsupported("amsgrad, maximize, gradient scaling or operands the device step does not take")
        for p, g, m, v, s in zip(self, grads, exp_avgs, exp_avg_sqs, state_steps):
            if p.numel() == 0:
                continue
            step = float(s.item())
            bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
            values = {"decay": 1 - lr * weight_decay, "one_minus_beta1": 1 - beta1, "beta2": beta2,
                      "one_minus_beta2": 1 - beta2, "neg_step_size": -lr / bc1, "inv_bc2": 1 / math.sqrt(bc2),
                      "eps": eps, "wd": weight_decay}
            scalars = torch.tensor([values[k] for k in SCALARS], dtype=torch.float32).to(p.device)
            call_kernel(adam_step, {"param": p.view(-1), "grad": g.view(-1), "exp_avg": m.view(-1),
                                    "exp_avg_sq": v.view(-1), "scalars": scalars}, {"decoupled": decoupled},
                        op=str(op))
    return kernel


lowering("_fused_adamw_")(_step(True, aten._fused_adamw_.default))
lowering("_fused_adam_")(_step(False, aten._fused_adam_.default))


def _plain(grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None, tensors) -> bool:
    """No gradient scaling and every tensor on one device, contiguous, fp32/bf16: the device path."""
    return grad_scale is None and found_inf is None and _runs_on_device(tensors)


def _grads(grads: list, params: list, maximize: bool, weight_decay: float) -> list:
    """The CPU kernels' effective gradient: negated for maximize, plus weight_decay * param."""
    g = torch._foreach_neg(grads) if maximize else list(grads)
    return torch._foreach_add(g, params, alpha=weight_decay) if weight_decay != 0 else g


def _sgd(op: torch._ops.OpOverload):
    def kernel(self: list, grads: list, momentum_buffer_list: list, *, weight_decay: float, momentum: float, lr,
               dampening: float, nesterov: bool, maximize: bool, is_first_step: bool,
               grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        if not self:
            return
        if not _plain(grad_scale, found_inf, [self, grads, *([momentum_buffer_list] if momentum else [])]):
            raise Unsupported("gradient scaling or operands the device step does not take")
        lr = float(lr.item()) if isinstance(lr, torch.Tensor) else lr
        g = _grads(grads, self, maximize, weight_decay)
        if momentum != 0:
            if is_first_step:                    # the buffer starts as the gradient
                for buf, x in zip(momentum_buffer_list, g):
                    buf.copy_(x)
            else:                                # buf = momentum * buf + (1 - dampening) * g
                torch._foreach_mul_(momentum_buffer_list, momentum)
                torch._foreach_add_(momentum_buffer_list, g, alpha=1 - dampening)
            g = torch._foreach_add(g, momentum_buffer_list, alpha=momentum) if nesterov else momentum_buffer_list
        torch._foreach_add_(self, g, alpha=-lr)
    return kernel


def _adagrad(op: torch._ops.OpOverload):
    def kernel(self: list, grads: list, state_sums: list, state_steps: list, *, lr, lr_decay: float,
               weight_decay: float, eps: float, maximize: bool, grad_scale: torch.Tensor | None = None,
               found_inf: torch.Tensor | None = None) -> None:
        if not self:
            return
        if not _plain(grad_scale, found_inf, [self, grads, state_sums]):
            raise Unsupported("gradient scaling or operands the device step does not take")
        lr = float(lr.item()) if isinstance(lr, torch.Tensor) else lr
        g = _grads(grads, self, maximize, weight_decay)
        # clr = lr / (1 + (step - 1) * lr_decay) per parameter (its step count is read on the host)
        clrs = [lr / (1 + (float(s.item()) - 1) * lr_decay) for s in state_steps]
        torch._foreach_addcmul_(state_sums, g, g)
        std = torch._foreach_sqrt(state_sums)
        torch._foreach_add_(std, eps)
        torch._foreach_addcdiv_(self, g, std, [-c for c in clrs])
    return kernel


for _name, _make in (("_fused_sgd_", _sgd), ("_fused_adagrad_", _adagrad)):
    for _overload in ("default", "tensor_lr"):
        lowering(_name if _overload == "default" else f"{_name}.{_overload}")(
            _make(getattr(getattr(aten, _name), _overload)))


# ---- gradient scaling (torch.amp.GradScaler) -----------------------------------------------------------

@lowering("_amp_foreach_non_finite_check_and_unscale_")
def amp_non_finite_check_and_unscale_(self: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``grads *= inv_scale``; ``found_inf = 1`` if any gradient held an inf or NaN (found before the scaling,
    as the CPU kernel checks): ``0 * g`` is 0 for finite values and NaN otherwise, so one multi-tensor
    2-norm of ``0 * g`` per list flags them without overflowing on large finite gradients."""
    if not self:
        return
    if not _runs_on_device([self]) or found_inf.device != self[0].device or inv_scale.device != self[0].device \
            or found_inf.dtype != torch.float32 or inv_scale.dtype != torch.float32 or found_inf.numel() != 1 \
            or inv_scale.numel() != 1:
        raise Unsupported("operands not float32 one-element tensors on the gradients' device")
    flags = torch._foreach_norm(torch._foreach_mul(self, 0.0))
    bad = torch.stack(flags).sum().isnan().to(torch.float32)
    found_inf.copy_(torch.maximum(found_inf, bad.reshape(found_inf.shape)))
    torch._foreach_mul_(self, inv_scale)


@lowering("_amp_update_scale_")
def amp_update_scale_(self: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
                      scale_growth_factor: float, scale_backoff_factor: float, growth_interval: int) -> torch.Tensor:
    """The CPU kernel's rule on the host-read flags: back off and reset the tracker after an inf, else count
    the step and grow the scale (when the grown scale is finite) every ``growth_interval`` clean steps."""
    if self.dtype != torch.float32 or growth_tracker.dtype != torch.int32 or found_inf.dtype != torch.float32 \
            or self.numel() != 1 or growth_tracker.numel() != 1 or found_inf.numel() != 1:
        raise Unsupported("operands not the float32/int32 one-element tensors the device rule takes")
    scale = torch.tensor(float(self.item()), dtype=torch.float32)       # fp32 products, as on the CPU
    if float(found_inf.item()):
        scale, tracker = scale * scale_backoff_factor, 0
    else:
        tracker = int(growth_tracker.item()) + 1
        if tracker == growth_interval:
            grown = scale * scale_growth_factor
            scale, tracker = (grown if bool(torch.isfinite(grown)) else scale), 0
    self.fill_(float(scale))
    growth_tracker.fill_(tracker)
    return self
