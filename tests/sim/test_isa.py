"""Every instruction against a PyTorch reference on random data, for the dtypes it supports."""
from __future__ import annotations

import contextlib
import functools
import operator

import pytest
import torch

from torchneuron.sim import AP, Engine, IndexOutOfRange, NeuronCore, SimulatorError, isa, tile
from torchneuron.sim.isa import tensor_engine
from torchneuron.sim.instruction import CostInputs

from .conftest import empty, hbm, put, rand
from .test_numerics import ACT_REF

F32, BF16, F16, E4, E5 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
I8, I16, I32, U8 = torch.int8, torch.int16, torch.int32, torch.uint8


def wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64) if t.dtype.is_floating_point else t.to(torch.int64)


def same(got: torch.Tensor, want: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Equal values (NaN == NaN), compared in a wide dtype so fp8 and uint work; dtypes must match."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    torch.testing.assert_close(wide(got), wide(want).reshape(got.shape), rtol=rtol, atol=atol, equal_nan=True)


def cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The engines' cast: through fp32 unless both sides are integers."""
    if values.dtype == dtype or (not values.dtype.is_floating_point and not dtype.is_floating_point):
        return values.to(dtype)
    return values.float().to(dtype)


# ---- DMA ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("src_dt,dst_dt", [(F32, F32), (F32, BF16), (BF16, F32), (F32, E4), (BF16, E5), (F16, BF16),
                                           (I32, F32), (F32, I32), (I32, I8), (U8, I16), (E4, F16)])
def test_dma_copy_load_and_store_with_casts(core, src_dt, dst_dt):
    x = rand((64, 96), src_dt, seed=1)
    sb = empty(core, (64, 96), dst_dt)
    core.execute(isa.dma_copy(dst=sb, src=hbm(core, "x", x)))
    same(sb.read(core), cast(x, dst_dt))
    y = torch.zeros(64, 96, dtype=src_dt)
    core.execute(isa.dma_copy(dst=hbm(core, "y", y), src=sb))
    same(y, cast(cast(x, dst_dt), src_dt))


def test_dma_copy_strided_and_reshaped(core):
    x = rand((256, 64), F32, seed=2)
    src = hbm(core, "x", x)[64:192, ::2]
    sb = empty(core, (128, 32), F32)
    core.execute(isa.dma_copy(dst=sb, src=src))
    same(sb.read(core), x[64:192, ::2])
    flat = empty(core, (16, 1024), BF16)  # element counts match, shapes differ: row-major order
    core.execute(isa.dma_copy(dst=flat, src=hbm(core, "x", x)))
    same(flat.read(core), x.reshape(16, 1024).to(BF16))


def test_dma_copy_sbuf_to_sbuf_and_hbm_to_hbm(core):
    x = rand((32, 40), BF16, seed=3)
    a = put(core, x)
    b = core.sbuf.allocate(64, 80).tile(BF16, (40,))[32:64]  # partitions 32..63
    core.execute(isa.dma_copy(dst=b, src=a))
    same(b.read(core), x)
    y = torch.zeros(32, 40, dtype=F32)
    core.execute(isa.dma_copy(dst=hbm(core, "y", y), src=hbm(core, "x", x)))
    same(y, x.float())


