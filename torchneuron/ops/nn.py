"""Neural-network ops on the device: softmax / log_softmax and layer norm, forward and backward.

softmax over the last dim is one launch of ``kernels.softmax.softmax_kernel`` on the rows of an
[N, D] view; another dim is moved last (a device copy) and back. Their backward ops follow the
formulas of PyTorch's CPU kernels, ``y * (g - sum(g * y))`` and ``g - exp(y) * sum(g)``: one launch
of ``softmax_bwd_kernel`` over the last dim (rows that fit SBUF), else element-wise and reduction
launches. Layer norm runs ``kernels.norms.layer_norm_kernel`` on the rows (missing weight/bias:
ones/zeros), which also returns the mean and 1/std that ``native_layer_norm`` returns (autograd saves
them); the backward is one ``layer_norm_bwd_kernel`` launch on those saved statistics, as the CPU
kernel uses them. ``F.rms_norm`` reaches ``_fused_rms_norm`` (PyTorch's composite calls it once the backend has a
kernel for it): one launch of the same kernel returning the fp32 1/rms, and one backward launch on it.

``F.cross_entropy`` with class targets of a 1-D/2-D input runs the fused ``kernels.cross_entropy`` kernels (one read
of the logits forward; one read and one write backward) through an autograd kernel of ``cross_entropy_loss``; other
calls take PyTorch's composition of log_softmax and nll_loss. ``nll_loss`` forward and backward are one launch each (``kernels.losses``: the targets become one-hot
rows against an iota, the reduction runs in the kernel). The other losses (``mse_loss``,
``binary_cross_entropy``, ``multi_margin_loss``, ``multilabel_margin_loss``) are composed of element-wise,
comparison and reduction launches; class targets become [N, C] masks against an iota row. Targets and
inputs out of range raise the CPU's errors after one host read of the device's range flags.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch._prims_common import canonicalize_dim
from torch.autograd import forward_ad

from torchneuron.kernels.cross_entropy import cross_entropy_bwd_kernel, cross_entropy_fwd_kernel
from torchneuron.kernels.losses import EXACT, nll_bwd_kernel, nll_fwd_kernel
from torchneuron.kernels.norms import layer_norm_bwd_kernel, layer_norm_kernel
from torchneuron.kernels.softmax import softmax_bwd_kernel, softmax_kernel
from torchneuron.ops.base import aten, checked, FLOATS, on_one_device, resize_out, type_name, Unsupported
from torchneuron.ops.elementwise import dense, device_copy
from torchneuron.ops.indexing import arange_values, index_words
from torchneuron.ops.kernel_call import call_kernel, PlanCache, traced_kernel
from torchneuron.ops.registry import lowering, register_out


def _softmax(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    dim = canonicalize_dim(max(x.dim(), 1), dim)
    if x.dim() == 0:
        x = x.reshape(1)
    last = x.dim() - 1
    moved = x if dim == last else x.movedim(dim, last)
    rows = dense(moved).reshape(-1, moved.shape[-1])
    # the CPU's last-dim log_softmax of half types rounds the row sum and its log to the dtype: so does the kernel
    meta = {"log": log, "half_logsum": log and dim == last}
    (res,) = call_kernel(softmax_kernel, {"x": rows}, meta, op="aten::_log_softmax" if log else "aten::_softmax")
    res = res.reshape(moved.shape)
    # contiguous, as the CPU's (and the meta kernel's, which compiled graphs are traced with) result is
    return res if dim == last else dense(res.movedim(last, dim))


def _softmax_lowering(name: str, log: bool) -> None:
    def kernel(self: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        if self.numel() == 0 and self.dtype in FLOATS and not half_to_float:
            canonicalize_dim(max(self.dim(), 1), dim)   # IndexError for a bad dim, as on CPU
            return torch.empty_like(self)
        if self.dtype not in FLOATS or half_to_float:
            raise Unsupported("a dtype the engines lack, or half_to_float")
        res = _softmax(self, dim, log)
        return res.reshape(()) if self.dim() == 0 else res
    kernel.__name__ = kernel.__qualname__ = name
    lowering(name)(kernel)
    register_out(f"{name}.out", kernel)


_softmax_lowering("_softmax", False)
_softmax_lowering("_log_softmax", True)


def softmax_backward(grad: torch.Tensor, out: torch.Tensor, dim: int, log: bool, scale: float = 1.0) -> torch.Tensor:
    """``scale`` times the input gradient of softmax (``log``: log_softmax) over ``dim``, given its output."""
    dim = canonicalize_dim(max(out.dim(), 1), dim)
    if out.dim() and dim == out.dim() - 1 and out.numel():
        D = out.shape[-1]
        (res,) = call_kernel(softmax_bwd_kernel, {"grad": dense(grad).reshape(-1, D), "y": dense(out).reshape(-1, D)},
                             {"log": log, "scale": float(scale)},
                             op="aten::_log_softmax_backward_data" if log else "aten::_softmax_backward_data")
        return res.reshape(out.shape)
    # in fp32 and rounded once, as the kernel and the CPU do (bf16/fp16 steps rounded each intermediate)
    g, y = grad.float(), out.float()
    if log:
        res = g - y.exp() * g.sum(dim, keepdim=True)
    else:
        res = y * (g - (g * y).sum(dim, keepdim=True))
    return (res if scale == 1.0 else res * scale).to(out.dtype)


def _backward_lowering(name: str, log: bool) -> None:
    def kernel(grad_output: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
        if output.dtype not in FLOATS or input_dtype != output.dtype or grad_output.dtype != output.dtype:
            raise Unsupported("a dtype the engines lack, or mixed dtypes")
        return softmax_backward(grad_output, output, dim, log)
    kernel.__name__ = kernel.__qualname__ = name
    lowering(name)(kernel)
    register_out(f"{name}.out", kernel)


_backward_lowering("_softmax_backward_data", False)
_backward_lowering("_log_softmax_backward_data", True)


# ---- layer norm -----------------------------------------------------------------------------------

def _norm_shape(x: torch.Tensor, normalized_shape: Sequence[int]) -> tuple[int, int]:
    """(rows, row length) of a layer norm over the trailing ``normalized_shape``, with PyTorch's error."""
    k = len(normalized_shape)
    if k == 0 or x.dim() < k or tuple(x.shape[x.dim() - k:]) != tuple(normalized_shape):
        raise RuntimeError(f"Given normalized_shape={list(normalized_shape)}, expected input with shape "
                           f"[*, {', '.join(str(s) for s in normalized_shape)}], but got input of size"
                           f"{list(x.shape)}")
    D = 1
    for s in normalized_shape:
        D *= s
    return x.numel() // D if D else 0, D


