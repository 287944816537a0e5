"""2-D convolutions whose patches fit the partitions (C * KH * KW <= 128, stride 1, one group): im2col in SBUF.

The patch matrix of a group of images is built on chip by one DMA per window offset, straight from HBM:
row (kh * KW + kw) * C + c of ``cols [K, images, OH, OW]`` holds x[n, c, oh + kh * dh - ph, ow + kw * dw - pw],
zero where that falls in the padding. Then

    forward:          out[o, L] = W[o, K] @ cols[K, L]                one matmul per 512 positions (K rows)
    weight gradient:  dW[o, K] = sum over L of gy[o, L] cols[K, L]    per 128 positions: cols and gy transposed
                                                                      on TensorE (positions onto partitions),
                                                                      one matmul accumulating in PSUM

with L the positions (n, oh, ow) of several images at once. At a stem's 3 channels or a small CNN's 8 x 8
images the direct kernels (``kernels.conv``) issue one matmul per window offset and image band, each a few
rows of the PE array; here an instruction covers every window offset and several images, so a step runs ~10x
fewer instructions. Each product pairs the elements im2col pairs, padding read as its zeros, as the CPU's
im2col does: no zero stands for anything else.

Limits (``im2col_fits``): one group, stride 1 (a strided window would make every DMA descriptor one element),
K <= 128, one image's positions within ``COLS_BYTES`` per partition; the weight gradient also O <= 128.
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, PSUM_FP32, itemsize, tiles
from torchneuron.kernels.conv import Dim, _ahead, conv2d_kernel
from torchneuron.kernels.matmul import alternating_evict

COLS_BYTES = 32 * 1024      # SBUF bytes per partition of one image group's patches (and of its output gradient)
PSUM_BANK_BYTES = 4 * PSUM_FP32


def im2col_fits(channels: int, out_channels: int, groups: int, dims: tuple[Dim, Dim], isz: int,
                wgrad: bool = False) -> bool:
    """Whether the SBUF-im2col kernels run this plain convolution (``wgrad``: its weight gradient too)."""
    hd, wd = dims
    return (groups == 1 and hd.s == wd.s == 1 and hd.ld == wd.ld == 1 and channels * hd.k * wd.k <= PMAX
            and min(hd.out, wd.out) > 0 and hd.out * wd.out * isz <= COLS_BYTES
            and (not wgrad or out_channels <= PMAX))


def _image_groups(n: int, positions: int, isz: int) -> list[tuple[int, int]]:
    """(first image, images) of each group whose positions fill at most COLS_BYTES per partition."""
    per = max(1, COLS_BYTES // (positions * isz))
    return [(n0, min(per, n - n0)) for n0 in range(0, n, per)]


def _valid(dim: Dim, k: int) -> tuple[int, int, int]:
    """(first output, count, first input) of the outputs whose window offset k reads a real input (stride 1)."""
    first = max(0, dim.lo - k * dim.d)
    last = min(dim.out, dim.size + dim.lo - k * dim.d)
    return first, max(0, last - first), first + k * dim.d - dim.lo


def _patches(x, n0: int, nb: int, hd: Dim, wd: Dim):
    """SBUF [K, nb, OH, OW]: the im2col patches of images [n0, n0 + nb), row (kh * KW + kw) * C + c; one DMA
    per window offset, the padding zeroed first where an offset reads it."""
    _, C, H, W = x.shape
    cols = nl.ndarray((PMAX, nb, hd.out, wd.out), x.dtype, buffer=nl.sbuf)
    spans = [(kh, kw, _valid(hd, kh), _valid(wd, kw)) for kh in range(hd.k) for kw in range(wd.k)]
    if any(rn < hd.out or cn < wd.out for _, _, (_, rn, _), (_, cn, _) in spans):
        nisa.memset(dst=cols[:C * hd.k * wd.k], value=0.0, engine=nisa.gpsimd_engine)
    for kh, kw, (r0, rn, ih), (c0, cn, iw) in spans:
        if rn == 0 or cn == 0:
            continue
        k = (kh * wd.k + kw) * C
        nisa.dma_copy(dst=cols[k:k + C, :, r0:r0 + rn, c0:c0 + cn],
                      src=x.ap([[H * W, C], [C * H * W, nb], [W, rn], [1, cn]], offset=n0 * C * H * W + ih * W + iw))
    return cols


@nki.jit
def conv2d_im2col_kernel(x, w, bias=None, dims=None):
    """2-D convolution of x [N, C, H, W] with w [O, C, KH, KW] along ``dims`` (two ``Dim``, stride 1), plus a
    per-channel ``bias``: im2col in SBUF, one K-row matmul per 512 output positions."""
    N, C, H, W = x.shape
    O, KH, KW = w.shape[0], w.shape[2], w.shape[3]
    hd, wd = dims
    dt, isz = x.dtype, itemsize(x.dtype)
    K, S = C * KH * KW, hd.out * wd.out
    assert w.dtype == dt and w.shape[1] == C and (hd.k, wd.k) == (KH, KW) and (hd.size, wd.size) == (H, W), \
        "conv2d_im2col: weight and dims do not match the input"
    assert im2col_fits(C, O, 1, dims, isz), "conv2d_im2col: see im2col_fits"
    out = nl.ndarray((N, O, hd.out, wd.out), dt, buffer=nl.shared_hbm)
    evict = alternating_evict()
    # the stationary W^T [(kh, kw, c), o]: one DMA reading the weight in that order
    wT = nl.ndarray((PMAX, O), dt, buffer=nl.sbuf)
    nisa.dma_copy(dst=wT[:K], src=w.ap([[KW, KH], [1, KW], [KH * KW, C], [K, O]]))
    bcols = {}
    if bias is not None:
        for o0, on in tiles(O):
            t = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=t[:on], src=bias.reshape((O, 1))[o0:o0 + on])
            bcols[o0] = t
    accs = collections.deque(maxlen=4)      # PSUM chunks in flight (evictions overlap the next matmuls)
    stages = collections.deque(maxlen=2)
    for n0, nb in _image_groups(N, S, isz):
        L = nb * S
        cols = _patches(x, n0, nb, hd, wd).reshape((PMAX, nb * S))
        for o0, on in tiles(O):
            stage = nl.ndarray((PMAX, L), dt, buffer=nl.sbuf)
            stages.append(stage)
            for p0 in range(0, L, PSUM_FP32):                     # TensorE: all K rows in one pass
                pn = min(PSUM_FP32, L - p0)
                acc = nl.ndarray((PMAX, pn), nl.float32, buffer=nl.psum)
                accs.append(acc)
                nisa.nc_matmul(dst=acc[:on], stationary=wT[:K, o0:o0 + on], moving=cols[:K, p0:p0 + pn],
                               accumulate=False)
                if bias is not None:                               # ScalarE: + bias, rounded once
                    nisa.activation(dst=stage[:on, p0:p0 + pn], op=nl.identity, data=acc[:on], bias=bcols[o0][:on])
                else:                                              # ScalarE / VectorE alternating
                    evict(stage[:on, p0:p0 + pn], acc[:on])
            nisa.dma_copy(dst=out.ap([[S, on], [O * S, nb], [1, S]], offset=(n0 * O + o0) * S), src=stage[:on])
    return out


@nki.jit
def conv2d_im2col_wgrad_kernel(x, gy, dims=None, kernel=(1, 1)):
    """The weight gradient [O, C, KH, KW] of a 2-D convolution of x [N, C, H, W] (stride 1, one group) whose
    output gradient is gy [N, O, OH, OW], along the forward's ``dims``: dW[o, K] = sum over positions of
    gy[o, L] cols[K, L], contracted on TensorE 128 positions at a time."""
    N, C, H, W = x.shape
    O = gy.shape[1]
    KH, KW = kernel
    hd, wd = dims
    dt, isz = x.dtype, itemsize(x.dtype)
    K, S = C * KH * KW, hd.out * wd.out
    assert gy.dtype == dt and (hd.k, wd.k) == (KH, KW) and (hd.size, wd.size) == (H, W) \
        and tuple(gy.shape[2:]) == (hd.out, wd.out), "conv2d_im2col_wgrad: dims do not match the tensors"
    assert im2col_fits(C, O, 1, dims, isz, wgrad=True), "conv2d_im2col_wgrad: see im2col_fits"
    out = nl.ndarray((O, C, KH, KW), dt, buffer=nl.shared_hbm)
    evict = alternating_evict()
    acc = nl.ndarray((PMAX, K), nl.float32, buffer=nl.psum)     # dW [o, (kh, kw, c)], summed over every position
    per = PSUM_BANK_BYTES // (max(K, O) * isz)                   # chunks whose transposes share one PSUM bank
    keep = collections.deque(maxlen=8)                           # transposes' PSUM and SBUF tiles in flight
    first = True

    def transposed(groups):
        """Per batch of <= ``per`` chunks of 128 positions (issuing its transposes and evictions): [(positions,
        SBUF slot)], cols^T [128, per, K], gy^T [128, per, O]."""
        for n0, nb in groups:
            L = nb * S
            cols = _patches(x, n0, nb, hd, wd).reshape((PMAX, L))
            g = nl.ndarray((PMAX, L), dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=g[:O], src=gy.ap([[S, O], [O * S, nb], [1, S]], offset=n0 * O * S))
            chunks = [(p0, min(PMAX, L - p0)) for p0 in range(0, L, PMAX)]
            for b0 in range(0, len(chunks), per):
                batch = chunks[b0:b0 + per]
                q = max(n for _, n in batch)
                tiles_ = []
                for src, width in ((cols, K), (g, O)):          # TensorE: positions onto the partitions
                    tp = nl.ndarray((PMAX, per, width), dt, buffer=nl.psum)
                    for j, (p0, n) in enumerate(batch):
                        nisa.nc_transpose(dst=tp[:n, j, :], data=src[:width, p0:p0 + n])
                    t = nl.ndarray((PMAX, per, width), dt, buffer=nl.sbuf)
                    evict(t[:q, :len(batch), :], tp[:q, :len(batch), :])   # rows past a short chunk: never read
                    keep.extend((tp, t))
                    tiles_.append(t)
                yield [n for _, n in batch], tiles_[0], tiles_[1], cols, g

    # software pipeline: the next batch's transposes are issued before this batch's matmuls
    for counts, xT, gT, *_ in _ahead(transposed(_image_groups(N, S, isz))):
        for j, n in enumerate(counts):                           # TensorE: dW[o, K] += gy^T[q, o]^T cols^T[q, K]
            nisa.nc_matmul(dst=acc[:O], stationary=gT[:n, j, :], moving=xT[:n, j, :], accumulate=not first)
            first = False
    # dW[o, c, kh, kw] from the (kh, kw, c) columns: reordered and rounded once on the way out of PSUM
    res = nl.ndarray((PMAX, C, KH, KW), dt, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res[:O], src=acc[:O].ap([[K, O], [1, C], [KW * C, KH], [C, KW]]))
    nisa.dma_copy(dst=out.reshape((O, K)), src=res[:O].reshape((O, K)))
    return out



@nki.jit
def conv2d_im2col_backward_kernel(x, gy, w, dims=None, gdims=None):
    """Both gradients of a 2-D convolution of x [N, C, H, W] by w in one launch: the weight gradient by
    ``conv2d_im2col_wgrad_kernel`` along the forward's ``dims``, the input gradient by the direct kernel's flipped
    loop nest (``conv2d_kernel``, ``flip``) along ``gdims``."""
    gw = conv2d_im2col_wgrad_kernel(x, gy, dims=dims, kernel=(w.shape[2], w.shape[3]))
    gx = conv2d_kernel(gy, w, dims=gdims, groups=1, flip=True)
    return gx, gw
