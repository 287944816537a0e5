"""The NeuronCore timing model: what one instruction costs, and when each one runs.

Two parts, both driven only by the chip table (``specs.py``) and the instruction
contract (``instruction.py``):

* ``instruction_cost_ns(ci, spec)`` prices one instruction from its ``CostInputs``: the
  time it occupies its engine (for Tensor/Vector/Scalar/GpSimd the initiation interval of
  back-to-back instructions, as the public cost formulas state it; for a DMA its fixed
  cost plus its transfer time).
* ``schedule(instructions, spec)`` places a program on a time line. Each DMA queue runs its
  instructions in program order; Tensor, Vector, Scalar and GpSimd each issue, when free, the
  ready instruction earliest in program order (the compiler's reordering, ASSUMPTION 15). An
  instruction starts when its engine or queue is free and every earlier instruction it depends on (read-after-write, write-after-read, write-after-write on
  overlapping ``Footprint``\\ s) has finished; one that had to wait for a dependency also
  pays its engine's dependent-instruction overhead. DMA queues run concurrently and share
  the core's 16 DMA engines and its share of HBM bandwidth.

``docs/hardware-model.md`` explains every formula with its source.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from torchneuron.sim.instruction import CostInputs, Engine, Footprint, Instruction, phases_disjoint
from torchneuron.sim.specs import FP8_DTYPES, ChipSpec, StreamEngineSpec

ENGINE_NAMES = ("tensor", "vector", "scalar", "gpsimd", "dma")

_ONCHIP = ("sbuf", "psum")


# ---------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------
def _dt(name: str) -> str:
    """Normalise a dtype name: 'torch.bfloat16' -> 'bfloat16'."""
    return name[6:] if name.startswith("torch.") else name


def _mem(name: str) -> str:
    """Memory kind of a CostInputs memory name: 'hbm:w' -> 'hbm'."""
    return name.split(":", 1)[0]


_OP_ALIASES = {"mul": "multiply", "sub": "subtract", "plus": "add", "maximum": "max", "minimum": "min"}


def _op(name: str | None) -> str:
    """Normalise an ALU op name: 'nl.multiply' / 'np.multiply' / 'mul' -> 'multiply'."""
    if not name:
        return ""
    name = name.rsplit(".", 1)[-1].strip().lower()
    return _OP_ALIASES.get(name, name)


def _ops(name: str | None) -> list[str]:
    """Split a two-op field ('subtract,multiply' or 'subtract/multiply')."""
    if not name:
        return []
    return [_op(part) for part in name.replace("/", ",").split(",") if part.strip()]


def _is_fp32(dtypes: Iterable[str]) -> bool:
    return any(_dt(d) == "float32" for d in dtypes)


# ---------------------------------------------------------------------------------------
# TensorE
# ---------------------------------------------------------------------------------------
def tensor_cycles(ci: CostInputs, spec: ChipSpec) -> float:
    """TensorE cycles of one nc_matmul / nc_matmul_mx / nc_transpose (initiation interval).

    * nc_matmul (LISA, A-v2): ``max(min(MM_INIT_LATENCY, M), N)`` per pass for
      BF16/FP16/TF32/FP8, x ``fp32_factor`` (4) for fp32 inputs; the background fast
      LoadStationary (``M / 4``, A-v2/PG) overlaps the MM, so the II is the longer of the
      two. A pass contracts 128 rows (PE rows), 256 for FP8 with double-row (NC-v3+),
      ``mx_contraction`` (512) for MX matmuls (NC-v4).
    * nc_transpose on TensorE (LISA): ``max(P, min(64, F))``, x ``fp32_transpose_factor``.
    """
    t = spec.tensor
    dtypes = [_dt(d) for d in ci.in_dtypes]
    if ci.opcode == "nc_transpose":
        p, f = max(ci.partitions, 1), max(ci.free_elems, 1)
        cycles = max(p, min(t.mm_init_latency_cycles, f))
        return cycles * (t.fp32_transpose_factor if _is_fp32(dtypes) else 1.0)
    if ci.matmul_kmn is not None:
        k, m, n = ci.matmul_kmn
    else:
        k, m, n = ci.partitions, t.pe_cols, ci.free_elems
    k, m, n = max(k, 1), max(m, 1), max(n, 1)
    mm = max(min(t.mm_init_latency_cycles, m), n)
    ls = m / t.load_stationary_speedup
    per_pass = t.pe_rows
    if ci.opcode == "nc_matmul_mx" or any(d.startswith("mx") or d.endswith("_x4") for d in dtypes):
        per_pass = t.mx_contraction or t.pe_rows
    elif dtypes and all(d in FP8_DTYPES for d in dtypes) and t.fp8_double_row:
        per_pass = 2 * t.pe_rows
    passes = math.ceil(k / per_pass)
    cycles = max(mm, ls) * passes
    if _is_fp32(dtypes):
        cycles *= t.fp32_factor
    return cycles * ci.pe_fraction  # PE tiling: matmuls on disjoint array tiles overlap (hardware-model.md)


# ---------------------------------------------------------------------------------------
# VectorE / ScalarE / GpSimdE
# ---------------------------------------------------------------------------------------
def _perf_copy_scalar(ci: CostInputs, e: StreamEngineSpec) -> float:
    """Performance-mode factor of tensor_copy / tensor_scalar (A-v3 on VectorE, A-v4 on ScalarE).

    Full factor when input and output are in SBUF, in a perf dtype and the innermost free
    dim is contiguous; the half factor when they are in perf dtypes and either not
    contiguous (both SBUF) or contiguous with one side in PSUM.
    """
    if not e.perf_dtypes:
        return 1.0
    src_dt = _dt(ci.in_dtypes[0]) if ci.in_dtypes else _dt(ci.out_dtype)
    if src_dt not in e.perf_dtypes or _dt(ci.out_dtype) not in e.perf_dtypes:
        return 1.0
    src_mem = _mem(ci.in_memories[0]) if ci.in_memories else "sbuf"
    mems = (src_mem, _mem(ci.out_memory))
    if any(m not in _ONCHIP for m in mems):
        return 1.0
    psum_sides = mems.count("psum")
    if psum_sides == 0:
        return e.perf_copy_scalar_full if ci.contiguous else e.perf_copy_scalar_half
    if psum_sides == 1 and ci.contiguous:
        return e.perf_copy_scalar_half
    return 1.0


def _tensor_tensor(ci: CostInputs, e: StreamEngineSpec, n: float) -> float:
    mems = [_mem(m) for m in ci.in_memories[:2]]
    dts = [_dt(d) for d in ci.in_dtypes[:2]] + [_dt(ci.out_dtype)]
    if sorted(mems) == ["psum", "sbuf"]:
        base = n                                           # LISA: one input in PSUM, one in SBUF
    elif (mems == ["sbuf", "sbuf"] and all(d == "bfloat16" for d in dts)
          and _op(ci.op) in ("add", "multiply", "subtract") and ci.contiguous):
        base = n                                           # LISA: the fast BF16 case
    else:
        base = 2 * n                                       # LISA, A-v2: two inputs ~ 2N
    if mems == ["sbuf", "sbuf"] and e.perf_dtypes and all(d in e.perf_dtypes for d in dts):
        base /= e.perf_tensor_tensor                       # A-v3 perf mode: 2x
    return base


def stream_cycles(ci: CostInputs, spec: ChipSpec) -> float:
    """Cycles of one VectorE/ScalarE/GpSimdE instruction in its engine's clock (its II).

    N is ``free_elems`` (elements per partition of the main input); the partition count
    does not matter (128 lanes, one per partition). Every formula is floored at MIN_II
    (LISA writes the floor on most formulas; applying it to all is an ASSUMPTION).
    """
    engine = ci.engine.value
    e = spec.stream_engine(engine)
    n = float(max(ci.free_elems, 0))
    lo = e.min_ii_cycles
    op = ci.opcode
    dts = [_dt(d) for d in ci.in_dtypes]
    out = _dt(ci.out_dtype)

    if op == "tensor_tensor":
        c = _tensor_tensor(ci, e, n)
    elif op in ("tensor_scalar", "tensor_copy"):
        c = n / _perf_copy_scalar(ci, e)                    # LISA N; A-v3/A-v4 perf mode
    elif op == "tensor_scalar_reduce":
        return max(lo, n) + lo                              # LISA
    elif op == "tensor_reduce":
        fast = bool(dts) and dts[0] == "bfloat16" and out == "bfloat16" and _op(ci.op) in ("add", "max")
        c = n / 2 if fast else n                            # LISA
    elif op == "tensor_tensor_scan":
        c = 2 * n                                           # LISA
    elif op == "scalar_tensor_tensor":
        ops = _ops(ci.op)
        fast = (len(dts) >= 2 and dts[0] == "bfloat16" and dts[-1] == "bfloat16"
                and ops[:2] == ["subtract", "multiply"] and int(n) % 2 == 0)
        c = n if fast else 2 * n                            # LISA
    elif op == "tensor_copy_predicated":
        mems = {_mem(m) for m in ci.in_memories[:2]}
        c = n if len(mems) > 1 else 2 * n                   # LISA
    elif op == "memset":
        zero = (ci.op or "").strip().lower() in ("0", "0.0", "zero")
        c = n / 2 if zero and out in ("bfloat16", "float16") else n   # LISA
    elif op == "reciprocal" and engine != "scalar":
        c = 8 * n                                           # LISA, SHR: 8x ScalarE's reciprocal
    elif op == "bn_aggr":
        c = 13 * (n / 3)                                    # LISA
    elif op in ("activation", "reciprocal"):
        c = n                                               # LISA, A-v2
    elif op == "activation_reduce":
        return max(lo, n) + lo                              # LISA, A-v2
    elif op == "exponential":
        # A-v4, MIG: 4x the throughput of ScalarE activation(exp) = N ScalarE cycles.
        c = n / e.exp_speedup * (e.clock_hz / spec.scalar.clock_hz)
    elif op in ("iota", "affine_select"):
        c = e.start_overhead_cycles + n                     # LISA: GPSIMD_START + N
    elif op == "tensor_partition_reduce":
        c = e.start_overhead_cycles + 2 * n                 # ASSUMPTION: NO NUMBER; start + two passes
    elif op in ("rand", "random", "rng"):
        c = n / e.rand_elems_per_lane_cycle                 # A-v4 (4/lane/cycle); ASSUMPTION 1 before
    elif op == "quantize_mx":
        c = n / 4                                           # A-v4: 4 input elements per partition per cycle
    elif op in ("bn_stats", "dropout", "range_select", "nc_stream_shuffle", "nc_transpose",
                "nc_match_replace8", "select", "max8", "nc_find_index8"):
        c = n                                               # LISA
    elif op in ("select_reduce", "activate2"):
        c = n                                               # ASSUMPTION: LISA's select / activation rule (N)
    elif op == "topk":
        c = n                                               # ISA: 4 n + K, carried in free_elems
    elif op == "sequence_bounds":
        c = e.start_overhead_cycles + 2 * n                 # ASSUMPTION: NO NUMBER; start + a forward and a backward pass
    else:
        # Any other instruction: one element per lane per cycle, plus the GpSimd start cost
        # on GpSimdE (ASSUMPTION: the generic streaming rule, A-v2).
        c = n + (e.start_overhead_cycles if engine == "gpsimd" else 0)
    return max(lo, c)


# ---------------------------------------------------------------------------------------
# DMA
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DmaCost:
    """The parts of one DMA instruction's cost."""

    fixed_ns: float              # descriptor setup, sync, semaphore-to-start
    engines: int                 # DMA engines the transfer is split over
    descriptors: int             # contiguous chunks (DMA buffers)
    bytes_per_descriptor: float
    efficiency: float            # fraction of engine peak reached
    engine_ns: float             # streaming time on each engine (bytes / engines / effective rate)
    hbm_bytes: int               # bytes read from plus written to HBM
    hbm_ns: float                # hbm_bytes at the core's share of HBM bandwidth

    @property
    def transfer_ns(self) -> float:
        return max(self.engine_ns, self.hbm_ns)

    @property
    def total_ns(self) -> float:
        return self.fixed_ns + self.transfer_ns


