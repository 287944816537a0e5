"""Flash attention: ``softmax(scale * Q K^T + causal mask) V`` and its backward, one kernel each, with the
score matrix never leaving the core.

Q [B, H, L, E], K [B, H, S, E], V [B, H, S, Ev] are HBM tensors, each optionally seen through a
``view`` (element offset, strides of its 4 dims) so that the heads of a fused QKV projection are read
where they lie. E, Ev <= 128 (Q K^T contracts over E, the backward's dO V^T over Ev: one partition
tile each). The causal mask is PyTorch's ``is_causal``: query i sees keys j <= i (top-left aligned).

Forward, per head (its K^T [E, S] and V [S, Ev] loaded once and kept in SBUF; K^T built by TensorE
transposes), per tile of 128 queries, per group of up to 1024 visible keys (two PSUM banks):

    s = Q K^T  [128, w] fp32                 nc_matmul per 512 keys                  TensorE -> PSUM
    s += mask (keys near the diagonal only)  identity x -inf bias tile, accumulated  TensorE -> PSUM
    m = max(s) (online across groups)        tensor_reduce from PSUM                 VectorE
    p = exp(scale*s - scale*m), l = sum(p)   one activation with its reduce          ScalarE
    p^T per 128 keys                         nc_transpose, evicted by VectorE        TensorE, VectorE
    o (+)= p V                               nc_matmul accumulating over key blocks  TensorE -> PSUM
    o = o / l; lse = log(l) + scale*m        [128, Ev] and [128, 1] only            Vector/Scalar/GpSimd

Keys past the diagonal are never multiplied (a causal tile of queries stops at its last query), so
causal attention costs half. Scores, probabilities and their transposes live in PSUM/SBUF; HBM sees Q,
K, V read once and O, lse written once.

Backward (FlashAttention-2's order), per head, per block of 128 keys j, per query tile i that sees it:

    s = Q_i K_j^T; p = exp(scale*s - lse_i)         TensorE, ScalarE (masked on the diagonal)
    dp = dO_i V_j^T                                 TensorE
    ds = p * (dp - D_i), D_i = rowsum(dO_i * O_i)   one scalar_tensor_tensor        VectorE
    dV_j += p^T dO_i ; dK_j += ds^T Q_i             TensorE, accumulated in PSUM over i
    dQ_i += ds K_j                                  TensorE (ds transposed), added in SBUF fp32
    (scale applied once to dK and dQ at the end)

Probabilities and ds are rounded to the input dtype before their matmuls (as the eager composition
rounds the probabilities it stores); every accumulation is fp32.
"""
from __future__ import annotations

import collections
import itertools

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, PSUM_FP32, cdiv, check_sbuf, itemsize
from torchneuron.kernels.matmul import alternating_evict

NEG_BIG = -3.0e38          # a finite "minus infinity" for masked scores: exp(scale * NEG_BIG + bias) is exactly 0
GROUP = 2 * PSUM_FP32      # keys per score group: two fp32 PSUM banks
EMAX = EVMAX = PMAX         # head dims: Q K^T contracts over E and the backward's dO V^T over Ev, on partitions
NBUF = 2                   # query tiles in flight (their tiles stay allocated while the next one starts)
KEEP_SBUF_BYTES = 32 * 1024  # SBUF per partition for keeping earlier tiles allocated (``_Keep``)
KEEP_MAX = 32


def flash_fits(E: int, Ev: int, S: int, L: int, dtype) -> bool:
    """Whether heads of these sizes take the flash kernels (head dims within one tile, K/V/Q of a head in SBUF)."""
    return 0 < E <= EMAX and 0 < Ev <= EVMAX and S > 0 and L > 0 and _sbuf_bytes(E, Ev, S, L, dtype) <= \
        nl.tile_size.sbuf_fmax_bytes


FLASH_MIN_KEYS = 32        # shorter sequences run faster as grouped small matmuls around a row softmax (256 heads of
                           # 16 x 16 bf16, compiled: forward 109 us against 184 us for flash on trn2); from 32 keys
                           # flash wins (64 heads of 64 x 16 fp32, compiled: forward 58 against 86 us, backward 95
                           # against 190 us; 96 heads of 32 x 64 bf16: 40 against 52 us, 65 against 98 us)


def flash_preferred(E: int, Ev: int, S: int, L: int, dtype) -> bool:
    """Whether attention of these sizes should take the flash kernels rather than the composed small-head path."""
    return max(L, S) >= FLASH_MIN_KEYS and flash_fits(E, Ev, S, L, dtype)