def _param(t: torch.Tensor | None, D: int, value: float, like: torch.Tensor) -> torch.Tensor:
    """A norm's weight or bias as the kernels read it: contiguous [D], or ``value`` everywhere when it is None."""
    if t is None:
        return torch.full((D,), value, dtype=like.dtype, device=like.device)
    t = dense(t)
    return t if t.shape == (D,) else t.reshape(D)   # (PyTorch's error for a parameter of another size)


# (kernel, device, dtypes, input shape, normalized shape, what else the trace depends on) -> the plan of a layer norm,
# forward or backward (operand i: argument i; the results allocated in their final shapes): a repeated call binds
# its contiguous tensors as they are, without the views, the trace key and the results' reshapes of each call
_NORM_PLANS = PlanCache()


def _planned_launch(kernel, key: tuple, args: dict[str, torch.Tensor], views: dict[str, tuple], meta: dict,
                    shapes: list[tuple], op: str) -> list[torch.Tensor]:
    """``kernel``'s results on ``args`` (contiguous, on device ``key[1]``; the kernel reads each at its ``views``
    shape) in the shapes ``shapes``, through the plan kept under ``key`` (traced by the first call)."""
    plan = _NORM_PLANS.get(key)
    if plan is None:
        traced = traced_kernel(kernel, {n: t.view(views[n]) for n, t in args.items()}, meta)
        plan = _NORM_PLANS.keep(key, traced, {n: i for i, n in enumerate(args)}, shapes)
    return plan.launch(list(args.values()), key[1], op)


@lowering("native_layer_norm")
def native_layer_norm(input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None,
                      bias: torch.Tensor | None, eps: float):
    """(layer_norm(input), mean, 1/std) over the trailing ``normalized_shape`` dims."""
    N, D = _norm_shape(input, normalized_shape)
    params = [t for t in (weight, bias) if t is not None]
    stat_shape = list(input.shape[:input.dim() - len(normalized_shape)]) + [1] * len(normalized_shape)
    if input.numel() == 0 and input.dtype in FLOATS:   # nothing to normalise: empty results of the right shapes
        empty = torch.empty(stat_shape, dtype=input.dtype, device=input.device)
        return torch.empty_like(input), empty, empty.clone()
    if input.dtype not in FLOATS or N == 0 or D == 0 or any(t.dtype != input.dtype for t in params):
        raise Unsupported
    eps = float(eps)
    key = (layer_norm_kernel, input.get_device(), input.dtype, input.shape, tuple(normalized_shape), eps,
           weight is None, bias is None)
    # the statistics in the input's dtype, as the CPU returns them, rounded by the kernel's store
    return tuple(_planned_launch(layer_norm_kernel, key, {"x": dense(input), "weight": _param(weight, D, 1.0, input),
                                                          "bias": _param(bias, D, 0.0, input)},
                                 {"x": (N, D), "weight": (D,), "bias": (D,)},
                                 {"eps": eps, "stats": True, "stats_dtype": input.dtype},
                                 [tuple(input.shape), tuple(stat_shape), tuple(stat_shape)], "aten::native_layer_norm"))