def dma_cost(ci: CostInputs, spec: ChipSpec) -> DmaCost:
    """Price a DMA: fixed cost + bytes / effective bandwidth.

    * Engines: a transfer touching SBUF/PSUM uses one engine per 8 partitions, up to 16
      (DMAO); an HBM->HBM copy one engine per 32 KiB, up to 16 (ASSUMPTION).
    * Descriptors: at least one per partition row on the SBUF side (A-v2: partitions are
      not contiguous), or ``dma_chunks`` if more (non-contiguous access). Efficiency
      ``b / (b + descriptor_overhead_bytes)`` for ``b`` bytes per descriptor reproduces the
      DMABW curve (small rows are a small fraction of peak, >= 4 KiB rows saturate).
    * Each engine streams ``bytes / engines`` at ``engine_bytes_per_ns * efficiency``;
      DMA transposes at 90 % (from HBM) or 50 % (SBUF->SBUF) of that (A-v3).
    * HBM traffic is bounded by the core's share of chip HBM bandwidth (DERIVED).
    * Fixed cost: ~1300 ns (DMABW); ~600 ns for a DMA that is not software-DGE on a core with
      hardware DGE (A-v3, DGE; ASSUMPTION 9 for the compiler's default mode).
    """
    d = spec.dma
    nbytes = max(int(ci.dma_bytes), 0)
    srcs = [_mem(m) for m in ci.in_memories] or ["hbm"]
    dst = _mem(ci.out_memory)
    mems = srcs + [dst]
    if any(m in _ONCHIP for m in mems):
        rows = max(int(ci.partitions), 1)
        engines = min(d.engines_per_core, math.ceil(rows / d.partitions_per_engine))
        descriptors = max(int(ci.dma_chunks), rows)
    else:
        engines = min(d.engines_per_core, max(1, math.ceil(nbytes / d.hbm_hbm_bytes_per_engine)))
        descriptors = max(int(ci.dma_chunks), engines)
    bpd = nbytes / descriptors
    eff = d.efficiency(bpd)
    if ci.opcode == "dma_transpose":
        factor = d.transpose_hbm_efficiency if "hbm" in srcs else d.transpose_sbuf_efficiency
        eff *= factor if factor is not None else 1.0
    engine_ns = (nbytes / engines) / (d.engine_bytes_per_ns * eff) if nbytes else 0.0
    hbm_bytes = nbytes * sum(1 for m in mems if m == "hbm")
    hbm_ns = hbm_bytes / (spec.hbm_bytes_per_second_per_core / 1e9)
    # Software DGE (descriptors written by GpSimd) and chips without hardware DGE pay the full
    # semaphore-to-start cost; elsewhere the compiler's default choice ("unknown": hardware DGE or
    # descriptors prepared in HBM, the lower-latency modes, DGE) is priced at hardware DGE's
    # ~600 ns (ASSUMPTION 9).
    mode = (getattr(ci, "dge_mode", None) or "").lower()
    fixed = d.hwdge_fixed_ns if (mode != "swdge" and d.hwdge_fixed_ns is not None) else d.fixed_ns
    return DmaCost(fixed_ns=fixed, engines=engines, descriptors=descriptors, bytes_per_descriptor=bpd,
                   efficiency=eff, engine_ns=engine_ns, hbm_bytes=hbm_bytes, hbm_ns=hbm_ns)


