"""Per-core steps (NeuronCore.run_bound): bit-identical to executing each instruction, the PSUM
group flags reset only where groups were opened, and programs prepared once per core."""
from __future__ import annotations

import gc

import pytest
import torch

from torchneuron.sim import AP, ArgSlot, Engine, IndexOutOfRange, NeuronCore, Program, SimulatorError, isa, tile
from torchneuron.sim.isa.common import int32_exact

from .test_isa import below_inplace_or_view

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32
P, F = 16, 24


def _sb(i: int, dtype=F32, free=(F,), parts: int = P, start: int = 0):
    """The i-th 512-byte column slot of SBUF as a tile."""
    return tile("sbuf", dtype, (parts, *free), start_partition=start, offset=512 * i)


def _ps(i: int, free=(F,), parts: int = P):
    return tile("psum", F32, (parts, *free), offset=2048 * i)


def mixed_program() -> Program:
    """Every instruction that has a step, in its fused and unfused variants, and some without."""
    x, y = tile("hbm:x", F32, (P, F)), tile("hbm:y", BF16, (P, F))
    col = _sb(9, F32, (1,))
    i = isa
    body = [
        i.dma_copy(dst=_sb(0), src=x, queue=0),                                   # whole buffer
        i.dma_copy(dst=_sb(1, BF16), src=y, queue=1),
        i.dma_copy(dst=_sb(2, F32, (F // 2,)), src=x[:, : F // 2]),               # strided HBM view
        i.dma_copy(dst=_sb(3, BF16), src=x),                                      # cast on the way
        i.dma_copy(dst=_sb(4, F32, (2, F // 2)), src=x),                          # reshape
        i.dma_copy(dst=col, src=tile("hbm:c", F32, (P, 1))),
        i.tensor_tensor(dst=_sb(5), data1=_sb(0), data2=_sb(1, BF16), op="add"),  # fused, mixed dtypes
        i.tensor_tensor(dst=_sb(6, BF16), data1=_sb(5), data2=_sb(0), op="multiply"),
        i.tensor_tensor(dst=_sb(7), data1=_sb(5), data2=_sb(0), op="maximum"),
        i.tensor_tensor(dst=_sb(7), data1=_sb(7), data2=_sb(0), op="greater"),    # not fused
        i.tensor_tensor(dst=_sb(0), data1=_sb(0), data2=_sb(5), op="subtract"),  # in place
        i.tensor_scalar(dst=_sb(8), data=_sb(0), op0="multiply", operand0=0.3),
        i.tensor_scalar(dst=_sb(8), data=_sb(8), op0="add", operand0=col, op1="multiply", operand1=1.7),
        i.tensor_scalar(dst=_sb(10), data=_sb(8), op0="subtract", operand0=col, reverse0=True),  # not fused
        i.tensor_scalar(dst=_sb(11, BF16), data=_sb(8), op0="multiply", operand0=2.5),            # not fused
        i.activation(dst=_sb(12), op="exp", data=_sb(8), scale=0.5, bias=col),
        i.activation(dst=_sb(13), op="tanh", data=_sb(12)),
        i.activation(dst=_sb(14), op="sigmoid", data=_sb(13), scale=col, reduce_op="add",
                     reduce_res=_sb(15, F32, (1,)), reduce_cmd="reset_reduce"),
        i.activation(dst=_sb(16, BF16), op="gelu", data=_sb(13)),                 # not fused
        i.tensor_reduce(dst=_sb(17, F32, (1,)), op="add", data=_sb(12), axis=1),
        i.tensor_reduce(dst=_sb(18, F32, (1,)), op="maximum", data=_sb(6, BF16), axis=1, negate=True),
        i.tensor_reduce(dst=_sb(19, F32, (2,)), op="add", data=_sb(4, F32, (2, F // 2)), axis=2),
        i.tensor_copy(dst=_sb(20, BF16), src=_sb(12)),
        i.tensor_copy(dst=_sb(21), src=_sb(20, BF16), engine="scalar"),
        i.tensor_copy(dst=_sb(22, F32, (F - 2,)), src=tile("sbuf", F32, (P, F - 2), offset=512 * 22 + 8)),
        i.memset(dst=_sb(23), value=0.0),
        i.memset(dst=_sb(24, I32), value=7),
        i.iota(dst=_sb(25, I32), pattern=[[1, F]]),
        i.iota(dst=_sb(77), pattern=[[-2, F // 4], [1, 4]], offset=5, channel_multiplier=3),
        # TensorE into PSUM: an accumulation group, closed by a VectorE write, then reopened
        i.nc_matmul(dst=_ps(0, (F,), P), stationary=_sb(26, BF16, (P,)), moving=_sb(1, BF16)),
        i.nc_matmul(dst=_ps(0, (F,), P), stationary=_sb(26, BF16, (P,)), moving=_sb(6, BF16)),
        i.tensor_copy(dst=_sb(27), src=_ps(0, (F,), P)),
        i.tensor_tensor(dst=_ps(0, (F,), P), data1=_sb(27), data2=_sb(5), op="add"),  # closes the group
        i.nc_matmul(dst=_ps(0, (F,), P), stationary=_sb(26, BF16, (P,)), moving=_sb(1, BF16)),
        i.nc_matmul(dst=_ps(1, (P,), P), stationary=_sb(28, F32, (P,)), moving=_sb(29, F32, (P,)),
                    accumulate=True),
        i.activation(dst=_sb(30), op="exp", data=_ps(0, (F,), P)),
        i.dma_copy(dst=tile("hbm:out", F32, (P, F)), src=_sb(30)),
        i.dma_copy(dst=tile("hbm:out2", BF16, (P, F)), src=_sb(12)),               # cast on the way out
        i.dma_copy(dst=tile("hbm:out3", F32, (P * F,)), src=_sb(13)),              # reshape on the way out
        i.dma_copy(dst=tile("hbm:out", F32, (P, F)), src=tile("hbm:x", F32, (P, F))),  # HBM to HBM
        i.dma_copy(dst=_sb(31, BF16), src=tile("hbm:out2", BF16, (P, F))),
        # transposes: TensorE opens a group the next matmul accumulates into; VectorE into SBUF and
        # into PSUM (closing a group there); one in place (no step)
        i.nc_transpose(dst=tile("psum", F32, (F, P), offset=2048 * 2), data=_sb(12)),
        i.nc_matmul(dst=tile("psum", F32, (F, P), offset=2048 * 2), stationary=_sb(12), moving=_sb(33, F32, (P,))),
        i.nc_transpose(dst=_sb(34, F32, (P,), parts=F), data=_sb(13), engine="vector"),
        i.nc_transpose(dst=_ps(1, (P,), P), data=_sb(35, F32, (P,)), engine="vector"),
        i.nc_transpose(dst=_sb(35, F32, (P,)), data=_sb(35, F32, (P,)), engine="vector"),
        i.nc_transpose(dst=tile("psum", BF16, (F, P), offset=2048 * 3), data=_sb(1, BF16)),
        # identity activations: a plain copy, scaled and biased, PSUM eviction, in place, with a reduction
        i.activation(dst=_sb(37), op="identity", data=_sb(12)),
        i.activation(dst=_sb(38), op="copy", data=_sb(13), scale=col, bias=0.25),
        i.activation(dst=_sb(39, F32, (P,)), op="identity", data=tile("psum", F32, (F, P), offset=2048 * 2)[:P, :]),
        i.activation(dst=_sb(37), op="identity", data=_sb(37), scale=1.5),
        i.activation(dst=_sb(40), op="identity", data=_sb(14), reduce_op="add", reduce_res=_sb(41, F32, (1,)),
                     reduce_cmd="reset_reduce"),
        i.activation(dst=_sb(42, BF16), op="identity", data=_sb(14)),
        # unfused ALU instructions: integer bit ops and comparisons (int64 compute), mixed shapes
        i.tensor_copy(dst=_sb(43, I32), src=_sb(12)),
        i.tensor_copy(dst=_sb(44, I32), src=_sb(13)),
        i.tensor_tensor(dst=_sb(45, I32), data1=_sb(43, I32), data2=_sb(44, I32), op="bitwise_xor"),
        i.tensor_tensor(dst=_sb(46, I32, (2, F // 2)), data1=_sb(45, I32, (2, F // 2)), data2=_sb(44, I32),
                        op="bitwise_and"),
        i.tensor_tensor(dst=_sb(47), data1=_sb(12), data2=_sb(13), op="greater_equal"),
        i.tensor_tensor(dst=_sb(48, BF16), data1=_sb(12), data2=_sb(13), op="divide"),
        i.tensor_scalar(dst=_sb(49, I32), data=_sb(47), op0="not_equal", operand0=0, op1="multiply", operand1=-1),
        i.tensor_scalar(dst=_sb(50, I32), data=_sb(45, I32), op0="bitwise_and", operand0=_sb(51, I32, (1,))),
        i.tensor_scalar(dst=_sb(52, I32), data=_sb(45, I32), op0="bitwise_xor", operand0=_sb(51, I32, (1,)),
                        reverse0=True),
        i.tensor_scalar(dst=_sb(53, I32, (2, F // 2)), data=_sb(44, I32, (2, F // 2)), op0="equal",
                        operand0=_sb(51, I32, (1,))),
        i.tensor_scalar(dst=_sb(54), data=_sb(12), op0="abs"),
        i.tensor_scalar(dst=_sb(55), data=_sb(12), op0="subtract", operand0=1.0, reverse0=True, op1="power",
                        operand1=-0.5),
        i.tensor_scalar(dst=_sb(56), data=_sb(12), op0="multiply", operand0=col, reverse0=True),
        # int32 bit ops and comparisons (computed in int32 by the steps), into int32, fp32 and int8
        i.tensor_scalar(dst=_sb(57, I32), data=_sb(45, I32), op0="bitwise_or", operand0=-7, reverse0=True,
                        op1="bitwise_and", operand1=12345),
        i.tensor_scalar(dst=_sb(58), data=_sb(45, I32), op0="less", operand0=_sb(51, I32, (1,)),
                        op1="not_equal", operand1=1, reverse1=True),
        i.tensor_tensor(dst=_sb(59, torch.int8), data1=_sb(45, I32), data2=_sb(44, I32), op="bitwise_or"),
        i.tensor_scalar(dst=_sb(60, I32), data=_sb(45, I32), op0="equal", operand0=2 ** 40),  # int64 compute
        i.tensor_scalar(dst=_sb(61, I32), data=_sb(45, I32), op0="add", operand0=_sb(51, I32, (1,))),
        # scalar_tensor_tensor: a scalar or a (P,1) operand0, reversed operators, bf16 and int32 tiles
        i.scalar_tensor_tensor(dst=_sb(62), data=_sb(12), op0="multiply", operand0=0.3, op1="add", operand1=_sb(13)),
        i.scalar_tensor_tensor(dst=_sb(63, BF16), data=_sb(12), op0="subtract", operand0=col, reverse0=True,
                               op1="divide", operand1=_sb(6, BF16), reverse1=True),
        i.scalar_tensor_tensor(dst=_sb(64, I32), data=_sb(45, I32), op0="add", operand0=3, op1="multiply",
                               operand1=_sb(44, I32)),
        i.scalar_tensor_tensor(dst=_sb(65, F32, (2, F // 2)), data=_sb(4, F32, (2, F // 2)), op0="maximum",
                               operand0=col, op1="subtract", operand1=_sb(12)),
        # a matmul overwriting its PSUM tile, then one accumulating onto it
        i.nc_matmul(dst=_ps(4, (P,), P), stationary=_sb(28, F32, (P,)), moving=_sb(29, F32, (P,)), accumulate=False),
        i.nc_matmul(dst=_ps(4, (P,), P), stationary=_sb(66, F32, (P,)), moving=_sb(29, F32, (P,))),
        i.dma_copy(dst=tile("hbm:out4", I32, (P, F)), src=_sb(50, I32)),
        i.dma_copy(dst=tile("hbm:out4", I32, (P, F))[:, 1:], src=tile("hbm:out4", I32, (P, F))[:, :F - 1]),
        # a TensorE transpose of a tile whose free dims do not flatten (a permuted pattern)
        i.nc_transpose(dst=tile("psum", F32, (F, P), offset=2048 * 5),
                       data=AP("sbuf", F32, ((1, 4), (4, F // 4)), partitions=P, offset=512 * 67)),
        i.nc_matmul(dst=tile("psum", F32, (F, P), offset=2048 * 5), stationary=_sb(12), moving=_sb(33, F32, (P,))),
        # exp over masked scores (below the bound where it underflows to +0.0), in place with a scale and with a
        # bias into another tile
        i.tensor_copy(dst=_sb(68), src=_sb(12)),
        i.memset(dst=_sb(68)[:, 3:9], value=-1e30),
        i.memset(dst=_sb(68)[P // 2:, 15:17], value=float("-inf")),
        i.activation(dst=_sb(68), op="exp", data=_sb(68), scale=0.5),
        i.memset(dst=_sb(68)[:, 20:22], value=-3e38),
        i.activation(dst=_sb(69), op="exp", data=_sb(68), bias=col),
        # unfused activations (planned steps): bf16 data with a tile scale and a reduction, identity of a tile
        # column-scaled into bf16, a reduction accumulating onto the registers
        i.activation(dst=_sb(70), op="tanh", data=_sb(6, BF16), scale=col, bias=0.5, reduce_op="maximum",
                     reduce_res=_sb(71, F32, (1,)), reduce_cmd="reset_reduce"),
        i.activation(dst=_sb(72, BF16), op="identity", data=_sb(13), scale=col, reduce_op="add",
                     reduce_res=_sb(73, F32, (1,)), reduce_cmd="reduce"),
        i.activation(dst=_sb(74), op="identity", data=_sb(74), reduce_cmd="reset_reduce"),
        # the causal select: keep where column <= partition, else a large negative value
        i.affine_select(dst=_sb(75), pattern=[[-1, F]], channel_multiplier=1, on_true_tile=_sb(12),
                        on_false_value=-1e30, cmp_op="greater_equal"),
        i.affine_select(dst=_sb(76, BF16), pattern=[[1, F]], offset=-3, channel_multiplier=0, on_true_tile=_sb(45, I32),
                        on_false_value=2.5, cmp_op="less"),
        i.affine_select(dst=_sb(45, I32), pattern=[[2, F]], channel_multiplier=-1, on_true_tile=_sb(45, I32),
                        on_false_value=-4, cmp_op="not_equal"),
        # predicated copies: planned where the three operands have one shape (a strided destination, the predicate
        # reversed, a bf16 tile); executed where they do not
        i.tensor_copy_predicated(dst=_sb(77), src=_sb(12), predicate=_sb(78, torch.uint8)),
        i.tensor_copy_predicated(dst=AP("sbuf", F32, ((2, F // 2),), partitions=P, offset=512 * 79),
                                 src=_sb(80, F32, (F // 2,)), predicate=_sb(81, torch.uint16, (F // 2,)),
                                 reverse_pred=True),
        i.tensor_copy_predicated(dst=_sb(6, BF16), src=_sb(20, BF16), predicate=_sb(78, torch.uint8)),
        i.tensor_copy_predicated(dst=_sb(82, F32, (2, F // 2)), src=_sb(12), predicate=_sb(78, torch.uint8)),
        # statistics: fp32, bf16 and 2-D data, one element per lane (an empty odd half), aggregated; in place (execute)
        i.bn_stats(dst=_sb(83, F32, (6,)), data=_sb(12)),
        i.bn_stats(dst=AP("sbuf", F32, ((1, 6),), partitions=P, offset=512 * 83 + 24), data=_sb(6, BF16)),
        i.bn_stats(dst=_sb(84, F32, (6,)), data=_sb(8, F32, (1,))),
        i.bn_stats(dst=_sb(85, F32, (6,)), data=_sb(4, F32, (2, F // 2))),
        i.bn_aggr(dst=_sb(86, F32, (2,)), data=AP("sbuf", F32, ((1, 12),), partitions=P, offset=512 * 83)),
        i.bn_aggr(dst=_sb(87, F32, (2,)), data=_sb(84, F32, (6,))),
        i.bn_aggr(dst=_sb(85, F32, (2,)), data=_sb(85, F32, (6,))),
        i.bn_stats(dst=_sb(12, F32, (6,)), data=_sb(12)),
    ]
    args = [ArgSlot("x", (P, F), F32), ArgSlot("y", (P, F), BF16), ArgSlot("c", (P, 1), F32),
            ArgSlot("out", (P, F), F32, "output"), ArgSlot("out2", (P, F), BF16, "output"),
            ArgSlot("out3", (P * F,), F32, "output"), ArgSlot("tmp", (4,), F32, "scratch"),
            ArgSlot("out4", (P, F), I32, "output")]
    return Program(body, args, "mixed")


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(P, F, generator=g), "y": torch.randn(P, F, generator=g).to(BF16),
            "c": torch.randn(P, 1, generator=g)}


SPECIALS = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, -1e30, 3e38, -100.0, 1e-40])


def _fill(core: NeuronCore, seed: int, specials: bool = False) -> None:
    """Random normal on-chip memory; with ``specials``, one value in 16 is NaN, +-inf, -0.0, a huge or a denormal
    value."""
    g = torch.Generator().manual_seed(seed)
    for mem in (core.sbuf, core.psum):
        values = torch.randn(mem.data.view(torch.float32).shape, generator=g)
        if specials:
            pick = torch.randint(0, 16 * len(SPECIALS), values.shape, generator=g)
            hit = pick < len(SPECIALS)
            values[hit] = SPECIALS[pick[hit]]
        mem.data.view(torch.float32).copy_(values)


def _reference(core: NeuronCore, prog: Program, bindings: dict[str, torch.Tensor]) -> None:
    """The program run one ``execute`` at a time (no steps)."""
    for name, t in bindings.items():
        core.bind(name, t)
    core.psum.close_groups()
    for instr in prog.instructions:
        core.execute(instr)


@pytest.mark.parametrize("specials", [False, True], ids=["normal", "nan-inf-zero"])
def test_steps_are_bit_identical_to_execute(specials):
    prog = mixed_program()
    probe = NeuronCore("trn2")
    stepped = [s for s in (i.step(probe, {}) for i in prog.instructions) if s is not None]
    assert len(stepped) > 20  # most of the program runs as steps
    fast, slow = NeuronCore("trn2", seed=3), NeuronCore("trn2", seed=3)
    for seed in (1, 2):  # twice: the second run reuses the prepared program
        _fill(fast, seed, specials)
        _fill(slow, seed, specials)
        a = _inputs(seed)
        if specials:
            for t in a.values():  # every 7th input element special too
                n = t.view(-1)[::7].numel()
                t.view(-1)[::7] = SPECIALS.repeat(n // len(SPECIALS) + 1)[:n].to(t.dtype)
        rep = fast.run(prog, a)
        outs = {n: torch.zeros_like(t) for n, t in rep.outputs.items()}
        _reference(slow, prog, {**{k: v.clone() for k, v in a.items()}, **outs, "tmp": torch.zeros(4)})
        for name in outs:
            assert torch.equal(rep.outputs[name].view(torch.uint8), outs[name].view(torch.uint8)), name
        assert torch.equal(fast.sbuf.data, slow.sbuf.data) and torch.equal(fast.psum.data, slow.psum.data)
        assert torch.equal(fast.psum.group_closed, slow.psum.group_closed)
        assert torch.equal(fast.regs[Engine.SCALAR].view(torch.int32), slow.regs[Engine.SCALAR].view(torch.int32))


def _special_tile(shape, seed: int) -> torch.Tensor:
    """fp32 values with +-0.0, +-inf and NaNs of distinct payloads among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    pick = torch.rand(shape, generator=g)
    nan = torch.randint(0x7FC00001, 0x7FFFFFFF, shape, generator=g, dtype=torch.int32).view(F32)
    x = torch.where(pick < 0.05, -0.0, torch.where(pick < 0.1, 0.0, x))
    return torch.where(pick > 0.95, nan, torch.where(pick > 0.92, float("inf"), torch.where(pick > 0.89, -float("inf"), x)))


def _in_place_cases():
    """Unfused fp32 element-wise instructions a planned step computes in place in dst, and ones it must not
    (dst read again after the first op wrote it: the fallback keeps the temporaries)."""
    i, col = isa, _sb(9, F32, (1,))
    for op0, op1 in (("multiply", "multiply"), ("subtract", "multiply"), ("multiply", "subtract"),
                     ("divide", "add"), ("add", "divide")):
        for rev0, rev1 in ((False, False), (True, False), (False, True), (True, True)):
            yield i.scalar_tensor_tensor(dst=_sb(3), data=_sb(0), op0=op0, operand0=col if rev1 else -0.0,
                                         op1=op1, operand1=_sb(1), reverse0=rev0, reverse1=rev1)
    yield i.scalar_tensor_tensor(dst=_sb(0), data=_sb(0), op0="multiply", operand0=col, op1="add", operand1=_sb(1))
    yield i.scalar_tensor_tensor(dst=_sb(1), data=_sb(0), op0="multiply", operand0=1.5, op1="add", operand1=_sb(1))
    yield i.scalar_tensor_tensor(dst=_sb(3), data=_sb(0), op0="multiply", operand0=1.5, op1="maximum",
                                 operand1=_sb(1))
    yield i.tensor_scalar(dst=_sb(3), data=_sb(0), op0="subtract", operand0=col, reverse0=True, op1="divide",
                          operand1=-0.0, reverse1=True)
    yield i.tensor_scalar(dst=_sb(0), data=_sb(0), op0="divide", operand0=3.0, reverse0=True)


@pytest.mark.parametrize("instr", list(_in_place_cases()), ids=lambda ins: f"{ins.opcode}")
def test_in_place_alu_steps_are_bit_identical_to_execute(instr):
    fast, slow = NeuronCore("trn2", seed=0), NeuronCore("trn2", seed=0)
    for core in (fast, slow):
        for k, ap in enumerate((_sb(0), _sb(1), _sb(3), _sb(9, F32, (1,)))):
            ap.write(core, _special_tile(ap.shape, k))
    step = instr.step(fast, {})
    assert step is not None
    step([])
    slow.execute(instr)
    assert torch.equal(fast.sbuf.data, slow.sbuf.data)


def test_psum_flags_reset_only_where_groups_opened():
    core = NeuronCore("trn2")
    prog = mixed_program()
    core.run(prog, _inputs(1))
    assert core.psum.groups_open and not core.psum.group_closed.all()  # the last matmuls left groups open
    core.begin_run()
    assert not core.psum.groups_open and core.psum.group_closed.all()
    version = core.psum.group_closed._version
    core.begin_run()  # nothing open: no fill at all
    assert core.psum.group_closed._version == version


@pytest.mark.parametrize("in_op_kernel", [False, True], ids=["python", "in-op-kernel"])
def test_accumulate_none_overwrites_at_the_start_of_every_run(in_op_kernel):
    # a matmul with accumulate=None in a later run must not add to the previous run's PSUM, also when the run
    # happens inside a device op's kernel, where in-place ops bump no tensor version counter
    with below_inplace_or_view(in_op_kernel):
        _overwrites_at_the_start_of_every_run()


def _overwrites_at_the_start_of_every_run():
    core = NeuronCore("trn2")
    acc = _ps(0, (8,), 4)
    body = [isa.dma_copy(dst=_sb(0, F32, (4,), 4), src=tile("hbm:s", F32, (4, 4))),
            isa.dma_copy(dst=_sb(1, F32, (8,), 4), src=tile("hbm:m", F32, (4, 8))),
            isa.nc_matmul(dst=acc, stationary=_sb(0, F32, (4,), 4), moving=_sb(1, F32, (8,), 4)),
            isa.tensor_copy(dst=_sb(2, F32, (8,), 4), src=acc),
            isa.dma_copy(dst=tile("hbm:o", F32, (4, 8)), src=_sb(2, F32, (8,), 4)),
            # a VectorE write closes the group: the next matmul overwrites the 7s
            isa.memset(dst=acc, value=7.0),
            isa.nc_matmul(dst=acc, stationary=_sb(0, F32, (4,), 4), moving=_sb(1, F32, (8,), 4)),
            isa.tensor_copy(dst=_sb(3, F32, (8,), 4), src=acc),
            isa.dma_copy(dst=tile("hbm:o2", F32, (4, 8)), src=_sb(3, F32, (8,), 4))]
    prog = Program(body, [ArgSlot("s", (4, 4), F32), ArgSlot("m", (4, 8), F32), ArgSlot("o", (4, 8), F32, "output"),
                          ArgSlot("o2", (4, 8), F32, "output")])
    s, m = torch.randn(4, 4), torch.randn(4, 8)
    first = core.run(prog, {"s": s, "m": m}).outputs
    second = core.run(prog, {"s": s, "m": m}).outputs
    for out in ("o", "o2"):
        assert torch.equal(first[out], second[out])
        assert torch.equal(first[out], first["o"])
    torch.testing.assert_close(first["o"], s.T @ m)


def test_run_bound_takes_slot_order_and_allocates_unbound():
    core = NeuronCore("trn2")
    prog = mixed_program()
    a = _inputs(4)
    tensors = core.run_bound(prog, [a["x"], a["y"], a["c"], None, None, None, None, None])
    want = core.run(prog, a).outputs
    assert torch.equal(tensors[3], want["out"]) and torch.equal(tensors[4], want["out2"])
    assert tensors[6].shape == (4,)
    assert not core._run_hbm and "hbm:x" not in core._memories  # nothing stays bound after the run


def test_run_binding_shadows_a_persistent_bind_for_the_run_only():
    core = NeuronCore("trn2")
    kept = torch.full((P, F), 5.0)
    core.bind("x", kept)
    prog = Program([isa.dma_copy(dst=_sb(0), src=tile("hbm:x", F32, (P, F))),
                    isa.dma_copy(dst=tile("hbm:o", F32, (P, F)), src=_sb(0))],
                   [ArgSlot("x", (P, F), F32), ArgSlot("o", (P, F), F32, "output")])
    x = torch.randn(P, F)
    assert torch.equal(core.run(prog, {"x": x}).outputs["o"], x)
    assert core.memory("hbm:x").data.data_ptr() == kept.data_ptr()


def test_errors_still_name_the_instruction_and_leave_nothing_bound():
    core = NeuronCore("trn1")  # a smaller SBUF than the trn3 tile below needs
    far = tile("sbuf", F32, (P, 16), offset=core.spec.sbuf_bytes_per_partition - 32)
    prog = Program([isa.dma_copy(dst=_sb(0), src=tile("hbm:x", F32, (P, F))), isa.memset(dst=far, value=1.0)],
                   [ArgSlot("x", (P, F), F32)])
    with pytest.raises(SimulatorError, match="memset: dst"):
        core.run(prog, {"x": torch.randn(P, F)})
    assert not core._run_hbm and "hbm:x" not in core._memories


def test_prepared_programs_are_dropped_with_the_program():
    core = NeuronCore("trn2")
    prog = mixed_program()
    core.run(prog, _inputs(1))
    assert len(core._plans) == 1
    del prog
    gc.collect()
    assert not core._plans


def test_int32_exact_computation_is_chosen_only_where_values_agree():
    t, col = _sb(0, I32), _sb(1, I32, (1,))
    assert int32_exact(t, [("bitwise_and", col, False, True), ("not_equal", 0, False, True)])
    assert int32_exact(t, [("bitwise_xor", -2 ** 31, True, True)])
    assert not int32_exact(t, [("add", col, False, True)])                  # may overflow int32
    assert not int32_exact(t, [("equal", 2 ** 31, False, True)])            # scalar beyond int32
    assert not int32_exact(t, [("bitwise_and", _sb(1, torch.uint32, (1,)), False, True)])
    assert not int32_exact(_sb(0, torch.int16), [("bitwise_and", 3, False, True)])


def test_run_uses_one_thread_and_restores_the_callers(monkeypatch):
    seen = []
    core = NeuronCore("trn2", seed=3)
    prog = mixed_program()
    _fill(core, 1)
    monkeypatch.setattr(core, "begin_run", lambda: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        core.run(prog, _inputs(1))
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_chained_copies_match_execute():
    # copies each reading what the one before it wrote (through SBUF, and through HBM where two slots are bound to
    # one tensor), a broadcast read, a cast, a reshape, and an HBM-to-HBM copy between two slots bound to one
    # tensor (its source read before it is written): bit for bit as execute
    x, out = tile("hbm:x", F32, (P, F)), tile("hbm:out", F32, (P, F))
    broadcast = AP("hbm:c", F32, ((1, P), (0, F)))  # each partition's one value, F times
    body = [isa.dma_copy(dst=_sb(0), src=x), isa.dma_copy(dst=out, src=_sb(0)), isa.dma_copy(dst=_sb(1), src=out),
            isa.tensor_copy(dst=_sb(2), src=_sb(1)), isa.dma_copy(dst=x[:, :F // 2], src=_sb(2)[:, F // 2:]),
            isa.dma_copy(dst=_sb(3), src=x), isa.dma_copy(dst=_sb(4, BF16), src=x),
            isa.dma_copy(dst=_sb(5, F32, (2, F // 2)), src=x), isa.dma_copy(dst=_sb(6), src=broadcast),
            isa.dma_copy(dst=out, src=_sb(3)),
            isa.dma_copy(dst=out[:, 1:], src=x[:, :F - 1])]  # HBM to HBM: overlapping where x and out are one tensor
    prog = Program(body, [ArgSlot("x", (P, F), F32), ArgSlot("out", (P, F), F32, "output"),
                          ArgSlot("c", (P, 1), F32)], "copies")
    for shared in (False, True):
        fast, slow = NeuronCore("trn2"), NeuronCore("trn2")
        _fill(fast, 5, specials=True)
        _fill(slow, 5, specials=True)
        g = torch.Generator().manual_seed(int(shared))
        x_t, c_t, out_t = torch.randn(P, F, generator=g), torch.randn(P, 1, generator=g), torch.randn(P, F, generator=g)
        x_t.view(-1)[::5] = SPECIALS.repeat(P * F // len(SPECIALS))[:x_t.view(-1)[::5].numel()]
        bound = []
        for _ in (fast, slow):
            b = {"x": x_t.clone(), "c": c_t.clone()}
            b["out"] = b["x"] if shared else out_t.clone()
            bound.append(b)
        fast.run(prog, bound[0])
        _reference(slow, prog, bound[1])
        for name in bound[0]:
            assert torch.equal(bound[0][name].view(torch.int32), bound[1][name].view(torch.int32)), name
        assert torch.equal(fast.sbuf.data, slow.sbuf.data)


@pytest.mark.parametrize("stepped", [False, True], ids=["execute", "steps"])
def test_accumulation_groups_through_partial_closes_and_runs(stepped):
    # a group opened by a matmul, added to, closed under its left half by a VectorE write, then written by a
    # matmul with accumulate=None: the left half overwritten, the right half added to; every run starts with
    # all groups closed. Small integers: every product and sum is exact, whatever the order of the sums.
    g = torch.Generator().manual_seed(5)
    s = torch.randint(-2, 3, (P, P), generator=g).float()
    m = torch.randint(-2, 3, (P, F), generator=g).float()
    z = torch.randint(-9, 10, (P, F // 2), generator=g).float()
    acc = tile("psum", F32, (P, F))
    mm = isa.nc_matmul(dst=acc, stationary=_sb(0, F32, (P,)), moving=_sb(1))
    body = [mm, mm, isa.tensor_copy(dst=acc[:, : F // 2], src=_sb(2, F32, (F // 2,))), mm,
            isa.tensor_copy(dst=_sb(3), src=acc)]
    prog = Program(body, [])
    core = NeuronCore("trn2")
    product = s.T @ m
    want = torch.cat([product[:, : F // 2], 3 * product[:, F // 2:]], 1)
    for _ in range(2):
        for ap, v in ((_sb(0, F32, (P,)), s), (_sb(1), m), (_sb(2, F32, (F // 2,)), z)):
            ap.write(core, v)
        acc.write(core, torch.full((P, F), 1e30))  # overwritten by the first matmul of each run
        if stepped:
            core.run_bound(prog, [])
        else:
            core.begin_run()
            for instr in body:
                core.execute(instr)
        assert torch.equal(_sb(3).read(core), want)
        flags = core.psum.group_closed[:P, : F]
        assert not flags.any()  # the last matmul opened the whole group again
    core.begin_run()
    assert core.psum.group_closed.all() and not core.psum.groups_open


V = 10  # rows of the gathered table


def _rows(n: int, cols=((1, F),), offset: int = 0, dtype=F32) -> AP:
    """n rows of the [V, F] table "hbm:x" as an indirect pattern (dim 0 indexed; ``cols``: the columns)."""
    return AP("hbm:x", dtype, ((F, n), *cols), offset=offset)


def _gather_program(oob_mode: str = "skip") -> Program:
    """Indirect row gathers (embedding lookups): whole rows, a strided column window of a partial tile, a cast
    into bf16, duplicate and reversed indices, indices past either end (left out with ``skip``), and a gather
    whose destination overwrites its own index tile."""
    i = isa
    idx = [_sb(k, I32, (1,)) for k in range(4)]
    window = _rows(5, ((2, 4),), offset=4 * 3)   # rows of 4 columns 3, 5, 7, 9
    body = [
        i.iota(dst=idx[0], pattern=[[0, 1]], offset=V - 1, channel_multiplier=-1),   # V-1 .. V-P: past the start
        i.iota(dst=idx[1], pattern=[[0, 1]], offset=2, channel_multiplier=0),        # one row, P times
        i.iota(dst=idx[2], pattern=[[0, 1]], offset=V - 4, channel_multiplier=1),    # past the end
        i.iota(dst=idx[3][:V], pattern=[[0, 1]], offset=0, channel_multiplier=1),
        i.dma_copy(dst=_sb(10), src=_rows(P), src_index=idx[1], oob_mode=oob_mode),
        i.dma_copy(dst=_sb(11, BF16), src=_rows(P), src_index=idx[1], oob_mode=oob_mode),
        i.dma_copy(dst=_sb(12, F32, (4,), parts=5, start=3), src=window,
                   src_index=_sb(1, I32, (1,), parts=5, start=3), oob_mode=oob_mode),
        i.dma_copy(dst=_sb(13)[:V], src=_rows(V), src_index=idx[3][:V], oob_mode=oob_mode),
        # the index tile overwritten by its own gather (the table's column 0)
        i.dma_copy(dst=_sb(3, F32, (1,))[:V], src=_rows(V, ((1, 1),)), src_index=idx[3][:V],
                   oob_mode=oob_mode),
        i.dma_copy(dst=_sb(16, I32), src=_rows(P), src_index=idx[1], oob_mode=oob_mode),   # fp32 into int32
        i.iota(dst=_sb(4, I32, (1,))[:V + 1], pattern=[[0, 1]], offset=0, channel_multiplier=1),
        i.dma_copy(dst=_sb(17)[:V + 1], src=_rows(V + 1), src_index=_sb(4, I32, (1,))[:V + 1],  # the last: row V
                   oob_mode=oob_mode),
        i.dma_copy(dst=_sb(14), src=_rows(P), src_index=idx[0], oob_mode=oob_mode),
        i.dma_copy(dst=_sb(15), src=_rows(P), src_index=idx[2], oob_mode=oob_mode),
    ]
    return Program(body, [ArgSlot("x", (V, F), F32)], "gathers")


def test_gather_steps_are_bit_identical_to_execute():
    prog = _gather_program()
    probe = NeuronCore("trn2")
    planned = [type(s) for s in (i.step(probe, {"hbm:x": (0, ArgSlot("x", (V, F), F32))})
                                  for i in prog.instructions if getattr(i, "src_index", None) is not None)]
    assert planned.count(type(None)) == 0
    fast, slow = NeuronCore("trn2", seed=3), NeuronCore("trn2", seed=3)
    for seed in (1, 2):
        _fill(fast, seed, specials=True)
        _fill(slow, seed, specials=True)
        x = _special_tile((V, F), seed)
        fast.run(prog, {"x": x.clone()})
        _reference(slow, prog, {"x": x.clone()})
        assert torch.equal(fast.sbuf.data, slow.sbuf.data)


def test_gather_step_raises_out_of_range_like_execute():
    prog = _gather_program("error")
    with pytest.raises(IndexOutOfRange, match=r"dma_copy: src_index\[10\] = 10 is outside the 10 rows of hbm:x"):
        NeuronCore("trn2").run(prog, {"x": torch.zeros(V, F)})
    prog = Program(prog.instructions[3:4] + prog.instructions[7:8], prog.args, "gather")  # index in range
    core = NeuronCore("trn2")
    core.run(prog, {"x": torch.arange(V * F, dtype=F32).reshape(V, F)})
    assert torch.equal(_sb(13)[:V].read(core), torch.arange(V * F, dtype=F32).reshape(V, F))


def test_gathers_from_another_dtype_or_by_narrow_indices_execute():
    i, slots = isa, {"hbm:x": (0, ArgSlot("x", (V, F), F32))}
    other = i.dma_copy(dst=_sb(0, I32), src=_rows(P, dtype=I32), src_index=_sb(1, I32, (1,)))
    narrow = i.dma_copy(dst=_sb(0), src=_rows(P), src_index=_sb(1, torch.int16, (1,)))
    assert other.step(NeuronCore("trn2"), slots) is None and narrow.step(NeuronCore("trn2"), slots) is None
