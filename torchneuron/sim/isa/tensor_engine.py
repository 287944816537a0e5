"""TensorE instructions: ``nc_matmul`` (also with PE tiling or the FP8 double-row mode) and ``nc_transpose``."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import torch

from torchneuron.sim.instruction import CostInputs, Engine
from torchneuron.sim.memory import PMAX, AP, Memory, SIM_THREADS, SimulatorError, store, writes_once
from torchneuron.sim.numerics import dtype_name
from torchneuron.sim.isa.common import (GEMM_MOVING_FMAX, GEMM_STATIONARY_FMAX, Instr, MATMUL_DTYPES, PSUM_BANK_BYTES,
                                        Step, TENSOR_TRANSPOSE_MAX, VECTOR_TRANSPOSE_MAX, matrix_view, step_scratch)


# ---- TensorE --------------------------------------------------------------------------------

def _psum_closed(instr: Instr, core, ap: AP) -> torch.Tensor:
    """The group-closed flags (one per 4-byte PSUM word) under an fp32 PSUM pattern (cached per core)."""
    psum = core.memory("psum")
    cached = instr.__dict__.get("_closed")
    if cached is not None and cached[0] is psum:
        return cached[1]
    flags = psum._flags  # a view of the flags, read only where _accumulate materializes them first
    sizes, strides, elem_offset = ap._geometry
    row = flags.stride(0)
    view = flags.as_strided((ap.partitions, *sizes), (row, *strides), ap.start_partition * row + elem_offset)
    instr.__dict__["_closed"] = (psum, view)
    return view


_BOXES: dict[tuple, int] = {}  # a PSUM box (start partition, partitions, geometry) -> its small-integer key


def _box(ap: AP) -> int:
    """The key of the PSUM box ``ap`` writes in the open-group records: one int per distinct box (hashing an int
    per matmul instead of the nested geometry tuple)."""
    return _BOXES.setdefault((ap.start_partition, ap.partitions, ap._geometry), len(_BOXES))


def _open_group(psum: Memory, closed: torch.Tensor, box: int) -> None:
    """Open the accumulation group under ``closed`` unless ``psum`` knows it open: its flags are cleared when
    next read (``Memory.pending``)."""
    if box in psum.open_boxes:
        return
    psum.pending[box] = closed
    psum.open_boxes.add(box)


def _accumulate(out: torch.Tensor, r: torch.Tensor, closed: torch.Tensor, accumulate: bool | None,
                psum: Memory, box: int) -> None:
    """PSUM's fp32 accumulation of a product ``r`` into ``out`` (accumulate: False overwrites, True adds, None
    adds inside an open group and overwrites where none is open), opening the group it writes."""
    if accumulate is False:
        out.copy_(r)
    elif accumulate or box in psum.open_boxes:  # (an open group has no closed flag to clear)
        out.add_(r)
    else:
        psum.materialize()  # the flags of the groups opened since they were last read
        out.masked_fill_(closed, 0.0).add_(r)  # overwrite where no group is open (NaN-safe)
    _open_group(psum, closed, box)


# ---- one-call PSUM overwrite ---------------------------------------------------------------------
# A matmul's result is defined as torch.mm of its fp32 operands into a dense [M, N] buffer, then copied into
# PSUM (overwrite) or added onto it (accumulate). For an overwrite, torch.mm straight into the strided PSUM view
# saves a call and a pass over the tile (about a quarter of a small matmul's host time), but the BLAS may pick
# another kernel for another output layout (with MKL, M <= 3 or N <= 11 give other bits). So each layout
# (shapes, strides, alignment) is tried once, on data that exposes any change of summation order, rounding or
# NaN propagation, against the two-call form; the one call runs only where every trial gave the same bits.
# (addmm_ onto PSUM for an accumulate gives other bits where a NaN product meets a NaN in PSUM: MKL keeps the
# product's payload, torch's add the PSUM one's; so accumulation keeps its two calls.)

PROBE_OUTPUTS = 256     # output elements compared per layout at least (trials x M x N) ...
PROBE_TRIALS = 4        # in at least this many random trials, the last with infinities and NaNs,
PROBE_MAX_TRIALS = 32   # and at most this many (a [1, 1] output: each trial differs in its K-long sum)
_MM_INTO: dict[tuple, bool] = {}  # layout -> whether the one call gives the dense calls' bits


def _layout(*ts: torch.Tensor) -> tuple:
    """What a BLAS call can see of these tensors: shapes, strides and address alignment."""
    return tuple((tuple(t.shape), t.stride(), t.data_ptr() % 64) for t in ts)


def _like(t: torch.Tensor) -> torch.Tensor:
    """Scratch with ``t``'s shape, strides and 64-byte address alignment (its untouched pages cost nothing)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    shift = t.data_ptr() % 64 // t.element_size()
    base = torch.empty(span + shift, dtype=t.dtype)  # (a CPU allocation: 64-byte aligned)
    return base.as_strided(t.shape, t.stride(), shift)


