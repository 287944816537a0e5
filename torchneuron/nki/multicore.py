"""Multi-core kernels: launches over several NeuronCores, and the instructions that move data between them
(``nisa.core_barrier``, ``nisa.sendrecv`` and the ``nki.collectives``).

A kernel launched as ``kernel[n](...)`` (``n`` = 2: a logical NeuronCore of two physical cores, LNC=2) or over
a grid is traced once per instance. Instance ``i`` (the row-major index of its program id) runs on its own
physical core, with its own SBUF, PSUM and registers; the instances share the kernel's HBM tensors, as the
cores of a logical NeuronCore share their HBM. On one rank, instances beyond the chip's cores (8 on trn2) wait
for the earlier ones on core ``i % 8``.

``kernel[n].ranks(w)`` launches ``w`` collective ranks at once, as ``w`` processes would each launch the
kernel: rank ``r`` has its own HBM tensors (its slice of every argument, its own ``shared_hbm`` tensors) and
its instances run on physical cores ``r*n .. r*n+n-1`` of consecutive chips (chip ``core // 8``), so a replica
group may span chips and is then timed over NeuronLink. ``nki.collectives`` move data between ranks;
``sendrecv`` and ``core_barrier`` between the instances of one rank.

The launch's instructions in instance order are also one plain ``Program`` (``LaunchProgram``), which one core
runs instance after instance with the same results when nothing crosses cores (the runtime's path on neuron
tensors). Cross-core instructions (``CrossCore``) split each instance's program into segments; such a launch
runs segment by segment on every core, the exchanges between. Every instance must issue the same cross-core
instructions in the same order (the SPMD rule of the reference); the launch refuses mismatched ones.

Timing: each core's segments are scheduled by the single-core timing model (``sim.timing``). A cross-core
instruction is a fence for the instances of each of its groups: it starts when the last of them reaches it and
lasts what the process group's cost model (``torchneuron.distributed.cost``) gives for that collective, its
size and the placement of its group (``topology``); each instance's next segment starts after it. The launch
lasts as long as its slowest core, not the sum of its instances.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Sequence

import torch

from torchneuron.distributed.cost import collective_ns
from torchneuron.distributed.topology import links, placement
from torchneuron.sim import NeuronCore, Program, SimulatorError
from torchneuron.sim.core import RunReport, host_binding
from torchneuron.sim.instruction import CostInputs, Engine, Footprint
from torchneuron.sim.isa import Instr
from torchneuron.sim.memory import AP, Memory
from torchneuron.sim.numerics import apply_alu, compute_dtype
from torchneuron.sim.program import ArgSlot
from torchneuron.sim.specs import ChipSpec
from torchneuron.sim import timing

#: Collective kinds and the cost-model formula (``distributed/cost.py``) each is priced with.
COST_KIND = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_v": "all_gather",
             "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all", "all_to_all_v": "all_to_all",
             "collective_permute": "send", "collective_permute_implicit": "send",
             "collective_permute_implicit_reduce": "send", "sendrecv": "send", "core_barrier": "barrier"}
REDUCE_OPS = ("add", "minimum", "maximum")


@dataclass(frozen=True)
class CrossCore(Instr):
    """One rank's part of an instruction that moves data between the NeuronCores of a launch.

    ``kind`` names it (``all_reduce``, ``sendrecv``, ``core_barrier``, ...). ``groups``: the rank lists that
    exchange among themselves (replica groups; the barrier's cores). ``pairs``: (source, target) ranks of a
    collective permute, or this rank's (send_to, recv_from) of a sendrecv. ``srcs1``: the second operands of
    an implicit permute with reduction. ``metadata``: the counts tensor of the ``_v`` collectives."""

    kind: str
    rank: int                   # the collective rank issuing it
    lane: int = 0               # its instance within the rank (program id, row-major)
    srcs: tuple[AP, ...] = ()
    dsts: tuple[AP, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    op: str | None = None
    dim: int = 0
    pairs: tuple[tuple[int, int], ...] = ()
    srcs1: tuple[AP, ...] = ()
    metadata: AP | None = None
    recv_counts_known: bool = True
    has_rdispls: bool = False
    pipe: int = 0
    engine: Engine = Engine.GPSIMD
    ENGINES = (Engine.GPSIMD, Engine.DMA, Engine.VECTOR, Engine.SCALAR, Engine.TENSOR)

    def check(self) -> None:
        if self.kind not in COST_KIND:
            raise SimulatorError(f"unknown cross-core instruction {self.kind!r}")
        self._set("opcode", self.kind)

    @cached_property
    def _operands(self) -> tuple[tuple[str, AP], ...]:
        named = [(f"{field}[{i}]", ap) for field in ("srcs", "srcs1", "dsts") for i, ap in enumerate(getattr(self, field))]
        return tuple(named + ([("metadata", self.metadata)] if self.metadata is not None else []))

    def reads(self) -> tuple[Footprint, ...]:
        return tuple(ap.footprint() for n, ap in self._operands if not n.startswith("dsts"))

    def writes(self) -> tuple[Footprint, ...]:
        meta = (self.metadata.footprint(),) if self.metadata is not None and not self.recv_counts_known else ()
        return tuple(ap.footprint() for n, ap in self._operands if n.startswith("dsts")) + meta

    def price(self) -> CostInputs:
        return CostInputs(opcode=self.kind, engine=self.engine, partitions=1, free_elems=1, flops=0)

    def execute(self, core: NeuronCore) -> None:
        raise SimulatorError(f"{self.kind}: moves data between NeuronCores; it runs in a multi-core launch "
                             f"(kernel[n] on NumPy arrays or CPU tensors), not on one core")

    @property
    def nbytes(self) -> int:
        """The collective's size S in the cost formula (``distributed/cost.py``): the full tensor for all-reduce,
        the gathered size for all-gather, the input for reduce-scatter and all-to-all, one message otherwise.
        The ``_v`` collectives are priced at their buffers' capacity (the counts are only known at run time)."""
        if self.kind == "core_barrier":
            return 0
        if self.kind in ("all_gather", "all_gather_v"):
            return sum(ap.nbytes for ap in self.dsts)
        if self.kind.startswith("collective_permute_implicit"):
            return max(ap.nbytes for ap in self.srcs)  # channels move concurrently
        return sum(ap.nbytes for ap in self.srcs)

    def fence_groups(self, world: int, lnc: int) -> tuple[tuple[int, ...], ...]:
        """The instances (``rank * lnc + lane``) that wait for each other at this instruction."""
        if self.kind in ("sendrecv", "core_barrier"):  # within each rank: its instances (the barrier's cores)
            lanes = range(lnc) if self.kind == "sendrecv" else self.groups[0]
            return tuple(tuple(r * lnc + c for c in lanes) for r in range(world))
        groups = (tuple(sorted({r for p in self.pairs for r in p})),) if self.kind == "collective_permute" \
            else self.groups
        return tuple(tuple(r * lnc + c for r in g for c in range(lnc)) for g in groups)


def cost_ns(op: CrossCore, group: Sequence[int], launch: "LaunchProgram", spec: ChipSpec) -> int:
    """Simulated nanoseconds of ``op`` over the instances ``group``: the process group's ring/tree formula for
    the collective's size at the slowest level the participating cores span (``distributed/cost.py``)."""
    per_node = spec.cores_per_chip * links(spec).chips_per_node
    kind = COST_KIND[op.kind]
    if op.kind in ("sendrecv", "core_barrier"):
        cores = [launch.core_of(i) for i in group]
        if op.kind == "sendrecv":  # one message between this core and the one it sends to
            cores = [launch.core_of(group[0] - group[0] % launch.lnc + op.lane),
                     launch.core_of(group[0] - group[0] % launch.lnc + op.pairs[0][0])]
    else:  # one endpoint per rank: the core of its first instance
        cores = sorted({launch.core_of(i - i % launch.lnc) for i in group})
    place = placement(cores, spec, per_node)
    if kind == "send":
        if place.size <= 1:
            return 0
        place = _pair(place)  # every rank sends one message at once over the pair's path
    return collective_ns(kind, op.nbytes, place, spec, links(spec))


def _pair(place: Any) -> Any:
    """Two ranks of ``place`` spanning its widest level (the path one message of a permute takes)."""
    level = place.level()
    for i in range(1, place.size):
        two = type(place)((place.nodes[0], place.nodes[i]), (place.chips[0], place.chips[i]))
        if two.level() == level:
            return two
    return type(place)(place.nodes[:2], place.chips[:2])


# ---- the launch program ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LaunchProgram(Program):
    """The instructions of every instance of a multi-core launch, in instance order, with each instance's own
    ``Program`` (``instances``, rank-major) and where they run. Run on one core it runs the instances one after
    another; its ``schedule`` is the multi-core one."""

    instances: tuple[Program, ...] = ()   # per instance, rank-major (rank r's instances are r*lnc .. r*lnc+lnc-1)
    cores: int = 1                    # physical cores per chip
    lnc: int = 1                      # instances per rank
    world: int = 1                    # collective ranks
    placement: tuple[int, ...] | None = None  # the core of each instance of one rank, when the grid names them

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "instances": self.instances, "cores": self.cores, "lnc": self.lnc,
                "world": self.world, "placement": self.placement}

    def run_on(self, core: NeuronCore, tensors: list) -> list | None:
        """What ``NeuronCore.run_bound`` does for a launch that moves data between cores: run it on the cores of
        ``core``'s chip model (None for other launches, which one core runs instance after instance)."""
        if not self.cross_core:
            return None
        return run_bound(self, list(tensors), core.spec)

    def core_of(self, instance: int) -> int:
        """The physical core (numbered across the chips of the node) ``instance`` runs on."""
        if self.world > 1:
            return instance
        return (instance if self.placement is None else self.placement[instance]) % self.cores

    @cached_property
    def cross_core(self) -> bool:
        """Whether the ranks exchange data (then each needs a core of its own)."""
        return any(isinstance(i, CrossCore) for i in self.instructions)

    @cached_property
    def segments(self) -> tuple[tuple[tuple[Program, CrossCore | None], ...], ...]:
        """Per rank: its program cut at each cross-core instruction, as (segment, the instruction ending it)."""
        out = []
        for prog in self.instances:
            cuts = [i for i, ins in enumerate(prog.instructions) if isinstance(ins, CrossCore)]
            bounds = [-1, *cuts, len(prog.instructions)]
            parts = []
            for k in range(len(bounds) - 1):
                lo, hi = bounds[k] + 1, bounds[k + 1]
                after = tuple((c - lo, p - lo) for c, p in prog.after if lo <= p and c < hi)
                seg = Program(prog.instructions[lo:hi], prog.args, prog.name, after)
                parts.append((seg, prog.instructions[hi] if hi < len(prog.instructions) else None))
            out.append(tuple(parts))
        return tuple(out)

    def schedule(self, spec: ChipSpec) -> timing.Timeline:
        """The launch on ``spec``'s cores: each core's instructions by the timing model, cross-core fences
        between; its device time is the slowest core's."""
        if any(r.dynamic for r in self.instances):
            if not all("_executed" in r.__dict__ for r in self.instances):  # ran as one program (one core)
                return super().schedule(spec)
            return chip_schedule(self, spec)  # timed per run
        cache = self.__dict__.setdefault("_chip_schedules", {})
        if spec not in cache:
            cache[spec] = chip_schedule(self, spec)
        return cache[spec]

    def roofline(self, spec: ChipSpec) -> timing.Roofline:
        """The roofline of the launch against the peaks of the cores it used (not one core's)."""
        roof = timing.roofline(self.schedule(spec), spec)
        used = len({self.core_of(i) for i in range(len(self.instances))})
        return replace(roof, tensor_fraction=roof.tensor_fraction / used, dma_fraction=roof.dma_fraction / used,
                       hbm_fraction=roof.hbm_fraction / used, lower_bound_ns=roof.lower_bound_ns / used)