# ---------------------------------------------------------------------------------------
# one instruction
# ---------------------------------------------------------------------------------------
SEQUENCER_OPS = frozenset({"branch", "register_move", "register_load", "register_store", "loop_begin", "loop_end",
                           "while_begin", "while_end"})


def instruction_cycles(ci: CostInputs, spec: ChipSpec) -> float:
    """Cycles of a compute instruction in its own engine's clock (not defined for DMA)."""
    if ci.opcode in SEQUENCER_OPS:
        # ASSUMPTION (14): NO NUMBER; a sequencer branch or register access takes one minimum interval
        return float(spec.vector.min_ii_cycles)
    if ci.engine is Engine.TENSOR:
        return tensor_cycles(ci, spec)
    if ci.engine is Engine.DMA:
        raise ValueError("a DMA has no engine cycles; use dma_cost()")
    return stream_cycles(ci, spec)


def instruction_cost_ns(ci: CostInputs, spec: ChipSpec) -> float:
    """Nanoseconds one instruction occupies its engine or DMA queue."""
    if ci.engine is Engine.DMA:
        return dma_cost(ci, spec).total_ns
    return instruction_cycles(ci, spec) / spec.clock_hz(ci.engine.value) * 1e9


def _flops(ci: CostInputs) -> int:
    if ci.flops:
        return int(ci.flops)
    if ci.opcode in ("nc_matmul", "nc_matmul_mx") and ci.matmul_kmn is not None:
        k, m, n = ci.matmul_kmn
        return 2 * k * m * n
    return 0


