"""Pooling on the device: max pooling (2-D and 3-D), average pooling (also adaptive), ``im2col`` /
``col2im`` (``F.unfold`` / ``F.fold``).

- **Max pooling**: 2-D in one launch (``kernels.pooling.max_pool2d_kernel``: planes on the partitions, the
  CPU's rule per window offset, values and int64 indices written by the kernel). 3-D, and 2-D rows too wide
  for SBUF: the window gather (``windows.im2col_patches``) with -inf padding, ``max`` and ``argmax`` over the
  window axis by the reduction kernel, the argmax turned into PyTorch's flat input index by one element-wise
  launch, with the CPU's rule for NaN (its last NaN's index: one more element-wise launch and a max over the
  window axis find it) and for windows of -inf (their first element inside the input). Backward: 2-D in one
  launch where a partition's planes fit SBUF (``kernels.pooling.max_pool2d_backward_kernel``: per window offset
  the gradients whose index is that offset's element, placed or summed in fp32); else ``where(index ==
  window_index[k], grad, 0)`` per window offset k, then col2im.
- **Average pooling** (n-D): window sums of the zero-padded im2col patches (one reduction over the window
  axis) divided by the CPU kernels' divisors (``count_include_pad``, ``ceil_mode``, ``divisor_override``),
  so a NaN or inf stays in the windows that hold it. Backward: each window's gradient over its divisor,
  spread back over the window by col2im.
- **Adaptive average pooling**: window sums when every size divides evenly (a global pool too); otherwise
  ``Mh @ x @ Mw^T`` with PyTorch's floor/ceil windows as band matrices of 1/count (two matmuls and two
  transposes in fp32, through which a NaN or inf spreads over its plane). Backward: ``Mh^T @ g @ Mw``.
- ``im2col`` / ``col2im``: the same gather and scatter with the batch dim first.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND

import torchneuron.nki.language as nl
from torchneuron.kernels.conv import Dim
from torchneuron.kernels.pooling import (max_pool2d_backward_kernel, max_pool2d_kernel, max_pool_backward_fits,
                                        max_pool_fits)
from torchneuron.kernels.reduction import reduce_kernel
from torchneuron.kernels import tilemath as tm
from torchneuron.ops.base import aten, device_table, floats_on_one_device, meta_run, meta_run_cached, Unsupported
from torchneuron.ops.elementwise import dense, run_pointwise, to_int64
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering, register_out
from torchneuron.ops.windows import as_float32, col2im_patches, im2col_patches, int_tuple


EXACT = 1 << 24          # flat indices computed in fp32 are exact below this


# ---- max pooling --------------------------------------------------------------------------------------

def _pool_geometry(n: int, kernel_size, stride, padding, dilation=1) -> tuple:
    """(kernel, stride, padding, dilation) n-tuples; an empty stride means the kernel size."""
    k = int_tuple(kernel_size, n)
    return k, int_tuple(stride, n, k), int_tuple(padding, n), int_tuple(dilation, n)


@functools.lru_cache(maxsize=256)
def _window_index(S: tuple, k: tuple, s: tuple, p: tuple, d: tuple, o: tuple) -> torch.Tensor:
    """int32 [K, 1, prod(O)]: the flat input index each window offset reads (row-major over S); -1 in the
    padding."""
    n = len(S)
    idx = torch.zeros([1] * (2 * n), dtype=torch.int64)
    inside = torch.ones([1] * (2 * n), dtype=torch.bool)
    for i in range(n):   # dims (k_0..k_{n-1}, o_0..o_{n-1}); position along dim i of offset k_i, window o_i
        shape_k, shape_o = [1] * (2 * n), [1] * (2 * n)
        shape_k[i], shape_o[n + i] = k[i], o[i]
        pos = torch.arange(o[i]).view(shape_o) * s[i] - p[i] + torch.arange(k[i]).view(shape_k) * d[i]
        inside = inside & (pos >= 0) & (pos < S[i])
        idx = idx * S[i] + pos
    idx = torch.where(inside, idx, -1)
    return idx.to(torch.int32).reshape(math.prod(k), 1, math.prod(o))


@functools.lru_cache(maxsize=256)
def _window_base(S: tuple, s: tuple, p: tuple, o: tuple) -> torch.Tensor:
    """fp32 [1, prod(O)]: the flat index of each window's first (padded) element."""
    n = len(S)
    base = torch.zeros([1] * n, dtype=torch.int64)
    for i in range(n):
        shape = [1] * n
        shape[i] = o[i]
        base = base * S[i] + torch.arange(o[i]).view(shape) * s[i] - p[i]
    return base.to(torch.float32).reshape(1, -1)


