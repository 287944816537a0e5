"""Convolution, pooling, batch/group norm and dropout on the device.

PyTorch hands convolutions to a PrivateUse1 backend only through ``convolution_overrideable`` and
its backward (their default kernels raise), ``native_batch_norm`` updates running statistics that
its schema does not mark as written, and ``native_dropout`` takes no generator argument: the
generic CPU fallback cannot serve any of them. Inputs these kernels do not run on the device go
to the dedicated CPU routes of the C++ glue (``torchneuron._C._fallback_*``), which count as
fallbacks like any other.

- **Convolution** (2-D; 1-D arrives as 2-D with H = 1): im2col, then the matmul kernel. The
  patches ``cols[C, KH, KW, B, OH, OW]`` are gathered from the zero-padded input by one strided
  DMA copy per kernel row (each a 5-dim access pattern over the input), so group g's patches are
  the contiguous rows ``[g*Cg*KH*KW, (g+1)*Cg*KH*KW)`` and ``out_g = W_g[OCg, K] @ cols_g[K, L]``.
  Backward: ``grad_W_g = grad_g @ cols_g^T`` and ``grad_cols_g = W_g^T @ grad_g`` (both operands
  handed to the kernel in their stored layout), then col2im: each kernel offset's columns are added
  into a strided window view of a zero-padded gradient (one copy per kernel row when windows do
  not overlap). Stride, padding, dilation and groups are PyTorch's.
- **Max pooling**: the same window gather with -inf padding, ``max`` and ``argmax`` over the
  window axis by the reduction kernel, the argmax turned into PyTorch's flat input index by one
  element-wise launch. Backward: ``where(index == window_index[k], grad, 0)`` per window offset k,
  then col2im.
- **Average pooling** (also adaptive): separable, so ``out = Mh @ x @ Mw^T`` with 1-D band
  matrices holding 1/count (PyTorch's divisors: ``count_include_pad``, ``ceil_mode``,
  ``divisor_override``); two matmuls and two transposes, in fp32. Backward: ``Mh^T @ g @ Mw``.
- **Batch norm / group norm / var_mean**: reductions and element-wise launches following the CPU
  kernels' formulas (batch norm's output as ``x * alpha + beta``, as the CPU kernel computes it);
  statistics in fp32.
- **Dropout**: ``kernels.random.dropout_kernel`` draws the mask with the core's PRNG, seeded per
  launch from a seed the host draws from the device's generator (``torch.manual_seed`` makes it
  reproducible); the backward is ``grad * mask * scale`` in one element-wise launch.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND

import torchneuron.nki.language as nl
from torchneuron import _C
from torchneuron.kernels.random import dropout_kernel
from torchneuron.kernels.reduction import reduce_kernel
from torchneuron.ops import reduction as _reduction  # noqa: F401  (its lowerings first: var_mean below defers)
from torchneuron.ops import tilemath as tm
from torchneuron.ops.copy import device_copy, to_int64
from torchneuron.ops.kernel_call import call_kernel, dense
from torchneuron.ops.pointwise import run_pointwise
from torchneuron.ops.registry import LOWERED, cpu_fallback, lowering
from torchneuron.ops.copy import write_result as _into
from torchneuron.ops.registry import meta_twin as _meta

aten = torch.ops.aten
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
EXACT = 1 << 24          # flat indices computed in fp32 are exact below this


# ---- shared helpers ---------------------------------------------------------------------------------

def _meta_run(op: torch._ops.OpOverload, *args: Any) -> Any:
    """``op`` on meta stand-ins: raises what the CPU kernel raises for bad arguments, returns the output meta."""
    return op(*[_meta(a) for a in args])


def _on(device: torch.device, *ts: torch.Tensor | None) -> bool:
    """Every given tensor is a float tensor the device computes, on ``device``."""
    return device.type == "neuron" and all(t is None or (t.device == device and t.dtype in FLOATS) for t in ts)


def _pair(v: Any, default: Sequence[int] | None = None) -> tuple[int, int]:
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        v = default
    v = [v] if isinstance(v, int) else list(v)
    return (int(v[0]), int(v[-1]))


def _padded_size(n: int, k: int, s: int, p: int, d: int, out: int) -> int:
    """Padded extent that holds the input and every window (ceil_mode windows may end past the padding)."""
    return max(n + 2 * p, (out - 1) * s + (k - 1) * d + 1)


def _pad(x: torch.Tensor, ph: int, pw: int, Hp: int, Wp: int, fill: float) -> torch.Tensor:
    """x [B, C, H, W] inside a [B, C, Hp, Wp] tensor filled with ``fill``, at offset (ph, pw)."""
    B, C, H, W = x.shape
    if (ph, pw, Hp, Wp) == (0, 0, H, W):
        return x
    out = torch.full((B, C, Hp, Wp), fill, dtype=x.dtype, device=x.device)
    device_copy(out[:, :, ph:ph + H, pw:pw + W], x)
    return out


def _window(xp: torch.Tensor, sizes: tuple, strides: tuple, offset: int) -> torch.Tensor:
    """An as_strided view of the padded tensor ``xp`` (strides in elements of xp)."""
    return xp.as_strided(sizes, strides, xp.storage_offset() + offset)


def _im2col(x: torch.Tensor, k: tuple, s: tuple, p: tuple, d: tuple, o: tuple, fill: float = 0.0) -> torch.Tensor:
    """Patches ``cols[C, KH, KW, B, OH, OW]`` of x [B, C, H, W]: one strided DMA copy per kernel row."""
    B, C, H, W = x.shape
    (KH, KW), (sh, sw), (ph, pw), (dh, dw), (OH, OW) = k, s, p, d, o
    xp = _pad(x, ph, pw, _padded_size(H, KH, sh, ph, dh, OH), _padded_size(W, KW, sw, pw, dw, OW), fill)
    sB, sC, sH, sW = xp.stride()
    cols = torch.empty((C, KH, KW, B, OH, OW), dtype=x.dtype, device=x.device)
    for kh in range(KH):   # a [C, KW, B, OH, OW] window view: 5 dims, what one DMA access pattern holds
        device_copy(cols[:, kh], _window(xp, (C, KW, B, OH, OW), (sC, dw * sW, sB, sh * sH, sw * sW), kh * dh * sH))
    return cols


def _col2im(cols: torch.Tensor, shape: tuple, k: tuple, s: tuple, p: tuple, d: tuple) -> torch.Tensor:
    """The adjoint of ``_im2col``: sum ``cols[C, KH, KW, B, OH, OW]`` into a [B, C, H, W] gradient."""
    B, C, H, W = shape
    (KH, KW), (sh, sw), (ph, pw), (dh, dw) = k, s, p, d
    OH, OW = cols.shape[-2:]
    Hp, Wp = _padded_size(H, KH, sh, ph, dh, OH), _padded_size(W, KW, sw, pw, dw, OW)
    gp = torch.zeros((B, C, Hp, Wp), dtype=cols.dtype, device=cols.device)
    sB, sC, sH, sW = gp.stride()
    # windows of different kernel offsets overlap when the stride is below the dilated kernel extent;
    # offsets whose targets are disjoint are written by one launch
    rows_overlap = KH > 1 and sh < (KH - 1) * dh + 1
    cols_overlap = KW > 1 and sw < (KW - 1) * dw + 1
    if not rows_overlap and not cols_overlap:       # every element has one source: plain copies
        for kh in range(KH):
            device_copy(_window(gp, (C, KW, B, OH, OW), (sC, dw * sW, sB, sh * sH, sw * sW), kh * dh * sH), cols[:, kh])
    elif not cols_overlap:                          # one kernel row at a time, all its columns at once
        for kh in range(KH):
            _window(gp, (C, KW, B, OH, OW), (sC, dw * sW, sB, sh * sH, sw * sW), kh * dh * sH).add_(cols[:, kh])
    elif not rows_overlap:
        for kw in range(KW):
            _window(gp, (C, KH, B, OH, OW), (sC, dh * sH, sB, sh * sH, sw * sW), kw * dw * sW).add_(cols[:, :, kw])
    else:
        for kh in range(KH):
            for kw in range(KW):
                _window(gp, (C, B, OH, OW), (sC, sB, sh * sH, sw * sW), kh * dh * sH + kw * dw * sW).add_(
                    cols[:, kh, kw])
    if (Hp, Wp) == (H, W):
        return gp
    return dense(gp[:, :, ph:ph + H, pw:pw + W])


@functools.lru_cache(maxsize=256)
def _host_table(kind: str, *args: Any) -> torch.Tensor:
    """Host-built constant tables (band matrices, window indices), cached per shape."""
    return _TABLES[kind](*args)


_DEVICE_TABLES: dict[tuple, torch.Tensor] = {}


def _table(device: torch.device, kind: str, *args: Any) -> torch.Tensor:
    """A constant table on the device (uploaded once per device and shape)."""
    key = (device.index, kind, args)
    t = _DEVICE_TABLES.get(key)
    if t is None:
        if len(_DEVICE_TABLES) > 512:
            _DEVICE_TABLES.clear()
        t = _DEVICE_TABLES[key] = _host_table(kind, *args).to(device)
    return t


# ---- convolution ------------------------------------------------------------------------------------

def _conv_args(input: torch.Tensor, weight: torch.Tensor, stride, padding, dilation, transposed: bool,
               output_padding, groups: int):
    """The geometry of a convolution the device runs, or None (fallback)."""
    if transposed or input.dim() != 4 or weight.dim() != 4 or groups < 1 or input.numel() == 0 \
            or weight.numel() == 0 or input.dtype != weight.dtype or any(output_padding):
        return None
    k = (weight.shape[2], weight.shape[3])
    s, p, d = _pair(stride), _pair(padding), _pair(dilation)
    o = tuple((n + 2 * pp - dd * (kk - 1) - 1) // ss + 1 for n, kk, ss, pp, dd in zip(input.shape[2:], k, s, p, d))
    if min(o) <= 0 or min(s) <= 0 or min(d) <= 0 or min(p) < 0 or input.shape[1] != weight.shape[1] * groups \
            or weight.shape[0] % groups:
        return None
    return k, s, p, d, o


@lowering("convolution_overrideable")
def convolution(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                groups: int) -> torch.Tensor:
    """N-d convolution (``F.conv1d/2d``): im2col + one matmul per group; others on the CPU route."""
    geo = _conv_args(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if geo is None or not _on(input.device, input, weight, bias) or (bias is not None and bias.dtype != input.dtype):
        return _C._fallback_convolution(input, weight, bias, list(stride), list(padding), list(dilation), transposed,
                                        list(output_padding), groups)
    k, s, p, d, (OH, OW) = geo
    B, OC = input.shape[0], weight.shape[0]
    G = groups
    K, L, OCg = weight[0].numel(), B * OH * OW, OC // G
    cols = _im2col(input, k, s, p, d, (OH, OW)).view(G, K, L)
    w2 = dense(weight).view(G, OCg, K)
    out = torch.empty((OC, L), dtype=input.dtype, device=input.device)
    for g in range(G):
        torch.mm(w2[g], cols[g], out=out[g * OCg:(g + 1) * OCg])
    if bias is not None:
        out = out + bias.view(OC, 1)
    res = out.view(OC, B, OH, OW).permute(1, 0, 2, 3)
    if input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last) and not input.is_contiguous():
        return res.contiguous(memory_format=torch.channels_last)  # the output follows the input's layout, as on CPU
    return dense(res)


@lowering("convolution_backward_overrideable")
def convolution_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                         stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int, output_mask: Sequence[bool]):
    """(grad_input, grad_weight, grad_bias) of a convolution: two matmuls per group and col2im."""
    geo = _conv_args(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if geo is None or not _on(input.device, grad_output, input, weight) or grad_output.dtype != input.dtype \
            or tuple(grad_output.shape[2:]) != tuple(geo[4]):
        return _C._fallback_convolution_backward(grad_output, input, weight, list(stride), list(padding),
                                                 list(dilation), transposed, list(output_padding), groups,
                                                 list(output_mask))
    k, s, p, d, (OH, OW) = geo
    B, C = input.shape[:2]
    OC, G = weight.shape[0], groups
    K, L, OCg = weight[0].numel(), B * OH * OW, OC // G
    g2 = dense(grad_output.reshape(B, OC, OH * OW).permute(1, 0, 2)).view(OC, L)     # [OC, (b, oh, ow)]
    grad_input = grad_weight = grad_bias = None
    if output_mask[2]:
        grad_bias = grad_output.sum((0, 2, 3))
    if output_mask[1]:
        cols = _im2col(input, k, s, p, d, (OH, OW)).view(G, K, L)
        gw = torch.empty((OC, K), dtype=input.dtype, device=input.device)
        for g in range(G):
            torch.mm(g2[g * OCg:(g + 1) * OCg], cols[g].t(), out=gw[g * OCg:(g + 1) * OCg])
        grad_weight = gw.view(weight.shape)
    if output_mask[0]:
        w2 = dense(weight).view(G, OCg, K)
        gcols = torch.empty((G, K, L), dtype=input.dtype, device=input.device)
        for g in range(G):
            torch.mm(w2[g].t(), g2[g * OCg:(g + 1) * OCg], out=gcols[g])
        grad_input = _col2im(gcols.view(C, k[0], k[1], B, OH, OW), tuple(input.shape), k, s, p, d)
    return grad_input, grad_weight, grad_bias


# ---- max pooling --------------------------------------------------------------------------------------

def _pool_geometry(kernel_size, stride, padding, dilation=1) -> tuple:
    """(kernel, stride, padding, dilation) pairs; an empty stride means the kernel size."""
    k = _pair(kernel_size)
    return k, _pair(stride, k), _pair(padding), _pair(dilation)


def _window_index(H: int, W: int, k: tuple, s: tuple, p: tuple, d: tuple, o: tuple) -> torch.Tensor:
    """int32 [K, 1, OH*OW]: the flat input index (h * W + w) each window offset reads; -1 in the padding."""
    (KH, KW), (OH, OW) = k, o
    kh = torch.arange(KH).view(KH, 1, 1, 1)
    kw = torch.arange(KW).view(1, KW, 1, 1)
    h = torch.arange(OH).view(1, 1, OH, 1) * s[0] - p[0] + kh * d[0]
    w = torch.arange(OW).view(1, 1, 1, OW) * s[1] - p[1] + kw * d[1]
    idx = torch.where((h >= 0) & (h < H) & (w >= 0) & (w < W), h * W + w, -1)
    return idx.to(torch.int32).reshape(KH * KW, 1, OH * OW)


def _window_base(H: int, W: int, s: tuple, p: tuple, o: tuple) -> torch.Tensor:
    """fp32 [1, OH*OW]: the flat index of each window's first (padded) element."""
    h = torch.arange(o[0]).view(-1, 1) * s[0] - p[0]
    w = torch.arange(o[1]).view(1, -1) * s[1] - p[1]
    return (h * W + w).to(torch.float32).reshape(1, -1)


