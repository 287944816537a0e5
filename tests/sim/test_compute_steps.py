"""Planned steps of the compute engines' instructions (ScalarE activation, VectorE statistics and reductions):
bit-identical to the instruction's ``execute`` over partial tiles, special values, aliasing and strided views, and
close to float64 references."""
from __future__ import annotations

import pytest
import torch

from torchneuron.sim import Engine, NeuronCore, isa, numerics as nx, tile
from torchneuron.sim.memory import AP

F32, BF16 = torch.float32, torch.bfloat16
TINY = 1.1754943508222875e-38  # the smallest normal fp32
# +-0, +-inf, NaN, large |x|, fp32 subnormals, values at the edges of exp's fast range
SPECIALS = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3e38, -3e38, 1e30, -1e30,
                         1e-40, -1e-40, TINY, -TINY, -87.0, -88.0, -104.0, -103.97208, 88.7, 89.0, 8.5, -8.5])


def _values(shape, seed: int, specials: bool = True) -> torch.Tensor:
    """Normal fp32 values scaled over a few binades, with about one in six a special value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
    if specials:
        pick = torch.randint(0, 6 * len(SPECIALS), shape, generator=g)
        hit = pick < len(SPECIALS)
        x[hit] = SPECIALS[pick[hit]]
    return x


def _sb(offset: int, dtype=F32, free=(64,), parts: int = 128, start: int = 0):
    """A tile at a byte offset of SBUF."""
    return tile("sbuf", dtype, (parts, *free), start_partition=start, offset=offset)


def _cores(seed: int, specials: bool = True) -> tuple[NeuronCore, NeuronCore]:
    """Two cores with the same random SBUF/PSUM contents and registers."""
    cores = NeuronCore("trn2", nan_fill=False), NeuronCore("trn2", nan_fill=False)
    for k, core in enumerate(cores):
        for mem in (core.sbuf, core.psum):
            words = mem.data.view(F32)[:, :4096]  # the first 16 KiB of each partition: where the tests' tiles lie
            words.copy_(_values(words.shape, seed + (mem is core.psum), specials))
        for regs in core.regs.values():
            regs.copy_(_values(regs.shape, seed + 7, specials=False))
    return cores


def _same_state(a: NeuronCore, b: NeuronCore) -> bool:
    return (torch.equal(a.sbuf.data, b.sbuf.data) and torch.equal(a.psum.data, b.psum.data)
            and all(torch.equal(a.regs[e].view(torch.int32), b.regs[e].view(torch.int32)) for e in a.regs))


def _check_step_matches_execute(instr, seed: int = 0, specials: bool = True, runs: int = 2) -> None:
    """The instruction's planned step leaves SBUF, PSUM and the registers as ``execute`` does, run after run."""
    fast, slow = _cores(seed, specials)
    step = instr.step(fast, {})
    assert step is not None, "no planned step: the core would take execute"
    for _ in range(runs):  # again: a step reuses its buffers
        step([])
        slow.execute(instr)
        assert _same_state(fast, slow)


# ---- activation ---------------------------------------------------------------------------------

