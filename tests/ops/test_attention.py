"""scaled_dot_product_attention on neuron: the fused forward/backward against the CPU, and which path runs."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchneuron.ops.kernel_call import PlanCache
from torchneuron.runtime import profiler
from tests.ops.bounds import assert_within, attention_bounds
from tests.ops.conftest import to_n

FUSED = "aten::_scaled_dot_product_fused_attention_overrideable"


def _inputs(q_shape, kv_len, ev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, _, E = q_shape
    q = torch.randn(q_shape, generator=g).to(dtype)
    k = torch.randn((B, H, kv_len, E), generator=g).to(dtype)
    v = torch.randn((B, H, kv_len, ev), generator=g).to(dtype)
    return q, k, v


def _grad_out(y):
    """The output gradient of every run: 0.5 + c / 8 along the value dim c (exact in bf16 and fp16)."""
    return torch.ones_like(y) * 0.5 + torch.arange(y.shape[-1], device=y.device, dtype=y.dtype) / 8


def _run(q, k, v, **kw):
    """(output, grads, launched op names) of SDPA forward + backward on the given device's tensors."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with profiler.record() as recs:
        y = F.scaled_dot_product_attention(*leaves, **kw)
        y.backward(_grad_out(y))
    return y.detach().cpu(), [t.grad.cpu() for t in leaves], {r.op for r in recs}


def _within_bounds(q, k, v, results: dict, grads: bool = True, **kw):
    """Each run's (name -> (output, [dq, dk, dv])) output, and gradients when ``grads``, within
    ``attention_bounds`` of float64 attention of the same inputs (tests/ops/bounds.py)."""
    g = _grad_out(torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype))
    exact, bounds = attention_bounds(q, k, v, g, **kw)
    # the device accumulates dK, dV and dQ in fp32 over every block and rounds them once
    tight = attention_bounds(q, k, v, g, blocks_in_dtype=False, **kw)[1]
    y = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=kw.get("causal", False),
                                       scale=kw.get("scale"), enable_gqa=kw.get("enable_gqa", False),
                                       attn_mask=kw.get("attn_mask"))
    assert (y - exact[0]).abs().max() <= 1e-12           # (the bounds' float64 attention is PyTorch's)
    for side, (out, gs) in results.items():
        side_bounds = tight if side == "device" else bounds
        assert_within(f"{side} output", out, exact[0], side_bounds[0])
        if grads:
            for name, got, want, bound in zip(("dq", "dk", "dv"), gs, exact[1:], side_bounds[1:]):
                assert_within(f"{side} {name}", got, want, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_shape,kv_len,ev,causal,scale", [
    ((2, 4, 64, 16), 64, 16, True, None),     # the GPT demo's attention
    ((1, 2, 10, 8), 7, 5, False, None),       # fewer keys than queries, another value width
    ((2, 1, 9, 8), 12, 8, True, 0.3),         # causal with more keys, an explicit scale
    ((1, 1, 130, 4), 130, 4, True, None),     # row blocks that do not start at query 0
])
def test_fused_attention_matches_cpu(q_shape, kv_len, ev, causal, scale, dtype, strict):
    q, k, v = _inputs(q_shape, kv_len, ev, dtype)
    want, want_grads, _ = _run(q, k, v, is_causal=causal, scale=scale)
    got, grads, ops = _run(to_n(q), to_n(k), to_n(v), is_causal=causal, scale=scale)
    assert FUSED in ops
    _within_bounds(q, k, v, {"device": (got, grads), "cpu": (want, want_grads)}, causal=causal, scale=scale)


def test_heads_split_from_a_fused_projection(strict):
    # strided q/k/v views (the usual qkv split + transpose) are read correctly
    x = torch.randn(2, 12, 3 * 16)
    q, k, v = (t.view(2, 12, 2, 8).transpose(1, 2) for t in x.split(16, dim=2))
    xn = to_n(x)
    qn, kn, vn = (t.view(2, 12, 2, 8).transpose(1, 2) for t in xn.split(16, dim=2))
    want, want_grads, _ = _run(q, k, v, is_causal=True)
    got, grads, _ = _run(qn, kn, vn, is_causal=True)
    _within_bounds(q, k, v, {"device": (got, grads), "cpu": (want, want_grads)}, causal=True)