# ---------------------------------------------------------------------------------------
# dependencies: a per-memory interval index
# ---------------------------------------------------------------------------------------
class _Access:
    __slots__ = ("p0", "p1", "b0", "b1", "period", "run", "idx", "alive", "mark")

    def __init__(self, fp: Footprint, idx: int):
        self.p0, self.p1 = fp.partitions
        self.b0, self.b1 = fp.byte_range
        self.period, self.run = fp.period, fp.run
        self.idx = idx
        self.alive = True
        self.mark = 0

    def covered_by(self, fp: Footprint) -> bool:
        """Whether a dense write ``fp`` rewrites every byte of this access (a strided one rewrites only some)."""
        (p0, p1), (b0, b1) = fp.partitions, fp.byte_range
        return not fp.period and p0 <= self.p0 and self.p1 <= p1 and b0 <= self.b0 and self.b1 <= b1


class _IntervalIndex:
    """Accesses of one memory, bucketed by byte range (bins); very wide ones kept apart.

    A narrow query looks at the bins it spans (and the wide accesses); a query spanning
    many bins scans the flat list of all accesses once instead.
    """

    MAX_BINS = 64

    def __init__(self, bin_bytes: int):
        self.bin = bin_bytes
        self.bins: dict[int, list[_Access]] = {}
        self.wide: list[_Access] = []
        self.all: list[_Access] = []
        self.stamp = 0

    def add(self, acc: _Access) -> None:
        self.all.append(acc)
        lo, hi = acc.b0 // self.bin, (acc.b1 - 1) // self.bin
        if hi - lo >= self.MAX_BINS:
            self.wide.append(acc)
            return
        for k in range(lo, hi + 1):
            self.bins.setdefault(k, []).append(acc)

    @staticmethod
    def _scan(lst: list[_Access], fp: Footprint, stamp: int, out: list) -> None:
        (p0, p1), (b0, b1), period, run = fp.partitions, fp.byte_range, fp.period, fp.run
        dead = 0
        for a in lst:
            if not a.alive:
                dead += 1
            elif a.mark != stamp and a.b0 < b1 and b0 < a.b1 and a.p0 < p1 and p0 < a.p1 and not (
                    period and a.period and phases_disjoint(a.b0, a.period, a.run, b0, period, run)):
                a.mark = stamp
                out.append(a)
        if dead and dead * 2 >= len(lst):
            lst[:] = [a for a in lst if a.alive]

    def query(self, fp: Footprint) -> list[_Access]:
        """The live accesses that may share a byte with ``fp``."""
        out: list[_Access] = []
        self.stamp += 1
        stamp = self.stamp
        b0, b1 = fp.byte_range
        lo, hi = b0 // self.bin, (b1 - 1) // self.bin
        if hi - lo >= self.MAX_BINS:
            self._scan(self.all, fp, stamp, out)
            return out
        for k in range(lo, hi + 1):
            lst = self.bins.get(k)
            if lst:
                self._scan(lst, fp, stamp, out)
        if self.wide:
            self._scan(self.wide, fp, stamp, out)
        return out