@functools.lru_cache(maxsize=256)
def _window_first_f32(S: tuple, k: tuple, s: tuple, p: tuple, d: tuple, o: tuple) -> torch.Tensor:
    """fp32 [1, prod(O)]: ``_window_first`` for the fp32 index arithmetic."""
    return _window_first(S, k, s, p, d, o).to(torch.float32).reshape(1, -1)


@functools.lru_cache(maxsize=64)
def _offsets_from_one(K: int) -> torch.Tensor:
    """fp32 [K, 1]: 1, 2, .., K (a window offset plus one, so 0 can mean "none")."""
    return torch.arange(1, K + 1, dtype=torch.float32).view(K, 1)


def _nan_offset(x, offset):
    """Tile function: ``offset`` where x is NaN, else 0."""
    return tm.where(tm.isnan(x), offset, nl.multiply(offset, 0.0))


@functools.lru_cache(maxsize=None)
def _pool_index_fn(k: tuple, steps: tuple):
    """Tile function: flat input index of window offset ``j``, ``base + sum_i j_i * steps[i]`` with
    ``(j_0, .., j_n-1)`` the digits of j in the mixed radix k (constants of the geometry, which the Program
    is traced for anyway). The CPU's scan takes every NaN (so its last NaN wins: offset ``last_nan - 1`` where
    ``last_nan`` > 0) and keeps the window's first element inside the input while nothing beats -inf (``first``
    where the maximum ``value`` is -inf, where argmax gave the first, perhaps padded, offset)."""
    def pool_index(j, base, last_nan, value, first):
        j = tm.where(nl.greater(last_nan, 0.0), nl.subtract(last_nan, 1.0), nl.add(j, 0.0))
        acc = base
        for i in range(len(k) - 1):
            radix = math.prod(k[i + 1:])
            digit = tm.floor(nl.multiply(nl.add(j, 0.5), 1.0 / radix))   # j >= 0 and small: exact
            acc = nl.add(acc, nl.multiply(digit, float(steps[i])))
            j = nl.subtract(j, nl.multiply(digit, float(radix)))
        acc = nl.add(acc, nl.multiply(j, float(steps[-1])))
        return tm.where(nl.equal(value, -math.inf), first, acc)
    return pool_index


_MAX_POOL = {2: (aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward),
             3: (aten.max_pool3d_with_indices, aten.max_pool3d_with_indices_backward)}


def _max_pool_ok(x: torch.Tensor, n: int) -> bool:
    """An n-D max pooling the device runs: a float input with its flat spatial indices exact in fp32."""
    return floats_on_one_device(x) and x.dim() in (n + 1, n + 2) and x.numel() > 0 and math.prod(x.shape[-n:]) < EXACT