@functools.lru_cache(maxsize=None)
def _pool_index_fn(KW: int, A: int, dw: int):
    """Tile function: flat input index of window offset ``k``, ``base + kh * A + k * dw`` with kh = k // KW
    (the constants depend only on the geometry, which the Program is traced for anyway)."""
    def pool_index(k, base):
        kh = tm.floor(nl.multiply(nl.add(k, 0.5), 1.0 / KW))   # k >= 0 and small: exact
        return nl.add(nl.add(nl.multiply(kh, float(A)), nl.multiply(k, float(dw))), base)
    return pool_index


_TABLES: dict = {"window_index": _window_index, "window_base": _window_base}


def _max_pool_ok(x: torch.Tensor) -> bool:
    return _on(x.device, x) and x.dim() in (3, 4) and x.numel() > 0 and x.shape[-1] * x.shape[-2] < EXACT


def _max_pool(self: torch.Tensor, kernel_size, stride, padding, dilation, ceil_mode):
    meta, _ = _meta_run(aten.max_pool2d_with_indices.default, self, kernel_size, stride, padding, dilation, ceil_mode)
    k, s, p, d = _pool_geometry(kernel_size, stride, padding, dilation)
    H, W = self.shape[-2:]
    OH, OW = meta.shape[-2:]
    BC = self.numel() // (H * W)
    cols = _im2col(self.reshape(BC, 1, H, W), k, s, p, d, (OH, OW), fill=float("-inf"))
    view = cols.view(1, k[0] * k[1], BC * OH * OW)
    (values,) = call_kernel(reduce_kernel, {"x": view}, {"op": "max"}, op="aten::max_pool2d_with_indices")
    (arg,) = call_kernel(reduce_kernel, {"x": view}, {"op": "argmax"}, op="aten::max_pool2d_with_indices")
    base = _table(self.device, "window_base", H, W, s, p, (OH, OW))
    flat = run_pointwise(_pool_index_fn(k[1], d[0] * W - k[1] * d[1], d[1]), [arg.view(BC, OH * OW), base],
                         KIND.DEFAULT, result_dtype=torch.float32, op="aten::max_pool2d_with_indices")
    return values.view(meta.shape), to_int64(flat).view(meta.shape)


