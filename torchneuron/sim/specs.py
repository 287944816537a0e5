"""Chip specifications: the single table every figure of the hardware model comes from.

Each chip (``trn1``, ``trn2``, ``trn3``) is one ``ChipSpec``. Chip-level figures (cores,
HBM, on-chip memory sizes) are its top-level fields; the engines' figures are grouped in
nested frozen dataclasses (``tensor``, ``vector``, ``scalar``, ``gpsimd``, ``dma``,
``interconnect``, ``runtime``). The timing model (``timing.py``) reads nothing else.

Every figure carries a source tag in the comment next to it. The tags name documents of
the public ``aws-neuron/aws-neuron-sdk`` repository (paths in ``SOURCES`` below; the
formulas are explained in ``docs/hardware-model.md``):

  DERIVED     arithmetic on published figures (the arithmetic is written next to it)
  ASSUMPTION  the documents give no number; the value is our choice, with the reason.
              These are the model's tunable parameters.

Units: clocks in Hz, sizes in bytes, bandwidths in bytes per second (``*_bytes_per_s``)
or bytes per nanosecond (``*_bytes_per_ns``, as the DMA guides state them), times in ns,
engine costs in cycles of that engine's own clock.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

#: Source tags used in this table -> document (repository ``aws-neuron/aws-neuron-sdk``).
SOURCES: dict[str, str] = {
    "A-v2": "nki/guides/architecture/trainium_inferentia2_arch.rst",
    "A-v3": "nki/guides/architecture/trainium2_arch.rst",
    "A-v4": "nki/guides/architecture/trainium3_arch.rst",
    "HW": "about-neuron/arch/neuron-hardware/{trainium,trainium2,trainium3,neuron-core-v2,"
          "neuron-core-v3,neuron-core-v4}.rst",
    "PG": "nki/deep-dives/nki_perf_guide.rst",
    "DMAO": "nki/get-started/about/nki-dma-overview.rst",
    "DMABW": "nki/deep-dives/nki-dma-bandwidth-guide.rst",
    "DGE": "nki/deep-dives/nki-dge.rst",
    "SHR": "nki/api/nki.api.shared.rst",
    "ISA": "nki/api/nki/isa/__init__.py",
    "LISA": "general/nki/api/nki/isa/__init__.py at older commits such as ce3668b "
            "(legacy 'Estimated instruction cost' sections)",
    "MMT": "nki/guides/tutorials/matrix_multiplication.rst",
    "TS": "nki/api/nki.language.tile_size.rst",
    "MIG": "nki/migration/index.rst",
}

#: dtype names (torch spelling) of the 8-bit float formats.
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e4m3", "float8_e5m2", "float8_e4m3fnuz",
                        "float8_e5m2fnuz", "float8_e3m4", "fp8", "fp8_e4m3", "fp8_e5m2",
                        "fp8_e3m4"})


@dataclass(frozen=True)
class TensorEngineSpec:
    """TensorE: the 128x128 systolic array (matmul, transpose). Costs in TensorE cycles."""

    clock_hz: float
    pe_rows: int                     # contraction (K) per pass for BF16
    pe_cols: int                     # stationary free size (M) limit
    max_moving_free: int             # moving free size (N) of one nc_matmul (fp32 PSUM output)
    mm_init_latency_cycles: int      # floor of the matmul initiation interval
    fp32_factor: float               # fp32 matmul costs this many BF16 passes
    fp32_transpose_factor: float     # fp32 nc_transpose cost relative to BF16
    load_stationary_speedup: float   # fast LoadStationary: LS II = stationary free size / this
    fp8_double_row: bool             # FP8 contraction 256 per pass (perf_mode=double_row)
    mx_contraction: int | None       # MXFP8/MXFP4 contraction per pass (nc_matmul_mx)
    bf16_flops: float                # published peak per core, BF16/FP16/TF32
    fp8_flops: float                 # published (or DERIVED) peak per core, dense FP8
    fp32_flops: float                # published peak per core, FP32
    mx_flops: float | None           # published peak per core, MXFP8/MXFP4
    dependent_overhead_cycles: int   # extra wait of an instruction that waited on a dependency


@dataclass(frozen=True)
class StreamEngineSpec:
    """VectorE, ScalarE or GpSimdE: 128 lanes streaming the free dimension. Costs in cycles."""

    clock_hz: float
    lanes: int                          # one lane per partition
    datapath_elems_16bit: int | None    # elements per cycle, BF16/FP16 (per the datapath table)
    datapath_elems_other: int | None    # elements per cycle, other dtypes
    min_ii_cycles: int                  # MIN_II: minimum initiation interval of one instruction
    dependent_overhead_cycles: int      # extra wait of an instruction that waited on a dependency
    start_overhead_cycles: int          # fixed start cost added by iota/affine_select/... (GpSimd)
    # Performance mode (automatic in hardware; factors are throughput gains over NC-v2):
    perf_dtypes: frozenset[str]         # dtypes that qualify
    perf_copy_scalar_full: float        # tensor_copy/tensor_scalar: all SBUF, perf dtypes, contiguous
    perf_copy_scalar_half: float        # same ops: not contiguous, or one side in PSUM
    perf_tensor_tensor: float           # tensor_tensor: both inputs SBUF, all tensors perf dtypes
    exp_speedup: float                  # nisa.exponential vs ScalarE activation(exp) (Vector, v4)
    rand_elems_per_lane_cycle: float    # random numbers per lane per cycle


@dataclass(frozen=True)
class DmaSpec:
    """The DMA engines paired with one NeuronCore and the cost of one DMA instruction."""

    engines_per_core: int
    engines_per_chip: int
    queues_per_engine: int
    partitions_per_engine: int          # SBUF partitions one engine normally serves
    engine_bytes_per_ns: float          # achievable peak per engine (B/ns == GB/s)
    engine_theoretical_bytes_per_s: float
    chip_bytes_per_s: float             # chip DMA bandwidth
    fixed_ns: float                     # per-transfer fixed cost (descriptors, sync, semaphore-to-start)
    hwdge_fixed_ns: float | None        # per-instruction cost of a hardware-DGE DMA (None: no HWDGE)
    descriptor_overhead_bytes: float    # per-descriptor cost expressed in bytes of transfer time
    min_recommended_row_bytes: int      # per-partition payload that approaches peak
    saturating_row_bytes: int           # per-partition payload that saturates the engines
    hbm_hbm_bytes_per_engine: int       # HBM->HBM copies: bytes per engine before adding an engine
    transpose_hbm_efficiency: float | None   # DMA transpose HBM->SBUF vs copy
    transpose_sbuf_efficiency: float | None  # DMA transpose SBUF->SBUF vs copy

    @property
    def bytes_per_s_per_core(self) -> float:
        """Achievable DMA bandwidth of one core: engines x per-engine peak (DMAO/DMABW table)."""
        return self.engines_per_core * self.engine_bytes_per_ns * 1e9

    def efficiency(self, bytes_per_descriptor: float) -> float:
        """Fraction of engine peak reached with descriptors (contiguous chunks) of this size.

        ``b / (b + descriptor_overhead_bytes)``: each descriptor costs a fixed time, worth
        ``descriptor_overhead_bytes`` of streaming. See ``descriptor_overhead_bytes`` in the
        table for how that value reproduces the published saturation curve.
        """
        b = max(float(bytes_per_descriptor), 1.0)
        return b / (b + self.descriptor_overhead_bytes)


@dataclass(frozen=True)
class InterconnectSpec:
    """Chip-to-chip links (NeuronLink) and the collective-communication cores."""

    neuronlink_version: str
    neuronlink_bytes_per_s_per_chip: float
    cc_cores_per_chip: int


@dataclass(frozen=True)
class RuntimeSpec:
    """Figures the runtime adds around a kernel (not the core's instructions)."""

    kernel_launch_overhead_ns: float    # per launch: NEFF start-up + tear-down
    compiler_reorders: bool = True      # compute engines issue in the compiler's order, not program order


@dataclass(frozen=True)
class ChipSpec:
    """One Trainium chip model and the NeuronCore generation inside it."""

    name: str                   # TORCHNEURON_CHIP value
    core_generation: str        # NeuronCore-vN
    cores_per_chip: int
    hbm_bytes_per_chip: int
    hbm_bytes_per_second: float  # whole chip
    hbm_stacks: int
    sbuf_partitions: int
    sbuf_bytes_per_partition: int
    psum_bytes_per_partition: int
    psum_banks: int
    tensor: TensorEngineSpec
    vector: StreamEngineSpec
    scalar: StreamEngineSpec
    gpsimd: StreamEngineSpec
    dma: DmaSpec
    interconnect: InterconnectSpec
    runtime: RuntimeSpec

    # -- DERIVED figures -------------------------------------------------------------
    @property
    def hbm_bytes_per_core(self) -> int:
        """HBM capacity one NeuronCore sees: the chip's HBM divided among its cores (DERIVED)."""
        return self.hbm_bytes_per_chip // self.cores_per_chip

    @property
    def hbm_bytes_per_second_per_core(self) -> float:
        """HBM bandwidth share of one core (DERIVED: chip bandwidth / cores)."""
        return self.hbm_bytes_per_second / self.cores_per_chip

    @property
    def psum_bank_bytes_per_partition(self) -> int:
        """One PSUM bank per partition: 16 KiB / 8 banks = 2 KiB (A-v2 states 2 KiB)."""
        return self.psum_bytes_per_partition // self.psum_banks

    # -- names kept from the first version of this table (read-only views) ------------
    @property
    def tensor_clock_hz(self) -> float:
        return self.tensor.clock_hz

    @property
    def vector_clock_hz(self) -> float:
        return self.vector.clock_hz

    @property
    def scalar_clock_hz(self) -> float:
        return self.scalar.clock_hz

    @property
    def gpsimd_clock_hz(self) -> float:
        return self.gpsimd.clock_hz

    @property
    def dma_engines_per_core(self) -> int:
        return self.dma.engines_per_core

    @property
    def dma_bytes_per_second_per_core(self) -> float:
        return self.dma.bytes_per_s_per_core

    @property
    def tensor_bf16_flops_per_core(self) -> float:
        return self.tensor.bf16_flops

    @property
    def tensor_fp32_flops_per_core(self) -> float:
        return self.tensor.fp32_flops

    def stream_engine(self, engine: str) -> StreamEngineSpec:
        """The VectorE/ScalarE/GpSimdE group by engine name ("vector", "scalar", "gpsimd")."""
        return {"vector": self.vector, "scalar": self.scalar, "gpsimd": self.gpsimd}[engine]

    def clock_hz(self, engine: str) -> float:
        """Clock of an engine by name ("tensor", "vector", "scalar", "gpsimd")."""
        if engine == "tensor":
            return self.tensor.clock_hz
        return self.stream_engine(engine).clock_hz

    def tensor_peak_flops(self, dtype: str = "bfloat16") -> float:
        """Published TensorE peak of one core for a matmul input dtype (for roofline reports)."""
        if dtype in ("float32", "fp32"):
            return self.tensor.fp32_flops
        if dtype in ("mxfp8", "mxfp4", "float8_e8m0fnu") and self.tensor.mx_flops:
            return self.tensor.mx_flops
        if dtype in FP8_DTYPES:
            return self.tensor.fp8_flops
        return self.tensor.bf16_flops


# ---------------------------------------------------------------------------------------
# Figures shared by all three generations (each with its source).
# ---------------------------------------------------------------------------------------
_PE = 128                   # A-v2, A-v3, A-v4: 128x128 processing elements
_MIN_II = 64                # LISA, SHR: "roughly 64 engine cycles" (Vector, Scalar, GpSimd)
_MM_INIT = 64               # A-v2, PG: MM_INIT_LATENCY = 64 TensorE cycles on NC-v2 ("64 cycles
                            # on trn1"). NC-v3/v4: NO NUMBER -> ASSUMPTION: same 64 (LISA's
                            # nc_matmul formula uses 64 with no generation qualifier).
_LS_SPEEDUP = 4.0           # A-v2, PG: fast LoadStationary up to 4x faster than an MM of equal free size
_FP32_MM = 4.0              # A-v2, LISA: fp32 matmul about 4x the cost of BF16
_VECTOR_DEP = 100           # A-v2: "add a static instruction overhead of 100 engine cycles" for
                            # VectorE instructions that each depend on the previous one's output
_SCALAR_DEP = 200           # DERIVED from PG Opt #5a: dependent 1-element IDENTITY activations ran
                            # at an II of 264 ScalarE cycles (189 ns, NC-v2) = MIN_II 64 + 200
_GPSIMD_DEP = 100           # ASSUMPTION: documents silent for GpSimdE; VectorE's figure (A-v2)
_TENSOR_DEP = 0             # ASSUMPTION: PSUM write-back / semaphore latency has NO NUMBER; the
                            # matmul pipeline latency is represented by the MM_INIT_LATENCY floor
_GPSIMD_START = 150         # LISA (iota "150 + N", affine_select "GPSIMD_START + N")
_DMA_ENGINES = 16           # DMAO, A-v3: 16 DMA engines per NeuronCore (v2-v4)
_DMA_QUEUES = 16            # DMAO: 16 queues per engine
_DMA_PARTS_PER_ENGINE = 8   # DMAO: "each DMA engine is typically responsible for ... eight SBUF partitions"
_DMA_FIXED_NS = 1300.0      # DMABW: "~1300 ns cross-engine" descriptor setup, sync, semaphore-to-start
_DMA_DESC_BYTES = 256.0     # ASSUMPTION (the guides give a curve, no per-descriptor number): the
                            # per-descriptor cost equals 256 B of streaming, so per-partition rows
                            # of 64 B reach 20 % of peak, 256 B 50 %, 2 KiB 89 %, 4 KiB 94 %,
                            # 8 KiB 97 % -- DMABW's curve ("< 256 B severely overhead-bound",
                            # ">= 2 KiB approaches peak", ">= 4 KiB saturates") and DMAO example 1
                            # (32 KiB in 4 rows of 8 KiB on one NC-v3 engine: 1416 ns measured,
                            # 1469 ns modelled).
_DMA_DESC_BYTES_V2 = 1280.0 # ASSUMPTION (16), NC-v2: NO hardware DGE (A-v3, DGE), so every descriptor is one
                            # prepared in HBM and fetched by the engine (DGE: "each descriptor consumes HBM
                            # bandwidth on first fetch"); 1280 B (75 ns at 17 B/ns) fitted to the trn1 matmul
                            # tutorial's DMA-bound versions (MMT @4eba310f: tiled 51.80 ms, block-free 22.07 ms),
                            # run as the kernel-optimization guide's same algorithms (docs: Calibration). Rows of
                            # 4 KiB reach 76 %, near PG's "close to 70 % DMA throughput" for large transfers.
_DMA_MIN_ROW = 2 * KiB      # DMABW: ">= 2 KiB per partition (minimum recommended)"
_DMA_SAT_ROW = 4 * KiB      # DMABW, DMAO: ">= 4 KiB per partition ... saturates the DMA engines"
_DMA_HBM_PIECE = 32 * KiB   # ASSUMPTION for HBM->HBM copies (no SBUF partitions to spread by): one
                            # engine per 32 KiB, PG Opt #9's "transfers should be larger than 32 KiB"
_LAUNCH_NS = 10_000.0       # ASSUMPTION: NO NUMBER for NEFF start-up/tear-down (the docs only say it
                            # exists); 10 us, the order of a GPU launch plus a host round trip
_REORDER = True             # ISA (nki.language.no_reorder): "Without this directive, the compiler scheduler is
                            # free to reorder independent operations for better hardware utilization";
                            # ASSUMPTION (15) for how: each engine issues, when free, the ready instruction
                            # earliest in program order (a list schedule; the engines execute in that order)
_NO_PERF = frozenset()
_BF16_FP16 = frozenset({"bfloat16", "float16"})
_BF16_FP16_FP8 = _BF16_FP16 | FP8_DTYPES


def _stream(clock_hz: float, dep: int, *, lanes_16: int | None, lanes_other: int | None,
            start: int = 0, perf: frozenset[str] = _NO_PERF, full: float = 1.0, half: float = 1.0,
            tt: float = 1.0, exp: float = 1.0, rand: float = 1.0) -> StreamEngineSpec:
    return StreamEngineSpec(
        clock_hz=clock_hz, lanes=_PE, datapath_elems_16bit=lanes_16, datapath_elems_other=lanes_other,
        min_ii_cycles=_MIN_II, dependent_overhead_cycles=dep, start_overhead_cycles=start,
        perf_dtypes=perf, perf_copy_scalar_full=full, perf_copy_scalar_half=half,
        perf_tensor_tensor=tt, exp_speedup=exp, rand_elems_per_lane_cycle=rand)


CHIPS: dict[str, ChipSpec] = {
    # ---------------------------------------------------------------- Trn1 / NC-v2
    "trn1": ChipSpec(
        name="trn1",
        core_generation="NeuronCore-v2",
        cores_per_chip=2,                     # A-v2
        hbm_bytes_per_chip=32 * GiB,          # A-v2: 2 stacks, 32 GiB
        hbm_bytes_per_second=820e9,           # A-v2 (HW trainium.rst: "820 GiB/sec")
        hbm_stacks=2,                         # A-v2
        sbuf_partitions=128,                  # A-v2
        sbuf_bytes_per_partition=192 * KiB,   # A-v2: 24 MiB = 128 x 192 KiB
        psum_bytes_per_partition=16 * KiB,    # A-v2: 2 MiB = 128 x 16 KiB
        psum_banks=8,                         # A-v2: 8 banks x 2 KiB per partition
        tensor=TensorEngineSpec(
            clock_hz=2.8e9,                   # A-v2
            pe_rows=_PE, pe_cols=_PE,         # A-v2
            max_moving_free=512,              # A-v2, TS: N <= 512 (one 2 KiB PSUM bank of fp32)
            mm_init_latency_cycles=_MM_INIT,  # A-v2, PG: 64 cycles on NC-v2
            fp32_factor=_FP32_MM,             # A-v2, LISA
            fp32_transpose_factor=_FP32_MM,   # ASSUMPTION: an fp32 transpose is an fp32 matmul pass (no transpose mode on NC-v2)
            load_stationary_speedup=_LS_SPEEDUP,  # A-v2, PG
            fp8_double_row=False,             # A-v3: double-row FP8 is new in NC-v3 (cFP8 runs at BF16 rate, A-v2)
            mx_contraction=None,              # A-v4: MX matmul is new in NC-v4
            bf16_flops=92e12,                 # A-v2 (DERIVED check: 128*128*2*2.8 GHz = 91.75 T)
            fp8_flops=92e12,                  # A-v2: cFP8 at the BF16 rate
            fp32_flops=23e12,                 # A-v2
            mx_flops=None,
            dependent_overhead_cycles=_TENSOR_DEP,
        ),
        vector=_stream(1.12e9, _VECTOR_DEP,   # A-v2 clock
                       lanes_16=128, lanes_other=128),  # A-v2: 128 elem/cycle; no perf mode on NC-v2
        scalar=_stream(1.4e9, _SCALAR_DEP,    # A-v2 clock
                       lanes_16=128, lanes_other=128),  # A-v2
        gpsimd=_stream(1.4e9, _GPSIMD_DEP,    # A-v2 clock
                       lanes_16=128, lanes_other=128,   # DERIVED (A-v2): 8 cores x 16 lanes of 32 bit
                       start=_GPSIMD_START),
        dma=DmaSpec(
            engines_per_core=_DMA_ENGINES, engines_per_chip=32,  # A-v2, DMAO
            queues_per_engine=_DMA_QUEUES, partitions_per_engine=_DMA_PARTS_PER_ENGINE,
            engine_bytes_per_ns=17.0,                     # DMABW, DMAO: 17 B/ns peak (16 x 17 = 272 GB/s)
            engine_theoretical_bytes_per_s=27.2e9,        # DMAO (A-v2: 27 GiB/s)
            chip_bytes_per_s=1e12,                        # HW (trainium.rst)
            fixed_ns=_DMA_FIXED_NS,                       # DMABW
            hwdge_fixed_ns=None,                          # A-v3: hardware DGE is new in NC-v3
            descriptor_overhead_bytes=_DMA_DESC_BYTES_V2,  # ASSUMPTION (16; see _DMA_DESC_BYTES_V2)
            min_recommended_row_bytes=_DMA_MIN_ROW, saturating_row_bytes=_DMA_SAT_ROW,
            hbm_hbm_bytes_per_engine=_DMA_HBM_PIECE,
            transpose_hbm_efficiency=None, transpose_sbuf_efficiency=None,  # A-v3: DMA transpose is NC-v3+
        ),
        interconnect=InterconnectSpec(
            neuronlink_version="NeuronLink-v2",           # HW (trainium.rst)
            neuronlink_bytes_per_s_per_chip=384e9,        # HW (trainium2.rst comparison table: Trainium 384 GB/s/chip)
            cc_cores_per_chip=6,                          # HW (trainium2.rst comparison table)
        ),
        runtime=RuntimeSpec(kernel_launch_overhead_ns=_LAUNCH_NS,  # ASSUMPTION
                            compiler_reorders=_REORDER),  # ISA, ASSUMPTION (15)
    ),
    # ---------------------------------------------------------------- Trn2 / NC-v3
    "trn2": ChipSpec(
        name="trn2",
        core_generation="NeuronCore-v3",
        cores_per_chip=8,                     # A-v3
        hbm_bytes_per_chip=96 * GiB,          # A-v3: 4 stacks, 96 GiB
        hbm_bytes_per_second=2.9e12,          # HW (A-v3 rounds to 3 TB/s)
        hbm_stacks=4,                         # A-v3
        sbuf_partitions=128,                  # A-v3
        sbuf_bytes_per_partition=224 * KiB,   # A-v3: 28 MiB = 128 x 224 KiB
        psum_bytes_per_partition=16 * KiB,    # A-v3
        psum_banks=8,                         # A-v3
        tensor=TensorEngineSpec(
            clock_hz=2.4e9,                   # A-v3
            pe_rows=_PE, pe_cols=_PE,         # A-v3
            max_moving_free=512,              # A-v3, TS
            mm_init_latency_cycles=_MM_INIT,  # ASSUMPTION (NO NUMBER for NC-v3; see _MM_INIT)
            fp32_factor=_FP32_MM,             # A-v2, LISA; A-v3 peaks agree: 79/20 ~ 4
            fp32_transpose_factor=2.0,        # A-v3: transpose mode makes fp32 transposes 2x faster (4/2)
            load_stationary_speedup=_LS_SPEEDUP,  # A-v2, PG (no NC-v3 figure; ASSUMPTION: unchanged)
            fp8_double_row=True,              # A-v3, ISA: contraction 256 per pass for FP8
            mx_contraction=None,
            bf16_flops=79e12,                 # A-v3 (DERIVED check: 128*128*2*2.4 GHz = 78.6 T)
            fp8_flops=158e12,                 # A-v3
            fp32_flops=20e12,                 # A-v3
            mx_flops=None,
            dependent_overhead_cycles=_TENSOR_DEP,
        ),
        vector=_stream(0.96e9, _VECTOR_DEP,   # A-v3 clock; overhead ASSUMPTION: NC-v2 figure (A-v2)
                       lanes_16=512, lanes_other=256,   # A-v3 datapath table
                       perf=_BF16_FP16,                 # A-v3: perf mode for BF16/FP16
                       full=4.0, half=2.0, tt=2.0),     # A-v3: 4x / 2x / 2x over NC-v2
        scalar=_stream(1.2e9, _SCALAR_DEP,    # A-v3 clock; overhead ASSUMPTION: NC-v2 figure (PG)
                       lanes_16=128, lanes_other=128),  # A-v3 datapath table
        gpsimd=_stream(1.2e9, _GPSIMD_DEP,    # A-v3 clock
                       lanes_16=None, lanes_other=None, # A-v3 datapath table: not stated
                       start=_GPSIMD_START),            # LISA (ASSUMPTION: unchanged on NC-v3)
        dma=DmaSpec(
            engines_per_core=_DMA_ENGINES, engines_per_chip=128,  # A-v3, DMAO
            queues_per_engine=_DMA_QUEUES, partitions_per_engine=_DMA_PARTS_PER_ENGINE,
            engine_bytes_per_ns=23.0,                     # DMABW, DMAO: 23 B/ns (16 x 23 = 368 GB/s)
            engine_theoretical_bytes_per_s=27.2e9,        # DMAO
            chip_bytes_per_s=3.5e12,                      # HW (trainium2.rst)
            fixed_ns=_DMA_FIXED_NS,                       # DMABW
            hwdge_fixed_ns=600.0,                         # A-v3, DGE: "about 600 ns" per DGE DMA instruction
            descriptor_overhead_bytes=_DMA_DESC_BYTES,    # ASSUMPTION
            min_recommended_row_bytes=_DMA_MIN_ROW, saturating_row_bytes=_DMA_SAT_ROW,
            hbm_hbm_bytes_per_engine=_DMA_HBM_PIECE,
            transpose_hbm_efficiency=0.9,                 # A-v3: "up to 90 %" of DMA copy throughput
            transpose_sbuf_efficiency=0.5,                # A-v3: "up to 50 %"
        ),
        interconnect=InterconnectSpec(
            neuronlink_version="NeuronLink-v3",           # HW (trainium2.rst)
            neuronlink_bytes_per_s_per_chip=1.28e12,      # HW (trainium2.rst: 1.28 TB/sec per chip)
            cc_cores_per_chip=20,                         # HW (trainium2.rst)
        ),
        runtime=RuntimeSpec(kernel_launch_overhead_ns=_LAUNCH_NS,  # ASSUMPTION
                            compiler_reorders=_REORDER),  # ISA, ASSUMPTION (15)
    ),
    # ---------------------------------------------------------------- Trn3 / NC-v4
    "trn3": ChipSpec(
        name="trn3",
        core_generation="NeuronCore-v4",
        cores_per_chip=8,                     # A-v4
        hbm_bytes_per_chip=144 * GiB,         # A-v4: 4 stacks, 144 GiB
        hbm_bytes_per_second=4.7e12,          # A-v4 (HW says 4.9 TB/s)
        hbm_stacks=4,                         # A-v4
        sbuf_partitions=128,                  # A-v4
        sbuf_bytes_per_partition=256 * KiB,   # DERIVED: 32 MiB / 128 partitions (A-v4)
        psum_bytes_per_partition=16 * KiB,    # A-v4
        psum_banks=8,                         # A-v4
        tensor=TensorEngineSpec(
            clock_hz=2.4e9,                   # A-v4
            pe_rows=_PE, pe_cols=_PE,         # A-v4
            max_moving_free=4096,             # ISA: up to 4096 (fp32 dst) / 8192 (bf16 dst) on NC-v4
            mm_init_latency_cycles=_MM_INIT,  # ASSUMPTION (NO NUMBER for NC-v4; see _MM_INIT)
            fp32_factor=_FP32_MM,             # A-v2, LISA; A-v4 peaks agree: 79/20 ~ 4
            fp32_transpose_factor=2.0,        # A-v3 transpose mode (ASSUMPTION: kept on NC-v4)
            load_stationary_speedup=_LS_SPEEDUP,  # A-v2, PG (ASSUMPTION: unchanged)
            fp8_double_row=True,              # A-v3, ISA: double-row FP8 on NC-v3/v4
            mx_contraction=512,               # A-v4: MX matmul contraction 512 per pass
            bf16_flops=79e12,                 # A-v4
            fp8_flops=158e12,                 # DERIVED: double-row FP8 = 2 x BF16 (A-v4 publishes only MX)
            fp32_flops=20e12,                 # A-v4
            mx_flops=315e12,                  # A-v4
            dependent_overhead_cycles=_TENSOR_DEP,
        ),
        vector=_stream(1.2e9, _VECTOR_DEP,    # A-v4 clock; overhead ASSUMPTION: NC-v2 figure (A-v2)
                       lanes_16=512, lanes_other=256,   # A-v4 datapath table (512 BF16/FP16/FP8)
                       perf=_BF16_FP16_FP8,             # ASSUMPTION: NC-v3 perf mode (A-v3, referred to by
                       full=4.0, half=2.0, tt=2.0,      # A-v4) extended to FP8 per A-v4's datapath table
                       exp=4.0,                         # A-v4, MIG: nisa.exponential 4x activation(exp)
                       rand=4.0),                       # A-v4: XORWOW 4 x 32-bit per lane per cycle
        scalar=_stream(1.2e9, _SCALAR_DEP,    # A-v4 clock; overhead ASSUMPTION: NC-v2 figure (PG)
                       lanes_16=256, lanes_other=128,   # A-v4 datapath table
                       perf=_BF16_FP16,                 # A-v4: ScalarE tensor_scalar/tensor_copy
                       full=2.0, half=2.0),             # A-v4: "up to 2x" for BF16/FP16
        gpsimd=_stream(1.2e9, _GPSIMD_DEP,    # A-v4 clock
                       lanes_16=128, lanes_other=128,   # A-v4 datapath table
                       start=_GPSIMD_START),            # LISA (ASSUMPTION: unchanged on NC-v4)
        dma=DmaSpec(
            engines_per_core=_DMA_ENGINES, engines_per_chip=128,  # A-v4, DMAO
            queues_per_engine=_DMA_QUEUES, partitions_per_engine=_DMA_PARTS_PER_ENGINE,
            engine_bytes_per_ns=33.0,                     # DMABW, DMAO: 33 B/ns (16 x 33 = 528 GB/s)
            engine_theoretical_bytes_per_s=38.4e9,        # DMAO
            chip_bytes_per_s=4.9e12,                      # HW (trainium3.rst)
            fixed_ns=_DMA_FIXED_NS,                       # DMABW
            hwdge_fixed_ns=600.0,                         # A-v3, DGE (ASSUMPTION: NC-v3 figure kept)
            descriptor_overhead_bytes=_DMA_DESC_BYTES,    # ASSUMPTION
            min_recommended_row_bytes=_DMA_MIN_ROW, saturating_row_bytes=_DMA_SAT_ROW,
            hbm_hbm_bytes_per_engine=_DMA_HBM_PIECE,
            transpose_hbm_efficiency=0.9,                 # A-v3 (ASSUMPTION: kept on NC-v4)
            transpose_sbuf_efficiency=0.5,                # A-v3 (ASSUMPTION: kept on NC-v4)
        ),
        interconnect=InterconnectSpec(
            neuronlink_version="NeuronLink-v4",           # HW (trainium3.rst)
            neuronlink_bytes_per_s_per_chip=2.56e12,      # HW (trainium3.rst: 2.56 TB/sec per device)
            cc_cores_per_chip=16,                         # HW (trainium3.rst)
        ),
        runtime=RuntimeSpec(kernel_launch_overhead_ns=_LAUNCH_NS,  # ASSUMPTION
                            compiler_reorders=_REORDER),  # ISA, ASSUMPTION (15)
    ),
}


def chip_spec(name: str) -> ChipSpec:
    """Look up a chip model by its TORCHNEURON_CHIP name."""
    try:
        return CHIPS[name]
    except KeyError:
        raise ValueError(f"unknown neuron chip {name!r}: expected one of {sorted(CHIPS)}") from None
