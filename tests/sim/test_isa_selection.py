"""The selection, search, on-chip movement and accumulating instructions against NumPy/PyTorch references
(``tensor_copy_predicated``, ``select_reduce``, ``range_select``, ``sequence_bounds``, ``nonzero_with_count``,
``nc_match_replace8``, ``nc_stream_shuffle``, ``nc_n_gather``, ``local_gather``, ``tensor_scalar_cumulative``,
``exponential``, ``activate2``, ``dma_compute``), including the published examples, and their limits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torchneuron.sim import Engine, IndexOutOfRange, SimulatorError, isa
from torchneuron.sim.isa.selection import FP32_MIN
from torchneuron.sim.timing import instruction_cost_ns, stream_cycles
from torchneuron.sim.specs import chip_spec

from .conftest import empty, hbm, put, rand

F32, BF16, U8, U16, U32, I32 = torch.float32, torch.bfloat16, torch.uint8, torch.uint16, torch.uint32, torch.int32


def test_tensor_copy_predicated_tile_scalar_and_reverse(core):
    x, old = rand((64, 40), F32, seed=1), rand((64, 40), F32, seed=2)
    pred = (rand((64, 40), F32, seed=3) > 0).to(U8)
    dst = put(core, old.clone())
    core.execute(isa.tensor_copy_predicated(dst=dst, src=put(core, x), predicate=put(core, pred)))
    assert torch.equal(dst.read(core), torch.where(pred != 0, x, old))
    dst2 = put(core, old.clone())
    core.execute(isa.tensor_copy_predicated(dst=dst2, src=7.5, predicate=put(core, pred), reverse_pred=True))
    assert torch.equal(dst2.read(core), torch.where(pred == 0, torch.tensor(7.5), old))


def test_tensor_copy_predicated_limits(core):
    dst, x = empty(core, (8, 16), F32), put(core, rand((8, 16), F32))
    with pytest.raises(SimulatorError, match="predicate is float32; it must be uint8"):
        isa.tensor_copy_predicated(dst=dst, src=x, predicate=x)
    with pytest.raises(SimulatorError, match="must have dst's dtype"):
        isa.tensor_copy_predicated(dst=dst, src=put(core, rand((8, 16), BF16)), predicate=empty(core, (8, 16), U8))
    with pytest.raises(SimulatorError, match="both in psum"):
        isa.tensor_copy_predicated(dst=dst, src=empty(core, (8, 16), F32, "psum"),
                                   predicate=empty(core, (8, 16), U32, "psum"))


def test_select_reduce_matches_where_and_max_and_chains(core):
    on_true, on_false = rand((32, 50), F32, seed=4), rand((32, 1), F32, seed=5)
    pred = (rand((32, 50), F32, seed=6) > 0.5).to(torch.int8)
    dst, res = empty(core, (32, 50), F32), empty(core, (32, 1), F32)
    core.execute(isa.select_reduce(dst=dst, predicate=put(core, pred), on_true=put(core, on_true),
                                   on_false=put(core, on_false), reduce_res=res, reduce_cmd="reset_reduce"))
    want = torch.where(pred != 0, on_true, on_false)
    assert torch.equal(dst.read(core), want)
    assert torch.equal(res.read(core), want.amax(1, keepdims=True))
    # a second call with reduce keeps the running maximum; reverse_pred selects the other side
    more = rand((32, 50), F32, seed=7) + 5
    core.execute(isa.select_reduce(dst=dst, predicate=put(core, pred), on_true=put(core, more), on_false=FP32_MIN,
                                   reduce_res=res, reduce_cmd="reduce", reverse_pred=True))
    second = torch.where(pred == 0, more, torch.tensor(FP32_MIN))
    assert torch.equal(res.read(core), torch.maximum(want.amax(1), second.amax(1)).reshape(32, 1))
    with pytest.raises(SimulatorError, match="only maximum"):
        isa.select_reduce(dst=dst, predicate=put(core, pred), on_true=put(core, on_true), on_false=0.0,
                          reduce_op="add")
    with pytest.raises(SimulatorError, match="predicate is uint32"):
        isa.select_reduce(dst=dst, predicate=empty(core, (32, 50), U32), on_true=put(core, on_true), on_false=0.0)


@pytest.mark.parametrize("ops", [("greater_equal", "less"), ("greater", "less_equal"), ("equal", "less")])
def test_range_select_published_numpy_semantics(core, ops):
    x = rand((16, 64), F32, seed=8)
    b0 = torch.randint(0, 40, (16, 1)).float()
    b1 = b0 + torch.randint(0, 30, (16, 1)).float()
    dst, res = empty(core, (16, 64), F32), empty(core, (16, 1), F32)
    core.execute(isa.range_select(dst=dst, on_true_tile=put(core, x), comp_op0=ops[0], comp_op1=ops[1],
                                  bound0=put(core, b0), bound1=put(core, b1), reduce_res=res, range_start=3))
    idx = np.zeros((16, 64), np.float32) + (3 + np.arange(64))
    cmp = {"greater_equal": np.greater_equal, "less": np.less, "greater": np.greater, "less_equal": np.less_equal,
           "equal": np.equal}
    mask = cmp[ops[0]](idx, b0.numpy()) & cmp[ops[1]](idx, b1.numpy())
    want = np.where(mask, x.numpy(), np.float32(FP32_MIN))
    np.testing.assert_array_equal(dst.read(core).numpy(), want)
    np.testing.assert_array_equal(res.read(core).numpy(), want.max(1, keepdims=True))
    with pytest.raises(SimulatorError, match="FP32_MIN"):
        isa.range_select(dst=dst, on_true_tile=put(core, x), comp_op0="less", comp_op1="less",
                         bound0=put(core, b0), bound1=put(core, b1), on_false_value=0.0)


def _bounds_reference(seq: np.ndarray) -> np.ndarray:
    """The published NumPy semantics of sequence_bounds for one row (padding id 0: n and -1)."""
    n = len(seq)
    lo, hi = np.zeros(n), np.zeros(n)
    lo[0] = 0 if seq[0] != 0 else n
    for i in range(1, n):
        lo[i] = n if seq[i] == 0 else lo[i - 1] if seq[i] == seq[i - 1] else i
    hi[-1] = n if seq[-1] != 0 else -1
    for i in range(n - 2, -1, -1):
        hi[i] = -1 if seq[i] == 0 else hi[i + 1] if seq[i] == seq[i + 1] else i + 1
    return np.vstack([lo, hi])


@pytest.mark.parametrize("dtype", [F32, I32])
def test_sequence_bounds_published_example_and_random(core, dtype):
    ids = torch.tensor([[0, 1, 1, 2, 2, 2, 0, 3, 3]], dtype=dtype)
    dst = empty(core, (1, 2, 9), dtype)
    core.execute(isa.sequence_bounds(dst=dst, segment_ids=put(core, ids)))
    assert dst.read(core).tolist() == [[[9, 1, 1, 3, 3, 3, 9, 7, 7], [-1, 3, 3, 6, 6, 6, -1, 9, 9]]]
    ids = torch.sort(torch.randint(0, 32, (32,), generator=torch.Generator().manual_seed(0))).values.reshape(1, 32)
    dst = empty(core, (1, 2, 32), dtype)
    core.execute(isa.sequence_bounds(dst=dst, segment_ids=put(core, ids.to(dtype))))
    np.testing.assert_array_equal(dst.read(core).reshape(2, 32).numpy(), _bounds_reference(ids[0].numpy()))
    with pytest.raises(SimulatorError, match="spans 2 partitions"):
        isa.sequence_bounds(dst=empty(core, (2, 2, 9), F32), segment_ids=empty(core, (2, 9), F32))


def test_nonzero_with_count_published_example_on_gpsimd_rows_only(core):
    src = torch.zeros(32, 8)
    src[0] = torch.tensor([0, 1, 1, 0, 0, 1, 0, 0.0])
    src[16] = torch.tensor([2, 0, 0, 0, 0, 0, 0, 3.0])
    src[5] = 1.0  # not a GpSimd core's first partition: ignored
    dst = put(core, torch.full((32, 9), 77, dtype=I32))
    core.execute(isa.nonzero_with_count(dst=dst, src=put(core, src), index_offset=16, padding_val=-1))
    out = dst.read(core)
    assert out[0].tolist() == [17, 18, 21, -1, -1, -1, -1, -1, 3]
    assert out[16].tolist() == [16, 23, -1, -1, -1, -1, -1, -1, 2]
    assert bool((out[5] == 77).all()) and bool((out[1:16] == 77).all())
    with pytest.raises(SimulatorError, match="one more element"):
        isa.nonzero_with_count(dst=empty(core, (32, 8), I32), src=put(core, src))


def test_nc_match_replace8_published_duplicate_order(core):
    data = torch.tensor([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], dtype=F32)
    vals = torch.tensor([[3, 8, 8, 8, 8, 8, 8, 8]], dtype=F32)
    dst, idx = empty(core, (1, 11), F32), empty(core, (1, 8), U32)
    core.execute(isa.nc_match_replace8(dst=dst, data=put(core, data), vals=put(core, vals), imm=-1.0, dst_idx=idx))
    assert idx.read(core).tolist() == [[2, 10, 9, 8, 7, 6, 5, 4]]
    assert dst.read(core).tolist() == [[1, 2, -1, 4, -1, -1, -1, -1, -1, -1, -1]]


def test_nc_match_replace8_random_matches_first_occurrence(core):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 6, (64, 40), generator=g).float()
    vals = torch.randint(0, 6, (64, 8), generator=g).float()
    dst = empty(core, (64, 40), F32)
    core.execute(isa.nc_match_replace8(dst=dst, data=put(core, data), vals=put(core, vals), imm=99.0))
    want = data.numpy().copy()
    for p in range(64):
        for i in range(7, -1, -1):
            hits = np.nonzero(want[p] == vals[p, i].item())[0]
            if len(hits):
                want[p, hits[0]] = 99.0
    np.testing.assert_array_equal(dst.read(core).numpy(), want)


def test_nc_stream_shuffle_per_quadrant_keep_and_in_place(core):
    x = rand((64, 12), F32, seed=9)
    mask = list(range(31, -1, -1))
    mask[3] = 255
    old = rand((64, 12), F32, seed=10)
    dst = put(core, old.clone())
    core.execute(isa.nc_stream_shuffle(dst=dst, src=put(core, x), shuffle_mask=mask))
    want = old.clone()
    for r in range(64):
        if mask[r % 32] != 255:
            want[r] = x[(r // 32) * 32 + mask[r % 32]]
    assert torch.equal(dst.read(core), want)
    t = put(core, x.clone())  # in place: every input row is read before any is written
    core.execute(isa.nc_stream_shuffle(dst=t, src=t, shuffle_mask=[(i + 1) % 32 for i in range(32)]))
    assert torch.equal(t.read(core), torch.cat([torch.roll(x[:32], -1, 0), torch.roll(x[32:], -1, 0)]))
    with pytest.raises(SimulatorError, match="16 entries; it must have 32"):
        isa.nc_stream_shuffle(dst=dst, src=dst, shuffle_mask=[0] * 16)


def test_nc_n_gather_and_out_of_range(core):
    data = rand((16, 4, 32), F32, seed=11)
    idx = torch.randint(0, 128, (16, 50), generator=torch.Generator().manual_seed(2)).to(U32)
    dst = empty(core, (16, 50), F32)
    core.execute(isa.nc_n_gather(dst=dst, data=put(core, data), indices=put(core, idx)))
    assert torch.equal(dst.read(core), torch.gather(data.reshape(16, -1), 1, idx.long()))
    idx[3, 7] = 128
    with pytest.raises(IndexOutOfRange, match=r"indices\[3, 7\] = 128 is outside \[0, 128\)"):
        core.execute(isa.nc_n_gather(dst=dst, data=put(core, data), indices=put(core, idx)))
    with pytest.raises(SimulatorError, match="psum"):
        isa.nc_n_gather(dst=dst, data=empty(core, (16, 8), F32, "psum"), indices=put(core, idx))


def test_local_gather_published_numpy_semantics(core):
    rng = np.random.default_rng(0)
    src = (rng.random((128, 512, 4)) * 100).astype(np.float32)
    per_core = rng.integers(0, 512, (16, 4)).astype(np.uint16)
    index = np.tile(per_core, (8, 1))
    elems, valid = 4, 64
    dst = empty(core, (128, valid * elems), F32)
    core.execute(isa.local_gather(dst=dst, src_buffer=put(core, torch.from_numpy(src)),
                                  index=put(core, torch.from_numpy(index * elems)), num_elem_per_idx=elems,
                                  num_valid_indices=valid))
    want = np.empty((128, valid, elems), np.float32)
    for c in range(8):
        rows = slice(16 * c, 16 * (c + 1))
        want[rows] = np.take(src[rows], index[rows].flatten(order="F")[:valid], axis=1)
    np.testing.assert_array_equal(dst.read(core).numpy().reshape(128, valid, elems), want)
    with pytest.raises(SimulatorError, match="num_elem_per_idx is 3"):
        isa.local_gather(dst=dst, src_buffer=put(core, torch.from_numpy(src)),
                         index=put(core, torch.from_numpy(index)), num_elem_per_idx=3)


@pytest.mark.parametrize("op0,op1,cmd", [("multiply", "add", "reset_reduce"), ("add", "maximum", "reset_reduce"),
                                         ("subtract", "multiply", "load_reduce"), ("multiply", "subtract", "reset_reduce")])
def test_tensor_scalar_cumulative_follows_the_published_loop(core, op0, op1, cmd):
    x = rand((8, 30), F32, seed=12, low=0.5, high=1.5)
    imm0 = rand((8, 1), F32, seed=13, low=0.5, high=1.5)
    dst = empty(core, (8, 30), F32)
    imm1 = 2.0 if cmd == "load_reduce" else None
    core.execute(isa.tensor_scalar_cumulative(dst=dst, src=put(core, x), op0=op0, op1=op1, imm0=put(core, imm0),
                                              imm1=imm1, reduce_cmd=cmd))
    fn = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum}
    reset = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -np.inf}[op1]
    reg = np.full(8, 2.0 if cmd == "load_reduce" else reset, np.float32)
    want = np.empty((8, 30), np.float32)
    for i in range(30):  # reg = op1(op0(in[i], imm0), reg), fp32 at every step
        reg = fn[op1](fn[op0](x[:, i].numpy(), imm0[:, 0].numpy()), reg).astype(np.float32)
        want[:, i] = reg
    np.testing.assert_array_equal(dst.read(core).numpy(), want)
    # the register carries on with reduce_cmd=reduce
    core.execute(isa.tensor_scalar_cumulative(dst=dst, src=put(core, x), op0=op0, op1=op1, imm0=put(core, imm0),
                                              reduce_cmd="reduce"))
    reg2 = fn[op1](fn[op0](x[:, 0].numpy(), imm0[:, 0].numpy()), reg).astype(np.float32)
    np.testing.assert_array_equal(dst.read(core).numpy()[:, 0], reg2)


def test_tensor_scalar_cumulative_limits(core):
    x = put(core, rand((8, 4), I32))
    with pytest.raises(SimulatorError, match="int32/uint32 are not supported"):
        isa.tensor_scalar_cumulative(dst=x, src=x, op0="add", op1="add", imm0=1.0)
    y = put(core, rand((8, 4), F32))
    with pytest.raises(SimulatorError, match="cumulative operator"):
        isa.tensor_scalar_cumulative(dst=y, src=y, op0="add", op1="divide", imm0=1.0)


def test_exponential_and_running_sum(core):
    x, m = rand((32, 64), F32, seed=14), rand((32, 1), F32, seed=15)
    dst, res = empty(core, (32, 64), BF16), empty(core, (32, 1), F32)
    core.execute(isa.exponential(dst=dst, src=put(core, x), max_value=put(core, m), reduce_res=res,
                                 reduce_cmd="reset_reduce"))
    e = torch.exp(x - m)
    assert torch.equal(dst.read(core), e.to(BF16))
    torch.testing.assert_close(res.read(core), e.sum(1, keepdim=True), rtol=64 * 2**-24, atol=0)
    core.execute(isa.exponential(dst=dst, src=put(core, x), max_value=put(core, m), reduce_res=res,
                                 reduce_cmd="load_reduce", reduce_init=1.5))
    torch.testing.assert_close(res.read(core), e.sum(1, keepdim=True) + 1.5, rtol=64 * 2**-24, atol=0)


@pytest.mark.parametrize("fn", ["gelu", "exp", "prelu"])
def test_activate2_scale_bias_function_and_reduce(core, fn):
    x = rand((16, 48), F32, seed=16)
    dst, res = empty(core, (16, 48), F32), empty(core, (16, 1), F32)
    core.execute(isa.activate2(dst=dst, op=fn, data=put(core, x), imm0=2.0, imm1=0.5, op0="multiply", op1="add",
                               relu_param=0.1, reduce_op="maximum", reduce_res=res, reduce_cmd="reset_reduce"))
    v = x * 2.0 + 0.5
    want = {"gelu": torch.nn.functional.gelu(v), "exp": torch.exp(v), "prelu": torch.where(v > 0, v, 0.1 * v)}[fn]
    assert torch.equal(dst.read(core), want)
    assert torch.equal(res.read(core), want.amax(1, keepdim=True))
    core.execute(isa.activate2(dst=dst, op="identity", data=put(core, x), imm0=put(core, x[:, :1].contiguous()),
                               imm1=0.0, op0="subtract", op1="bypass", reverse0=True))
    assert torch.equal(dst.read(core), x[:, :1] - x)
    with pytest.raises(SimulatorError, match="supported pairs"):
        isa.activate2(dst=dst, op="exp", data=put(core, x), imm0=1.0, imm1=1.0, op0="add", op1="add")


def test_dma_compute_sums_sources_in_fp32(core):
    a, b, c = (rand((64, 32), F32, seed=s) for s in (17, 18, 19))
    dst = torch.zeros(64, 32, dtype=BF16)
    core.execute(isa.dma_compute(dst=hbm(core, "out", dst), srcs=(put(core, a), hbm(core, "b", b), put(core, c))))
    assert torch.equal(dst, ((a + b) + c).to(BF16))
    with pytest.raises(SimulatorError, match="only add"):
        isa.dma_compute(dst=put(core, a), srcs=(put(core, b),), reduce_op="maximum")
    with pytest.raises(SimulatorError, match="1.0 per source"):
        isa.dma_compute(dst=put(core, a), srcs=(put(core, b),), scales=(2.0,))
    with pytest.raises(SimulatorError, match="PSUM"):
        isa.dma_compute(dst=put(core, a), srcs=(empty(core, (64, 32), F32, "psum"),))


def test_new_instructions_are_priced_by_their_rules(core):
    spec = chip_spec("trn2")
    n = 2048
    x, p = empty(core, (128, n), F32), empty(core, (128, n), U8)
    sel = isa.select_reduce(dst=x, predicate=p, on_true=x, on_false=0.0).cost_inputs()
    assert stream_cycles(sel, spec) == n  # LISA's select rule
    seq = isa.sequence_bounds(dst=empty(core, (1, 2, n), F32), segment_ids=empty(core, (1, n), F32)).cost_inputs()
    assert stream_cycles(seq, spec) == spec.gpsimd.start_overhead_cycles + 2 * n
    act2 = isa.activate2(dst=x, op="exp", data=x, imm0=1.0, imm1=0.0, op0="multiply", op1="add").cost_inputs()
    assert act2.engine is Engine.SCALAR and stream_cycles(act2, spec) == n
    gather = isa.nc_n_gather(dst=x, data=x, indices=empty(core, (128, n), U32)).cost_inputs()
    assert stream_cycles(gather, spec) == spec.gpsimd.start_overhead_cycles + n  # the generic GpSimd rule
    dc = isa.dma_compute(dst=x, srcs=(x, x)).cost_inputs()
    assert dc.dma_bytes == 3 * 128 * n * 4 and instruction_cost_ns(dc, spec) > 0


def test_registers_and_branches_cost_one_minimum_interval_and_order_by_register(core):
    from torchneuron.sim.isa.control import Branch, branches, reg_footprint
    from torchneuron.sim.timing import instruction_cycles, schedule
    spec = chip_spec("trn2")
    tile_int = empty(core, (1, 1), I32)
    load = isa.register_load(dst=3, src=tile_int)
    assert instruction_cycles(load.cost_inputs(), spec) == spec.vector.min_ii_cycles
    assert reg_footprint(3) in load.writes() and tile_int.footprint() in load.reads()
    end = isa.loop_end(counter=3, limit=4, stride=1, begin=0, engines=("tensor", "vector"))
    expanded = branches(end)
    assert [b.engine for b in expanded] == [Engine.TENSOR, Engine.VECTOR]
    tl = schedule([load, *expanded], spec)
    # both branches read register 3: they wait for the load, then pay their engine's dependent overhead
    assert min(tl.start_ns[1:]) >= tl.end_ns[0]
    assert instruction_cycles(Branch(engine=Engine.TENSOR).cost_inputs(), spec) == spec.vector.min_ii_cycles
    with pytest.raises(SimulatorError, match="registers hold integers"):
        isa.register_load(dst=0, src=empty(core, (1, 1), F32))
    with pytest.raises(SimulatorError, match="positive compile-time integer"):
        isa.loop_end(counter=0, limit=1, stride=0, begin=0)



def test_dma_compute_operands_can_be_replaced_by_name(core):
    a, b, c = (put(core, rand((8, 16), F32, seed=s)) for s in (20, 21, 22))
    instr = isa.dma_compute(dst=a, srcs=(b, c))
    assert [n for n, _ in instr.operands()] == ["dst", "srcs[0]", "srcs[1]"]
    moved = instr.replace_operands({"srcs[1]": a, "dst": b})
    assert moved.dst == b and moved.srcs == (b, a) and moved.reads() == (b.footprint(), a.footprint())


@pytest.mark.parametrize("n,k", [(42, 8), (48, 20), (8, 8)])
def test_topk_over_16_partition_snakes(core, n, k):
    cols = -(-n // 16)
    g = torch.Generator().manual_seed(n + k)
    src = torch.randperm(2 * 16 * cols, generator=g).float().reshape(32, cols).to(BF16)  # distinct values
    kc = -(-k // 16)
    val, idx = empty(core, (32, k), BF16), put(core, torch.full((32, k), 7, dtype=torch.int64).to(U32))
    core.execute(isa.topk(val_dst=val, idx_dst=idx, src=put(core, src), n=n))
    got_v, got_i = val.read(core).float(), idx.read(core).to(torch.int64)
    for grp in range(2):
        snake = src[16 * grp:16 * grp + 16].float().t().reshape(-1)[:n]   # position s = p + 16 c
        want = torch.topk(snake, k).values.flip(0)                      # ascending
        q = torch.arange(k)
        assert torch.equal(got_v[16 * grp + q % 16, q // 16], want)
        assert torch.equal(snake[got_i[16 * grp + q % 16, q // 16]], want)
    untouched = torch.ones(32, k, dtype=torch.bool)
    for grp in range(2):
        q = torch.arange(k)
        untouched[16 * grp + q % 16, q // 16] = False
    assert bool((got_i[untouched] == 7).all()) and kc <= k
    spec = chip_spec("trn2")
    assert stream_cycles(isa.topk(val_dst=val, idx_dst=idx, src=put(core, src), n=n).cost_inputs(), spec) == \
        max(spec.gpsimd.min_ii_cycles, 4 * n + k)  # ISA: 4n + K


def test_topk_limits(core):
    src = put(core, rand((32, 4), BF16))
    with pytest.raises(SimulatorError, match="multiple of 16"):
        isa.topk(val_dst=empty(core, (8, 8), BF16), idx_dst=empty(core, (8, 8), U32), src=put(core, rand((8, 4), BF16)),
                 n=32)
    with pytest.raises(SimulatorError, match="K <= n"):
        isa.topk(val_dst=empty(core, (32, 40), BF16), idx_dst=empty(core, (32, 40), U32), src=src, n=32)
    with pytest.raises(SimulatorError, match="needs 5"):
        isa.topk(val_dst=empty(core, (32, 8), BF16), idx_dst=empty(core, (32, 8), U32), src=src, n=80)
