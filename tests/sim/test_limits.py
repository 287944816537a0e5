"""Every hardware limit is an error that names the instruction, the operand and the limit."""
from __future__ import annotations

import re

import pytest
import torch

from torchneuron.sim import AP, ArgSlot, NeuronCore, Program, SimulatorError, isa, tile

from .conftest import empty, hbm, put

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32


def sb(shape, dtype=F32, start=0, offset=0, memory="sbuf"):
    """An on-chip pattern without allocating (limits are checked when the instruction is built)."""
    return tile(memory, dtype, shape, start_partition=start, offset=offset)


def ps(shape, dtype=F32, offset=0):
    return sb(shape, dtype, offset=offset, memory="psum")


def raises(*words: str):
    """Expect a SimulatorError whose message contains every word (in order)."""
    return pytest.raises(SimulatorError, match=".*".join(re.escape(w) for w in words))


def test_simulator_error_is_a_value_error():
    assert issubclass(SimulatorError, ValueError)


def test_partition_limit():
    with raises("tensor_tensor:", "data1", "129 partitions", "limit is 128"):
        isa.tensor_tensor(dst=sb((129, 4)), data1=sb((129, 4)), data2=sb((129, 4)), op="add")
    with raises("dma_copy:", "dst", "129 partitions", "128"):
        isa.dma_copy(dst=sb((129, 4)), src=tile("hbm:x", F32, (129, 4)))


def test_free_size_limit_per_engine_operand():
    with raises("activation:", "data", "65537 elements per partition", "sbuf is 65536"):
        isa.activation(dst=sb((1, 65537), BF16), op="exp", data=sb((1, 65537), BF16))
    with raises("tensor_copy:", "src", "4097 elements", "psum is 4096"):
        isa.tensor_copy(dst=sb((1, 4097), BF16), src=ps((1, 4097), BF16))


def test_matmul_tile_limits():
    with raises("nc_matmul:", "stationary", "129 elements per partition (M)", "128", "gemm_stationary_fmax"):
        isa.nc_matmul(dst=ps((129, 8)), stationary=sb((64, 129), BF16), moving=sb((64, 8), BF16))
    with raises("nc_matmul:", "moving", "513 elements per partition (N)", "512", "gemm_moving_fmax"):
        isa.nc_matmul(dst=ps((8, 513)), stationary=sb((64, 8), BF16), moving=sb((64, 513), BF16))
    with raises("nc_matmul:", "stationary", "129 partitions", "128"):
        isa.nc_matmul(dst=ps((8, 8)), stationary=sb((129, 8), BF16), moving=sb((129, 8), BF16))
    with raises("nc_matmul:", "moving", "has 32 partitions", "stationary has 64"):
        isa.nc_matmul(dst=ps((8, 8)), stationary=sb((64, 8), BF16), moving=sb((32, 8), BF16))
    with raises("nc_matmul:", "dst", "shape (8, 16)", "[M=8, N=8]"):
        isa.nc_matmul(dst=ps((8, 16)), stationary=sb((64, 8), BF16), moving=sb((64, 8), BF16))


def test_matmul_output_must_fit_one_psum_bank():
    with raises("nc_matmul:", "dst", "bytes [1024, 3072)", "one 2048-byte bank"):
        isa.nc_matmul(dst=ps((8, 512), offset=1024), stationary=sb((64, 8), BF16), moving=sb((64, 512), BF16))
    with raises("nc_transpose:", "dst", "across banks"):
        isa.nc_transpose(dst=ps((128, 128), offset=1792), data=sb((128, 128)))