@lowering("max_pool2d_with_indices")
def max_pool2d_with_indices(self: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,), ceil_mode: bool = False):
    """(values, flat input indices) of 2-D max pooling: window gather, max and argmax reductions."""
    shape = _meta_run(aten.max_pool2d_with_indices.default, self, kernel_size, stride, padding, dilation,
                      ceil_mode)[0].shape                         # the CPU's errors for bad arguments
    if self.numel() == 0 and _on(self.device, self):
        return (torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=torch.int64, device=self.device))
    if not _max_pool_ok(self):
        return cpu_fallback(aten.max_pool2d_with_indices.default, self, kernel_size, stride, padding, dilation,
                            ceil_mode)
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode)


@lowering("max_pool2d_with_indices.out")
def max_pool2d_with_indices_out(self: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
                                padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,), ceil_mode: bool = False,
                                *, out: torch.Tensor, indices: torch.Tensor):
    """``max_pool2d_with_indices`` into ``out`` and ``indices``."""
    if not _max_pool_ok(self) or out.device != self.device or indices.device != self.device \
            or out.dtype != self.dtype or indices.dtype != torch.int64:
        return cpu_fallback(aten.max_pool2d_with_indices.out, self, kernel_size, stride, padding, dilation, ceil_mode,
                            out=out, indices=indices)
    values, idx = _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode)
    return _into(values, out), _into(idx, indices)