@functools.lru_cache(maxsize=256)
def _window_first(S: tuple, k: tuple, s: tuple, p: tuple, d: tuple, o: tuple) -> torch.Tensor:
    """int32 [prod(O)]: the flat index of each window's first element inside the input (the CPU's starting index:
    a window of -inf keeps it)."""
    idx = torch.zeros([1] * len(S), dtype=torch.int64)
    for i in range(len(S)):
        start = torch.arange(o[i]) * s[i] - p[i]
        start = torch.where(start < 0, start + (-start + d[i] - 1) // d[i] * d[i], start)   # first dilated step >= 0
        shape = [1] * len(S)
        shape[i] = o[i]
        idx = idx * S[i] + start.view(shape)
    return idx.to(torch.int32).reshape(-1)


def _pool_dims(S: tuple, k: tuple, s: tuple, p: tuple, d: tuple, O: tuple) -> tuple:
    """The (H, W) ``Dim`` pair of a 2-D pooling of S into O (padding after the input: whatever ceil_mode reads)."""
    return tuple(Dim(S[i], 1, p[i], (O[i] - 1) * s[i] + d[i] * (k[i] - 1) + 1 - S[i] - p[i], k[i], d[i], s[i])
                 for i in range(2))


def _max_pool2d_direct(self: torch.Tensor, k: tuple, s: tuple, p: tuple, d: tuple, O: tuple):
    """(values, int64 indices) of 2-D max pooling by ``max_pool2d_kernel`` (one launch), or None where its bands
    do not fit SBUF."""
    S = tuple(self.shape[-2:])
    dims = _pool_dims(S, k, s, p, d, O)
    if not max_pool_fits(*dims, self.element_size()):
        return None
    args = {"x": dense(self).view(-1, *S)}
    if any(p):
        args["first"] = device_table(self.device, _window_first, S, k, s, p, d, O)
    values, words = call_kernel(max_pool2d_kernel, args, {"dims": dims}, op="aten::max_pool2d_with_indices")
    return values, words.view(torch.int64).view(values.shape)


def _max_pool(n: int, self: torch.Tensor, kernel_size, stride, padding, dilation, ceil_mode):
    """(values, int64 flat indices) of n-D max pooling on the device."""
    op = f"aten::max_pool{n}d_with_indices"
    meta, _ = meta_run_cached(_MAX_POOL[n][0].default, self, kernel_size, stride, padding, dilation, ceil_mode)
    k, s, p, d = _pool_geometry(n, kernel_size, stride, padding, dilation)
    S, O = tuple(self.shape[-n:]), tuple(meta.shape[-n:])
    if n == 2 and (direct := _max_pool2d_direct(self, k, s, p, d, O)) is not None:
        values, indices = direct
        return values.view(meta.shape), indices.view(meta.shape)
    BC = self.numel() // math.prod(S)
    cols = im2col_patches(self.reshape(BC, 1, *S), k, s, p, d, O, fill=float("-inf"))
    view = cols.view(1, math.prod(k), BC * math.prod(O))
    (values,) = call_kernel(reduce_kernel, {"x": view}, {"op": "max"}, op=op)
    (arg,) = call_kernel(reduce_kernel, {"x": view}, {"op": "argmax"}, op=op)
    K, P = math.prod(k), math.prod(O)
    nan_at = run_pointwise(_nan_offset, [cols.view(K, BC * P), device_table(self.device, _offsets_from_one, K)],
                           KIND.DEFAULT, result_dtype=torch.float32, op=op)
    (last_nan,) = call_kernel(reduce_kernel, {"x": nan_at.view(1, K, BC * P)}, {"op": "max"}, op=op)
    base = device_table(self.device, _window_base, S, s, p, O)
    first = device_table(self.device, _window_first_f32, S, k, s, p, d, O)
    steps = tuple(dd * math.prod(S[i + 1:]) for i, dd in enumerate(d))
    flat = run_pointwise(_pool_index_fn(k, steps), [arg.view(BC, P), base, last_nan.view(BC, P),
                                                    values.view(BC, P), first], KIND.DEFAULT,
                         result_dtype=torch.float32, op=op)
    return values.view(meta.shape), to_int64(flat).view(meta.shape)


def _max_pool_forward(n: int, self, kernel_size, stride, padding, dilation, ceil_mode):
    """``max_pool{n}d_with_indices``: the CPU's errors, empty inputs, the device or the fallback."""
    if self.dim() not in (n + 1, n + 2):      # (the meta kernel raises IndexError for too few dims)
        raise RuntimeError(f"non-empty {n + 1}D or {n + 2}D (batch mode) tensor expected for input")
    shape = meta_run_cached(_MAX_POOL[n][0].default, self, kernel_size, stride, padding, dilation,
                             ceil_mode)[0].shape                  # the CPU's errors for bad arguments
    if self.numel() == 0 and floats_on_one_device(self):
        return (torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=torch.int64, device=self.device))
    if not _max_pool_ok(self, n):
        raise Unsupported("a tensor or dtype the device pooling does not take")
    return _max_pool(n, self, kernel_size, stride, padding, dilation, ceil_mode)