@lowering("native_layer_norm_backward")
def native_layer_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, normalized_shape: Sequence[int],
                               mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
                               bias: torch.Tensor | None, output_mask: Sequence[bool]):
    """(grad_input, grad_weight, grad_bias) of layer norm, from the forward's saved mean and 1/std."""
    N, D = _norm_shape(input, normalized_shape)
    if (N == 0 or D == 0) and input.dtype in FLOATS and all(t.device == input.device for t in (grad_out, mean, rstd)):
        # no rows (or no features): an empty input gradient, zero parameter gradients, as on the CPU
        zeros = [torch.zeros(normalized_shape, dtype=p.dtype, device=p.device) if p is not None and m else None
                 for p, m in ((weight, output_mask[1]), (bias, output_mask[2]))]
        return (torch.zeros_like(input) if output_mask[0] else None), *zeros
    if input.dtype not in FLOATS or grad_out.dtype != input.dtype or \
            (weight is not None and weight.dtype != input.dtype) or mean.numel() != N or rstd.numel() != N or \
            any(t.device != input.device for t in (grad_out, mean, rstd)):
        raise Unsupported
    # from the saved statistics, as the CPU kernel does: x^ = (x - mean) * rstd, g = dy * w,
    # dx = rstd * (g - mean(g) - x^ * mean(g * x^)), dw = sum(dy * x^), db = sum(dy) over rows
    key = (layer_norm_bwd_kernel, input.get_device(), input.dtype, input.shape, tuple(normalized_shape),
           weight is None, mean.dtype, rstd.dtype)
    params = tuple(normalized_shape)
    dx, dw, db = _planned_launch(
        layer_norm_bwd_kernel, key, {"dy": dense(grad_out), "x": dense(input), "weight": _param(weight, D, 1.0, input),
                                     "mean": dense(mean), "rstd": dense(rstd)},
        {"dy": (N, D), "x": (N, D), "weight": (D,), "mean": (N, 1), "rstd": (N, 1)}, {},
        [tuple(input.shape), params, params], "aten::native_layer_norm_backward")
    dx = dx if output_mask[0] else None
    dw = dw if output_mask[1] and weight is not None else None
    db = db.to(bias.dtype) if output_mask[2] and bias is not None else None
    return dx, dw, db


# ---- RMS norm ----------------------------------------------------------------------------------------
# ``rms_norm`` is CompositeImplicitAutograd; it calls ``_fused_rms_norm`` on a backend with a kernel for it (else
# it decomposes into pow, mean, add, rsqrt and two products: 8 launches each way), whose own autograd formula
# calls ``_fused_rms_norm_backward``: one launch of the norm kernels each way.

def _fused_rms_ok(input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None) -> bool:
    """Whether the norm kernels take this RMS norm: a float dtype the engines compute in, a weight of the input's
    dtype, device and the normalized shape."""
    k = len(normalized_shape)
    return (input.dtype in FLOATS and 0 < k <= input.dim()
            and tuple(input.shape[input.dim() - k:]) == tuple(normalized_shape)
            and (weight is None or (weight.dtype == input.dtype and weight.device == input.device
                                    and tuple(weight.shape) == tuple(normalized_shape))))


def _rms_eps(eps: float | None) -> float:
    """The epsilon PyTorch adds when none is given: that of the fp32 the statistics are computed in."""
    return torch.finfo(torch.float32).eps if eps is None else float(eps)


@lowering("_fused_rms_norm")
def fused_rms_norm(input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None,
                   eps: float | None):
    """(rms_norm(input), 1/rms) over the trailing ``normalized_shape`` dims, 1/rms in fp32 with those dims kept."""
    if not _fused_rms_ok(input, normalized_shape, weight):
        checked(aten._fused_rms_norm.default, input, normalized_shape, weight, eps)   # the CPU's errors
        raise Unsupported("a dtype the engines lack, or a weight unlike the input")
    N, D = _norm_shape(input, normalized_shape)
    stat_shape = list(input.shape[:input.dim() - len(normalized_shape)]) + [1] * len(normalized_shape)
    if N == 0 or D == 0:   # nothing to normalise: empty results of the right shapes
        return torch.empty_like(input), torch.empty(stat_shape, dtype=torch.float32, device=input.device)
    w = _param(weight, D, 1.0, input)
    out, rstd = call_kernel(layer_norm_kernel, {"x": dense(input).reshape(N, D), "weight": w, "bias": w},
                            {"eps": _rms_eps(eps), "rms": True, "stats": True}, op="aten::_fused_rms_norm")
    return out.reshape(input.shape), rstd.reshape(stat_shape)


def _rms_norm_backward_composed(grad_out: torch.Tensor, input: torch.Tensor, normalized_shape: Sequence[int],
                                rstd: torch.Tensor, weight: torch.Tensor | None, output_mask: Sequence[bool]):
    """(grad_input, grad_weight) of RMS norm from element-wise and reduction ops, in fp32 (fp64 for fp64 inputs)."""
    k = len(normalized_shape)
    rows = list(range(input.dim() - k))
    ct = torch.promote_types(input.dtype, torch.float32)
    g, r = grad_out.to(ct), rstd.to(ct)
    xh = input.to(ct) * r
    gw = g * weight.to(ct) if weight is not None else g
    dx = dw = None
    if output_mask[0]:
        dims = list(range(input.dim() - k, input.dim()))
        dx = (r * (gw - xh * (gw * xh).mean(dims, keepdim=True))).to(input.dtype)
    if output_mask[1] and weight is not None:
        gx = g * xh
        dw = (gx.sum(rows) if rows else gx).reshape(weight.shape).to(weight.dtype)
    return dx, dw


@lowering("_fused_rms_norm_backward")
def fused_rms_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, normalized_shape: Sequence[int],
                            rstd: torch.Tensor, weight: torch.Tensor | None, output_mask: Sequence[bool]):
    """(grad_input, grad_weight) of RMS norm, from the forward's saved 1/rms."""
    N = input.numel() // max(1, math.prod(normalized_shape))
    if not _fused_rms_ok(input, normalized_shape, weight) or input.numel() == 0 or grad_out.dtype != input.dtype or \
            grad_out.shape != input.shape or rstd.dtype != torch.float32 or rstd.numel() != N or \
            any(t.device != input.device for t in (grad_out, rstd)):
        # the CPU has no kernel of this op to fall back to: what the kernel does not take is composed of other ops
        return _rms_norm_backward_composed(grad_out, input, normalized_shape, rstd, weight, output_mask)
    N, D = _norm_shape(input, normalized_shape)
    # x^ = x * rstd, g = dy * w: dx = rstd * (g - x^ * mean(g * x^)), dw = sum(dy * x^) over rows
    dx, dw, _ = call_kernel(layer_norm_bwd_kernel, {
        "dy": dense(grad_out).reshape(N, D), "x": dense(input).reshape(N, D), "weight": _param(weight, D, 1.0, input),
        "rstd": dense(rstd).reshape(N, 1)}, {"rms": True}, op="aten::_fused_rms_norm_backward")
    return (dx.reshape(input.shape) if output_mask[0] else None,
            dw.reshape(normalized_shape) if output_mask[1] and weight is not None else None)