def _max_pool_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    _meta_run(aten.max_pool2d_with_indices_backward.default, grad_output, self, kernel_size, stride, padding, dilation,
              ceil_mode, indices)
    k, s, p, d = _pool_geometry(kernel_size, stride, padding, dilation)
    H, W = self.shape[-2:]
    OH, OW = grad_output.shape[-2:]
    BC = self.numel() // (H * W)
    # the low int32 words of the int64 indices (indices are below 2**24)
    low = dense(indices.reshape(BC, OH * OW)).view(torch.int32).view(1, BC, OH * OW, 2)[..., 0]
    table = _table(self.device, "window_index", H, W, k, s, p, d, (OH, OW))           # [K, 1, OH*OW]
    g = grad_output.reshape(1, BC, OH * OW)
    contrib = torch.where(low == table, g, 0)                                          # [K, BC, OH*OW]
    cols = contrib.view(1, k[0], k[1], BC, OH, OW)
    return _col2im(cols, (BC, 1, H, W), k, s, p, d).view(self.shape)


def _max_pool_backward_ok(grad_output, self, indices) -> bool:
    return (_max_pool_ok(self) and _on(self.device, grad_output) and grad_output.dtype == self.dtype
            and indices.device == self.device and indices.dtype == torch.int64
            and tuple(indices.shape) == tuple(grad_output.shape))


