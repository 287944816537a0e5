"""The flash attention kernels against float64 attention, within error bounds derived per element.

Each product the kernels round is bounded by the sum of the absolute values of its terms (computed
in float64 from the same inputs): rounding the probabilities, dS and the result to the input dtype
costs a few units of its roundoff ``u`` relative to those sums; fp32 accumulation over S keys adds
S * u32 of them.
"""
import math

import pytest
import torch

from torchneuron.sim.specs import chip_spec
from torchneuron.kernels.attention import flash_attention_bwd, flash_attention_fwd, flash_fits

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# half the spacing of each dtype's subnormals: a result that small rounds to an absolute, not a relative, error
UNDERFLOW = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
SPEC = chip_spec("trn2")
ROUNDINGS = 4     # P (or dS), the operand it meets, the result: each rounded once, with slack for one more


def _reference(q, k, v, g, scale, causal):
    """float64 (O, lse, dQ, dK, dV) and the per-element sums of absolute terms behind each."""
    q, k, v, g = (t.double() for t in (q, k, v, g))
    L, S = q.shape[2], k.shape[2]
    s = scale * q @ k.transpose(-1, -2)
    if causal:
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    o = p @ v
    dp = g @ v.transpose(-1, -2)
    d = (g * o).sum(-1, keepdim=True)
    ds = p * (dp - d)
    ds_abs = p * ((g.abs() @ v.abs().transpose(-1, -2)) + d.abs())
    ref = dict(o=o, lse=torch.logsumexp(s, -1), dq=scale * ds @ k, dk=scale * ds.transpose(-1, -2) @ q,
               dv=p.transpose(-1, -2) @ g)
    terms = dict(o=p @ v.abs(), lse=torch.ones_like(ref["lse"]) * (1 + ref["lse"].abs()),
                 dq=scale * ds_abs @ k.abs(), dk=scale * ds_abs.transpose(-1, -2) @ q.abs(),
                 dv=p.transpose(-1, -2) @ g.abs())
    return ref, terms


