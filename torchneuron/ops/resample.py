"""Padding, upsampling and the remaining adaptive/3-D pooling ops on the device.

Every op here is separable: along each spatial dim the output is either a gather of input rows
(replication/reflection padding, nearest upsampling: ``index_select`` with an index built on the
host, exact) or a small matrix applied to that dim (linear or cubic interpolation weights, pooling bands:
a matmul in fp32). A gather's backward is the transposed one-hot matrix, so gradients are summed
by TensorE in fp32, as ``index_add`` does. Shapes and argument errors come from running the op on
meta stand-ins first, so bad input raises what the CPU kernel raises.

- **Padding** ``replication_pad{1,2,3}d``, ``reflection_pad{1,2,3}d`` and their backward ops.
- **Upsampling** ``upsample_nearest{1,2,3}d`` (PyTorch's float index rule) and ``upsample_linear1d``,
  ``upsample_bilinear2d``, ``upsample_trilinear3d``, ``upsample_bicubic2d`` (one interpolation matrix per dim,
  both ``align_corners``), with backward ops. Empty operands get the CPU's argument checks and empty results.
- **Unpooling** ``max_unpool3d`` (through ``max_unpool2d`` on volumes flattened to one row).
- **Antialiased resizing** ``_upsample_bilinear2d_aa``, ``_upsample_bicubic2d_aa``: the same matmuls, with
  the filter's support widened by the downsampling factor and each row normalized (forward and backward).
- **Pooling** ``adaptive_max_pool2d``/``3d`` (each window's flat positions gathered in one ``index_select``,
  padded by repeating the last, ``max`` over the window; the winner's flat index looked up in the same
  table) and backward (``scatter_add``); ``fractional_max_pool2d``/``3d`` and backward (window starts
  computed on the device from the given samples, as the CPU's ``generate_intervals`` in fp32, then a
  ``gather`` and the same window max); ``avg_pool3d`` with backward as window sums over the CPU's divisors
  (``pooling.avg_pool_windows``, as in 2-D); ``_adaptive_avg_pool3d`` with backward the same when every size
  divides evenly, else one band matrix per dim.
- **Grid sampling** ``grid_sampler_2d``/``3d`` forward: ``sampling_grid.py``.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch

from torchneuron.ops.base import aten, device_table, floats_on_one_device, meta_run, Unsupported
from torchneuron.ops.elementwise import dense, to_int64
from torchneuron.ops.pooling import adaptive_band, adaptive_windows, avg_pool_windows, avg_pool_windows_backward
from torchneuron.ops.registry import lowering, register_out
from torchneuron.ops.windows import as_float32

EXACT = 1 << 24          # flat indices held in fp32 are exact below this


# ---- host tables -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _pad_index(kind: str, n: int, left: int, right: int) -> torch.Tensor:
    """int64 [left + n + right]: the input position each padded position reads."""
    j = torch.arange(-left, n + right, dtype=torch.int64)
    if kind == "replicate":
        return j.clamp(0, n - 1)
    j = torch.where(j < 0, -j, j)                 # reflect about 0 and about n - 1, edges not repeated
    return torch.where(j > n - 1, 2 * (n - 1) - j, j)


def _nearest_scale(n: int, out: int, scale: float | None) -> float:
    """PyTorch's ``compute_scales_value``: 1/scale when given, else in/out (both as float32)."""
    return float(torch.tensor(1.0 / scale if scale is not None and scale > 0 else n / out, dtype=torch.float32))


@functools.lru_cache(maxsize=256)
def _nearest_index(n: int, out: int, scale: float | None, exact: bool = False) -> torch.Tensor:
    """int64 [out]: ``min(floor(dst * scale), n - 1)`` in float32, as the CPU kernel computes it
    (``exact``: the pixel-centre rule of nearest-exact, ``floor((dst + 0.5) * scale)``)."""
    if out == n:
        return torch.arange(n, dtype=torch.int64)
    if out == 2 * n:
        return torch.arange(out, dtype=torch.int64) // 2
    s = torch.tensor(_nearest_scale(n, out, scale), dtype=torch.float32)
    dst = torch.arange(out, dtype=torch.float32) + (0.5 if exact else 0.0)
    src = torch.floor(dst * s).to(torch.int64)
    return src.clamp(max=n - 1)