@lowering("max_pool2d_with_indices_backward")
def max_pool2d_with_indices_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: Sequence[int],
                                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                                     ceil_mode: bool, indices: torch.Tensor) -> torch.Tensor:
    """Gradient of max pooling: each output's gradient added at its argmax (window compare, then col2im)."""
    if not _max_pool_backward_ok(grad_output, self, indices):
        return cpu_fallback(aten.max_pool2d_with_indices_backward.default, grad_output, self, kernel_size, stride,
                            padding, dilation, ceil_mode, indices)
    return _max_pool_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices)


@lowering("max_pool2d_with_indices_backward.grad_input")
def max_pool2d_with_indices_backward_out(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: Sequence[int],
                                         stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                                         ceil_mode: bool, indices: torch.Tensor, *,
                                         grad_input: torch.Tensor) -> torch.Tensor:
    """``max_pool2d_with_indices_backward`` into ``grad_input``."""
    if not _max_pool_backward_ok(grad_output, self, indices) or grad_input.device != self.device:
        return cpu_fallback(aten.max_pool2d_with_indices_backward.grad_input, grad_output, self, kernel_size, stride,
                            padding, dilation, ceil_mode, indices, grad_input=grad_input)
    return _into(_max_pool_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices),
                 grad_input)


# ---- average pooling (separable band matrices) ------------------------------------------------------

def _avg_band(n: int, out: int, k: int, s: int, p: int, count_include_pad: bool, scale: float) -> torch.Tensor:
    """fp32 [out, n]: row o averages the window of output o along one dim, with PyTorch's divisor
    (the 2-D divisor is the product of the two dims' counts); ``scale`` replaces 1/count when non-zero."""
    m = torch.zeros(out, n, dtype=torch.float64)
    for o in range(out):
        start = o * s - p
        end = min(start + k, n + p)
        size = end - start
        lo, hi = max(start, 0), min(end, n)
        if hi > lo:
            m[o, lo:hi] = scale if scale else 1.0 / (size if count_include_pad else hi - lo)
    return m.to(torch.float32)


def _adaptive_band(n: int, out: int) -> torch.Tensor:
    """fp32 [out, n]: row o averages input [floor(o*n/out), ceil((o+1)*n/out))."""
    m = torch.zeros(out, n, dtype=torch.float64)
    for o in range(out):
        lo, hi = (o * n) // out, -(-((o + 1) * n) // out)
        m[o, lo:hi] = 1.0 / (hi - lo)
    return m.to(torch.float32)


_TABLES.update(avg_band=_avg_band, adaptive_band=_adaptive_band)


