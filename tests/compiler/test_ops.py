"""Compiled vs eager, op by op: every op the compiler lowers (views, fused pointwise ops, library kernels)
run under ``torch.compile(backend="neuron")`` on PyTorch's OpInfo samples, against the same op run eagerly
on neuron (itself checked against the CPU by the OpInfo tests) and against the CPU.

Tolerances: a fused group computes in fp32 and rounds once at its outputs, as each eager op does for
its own result, so float32 results agree to a few ulps (PyTorch's float32 defaults). Gradients of
differentiable samples are compared the same way.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.common_methods_invocations import op_db

from torchneuron.compiler import lowering, reports
from torchneuron.runtime import profiler
from tests.opinfo.harness import _tensors

# OpInfo name for each lowered ATen op (several overloads share one); the tables must be covered
OPINFOS = {
    "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh", "sigmoid": "sigmoid",
    "erf": "erf", "sin": "sin", "cos": "cos", "reciprocal": "reciprocal", "log1p": "log1p", "expm1": "expm1",
    "neg": "neg", "abs": "abs", "relu": "nn.functional.relu", "silu": "nn.functional.silu", "sign": "sign",
    "floor": "floor", "ceil": "ceil", "trunc": "trunc", "logical_not": "logical_not", "isnan": "isnan",
    "log2": "log2", "exp2": "exp2", "atan": "atan", "mul": "mul", "div": "div:no_rounding_mode", "maximum": "maximum",
    "minimum": "minimum", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "pow": "pow",
    "atan2": "atan2", "add": "add", "sub": "sub", "rsub": "rsub", "logical_and": "logical_and",
    "logical_or": "logical_or", "where": "where", "clamp": "clamp", "clamp_min": "clamp_min",
    "clamp_max": "clamp_max", "gelu": "nn.functional.gelu", "gelu_backward": "nn.functional.gelu",
    "silu_backward": "nn.functional.silu", "sigmoid_backward": "sigmoid", "tanh_backward": "tanh",
    "threshold_backward": "nn.functional.relu", "leaky_relu": "nn.functional.leaky_relu", "addcmul": "addcmul",
    "addcdiv": "addcdiv", "lerp": "lerp", "convert_element_type": "bfloat16", "_to_copy": "half",
    "clone": "clone", "mm": "mm", "addmm": "addmm", "bmm": "bmm", "_softmax": "softmax",
    "_log_softmax": "log_softmax", "_softmax_backward_data": "softmax",
    "_log_softmax_backward_data": "log_softmax", "native_layer_norm": "nn.functional.layer_norm",
    "native_layer_norm_backward": "nn.functional.layer_norm", "sum": "sum", "mean": "mean", "amax": "amax",
    "amin": "amin", "cat": "cat", "full_like": "full_like", "embedding": "nn.functional.embedding",
    "embedding_dense_backward": "nn.functional.embedding",
}
# lowered ops whose OpInfo samples never reach the lowering (3-D attention takes the math path; the first nll_loss
# samples are unreduced or 1-D, which stay eager): tested below
ELSEWHERE = {"_scaled_dot_product_fused_attention_overrideable": "test_fused_attention_in_a_program",
             "_scaled_dot_product_fused_attention_overrideable_backward": "test_fused_attention_in_a_program",
             "copy_": "test_input_mutation_is_written_by_the_program",
             "arange": "test_token_and_position_embeddings_run_in_the_program",
             "nll_loss_forward": "test_cross_entropy_runs_in_the_program_and_checks_its_targets",
             "nll_loss_backward": "test_cross_entropy_runs_in_the_program_and_checks_its_targets"}
SAMPLES = 3
BY_NAME = {(o.name, o.variant_test_name): o for o in op_db}


def _packet(op) -> str:
    return op._schema.name.split("::")[-1]


def test_every_lowering_has_an_opinfo_here():
    lowered = {_packet(op) for op in (*lowering.POINTWISE, *lowering.KERNELS)}
    missing = lowered - set(OPINFOS) - set(ELSEWHERE)
    assert not missing, f"lowered ops without an OpInfo in this test: {sorted(missing)}"


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.detach().to(device).requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


@pytest.mark.parametrize("name", sorted(set(OPINFOS.values())))
def test_compiled_matches_eager(name):
    op = BY_NAME.get(tuple(name.split(":")) if ":" in name else (name, ""))  # "name:variant"
    assert op is not None, name
    every = list(op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd))
    scalars = [x for x in every if isinstance(x.input, torch.Tensor) and x.input.dim() == 0]
    samples = [x for x in every if x not in scalars][:SAMPLES - 1] + scalars[:1]   # one 0-d edge case
    before = {id(r) for r in reports()}
    for sample in samples:
        torch._dynamo.reset()
        fn = op.get_op()
        compiled = torch.compile(lambda x, *a, **k: fn(x, *a, **k), backend="neuron")
        n_in, n_args, n_kw = _to(sample.input, "neuron"), _to(sample.args, "neuron"), _to(sample.kwargs, "neuron")
        got = compiled(n_in, *n_args, **n_kw)
        e_in, e_args, e_kw = _to(sample.input, "neuron"), _to(sample.args, "neuron"), _to(sample.kwargs, "neuron")
        want = fn(e_in, *e_args, **e_kw)
        cpu = fn(sample.input, *sample.args, **sample.kwargs)
        for g, w, c in zip(_tensors(got), _tensors(want), _tensors(cpu)):
            assert g.device.type == "neuron"
            torch.testing.assert_close(g.cpu(), w.cpu(), equal_nan=True)
            torch.testing.assert_close(g.cpu(), c.detach(), equal_nan=True, check_dtype=True)
        outs = [(g, w) for g, w in zip(_tensors(got), _tensors(want)) if g.requires_grad and g.is_floating_point()]
        if outs:
            seed = torch.Generator().manual_seed(0)
            grads = [torch.randn(g.shape, generator=seed) for g, _ in outs]
            gi = torch.autograd.grad([g for g, _ in outs], [t for t in _tensors([n_in, n_args]) if t.requires_grad],
                                     [x.to("neuron") for x in grads], allow_unused=True)
            wi = torch.autograd.grad([w for _, w in outs], [t for t in _tensors([e_in, e_args]) if t.requires_grad],
                                     [x.to("neuron") for x in grads], allow_unused=True)
            for a, b in zip(gi, wi):
                if a is not None and b is not None:
                    torch.testing.assert_close(a.cpu(), b.cpu(), equal_nan=True)
    assert any(r.segments for r in reports() if id(r) not in before), f"{name}: no sample ran in a compiled program"


def test_cast_to_bfloat16_rounds_inside_a_fused_group():
    """``(x * 3).bfloat16().float() + 1`` fused: the cast rounds as eager's does (bit for bit here)."""
    x = torch.randn(300, 70)
    fn = lambda t: (t * 3).to(torch.bfloat16).to(torch.float32) + 1  # noqa: E731
    got = torch.compile(fn, backend="neuron")(x.to("neuron")).cpu()
    torch.testing.assert_close(got, fn(x), rtol=0, atol=0)
    assert any(r.fused_nodes >= 3 for r in reports())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_fused_groups_cast_result_is_rounded_once_by_its_store(dtype):
    """``(a + b).to(dtype)``, the cast a result only: rounded once (to nearest even, as eager's cast) into a tile of
    its dtype by one GpSimd copy per tile, no VectorE round trip; bit for bit with the CPU on ties, overflow,
    infinities, NaN, zeros and subnormals."""
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.0, 65520.0, -65520.0,
                          1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 2.0**24 + 1, 3.39e38,
                          torch.finfo(torch.float32).max, 1e-40, -1e-40, 6e-8, 2**-25])
    a = torch.cat([edges, torch.randn(128 * 64 - edges.numel()) * 100]).reshape(128, 64)
    b = torch.cat([torch.zeros(edges.numel()), torch.randn(128 * 64 - edges.numel())]).reshape(128, 64)
    fn = lambda x, y: (x + y).to(dtype)  # noqa: E731
    run = torch.compile(fn, backend="neuron")
    x, y = a.to("neuron"), b.to("neuron")
    run(x, y)   # (compiles)
    with profiler.record() as records:
        got = run(x, y).cpu()
    want = fn(a, b)
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    (launch,) = records
    copies = [i for i in launch.program.instructions if i.opcode == "tensor_copy"]
    assert [str(i.engine) for i in copies] == ["Engine.GPSIMD"] and copies[0].dst.dtype == dtype   # (one tile)


