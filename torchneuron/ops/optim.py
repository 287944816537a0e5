"""Fused optimizer steps on the device: ``_fused_adamw_`` and ``_fused_adam_`` (``torch.optim.AdamW(...,
fused=True)`` / ``Adam(..., fused=True)``), one ``kernels.optim.adam_step`` launch per parameter.

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
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import cpu_fallback, lowering

aten = torch.ops.aten


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
            return cpu_fallback(op, self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
                                maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
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