def _separable(x: torch.Tensor, mh: torch.Tensor, mw: torch.Tensor) -> torch.Tensor:
    """``mh @ x[i] @ mw^T`` for every plane of x [BC, H, W] (fp32): two matmuls, two transposes."""
    BC, H, W = x.shape
    OH, OW = mh.shape[0], mw.shape[0]
    y = dense(x).view(BC * H, W) @ mw.t()                                    # [BC*H, OW]
    y = dense(y.view(BC, H, OW).transpose(1, 2)).view(BC * OW, H) @ mh.t()   # [BC*OW, OH]
    return dense(y.view(BC, OW, OH).transpose(1, 2))


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def _avg_matrices(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, out_hw):
    k, s, p, _ = _pool_geometry(kernel_size, stride, padding)
    H, W = self.shape[-2:]
    scale = 1.0 / divisor_override if divisor_override else 0.0
    mh = _table(self.device, "avg_band", H, out_hw[0], k[0], s[0], p[0], count_include_pad, scale)
    mw = _table(self.device, "avg_band", W, out_hw[1], k[1], s[1], p[1], count_include_pad, 1.0 if scale else 0.0)
    return mh, mw


def _avg_ok(x: torch.Tensor) -> bool:
    return _on(x.device, x) and x.dim() in (3, 4) and x.numel() > 0


def _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    meta = _meta_run(aten.avg_pool2d.default, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)
    mh, mw = _avg_matrices(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                           meta.shape[-2:])
    H, W = self.shape[-2:]
    res = _separable(_f32(self).reshape(-1, H, W), mh, mw)
    return res.to(self.dtype).view(meta.shape)


@lowering("avg_pool2d")
def avg_pool2d(self: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
               padding: Sequence[int] = (0,), ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None) -> torch.Tensor:
    """2-D average pooling as ``Mh @ x @ Mw^T`` (band matrices of 1/count)."""
    shape = _meta_run(aten.avg_pool2d.default, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                      divisor_override).shape                     # the CPU's errors for bad arguments
    if self.numel() == 0 and _on(self.device, self):
        return torch.empty(shape, dtype=self.dtype, device=self.device)
    if not _avg_ok(self):
        return cpu_fallback(aten.avg_pool2d.default, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                            divisor_override)
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lowering("avg_pool2d.out")
def avg_pool2d_out(self: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
                   padding: Sequence[int] = (0,), ceil_mode: bool = False, count_include_pad: bool = True,
                   divisor_override: int | None = None, *, out: torch.Tensor) -> torch.Tensor:
    """``avg_pool2d`` into ``out``."""
    if not _avg_ok(self) or out.device != self.device or out.dtype != self.dtype:
        return cpu_fallback(aten.avg_pool2d.out, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                            divisor_override, out=out)
    return _into(_avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override), out)


def _avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                       divisor_override):
    _meta_run(aten.avg_pool2d_backward.default, grad_output, self, kernel_size, stride, padding, ceil_mode,
              count_include_pad, divisor_override)
    mh, mw = _avg_matrices(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                           grad_output.shape[-2:])
    OH, OW = grad_output.shape[-2:]
    res = _separable(_f32(grad_output).reshape(-1, OH, OW), mh.t(), mw.t())
    return res.to(self.dtype).view(self.shape)


def _avg_backward_ok(grad_output, self) -> bool:
    return _avg_ok(self) and _on(self.device, grad_output) and grad_output.dtype == self.dtype


@lowering("avg_pool2d_backward")
def avg_pool2d_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: Sequence[int],
                        stride: Sequence[int], padding: Sequence[int], ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None) -> torch.Tensor:
    """Gradient of average pooling: ``Mh^T @ g @ Mw``."""
    if not _avg_backward_ok(grad_output, self):
        return cpu_fallback(aten.avg_pool2d_backward.default, grad_output, self, kernel_size, stride, padding,
                            ceil_mode, count_include_pad, divisor_override)
    return _avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)


@lowering("avg_pool2d_backward.grad_input")
def avg_pool2d_backward_out(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: Sequence[int],
                            stride: Sequence[int], padding: Sequence[int], ceil_mode: bool, count_include_pad: bool,
                            divisor_override: int | None, *, grad_input: torch.Tensor) -> torch.Tensor:
    """``avg_pool2d_backward`` into ``grad_input``."""
    if not _avg_backward_ok(grad_output, self) or grad_input.device != self.device:
        return cpu_fallback(aten.avg_pool2d_backward.grad_input, grad_output, self, kernel_size, stride, padding,
                            ceil_mode, count_include_pad, divisor_override, grad_input=grad_input)
    return _into(_avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                    divisor_override), grad_input)