@lowering("max_pool2d_with_indices")
def max_pool2d_with_indices(self: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,), ceil_mode: bool = False):
    """(values, flat input indices) of 2-D max pooling: window gather, max and argmax reductions."""
    return _max_pool_forward(2, self, kernel_size, stride, padding, dilation, ceil_mode)


@lowering("max_pool3d_with_indices")
def max_pool3d_with_indices(self: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,), ceil_mode: bool = False):
    """(values, flat input indices) of 3-D max pooling: window gather, max and argmax reductions."""
    return _max_pool_forward(3, self, kernel_size, stride, padding, dilation, ceil_mode)


register_out("max_pool2d_with_indices.out", max_pool2d_with_indices, warn_resize=False)   # the CPU resizes quietly
register_out("max_pool3d_with_indices.out", max_pool3d_with_indices, warn_resize=False)   # the CPU resizes quietly


def _max_pool_backward(n: int, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Gradient of n-D max pooling on the device: 2-D in one launch where the planes fit SBUF, else a window
    compare against the indices, then col2im."""
    meta_run_cached(_MAX_POOL[n][1].default, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode,
                    indices)
    k, s, p, d = _pool_geometry(n, kernel_size, stride, padding, dilation)
    S, O = tuple(self.shape[-n:]), tuple(grad_output.shape[-n:])
    BC, L = self.numel() // math.prod(S), math.prod(O)
    if n == 2 and max_pool_backward_fits(BC, *(dims := _pool_dims(S, k, s, p, d, O))):
        words = dense(indices).view(torch.int32).view(BC, *O, 2)
        (grad,) = call_kernel(max_pool2d_backward_kernel, {"gy": dense(grad_output).view(BC, *O), "words": words},
                              {"dims": dims}, op="aten::max_pool2d_with_indices_backward")
        return grad.view(self.shape)
    # the low int32 words of the int64 indices (indices are below 2**24)
    low = dense(indices.reshape(BC, L)).view(torch.int32).view(1, BC, L, 2)[..., 0]
    table = device_table(self.device, _window_index, S, k, s, p, d, O)           # [K, 1, prod(O)]
    # overlapping windows' bf16/fp16 gradients summed in fp32 and rounded once: at least as exact as the CPU's
    contrib = torch.where(low == table, as_float32(grad_output).reshape(1, BC, L), 0)   # [K, BC, prod(O)]
    grad = col2im_patches(contrib.view(1, *k, BC, *O), (BC, 1, *S), k, s, p, d).view(self.shape)
    return grad.to(self.dtype)


def _max_pool_backward_ok(n: int, grad_output, self, indices) -> bool:
    """The device runs this max pooling gradient."""
    return (_max_pool_ok(self, n) and floats_on_one_device(grad_output) and grad_output.dtype == self.dtype
            and indices.device == self.device and indices.dtype == torch.int64
            and tuple(indices.shape) == tuple(grad_output.shape))


def _max_pool_grad(n: int, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """``max_pool{n}d_with_indices_backward``: the device or the fallback."""
    if not _max_pool_backward_ok(n, grad_output, self, indices):
        raise Unsupported("tensors or dtypes the device gradient does not take")
    return _max_pool_backward(n, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices)


@lowering("max_pool2d_with_indices_backward")
def max_pool2d_with_indices_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: Sequence[int],
                                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                                     ceil_mode: bool, indices: torch.Tensor) -> torch.Tensor:
    """Gradient of max pooling: each output's gradient added at its argmax (window compare, then col2im)."""
    return _max_pool_grad(2, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices)


@lowering("max_pool3d_with_indices_backward")
def max_pool3d_with_indices_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: Sequence[int],
                                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                                     ceil_mode: bool, indices: torch.Tensor) -> torch.Tensor:
    """Gradient of 3-D max pooling: each output's gradient added at its argmax (window compare, then col2im)."""
    return _max_pool_grad(3, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices)