def _probe_data(shape: tuple[int, int], gen: torch.Generator, specials: bool) -> torch.Tensor:
    """fp32 values of both signs over a few binades (a sum of them rounds differently in another order), some
    signed zeros, and with ``specials`` infinities and NaNs of distinct payloads (NaN propagation must match)."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 7, shape, generator=gen).float())
    pick = torch.rand(shape, generator=gen)
    x = torch.where(pick < 0.04, -0.0, x)
    if specials:
        x = torch.where(pick > 0.98, float("inf"), torch.where(pick > 0.96, -float("inf"), x))
        nan = torch.randint(0x7FC00001, 0x7FFFFFFF, shape, generator=gen, dtype=torch.int32).view(torch.float32)
        x = torch.where((pick > 0.04) & (pick < 0.07), nan, x)
    return x


def _agrees(a: torch.Tensor, b: torch.Tensor, outputs: int,
            results: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether ``results`` gives two tensors of the same bits on every trial, called on scratch operands laid out
    like ``a`` and ``b`` (``_like``; the tensors themselves are not touched) holding probe data (``_probe_data``);
    ``outputs`` elements are compared per trial. Runs with the simulator's torch threads (SIM_THREADS)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(SIM_THREADS)
    try:
        gen = torch.Generator().manual_seed(len(_MM_INTO))
        pa, pb = _like(a), _like(b)
        trials = min(PROBE_MAX_TRIALS, max(PROBE_TRIALS, -(-PROBE_OUTPUTS // outputs)))
        for trial in range(trials):
            specials = trial == trials - 1
            pa.copy_(_probe_data(tuple(a.shape), gen, specials))
            pb.copy_(_probe_data(tuple(b.shape), gen, specials))
            x, y = results(pa, pb)
            if not torch.equal(x.view(torch.int32), y.view(torch.int32)):
                return False
        return True
    finally:
        torch.set_num_threads(threads)


def mm_into_agrees(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``torch.mm(a, b, out=out)`` gives the bits of ``torch.mm`` into a dense buffer copied into ``out``,
    for tensors laid out like these (tried once per layout; see ``_agrees``)."""
    key = _layout(a, b, out)
    known = _MM_INTO.get(key)
    if known is None:
        pout, dense = _like(out), torch.empty(out.shape)
        known = _MM_INTO[key] = _agrees(a, b, out.numel(), lambda pa, pb: (torch.mm(pa, pb, out=dense),
                                                                         torch.mm(pa, pb, out=pout)))
    return known


