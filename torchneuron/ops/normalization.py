"""Batch norm and group norm (and ``var_mean``) on the device: reductions and element-wise launches
following the CPU kernels' formulas (batch norm's output as ``x * alpha + beta``, as the CPU kernel computes
it); statistics in fp32.

``native_batch_norm`` updates running statistics that its schema does not mark as written, so the generic
CPU fallback cannot serve it: inputs these kernels do not run go to the C++ glue's dedicated CPU route
(``torchneuron._C._fallback_native_batch_norm``), which counts as a fallback like any other.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from torchneuron import _C
from torchneuron.kernels.batch_norm import batch_norm_fits, batch_norm_train_backward_kernel, batch_norm_train_kernel
from torchneuron.ops.base import aten, floats_on_one_device, meta_run, Unsupported
from torchneuron.ops.elementwise import dense
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering
from torchneuron.ops.windows import as_float32


# ---- batch norm, group norm, var_mean -------------------------------------------------------------------

def _stat_dtype(input: torch.Tensor, *params: torch.Tensor | None) -> torch.dtype:
    """The dtype of the saved statistics: fp32 when a reduced-precision input meets fp32 parameters (the CPU
    kernel's mixed mode), else the input's."""
    if input.dtype != torch.float32 and any(t is not None and t.dtype == torch.float32 for t in params):
        return torch.float32
    return input.dtype


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` and back to fp32: one bf16/fp16 operation of the CPU's scalar code."""
    return t.to(dtype).to(torch.float32)


def _saved_statistics(mean: torch.Tensor, var_sum: torch.Tensor, n: int, eps: float,
                      sdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(save_mean, save_invstd) in ``sdt`` from the fp32 per-channel mean and sum of squared deviations.

    The CPU's bf16 kernel keeps its statistics in bf16 scalars: the sum of squares is rounded, divided by
    ``n`` (itself rounded to bf16) in bf16, and 1/sqrt(var + eps) taken in fp32 from that. Its fp16 kernel,
    like fp32 and the mixed kernels, takes 1/sqrt(var_sum / n + eps) in fp32 and rounds once."""
    if sdt == torch.bfloat16:
        n_r = float(torch.tensor(float(n)).to(sdt))
        var = _rounded(_rounded(var_sum, sdt) / n_r, sdt)
        return mean.to(sdt), (var + eps).sqrt().reciprocal().to(sdt)
    return mean.to(sdt), (var_sum / n + eps).rsqrt().to(sdt)


def _update_running(running_mean: torch.Tensor | None, running_var: torch.Tensor | None, mean: torch.Tensor,
                    save_mean: torch.Tensor, var_sum: torch.Tensor, n: int, momentum: float,
                    sdt: torch.dtype) -> None:
    """running = momentum * batch + (1 - momentum) * running, the variance unbiased, in place, rounded as the
    CPU's kernel rounds: per bf16 operation for bf16 statistics (from the saved bf16 mean and the bf16 sum of
    squares; only ``momentum * unbiased_var`` stays fp32 there), once from fp32 otherwise."""
    unbiased = var_sum / max(n - 1, 1)
    if sdt == torch.bfloat16:
        m = _rounded(torch.tensor(momentum), sdt).item()
        keep = _rounded(torch.tensor(1.0 - m), sdt).item()
        if running_mean is not None:
            running_mean.copy_(_rounded(_rounded(save_mean.float() * m, sdt)
                                        + _rounded(running_mean.float() * keep, sdt), sdt))
        if running_var is not None:
            n1 = float(torch.tensor(float(max(n - 1, 1))).to(sdt))
            unbiased = _rounded(_rounded(var_sum, sdt) / n1, sdt)
            running_var.copy_(unbiased * m + _rounded(running_var.float() * keep, sdt))
        return
    if running_mean is not None:
        running_mean.copy_(as_float32(running_mean) * (1 - momentum) + mean * momentum)
    if running_var is not None:
        running_var.copy_(as_float32(running_var) * (1 - momentum) + unbiased * momentum)


def _fused(input: torch.Tensor, *vectors: torch.Tensor | None, grad: torch.Tensor | None = None) -> bool:
    """Whether the one-launch training kernels take a batch norm of ``input`` (and its gradient ``grad``) with these
    per-channel vectors: fp32 throughout, contiguous [C] vectors, each channel's values within one tile."""
    C = input.shape[1]
    return (input.dtype == torch.float32 and (grad is None or grad.dtype == torch.float32)
            and all(t is None or (t.dtype == torch.float32 and tuple(t.shape) == (C,) and t.is_contiguous())
                    for t in vectors)
            and batch_norm_fits(input.shape[0], input.numel() // (input.shape[0] * C)))


def _channels_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, C, *S] as a dense [N, C, prod(S)]."""
    return dense(t).view(t.shape[0], t.shape[1], -1)


def _present(**tensors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The kernel inputs that are given."""
    return {k: v for k, v in tensors.items() if v is not None}


def _batch_norm_fused(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
                      eps: float):
    """Training batch norm of fp32 tensors in one launch; the running statistics written in place."""
    running = running_mean is not None and running_var is not None
    inputs = _present(x=_channels_rows(input), weight=weight, bias=bias,
                      running_mean=running_mean if running else None, running_var=running_var if running else None)
    res = call_kernel(batch_norm_train_kernel, inputs, {"momentum": float(momentum), "eps": float(eps)},
                      outputs=[None, None, None, running_mean, running_var] if running else (),
                      op="aten::native_batch_norm")
    return res[0].view(input.shape), res[1], res[2]


@lowering("native_batch_norm")
def native_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                      momentum: float, eps: float):
    """(out, save_mean, save_invstd); in training, updates the running statistics in place."""
    ok = (floats_on_one_device(input, weight, bias, running_mean, running_var) and input.dim() >= 2
          and input.numel() > 0 and (training or (running_mean is not None and running_var is not None)))
    if not ok:
        return _C._fallback_native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    C = input.shape[1]
    if any(t is not None and tuple(t.shape) != (C,) for t in (weight, bias, running_mean, running_var)):
        # the meta kernel's errors for parameters of another size (it costs ~2 ms of host time: only here)
        meta_run(aten.native_batch_norm.default, input, weight, bias, running_mean, running_var, training, momentum,
                 eps)
    dims = [0, *range(2, input.dim())]
    shape = [1, C] + [1] * (input.dim() - 2)
    sdt = _stat_dtype(input, weight, bias, running_mean, running_var)
    if training and _fused(input, weight, bias, running_mean, running_var):
        return _batch_norm_fused(input, weight, bias, running_mean, running_var, momentum, eps)
    if training:
        x = as_float32(input)
        n = input.numel() // C
        mean = x.mean(dims)
        dev = x - mean.view(shape)
        var_sum = (dev * dev).sum(dims)
        save_mean, save_invstd = _saved_statistics(mean, var_sum, n, eps, sdt)
        with torch.no_grad():
            _update_running(running_mean, running_var, mean, save_mean, var_sum, n, momentum, sdt)
        # the CPU transforms the input with the statistics as saved (rounded to bf16/fp16 when those are the
        # parameters' dtype), not with their fp32 values
        mean, invstd = as_float32(save_mean), as_float32(save_invstd)
    else:
        mean, invstd = as_float32(running_mean), (as_float32(running_var) + eps).rsqrt()
        save_mean = torch.empty((0,), dtype=sdt, device=input.device)
        save_invstd = torch.empty((0,), dtype=sdt, device=input.device)
    # out = x * alpha + beta with alpha = invstd * w, beta = b - mean * alpha (the CPU kernel's form)
    alpha = invstd * as_float32(weight) if weight is not None else invstd
    beta = -mean * alpha if bias is None else as_float32(bias) - mean * alpha
    out = torch.addcmul(beta.view(shape), input, alpha.view(shape))
    return out.to(input.dtype), save_mean, save_invstd


@lowering("native_batch_norm_backward")
def native_batch_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None,
                               running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                               save_mean: torch.Tensor | None, save_invstd: torch.Tensor | None, train: bool,
                               eps: float, output_mask: Sequence[bool]):
    """(grad_input, grad_weight, grad_bias) of batch norm, from the saved (train) or running (eval) statistics."""
    stats = (save_mean, save_invstd) if train else (running_mean, running_var)
    ok = (floats_on_one_device(grad_out, input, weight, *stats) and input.dim() >= 2 and input.numel() > 0
          and all(t is not None and t.numel() == input.shape[1] for t in stats))
    if not ok:
        raise Unsupported
    if train and _fused(input, weight, *stats, grad=grad_out):
        gi, gw, gb = call_kernel(batch_norm_train_backward_kernel,
                                 _present(g=_channels_rows(grad_out), x=_channels_rows(input), mean=save_mean,
                                          invstd=save_invstd, weight=weight), op="aten::native_batch_norm_backward")
        return (gi.view(input.shape) if output_mask[0] else None, gw if output_mask[1] else None,
                gb if output_mask[2] else None)
    C = input.shape[1]
    dims = [0, *range(2, input.dim())]
    shape = [1, C] + [1] * (input.dim() - 2)
    n = input.numel() // C
    if train:
        mean, invstd = as_float32(save_mean), as_float32(save_invstd)
    else:
        mean, invstd = as_float32(running_mean), (as_float32(running_var) + eps).rsqrt()
    x, g = as_float32(input), as_float32(grad_out)
    dev = x - mean.view(shape)
    sum_g = g.sum(dims)
    dot = (g * dev).sum(dims)
    w = as_float32(weight) if weight is not None else None
    scale = invstd * w if w is not None else invstd
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if train:   # (g - mean(g) - dev * dot * invstd^2 / n) * invstd * w
            k = dot * invstd * invstd / n
            gi = (g - (sum_g / n).view(shape) - dev * k.view(shape)) * scale.view(shape)
        else:
            gi = g * scale.view(shape)
        grad_input = gi.to(input.dtype)
    pdt = weight.dtype if weight is not None else _stat_dtype(input, *stats)
    if output_mask[1]:
        grad_weight = (dot * invstd).to(pdt)
    if output_mask[2]:
        grad_bias = sum_g.to(pdt)
    return grad_input, grad_weight, grad_bias