def _bin_bytes(memory: str) -> int:
    return 64 * 1024 if memory.startswith("hbm") else 1024


def dependencies(instructions: Sequence[Instruction],
                 queue_keys: Sequence[tuple] | None = None,
                 in_order: Callable[[tuple], bool] | None = None) -> list[list[int]]:
    """For each instruction, the earlier instructions it must wait for (RAW, WAR, WAW).

    ``in_order(queue_key)`` says whether a queue runs its instructions in program order (all
    do when it is not given). Of the conflicting instructions on one in-order queue only the
    latest is kept: it finishes last there, so waiting for it waits for all of them. On a
    queue the compiler may reorder every conflicting instruction is kept.

    An access fully covered by a later write is retired from the index (anything that
    conflicts with it also conflicts with that write, which waits for it), and a read is
    replaced by a later read of the same box on the same in-order queue, so the index stays
    small for tiled programs and the analysis is close to linear.
    """
    writes: dict[str, _IntervalIndex] = {}
    reads: dict[str, _IntervalIndex] = {}
    last_read: dict[tuple, _Access] = {}
    preds: list[list[int]] = []
    qkeys_seen: list[tuple] = []
    ordered_seen: list[bool] = []   # whether each instruction's queue runs in program order (asked once each)
    for i, ins in enumerate(instructions):
        qkey = queue_keys[i] if queue_keys is not None else (ins.engine.value, ins.queue)
        deps: set[int] = set()
        rds = [fp for fp in ins.reads() if fp.byte_range[0] < fp.byte_range[1] and fp.partitions[0] < fp.partitions[1]]
        wrs = [fp for fp in ins.writes() if fp.byte_range[0] < fp.byte_range[1] and fp.partitions[0] < fp.partitions[1]]
        for fp in rds:                                           # read-after-write
            idx = writes.get(fp.memory)
            if idx is not None:
                for a in idx.query(fp):
                    deps.add(a.idx)
        for fp in wrs:                                           # write-after-write, write-after-read
            for table in (writes, reads):
                idx = table.get(fp.memory)
                if idx is None:
                    continue
                for a in idx.query(fp):
                    if a.idx != i:
                        deps.add(a.idx)
                    if a.covered_by(fp):
                        a.alive = False
        for fp in wrs:
            idx = writes.get(fp.memory)
            if idx is None:
                idx = writes[fp.memory] = _IntervalIndex(_bin_bytes(fp.memory))
            idx.add(_Access(fp, i))
        ordered = in_order is None or in_order(qkey)
        for fp in rds:
            key = (fp.memory, fp.partitions, fp.byte_range, fp.period, fp.run, qkey)
            old = last_read.get(key) if ordered else None
            if old is not None:
                old.alive = False                                # same box, same in-order queue
            idx = reads.get(fp.memory)
            if idx is None:
                idx = reads[fp.memory] = _IntervalIndex(_bin_bytes(fp.memory))
            acc = _Access(fp, i)
            idx.add(acc)
            last_read[key] = acc
        deps.discard(i)
        qkeys_seen.append(qkey)
        ordered_seen.append(ordered)
        # Only the latest dependency on each in-order queue matters (it ends last there).
        latest: dict[tuple, int] = {}
        kept: list[int] = []
        for d in deps:
            k = qkeys_seen[d]
            if not ordered_seen[d]:
                kept.append(d)
            elif d > latest.get(k, -1):
                latest[k] = d
        preds.append(sorted([*latest.values(), *kept]))
    return preds