def test_views_move_no_data_and_transposed_matmul_operands_are_taken_as_they_lie():
    """``x @ w.t()`` and a permute feeding a pointwise op: one program, no eager ops."""
    x, w = torch.randn(64, 48), torch.randn(32, 48)
    fn = lambda a, b: torch.relu(a @ b.t()).permute(1, 0) * 2  # noqa: E731
    got = torch.compile(fn, backend="neuron")(x.to("neuron"), w.to("neuron"))
    torch.testing.assert_close(got.cpu(), fn(x, w))
    rep = reports()[-1]
    assert rep.segments == 1 and not rep.eager_nodes


def test_pointwise_chain_is_one_group_with_one_pass():
    """Eight element-wise ops over one shape: one fusion group, reading each input once."""
    a, b = torch.randn(256, 512), torch.randn(256, 512)
    fn = lambda x, y: torch.sigmoid(torch.exp(x * 0.1) - y).mul(3).add(x).abs().sqrt()  # noqa: E731
    got = torch.compile(fn, backend="neuron")(a.to("neuron"), b.to("neuron"))
    torch.testing.assert_close(got.cpu(), fn(a, b))
    rep = reports()[-1]
    assert rep.fusion_groups == 1 and rep.fused_nodes == 8
    (prog,) = rep.programs
    # two fp32 inputs read once and one output written once: no intermediate reaches HBM
    assert prog.hbm_bytes_read == 2 * a.numel() * 4 and prog.hbm_bytes_written == a.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [24, 160])      # short: grouped small matmuls; from 128: the flash kernels