ALL_OPS = sorted(nx.ACTIVATIONS)


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200, 4096])
def test_activation_buffer_is_apply_activations_evaluation(op, n):
    # apply_activation's definition before buffers: the function of a zero-padded contiguous copy
    x = _values((n,), n)
    padded = torch.zeros(-(-n // 64) * 64)
    padded[:n] = x
    want = nx.ACTIVATIONS[op](padded)[:n]
    buf, run = nx.activation_buffer(op, n, F32)
    for _ in range(2):  # the second run starts from what the first left in the buffer and its padding
        buf[:n].copy_(x)
        got = run()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(nx.apply_activation(op, x.view(1, n)).view(torch.int32), want.view(1, n).view(torch.int32))


def test_gelu_dx_is_close_to_float64():
    # the formula evaluated in place against the derivative of x * Phi(x) in float64
    x = torch.cat([torch.linspace(-12, 12, 4801), torch.tensor([0.0, -0.0, 1e-40, -1e-40, 30.0, -30.0])])
    got = nx.apply_activation("gelu_dx", x)
    xd = x.double()
    want = 0.5 * (1 + torch.erf(xd / 2 ** 0.5)) + xd * torch.exp(-0.5 * xd * xd) / (2 * torch.pi) ** 0.5
    # each of the ~10 fp32 operations rounds once (a few eps relative), erf/exp within 1-2 ulp of their values;
    # near the zero of the derivative (x ~ -0.75) the sum cancels, hence an absolute term of a few eps
    torch.testing.assert_close(got.double(), want, rtol=8 * 2 ** -23, atol=8 * 2 ** -23)
    assert torch.isnan(nx.apply_activation("gelu_dx", torch.tensor([float("nan")]))).all()


def _activation_cases():
    i = isa
    col = _sb(4096, F32, (1,))
    bcol = _sb(4100, BF16, (1,))
    yield "gelu", i.activation(dst=_sb(0), op="gelu", data=_sb(512))
    yield "gelu_dx", i.activation(dst=_sb(0, free=(2, 64)), op="gelu_dx", data=_sb(1024, free=(2, 64)))
    yield "gelu_dx in place", i.activation(dst=_sb(512), op="gelu_dx", data=_sb(512))
    yield "gelu_dx from psum strided", i.activation(
        dst=_sb(0, free=(2, 32)), op="gelu_dx", data=tile("psum", F32, (128, 2, 64), offset=0)[:, :, ::2],
        reduce_res=_sb(4104, F32, (1,)), reduce_cmd="reset_reduce")
    yield "gelu partial", i.activation(dst=_sb(0, free=(37,), parts=45, start=3), op="gelu",
                                       data=_sb(512, free=(37,), parts=45, start=3))
    yield "gelu_dx scale bias", i.activation(dst=_sb(0, free=(65,)), op="gelu_dx", data=_sb(512, free=(65,)),
                                             scale=col, bias=-0.75)
    yield "gelu bf16", i.activation(dst=_sb(0, BF16), op="gelu", data=_sb(512, BF16), bias=bcol)
    yield "gelu into bf16", i.activation(dst=_sb(0, BF16), op="gelu_apprx_tanh", data=_sb(512), scale=1.7)
    yield "silu", i.activation(dst=_sb(0, free=(4, 17)), op="silu", data=_sb(512, free=(4, 17)))
    for cmd in ("reset_reduce", "reduce", "reset"):
        yield f"identity {cmd} in place", i.activation(
            dst=_sb(512), op="identity", data=_sb(512), reduce_op="add", reduce_res=_sb(4104, F32, (1,)),
            reduce_cmd=cmd)
    yield "identity reduce max in place 3d", i.activation(
        dst=_sb(512, free=(4, 16)), op="identity", data=_sb(512, free=(4, 16)), reduce_op="maximum",
        reduce_res=_sb(4104, F32, (1,)), reduce_cmd="reset_reduce")
    strided = tile("sbuf", F32, (128, 64), offset=1024)[:, ::2]
    yield "identity in place strided", i.activation(dst=strided, op="identity", data=strided,
                                                    reduce_res=_sb(4104, F32, (1,)), reduce_cmd="reduce")
    yield "identity reduce_res only", i.activation(dst=_sb(512, free=(1,)), op="identity", data=_sb(512, free=(1,)),
                                                   reduce_res=_sb(4104, F32, (1,)))
    yield "identity reduce into another tile", i.activation(
        dst=_sb(0, BF16, free=(2, 64)), op="identity", data=_sb(1024, free=(2, 64)), reduce_op="add",
        reduce_res=_sb(4104, F32, (1,)), reduce_cmd="reset_reduce")
    yield "identity reduce from strided rows", i.activation(
        dst=_sb(0, free=(32,)), op="identity", data=tile("psum", F32, (128, 64), offset=0)[:, ::2],
        reduce_op="add", reduce_res=_sb(4104, F32, (1,)), reduce_cmd="reset_reduce")
    yield "identity reduce overlapping", i.activation(
        dst=_sb(128, free=(64,)), op="identity", data=_sb(0, free=(64,)), reduce_op="maximum", reduce_cmd="reduce")
    yield "identity reduce max", i.activation(dst=_sb(0, free=(3, 64)), op="copy", data=_sb(1024, free=(3, 64)),
                                              reduce_op="maximum", reduce_cmd="reset_reduce")
    yield "identity scale reduce", i.activation(dst=_sb(0), op="identity", data=_sb(0), scale=col,
                                                reduce_res=_sb(4104, F32, (1,)), reduce_cmd="reduce")
    yield "identity bf16 in place", i.activation(dst=_sb(0, BF16), op="identity", data=_sb(0, BF16),
                                                 reduce_res=_sb(4104, F32, (1,)), reduce_cmd="reset_reduce")
    yield "exp reduce", i.activation(dst=_sb(0, free=(65,)), op="exp", data=_sb(512, free=(65,)), bias=col,
                                     reduce_op="add", reduce_res=_sb(4104, F32, (1,)), reduce_cmd="reset_reduce")
    yield "exp reduce in place", i.activation(dst=_sb(512), op="exp", data=_sb(512), scale=0.25,
                                              reduce_cmd="reset_reduce")
    yield "tanh psum", i.activation(dst=_sb(0), op="tanh", data=tile("psum", F32, (128, 64), offset=2048),
                                    reduce_res=_sb(4104, F32, (1,)), reduce_cmd="reset_reduce")
    yield "gelu from psum strided", i.activation(
        dst=_sb(0, free=(32,)), op="gelu", data=tile("psum", F32, (128, 64), offset=0)[:, ::2])


@pytest.mark.parametrize("specials", [False, True], ids=["normal", "specials"])
@pytest.mark.parametrize("case", list(_activation_cases()), ids=lambda c: c[0])
def test_activation_steps_match_execute(case, specials):
    _check_step_matches_execute(case[1], specials=specials)


@pytest.mark.parametrize("op", ["add", "maximum", "minimum"])
@pytest.mark.parametrize("shape", [(128, 1), (128, 2), (128, 65), (64, 8, 64), (32, 3, 5)])
def test_reset_reduce_into_registers_is_the_identity_then_the_reduction(op, shape):
    # written straight into the registers: the bits of resetting them to op's identity and folding the reduction
    # in, over special values, rows of -0.0 and strided values
    from torchneuron.sim.isa.scalar_engine import register_accumulator
    x = _values(shape, sum(shape))
    x[:4] = torch.tensor([-0.0, 0.0, float("nan"), -float("inf")]).view(4, *[1] * (len(shape) - 1))
    xv = torch.empty(shape[0], 2 * shape[1] + 3)[:, 3::2][:, :shape[1]] if len(shape) == 2 else x  # strided rows
    xv.copy_(x)
    regs = _values((shape[0],), 9, specials=False)
    register_accumulator(regs, op, "reset_reduce", len(shape))(xv)
    fold = {"add": torch.add, "maximum": torch.maximum, "minimum": torch.minimum}[op]
    part = nx.apply_reduce(op, xv, tuple(range(1, len(shape))))
    want = fold(torch.full((shape[0],), nx.REDUCE_IDENTITY[op]), part)
    assert torch.equal(regs.view(torch.int32), want.view(torch.int32))


def test_activation_reduction_is_close_to_float64():
    fast, _ = _cores(3, specials=False)
    data, res = _sb(512), _sb(4104, F32, (1,))
    instr = isa.activation(dst=_sb(0), op="gelu", data=data, scale=0.5, reduce_res=res, reduce_cmd="reset_reduce")
    x = data.view(fast).double()
    instr.step(fast, {})([])
    want = torch.nn.functional.gelu(0.5 * x)
    # gelu = x * 0.5 * (1 + erf(x / sqrt2)) in fp32: a few roundings relative to the result, and the error of
    # 1 + erf (torch's vectorised fp32 erf: a few eps absolute near 1, where 1 + erf cancels for negative x) times
    # x / 2, so 8 eps of |gelu| + |x / 2|; the fp32 sum of 64 terms within 64 eps of the sum of their magnitudes
    eps = 2 ** -23
    err = (_sb(0).view(fast).double() - want).abs()
    assert (err <= 8 * eps * (want.abs() + (0.5 * x).abs())).all()
    bound = 64 * 2 ** -23 * want.abs().sum(1, keepdim=True) + 1e-30
    assert ((res.view(fast).double() - want.sum(1, keepdim=True)).abs() <= bound).all()
    assert torch.equal(fast.regs[Engine.SCALAR][:128], res.view(fast).reshape(-1))


# ---- bn_stats / bn_aggr -----------------------------------------------------------------------------

def _bn_stats_formula(x: torch.Tensor) -> torch.Tensor:
    """bn_stats as the plain expression: (count, mean, sum of squared deviations) of the even then odd elements."""
    stats = []
    for half in (x[:, 0::2], x[:, 1::2]):
        n = half.shape[1]
        mean = half.mean(1) if n else torch.zeros(x.shape[0])
        stats += [torch.full_like(mean, float(n)), mean, ((half - mean[:, None]) ** 2).sum(1)]
    return torch.stack(stats, 1)


def _bn_aggr_formula(x: torch.Tensor) -> torch.Tensor:
    g = x.reshape(x.shape[0], -1, 3)
    n, mean, m2 = g[..., 0], g[..., 1], g[..., 2]
    total = n.sum(1)
    mu = (n * mean).sum(1) / total
    return torch.stack([mu, (m2.sum(1) + (n * (mean - mu[:, None]) ** 2).sum(1)) / total], 1)


@pytest.mark.parametrize("f", [1, 2, 3, 4, 6, 16, 17, 30, 64, 65, 100, 512])
def test_bn_statistics_match_their_formulas_bit_for_bit(f):
    from torchneuron.sim.isa.vector_engine import bn_aggr_fn, bn_stats_fn
    x = _values((128, f), f)
    base = torch.empty(128, 1000)  # a strided view, as a tile in SBUF
    xv = base[:, 7:7 + f]
    xv.copy_(x)
    out = torch.empty(128, 6)
    bn_stats_fn(xv, out)()
    assert torch.equal(out.view(torch.int32), _bn_stats_formula(xv).view(torch.int32))
    stats = torch.cat([_bn_stats_formula(_values((128, 64), s, specials=False)) for s in range(f % 5 + 1)], 1)
    agg = torch.empty(128, 2)
    bn_aggr_fn(stats, agg)()
    assert torch.equal(agg.view(torch.int32), _bn_aggr_formula(stats).view(torch.int32))
    triples = base[:, 11:11 + 3 * (f % 7 + 1)]  # any values (special ones too), in a strided view
    triples.copy_(_values(triples.shape, f + 1))
    bn_aggr_fn(triples, agg)()
    assert torch.equal(agg.view(torch.int32), _bn_aggr_formula(triples).view(torch.int32))


def test_bn_statistics_are_close_to_float64():
    fast, _ = _cores(5, specials=False)
    data, stats, agg = _sb(0, free=(4, 96)), _sb(2048, free=(24,)), _sb(2200, free=(2,))
    for j in range(4):
        isa.bn_stats(dst=stats[:, 6 * j:6 * j + 6], data=data[:, j]).step(fast, {})([])
    isa.bn_aggr(dst=agg, data=stats).step(fast, {})([])
    x = data.view(fast).reshape(128, -1).double()
    mean, var = x.mean(1), x.var(1, unbiased=False)
    # fp32 sums of at most 384 terms: within 384 eps of the sums of magnitudes
    eps = 2 ** -23
    got = agg.view(fast).double()
    assert ((got[:, 0] - mean).abs() <= 384 * eps * x.abs().mean(1)).all()
    assert ((got[:, 1] - var).abs() <= 384 * eps * (x - mean[:, None]).pow(2).mean(1) + 384 * eps * mean.abs() ** 2
            ).all()


def _statistics_cases():
    i = isa
    yield "bn_stats", i.bn_stats(dst=_sb(2048, free=(6,)), data=_sb(0))
    yield "bn_stats odd", i.bn_stats(dst=_sb(2048, free=(6,)), data=_sb(0, free=(65,)))
    yield "bn_stats one", i.bn_stats(dst=_sb(2048, free=(6,)), data=_sb(0, free=(1,)))
    yield "bn_stats 3d partial", i.bn_stats(dst=_sb(2048, free=(6,), parts=37, start=50),
                                            data=_sb(0, free=(4, 16), parts=37, start=50))
    yield "bn_stats bf16", i.bn_stats(dst=_sb(2048, BF16, free=(6,)), data=_sb(0, BF16, free=(100,)))
    yield "bn_stats psum", i.bn_stats(dst=_sb(2048, free=(6,)), data=tile("psum", F32, (128, 512), offset=0))
    yield "bn_aggr", i.bn_aggr(dst=_sb(2048, free=(2,)), data=_sb(0, free=(6,)))
    yield "bn_aggr groups", i.bn_aggr(dst=_sb(2048, free=(2,)), data=_sb(0, free=(4, 6)))
    yield "bn_aggr bf16", i.bn_aggr(dst=_sb(2048, BF16, free=(2,)), data=_sb(0, BF16, free=(12,)))


@pytest.mark.parametrize("specials", [False, True], ids=["normal", "specials"])
@pytest.mark.parametrize("case", list(_statistics_cases()), ids=lambda c: c[0])
def test_statistics_steps_match_execute(case, specials):
    _check_step_matches_execute(case[1], specials=specials)


# ---- tensor_reduce written into dst --------------------------------------------------------------------------

def _reduce_cases():
    i = isa
    for op in ("add", "maximum", "minimum"):
        yield f"{op} rows", i.tensor_reduce(dst=_sb(4096, free=(8,)), op=op, data=_sb(0, free=(8, 64)), axis=2)
    yield "add negate", i.tensor_reduce(dst=_sb(4096, free=(1,)), op="add", data=_sb(0, free=(65,)), negate=True)
    yield "max negate", i.tensor_reduce(dst=_sb(4096, free=(1,)), op="maximum", data=_sb(0, free=(65,)), axis=1,
                                        negate=True)
    yield "add two axes", i.tensor_reduce(dst=_sb(4096, free=(4,)), op="add", data=_sb(0, free=(4, 8, 16)),
                                          axis=(2, 3))
    yield "add keepdims", i.tensor_reduce(dst=_sb(4096, free=(4, 1)), op="add", data=_sb(0, free=(4, 1, 16)),
                                          axis=3, keepdims=True)
    yield "add short rows", i.tensor_reduce(dst=_sb(4096, free=(64,)), op="add", data=_sb(0, free=(64, 8)), axis=2)
    yield "add strided data", i.tensor_reduce(dst=_sb(4096, free=(8,)), op="add", axis=2,
                                              data=tile("psum", F32, (128, 8, 64), offset=0)[:, :, ::2])
    yield "add dst columns", i.tensor_reduce(dst=tile("sbuf", F32, (128, 2, 8), offset=4096)[:, 1], op="add",
                                             data=_sb(0, free=(8, 64)), axis=2)
    transposed = AP("sbuf", F32, ((1, 4), (4, 8)), partitions=128, offset=4096)  # (128, 4, 8), the 4 innermost
    yield "add dst transposed", i.tensor_reduce(dst=transposed, op="add", data=_sb(0, free=(4, 8, 32)), axis=3)
    yield "add bf16 data", i.tensor_reduce(dst=_sb(4096, free=(8,)), op="add", data=_sb(0, BF16, (8, 64)), axis=2)
    yield "add into bf16", i.tensor_reduce(dst=_sb(4096, BF16, (8,)), op="add", data=_sb(0, free=(8, 64)), axis=2)
    yield "add partial", i.tensor_reduce(dst=_sb(4096, free=(8,), parts=45, start=3), op="add",
                                         data=_sb(0, free=(8, 64), parts=45, start=3), axis=2)


@pytest.mark.parametrize("specials", [False, True], ids=["normal", "specials"])
@pytest.mark.parametrize("case", list(_reduce_cases()), ids=lambda c: c[0])
def test_reduce_steps_match_execute(case, specials):
    _check_step_matches_execute(case[1], specials=specials)


# ---- exp's clamped route with a step's buffers -------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], [float("nan")], [-87.5], [-100.0], [-103.9720764], [-87.00001]],
                         ids=["masked", "nan", "denormal", "denormal2", "above-zero-bound", "below-fast-min"])
def test_exp_with_buffers_matches_torch_bit_for_bit(extra):
    # a causal softmax's masked scores (half the tile far below exp's range) in a strided view, in place, twice
    # with the same buffers: torch.exp's bits, also where a value in the band makes the route step aside
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, 64, generator=g) * 4
    x[:, :, 40:] = torch.tensor([-3e38, -float("inf"), -1e4, -104.0])[torch.randint(0, 4, (64, 8, 24), generator=g)]
    x.view(-1)[torch.randperm(x.numel(), generator=g)[:len(extra)]] = torch.tensor(extra or [0.0])[:len(extra)]
    want = torch.exp(x)
    fn = nx.exp_buffers()
    sbuf = torch.full((64, 1000), float("nan"))
    view = sbuf[:, 100:612].view(64, 8, 64)
    for _ in range(2):
        view.copy_(x)
        assert torch.equal(fn(view, out=view).view(torch.int32), want.view(torch.int32))
    ref = x.clone()
    assert (nx._exp_keep(ref) is None) == bool(extra)  # the route is taken exactly where nothing is in the band