def _check(name, got, ref, terms, dtype, S):
    bound = (ROUNDINGS * U[dtype] + S * U[torch.float32]) * terms + UNDERFLOW[dtype] + 1e-30
    err = (got.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{name}: error {err.max().item():.3e} is {worst:.2f}x its bound"


CASES = [  # B, H, L, S, E, Ev, causal
    (1, 2, 200, 200, 64, 64, True),       # ragged query tiles, the diagonal inside a tile
    (2, 1, 130, 300, 32, 48, False),      # more keys than queries, another value width
    (1, 1, 300, 90, 16, 8, True),         # fewer keys than queries: later queries see every key
    (1, 1, 100, 260, 128, 96, True),      # causal with keys no query sees (their dK, dV are zero)
    (1, 1, 130, 1300, 16, 16, False),     # more than one score group: the online rescaling
    (1, 1, 256, 128, 8, 128, True),       # the widest value head
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,H,L,S,E,Ev,causal", CASES)
def test_forward_and_backward_match_float64(B, H, L, S, E, Ev, causal, dtype):
    q, k, v = (torch.randn(B, H, n, d).to(dtype) for n, d in ((L, E), (S, E), (S, Ev)))
    g = torch.randn(B, H, L, Ev).to(dtype)
    scale = 1 / math.sqrt(E)
    ref, terms = _reference(q, k, v, g, scale, causal)
    o, lse = flash_attention_fwd(q, k, v, scale=scale, causal=causal)
    assert o.dtype == dtype and o.shape == (B, H, L, Ev) and lse.dtype == torch.float32 and lse.shape == (B, H, L)
    _check("O", o, ref["o"], terms["o"], dtype, S)
    _check("lse", lse, ref["lse"], terms["lse"], torch.float32, S)
    dq, dk, dv = flash_attention_bwd(q, k, v, o, g, lse, scale=scale, causal=causal)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert got.dtype == dtype
        _check(name, got, ref[name], terms[name], dtype, max(L, S))


def test_large_scores_are_stable():
    """Scores of magnitude ~1e4: the running max keeps exp() finite, as softmax's max subtraction does."""
    q, k, v = (torch.randn(1, 1, 64, 16) * 30 for _ in range(3))
    g = torch.randn(1, 1, 64, 16)
    ref, terms = _reference(q, k, v, g, 1.0, True)
    o, lse = flash_attention_fwd(q, k, v, scale=1.0, causal=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    _check("O", o, ref["o"], terms["o"], torch.float32, 64)


def test_strided_heads_are_read_in_place():
    """Heads split out of one fused projection [B, T, 3, H, E] and transposed: the views give the kernel the
    strides, and nothing is copied dense first."""
    B, T, H, E = 2, 40, 3, 8
    x = torch.randn(B, T, 3 * H * E)
    q, k, v = (t.reshape(B, T, H, E).transpose(1, 2) for t in x.split(H * E, dim=2))
    views = {f"{n}_view": (i * H * E, tuple(t.stride())) for i, (n, t) in enumerate(zip("qkv", (q, k, v)))}
    flat = x.reshape(-1)
    o, lse = flash_attention_fwd(flat, flat, flat, scale=0.5, causal=True, shape=(B, H, T, T, E, E), **views)
    ref, terms = _reference(q, k, v, torch.zeros(B, H, T, E), 0.5, True)
    _check("O", o, ref["o"], terms["o"], torch.float32, T)
    prog = flash_attention_fwd.trace((), dict(q=flat, k=flat, v=flat, scale=0.5, causal=True, shape=(B, H, T, T, E, E),
                                             **views), SPEC).program
    assert prog.hbm_bytes_read == flat.numel() * 4     # q, k and v (a third of the projection each) read once


def test_causal_skips_keys_past_the_diagonal():
    """A causal forward multiplies only the tiles at or below the diagonal: about half the TensorE work (besides
    the causal bias TensorE adds to each diagonal tile: the identity [128, 128] against it)."""
    q = k = v = torch.randn(1, 1, 1024, 64).bfloat16()
    flops = {c: flash_attention_fwd.trace((), dict(q=q, k=k, v=v, causal=c), SPEC).program.flops for c in (False, True)}
    mask = 2 * 128**3 * (1024 // 128)
    assert flops[True] - mask < 0.6 * flops[False]


@pytest.mark.parametrize("E,Ev,msg", [(129, 64, "head dim 129"), (64, 129, "value head dim 129")])
def test_heads_beyond_one_tile_are_refused(E, Ev, msg):
    assert not flash_fits(E, Ev, 64, 64, torch.float32)
    q, k, v = torch.randn(1, 1, 8, E), torch.randn(1, 1, 8, E), torch.randn(1, 1, 8, Ev)
    with pytest.raises(AssertionError, match=msg):
        flash_attention_fwd(q, k, v)


def test_non_positive_scale_is_refused():
    q = torch.randn(1, 1, 8, 8)
    with pytest.raises(AssertionError, match="scale must be positive"):
        flash_attention_fwd(q, q, q, scale=-1.0)


@pytest.mark.parametrize("L,E", [(1024, 64), (2048, 128)])    # dQ accumulated in PSUM; in SBUF
def test_many_heads_fit_psum(L, E):
    """Heads pipelined one after another keep their PSUM tiles within the 8 banks (traced, not run)."""
    q = torch.zeros(1, 4, L, E, dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, L)
    flash_attention_bwd.trace((), dict(q=q, k=q, v=q, o=q, do=q, lse=lse, causal=True), SPEC)
    flash_attention_fwd.trace((), dict(q=q, k=q, v=q, causal=True), SPEC)


@pytest.mark.parametrize("L,S", [(40, 40), (200, 200), (40, 72)])
def test_result_layouts_hold_the_same_values(L, S):
    """O in "rows" ([B, L, H, Ev]) and dQ/dK/dV in "rows" or "packed" ([B, L, 3, H, E]) are the default results
    moved, bit for bit: only where they are stored changes."""
    torch.manual_seed(0)
    B, H, E = 2, 3, 16
    q, k, v = torch.randn(B, H, L, E), torch.randn(B, H, S, E), torch.randn(B, H, S, E)
    o, lse = flash_attention_fwd(q, k, v, scale=0.25, causal=True)
    rows, lse_rows = flash_attention_fwd(q, k, v, scale=0.25, causal=True, out_layout="rows")
    assert torch.equal(rows.transpose(1, 2), o) and torch.equal(lse_rows, lse)
    g = torch.randn(B, H, L, E)
    grads = flash_attention_bwd(q, k, v, o, g, lse, scale=0.25, causal=True)
    by_rows = flash_attention_bwd(q, k, v, o, g, lse, scale=0.25, causal=True, out_layout="rows")
    for want, got in zip(grads, by_rows):
        assert torch.equal(got.transpose(1, 2), want)
    if L == S:
        packed = flash_attention_bwd(q, k, v, o, g, lse, scale=0.25, causal=True, out_layout="packed")
        assert packed.shape == (B, L, 3, H, E)
        for i, want in enumerate(grads):
            assert torch.equal(packed[:, :, i].transpose(1, 2), want)
    else:
        with pytest.raises(AssertionError, match="packed gradients need L == S"):
            flash_attention_bwd(q, k, v, o, g, lse, scale=0.25, causal=True, out_layout="packed")


@pytest.mark.parametrize("L", [40, 200])
def test_small_heads_loaded_together_give_the_per_head_results(L, monkeypatch):
    """Several small heads' rows moved by one DMA each (HEAD_GROUP_BYTES) change where rows wait, not any value:
    forward and backward equal, bit for bit, the one-head-at-a-time kernels, with fewer DMAs."""
    import torchneuron.kernels.attention as attention

    torch.manual_seed(0)
    B, H, E = 2, 5, 16
    q, k, v, g = (torch.randn(B, H, L, E) for _ in range(4))
    o, lse = flash_attention_fwd(q, k, v, scale=0.25, causal=True)
    grads = flash_attention_bwd(q, k, v, o, g, lse, scale=0.25, causal=True)
    grouped = flash_attention_fwd.trace((), dict(q=q, k=k, v=v, scale=0.25, causal=True), SPEC).program
    traced = (flash_attention_fwd.cache, flash_attention_bwd.cache)
    saved = [dict(c) for c in traced]
    monkeypatch.setattr(attention, "HEAD_GROUP_BYTES", 0)
    try:
        for c in traced:          # (traces are cached per signature: trace again without grouping)
            c.clear()
        o1, lse1 = flash_attention_fwd(q, k, v, scale=0.25, causal=True)
        single_grads = flash_attention_bwd(q, k, v, o, g, lse, scale=0.25, causal=True)
        single = flash_attention_fwd.trace((), dict(q=q, k=k, v=v, scale=0.25, causal=True), SPEC).program
    finally:
        for c, old in zip(traced, saved):
            c.clear()
            c.update(old)
    assert torch.equal(o, o1) and torch.equal(lse, lse1)
    for a, b in zip(grads, single_grads):
        assert torch.equal(a, b)
    dmas = [sum(i.opcode == "dma_copy" for i in p.instructions) for p in (grouped, single)]
    assert dmas[0] < dmas[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ds_on_scalar_and_gpsimd_equals_vector(dtype, monkeypatch):
    """dS = P * (dP - D) formed by ScalarE (dP - D) and GpSimd (the product) rounds as VectorE's one instruction
    does: the gradients are bit for bit those of either route alone, and within the float64 bound."""
    import torchneuron.kernels.attention as attention

    torch.manual_seed(1)
    B, H, L, E = 1, 2, 300, 32
    q, k, v, g = (torch.randn(B, H, L, E).to(dtype) for _ in range(4))
    o, lse = flash_attention_fwd(q, k, v, scale=E ** -0.5, causal=True)
    grads = {}
    cache = flash_attention_bwd.cache
    saved = dict(cache)
    try:
        for route in ((False,), (True,), (False, True, True)):
            monkeypatch.setattr(attention, "DS_OFFLOAD", route)
            cache.clear()             # (traces are cached per signature)
            grads[route] = flash_attention_bwd(q, k, v, o, g, lse, scale=E ** -0.5, causal=True)
    finally:
        cache.clear()
        cache.update(saved)
    ref, terms = _reference(q, k, v, g, E ** -0.5, True)
    for a, b, c, name in zip(*grads.values(), ("dq", "dk", "dv")):
        assert torch.equal(a, b) and torch.equal(a, c), name
        _check(name, a, ref[name], terms[name], dtype, L)