# ---------------------------------------------------------------------------------------
# the schedule
# ---------------------------------------------------------------------------------------
@dataclass
class Timeline:
    """A scheduled program: when each instruction ran and what the core did."""

    device_time_ns: float
    start_ns: list[float]
    end_ns: list[float]
    engine_busy_ns: dict[str, float]
    engine_instructions: dict[str, int]
    flops: int                    # all arithmetic reported by the instructions
    tensor_flops: int             # on TensorE
    tensor_flops_by_dtype: dict[str, int]
    dma_bytes: int
    hbm_bytes: int
    chip: str = ""
    preds: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def instructions(self) -> int:
        return len(self.start_ns)

    def utilization(self, engine: str) -> float:
        """Fraction of the device time the engine was busy (DMA: any transfer in flight)."""
        return self.engine_busy_ns[engine] / self.device_time_ns if self.device_time_ns else 0.0

    def totals(self) -> dict:
        """Per-kernel report: time, per-engine busy time and utilization, FLOPs, bytes."""
        return {
            "device_time_ns": self.device_time_ns,
            "instructions": self.instructions,
            "engine_busy_ns": dict(self.engine_busy_ns),
            "engine_utilization": {k: self.utilization(k) for k in ENGINE_NAMES},
            "engine_instructions": dict(self.engine_instructions),
            "flops": self.flops,
            "tensor_flops": self.tensor_flops,
            "dma_bytes": self.dma_bytes,
            "hbm_bytes": self.hbm_bytes,
        }


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def schedule(instructions: Sequence[Instruction], spec: ChipSpec,
             after: Sequence[tuple[int, int]] = ()) -> Timeline:
    """Place a program on a time line (see the module docstring for the rules).

    List scheduling in time order: among the queues whose next instruction has all its
    dependencies placed, the one that can start earliest goes next. A compute engine issues
    the ready instruction earliest in program order (in program order if the spec says the
    compiler does not reorder, or the engine branches); DMA queues are in order. A DMA occupies its queue for its fixed cost plus its transfer; the
    transfer needs ``engines`` of the core's DMA engines (the earliest free ones) and a
    slot on the core's HBM channel (bytes / per-core HBM bandwidth), so concurrent DMAs on
    different queues overlap their fixed costs and share bandwidth. ``after`` adds explicit
    (consumer, producer) waits (``NkiInstruction.depends_on``) to the data dependencies.
    """
    n = len(instructions)
    cis = [ins.cost_inputs() for ins in instructions]
    qkeys = [(ins.engine.value, ins.queue if ins.engine is Engine.DMA else 0) for ins in instructions]
    # Compute engines issue in the compiler's order, which may differ from program order
    # (ASSUMPTION 15); DMA queues are first-in first-out, and an engine that branches (a
    # dynamic loop) keeps program order: the compiler cannot move work across its branches.
    reordering = set()
    if spec.runtime.compiler_reorders:
        branching = {qkeys[i] for i, ci in enumerate(cis) if ci.opcode in SEQUENCER_OPS}
        reordering = {k for k in qkeys if k[0] != "dma" and k not in branching}
    preds = dependencies(instructions, qkeys, in_order=lambda k: k not in reordering)
    for c, p in after:  # explicit waits (depends_on): a semaphore, priced like a data dependency
        if p not in preds[c]:
            preds[c] = sorted({*preds[c], p})

    memo: dict = {}
    dur = [0.0] * n
    dmac: list[DmaCost | None] = [None] * n
    overhead = [0.0] * n
    for i, ci in enumerate(cis):
        hit = memo.get(ci)
        if hit is None:
            if ci.engine is Engine.DMA:
                dc = dma_cost(ci, spec)
                hit = (dc.total_ns, dc)
            else:
                hit = (instruction_cost_ns(ci, spec), None)
            memo[ci] = hit
        dur[i], dmac[i] = hit
        eng = qkeys[i][0]
        if eng in ("vector", "scalar", "gpsimd"):
            e = spec.stream_engine(eng)
            overhead[i] = e.dependent_overhead_cycles / e.clock_hz * 1e9
        elif eng == "tensor":
            overhead[i] = spec.tensor.dependent_overhead_cycles / spec.tensor.clock_hz * 1e9

    queues: dict[tuple, list[int]] = {}
    for i, k in enumerate(qkeys):
        queues.setdefault(k, []).append(i)
    pos = {k: 0 for k in queues}
    queue_free = {k: 0.0 for k in queues}
    left = [len(p) for p in preds]
    succs: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    dep_ready = [0.0] * n
    start = [0.0] * n
    end = [0.0] * n
    dma_free = [0.0] * spec.dma.engines_per_core
    hbm_free = 0.0

    # The heap holds (time, program index, queue key, version): for an in-order queue its head
    # instruction once ready; for a reordering engine its next issue (version-checked, as new
    # ready instructions or the engine's own progress can change it).
    heap: list[tuple[float, int, tuple, int]] = []
    pushed = [False] * n
    waiting: dict[tuple, list[tuple[float, int]]] = {k: [] for k in queues if k in reordering}
    available: dict[tuple, list[int]] = {k: [] for k in waiting}
    version = {k: 0 for k in waiting}

    def ready_at(h: int) -> float:
        return dep_ready[h] + overhead[h] if preds[h] else 0.0

    def push_head(k: tuple) -> None:
        p = pos[k]
        lst = queues[k]
        if p < len(lst) and left[lst[p]] == 0 and not pushed[lst[p]]:
            h = lst[p]
            pushed[h] = True
            heapq.heappush(heap, (max(queue_free[k], ready_at(h)), h, k, 0))

    def release(k: tuple, t: float) -> list:
        """A reordering engine's available heap, with every instruction ready by ``t`` moved into it."""
        avail, wait = available[k], waiting[k]
        while wait and wait[0][0] <= t:
            heapq.heappush(avail, heapq.heappop(wait)[1])
        return avail

    def next_issue(k: tuple) -> tuple[float, int] | None:
        """When a reordering engine issues next, and what: at the time it is free, the ready
        instruction earliest in program order; if none is ready then, the first to become ready."""
        t = queue_free[k]
        avail, wait = release(k, t), waiting[k]
        if avail:
            return t, avail[0]
        return (wait[0][0], wait[0][1]) if wait else None

    def offer(k: tuple) -> None:
        nxt = next_issue(k)
        version[k] += 1
        if nxt is not None:
            heapq.heappush(heap, (nxt[0], nxt[1], k, version[k]))

    def became_ready(h: int) -> None:
        k = qkeys[h]
        if k in waiting:
            heapq.heappush(waiting[k], (ready_at(h), h))
            offer(k)
        elif queues[k][pos[k]] == h:
            push_head(k)

    for k in queues:
        if k in waiting:
            for h in queues[k]:
                if left[h] == 0:
                    heapq.heappush(waiting[k], (0.0, h))
            offer(k)
        else:
            push_head(k)
    done = 0
    while heap:
        est, h, k, ver = heapq.heappop(heap)
        if k in waiting:
            if ver != version[k]:
                continue                                  # superseded by a later offer
            h = heapq.heappop(release(k, est))            # ready by now and earliest in program order
        dc = dmac[h]
        if dc is None:
            s, e = est, est + dur[h]
        else:
            s = est
            t0 = s + dc.fixed_ns
            if dc.engine_ns > 0 or dc.hbm_ns > 0:
                chosen = sorted(range(len(dma_free)), key=dma_free.__getitem__)[:dc.engines]
                ts = max(t0, max(dma_free[j] for j in chosen))
                te = ts + dc.engine_ns
                if dc.hbm_ns > 0:
                    hs = max(ts, hbm_free)
                    hbm_free = hs + dc.hbm_ns
                    te = max(te, hbm_free)
                for j in chosen:
                    dma_free[j] = te
                e = te
            else:
                e = t0
        start[h], end[h] = s, e
        queue_free[k] = e
        pos[k] += 1
        done += 1
        for sc in succs[h]:
            left[sc] -= 1
            if e > dep_ready[sc]:
                dep_ready[sc] = e
            if left[sc] == 0:
                became_ready(sc)
        if k in waiting:
            offer(k)
        else:
            push_head(k)
    if done != n:  # cannot happen for a program (program order is a valid order)
        raise RuntimeError(f"timing: scheduled {done} of {n} instructions")

    busy = {name: 0.0 for name in ENGINE_NAMES}
    counts = {name: 0 for name in ENGINE_NAMES}
    dma_intervals = []
    flops = tensor_flops = dma_bytes = hbm_bytes = 0
    by_dtype: dict[str, int] = {}
    for i, ci in enumerate(cis):
        eng = qkeys[i][0]
        counts[eng] += 1
        f = _flops(ci)
        flops += f
        if eng == "dma":
            dma_intervals.append((start[i], end[i]))
            dma_bytes += int(ci.dma_bytes)
            hbm_bytes += dmac[i].hbm_bytes
        else:
            busy[eng] += end[i] - start[i]
            if eng == "tensor" and f:
                tensor_flops += f
                dt = _dt(ci.in_dtypes[0]) if ci.in_dtypes else "bfloat16"
                by_dtype[dt] = by_dtype.get(dt, 0) + f
    busy["dma"] = _union_length(dma_intervals)
    return Timeline(device_time_ns=max(end, default=0.0), start_ns=start, end_ns=end,
                    engine_busy_ns=busy, engine_instructions=counts, flops=flops,
                    tensor_flops=tensor_flops, tensor_flops_by_dtype=by_dtype,
                    dma_bytes=dma_bytes, hbm_bytes=hbm_bytes, chip=spec.name, preds=preds)