@lowering("native_group_norm")
def native_group_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, N: int, C: int,
                      HxW: int, group: int, eps: float):
    """(out, mean, rstd) of group norm, the statistics in fp32 as on the CPU (an fp16 variance past 65504
    overflowed to inf and gave zeros); mean and rstd per (n, group)."""
    ok = (floats_on_one_device(input, weight, bias) and input.numel() > 0 and group > 0 and C % group == 0
          and input.numel() == N * C * HxW)
    if not ok:
        raise Unsupported
    meta_run(aten.native_group_norm.default, input, weight, bias, N, C, HxW, group, eps)
    x = as_float32(input).reshape(N, group, -1)
    mean = x.mean(-1)
    dev = x - mean.unsqueeze(-1)
    rstd = ((dev * dev).mean(-1) + eps).rsqrt()
    y = (dev * rstd.unsqueeze(-1)).reshape(N, C, HxW)
    if weight is not None:
        y = y * as_float32(weight).view(1, C, 1)
    if bias is not None:
        y = y + as_float32(bias).view(1, C, 1)
    sdt = _stat_dtype(input, weight, bias)
    return y.to(input.dtype).view(input.shape), mean.to(sdt), rstd.to(sdt)


@lowering("native_group_norm_backward")
def native_group_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                               weight: torch.Tensor | None, N: int, C: int, HxW: int, group: int,
                               output_mask: Sequence[bool]):
    """(grad_input, grad_weight, grad_bias) of group norm, from the forward's mean and 1/std per (n, group)."""
    ok = (floats_on_one_device(grad_out, input, mean, rstd, weight) and input.numel() > 0 and group > 0
          and C % group == 0 and input.numel() == N * C * HxW)
    if not ok:
        raise Unsupported
    G = group
    x = as_float32(input).reshape(N, G, C // G, HxW)
    g = as_float32(grad_out).reshape(N, G, C // G, HxW)
    xhat = (x - as_float32(mean).view(N, G, 1, 1)) * as_float32(rstd).view(N, G, 1, 1)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:   # rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) over each group, gw = g * weight
        gw = g * as_float32(weight).view(1, G, C // G, 1) if weight is not None else g
        m1 = gw.mean((2, 3), keepdim=True)
        m2 = (gw * xhat).mean((2, 3), keepdim=True)
        gi = (gw - m1 - xhat * m2) * as_float32(rstd).view(N, G, 1, 1)
        grad_input = gi.to(input.dtype).view(input.shape)
    pdt = weight.dtype if weight is not None else input.dtype
    if output_mask[1]:
        grad_weight = (g * xhat).reshape(N, C, HxW).sum((0, 2)).to(pdt)
    if output_mask[2]:
        grad_bias = g.reshape(N, C, HxW).sum((0, 2)).to(pdt)
    return grad_input, grad_weight, grad_bias


def _var_mean(self: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False):
    """(var, mean) over ``dim``: the device's var and mean reductions."""
    if not floats_on_one_device(self):
        raise Unsupported("not a float tensor on a neuron device")
    var = torch.var(self, dim, correction=correction, keepdim=keepdim)
    dims = [] if dim is None else dim
    mean = self.mean(dims, keepdim=keepdim) if dims else self.mean().reshape([1] * self.dim() if keepdim else [])
    return var, mean


lowering("var_mean.correction")(_var_mean)


# The functional batch-norm variants export / torch.compile paths and some modules call: the same kernel.
@lowering("_native_batch_norm_legit")
def native_batch_norm_legit(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                            running_mean: torch.Tensor, running_var: torch.Tensor, training: bool, momentum: float,
                            eps: float):
    """``native_batch_norm`` with running statistics."""
    return native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@lowering("_native_batch_norm_legit.no_stats")
def native_batch_norm_legit_no_stats(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                                     training: bool, momentum: float, eps: float):
    """``native_batch_norm`` without running statistics."""
    return native_batch_norm(input, weight, bias, None, None, training, momentum, eps)


@lowering("_batch_norm_with_update")
def batch_norm_with_update(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                           running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float, eps: float):
    """Training batch norm that updates the running statistics; the reserve tensor is empty, as on CPU."""
    out, mean, invstd = native_batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, invstd, torch.empty(0, dtype=torch.uint8, device=input.device)