register_out("max_pool2d_with_indices_backward.grad_input", max_pool2d_with_indices_backward,
             warn_resize=False)
register_out("max_pool3d_with_indices_backward.grad_input", max_pool3d_with_indices_backward,
             warn_resize=False)


# ---- unfold / fold (im2col, col2im) -------------------------------------------------------------------

@lowering("im2col")
def im2col(self: torch.Tensor, kernel_size: Sequence[int], dilation: Sequence[int], padding: Sequence[int],
           stride: Sequence[int]) -> torch.Tensor:
    """``F.unfold``: [B, C*KH*KW, L] patches by strided DMA copies of window views of the padded input."""
    meta = meta_run(aten.im2col.default, self, kernel_size, dilation, padding, stride)   # the CPU's errors
    if self.numel() == 0 and floats_on_one_device(self):
        return torch.zeros(meta.shape, dtype=self.dtype, device=self.device)
    if not floats_on_one_device(self):
        raise Unsupported
    k, s, p, d = _pool_geometry(2, kernel_size, stride, padding, dilation)
    x = self if self.dim() == 4 else self.unsqueeze(0)
    o = tuple((n + 2 * pp - dd * (kk - 1) - 1) // ss + 1 for n, kk, ss, pp, dd in zip(x.shape[2:], k, s, p, d))
    return im2col_patches(x, k, s, p, d, o, batch_first=True).view(meta.shape)


@lowering("col2im")
def col2im(self: torch.Tensor, output_size: Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int],
           padding: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """``F.fold`` (and the gradient of ``F.unfold``): each patch column summed into its window (col2im)."""
    meta = meta_run(aten.col2im.default, self, output_size, kernel_size, dilation, padding, stride)
    if self.numel() == 0 and floats_on_one_device(self):
        return torch.zeros(meta.shape, dtype=self.dtype, device=self.device)
    if not floats_on_one_device(self):
        raise Unsupported
    k, s, p, d = _pool_geometry(2, kernel_size, stride, padding, dilation)
    S = int_tuple(output_size, 2)
    o = tuple((n + 2 * pp - dd * (kk - 1) - 1) // ss + 1 for n, kk, ss, pp, dd in zip(S, k, s, p, d))
    cols = self if self.dim() == 3 else self.unsqueeze(0)
    B, C = cols.shape[0], cols.shape[1] // math.prod(k)
    cols = cols.reshape(B, C, *k, *o).permute(1, 2, 3, 0, 4, 5)      # [C, KH, KW, B, OH, OW], strided
    return col2im_patches(cols, (B, C, *S), k, s, p, d).view(meta.shape)


# ---- average pooling (window sums; band matrices for uneven adaptive windows) -----------------------------

@functools.lru_cache(maxsize=256)
def adaptive_band(n: int, out: int) -> torch.Tensor:
    """fp32 [out, n]: row o averages input [floor(o*n/out), ceil((o+1)*n/out))."""
    m = torch.zeros(out, n, dtype=torch.float64)
    for o in range(out):
        lo, hi = (o * n) // out, -(-((o + 1) * n) // out)
        m[o, lo:hi] = 1.0 / (hi - lo)
    return m.to(torch.float32)




def _separable(x: torch.Tensor, mh: torch.Tensor, mw: torch.Tensor) -> torch.Tensor:
    """``mh @ x[i] @ mw^T`` for every plane of x [BC, H, W] (fp32): two matmuls, two transposes."""
    BC, H, W = x.shape
    OH, OW = mh.shape[0], mw.shape[0]
    y = dense(x).view(BC * H, W) @ mw.t()                                    # [BC*H, OW]
    y = dense(y.view(BC, H, OW).transpose(1, 2)).view(BC * OW, H) @ mh.t()   # [BC*OW, OH]
    return dense(y.view(BC, OW, OH).transpose(1, 2))


def _avg_ok(x: torch.Tensor) -> bool:
    return floats_on_one_device(x) and x.dim() in (3, 4) and x.numel() > 0


@functools.lru_cache(maxsize=256)
def _avg_divisor(sizes: tuple, outs: tuple, k: tuple, s: tuple, p: tuple, count_include_pad: bool,
                 divisor_override: int) -> torch.Tensor:
    """fp32 [prod(outs)]: the CPU kernels' divisor of each window's sum (``divisor_override`` when non-zero;
    else the product over dims of the window's extent clipped to the padded input, or of its count of input
    elements without the padding)."""
    if divisor_override:
        return torch.full((math.prod(outs),), float(divisor_override))
    total = torch.ones(())
    for n, out, kk, ss, pp in zip(sizes, outs, k, s, p):
        start = torch.arange(out) * ss - pp
        end = torch.clamp(start + kk, max=n + pp)
        extent = end - start if count_include_pad else torch.clamp(end, max=n) - torch.clamp(start, min=0)
        total = total.unsqueeze(-1) * extent
    return total.reshape(-1).to(torch.float32)




def _avg_geometry(self: torch.Tensor, n: int, kernel_size, stride, padding, count_include_pad, divisor_override,
                  outs: tuple) -> tuple[tuple, tuple, tuple, torch.Tensor]:
    """(k, s, p, divisor row on the device) of an n-D average pooling producing ``outs``."""
    k, s, p, _ = _pool_geometry(n, kernel_size, stride, padding)
    div = device_table(self.device, _avg_divisor, tuple(self.shape[-n:]), tuple(outs), k, s, p, bool(count_include_pad),
                 int(divisor_override or 0))
    return k, s, p, div


def avg_pool_windows(self: torch.Tensor, n: int, kernel_size, stride, padding, count_include_pad, divisor_override,
                     outs: tuple) -> torch.Tensor:
    """n-D average pooling as window sums (im2col with zero padding, one reduction over the window) over the
    CPU's divisors: a NaN or inf stays in the windows holding it."""
    k, s, p, div = _avg_geometry(self, n, kernel_size, stride, padding, count_include_pad, divisor_override, outs)
    S = tuple(self.shape[-n:])
    BC = self.numel() // math.prod(S)
    cols = im2col_patches(as_float32(self).reshape(BC, 1, *S), k, s, p, (1,) * n, tuple(outs))
    (sums,) = call_kernel(reduce_kernel, {"x": cols.view(1, math.prod(k), BC * math.prod(outs))}, {"op": "sum"},
                          op=f"aten::avg_pool{n}d")
    return (sums.view(BC, math.prod(outs)) / div).to(self.dtype)


def avg_pool_windows_backward(grad_output: torch.Tensor, self: torch.Tensor, n: int, kernel_size, stride, padding,
                              count_include_pad, divisor_override) -> torch.Tensor:
    """Each window's gradient over its divisor, spread back over the window (col2im of a broadcast view)."""
    outs = tuple(grad_output.shape[-n:])
    k, s, p, div = _avg_geometry(self, n, kernel_size, stride, padding, count_include_pad, divisor_override, outs)
    S = tuple(self.shape[-n:])
    BC = self.numel() // math.prod(S)
    g = (as_float32(grad_output).reshape(BC, math.prod(outs)) / div).view(BC, *(1,) * n, 1, *outs)
    res = col2im_patches(g.expand(BC, *k, 1, *outs), (1, BC, *S), k, s, p, (1,) * n)
    return res.to(self.dtype).view(self.shape)


def adaptive_windows(sizes: Sequence[int], outs: Sequence[int]) -> tuple[int, ...] | None:
    """The window (= stride) of an adaptive average pooling whose every dim divides evenly (then its windows
    are a plain pooling's: sums over the same elements, the same divisor); None otherwise."""
    if all(o > 0 and n % o == 0 for n, o in zip(sizes, outs)):
        return tuple(n // o for n, o in zip(sizes, outs))
    return None


def _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    meta = meta_run(aten.avg_pool2d.default, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)
    return avg_pool_windows(self, 2, kernel_size, stride, padding, count_include_pad, divisor_override,
                            tuple(meta.shape[-2:])).view(meta.shape)


@lowering("avg_pool2d")
def avg_pool2d(self: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
               padding: Sequence[int] = (0,), ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None) -> torch.Tensor:
    """2-D average pooling as window sums over the CPU's divisors."""
    shape = meta_run(aten.avg_pool2d.default, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                      divisor_override).shape                     # the CPU's errors for bad arguments
    if self.numel() == 0 and floats_on_one_device(self):
        return torch.empty(shape, dtype=self.dtype, device=self.device)
    if not _avg_ok(self):
        raise Unsupported
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


register_out("avg_pool2d.out", avg_pool2d)


def _avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                       divisor_override):
    meta_run(aten.avg_pool2d_backward.default, grad_output, self, kernel_size, stride, padding, ceil_mode,
              count_include_pad, divisor_override)
    return avg_pool_windows_backward(grad_output, self, 2, kernel_size, stride, padding, count_include_pad,
                                     divisor_override)


def _avg_backward_ok(grad_output, self) -> bool:
    return _avg_ok(self) and floats_on_one_device(grad_output) and grad_output.dtype == self.dtype


@lowering("avg_pool2d_backward")
def avg_pool2d_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: Sequence[int],
                        stride: Sequence[int], padding: Sequence[int], ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None) -> torch.Tensor:
    """Gradient of average pooling: each window's gradient over its divisor, spread back over the window."""
    if not _avg_backward_ok(grad_output, self):
        raise Unsupported
    return _avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)


