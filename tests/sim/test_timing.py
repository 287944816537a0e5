"""The timing model: each formula pinned to the spec table, and the scheduler's rules.

Uses a tiny fake instruction implementing the ``instruction.Instruction`` protocol, so
these tests do not depend on the instruction set (isa.py).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import time

import pytest

from torchneuron.sim.instruction import CostInputs, Engine, Footprint
from torchneuron.sim.specs import CHIPS, KiB, SOURCES, chip_spec
from torchneuron.sim.timing import (
    ENGINE_NAMES,
    dma_cost,
    instruction_cost_ns,
    instruction_cycles,
    roofline,
    schedule,
)

TRN1, TRN2, TRN3 = CHIPS["trn1"], CHIPS["trn2"], CHIPS["trn3"]
BF16, FP32, FP16 = "bfloat16", "float32", "float16"


# ---------------------------------------------------------------------------------------
# a fake instruction and builders
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Fake:
    ci: CostInputs
    rd: tuple = ()
    wr: tuple = ()
    queue: int = 0

    @property
    def engine(self) -> Engine:
        return self.ci.engine

    def reads(self):
        return self.rd

    def writes(self):
        return self.wr

    def cost_inputs(self) -> CostInputs:
        return self.ci


def sb(b0, b1, p0=0, p1=128):
    return Footprint("sbuf", (p0, p1), (b0, b1))


def ps(b0, b1, p0=0, p1=128):
    return Footprint("psum", (p0, p1), (b0, b1))


def hbm(name, b0, b1):
    return Footprint(f"hbm:{name}", (0, 1), (b0, b1))


def mm(k=128, m=128, n=512, dt=BF16):
    return CostInputs("nc_matmul", Engine.TENSOR, partitions=k, free_elems=n, in_dtypes=(dt, dt),
                      out_dtype=FP32, in_memories=("sbuf", "sbuf"), out_memory="psum",
                      matmul_kmn=(k, m, n), flops=2 * k * m * n)


def vec(opcode, n, dts=(FP32, FP32), mems=("sbuf", "sbuf"), out=FP32, out_mem="sbuf", op=None,
        contiguous=True, engine=Engine.VECTOR, p=128):
    return CostInputs(opcode, engine, partitions=p, free_elems=n, in_dtypes=dts, out_dtype=out,
                      in_memories=mems, out_memory=out_mem, op=op, contiguous=contiguous)


def act(n, dt=FP32):
    return vec("activation", n, dts=(dt,), mems=("sbuf",), out=dt, engine=Engine.SCALAR, op="exp")


def dma(nbytes, p=128, src="hbm", dst="sbuf", chunks=0, dge=None, opcode="dma_copy"):
    return CostInputs(opcode, Engine.DMA, partitions=p, free_elems=nbytes // max(p, 1) // 2,
                      in_dtypes=(BF16,), out_dtype=BF16, in_memories=(src,), out_memory=dst,
                      dma_bytes=nbytes, dma_chunks=chunks, dge_mode=dge)


def ns(cycles, hz):
    return cycles / hz * 1e9


# ---------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------
_TAG = re.compile(r"#.*\b(" + "|".join(map(re.escape, [*SOURCES, "DERIVED", "ASSUMPTION"])) + r")\b")


def test_every_figure_in_the_table_cites_a_source_or_is_an_assumption():
    src = pathlib.Path(__import__("torchneuron.sim.specs", fromlist=["x"]).__file__).read_text()
    body = src.split("CHIPS: dict[str, ChipSpec] = {", 1)[1].split("def chip_spec", 1)[0]
    shared = src.split("# Figures shared by all three generations", 1)[1].split("def _stream", 1)[0]
    unsourced = []
    for line in body.splitlines():
        if re.search(r"=\s*[\d(]", line) or re.search(r"\(\d", line):   # a literal figure
            if not _TAG.search(line):
                unsourced.append(line.strip())
    for line in shared.splitlines():
        if re.match(r"_[A-Z0-9_]+\s*=\s*[\d(]", line) and not _TAG.search(line):
            unsourced.append(line.strip())
    assert not unsourced, "figures without a source tag:\n" + "\n".join(unsourced)


@pytest.mark.parametrize("name", sorted(CHIPS))
def test_table_is_consistent_with_itself(name):
    c = CHIPS[name]
    assert chip_spec(name) is c
    # DERIVED: 128 x 128 PEs x 2 flop x clock reproduces the published BF16 peak (< 1 %).
    derived = c.tensor.pe_rows * c.tensor.pe_cols * 2 * c.tensor.clock_hz
    assert derived == pytest.approx(c.tensor.bf16_flops, rel=0.01)
    # fp32 is about 4x slower (A-v2, LISA) and the published fp32 peak agrees.
    assert c.tensor.bf16_flops / c.tensor.fp32_flops == pytest.approx(c.tensor.fp32_factor, rel=0.05)
    # DMA per core = 16 engines x per-engine peak (DMAO/DMABW table).
    assert c.dma.bytes_per_s_per_core == pytest.approx({"trn1": 272e9, "trn2": 368e9, "trn3": 528e9}[name])
    assert c.dma.engines_per_core == 16 and c.dma.queues_per_engine == 16
    # the names of the first version of the table still read the same figures
    assert c.tensor_clock_hz == c.tensor.clock_hz and c.vector_clock_hz == c.vector.clock_hz
    assert c.scalar_clock_hz == c.scalar.clock_hz and c.gpsimd_clock_hz == c.gpsimd.clock_hz
    assert c.dma_engines_per_core == 16
    assert c.dma_bytes_per_second_per_core == c.dma.bytes_per_s_per_core
    assert c.tensor_bf16_flops_per_core == c.tensor.bf16_flops
    assert c.tensor_fp32_flops_per_core == c.tensor.fp32_flops
    assert c.hbm_bytes_per_core * c.cores_per_chip == c.hbm_bytes_per_chip
    assert c.psum_bank_bytes_per_partition == 2 * KiB
    assert c.runtime.kernel_launch_overhead_ns > 0
    hash(c)  # frozen all the way down: usable as a cache key


def test_table_values_per_generation():
    assert (TRN1.tensor.clock_hz, TRN2.tensor.clock_hz, TRN3.tensor.clock_hz) == (2.8e9, 2.4e9, 2.4e9)
    assert (TRN1.vector.clock_hz, TRN2.vector.clock_hz, TRN3.vector.clock_hz) == (1.12e9, 0.96e9, 1.2e9)
    assert (TRN1.scalar.clock_hz, TRN2.scalar.clock_hz, TRN3.scalar.clock_hz) == (1.4e9, 1.2e9, 1.2e9)
    assert all(c.tensor.mm_init_latency_cycles == 64 for c in CHIPS.values())
    assert all(c.vector.min_ii_cycles == 64 for c in CHIPS.values())
    assert TRN1.vector.dependent_overhead_cycles == 100
    assert TRN1.gpsimd.start_overhead_cycles == 150
    assert (TRN1.dma.fixed_ns, TRN2.dma.hwdge_fixed_ns, TRN1.dma.hwdge_fixed_ns) == (1300, 600, None)
    assert [c.interconnect.neuronlink_bytes_per_s_per_chip for c in (TRN1, TRN2, TRN3)] == [384e9, 1.28e12, 2.56e12]
    assert TRN2.tensor_peak_flops("float8_e4m3fn") == 158e12 and TRN3.tensor_peak_flops("mxfp8") == 315e12
    assert TRN2.tensor_peak_flops(FP32) == 20e12 and TRN1.tensor_peak_flops(BF16) == 92e12


# ---------------------------------------------------------------------------------------
# TensorE
# ---------------------------------------------------------------------------------------
def test_bf16_matmul_128x128x512_is_512_cycles():
    assert instruction_cycles(mm(), TRN2) == 512
    assert instruction_cost_ns(mm(), TRN2) == pytest.approx(213.33, abs=0.01)   # 512 / 2.4 GHz
    assert instruction_cost_ns(mm(), TRN1) == pytest.approx(182.86, abs=0.01)   # 512 / 2.8 GHz
    assert instruction_cost_ns(mm(), TRN3) == pytest.approx(213.33, abs=0.01)


def test_matmul_dtypes():
    for dt in (FP16, "tfloat32", "float8_e4m3fn"):
        assert instruction_cycles(mm(dt=dt), TRN1) == 512
    assert instruction_cycles(mm(dt=FP32), TRN2) == 4 * 512
    assert instruction_cost_ns(mm(dt=FP32), TRN2) == pytest.approx(4 * 213.33, abs=0.05)


def test_matmul_floors_at_mm_init_latency():
    for n in (1, 16, 63, 64):
        assert instruction_cycles(mm(n=n), TRN2) == TRN2.tensor.mm_init_latency_cycles
    assert instruction_cycles(mm(n=65), TRN2) == 65
    assert instruction_cycles(mm(n=32, dt=FP32), TRN2) == 4 * 64


def test_matmul_worked_examples_of_the_perf_guide():
    # PG: vector as moving ([1,128] x [128,128]): one MM every ~64 cycles.
    assert instruction_cycles(mm(k=128, m=128, n=1), TRN1) == 64
    # PG: vector as stationary (M=1), 128 moving columns: one MM every ~128 cycles.
    assert instruction_cycles(mm(k=128, m=1, n=128), TRN1) == 128
    # Fewer contraction rows or output partitions cost the same (PG).
    assert instruction_cycles(mm(k=32, m=64, n=512), TRN2) == 512


def test_fp8_double_row_and_mx():
    fp8 = "float8_e4m3fn"
    # NC-v3/v4: contraction 256 per pass for FP8 (double row) -> 2x throughput.
    assert instruction_cycles(mm(k=256, dt=fp8), TRN2) == 512
    assert instruction_cycles(mm(k=256, dt=fp8), TRN1) == 2 * 512
    mx = dataclasses.replace(mm(k=512), opcode="nc_matmul_mx")
    assert instruction_cycles(mx, TRN3) == 512


def test_tensor_transpose():
    t = lambda p, f, dt=BF16: CostInputs("nc_transpose", Engine.TENSOR, p, f, (dt,), dt)
    assert instruction_cycles(t(128, 128), TRN2) == 128          # LISA max(P, min(64, F))
    assert instruction_cycles(t(32, 128), TRN2) == 64
    assert instruction_cycles(t(128, 32), TRN2) == 128
    assert instruction_cycles(t(128, 128, FP32), TRN1) == 4 * 128  # fp32 matmul pass on NC-v2
    assert instruction_cycles(t(128, 128, FP32), TRN2) == 2 * 128  # transpose mode 2x faster (A-v3)


# ---------------------------------------------------------------------------------------
# VectorE / ScalarE / GpSimdE
# ---------------------------------------------------------------------------------------
def test_vector_tiny_op_floors_at_min_ii():
    for n in (1, 8, 32, 64):
        assert instruction_cycles(vec("tensor_scalar", n), TRN2) == 64
        assert instruction_cost_ns(vec("tensor_scalar", n), TRN2) == pytest.approx(ns(64, 0.96e9))
    assert instruction_cycles(vec("tensor_tensor", 16), TRN1) == 64
    assert instruction_cycles(act(1), TRN1) == 64


def test_tensor_tensor():
    assert instruction_cycles(vec("tensor_tensor", 512), TRN1) == 1024                    # two inputs: 2N
    assert instruction_cycles(vec("tensor_tensor", 512, mems=("psum", "sbuf")), TRN1) == 512
    bf = dict(dts=(BF16, BF16), out=BF16)
    assert instruction_cycles(vec("tensor_tensor", 512, op="add", **bf), TRN1) == 512      # LISA fast case
    assert instruction_cycles(vec("tensor_tensor", 512, op="divide", **bf), TRN1) == 1024
    assert instruction_cycles(vec("tensor_tensor", 512, op="add", contiguous=False, **bf), TRN1) == 1024
    # NC-v3 perf mode: 2x when both inputs in SBUF and all tensors BF16/FP16.
    assert instruction_cycles(vec("tensor_tensor", 512, op="divide", **bf), TRN2) == 512
    assert instruction_cycles(vec("tensor_tensor", 512, op="add", **bf), TRN2) == 256
    assert instruction_cycles(vec("tensor_tensor", 512), TRN2) == 1024                    # fp32: no perf mode
    assert instruction_cost_ns(vec("tensor_tensor", 512), TRN2) == pytest.approx(ns(1024, 0.96e9))


def test_tensor_scalar_and_copy_perf_mode():
    bf = dict(dts=(BF16,), mems=("sbuf",), out=BF16)
    for opc in ("tensor_scalar", "tensor_copy"):
        assert instruction_cycles(vec(opc, 512, dts=(FP32,), mems=("sbuf",)), TRN2) == 512
        assert instruction_cycles(vec(opc, 512, **bf), TRN1) == 512                        # NC-v2: N
        assert instruction_cycles(vec(opc, 512, **bf), TRN2) == 128                        # 4x
        assert instruction_cycles(vec(opc, 512, contiguous=False, **bf), TRN2) == 256      # 2x
        assert instruction_cycles(vec(opc, 512, dts=(BF16,), mems=("psum",), out=BF16), TRN2) == 256
        assert instruction_cycles(vec(opc, 128, **bf), TRN2) == 64                         # floor after the factor
        # NC-v4 ScalarE: up to 2x for BF16/FP16; NC-v3 ScalarE: none.
        assert instruction_cycles(vec(opc, 512, engine=Engine.SCALAR, **bf), TRN3) == 256
        assert instruction_cycles(vec(opc, 512, engine=Engine.SCALAR, **bf), TRN2) == 512


def test_other_vector_formulas():
    n = 512
    bf = dict(dts=(BF16,), mems=("sbuf",), out=BF16)
    assert instruction_cycles(vec("tensor_reduce", n, op="add", **bf), TRN1) == n / 2
    assert instruction_cycles(vec("tensor_reduce", n, op="multiply", **bf), TRN1) == n
    assert instruction_cycles(vec("tensor_reduce", n, dts=(FP32,), mems=("sbuf",), op="add"), TRN1) == n
    assert instruction_cycles(vec("tensor_tensor_scan", n), TRN1) == 2 * n
    assert instruction_cycles(vec("tensor_scalar_reduce", n), TRN1) == n + 64
    assert instruction_cycles(vec("scalar_tensor_tensor", n, dts=(BF16, BF16), op="subtract,multiply"), TRN1) == n
    assert instruction_cycles(vec("scalar_tensor_tensor", n, op="add,multiply"), TRN1) == 2 * n
    assert instruction_cycles(vec("memset", n, dts=(), mems=(), out=BF16, op="0"), TRN1) == n / 2
    assert instruction_cycles(vec("memset", n, dts=(), mems=(), out=BF16, op="1.5"), TRN1) == n
    assert instruction_cycles(vec("bn_stats", n), TRN1) == n
    assert instruction_cycles(vec("bn_aggr", 6), TRN1) == 64
    assert instruction_cycles(vec("bn_aggr", 96), TRN1) == 13 * 32
    assert instruction_cycles(vec("max8", n), TRN1) == n
    assert instruction_cycles(vec("nc_find_index8", n), TRN1) == n
    assert instruction_cycles(vec("reciprocal", n), TRN1) == 8 * n                        # VectorE 8x slower
    assert instruction_cycles(vec("reciprocal", n, engine=Engine.SCALAR), TRN1) == n
    assert instruction_cycles(vec("tensor_copy_predicated", n, mems=("sbuf", "psum")), TRN1) == n
    assert instruction_cycles(vec("tensor_copy_predicated", n, mems=("sbuf", "sbuf")), TRN1) == 2 * n
    assert instruction_cycles(vec("dropout", n), TRN1) == n
    assert instruction_cycles(vec("some_future_op", n), TRN1) == n                      # generic rule


def test_scalar_engine_activation():
    for c in CHIPS.values():
        assert instruction_cycles(act(512), c) == 512
        assert instruction_cost_ns(act(512), c) == pytest.approx(ns(512, c.scalar.clock_hz))
    assert instruction_cycles(vec("activation_reduce", 512, engine=Engine.SCALAR), TRN1) == 512 + 64
    # NC-v4 VectorE exponential: 4x activation(exp)
    assert instruction_cycles(vec("exponential", 512), TRN3) == 128


def test_gpsimd_start_cost():
    g = dict(engine=Engine.GPSIMD, dts=(), mems=())
    assert instruction_cycles(vec("iota", 512, **g), TRN1) == 150 + 512
    assert instruction_cycles(vec("affine_select", 1, **g), TRN2) == 151
    assert instruction_cost_ns(vec("iota", 512, **g), TRN1) == pytest.approx(ns(662, 1.4e9))
    assert instruction_cycles(vec("tensor_copy", 512, engine=Engine.GPSIMD), TRN1) == 512  # LISA: any engine
    assert instruction_cycles(vec("tensor_partition_reduce", 512, engine=Engine.GPSIMD), TRN1) == 150 + 1024


# ---------------------------------------------------------------------------------------
# DMA
# ---------------------------------------------------------------------------------------
def test_dma_cost_is_fixed_plus_bytes_over_effective_bandwidth():
    d = TRN2.dma
    nbytes = 128 * 4 * KiB                       # 4 KiB per partition row
    c = dma_cost(dma(nbytes), TRN2)
    assert c.engines == 16 and c.descriptors == 128
    eff = 4096 / (4096 + d.descriptor_overhead_bytes)
    assert c.efficiency == pytest.approx(eff)
    # the compiler's default DGE mode on a core with hardware DGE: its ~600 ns (assumption 9)
    expected = d.hwdge_fixed_ns + nbytes / (16 * d.engine_bytes_per_ns * eff)
    assert instruction_cost_ns(dma(nbytes), TRN2) == pytest.approx(expected)
    assert c.total_ns == pytest.approx(expected)
    # the same on trn1 with its own per-engine peak
    eff1 = TRN1.dma.efficiency(4096)
    assert instruction_cost_ns(dma(nbytes), TRN1) == pytest.approx(1300 + nbytes / (16 * 17 * eff1))


def test_dma_efficiency_follows_the_bandwidth_guide():
    d = TRN2.dma
    assert d.efficiency(128) < 0.5                     # < 256 B: a small fraction of peak
    assert 0.5 <= d.efficiency(1024) < 0.85            # 256 B - 2 KiB: below peak
    assert d.efficiency(2 * KiB) >= 0.85               # >= 2 KiB: approaches peak
    assert d.efficiency(4 * KiB) >= 0.9                # >= 4 KiB: saturates
    effs = [d.efficiency(b) for b in (64, 256, 1024, 2048, 4096, 65536)]
    assert effs == sorted(effs)


def test_dma_measured_example_of_the_dma_overview():
    # DMAO example 1: A[4, 4096] bf16 (32 KiB) HBM -> SBUF on NC-v3 uses one engine and took
    # 1416 ns of transfer.
    c = dma_cost(dma(32 * KiB, p=4), TRN2)
    assert c.engines == 1
    assert c.transfer_ns == pytest.approx(1416, rel=0.05)
    # DMAO example 2: A[128, 128] bf16 uses all 16 engines, 2 KiB each.
    c2 = dma_cost(dma(32 * KiB, p=128), TRN2)
    assert c2.engines == 16 and c2.bytes_per_descriptor == 256


def test_small_or_scattered_dma_is_slower_per_byte():
    total = 128 * 8 * KiB
    big = instruction_cost_ns(dma(total), TRN2)
    scattered = instruction_cost_ns(dma(total, chunks=128 * 64), TRN2)   # 128 B chunks
    assert scattered > 2 * big - TRN2.dma.hwdge_fixed_ns
    many_small = 64 * instruction_cost_ns(dma(total // 64), TRN2)
    assert many_small > 10 * big
    # fewer partitions -> fewer engines -> slower for the same bytes
    assert instruction_cost_ns(dma(total, p=8), TRN2) > 8 * (big - TRN2.dma.hwdge_fixed_ns)


def test_dma_fixed_cost_modes_and_transpose():
    assert dma_cost(dma(4096, dge="hwdge"), TRN2).fixed_ns == 600
    assert dma_cost(dma(4096, dge="hwdge"), TRN1).fixed_ns == 1300      # no HWDGE on NC-v2
    assert dma_cost(dma(4096), TRN2).fixed_ns == 600                      # default mode: hardware DGE's cost
    assert dma_cost(dma(4096, dge="swdge"), TRN2).fixed_ns == 1300        # descriptors written by GpSimd
    assert dma_cost(dma(4096), TRN1).fixed_ns == 1300
    assert instruction_cost_ns(dma(0), TRN2) == 600
    copy = dma_cost(dma(1 << 20), TRN2)
    tr = dma_cost(dma(1 << 20, opcode="dma_transpose"), TRN2)
    assert tr.engine_ns == pytest.approx(copy.engine_ns / 0.9)
    tr_sb = dma_cost(dma(1 << 20, src="sbuf", opcode="dma_transpose"), TRN2)
    assert tr_sb.engine_ns == pytest.approx(copy.engine_ns / 0.5)
    assert tr_sb.hbm_bytes == 0


def test_dma_hbm_bandwidth_bound():
    slow = dataclasses.replace(TRN2, hbm_bytes_per_second=8 * 100e9)      # 100 GB/s per core
    nbytes = 128 * 8 * KiB
    c = dma_cost(dma(nbytes), slow)
    assert c.hbm_ns == pytest.approx(nbytes / 100)
    assert c.total_ns == pytest.approx(600 + nbytes / 100)
    hh = dma_cost(dma(nbytes, p=1, dst="hbm"), slow)                       # HBM -> HBM: read + write
    assert hh.hbm_bytes == 2 * nbytes and hh.engines == 16


# ---------------------------------------------------------------------------------------
# the schedule
# ---------------------------------------------------------------------------------------
def no_overhead(spec):
    z = lambda e: dataclasses.replace(e, dependent_overhead_cycles=0)
    return dataclasses.replace(spec, vector=z(spec.vector), scalar=z(spec.scalar), gpsimd=z(spec.gpsimd),
                               tensor=z(spec.tensor))


def test_dependent_chain_serializes():
    spec = no_overhead(TRN2)
    prog = [
        Fake(dma(128 * 1024), rd=(hbm("x", 0, 128 * 1024),), wr=(sb(0, 1024),)),
        Fake(mm(), rd=(sb(0, 1024),), wr=(ps(0, 2048),)),
        Fake(act(512), rd=(ps(0, 2048),), wr=(sb(4096, 6144),)),
        Fake(vec("tensor_scalar", 512), rd=(sb(4096, 6144),), wr=(sb(8192, 10240),)),
        Fake(dma(128 * 2048, src="sbuf", dst="hbm"), rd=(sb(8192, 10240),), wr=(hbm("y", 0, 1 << 18),), queue=1),
    ]
    tl = schedule(prog, spec)
    durs = [instruction_cost_ns(p.ci, spec) for p in prog]
    assert tl.device_time_ns == pytest.approx(sum(durs))
    for i in range(1, len(prog)):
        assert tl.start_ns[i] == pytest.approx(tl.end_ns[i - 1])
    assert tl.preds == [[], [0], [1], [2], [3]]


def test_dependent_instructions_pay_the_static_overhead():
    # A-v2: +100 VectorE cycles for each instruction depending on the previous one.
    chain = [Fake(vec("tensor_scalar", 512), rd=(sb(i * 4096, i * 4096 + 2048),),
                  wr=(sb((i + 1) * 4096, (i + 1) * 4096 + 2048),)) for i in range(4)]
    tl = schedule(chain, TRN2)
    assert tl.device_time_ns == pytest.approx(ns(4 * 512 + 3 * 100, 0.96e9))
    # Independent back-to-back instructions do not.
    indep = [Fake(vec("tensor_scalar", 512), rd=(sb(0, 2048),), wr=(sb((i + 1) * 4096, (i + 1) * 4096 + 2048),))
             for i in range(4)]
    assert schedule(indep, TRN2).device_time_ns == pytest.approx(ns(4 * 512, 0.96e9))


def test_perf_guide_small_dependent_activations():
    # PG Opt #5a: back-to-back dependent 1-element activations on NC-v2 ran at an II of
    # ~189 ns (264 ScalarE cycles).
    prog = [Fake(act(1), rd=(sb(4 * i, 4 * i + 4),), wr=(sb(4 * i + 4, 4 * i + 8),)) for i in range(10)]
    tl = schedule(prog, TRN1)
    ii = [b - a for a, b in zip(tl.start_ns, tl.start_ns[1:])]
    assert ii == pytest.approx([ns(264, 1.4e9)] * 9)
    assert ii[0] == pytest.approx(189, abs=1)


def test_independent_engines_overlap():
    prog = [
        Fake(mm(), rd=(sb(0, 1024),), wr=(ps(0, 2048),)),
        Fake(vec("tensor_tensor", 1024), rd=(sb(10000, 12000), sb(20000, 22000)), wr=(sb(30000, 34096),)),
        Fake(act(2048), rd=(sb(40000, 48192),), wr=(sb(50000, 58192),)),
        Fake(vec("iota", 512, engine=Engine.GPSIMD, dts=(), mems=()), wr=(sb(60000, 62048),)),
        Fake(dma(128 * 4096), rd=(hbm("x", 0, 1 << 19),), wr=(sb(70000, 74096),)),
    ]
    tl = schedule(prog, TRN2)
    durs = [instruction_cost_ns(p.ci, TRN2) for p in prog]
    assert tl.start_ns == [0.0] * 5
    assert tl.device_time_ns == pytest.approx(max(durs))
    assert tl.device_time_ns < sum(durs) / 2
    assert set(tl.engine_busy_ns) == set(ENGINE_NAMES)
    for name, d in zip(("tensor", "vector", "scalar", "gpsimd", "dma"), durs):
        assert tl.engine_busy_ns[name] == pytest.approx(d)
        assert tl.engine_instructions[name] == 1
    assert tl.flops == 2 * 128 * 128 * 512 and tl.dma_bytes == 128 * 4096


def test_same_engine_runs_in_order():
    prog = [Fake(vec("tensor_scalar", 512), rd=(sb(0, 2048),), wr=(sb(4096 * (i + 1), 4096 * (i + 1) + 2048),))
            for i in range(3)]
    tl = schedule(prog, TRN2)
    d = instruction_cost_ns(prog[0].ci, TRN2)
    assert tl.start_ns == pytest.approx([0, d, 2 * d])


def test_write_after_read():
    spec = no_overhead(TRN2)
    long_read = Fake(vec("tensor_tensor", 4096), rd=(sb(0, 16384), sb(20000, 36384)), wr=(sb(40000, 56384),))
    overwrite = Fake(act(64), rd=(sb(60000, 60256),), wr=(sb(8000, 8256, p0=64, p1=65),))
    tl = schedule([long_read, overwrite], spec)
    assert tl.start_ns[1] == pytest.approx(tl.end_ns[0])
    # a write elsewhere does not wait
    elsewhere = Fake(act(64), rd=(sb(60000, 60256),), wr=(sb(100000, 100256),))
    assert schedule([long_read, elsewhere], spec).start_ns[1] == 0
    # disjoint partitions of the same bytes do not conflict either
    other_parts = Fake(act(64), rd=(sb(60000, 60256),), wr=(sb(0, 256, p0=0, p1=64),))
    narrow = dataclasses.replace(long_read, rd=(sb(0, 16384, p0=64, p1=128),))
    assert schedule([narrow, other_parts], spec).start_ns[1] == 0


def test_write_after_write_and_read_after_read():
    spec = no_overhead(TRN2)
    w1 = Fake(vec("tensor_scalar", 4096), rd=(sb(0, 16384),), wr=(sb(20000, 36384),))
    w2 = Fake(act(64), rd=(sb(60000, 60256),), wr=(sb(36000, 36500),))            # overlaps w1's output
    tl = schedule([w1, w2], spec)
    assert tl.start_ns[1] == pytest.approx(tl.end_ns[0])
    r2 = Fake(act(64), rd=(sb(0, 256),), wr=(sb(60000, 60256),))                  # reads w1's input only
    assert schedule([w1, r2], spec).start_ns[1] == 0


def test_retired_accesses_still_order_later_instructions():
    spec = no_overhead(TRN2)
    a = Fake(vec("tensor_scalar", 1024), rd=(sb(0, 4096),), wr=(sb(8192, 12288),))   # reads X
    b = Fake(vec("tensor_scalar", 64), rd=(sb(50000, 50256),), wr=(sb(0, 8192),))   # overwrites X (covers a's read)
    c = Fake(act(64), rd=(sb(60000, 60256),), wr=(sb(1000, 1100),))                  # writes into X again
    tl = schedule([a, b, c], spec)
    assert tl.start_ns[2] >= tl.end_ns[0] and tl.start_ns[2] >= tl.end_ns[1]


def test_dma_queues_run_concurrently():
    spec = TRN2
    one_engine = dma(8 * 8 * KiB, p=8)                    # 8 partitions -> one DMA engine
    d = instruction_cost_ns(one_engine, spec)
    same_q = [Fake(one_engine, rd=(hbm("x", i << 16, (i + 1) << 16),), wr=(sb(i * 8192, (i + 1) * 8192, 0, 8),))
              for i in range(4)]
    assert schedule(same_q, spec).device_time_ns == pytest.approx(4 * d)
    diff_q = [dataclasses.replace(f, queue=i) for i, f in enumerate(same_q)]
    tl = schedule(diff_q, spec)
    assert tl.device_time_ns == pytest.approx(d)
    assert tl.engine_busy_ns["dma"] == pytest.approx(d)


def test_concurrent_dmas_share_the_engines():
    spec = TRN2
    full = dma(128 * 4 * KiB)                             # all 16 engines
    c = dma_cost(full, spec)
    prog = [Fake(full, rd=(hbm("x", i << 19, (i + 1) << 19),), wr=(sb(i * 4096, (i + 1) * 4096),), queue=i)
            for i in range(2)]
    tl = schedule(prog, spec)
    # fixed costs overlap; the transfers take turns on the engines
    assert tl.device_time_ns == pytest.approx(c.fixed_ns + 2 * c.transfer_ns)
    assert tl.device_time_ns < 2 * c.total_ns


def test_concurrent_dmas_share_hbm_bandwidth():
    slow = dataclasses.replace(TRN2, hbm_bytes_per_second=8 * 20e9)        # 20 GB/s per core
    one_engine = dma(8 * 8 * KiB, p=8)
    c = dma_cost(one_engine, slow)
    assert c.hbm_ns > c.engine_ns
    prog = [Fake(one_engine, rd=(hbm("x", i << 16, (i + 1) << 16),), wr=(sb(i * 8192, (i + 1) * 8192, 8 * i, 8 * i + 8),),
                 queue=i) for i in range(4)]
    tl = schedule(prog, slow)
    assert tl.device_time_ns == pytest.approx(c.fixed_ns + 4 * c.hbm_ns)


def test_later_independent_dma_is_not_held_behind_a_waiting_one():
    spec = TRN2
    long = Fake(vec("tensor_tensor", 16384), rd=(sb(0, 65536), sb(65536, 131072)), wr=(sb(131072, 196608),))
    store = Fake(dma(128 * 4096, src="sbuf", dst="hbm"), rd=(sb(131072, 135168),), wr=(hbm("y", 0, 1 << 19),))
    load = Fake(dma(128 * 4096), rd=(hbm("x", 0, 1 << 19),), wr=(sb(200000, 204096),), queue=1)
    tl = schedule([long, store, load], spec)
    assert tl.start_ns[1] >= tl.end_ns[0]
    assert tl.start_ns[2] == 0 and tl.end_ns[2] < tl.end_ns[0]


def test_empty_program_and_totals():
    tl = schedule([], TRN2)
    assert tl.device_time_ns == 0 and tl.start_ns == [] and tl.instructions == 0
    assert tl.totals()["engine_utilization"]["tensor"] == 0


def test_roofline():
    tl = schedule([Fake(mm(), rd=(sb(0, 1024),), wr=(ps(0, 2048),))], TRN2)
    r = roofline(tl, TRN2)
    assert r.dtype == BF16 and r.peak_flops == 79e12
    assert r.tensor_fraction == pytest.approx(2 * 128 * 128 * 512 / 213.333e-9 / 79e12, rel=1e-4)
    assert r.bound == "compute" and math.isinf(r.arithmetic_intensity)
    prog = [Fake(dma(128 * 64 * KiB), rd=(hbm("x", 0, 1 << 23),), wr=(sb(0, 65536),))]
    tl = schedule(prog, TRN2)
    r = roofline(tl, TRN2)
    assert r.bound == "memory" and 0.5 < r.dma_fraction < 1.0
    assert r.lower_bound_ns <= tl.device_time_ns


def test_schedule_is_fast_for_thousands_of_instructions():
    # A tiled matmul-like loop: load, matmul (accumulate), evacuate, store, with buffer reuse.
    prog = []
    for i in range(1000):
        buf = (i % 4) * 8192
        prog.append(Fake(dma(128 * 1024), rd=(hbm("a", i * 131072, (i + 1) * 131072),), wr=(sb(buf, buf + 1024),),
                         queue=i % 4))
        prog.append(Fake(mm(), rd=(sb(buf, buf + 1024), sb(100000, 100256)), wr=(ps((i % 8) * 2048, (i % 8 + 1) * 2048),)))
        prog.append(Fake(act(512), rd=(ps((i % 8) * 2048, (i % 8 + 1) * 2048),), wr=(sb(40000 + buf, 42048 + buf),)))
        prog.append(Fake(dma(128 * 2048, src="sbuf", dst="hbm"), rd=(sb(40000 + buf, 42048 + buf),),
                         wr=(hbm("c", i * 262144, (i + 1) * 262144),), queue=4 + i % 4))
    t0 = time.perf_counter()
    tl = schedule(prog, TRN2)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"scheduling 4000 instructions took {elapsed:.2f} s"
    assert tl.instructions == 4000
    # sanity: every instruction starts after its dependencies end
    for i, ps_ in enumerate(tl.preds):
        for p in ps_:
            assert tl.start_ns[i] >= tl.end_ns[p] - 1e-6
    # and the DMA-bound loop overlaps compute with data movement
    assert tl.device_time_ns < sum(instruction_cost_ns(p.ci, TRN2) for p in prog) / 2


def test_pruned_dependencies_give_the_same_schedule_as_all_pairs():
    import random

    from torchneuron.sim import timing

    rng = random.Random(0)

    def fp():
        mem = rng.choice(["sbuf", "sbuf", "psum", "hbm:a"])
        if mem.startswith("hbm"):
            b0 = rng.randrange(0, 1 << 20, 4096) + rng.choice([0, 0, 256, 512, 768])
            period, run = rng.choice([(0, 0), (0, 0), (1024, 256), (1024, 512), (2048, 256), (3072, 256)])
            return Footprint(mem, (0, 1), (b0, b0 + rng.choice([4096, 65536, 1 << 19])), period, run)
        p0 = rng.choice([0, 0, 32, 64])
        b0 = rng.randrange(0, 16384, 256)
        return Footprint(mem, (p0, rng.choice([p0 + 32, 128])), (b0, b0 + rng.choice([256, 2048, 8192, 70000])))

    kinds = [lambda: mm(), lambda: act(rng.choice([1, 512])), lambda: vec("tensor_tensor", 256),
             lambda: vec("iota", 64, engine=Engine.GPSIMD, dts=(), mems=()), lambda: dma(rng.choice([4096, 1 << 19]))]
    prog = [Fake(rng.choice(kinds)(), rd=tuple(fp() for _ in range(rng.randint(0, 2))),
                 wr=tuple(fp() for _ in range(rng.randint(0, 2))), queue=rng.randrange(4)) for _ in range(400)]

    def all_pairs(instructions, queue_keys=None, in_order=None):
        out = []
        for i, ins in enumerate(instructions):
            deps = []
            for j in range(i):
                o = instructions[j]
                if (any(r.overlaps(w) for r in ins.reads() for w in o.writes())
                        or any(w.overlaps(x) for w in ins.writes() for x in (*o.reads(), *o.writes()))):
                    deps.append(j)
            out.append(deps)
        return out

    fast = schedule(prog, TRN2)
    original = timing.dependencies
    timing.dependencies = all_pairs
    try:
        slow = schedule(prog, TRN2)
    finally:
        timing.dependencies = original
    assert fast.start_ns == pytest.approx(slow.start_ns)
    assert fast.end_ns == pytest.approx(slow.end_ns)
    for i, deps in enumerate(slow.preds):
        for j in deps:
            assert fast.start_ns[i] >= fast.end_ns[j] - 1e-6


def test_phases_disjoint_agrees_with_the_byte_sets():
    """The periodic footprint test against the touched bytes listed out: it may answer "may meet" for sets that do
    not (it is sufficient, not exact), but never "disjoint" for sets that share a byte."""
    import random

    from torchneuron.sim.instruction import phases_disjoint

    rng = random.Random(1)

    def touched(b0, period, run, end):
        return {b for b in range(b0, end) if not period or (b - b0) % period < run}

    proved = 0
    for _ in range(3000):
        a0, b0 = rng.randrange(0, 64), rng.randrange(0, 64)
        pa, pb = rng.choice([0, 8, 12, 16, 24, 32]), rng.choice([0, 8, 12, 16, 24, 32])
        ra, rb = (rng.randrange(1, pa) if pa else 0), (rng.randrange(1, pb) if pb else 0)
        if phases_disjoint(a0, pa, ra, b0, pb, rb):
            proved += 1
            assert not touched(a0, pa, ra, 400) & touched(b0, pb, rb, 400), (a0, pa, ra, b0, pb, rb)
    assert proved > 100   # the positive answers were exercised


def test_interleaved_row_stores_of_different_heads_do_not_wait_for_each_other():
    """Two DMA writes into the rows of one [rows, heads * d] tensor, one head each (rows interleave in memory), are
    independent; a write of the same head's columns depends on the first."""
    from torchneuron.sim.memory import AP

    def head_rows(h: int, d: int = 16, heads: int = 4, rows: int = 64):
        return AP("hbm:y", "float32", ((heads * d, rows), (1, d)), offset=4 * h * d).footprint()

    first, other, same = head_rows(0), head_rows(1), head_rows(0)
    assert first.period == 256 and first.run == 64
    store = dma(64 * 64, src="sbuf", dst="hbm")
    prog = [Fake(store, wr=(first,)), Fake(store, wr=(other,), queue=1), Fake(store, wr=(same,), queue=2)]
    tl = schedule(prog, TRN2)
    assert tl.preds[1] == [] and tl.preds[2] == [0]
