"""2-D max pooling with indices in one kernel: planes on the partitions, a band of rows on the free axis.

For each tile of <= 128 partitions of planes (batch x channels; several planes per partition where they divide
the partitions evenly and a band holds them whole) and each band of output rows:

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


def _plane_groups(bc: int) -> int:
    """Planes per partition: as many as make the planes fill the partitions evenly (256 planes: 2 on each of 128),
    so that one instruction covers them all; 1 where they do not divide."""
    per = -(-bc // PMAX)
    return per if bc % per == 0 else 1


def _band_rows(hd: Dim, wd: Dim, isz: int, gp: int = 1) -> int:
    """Output rows per band of ``gp`` planes per partition (0: not even one fits): input rows x padded width in the
    dtype plus a uint8 mask, and per output position its value, its index word pair and SCRATCH candidate indices
    and uint8 predicates."""
    wb = wd.span(0, wd.out)[1]
    per_out = gp * wd.out * (isz + 8 + SCRATCH * (4 + 1))
    rows = 0
    while rows < hd.out and gp * hd.span(0, rows + 1)[1] * wb * (isz + 1) <= IN_BYTES \
            and (rows + 1) * per_out <= OUT_BYTES:
        rows += 1
    return rows


def _forward_groups(bc: int, hd: Dim, wd: Dim, isz: int) -> int:
    """Planes per partition of the forward: ``_plane_groups`` where a band of them holds every output row, else 1."""
    gp = _plane_groups(bc)
    return gp if gp > 1 and _band_rows(hd, wd, isz, gp) == hd.out else 1


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
    gp = _forward_groups(BC, hd, wd, isz)   # planes per partition: one instruction covers them all
    rows = _band_rows(hd, wd, isz, gp)
    assert rows > 0, "max_pool2d: one output row's input band does not fit SBUF (see max_pool_fits)"
    values = nl.ndarray((BC, OH, OW), dt, buffer=nl.shared_hbm)
    words = nl.ndarray((BC, OH, OW, 2), nl.int32, buffer=nl.shared_hbm)
    x_planes, v_planes = x.reshape((BC // gp, gp, H, W)), values.reshape((BC // gp, gp, OH, OW))
    w_planes = words.reshape((BC // gp, gp, OH, OW, 2))
    pw0, wb = wd.span(0, OW)
    j0, nj, rj = wd.fill(pw0, wb)
    ring = collections.deque(maxlen=2)      # the previous band's tiles: its stores overlap this band's loads
    for c0, cp in tiles(BC // gp):
        for oh0 in range(0, OH, rows):
            nr = min(rows, OH - oh0)
            ph0, hb = hd.span(oh0, nr)
            i0, ni, ri = hd.fill(ph0, hb)
            band = nl.ndarray((PMAX, gp, hb, wb), dt, buffer=nl.sbuf)
            if gp == 1:
                fill_outside(band.reshape((PMAX, hb, wb)), cp, hb, wb, (ri, ni, 1), (rj, nj, 1), value=float("-inf"))
            elif (ni, nj) != (hb, wb):
                nisa.memset(dst=band[:cp], value=float("-inf"), engine=nisa.gpsimd_engine)
            if ni and nj:
                nisa.dma_copy(dst=band[:cp, :, ri:ri + ni, rj:rj + nj],
                              src=x_planes[c0:c0 + cp, :, i0:i0 + ni, j0:j0 + nj])
            nan = nl.ndarray((PMAX, gp, hb, wb), nl.uint8, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=nan[:cp], data1=band[:cp], data2=band[:cp], op=nl.not_equal,
                               engine=nisa.gpsimd_engine)
            best = nl.ndarray((PMAX, gp, nr, OW), dt, buffer=nl.sbuf)
            pairs = nl.ndarray((PMAX, gp, nr, OW, 2), nl.int32, buffer=nl.sbuf)
            index = pairs[:cp, :, :, :, 0]
            nisa.memset(dst=pairs[:cp, :, :, :, 1], value=0, engine=nisa.gpsimd_engine)   # indices are >= 0
            # flat input index of the band's first padded position: window offset (kh, kw) of output (r, c) reads
            # base + (r * sh + kh * dh) * W + c * sw + kw * dw
            base = (ph0 - hd.lo) * W + (pw0 - wd.lo)
            if padded:
                nisa.memset(dst=best[:cp], value=float("-inf"))
                nisa.dma_copy(dst=index, src=first.ap([[0, cp], [0, gp], [OW, nr], [1, OW]], offset=oh0 * OW))
            scratch = collections.deque(maxlen=SCRATCH)   # the next offsets' iotas overlap this one's copies
            for kh in range(hd.k):
                for kw in range(wd.k):
                    a, b = kh * hd.d, kw * wd.d
                    window = (slice(a, a + (nr - 1) * hd.s + 1, hd.s), slice(b, b + (OW - 1) * wd.s + 1, wd.s))
                    v = band[:cp, :, window[0], window[1]]
                    cand = nl.ndarray((PMAX, gp, nr, OW), nl.int32, buffer=nl.sbuf)
                    nisa.iota(dst=cand[:cp], pattern=[[0, gp], [hd.s * W, nr], [wd.s, OW]], offset=base + a * W + b)
                    if not padded and (kh, kw) == (0, 0):    # the first element is inside: the CPU takes it
                        nisa.tensor_copy(dst=best[:cp], src=v)
                        nisa.tensor_copy(dst=index, src=cand[:cp], engine=nisa.gpsimd_engine)
                        scratch.append(cand)
                        continue
                    take = nl.ndarray((PMAX, gp, nr, OW), nl.uint8, buffer=nl.sbuf)
                    nisa.tensor_tensor(dst=take[:cp], data1=v, data2=best[:cp], op=nl.greater)
                    nisa.tensor_tensor(dst=take[:cp], data1=take[:cp], data2=nan[:cp, :, window[0], window[1]],
                                       op=nl.maximum)
                    nisa.tensor_copy_predicated(dst=best[:cp], src=v, predicate=take[:cp])
                    nisa.tensor_copy_predicated(dst=index, src=cand[:cp], predicate=take[:cp])
                    scratch.append((cand, take))
            nisa.dma_copy(dst=v_planes[c0:c0 + cp, :, oh0:oh0 + nr], src=best[:cp])
            nisa.dma_copy(dst=w_planes[c0:c0 + cp, :, oh0:oh0 + nr], src=pairs[:cp])
            ring.append((band, nan, best, pairs))
    return values, words


GRAD_BYTES = 96 * 1024   # SBUF bytes per partition of the backward's planes: gradient rows, indices, scratch


def _backward_band(hd: Dim, wd: Dim) -> tuple[int, int]:
    """(rows, columns) of the backward's padded band: every position a window reads and every input position."""
    return max(hd.span(0, hd.out)[1], hd.lo + hd.size), max(wd.span(0, wd.out)[1], wd.lo + wd.size)