def test_matmul_memories_and_dtypes():
    with raises("nc_matmul:", "stationary", "is in psum", "sbuf"):
        isa.nc_matmul(dst=ps((8, 8)), stationary=ps((64, 8), BF16), moving=sb((64, 8), BF16))
    with raises("nc_matmul:", "dst", "is in sbuf", "psum"):
        isa.nc_matmul(dst=sb((8, 8)), stationary=sb((64, 8), BF16), moving=sb((64, 8), BF16))
    with raises("nc_matmul:", "moving", "fp32"):
        isa.nc_matmul(dst=ps((8, 8)), stationary=sb((64, 8), F32), moving=sb((64, 8), BF16))
    with raises("nc_matmul:", "stationary", "int32", "fp8/bf16/fp16/fp32"):
        isa.nc_matmul(dst=ps((8, 8)), stationary=sb((64, 8), I32), moving=sb((64, 8), I32))
    with raises("nc_matmul:", "dst", "bfloat16", "float32"):
        isa.nc_matmul(dst=ps((8, 8), BF16), stationary=sb((64, 8), BF16), moving=sb((64, 8), BF16))


def test_transpose_size_limits():
    with raises("nc_transpose:", "data", "[33, 8]", "vector engine transposes at most [32, 32]"):
        isa.nc_transpose(dst=sb((8, 33)), data=sb((33, 8)), engine="vector")
    with raises("nc_transpose:", "data", "[64, 129]", "[128, 128]"):
        isa.nc_transpose(dst=ps((129, 64)), data=sb((64, 129)))
    with raises("nc_transpose:", "dst", "bfloat16", "float32"):
        isa.nc_transpose(dst=ps((8, 8), BF16), data=sb((8, 8)))


def test_gpsimd_cannot_touch_psum():
    with raises("iota:", "dst", "is in psum", "GpSimd cannot access PSUM"):
        isa.iota(dst=ps((8, 8)), pattern=[[1, 8]])
    with raises("tensor_copy:", "src", "is in psum", "GpSimd cannot access PSUM"):
        isa.tensor_copy(dst=sb((8, 8)), src=ps((8, 8)), engine="gpsimd")
    with raises("memset:", "dst", "GpSimd cannot access PSUM"):
        isa.memset(dst=ps((8, 8)), value=0, engine="gpsimd")
    with raises("affine_select:", "on_true_tile", "GpSimd"):
        isa.affine_select(dst=sb((8, 8)), pattern=[[1, 8]], channel_multiplier=1, on_true_tile=ps((8, 8)),
                          on_false_value=0.0)


def test_dma_cannot_touch_psum():
    with raises("dma_copy:", "src", "is in psum", "DMA cannot access PSUM"):
        isa.dma_copy(dst=tile("hbm:x", F32, (8, 8)), src=ps((8, 8)))
    with raises("dma_copy:", "dst", "is in psum"):
        isa.dma_copy(dst=ps((8, 8)), src=sb((8, 8)))


def test_shape_mismatches():
    with raises("tensor_tensor:", "data2", "shape (8, 5)", "data1 (8, 4)"):
        isa.tensor_tensor(dst=sb((8, 4)), data1=sb((8, 4)), data2=sb((8, 5)), op="add")
    with raises("tensor_copy:", "dst", "shape (4, 8)"):
        isa.tensor_copy(dst=sb((4, 8)), src=sb((8, 4)))
    with raises("dma_copy:", "dst", "32 elements", "src has 64"):
        isa.dma_copy(dst=sb((8, 4)), src=tile("hbm:x", F32, (8, 8)))
    with raises("tensor_scalar:", "operand0", "shape (8, 2)", "(8, 1)"):
        isa.tensor_scalar(dst=sb((8, 4)), data=sb((8, 4)), op0="add", operand0=sb((8, 2)))
    with raises("tensor_reduce:", "dst", "has 4 elements", "leaves 2"):
        isa.tensor_reduce(dst=sb((8, 4)), op="add", data=sb((8, 2, 3)), axis=2)
    with raises("dma_transpose:", "dst", "shape (8, 4)", "(4, 8)"):
        isa.dma_transpose(dst=sb((8, 4)), src=tile("hbm:x", F32, (8, 4)))


