"""Attention of small heads, several heads per instruction: ``softmax(scale * Q K^T + causal mask) V`` and its
backward for heads whose queries and keys fit one tile (L, S <= 128), G heads at a time.

The flash kernels (``attention.py``) run one head per loop iteration; for heads of 64 x 16 that is ~19
instructions per head forward and ~32 backward, each nearly empty (a [64, 64] softmax uses 64 of a
partition's elements). Here a group of G heads shares every instruction but its matmuls:

* one DMA per operand loads the G heads' rows side by side ([n, G, d] on n partitions), one TensorE
  transpose stacks their Q^T (K^T, ...) on partitions [G*d, n];
* each head's products are matmuls on its own partitions (contraction rows g*d ..), written side by side
  into one PSUM tile: the scores of all G heads are [L, G, S] in one bank;
* softmax, its statistics and the backward's dS run once over [L, G, S] (reductions over the trailing axis);
* P^T (and dS^T) are transposed 128 // S heads at a time.

Heads whose contraction rows lie on different partitions (Q K^T and dO V^T over each head's E rows, the
products of a transposed chunk over its heads' S rows) run on row tiles of the PE array (``tile_position``),
which the hardware runs concurrently; heads contracting over the same partitions (dV, dK: the queries) keep
the whole array.

A head's matmuls read only its own rows, so an inf or NaN in one head never reaches another (a block-diagonal
operand would: 0 * inf is NaN).

Limits: L, S <= 128 (one tile of queries and keys), G * E and G * Ev <= 128 (stacked transposes),
G * S <= 512 (one fp32 PSUM bank of scores). Heads of a group are consecutive in (batch, head) order, G
dividing H or a multiple of it, so a group is one strided access per operand.

Precision follows the flash kernels: scores, max, sums and every product accumulate in fp32; the
probabilities (and dS) are rounded to the input dtype before their matmuls.
"""
from __future__ import annotations

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, PSUM_FP32, spread
from torchneuron.kernels.attention import (causal_bias, flash_attention_bwd, flash_attention_fwd, flash_preferred,
                                           result_views)
from torchneuron.kernels.matmul import alternating_evict

MIN_GROUP = 2             # fewer heads per instruction than this: the flash kernels are as good