def test_fused_attention_in_a_program(dtype, causal, T):
    """Heads split out of one projection (strided views), SDPA forward and backward inside one program each,
    against the eager fused op on neuron (bit for bit: the same kernels) and the CPU (within the dtype's
    tolerance: bf16 rounds the scores and probabilities, as the eager op does)."""
    torch.manual_seed(0)
    B, H, E = 2, 3, 16
    x = torch.randn(B, T, 3 * H * E, dtype=dtype)

    def attend(t):
        q, k, v = t.split(H * E, dim=2)
        q, k, v = (z.view(B, T, H, E).transpose(1, 2) for z in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(B, T, H * E)

    results = []
    for run in (torch.compile(attend, backend="neuron"), attend):
        xn = x.to("neuron").requires_grad_()
        y = run(xn)
        y.backward(torch.ones_like(y))
        results.append((y.detach().cpu(), xn.grad.cpu()))
    (got, got_grad), (want, want_grad) = results
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)
    xc = x.clone().requires_grad_()
    yc = attend(xc)
    yc.backward(torch.ones_like(yc))
    # bf16: the CPU's math path rounds scores, probabilities and products to bf16 (2**-8 relative each) at
    # other points than the fused kernels; a few such roundings stack on values of magnitude ~1
    tol = {"rtol": 2**-6, "atol": 2**-6} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, yc.detach(), **tol)
    torch.testing.assert_close(got_grad, xc.grad, **tol)
    assert any("attention" in k for r in reports()[-3:] for k in r.kernels)


def test_input_mutation_is_written_by_the_program():
    """``buf.mul_(0.9).add_(x)`` (a running statistic): AOTAutograd's trailing ``copy_`` into the input runs in
    the program (a DMA into the input's own memory), and the input holds the CPU's values afterwards."""
    def update(buf, x):
        buf.mul_(0.9).add_(x.square())
        return x.sum(0)

    buf, x = torch.randn(48, 80), torch.randn(48, 80)
    nbuf = buf.to("neuron")
    out = torch.compile(update, backend="neuron")(nbuf, x.to("neuron"))
    want = update(buf, x)
    torch.testing.assert_close(out.cpu(), want)
    torch.testing.assert_close(nbuf.cpu(), buf)
    assert any(k.startswith("aten.copy_") for r in reports()[-2:] for k in r.kernels)


def test_sum_in_another_dtype_accumulates_in_one_pass():
    """``x.sum(0, dtype=float32)`` of bf16 values (a bias gradient under autocast) is one reduction in the program,
    its result within fp32 summation-order rounding of the CPU's (the bf16 inputs are exact in fp32)."""
    x = torch.randn(1000, 96).bfloat16()
    got = torch.compile(lambda t: t.sum(0, dtype=torch.float32), backend="neuron")(x.to("neuron")).cpu()
    want = x.sum(0, dtype=torch.float32)
    assert got.dtype == torch.float32
    bound = x.shape[0] * 2.0**-24 * x.float().abs().sum(0)
    assert ((got - want).abs() <= bound).all()
    rep = reports()[-1]
    assert not rep.eager_nodes and "aten.sum.dim_IntList" in rep.kernels