def test_both_inputs_in_psum():
    with raises("tensor_tensor:", "data1 and data2", "both in psum", "at most one"):
        isa.tensor_tensor(dst=sb((8, 4)), data1=ps((8, 4)), data2=ps((8, 4), offset=64), op="add")
    with raises("tensor_tensor_scan:", "both in psum"):
        isa.tensor_tensor_scan(dst=sb((8, 4)), data0=ps((8, 4)), data1=ps((8, 4)), initial=0.0,
                               op0="multiply", op1="add")


def test_operator_rules():
    with raises("tensor_tensor:", "unknown ALU operator 'frobnicate'"):
        isa.tensor_tensor(dst=sb((8, 4)), data1=sb((8, 4)), data2=sb((8, 4)), op="frobnicate")
    with raises("activation:", "unknown activation function 'softmax9'"):
        isa.activation(dst=sb((8, 4)), op="softmax9", data=sb((8, 4)))
    with raises("tensor_tensor:", "data1", "float32", "bitvec operator 'bitwise_and'", "integer dtypes"):
        isa.tensor_tensor(dst=sb((8, 4), I32), data1=sb((8, 4)), data2=sb((8, 4), I32), op="bitwise_and")
    with raises("tensor_scalar:", "op0/op1", "(subtract, None)", "ScalarE supports"):
        isa.tensor_scalar(dst=sb((8, 4)), data=sb((8, 4)), op0="subtract", operand0=1.0, engine="scalar")
    with raises("tensor_scalar:", "op0 and op1", "mix bitvec and arithmetic"):
        isa.tensor_scalar(dst=sb((8, 4), I32), data=sb((8, 4), I32), op0="bitwise_and", operand0=1, op1="add",
                          operand1=1)
    with raises("tensor_reduce:", "axis", "never the partition dim"):
        isa.tensor_reduce(dst=sb((1, 4)), op="add", data=sb((8, 4)), axis=0)
    with raises("activation:", "reduce_op", "'multiply'", "add"):
        isa.activation(dst=sb((8, 4)), op="exp", data=sb((8, 4)), reduce_op="multiply", reduce_cmd="reduce")
    with raises("tensor_tensor:", "runs on vector/gpsimd, not on scalar"):
        isa.tensor_tensor(dst=sb((8, 4)), data1=sb((8, 4)), data2=sb((8, 4)), op="add", engine="scalar")
    with raises("memset:", "value", "2.5 is not an integer", "int32"):
        isa.memset(dst=sb((8, 4), I32), value=2.5)


def test_size_rules_of_special_instructions():
    with raises("bn_stats:", "data", "513 elements", "512", "bn_stats_fmax"):
        isa.bn_stats(dst=sb((8, 6)), data=sb((8, 513)))
    with raises("bn_aggr:", "data", "7 elements", "multiple of 3"):
        isa.bn_aggr(dst=sb((8, 2)), data=sb((8, 7)))
    with raises("max8:", "src", "7 elements", "[8, 16384]"):
        isa.max8(dst=sb((8, 8)), src=sb((8, 7)))
    with raises("nc_find_index8:", "dst", "float32", "uint16 or uint32"):
        isa.nc_find_index8(dst=sb((8, 8)), data=sb((8, 16)), vals=sb((8, 8)))
    with raises("iota:", "pattern", "covers 6 elements", "dst has 8"):
        isa.iota(dst=sb((8, 8), I32), pattern=[[1, 6]])
    with raises("rng:", "dst", "float32", "integer"):
        isa.rng(dst=sb((8, 8)))
    with raises("dropout:", "prob", "1.5", "[0, 1]"):
        isa.dropout(dst=sb((8, 8)), data=sb((8, 8)), prob=1.5)
    with raises("dma_copy:", "dge_mode", "hwdge", "swdge"):
        isa.dma_copy(dst=sb((8, 4)), src=AP("hbm:t", F32, ((4, 8), (1, 4))), src_index=sb((8, 1), I32),
                     dge_mode="hwdge")