# ---------------------------------------------------------------------------------------
# roofline
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roofline:
    """How close a scheduled kernel came to the modelled chip's limits."""

    device_time_ns: float
    dtype: str
    tensor_flops: int
    peak_flops: float             # TensorE peak of one core for ``dtype``
    tensor_fraction: float        # achieved / peak TensorE FLOP rate
    dma_bytes: int
    dma_fraction: float           # achieved / per-core DMA bandwidth (16 engines x peak)
    hbm_bytes: int
    hbm_fraction: float           # achieved / per-core share of HBM bandwidth
    arithmetic_intensity: float   # TensorE FLOPs per HBM byte (inf when no HBM traffic)
    ridge_intensity: float        # FLOPs per byte where the roofline turns (peak / HBM bandwidth)
    lower_bound_ns: float         # max(flops / peak, hbm bytes / HBM bandwidth, dma bytes / DMA bandwidth)

    @property
    def bound(self) -> str:
        """'compute' when TensorE is the nearer limit, else 'memory'."""
        return "compute" if self.tensor_fraction >= max(self.dma_fraction, self.hbm_fraction) else "memory"


def roofline(timeline: Timeline, spec: ChipSpec, dtype: str | None = None) -> Roofline:
    """Fraction of TensorE peak (for the matmul dtype) and of DMA/HBM bandwidth reached."""
    if dtype is None:
        by = timeline.tensor_flops_by_dtype
        dtype = max(by, key=by.get) if by else "bfloat16"
    dtype = _dt(dtype)
    peak = spec.tensor_peak_flops(dtype)
    seconds = timeline.device_time_ns * 1e-9
    dma_bw = spec.dma.bytes_per_s_per_core
    hbm_bw = spec.hbm_bytes_per_second_per_core

    def frac(amount: float, rate: float) -> float:
        return amount / (seconds * rate) if seconds > 0 else 0.0

    return Roofline(
        device_time_ns=timeline.device_time_ns, dtype=dtype, tensor_flops=timeline.tensor_flops,
        peak_flops=peak, tensor_fraction=frac(timeline.tensor_flops, peak),
        dma_bytes=timeline.dma_bytes, dma_fraction=frac(timeline.dma_bytes, dma_bw),
        hbm_bytes=timeline.hbm_bytes, hbm_fraction=frac(timeline.hbm_bytes, hbm_bw),
        arithmetic_intensity=(timeline.tensor_flops / timeline.hbm_bytes if timeline.hbm_bytes else math.inf),
        ridge_intensity=peak / hbm_bw,
        lower_bound_ns=1e9 * max(timeline.tensor_flops / peak, timeline.hbm_bytes / hbm_bw,
                                 timeline.dma_bytes / dma_bw),
    )