@pytest.mark.parametrize("T", [64, 160])    # packed heads; the flash kernels
def test_results_are_laid_out_as_the_projection_views(T, strict):
    """Heads viewed from a fused projection get an output and gradients of the same [B, T, H, d] memory: merging
    the heads back and autograd's reverse of the split are views, so no copy runs in either direction; a
    contiguous query keeps contiguous results. Values within the float64 bounds either way."""
    B, H, E = 2, 4, 16
    x = torch.randn(B, T, 3 * H * E, generator=torch.Generator().manual_seed(3))

    def heads(t):
        return (z.view(B, T, H, E).transpose(1, 2) for z in t.split(H * E, dim=2))

    xn = to_n(x).requires_grad_()
    g = _grad_out(to_n(torch.zeros(B, T, H, E))).reshape(B, T, H * E)   # (the bounds' gradient, per head)
    with profiler.record() as recs:
        y = F.scaled_dot_product_attention(*heads(xn), is_causal=True)
        y.transpose(1, 2).reshape(B, T, H * E).backward(g)
    ops = [r.op for r in recs]
    assert FUSED in ops and FUSED + "_backward" in ops and "aten::copy_" not in ops, ops
    assert y.transpose(1, 2).is_contiguous()
    q, k, v = heads(x)
    grads = [g.cpu() for g in heads(xn.grad)]
    _within_bounds(q, k, v, {"device": (y.detach().cpu(), grads)}, causal=True)
    qc, kc, vc = (to_n(t.contiguous()).requires_grad_() for t in (q, k, v))
    yc = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    yc.backward(_grad_out(yc))
    assert yc.is_contiguous() and all(t.grad.is_contiguous() for t in (qc, kc, vc))
    _within_bounds(q, k, v, {"device": (yc.detach().cpu(), [t.grad.cpu() for t in (qc, kc, vc)])}, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_heads_of_a_fused_projection(dtype, strict):
    """In a compiled program the packed-heads kernels see q, k and v as one buffer (the projection's) and the
    gradients as one [B, T, 3, H, E] tensor: the forward loads each row's q, k, v as one piece and the backward
    stores dQ, dK, dV together, two groups of 64 queries stacked on the partitions. The same values as the eager
    op's (bit for bit: the same per-head products) and within the float64 bounds."""
    B, H, T, E = 4, 4, 64, 16          # 16 heads: one pass of two stacked groups of 8
    x = torch.randn(B, T, 3 * H * E, generator=torch.Generator().manual_seed(5)).to(dtype)

    def heads(t):
        return (z.view(B, T, H, E).transpose(1, 2) for z in t.split(H * E, dim=2))

    def attend(t):
        return F.scaled_dot_product_attention(*heads(t), is_causal=True).transpose(1, 2).reshape(B, T, H * E)

    g = _grad_out(torch.zeros(B, T, H, E, dtype=dtype)).reshape(B, T, H * E)
    results = []
    for run in (torch.compile(attend, backend="neuron"), attend):
        xn = to_n(x).requires_grad_()
        y = run(xn)
        y.backward(to_n(g))
        results.append((y.detach().cpu(), xn.grad.cpu()))
    (got, got_grad), (want, want_grad) = results
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    q, k, v = heads(x)
    out = got.reshape(B, T, H, E).transpose(1, 2)
    _within_bounds(q, k, v, {"device": (out, list(heads(got_grad)))}, causal=True)


def test_sequence_major_heads_take_the_layout_with_fewer_copies(strict, monkeypatch):
    """nn.MultiheadAttention's heads are a view of a sequence-major [T, B * H, d] projection: the rows layout
    would make autograd copy each of the q/k/v gradients to reverse that split, so the op lays them out as
    heads. The copies of a forward and backward under the op's choice are the fewest of either forced layout;
    the input's gradient equals the CPU module's within fp32 accumulation over D and T terms."""
    import torchneuron.ops.attention as attention
    torch.manual_seed(0)
    T, B, D, H = 64, 2, 32, 4
    mha = torch.nn.MultiheadAttention(D, H)
    x = torch.randn(T, B, D, requires_grad=True)
    want = torch.autograd.grad(mha(x, x, x, need_weights=False)[0].square().sum(), x)[0]
    mha.to("neuron")

    def copies_and_grad():
        xn = to_n(x.detach()).requires_grad_()
        with profiler.record() as recs:
            mha(xn, xn, xn, need_weights=False)[0].square().sum().backward()
        ops = [r.op for r in recs]
        assert FUSED in ops and FUSED + "_backward" in ops
        return ops.count("aten::copy_"), xn.grad.cpu()

    chosen, grad = copies_and_grad()
    forced = []
    for layout in ("rows", "heads"):
        monkeypatch.setattr(attention, "_layout", lambda t, layout=layout: layout)
        monkeypatch.setattr(attention, "_PLANS", PlanCache())   # (the plans kept the chosen layout)
        forced.append(copies_and_grad()[0])
    assert chosen == min(forced) < max(forced), (chosen, forced)
    torch.testing.assert_close(grad, want, atol=64 * 2.0 ** -24 * (T + D) * want.abs().max().item(), rtol=0)


def test_packed_heads_launch_the_faster_stacking(strict):
    """The eager op launches the packed-heads program (queries stacked on the partitions or not) that the
    device's timing model prices faster, in each direction; the values stay within the float64 bounds."""
    from torchneuron.kernels.packed_attention import packed_attention_bwd, packed_attention_fwd
    from torchneuron import runtime

    B, H, T, E = 4, 4, 64, 16
    x = torch.randn(B, T, 3 * H * E, generator=torch.Generator().manual_seed(4))

    def heads(t):
        return (z.view(B, T, H, E).transpose(1, 2) for z in t.split(H * E, dim=2))

    xn = to_n(x).requires_grad_()
    g = _grad_out(to_n(torch.zeros(B, T, H, E))).reshape(B, T, H * E)
    with profiler.record() as recs:
        y = F.scaled_dot_product_attention(*heads(xn), is_causal=True)
        y.transpose(1, 2).reshape(B, T, H * E).backward(g)
    spec = runtime.core(xn.device.index).spec
    flat = x.reshape(-1)
    views = {f"{n}_view": (i * H * E, (T * 3 * H * E, E, 3 * H * E, 1)) for i, n in enumerate("qkv")}
    rows = torch.zeros(B * T * H * E)
    common = dict(scale=0.25, causal=True, shape=(B, H, T, T, E, E), out_layout="rows", **views)
    calls = {packed_attention_fwd: dict(q=flat, k=flat, v=flat),
             packed_attention_bwd: dict(q=flat, k=flat, v=flat, o=rows, do=rows, lse=torch.zeros(B, H, T),
                                        o_view=(0, (T * H * E, E, H * E, 1)), do_view=(0, (T * H * E, E, H * E, 1)))}
    for kernel, args in calls.items():
        times = [kernel.trace((), {**args, **common, "stack_queries": s, "pass_dmas": s}, spec).program
                 .schedule(spec).device_time_ns for s in (False, True)]
        assert times[0] != times[1]
        launched, = [r for r in recs if r.name == kernel.__name__]
        assert launched.program.schedule(spec).device_time_ns == min(times)
    q, k, v = heads(x)
    _within_bounds(q, k, v, {"device": (y.detach().cpu(), [t.cpu() for t in heads(xn.grad)])}, causal=True)


def test_repeated_calls_replay_the_plan_of_their_own_geometry(strict, monkeypatch):
    """The fused op keeps a plan per operand geometry (shapes, strides, dtypes): dense heads after heads viewed
    from a fused projection (the same shapes, other strides and result layout) get their own program's results,
    bit for bit as with no plan kept, and a repeated call its first call's, in both directions."""
    import torchneuron.ops.attention as attention
    B, H, T, E = 2, 4, 32, 16
    x = torch.randn(B, T, 3 * H * E, generator=torch.Generator().manual_seed(5))
    g = torch.randn(B, H, T, E, generator=torch.Generator().manual_seed(6))

    def run(dense: bool) -> list[torch.Tensor]:
        xn = to_n(x).requires_grad_()
        q, k, v = (z.view(B, T, H, E).transpose(1, 2) for z in xn.split(H * E, dim=2))
        if dense:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(to_n(g))
        return [y.detach().cpu(), xn.grad.cpu()]

    monkeypatch.setattr(attention, "_PLANS", PlanCache())
    want_dense = run(dense=True)
    monkeypatch.setattr(attention, "_PLANS", PlanCache())
    first = run(dense=False)
    got_dense, again = run(dense=True), run(dense=False)
    assert len(attention._PLANS.keys()) == 4
    assert all(torch.equal(a, b) for a, b in zip(got_dense + again, want_dense + first))


def test_long_key_rows_take_the_unfused_softmax(strict):
    q, k, v = _inputs((1, 1, 3, 4), 2900, 4, torch.float32)
    want, want_grads, _ = _run(q, k, v, is_causal=True)
    got, grads, _ = _run(to_n(q), to_n(k), to_n(v), is_causal=True)
    _within_bounds(q, k, v, {"device": (got, grads), "cpu": (want, want_grads)}, causal=True)


@pytest.mark.parametrize("kw", [dict(attn_mask=torch.randn(5, 6)), dict(enable_gqa=True)])
def test_masks_and_grouped_heads_take_the_math_path(kw, strict):
    q, k, v = _inputs((1, 2, 5, 4), 6, 4, torch.float32)
    if kw.get("enable_gqa"):
        k, v = k[:, :1], v[:, :1]
    dev_kw = {n: to_n(t) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    want, _, _ = _run(q, k, v, **kw)
    got, _, ops = _run(to_n(q), to_n(k), to_n(v), **dev_kw)
    assert FUSED not in ops
    _within_bounds(q, k, v, {"device": (got, None), "cpu": (want, None)}, grads=False, **kw)


def test_sdpa_kernel_math_choice_is_respected(strict):
    q, k, v = _inputs((1, 2, 5, 4), 5, 4, torch.float32)
    with sdpa_kernel([SDPBackend.MATH]):
        got, _, ops = _run(to_n(q), to_n(k), to_n(v), is_causal=True)
    assert FUSED not in ops
    want, _, _ = _run(q, k, v, is_causal=True)
    _within_bounds(q, k, v, {"device": (got, None), "cpu": (want, None)}, grads=False, causal=True)


def test_direct_call_with_a_bias_is_refused():
    q = to_n(torch.randn(1, 1, 4, 4))
    with pytest.raises(RuntimeError, match="math path"):
        torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, q, q, to_n(torch.zeros(4, 4)))
    with pytest.raises(RuntimeError, match="4-D"):
        torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q[0], q[0], q[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_scores_stay_fp32(dtype, strict):
    # Scores of magnitude ~30: rounded to bf16 before exp() they lose up to 0.06, a 6% error in a probability.
    # With fp32 scores (as the CPU keeps them) the only roundings are the probabilities' (eps/2 each, meeting
    # V in its dtype) and the output's; the reference is float64 from the same rounded inputs.
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, 3, 8, generator=gen).mul(4).to(dtype)      # 3 queries, 6 keys: the unfused path
    k, v = (torch.randn(4, 4, 6, 8, generator=gen).mul(4).to(dtype) for _ in range(2))
    out = F.scaled_dot_product_attention(to_n(q), to_n(k), to_n(v), is_causal=True).cpu().double()
    q64, k64, v64 = q.double(), k.double(), v.double()
    exact = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    scores = q64 @ k64.transpose(-1, -2) / 8 ** 0.5
    assert scores.abs().max() > 16           # where a bf16 score's rounding matters
    probs = torch.softmax(scores.masked_fill(~torch.ones(3, 6, dtype=torch.bool).tril(), float("-inf")), -1)
    eps = torch.finfo(dtype).eps
    # each probability off by eps/2 (one rounding; fp32 steps are far below), the sum of P|V| accumulated in
    # fp32, the result rounded once
    bound = eps / 2 * (probs @ v64.abs()) + eps / 2 * exact.abs() + 4 * torch.finfo(torch.float32).eps * (
        probs @ v64.abs())
    assert ((out - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_reduced_precision_short_sequences_round_as_the_cpu(dtype, causal, strict):
    # The CPU's attention kernel rounds the unnormalized exp(z - max) to the dtype, divides the fp32 sum of their
    # products with V once, and in the backward rounds P and dS = P (dP - rowsum(dO * O)) before their matmuls,
    # applying the scale after. Normalizing first (P rounded, then P V rounded) put ~6% of the outputs a unit
    # of the dtype or more away from the CPU's and twice as far from float64. With the same roundings, a result
    # moves only where fp32 sums in another order straddle a rounding boundary of the dtype: at most K = 8
    # units of fp32 in a sum of |terms| ~ the result, against a boundary gap of 2**-8 (bf16) or 2**-11 (fp16)
    # relative, so a fraction of about K * 2**-24 / 2**-11 < 0.1% of the elements, each by one unit.
    q, k, v = _inputs((4, 4, 3, 8), 6, 8, dtype, seed=3)
    q, k, v = q * 4, k * 4, v * 4
    want, want_grads, _ = _run(q, k, v, is_causal=causal)
    got, got_grads, ops = _run(to_n(q), to_n(k), to_n(v), is_causal=causal)
    assert FUSED in ops
    for name, a, e in [("out", got, want), *zip(("dq", "dk", "dv"), got_grads, want_grads)]:
        a, e = a.double(), e.double()
        off = (a - e).abs()
        unit = torch.finfo(dtype).eps * e.abs().amax()
        assert float((off > 0).double().mean()) <= 0.01, name
        assert float(off.max()) <= unit, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bounds_fail_a_unit_in_the_wrong_place(dtype, strict):
    # the derived bounds are far below the error of a scale of 1/E instead of 1/sqrt(E) in the fused kernel
    q, k, v = _inputs((2, 4, 64, 16), 64, 16, dtype)
    want, want_grads, _ = _run(q, k, v, is_causal=True)
    got, grads, _ = _run(to_n(q), to_n(k), to_n(v), is_causal=True, scale=1 / 16)
    with pytest.raises(AssertionError, match="device output"):
        _within_bounds(q, k, v, {"device": (got, grads), "cpu": (want, want_grads)}, causal=True)