@functools.lru_cache(maxsize=256)
def _gather_t(index: tuple[int, ...], n: int) -> torch.Tensor:
    """fp32 [n, m]: the transposed one-hot matrix of a gather of ``index`` from n rows (its backward)."""
    m = torch.zeros(n, len(index), dtype=torch.float32)
    m[torch.tensor(index, dtype=torch.int64), torch.arange(len(index))] = 1.0
    return m


CUBIC_A = -0.75          # the cubic convolution coefficient PyTorch's bicubic uses


def cubic_weights(t: torch.Tensor) -> list[torch.Tensor]:
    """fp32 weights of the four taps at -1, 0, 1, 2 around a source at fraction ``t`` (Keys' cubic
    convolution kernel: one cubic within distance 1, another between 1 and 2)."""
    A = CUBIC_A

    def near(x: torch.Tensor) -> torch.Tensor:      # |x| <= 1
        return ((A + 2) * x - (A + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:       # 1 < |x| < 2
        return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A

    return [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]


def _aa_filter(mode: str, x: float) -> float:
    """The antialiasing filter at ``x`` in fp32: the triangle (``linear_aa``) or Keys' cubic with a = -0.5
    (``cubic_aa``, PIL's bicubic)."""
    f = np.float32
    x = abs(f(x))
    if mode == "linear_aa":
        return f(1) - x if x < 1 else f(0)
    a = f(-0.5)
    if x < 1:
        return ((a + f(2)) * x - (a + f(3))) * x * x + f(1)
    if x < 2:
        return ((a * x - f(5) * a) * x + f(8) * a) * x - f(4) * a
    return f(0)


def _aa_matrix(mode: str, n: int, out: int, scale: float) -> torch.Tensor:
    """fp32 [out, n]: antialiased interpolation weights (``_upsample_*2d_aa``): the filter's support widened
    by the downsampling factor, each row's taps normalized to sum to 1, with the CPU kernel's mix of fp32
    and double rounding term by term."""
    f = np.float32
    taps = 2 if mode == "linear_aa" else 4
    support = f(taps * 0.5 * scale) if scale >= 1.0 else f(taps * 0.5)
    width = int(math.ceil(support)) * 2 + 1
    invscale = f(1.0 / scale) if scale >= 1.0 else f(1.0)
    m = torch.zeros(out, n, dtype=torch.float32)
    for i in range(out):
        center = f(scale * (i + 0.5))
        lo = max(int(float(center - support) + 0.5), 0)
        size = min(max(min(int(float(center + support) + 0.5), n) - lo, 0), width)
        ws = [_aa_filter(mode, (float(f(j + lo) - center) + 0.5) * float(invscale)) for j in range(size)]
        total = f(0)
        for w in ws:
            total = total + w
        if total != 0:
            ws = [w / total for w in ws]
        if size:
            m[i, lo:lo + size] = torch.tensor(np.array(ws, dtype=np.float32))
    return m


@functools.lru_cache(maxsize=256)
def _interp_matrix(mode: str, n: int, out: int, align_corners: bool, scale: float | None) -> torch.Tensor:
    """fp32 [out, n]: PyTorch's ``linear`` or ``cubic`` interpolation weights along one dim, with the CPU
    kernel's source index (``area_pixel_compute_source_index`` in float32) and its edge rules: linear
    clamps the source at 0 and its fraction to [0, 1], cubic clamps each of its four taps into the input.
    A linear dim whose size does not change is copied whatever the scale, as the CPU kernel does."""
    if mode != "cubic" and out == n:
        return torch.eye(n, dtype=torch.float32)
    if align_corners:
        s = (n - 1) / (out - 1) if out > 1 else 0.0
    else:
        s = 1.0 / scale if scale is not None and scale > 0 else n / out
    s32 = torch.tensor(s, dtype=torch.float32)
    if mode.endswith("_aa"):
        return _aa_matrix(mode, n, out, float(s32))
    dst = torch.arange(out, dtype=torch.float32)
    if align_corners:
        src = dst * s32
    else:
        src = s32 * (dst + 0.5) - 0.5
        if mode == "linear":
            src = torch.clamp(src, min=0.0)
    m = torch.zeros(out, n, dtype=torch.float32)
    rows = torch.arange(out)
    if mode == "linear":
        i0 = src.to(torch.int64).clamp(max=n - 1)
        i1 = torch.where(i0 < n - 1, i0 + 1, i0)
        l1 = (src - i0.to(torch.float32)).clamp(0.0, 1.0)
        m.index_put_((rows, i0), 1.0 - l1, accumulate=True)
        m.index_put_((rows, i1), l1, accumulate=True)
        return m
    base = torch.floor(src)
    for tap, w in enumerate(cubic_weights(src - base)):
        m.index_put_((rows, (base.to(torch.int64) - 1 + tap).clamp(0, n - 1)), w, accumulate=True)
    return m


@functools.lru_cache(maxsize=256)
def _window_index(n: int, out: int) -> tuple[torch.Tensor, int]:
    """int64 [out * K] adaptive windows padded to the widest K by repeating their last row, and K."""
    lo = [(o * n) // out for o in range(out)]
    hi = [-(-((o + 1) * n) // out) for o in range(out)]
    K = max(h - l for l, h in zip(lo, hi))
    return torch.tensor([min(l + k, h - 1) for l, h in zip(lo, hi) for k in range(K)], dtype=torch.int64), K


@functools.lru_cache(maxsize=256)
def _max_flat_table(sizes: tuple[int, ...], outs: tuple[int, ...]) -> torch.Tensor:
    """fp32 [*outs, K]: the flat input index (row-major over ``sizes``) of each gathered window element."""
    k = len(sizes)
    flat = torch.zeros([1] * (2 * k), dtype=torch.int64)
    for d, (n, o) in enumerate(zip(sizes, outs)):
        idx, K = _window_index(n, o)
        shape = [1] * (2 * k)
        shape[2 * d], shape[2 * d + 1] = o, K
        flat = flat * n + idx.view(shape)
    perm = list(range(0, 2 * k, 2)) + list(range(1, 2 * k, 2))      # outputs first, then window offsets
    return flat.permute(perm).reshape(*outs, -1).to(torch.float32)


def _max_flat_index(sizes: tuple[int, ...], outs: tuple[int, ...]) -> torch.Tensor:
    """``_max_flat_table`` flattened to int64 (a gather index)."""
    return _max_flat_table(sizes, outs).reshape(-1).to(torch.int64)


# ---- separable helpers --------------------------------------------------------------------------

def _apply(x: torch.Tensor, m: torch.Tensor, d: int) -> torch.Tensor:
    """``m [out, n]`` applied along dim ``d`` of fp32 ``x``: one matmul."""
    moved = x.movedim(d, -1)
    shape = moved.shape
    y = dense(moved).reshape(-1, shape[-1]) @ m.t()
    return dense(y.reshape(*shape[:-1], m.shape[0]).movedim(-1, d))


def _gather_dims(x: torch.Tensor, indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """``x`` gathered along its last ``len(indices)`` dims (exact row copies)."""
    k = len(indices)
    for i, idx in enumerate(indices):
        x = x.index_select(x.dim() - k + i, idx)
    return x


def _scatter_dims(g: torch.Tensor, indices: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """The backward of ``_gather_dims`` (host ``indices``): gradient rows summed per source row (fp32)."""
    k = len(indices)
    out_dtype = g.dtype
    g = as_float32(g)
    for i, (idx, n) in enumerate(zip(indices, sizes)):
        g = _apply(g, device_table(g.device, _gather_t, tuple(idx.tolist()), n), g.dim() - k + i)
    return g.to(out_dtype)


def _empty_result(op: torch._ops.OpOverload, *args: Any) -> Any:
    """The result of ``op`` when an operand is empty: the CPU's argument checks (on meta stand-ins), then
    zeros of the output shapes (a backward whose gradient is empty yields zeros of the input's shape)."""
    meta = meta_run(op, *args)
    dev = args[0].device
    if isinstance(meta, tuple):
        return tuple(torch.zeros(m.shape, dtype=m.dtype, device=dev) for m in meta)
    return torch.zeros(meta.shape, dtype=meta.dtype, device=dev)


def register_resample(base: str, out_overload: str | None, fn: Callable[..., Any], n_tensors: int,
                      check: Callable[..., None] | None = None, warn_resize: bool = True) -> None:
    """Lower ``aten.base`` (and its ``out_overload``) to ``fn``; inputs it cannot run go to the CPU fallback.
    ``check(*args)`` raises for bad arguments the meta kernel lets through, before empty operands are served;
    ``warn_resize`` as in ``register_out``."""
    packet = getattr(aten, base)
    check = check or (lambda *args: None)

    def functional(*args: Any) -> Any:
        if not floats_on_one_device(*args[:n_tensors]) or args[0].dtype != args[n_tensors - 1].dtype:
            raise Unsupported
        check(*args)
        if any(t.numel() == 0 for t in args[:n_tensors]):
            return _empty_result(packet.default, *args)
        return fn(*args)

    functional.__name__ = functional.__qualname__ = base
    functional.__doc__ = f"``{base}`` on the device (separable gathers or matmuls)."
    lowering(base)(functional)
    if out_overload is not None:
        register_out(f"{base}.{out_overload}", functional, warn_resize)


# ---- padding ------------------------------------------------------------------------------------

def _pad_indices(kind: str, shape: Sequence[int], padding: Sequence[int], k: int) -> list[tuple]:
    """(index key, input size) per spatial dim, first spatial dim first; padding lists the last dim first."""
    res = []
    for i in range(k):
        d = len(shape) - k + i
        j = k - 1 - i
        res.append((kind, shape[d], padding[2 * j], padding[2 * j + 1]))
    return res


def _pad_lowerings(kind: str, k: int) -> None:
    name = f"{'replication' if kind == 'replicate' else 'reflection'}_pad{k}d"
    fwd_op = getattr(aten, name).default
    bwd_op = getattr(aten, f"{name}_backward").default

    def forward(self: torch.Tensor, padding: Sequence[int]) -> torch.Tensor:
        meta = meta_run(fwd_op, self, padding)
        idx = [device_table(self.device, _pad_index, *key) for key in _pad_indices(kind, self.shape, padding, k)]
        return _gather_dims(self, idx).view(meta.shape)

    def backward(grad_output: torch.Tensor, self: torch.Tensor, padding: Sequence[int]) -> torch.Tensor:
        meta_run(bwd_op, grad_output, self, padding)
        keys = _pad_indices(kind, self.shape, padding, k)
        idx = [_pad_index(*key) for key in keys]
        return _scatter_dims(grad_output, idx, [key[1] for key in keys]).view(self.shape)

    register_resample(name, "out", forward, 1, warn_resize=name != "reflection_pad2d")   # (its CPU kernel: quietly)
    register_resample(f"{name}_backward", "grad_input", backward, 2)


for _kind in ("replicate", "reflect"):
    for _k in (1, 2, 3):
        _pad_lowerings(_kind, _k)


# ---- upsampling ---------------------------------------------------------------------------------

def _upsample_sizes(k: int, input_size: Sequence[int], output_size: Sequence[int]) -> list[int]:
    """The CPU's ``upsample_common_check`` (PyTorch's meta decompositions skip it): the full output size."""
    if len(output_size) != k:
        raise RuntimeError(f"It is expected output_size equals to {k}, but got size {len(output_size)}")
    if len(input_size) != k + 2:
        raise RuntimeError(f"It is expected input_size equals to {k + 2}, but got size {len(input_size)}")
    spatial, out = [int(v) for v in input_size[2:]], [int(v) for v in output_size]
    if min(spatial + out) <= 0:
        raise RuntimeError(f"Input and output sizes should be greater than 0, but got input {spatial} and output {out}")
    return [int(input_size[0]), int(input_size[1])] + out


def _upsample_check(k: int, backward: bool) -> Callable[..., None]:
    """The argument checks of an upsampling op in ``k`` dims (its backward when ``backward``), as the CPU's."""
    def forward_check(self: torch.Tensor, output_size: Sequence[int], *rest: Any) -> None:
        _upsample_sizes(k, self.shape, output_size)
        if self.numel() == 0 and self.shape[1:].numel() == 0:   # only the batch may be empty
            raise RuntimeError(f"Non-empty {k + 2}D data tensor expected but got a tensor with sizes "
                               f"{list(self.shape)}")

    def backward_check(grad_output: torch.Tensor, output_size: Sequence[int], input_size: Sequence[int],
                       *rest: Any) -> None:
        full = _upsample_sizes(k, input_size, output_size)
        if grad_output.dim() != k + 2:
            raise RuntimeError(f"Expected grad_output to be a tensor of dimension {k + 2} but got: dimension "
                               f"{grad_output.dim()}")
        for i, n in enumerate(full):
            if grad_output.shape[i] != n:
                raise RuntimeError(f"Expected grad_output to have the same shape as output; output.size({i}) = {n} "
                                   f"but got grad_output.size({i}) = {grad_output.shape[i]}")

    return backward_check if backward else forward_check


def _scales(k: int, scales: Sequence[Any]) -> list[float | None]:
    return (list(scales) + [None] * k)[:k]


def _nearest_lowerings(k: int, exact: bool = False) -> None:
    name = f"_upsample_nearest_exact{k}d" if exact else f"upsample_nearest{k}d"
    fwd_op = getattr(aten, name).default
    bwd_op = getattr(aten, f"{name}_backward").default

    def forward(self: torch.Tensor, output_size: Sequence[int], *scales: float | None) -> torch.Tensor:
        meta = meta_run(fwd_op, self, output_size, *scales)
        sc = _scales(k, scales)
        n = self.shape[-k:]
        idx = [device_table(self.device, _nearest_index, n[i], int(output_size[i]), sc[i], exact) for i in range(k)]
        return _gather_dims(self, idx).view(meta.shape)

    def backward(grad_output: torch.Tensor, output_size: Sequence[int], input_size: Sequence[int],
                 *scales: float | None) -> torch.Tensor:
        meta_run(bwd_op, grad_output, output_size, input_size, *scales)
        sc = _scales(k, scales)
        n = [int(v) for v in input_size[-k:]]
        idx = [_nearest_index(n[i], int(output_size[i]), sc[i], exact) for i in range(k)]
        return _scatter_dims(grad_output, idx, n).view([int(v) for v in input_size])

    register_resample(name, "out", forward, 1, _upsample_check(k, False))
    register_resample(f"{name}_backward", "grad_input", backward, 1, _upsample_check(k, True))


for _k in (1, 2, 3):
    _nearest_lowerings(_k)
    _nearest_lowerings(_k, exact=True)


def _interp(x: torch.Tensor, mode: str, out_size: Sequence[int], in_size: Sequence[int], align_corners: bool,
            scales: Sequence[Any], transpose: bool) -> torch.Tensor:
    """Each of the last ``len(out_size)`` dims interpolated by ``_interp_matrix`` in turn (its transpose for
    the backward), in fp32."""
    k = len(out_size)
    if transpose and mode == "cubic" and list(map(int, out_size)) == list(map(int, in_size)):
        return x.clone()           # the CPU's bicubic backward copies when no size changes (not its forward)
    sc = _scales(k, scales)
    y = as_float32(x)
    for i in range(k):
        m = device_table(x.device, _interp_matrix, mode, int(in_size[i]), int(out_size[i]), bool(align_corners), sc[i])
        y = _apply(y, m.t() if transpose else m, y.dim() - k + i)
    return y.to(x.dtype)


def _interp_lowerings(name: str, mode: str, k: int) -> None:
    fwd_op = getattr(aten, name).default
    bwd_op = getattr(aten, f"{name}_backward").default

    def forward(self: torch.Tensor, output_size: Sequence[int], align_corners: bool,
                *scales: float | None) -> torch.Tensor:
        meta = meta_run(fwd_op, self, output_size, align_corners, *scales)
        return _interp(self, mode, output_size, self.shape[-k:], align_corners, scales, False).view(meta.shape)

    def backward(grad_output: torch.Tensor, output_size: Sequence[int], input_size: Sequence[int],
                 align_corners: bool, *scales: float | None) -> torch.Tensor:
        meta_run(bwd_op, grad_output, output_size, input_size, align_corners, *scales)
        res = _interp(grad_output, mode, output_size, input_size[-k:], align_corners, scales, True)
        return res.view([int(v) for v in input_size])

    register_resample(name, "out", forward, 1, _upsample_check(k, False))
    register_resample(f"{name}_backward", "grad_input", backward, 1, _upsample_check(k, True))


for _name, _mode, _k in (("upsample_linear1d", "linear", 1), ("upsample_bilinear2d", "linear", 2),
                         ("upsample_trilinear3d", "linear", 3), ("upsample_bicubic2d", "cubic", 2),
                         ("_upsample_bilinear2d_aa", "linear_aa", 2), ("_upsample_bicubic2d_aa", "cubic_aa", 2)):
    _interp_lowerings(_name, _mode, _k)


# ---- pooling ------------------------------------------------------------------------------------

def _adaptive_max_pool(k: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    op = getattr(aten, f"adaptive_max_pool{k}d").default

    def pool(self: torch.Tensor, output_size: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        values_meta, _ = meta_run(op, self, output_size)
        sizes = tuple(int(v) for v in self.shape[-k:])
        outs = tuple(int(v) for v in values_meta.shape[-k:])
        if values_meta.numel() == 0:
            return (torch.empty(values_meta.shape, dtype=self.dtype, device=self.device),
                    torch.empty(values_meta.shape, dtype=torch.int64, device=self.device))
        if math.prod(sizes) >= EXACT:
            raise Unsupported("a plane of EXACT elements or more (its flat indices would round in fp32)")
        x = self.reshape(-1, math.prod(sizes))
        B = x.shape[0]
        # windows padded by repeating their last element: a repeat never beats the first occurrence it copies;
        # one gather of the flat positions, in the CPU kernel's scan order within each window
        table = device_table(self.device, _max_flat_table, sizes, outs)
        win = x.index_select(1, device_table(self.device, _max_flat_index, sizes, outs)).view(B, *table.shape)
        values, flat = _window_max(win, table)
        return values.view(values_meta.shape), to_int64(flat.view(values_meta.shape))

    pool.__doc__ = f"``adaptive_max_pool{k}d``: windows gathered with clamped indices, the max over each."
    return pool


def _window_max(win: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Max over the last dim of ``win`` and the fp32 flat index ``table`` holds for the winner (``table``
    broadcasts against ``win``): the first maximum, or the last NaN as the CPU kernels take
    (``val > max || isnan(val)``)."""
    values, k = win.max(-1, keepdim=True)
    table = table.expand(win.shape)
    flat = torch.gather(table, -1, k)
    # the NaN with the largest position weight; positions are distinct, so its argmax is exact
    nan = win.isnan()
    weights = device_table(win.device, _positions, win.shape[-1])
    _, last_nan = (nan.to(torch.float32) * weights).max(-1, keepdim=True)
    flat = torch.where(values.isnan(), torch.gather(table, -1, last_nan), flat)
    return values.squeeze(-1), flat.squeeze(-1)


def _positions(K: int) -> torch.Tensor:
    """fp32 [K]: 1..K, the weight of each window position."""
    return torch.arange(1, K + 1, dtype=torch.float32)


def _adaptive_max_pool_backward(k: int) -> Callable[..., torch.Tensor]:
    op = getattr(aten, f"adaptive_max_pool{k}d_backward").default

    def backward(grad_output: torch.Tensor, self: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The gradient summed into each window's argmax (``scatter_add`` over the flat indices, fp32)."""
        meta_run(op, grad_output, self, indices)
        return _argmax_scatter(grad_output, self, indices, k)

    return backward


def _argmax_scatter(grad_output: torch.Tensor, self: torch.Tensor, indices: torch.Tensor, k: int) -> torch.Tensor:
    """A max pool's input gradient: each output's gradient added at its flat argmax over the last ``k``
    dims (``scatter_add`` in fp32)."""
    S = math.prod(self.shape[-k:])
    B = self.numel() // S
    grad = torch.zeros(B, S, dtype=torch.float32, device=self.device)
    grad.scatter_add_(1, indices.reshape(B, -1), as_float32(grad_output).reshape(B, -1))
    return grad.to(self.dtype).view(self.shape)


# ---- fractional max pooling ---------------------------------------------------------------------------

def _fractional_positions(u: torch.Tensor, n: int, out: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """fp32 [B, out, K]: the input positions of each window along one dim, from the planes' samples ``u [B]``
    as the CPU's ``generate_intervals`` computes them in the input's dtype (each step rounded to it for
    bf16/fp16): ``int((i + u) * alpha) - int(u * alpha)`` with ``alpha = (n - K) / (out - 1)``, the last
    window ending at the input's end."""
    B = u.shape[0]
    last = torch.full((B, 1), float(n - K), dtype=torch.float32, device=u.device)
    if out > 1:
        def rnd(t: torch.Tensor) -> torch.Tensor:
            return t if dtype == torch.float32 else t.to(dtype).to(torch.float32)
        alpha = float(torch.tensor(n - K, dtype=dtype) / torch.tensor(out - 1, dtype=dtype))
        i = device_table(u.device, _positions, out - 1) - 1.0                          # 0 .. out - 2
        starts = torch.trunc(rnd(rnd(i.view(1, -1) + u.view(B, 1)) * alpha)) - torch.trunc(rnd(u * alpha)).view(B, 1)
        starts = torch.cat([starts, last], dim=1)
    else:
        starts = last
    offsets = device_table(u.device, _positions, K) - 1.0
    # out-of-range samples are not the CPU's contract: clamping keeps the gather inside the input
    return (starts.view(B, out, 1) + offsets.view(1, 1, K)).clamp(0.0, float(n - 1))


def _fractional_max_pool(k: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    op = getattr(aten, f"fractional_max_pool{k}d").default

    def pool(self: torch.Tensor, kernel_size: Sequence[int], output_size: Sequence[int],
             random_samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``fractional_max_pool{k}d`` given its samples: windows gathered per plane, the max over each."""
        if random_samples.device != self.device or random_samples.dtype != self.dtype:
            raise Unsupported("samples on another device or of another dtype")
        values_meta, _ = meta_run(op, self, kernel_size, output_size, random_samples)
        sizes = [int(v) for v in self.shape[-k:]]
        outs = [int(v) for v in values_meta.shape[-k:]]
        Ks = [int(v) for v in kernel_size]
        if values_meta.numel() == 0:
            return (torch.empty(values_meta.shape, dtype=self.dtype, device=self.device),
                    torch.empty(values_meta.shape, dtype=torch.int64, device=self.device))
        if math.prod(sizes) >= EXACT:
            raise Unsupported("a plane of EXACT elements or more (its flat indices would round in fp32)")
        N = 1 if self.dim() == k + 1 else self.shape[0]
        x = self.reshape(-1, math.prod(sizes))
        B = x.shape[0]
        u = as_float32(random_samples[:N]).reshape(B, k)
        # the 2-D op's samples are (w, h), the 3-D op's (t, h, w)
        order = [1, 0] if k == 2 else [0, 1, 2]
        flat = None
        for d in range(k):
            pos = _fractional_positions(dense(u[:, order[d]]), sizes[d], outs[d], Ks[d], self.dtype)
            shape = [B] + [1] * (2 * k)
            shape[1 + d], shape[1 + k + d] = outs[d], Ks[d]
            pos = pos.view(shape)
            flat = pos if flat is None else flat * float(sizes[d]) + pos
        flat = dense(flat).view(B, *outs, -1)
        win = torch.gather(x, 1, to_int64(flat.view(B, -1))).view(flat.shape)
        values, idx = _window_max(win, flat)
        return values.view(values_meta.shape), to_int64(idx.view(values_meta.shape))

    return pool


def _fractional_max_pool_backward(k: int) -> Callable[..., torch.Tensor]:
    op = getattr(aten, f"fractional_max_pool{k}d_backward").default

    def backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: Sequence[int],
                 output_size: Sequence[int], indices: torch.Tensor) -> torch.Tensor:
        """The gradient summed into each window's argmax."""
        if indices.device != self.device or indices.dtype != torch.int64:
            raise Unsupported("indices on another device or not int64")
        try:
            meta_run(op, grad_output, self, kernel_size, output_size, indices)
        except NotImplementedError:      # the 3-D backward has no meta kernel: the CPU checks mismatches
            if grad_output.shape != indices.shape or self.dim() not in (k + 1, k + 2):
                raise Unsupported("a shape mismatch: the CPU raises its error")
        return _argmax_scatter(grad_output, self, indices, k)

    return backward


for _k in (2, 3):
    register_resample(f"fractional_max_pool{_k}d", "output", _fractional_max_pool(_k), 1)
    register_resample(f"fractional_max_pool{_k}d_backward", "grad_input", _fractional_max_pool_backward(_k), 2)


def _max_ok(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind the extra checks of the max-pool ops (int64 indices on the same device)."""
    def wrapped(*args: Any) -> Any:
        idx = args[2] if len(args) > 2 else None
        if idx is not None and (idx.device != args[0].device or idx.dtype != torch.int64):
            raise Unsupported("indices on another device or not int64")
        return fn(*args)
    return wrapped


for _k in (2, 3):
    register_resample(f"adaptive_max_pool{_k}d", "out", _adaptive_max_pool(_k), 1)
    register_resample(f"adaptive_max_pool{_k}d_backward", "grad_input", _max_ok(_adaptive_max_pool_backward(_k)), 2)


def _bands(x: torch.Tensor, mats: Sequence[torch.Tensor], transpose: bool) -> torch.Tensor:
    """One pooling band matrix applied along each of the last three dims, in fp32."""
    y = as_float32(x)
    for i, m in enumerate(mats):
        y = _apply(y, m.t() if transpose else m, y.dim() - 3 + i)
    return y.to(x.dtype)


def _adaptive_avg_pool3d(self: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    meta = meta_run(aten._adaptive_avg_pool3d.default, self, output_size)
    if meta.numel() == 0:
        return torch.empty(meta.shape, dtype=self.dtype, device=self.device)
    k = adaptive_windows(self.shape[-3:], meta.shape[-3:])
    if k is not None:           # window sums, as a plain pooling's
        return avg_pool_windows(self, 3, k, k, (0, 0, 0), True, None, tuple(meta.shape[-3:])).view(meta.shape)
    mats = [device_table(self.device, adaptive_band, n, o) for n, o in zip(self.shape[-3:], meta.shape[-3:])]
    return _bands(self, mats, False).view(meta.shape)


def _adaptive_avg_pool3d_backward(grad_output: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    meta_run(aten._adaptive_avg_pool3d_backward.default, grad_output, self)
    k = adaptive_windows(self.shape[-3:], grad_output.shape[-3:])
    if k is not None:
        return avg_pool_windows_backward(grad_output, self, 3, k, k, (0, 0, 0), True, None)
    mats = [device_table(self.device, adaptive_band, n, o) for n, o in zip(self.shape[-3:], grad_output.shape[-3:])]
    return _bands(grad_output, mats, True).view(self.shape)


register_resample("_adaptive_avg_pool3d", None, _adaptive_avg_pool3d, 1)
register_resample("_adaptive_avg_pool3d_backward", None, _adaptive_avg_pool3d_backward, 2)


def _avg_pool3d(self: torch.Tensor, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
                divisor_override=None) -> torch.Tensor:
    meta = meta_run(aten.avg_pool3d.default, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)
    return avg_pool_windows(self, 3, kernel_size, stride, padding, count_include_pad, divisor_override,
                            tuple(meta.shape[-3:])).view(meta.shape)


def _avg_pool3d_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size, stride, padding, ceil_mode,
                         count_include_pad, divisor_override) -> torch.Tensor:
    meta_run(aten.avg_pool3d_backward.default, grad_output, self, kernel_size, stride, padding, ceil_mode,
              count_include_pad, divisor_override)
    return avg_pool_windows_backward(grad_output, self, 3, kernel_size, stride, padding, count_include_pad,
                                     divisor_override)


register_resample("avg_pool3d", "out", _avg_pool3d, 1)
register_resample("avg_pool3d_backward", "grad_input", _avg_pool3d_backward, 2)


# ---- unpooling ----------------------------------------------------------------------------------

def _max_unpool3d(self: torch.Tensor, indices: torch.Tensor, output_size: Sequence[int], stride: Sequence[int],
                  padding: Sequence[int]) -> torch.Tensor:
    """``max_unpool2d`` over volumes flattened to one row: the indices are flat in D*H*W either way."""
    op = aten.max_unpool3d.default
    if indices.device != self.device:
        raise Unsupported("indices on another device")
    meta = meta_run(op, self, indices, output_size, stride, padding)
    if meta.numel() == 0:
        return torch.zeros(meta.shape, dtype=self.dtype, device=self.device)
    od, oh, ow = (int(v) for v in output_size)
    rows = self.shape[:-3] + (1, -1)
    try:
        res = aten.max_unpool2d(self.reshape(rows), indices.reshape(rows), [1, od * oh * ow])
    except RuntimeError as e:
        # the CPU names the volume's three sizes
        raise RuntimeError(str(e).replace(f"size 1x{od * oh * ow})", f"size {od}x{oh}x{ow})")) from None
    return res.view(meta.shape)


register_resample("max_unpool3d", "out", _max_unpool3d, 1, warn_resize=False)   # the CPU resizes quietly
