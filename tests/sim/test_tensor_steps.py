"""TensorE transposes and matmul probing, and the C++ copy batch's walk over a copy's outer dims: each step or
batch bit for bit what the unplanned ``execute`` does, and what torch computes."""
from __future__ import annotations

import pytest
import torch

from torchneuron.sim import ArgSlot, NeuronCore, Program, copies, isa, tile
from torchneuron.sim.isa import tensor_engine
from torchneuron.sim.memory import SIM_THREADS
from tests.sim.test_copies import _bits, _copy_batch_of, _same_bits
from tests.sim.test_isa import _matmul_operand
from tests.sim.test_steps import _reference

F32, BF16 = torch.float32, torch.bfloat16
P = 32   # partitions of the transposed tiles (VectorE transposes at most [32, 32])


# ---- nc_transpose: sources whose free dims do not flatten into one --------------------------------------------

def _transposes() -> Program:
    """Transposes of [P, 2, 8] cuts of [P, 2, 16] tiles (free dims that do not flatten): into a PSUM tile (fp32,
    opening its group, which the matmul after it then adds into), bf16 into PSUM, on VectorE, and into a PSUM tile
    whose own free dims do not merge (neither side a view in the other's element order)."""
    cut32 = tile("sbuf", F32, (P, 2, 16))[:, :, 4:12]
    cut16 = tile("sbuf", BF16, (P, 2, 16), offset=512)[:, :, :8]
    split_dst = tile("psum", F32, (16, 2, 32), offset=4096)[:, :, :16]       # [16, P] as (2, 16) of (2, 32)
    body = [isa.dma_copy(dst=tile("sbuf", F32, (P, 2, 16)), src=tile("hbm:x", F32, (P, 2, 16))),
            isa.dma_copy(dst=tile("sbuf", BF16, (P, 2, 16), offset=512), src=tile("hbm:y", BF16, (P, 2, 16))),
            isa.nc_transpose(dst=tile("psum", F32, (16, P)), data=cut32),
            isa.nc_transpose(dst=tile("psum", BF16, (16, P), offset=2048), data=cut16),
            isa.nc_transpose(dst=tile("sbuf", F32, (16, P), offset=1024), data=cut32, engine="vector"),
            isa.nc_transpose(dst=split_dst, data=cut32),
            isa.nc_matmul(dst=tile("psum", F32, (16, P)), stationary=tile("sbuf", F32, (16, 16), offset=2048),
                          moving=tile("sbuf", F32, (16, P), offset=1024)),
            isa.dma_copy(dst=tile("hbm:o", F32, (16, P)), src=tile("sbuf", F32, (16, P), offset=1024))]
    args = [ArgSlot("x", (P, 2, 16), F32), ArgSlot("y", (P, 2, 16), BF16), ArgSlot("o", (16, P), F32, "output")]
    return Program(body, args, "transposes")


@pytest.mark.parametrize("batched", [False, True], ids=["steps", "copy batch"])
def test_transposes_of_unflattened_sources_match_execute_and_torch(batched, monkeypatch):
    # each transpose's step (or the copy batch) reads views of the tile, not a copy made when it was planned: run
    # twice on other values, it must keep execute's bits (NaN payloads, signed zeros, subnormals, infinities)
    if not batched:
        monkeypatch.setattr(copies, "_copy_batch", None)
    prog = _transposes()
    # (on-chip state compared after the runs: at the program's own addresses, not packed on the host)
    fast, slow = (NeuronCore("trn2", nan_fill=False, pack_tiles=False) for _ in range(2))
    for seed in (1, 2):
        for core in (fast, slow):
            core.sbuf.data.copy_(_bits(tuple(core.sbuf.data.shape), torch.uint8, seed))
            core.psum.data.copy_(_bits(tuple(core.psum.data.shape), torch.uint8, seed + 10))
        x, y = _bits((P, 2, 16), F32, seed), _bits((P, 2, 16), BF16, seed + 20)
        out = fast.run(prog, {"x": x, "y": y}, timed=False).outputs["o"]
        ref = {"x": x.clone(), "y": y.clone(), "o": torch.zeros(16, P)}
        _reference(slow, prog, ref)
        assert _same_bits(out, ref["o"])
        assert torch.equal(fast.sbuf.data, slow.sbuf.data) and torch.equal(fast.psum.data, slow.psum.data)
        assert torch.equal(fast.psum.group_closed, slow.psum.group_closed)
        # and what a transpose is: torch's, of the cut's values flattened (bits moved unchanged)
        want32 = x[:, :, 4:12].reshape(P, 16).T
        assert _same_bits(out, want32)
        assert _same_bits(tile("psum", BF16, (16, P), offset=2048).view(fast), y[:, :, :8].reshape(P, 16).T)
        split = tile("psum", F32, (16, 2, 32), offset=4096)[:, :, :16].view(fast)
        assert _same_bits(split.reshape(16, P), want32)
    plan = fast._plan(prog)
    assert all(step is not None for _, step, _ in plan.entries[2:6])


