"""The packed-heads attention kernels (several small heads per instruction) against float64 attention, within
the flash kernels' per-element bounds (``test_attention``), plus the isolation of heads that share an
instruction and the group rules."""
import math

import pytest
import torch

from tests.kernels.test_attention import U, _reference
from torchneuron.kernels.packed_attention import packed_attention_bwd, packed_attention_fwd, packed_heads
from torchneuron.sim.specs import chip_spec

SPEC = chip_spec("trn2")
ROUNDINGS = 4     # as for flash: P (or dS), the operand it meets, the result, and one more


def _check(name, got, ref, terms, dtype, n, operand_abs):
    """Error within the relative bound of the flash tests, plus the absolute one of subnormal results: each
    rounding to ``dtype`` of a value below its smallest normal is off by up to half the subnormal spacing,
    and n of those (the rounded probabilities) meet operands of at most ``operand_abs``."""
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    bound = (ROUNDINGS * U[dtype] + n * U[torch.float32]) * terms + tiny * (1 + n * operand_abs)
    err = (got.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{name}: error {err.max().item():.3e} is {worst:.2f}x its bound"


CASES = [  # B, H, L, S, E, Ev, causal: G heads per group
    (2, 4, 64, 64, 16, 16, True),      # the demo's heads: groups of 8 spanning two batch elements
    (1, 3, 40, 72, 16, 8, False),      # L < S, Ev < E: one group of 3
    (4, 2, 20, 20, 32, 32, True),      # groups of 4 (two batch elements of 2 heads)
    (1, 6, 128, 128, 32, 32, True),    # whole tiles: 4 would not divide H = 6, so groups of 3
    (1, 5, 40, 40, 16, 16, False),     # 5 heads, P^T chunks of 3: a ragged last chunk
    (3, 1, 50, 30, 8, 24, True),       # L > S: later queries see every key; G = 3 batch elements of 1 head
    (4, 4, 64, 64, 16, 16, True),      # two groups of 8 stacked on the partitions (queries 0-63 and 64-127)
    (6, 4, 64, 64, 16, 16, False),     # three groups: two stacked, then one alone
    (3, 8, 32, 32, 16, 16, True),      # queries of 32: up to four groups stacked, here three
    (2, 12, 32, 32, 16, 16, False),    # groups of 6: four stacked span two batch elements (a DMA per group)
]


@pytest.mark.parametrize("stack,pass_dmas", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,H,L,S,E,Ev,causal", CASES)
def test_packed_forward_and_backward_match_float64(B, H, L, S, E, Ev, causal, dtype, stack, pass_dmas):
    torch.manual_seed(B * 100 + L)
    G = packed_heads(B, H, L, S, E, Ev)
    assert G >= 2 and (B * H) % G == 0 and (G % H == 0 or H % G == 0)
    q, k, v = (torch.randn(B, H, n, d).to(dtype) for n, d in ((L, E), (S, E), (S, Ev)))
    g = torch.randn(B, H, L, Ev).to(dtype)
    scale = 1 / math.sqrt(E)
    ref, terms = _reference(q, k, v, g, scale, causal)
    o, lse = packed_attention_fwd(q, k, v, scale=scale, causal=causal, out_layout="rows", stack_queries=stack,
                                   pass_dmas=pass_dmas)
    assert o.dtype == dtype and o.shape == (B, L, H, Ev) and lse.dtype == torch.float32 and lse.shape == (B, H, L)
    o = o.transpose(1, 2)
    _check("O", o, ref["o"], terms["o"], dtype, S, v.abs().max().item())
    _check("lse", lse, ref["lse"], terms["lse"], torch.float32, S, 0.0)
    dq, dk, dv = packed_attention_bwd(q, k, v, o.contiguous(), g, lse, scale=scale, causal=causal, out_layout="rows",
                                      stack_queries=stack, pass_dmas=pass_dmas)
    n = max(L, S)
    for name, got, other in (("dq", dq, k), ("dk", dk, q), ("dv", dv, g)):
        assert got.dtype == dtype
        _check(name, got.transpose(1, 2), ref[name], terms[name], dtype, n, scale * other.abs().max().item() * 4)


def test_packed_results_match_flash_layouts_and_views():
    """Heads read in place from one fused projection [B, T, 3 * H * E] (their views), and the results in the
    backward's "packed" layout [B, T, 3, H, E]: the same values as the contiguous call's, bit for bit."""
    torch.manual_seed(1)
    B, T, H, E = 4, 48, 2, 16
    x = torch.randn(B, T, 3 * H * E)
    q, k, v = (t.reshape(B, T, H, E).transpose(1, 2) for t in x.split(H * E, dim=2))
    views = {f"{n}_view": (i * H * E, tuple(t.stride())) for i, (n, t) in enumerate(zip("qkv", (q, k, v)))}
    flat = x.reshape(-1)
    shape = (B, H, T, T, E, E)
    o, lse = packed_attention_fwd(flat, flat, flat, scale=0.3, causal=True, shape=shape, **views)
    o_ref, lse_ref = packed_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), scale=0.3, causal=True)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    g = torch.randn(B, H, T, E)
    oh = o
    grads = packed_attention_bwd(q.contiguous(), k.contiguous(), v.contiguous(), oh, g, lse, scale=0.3, causal=True)
    packed = packed_attention_bwd(flat, flat, flat, oh, g, lse, scale=0.3, causal=True, shape=shape, out_layout="packed",
                                  **views)
    assert packed.shape == (B, T, 3, H, E)
    for i, want in enumerate(grads):
        assert torch.equal(packed[:, :, i].transpose(1, 2), want)