def max_pool_backward_fits(bc: int, hd: Dim, wd: Dim) -> bool:
    """Whether ``max_pool2d_backward_kernel`` runs the gradient of a pooling of ``bc`` planes along ``hd``, ``wd``:
    a partition's planes, padded, with their output gradients, index words and scratch, fit GRAD_BYTES."""
    hb, wb = _backward_band(hd, wd)
    outs = hd.out * wd.out
    return hd.out > 0 and wd.out > 0 and _plane_groups(bc) * (hb * wb * 4 + outs * (4 + 8 + 4 + 4 + 2)) <= GRAD_BYTES


@nki.jit
def max_pool2d_backward_kernel(gy, words, dims=None):
    """The input gradient [BC, H, W] (gy's dtype) of 2-D max pooling along ``dims``: each output's gradient gy
    [BC, OH, OW] added at its input index (the low int32 word of ``words`` [BC, OH, OW, 2], the forward's int64
    indices), overlapping windows' gradients summed in fp32 and rounded once.

        per tile of planes (several per partition where they divide evenly):
            output gradients (fp32) and index words                         DMA, casting on the way in
            rel = index - flat index of each window's first padded element  GpSimd iota, VectorE
            zeroed fp32 band of the padded planes                           GpSimd memset
            for each window offset (kh, kw):                                strided SBUF views of the band
                take = rel == kh * dh * W + kw * dw                         VectorE
                band[window] = gy where take (disjoint windows), or
                band[window] += (gy where take, else 0)                     VectorE
            store the band's input positions, rounded once                  DMA

    A gradient reaches only the position its index names (an inf or NaN there too, nowhere else: selected, never
    multiplied by a 0/1 mask)."""
    BC, OH, OW = gy.shape
    hd, wd = dims
    H, W = hd.size, wd.size
    assert (hd.out, wd.out) == (OH, OW) and tuple(words.shape) == (BC, OH, OW, 2) and hd.ld == wd.ld == 1, \
        f"max_pool2d_backward: dims {dims} do not fit the gradient {tuple(gy.shape)}"
    assert max_pool_backward_fits(BC, hd, wd), "max_pool2d_backward: the planes do not fit SBUF (see the fits check)"
    assert H * W < 1 << 24, "max_pool2d_backward: flat indices are compared in fp32"
    dt = gy.dtype
    gp = _plane_groups(BC)
    hb, wb = _backward_band(hd, wd)
    out = nl.ndarray((BC, H, W), dt, buffer=nl.shared_hbm)
    g_planes = gy.reshape((BC // gp, gp, OH, OW))
    w_planes = words.reshape((BC // gp, gp, OH, OW, 2))
    o_planes = out.reshape((BC // gp, gp, H, W))
    disjoint = hd.s >= hd.d * (hd.k - 1) + 1 and wd.s >= wd.d * (wd.k - 1) + 1   # each position in <= 1 window
    ring = collections.deque(maxlen=2)      # the previous tile's tiles: its store overlaps this tile's loads
    for p0, pn in tiles(BC // gp):
        g = nl.ndarray((PMAX, gp, OH, OW), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=g[:pn], src=g_planes[p0:p0 + pn])
        pairs = nl.ndarray((PMAX, gp, OH, OW, 2), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=pairs[:pn], src=w_planes[p0:p0 + pn])
        # flat input index of each window's first padded element: (r * sh - lo_h) * W + c * sw - lo_w
        rel = nl.ndarray((PMAX, gp, OH, OW), nl.float32, buffer=nl.sbuf)
        first = nl.ndarray((PMAX, gp, OH, OW), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=first[:pn], pattern=[[0, gp], [hd.s * W, OH], [wd.s, OW]], offset=-hd.lo * W - wd.lo)
        nisa.tensor_tensor(dst=rel[:pn], data1=pairs[:pn, :, :, :, 0], data2=first[:pn], op=nl.subtract)
        band = nl.ndarray((PMAX, gp, hb, wb), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=band[:pn], value=0.0, engine=nisa.gpsimd_engine)
        scratch = collections.deque(maxlen=2)
        for kh in range(hd.k):
            for kw in range(wd.k):
                a, b = kh * hd.d, kw * wd.d
                window = band[:pn, :, a:a + (OH - 1) * hd.s + 1:hd.s, b:b + (OW - 1) * wd.s + 1:wd.s]
                take = nl.ndarray((PMAX, gp, OH, OW), nl.uint8, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=take[:pn], data=rel[:pn], op0=nl.equal, operand0=float(a * W + b))
                if disjoint:
                    nisa.tensor_copy_predicated(dst=window, src=g[:pn], predicate=take[:pn])
                    scratch.append(take)
                    continue
                part = nl.ndarray((PMAX, gp, OH, OW), nl.float32, buffer=nl.sbuf)
                nisa.select_reduce(dst=part[:pn], predicate=take[:pn], on_true=g[:pn], on_false=0.0)
                nisa.tensor_tensor(dst=window, data1=window, data2=part[:pn], op=nl.add)
                scratch.append((take, part))
        nisa.dma_copy(dst=o_planes[p0:p0 + pn], src=band[:pn, :, hd.lo:hd.lo + H, wd.lo:wd.lo + W])
        ring.append((g, pairs, rel, first, band))
    return out