def test_layer_norm_backward_for_weights_only_stays_in_the_program():
    """A first layer's layer norm: its input needs no gradient, so the backward asks for dweight and dbias only."""
    x, w, b = torch.randn(64, 48), torch.randn(48), torch.randn(48)

    def grads(x, w, b, run):
        w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
        run(x, w, b).square().sum().backward()
        return w.grad.cpu(), b.grad.cpu()

    fn = lambda x, w, b: F.layer_norm(x, (48,), w, b)  # noqa: E731
    got = grads(x.to("neuron"), w.to("neuron"), b.to("neuron"), torch.compile(fn, backend="neuron"))
    want = grads(x, w, b, fn)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * r.abs().max().item())
    backward = [r for r in reports() if "backward" in r.name][-1]
    assert "aten.native_layer_norm_backward.default" in backward.kernels and not backward.eager_nodes


class _Embedder(torch.nn.Module):
    """Token plus position embeddings (positions from ``arange``, as GPT-style models build them)."""

    def __init__(self, V: int = 50, T: int = 16, D: int = 32, padding_idx: int | None = None):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(V, D, padding_idx=padding_idx), torch.nn.Embedding(T, D)
        self.head = torch.nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.shape[1], device=idx.device)
        return self.head(self.wte(idx) + self.wpe(pos)).square().mean()


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_token_and_position_embeddings_run_in_the_program(padding_idx, tmp_path, monkeypatch):
    """int64 token ids bound as int32 words, ``arange`` positions, both gathers and the gradients' one-hot
    products inside the programs (no eager node); every gradient equals the CPU's up to fp32 summation order.
    The backward builds the one-hots (from its id inputs) before its first product, not after the head's."""
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path))
    torch.manual_seed(0)
    cpu = _Embedder(padding_idx=padding_idx)
    dev = _Embedder(padding_idx=padding_idx).to("neuron")
    dev.load_state_dict(cpu.state_dict())
    idx = torch.randint(0, 50, (4, 16))
    idx[0, :4] = 3                                  # repeated rows (and the padding row when there is one)
    before = {id(r) for r in reports()}
    got = torch.compile(dev, backend="neuron")(idx.to("neuron"))
    want = cpu(idx)
    got.backward()
    want.backward()
    torch.testing.assert_close(got.cpu(), want.detach())
    for (name, p), q in zip(cpu.named_parameters(), dev.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, msg=name)
    new = [r for r in reports() if id(r) not in before]
    assert new and all(r.segments == 1 and not r.eager_nodes for r in new)
    kernels = {k for r in new for k in r.kernels}
    assert {"aten.embedding.default", "aten.arange.start_step", "aten.embedding_dense_backward.default"} <= kernels
    (backward,) = [r for r in new if "backward" in r.name]
    opcodes = [ln.split()[4] for ln in (tmp_path / backward.name / "program_s0.txt").read_text().splitlines()[2:]]
    assert opcodes.index("iota") < min(i for i, op in enumerate(opcodes) if op.startswith("nc_matmul"))


@pytest.mark.parametrize("bad", [50, -1, 2**32 + 1])
def test_an_embedding_index_outside_the_table_raises_index_error(bad):
    """A bad token id fails the program's indirect DMA (2**32 + 1 is not row 1), as the eager op raises."""
    emb = torch.nn.Embedding(50, 8).to("neuron")
    idx = torch.tensor([[1, bad]])
    with pytest.raises(IndexError):
        emb(idx.to("neuron"))
    with pytest.raises(IndexError):
        torch.compile(emb, backend="neuron")(idx.to("neuron"))


def test_cat_of_slices_lying_side_by_side_is_a_view():
    """``cat`` of a product's column blocks in their own order is the product itself (no copy); in another order
    the blocks are copied. Both equal the CPU's."""
    x, w = torch.randn(32, 24), torch.randn(24, 48)

    def joined(order):
        def fn(a, b):
            parts = (a @ b).split(16, dim=1)
            return torch.cat([parts[i] for i in order], dim=1) * 2
        return fn

    instructions = {}
    for order in ((0, 1, 2), (1, 0, 2)):
        torch._dynamo.reset()
        fn = joined(order)
        got = torch.compile(fn, backend="neuron")(x.to("neuron"), w.to("neuron"))
        torch.testing.assert_close(got.cpu(), fn(x, w))
        rep = reports()[-1]
        assert rep.segments == 1 and not rep.eager_nodes
        instructions[order] = rep.programs[0].instructions
    assert instructions[(0, 1, 2)] < instructions[(1, 0, 2)]