@pytest.mark.parametrize("extra", [[], [float("nan")], [-87.5], [-103.9720764], [-87.00001]],
                         ids=["unmasked", "nan", "denormal", "above-zero-bound", "below-fast-min"])
def test_exp_after_masked_scores_matches_torch_bit_for_bit(extra):
    # a step whose last input held masked scores skips the test for them: the next input, masked or not, with NaN
    # or a value in the band, still gets torch.exp's bits, run after run
    g = torch.Generator().manual_seed(2)
    masked = torch.randn(64, 512, generator=g)
    masked[:, 300:] = -3e38
    plain = torch.randn(64, 512, generator=g) * 30
    plain.view(-1)[torch.randperm(plain.numel(), generator=g)[:len(extra)]] = torch.tensor(extra or [0.0])[:len(extra)]
    fn = nx.exp_buffers()
    sbuf = torch.full((64, 2000), float("nan"))
    view = sbuf[:, 700:1212]
    for x in (masked, plain, plain, masked, masked, plain):
        view.copy_(x)
        assert torch.equal(fn(view, out=view).view(torch.int32), torch.exp(x).view(torch.int32))


# ---- affine_select ----------------------------------------------------------------------------------------

def _affine_cases():
    i = isa
    causal = dict(pattern=[[0, 8], [-1, 64]], channel_multiplier=1, cmp_op="greater_equal")
    yield "in place 3d", i.affine_select(dst=_sb(0, free=(8, 64)), on_true_tile=_sb(0, free=(8, 64)),
                                         on_false_value=0.0, **causal)
    yield "disjoint", i.affine_select(dst=_sb(4096, free=(64,), parts=64), pattern=[[-1, 64]], channel_multiplier=1,
                                      on_true_tile=_sb(0, free=(64,), parts=64), on_false_value=-3e38,
                                      cmp_op="greater_equal")
    yield "shifted overlap", i.affine_select(dst=_sb(8, free=(8, 64)), on_true_tile=_sb(0, free=(8, 64)),
                                             on_false_value=-float("inf"), **causal)
    yield "partial partitions", i.affine_select(dst=_sb(0, free=(40,), parts=30, start=90), pattern=[[2, 40]],
                                                channel_multiplier=-3, offset=7, cmp_op="not_equal",
                                                on_true_tile=_sb(0, free=(40,), parts=30, start=90),
                                                on_false_value=float("nan"))
    yield "into bf16", i.affine_select(dst=_sb(4096, BF16, free=(8, 64)), on_true_tile=_sb(0, free=(8, 64)),
                                       on_false_value=-1e30, **causal)
    yield "int32 in place", i.affine_select(dst=_sb(0, torch.int32, free=(64,)), pattern=[[-1, 64]],
                                            channel_multiplier=1, on_true_tile=_sb(0, torch.int32, free=(64,)),
                                            on_false_value=-5, cmp_op="less")


