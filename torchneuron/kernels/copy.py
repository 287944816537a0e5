"""Copies on the device: strided views (``strided_copy``) and int32 to int64 (``widen_int64``).

``strided_copy``: ``dst[view] = src[view]`` as HBM-to-HBM DMAs through access patterns.

Each view is ``(offset, sizes, strides)`` in elements of a flat HBM buffer, so any PyTorch
view (transposed, sliced, broadcast with stride 0) is read or written where it lies, with no
staging through SBUF. The DMA casts when the dtypes differ. The copy is cut along its outer
dim into up to ``DMA_QUEUES`` transfers, which the runtime spreads over that many DMA queues,
so a large copy runs on all of them at once. A transfer's cost depends on its contiguous runs
(the timing model prices a DMA per descriptor): a copy whose innermost dim is strided pays
for it, as on the device. One value broadcast over a large contiguous float destination (``expand``
of a scalar) is the exception: it is spread in SBUF and stored in long rows.
"""
from __future__ import annotations

import functools
import inspect

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, cdiv, flat_blocks

DMA_QUEUES = 16          # transfers a large copy is cut into (the trace's round-robin DMA queues)
SPLIT_BYTES = 64 * 1024  # below this one transfer: a descriptor's fixed cost outweighs the parallelism


def _pattern(sizes: tuple, strides: tuple, lo: int, hi: int) -> list[list[int]]:
    return [[strides[0], hi - lo]] + [[st, n] for st, n in zip(strides[1:], sizes[1:])]


@nki.jit
def strided_copy(dst, src, dst_view, src_view):
    """Copy ``src`` viewed as ``src_view`` into ``dst`` viewed as ``dst_view`` (same sizes); returns nothing."""
    _copy_view(dst, src, dst_view, src_view)


@functools.cache
def multi_copy(count: int) -> nki.Kernel:
    """The kernel copying ``count`` sources (arguments ``src0, src1, ...``) into views of one ``dst``
    (``views``: one (dst_view, src_view) pair per source), as ``strided_copy`` copies each: one launch
    for what would be ``count`` (``torch.cat`` of many tensors)."""
    def body(**kw):
        for i, (dst_view, src_view) in enumerate(kw["views"]):
            _copy_view(kw["dst"], kw[f"src{i}"], dst_view, src_view)

    kind = inspect.Parameter.KEYWORD_ONLY
    body.__signature__ = inspect.Signature([inspect.Parameter("dst", kind)] + [
        inspect.Parameter(f"src{i}", kind) for i in range(count)] + [inspect.Parameter("views", kind)])
    body.__name__ = body.__qualname__ = f"multi_copy_x{count}"
    return nki.jit(body)


def _copy_view(dst, src, dst_view, src_view):
    """The DMAs of one view-to-view copy, cut along the outer dim over the DMA queues."""
    (doff, sizes, dst_strides), (soff, src_sizes, src_strides) = dst_view, src_view
    assert tuple(sizes) == tuple(src_sizes), f"strided_copy: sizes {sizes} and {src_sizes} differ"
    assert len(sizes) >= 1, "strided_copy: views have at least one dim (a scalar is [1])"
    n = 1
    for s in sizes:
        n *= s
    if _is_fill(dst, sizes, dst_strides, src_strides, n):
        _fill(dst, src, doff, n, soff)
        return
    pieces = min(DMA_QUEUES, sizes[0], max(1, n * dst.dtype.itemsize // SPLIT_BYTES))
    step = cdiv(sizes[0], pieces)
    for lo in range(0, sizes[0], step):
        hi = min(sizes[0], lo + step)
        nisa.dma_copy(dst=dst.ap(_pattern(sizes, dst_strides, lo, hi), offset=doff + lo * dst_strides[0]),
                      src=src.ap(_pattern(sizes, src_strides, lo, hi), offset=soff + lo * src_strides[0]))


FILL_MIN = 4096         # elements from which a one-value broadcast is filled through SBUF


def _is_fill(dst, sizes, dst_strides, src_strides, n: int) -> bool:
    """Whether the copy writes one source value over a contiguous float destination (``expand`` of a scalar:
    a DMA reading it would pay one descriptor per element)."""
    contiguous, step = True, 1
    for size, st in zip(reversed(sizes), reversed(dst_strides)):
        contiguous = contiguous and (size == 1 or st == step)
        step *= size
    return (n >= FILL_MIN and contiguous and dst.dtype in (nl.float32, nl.bfloat16, nl.float16)
            and all(st == 0 or size == 1 for size, st in zip(sizes, src_strides)))


def _fill(dst, src, doff: int, n: int, soff: int) -> None:
    """``dst[doff:doff + n] = src[soff]``: the value DMA'd onto every partition (cast to dst's float dtype),
    spread over a [128, f] tile by VectorE (an exact float copy), stored in contiguous rows."""
    f = max(1, min(2048, n // PMAX))
    one = nl.ndarray((PMAX, 1), dst.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=one, src=src.ap([[0, PMAX], [1, 1]], offset=soff))
    tile = nl.ndarray((PMAX, f), dst.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tile, src=one[:, :1].ap([[1, PMAX], [0, f]]), engine=nisa.vector_engine)
    for s, p, w in flat_blocks(n, f):
        nisa.dma_copy(dst=dst.ap([[w, p], [1, w]], offset=doff + s), src=tile[:p, :w])


@nki.jit
def widen_int64(dst, src):
    """int32 ``src`` [n] into int64 ``dst`` given as its [2n] int32 words (little endian: low, then the
    sign-extended high word); returns nothing."""
    (n,) = src.shape
    assert dst.shape[0] == 2 * n, f"widen_int64: dst has {dst.shape[0]} words for {n} values"
    for s, p, w in flat_blocks(n):
        lo = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
        hi = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=lo[:p], src=src[s:s + p * w].reshape((p, w)))
        # high word: -1 for negative values, 0 otherwise
        nisa.tensor_scalar(dst=hi[:p], data=lo[:p], op0=nl.less, operand0=0, op1=nl.multiply, operand1=-1)
        nisa.dma_copy(dst=dst.ap([[2 * w, p], [2, w]], offset=2 * s), src=lo[:p])
        nisa.dma_copy(dst=dst.ap([[2 * w, p], [2, w]], offset=2 * s + 1), src=hi[:p])