def test_transposed_views_pair_execute_elements_as_views():
    # flattening sources: data viewed in dst's shape; unflattened: the partition dim moved last, dst viewed so;
    # neither a view: None (the step then copies per run)
    core = NeuronCore("trn2", nan_fill=False)
    flat = isa.nc_transpose(dst=tile("psum", F32, (32, P)), data=tile("sbuf", F32, (P, 32)))
    cut = isa.nc_transpose(dst=tile("psum", F32, (16, P)), data=tile("sbuf", F32, (P, 2, 16))[:, :, 4:12])
    neither = isa.nc_transpose(dst=tile("psum", F32, (16, 2, 32))[:, :, :16],
                              data=tile("sbuf", F32, (P, 2, 16))[:, :, :8])
    for instr in (flat, cut):
        dv, values = instr.transposed_views(core)
        assert dv.shape == values.shape
        assert dv.untyped_storage().data_ptr() == core.psum.data.untyped_storage().data_ptr()
        assert values.untyped_storage().data_ptr() == core.sbuf.data.untyped_storage().data_ptr()
    dv, values = cut.transposed_views(core)
    assert values.shape == (2, 8, P)
    assert neither.transposed_views(core) is None


# ---- nc_matmul: the one-call probe -----------------------------------------------------------------------------

