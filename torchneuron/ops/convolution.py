"""Convolution on the device (1-3-D, plain or transposed): the direct kernel (``kernels.conv``) for 1-D and 2-D
convolutions, plain forward and backward and transposed forward; im2col and the matmul kernel for the rest.

A transposed convolution's forward is a plain one's input gradient: the direct kernel's ``flip`` loop nest, which
sums every window offset's products in PSUM and rounds once. Where col2im sums the offsets instead (3-D, a
padding beyond ``dilation * (k - 1)``, bands that do not fit), a 2-byte dtype's columns are fp32 (the products
of its values are exact there) and the result is rounded once at the end, as the CPU does: one bf16 column per
offset, added in bf16, was up to 75x that bound off.

The direct kernel takes a 1-D convolution as 2-D with H = 1. Its input gradient is the same kernel run on the
output gradient (zero-inserted by the stride, padded by ``dilation * (k - 1) - padding``) with the weight
flipped; a padding larger than that takes the im2col route. The weight gradient is ``conv2d_wgrad_kernel``;
when both gradients are wanted and the input gradient runs directly, one ``conv2d_backward_kernel`` launch
computes the two.

PyTorch hands convolutions to a PrivateUse1 backend only through ``convolution_overrideable`` and its
backward (their default kernels raise): inputs these kernels do not run go to the C++ glue's dedicated CPU
route (``torchneuron._C._fallback_convolution*``), which counts as a fallback like any other.

Group g's patches are contiguous rows and ``out_g = W_g[OCg, K] @ cols_g[K, L]``. Backward:
``grad_W_g = grad_g @ cols_g^T`` and ``grad_cols_g = W_g^T @ grad_g`` (both operands handed to the kernel in
their stored layout), then col2im. A transposed convolution is the input gradient of a plain one:
``cols_g = W_g^T @ x_g`` then col2im (output_padding only widens the col2im target); its backward is the
plain forward (im2col of the output gradient, ``grad_x_g = W_g @ cols_g``) and ``grad_W_g = x_g @ cols_g^T``.
Stride, padding, dilation, groups and output_padding are PyTorch's.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from torchneuron import _C
from torchneuron.kernels.conv import (Dim, conv2d_backward_kernel, conv2d_kernel, conv2d_wgrad_kernel, conv_fits,
                                      dims_of)
from torchneuron.kernels.conv_im2col import (conv2d_im2col_backward_kernel, conv2d_im2col_kernel,
                                             conv2d_im2col_wgrad_kernel, im2col_fits)
from torchneuron.ops.base import floats_on_one_device
from torchneuron.ops.elementwise import dense
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering
from torchneuron.ops.windows import col2im_patches, im2col_patches, int_tuple


# ---- convolution ------------------------------------------------------------------------------------
# A convolution's input side is "patches" and its output side "rows"; a transposed one swaps them.
# With the weight as W_g [R, Kp] per group (R = weight.shape[0] / G rows, Kp the rest):
#   rows_g = W_g @ cols_g,   cols_g = W_g^T @ rows_g,   grad W_g = rows_g @ cols_g^T
# where rows are [channels, (b, *spatial)] and cols the im2col patches [(c, *k), (b, *spatial)].

def _conv_geometry(input: torch.Tensor, weight: torch.Tensor, stride, padding, dilation, transposed: bool,
                   output_padding, groups: int):
    """(k, s, p, d, patch-side spatial size, row-side spatial size) of a convolution the device runs, or None."""
    n = input.dim() - 2
    if n not in (1, 2, 3) or weight.dim() != n + 2 or groups < 1 or input.numel() == 0 or weight.numel() == 0 \
            or input.dtype != weight.dtype:
        return None
    k = tuple(weight.shape[2:])
    s, p, d, op = (int_tuple(v, n, (0,)) for v in (stride, padding, dilation, output_padding))
    if min(s) <= 0 or min(d) <= 0 or min(p) < 0 or min(op) < 0 or weight.shape[0] % groups:
        return None
    S = tuple(input.shape[2:])
    if transposed:
        if input.shape[1] != weight.shape[0] or any(o >= max(ss, dd) for o, ss, dd in zip(op, s, d)):
            return None
        rows = S
        patch = tuple((i - 1) * ss - 2 * pp + dd * (kk - 1) + o + 1 for i, kk, ss, pp, dd, o in zip(S, k, s, p, d, op))
    else:
        if any(op) or input.shape[1] != weight.shape[1] * groups:
            return None
        patch = S
        rows = tuple((i + 2 * pp - dd * (kk - 1) - 1) // ss + 1 for i, kk, ss, pp, dd in zip(S, k, s, p, d))
    if min(rows) <= 0 or min(patch) <= 0:
        return None
    return k, s, p, d, patch, rows


def _to_rows(t: torch.Tensor) -> torch.Tensor:
    """[B, C, *S] as dense rows [C, B * prod(S)]."""
    B, C = t.shape[:2]
    return dense(t.reshape(B, C, -1).transpose(0, 1)).view(C, -1)


def _from_rows(r: torch.Tensor, B: int, S: tuple) -> torch.Tensor:
    """Rows [C, B * prod(S)] as a dense [B, C, *S] tensor."""
    return dense(r.view(r.shape[0], B, -1).transpose(0, 1)).view(B, r.shape[0], *S)


def _group_weight(weight: torch.Tensor, G: int) -> torch.Tensor:
    """The weight as [G, weight.shape[0] / G, rest] (W_g [R, Kp] per group)."""
    return dense(weight).view(G, weight.shape[0] // G, -1)


def _rows_from_cols(w2: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """rows_g = W_g @ cols_g for w2 [G, R, Kp], cols [G, Kp, L]: [G * R, L]."""
    G, R, _ = w2.shape
    out = torch.empty((G * R, cols.shape[-1]), dtype=cols.dtype, device=cols.device)
    for g in range(G):
        torch.mm(w2[g], cols[g], out=out[g * R:(g + 1) * R])
    return out


def _cols_from_rows(w2: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cols_g = W_g^T @ rows_g for w2 [G, R, Kp], rows [G * R, L]: [G, Kp, L] (W_g^T in its stored layout)."""
    G, R, Kp = w2.shape
    out = torch.empty((G, Kp, rows.shape[-1]), dtype=rows.dtype, device=rows.device)
    for g in range(G):
        torch.mm(w2[g].t(), rows[g * R:(g + 1) * R], out=out[g])
    return out


