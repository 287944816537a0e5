"""Padding, upsampling and the remaining adaptive/3-D pooling ops on the device.

Every op here is separable: along each spatial dim the output is either a gather of input rows
(replication/reflection padding, nearest upsampling: ``index_select`` with an index built on the
host, exact) or a small matrix applied to that dim (bilinear interpolation weights, pooling bands:
a matmul in fp32). A gather's backward is the transposed one-hot matrix, so gradients are summed
by TensorE in fp32, as ``index_add`` does. Shapes and argument errors come from running the op on
meta stand-ins first, so bad input raises what the CPU kernel raises.

- **Padding** ``replication_pad{1,2,3}d``, ``reflection_pad{1,2,3}d`` and their backward ops.
- **Upsampling** ``upsample_nearest{1,2,3}d`` (PyTorch's float index rule) and ``upsample_bilinear2d``
  (both ``align_corners``), with backward ops.
- **Pooling** ``adaptive_max_pool2d`` (windows gathered with clamped indices, ``max`` over the window,
  flat indices looked up in a host table) and backward (``scatter_add``); ``_adaptive_avg_pool3d``
  and ``avg_pool3d`` with backward (one band matrix per dim, as ``cnn.py`` does in 2-D).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from torchneuron.ops.cnn import FLOATS, _adaptive_band, _avg_band, _into, _meta_run
from torchneuron.ops.copy import to_int64
from torchneuron.ops.kernel_call import dense
from torchneuron.ops.registry import cpu_fallback, lowering

aten = torch.ops.aten
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


@functools.lru_cache(maxsize=256)
def _linear_matrix(n: int, out: int, align_corners: bool, scale: float | None) -> torch.Tensor:
    """fp32 [out, n]: PyTorch's linear interpolation weights (``area_pixel_compute_source_index``)."""
    if align_corners:
        s = (n - 1) / (out - 1) if out > 1 else 0.0
    else:
        s = 1.0 / scale if scale is not None and scale > 0 else n / out
    s32 = torch.tensor(s, dtype=torch.float32)
    dst = torch.arange(out, dtype=torch.float32)
    src = dst * s32 if align_corners else torch.clamp(s32 * (dst + 0.5) - 0.5, min=0.0)
    i0 = src.to(torch.int64).clamp(max=n - 1)
    i1 = torch.where(i0 < n - 1, i0 + 1, i0)
    l1 = src - i0.to(torch.float32)
    m = torch.zeros(out, n, dtype=torch.float32)
    rows = torch.arange(out)
    m.index_put_((rows, i0), 1.0 - l1, accumulate=True)
    m.index_put_((rows, i1), l1, accumulate=True)
    return m