def launch_program(traces: Sequence[Any], name: str, outputs: Sequence[str], world: int = 1,
                   placement: tuple[int, ...] | None = None) -> LaunchProgram:
    """The program of a multi-core launch from the traces of its instances (``nki.tracing.Trace``, rank-major)."""
    placed = [t.program(name, outputs) for t in traces]  # placement first: spilling may add scratch slots
    args = tuple(ArgSlot(s.name, s.shape, s.dtype, "output") if s.name in outputs else s
                 for s in traces[0].slots.values())
    ranks = tuple(Program(p.instructions, args, f"{name}[{r}]", p.after) for r, p in enumerate(placed))
    spec = traces[0].spec
    lnc = len(traces) // world
    if world > 1 and spec.cores_per_chip % lnc:
        raise SimulatorError(f"a launch of {world} ranks of {lnc} instances each: a rank's instances share one "
                             f"chip's HBM, and {lnc} does not divide a {spec.name} chip's {spec.cores_per_chip} "
                             f"NeuronCores")
    _check_spmd(ranks, spec, world, lnc)
    instructions, after, base = [], [], 0
    for prog in ranks:
        instructions += prog.instructions
        after += [(c + base, p + base) for c, p in prog.after]
        base += len(prog.instructions)
    launch = LaunchProgram(tuple(instructions), args, name, tuple(after), instances=ranks,
                           cores=spec.cores_per_chip, lnc=lnc, world=world, placement=placement)
    if launch.cross_core and len({launch.core_of(i) for i in range(len(ranks))}) < len(ranks):
        raise SimulatorError(f"a launch of {len(ranks)} instances that exchange data between cores needs a core "
                             f"per instance; its grid places several on one core")
    return launch