def _col2im_of_rows(w2: torch.Tensor, rows: torch.Tensor, shape: tuple, k: tuple, s: tuple, p: tuple, d: tuple,
                    row_size: tuple, bias: torch.Tensor | None = None) -> torch.Tensor:
    """col2im of ``cols_g = W_g^T @ rows_g`` into a [B, C, *S] ``shape`` (plus a per-channel ``bias``): a transposed
    convolution, or a plain one's input gradient, on the im2col route. A 2-byte dtype's window offsets are summed
    in fp32 and rounded once, as the direct kernel and the CPU do: the products of 2-byte values are exact in fp32,
    so the matmul runs on fp32 copies and col2im adds fp32 columns (a bf16 column per offset, added in bf16, is
    up to ~k roundings of the sum off)."""
    B, C = shape[:2]
    dtype = rows.dtype
    if dtype.itemsize == 2:
        w2, rows = w2.to(torch.float32), rows.to(torch.float32)
    cols = _cols_from_rows(w2, rows)
    res = col2im_patches(cols.view(C, *k, B, *row_size), shape, k, s, p, d)
    if bias is not None:
        res = res + bias.to(res.dtype).view(C, *[1] * len(k))
    return res if res.dtype == dtype else res.to(dtype)


def _weight_grad(rows: torch.Tensor, cols: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """grad W_g = rows_g @ cols_g^T for rows [G * R, L], cols [G, Kp, L]: the weight's gradient, ``shape``."""
    G, Kp, _ = cols.shape
    R = rows.shape[0] // G
    out = torch.empty((G * R, Kp), dtype=rows.dtype, device=rows.device)
    for g in range(G):
        torch.mm(rows[g * R:(g + 1) * R], cols[g].t(), out=out[g * R:(g + 1) * R])
    return out.view(shape)


def _follow_layout(res: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """The output in the input's channels-last layout when it has one, as on CPU."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(input.dim())
    if fmt is not None and input.is_contiguous(memory_format=fmt) and not input.is_contiguous():
        return res.contiguous(memory_format=fmt)
    return res


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    """A dense [N, C, H, W] view of a 1-D ([N, C, L] as H = 1) or 2-D convolution operand."""
    t = dense(t)
    return t.unsqueeze(2) if t.dim() == 3 else t


def _direct_dims(input: torch.Tensor, weight: torch.Tensor, geo: tuple, groups: int, grad: bool = False,
                 wgrad: bool = False):
    """The direct kernel's (H, W) ``Dim`` pair for a plain 1-D/2-D convolution (``grad``: its input gradient's,
    run on the output gradient; ``wgrad``: the forward's, where the weight-gradient kernel fits too), or None
    where the im2col route runs it."""
    k, s, p, d, patch, rows = geo
    if input.dim() not in (3, 4) or input.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if not (grad or wgrad) and groups == 1 and math.prod(k) > 1 and weight.shape[1] * math.prod(k) <= 128:
        # the whole contraction (a stem's 3 channels x 3 x 3) fits one TensorE pass: im2col's single matmul
        # uses C*KH*KW rows of the array where the direct kernel uses C per window offset, and sums without
        # accumulating in PSUM
        return None
    one = (1,) if input.dim() == 3 else ()
    k, s, p, d, patch, rows = (one + tuple(v) for v in (k, s, p, d, patch, rows))
    if grad:      # the gradient of the output, zero-inserted by the stride; the kernel window flipped
        if any(pp > dd * (kk - 1) for kk, pp, dd in zip(k, p, d)):
            return None
        dims = tuple(Dim(r, ss, dd * (kk - 1) - pp, i + pp - 1 - (r - 1) * ss, kk, dd, 1)
                     for r, i, kk, ss, pp, dd in zip(rows, patch, k, s, p, d))
    else:
        dims = tuple(dims_of(i, kk, ss, (pp, pp), dd) for i, kk, ss, pp, dd in zip(patch, k, s, p, d))
    channels = weight.shape[0] if grad else input.shape[1]
    if not conv_fits(channels, tuple(weight.shape), groups, dims, grad, input.element_size(), wgrad):
        return None
    return dims


def _im2col_dims(input: torch.Tensor, weight: torch.Tensor, geo: tuple, groups: int, wgrad: bool = False):
    """The (H, W) ``Dim`` pair of a plain 1-D/2-D convolution the SBUF-im2col kernels run (``wgrad``: its weight
    gradient too), or None."""
    k, s, p, d, patch, rows = geo
    if input.dim() not in (3, 4) or input.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    one = (1,) if input.dim() == 3 else ()
    dims = tuple(dims_of(i, kk, ss, (pp, pp), dd) for i, kk, ss, pp, dd in
                 zip(*(one + tuple(v) for v in (patch, k, s, p, d))))
    return dims if im2col_fits(input.shape[1], weight.shape[0], groups, dims, input.element_size(), wgrad) else None


@lowering("convolution_overrideable")
def convolution(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                groups: int) -> torch.Tensor:
    """1-3-D convolution, plain or transposed (``F.conv*d``, ``F.conv_transpose*d``): im2col + one matmul per
    group, or one matmul per group + col2im; others on the CPU route."""
    geo = _conv_geometry(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if geo is None or not floats_on_one_device(input, weight, bias) or (bias is not None and bias.dtype != input.dtype):
        return _C._fallback_convolution(input, weight, bias, list(stride), list(padding), list(dilation), transposed,
                                        list(output_padding), groups)
    if not transposed and (dims := _im2col_dims(input, weight, geo, groups)) is not None:
        args = {"x": _as_2d(input), "w": _as_2d(weight)}
        if bias is not None:
            args["bias"] = dense(bias)
        (res,) = call_kernel(conv2d_im2col_kernel, args, {"dims": dims}, op="aten::convolution")
        return _follow_layout(res.view(res.shape[0], res.shape[1], -1) if input.dim() == 3 else res, input)
    # a transposed convolution is a plain one's input gradient: the direct kernel's flipped loop nest, every
    # window offset's products summed in PSUM (fp32) and rounded once
    dims = _direct_dims(input, weight, geo, groups, grad=transposed)
    if dims is not None:
        args = {"x": _as_2d(input), "w": _as_2d(weight)}
        if bias is not None:
            args["bias"] = dense(bias)
        (res,) = call_kernel(conv2d_kernel, args, {"dims": dims, "groups": groups, "flip": transposed},
                             op="aten::convolution")
        return _follow_layout(res.view(res.shape[0], res.shape[1], -1) if input.dim() == 3 else res, input)
    k, s, p, d, patch, rows = geo
    B, G = input.shape[0], groups
    w2 = _group_weight(weight, G)
    if transposed:
        OC = weight.shape[1] * G
        res = _col2im_of_rows(w2, _to_rows(input), (B, OC, *patch), k, s, p, d, rows, bias)
    else:
        OC = weight.shape[0]
        out = _rows_from_cols(w2, im2col_patches(input, k, s, p, d, rows).view(G, -1, B * math.prod(rows)))
        if bias is not None:
            out = out + bias.view(OC, 1)
        res = _from_rows(out, B, rows)
    return _follow_layout(res, input)


@lowering("convolution_backward_overrideable")
def convolution_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                         stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int, output_mask: Sequence[bool]):
    """(grad_input, grad_weight, grad_bias) of a convolution, plain or transposed: matmuls per group, im2col
    of the patch side and col2im back to it."""
    geo = _conv_geometry(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if geo is None or not floats_on_one_device(grad_output, input, weight) or grad_output.dtype != input.dtype \
            or tuple(grad_output.shape[2:]) != tuple(geo[4] if transposed else geo[5]) \
            or grad_output.shape[0] != input.shape[0]:
        return _C._fallback_convolution_backward(grad_output, input, weight, list(stride), list(padding),
                                                 list(dilation), transposed, list(output_padding), groups,
                                                 list(output_mask))
    k, s, p, d, patch, rows = geo
    B, G = input.shape[0], groups
    L = B * math.prod(rows)
    grad_input = grad_weight = grad_bias = None
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, grad_output.dim())])
    if transposed:      # the output is the patch side: its im2col serves both gradients
        cols = im2col_patches(grad_output, k, s, p, d, rows).view(G, -1, L)
        if output_mask[0]:
            grad_input = _follow_layout(_from_rows(_rows_from_cols(_group_weight(weight, G), cols), B, rows), input)
        if output_mask[1]:
            grad_weight = _weight_grad(_to_rows(input), cols, weight.shape)
    elif output_mask[1] and (dims := _im2col_dims(input, weight, geo, groups, wgrad=True)) is not None:
        x4, g4, w4 = _as_2d(input), _as_2d(grad_output), _as_2d(weight)
        gdims = _direct_dims(input, weight, geo, groups, grad=True) if output_mask[0] else None
        if gdims is not None:   # both gradients from one launch
            gi, gw = call_kernel(conv2d_im2col_backward_kernel, {"x": x4, "gy": g4, "w": w4},
                                 {"dims": dims, "gdims": gdims}, op="aten::convolution_backward")
            return _follow_layout(gi.view(input.shape), input), gw.view(weight.shape), grad_bias
        (gw,) = call_kernel(conv2d_im2col_wgrad_kernel, {"x": x4, "gy": g4},
                            {"dims": dims, "kernel": tuple(w4.shape[2:])}, op="aten::convolution_backward")
        grad_weight = gw.view(weight.shape)
        if output_mask[0]:
            grad_input = convolution_backward(grad_output, input, weight, stride, padding, dilation, transposed,
                                              output_padding, groups, (True, False, False))[0]
    elif (dims := _direct_dims(input, weight, geo, groups, wgrad=True)) is not None:
        x4, g4, w4 = _as_2d(input), _as_2d(grad_output), _as_2d(weight)
        gdims = _direct_dims(input, weight, geo, groups, grad=True) if output_mask[0] else None
        if output_mask[1] and gdims is not None:   # both gradients from one launch
            gi, gw = call_kernel(conv2d_backward_kernel, {"x": x4, "gy": g4, "w": w4},
                                 {"dims": dims, "gdims": gdims, "groups": groups}, op="aten::convolution_backward")
            return _follow_layout(gi.view(input.shape), input), gw.view(weight.shape), grad_bias
        if output_mask[1]:
            (gw,) = call_kernel(conv2d_wgrad_kernel, {"x": x4, "gy": g4},
                                {"dims": dims, "groups": groups, "kernel": tuple(w4.shape[2:])},
                                op="aten::convolution_backward")
            grad_weight = gw.view(weight.shape)
        if output_mask[0]:
            if gdims is not None:
                (gi,) = call_kernel(conv2d_kernel, {"x": g4, "w": w4}, {"dims": gdims, "groups": groups, "flip": True},
                                    op="aten::convolution_backward")
            else:
                gi = _col2im_of_rows(_group_weight(weight, G), _to_rows(grad_output), tuple(input.shape), k, s, p, d,
                                     rows)
            grad_input = _follow_layout(gi.view(input.shape), input)
    else:
        g2 = _to_rows(grad_output)
        if output_mask[1]:
            grad_weight = _weight_grad(g2, im2col_patches(input, k, s, p, d, rows).view(G, -1, L), weight.shape)
        if output_mask[0]:
            grad_input = _follow_layout(_col2im_of_rows(_group_weight(weight, G), g2, tuple(input.shape), k, s, p,
                                                        d, rows), input)
    return grad_input, grad_weight, grad_bias
