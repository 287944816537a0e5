"""2-D max pooling with indices in one kernel: planes on the partitions, a band of rows on the free axis.

For each tile of <= 128 planes (batch x channels) and each band of output rows:

    input rows the band's windows read [p, rows, padded width]      DMA; -inf in the padding (GpSimd memset)
    NaN mask of those rows (x != x)                                 GpSimd, once per band
    for each window offset (kh, kw), in the CPU's order:            strided SBUF views of the band
        candidate flat indices of the offset                       GpSimd iota
        take = (x > best) or x is NaN                              VectorE
        best = x where take; index = candidate where take          VectorE predicated copies
    store the values and the int64 indices (int32 word pairs)      DMA

This is the CPU kernel's rule element for element: the maximum starts at -inf with the index of the window's
first element inside the input, and moves to every later element that is greater or NaN, so the first of
equal maxima wins and, when the window holds NaN, the last NaN does (value NaN). A window of -inf only keeps
its first element inside the input. A handful of instructions per window offset, whatever the number of
planes and output positions a band holds.
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, itemsize, tiles
from torchneuron.kernels.conv import Dim, fill_outside

IN_BYTES = 48 * 1024     # SBUF bytes per partition of one band's input rows and their NaN mask
OUT_BYTES = 24 * 1024    # SBUF bytes per partition of one band's results and scratch
SCRATCH = 3              # window offsets whose candidate and predicate tiles are alive at once


def _band_rows(hd: Dim, wd: Dim, isz: int) -> int:
    """Output rows per band (0: not even one fits): input rows x padded width in the dtype plus a uint8 mask,
    and per output position its value, its index word pair and SCRATCH candidate indices and uint8 predicates."""
    wb = wd.span(0, wd.out)[1]
    per_out = wd.out * (isz + 8 + SCRATCH * (4 + 1))
    rows = 0
    while rows < hd.out and hd.span(0, rows + 1)[1] * wb * (isz + 1) <= IN_BYTES \
            and (rows + 1) * per_out <= OUT_BYTES:
        rows += 1
    return rows


def max_pool_fits(hd: Dim, wd: Dim, isz: int) -> bool:
    """Whether ``max_pool2d_kernel`` runs a pooling along ``hd``, ``wd`` of ``isz``-byte elements."""
    return hd.out > 0 and wd.out > 0 and _band_rows(hd, wd, isz) > 0


@nki.jit
def max_pool2d_kernel(x, first=None, dims=None):
    """(values [BC, OH, OW] in x's dtype, the int64 flat input indices as int32 word pairs [BC, OH, OW, 2]) of
    max pooling the planes x [BC, H, W] along ``dims`` (two ``Dim``: padding ``lo``, output sizes ``out``).
    ``first`` (int32 [OH * OW], given when there is padding): each window's first element inside the input."""
    BC, H, W = x.shape
    hd, wd = dims
    assert (hd.size, wd.size) == (H, W) and hd.ld == wd.ld == 1, f"max_pool2d: dims {dims} do not fit {H}x{W}"
    padded = hd.lo > 0 or wd.lo > 0
    assert (first is not None) == padded, "max_pool2d: the first-element table comes with padding, only then"
    OH, OW = hd.out, wd.out
    assert H * W < 1 << 31, "max_pool2d: flat indices are int32 on chip"
    dt, isz = x.dtype, itemsize(x.dtype)
    rows = _band_rows(hd, wd, isz)
    assert rows > 0, "max_pool2d: one output row's input band does not fit SBUF (see max_pool_fits)"
    values = nl.ndarray((BC, OH, OW), dt, buffer=nl.shared_hbm)
    words = nl.ndarray((BC, OH, OW, 2), nl.int32, buffer=nl.shared_hbm)
    pw0, wb = wd.span(0, OW)
    j0, nj, rj = wd.fill(pw0, wb)
    ring = collections.deque(maxlen=2)      # the previous band's tiles: its stores overlap this band's loads
    for c0, cp in tiles(BC):
        for oh0 in range(0, OH, rows):
            nr = min(rows, OH - oh0)
            ph0, hb = hd.span(oh0, nr)
            i0, ni, ri = hd.fill(ph0, hb)
            band = nl.ndarray((PMAX, hb, wb), dt, buffer=nl.sbuf)
            fill_outside(band, cp, hb, wb, (ri, ni, 1), (rj, nj, 1), value=float("-inf"))
            if ni and nj:
                nisa.dma_copy(dst=band[:cp, ri:ri + ni, rj:rj + nj], src=x[c0:c0 + cp, i0:i0 + ni, j0:j0 + nj])
            nan = nl.ndarray((PMAX, hb, wb), nl.uint8, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=nan[:cp], data1=band[:cp], data2=band[:cp], op=nl.not_equal,
                               engine=nisa.gpsimd_engine)
            best = nl.ndarray((PMAX, nr, OW), dt, buffer=nl.sbuf)
            pairs = nl.ndarray((PMAX, nr, OW, 2), nl.int32, buffer=nl.sbuf)
            index = pairs[:cp, :, :, 0]
            nisa.memset(dst=pairs[:cp, :, :, 1], value=0, engine=nisa.gpsimd_engine)   # indices are >= 0
            # flat input index of the band's first padded position: window offset (kh, kw) of output (r, c) reads
            # base + (r * sh + kh * dh) * W + c * sw + kw * dw
            base = (ph0 - hd.lo) * W + (pw0 - wd.lo)
            if padded:
                nisa.memset(dst=best[:cp], value=float("-inf"))
                nisa.dma_copy(dst=index, src=first.ap([[0, cp], [OW, nr], [1, OW]], offset=oh0 * OW))
            scratch = collections.deque(maxlen=SCRATCH)   # the next offsets' iotas overlap this one's copies
            for kh in range(hd.k):
                for kw in range(wd.k):
                    a, b = kh * hd.d, kw * wd.d
                    window = (slice(a, a + (nr - 1) * hd.s + 1, hd.s), slice(b, b + (OW - 1) * wd.s + 1, wd.s))
                    v = band[:cp, window[0], window[1]]
                    cand = nl.ndarray((PMAX, nr, OW), nl.int32, buffer=nl.sbuf)
                    nisa.iota(dst=cand[:cp], pattern=[[hd.s * W, nr], [wd.s, OW]], offset=base + a * W + b)
                    if not padded and (kh, kw) == (0, 0):    # the first element is inside: the CPU takes it
                        nisa.tensor_copy(dst=best[:cp], src=v)
                        nisa.tensor_copy(dst=index, src=cand[:cp], engine=nisa.gpsimd_engine)
                        scratch.append(cand)
                        continue
                    take = nl.ndarray((PMAX, nr, OW), nl.uint8, buffer=nl.sbuf)
                    nisa.tensor_tensor(dst=take[:cp], data1=v, data2=best[:cp], op=nl.greater)
                    nisa.tensor_tensor(dst=take[:cp], data1=take[:cp], data2=nan[:cp, window[0], window[1]],
                                       op=nl.maximum)
                    nisa.tensor_copy_predicated(dst=best[:cp], src=v, predicate=take[:cp])
                    nisa.tensor_copy_predicated(dst=index, src=cand[:cp], predicate=take[:cp])
                    scratch.append((cand, take))
            nisa.dma_copy(dst=values[c0:c0 + cp, oh0:oh0 + nr], src=best[:cp])
            nisa.dma_copy(dst=words[c0:c0 + cp, oh0:oh0 + nr], src=pairs[:cp])
            ring.append((band, nan, best, pairs))
    return values, words
