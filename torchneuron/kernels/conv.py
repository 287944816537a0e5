"""Direct 2-D convolution on TensorE (implicit GEMM): no im2col patches in HBM.

Input channels on the partitions (the contraction, <= 128 per tile), the window offsets as shifted
(strided) SBUF views of one loaded input band, output channels as the stationary operand's columns,
fp32 accumulation in one PSUM bank per chunk of <= 512 output positions:

    for each group g, for each block of output-channel tiles whose weights fit SBUF:
        stationary tiles W^T[ci, k, co] of the block                 DMA rows of w, TensorE transposes
        for each group of images, for each band of output rows x columns:
            input band [ci, images, rows, cols] per ci tile, padded  DMA (contiguous) + GpSimd copy
            for each co tile, for each chunk of rows (rows * cols <= 512):
                for each ci tile, kh, kw:                            TensorE, accumulating in PSUM
                    acc[co, chunk] += W^T[ci, k, co]^T @ band[ci, kh*d + rows*s, kw*d + cols*s]
                evict acc (+ bias, cast to the output dtype)          ScalarE / VectorE alternating
            store the band [co, rows, cols]                           DMA

A group holds several images where one PSUM chunk holds a whole image's outputs (``_image_groups``: at 8 x 8
maps, 8 images per matmul), else one.

``flip=True`` runs the input gradient of a convolution with the same loop nest: the input is the
output gradient, zero-inserted by the forward stride (``lhs_dilation``) and padded by
``dilation * (k - 1) - padding``; the stationary tiles are the forward weight's rows as stored
([co_fwd, ci_fwd, k] is already contraction-major) with the kernel window flipped. Each window offset's
matmul there covers only the outputs at which it reads an element of the gradient (``_gradient_reads``: a
strided rectangle), never the padding or an inserted zero: a zero times an inf or NaN weight would be NaN
where the CPU's sum has no term. An offset that covers the whole chunk goes first and overwrites PSUM;
where none does (stride > kernel), a 0 x 0 matmul of one partition starts the chunk from zeros. At stride
2 this also skips the three quarters of the products that were zeros.

The weight gradient (``conv2d_wgrad_kernel``) contracts over output positions instead: per chunk of
<= 128 positions (rows x output columns, numbered column after column) the output gradient [o, positions]
and the input columns the window reads [c, positions] are transposed on TensorE (positions onto the
partitions), then one matmul per (c tile, up to 4 window offsets in one PSUM bank) accumulates
dW^T[o, (k, c)] over all images and positions in PSUM. The gradient is transposed once per chunk; window
offsets kw whose columns kw * d + s * ow share a residue mod s share one transpose of the input's columns
per window row, in which offset kw's are a contiguous run of partitions, kw * d // s rows' worth further
down: its matmuls contract over that run only, against the gradient's transpose moved there by an
SBUF -> SBUF DMA (``_grad_shifted``). So each product pairs an input column only with the outputs that
read it (an inf or NaN of x in a column some offset never reads cannot meet a zero there: 0 * inf = NaN),
and at stride 2 the chunks hold twice the outputs of a layout that also transposes the unread columns.
An input window row already transposed for the previous chunk is reused: at 128 channels 3x3, 2 transposes
per 9 matmuls instead of 6 (TensorE transposes cost as much as the matmuls they feed; the DMAs had time
to spare).
``conv2d_backward_kernel`` runs both gradients as one program (one launch; each part's DMAs and
evictions overlap the other's TensorE work).

TensorE time of the forward equals its FLOPs at peak when the channel tiles are full (C, O >= 128):
the chunks are N = rows * cols <= 512 columns and every matmul pass is one stationary load.
"""
from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, PSUM_FP32, cdiv, itemsize, tiles
from torchneuron.kernels.matmul import alternating_evict

X_BAND_BYTES = 40 * 1024    # SBUF bytes per partition of one input band (all ci tiles); two are in flight
W_BYTES = 64 * 1024         # SBUF bytes per partition of a block's stationary tiles
OUT_BAND = 4096             # output positions per band (one staging tile of <= 16 KiB fp32 per partition)


