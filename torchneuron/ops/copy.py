"""Copies and fills on the device: ``copy_``, ``fill_``, ``zero_`` as strided DMA kernels.

A copy between two tensors of one neuron device runs ``kernels.copy.strided_copy`` over the
storage spans the two views cover, reading and writing each view through its strides (a cast
when the dtypes differ). Dtypes the NeuronCore cannot compute in (int64, float64, complex) are
still copied on the device when source and destination share the dtype: the DMA moves their
bytes as int32 words. A fill is a copy from a one-element device tensor broadcast with stride 0.
Copies between the host and a device, or between devices, stay with the C++ ``_copy_from``.
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron.kernels.copy import multi_copy, strided_copy, widen_int64
from torchneuron.ops.kernel_call import DEVICE_DTYPES, call_kernel, scalar_operand
from torchneuron.ops.registry import cpu_fallback, lowering

aten = torch.ops.aten


def _span(t: torch.Tensor) -> torch.Tensor:
    """The contiguous 1-D run of storage a (non-empty) view covers, starting at its first element."""
    n = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.as_strided((n,), (1,), t.storage_offset())


def _coalesce(sizes: list, a: list, b: list) -> tuple[tuple, tuple, tuple]:
    """Drop size-1 dims and merge neighbours that are contiguous in both views (fewer DMA dims)."""
    dims = [(n, x, y) for n, x, y in zip(sizes, a, b) if n != 1] or [(1, 1, 1)]
    out = [list(dims[0])]
    for n, x, y in dims[1:]:
        m, px, py = out[-1]
        if px == x * n and py == y * n:
            out[-1] = [m * n, x, y]
        else:
            out.append([n, x, y])
    return tuple(d[0] for d in out), tuple(d[1] for d in out), tuple(d[2] for d in out)


def _words(span: torch.Tensor, sizes: list, strides: list) -> tuple[torch.Tensor, list, list]:
    """Reinterpret a span of a dtype the core lacks as int32 words (one more dim of itemsize/4)."""
    k = span.dtype.itemsize // 4
    return span.view(torch.int32), [*sizes, k], [*(s * k for s in strides), 1]


INT_DTYPES = (torch.bool, torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16)


def can_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``device_copy`` runs this copy on the device."""
    if dst.dtype == src.dtype:
        return dst.dtype in DEVICE_DTYPES or dst.dtype.itemsize % 4 == 0
    if dst.dtype == torch.int64:
        return src.dtype in DEVICE_DTYPES
    if src.dtype == torch.int64:
        return dst.dtype in DEVICE_DTYPES
    if torch.float64 in (dst.dtype, src.dtype):  # to or from a float dtype of the core, by integer work
        other = src.dtype if dst.dtype == torch.float64 else dst.dtype
        return other.is_floating_point and other in DEVICE_DTYPES
    return dst.dtype in DEVICE_DTYPES and src.dtype in DEVICE_DTYPES