def bmm_agrees(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch.bmm(a, b)`` gives each matrix the bits of its own ``torch.mm`` (a dense [M, N] result), for
    [B, M, K] and [B, K, N] operands laid out like these (tried once per layout; see ``_agrees``)."""
    key = ("bmm", *_layout(a, b))
    known = _MM_INTO.get(key)
    if known is None:
        batched, each = torch.empty(a.shape[0], a.shape[1], b.shape[2]), torch.empty(a.shape[0], a.shape[1], b.shape[2])

        def results(pa: torch.Tensor, pb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            for i in range(pa.shape[0]):
                torch.mm(pa[i], pb[i], out=each[i])
            return torch.bmm(pa, pb, out=batched), each
        known = _MM_INTO[key] = _agrees(a, b, batched.numel(), results)
    return known


def _one_bank(instr: Instr, name: str) -> None:
    lo, hi = getattr(instr, name).byte_range
    if lo // PSUM_BANK_BYTES != (hi - 1) // PSUM_BANK_BYTES:
        raise instr._fail(name, f"covers PSUM bytes [{lo}, {hi}) across banks; a TensorE output must fit one "
                                f"{PSUM_BANK_BYTES}-byte bank (nl.tile_size.psum_bank_fmax_bytes)")


@dataclass(frozen=True)
class NcMatmul(Instr):
    """``nisa.nc_matmul``: ``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on TensorE, fp32 accumulation
    into one PSUM bank. ``accumulate``: False overwrites, True adds, None adds where an accumulation
    group is open and overwrites elsewhere. A TensorE write opens the group at a PSUM word; the start
    of a run, allocating the word and any other engine writing it close it. (A kernel front end that
    knows its PSUM tiles' lifetimes should pass True/False.) ``is_transpose``: bit-exact transpose
    mode (NaN/inf pass through; dst may keep the input dtype)."""

    dst: AP
    stationary: AP
    moving: AP
    is_stationary_onezero: bool = False
    is_moving_onezero: bool = False
    is_transpose: bool = False
    accumulate: bool | None = None
    opcode = "nc_matmul"
    engine = Engine.TENSOR

    @cached_property
    def kmn(self) -> tuple[int, int, int]:
        """(K, M, N): contraction, stationary free size, moving free size."""
        return self.stationary.partitions, self.stationary.free_elems, self.moving.free_elems

    def check(self) -> None:
        self._ap("stationary", ("sbuf",))
        self._ap("moving", ("sbuf",))
        k, m, n = self.kmn
        if self.moving.partitions != k:
            raise self._fail("moving", f"has {self.moving.partitions} partitions; stationary has {k} (the "
                                       f"contraction dim K must match)")
        if m > GEMM_STATIONARY_FMAX:
            raise self._fail("stationary", f"has {m} elements per partition (M); the limit is "
                                           f"{GEMM_STATIONARY_FMAX} (nl.tile_size.gemm_stationary_fmax)")
        if n > GEMM_MOVING_FMAX:
            raise self._fail("moving", f"has {n} elements per partition (N); the limit is {GEMM_MOVING_FMAX} "
                                       f"(nl.tile_size.gemm_moving_fmax, one PSUM bank of fp32)")
        self._ap("dst", ("psum",))
        if self.dst.partitions != m or self.dst.free_elems != n:
            raise self._fail("dst", f"has shape {self.dst.shape}; it must be [M={m}, N={n}]")
        _one_bank(self, "dst")
        for name in ("stationary", "moving"):
            dt = getattr(self, name).dtype
            if dt not in MATMUL_DTYPES:
                raise self._fail(name, f"is {dtype_name(dt)}; TensorE takes fp8/bf16/fp16/fp32")
        if (self.stationary.dtype == torch.float32) != (self.moving.dtype == torch.float32):
            raise self._fail("moving", "and stationary mix fp32 with another dtype; fp32 needs fp32 on both sides")
        allowed = {torch.float32} | ({self.stationary.dtype} if self.is_transpose else set())
        if self.dst.dtype not in allowed:
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; matmul output is float32 "
                                    f"(transpose mode may keep the input dtype)")

    def _read_names(self) -> tuple[str, ...]:
        names = ("stationary", "moving")
        return names if self.accumulate is False else (*names, "dst")

    def _state(self, core, sbuf, psum) -> tuple:
        """Per-core constants of execute (cached): [K, M] / [K, N] views of the operands (None where
        their strides allow no view), fp32 scratch they are converted into (None for fp32 operands),
        the fp32 [K, M] operand transposed as the array reads it, the product buffer, [M, N] views of
        dst and of its group flags (None where dst's free dims do not flatten) and dst's box key."""
        k, m, n = self.kmn
        s, mv = matrix_view(self.stationary.view(sbuf), k, m), matrix_view(self.moving.view(sbuf), k, n)
        scratch = step_scratch(core)
        s_f = scratch((k, m), torch.float32, "stationary") if self.stationary.dtype != torch.float32 else None
        mv_f = scratch((k, n), torch.float32, "moving") if self.moving.dtype != torch.float32 else None
        s_t = s_f.T if s_f is not None else (s.T if s is not None else None)
        mv_use = mv_f if mv_f is not None else mv
        out2 = closed2 = None
        if self.dst.dtype == torch.float32:
            out2, closed2 = matrix_view(self.dst.view(psum), m, n), matrix_view(_psum_closed(self, core, self.dst), m, n)
            if out2 is None or closed2 is None:
                out2 = closed2 = None
        state = (sbuf, psum, s, s_f, s_t, mv, mv_f, mv_use, scratch((m, n), torch.float32, "product"), out2, closed2,
                 _box(self.dst))
        self.__dict__["_mm"] = state
        return state

    def execute(self, core) -> None:
        sbuf, psum = core.memory("sbuf"), core.memory("psum")
        st = self.__dict__.get("_mm")
        if st is None or st[0] is not sbuf or st[1] is not psum:
            st = self._state(core, sbuf, psum)
        self._multiply(core, st)

    def step(self, core, slots) -> Step | None:
        st = self._state(core, core.memory("sbuf"), core.memory("psum"))
        _, psum, s, s_f, s_t, mv, mv_f, mv_use, r, out, closed, box = st
        if self.is_transpose or s is None or mv is None or out is None:
            return lambda h: self._multiply(core, st)
        # the common case (views of operands and of an fp32 dst): _multiply's torch calls in its order,
        # without its per-run unpacking and branches (a matmul of a small tile costs little more than these)
        accumulate, open_boxes, mm = self.accumulate, psum.open_boxes, torch.mm
        if accumulate is None:
            def step(h):
                mm(s_t, mv_use, out=r)
                _accumulate(out, r, closed, None, psum, box)
        elif accumulate:
            def step(h):
                mm(s_t, mv_use, out=r)
                out.add_(r)
                if box not in open_boxes:
                    _open_group(psum, closed, box)
        elif mm_into_agrees(s_t, mv_use, out):
            def step(h):  # the overwrite in one call (see mm_into_agrees)
                mm(s_t, mv_use, out=out)
                if box not in open_boxes:
                    _open_group(psum, closed, box)
        else:
            def step(h):
                mm(s_t, mv_use, out=r)
                out.copy_(r)
                if box not in open_boxes:
                    _open_group(psum, closed, box)
        converts = tuple((f, v) for f, v in ((s_f, s), (mv_f, mv)) if f is not None)
        if not converts:
            return step
        multiply = step

        def step(h):  # bf16/fp16/fp8 operands: converted to fp32 first (exact)
            for scratch, values in converts:
                scratch.copy_(values)
            multiply(h)
        return step

    def _multiply(self, core, st: tuple) -> None:
        sbuf, psum, s, s_f, s_t, mv, mv_f, mv_use, r, out, closed, box = st
        # the array multiplies in fp32 (bf16/fp16/fp8 -> fp32 is exact)
        if s is None:  # operand strides allow no [K, M] view: read a fresh copy
            k, m, _ = self.kmn
            s = self.stationary.view(sbuf).reshape(k, m)
            s_t = None if s_f is not None else s.T
        if s_f is not None:
            s_f.copy_(s)
            s_t = s_f.T if s_t is None else s_t
        if mv is None:
            k, _, n = self.kmn
            mv = self.moving.view(sbuf).reshape(k, n)
            mv_use = mv
        if mv_f is not None:
            mv_use = mv_f.copy_(mv)
        if self.is_transpose:
            # bit-exact: each output is the stationary element a 1 in moving selects; 0 * NaN stays out
            s, mv = s_t.T, mv_use
            r = torch.where(mv.unsqueeze(1) != 0, s.unsqueeze(2) * mv.unsqueeze(1), 0.0).sum(0)
        else:
            r = torch.mm(s_t, mv_use, out=r)
        dst = self.dst
        if dst.dtype != torch.float32:  # transpose mode keeping a 16/8-bit dtype: no accumulation groups
            r = r.view(dst.shape)
            dst.write(core, dst.view(core).float() + r if self.accumulate else r)
            return
        if out is None:  # dst's free dims do not flatten to one: work in its own shape
            out = dst.view(core)
            closed = _psum_closed(self, core, dst)
            r = r.view(dst.shape)
        # PSUM accumulates in place, in fp32, after the array's fp32 dot products
        _accumulate(out, r, closed, self.accumulate, psum, box)

    def price(self) -> CostInputs:
        k, m, n = self.kmn
        return self._cost([self.stationary, self.moving], self.dst, main=self.moving,
                          op="transpose" if self.is_transpose else None, matmul_kmn=(k, m, n), flops=2 * k * m * n)


@dataclass(frozen=True)
class NcTranspose(Instr):
    """``nisa.nc_transpose``: swap partition and (flattened) free axes. TensorE: <= [128, 128],
    SBUF -> PSUM; VectorE: <= [32, 32], SBUF/PSUM. Bit-exact, same dtype in and out."""

    dst: AP
    data: AP
    engine: Engine = Engine.TENSOR
    opcode = "nc_transpose"
    ENGINES = (Engine.TENSOR, Engine.VECTOR)

    def check(self) -> None:
        tensor = self.engine == Engine.TENSOR
        self._ap("data", ("sbuf",) if tensor else ("sbuf", "psum"))
        limit = TENSOR_TRANSPOSE_MAX if tensor else VECTOR_TRANSPOSE_MAX
        p, f = self.data.partitions, self.data.free_elems
        if p > limit or f > limit:
            raise self._fail("data", f"is [{p}, {f}]; {self.engine.value} engine transposes at most "
                                     f"[{limit}, {limit}]")
        self._ap("dst", ("psum",) if tensor else ("sbuf", "psum"))
        if self.dst.dtype != self.data.dtype:
            raise self._fail("dst", f"is {dtype_name(self.dst.dtype)}; it must equal data's "
                                    f"{dtype_name(self.data.dtype)}")
        if self.dst.partitions != f or self.dst.free_elems != p:
            raise self._fail("dst", f"has shape {self.dst.shape}; the transpose of [{p}, {f}] is [{f}, {p}]")
        if tensor:
            _one_bank(self, "dst")

    def execute(self, core) -> None:
        x = self.data.view(core).reshape(self.data.partitions, self.data.free_elems)
        self.dst.write(core, x.T)
        if self.engine == Engine.TENSOR and self.dst.dtype == torch.float32:
            _open_group(core.memory("psum"), _psum_closed(self, core, self.dst), _box(self.dst))

    def transposed_views(self, core) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(dst, values): views of dst's and data's memory in one shape pairing the elements execute's reshape
        and transpose pair (a copy here would freeze the tile's values): data in dst's shape, or, where data's
        free dims do not flatten into one (a permuted or sliced pattern), data with its partition dim moved
        last ([*free, partitions], execute's x.T unflattened) and dst viewed in that shape (both row-major);
        None where neither is a view."""
        dv, data = self.dst.view(core), self.data
        source = data.view(core)
        values = matrix_view(source, data.partitions, data.free_elems)
        if values is not None:
            values = values.T
            if values.shape == dv.shape:
                return dv, values
            try:
                return dv, values.view(dv.shape)
            except RuntimeError:
                pass
        values = source.permute(*range(1, source.dim()), 0)
        try:
            return dv.view(values.shape), values
        except RuntimeError:
            return None

    def group_opener(self, core) -> Callable[[], None] | None:
        """What TensorE does after the write: open the accumulation group at dst (as execute); None where it
        opens none (VectorE, or a dtype other than fp32)."""
        dst = self.dst
        if self.engine != Engine.TENSOR or dst.dtype != torch.float32:
            return None
        psum, box = core.memory("psum"), _box(dst)
        closed = _psum_closed(self, core, dst)

        def open_group() -> None:
            _open_group(psum, closed, box)
        return open_group

    def step(self, core, slots) -> Step | None:
        dst, data = self.dst, self.data
        if dst.overlaps(data):
            return None  # in place or overlapping: write's alias check decides on a clone
        views = self.transposed_views(core)
        if views is not None:
            dv, values = views

            def copy(h):
                try:
                    dv.copy_(values)
                except RuntimeError as e:
                    raise SimulatorError(f"{dst!r}: cannot write through this pattern: {e}") from None
        else:
            # neither side is a view in the other's element order: execute's reshape copies the tile each run;
            # the transposed copy then lands in dst (copies move bits: the same values either way)
            rows, cols, source, dv = data.partitions, data.free_elems, data.view(core), dst.view(core)

            def copy(h):
                store(dst, dv, source.reshape(rows, cols).T, may_alias=False)
        open_group = self.group_opener(core)
        if open_group is None:
            return copy

        def step(h):  # the write, then TensorE opens the accumulation group there (as execute)
            copy(h)
            open_group()
        return step

    def price(self) -> CostInputs:
        p, f = self.data.partitions, self.data.free_elems
        kmn = (p, f, p) if self.engine == Engine.TENSOR else None  # a matmul against a [p, p] identity
        return self._cost([self.data], self.dst, matmul_kmn=kmn, flops=0)



PE_ROWS = PE_COLS = PMAX       # the TensorE systolic array is 128 x 128 processing elements
PE_TILE_SIZES = (32, 64, 128)  # row / column tile sizes of the tiling modes (NC-v2 allows 64 and 128 only)
FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
PERF_MODES = ("none", "double_row")


@dataclass(frozen=True)
class NcMatmulTiled(Instr):
    """``nisa.nc_matmul`` with TensorE tiling or a performance mode: ``dst[M, N] (+)= stationary.T @ moving``.

    ``tile_position=(start_row, start_col)`` / ``tile_size=(rows, cols)``: the matmul uses only that
    ``rows x cols`` tile of the 128 x 128 PE array (K <= rows, M <= cols), so several such matmuls on
    disjoint tiles run concurrently; the timing model charges the tile's share of the array.
    ``perf_mode="double_row"`` (FP8 only, no column tiling): the contraction is 2K, laid out as
    ``stationary[K, 2, M]`` / ``moving[K, 2, N]``, at twice the FP8 matmul throughput. Functionally the
    result equals the plain matmul; ``accumulate`` as in ``NcMatmul``."""

    dst: AP
    stationary: AP
    moving: AP
    is_stationary_onezero: bool = False
    is_moving_onezero: bool = False
    is_transpose: bool = False
    accumulate: bool | None = None
    tile_position: tuple[int, int] = (0, 0)
    tile_size: tuple[int, int] = (PE_ROWS, PE_COLS)
    perf_mode: str = "none"
    opcode = "nc_matmul_tiled"
    engine = Engine.TENSOR

    def check(self) -> None:
        self._set("perf_mode", str(getattr(self.perf_mode, "name", self.perf_mode)))
        if self.perf_mode not in PERF_MODES:
            raise self._fail("perf_mode", f"is {self.perf_mode!r}; expected one of {PERF_MODES}")
        pos, size = tuple(int(v) for v in self.tile_position), tuple(int(v) for v in self.tile_size)
        self._set("tile_position", pos)
        self._set("tile_size", size)
        if len(pos) != 2 or len(size) != 2:
            raise self._fail("tile_position/tile_size", f"are {pos}/{size}; each is a (row, column) pair")
        for axis, p, s, extent in (("row", pos[0], size[0], PE_ROWS), ("column", pos[1], size[1], PE_COLS)):
            if s not in PE_TILE_SIZES:
                raise self._fail("tile_size", f"has {axis} size {s}; PE tiles are {PE_TILE_SIZES}")
            if p < 0 or p % s or p + s > extent:
                raise self._fail("tile_position", f"has start {axis} {p}; it must be a multiple of the {axis} "
                                                  f"tile size {s} with start + size <= {extent}")
        k, m = self.stationary.partitions, self.stationary.free_elems
        if self.perf_mode == "double_row":
            for name in ("stationary", "moving"):
                ap = getattr(self, name)
                if ap.dtype not in FP8:
                    raise self._fail(name, f"is {dtype_name(ap.dtype)}; perf_mode=double_row takes fp8 "
                                           f"(float8_e4m3 / float8_e5m2) on both sides")
                if len(ap.shape) < 3 or ap.shape[1] != 2:
                    raise self._fail(name, f"has shape {ap.shape}; perf_mode=double_row splits the contraction "
                                           f"as [K, 2, free] (the first free dim must be 2)")
            if size[1] != PE_COLS:
                raise self._fail("perf_mode", "double_row cannot be combined with column tiling "
                                              f"(tile_size column {size[1]} < {PE_COLS})")
            if self.is_transpose:
                raise self._fail("perf_mode", "double_row cannot be combined with is_transpose")
            m //= 2
        if k > size[0]:
            raise self._fail("stationary", f"has {k} partitions (K); the PE tile has {size[0]} rows")
        if m > size[1]:
            raise self._fail("stationary", f"has {m} elements per partition (M); the PE tile has {size[1]} columns")
        self._parts  # the equivalent plain matmuls check the operands (PSUM dst, one bank, dtypes, shapes)

    @cached_property
    def _parts(self) -> tuple[NcMatmul, ...]:
        """Plain matmuls computing the same result (double row: one per half of the contraction, the second
        accumulating onto the first in fp32 PSUM, as the array's fp32 partial sums do)."""
        flags = dict(is_stationary_onezero=self.is_stationary_onezero, is_moving_onezero=self.is_moving_onezero,
                     is_transpose=self.is_transpose)
        if self.perf_mode != "double_row":
            return (NcMatmul(self.dst, self.stationary, self.moving, accumulate=self.accumulate, **flags),)
        return tuple(NcMatmul(self.dst, self.stationary[:, j], self.moving[:, j],
                              accumulate=self.accumulate if j == 0 else True, **flags) for j in (0, 1))

    @cached_property
    def kmn(self) -> tuple[int, int, int]:
        """(K, M, N): the whole contraction (2K with double row), stationary and moving free sizes."""
        k, m, n = self._parts[0].kmn
        return k * len(self._parts), m, n

    @property
    def pe_fraction(self) -> float:
        """The share of the PE array the matmul occupies."""
        return self.tile_size[0] * self.tile_size[1] / (PE_ROWS * PE_COLS)

    def _read_names(self) -> tuple[str, ...]:
        names = ("stationary", "moving")
        return names if self.accumulate is False else (*names, "dst")

    def execute(self, core) -> None:
        for part in self._parts:
            part.execute(core)

    def step(self, core, slots) -> Step | None:
        steps = [part.step(core, slots) for part in self._parts]
        if any(s is None for s in steps):
            return None
        if len(steps) == 1:
            return steps[0]
        first, second = steps
        return lambda h: (first(h), second(h))

    def price(self) -> CostInputs:
        k, m, n = self.kmn
        return self._cost([self.stationary, self.moving], self.dst, main=self.moving,
                          op="transpose" if self.is_transpose else None, matmul_kmn=(k, m, n),
                          flops=2 * k * m * n, pe_fraction=self.pe_fraction)


# ---- runs of independent matmuls as one call -----------------------------------------------------------------
# The attention kernels issue runs of overwriting matmuls of one shape whose operands and results step by a constant
# offset (one per head, or per row tile of the PE array). Each reads SBUF only and writes its own PSUM box, so none
# reads what another writes: torch.bmm computes a run in one call (a small matmul is mostly call overhead), where
# the batched call was tried once per layout to give every matmul the bits of its own torch.mm (bmm_agrees). A
# matmul's write opens its accumulation group; the run opens its matmuls' groups after the products, in order (an
# overwrite does not read the flags, so they end as the steps one by one leave them).

def _run_matmul(instr: Instr) -> NcMatmul | None:
    """The plain matmul ``instr`` runs as where it can join a batched run (an overwrite of one part, not transpose
    mode: itself, or a tiled matmul's one part); None for any other instruction."""
    if type(instr) is NcMatmulTiled and len(instr._parts) == 1:
        instr = instr._parts[0]
    if type(instr) is not NcMatmul or instr.accumulate is not False or instr.is_transpose:
        return None
    return instr


def run_operands(instr: Instr) -> tuple[AP, AP, AP] | None:
    """(stationary, moving, dst) of a matmul that can join a batched run (``_run_matmul``); None for any other
    instruction."""
    mm = _run_matmul(instr)
    return None if mm is None else (mm.stationary, mm.moving, mm.dst)


def _operand_steps(a: tuple[AP, ...], b: tuple[AP, ...]) -> tuple[tuple[int, int], ...]:
    """(partitions, bytes) from each of ``a``'s operands to ``b``'s: positive where above (0, 0) (a partition weighs
    more than a row's bytes, so the core's views step forward there)."""
    return tuple((y.start_partition - x.start_partition, y.offset - x.offset) for x, y in zip(a, b))


def extends_matmul_run(run: Sequence[Instr], instr: Instr) -> bool:
    """Whether ``instr`` continues ``run`` (matmuls that can join a run, consecutive as the core executes them):
    operands of the first's memories, dtypes, patterns and partition counts, each a positive step from the last's,
    the step from the first to the second (the rule ``batch_matmuls`` runs by; ``host_layout`` keeps such runs'
    operands side by side)."""
    ops, first = run_operands(instr), run_operands(run[0])
    if ops is None or first is None:
        return False
    if any((x.memory, x.dtype, x.pattern, x.partitions) != (y.memory, y.dtype, y.pattern, y.partitions)
           for x, y in zip(first, ops)):
        return False
    steps = _operand_steps(run_operands(run[-1]), ops)
    return min(steps) > (0, 0) and (len(run) == 1 or steps == _operand_steps(first, run_operands(run[1])))


def _batchable(instr: Instr, core) -> tuple | None:
    """(stationary [K, M], moving [K, N], dst [M, N], group flags, box): the views of a matmul that can join a batched
    run (``run_operands``; operands viewed in place, into an fp32 PSUM view), from its step's state on ``core``; None
    for any other instruction."""
    mm = _run_matmul(instr)
    if mm is None:
        return None
    state = mm.__dict__.get("_mm")
    if state is None or state[0] is not core.sbuf:
        return None
    _, _, s, _, _, mv, _, _, _, out, closed, box = state
    if s is None or mv is None or out is None:
        return None
    return s, mv, out, closed, box


def _steps(first: tuple, second: tuple) -> tuple[int, int, int]:
    """The element offsets from one matmul's operand and result views to the next's."""
    return tuple(b.storage_offset() - a.storage_offset() for a, b in zip(first[:3], second[:3]))


def _run_step(core, run: list[tuple]) -> Step | None:
    """The step of a run of batchable matmuls (their ``_batchable`` views, in program order): bf16/fp16/fp8 operands
    converted to fp32 scratch in one call per side (exact, as each matmul's own conversion), one bmm into a dense
    buffer, copied into the results, then the groups opened; None where the run's views overlap (a result written
    twice, or operands that scratch could not lay out) or the batched call would give other bits."""
    steps = _steps(run[0], run[1])
    if min(steps) <= 0:
        return None
    batch = [t.as_strided((len(run), *t.shape), (step, *t.stride()), t.storage_offset())
             for t, step in zip(run[0][:3], steps)]
    if not all(writes_once(view.shape, view.stride()) for view in batch):
        return None
    values, out = batch[:2], batch[2]
    scratch = step_scratch(core)
    # each operand side as the array reads it: fp32 values in place, else fp32 scratch the step converts them into
    stationary, moving = (v if v.dtype == torch.float32 else scratch(tuple(v.shape), torch.float32, f"run {side}")
                          for v, side in zip(values, ("stationary", "moving")))
    converts = tuple((f, v) for f, v in zip((stationary, moving), values) if f is not v)
    stationary = stationary.transpose(1, 2)
    if not bmm_agrees(stationary, moving):
        return None
    product = scratch(tuple(out.shape), torch.float32, "run product")
    psum, opens = core.memory("psum"), tuple((closed, box) for *_, closed, box in run)
    open_boxes, bmm = psum.open_boxes, torch.bmm

    def step(h):
        for scratch, source in converts:
            scratch.copy_(source)
        bmm(stationary, moving, out=product)
        out.copy_(product)
        for closed, box in opens:
            if box not in open_boxes:
                _open_group(psum, closed, box)
    return step


def batch_matmuls(core, entries: Sequence[tuple]) -> tuple:
    """``entries`` (instr, step, closes) with each run of consecutive batchable matmuls (``extends_matmul_run``)
    replaced by one entry whose step runs them all (its instr: the run's first)."""
    out: list[tuple] = []
    run: list[tuple] = []   # (entry, views)

    def flush() -> None:
        step = _run_step(core, [views for _, views in run]) if len(run) > 1 else None
        if step is None:
            out.extend(entry for entry, _ in run)
        else:
            out.append((run[0][0][0], step, None))
        run.clear()

    for entry in entries:
        views = _batchable(entry[0], core) if entry[1] is not None else None
        if views is None:
            flush()
            out.append(entry)
            continue
        if run and not extends_matmul_run([e[0] for e, _ in run], entry[0]):
            flush()
        run.append((entry, views))
    flush()
    return tuple(out)