def test_mm_probe_runs_on_the_simulator_threads_and_bounds_its_trials(monkeypatch):
    # a [1, 1] output: PROBE_OUTPUTS // 1 trials would be 256; the probe stops at PROBE_MAX_TRIALS, on SIM_THREADS
    # threads, and restores the caller's thread count
    seen = []
    probe = tensor_engine._probe_data

    def counted(shape, gen, specials):
        seen.append((torch.get_num_threads(), specials))
        return probe(shape, gen, specials)
    monkeypatch.setattr(tensor_engine, "_probe_data", counted)
    monkeypatch.setattr(tensor_engine, "_MM_INTO", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(SIM_THREADS + 1)
    try:
        a, b, out = torch.empty(96, 1).T, torch.empty(96, 1), torch.empty(4, 4)[1:2, 2:3]
        agrees = tensor_engine.mm_into_agrees(a, b, out)
        assert torch.get_num_threads() == SIM_THREADS + 1
    finally:
        torch.set_num_threads(threads)
    assert all(t == SIM_THREADS for t, _ in seen)
    trials = len(seen) // 2   # two operands per trial
    assert 1 <= trials <= tensor_engine.PROBE_MAX_TRIALS
    if agrees:  # every trial ran, the last with infinities and NaNs
        assert trials == tensor_engine.PROBE_MAX_TRIALS
        assert [sp for _, sp in seen] == [False] * (2 * trials - 2) + [True, True]


@pytest.mark.parametrize("k", [1, 2, 3, 96])
def test_tiny_matmul_steps_match_execute_and_float64(k):
    # [1, 1] and [1, 3] outputs (the layouts probed fewest times): overwrite, accumulate into the group, add where
    # open; the step's bits are execute's, and within fp32 summation's bound of a float64 reference
    cores = [NeuronCore("trn2", nan_fill=False) for _ in range(2)]
    for m, n in ((1, 1), (1, 3)):
        s = tile("sbuf", F32, (k, m), offset=4 + 64 * m)
        mv = tile("sbuf", F32, (k, n), offset=1024 + 8 * n)
        dst = tile("psum", F32, (m, n), offset=4 * n)
        instrs = [isa.nc_matmul(dst=dst, stationary=s, moving=mv, accumulate=acc) for acc in (False, True, None)]
        for seed, instr in enumerate(instrs):
            values = [_matmul_operand((k, m), F32, seed), _matmul_operand((k, n), F32, seed + 7)]
            for c in cores:
                s.write(c, values[0])
                mv.write(c, values[1])
            before = dst.read(cores[1]).double()
            instr.step(cores[0], {})([])
            cores[1].execute(instr)
            assert torch.equal(dst.view(cores[0]).view(torch.int32), dst.view(cores[1]).view(torch.int32))
            a, b = values[0].double(), values[1].double()
            adds = instr.accumulate is not False   # None adds too: the overwrite before opened the group
            want = a.T @ b + (before if adds else 0.0)
            got = dst.read(cores[1]).double()
            bound = (k + 1) * 2.0 ** -24 * (a.abs().T @ b.abs() + (before.abs() if adds else 0.0))
            finite = want.isfinite() & got.isfinite()
            assert ((got - want).abs() <= bound)[finite].all()
            assert torch.equal(got.isfinite(), want.isfinite())


# ---- the copy batch's walk over outer dims (with cache hints ahead of each copy) ---------------------------------

def _walk_cases():
    """(dst's buffer, dst as a view of it, src): 3 to 5 dims, permuted and sliced, size-1 dims, a broadcast (stride 0)
    source, transposes under two outer dims, sides inside padded buffers (as SBUF rows are)."""
    buf = _bits((6, 5, 7, 40), F32, 1)
    return [
        (_bits((3, 5, 7, 11), F32, 2), lambda t: t[:, :, :, 1:10], buf[:3, :, :, 3:12]),        # 4-d, sliced rows
        (_bits((7, 3, 5, 9), BF16, 3), lambda t: t, _bits((5, 9, 7, 3), BF16, 4).permute(2, 3, 0, 1)),  # permuted
        (_bits((2, 1, 3, 1, 33), torch.uint8, 5), lambda t: t, _bits((2, 1, 3, 1, 33), torch.uint8, 6)),  # size 1
        (_bits((4, 6, 10), F32, 7), lambda t: t, _bits((4, 1, 10), F32, 8).expand(4, 6, 10)),    # broadcast
        (_bits((2, 3, 20, 24), F32, 9), lambda t: t,
         _bits((2, 3, 24, 30), F32, 10)[:, :, :, 3:23].transpose(2, 3)),                         # transposes
        (_bits((3, 2, 17, 9), BF16, 11), lambda t: t, _bits((3, 2, 9, 40), BF16, 12)[:, :, :, :17].transpose(2, 3)),
        (_bits((5, 64, 48), torch.int16, 13), lambda t: t.transpose(1, 2), _bits((5, 48, 64), torch.int16, 14)),
    ]


@pytest.mark.parametrize("case", range(7))
def test_batched_copies_over_outer_dims_match_torch(case):
    base, view_of, src = _walk_cases()[case]
    want = base.clone()
    view_of(want).copy_(src)
    _copy_batch_of([(view_of(base), src)]).run([])
    assert _same_bits(base, want)


def test_a_batch_of_copies_over_outer_dims_runs_in_order():
    # the second copy reads what the first wrote (a 3-d transposed pattern), the third overwrites part of the first
    a = _bits((4, 16, 24), F32, 20)
    b = torch.zeros(4, 24, 16).transpose(1, 2)                  # [4, 16, 24], dense along dim 1
    c = torch.zeros(4, 16, 24)
    d = _bits((2, 16, 24), F32, 21)
    _copy_batch_of([(b, a), (c, b), (b[1:3], d)]).run([])
    assert _same_bits(c, a)
    want = a.clone()
    want[1:3] = d
    assert _same_bits(b, want)


# ---- runs of independent matmuls as one bmm (tensor_engine.batch_matmuls) --------------------------------------

K, M, N, RUN = 16, 24, 20, 6   # partial tiles: K rows of 128, M of 128 columns, N of 512


def _operands(i: int, dtype=F32) -> tuple:
    """The i-th matmul's operands of a run: each in its own 16-partition band of SBUF (as one PE row tile each)."""
    return (tile("sbuf", dtype, (K, M), start_partition=K * i, offset=2560),
            tile("sbuf", dtype, (K, N), start_partition=K * i, offset=3072))


def _matmuls() -> tuple[Program, list[list[int]], list[list[int]]]:
    """A run of overwrites stepping through SBUF bands and PSUM columns, then runs that must not be batched whole: a
    result step that changes (its first two batch), two results in one box, a shared stationary, accumulations,
    results stepping by less than their width; a run of bf16 operands (batched); then matmuls with accumulate=None
    into a box the run opened (adds) and into one it did not (overwrites). Runs apart by a copy between them. Also:
    per run, the indices of its instructions that batch into the first of them, and of those that keep their own
    entries."""
    box = lambda j: tile("psum", F32, (M, N), offset=2048 + 4 * N * j)                  # noqa: E731
    irregular = [tile("psum", F32, (M, N), offset=o) for o in (8192, 8192 + 4 * N, 8192 + 12 * N)]
    groups = [
        [isa.nc_matmul_tiled(dst=box(j), stationary=_operands(j)[0], moving=_operands(j)[1], accumulate=False,
                             tile_position=(K * j // 32 * 32, 0), tile_size=(32, 128)) for j in range(RUN)],
        [isa.nc_matmul(dst=d, stationary=_operands(j)[0], moving=_operands(j)[1], accumulate=False)
         for j, d in enumerate(irregular)],
        [isa.nc_matmul(dst=box(0), stationary=_operands(j)[0], moving=_operands(j)[1], accumulate=False)
         for j in (1, 2)],                                                                  # one box twice
        [isa.nc_matmul(dst=box(j), stationary=_operands(0)[0], moving=_operands(j)[1], accumulate=False)
         for j in (3, 4, 5)],                                                               # a shared stationary
        [isa.nc_matmul(dst=box(j), stationary=_operands(j)[0], moving=_operands(j)[1], accumulate=True)
         for j in (3, 4)],                                                                  # accumulations
        [isa.nc_matmul(dst=tile("psum", F32, (M, N), offset=14336 + 2 * N * j), stationary=_operands(j)[0],
                       moving=_operands(j)[1], accumulate=False) for j in range(3)],        # results overlap
        [isa.nc_matmul(dst=tile("psum", F32, (M, N), offset=4096 + 4 * N * j), stationary=_operands(j, BF16)[0],
                       moving=_operands(j, BF16)[1], accumulate=False) for j in range(4)],  # bf16 operands
        [isa.nc_matmul(dst=box(1), stationary=_operands(6)[0], moving=_operands(6)[1]),
         isa.nc_matmul(dst=tile("psum", F32, (M, N), offset=12288), stationary=_operands(7)[0],
                       moving=_operands(7)[1])],
    ]
    batched = [list(range(1, RUN)), [1], [], [], [], [], [1, 2, 3], []]
    body = [isa.dma_copy(dst=tile("sbuf", F32, (128, 256), offset=2560), src=tile("hbm:x", F32, (128, 256)))]
    spans = []
    for group in groups:
        spans.append(list(range(len(body), len(body) + len(group))))
        body += [*group, isa.tensor_copy(dst=tile("sbuf", F32, (1, 4), offset=65536),
                                         src=tile("sbuf", F32, (1, 4), offset=65600))]
    merged = [[span[i] for i in b] for span, b in zip(spans, batched)]
    own = [[i for i in span if i not in m] for span, m in zip(spans, merged)]
    return Program(body, [ArgSlot("x", (128, 256), F32)], "matmuls"), merged, own


def _matmul_input(seed: int) -> torch.Tensor:
    """Matmul operand values (many binades, +-0, infinities, NaNs of distinct payloads) with subnormals among them."""
    x = _matmul_operand((128, 256), F32, seed)
    x.view(-1)[7::97] = torch.tensor([1e-40, -3e-42, 1e-45])[torch.arange(len(x.view(-1)[7::97])) % 3]
    return x


@pytest.mark.parametrize("agrees", [True, False], ids=["bmm", "bmm refused"])
def test_runs_of_matmuls_match_execute_and_float64(agrees, monkeypatch):
    if not agrees:
        monkeypatch.setattr(tensor_engine, "bmm_agrees", lambda a, b: False)
    prog, merged, own = _matmuls()
    fast, slow = NeuronCore("trn2", nan_fill=False, host_order=False), NeuronCore("trn2", nan_fill=False)
    for seed in (1, 2):
        for core in (fast, slow):
            core.psum.data.copy_(_bits(tuple(core.psum.data.shape), torch.uint8, seed))
        x = _matmul_input(seed)
        fast.run(prog, {"x": x}, timed=False)
        _reference(slow, prog, {"x": x.clone()})
        assert torch.equal(fast.psum.data, slow.psum.data) and torch.equal(fast.sbuf.data, slow.sbuf.data)
        assert torch.equal(fast.psum.group_closed, slow.psum.group_closed)
        # the run's results (those the later matmuls leave): within fp32 summation's bound of float64 (relative
        # rounding per step, and an absolute 2**-149 per product in the subnormal range); outputs whose finite
        # products reach fp32's overflow (bf16 operands read from fp32 bytes span its whole range) are left to the
        # comparison with execute above
        for j, dtype, offset in ((2, F32, 2048), (2, BF16, 4096)):
            a, b = (ap.read(slow).double() for ap in _operands(j, dtype))
            want, got = a.T @ b, tile("psum", F32, (M, N), offset=offset + 4 * N * j).read(slow).double()
            magnitude = a.abs().nan_to_num(0.0, posinf=0.0).T @ b.abs().nan_to_num(0.0, posinf=0.0)
            kept = magnitude < torch.finfo(F32).max
            finite = want.isfinite() & kept
            bound = K * 2.0 ** -24 * (a.abs().T @ b.abs()) + K * 2.0 ** -149
            assert ((got - want).abs() <= bound)[finite].all()
            assert torch.equal(got[~finite & kept].nan_to_num(0.0), want[~finite & kept].nan_to_num(0.0))
            assert torch.equal(got.isnan()[kept], want.isnan()[kept])
            assert kept.float().mean() > 0.5   # most outputs checked
    firsts = {id(entry[0]) for entry in fast._plan(prog).batched}
    ins = prog.instructions
    assert all(id(ins[i]) in firsts for span in own for i in span)
    assert all((id(ins[i]) in firsts) is not agrees for span in merged for i in span)


def test_which_matmuls_continue_a_run():
    """The rule batched runs follow (``extends_matmul_run``, shared by ``batch_matmuls`` and the packed host layout):
    the first's layouts, each operand a positive step from the last, the step between the first two."""
    def mm(i, step=2048, parts=128, accumulate=False, dst_step=512):
        return isa.nc_matmul(dst=tile("psum", F32, (64, 128), offset=dst_step * i),
                             stationary=tile("sbuf", F32, (parts, 64), offset=step * i),
                             moving=tile("sbuf", F32, (parts, 128), offset=1024 + step * i), accumulate=accumulate)
    run = [mm(0), mm(1)]
    assert tensor_engine.extends_matmul_run(run[:1], run[1]) and tensor_engine.extends_matmul_run(run, mm(2))
    assert not tensor_engine.extends_matmul_run(run, mm(3))                      # another step than the run's
    assert not tensor_engine.extends_matmul_run(run[:1], mm(0))                  # no step
    assert not tensor_engine.extends_matmul_run([mm(1)], mm(0))                  # a step back
    assert not tensor_engine.extends_matmul_run(run[:1], mm(1, parts=64))        # another partition count
    assert not tensor_engine.extends_matmul_run(run[:1], mm(1, accumulate=True))  # an accumulation reads PSUM
    assert tensor_engine.run_operands(mm(0, accumulate=None)) is None