@dataclass(frozen=True)
class Dim:
    """One spatial dim of a convolution as the kernel runs it: input length, zero insertion between
    input elements (``ld``), padding before/after, kernel size, dilation, stride."""

    size: int
    ld: int
    lo: int
    hi: int
    k: int
    d: int
    s: int

    @property
    def padded(self) -> int:
        return (self.size - 1) * self.ld + 1 + self.lo + self.hi

    @property
    def out(self) -> int:
        return (self.padded - self.d * (self.k - 1) - 1) // self.s + 1

    def span(self, o0: int, n: int) -> tuple[int, int]:
        """(first padded position, length) of the input band that outputs [o0, o0 + n) read."""
        return o0 * self.s, (n - 1) * self.s + self.d * (self.k - 1) + 1

    def fill(self, p0: int, length: int) -> tuple[int, int, int]:
        """(first input index, count, its offset in the band) of the real inputs in padded [p0, p0 + length)."""
        first = max(0, cdiv(p0 - self.lo, self.ld))
        last = min(self.size - 1, (p0 + length - 1 - self.lo) // self.ld)
        return first, max(0, last - first + 1), self.lo + first * self.ld - p0


def dims_of(size: int, k: int, stride: int, pad: tuple[int, int], dilation: int, ld: int = 1) -> Dim:
    """A ``Dim`` from a convolution's parameters along one axis."""
    return Dim(size, ld, pad[0], pad[1], k, dilation, stride)


@dataclass(frozen=True)
class Plan:
    """Band and block sizes of one convolution (``plan``)."""

    band_rows: int      # output rows per band
    band_cols: int      # output columns per band (<= 512)
    chunk_rows: int     # output rows per PSUM chunk (chunk_rows * band_cols <= 512)
    co_block: int       # output-channel tiles per weight block


def plan(hd: Dim, wd: Dim, ci: int, co: int, isz: int) -> Plan | None:
    """Band sizes for ci input and co output channels per group of ``isz``-byte elements (None: does not fit)."""
    cit, kk = cdiv(ci, PMAX), hd.k * wd.k
    co_tiles = cdiv(co, PMAX)
    per_tile = cit * kk * PMAX * isz
    co_block = min(co_tiles, W_BYTES // per_tile)
    if co_block == 0:
        return None
    oh, ow = hd.out, wd.out
    cols = min(ow, PSUM_FP32)
    while True:
        rc = max(1, min(oh, PSUM_FP32 // cols))
        rows = max(rc, min(oh, OUT_BAND // cols) // rc * rc)

        def band_bytes(r: int) -> int:
            return cit * hd.span(0, r)[1] * wd.span(0, cols)[1] * isz
        while rows > rc and band_bytes(rows) > X_BAND_BYTES:
            rows -= rc
        if band_bytes(rows) <= X_BAND_BYTES:
            while rc > 1 and band_bytes(rows) > X_BAND_BYTES:
                rc -= 1
            return Plan(rows, cols, rc, co_block)
        if rc > 1:                   # one chunk of rows is still too tall: fewer rows per chunk
            rows = rc = 1
            if band_bytes(1) <= X_BAND_BYTES:
                return Plan(1, cols, 1, co_block)
        if cols == 1:
            return None
        cols = max(1, cols // 2)


WHOLE_FILL = 1024           # elements per partition of a padded band filled whole, not by its border strips
WGRAD_ROW_BYTES = 48 * 1024   # SBUF bytes per partition of the weight gradient's fp32 row and its cast


def conv_fits(channels: int, w_shape, groups: int, dims: tuple[Dim, Dim], flip: bool, isz: int,
              wgrad: bool = False) -> bool:
    """Whether ``conv2d_kernel`` runs this convolution of an input with ``channels`` channels (its bands and
    weight blocks fit SBUF); ``wgrad``: and ``conv2d_wgrad_kernel`` its weight gradient."""
    ci = channels // groups
    co = w_shape[1] if flip else w_shape[0] // groups
    hd, wd = dims
    if min(hd.out, wd.out) <= 0 or plan(hd, wd, ci, co, isz) is None:
        return False
    return not wgrad or ci * hd.k * wd.k * (4 + isz) <= WGRAD_ROW_BYTES


@nki.jit
def conv2d_kernel(x, w, bias=None, dims=None, groups=1, flip=False):
    """2-D convolution of x [N, C, H, W] with w ([O, C/G, KH, KW]; ``flip``: the forward weight of an input
    gradient, [C_fwd, O/G, KH, KW] read flipped) along ``dims`` (two ``Dim``), plus a per-channel ``bias``."""
    N, CX, H, Wd = x.shape
    hd, wd = dims
    assert (hd.size, wd.size) == (H, Wd), f"conv2d: dims {dims} do not describe an input of {H}x{Wd}"
    G = groups
    kk = hd.k * wd.k
    assert (w.shape[2], w.shape[3]) == (hd.k, wd.k), "conv2d: kernel size differs from dims"
    ci = CX // G
    co = w.shape[1] if flip else w.shape[0] // G
    assert (w.shape[0] // G if flip else w.shape[1]) == ci, "conv2d: weight and input channels differ"
    dt, isz = x.dtype, itemsize(x.dtype)
    assert w.dtype == dt, "conv2d: input and weight dtypes differ"
    p = plan(hd, wd, ci, co, isz)
    assert p is not None, "conv2d: the input bands or weights do not fit SBUF (see conv_fits)"
    OH, OW = hd.out, wd.out
    out = nl.ndarray((N, co * G, OH, OW), dt, buffer=nl.shared_hbm)
    evict = alternating_evict()
    cis, cos_all = tiles(ci), tiles(co)
    ring = collections.deque(maxlen=3)     # input bands of the last bands (the next one's loads overlap matmuls)
    accs = collections.deque(maxlen=4)     # PSUM chunks in flight (evictions overlap the next matmuls)
    stages = collections.deque(maxlen=2)
    zeros = None
    if flip:
        zeros = nl.ndarray((1, PSUM_FP32), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0, engine=nisa.gpsimd_engine)
    wflat = w.reshape((w.shape[0], w.shape[1] * kk))
    images = _image_groups(N, hd, wd, p, len(cis), isz)
    for g in range(G):
        for b0 in range(0, len(cos_all), p.co_block):
            cos = cos_all[b0:b0 + p.co_block]
            stat = _weights(wflat, g, cis, cos, kk, flip, ci, co, evict)
            bcols = {}
            if bias is not None:
                for j, (o0, on) in enumerate(cos):
                    t = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=t[:on], src=bias.reshape((bias.shape[0], 1))[g * co + o0:g * co + o0 + on])
                    bcols[j] = t
            for n0, nb, oh0, nr, ow0, nc, bands in _ahead(b for n0, nb in images for b in
                                                          _bands(x, n0, nb, g * ci, cis, hd, wd, p)):
                ring.append(bands)
                for j, (o0, on) in enumerate(cos):
                    stage = nl.ndarray((PMAX, nb, nr, nc), dt, buffer=nl.sbuf)
                    stages.append(stage)
                    for r0 in range(0, nr, p.chunk_rows):
                        rn = min(p.chunk_rows, nr - r0)
                        acc = nl.ndarray((PMAX, nb, rn, nc), nl.float32, buffer=nl.psum)
                        accs.append(acc)
                        steps = [(i, kh, kw) for i in range(len(cis)) for kh in range(hd.k)
                                 for kw in range(wd.k)]
                        reads = _gradient_reads(hd, wd, oh0 + r0, rn, ow0, nc) if flip else None
                        if flip:     # each offset's products over the outputs it has; the first covers them all
                            full = [kk for kk, ((_, cr), (_, cc)) in reads.items() if (cr, cc) == (rn, nc)]
                            if full:
                                steps = [(0, *full[0])] + [t for t in steps if t != (0, *full[0])]
                            else:    # no offset has every output: the sums start from zeros (0 x 0 on TensorE)
                                nisa.nc_matmul(dst=acc[:on], stationary=zeros[:1, :on], moving=zeros[:1, :nb * rn * nc],
                                               accumulate=False)
                        for s, (i, kh, kw) in enumerate(steps):
                            cn = cis[i][1]
                            a, b = r0 * hd.s + kh * hd.d, kw * wd.d
                            if flip:
                                (fr, cr), (fc, cc) = reads[kh, kw]
                                if cr == 0 or cc == 0:
                                    continue
                                rows, cols = slice(fr, fr + (cr - 1) * hd.ld + 1, hd.ld), slice(fc, fc + (cc - 1) * wd.ld + 1, wd.ld)
                                nisa.nc_matmul(dst=acc[:on, :, rows, cols], stationary=stat[i, j][:cn, kh * wd.k + kw, :on],
                                               moving=bands[i][:cn, :, a + fr:a + rows.stop:hd.ld,
                                                               b + fc:b + cols.stop:wd.ld],
                                               accumulate=s > 0 or not full)
                                continue
                            mv = bands[i][:cn, :, a:a + (rn - 1) * hd.s + 1:hd.s, b:b + (nc - 1) * wd.s + 1:wd.s]
                            nisa.nc_matmul(dst=acc[:on], stationary=stat[i, j][:cn, kh * wd.k + kw, :on],
                                           moving=mv, accumulate=s > 0)
                        if bias is not None:
                            nisa.activation(dst=stage[:on, :, r0:r0 + rn, :], op=nl.identity, data=acc[:on],
                                            bias=bcols[j][:on])
                        else:
                            evict(stage[:on, :, r0:r0 + rn, :], acc[:on])
                    nisa.dma_copy(dst=out.ap([[OH * OW, on], [co * G * OH * OW, nb], [OW, nr], [1, nc]],
                                             offset=((n0 * co * G + g * co + o0) * OH + oh0) * OW + ow0),
                                  src=stage[:on])
    return out


def _gradient_reads(hd: Dim, wd: Dim, oh0: int, rn: int, ow0: int, nc: int) -> dict:
    """{(kh, kw): ((first, count) of rows, (first, count) of columns)}: the outputs of an input gradient's chunk
    (rows oh0 + r, r < rn; columns ow0 + c, c < nc) whose window offset reads an element of the output gradient,
    not the padding around it or a zero inserted by the stride (every ld-th output from the first; stride-1
    dims). Its matmuls cover only those: a zero there times an inf or NaN weight would be NaN where the CPU's
    sum has no term."""
    def along(dim: Dim, o0: int, n: int, k: int) -> tuple[int, int]:
        q0 = o0 + k * dim.d - dim.lo          # the zero-inserted coordinate output o0 reads
        t = max(0, -q0)
        t += -(q0 + t) % dim.ld
        last = min(n - 1, (dim.size - 1) * dim.ld - q0)
        return (t, (last - t) // dim.ld + 1) if last >= t else (0, 0)
    assert hd.s == wd.s == 1, "an input gradient's dims have stride 1"
    return {(kh, kw): (along(hd, oh0, rn, kh), along(wd, ow0, nc, kw)) for kh in range(hd.k) for kw in range(wd.k)}


def _weights(wflat, g: int, cis: list, cos: list, kk: int, flip: bool, ci: int, co: int, evict) -> dict:
    """{(ci tile, co tile): SBUF [ci, kk, co]}: the stationary operands of group g's block ``cos``."""
    dt, isz = wflat.dtype, itemsize(wflat.dtype)
    tiles = {}
    if flip:
        # the forward weight's rows [ci (this conv's contraction), (co, k)] are contraction-major already:
        # one copy per tile reorders them to [ci, k, co] with the window flipped (k' = kk - 1 - k)
        for i, (c0, cn) in enumerate(cis):
            rows = nl.ndarray((PMAX, co * kk), dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=rows[:cn], src=wflat[g * ci + c0:g * ci + c0 + cn])
            for j, (o0, on) in enumerate(cos):
                t = nl.ndarray((PMAX, kk, on), dt, buffer=nl.sbuf)
                for k in range(kk):
                    f = o0 * kk + kk - 1 - k
                    nisa.tensor_copy(dst=t[:cn, k, :], src=rows[:cn, f:f + (on - 1) * kk + 1:kk],
                                     engine=nisa.gpsimd_engine)
                tiles[i, j] = t
        return tiles
    per_bank = max(1, PSUM_FP32 * 4 // (PMAX * isz))       # transposes per PSUM bank (8 bf16, 4 fp32)
    for j, (o0, on) in enumerate(cos):
        rows = nl.ndarray((PMAX, ci * kk), dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows[:on], src=wflat[g * co + o0:g * co + o0 + on])
        for i, (c0, cn) in enumerate(cis):
            t = nl.ndarray((PMAX, kk, on), dt, buffer=nl.sbuf)
            for k0 in range(0, kk, per_bank):
                nk = min(per_bank, kk - k0)
                tp = nl.ndarray((PMAX, per_bank, PMAX), dt, buffer=nl.psum)
                for k in range(k0, k0 + nk):             # rows[o, c*kk + k] -> tp[c, k, o]
                    nisa.nc_transpose(dst=tp[:cn, k - k0, :on],
                                      data=rows[:on, c0 * kk + k:(c0 + cn - 1) * kk + k + 1:kk])
                evict(t[:cn, k0:k0 + nk, :], tp[:cn, :nk, :on])
            tiles[i, j] = t
    return tiles


def _copy_engine(dt):
    """The engine that places loaded data into a padded tile: VectorE for 2-byte dtypes (its performance mode
    copies them 4x faster), GpSimd for fp32 (the engine the evictions leave idle)."""
    return nisa.vector_engine if itemsize(dt) == 2 else nisa.gpsimd_engine


def fill_outside(t, p: int, rows: int, cols: int, r: tuple[int, int, int], c: tuple[int, int, int],
                 value: float = 0.0) -> None:
    """Fill an SBUF [p, rows, cols] tile with ``value`` outside the (offset, count, step) rows x columns the data
    will fill: the border strips when the steps are 1 (padding) and the tile is large, else the whole tile once
    (under inserted zeros; and a small tile, where one instruction costs less host time than four and about the
    same device time)."""
    (r0, nr, rs), (c0, nc, cs) = r, c
    border = rows * cols > nr * nc
    if border and (nr == 0 or nc == 0 or rs > 1 or cs > 1 or rows * cols <= WHOLE_FILL):
        nisa.memset(dst=t[:p], value=value, engine=nisa.gpsimd_engine)
        return
    for rr in ((0, r0), (r0 + nr, rows)):
        if rr[0] < rr[1]:
            nisa.memset(dst=t[:p, rr[0]:rr[1], :], value=value, engine=nisa.gpsimd_engine)
    for cc in ((0, c0), (c0 + nc, cols)):
        if cc[0] < cc[1]:
            nisa.memset(dst=t[:p, r0:r0 + nr, cc[0]:cc[1]], value=value, engine=nisa.gpsimd_engine)


def _ahead(items, depth: int = 1):
    """The items of a generator whose advancing issues instructions (loads, transposes), ``depth`` ahead: item
    i + depth's are issued before item i is used, so they overlap its compute."""
    it = iter(items)
    queue = collections.deque(itertools.islice(it, depth))
    for item in it:
        queue.append(item)
        yield queue.popleft()
    yield from queue


def _image_groups(n: int, hd: Dim, wd: Dim, p: Plan, ci_tiles: int, isz: int) -> list[tuple[int, int]]:
    """(first image, images) of the forward kernel's bands: several images per band and PSUM chunk where one chunk
    holds a whole image (a small CNN's 8 x 8 maps: one matmul per window offset for up to 8 images instead of
    one each), else one."""
    OH, OW = hd.out, wd.out
    per = 1
    if p.band_rows == p.chunk_rows == OH and p.band_cols == OW:
        band = ci_tiles * hd.span(0, OH)[1] * wd.span(0, OW)[1] * isz
        per = max(1, min(PSUM_FP32 // (OH * OW), X_BAND_BYTES // band))
    return [(n0, min(per, n - n0)) for n0 in range(0, n, per)]


def _bands(x, n0: int, nb: int, c0: int, cis: list, hd: Dim, wd: Dim, p: Plan):
    """(first image, images, first output row, rows, first output column, columns, input bands per ci tile) of
    the bands of images [n0, n0 + nb) (several images only where a band holds whole images)."""
    OH, OW = hd.out, wd.out
    assert nb == 1 or (p.band_rows >= OH and p.band_cols >= OW), "conv2d: bands of several images hold whole images"
    for oh0 in range(0, OH, p.band_rows):
        nr = min(p.band_rows, OH - oh0)
        ph0, hb = hd.span(oh0, nr)
        for ow0 in range(0, OW, p.band_cols):
            nc = min(p.band_cols, OW - ow0)
            pw0, wb = wd.span(ow0, nc)
            yield n0, nb, oh0, nr, ow0, nc, [_load_band(x, n0, nb, c0 + c, cn, hd, wd, ph0, hb, pw0, wb)
                                             for c, cn in cis]


def _load_band(x, n0: int, nb: int, c0: int, cn: int, hd: Dim, wd: Dim, ph0: int, hb: int, pw0: int, wb: int):
    """SBUF [cn, nb, hb, wb]: padded rows [ph0, ph0 + hb) x columns [pw0, pw0 + wb) of channels [c0, c0 + cn) of
    images [n0, n0 + nb) (zeros where padding or inserted zeros fall)."""
    _, C, H, W = x.shape
    dt = x.dtype
    band = nl.ndarray((PMAX, nb, hb, wb), dt, buffer=nl.sbuf)
    i0, ni, ri = hd.fill(ph0, hb)
    j0, nj, rj = wd.fill(pw0, wb)
    src = x.ap([[H * W, cn], [C * H * W, nb], [W, ni], [1, nj]], offset=((n0 * C + c0) * H + i0) * W + j0)
    whole = (ri, rj) == (0, 0) and (ni, nj) == (hb, wb) and hd.ld == wd.ld == 1
    if whole:                    # the band is all real input: one DMA straight in
        nisa.dma_copy(dst=band[:cn], src=src)
        return band
    if nb == 1:
        fill_outside(band.reshape((PMAX, hb, wb)), cn, hb, wb, (ri, ni, hd.ld), (rj, nj, wd.ld))
    else:                        # several small images: one fill
        nisa.memset(dst=band[:cn], value=0.0, engine=nisa.gpsimd_engine)
    if ni == 0 or nj == 0:
        return band
    # the real part lands in strided rows/columns of the band: load it contiguous (long DMA rows, not one
    # descriptor per short row) and place it with one GpSimd copy
    raw = nl.ndarray((PMAX, nb, ni, nj), dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=raw[:cn], src=src)
    nisa.tensor_copy(dst=band[:cn, :, ri:ri + (ni - 1) * hd.ld + 1:hd.ld, rj:rj + (nj - 1) * wd.ld + 1:wd.ld],
                     src=raw[:cn], engine=_copy_engine(dt))
    return band


@nki.jit
def conv2d_wgrad_kernel(x, gy, dims=None, groups=1, kernel=(1, 1)):
    """The weight gradient [O, C/G, KH, KW] of a 2-D convolution of x [N, C, H, W] whose output gradient is
    gy [N, O, OH, OW], along ``dims`` (the forward's two ``Dim``).

    dW[o, c, kh, kw] = sum over (n, oh, ow) of gy[o, oh, ow] * xp[c, oh * sh + kh * dh, ow * s + kw * d] (xp: x
    zero-padded). Per chunk of (rows, output columns) positions, numbered column-major (position (j, r) on
    partition j * rows + r), the gradient is transposed once, and each window row kh of the input once per
    ``_tap_groups`` group: the band columns rho + s * t, t from the chunk's first column plus the group's first
    delta. Window offset kw of the group (kw * d = rho + s * delta) reads one contiguous range of those
    partitions, (delta - d0) * rows down from the gradient's: its matmuls contract over that range only, with
    the gradient moved there by an SBUF -> SBUF DMA. No product pairs an input column with a zero standing for
    an output the window offset does not have there (a NaN or inf of x would make 0 * inf = NaN where the CPU's
    sum never reads it); padding is read as the zeros it is, as im2col reads it."""
    N, C, H, Wd = x.shape
    O, OH, OW = gy.shape[1], gy.shape[2], gy.shape[3]
    hd, wd = dims
    KH, KW = kernel
    assert (hd.k, wd.k) == (KH, KW) and (hd.out, wd.out) == (OH, OW) and (hd.size, wd.size) == (H, Wd), \
        "conv2d_wgrad: dims do not match the tensors"
    assert hd.ld == wd.ld == 1, "conv2d_wgrad: the forward's dims have no inserted zeros"
    G = groups
    ci, co = C // G, O // G
    dt, isz = x.dtype, itemsize(x.dtype)
    assert gy.dtype == dt, "conv2d_wgrad: input and gradient dtypes differ"
    out = nl.ndarray((O, ci, KH, KW), dt, buffer=nl.shared_hbm)
    p = plan(hd, wd, ci, 1, isz)
    assert p is not None, "conv2d_wgrad: the input bands do not fit SBUF (see conv_fits)"
    cis, cos = tiles(ci), tiles(co)
    taps, tap_of = _tap_groups(wd)
    spread = max(d1 - d0 for _, d0, d1 in taps)     # columns a group's transpose holds beyond the chunk's
    cols = KW * KH * ci                             # accumulator columns per output channel, (kw, kh, c) order
    blocks = [(f0, min(4 * PSUM_FP32, cols - f0)) for f0 in range(0, cols, 4 * PSUM_FP32)]
    per_bank = max(1, PSUM_FP32 * 4 // (PMAX * isz))
    evict = alternating_evict()
    ring = collections.deque(maxlen=3)              # input bands and gradient bands of the last bands
    keep = (collections.deque(maxlen=4), collections.deque(maxlen=16))  # transposes' PSUM, SBUF tiles

    def piece(kw, kh, c0, cn, f0, fw):
        """Accumulator columns [s0, s1) of (kw, kh, channels c0..c0+cn) inside the block [f0, f0 + fw)."""
        base = (kw * KH + kh) * ci + c0
        return base, max(base, f0), min(base + cn, f0 + fw)

    for g in range(G):
        for o0, on in cos:
            res = nl.ndarray((PMAX, cols), nl.float32, buffer=nl.sbuf)   # this o tile's dW row, (kw, kh, c)
            for f0, fw in blocks:
                kws = list(range(f0 // (KH * ci), (f0 + fw - 1) // (KH * ci) + 1))
                xs = [(kh, i) for kh in range(KH) for i, (c0, cn) in enumerate(cis)
                      if any(piece(kw, kh, c0, cn, f0, fw)[1] < piece(kw, kh, c0, cn, f0, fw)[2] for kw in kws)]
                used = sorted({tap_of[kw][0] for kw in kws})     # the tap groups whose input columns are transposed
                accs = [nl.ndarray((PMAX, min(PSUM_FP32, fw - b)), nl.float32, buffer=nl.psum)
                        for b in range(0, fw, PSUM_FP32)]

                def operands():
                    """Per chunk of positions (issuing its transposes and copies): ({kw: (slot of its group in the
                    x^T tiles, first partition)}, positions, gradient^T by first partition, x^T per xs)."""
                    def inputs():
                        for n in range(N):
                            for _, _, oh0, nr, ow0, nc, bands in _bands(x, n, 1, g * ci, cis, hd, wd, p):
                                yield nr, ow0, nc, bands, _grad_band(gy, n, g * co + o0, on, oh0, nr, ow0, nc)
                    for nr, ow0, nc, bands, gb in _ahead(inputs()):
                        ring.append((bands, gb))
                        m, rc = (nc, max(1, PMAX // (nc + spread))) if nc + spread <= PMAX else (PMAX - spread, 1)
                        made = {}                             # x^T tiles of the previous chunk, by what they hold
                        for r0 in range(0, nr, rc):
                            rn = min(rc, nr - r0)
                            for j0 in range(0, nc, m):
                                mn = min(m, nc - j0)
                                # offset kw reads partitions [off * rn, (off + mn) * rn) of its group's x^T
                                spans = {kw: (used.index(tap_of[kw][0]), tap_of[kw][1] * rn) for kw in kws}
                                gTs = _grad_shifted(gb, r0, rn, j0, mn, on, {e for _, e in spans.values()},
                                                    dt, per_bank, evict, keep)
                                a = r0 * hd.s
                                xTs, new = [], {}
                                for kh, i in xs:              # a window row another chunk already transposed is reused
                                    key = (a + kh * hd.d, rn, j0, i)
                                    if key not in made:
                                        h0, cn = a + kh * hd.d, cis[i][1]
                                        views = []
                                        for t in used:
                                            rho, d0, d1 = taps[t]
                                            c0, ln = rho + wd.s * (j0 + d0), mn + d1 - d0
                                            views.append(_cols_first(bands[i][:cn, 0, h0:h0 + (rn - 1) * hd.s + 1:hd.s,
                                                                              c0:c0 + (ln - 1) * wd.s + 1:wd.s]))
                                        made[key] = _transposed(views, PMAX, dt, per_bank, evict, keep)
                                    new[key] = made[key]
                                    xTs.append(made[key])
                                made = new
                                yield spans, rn * mn, gTs, xTs

                def products(spans, q, gTs, xTs, first):
                    for kw in kws:
                        u, p0 = spans[kw]
                        gT, p1 = gTs[p0], p0 + q
                        for j, (kh, i) in enumerate(xs):
                            base, s0, s1 = piece(kw, kh, *cis[i], f0, fw)
                            while s0 < s1:                    # split at PSUM bank edges
                                b = (s0 - f0) // PSUM_FP32
                                e = min(s1, f0 + (b + 1) * PSUM_FP32)
                                lo = f0 + b * PSUM_FP32
                                nisa.nc_matmul(dst=accs[b][:on, s0 - lo:e - lo], stationary=gT[p0:p1, :on],
                                               moving=xTs[j][p0:p1, u, s0 - base:e - base], accumulate=not first)
                                s0 = e

                # software pipeline: chunk i+1's and i+2's transposes are issued before chunk i's matmuls, so TensorE
                # never waits for the evictions and copies of the operands it is about to use
                first = True
                for chunk in _ahead(operands(), 3):
                    products(*chunk, first)
                    first = False
                for bi, acc in enumerate(accs):
                    b0 = f0 + bi * PSUM_FP32
                    nisa.tensor_copy(dst=res[:on, b0:b0 + acc.shape[1]], src=acc[:on])
            # dW[o, c, kh, kw] from the (kw, kh, c) columns: reordered on chip, rounded once, one contiguous store
            cast = nl.ndarray((PMAX, ci, KH, KW), dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=cast[:on], src=res[:on].ap([[cols, on], [1, ci], [ci, KH], [KH * ci, KW]]))
            nisa.dma_copy(dst=out.reshape((O, cols))[g * co + o0:g * co + o0 + on],
                          src=cast[:on].reshape((on, cols)))
    return out


@nki.jit
def conv2d_backward_kernel(x, gy, w, dims=None, gdims=None, groups=1):
    """Both gradients of a 2-D convolution of x [N, C, H, W] by w, whose output gradient is gy, in one launch:
    (input gradient, ``conv2d_kernel`` with ``flip`` along ``gdims``; weight gradient, ``conv2d_wgrad_kernel``
    along the forward's ``dims``). One program lets each part's DMAs and evictions overlap the other's TensorE
    work, and saves a launch."""
    gw = conv2d_wgrad_kernel(x, gy, dims=dims, groups=groups, kernel=(w.shape[2], w.shape[3]))
    gx = conv2d_kernel(gy, w, dims=gdims, groups=groups, flip=True)
    return gx, gw


def _tap_groups(wd: Dim, limit: int = 64) -> tuple[list, dict]:
    """The window offsets kw of ``wd`` grouped for the weight gradient's input transposes: the band columns offset
    kw reads for output columns j are kw * d + s * j = rho + s * (j + delta), so offsets of one residue rho share
    one strided run of columns, shifted by delta (a group is split where its deltas spread beyond ``limit``,
    which keeps 128 - limit output columns per chunk). ([(rho, d0, d1) per group], {kw: (group, delta - d0)})."""
    groups, where = [], {}
    by_rho = collections.defaultdict(list)
    for kw in range(wd.k):
        by_rho[kw * wd.d % wd.s].append((kw * wd.d // wd.s, kw))
    for rho in sorted(by_rho):
        for delta, kw in sorted(by_rho[rho]):
            if not groups or groups[-1][0] != rho or delta - groups[-1][1] > limit:
                groups.append([rho, delta, delta])
            groups[-1][2] = delta
            where[kw] = (len(groups) - 1, delta - groups[-1][1])
    return [tuple(t) for t in groups], where


def _cols_first(v):
    """An on-chip [p, rows, cols] view read column after column (free order cols, rows): a transpose puts its
    element (r, j) on partition j * rows + r."""
    (rs, rn), (cs, cn) = v.access.pattern
    return v.ap([[1, v.shape[0]], [cs, cn], [rs, rn]])


def _grad_band(gy, n: int, o0: int, on: int, oh0: int, nr: int, ow0: int, nc: int):
    """SBUF [on, nr, nc]: rows [oh0, oh0 + nr) x columns [ow0, ow0 + nc) of image n's gradient channels
    [o0, o0 + on)."""
    gb = nl.ndarray((PMAX, nr, nc), gy.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=gb[:on], src=gy[n, o0:o0 + on, oh0:oh0 + nr, ow0:ow0 + nc])
    return gb


def _grad_shifted(gb, r0: int, rn: int, j0: int, mn: int, on: int, shifts: set, dt, per_bank: int, evict,
                  keep: tuple) -> dict:
    """The gradient band's chunk (rows [r0, r0 + rn) x columns [j0, j0 + mn)) transposed column-major,
    [rn * mn, on], and for each shift e > 0 a copy moved down e partitions (an SBUF -> SBUF DMA): {e: tile}.
    One TensorE transpose serves every window offset; the partitions outside a copy's range are never read."""
    q = rn * mn
    base = _transposed([_cols_first(gb[:on, r0:r0 + rn, j0:j0 + mn])], on, dt, per_bank, evict, keep)[:, 0, :]
    out = {}
    for e in sorted(shifts):
        if e == 0:
            out[0] = base
            continue
        t = nl.ndarray((PMAX, on), dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[e:e + q, :on], src=base[:q, :on])
        keep[1].append(t)
        out[e] = t
    return out


def _transposed(views: list, width: int, dt, per_bank: int, evict, keep: tuple):
    """SBUF [q, len(views), width]: each view [p, ...positions...] transposed on TensorE (its positions onto
    partitions from 0; q the most positions of a view), ``per_bank`` transposes per PSUM bank, each bank
    evicted once (the partitions past a shorter view's positions hold whatever the bank held: never read);
    the PSUM and SBUF tiles go into the rings ``keep`` (so the next chunks' transposes and evictions use other
    buffers and overlap)."""
    qs = [math.prod(v.shape[1:]) for v in views]
    t = nl.ndarray((PMAX, len(views), width), dt, buffer=nl.sbuf)
    for v0 in range(0, len(views), per_bank):
        nv = min(per_bank, len(views) - v0)
        q = max(qs[v0:v0 + nv])
        tp = nl.ndarray((PMAX, per_bank, width), dt, buffer=nl.psum)
        for j in range(nv):
            v = views[v0 + j]
            nisa.nc_transpose(dst=tp[:qs[v0 + j], j, :v.shape[0]], data=v)
        evict(t[:q, v0:v0 + nv, :], tp[:q, :nv, :])
        keep[0].append(tp)
    keep[1].append(t)
    return t