def _signature(op: CrossCore) -> tuple:
    shapes = tuple((ap.kind, tuple(ap.shape), ap.dtype) for ap in (*op.srcs, *op.srcs1, *op.dsts))
    meta = None if op.metadata is None else (op.metadata.kind, tuple(op.metadata.shape))
    pairs = () if op.kind == "sendrecv" else op.pairs
    return (op.kind, op.groups, op.op, op.dim, pairs, shapes, meta, op.recv_counts_known, op.has_rdispls, op.pipe)


def _check_spmd(ranks: Sequence[Program], spec: ChipSpec, world: int, lnc: int) -> None:
    """Refuse a launch whose instances do not issue the same cross-core instructions in the same order."""
    ops = [[i for i in p.instructions if isinstance(i, CrossCore)] for p in ranks]
    if not any(ops):
        return
    n = len(ranks)
    if world == 1 and n > spec.cores_per_chip:
        raise SimulatorError(f"a launch of {n} instances that exchange data between cores needs a core per "
                             f"instance; a {spec.name} chip has {spec.cores_per_chip} NeuronCores")
    if any(p.dynamic for p in ranks):
        raise NotImplementedError("cross-core instructions in a kernel with dynamic loops (nl.fori_loop, "
                                  "nl.dynamic_range, nl.while_loop) are not modelled")
    for r in range(1, n):
        if len(ops[r]) != len(ops[0]):
            raise SimulatorError(f"the instances of the launch disagree: instance 0 issues {len(ops[0])} "
                                 f"cross-core instructions ({', '.join(o.kind for o in ops[0])}), instance {r} "
                                 f"issues {len(ops[r])} ({', '.join(o.kind for o in ops[r])})")
        for k, (a, b) in enumerate(zip(ops[0], ops[r])):
            if _signature(a) != _signature(b):
                raise SimulatorError(f"the instances of the launch disagree on cross-core instruction {k}: "
                                     f"instance 0 issues {_describe(a)}, instance {r} issues {_describe(b)}")
    for k, op in enumerate(ops[0]):
        step = [o[k] for o in ops]
        if op.kind == "sendrecv":
            for i, o in enumerate(step):
                base, (to, frm) = i - i % lnc, o.pairs[0]
                if not (0 <= to < lnc and 0 <= frm < lnc):
                    raise SimulatorError(f"sendrecv: core {o.lane} sends to {to} and receives from {frm}; the "
                                         f"launch has cores 0..{lnc - 1} (program ids)")
                if step[base + to].pairs[0][1] != o.lane:
                    raise SimulatorError(f"sendrecv: core {o.lane} sends to core {to}, which receives from core "
                                         f"{step[base + to].pairs[0][1]} (pipe {o.pipe})")
        elif op.kind != "core_barrier" and lnc > 1:
            for i, o in enumerate(step):  # a rank's collective is one transfer: its instances name one tensor
                first = step[i - i % lnc]
                if any(ap.on_chip for ap in (*o.srcs, *o.dsts)) or (o.srcs, o.dsts, o.srcs1) != \
                        (first.srcs, first.dsts, first.srcs1):
                    raise NotImplementedError(f"{op.kind}: with {lnc} instances per rank, a collective's tensors "
                                              f"must be the rank's shared HBM tensors (nl.shared_hbm), the same "
                                              f"for every instance")