def test_a_non_finite_head_leaves_the_others_finite():
    """Heads share instructions but not values: an inf in one head's keys and a NaN in another's values stay in
    those heads; every other head's output and gradients are finite and within their float64 bounds."""
    torch.manual_seed(2)
    B, H, L, E = 2, 4, 32, 16
    q, k, v, g = (torch.randn(B, H, L, E) for _ in range(4))
    ref, terms = _reference(q, k, v, g, 0.25, False)
    k[0, 1, 3, 2] = float("inf")
    v[1, 2, 5, 0] = float("nan")
    o, lse = packed_attention_fwd(q, k, v, scale=0.25, causal=False)
    dq, dk, dv = packed_attention_bwd(q, k, v, o, g, lse, scale=0.25)
    assert not torch.isfinite(o[1, 2]).all() and not torch.isfinite(dv[0, 1]).all()
    for b in range(B):
        for h in range(H):
            if (b, h) in ((0, 1), (1, 2)):
                continue
            for name, got in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
                assert torch.isfinite(got[b, h]).all(), f"{name} of head ({b}, {h})"
                _check(name, got[b, h], ref[name][b, h], terms[name][b, h], torch.float32, L, 0.0)


@pytest.mark.parametrize("B,H,L,S,E,Ev,want", [
    (16, 4, 64, 64, 16, 16, 8),       # 128 // 16 rows and 512 // 64 keys: 8 heads, two batch elements
    (1, 12, 128, 128, 64, 64, 2),     # 128 // 64: two heads of 64
    (3, 5, 16, 16, 16, 16, 5),        # 8 would cross batch elements unevenly: one batch element's 5 heads
    (1, 7, 64, 64, 16, 16, 7),        # 7 heads of one batch element (divides H)
    (2, 4, 200, 64, 16, 16, 0),       # L > 128: the flash kernels
    (2, 4, 64, 64, 128, 128, 0),      # one head fills the contraction rows
    (1, 1, 64, 64, 16, 16, 0),        # a single head: nothing to pack
])
def test_group_rules(B, H, L, S, E, Ev, want):
    assert packed_heads(B, H, L, S, E, Ev) == want


def test_not_a_packed_shape_is_refused():
    q = torch.randn(1, 1, 8, 8)
    with pytest.raises(AssertionError, match="not a packed-heads shape"):
        packed_attention_fwd(q, q, q)
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(AssertionError, match="scale must be positive"):
        packed_attention_fwd(q, q, q, scale=-1.0)