@pytest.mark.parametrize("case", list(_affine_cases()), ids=lambda c: c[0])
def test_affine_select_steps_match_execute(case):
    # NaNs of distinct payloads among the values: a selection copies elements, payloads included
    fast, slow = _cores(9)
    for core in (fast, slow):
        words = core.sbuf.data.view(torch.int32)[:, :4096]
        g = torch.Generator().manual_seed(3)
        nan = torch.randint(0x7FC00001, 0x7FFFFFFF, words.shape, generator=g, dtype=torch.int32)
        pick = torch.rand(words.shape, generator=g) < 0.1
        words[pick] = nan[pick]
    step = case[1].step(fast, {})
    for _ in range(2):
        step([])
        slow.execute(case[1])
        assert _same_state(fast, slow)


def test_causal_affine_select_against_a_mask():
    fast, _ = _cores(4)
    tile_ = _sb(0, free=(8, 64))
    x = tile_.view(fast).clone()
    isa.affine_select(dst=tile_, on_true_tile=tile_, on_false_value=-3e38, pattern=[[0, 8], [-1, 64]],
                      channel_multiplier=1, cmp_op="greater_equal").step(fast, {})([])
    keep = torch.arange(128)[:, None, None] >= torch.arange(64)[None, None, :]  # p - i >= 0
    want = torch.where(keep, x, torch.tensor(-3e38))
    assert torch.equal(tile_.view(fast).view(torch.int32), want.view(torch.int32))