@lowering("_adaptive_avg_pool2d")
def adaptive_avg_pool2d(self: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    """Adaptive average pooling as ``Mh @ x @ Mw^T`` (PyTorch's floor/ceil windows)."""
    if not _avg_ok(self):
        return cpu_fallback(aten._adaptive_avg_pool2d.default, self, output_size)
    meta = _meta_run(aten._adaptive_avg_pool2d.default, self, output_size)
    H, W = self.shape[-2:]
    OH, OW = meta.shape[-2:]
    mh = _table(self.device, "adaptive_band", H, OH)
    mw = _table(self.device, "adaptive_band", W, OW)
    return _separable(_f32(self).reshape(-1, H, W), mh, mw).to(self.dtype).view(meta.shape)


@lowering("_adaptive_avg_pool2d_backward")
def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    """Gradient of adaptive average pooling: ``Mh^T @ g @ Mw``."""
    if not _avg_backward_ok(grad_output, self) or grad_output.dim() != self.dim():
        return cpu_fallback(aten._adaptive_avg_pool2d_backward.default, grad_output, self)
    H, W = self.shape[-2:]
    OH, OW = grad_output.shape[-2:]
    mh = _table(self.device, "adaptive_band", H, OH)
    mw = _table(self.device, "adaptive_band", W, OW)
    res = _separable(_f32(grad_output).reshape(-1, OH, OW), mh.t(), mw.t())
    return res.to(self.dtype).view(self.shape)


# ---- batch norm, group norm, var_mean -------------------------------------------------------------------

def _stat_dtype(input: torch.Tensor, *params: torch.Tensor | None) -> torch.dtype:
    """The dtype of the saved statistics: fp32 when a reduced-precision input meets fp32 parameters (the CPU
    kernel's mixed mode), else the input's."""
    if input.dtype != torch.float32 and any(t is not None and t.dtype == torch.float32 for t in params):
        return torch.float32
    return input.dtype


@lowering("native_batch_norm")
def native_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                      momentum: float, eps: float):
    """(out, save_mean, save_invstd); in training, updates the running statistics in place."""
    ok = (_on(input.device, input, weight, bias, running_mean, running_var) and input.dim() >= 2
          and input.numel() > 0 and (training or (running_mean is not None and running_var is not None)))
    if not ok:
        return _C._fallback_native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    _meta_run(aten.native_batch_norm.default, input, weight, bias, running_mean, running_var, training, momentum, eps)
    C = input.shape[1]
    dims = [0, *range(2, input.dim())]
    shape = [1, C] + [1] * (input.dim() - 2)
    sdt = _stat_dtype(input, weight, bias, running_mean, running_var)
    if training:
        x = _f32(input)
        n = input.numel() // C
        mean = x.mean(dims)
        dev = x - mean.view(shape)
        var = (dev * dev).mean(dims)
        invstd = (var + eps).rsqrt()
        with torch.no_grad():
            if running_mean is not None:   # running = (1 - momentum) * running + momentum * batch
                running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            if running_var is not None:    # with the unbiased variance
                running_var.mul_(1 - momentum).add_(var, alpha=momentum * n / max(n - 1, 1))
        save_mean, save_invstd = mean.to(sdt), invstd.to(sdt)
    else:
        mean, invstd = _f32(running_mean), (_f32(running_var) + eps).rsqrt()
        save_mean = torch.empty((0,), dtype=sdt, device=input.device)
        save_invstd = torch.empty((0,), dtype=sdt, device=input.device)
    # out = x * alpha + beta with alpha = invstd * w, beta = b - mean * alpha (the CPU kernel's form)
    alpha = invstd * _f32(weight) if weight is not None else invstd
    beta = -mean * alpha if bias is None else _f32(bias) - mean * alpha
    out = torch.addcmul(beta.view(shape), input, alpha.view(shape))
    return out.to(input.dtype), save_mean, save_invstd


@lowering("native_batch_norm_backward")
def native_batch_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None,
                               running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                               save_mean: torch.Tensor | None, save_invstd: torch.Tensor | None, train: bool,
                               eps: float, output_mask: Sequence[bool]):
    """(grad_input, grad_weight, grad_bias) of batch norm, from the saved (train) or running (eval) statistics."""
    stats = (save_mean, save_invstd) if train else (running_mean, running_var)
    ok = (_on(input.device, grad_out, input, weight, *stats) and input.dim() >= 2 and input.numel() > 0
          and all(t is not None and t.numel() == input.shape[1] for t in stats))
    if not ok:
        return cpu_fallback(aten.native_batch_norm_backward.default, grad_out, input, weight, running_mean,
                            running_var, save_mean, save_invstd, train, eps, output_mask)
    C = input.shape[1]
    dims = [0, *range(2, input.dim())]
    shape = [1, C] + [1] * (input.dim() - 2)
    n = input.numel() // C
    if train:
        mean, invstd = _f32(save_mean), _f32(save_invstd)
    else:
        mean, invstd = _f32(running_mean), (_f32(running_var) + eps).rsqrt()
    x, g = _f32(input), _f32(grad_out)
    dev = x - mean.view(shape)
    sum_g = g.sum(dims)
    dot = (g * dev).sum(dims)
    w = _f32(weight) if weight is not None else None
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


