"""Tensor values inside a graph's program while it is traced: an HBM tensor and a layout over it.

A ``Value`` is what an fx node computes, as the program sees it: ``buf``, a whole HBM tensor of the
trace (a graph input's storage, or a kernel's output), and ``layout``, a meta tensor whose sizes,
strides and storage offset (in elements of ``buf``) say where the value's elements lie. Views
change only the layout (``torch`` computes it on the meta tensor, with PyTorch's own rules), so a
transpose or a slice moves no data; a kernel that needs its operand dense gets it through
``dense``, which copies only when the layout is not already contiguous.

int64 values (indices: token ids, ``arange`` positions, targets) live as int32 word pairs, as the
eager kernels read them: ``buf`` holds the words, ``layout`` counts int64 elements. Only index
lowerings read them, through ``index_words``; no element-wise pass computes on them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchneuron.kernels.copy import strided_copy
import torchneuron.nki.language as nl


class NotLowerable(Exception):
    """A lowering met a case it cannot emit: the segment runs as eager ops for this input signature."""


@dataclass(frozen=True)
class HostTensor:
    """A tensor a program neither reads nor writes (a placeholder output such as an attention op's unused
    RNG seed, or an input of a kind the device cannot bind): made or kept on the host, uninitialized."""

    shape: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class Value:
    """``buf`` (an HBM NkiTensor, whole) seen through ``layout`` (a meta tensor over ``buf``'s elements)."""

    buf: object
    layout: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The value's sizes."""
        return tuple(self.layout.shape)

    @property
    def dtype(self) -> torch.dtype:
        """The element dtype."""
        return self.layout.dtype

    def with_layout(self, layout: torch.Tensor) -> "Value":
        """The same buffer seen through another layout (a view)."""
        return Value(self.buf, layout)

    def reshape(self, shape: tuple[int, ...]) -> "Value":
        """A contiguous value reshaped (a view)."""
        return self.with_layout(self.layout.view(shape))


def numel(shape: tuple[int, ...]) -> int:
    """Elements of ``shape``."""
    return math.prod(shape)


def strided_value(buf: object, shape: tuple, stride: tuple | None = None, offset: int = 0,
                  dtype: torch.dtype | None = None) -> Value:
    """The HBM tensor ``buf`` seen as ``shape`` through ``stride`` and ``offset`` (in elements; contiguous when
    ``stride`` is None); ``dtype`` int64 over an int32 ``buf`` counts its word pairs as elements."""
    dtype = dtype or buf.dtype
    words = 2 if dtype == torch.int64 and buf.dtype == torch.int32 else 1
    base = torch.empty(numel(tuple(buf.shape)) // words, dtype=dtype, device="meta")
    if stride is None:
        return Value(buf, base[offset:offset + numel(shape)].view(shape))
    return Value(buf, base.as_strided(shape, stride, offset))


def hbm_value(buf: object) -> Value:
    """A whole HBM tensor of the trace as a contiguous value of its own shape."""
    return strided_value(buf, tuple(buf.shape))


def index_words(v: Value) -> tuple[object, int]:
    """(the value's elements as a 1-D int32 HBM tensor, the words per element: 2 for int64, else 1) of a
    contiguous int32/int64 index value (what ``gather_rows`` and the one-hot builders take)."""
    lay = v.layout
    if v.dtype not in (torch.int32, torch.int64) or not lay.is_contiguous():
        raise NotLowerable(f"an index of dtype {v.dtype} and strides {tuple(lay.stride())}")
    w = 2 if v.dtype == torch.int64 else 1
    n, off = lay.numel(), lay.storage_offset()
    whole = flat(v)
    return (whole if off == 0 and n * w == whole.shape[0] else whole[off * w:(off + n) * w]), w


def flat(v: Value):
    """The value's whole buffer as 1-D (what its layout's strides and offset count in)."""
    n = numel(tuple(v.buf.shape))
    return v.buf if len(v.buf.shape) == 1 else v.buf.reshape((n,))


def dense(v: Value, shape: tuple[int, ...] | None = None):
    """``v`` as a contiguous HBM tensor of ``shape`` (default: its own; a 0-d value is [1]): a view when the
    layout is contiguous, else a strided DMA copy into a new buffer."""
    shape = tuple(shape if shape is not None else v.shape) or (1,)
    if v.dtype == torch.int64:
        raise NotLowerable("int64 values are read only as index words")
    n = v.layout.numel()
    assert numel(shape) == n, f"dense: {v.shape} has {n} elements, not {numel(shape)}"
    lay = v.layout
    if lay.is_contiguous():
        off = lay.storage_offset()
        whole = flat(v)
        view = whole if off == 0 and n == whole.shape[0] else whole[off:off + n]
        return view.reshape(shape)
    out = nl.ndarray(shape, v.dtype, buffer=nl.shared_hbm)
    sizes = tuple(lay.shape) or (1,)
    src_strides = tuple(lay.stride()) or (1,)
    dst_strides = tuple(torch.empty(sizes, device="meta").stride())
    strided_copy(out.reshape((n,)), flat(v), (0, sizes, dst_strides), (lay.storage_offset(), sizes, src_strides))
    return out


def unexpanded(v: Value) -> Value:
    """``v`` with its broadcast (stride-0) dims back to size 1: what an element-wise kernel loads once."""
    lay = v.layout
    sizes = tuple(1 if st == 0 else n for n, st in zip(lay.shape, lay.stride()))
    if sizes == tuple(lay.shape):
        return v
    return v.with_layout(lay.as_strided(sizes, lay.stride(), lay.storage_offset()))