def to_int64(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src`` (a device dtype) as int64, on the device: via int32, then the sign-extended high words."""
    if src.dtype != torch.int32:
        src32 = torch.empty(src.shape, dtype=torch.int32, device=src.device)
        device_copy(src32, src)
        src = src32
    elif not src.is_contiguous():
        src = src.contiguous()
    dst = out if out is not None and out.is_contiguous() else torch.empty(src.shape, dtype=torch.int64,
                                                                           device=src.device)
    if src.numel():
        call_kernel(widen_int64, {"dst": dst.reshape(-1).view(torch.int32), "src": src.reshape(-1)},
                    op="aten::_to_copy")
    if out is not None and dst is not out:
        device_copy(out, dst)
        return out
    return dst


def _word(src: torch.Tensor, k: int) -> torch.Tensor:
    """Word ``k`` (0: low, 1: high) of each element of an int64 tensor, as an int32 view."""
    words = _span(src).view(torch.int32)
    return words.as_strided(src.shape, [2 * st for st in src.stride()], words.storage_offset() + k)


def _int64_to_float(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst = float(src)`` for int64 ``src``: (high word + borrow) * 2**32 + the low word read signed."""
    from torchneuron.ops import tilemath
    from torchneuron.ops.pointwise import KIND, run_pointwise
    run_pointwise(tilemath.from_words, [_word(src, 1), _word(src, 0), 4294967296.0],
                  KIND.INT_TO_FLOAT, dst, op="aten::_to_copy")


def _float64_convert(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst = src`` between float64 and a float dtype of the core, through fp32 (as the CPU casts
    half and bfloat16 to and from double): fp32 bits <-> the two words of the float64."""
    from torchneuron.ops import tilemath
    from torchneuron.ops.pointwise import KIND, run_pointwise
    if dst.dtype == torch.float64:
        if src.dtype != torch.float32:
            src = src.to(torch.float32)
        bits = src.view(torch.int32)
        run_pointwise(tilemath.f64_high_word, [bits], KIND.DEFAULT, _word(dst, 1), op="aten::_to_copy")
        run_pointwise(tilemath.f64_low_word, [bits], KIND.DEFAULT, _word(dst, 0), op="aten::_to_copy")
        return
    narrow = dst if dst.dtype == torch.float32 else torch.empty(dst.shape, dtype=torch.float32, device=dst.device)
    run_pointwise(tilemath.f64_to_f32_bits, [_word(src, 1), _word(src, 0)], KIND.DEFAULT,
                  narrow.view(torch.int32), op="aten::_to_copy")
    if narrow is not dst:
        device_copy(dst, narrow)


def device_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` (broadcast to dst's shape) on dst's neuron device, through the views' strides."""
    src = src.expand(dst.shape)
    if dst.numel() == 0:
        return
    if dst.dtype != src.dtype and torch.int64 in (dst.dtype, src.dtype):
        if dst.dtype == torch.int64:
            to_int64(src, dst)
        elif dst.dtype.is_floating_point:
            _int64_to_float(dst, src)
        else:  # int64 -> narrower ints: the low words, cast (values beyond int32 wrap, as a C cast does)
            device_copy(dst, _word(src, 0))
        return
    if dst.dtype != src.dtype and torch.float64 in (dst.dtype, src.dtype):
        _float64_convert(dst, src)
        return
    dspan, sspan = _span(dst), _span(src)
    sizes, dstr, sstr = list(dst.shape), list(dst.stride()), list(src.stride())
    if dst.dtype not in DEVICE_DTYPES:  # same dtype (can_copy): move the bytes as int32 words
        dspan, dsizes, dstr = _words(dspan, sizes, dstr)
        sspan, sizes, sstr = _words(sspan, sizes, sstr)
    sizes, dstr, sstr = _coalesce(sizes, dstr, sstr)
    call_kernel(strided_copy, {"dst": dspan, "src": sspan},
                {"dst_view": (0, sizes, dstr), "src_view": (0, sizes, sstr)}, op="aten::copy_")


def copy_parts(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst[...] = src`` for each (dst, src) pair, the dsts being non-overlapping views of one tensor and
    every src of the dsts' dtype: one ``multi_copy`` launch (``torch.cat`` of many inputs)."""
    parts = [(d, s.expand(d.shape)) for d, s in parts if d.numel()]
    if not parts:
        return
    base = parts[0][0]
    start = min(d.storage_offset() for d, _ in parts)
    end = max(d.storage_offset() + sum((n - 1) * st for n, st in zip(d.shape, d.stride())) for d, _ in parts)
    dspan = base.as_strided((end - start + 1,), (1,), start)
    words = base.dtype not in DEVICE_DTYPES
    if words:
        dspan = dspan.view(torch.int32)
    inputs, views = {"dst": dspan}, []
    for i, (d, src) in enumerate(parts):
        sspan = _span(src)
        sizes, dstr, sstr = list(d.shape), list(d.stride()), list(src.stride())
        if words:
            k = d.dtype.itemsize // 4
            sspan = sspan.view(torch.int32)
            sizes, dstr, sstr = [*sizes, k], [*(x * k for x in dstr), 1], [*(x * k for x in sstr), 1]
        sizes, dstr, sstr = _coalesce(sizes, dstr, sstr)
        scale = d.dtype.itemsize // 4 if words else 1
        inputs[f"src{i}"] = sspan
        views.append(((scale * (d.storage_offset() - start), sizes, dstr), (0, sizes, sstr)))
    call_kernel(multi_copy(len(parts)), inputs, {"views": tuple(views)}, op="aten::cat")


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


@lowering("copy_")
def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``self.copy_(src)``: a DMA kernel within one neuron device, else a host transfer."""
    if self.device == src.device and self.device.type == "neuron" and can_copy(self, src) \
            and not self.is_conj() and not src.is_conj() and not self.is_neg() and not src.is_neg():
        if src.shape != self.shape:
            torch.broadcast_shapes(src.shape, self.shape)  # RuntimeError for shapes that do not broadcast
        if self.numel() and not _same_data(self, src):
            device_copy(self, src)
        return self
    if self.device == src.device:
        return cpu_fallback(aten.copy_.default, self, src, non_blocking)
    return aten._copy_from(src, self, non_blocking)


def fill(self: torch.Tensor, value: Any) -> torch.Tensor:
    """Fill ``self`` with a scalar on the device."""
    if self.numel():
        device_copy(self, scalar_operand(value, self.dtype, self.device).view(()))
    return self


@lowering("fill_.Scalar")
def fill_scalar(self: torch.Tensor, value: Any) -> torch.Tensor:
    """``self.fill_(value)``."""
    if not can_copy(self, self):
        return cpu_fallback(aten.fill_.Scalar, self, value)
    return fill(self, value)


@lowering("fill_.Tensor")
def fill_tensor(self: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``self.fill_(value)`` with a 0-dim tensor (read on the device when it lives there)."""
    if value.dim() != 0:
        raise RuntimeError(f"fill_ only supports 0-dimension value tensor but got tensor with {value.dim()} "
                           "dimensions.")
    if value.device != self.device or not can_copy(self, value):
        if value.device.type == "cpu":
            return fill_scalar(self, value.item())
        return cpu_fallback(aten.fill_.Tensor, self, value)
    if self.numel():
        device_copy(self, value)
    return self


@lowering("zero_")
def zero_(self: torch.Tensor) -> torch.Tensor:
    """``self.zero_()``."""
    return fill_scalar(self, False if self.dtype == torch.bool else 0)


def write_result(res: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``res`` itself, or copied into the ``out=`` tensor (resized first when its shape differs, with
    PyTorch's warning for a non-empty one) on the device."""
    if out is None:
        return res
    if tuple(out.shape) != tuple(res.shape):
        torch._refs._maybe_resize_out(out, res.shape)
    device_copy(out, res)
    return out