@lowering("native_group_norm_backward")
def native_group_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                               weight: torch.Tensor | None, N: int, C: int, HxW: int, group: int,
                               output_mask: Sequence[bool]):
    """(grad_input, grad_weight, grad_bias) of group norm, from the forward's mean and 1/std per (n, group)."""
    ok = (_on(input.device, grad_out, input, mean, rstd, weight) and input.numel() > 0 and group > 0
          and C % group == 0 and input.numel() == N * C * HxW)
    if not ok:
        return cpu_fallback(aten.native_group_norm_backward.default, grad_out, input, mean, rstd, weight, N, C, HxW,
                            group, output_mask)
    G = group
    x = _f32(input).reshape(N, G, C // G, HxW)
    g = _f32(grad_out).reshape(N, G, C // G, HxW)
    xhat = (x - _f32(mean).view(N, G, 1, 1)) * _f32(rstd).view(N, G, 1, 1)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:   # rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) over each group, gw = g * weight
        gw = g * _f32(weight).view(1, G, C // G, 1) if weight is not None else g
        m1 = gw.mean((2, 3), keepdim=True)
        m2 = (gw * xhat).mean((2, 3), keepdim=True)
        gi = (gw - m1 - xhat * m2) * _f32(rstd).view(N, G, 1, 1)
        grad_input = gi.to(input.dtype).view(input.shape)
    pdt = weight.dtype if weight is not None else input.dtype
    if output_mask[1]:
        grad_weight = (g * xhat).reshape(N, C, HxW).sum((0, 2)).to(pdt)
    if output_mask[2]:
        grad_bias = g.reshape(N, C, HxW).sum((0, 2)).to(pdt)
    return grad_input, grad_weight, grad_bias


def _var_mean(self: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False):
    """(var, mean) over ``dim``: the device's var and mean reductions."""
    if not _on(self.device, self):
        return cpu_fallback(aten.var_mean.correction, self, dim, correction=correction, keepdim=keepdim)
    var = torch.var(self, dim, correction=correction, keepdim=keepdim)
    dims = [] if dim is None else dim
    mean = self.mean(dims, keepdim=keepdim) if dims else self.mean().reshape([1] * self.dim() if keepdim else [])
    return var, mean


if "var_mean.correction" not in LOWERED:   # the reduction module may lower it itself
    lowering("var_mean.correction")(_var_mean)


# ---- dropout --------------------------------------------------------------------------------------

def _draw_seed(device: torch.device) -> int:
    """A 31-bit seed drawn from the device's default generator (advancing it), for one dropout launch."""
    from torchneuron.neuron.random import default_generators
    gen = default_generators[device.index]
    host = torch.Generator()
    host.set_state(gen.get_state())
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=host).item())
    gen.set_state(host.get_state())
    return seed


@lowering("native_dropout")
def native_dropout(input: torch.Tensor, p: float, train: bool | None):
    """(out, mask) of dropout, the mask drawn on the device from the neuron generator."""
    if not _on(input.device, input) or input.numel() == 0 or not 0.0 <= p <= 1.0:
        return _C._fallback_native_dropout(input, p, train)
    if train is not None and not train:
        return input.clone(), torch.ones(input.shape, dtype=torch.bool, device=input.device)
    keep = 1.0 - p
    scale = 0.0 if keep == 0.0 else 1.0 / keep
    dev = input.device
    seed = torch.tensor([[_draw_seed(dev)]], dtype=torch.int32).to(dev)
    out, mask = call_kernel(dropout_kernel, {"x": dense(input).reshape(-1), "seed": seed,
                                             "p": torch.tensor([[p]], dtype=torch.float32).to(dev),
                                             "scale": torch.tensor([[scale]], dtype=torch.float32).to(dev)},
                            op="aten::native_dropout")
    return out.view(input.shape), mask.view(input.shape)


def _dropout_grad_tile(g, m, s):
    """``g * mask * scale`` (the mask loads as 0.0 / 1.0)."""
    return nl.multiply(nl.multiply(g, m), s)


@lowering("native_dropout_backward")
def native_dropout_backward(grad_output: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``grad * mask * scale`` in one element-wise launch."""
    if not _on(grad_output.device, grad_output) or mask.device != grad_output.device or mask.dtype != torch.bool:
        return cpu_fallback(aten.native_dropout_backward.default, grad_output, mask, scale)
    return run_pointwise(_dropout_grad_tile, [grad_output, mask, float(scale)], KIND.DEFAULT,
                         result_dtype=grad_output.dtype, op="aten::native_dropout_backward")


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