def _describe(op: CrossCore) -> str:
    shapes = ", ".join(f"{ap.kind} {str(ap.dtype).removeprefix('torch.')}{list(ap.shape)}" for ap in op.srcs)
    extra = f" groups {[list(g) for g in op.groups]}" if op.groups else ""
    extra += f" op {op.op}" if op.op else ""
    extra += f" pairs {[list(p) for p in op.pairs]}" if op.pairs and op.kind != "sendrecv" else ""
    return f"{op.kind}({shapes}){extra}"


# ---- timing ---------------------------------------------------------------------------------------


def chip_schedule(launch: LaunchProgram, spec: ChipSpec) -> timing.Timeline:
    """The multi-core timeline of ``launch`` (per instruction in rank order, engine figures summed over cores)."""
    n = len(launch.instances)
    starts: list[list[float]] = [[] for _ in range(n)]
    ends: list[list[float]] = [[] for _ in range(n)]
    parts: list[timing.Timeline] = []

    def place(r: int, sched: timing.Timeline, at: float) -> None:
        starts[r] += [s + at for s in sched.start_ns]
        ends[r] += [e + at for e in sched.end_ns]
        parts.append(sched)

    if not launch.cross_core:  # instances beyond the core count wait for their core
        free: dict[int, float] = {}
        for r, prog in enumerate(launch.instances):
            sched = prog.schedule(spec)
            core = launch.core_of(r)
            place(r, sched, free.get(core, 0.0))
            free[core] = free.get(core, 0.0) + sched.device_time_ns
    else:
        clock = [0.0] * n
        for k in range(len(launch.segments[0])):
            for r in range(n):
                seg, _ = launch.segments[r][k]
                sched = seg.schedule(spec)
                place(r, sched, clock[r])
                clock[r] += sched.device_time_ns
            op = launch.segments[0][k][1]
            if op is None:
                continue
            begin, done = list(clock), list(clock)  # a rank in no group passes the instruction at once
            for group in op.fence_groups(launch.world, launch.lnc):
                start = max(clock[r] for r in group)
                end = start + cost_ns(launch.segments[group[0]][k][1], group, launch, spec)
                for r in group:
                    begin[r], done[r] = start, end
            for r in range(n):
                starts[r].append(begin[r])
                ends[r].append(done[r])
            clock = done
    start_ns = [s for r in range(n) for s in starts[r]]
    end_ns = [e for r in range(n) for e in ends[r]]
    busy = {e: sum(p.engine_busy_ns.get(e, 0.0) for p in parts) for e in timing.ENGINE_NAMES}
    counts = {e: sum(p.engine_instructions.get(e, 0) for p in parts) for e in timing.ENGINE_NAMES}
    by_dtype: dict[str, int] = {}
    for p in parts:
        for dt, f in p.tensor_flops_by_dtype.items():
            by_dtype[dt] = by_dtype.get(dt, 0) + f
    return timing.Timeline(device_time_ns=max(end_ns, default=0.0), start_ns=start_ns, end_ns=end_ns,
                           engine_busy_ns=busy, engine_instructions=counts, flops=sum(p.flops for p in parts),
                           tensor_flops=sum(p.tensor_flops for p in parts), tensor_flops_by_dtype=by_dtype,
                           dma_bytes=sum(p.dma_bytes for p in parts), hbm_bytes=sum(p.hbm_bytes for p in parts),
                           chip=spec.name)


