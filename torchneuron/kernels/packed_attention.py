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
* P^T (and dS^T) are transposed 128 // S heads at a time;
* with ``stack_queries`` (the graph compiler's programs; the eager op where faster), queries of 32 or 64
  (L == S) stack 128 // L groups on the partitions (group i's queries on partitions i*L ..; ``stacked_groups``): the softmax and backward
  passes above run once for all of them on every partition instead of on L, and each group's products take
  the PE column tile of the PSUM partitions they write (NeuronCore-v3's column tiling), so the stacked
  groups' products run side by side; with ``pass_dmas`` each operand of a pass also moves by one DMA over
  all its partitions (twice the DMA engines of one group's; ``_pass_dma``). Which is faster depends on the
  shape, on how the heads lie in HBM and on what overlaps: the eager op launches whichever the timing model
  prices faster (``ops/attention.py``), so the demo's 64 heads read from a fused projection run stacked with
  pass DMAs (forward 19.8 -> 14.3 us, backward 31.6 -> 23.0 us against unstacked). The graph compiler's
  programs stack without pass DMAs: there the bigger DMAs slow the kernels they overlap (the demo's compiled
  step 0.379 -> 0.381 ms with them).

Heads whose contraction rows lie on different partitions (Q K^T and dO V^T over each head's E rows, the
products of a transposed chunk over its heads' S rows) run on row tiles of the PE array (``tile_position``),
which the hardware runs concurrently; heads contracting over the same partitions (dV, dK: the queries) share a
row tile, so only stacked groups' dV and dK products overlap (each group's queries on its own row tile).

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
from torchneuron.kernels.attention import (NEG_BIG, _vector_copy, causal_bias, flash_attention_bwd, flash_attention_fwd,
                                           flash_preferred, result_views)
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


def _groups_ap(t, view, fs, G: int, H: int, n: int, d: int):
    """Rows [0, n) of the G heads of each consecutive group of ``fs`` as one HBM access [len(fs) * n, G, d]
    (group i's rows first), or None where no one stride steps from group to group (groups of one batch
    element's heads that run into the next)."""
    if len(fs) == 1:
        return _rows_ap(t, view, fs[0], G, H, n, d)
    _, (sb, sh, sn, sd) = view
    if G % H == 0:
        step = (G // H) * sb
    elif fs[0] % H + len(fs) * G <= H:
        step = G * sh
    else:
        return None
    base, heads = _heads_ap(view, fs[0], G, H)
    return t.ap([[step, len(fs)], [sn, n], *heads, [sd, d]], offset=base)


def _pass_dma(moves: list, fs, G: int, H: int, whole_pass: bool, store: bool = False) -> None:
    """Move rows [0, n) of the G heads of each group of ``fs`` between HBM and SBUF for each ``(tile, t, view,
    n, d)`` of ``moves`` (group i on partitions i*n ..; ``store``: to HBM): with ``whole_pass``, one DMA per
    operand for the pass where ``_groups_ap`` finds one (over all the pass's partitions: twice the DMA engines
    of one group's); else one per group and operand, group by group."""
    dmas = []
    for i, f0 in enumerate(fs):
        for tile, t, view, n, d in moves:
            whole = _groups_ap(t, view, fs, G, H, n, d) if whole_pass else None
            if whole is not None and i == 0:
                dmas.append((whole, tile[:len(fs) * n]))
            elif whole is None:
                dmas.append((_rows_ap(t, view, f0, G, H, n, d), tile[i * n:(i + 1) * n]))
    for hbm, sbuf in dmas:
        if store:
            nisa.dma_copy(dst=hbm, src=sbuf)
        else:
            nisa.dma_copy(dst=sbuf, src=hbm)


def _lse_ap(lse, fs, G: int, L: int, whole_pass: bool) -> list:
    """(HBM access, columns of a [G, len(fs) * L] tile) of the [B, H, L] logsumexp rows of the groups of ``fs``:
    head g of group i is row fs[i] + g, its L values contiguous (one 4*L-byte piece per head and group), the
    tile holding it on partition g, columns i*L ..: one DMA for the pass with ``whole_pass`` (consecutive groups'
    heads are consecutive: one stride steps from group to group), else one per group."""
    if whole_pass:
        return [(lse.ap([[L, G], [G * L, len(fs)], [1, L]], offset=fs[0] * L), slice(0, len(fs) * L))]
    return [(lse.ap([[L, G], [1, L]], offset=f0 * L), slice(i * L, (i + 1) * L)) for i, f0 in enumerate(fs)]


def _store_lse(ls, lse, fs, G: int, L: int, whole_pass: bool, evict) -> None:
    """Store ``ls`` [len(fs) * L, G] (query on the partitions, as the softmax makes it) into the [B, H, L]
    logsumexp: transposed on TensorE (bit-exact) to head-major [G, len(fs) * L] first, so that each head's L
    values leave as one piece rather than L 4-byte pieces (a 4-byte descriptor moves at ~1.5 % of a DMA
    engine's peak)."""
    P = len(fs) * L
    tp = nl.ndarray((PMAX, P), nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=tp[:G, :P], data=ls[:P, :G])
    lt = nl.ndarray((PMAX, P), nl.float32, buffer=nl.sbuf)
    evict(lt[:G, :P], tp[:G, :P])
    for hbm, cols in _lse_ap(lse, fs, G, L, whole_pass):
        nisa.dma_copy(dst=hbm, src=lt[:G, cols])


def _load_lse(lse, fs, G: int, L: int, whole_pass: bool):
    """The [B, H, L] logsumexp of the groups of ``fs`` as a PSUM tile [len(fs) * L, G] (``_store_lse``'s
    inverse: loaded head-major in L-value pieces, transposed on TensorE)."""
    P = len(fs) * L
    lt = nl.ndarray((PMAX, P), nl.float32, buffer=nl.sbuf)
    for hbm, cols in _lse_ap(lse, fs, G, L, whole_pass):
        nisa.dma_copy(dst=lt[:G, cols], src=hbm)
    tp = nl.ndarray((PMAX, G), nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=tp[:P, :G], data=lt[:G, :P])
    return tp


def _load_rows(t, view, f0: int, G: int, H: int, n: int, d: int, dt, copies: int = 1, block: int = 0,
               skip: int = -1):
    """SBUF [copies * block or n, G, d]: the G heads' rows side by side on partitions 0 .. n (``copies`` > 1:
    repeated on partition blocks of ``block`` rows, so that head j of a transposed chunk finds its own rows on
    the partitions its P^T rows occupy: ``_chunk_products``; block ``skip`` left out, another tile holds it)."""
    tile = nl.ndarray((PMAX, G, d), dt, buffer=nl.sbuf)
    for j in range(copies):
        if j != skip:
            nisa.dma_copy(dst=tile[j * block:j * block + n], src=_rows_ap(t, view, f0, G, H, n, d))
    return tile


def _side_by_side(operands: list, G: int, H: int) -> bool:
    """Whether operands ``(tensor, view, n, d)`` lie side by side in each row of one HBM tensor, as a fused
    projection's q, k and v do: one buffer, the same strides and rows, each row's H heads contiguous, operand j
    at j * H * d, and groups of whole batch elements. One DMA per group then moves each row's heads of all the
    operands as one piece (q, k, v: 3x the bytes per descriptor)."""
    t0, (o0, st), n0, d0 = operands[0]
    if G % H or st[3] != 1 or st[1] != d0:
        return False
    return all(t.access.memory == t0.access.memory and t.access.offset == t0.access.offset and w == (o0 + j * H * d0, st)
               and (n, d) == (n0, d0) for j, (t, w, n, d) in enumerate(operands))


def _side_by_side_tile(parts: int, G: int, H: int, d: int, dt) -> tuple:
    """(SBUF [128, G // H, parts * H * d], its [128, G // H, H, d] view of each part): the rows of ``parts``
    operands side by side (``_side_by_side``), as one DMA moves them."""
    Gb, row = G // H, parts * H * d
    tile = nl.ndarray((PMAX, Gb, row), dt, buffer=nl.sbuf)
    return tile, [tile.ap([[Gb * row, PMAX], [row, Gb], [d, H], [1, d]], offset=j * H * d) for j in range(parts)]


def _move_side_by_side(tile, operands: list, fs, G: int, H: int, whole_pass: bool, store: bool = False) -> None:
    """Move rows [0, n) of the groups of ``fs`` of operands ``_side_by_side`` lays out between HBM and ``tile``
    (``_side_by_side_tile``; group i on partitions i*n ..; ``store``: to HBM): one DMA per group, or for the
    pass with ``whole_pass``, each row's heads of all the operands one piece."""
    t, (off, (sb, _, sn, _)), n, d = operands[0]
    Gb, row = G // H, len(operands) * H * d
    if whole_pass:
        moves = [(t.ap([[Gb * sb, len(fs)], [sn, n], [sb, Gb], [1, row]], offset=off + fs[0] // H * sb),
                  tile[:len(fs) * n])]
    else:
        moves = [(t.ap([[sn, n], [sb, Gb], [1, row]], offset=off + f0 // H * sb), tile[i * n:(i + 1) * n])
                 for i, f0 in enumerate(fs)]
    for hbm, sbuf in moves:
        if store:
            nisa.dma_copy(dst=hbm, src=sbuf)
        else:
            nisa.dma_copy(dst=sbuf, src=hbm)


def _load_side_by_side(operands: list, fs, G: int, H: int, whole_pass: bool, dt) -> list:
    """Operands ``_side_by_side`` lays out, loaded together (``_move_side_by_side``): each a [128, G // H, H, d]
    view of one tile (``_head``)."""
    tile, views = _side_by_side_tile(len(operands), G, H, operands[0][3], dt)
    _move_side_by_side(tile, operands, fs, G, H, whole_pass)
    return views


def _as_heads(t, P: int, H: int):
    """Partitions [0, P) of a [128, G, d] tile seen as [P, G // H, H, d] (a ``_side_by_side_tile`` view's shape)."""
    _, G, d = t.shape
    return t[:P].reshape((P, G // H, H, d))


def _head(rows, parts, g: int):
    """Head g's rows [parts, d] of a rows tile: [P, G, d], or [P, G // H, H, d] (``_load_side_by_side``)."""
    return rows[parts, g] if rows.ndim == 3 else rows[parts, g // rows.shape[2], g % rows.shape[2]]


def _block_rows(t, view, fs, G: int, H: int, n: int, d: int, dt, hc: int, loaded=None) -> list:
    """Per group i of ``fs``, per partition block j < hc: the tile whose partitions j*n .. hold group i's rows
    (``_chunk_products``): ``loaded`` (the pass's rows, group i on block i) where j == i, else a tile of copies."""
    if loaded is None:
        return [[_load_rows(t, view, f0, G, H, n, d, dt, copies=hc, block=n)] * hc for f0 in fs]
    rest = [_load_rows(t, view, f0, G, H, n, d, dt, copies=hc, block=n, skip=i) for i, f0 in enumerate(fs)]
    return [[loaded if j == i else rest[i] for j in range(hc)] for i in range(len(fs))]


def _stacked_t(blocks: list, n: int, G: int, d: int, dt, evict):
    """SBUF row blocks, each [n, G, d] on its own partitions, transposed side by side to [G*d, len(blocks) * n]
    (TensorE, one transpose per block into one PSUM tile, evicted to SBUF once)."""
    tp = nl.ndarray((PMAX, len(blocks) * n), dt, buffer=nl.psum)
    for i, rows in enumerate(blocks):
        nisa.nc_transpose(dst=tp[:G * d, i * n:(i + 1) * n], data=rows)
    out = nl.ndarray((PMAX, len(blocks) * n), dt, buffer=nl.sbuf)
    evict(out[:G * d, :len(blocks) * n], tp[:G * d, :len(blocks) * n])
    return out


def _scalar_copy(dst, src) -> None:
    """A PSUM -> SBUF eviction on ScalarE (the forward's P^T and logsumexp: VectorE has the softmax's mask, max
    and sums, and alternating put the evictions behind them; the demo's compiled forward 122.3 -> 121.5 us)."""
    nisa.activation(dst=dst, op=nl.identity, data=src)


def _row_tile(k0: int, k: int, c0: int = 0, m: int = PMAX) -> dict:
    """PE tiling arguments of a matmul contracting over partitions [k0, k0 + k): the smallest row tile of the
    array holding them, so that heads whose rows lie in different tiles run concurrently (PE rows are fed by
    their own partitions: heads on the same rows cannot); {} when that is the whole array. ``m`` < 128
    stationary columns written to PSUM partitions [c0, c0 + m) (a stacked group: ``stacked_groups``) take the
    column tile of that size at c0, the PE columns that feed those partitions. Row tiles are 32 rows from
    NeuronCore-v3, 64 on v2."""
    rows = ((32, 64) if nisa.get_nc_version() != nisa.nc_version.gen2 else (64,))
    size = next((r for r in rows if k0 // r == (k0 + k - 1) // r), PMAX)
    if m == PMAX and size == PMAX:
        return {}
    return dict(tile_position=(k0 // size * size, c0), tile_size=(size, m))


def stacked_groups(L: int, S: int) -> int:
    """Groups of heads whose queries share one pass on the partitions (group i on partitions i*L ..): their
    softmax and its statistics run once over all of them. Queries and keys of one PE column tile (32 or 64 on
    NeuronCore-v3), so that each group's products land on their own PE columns; 1 otherwise."""
    if L != S or L not in (32, 64) or nisa.get_nc_version() == nisa.nc_version.gen2:
        return 1
    return PMAX // L


def _stacked_causal_bias(stack: int, L: int):
    """[stack * L, L] fp32: ``stack`` copies of the causal bias of L queries and keys, one per group of queries
    (0 where key t <= query r, else NEG_BIG)."""
    if stack == 1:
        return causal_bias()
    zero = nl.ndarray((PMAX, L), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    bias = nl.ndarray((PMAX, L), nl.float32, buffer=nl.sbuf)
    for i in range(stack):   # (the select's partition index counts from the slice's first partition)
        nisa.affine_select(dst=bias[i * L:(i + 1) * L], pattern=[[-1, L]], channel_multiplier=1,
                           on_true_tile=zero[i * L:(i + 1) * L], on_false_value=NEG_BIG, cmp_op="greater_equal")
    return bias


def _scores(dst, aT, bT, L: int, S: int, G: int, d: int, stack: int) -> None:
    """``dst[i*L .., g] = a_ig^T b_ig`` for each head g and stacked group i: aT [G*d, stack*L] and bT
    [G*d, stack*S] hold head g's d contraction rows at g*d, group i's columns at i*L / i*S; each product on
    its own PE row tile (and column tile when stacked), into one PSUM bank."""
    for i in range(stack):
        q, k = slice(i * L, (i + 1) * L), slice(i * S, (i + 1) * S)
        for g in range(G):
            r = slice(g * d, (g + 1) * d)
            tiling = _row_tile(g * d, d, i * L, L) if stack > 1 else _row_tile(g * d, d)
            nisa.nc_matmul(dst=dst[q, g], stationary=aT[r, q], moving=bT[r, k], accumulate=False, **tiling)


def _probabilities(qT, kT, L: int, S: int, G: int, E: int, scale: float, bias, stack: int = 1):
    """(exp(scale * (s - m)) fp32 [stack*L, G, S], the per-head row max m [stack*L, G]) of the scores
    s = Q K^T (+ causal bias) of ``stack`` groups of G heads (``_scores``)."""
    P = stack * L
    sc = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.psum)
    _scores(sc, qT, kT, L, S, G, E, stack)
    x = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.sbuf)
    src = sc
    if bias is not None:
        nisa.tensor_tensor(dst=x[:P], data1=sc[:P], data2=bias[:P, :S].ap([[bias.shape[1], P], [0, G], [1, S]]),
                           op=nl.add)
        src = x
    m = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m[:P], op=nl.maximum, data=src[:P], axis=(2,))
    nisa.tensor_tensor(dst=x[:P], data1=src[:P], data2=spread(m, P, G, S), op=nl.subtract,
                       engine=nisa.gpsimd_engine if src is x else nisa.vector_engine)   # (GpSimd reads no PSUM)
    nisa.activation(dst=x[:P], op=nl.exp, data=x[:P], scale=scale)
    return x, m


def _chunk_products(dst, probs, rows: list, L: int, S: int, G: int, hc: int, dt, evict) -> None:
    """``dst[:, g] = probs_g rows_g`` ([L, S] x [S, d] per head) for ``len(rows)`` stacked groups (group i's
    queries on partitions i*L ..): probs [stack*L, G, S] transposed hc heads at a time (head j of a chunk on
    partitions j*S ..), each head's matmul on its own S partitions; ``rows[i][j]`` holds group i's rows of every
    head on partition block j (``_block_rows``)."""
    stack = len(rows)
    P = stack * L
    for c0 in range(0, G, hc):
        n = min(hc, G - c0)
        tp = nl.ndarray((PMAX, P), dt, buffer=nl.psum)
        nisa.nc_transpose(dst=tp[:n * S, :P], data=probs[:P, c0:c0 + n])
        pT = nl.ndarray((PMAX, P), dt, buffer=nl.sbuf)
        evict(pT[:n * S, :P], tp[:n * S, :P])
        for j in range(n):
            for i, r in enumerate(rows):
                q = slice(i * L, (i + 1) * L)
                tiling = _row_tile(j * S, S, i * L, L) if stack > 1 else _row_tile(j * S, S)
                nisa.nc_matmul(dst=dst[q, c0 + j], stationary=pT[j * S:(j + 1) * S, q],
                               moving=_head(r[j], slice(j * S, (j + 1) * S), c0 + j), accumulate=False,
                               **tiling)


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
                         out_layout="heads", stack_queries=False, pass_dmas=False):
    """(O in q's dtype, [B, H, L, Ev] or as ``result_views`` lays out ``out_layout``, lse [B, H, L] fp32) of
    small heads, G per instruction; ``shape`` = (B, H, L, S, E, Ev) when q/k/v are flat buffers seen through
    their views. ``stack_queries``: groups stacked on the partitions where they can be (``stacked_groups``);
    ``pass_dmas``: a stacked pass's operands moved by one DMA each (``_pass_dma``)."""
    B, H, L, S, E, Ev, G, dt = _group_shape(q, k, v, scale, shape, "packed attention")
    q_view, k_view, v_view = _views(B, H, [(q_view, L, E), (k_view, S, E), (v_view, S, Ev)])
    out_shape, (ov,) = result_views(B, H, L, Ev, out_layout)
    out = nl.ndarray(out_shape, dt, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, H, L), nl.float32, buffer=nl.shared_hbm)
    evict = alternating_evict()
    stack = stacked_groups(L, S) if stack_queries else 1
    bias = _stacked_causal_bias(stack, L) if causal else None
    hc = min(G, PMAX // S)                    # heads per P^T chunk (rows: hc * S keys)
    qkv = [(q, q_view, L, E), (k, k_view, S, E), (v, v_view, S, Ev)]
    fused = _side_by_side(qkv, G, H)          # a fused projection's q, k, v: one DMA for the three
    lse_store = None
    for f00 in range(0, B * H, stack * G):
        fs = range(f00, min(f00 + stack * G, B * H), G)   # the groups of this pass: group i on partitions i*L ..
        P = len(fs) * L
        if fused:
            qr, kr, vr = _load_side_by_side(qkv, fs, G, H, pass_dmas, dt)
            vrows = _block_rows(v, v_view, fs, G, H, S, Ev, dt, hc, loaded=vr)
        else:
            qr = nl.ndarray((PMAX, G, E), dt, buffer=nl.sbuf)
            kr = nl.ndarray((PMAX, G, E), dt, buffer=nl.sbuf)
            _pass_dma([(qr, q, q_view, L, E), (kr, k, k_view, S, E)], fs, G, H, pass_dmas)
            vrows = _block_rows(v, v_view, fs, G, H, S, Ev, dt, hc)
        qT = _stacked_t([qr[:P]], P, G, E, dt, evict)                             # [G*E, P]
        kT = _stacked_t([kr[:len(fs) * S]], len(fs) * S, G, E, dt, evict)         # [G*E, stack*S]
        x, m = _probabilities(qT, kT, L, S, G, E, float(scale), bias, len(fs))
        if lse_store is not None:     # the previous pass's, emitted behind this pass's softmax
            lse_store()
        lsum = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)                   # the sums of the fp32 exps
        nisa.tensor_reduce(dst=lsum[:P], op=nl.add, data=x[:P], axis=(2,))
        pt = x
        if dt != nl.float32:                                                      # p rounded to the input dtype
            pt = nl.ndarray((PMAX, G, S), dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=pt[:P], src=x[:P], engine=nisa.gpsimd_engine)
        o = nl.ndarray((PMAX, G, Ev), nl.float32, buffer=nl.psum)
        _chunk_products(o, pt, vrows, L, S, G, hc, dt, _scalar_copy)
        res = nl.ndarray((PMAX, G, Ev), dt, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=res[:P], data1=o[:P], data2=spread(lsum, P, G, Ev), op=nl.divide)
        _pass_dma([(res, out, ov, L, Ev)], fs, G, H, pass_dmas, store=True)
        ls = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)                    # lse = log(l) + scale * m
        nisa.activation(dst=ls[:P], op=nl.log, data=lsum[:P])
        nisa.scalar_tensor_tensor(dst=ls[:P], data=m[:P], op0=nl.multiply, operand0=float(scale), op1=nl.add,
                                  operand1=ls[:P])
        lse_store = (lambda ls=ls, fs=fs: _store_lse(ls, lse, fs, G, L, pass_dmas, _scalar_copy))
    lse_store()
    return out, lse


@nki.jit
def packed_attention_bwd(q, k, v, o, do, lse, scale=1.0, causal=False, q_view=None, k_view=None, v_view=None,
                         o_view=None, do_view=None, shape=None, out_layout="heads", stack_queries=False,
                         pass_dmas=False):
    """(dQ, dK, dV) of small heads, G per instruction, the probabilities recomputed from the forward's
    logsumexp ``lse`` [B, H, L] fp32; laid out as ``result_views`` gives for ``out_layout`` ("heads" or
    "rows": one tensor each; "packed": one [B, n, 3, H, d] tensor when L == S and E == Ev); ``stack_queries`` and
    ``pass_dmas`` as for the forward."""
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
    stack = stacked_groups(L, S) if stack_queries else 1
    qkv = [(q, q_view, L, E), (k, k_view, S, E), (v, v_view, S, Ev)]
    fused = _side_by_side(qkv, G, H)          # a fused projection's q, k, v: one DMA for the three
    together = out_layout == "packed" and _side_by_side([(t, w, L, E) for t, w in targets], G, H)
    for f00 in range(0, B * H, stack * G):
        fs = range(f00, min(f00 + stack * G, B * H), G)   # the groups of this pass: group i on partitions i*L ..
        P, PS = len(fs) * L, len(fs) * S
        orr, dor = (nl.ndarray((PMAX, G, Ev), dt, buffer=nl.sbuf) for _ in range(2))
        if fused:
            qr, kr, vr = _load_side_by_side(qkv, fs, G, H, pass_dmas, dt)
            _pass_dma([(orr, o, o_view, L, Ev), (dor, do, do_view, L, Ev)], fs, G, H, pass_dmas)
            krows = _block_rows(k, k_view, fs, G, H, S, E, dt, hc, loaded=kr)
            kT = _stacked_t([kr[:PS]], PS, G, E, dt, _scalar_copy)
        else:
            qr, vr = (nl.ndarray((PMAX, G, d), dt, buffer=nl.sbuf) for d in (E, Ev))
            # each group's K rows repeated on blocks of S partitions, for the dQ products of its dS^T chunks
            # (``_chunk_products``); group i's block i is also where K^T is transposed from: K is loaded once
            kreps = [_load_rows(k, k_view, f0, G, H, S, E, dt, copies=max(hc, len(fs)), block=S) for f0 in fs]
            _pass_dma([(qr, q, q_view, L, E), (vr, v, v_view, S, Ev), (orr, o, o_view, L, Ev),
                       (dor, do, do_view, L, Ev)], fs, G, H, pass_dmas)
            krows = [[kr] * hc for kr in kreps]
            kT = _stacked_t([kr[i * S:(i + 1) * S] for i, kr in enumerate(kreps)], S, G, E, dt, _scalar_copy)
        # the operands' transposes evicted by engine per operand, K^T and Q^T (the scores' operands, needed first)
        # on ScalarE, dO^T and V^T on VectorE (alternating call by call: the demo's backward 176.5 -> 177.3 us)
        qT = _stacked_t([qr[:P]], P, G, E, dt, _scalar_copy)
        doT = _stacked_t([dor[:P]], P, G, Ev, dt, _vector_copy)
        vT = _stacked_t([vr[:PS]], PS, G, Ev, dt, _vector_copy)
        # P = exp(scale * s - lse): the scores minus lse / scale on VectorE, the exp on ScalarE, and keys past
        # the diagonal zeroed by a select on GpSimd (never a product: an overflowed exp there must not be NaN)
        ls = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ls[:P], data=_load_lse(lse, fs, G, L, pass_dmas)[:P], op0=nl.multiply,
                           operand0=1.0 / scale)
        sc = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.psum)
        _scores(sc, qT, kT, L, S, G, E, len(fs))
        p = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.sbuf)                  # P, fp32
        nisa.tensor_tensor(dst=p[:P], data1=sc[:P], data2=spread(ls, P, G, S), op=nl.subtract)
        nisa.activation(dst=p[:P], op=nl.exp, data=p[:P], scale=scale)
        if causal:   # query l sees key t iff l - t >= 0 (the select's partition index counts from the slice's start)
            for i in range(len(fs)):
                rows = slice(i * L, (i + 1) * L)
                nisa.affine_select(dst=p[rows], pattern=[[0, G], [-1, S]], channel_multiplier=1, on_true_tile=p[rows],
                                   on_false_value=0.0, cmp_op="greater_equal")
        # D = rowsum(dO * O) per head
        prod = nl.ndarray((PMAX, G, Ev), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[:P], data1=dor[:P], data2=orr[:P], op=nl.multiply, engine=nisa.gpsimd_engine)
        dsum = nl.ndarray((PMAX, G), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=dsum[:P], op=nl.add, data=prod[:P], axis=(2,))
        # dS = P * (dO V^T - D)   (scale applied to dQ and dK when they are evicted)
        dp = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.psum)
        _scores(dp, doT, vT, L, S, G, Ev, len(fs))
        ds = nl.ndarray((PMAX, G, S), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=ds[:P], data1=dp[:P], data2=spread(dsum, P, G, S), op=nl.subtract)
        dsd = nl.ndarray((PMAX, G, S), dt, buffer=nl.sbuf)                        # rounded for its matmuls
        nisa.tensor_tensor(dst=dsd[:P], data1=ds[:P], data2=p[:P], op=nl.multiply, engine=nisa.gpsimd_engine)
        pd = p
        if dt != nl.float32:
            pd = nl.ndarray((PMAX, G, S), dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=pd[:P], src=p[:P], engine=nisa.gpsimd_engine)
        # dV = P^T dO and dK = dS^T Q: per head, contracting over the queries: a group's heads share its L
        # partitions (one PE row tile), the stacked groups' row tiles run concurrently, each writing its keys'
        # PSUM partitions (i*S .., the PE column tile there): one eviction per gradient for the pass. The packed
        # gradients of a fused projection are evicted side by side and stored together (768-byte rows of q, k,
        # v for the demo's heads instead of three 256-byte pieces)
        if together:
            gtile, gviews = _side_by_side_tile(3, G, H, E, dt)
        for (t, w), a, b, d, sc, part in ((targets[2], pd, dor, Ev, 1.0, 2), (targets[1], dsd, qr, E, scale, 1)):
            acc = nl.ndarray((PMAX, G, d), nl.float32, buffer=nl.psum)
            for g in range(G):
                for i in range(len(fs)):
                    rows, keys = slice(i * L, (i + 1) * L), slice(i * S, (i + 1) * S)
                    nisa.nc_matmul(dst=acc[keys, g], stationary=a[rows, g], moving=_head(b, rows, g), accumulate=False,
                                   **(_row_tile(i * L, L, i * S, S) if len(fs) > 1 else {}))
            if together:
                nisa.activation(dst=gviews[part][:PS], op=nl.identity, data=_as_heads(acc, PS, H), scale=sc)
                continue
            res = nl.ndarray((PMAX, G, d), dt, buffer=nl.sbuf)
            nisa.activation(dst=res[:PS], op=nl.identity, data=acc[:PS], scale=sc)
            _pass_dma([(res, t, w, S, d)], fs, G, H, pass_dmas, store=True)
        # dQ = dS K: dS^T hc heads at a time, times each head's K rows
        dq = nl.ndarray((PMAX, G, E), nl.float32, buffer=nl.psum)
        _chunk_products(dq, dsd, krows, L, S, G, hc, dt, evict)
        if together:
            nisa.activation(dst=gviews[0][:P], op=nl.identity, data=_as_heads(dq, P, H), scale=scale)
            _move_side_by_side(gtile, [(t, w, L, E) for t, w in targets], fs, G, H, pass_dmas, store=True)
            continue
        res = nl.ndarray((PMAX, G, E), dt, buffer=nl.sbuf)
        nisa.activation(dst=res[:P], op=nl.identity, data=dq[:P], scale=scale)
        _pass_dma([(res, *targets[0], L, E)], fs, G, H, pass_dmas, store=True)
    if out_layout == "packed":
        return grads
    return tuple(t for t, _ in targets)