register_out("avg_pool2d_backward.grad_input", avg_pool2d_backward, warn_resize=False)   # quietly, as the CPU


@lowering("_adaptive_avg_pool2d")
def adaptive_avg_pool2d(self: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    """Adaptive average pooling: window sums when the sizes divide evenly, else ``Mh @ x @ Mw^T`` (PyTorch's
    floor/ceil windows as band matrices, through which a NaN or inf spreads over its plane)."""
    meta = meta_run(aten._adaptive_avg_pool2d.default, self, output_size)   # the CPU's errors
    if self.numel() == 0 and floats_on_one_device(self):
        return torch.empty(meta.shape, dtype=self.dtype, device=self.device)
    if not _avg_ok(self):
        raise Unsupported
    H, W = self.shape[-2:]
    OH, OW = meta.shape[-2:]
    k = adaptive_windows((H, W), (OH, OW))
    if k is not None:           # (a global pool too): window sums, a NaN stays in its window
        return avg_pool_windows(self, 2, k, k, (0, 0), True, None, (OH, OW)).view(meta.shape)
    mh = device_table(self.device, adaptive_band, H, OH)
    mw = device_table(self.device, adaptive_band, W, OW)
    return _separable(as_float32(self).reshape(-1, H, W), mh, mw).to(self.dtype).view(meta.shape)


@lowering("_adaptive_avg_pool2d_backward")
def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    """Gradient of adaptive average pooling: the window sums' gradient when the sizes divide evenly, else
    ``Mh^T @ g @ Mw``."""
    if self.numel() == 0 and floats_on_one_device(self, grad_output) and grad_output.numel() == 0:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)
    if not _avg_backward_ok(grad_output, self) or grad_output.dim() != self.dim():
        raise Unsupported
    H, W = self.shape[-2:]
    OH, OW = grad_output.shape[-2:]
    k = adaptive_windows((H, W), (OH, OW))
    if k is not None:
        return avg_pool_windows_backward(grad_output, self, 2, k, k, (0, 0), True, None)
    mh = device_table(self.device, adaptive_band, H, OH)
    mw = device_table(self.device, adaptive_band, W, OW)
    res = _separable(as_float32(grad_output).reshape(-1, OH, OW), mh.t(), mw.t())
    return res.to(self.dtype).view(self.shape)