def test_out_of_bounds_on_chip_access_at_run_time(core):
    end = core.spec.sbuf_bytes_per_partition
    instr = isa.tensor_copy(dst=sb((8, 8)), src=sb((8, 8), offset=end - 16))
    with raises("tensor_copy:", "src", "reaches partitions [0, 8)", f"bytes [{end - 16}, {end + 16})",
                f"sbuf has 128 partitions x {end} bytes"):
        core.execute(instr)


def test_out_of_bounds_hbm_access(core):
    hbm(core, "x", torch.zeros(8, 8))
    instr = isa.dma_copy(dst=sb((8, 16)), src=tile("hbm:x", F32, (8, 16)))
    with raises("dma_copy:", "src", "bytes [0, 512) of hbm:x", "256 bytes"):
        core.execute(instr)
    with raises("program 'k'", "instruction 0 (dma_copy) src", "bytes [0, 512) of hbm:x", "256 bytes"):
        Program([instr], [ArgSlot("x", (8, 8), F32)], "k")  # static check when the program is built
    with raises("dma_copy:", "no memory 'hbm:y'"):
        core.execute(isa.dma_copy(dst=sb((8, 8)), src=tile("hbm:y", F32, (8, 8))))


def test_sbuf_and_psum_overflow(core):
    cap = core.spec.sbuf_bytes_per_partition
    core.sbuf.allocate(128, cap - 1024)
    with raises("sbuf overflow", "128 partitions x 2048 bytes", f"128 partitions x {cap} bytes"):
        core.sbuf.allocate(128, 2048)
    for _ in range(8):
        core.psum.allocate(128, 2048)
    with raises("psum overflow", "128 partitions x 4 bytes", "16384 bytes"):
        core.psum.allocate(128, 4)


def test_program_binding_errors(core):
    prog = Program([], [ArgSlot("x", (4, 4), F32), ArgSlot("y", (4,), BF16, "output")], "k")
    with raises("program 'k'", "input 'x' (float32[4, 4]) is not bound"):
        core.run(prog, {}, timed=False)
    with raises("program 'k'", "argument 'x' expects float32[4, 4], got bfloat16[4, 4]"):
        core.run(prog, {"x": torch.zeros(4, 4, dtype=BF16)}, timed=False)
    with raises("program 'k'", "no argument named ['z']"):
        core.run(prog, {"x": torch.zeros(4, 4), "z": torch.zeros(1)}, timed=False)
    with raises("program 'k'", "names hbm:w, which is not an argument"):
        Program([isa.dma_copy(dst=sb((4, 4)), src=tile("hbm:w", F32, (4, 4)))], [ArgSlot("x", (4, 4), F32)], "k")


def test_nan_fill_exposes_uninitialized_reads():
    core = NeuronCore("trn2", nan_fill=True)
    src = empty(core, (16, 32), BF16)  # allocated, never written
    dst = empty(core, (16, 32), F32)
    core.execute(isa.tensor_copy(dst=dst, src=src))
    assert torch.isnan(dst.read(core)).all()
    acc = empty(core, (16, 32), F32, "psum")
    assert torch.isnan(acc.read(core)).all()
    # the first matmul of a group overwrites, so NaN-filled PSUM does not leak into results
    core.execute(isa.nc_matmul(dst=acc, stationary=put(core, torch.ones(8, 16, dtype=BF16)),
                               moving=put(core, torch.ones(8, 32, dtype=BF16))))
    assert torch.equal(acc.read(core), torch.full((16, 32), 8.0))


def test_nan_fill_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHNEURON_SIM_NAN_FILL", "1")
    core = NeuronCore("trn2")
    assert torch.isnan(empty(core, (4, 4), F32).read(core)).all()
    prog = Program([], [ArgSlot("out", (4,), F32, "output")])
    assert torch.isnan(core.run(prog, timed=False).outputs["out"]).all()  # unbound outputs too
    monkeypatch.setenv("TORCHNEURON_SIM_NAN_FILL", "0")
    core = NeuronCore("trn2")
    assert torch.equal(empty(core, (4, 4), F32).read(core), torch.zeros(4, 4))