# ---- execution ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cores(spec: ChipSpec) -> list[NeuronCore]:
    return []


def chip_cores(spec: ChipSpec, count: int) -> list[NeuronCore]:
    """``count`` simulated NeuronCores of ``spec`` chips (each with its own SBUF, PSUM and registers), kept for
    later launches."""
    cores = _cores(spec)
    while len(cores) < count:
        # (tiles not packed on the host: exchanges read SBUF at the programs' addresses between segments)
        cores.append(NeuronCore(spec, nan_fill=False, pack_tiles=False))
    return cores


class _Space:
    """The memories one rank sees: its core's SBUF/PSUM and the launch's HBM tensors."""

    def __init__(self, core: NeuronCore, hbm: dict[str, Memory]):
        self.core, self.hbm = core, hbm

    def memory(self, name: str) -> Memory:
        return self.hbm[name] if name.startswith("hbm:") else self.core.memory(name)


def run(launch: LaunchProgram, bindings: dict[str, torch.Tensor], spec: ChipSpec, *, timed: bool = False) -> RunReport:
    """Run every rank of ``launch`` on its own core of a ``spec`` chip (shared HBM) and report like
    ``NeuronCore.run``."""
    bound = launch.bind(bindings or {})
    run_bound(launch, [host_binding(s.name, bound[s.name]) for s in launch.args], spec)
    return RunReport.of(launch, bound, spec, timed)