def _sbuf_bytes(E: int, Ev: int, S: int, L: int, dtype) -> int:
    # per partition, backward (the larger): K^T, V^T, Q^T, dO^T [<=128, n] plus K, Q, dO rows and the dQ
    # accumulator (fp32), plus the per-tile work tiles
    isz = itemsize(dtype)
    rows = cdiv(S, PMAX) * (E + Ev) + cdiv(L, PMAX) * (E + Ev)
    return isz * (2 * S + 2 * L + rows) + 4 * cdiv(L, PMAX) * (E + 2) + NBUF * 16 * GROUP + KEEP_SBUF_BYTES


def _view(t, view):
    """(offset, strides) of a [B, H, n, d] HBM tensor: ``view`` if given, else its contiguous layout."""
    if view is not None:
        return view
    B, H, n, d = t.shape
    return 0, (H * n * d, n * d, d, 1)


def _rows(t, view, b: int, h: int, r0: int, rows: int, cols: int):
    """Rows [r0, r0 + rows) of head (b, h) as an HBM access [rows, cols]."""
    off, (sb, sh, sn, sd) = view
    return t.ap([[sn, rows], [sd, cols]], offset=off + b * sb + h * sh + r0 * sn)


def _load_head_rows(t, view, b: int, h: int, n: int, d: int, dt, heads: int = 0):
    """All n rows of head (b, h) as SBUF [128, ceil(n/128), d]: chunk c, partition i holds row c*128 + i (the
    whole 128-row chunks in one DMA). ``heads`` > 0: heads h .. h + heads - 1 at once, [128, chunks, heads, d]
    (one DMA moves each row's heads together: fewer, longer descriptors where the heads lie side by side)."""
    off, (sb, sh, sn, sd) = view
    inner = [[sh, heads], [sd, d]] if heads else [[sd, d]]
    tile = nl.ndarray((PMAX, cdiv(n, PMAX), *([heads] if heads else []), d), dt, buffer=nl.sbuf)
    full, rem = divmod(n, PMAX)
    base = off + b * sb + h * sh
    if full:
        nisa.dma_copy(dst=tile[:, :full], src=t.ap([[sn, PMAX], [PMAX * sn, full], *inner], offset=base))
    if rem:
        nisa.dma_copy(dst=tile[:rem, full], src=t.ap([[sn, rem], *inner], offset=base + full * PMAX * sn))
    return tile


HEAD_GROUP_BYTES = 2048    # SBUF per partition for the rows of heads loaded together (small heads: one DMA per
                           # operand for several heads instead of one each)