@pytest.mark.parametrize("N", [96, 256])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_runs_in_the_program_and_checks_its_targets(weighted, reduction, N, monkeypatch):
    """log_softmax and nll (forward and backward) in the programs, equal to the CPU within fp32 summation order
    over the rows; a target outside the classes fails the program's device-side assertion with the eager op's
    IndexError, and the next call with good targets runs as before. 256 rows (whole blocks of 128) take the
    forward as one kernel (the loss picked from the log-softmax in SBUF), 96 rows the two kernels."""
    from torchneuron.compiler import kernel_lowerings
    fused = []
    kernel = kernel_lowerings.log_softmax_nll_fwd_kernel
    monkeypatch.setattr(kernel_lowerings, "log_softmax_nll_fwd_kernel", lambda *a, **k: fused.append(1) or kernel(*a, **k))
    torch.manual_seed(0)
    x, t = torch.randn(N, 40), torch.randint(0, 40, (N,))
    t[:5] = 7                                               # ignored rows
    w = torch.rand(40) if weighted else None
    fn = lambda a, b, c: F.cross_entropy(a, b, weight=c, ignore_index=7, reduction=reduction)  # noqa: E731
    xn = x.to("neuron").requires_grad_()
    wn = None if w is None else w.to("neuron")
    compiled = torch.compile(fn, backend="neuron")
    got = compiled(xn, t.to("neuron"), wn)
    got.backward()
    xc = x.clone().requires_grad_()
    want = fn(xc, t, w)
    want.backward()
    torch.testing.assert_close(got.cpu(), want.detach())
    torch.testing.assert_close(xn.grad.cpu(), xc.grad)
    new = reports()[-2:]
    assert all(not r.eager_nodes for r in new)
    assert {"aten.nll_loss_forward.default", "aten.nll_loss_backward.default"} <= {k for r in new for k in r.kernels}
    assert bool(fused) == (N == 256)
    bad = t.clone()
    bad[50] = 40
    with pytest.raises(IndexError):
        fn(x.to("neuron"), bad.to("neuron"), wn)             # the eager op
    with pytest.raises(IndexError, match="Target out of bounds"):
        compiled(x.to("neuron"), bad.to("neuron"), wn)
    torch.testing.assert_close(compiled(x.to("neuron"), t.to("neuron"), wn).cpu(), want.detach())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_arange_with_a_start_and_a_step(dtype):
    """``arange(2, 2 + 3n, 3)`` in a program (GpSimd's iota): int32 feeds the element-wise pass in the program,
    int64 leaves the program as word pairs the host views as int64 (an eager op reads it); both equal the CPU."""
    x = torch.randn(4, 50)
    fn = lambda t: t * torch.arange(2, 152, 3, device=t.device, dtype=dtype)  # noqa: E731
    got = torch.compile(fn, backend="neuron")(x.to("neuron"))
    torch.testing.assert_close(got.cpu(), fn(x))
    assert "aten.arange.start_step" in reports()[-1].kernels
    ids = torch.compile(lambda t: torch.arange(5, 5 + t.shape[0], device=t.device) * 1, backend="neuron")(
        x.to("neuron"))
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), torch.arange(5, 9))


def test_an_adamw_step_updates_each_parameter_in_one_pass():
    """A compiled AdamW step: each parameter's update (decay, both moments, the step) is one fusion group, its
    producers folded into their one reader instead of passing through HBM, and the parameters and moments
    equal the CPU's run of the same graph after two steps within fp32 rounding of the update's few operations."""
    torch.manual_seed(0)
    params = [torch.randn(65, 64), torch.randn(64)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(2)]
    runs = []
    for device in ("neuron", "cpu"):
        ps = [p.clone().to(device).requires_grad_() for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
        # the reference is the same graph on the CPU: a compiled step keeps its step count as an fp32 tensor,
        # so its bias corrections round in fp32 (1 - 0.999**t loses ~2**-24 / 0.002 relative) where eager
        # AdamW computes them in double
        step = torch.compile(opt.step, backend="neuron" if device == "neuron" else "aot_eager")
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.to(device)
            step()
        runs.append(([p.detach().cpu() for p in ps], [opt.state[p]["exp_avg_sq"].cpu() for p in ps]))
        if device == "neuron":
            rep = reports()[-1]
    # per step: the parameter rounded once (half an ulp, 2**-24 relative) after an update of size ~lr whose
    # eight or so operations each round (2**-24 relative); the moments likewise, relative to themselves
    steps, u = len(grads), 2.0**-24
    (p_got, v_got), (p_want, v_want) = runs
    for a, b in zip(p_got, p_want):
        assert ((a - b).abs() <= steps * (2 * u * b.abs() + 1e-2 * 16 * u)).all()
    for a, b in zip(v_got, v_want):
        assert ((a - b).abs() <= steps * 16 * u * b.abs()).all()
    assert rep.fusion_groups == len(params), rep.summary()