def run_bound(launch: LaunchProgram, tensors: list, spec: ChipSpec) -> list:
    """Execute ``launch`` on HBM tensors in slot order (contiguous host tensors; ``None`` for an output or
    scratch slot allocates it), each instance on its own core of ``spec`` chips; returns the tensors used."""
    for i, slot in enumerate(launch.args):
        if tensors[i] is None:
            tensors[i] = Program.allocate(slot)
    n = len(launch.instances)
    pool = chip_cores(spec, max(launch.core_of(i) for i in range(n)) + 1)
    cores = [pool[launch.core_of(i)] for i in range(n)]
    if not launch.cross_core:
        for r, prog in enumerate(launch.instances):
            cores[r].run_bound(prog, tensors)
        return tensors
    hbm = {f"hbm:{s.name}": Memory.hbm(s.name, t) for s, t in zip(launch.args, tensors)}
    spaces = [_Space(cores[r], hbm) for r in range(n)]
    for k in range(len(launch.segments[0])):
        for r, parts in enumerate(launch.segments):
            cores[r].run_bound(parts[k][0], tensors, fresh=k == 0)
        if launch.segments[0][k][1] is not None:
            exchange([parts[k][1] for parts in launch.segments], spaces, launch.lnc)
    return tensors


def _read(ap: AP, space: _Space) -> torch.Tensor:
    return ap.view(space).clone()


def _compute(values: torch.Tensor) -> torch.Tensor:
    """Values in the dtype reductions compute in: fp32 for floats (as the DMA engines do), int64 for ints."""
    return values.to(compute_dtype(values.dtype))


def _reduce(op: str, values: list[torch.Tensor]) -> torch.Tensor:
    acc = _compute(values[0])
    for v in values[1:]:
        acc = apply_alu(op, acc, _compute(v))
    return acc


def exchange(ops: Sequence[CrossCore], spaces: Sequence[_Space], lnc: int = 1) -> None:
    """Do the data movement of one cross-core instruction (``ops[i]``: instance i's part; a rank's collective is
    done once, by its first instance), reading every source before writing any destination."""
    op = ops[0]
    kind = op.kind
    writes: list[tuple[AP, int, torch.Tensor]] = []
    if kind == "core_barrier":
        return
    if kind == "sendrecv":
        for i, o in enumerate(ops):
            to = i - i % lnc + o.pairs[0][0]
            writes.append((ops[to].dsts[0], to, _read(o.srcs[0], spaces[i])))
    elif kind == "collective_permute":
        for s, t in op.pairs:
            writes.append((ops[t * lnc].dsts[0], t * lnc, _read(ops[s * lnc].srcs[0], spaces[s * lnc])))
    for ranks in op.groups if kind not in ("sendrecv", "collective_permute") else ():
        g = [r * lnc for r in ranks]  # each rank's first instance
        p = len(g)
        for i in range(len(op.srcs)):
            if kind == "all_reduce":
                total = _reduce(op.op, [_read(ops[r].srcs[i], spaces[r]) for r in g])
                writes += [(ops[r].dsts[i], r, total) for r in g]
            elif kind == "all_gather":
                whole = torch.cat([_read(ops[r].srcs[i], spaces[r]) for r in g], dim=op.dim)
                writes += [(ops[r].dsts[i], r, whole) for r in g]
            elif kind == "reduce_scatter":
                chunks = [_read(ops[r].srcs[i], spaces[r]).chunk(p, dim=op.dim) for r in g]
                writes += [(ops[r].dsts[i], r, _reduce(op.op, [c[j] for c in chunks])) for j, r in enumerate(g)]
            elif kind == "all_to_all":
                chunks = [_read(ops[r].srcs[i], spaces[r]).chunk(p, dim=op.dim) for r in g]
                writes += [(ops[r].dsts[i], r, torch.cat([c[j] for c in chunks], dim=op.dim))
                           for j, r in enumerate(g)]
            elif kind in ("collective_permute_implicit", "collective_permute_implicit_reduce"):
                for k, r in enumerate(g):
                    value = _read(ops[r].srcs[i], spaces[r])
                    if kind.endswith("reduce"):
                        value = _reduce(op.op, [value, _read(ops[r].srcs1[i], spaces[r])])
                    nxt = g[(k + 1) % p]
                    writes.append((ops[nxt].dsts[i], nxt, value))
            elif kind in ("all_gather_v", "all_to_all_v"):
                writes += [(ap, g[j], v) for ap, j, v in _exchange_v(op, [ops[r] for r in g], [spaces[r] for r in g])]
    for ap, r, value in writes:
        ap.write(spaces[r], value)