# ---- tensor_scalar powers in place ------------------------------------------------------------------------

@pytest.mark.parametrize("exponent", [2.0, 0.5, -0.5, -1.0, 0.3, 3.0])
@pytest.mark.parametrize("free", [(1,), (100,), (3, 64)], ids=["column", "row", "3d"])
def test_tensor_scalar_powers_match_execute(exponent, free):
    # a layer norm's rstd: (var + eps) ** -0.5 written into dst, against execute's temporaries (contiguous: the
    # vector path) over negative, zero, subnormal, huge, infinite and NaN-payload values
    g = torch.Generator().manual_seed(0)
    for dst, data in ((_sb(2048, free=free), _sb(0, free=free)), (_sb(0, free=free), _sb(0, free=free))):
        instr = isa.tensor_scalar(dst=dst, data=data, op0="add", operand0=1e-5, op1="power", operand1=exponent)
        fast, slow = _cores(int(torch.randint(0, 100, (1,), generator=g)))
        for core in (fast, slow):
            words = core.sbuf.data.view(torch.int32)[:, :2048]
            nan = torch.randint(0x7FC00001, 0x7FFFFFFF, words.shape, generator=torch.Generator().manual_seed(1),
                                dtype=torch.int32)
            words[::7] = (nan | (torch.arange(words.shape[1]) % 2 << 31).to(torch.int32))[::7]
        step = instr.step(fast, {})
        step([])
        slow.execute(instr)
        assert _same_state(fast, slow)
    # the step's results against the float64 power of the fp32 sum: x * x, sqrt and 1 / x round once, 1 / sqrt
    # twice, torch's general pow is within an ulp: 2 ulp (relative 2 ** -22) covers each
    fast, _ = _cores(3, specials=False)
    data, dst = _sb(0, free=free), _sb(2048, free=free)
    data.view(fast).abs_()
    isa.tensor_scalar(dst=dst, data=data, op0="add", operand0=1e-5, op1="power", operand1=exponent).step(fast, {})([])
    want = (data.view(fast) + 1e-5).double() ** exponent
    assert torch.isclose(dst.view(fast).double(), want, rtol=2 ** -22, atol=0).all()