def _gather_setup(core, rows=100, n=128, width=16, dtype=F32, seed=4):
    table = rand((rows, width), dtype, seed=seed)
    core.bind("table", table)
    src = AP("hbm:table", dtype, ((width, n), (1, width)))  # dim 0 indexed; row pitch = width
    idx = torch.randint(0, rows, (n, 1), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    return table, src, idx


@pytest.mark.parametrize("dtype", [F32, BF16, I32])
def test_dma_gather(core, dtype):
    table, src, idx = _gather_setup(core, dtype=dtype)
    dst = empty(core, (128, 16), dtype)
    instr = isa.dma_copy(dst=dst, src=src, src_index=put(core, idx))
    core.execute(instr)
    same(dst.read(core), table[idx[:, 0].long()])
    assert instr.dge_mode == "swdge" and instr.cost_inputs().op == "gather"


def test_dma_gather_out_of_bounds(core):
    table, src, idx = _gather_setup(core)
    idx[5] = 100
    idx[9] = -1
    dst = put(core, torch.full((128, 16), 7.0))
    with pytest.raises(IndexOutOfRange, match=r"dma_copy: src_index\[5\] = 100 is outside the 100 rows of hbm:table"):
        core.execute(isa.dma_copy(dst=dst, src=src, src_index=put(core, idx)))
    core.execute(isa.dma_copy(dst=dst, src=src, src_index=put(core, idx), oob_mode="skip"))
    want = table[idx[:, 0].long().clamp(0, 99)]
    want[5] = want[9] = 7.0  # skipped rows keep their old contents
    same(dst.read(core), want)


def test_dma_scatter(core):
    out = torch.zeros(200, 8)
    core.bind("out", out)
    dst = AP("hbm:out", F32, ((8, 128), (1, 8)))
    idx = torch.randperm(200, generator=torch.Generator().manual_seed(5))[:128].to(torch.int32).reshape(128, 1)
    x = rand((128, 8), F32, seed=6)
    core.execute(isa.dma_copy(dst=dst, src=put(core, x), dst_index=put(core, idx)))
    want = torch.zeros(200, 8)
    want[idx[:, 0].long()] = x
    same(out, want)
    idx[0] = 500
    with pytest.raises(SimulatorError, match="dst_index"):
        core.execute(isa.dma_copy(dst=dst, src=put(core, x), dst_index=put(core, idx)))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_dma_transpose(core, dtype):
    x = rand((32, 64), dtype, seed=7)
    dst = empty(core, (64, 32), dtype)
    core.execute(isa.dma_transpose(dst=dst, src=hbm(core, "x", x)))
    same(dst.read(core), x.T)
    y = rand((4, 5, 6), dtype, seed=8)
    dst3 = empty(core, (6, 5, 4), dtype)
    instr = isa.dma_transpose(dst=dst3, src=put(core, y))
    core.execute(instr)
    same(dst3.read(core), y.permute(2, 1, 0))
    assert instr.axes == (2, 1, 0) and instr.cost_inputs().opcode == "dma_transpose"


# ---- TensorE ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16, F16, E4, E5])
def test_nc_matmul(core, dtype):
    k, m, n = 128, 96, 512
    s, mv = rand((k, m), dtype, seed=9, low=-1, high=1), rand((k, n), dtype, seed=10, low=-1, high=1)
    dst = empty(core, (m, n), F32, "psum")
    instr = isa.nc_matmul(dst=dst, stationary=put(core, s), moving=put(core, mv))
    core.execute(instr)
    same(dst.read(core), s.float().T @ mv.float(), rtol=1e-5, atol=1e-5)
    ci = instr.cost_inputs()
    assert ci.matmul_kmn == (k, m, n) and ci.flops == 2 * k * m * n and ci.engine == Engine.TENSOR
    assert ci.in_memories == ("sbuf", "sbuf") and ci.out_memory == "psum" and ci.free_elems == n


def test_nc_matmul_multi_dim_operands(core):
    s, mv = rand((64, 4, 8), BF16, seed=11), rand((64, 2, 16), BF16, seed=12)
    dst = empty(core, (32, 2, 16), F32, "psum")
    core.execute(isa.nc_matmul(dst=dst, stationary=put(core, s), moving=put(core, mv)))
    same(dst.read(core), (s.reshape(64, 32).float().T @ mv.reshape(64, 32).float()).reshape(32, 2, 16),
         rtol=1e-5, atol=1e-5)


def below_inplace_or_view(inside: bool):
    """As inside a device op's kernel (in-place ops then bump no tensor version counter), or not."""
    return torch._C._AutoDispatchBelowADInplaceOrView() if inside else contextlib.nullcontext()


@pytest.mark.parametrize("in_op_kernel", [False, True], ids=["python", "in-op-kernel"])
def test_nc_matmul_accumulation_modes(core, in_op_kernel):
    with below_inplace_or_view(in_op_kernel):
        _accumulation_modes(core)


def _accumulation_modes(core):
    k, m, n = 64, 32, 128
    ops = [(put(core, rand((k, m), BF16, seed=20 + i)), put(core, rand((k, n), BF16, seed=30 + i))) for i in range(5)]
    prods = [s.read(core).float().T @ mv.read(core).float() for s, mv in ops]
    dst = empty(core, (m, n), F32, "psum")
    dst.write(core, torch.full((m, n), 1e6))  # stale data: accumulate=None must overwrite it first

    def mm(i, acc):
        core.execute(isa.nc_matmul(dst=dst, stationary=ops[i][0], moving=ops[i][1], accumulate=acc))

    core.begin_run()
    mm(0, None)
    mm(1, None)
    same(dst.read(core), prods[0] + prods[1], rtol=1e-6, atol=1e-5)
    mm(2, False)
    same(dst.read(core), prods[2], rtol=1e-6, atol=1e-5)
    mm(3, True)
    same(dst.read(core), prods[2] + prods[3], rtol=1e-6, atol=1e-5)
    core.execute(isa.memset(dst=dst, value=0.0))  # a non-TensorE write closes the group
    mm(4, None)
    same(dst.read(core), prods[4], rtol=1e-6, atol=1e-5)
    core.begin_run()  # a new run: nothing is open
    mm(0, None)
    same(dst.read(core), prods[0], rtol=1e-6, atol=1e-5)
    fresh = empty(core, (m, n), F32, "psum")  # a new allocation starts closed too
    core.execute(isa.nc_matmul(dst=fresh, stationary=ops[1][0], moving=ops[1][1]))
    same(fresh.read(core), prods[1], rtol=1e-6, atol=1e-5)


def _matmul_operand(shape, dtype, seed: int) -> torch.Tensor:
    """Values over many binades with -0.0, infinities and NaNs of distinct payloads (fp16: also +-65504)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
    pick = torch.rand(shape, generator=g)
    nan = torch.randint(0x7FC00001, 0x7FFFFFFF, shape, generator=g, dtype=torch.int32).view(F32)
    x = torch.where(pick < 0.03, -0.0, torch.where(pick > 0.995, float("inf"), torch.where(pick > 0.99, nan, x)))
    if dtype == F16:
        x = torch.where((pick > 0.5) & (pick < 0.51), 65504.0, torch.where((pick > 0.51) & (pick < 0.52), -65504.0, x))
    return x.to(dtype)


# shapes around the layouts where torch.mm into the strided PSUM view and into a dense buffer differ (with MKL:
# M <= 3 or N <= 11), and the demo's
MATMUL_STEP_SHAPES = [(1, 1, 1), (2, 3, 64), (16, 2, 16), (64, 4, 8), (64, 4, 12), (128, 1, 128), (128, 128, 8),
                      (3, 128, 11), (64, 64, 16), (16, 64, 64), (128, 128, 64), (64, 128, 256), (128, 65, 512)]


@pytest.mark.parametrize("kmn,dtype", [(kmn, F32) for kmn in MATMUL_STEP_SHAPES]
                         + [(kmn, dt) for kmn in ((2, 3, 64), (64, 4, 12), (128, 128, 64)) for dt in (BF16, F16, E4)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v).removeprefix("torch."))
def test_nc_matmul_steps_are_bit_identical_to_execute(kmn, dtype):
    # a step may write an overwrite straight into PSUM (tensor_engine.mm_into_agrees): every accumulate mode's
    # result must keep execute's bits (NaN payloads included) and leave the same group flags
    k, m, n = kmn
    cores = [NeuronCore("trn2", nan_fill=False, seed=0) for _ in range(2)]

    def at(c, memory: str, x: torch.Tensor, offset: int) -> AP:  # tiles at odd 4-byte offsets: BLAS alignment varies
        ap = tile(memory, x.dtype, tuple(x.shape), offset=offset * x.dtype.itemsize)
        ap.write(c, x)
        return ap
    ops = [[(at(c, "sbuf", _matmul_operand((k, m), dtype, 3 * i), 1000 * i + 4 * i + 1),
             at(c, "sbuf", _matmul_operand((k, n), dtype, 3 * i + 1), 1000 * i + 500 + 8 * i + 3)) for i in range(4)]
           for c in cores]
    dsts = [at(c, "psum", _matmul_operand((m, n), F32, 99), 0 if n == 512 else 2) for c in cores]
    plan = [False, True, None, False]  # overwrite, accumulate, add into the open group, overwrite again
    instrs = [isa.nc_matmul(dst=dsts[0], stationary=s, moving=mv, accumulate=acc) for (s, mv), acc in zip(ops[0], plan)]
    fast, slow = cores
    steps = [instr.step(fast, {}) for instr in instrs]
    assert all(step is not None for step in steps)
    for c in cores:
        c.begin_run()
    for i, (instr, step) in enumerate(zip(instrs, steps)):
        step([])
        slow.execute(instr)
        assert torch.equal(dsts[0].view(fast).view(torch.int32), dsts[1].view(slow).view(torch.int32)), plan[i]
        assert torch.equal(fast.psum.group_closed, slow.psum.group_closed)
    # the last product, overwritten: within fp32 accumulation's bound of a float64 reference where that is finite
    a, b = ops[1][3][0].read(slow).double(), ops[1][3][1].read(slow).double()
    want, got = a.T @ b, dsts[1].read(slow).double()
    finite = want.isfinite()
    bound = k * 2.0 ** -24 * (a.abs().T @ b.abs())
    assert ((got - want).abs() <= bound)[finite].all()
    assert torch.equal(got[~finite].isnan(), want[~finite].isnan())
    assert torch.equal(got[~finite].nan_to_num(0.0), want[~finite].nan_to_num(0.0))


def test_mm_into_agrees_is_kept_per_layout_and_touches_nothing(core):
    s, mv, dst = put(core, rand((64, 32), F32, seed=1)), put(core, rand((64, 48), F32, seed=2)), empty(core, (32, 48), F32, "psum")
    a, b, out = s.view(core).T, mv.view(core), dst.view(core)
    before = [t.clone() for t in (a, b, out)]
    first = tensor_engine.mm_into_agrees(a, b, out)
    assert all(torch.equal(t, u) or (t.isnan() == u.isnan()).all() for t, u in zip((a, b, out), before))
    assert tensor_engine.mm_into_agrees(a, b, out) is first
    assert tensor_engine._layout(a, b, out) in tensor_engine._MM_INTO
    if first:  # the contract, on fresh data: the one call gives the dense call's bits
        for seed in range(5):
            a.copy_(_matmul_operand((32, 64), F32, seed)), b.copy_(_matmul_operand((64, 48), F32, seed + 50))
            dense = torch.mm(a, b)
            torch.mm(a, b, out=out)
            assert torch.equal(out.view(torch.int32), dense.view(torch.int32))


@pytest.mark.parametrize("out_dt", [BF16, F32])
def test_nc_matmul_transpose_mode_is_bit_exact(core, out_dt):
    s = rand((64, 32), BF16, seed=13)
    s[3, 7], s[10, 0], s[63, 31] = float("nan"), float("inf"), -float("inf")
    eye = put(core, torch.eye(64, dtype=BF16))
    dst = empty(core, (32, 64), out_dt, "psum")
    core.execute(isa.nc_matmul(dst=dst, stationary=put(core, s), moving=eye, is_transpose=True))
    same(dst.read(core), s.T.to(out_dt))


@pytest.mark.parametrize("dtype", [BF16, F32, I32, E4])
def test_nc_transpose_tensor_engine(core, dtype):
    x = rand((128, 96), dtype, seed=14)
    dst = empty(core, (96, 128), dtype, "psum")
    instr = isa.nc_transpose(dst=dst, data=put(core, x))
    core.execute(instr)
    same(dst.read(core), x.T)
    assert instr.cost_inputs().matmul_kmn == (128, 96, 128)


@pytest.mark.parametrize("src_mem,dst_mem", [("sbuf", "sbuf"), ("psum", "sbuf"), ("sbuf", "psum")])
def test_nc_transpose_vector_engine(core, src_mem, dst_mem):
    x = rand((32, 20), I32, seed=15)
    dst = empty(core, (20, 32), I32, dst_mem)
    instr = isa.nc_transpose(dst=dst, data=put(core, x, src_mem), engine="vector")
    core.execute(instr)
    same(dst.read(core), x.T)
    assert instr.engine == Engine.VECTOR


# ---- copies and elementwise -------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["vector", "scalar", "gpsimd"])
@pytest.mark.parametrize("src_dt,dst_dt", [(F32, BF16), (BF16, F32), (F32, E4), (E5, F16), (I32, I32), (I32, F32),
                                           (F32, I8), (I16, I32), (U8, BF16), (torch.bool, F32)])
def test_tensor_copy(core, engine, src_dt, dst_dt):
    x = rand((16, 3, 24), src_dt, seed=16)
    dst = empty(core, (16, 72), dst_dt)
    core.execute(isa.tensor_copy(dst=dst, src=put(core, x), engine=engine))
    same(dst.read(core), cast(x, dst_dt).reshape(16, 72))


def test_tensor_copy_evicts_psum(core):
    x = rand((128, 512), F32, seed=17)
    dst = empty(core, (128, 512), BF16)
    core.execute(isa.tensor_copy(dst=dst, src=put(core, x, "psum")))
    same(dst.read(core), x.to(BF16))


FLOAT_OPS = {
    "add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "divide": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum, "power": lambda a, b: torch.pow(a.abs(), b),
    "equal": lambda a, b: (a == b).float(), "not_equal": lambda a, b: (a != b).float(),
    "greater": lambda a, b: (a > b).float(), "greater_equal": lambda a, b: (a >= b).float(),
    "less": lambda a, b: (a < b).float(), "less_equal": lambda a, b: (a <= b).float(),
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).float(), "logical_or": lambda a, b: ((a != 0) | (b != 0)).float(),
    "logical_xor": lambda a, b: ((a != 0) ^ (b != 0)).float(),
}


@pytest.mark.parametrize("op,dtype", [(op, dt) for op in sorted(FLOAT_OPS) for dt in (F32, BF16, F16, E4)
                                      if dt != E4 or op in ("add", "multiply", "maximum", "greater")])
def test_tensor_tensor_float(core, op, dtype):
    a, b = rand((32, 64), dtype, seed=18), rand((32, 64), dtype, seed=19)
    b[:, ::5] = a[:, ::5]
    if op == "power":
        a = a.float().abs().to(dtype)
    dst = empty(core, (32, 64), dtype)
    instr = isa.tensor_tensor(dst=dst, data1=put(core, a), data2=put(core, b), op=op)
    core.execute(instr)
    same(dst.read(core), FLOAT_OPS[op](a.float(), b.float()).to(dtype))
    assert instr.cost_inputs().op == op


def test_tensor_tensor_mixed_dtypes_psum_operand_and_gpsimd(core):
    a, b = rand((16, 128), BF16, seed=20), rand((16, 128), F32, seed=21)
    dst = empty(core, (16, 128), F16)
    core.execute(isa.tensor_tensor(dst=dst, data1=put(core, a), data2=put(core, b, "psum"), op="subtract"))
    same(dst.read(core), (a.float() - b).to(F16))
    dst2 = empty(core, (16, 128), F32)
    core.execute(isa.tensor_tensor(dst=dst2, data1=put(core, a), data2=put(core, b), op="multiply", engine="gpsimd"))
    same(dst2.read(core), a.float() * b)


@pytest.mark.parametrize("dtype,wide", [(BF16, F32), (F16, F32), (BF16, F16)])
@pytest.mark.parametrize("op", ["add", "multiply", "divide"])
def test_tensor_tensor_rounds_once_into_a_wider_dst(core, op, dtype, wide):
    """Two narrow operands into a wider dst: computed in fp32 and rounded once, to dst's dtype. (torch's
    ``mul(bf16, bf16, out=fp32)`` rounds the product to bf16 first: a bf16 x bf16 product stored as fp32 lost
    its low half, and bf16 into fp16 was rounded twice.)"""
    a, b = rand((32, 64), dtype, seed=24), rand((32, 64), dtype, seed=25)
    dst = empty(core, (32, 64), wide)
    core.execute(isa.tensor_tensor(dst=dst, data1=put(core, a), data2=put(core, b), op=op))
    want = FLOAT_OPS[op](a.float(), b.float()).to(wide)
    same(dst.read(core), want)
    assert not torch.equal(want, FLOAT_OPS[op](a, b).to(wide))     # the double rounding would be caught


INT_OPS = {
    "add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "maximum": torch.maximum,
    "minimum": torch.minimum, "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor, "left_shift": lambda a, b: a << (b & 7), "right_shift": lambda a, b: a >> (b & 7),
    "equal": lambda a, b: (a == b).long(), "greater": lambda a, b: (a > b).long(),
}


@pytest.mark.parametrize("dtype", [I32, I8, I16, U8])
@pytest.mark.parametrize("op", sorted(INT_OPS) + ["divide"])
def test_tensor_tensor_int_exact(core, op, dtype):
    a, b = rand((8, 40), dtype, seed=22), rand((8, 40), dtype, seed=23)
    if op in ("left_shift", "right_shift"):
        b = (b.to(torch.int64) & 7).to(dtype)
    if op == "divide":
        b = torch.where(b == 0, torch.ones_like(b), b)
    if dtype == I32:
        a[0, :4] = torch.tensor([2 ** 30 + 1, -(2 ** 30) - 7, 16777217, 2 ** 31 - 1], dtype=I32)
    dst = empty(core, (8, 40), dtype)
    core.execute(isa.tensor_tensor(dst=dst, data1=put(core, a), data2=put(core, b), op=op))
    if op == "divide":
        want = (a.to(torch.float64) / b.to(torch.float64)).to(dtype)
    else:
        want = INT_OPS[op](a.to(torch.int64), b.to(torch.int64)).to(dtype)
    same(dst.read(core), want)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_tensor_scalar_two_ops_tile_and_scalar_operands(core, dtype):
    x = rand((64, 100), dtype, seed=24)
    col = rand((64, 1), F32, seed=25)
    dst = empty(core, (64, 100), dtype)
    core.execute(isa.tensor_scalar(dst=dst, data=put(core, x), op0="multiply", operand0=0.3, op1="add",
                                   operand1=put(core, col)))
    s = float(torch.tensor(0.3, dtype=F32))
    same(dst.read(core), (x.float() * s + col).to(dtype))
    core.execute(isa.tensor_scalar(dst=dst, data=put(core, x), op0="subtract", operand0=put(core, col),
                                   reverse0=True, op1="divide", operand1=2.0, reverse1=True))
    same(dst.read(core), (2.0 / (col - x.float())).to(dtype))


@pytest.mark.parametrize("op", ["add", "subtract", "multiply"])  # (torch's maximum of -0.0 and 0.0 depends on the
def test_tensor_scalar_signed_zero_operands_keep_their_sign(core, op):  # element's position in its vector loop)
    # +0.0 and -0.0 compare (and hash) equal: a scalar cache keyed by value alone gave the second the first's sign,
    # and a -0.0 operand was read as "no operand" (0)
    x = torch.tensor([-0.0, 0.0, -1.5, 2.0, float("inf"), -float("inf")]).repeat(4, 1)
    data = put(core, x)
    for zero in (0.0, -0.0, 0.0):
        dst = empty(core, (4, 6), F32)
        instr = isa.tensor_scalar(dst=dst, data=data, op0=op, operand0=zero)
        want = {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul}[op](x, torch.tensor(zero))
        core.execute(instr)
        assert torch.equal(dst.read(core).view(torch.int32), want.view(torch.int32)), zero
        dst.write(core, 7.0)
        instr.step(core, {})([])
        assert torch.equal(dst.read(core).view(torch.int32), want.view(torch.int32)), zero


def test_tensor_scalar_engines_and_ops(core):
    x = rand((32, 48), F32, seed=26)
    dst = empty(core, (32, 48), F32)
    core.execute(isa.tensor_scalar(dst=dst, data=put(core, x), op0="multiply", operand0=2.0, op1="add",
                                   operand1=1.0, engine="scalar"))
    same(dst.read(core), x * 2 + 1)
    core.execute(isa.tensor_scalar(dst=dst, data=put(core, x), op0="abs", operand0=None, engine="gpsimd"))
    same(dst.read(core), x.abs())
    core.execute(isa.tensor_scalar(dst=dst, data=put(core, x), op0="max", operand0=0.0, op1="pow", operand1=2.0))
    same(dst.read(core), x.clamp(min=0) ** 2)
    core.execute(isa.tensor_scalar(dst=dst, data=put(core, x), op0="greater", operand0=0.5))
    same(dst.read(core), (x > 0.5).float())


def test_tensor_scalar_ints(core):
    x = rand((16, 32), I32, seed=27)
    dst = empty(core, (16, 32), I32)
    core.execute(isa.tensor_scalar(dst=dst, data=put(core, x), op0="bitwise_and", operand0=0xFF,
                                   op1="right_shift", operand1=2))
    same(dst.read(core), (x & 0xFF) >> 2)
    core.execute(isa.tensor_scalar(dst=dst, data=put(core, x), op0="multiply", operand0=0.5))
    same(dst.read(core), (x.to(torch.float64) * 0.5).to(I32))
    big = torch.full((16, 32), 2 ** 30 + 3, dtype=I32)
    core.execute(isa.tensor_scalar(dst=dst, data=put(core, big), op0="add", operand0=2))
    same(dst.read(core), big + 2)  # exact, no fp32 detour


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_scalar_tensor_tensor(core, dtype):
    x, y = rand((32, 64), dtype, seed=28), rand((32, 64), dtype, seed=29)
    mean = rand((32, 1), F32, seed=30)
    dst = empty(core, (32, 64), dtype)
    core.execute(isa.scalar_tensor_tensor(dst=dst, data=put(core, x), op0="subtract", operand0=put(core, mean),
                                          op1="multiply", operand1=put(core, y)))
    same(dst.read(core), ((x.float() - mean) * y.float()).to(dtype))
    core.execute(isa.scalar_tensor_tensor(dst=dst, data=put(core, x), op0="multiply", operand0=3.0,
                                          op1="subtract", operand1=put(core, y, "psum"), reverse1=True))
    same(dst.read(core), (y.float() - x.float() * 3.0).to(dtype))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_reciprocal(core, dtype):
    x = rand((16, 64), dtype, seed=31)
    dst = empty(core, (16, 64), dtype)
    core.execute(isa.reciprocal(dst=dst, data=put(core, x)))
    same(dst.read(core), torch.reciprocal(x.float()).to(dtype))


# ---- ScalarE activation --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("fn", sorted(ACT_REF))
def test_activation_functions(core, fn, dtype):
    x = rand((32, 64), dtype, seed=32)
    if fn in ("log", "sqrt", "rsqrt"):
        x = (x.float().abs() + 0.1).to(dtype)
    dst = empty(core, (32, 64), dtype)
    instr = isa.activation(dst=dst, op=fn, data=put(core, x))
    core.execute(instr)
    same(dst.read(core), ACT_REF[fn](x.float()).to(dtype), rtol=1e-5 if dtype == F32 else 1e-2, atol=1e-6)
    assert instr.cost_inputs().op == fn and instr.engine == Engine.SCALAR


def test_activation_scale_and_bias(core):
    x = rand((64, 128), BF16, seed=33)
    scale, bias = rand((64, 1), F32, seed=34), rand((64, 1), F32, seed=35)
    dst = empty(core, (64, 128), F32)
    core.execute(isa.activation(dst=dst, op="exp", data=put(core, x), scale=put(core, scale), bias=-1.5))
    same(dst.read(core), torch.exp(x.float() * scale - 1.5))
    core.execute(isa.activation(dst=dst, op="tanh", data=put(core, x, "psum"), scale=0.5, bias=put(core, bias)))
    same(dst.read(core), torch.tanh(x.float() * 0.5 + bias))


def test_activation_reduce_registers(core):
    xs = [rand((32, 64), F32, seed=36 + i) for i in range(2)]
    dst = empty(core, (32, 64), BF16)
    res = empty(core, (32, 1), F32)
    first = isa.activation(dst=dst, op="exp", data=put(core, xs[0]), reduce_op="add", reduce_res=res,
                           reduce_cmd="reset_reduce")
    core.execute(first)
    s0 = torch.exp(xs[0]).sum(1, keepdim=True)
    same(res.read(core), s0, rtol=1e-6, atol=1e-5)
    assert first.cost_inputs().opcode == "activation_reduce"
    assert first.writes() == (dst.footprint(), res.footprint())
    core.execute(isa.activation(dst=dst, op="exp", data=put(core, xs[1]), reduce_cmd="reduce"))
    core.execute(isa.activation(dst=dst, op="copy", data=put(core, xs[1]), reduce_res=res))  # idle: read out
    same(res.read(core), s0 + torch.exp(xs[1]).sum(1, keepdim=True), rtol=1e-6, atol=1e-4)
    core.execute(isa.activation(dst=dst, op="relu", data=put(core, xs[1]), reduce_op="maximum", reduce_res=res,
                                reduce_cmd="reset_reduce"))
    same(res.read(core), torch.relu(xs[1]).amax(1, keepdim=True))
    core.execute(isa.activation(dst=dst, op="copy", data=put(core, xs[1]), reduce_res=res, reduce_cmd="reset"))
    same(res.read(core), torch.zeros(32, 1))


# ---- reductions and scans -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("op,ref", [("add", lambda t, d: t.sum(d)), ("maximum", lambda t, d: t.amax(d)),
                                    ("minimum", lambda t, d: t.amin(d)),
                                    ("multiply", lambda t, d: t.flatten(d[0]).prod(d[0]))])
@pytest.mark.parametrize("axis", [(2,), (1, 2)])
def test_tensor_reduce_float(core, op, ref, dtype, axis):
    x = rand((64, 4, 8), dtype, seed=40, low=0.5, high=1.5)
    kept = 4 if axis == (2,) else 1
    dst = empty(core, (64, kept), dtype)
    core.execute(isa.tensor_reduce(dst=dst, op=op, data=put(core, x), axis=axis))
    same(dst.read(core), ref(x.float(), axis).to(dtype), rtol=1e-6, atol=1e-6)


def test_tensor_reduce_negate_ints_and_logical(core):
    x = rand((16, 32), F32, seed=41)
    dst = empty(core, (16, 1), F32)
    core.execute(isa.tensor_reduce(dst=dst, op="max", data=put(core, x), axis=1, negate=True))
    same(dst.read(core), -x.amax(1, keepdim=True))
    xi = rand((16, 32), I32, seed=42)
    di = empty(core, (16, 1), I32)
    refs = {"add": lambda t: t.sum(1), "maximum": lambda t: t.amax(1), "logical_and": lambda t: (t != 0).all(1).long(),
            "bitwise_or": lambda t: torch.tensor([functools.reduce(operator.or_, r.tolist()) for r in t])}
    for op, ref in refs.items():
        core.execute(isa.tensor_reduce(dst=di, op=op, data=put(core, xi), axis=(1,)))
        same(di.read(core), ref(xi.to(torch.int64)).to(I32).reshape(16, 1))


@pytest.mark.parametrize("op,ref", [("add", lambda t: t.sum(0)), ("maximum", lambda t: t.amax(0)),
                                    ("minimum", lambda t: t.amin(0))])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_tensor_partition_reduce(core, op, ref, dtype):
    x = rand((64, 32), dtype, seed=43)
    dst = empty(core, (1, 32), dtype)
    instr = isa.tensor_partition_reduce(dst=dst, op=op, data=put(core, x))
    core.execute(instr)
    same(dst.read(core), ref(x.float()).to(dtype).reshape(1, 32), rtol=1e-6, atol=1e-5)
    assert instr.engine == Engine.GPSIMD


def test_tensor_partition_reduce_bitwise(core):
    x = rand((16, 8), I32, seed=44)
    dst = empty(core, (1, 8), I32)
    core.execute(isa.tensor_partition_reduce(dst=dst, op="bitwise_and", data=put(core, x)))
    want = x[0].clone()
    for r in x[1:]:
        want &= r
    same(dst.read(core), want.reshape(1, 8))


def test_tensor_scalar_reduce(core):
    xs = [rand((32, 64), F32, seed=45 + i) for i in range(2)]
    dst = empty(core, (32, 64), F32)
    res = empty(core, (32, 1), F32)
    core.execute(isa.tensor_scalar_reduce(dst=dst, data=put(core, xs[0]), op0="multiply", operand0=2.0,
                                          reduce_op="add", reduce_res=res))
    same(dst.read(core), xs[0] * 2)
    same(res.read(core), (xs[0] * 2).sum(1, keepdim=True), rtol=1e-6, atol=1e-5)
    core.execute(isa.tensor_scalar_reduce(dst=dst, data=put(core, xs[1]), op0="multiply", operand0=2.0,
                                          reduce_op="add", reduce_res=res, reduce_cmd="reduce"))
    same(res.read(core), (xs[0] * 2).sum(1, keepdim=True) + (xs[1] * 2).sum(1, keepdim=True), rtol=1e-6, atol=1e-4)
    core.execute(isa.tensor_scalar_reduce(dst=dst, data=put(core, xs[1]), op0="multiply", operand0=1.0,
                                          reduce_op="maximum", reduce_res=res, reduce_cmd="load_reduce",
                                          reduce_init=100.0))
    same(res.read(core), torch.full((32, 1), 100.0))


def _scan_ref(a, b, init, op0, op1):
    r, out = init, []
    for i in range(a.shape[1]):
        r = op1(op0(a[:, i], r), b[:, i])
        out.append(r)
    return torch.stack(out, 1)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_tensor_tensor_scan_linear_recurrence(core, dtype):
    decay = rand((16, 300), dtype, seed=50, low=0.5, high=1.0)
    inp = rand((16, 300), dtype, seed=51)
    init = rand((16, 1), F32, seed=52)
    dst = empty(core, (16, 300), dtype)
    core.execute(isa.tensor_tensor_scan(dst=dst, data0=put(core, decay), data1=put(core, inp),
                                        initial=put(core, init), op0="multiply", op1="add"))
    want = _scan_ref(decay.float(), inp.float(), init[:, 0], torch.mul, torch.add).to(dtype)
    same(dst.read(core), want)


def test_tensor_tensor_scan_reversed_and_scalar_initial(core):
    a, b = rand((8, 20), F32, seed=53), rand((8, 20), F32, seed=54)
    dst = empty(core, (8, 20), F32)
    core.execute(isa.tensor_tensor_scan(dst=dst, data0=put(core, a), data1=put(core, b), initial=0.5,
                                        op0="subtract", op1="maximum", reverse0=True, reverse1=True))
    want = _scan_ref(a, b, torch.full((8,), 0.5), lambda x, r: r - x, lambda t, y: torch.maximum(y, t))
    same(dst.read(core), want)


# ---- generators and selection ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [I32, F32, BF16, U8])
def test_iota(core, dtype):
    dst = empty(core, (16, 4, 8), dtype)
    core.execute(isa.iota(dst=dst, pattern=[[8, 4], [1, 8]], offset=5, channel_multiplier=3))
    p = torch.arange(16).reshape(16, 1, 1)
    want = 5 + 3 * p + 8 * torch.arange(4).reshape(1, 4, 1) + torch.arange(8).reshape(1, 1, 8)
    same(dst.read(core), cast(want.to(I32), dtype))


@pytest.mark.parametrize("dtype,value", [(F32, 3.5), (BF16, 0.1), (I8, -7), (E4, 1.0), (I32, 2 ** 31 - 1)])
@pytest.mark.parametrize("engine,memory", [("vector", "sbuf"), ("vector", "psum"), ("gpsimd", "sbuf")])
def test_memset(core, dtype, value, engine, memory):
    dst = empty(core, (32, 16), dtype, memory)
    core.execute(isa.memset(dst=dst, value=value, engine=engine))
    same(dst.read(core), torch.full((32, 16), value, dtype=dtype))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_affine_select_causal_mask(core, dtype):
    x = rand((64, 64), dtype, seed=55)
    dst = empty(core, (64, 64), dtype)
    instr = isa.affine_select(dst=dst, pattern=[[-1, 64]], channel_multiplier=1, on_true_tile=put(core, x),
                              on_false_value=-9984.0, cmp_op="greater_equal")
    core.execute(instr)
    p, j = torch.arange(64).reshape(64, 1), torch.arange(64).reshape(1, 64)
    same(dst.read(core), torch.where(p >= j, x, torch.tensor(-9984.0).to(dtype)))
    core.execute(isa.affine_select(dst=dst, pattern=[[1, 64]], channel_multiplier=-1, on_true_tile=put(core, x),
                                   on_false_value=0.0, offset=0))  # keep the diagonal only
    same(dst.read(core), torch.where(p == j, x, torch.zeros((), dtype=dtype)))


# ---- statistics, top-8 ----------------------------------------------------------------------------

@pytest.mark.parametrize("chunks,width", [(2, 500), (1, 7), (3, 1)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_bn_stats_and_aggr(core, chunks, width, dtype):
    x = rand((128, chunks * width), dtype, seed=56) + 3
    xt = put(core, x)
    stats = empty(core, (128, 6 * chunks), F32)
    for c in range(chunks):
        core.execute(isa.bn_stats(dst=stats[:, 6 * c:6 * c + 6], data=xt[:, c * width:(c + 1) * width]))
    even = x.float()[:, 0:width:2]
    same(stats.read(core)[:, 0:3], torch.stack([torch.full((128,), float(even.shape[1])), even.mean(1),
                                                 even.var(1, unbiased=False) * even.shape[1]], 1), rtol=1e-5, atol=1e-4)
    mv = empty(core, (128, 2), F32)
    core.execute(isa.bn_aggr(dst=mv, data=stats))
    var, mean = torch.var_mean(x.float(), dim=1, unbiased=False)
    same(mv.read(core), torch.stack([mean, var], 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_max8_and_find_index8(core, dtype):
    x = torch.stack([torch.randperm(100, generator=torch.Generator().manual_seed(i)) for i in range(32)]).to(dtype)
    xt = put(core, x)
    top = empty(core, (32, 8), dtype)
    core.execute(isa.max8(dst=top, src=xt))
    values, indices = torch.topk(x.float(), 8, dim=1)
    same(top.read(core), values.to(dtype))
    idx = empty(core, (32, 8), torch.uint32)
    core.execute(isa.nc_find_index8(dst=idx, data=xt, vals=top))
    same(idx.read(core), indices.to(torch.uint32))


# ---- random numbers --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [I32, U8, torch.uint32, I16])
def test_rng_is_deterministic_per_seed(dtype):
    from torchneuron.sim import NeuronCore
    outs = []
    for _ in range(2):
        c = NeuronCore("trn2", seed=7)
        dst = empty(c, (64, 32), dtype)
        c.execute(isa.rng(dst=dst))
        outs.append(dst.read(c))
    same(outs[0], outs[1])
    assert len(torch.unique(outs[0])) > 20


def test_set_rng_seed(core):
    seed = put(core, torch.tensor([[1234]], dtype=I32))
    dst = empty(core, (8, 16), I32)
    core.execute(isa.set_rng_seed(src_seeds=seed))
    core.execute(isa.rng(dst=dst, engine="gpsimd"))
    first = dst.read(core)
    core.execute(isa.rng(dst=dst))
    assert not torch.equal(first, dst.read(core))
    core.execute(isa.set_rng_seed(src_seeds=seed))
    core.execute(isa.rng(dst=dst))
    same(dst.read(core), first)


def test_rand2_range(core):
    dst = empty(core, (64, 256), F32)
    core.execute(isa.rand2(dst=dst, min=-2.0, max=3.0))
    v = dst.read(core)
    assert v.min() >= -2.0 and v.max() <= 3.0 and abs(float(v.mean()) - 0.5) < 0.1


@pytest.mark.parametrize("dtype", [F32, BF16, I32])
def test_dropout(core, dtype):
    x = rand((128, 512), dtype, seed=60)
    x = torch.where(x == 0, torch.ones((), dtype=dtype), x)
    xt = put(core, x)
    dst = empty(core, (128, 512), dtype)
    core.execute(isa.dropout(dst=dst, data=xt, prob=0.0))
    same(dst.read(core), x)
    core.execute(isa.dropout(dst=dst, data=xt, prob=1.0))
    same(dst.read(core), torch.zeros_like(x))
    core.execute(isa.dropout(dst=dst, data=xt, prob=0.3))
    out = dst.read(core)
    kept = out != 0
    assert abs(1 - float(kept.float().mean()) - 0.3) < 0.02
    same(out[kept], x[kept])
    prob = put(core, torch.cat([torch.zeros(64, 1), torch.ones(64, 1)]))
    core.execute(isa.dropout(dst=dst, data=xt, prob=prob))
    same(dst.read(core)[:64], x[:64])
    same(dst.read(core)[64:], torch.zeros_like(x[64:]))


# ---- the timing contract ---------------------------------------------------------------------------

def test_every_opcode_builds_valid_cost_inputs(core):
    a = put(core, rand((32, 64), BF16, seed=70))
    b = put(core, rand((32, 64), BF16, seed=71))
    f = empty(core, (32, 64), F32)
    col = put(core, rand((32, 1), F32, seed=72))
    x = torch.zeros(32, 64, dtype=BF16)
    core.bind("x", x)
    h = tile("hbm:x", BF16, (32, 64))
    ps = empty(core, (32, 64), F32, "psum")
    built = [
        isa.dma_copy(dst=a, src=h, queue=3), isa.dma_transpose(dst=empty(core, (64, 32), BF16), src=h),
        isa.nc_matmul(dst=ps, stationary=empty(core, (32, 32), BF16), moving=a),
        isa.nc_transpose(dst=empty(core, (64, 32), BF16, "psum"), data=a), isa.tensor_copy(dst=f, src=a),
        isa.tensor_tensor(dst=f, data1=a, data2=b, op="add"), isa.tensor_scalar(dst=f, data=a, op0="add", operand0=1.0),
        isa.scalar_tensor_tensor(dst=f, data=a, op0="add", operand0=col, op1="multiply", operand1=b),
        isa.reciprocal(dst=f, data=a), isa.activation(dst=f, op="exp", data=a),
        isa.tensor_reduce(dst=empty(core, (32, 1), F32), op="add", data=a, axis=1),
        isa.tensor_partition_reduce(dst=empty(core, (1, 64), F32), op="add", data=a),
        isa.tensor_scalar_reduce(dst=f, data=a, op0="add", operand0=1.0, reduce_op="add", reduce_res=col),
        isa.tensor_tensor_scan(dst=f, data0=a, data1=b, initial=0.0, op0="multiply", op1="add"),
        isa.iota(dst=f, pattern=[[1, 64]]), isa.memset(dst=f, value=0.0),
        isa.affine_select(dst=f, pattern=[[1, 64]], channel_multiplier=1, on_true_tile=a, on_false_value=0.0),
        isa.bn_stats(dst=empty(core, (32, 6), F32), data=a), isa.bn_aggr(dst=empty(core, (32, 2), F32), data=f[:, :63]),
        isa.max8(dst=empty(core, (32, 8), F32), src=a),
        isa.nc_find_index8(dst=empty(core, (32, 8), torch.uint32), data=a, vals=empty(core, (32, 8), F32)),
        isa.rng(dst=empty(core, (32, 64), I32)), isa.set_rng_seed(src_seeds=empty(core, (1, 1), I32)),
        isa.rand2(dst=f, min=0.0, max=1.0), isa.dropout(dst=b, data=a, prob=0.5),
    ]
    # the tiled/double-row matmul, the run-time-offset DMA and the MX pair are built from kernels in
    # tests/nki/test_address_tiling_loops.py, whose profiles read the same cost inputs
    built_by_kernels = {"nc_matmul_tiled", "dma_copy_dynamic", "quantize_mx", "nc_matmul_mx"}
    # the selection, movement and accumulating instructions price themselves in test_isa_selection.py
    built_by_kernels |= {"tensor_copy_predicated", "select_reduce", "range_select", "sequence_bounds",
                         "nonzero_with_count", "nc_match_replace8", "nc_stream_shuffle", "nc_n_gather", "local_gather",
                         "tensor_scalar_cumulative", "exponential", "activate2", "dma_compute"}
    built_by_kernels |= {"device_print"}  # tests/nki/test_language_api.py
    built_by_kernels |= {"register_move", "register_load", "register_store", "loop_begin", "loop_end", "while_begin",
                         "while_end"}  # tests/nki/test_dynamic_loops.py, tests/sim/test_isa_selection.py
    built_by_kernels |= {"rand_get_state", "rand_set_state", "topk"}  # tests/nki/test_isa_api.py
    assert {i.opcode for i in built} == set(isa.OPCODES) - built_by_kernels
    for instr in built:
        ci = instr.cost_inputs()
        assert isinstance(ci, CostInputs) and ci.opcode.startswith(instr.opcode.split("_")[0])
        assert ci.engine == instr.engine and isinstance(instr.queue, int)
        assert 1 <= ci.partitions <= 128 and ci.free_elems >= 1
        assert all(isinstance(d, str) and not d.startswith("torch") for d in (*ci.in_dtypes, ci.out_dtype))
        assert all(m in ("sbuf", "psum", "hbm") for m in (*ci.in_memories, ci.out_memory))
        assert instr.reads() or instr.writes()
        core.execute(instr)  # and each one runs
    dma = built[0].cost_inputs()
    assert dma.dma_bytes == 32 * 64 * 2 and dma.dma_chunks == 32 and built[0].queue == 3
    strided = isa.dma_copy(dst=empty(core, (32, 32), BF16), src=h[:, ::2]).cost_inputs()
    assert strided.dma_chunks == 32 * 32 and not strided.contiguous


# ---- in-place and overlapping operands (the one-pass fast paths fall back when torch refuses) ------------

@pytest.mark.parametrize("dtype", [F32, BF16])
def test_elementwise_in_place_and_overlapping(core, dtype):
    x = rand((8, 64), dtype, seed=80)
    a = put(core, x)
    core.execute(isa.tensor_tensor(dst=a, data1=a, data2=a, op="add"))  # exactly in place
    same(a.read(core), (x.float() * 2).to(dtype))
    a.write(core, x)
    core.execute(isa.tensor_tensor(dst=a[:, 1:], data1=a[:, :63], data2=a[:, :63], op="multiply"))  # shifted
    same(a.read(core)[:, 1:], (x[:, :63].float() ** 2).to(dtype))
    a.write(core, x)
    core.execute(isa.tensor_scalar(dst=a[:, 2:], data=a[:, :62], op0="add", operand0=1.0, op1="multiply",
                                   operand1=2.0))
    same(a.read(core)[:, 2:], ((x[:, :62].float() + 1) * 2).to(dtype))
    a.write(core, x)
    core.execute(isa.activation(dst=a[:, 1:], op="exp", data=a[:, :63], scale=0.5, bias=1.0))
    same(a.read(core)[:, 1:], torch.exp(x[:, :63].float() * 0.5 + 1.0).to(dtype))
    a.write(core, x)
    core.execute(isa.activation(dst=a, op="tanh", data=a, bias=put(core, torch.ones(8, 1))))
    same(a.read(core), torch.tanh(x.float() + 1).to(dtype))


# ---- a destination that is also an input: every input is read as it was before the instruction ----------

def _aliased_cases():
    """(name, instruction on column tiles c, b and registers readout r, reference of (dst, r) from c, b)."""
    yield ("tensor_scalar operand1 is dst",
           lambda c, b, r: isa.tensor_scalar(dst=c, data=c, op0="add", operand0=1.5, op1="multiply", operand1=c),
           lambda c, b: ((c + 1.5) * c, None))
    yield ("tensor_scalar operand0 and operand1 are dst",
           lambda c, b, r: isa.tensor_scalar(dst=c, data=b, op0="subtract", operand0=c, op1="multiply", operand1=c),
           lambda c, b: ((b - c) * c, None))
    yield ("activation bias is dst after a scale",
           lambda c, b, r: isa.activation(dst=c, op="identity", data=b, scale=2.0, bias=c),
           lambda c, b: (b * 2.0 + c, None))
    yield ("tensor_scalar_reduce reduce_init is dst",
           lambda c, b, r: isa.tensor_scalar_reduce(dst=c, data=c, op0="multiply", operand0=3.0, reduce_op="add",
                                                    reduce_res=r, reduce_cmd="load_reduce", reduce_init=c),
           lambda c, b: (c * 3.0, c + c * 3.0))
    yield ("exponential reduce_init is dst",
           lambda c, b, r: isa.exponential(dst=c, src=c, reduce_res=r, reduce_cmd="load_reduce", reduce_init=c),
           lambda c, b: (torch.exp(c), c + torch.exp(c)))


# the instructions with a per-core step run both ways
_ALIASED = [(case, path) for case in _aliased_cases() for path in ("execute", "step")
            if path == "execute" or not case[0].startswith(("tensor_scalar_reduce", "exponential"))]


@pytest.mark.parametrize("case,path", _ALIASED, ids=lambda v: v if isinstance(v, str) else v[0])
def test_destination_aliasing_an_input_reads_the_input_before_the_write(core, case, path):
    _, build, reference = case
    c0 = torch.tensor([[1.0], [-2.5], [0.0], [-0.0], [3.0e38], [float("inf")], [float("nan")], [7.0]])
    b0 = rand((8, 1), F32, seed=81)
    c, b, r = put(core, c0), put(core, b0), empty(core, (8, 1), F32)
    instr = build(c, b, r)
    if path == "step":
        instr.step(core, {})([])
    else:
        core.execute(instr)
    want_dst, want_res = reference(c0, b0)
    same(c.read(core), want_dst)
    if want_res is not None:
        same(r.read(core), want_res)


def test_nc_match_replace8_leaves_data_and_overlapping_vals_unchanged(core):
    x = torch.arange(64, dtype=F32).reshape(4, 16) % 5  # repeated values: each of vals matches several
    data = put(core, x)
    out = empty(core, (4, 16), F32)
    core.execute(isa.nc_match_replace8(dst=out, data=data, vals=data[:, :8], imm=-1.0))  # vals inside data
    assert torch.equal(data.read(core), x)
    apart = empty(core, (4, 16), F32)
    core.execute(isa.nc_match_replace8(dst=apart, data=data, vals=put(core, x[:, :8].clone()), imm=-1.0))
    same(out.read(core), apart.read(core))