def _counts(o: CrossCore, space: _Space) -> torch.Tensor:
    """The ``_v`` metadata of one rank as int64 [rows, p] (read when the collective runs)."""
    m = _read(o.metadata, space).to(torch.int64)
    return m.reshape(m.shape[-2], m.shape[-1])


def _exchange_v(op: CrossCore, group: Sequence[CrossCore], spaces: Sequence[_Space]) -> list:
    """The writes of a variable-length all-gather / all-to-all over one replica group (flat element buffers)."""
    p = len(group)
    metas = [_counts(o, s) for o, s in zip(group, spaces)]
    srcs = [_read(o.srcs[0], s).reshape(-1) for o, s in zip(group, spaces)]
    writes = []
    for j, (recv, space) in enumerate(zip(group, spaces)):
        dst = _read(recv.dsts[0], space).reshape(-1)
        slot = dst.numel() // p
        got = []
        for k in range(p):
            col = 0 if op.kind == "all_gather_v" else j  # all-gather: one chunk for every destination
            count, displ = int(metas[k][0, col]), int(metas[k][1, col])
            if displ < 0 or count < 0 or displ + count > srcs[k].numel():
                raise SimulatorError(f"{op.kind}: rank {group[k].rank} sends elements [{displ}, {displ + count}) of "
                                     f"a source of {srcs[k].numel()} elements")
            at = int(metas[j][3, k]) if op.has_rdispls else k * slot
            if count > (dst.numel() - at if op.has_rdispls else slot) or at < 0:
                raise SimulatorError(f"{op.kind}: rank {recv.rank} receives {count} elements from rank "
                                     f"{group[k].rank} at element {at}; its destination slot holds "
                                     f"{slot if not op.has_rdispls else dst.numel() - at}")
            dst[at:at + count] = srcs[k][displ:displ + count].to(dst.dtype)
            got.append(count)
        writes.append((recv.dsts[0], j, dst))
        if not op.recv_counts_known:
            meta = _read(recv.metadata, space)
            flat = meta.reshape(meta.shape[-2], meta.shape[-1])
            flat[2, :] = torch.tensor(got, dtype=torch.int64).to(flat.dtype)
            writes.append((recv.metadata, j, meta))
    return writes


def check_group(groups: Any, ranks: int, what: str) -> tuple[tuple[int, ...], ...]:
    """Replica groups as a tuple of rank tuples; ValueError for overlapping, empty or out-of-range ones."""
    try:
        out = tuple(tuple(int(r) for r in g) for g in groups)
    except TypeError:
        raise TypeError(f"{what}: a replica group is a list of rank lists, got {groups!r}") from None
    seen: set[int] = set()
    for g in out:
        if not g:
            raise ValueError(f"{what}: replica group {[list(x) for x in out]} has an empty rank list")
        for r in g:
            if not 0 <= r < ranks:
                raise ValueError(f"{what}: rank {r} of replica group {[list(x) for x in out]} is not a rank of "
                                 f"the launch (ranks 0..{ranks - 1})")
            if r in seen:
                raise ValueError(f"{what}: rank {r} appears twice in replica group {[list(x) for x in out]} "
                                 f"(its rank lists must not overlap)")
            seen.add(r)
    return out


def ring_position(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[tuple[int, ...], int] | None:
    """The rank list holding ``rank`` and its position there (None: the rank takes no part)."""
    for g in groups:
        if rank in g:
            return g, g.index(rank)
    return None


__all__ = ["CrossCore", "LaunchProgram", "launch_program", "run", "exchange", "chip_schedule", "cost_ns",
           "check_group", "ring_position", "chip_cores"]