def packed_heads(B: int, H: int, L: int, S: int, E: int, Ev: int) -> int:
    """Heads per group for attention of these sizes (0: not a packed-heads shape). A group is a divisor of H
    heads of one batch element, or whole batch elements (a divisor of B times H)."""
    if not (0 < L <= PMAX and 0 < S <= PMAX and 0 < E <= PMAX and 0 < Ev <= PMAX and B > 0 and H > 0):
        return 0
    g = min(PMAX // max(E, Ev), PSUM_FP32 // S)
    if g >= H:
        g = H * _largest_divisor(B, g // H)
    else:
        g = _largest_divisor(H, g)
    return g if g >= MIN_GROUP else 0


def attention_kernels(B: int, H: int, L: int, S: int, E: int, Ev: int, dtype) -> tuple | None:
    """(forward, backward) attention kernels for heads of these sizes, the one rule of the eager op and the
    compiler: packed heads where they pack, else the flash kernels where preferred, else None (composed)."""
    if packed_heads(B, H, L, S, E, Ev):
        return packed_attention_fwd, packed_attention_bwd
    if flash_preferred(E, Ev, S, L, dtype):
        return flash_attention_fwd, flash_attention_bwd
    return None


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _heads_ap(view, f0: int, G: int, H: int):
    """(element offset of head f0, [stride, count] pairs over the G heads f0 ..) of a [B, H, n, d] view."""
    off, (sb, sh, _, _) = view
    b, h = divmod(f0, H)
    if G <= H:
        return off + b * sb + h * sh, [[sh, G]]
    return off + b * sb, [[sb, G // H], [sh, H]]


def _rows_ap(t, view, f0: int, G: int, H: int, n: int, d: int):
    """Rows [0, n) of G consecutive heads as an HBM access [n, (heads), d]."""
    base, heads = _heads_ap(view, f0, G, H)
    _, (_, _, sn, sd) = view
    return t.ap([[sn, n], *heads, [sd, d]], offset=base)


def _load_rows(t, view, f0: int, G: int, H: int, n: int, d: int, dt, copies: int = 1, block: int = 0):
    """SBUF [copies * block or n, G, d]: the G heads' rows side by side on partitions 0 .. n (``copies`` > 1:
    repeated on partition blocks of ``block`` rows, so that head j of a transposed chunk finds its own rows on
    the partitions its P^T rows occupy: ``_chunk_products``)."""
    tile = nl.ndarray((PMAX, G, d), dt, buffer=nl.sbuf)
    for j in range(copies):
        nisa.dma_copy(dst=tile[j * block:j * block + n], src=_rows_ap(t, view, f0, G, H, n, d))
    return tile


def _stacked_t(rows, n: int, G: int, d: int, dt, evict):
    """SBUF [n, G, d] rows transposed to [G*d, n] (TensorE, evicted to SBUF)."""
    tp = nl.ndarray((PMAX, n), dt, buffer=nl.psum)
    nisa.nc_transpose(dst=tp[:G * d, :n], data=rows[:n])
    out = nl.ndarray((PMAX, n), dt, buffer=nl.sbuf)
    evict(out[:G * d, :n], tp[:G * d, :n])
    return out


def _row_tile(k0: int, k: int) -> dict:
    """PE tiling arguments of a matmul contracting over partitions [k0, k0 + k): the smallest row tile of the
    array holding them (all 128 columns), so that heads whose rows lie in different tiles run concurrently
    (PE rows are fed by their own partitions: heads on the same rows cannot); {} when that is the whole array.
    Row tiles are 32 rows from NeuronCore-v3, 64 on v2."""
    for size in ((32, 64) if nisa.get_nc_version() != nisa.nc_version.gen2 else (64,)):
        if k0 // size == (k0 + k - 1) // size:
            return dict(tile_position=(k0 // size * size, 0), tile_size=(size, PMAX))
    return {}


def _per_head(dst, a, b, G: int, da: int, db: int, n: int) -> None:
    """``dst[:, g] = a_g^T b_g`` for each head g: a [G*da, ...] and b [G*db, ...] hold head g's contraction
    rows at g*da / g*db (n of them when da, db are 0: the heads' rows are the same partitions)."""
    for g in range(G):
        ra = slice(g * da, g * da + n) if da else slice(0, n)
        rb = slice(g * db, g * db + n) if db else slice(0, n)
        tiling = _row_tile(ra.start, n) if da and da == db else {}   # (da = 0: every head on the same rows)
        nisa.nc_matmul(dst=dst[:, g], stationary=a(ra, g), moving=b(rb, g), accumulate=False, **tiling)


def _probabilities(qT, kT, L: int, S: int, G: int, E: int, scale: float, bias):
    """(exp(scale * (s - m)) fp32 [L, G, S], the per-head row max m [L, G]) of the G heads' scores
    s = Q K^T (+ causal bias): one matmul per head on its E partitions, into one PSUM bank."""
    sc = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.psum)
    _per_head(sc[:L], lambda r, g: qT[r, :L], lambda r, g: kT[r, :S], G, E, E, E)
    x = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.sbuf)
    src = sc
    if bias is not None:
        nisa.tensor_tensor(dst=x[:L], data1=sc[:L], data2=bias[:L, :S].ap([[PMAX, L], [0, G], [1, S]]), op=nl.add)
        src = x
    m = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m[:L], op=nl.maximum, data=src[:L], axis=(2,))
    nisa.tensor_tensor(dst=x[:L], data1=src[:L], data2=spread(m, L, G, S), op=nl.subtract,
                       engine=nisa.gpsimd_engine if src is x else nisa.vector_engine)   # (GpSimd reads no PSUM)
    nisa.activation(dst=x[:L], op=nl.exp, data=x[:L], scale=scale)
    return x, m


def _chunk_products(dst, probs, rows, L: int, S: int, G: int, hc: int, dt, evict) -> None:
    """``dst[:, g] = probs_g rows_g`` ([L, S] x [S, d] per head): probs [L, G, S] transposed hc heads at a
    time (head j of a chunk on partitions j*S ..), each head's matmul on its own S partitions; ``rows`` holds
    every head's rows on each partition block (``_load_rows`` with copies=hc)."""
    for c0 in range(0, G, hc):
        n = min(hc, G - c0)
        tp = nl.ndarray((PMAX, L), dt, buffer=nl.psum)
        nisa.nc_transpose(dst=tp[:n * S, :L], data=probs[:L, c0:c0 + n])
        pT = nl.ndarray((PMAX, L), dt, buffer=nl.sbuf)
        evict(pT[:n * S, :L], tp[:n * S, :L])
        for j in range(n):
            nisa.nc_matmul(dst=dst[:, c0 + j], stationary=pT[j * S:(j + 1) * S, :L],
                           moving=rows[j * S:(j + 1) * S, c0 + j], accumulate=False, **_row_tile(j * S, S))


def _group_shape(q, k, v, scale: float, shape, what: str):
    """(B, H, L, S, E, Ev, G, dtype) of a call, its limits asserted (``shape`` None: the tensors' own)."""
    B, H, L, S, E, Ev = shape if shape is not None else (*q.shape[:3], k.shape[2], q.shape[3], v.shape[3])
    G = packed_heads(B, H, L, S, E, Ev)
    assert G, f"{what}: heads of L={L}, S={S}, E={E}, Ev={Ev} (H={H}) are not a packed-heads shape"
    assert scale > 0, f"{what}: the scale must be positive"
    return B, H, L, S, E, Ev, G, q.dtype


def _views(B: int, H: int, given: list) -> list:
    """Each operand's (offset, strides): its view, or the contiguous [B, H, n, d] layout of its ``(view, n, d)``."""
    return [w if w is not None else result_views(B, H, n, d, "heads")[1][0] for w, n, d in given]


@nki.jit
def packed_attention_fwd(q, k, v, scale=1.0, causal=False, q_view=None, k_view=None, v_view=None, shape=None,
                         out_layout="heads"):
    """(O in q's dtype, [B, H, L, Ev] or as ``result_views`` lays out ``out_layout``, lse [B, H, L] fp32) of
    small heads, G per instruction; ``shape`` = (B, H, L, S, E, Ev) when q/k/v are flat buffers seen through
    their views."""
    B, H, L, S, E, Ev, G, dt = _group_shape(q, k, v, scale, shape, "packed attention")
    q_view, k_view, v_view = _views(B, H, [(q_view, L, E), (k_view, S, E), (v_view, S, Ev)])
    out_shape, (ov,) = result_views(B, H, L, Ev, out_layout)
    out = nl.ndarray(out_shape, dt, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, H, L), nl.float32, buffer=nl.shared_hbm)
    evict = alternating_evict()
    bias = causal_bias() if causal else None
    hc = min(G, PMAX // S)                    # heads per P^T chunk (rows: hc * S keys)
    for f0 in range(0, B * H, G):
        qr = _load_rows(q, q_view, f0, G, H, L, E, dt)
        kr = _load_rows(k, k_view, f0, G, H, S, E, dt)
        vrep = _load_rows(v, v_view, f0, G, H, S, Ev, dt, copies=hc, block=S)
        qT = _stacked_t(qr, L, G, E, dt, evict)                                   # [G*E, L]
        kT = _stacked_t(kr, S, G, E, dt, evict)                                   # [G*E, S]
        x, m = _probabilities(qT, kT, L, S, G, E, float(scale), bias)
        lsum = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)                   # the sums of the fp32 exps
        nisa.tensor_reduce(dst=lsum[:L], op=nl.add, data=x[:L], axis=(2,))
        pt = x
        if dt != nl.float32:                                                      # p rounded to the input dtype
            pt = nl.ndarray((PMAX, G, S), dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=pt[:L], src=x[:L], engine=nisa.gpsimd_engine)
        o = nl.ndarray((PMAX, G, Ev), nl.float32, buffer=nl.psum)
        _chunk_products(o[:L], pt, vrep, L, S, G, hc, dt, evict)
        res = nl.ndarray((PMAX, G, Ev), dt, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=res[:L], data1=o[:L], data2=spread(lsum, L, G, Ev), op=nl.divide)
        nisa.dma_copy(dst=_rows_ap(out, ov, f0, G, H, L, Ev), src=res[:L])
        ls = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)                    # lse = log(l) + scale * m
        nisa.activation(dst=ls[:L], op=nl.log, data=lsum[:L])
        nisa.scalar_tensor_tensor(dst=ls[:L], data=m[:L], op0=nl.multiply, operand0=float(scale), op1=nl.add,
                                  operand1=ls[:L])
        nisa.dma_copy(dst=lse.ap([[1, L], [L, G]], offset=f0 * L), src=ls[:L])
    return out, lse


@nki.jit
def packed_attention_bwd(q, k, v, o, do, lse, scale=1.0, causal=False, q_view=None, k_view=None, v_view=None,
                         o_view=None, do_view=None, shape=None, out_layout="heads"):
    """(dQ, dK, dV) of small heads, G per instruction, the probabilities recomputed from the forward's
    logsumexp ``lse`` [B, H, L] fp32; laid out as ``result_views`` gives for ``out_layout`` ("heads" or
    "rows": one tensor each; "packed": one [B, n, 3, H, d] tensor when L == S and E == Ev)."""
    B, H, L, S, E, Ev, G, dt = _group_shape(q, k, v, scale, shape, "packed attention backward")
    q_view, k_view, v_view, o_view, do_view = _views(B, H, [(q_view, L, E), (k_view, S, E), (v_view, S, Ev),
                                                            (o_view, L, Ev), (do_view, L, Ev)])
    assert out_layout != "packed" or (L == S and E == Ev), "packed attention backward: 'packed' needs L == S, E == Ev"
    scale = float(scale)
    evict = alternating_evict()
    hc = min(G, PMAX // S)
    if out_layout == "packed":
        gshape, views = result_views(B, H, L, E, "packed", parts=3)
        grads = nl.ndarray(gshape, dt, buffer=nl.shared_hbm)
        targets = [(grads, w) for w in views]
    else:
        targets = []
        for n, d in ((L, E), (S, E), (S, Ev)):
            gshape, (w,) = result_views(B, H, n, d, out_layout)
            targets.append((nl.ndarray(gshape, dt, buffer=nl.shared_hbm), w))
    for f0 in range(0, B * H, G):
        qr = _load_rows(q, q_view, f0, G, H, L, E, dt)
        krep = _load_rows(k, k_view, f0, G, H, S, E, dt, copies=hc, block=S)     # block 0: the K rows
        vr = _load_rows(v, v_view, f0, G, H, S, Ev, dt)
        orr = _load_rows(o, o_view, f0, G, H, L, Ev, dt)
        dor = _load_rows(do, do_view, f0, G, H, L, Ev, dt)
        qT = _stacked_t(qr, L, G, E, dt, evict)
        kT = _stacked_t(krep, S, G, E, dt, evict)
        doT = _stacked_t(dor, L, G, Ev, dt, evict)
        vT = _stacked_t(vr, S, G, Ev, dt, evict)
        # P = exp(scale * s - lse): the scores minus lse / scale on VectorE, the exp on ScalarE, and keys past
        # the diagonal zeroed by a select on GpSimd (never a product: an overflowed exp there must not be NaN)
        ls = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ls[:L], src=lse.ap([[1, L], [L, G]], offset=f0 * L))
        nisa.tensor_scalar(dst=ls[:L], data=ls[:L], op0=nl.multiply, operand0=1.0 / scale)
        sc = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.psum)
        _per_head(sc[:L], lambda r, g: qT[r, :L], lambda r, g: kT[r, :S], G, E, E, E)
        p = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.sbuf)                  # P, fp32
        nisa.tensor_tensor(dst=p[:L], data1=sc[:L], data2=spread(ls, L, G, S), op=nl.subtract)
        nisa.activation(dst=p[:L], op=nl.exp, data=p[:L], scale=scale)
        if causal:                                                                # query l sees key t iff l - t >= 0
            nisa.affine_select(dst=p[:L], pattern=[[0, G], [-1, S]], channel_multiplier=1, on_true_tile=p[:L],
                               on_false_value=0.0, cmp_op="greater_equal")
        # D = rowsum(dO * O) per head
        prod = nl.ndarray((PMAX, G, Ev), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[:L], data1=dor[:L], data2=orr[:L], op=nl.multiply, engine=nisa.gpsimd_engine)
        dsum = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=dsum[:L], op=nl.add, data=prod[:L], axis=(2,))
        # dS = P * (dO V^T - D)   (scale applied to dQ and dK when they are evicted)
        dp = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.psum)
        _per_head(dp[:L], lambda r, g: doT[r, :L], lambda r, g: vT[r, :S], G, Ev, Ev, Ev)
        ds = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=ds[:L], data1=dp[:L], data2=spread(dsum, L, G, S), op=nl.subtract)
        dsd = nl.ndarray((PMAX, G, S), dt, buffer=nl.sbuf)                        # rounded for its matmuls
        nisa.tensor_tensor(dst=dsd[:L], data1=ds[:L], data2=p[:L], op=nl.multiply, engine=nisa.gpsimd_engine)
        pd = p
        if dt != nl.float32:
            pd = nl.ndarray((PMAX, G, S), dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=pd[:L], src=p[:L], engine=nisa.gpsimd_engine)
        # dV = P^T dO and dK = dS^T Q: per head, contracting over the queries (the same L partitions)
        for (t, w), a, b, d, sc in ((targets[2], pd, dor, Ev, 1.0), (targets[1], dsd, qr, E, scale)):
            acc = nl.ndarray((PMAX, G, d), nl.float32, buffer=nl.psum)
            _per_head(acc[:S], lambda r, g, a=a: a[r, g], lambda r, g, b=b: b[r, g], G, 0, 0, L)
            res = nl.ndarray((PMAX, G, d), dt, buffer=nl.sbuf)
            nisa.activation(dst=res[:S], op=nl.identity, data=acc[:S], scale=sc)
            nisa.dma_copy(dst=_rows_ap(t, w, f0, G, H, S, d), src=res[:S])
        # dQ = dS K: dS^T hc heads at a time, times each head's K rows
        dq = nl.ndarray((PMAX, G, E), nl.float32, buffer=nl.psum)
        _chunk_products(dq[:L], dsd, krep, L, S, G, hc, dt, evict)
        res = nl.ndarray((PMAX, G, E), dt, buffer=nl.sbuf)
        nisa.activation(dst=res[:L], op=nl.identity, data=dq[:L], scale=scale)
        t, w = targets[0]
        nisa.dma_copy(dst=_rows_ap(t, w, f0, G, H, L, E), src=res[:L])
    if out_layout == "packed":
        return grads
    return tuple(t for t, _ in targets)