# ---- comparisons and logical operators written straight into dst ------------------------------------------

def _truth_cases():
    i, I32 = isa, torch.int32
    for op in ("logical_and", "logical_or", "logical_xor", "equal", "greater"):
        for dt in (F32, I32):
            yield f"tt {op} {dt}", i.tensor_tensor(dst=_sb(4096, dt, free=(4, 16)), data1=_sb(0, dt, free=(4, 16)),
                                                   data2=_sb(1024, dt, free=(4, 16)), op=op)
    yield "tt in place", i.tensor_tensor(dst=_sb(0, I32), data1=_sb(0, I32), data2=_sb(1024, I32), op="logical_and")
    yield "tt shifted overlap", i.tensor_tensor(dst=_sb(4), data1=_sb(0), data2=_sb(1024), op="greater")
    yield "tt into bf16", i.tensor_tensor(dst=_sb(4096, BF16), data1=_sb(0), data2=_sb(1024), op="less_equal")
    yield "tt mixed dtypes", i.tensor_tensor(dst=_sb(4096, I32), data1=_sb(0, I32), data2=_sb(1024), op="not_equal")
    yield "ts equal 0", i.tensor_scalar(dst=_sb(4096, I32, free=(1,)), data=_sb(0, I32, free=(1,)), op0="equal",
                                        operand0=0)
    yield "ts reversed column", i.tensor_scalar(dst=_sb(4096, I32), data=_sb(0, I32), op0="greater",
                                                operand0=_sb(2048, I32, free=(1,)), reverse0=True)
    yield "ts logical scalar", i.tensor_scalar(dst=_sb(4096), data=_sb(0), op0="logical_xor", operand0=2.5)
    yield "ts reversed scalar", i.tensor_scalar(dst=_sb(0), data=_sb(0), op0="less", operand0=-0.0, reverse0=True)


@pytest.mark.parametrize("case", list(_truth_cases()), ids=lambda c: c[0])
def test_comparison_and_logical_steps_match_execute(case):
    # int32 tiles hold the fp32 specials' bit patterns (0, 0x80000000, NaN words...) and large integers
    _check_step_matches_execute(case[1])


def test_logical_and_against_truthiness():
    fast, _ = _cores(2)
    a, b, dst = _sb(0), _sb(1024), _sb(4096, torch.int32)
    isa.tensor_tensor(dst=dst, data1=a, data2=b, op="logical_and").step(fast, {})([])
    want = ((a.view(fast) != 0) & (b.view(fast) != 0)).to(torch.int32)  # NaN is true, -0.0 false
    assert torch.equal(dst.view(fast), want)