# ---- negative log likelihood ------------------------------------------------------------------------

def _nll_ok(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> bool:
    """Whether the nll kernels take these arguments (int64 class targets, as the CPU demands; the rest,
    with its errors, goes to the CPU; so do zero classes). Rows of any class count fit: wide ones run in
    column blocks."""
    return (self.dtype in (torch.float32, torch.bfloat16) and self.dim() in (1, 2) and target.device == self.device
            and target.dtype == torch.int64 and target.numel() > 0 and target.dim() == self.dim() - 1
            and (self.dim() == 1 or target.shape[0] == self.shape[0]) and 0 < self.shape[-1] < EXACT
            and abs(ignore_index) < EXACT
            and (weight is None or (weight.device == self.device and weight.dtype == self.dtype
                                    and weight.numel() == self.shape[-1])))


def _nll_args(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None) -> tuple[dict, int]:
    """The kernels' tensor arguments (target as its int32 word pairs) and the class count."""
    C = self.shape[-1]
    words, _ = index_words(target)
    args = {"words": words.reshape(-1, 2)}
    if weight is not None:
        args["weight"] = dense(weight).reshape(1, C)
    return args, C


def _raise_bad_target(bad: torch.Tensor, target: torch.Tensor, C: int, ignore_index: int) -> None:
    """The CPU's IndexError naming the first out-of-range target, after one host read of the count."""
    if bad.item():
        t = target.reshape(-1).cpu()
        first = int(((t != ignore_index) & ((t < 0) | (t >= C))).nonzero()[0, 0])
        raise IndexError(f"Target {int(t[first])} is out of bounds.")


@lowering("nll_loss_forward")
def nll_loss_forward(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int,
                     ignore_index: int):
    """(loss, total_weight) of the negative log likelihood: ``-w[t_n] * x[n, t_n]``, reduced."""
    if not _nll_ok(self, target, weight, ignore_index):
        raise Unsupported
    args, C = _nll_args(self, target, weight)
    red = reduction if self.dim() == 2 or reduction else 2   # one sample unreduced: its loss, a scalar
    loss, total, bad = call_kernel(nll_fwd_kernel, {"x": dense(self).reshape(-1, C), **args},
                                   {"ignore_index": int(ignore_index), "reduction": red}, op="aten::nll_loss_forward")
    _raise_bad_target(bad, target, C, ignore_index)
    if self.dim() == 2 and reduction == 0:       # the CPU reports no total weight when nothing is reduced
        return loss.reshape(-1), torch.zeros((), dtype=self.dtype, device=self.device)
    return loss.reshape(()), total.reshape(())


@lowering("nll_loss_backward")
def nll_loss_backward(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                      weight: torch.Tensor | None, reduction: int, ignore_index: int, total_weight: torch.Tensor):
    """d(loss)/d(input): ``-w[t_n] * g_n`` at (n, t_n), zero elsewhere."""
    if not _nll_ok(self, target, weight, ignore_index) or grad_output.dtype != self.dtype or \
            total_weight.device != self.device or total_weight.numel() != 1:
        raise Unsupported
    args, C = _nll_args(self, target, weight)
    red = reduction if self.dim() == 2 or reduction else 2
    grad = dense(grad_output).reshape(-1, 1)
    if grad.shape[0] != (target.numel() if red == 0 else 1):
        raise Unsupported
    dx, bad = call_kernel(nll_bwd_kernel, {"grad": grad, "total": dense(total_weight).reshape(1, 1), **args},
                          {"num_classes": C, "ignore_index": int(ignore_index), "reduction": red},
                          op="aten::nll_loss_backward")
    _raise_bad_target(bad, target, C, ignore_index)
    return dx.reshape(self.shape)


# ---- cross-entropy -----------------------------------------------------------------------------------
# ``cross_entropy_loss`` is CompositeImplicitAutograd: log_softmax then nll_loss, which writes and rereads the [N, C]
# log-probabilities. On neuron its autograd kernel runs the fused kernels (``kernels.cross_entropy``: each row of
# logits read once each way) for class targets of 1-D/2-D inputs; anything else, and calls being traced (fake or
# functorch-wrapped tensors: the compiler lowers the composition), take PyTorch's composition.
#
# The autograd kernel is registered on import; ``use_fused_cross_entropy(False)`` removes it (PyTorch's composition
# for every call) and ``use_fused_cross_entropy(True)`` registers it again.

_AUTOGRAD_LIB: torch.library.Library | None = None
# Below this many classes the composition is faster: its kernels group several short rows per partition, where the
# fused kernels take one row per partition (16384 x 100 bf16: 177 us against 287 us forward; 256 classes: 353
# against 296 us)
FUSED_CE_MIN_CLASSES = 256


def _fused_ce_ok(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int,
                 ignore_index: int, label_smoothing: float) -> bool:
    """Whether the fused kernels take this cross-entropy: a float input [N, C] or [C] of at least
    FUSED_CE_MIN_CLASSES classes on one device with int64 class targets of its batch shape, class weights of its
    dtype that need no gradient (the composition raises the CPU's error for one), label smoothing in [0, 1] without
    class weights, and no tensor being traced."""
    ts = [t for t in (self, target, weight) if t is not None]
    if any(type(t) is not torch.Tensor for t in ts) or torch._C._are_functorch_transforms_active() or \
            torch.compiler.is_compiling() or forward_ad.unpack_dual(self).tangent is not None:
        return False     # traced, or a forward-mode tangent (the composition has the forward derivatives)
    C = self.shape[-1] if self.dim() else 0
    return (self.dtype in FLOATS and self.dim() in (1, 2) and self.numel() > 0 and FUSED_CE_MIN_CLASSES <= C < EXACT
            and target.dtype == torch.int64 and target.dim() == self.dim() - 1
            and (self.dim() == 1 or target.shape[0] == self.shape[0]) and abs(ignore_index) < EXACT
            and reduction in (0, 1, 2) and 0.0 <= label_smoothing <= 1.0
            and (weight is None or (label_smoothing == 0.0 and weight.dtype == self.dtype and weight.dim() == 1
                                    and weight.numel() == C and not weight.requires_grad))
            and on_one_device(*ts))


class _FusedCrossEntropy(torch.autograd.Function):
    """Cross-entropy through the fused kernels; its backward runs the fused backward kernel (a backward that
    builds a graph, for higher derivatives, differentiates PyTorch's composition instead)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int,
                ignore_index: int, smoothing: float) -> torch.Tensor:
        """The loss, from one launch; saves the row log-sum-exp and the total weight."""
        args, C = _nll_args(x, target, weight)
        red = reduction if x.dim() == 2 or reduction else 2   # one sample unreduced: its loss, a scalar
        meta = {"ignore_index": int(ignore_index), "reduction": red, "smoothing": float(smoothing)}
        loss, lse, total, bad = call_kernel(cross_entropy_fwd_kernel, {"x": dense(x).reshape(-1, C), **args}, meta,
                                            op="aten::cross_entropy_loss")
        _raise_bad_target(bad, target, C, ignore_index)
        ctx.save_for_backward(x, target, weight, lse, total)
        ctx.meta = (reduction, int(ignore_index), float(smoothing), red)
        return loss.reshape(-1) if red == 0 else loss.reshape(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """d loss / d x from one launch."""
        x, target, weight, lse, total = ctx.saved_tensors
        reduction, ignore_index, smoothing, red = ctx.meta
        if torch.is_grad_enabled():   # create_graph: a gradient that is itself differentiable
            loss = aten.cross_entropy_loss.default.decompose(x, target, weight, reduction, ignore_index, smoothing)
            return torch.autograd.grad(loss, x, grad, create_graph=True)[0], None, None, None, None, None
        args, C = _nll_args(x, target, weight)
        g = dense(grad.to(x.dtype)).reshape(-1, 1)
        dx, bad = call_kernel(cross_entropy_bwd_kernel, {"grad": g, "x": dense(x).reshape(-1, C), "lse": lse,
                                                        "total": total, **args},
                              {"ignore_index": ignore_index, "reduction": red, "smoothing": smoothing},
                              op="aten::cross_entropy_loss_backward")
        _raise_bad_target(bad, target, C, ignore_index)
        return dx.reshape(x.shape), None, None, None, None, None


def cross_entropy_loss(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                       reduction: int = 1, ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy`` on neuron: the fused kernels where they apply, else PyTorch's composition."""
    if _fused_ce_ok(self, target, weight, reduction, ignore_index, label_smoothing):
        return _FusedCrossEntropy.apply(self, target, weight, reduction, ignore_index, label_smoothing)
    return aten.cross_entropy_loss.default.decompose(self, target, weight, reduction, ignore_index, label_smoothing)


def use_fused_cross_entropy(enabled: bool = True) -> None:
    """Route ``F.cross_entropy`` on neuron through the fused kernels where they apply (True, the default) or
    PyTorch's composition always (False)."""
    global _AUTOGRAD_LIB
    if enabled and _AUTOGRAD_LIB is None:
        _AUTOGRAD_LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (kept alive while enabled)
        _AUTOGRAD_LIB.impl("cross_entropy_loss", cross_entropy_loss, "AutogradPrivateUse1")
    elif not enabled and _AUTOGRAD_LIB is not None:
        _AUTOGRAD_LIB._destroy()
        _AUTOGRAD_LIB = None


use_fused_cross_entropy(True)


# ---- regression losses ---------------------------------------------------------------------------------

def reduce_loss(losses: torch.Tensor, reduction: int) -> torch.Tensor:
    """ATen's reduction enum: 0 none, 1 mean, 2 sum."""
    return losses if reduction == 0 else losses.mean() if reduction == 1 else losses.sum()


def _mse_ok(*ts: torch.Tensor) -> bool:
    return all(t.device == ts[0].device and t.dtype in FLOATS and t.dtype == ts[0].dtype for t in ts)


@lowering("mse_loss")
def mse_loss(self: torch.Tensor, target: torch.Tensor, reduction: int = 1):
    """Mean squared error: ``(self - target) ** 2``, reduced."""
    if not _mse_ok(self, target):
        raise Unsupported("mixed or unsupported dtypes, or several devices")
    d = self - target
    return reduce_loss(d * d, reduction)


@lowering("mse_loss_backward")
def mse_loss_backward(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor, reduction: int):
    """``2 * (self - target) * grad`` (divided by the element count for the mean)."""
    if not _mse_ok(grad_output, self, target):
        raise Unsupported("mixed or unsupported dtypes, or several devices")
    scale = 2.0 / self.numel() if reduction == 1 else 2.0
    res = (self - target) * grad_output * scale
    return res.expand(torch.broadcast_shapes(self.shape, target.shape)) if res.shape != self.shape else res


register_out("mse_loss.out", mse_loss)
register_out("mse_loss_backward.grad_input", mse_loss_backward)


# ---- classification losses: binary cross entropy, multi-class and multi-label margins ------------------

def _any_true(*flags: torch.Tensor) -> list[bool]:
    """Whether each boolean tensor has a set element, read by the host in one sync."""
    return torch.cat([f.any().reshape(1) for f in flags]).tolist()


def _check_long(target: torch.Tensor) -> None:
    """The CPU margin kernels' refusal of a class target that is not int64 (their meta functions take int32)."""
    if target.dtype != torch.int64:
        raise RuntimeError(f"expected scalar type Long but found {type_name(target.dtype)}")


def _class_rows(self: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``self`` and ``target`` as [N, C] / [N, -1] rows (a vector or 0-dim input is one row)."""
    C = self.shape[-1] if self.dim() else 1
    return self.reshape(-1, C), target.reshape(self.reshape(-1, C).shape[0], -1)


MARGIN_DTYPES = (torch.float32,)   # the CPU's margin-loss kernels have no half types (theirs raise)


@lowering("binary_cross_entropy")
def binary_cross_entropy(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                         reduction: int = 1) -> torch.Tensor:
    """``-w (t log(x) + (1 - t) log(1 - x))`` with the logs clamped at -100, as the CPU kernel computes it."""
    checked(aten.binary_cross_entropy.default, self, target, weight, reduction)
    ts = [t for t in (self, target, weight) if t is not None]
    if not on_one_device(*ts) or not _mse_ok(*ts):
        raise Unsupported("mixed or unsupported dtypes, or several devices")
    bad_x, bad_t = _any_true(~((self >= 0) & (self <= 1)), ~((target >= 0) & (target <= 1)))  # NaN is outside
    if bad_x:
        raise RuntimeError("all elements of input should be between 0 and 1")
    if bad_t:
        raise RuntimeError("all elements of target should be between 0 and 1")
    losses = (target - 1) * torch.log1p(-self).clamp(min=-100) - target * torch.log(self).clamp(min=-100)
    if weight is not None:
        losses = losses * weight
    return reduce_loss(losses, reduction)


@lowering("binary_cross_entropy_backward")
def binary_cross_entropy_backward(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                                  weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """``g (x - t) / max((1 - x) x, 1e-12)``, times the weight, over the element count for the mean."""
    checked(aten.binary_cross_entropy_backward.default, grad_output, self, target, weight, reduction)
    ts = [t for t in (grad_output, self, target, weight) if t is not None]
    if not on_one_device(*ts) or not _mse_ok(*ts):
        raise Unsupported("mixed or unsupported dtypes, or several devices")
    res = grad_output * (self - target) / ((1 - self) * self).clamp(min=1e-12)
    if weight is not None:
        res = res * weight
    if reduction == 1:
        res = res / self.numel()
    return (res.expand(self.shape) if res.shape != self.shape else res).contiguous()


# The CPU's out= kernels of binary cross-entropy write each element's value into the out= tensor's squeezed view
# (resized, growing the storage, where its shape is not the squeezed operands'), then weight and reduce (the
# forward's mean or sum, the backward's division by the element count) the tensor itself, in its own shape.
# register_out derives them from the unweighted, unreduced values; their write hooks do the rest in that order.

def _bce_values(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                reduction: int = 1) -> torch.Tensor:
    """binary_cross_entropy.out's functional part: each element's loss, unweighted (the out= write weighs it)."""
    if self.shape != target.shape or not on_one_device(*[t for t in (self, target, weight) if t is not None]):
        raise Unsupported("operands of other shapes (the CPU broadcasts their squeezed forms), or several devices")
    return binary_cross_entropy(self, target, None, 0)


def _write_squeezed(values: torch.Tensor, out: torch.Tensor) -> None:
    """``values`` written as the CPU's element-wise kernel writes them: into ``out``'s squeezed view, resized to
    the squeezed values' shape when it differs (ATen's warning naming the view's shape; ``out`` keeps its own)."""
    view = out.squeeze()
    shape = values.squeeze().shape
    resize_out(view, shape)
    device_copy(view, values.reshape(shape))


def _bce_write(values: torch.Tensor, out: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
               weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """binary_cross_entropy.out's write: the losses, then the weight and the reduction applied to ``out``."""
    _write_squeezed(values, out)
    if weight is not None:
        out.mul_(weight)
    if reduction != 0:
        total = reduce_loss(out, reduction)
        out.resize_as_(total).copy_(total)     # (quietly: resize_as_ has no warning)
    return out


def _bce_backward_values(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                         weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """binary_cross_entropy_backward.grad_input's functional part: each element's gradient, unweighted and not
    divided by the count (the out= write does both)."""
    if self.shape != target.shape or grad_output.shape not in (self.shape, torch.Size([])) or \
            not on_one_device(*[t for t in (grad_output, self, target, weight) if t is not None]):
        raise Unsupported("operands of other shapes (the CPU broadcasts their squeezed forms), or several devices")
    return binary_cross_entropy_backward(grad_output, self, target, None, 2 if reduction == 1 else reduction)


def _bce_backward_write(values: torch.Tensor, out: torch.Tensor, grad_output: torch.Tensor, self: torch.Tensor,
                        target: torch.Tensor, weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """binary_cross_entropy_backward.grad_input's write: the gradients, then the weight and the mean's division."""
    _write_squeezed(values, out)
    if weight is not None:
        out.mul_(weight)
    if reduction == 1:
        out.div_(self.numel())
    return out


register_out("binary_cross_entropy.out", _bce_values, write=_bce_write)
register_out("binary_cross_entropy_backward.grad_input", _bce_backward_values, write=_bce_backward_write)


@lowering("multi_margin_loss")
def multi_margin_loss(self: torch.Tensor, target: torch.Tensor, p: int = 1, margin: float = 1,
                      weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """Per row, ``sum_{i != y} w_y max(0, margin - x_y + x_i)^p / C`` (y the row's target class)."""
    checked(aten.multi_margin_loss.default, self, target, p, margin, weight, reduction)
    _check_long(target)
    ok = on_one_device(self, target, weight) and self.dtype in MARGIN_DTYPES and target.dtype == torch.int64
    if not ok or (weight is not None and weight.dtype != self.dtype) or p not in (1, 2):
        raise Unsupported("several devices, a dtype the CPU kernel has no half form of, or p other than 1 and 2")
    x, t = _class_rows(self, target)
    C = x.shape[1]
    if _any_true((t < 0) | (t >= C))[0]:
        raise RuntimeError("target out of range")
    mask = arange_values(C, x.device).reshape(1, C) == t                    # [N, C]: the target class
    x_y = torch.where(mask, x, 0).sum(1, keepdim=True)
    z = float(margin) - x_y + x
    h = torch.where(z > 0, z, 0)                                           # (a NaN z adds nothing, as on CPU)
    if p == 2:
        h = h * h
    if weight is not None:
        h = h * torch.where(mask, weight.reshape(1, C), 0).sum(1, keepdim=True)
    losses = torch.where(mask, 0, h).sum(1) / C
    if reduction == 0:   # shaped like the target (the meta function says [1] for a 0-dim one)
        return losses.reshape(target.shape)
    return reduce_loss(losses, reduction)


# the CPU's margin-loss kernels resize an out= tensor without a warning
register_out("multi_margin_loss.out", multi_margin_loss, warn_resize=False)


MARGIN_LIMIT = 1 << 24    # elements of the [N, C, C] blocks multilabel_margin_loss builds


def _multilabel_terms(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For [N, C] inputs and targets: (listed [N, C]: target slot j comes before the row's first -1; hot
    [N, C, C]: slot j names class i; z [N, C, C]: ``1 - x_{y_j} + x_i``), after the CPU's range check."""
    N, C = x.shape
    if _any_true((t < -1) | (t >= C))[0]:
        raise RuntimeError("argument #2 'target' is out of range")
    listed = (t < 0).to(torch.int32).cumsum(1) == 0
    hot = (t.reshape(N, C, 1) == arange_values(C, x.device).reshape(1, 1, C)) & listed.reshape(N, C, 1)
    x_y = torch.where(hot, x.reshape(N, 1, C), 0).sum(2)                       # [N, C]: x of the j-th target
    return listed, hot, 1 - x_y.reshape(N, C, 1) + x.reshape(N, 1, C)


def _scale_by_grad(grad: torch.Tensor, grad_output: torch.Tensor, reduction: int, N: int) -> torch.Tensor:
    """Per-row gradients [N, C] times the loss's incoming gradient (one per row when unreduced)."""
    return grad * (grad_output.reshape(N, 1) if reduction == 0 else grad_output.reshape(1, 1))


@lowering("multilabel_margin_loss_forward")
def multilabel_margin_loss_forward(self: torch.Tensor, target: torch.Tensor, reduction: int):
    """(loss, is_target): per row, ``sum_j sum_{i not a target} max(0, 1 - x_{y_j} + x_i) / C`` over the target
    classes y_j listed before the row's first -1."""
    checked(aten.multilabel_margin_loss_forward.default, self, target, reduction)
    _check_long(target)
    x, t = _class_rows(self, target)
    N, C = x.shape
    if not on_one_device(self, target) or self.dtype not in MARGIN_DTYPES or \
            target.dtype != torch.int64 or N * C * C > MARGIN_LIMIT:
        raise Unsupported("several devices, an unsupported dtype, or more than MARGIN_LIMIT terms")
    listed, hot, z = _multilabel_terms(x, t)
    targets = hot.any(1)                                                      # [N, C]: class i is a target
    h = torch.where(listed.reshape(N, C, 1) & ~targets.reshape(N, 1, C) & (z > 0), z, 0)   # NaN z: nothing
    losses = h.sum((1, 2)) / C
    # a vector input gives a 0-dim loss (the meta function says [1])
    loss = losses.reshape(() if self.dim() <= 1 else (N,)) if reduction == 0 else reduce_loss(losses, reduction)
    return loss, targets.to(self.dtype).reshape(target.shape)


register_out("multilabel_margin_loss_forward.output", multilabel_margin_loss_forward, warn_resize=False)


@lowering("multilabel_margin_loss_backward")
def multilabel_margin_loss_backward(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                                    reduction: int, is_target: torch.Tensor) -> torch.Tensor:
    """Each active term ``1 - x_{y_j} + x_i > 0`` adds g to x_i's gradient and -g to x_{y_j}'s,
    g = 1/C (1/(N C) for the mean), times the incoming gradient."""
    x, t = _class_rows(self, target)
    N, C = x.shape
    ok = (on_one_device(grad_output, self, target, is_target) and self.dtype in MARGIN_DTYPES
          and target.dtype == torch.int64 and t.shape == x.shape and is_target.shape == target.shape
          and grad_output.dtype == self.dtype and N * C * C <= MARGIN_LIMIT and self.numel() > 0
          and grad_output.numel() == (N if reduction == 0 else 1))
    if not ok:   # (the CPU's checks and errors for anything unexpected)
        raise Unsupported("what the device kernel does not take (the CPU raises its errors)")
    listed, hot, z = _multilabel_terms(x, t)
    others = ~(is_target.reshape(N, C) > 0)
    active = (listed.reshape(N, C, 1) & others.reshape(N, 1, C) & (z > 0)).to(torch.float32)   # [N, j, i]
    per_target = active.sum(2)                                                          # [N, j]
    taken = torch.where(hot, per_target.reshape(N, C, 1), 0).sum(1)                    # [N, i] as a target
    g = 1.0 / (C * N) if reduction == 1 else 1.0 / C
    grad = (active.sum(1) - taken) * g
    return _scale_by_grad(grad.to(self.dtype), grad_output, reduction, N).reshape(self.shape)


register_out("multilabel_margin_loss_backward.grad_input", multilabel_margin_loss_backward, warn_resize=False)


@lowering("multi_margin_loss_backward")
def multi_margin_loss_backward(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor, p: int,
                               margin: float, weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """For each active class ``margin - x_y + x_i > 0``: ``g`` (p = 1) or ``2 g z`` (p = 2), times ``w_y``, at
    x_i, their negated sum at x_y; g = 1/C (1/(N C) for the mean), times the incoming gradient."""
    x = self.reshape(-1, self.shape[-1] if self.dim() else 1)
    N, C = x.shape
    ok = (on_one_device(grad_output, self, target, weight) and self.dtype in MARGIN_DTYPES
          and target.dtype == torch.int64 and target.numel() == N and p in (1, 2)
          and grad_output.dtype == self.dtype and (weight is None or weight.dtype == self.dtype) and C > 0
          and grad_output.numel() == (N if reduction == 0 else 1))
    if not ok:
        raise Unsupported("what the device kernel does not take (the CPU raises its errors)")
    t = target.reshape(N, 1)
    if _any_true((t < 0) | (t >= C))[0]:
        raise RuntimeError("target out of range")
    mask = arange_values(C, x.device).reshape(1, C) == t
    x_y = torch.where(mask, x, 0).sum(1, keepdim=True)
    z = float(margin) - x_y + x
    g = 1.0 / (C * N) if reduction == 1 else 1.0 / C
    h = torch.where(~mask & (z > 0), z * (2 * g) if p == 2 else g, 0)
    if weight is not None:
        h = h * torch.where(mask, weight.reshape(1, C), 0).sum(1, keepdim=True)
    grad = torch.where(mask, -h.sum(1, keepdim=True), h).to(self.dtype)
    return _scale_by_grad(grad, grad_output, reduction, N).reshape(self.shape)


register_out("multi_margin_loss_backward.grad_input", multi_margin_loss_backward, warn_resize=False)


# ---- weight normalization (nn.utils.parametrizations.weight_norm) -------------------------------------

def _weight_norm_dims(v: torch.Tensor, dim: int) -> list[int] | None:
    """The dims a weight norm reduces (all but ``dim``), for the fused op's dims (first or last), else None."""
    d = dim + v.dim() if dim < 0 else dim
    if v.dtype != torch.float32 or v.dim() == 0 or d not in (0, v.dim() - 1):
        return None
    return [i for i in range(v.dim()) if i != d]


@lowering("_weight_norm_interface")
def weight_norm_interface(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(w = v * (g / ||v||), the norms ||v|| over every dim but ``dim``, kept as size-1 dims)."""
    dims = _weight_norm_dims(v, dim)
    if dims is None or g.device != v.device or g.dtype != v.dtype:
        raise Unsupported
    norms = torch.linalg.vector_norm(v, 2, dims, keepdim=True)
    return v * (g.reshape(norms.shape) / norms), norms


@lowering("_weight_norm_interface_backward")
def weight_norm_interface_backward(grad_w: torch.Tensor, saved_v: torch.Tensor, saved_g: torch.Tensor,
                                   saved_norms: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's gradients: grad_g = sum(grad_w * v) / norm, grad_v = (g / norm) (grad_w - v grad_g / norm)."""
    dims = _weight_norm_dims(saved_v, dim)
    if dims is None or any(t.device != saved_v.device or t.dtype != saved_v.dtype
                           for t in (grad_w, saved_g, saved_norms)):
        raise Unsupported
    norms = saved_norms.reshape([1 if i in dims else n for i, n in enumerate(saved_v.shape)])
    grad_g = (grad_w * saved_v).sum(dims, keepdim=True) / norms
    grad_v = (saved_g.reshape(norms.shape) / norms) * (grad_w - saved_v * (grad_g / norms))
    return grad_v, grad_g.reshape(saved_g.shape)