def test_packing_takes_fewer_instructions_and_less_time_than_flash():
    """The demo's attention (64 heads of 64 x 16, causal, fp32): fewer instructions and less simulated time
    than the one-head-at-a-time flash kernels, forward and backward."""
    from torchneuron.kernels.attention import flash_attention_bwd, flash_attention_fwd

    q = torch.zeros(16, 4, 64, 16)
    lse = torch.zeros(16, 4, 64)
    packed = [packed_attention_fwd.trace((), dict(q=q, k=q, v=q, causal=True), SPEC).program,
              packed_attention_bwd.trace((), dict(q=q, k=q, v=q, o=q, do=q, lse=lse, causal=True), SPEC).program]
    flash = [flash_attention_fwd.trace((), dict(q=q, k=q, v=q, causal=True), SPEC).program,
             flash_attention_bwd.trace((), dict(q=q, k=q, v=q, o=q, do=q, lse=lse, causal=True), SPEC).program]
    for p, f in zip(packed, flash):
        assert len(p.instructions) < len(f.instructions) / 2
        assert p.schedule(SPEC).device_time_ns < f.schedule(SPEC).device_time_ns


@pytest.mark.parametrize("chip,rows,stacked", [("trn1", 64, False), ("trn2", 32, True)])
def test_head_matmuls_use_row_tiles_only_of_their_own_partitions(chip, rows, stacked):
    """A tiled matmul claims the PE rows its contraction's partitions feed (the smallest tile of the chip
    holding them), so heads on different rows may overlap and heads on the same rows never claim to; with two
    groups of 64 queries stacked on the partitions (``stack_queries``; NeuronCore-v3 only) a product also
    claims only the PE columns of the PSUM partitions it writes, and the backward's dV and dK of the two groups
    (each group's heads on its own 64 query rows) take row tiles too. Unstacked, those keep the whole array."""
    spec = chip_spec(chip)
    q, lse = torch.zeros(16, 4, 64, 16), torch.zeros(16, 4, 64)
    progs = [packed_attention_fwd.trace((), dict(q=q, k=q, v=q, causal=True, stack_queries=True), spec).program,
             packed_attention_bwd.trace((), dict(q=q, k=q, v=q, o=q, do=q, lse=lse, causal=True, stack_queries=True),
                                        spec).program]
    for prog, plain_products in zip(progs, (0, 0 if stacked else 2 * 64)):   # dV and dK: one per head each
        tiled = [i for i in prog.instructions if i.opcode == "nc_matmul_tiled"]
        assert tiled and sum(i.opcode == "nc_matmul" for i in prog.instructions) == plain_products
        column_tiles = set()   # the PSUM halves written by column-tiled products
        for ins in tiled:
            (r0, c0), (nr, nc) = ins.tile_position, ins.tile_size
            p0 = ins.stationary.start_partition
            p1 = p0 + ins.stationary.partitions
            d0 = ins.dst.start_partition
            assert ins.moving.start_partition == p0 and r0 <= p0 and p1 <= r0 + nr
            assert nr == min(s for s in (rows, 64, 128) if p0 // s == (p1 - 1) // s)
            assert (c0, nc) == ((d0, ins.dst.partitions) if nc < 128 else (0, 128))
            if nc < 128:
                column_tiles.add(d0 // 64)
        assert column_tiles == ({0, 1} if stacked else set())


def test_stacked_backward_loads_each_operand_once():
    """With two groups of 64 queries stacked (the demo's 64 heads, groups of 8, hc = 2 heads per dS^T chunk),
    each pass loads K only as each group's repeated blocks (K^T is transposed from them); with ``pass_dmas`` Q,
    V, O, dO and the lse by one DMA over both groups' partitions, and dQ, dK and dV stored by one each (each
    group's keys on their own partitions): 12 DMAs a pass; else Q, V, O, dO, the lse and the three stores
    once per group: 20."""
    q, lse = torch.zeros(16, 4, 64, 16), torch.zeros(16, 4, 64)
    stack, hc, passes = 2, 2, 4
    for pass_dmas, per_pass in ((True, 4 + stack * hc + 1 + 3), (False, stack * (4 + hc + 1 + 3))):
        prog = packed_attention_bwd.trace((), dict(q=q, k=q, v=q, o=q, do=q, lse=lse, causal=True, stack_queries=True,
                                                   pass_dmas=pass_dmas), SPEC).program
        assert sum(i.opcode == "dma_copy" for i in prog.instructions) == passes * per_pass