@functools.lru_cache(maxsize=256)
def _window_index(n: int, out: int) -> tuple[torch.Tensor, int]:
    """int64 [out * K] adaptive windows padded to the widest K by repeating their last row, and K."""
    lo = [(o * n) // out for o in range(out)]
    hi = [-(-((o + 1) * n) // out) for o in range(out)]
    K = max(h - l for l, h in zip(lo, hi))
    return torch.tensor([min(l + k, h - 1) for l, h in zip(lo, hi) for k in range(K)], dtype=torch.int64), K


@functools.lru_cache(maxsize=256)
def _max_flat_table(H: int, W: int, OH: int, OW: int) -> torch.Tensor:
    """fp32 [OH, OW, KH*KW]: the flat input index ``h * W + w`` of each gathered window element."""
    ih, KH = _window_index(H, OH)
    iw, KW = _window_index(W, OW)
    t = ih.view(OH, KH, 1, 1) * W + iw.view(1, 1, OW, KW)
    return t.permute(0, 2, 1, 3).reshape(OH, OW, KH * KW).to(torch.float32)


_DEVICE_TABLES: dict[tuple, torch.Tensor] = {}


def _dev(device: torch.device, builder: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``builder(*args)`` on the device, uploaded once per device and arguments."""
    key = (device.index, builder.__name__, args)
    t = _DEVICE_TABLES.get(key)
    if t is None:
        if len(_DEVICE_TABLES) > 512:
            _DEVICE_TABLES.clear()
        t = _DEVICE_TABLES[key] = builder(*args).to(device)
    return t


# ---- separable helpers --------------------------------------------------------------------------

def _apply(x: torch.Tensor, m: torch.Tensor, d: int) -> torch.Tensor:
    """``m [out, n]`` applied along dim ``d`` of fp32 ``x``: one matmul."""
    moved = x.movedim(d, -1)
    shape = moved.shape
    y = dense(moved).reshape(-1, shape[-1]) @ m.t()
    return dense(y.reshape(*shape[:-1], m.shape[0]).movedim(-1, d))


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)


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
    g = _f32(g)
    for i, (idx, n) in enumerate(zip(indices, sizes)):
        g = _apply(g, _dev(g.device, _gather_t, tuple(idx.tolist()), n), g.dim() - k + i)
    return g.to(out_dtype)


def _ok(*ts: torch.Tensor | None) -> bool:
    """Every tensor is a non-empty float tensor on the same neuron device."""
    dev = ts[0].device
    return dev.type == "neuron" and all(t is None or (t.device == dev and t.dtype in FLOATS and t.numel() > 0)
                                        for t in ts)


def _register(base: str, out_overload: str | None, fn: Callable[..., Any], n_tensors: int) -> None:
    """Lower ``aten.base`` (and its ``out_overload``) to ``fn``; inputs it cannot run go to the CPU fallback."""
    packet = getattr(aten, base)

    def functional(*args: Any) -> Any:
        if not _ok(*args[:n_tensors]) or args[0].dtype != args[n_tensors - 1].dtype:
            return cpu_fallback(packet.default, *args)
        return fn(*args)

    functional.__doc__ = f"``{base}`` on the device (separable gathers or matmuls)."
    lowering(base)(functional)
    if out_overload is None:
        return
    op = getattr(packet, out_overload)
    names = [a.name for a in op._schema.arguments if a.kwarg_only]

    def out_variant(*args: Any, **kwargs: Any) -> Any:
        outs = [kwargs[n] for n in names]
        if (not _ok(*args[:n_tensors]) or args[0].dtype != args[n_tensors - 1].dtype
                or any(o.device != args[0].device for o in outs) or outs[0].dtype != args[0].dtype):
            return cpu_fallback(op, *args, **kwargs)
        res = fn(*args)
        if isinstance(res, tuple):
            if outs[1].dtype != torch.int64:
                return cpu_fallback(op, *args, **kwargs)
            return tuple(_into(r, o) for r, o in zip(res, outs))
        return _into(res, outs[0])

    out_variant.__doc__ = f"``{base}.{out_overload}``: the result copied into the given tensor."
    lowering(f"{base}.{out_overload}")(out_variant)


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
        meta = _meta_run(fwd_op, self, padding)
        idx = [_dev(self.device, _pad_index, *key) for key in _pad_indices(kind, self.shape, padding, k)]
        return _gather_dims(self, idx).view(meta.shape)

    def backward(grad_output: torch.Tensor, self: torch.Tensor, padding: Sequence[int]) -> torch.Tensor:
        _meta_run(bwd_op, grad_output, self, padding)
        keys = _pad_indices(kind, self.shape, padding, k)
        idx = [_pad_index(*key) for key in keys]
        return _scatter_dims(grad_output, idx, [key[1] for key in keys]).view(self.shape)

    _register(name, "out", forward, 1)
    _register(f"{name}_backward", "grad_input", backward, 2)


for _kind in ("replicate", "reflect"):
    for _k in (1, 2, 3):
        _pad_lowerings(_kind, _k)


# ---- upsampling ---------------------------------------------------------------------------------

def _scales(k: int, scales: Sequence[Any]) -> list[float | None]:
    return (list(scales) + [None] * k)[:k]


def _nearest_lowerings(k: int, exact: bool = False) -> None:
    name = f"_upsample_nearest_exact{k}d" if exact else f"upsample_nearest{k}d"
    fwd_op = getattr(aten, name).default
    bwd_op = getattr(aten, f"{name}_backward").default

    def forward(self: torch.Tensor, output_size: Sequence[int], *scales: float | None) -> torch.Tensor:
        meta = _meta_run(fwd_op, self, output_size, *scales)
        sc = _scales(k, scales)
        n = self.shape[-k:]
        idx = [_dev(self.device, _nearest_index, n[i], int(output_size[i]), sc[i], exact) for i in range(k)]
        return _gather_dims(self, idx).view(meta.shape)

    def backward(grad_output: torch.Tensor, output_size: Sequence[int], input_size: Sequence[int],
                 *scales: float | None) -> torch.Tensor:
        _meta_run(bwd_op, grad_output, output_size, input_size, *scales)
        sc = _scales(k, scales)
        n = [int(v) for v in input_size[-k:]]
        idx = [_nearest_index(n[i], int(output_size[i]), sc[i], exact) for i in range(k)]
        return _scatter_dims(grad_output, idx, n).view([int(v) for v in input_size])

    _register(name, "out", forward, 1)
    _register(f"{name}_backward", "grad_input", backward, 1)


for _k in (1, 2, 3):
    _nearest_lowerings(_k)
    _nearest_lowerings(_k, exact=True)


def _bilinear(x: torch.Tensor, out_hw: Sequence[int], in_hw: Sequence[int], align_corners: bool,
              scales: Sequence[Any], transpose: bool) -> torch.Tensor:
    """Rows then columns interpolated by ``_linear_matrix`` (its transpose for the backward), in fp32."""
    sc = _scales(2, scales)
    y = _f32(x)
    for i, d in enumerate((-2, -1)):
        m = _dev(x.device, _linear_matrix, int(in_hw[i]), int(out_hw[i]), bool(align_corners), sc[i])
        y = _apply(y, m.t() if transpose else m, y.dim() + d)
    return y.to(x.dtype)


def _bilinear_forward(self: torch.Tensor, output_size: Sequence[int], align_corners: bool,
                      *scales: float | None) -> torch.Tensor:
    meta = _meta_run(aten.upsample_bilinear2d.default, self, output_size, align_corners, *scales)
    return _bilinear(self, output_size, self.shape[-2:], align_corners, scales, False).view(meta.shape)


def _bilinear_backward(grad_output: torch.Tensor, output_size: Sequence[int], input_size: Sequence[int],
                       align_corners: bool, *scales: float | None) -> torch.Tensor:
    _meta_run(aten.upsample_bilinear2d_backward.default, grad_output, output_size, input_size, align_corners,
              *scales)
    res = _bilinear(grad_output, output_size, input_size[-2:], align_corners, scales, True)
    return res.view([int(v) for v in input_size])


_register("upsample_bilinear2d", "out", _bilinear_forward, 1)
_register("upsample_bilinear2d_backward", "grad_input", _bilinear_backward, 1)


# ---- pooling ------------------------------------------------------------------------------------

def _adaptive_max_pool2d(self: torch.Tensor, output_size: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    values_meta, _ = _meta_run(aten.adaptive_max_pool2d.default, self, output_size)
    H, W = self.shape[-2:]
    OH, OW = values_meta.shape[-2:]
    if values_meta.numel() == 0:
        return (torch.empty(values_meta.shape, dtype=self.dtype, device=self.device),
                torch.empty(values_meta.shape, dtype=torch.int64, device=self.device))
    if H * W >= EXACT:
        return cpu_fallback(aten.adaptive_max_pool2d.default, self, output_size)
    ih, KH = _window_index(H, OH)
    iw, KW = _window_index(W, OW)
    x = self.reshape(-1, H, W)
    B = x.shape[0]
    # windows padded by repeating their last element: a repeat never beats the first occurrence it copies
    win = _gather_dims(x, [_dev(self.device, _window_rows, H, OH), _dev(self.device, _window_rows, W, OW)])
    win = dense(win.view(B, OH, KH, OW, KW).permute(0, 1, 3, 2, 4)).view(B, OH, OW, KH * KW)
    values, k = win.max(-1, keepdim=True)
    table = _dev(self.device, _max_flat_table, H, W, OH, OW).expand(B, OH, OW, KH * KW)
    flat = torch.gather(table, -1, k)
    # the CPU kernel takes the last NaN of a window (``val > max || isnan(val)``): the NaN with the largest
    # position weight; positions are distinct, so its argmax is exact
    nan = win.isnan()
    weights = _dev(self.device, _positions, KH * KW)
    _, last_nan = (nan.to(torch.float32) * weights).max(-1, keepdim=True)
    flat = torch.where(values.isnan(), torch.gather(table, -1, last_nan), flat)
    return values.view(values_meta.shape), to_int64(flat.view(values_meta.shape))


def _positions(K: int) -> torch.Tensor:
    """fp32 [K]: 1..K, the weight of each window position."""
    return torch.arange(1, K + 1, dtype=torch.float32)


def _window_rows(n: int, out: int) -> torch.Tensor:
    """The index of ``_window_index`` alone (a table builder for ``_dev``)."""
    return _window_index(n, out)[0]


def _adaptive_max_pool2d_backward(grad_output: torch.Tensor, self: torch.Tensor,
                                  indices: torch.Tensor) -> torch.Tensor:
    _meta_run(aten.adaptive_max_pool2d_backward.default, grad_output, self, indices)
    H, W = self.shape[-2:]
    B = self.numel() // (H * W)
    grad = torch.zeros(B, H * W, dtype=torch.float32, device=self.device)
    grad.scatter_add_(1, indices.reshape(B, -1), _f32(grad_output).reshape(B, -1))
    return grad.to(self.dtype).view(self.shape)


def _max_ok(fn: Callable[..., Any], op: torch._ops.OpOverload) -> Callable[..., Any]:
    """``fn`` behind the extra checks of the max-pool ops (int64 indices on the same device)."""
    def wrapped(*args: Any) -> Any:
        idx = args[2] if len(args) > 2 else None
        if idx is not None and (idx.device != args[0].device or idx.dtype != torch.int64):
            return cpu_fallback(op, *args)
        return fn(*args)
    return wrapped


_register("adaptive_max_pool2d", "out", _adaptive_max_pool2d, 1)
_register("adaptive_max_pool2d_backward", "grad_input",
          _max_ok(_adaptive_max_pool2d_backward, aten.adaptive_max_pool2d_backward.default), 2)


def _bands(x: torch.Tensor, mats: Sequence[torch.Tensor], transpose: bool) -> torch.Tensor:
    """One pooling band matrix applied along each of the last three dims, in fp32."""
    y = _f32(x)
    for i, m in enumerate(mats):
        y = _apply(y, m.t() if transpose else m, y.dim() - 3 + i)
    return y.to(x.dtype)


def _adaptive_avg_pool3d(self: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    meta = _meta_run(aten._adaptive_avg_pool3d.default, self, output_size)
    if meta.numel() == 0:
        return torch.empty(meta.shape, dtype=self.dtype, device=self.device)
    mats = [_dev(self.device, _adaptive_band, n, o) for n, o in zip(self.shape[-3:], meta.shape[-3:])]
    return _bands(self, mats, False).view(meta.shape)


def _adaptive_avg_pool3d_backward(grad_output: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    _meta_run(aten._adaptive_avg_pool3d_backward.default, grad_output, self)
    mats = [_dev(self.device, _adaptive_band, n, o) for n, o in zip(self.shape[-3:], grad_output.shape[-3:])]
    return _bands(grad_output, mats, True).view(self.shape)


_register("_adaptive_avg_pool3d", None, _adaptive_avg_pool3d, 1)
_register("_adaptive_avg_pool3d_backward", None, _adaptive_avg_pool3d_backward, 2)


def _triple(v: Any, default: Sequence[int]) -> list[int]:
    v = list(default) if v is None or len(v) == 0 else list(v)
    return v * 3 if len(v) == 1 else v


def _avg3d_mats(self: torch.Tensor, out_dhw: Sequence[int], kernel_size, stride, padding, count_include_pad,
                divisor_override) -> list[torch.Tensor]:
    """The three band matrices; a divisor override scales the first and leaves the others at 1."""
    k = _triple(kernel_size, kernel_size)
    s = _triple(stride, k)
    p = _triple(padding, [0])
    scale = 1.0 / divisor_override if divisor_override else 0.0
    return [_dev(self.device, _avg_band, n, o, k[i], s[i], p[i], bool(count_include_pad),
                 scale if i == 0 else (1.0 if scale else 0.0))
            for i, (n, o) in enumerate(zip(self.shape[-3:], out_dhw))]


def _avg_pool3d(self: torch.Tensor, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
                divisor_override=None) -> torch.Tensor:
    meta = _meta_run(aten.avg_pool3d.default, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)
    mats = _avg3d_mats(self, meta.shape[-3:], kernel_size, stride, padding, count_include_pad, divisor_override)
    return _bands(self, mats, False).view(meta.shape)


def _avg_pool3d_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size, stride, padding, ceil_mode,
                         count_include_pad, divisor_override) -> torch.Tensor:
    _meta_run(aten.avg_pool3d_backward.default, grad_output, self, kernel_size, stride, padding, ceil_mode,
              count_include_pad, divisor_override)
    mats = _avg3d_mats(self, grad_output.shape[-3:], kernel_size, stride, padding, count_include_pad,
                       divisor_override)
    return _bands(grad_output, mats, True).view(self.shape)


_register("avg_pool3d", "out", _avg_pool3d, 1)
_register("avg_pool3d_backward", "grad_input", _avg_pool3d_backward, 2)