def _heads_rows(operands, b: int, H: int, dt, ring):
    """Per head h of batch b: (h, the rows of each operand (tensor, view, rows, head dim) as ``_load_head_rows``
    gives them). Small heads are loaded several at a time (as many as HEAD_GROUP_BYTES of rows hold), each
    head's rows then a view of the group's tile."""
    per_head = itemsize(dt) * sum(cdiv(n, PMAX) * d for _, _, n, d in operands)
    G = max(1, min(H, HEAD_GROUP_BYTES // max(per_head, 1)))
    for h0 in range(0, H, G):
        if G == 1:
            yield h0, [_load_head_rows(t, w, b, h0, n, d, dt) for t, w, n, d in operands]
            continue
        g = min(G, H - h0)
        group = [_load_head_rows(t, w, b, h0, n, d, dt, heads=g) for t, w, n, d in operands]
        ring.sbuf(*group)
        for j in range(g):
            yield h0 + j, [x[:, :, j, :] for x in group]


def _store_head_rows(t, view, b: int, h: int, tile, n: int, d: int) -> None:
    """SBUF [128, ceil(n/128), d] (``_load_head_rows``' layout) into rows [0, n) of head (b, h) of an HBM tensor
    seen through ``view`` (offset, strides of [B, H, n, d])."""
    off, (sb, sh, sn, sd) = view
    base = off + b * sb + h * sh
    full, rem = divmod(n, PMAX)
    if full:
        nisa.dma_copy(dst=t.ap([[sn, PMAX], [PMAX * sn, full], [sd, d]], offset=base), src=tile[:, :full, :d])
    if rem:
        nisa.dma_copy(dst=_rows(t, view, b, h, full * PMAX, rem, d), src=tile[:rem, full, :d])


def result_views(B: int, H: int, n: int, d: int, layout: str, parts: int = 1):
    """(HBM shape, per part the (offset, strides of [B, H, n, d])) of a kernel result of ``parts`` tensors:

    ``"heads"``  [B, H, n, d] each, contiguous (the op's own layout);
    ``"rows"``   [B, n, H, d] each: heads side by side in each row, so ``transpose(1, 2)`` of the result is
                 contiguous and merging (H, d) is a view (what an output projection reads);
    ``"packed"`` all parts in one [B, n, parts, H, d]: the backward's dQ, dK, dV as the rows of the fused QKV
                 projection's gradient (``cat`` of the three is then a view)."""
    if layout == "heads":
        return (B, H, n, d), [(0, (H * n * d, n * d, d, 1))] * parts
    if layout == "rows":
        return (B, n, H, d), [(0, (n * H * d, d, H * d, 1))] * parts
    assert layout == "packed", f"result_views: unknown layout {layout!r}"
    row = parts * H * d
    return (B, n, parts, H, d), [(i * H * d, (n * row, d, row, 1)) for i in range(parts)]


def _transposed(rows, n: int, d: int, evict):
    """SBUF row chunks [128, chunks, d] (``_load_head_rows``) as [d, n]: TensorE transposes into PSUM banks
    of 2 KiB, each bank evicted once."""
    out = nl.ndarray((PMAX, n), rows.dtype, buffer=nl.sbuf)
    per_bank = 2048 // itemsize(rows.dtype) // PMAX          # 128-column transposes per PSUM bank
    for c0 in range(0, cdiv(n, PMAX), per_bank):
        c1 = min(cdiv(n, PMAX), c0 + per_bank)
        tp = nl.ndarray((PMAX, (c1 - c0) * PMAX), rows.dtype, buffer=nl.psum)
        for c in range(c0, c1):
            r = min(PMAX, n - c * PMAX)
            nisa.nc_transpose(dst=tp[:d, (c - c0) * PMAX:(c - c0) * PMAX + r], data=rows[:r, c, :d])
        w = min(n, c1 * PMAX) - c0 * PMAX
        evict(out[:d, c0 * PMAX:c0 * PMAX + w], tp[:d, :w])
    return out


def causal_bias():
    """[128, 128] fp32: 0 where column t <= row r (key at or before the query), else NEG_BIG."""
    zero = nl.ndarray((PMAX, PMAX), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    bias = nl.ndarray((PMAX, PMAX), nl.float32, buffer=nl.sbuf)
    nisa.affine_select(dst=bias, pattern=[[-1, PMAX]], channel_multiplier=1, on_true_tile=zero,
                       on_false_value=NEG_BIG, cmp_op="greater_equal")
    return bias


def _causal_mask():
    """(the identity, the causal bias) in bf16 (which holds NEG_BIG), the operands of ``_mask_diagonal``'s matmul."""
    ident = nl.shared_identity_matrix(PMAX, nl.bfloat16)
    bias = nl.ndarray((PMAX, PMAX), nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=bias, src=causal_bias(), engine=nisa.gpsimd_engine)
    return ident, bias


def _visible(q0: int, p: int, S: int, causal: bool) -> int:
    """Keys [0, n) some query of the tile [q0, q0 + p) sees."""
    return min(S, q0 + p) if causal else S


def _mask_diagonal(sc, c0: int, w: int, q0: int, p: int, mask, causal: bool) -> None:
    """Add the causal bias to the columns of the score group [c0, c0 + w) that only some of the tile's
    queries see (keys q0 .. q0 + p - 1) and set those none sees to NEG_BIG, in place in PSUM. ``mask``:
    ``_causal_mask``'s pair, the bias accumulated onto the scores by TensorE (the identity against it:
    1 * bias, exact; an unmasked score gains 0, a masked one gives exp() 0 either way), for a kernel whose
    VectorE is busier than its TensorE (the forward); else ``causal_bias``' tile, added by VectorE."""
    if not causal:
        return
    lo, hi = max(c0, q0), min(c0 + w, q0 + p)
    if lo < hi:   # key j = lo + t is seen by query q0 + r iff lo - q0 + t <= r
        t0 = lo - q0
        if isinstance(mask, tuple):
            ident, bias = mask
            nisa.nc_matmul(dst=sc[:p, lo - c0:hi - c0], stationary=ident[:p, :p], moving=bias[:p, t0:t0 + hi - lo],
                           accumulate=True)
        else:
            nisa.tensor_tensor(dst=sc[:p, lo - c0:hi - c0], data1=sc[:p, lo - c0:hi - c0],
                               data2=mask[:p, t0:t0 + hi - lo], op=nl.add)
    if c0 + w > q0 + p:   # keys after the tile's last query (a backward key block past the diagonal): none sees them
        nisa.memset(dst=sc[:p, max(c0, q0 + p) - c0:w], value=NEG_BIG)


def _prologue(q, k, v, scale: float, shape, operands, what: str):
    """((B, H, L, S, E, Ev), dtype, each operand's view) of a flash kernel's call, its limits asserted."""
    B, H, L, S, E, Ev = shape if shape is not None else (*q.shape[:3], k.shape[2], q.shape[3], v.shape[3])
    assert 0 < E <= EMAX, f"{what}: head dim {E} > {EMAX} (one contraction tile)"
    assert 0 < Ev <= EVMAX, f"{what}: value head dim {Ev} > {EVMAX} (one contraction tile in the backward)"
    assert scale > 0, f"{what}: the scale must be positive (the running max is taken before scaling)"
    check_sbuf(_sbuf_bytes(E, Ev, S, L, q.dtype), f"{what} L={L} S={S} E={E} Ev={Ev}")
    views = tuple(_view(t, w) if shape is None else w for t, w in operands)
    return (B, H, L, S, E, Ev), q.dtype, views


@nki.jit
def flash_attention_fwd(q, k, v, scale=1.0, causal=False, q_view=None, k_view=None, v_view=None, shape=None,
                        out_layout="heads"):
    """(O in q's dtype, lse [B, H, L] fp32) of ``softmax(scale * Q K^T + mask) V``; O is [B, H, L, Ev], or
    [B, L, H, Ev] with ``out_layout="rows"`` (``result_views``).

    ``shape`` = (B, H, L, S, E, Ev) when q/k/v are flat buffers seen through the views; else their shapes."""
    (B, H, L, S, E, Ev), dt, (qv, kv, vv) = _prologue(q, k, v, scale, shape, ((q, q_view), (k, k_view), (v, v_view)),
                                                      "flash attention")
    out_shape, (ov,) = result_views(B, H, L, Ev, out_layout)
    out = nl.ndarray(out_shape, dt, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, H, L), nl.float32, buffer=nl.shared_hbm)
    lv = (0, (H * L, L, 1, 1))
    evict, mask, ring, pipe = _emitters(causal, itemsize(dt) * (S + 2 * PMAX + cdiv(S, PMAX) * (Ev + PMAX)),
                                        mask_on_tensor=True)
    operands = ((k, kv, S, E), (v, vv, S, Ev), (q, qv, L, E))
    for b in range(B):
        for h, (kr, vr, qr) in _heads_rows(operands, b, H, dt, ring):
            kT = _transposed(kr, S, E, evict)                                                 # [E, S]
            qT = _transposed(qr, L, E, evict)                                                 # [E, L]
            res = nl.ndarray((PMAX, cdiv(L, PMAX), Ev), dt, buffer=nl.sbuf)                  # O of the head
            ls = nl.ndarray((PMAX, cdiv(L, PMAX), 1), nl.float32, buffer=nl.sbuf)             # lse of the head
            ring.sbuf(kT, vr, qT, res, ls)
            for i, q0 in enumerate(range(0, L, PMAX)):
                p = min(PMAX, L - q0)
                last = q0 + p == L
                store = (lambda b=b, h=h, res=res, ls=ls: (_store_head_rows(out, ov, b, h, res, L, Ev),
                                                          _store_head_rows(lse, lv, b, h, ls, L, 1))) if last else None
                pipe.push(_fwd_tile(qT, kT, vr, q0, p, _visible(q0, p, S, causal), E, Ev, float(scale), mask,
                                    causal, evict, res[:, i, :], ls[:, i, :], ring, store))
    pipe.drain()
    return out, lse


def _emitters(causal: bool, tile_bytes: int, mask_on_tensor: bool = False):
    """(PSUM eviction alternating Scalar/Vector, the causal mask's operands or None, the tiles kept allocated, the
    software pipeline) of one kernel whose query tiles use ``tile_bytes`` of SBUF per partition (the mask as
    ``_mask_diagonal`` takes it: added by TensorE with ``mask_on_tensor``, else by VectorE)."""
    mask = (_causal_mask() if mask_on_tensor else causal_bias()) if causal else None
    return alternating_evict(), mask, _Keep(tile_bytes), _Pipeline()


class _Keep:
    """Recent tiles kept allocated, so that a new tile does not reuse memory an earlier one is still read
    from (which would make its writer wait): PSUM tiles of the last NBUF query tiles (PSUM holds 8 banks);
    SBUF tiles of as many as fit KEEP_SBUF_BYTES, up to KEEP_MAX (small heads: loads run many heads ahead;
    64 heads of 64x16 take 111 us instead of 189 us with NBUF)."""

    def __init__(self, tile_bytes: int) -> None:
        self.psum_tiles = collections.deque(maxlen=2 * NBUF)
        self.sbuf_tiles = collections.deque(maxlen=max(2 * NBUF, min(KEEP_MAX, KEEP_SBUF_BYTES // max(tile_bytes, 1))))

    def psum(self, *tiles) -> None:
        """Keep PSUM tiles of the current query tile."""
        self.psum_tiles.append(tiles)

    def sbuf(self, *tiles) -> None:
        """Keep SBUF tiles of the current query tile (or head)."""
        self.sbuf_tiles.append(tiles)


class _Pipeline:
    """Software pipelining in program order: a tile's steps are a generator whose first step (scores, max,
    exp) is emitted before the rest of the previous tile (transposes, PV, normalization), so each engine's
    in-order queue has the next tile's work behind the current one's instead of waiting on its chain."""

    def __init__(self) -> None:
        self.pending = None

    def push(self, steps) -> None:
        """Emit the first step of ``steps``, then finish the tile before it."""
        next(steps)
        self.drain()
        self.pending = steps

    def drain(self) -> None:
        """Finish the pending tile."""
        if self.pending is not None:
            for _ in self.pending:
                pass
            self.pending = None


def _fwd_tile(qT, kT, vr, q0, p, n, E, Ev, scale, mask, causal, evict, res, ls, ring, store):
    """One tile of p queries against keys [0, n), as pipeline steps: online softmax over groups of GROUP keys."""
    dt = qT.dtype
    m = lsum = acc = nb = None      # running raw-score max, sum of exp(scale * (s - m)), unnormalized output
    for g0 in range(0, n, GROUP):
        w = min(GROUP, n - g0)
        sc = nl.ndarray((PMAX, GROUP), nl.float32, buffer=nl.psum)
        for c0 in range(0, w, PSUM_FP32):                       # one matmul per PSUM bank
            cw = min(PSUM_FP32, w - c0)
            nisa.nc_matmul(dst=sc[:p, c0:c0 + cw], stationary=qT[:E, q0:q0 + p], moving=kT[:E, g0 + c0:g0 + c0 + cw],
                           accumulate=False)
        _mask_diagonal(sc, g0, w, q0, p, mask, causal)
        gm = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=gm[:p], op=nl.maximum, data=sc[:p, :w], axis=(1,))
        alpha = None
        if m is None:
            m = gm
        else:                                                    # alpha = exp(scale * (m_old - m_new))
            mnew = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=mnew[:p], data1=m[:p], data2=gm[:p], op=nl.maximum)
            alpha = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=alpha[:p], data1=m[:p], data2=mnew[:p], op=nl.subtract)
            nisa.activation(dst=alpha[:p], op=nl.exp, data=alpha[:p], scale=scale)
            m = mnew
        nb = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)   # -scale * m, the exponent's bias (on GpSimd,
        nisa.tensor_scalar(dst=nb[:p], data=m[:p], op0=nl.multiply, operand0=-scale,   # which is otherwise idle)
                           engine=nisa.gpsimd_engine)
        pt = nl.ndarray((PMAX, GROUP), dt, buffer=nl.sbuf)
        gsum = nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=pt[:p, :w], op=nl.exp, data=sc[:p, :w], bias=nb[:p], scale=scale,
                        reduce_op=nl.add, reduce_res=gsum[:p], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        yield
        # P^T evicted by VectorE (a PSUM -> SBUF bf16 copy runs at twice its rate per element there; ScalarE
        # has the exp): GPT-2 block forward 571.6 -> 566.7 us against alternating, 578.3 us on ScalarE
        pT = _transposed_cols(pt, p, w, _vector_copy)                                     # [128, blocks, p]
        o = nl.ndarray((PMAX, Ev), nl.float32, buffer=nl.psum)
        for j, k0 in enumerate(range(0, w, PMAX)):
            kb = min(PMAX, w - k0)
            nisa.nc_matmul(dst=o[:p, :Ev], stationary=pT[:kb, j, :p], moving=vr[:kb, (g0 + k0) // PMAX, :Ev],
                           accumulate=j > 0)
        if acc is None and g0 + w >= n:                          # one group: normalize straight from PSUM
            acc, lsum = o, gsum
        elif acc is None:
            lsum, acc = gsum, nl.ndarray((PMAX, Ev), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=acc[:p, :Ev], src=o[:p, :Ev], engine=nisa.vector_engine)
        else:                                                    # rescale what came before by alpha
            nisa.scalar_tensor_tensor(dst=lsum[:p], data=lsum[:p], op0=nl.multiply, operand0=alpha[:p],
                                      op1=nl.add, operand1=gsum[:p])
            nisa.scalar_tensor_tensor(dst=acc[:p, :Ev], data=acc[:p, :Ev], op0=nl.multiply, operand0=alpha[:p],
                                      op1=nl.add, operand1=o[:p, :Ev])
        ring.psum(sc, o)
        ring.sbuf(pt, pT)
    nisa.tensor_scalar(dst=res[:p, :Ev], data=acc[:p, :Ev], op0=nl.divide, operand0=lsum[:p])
    nisa.activation(dst=ls[:p], op=nl.log, data=lsum[:p])            # lse = log(l) + scale * m
    nisa.tensor_tensor(dst=ls[:p], data1=ls[:p], data2=nb[:p], op=nl.subtract, engine=nisa.gpsimd_engine)
    if store is not None:
        store()


def _vector_copy(dst, src) -> None:
    """A PSUM -> SBUF eviction on VectorE."""
    nisa.tensor_copy(dst=dst, src=src, engine=nisa.vector_engine)


def _transposed_cols(t, p: int, w: int, evict):
    """Columns [0, w) of an SBUF tile [p, w] as [128, ceil(w/128), p] (block j, partition i = column j*128 + i):
    TensorE transposes into PSUM banks, each bank evicted once (a last block of fewer keys apart)."""
    blocks = cdiv(w, PMAX)
    out = nl.ndarray((PMAX, blocks, PMAX), t.dtype, buffer=nl.sbuf)
    per_bank = 2048 // itemsize(t.dtype) // PMAX
    for j0 in range(0, blocks, per_bank):
        j1 = min(blocks, j0 + per_bank)
        tp = nl.ndarray((PMAX, j1 - j0, PMAX), t.dtype, buffer=nl.psum)
        for j in range(j0, j1):
            kb = min(PMAX, w - j * PMAX)
            nisa.nc_transpose(dst=tp[:kb, j - j0, :p], data=t[:p, j * PMAX:j * PMAX + kb])
        full = max(0, min(j1, w // PMAX) - j0)                  # blocks of 128 keys
        if full:
            evict(out[:, j0:j0 + full, :p], tp[:, :full, :p])
        if j0 + full < j1:
            kb = w - (j1 - 1) * PMAX
            evict(out[:kb, j1 - 1, :p], tp[:kb, j1 - 1 - j0, :p])
    return out


# Which (query tile, key block) pairs form dS = P * (dP - D) on ScalarE (dP - D, evicting PSUM) and GpSimd (the
# product; it has no PSUM access) instead of one VectorE scalar_tensor_tensor: that instruction reads fp32 dP at
# 2 cycles per element, which made VectorE the backward's bottleneck. Two pairs in three (their dS^T evicted by
# VectorE): the GPT-2 block's backward 856 -> 810 us (one in two 825 us, all 821 us).
DS_OFFLOAD = (False, True, True)
DQ_PSUM_BYTES = 2048       # the dQ accumulator of a head stays in PSUM (one bank; two heads in flight) when it
                           # fits, else SBUF


@nki.jit
def flash_attention_bwd(q, k, v, o, do, lse, scale=1.0, causal=False, q_view=None, k_view=None, v_view=None,
                        o_view=None, do_view=None, shape=None, out_layout="heads"):
    """(dQ, dK, dV) of ``flash_attention_fwd`` given its output ``o``, the output's gradient ``do`` and the
    forward's ``lse`` [B, H, L] fp32; the probabilities are recomputed, never stored. ``out_layout``
    (``result_views``): "heads" or "rows" give three tensors; "packed" (L == S, E == Ev) one [B, L, 3, H, E]."""
    (B, H, L, S, E, Ev), dt, (qv, kv, vv, ov, dov) = _prologue(
        q, k, v, scale, shape, ((q, q_view), (k, k_view), (v, v_view), (o, o_view), (do, do_view)),
        "flash attention backward")
    if out_layout == "packed":
        assert L == S and E == Ev, "flash attention backward: packed gradients need L == S and E == Ev"
        packed_shape, views = result_views(B, H, L, E, "packed", parts=3)
        dq = dk = dv = nl.ndarray(packed_shape, dt, buffer=nl.shared_hbm)
    else:
        (q_shape, (dqv,)), (k_shape, (dkv,)), (v_shape, (dvv,)) = (
            result_views(B, H, n, d, out_layout) for n, d in ((L, E), (S, E), (S, Ev)))
        views = (dqv, dkv, dvv)
        dq, dk, dv = (nl.ndarray(sh, dt, buffer=nl.shared_hbm) for sh in (q_shape, k_shape, v_shape))
    Lc, Sc = cdiv(L, PMAX), cdiv(S, PMAX)
    epad = 1 << (E - 1).bit_length()                 # dQ columns per tile, a power of two: no tile crosses a bank
    dq_in_psum = Lc * epad * 4 <= DQ_PSUM_BYTES
    evict, mask, ring, pipe = _emitters(causal, itemsize(dt) * (3 * PMAX + 2 * (L + S) + (Lc + Sc) * (E + Ev)))
    operands = ((q, qv, L, E), (k, kv, S, E), (do, dov, L, Ev), (v, vv, S, Ev), (o, ov, L, Ev))
    offload = itertools.cycle(DS_OFFLOAD)
    for b in range(B):
        for h, (qr, kr, dor, vr, orows) in _heads_rows(operands, b, H, dt, ring):   # [128, chunks, d] each
            qT, kT = _transposed(qr, L, E, evict), _transposed(kr, S, E, evict)
            vT = _transposed(vr, S, Ev, evict)
            doT = _transposed(dor, L, Ev, evict)
            nd, nlse = _row_stats(orows, dor, lse, b, h, L, Ev)
            dqacc = nl.ndarray((PMAX, Lc, epad), nl.float32, buffer=nl.psum if dq_in_psum else nl.sbuf)
            if not dq_in_psum:
                nisa.memset(dst=dqacc, value=0.0)
            dkh = nl.ndarray((PMAX, Sc, E), dt, buffer=nl.sbuf)
            dvh = nl.ndarray((PMAX, Sc, Ev), dt, buffer=nl.sbuf)
            ring.sbuf(qr, kr, dor, qT, kT, vT, doT, nd, nlse, dkh, dvh)   # dqacc: held by the head's steps only
            for j, s0 in enumerate(range(0, S, PMAX)):
                kb = min(PMAX, S - s0)
                tiles = [(i, q0, min(PMAX, L - q0)) for i, q0 in enumerate(range(0, L, PMAX))
                         if not causal or q0 + min(PMAX, L - q0) - 1 >= s0]
                if not tiles:                                # keys no query sees (causal, S > L): zero gradients
                    nisa.memset(dst=dkh[:kb, j, :], value=0.0)
                    nisa.memset(dst=dvh[:kb, j, :], value=0.0)
                    continue
                dvj = nl.ndarray((PMAX, Ev), nl.float32, buffer=nl.psum)
                dkj = nl.ndarray((PMAX, E), nl.float32, buffer=nl.psum)
                for n, (i, q0, p) in enumerate(tiles):
                    last = None
                    if n == len(tiles) - 1:
                        last = (lambda j=j, kb=kb, dvj=dvj, dkj=dkj, dkh=dkh, dvh=dvh: (
                            evict(dvh[:kb, j, :], dvj[:kb, :Ev]),
                            nisa.activation(dst=dkh[:kb, j, :], op=nl.copy, data=dkj[:kb, :E], scale=float(scale))))
                    pipe.push(_bwd_pair(qT, kT, vT, doT, qr, kr, dor, nd, nlse, dqacc, dvj, dkj, i, q0, p, j, s0, kb,
                                        E, Ev, float(scale), mask, causal, evict, dq_in_psum, first=n == 0,
                                        ring=ring, last=last, offload=next(offload)))
            pipe.push(_bwd_head_end(dq, dk, dv, views, dqacc, dkh, dvh, b, h, L, S, E, Ev, float(scale)))
    pipe.drain()
    return dq if out_layout == "packed" else (dq, dk, dv)


def _row_stats(orows, dor, lse, b: int, h: int, L: int, Ev: int):
    """Per query of head (b, h), as [128, Lc] fp32 tiles: -D = -rowsum(dO * O) and -lse (the exponent's bias)."""
    Lc = cdiv(L, PMAX)
    prod = nl.ndarray((PMAX, Lc, Ev), nl.float32, buffer=nl.sbuf)
    d = nl.ndarray((PMAX, Lc), nl.float32, buffer=nl.sbuf)
    nlse = nl.ndarray((PMAX, Lc), nl.float32, buffer=nl.sbuf)
    full, rem = divmod(L, PMAX)
    base = (b * lse.shape[1] + h) * L
    if full:
        nisa.dma_copy(dst=nlse[:, :full], src=lse.ap([[1, PMAX], [PMAX, full]], offset=base))
    if rem:
        nisa.memset(dst=nlse[:, full:Lc], value=0.0)
        nisa.dma_copy(dst=nlse[:rem, full:Lc], src=lse.ap([[1, rem], [1, 1]], offset=base + full * PMAX))
    nisa.tensor_scalar(dst=nlse, data=nlse, op0=nl.multiply, operand0=-1.0)
    if rem:        # rows past L in the last chunk hold no query: zero them so the sums stay finite
        nisa.memset(dst=orows[rem:, Lc - 1, :], value=0.0)
        nisa.memset(dst=dor[rem:, Lc - 1, :], value=0.0)
    nisa.tensor_tensor(dst=prod, data1=dor, data2=orows, op=nl.multiply)
    nisa.tensor_reduce(dst=d, op=nl.add, data=prod, axis=(2,))
    nisa.tensor_scalar(dst=d, data=d, op0=nl.multiply, operand0=-1.0)     # exact: -D, added to dP
    return d, nlse


def _bwd_pair(qT, kT, vT, doT, qr, kr, dor, nd, nlse, dqacc, dvj, dkj, i, q0, p, j, s0, kb, E, Ev, scale, mask,
              causal, evict, dq_in_psum, first, ring, last, offload=False):
    """Pipeline steps of one (query tile i, key block j) pair of the backward (``nd``: -D per query; ``offload``:
    dS formed by ScalarE and GpSimd instead of VectorE)."""
    dt = qT.dtype
    sp = nl.ndarray((PMAX, 2 * PMAX), nl.float32, buffer=nl.psum)     # scores | dP, one PSUM bank
    nisa.nc_matmul(dst=sp[:p, :kb], stationary=qT[:E, q0:q0 + p], moving=kT[:E, s0:s0 + kb], accumulate=False)
    nisa.nc_matmul(dst=sp[:p, PMAX:PMAX + kb], stationary=doT[:Ev, q0:q0 + p], moving=vT[:Ev, s0:s0 + kb],
                   accumulate=False)
    _mask_diagonal(sp, s0, kb, q0, p, mask, causal)
    pr = nl.ndarray((PMAX, PMAX), dt, buffer=nl.sbuf)                  # P = exp(scale * s - lse)
    nisa.activation(dst=pr[:p, :kb], op=nl.exp, data=sp[:p, :kb], bias=nlse[:p, i:i + 1], scale=scale)
    ds = nl.ndarray((PMAX, PMAX), dt, buffer=nl.sbuf)                  # dS / scale = P * (dP - D)
    if offload:   # ScalarE: dP - D (fp32, as the VectorE form rounds it); GpSimd: times P (SBUF operands only)
        dd = nl.ndarray((PMAX, PMAX), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=dd[:p, :kb], op=nl.identity, data=sp[:p, PMAX:PMAX + kb], bias=nd[:p, i:i + 1])
        nisa.tensor_tensor(dst=ds[:p, :kb], data1=dd[:p, :kb], data2=pr[:p, :kb], op=nl.multiply,
                           engine=nisa.gpsimd_engine)
        ring.sbuf(dd)
    else:
        nisa.scalar_tensor_tensor(dst=ds[:p, :kb], data=sp[:p, PMAX:PMAX + kb], op0=nl.add,
                                  operand0=nd[:p, i:i + 1], op1=nl.multiply, operand1=pr[:p, :kb])
    yield
    nisa.nc_matmul(dst=dvj[:kb, :Ev], stationary=pr[:p, :kb], moving=dor[:p, i, :Ev], accumulate=not first)
    nisa.nc_matmul(dst=dkj[:kb, :E], stationary=ds[:p, :kb], moving=qr[:p, i, :E], accumulate=not first)
    tp = nl.ndarray((PMAX, PMAX), dt, buffer=nl.psum)
    nisa.nc_transpose(dst=tp[:kb, :p], data=ds[:p, :kb])
    dsT = nl.ndarray((PMAX, PMAX), dt, buffer=nl.sbuf)
    if offload:   # ScalarE has this pair's dP - D
        nisa.tensor_copy(dst=dsT[:kb, :p], src=tp[:kb, :p], engine=nisa.vector_engine)
    else:
        evict(dsT[:kb, :p], tp[:kb, :p])
    if dq_in_psum:
        nisa.nc_matmul(dst=dqacc[:p, i, :E], stationary=dsT[:kb, :p], moving=kr[:kb, j, :E], accumulate=j > 0)
    else:
        part = nl.ndarray((PMAX, E), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=part[:p, :E], stationary=dsT[:kb, :p], moving=kr[:kb, j, :E], accumulate=False)
        nisa.tensor_tensor(dst=dqacc[:p, i, :E], data1=dqacc[:p, i, :E], data2=part[:p, :E], op=nl.add)
    if last is not None:
        last()
    ring.psum(sp, tp)
    ring.sbuf(pr, ds, dsT)


def _bwd_head_end(dq, dk, dv, views, dqacc, dkh, dvh, b, h, L, S, E, Ev, scale):
    """Pipeline steps closing a head: dQ scaled and cast, the head's dQ, dK, dV stored."""
    yield
    dqh = nl.ndarray((PMAX, cdiv(L, PMAX), E), dq.dtype, buffer=nl.sbuf)
    nisa.activation(dst=dqh, op=nl.copy, data=dqacc[:, :, :E], scale=scale)
    dqv, dkv, dvv = views
    _store_head_rows(dq, dqv, b, h, dqh, L, E)
    _store_head_rows(dk, dkv, b, h, dkh, S, E)
    _store_head_rows(dv, dvv, b, h, dvh, S, Ev)
