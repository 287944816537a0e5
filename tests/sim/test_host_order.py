"""Demand order on the host (``sim.host_order``): a static program run with its instructions reordered gives bit for
bit what it gives in program order, and no instruction moves past what it depends on (bytes, HBM slots that may be
one tensor, an engine's registers, barriers)."""
from __future__ import annotations

import random

import pytest
import torch

from torchneuron.sim import AP, ArgSlot, NeuronCore, Program, SimulatorError, host_order, isa, tile

F32 = torch.float32
TABLE = AP("hbm:table", F32, ((64, 128), (1, 64)))  # rows of a [16, 64] table, dim 0 indexed


def _runs(program: Program, tensors: list) -> list[list[torch.Tensor]]:
    """The program's slot tensors after a run in program order and after one in demand order (own cores, packed
    and not), each on clones of ``tensors``."""
    out = []
    for order, pack in ((False, False), (True, False), (True, True)):
        core = NeuronCore("trn2", host_order=order, pack_tiles=pack)
        out.append(core.run_bound(program, [None if t is None else t.clone() for t in tensors]))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _assert_same_runs(program: Program, tensors: list) -> None:
    first, *others = _runs(program, tensors)
    for other in others:
        for a, b in zip(first, other):
            assert torch.equal(_bits(a), _bits(b)), program.name


def _random_program(seed: int, steps: int = 300) -> tuple[Program, list[torch.Tensor | None]]:
    """Loads issued early and stores late (as a compiled program's are), tiles reused in place and by column
    slices, PSUM accumulation groups opened, added to and read out, transposes, register reductions read out,
    random bits (barriers), an in-place update of an input read again and stores."""
    rnd = random.Random(seed)
    core = NeuronCore("trn2")
    sb, ps = core.sbuf, core.psum
    x, io = tile("hbm:x", F32, (512, 256)), tile("hbm:io", F32, (512, 256))
    out = tile("hbm:out", F32, (4096, 256))
    prog: list = []
    tiles: list = []
    stores = 0

    def fresh(cols: int = 256):
        t = sb.allocate(128, cols * 4).tile(F32, (cols,))
        if cols == 256:  # (the [128, 1] results are read only by the loads and stores of whole tiles' bytes)
            tiles.append(t)
        return t

    for _ in range(steps):
        kind = rnd.randrange(11)
        if len(tiles) < 3 or kind == 0:     # a load (of an input, or of the input updated in place)
            src = rnd.choice((x, io))
            row = rnd.randrange(0, 512 - 128 + 1, 32)
            prog.append(isa.dma_copy(dst=fresh(), src=src[row:row + 128, :]))
            continue
        a, b = rnd.choice(tiles), rnd.choice(tiles)
        if kind == 1:
            prog.append(isa.tensor_tensor(dst=fresh(), data1=a, data2=b, op=rnd.choice(("add", "multiply"))))
        elif kind == 2:                     # in place, on a column slice
            c0 = rnd.randrange(0, 128)
            prog.append(isa.tensor_scalar(dst=a[:, c0:c0 + 128], data=b[:, c0:c0 + 128], op0="multiply",
                                          operand0=rnd.uniform(-1.5, 1.5)))
        elif kind == 3:                     # a PSUM group: overwrite, accumulate, read out
            acc = ps.allocate(128, 512).tile(F32, (128,))
            prog.append(isa.nc_matmul(dst=acc, stationary=a[:, :128], moving=b[:, :128], accumulate=False))
            prog.append(isa.nc_matmul(dst=acc, stationary=b[:, :128], moving=a[:, 128:], accumulate=True))
            prog.append(isa.tensor_copy(dst=a[:, 128:], src=acc))
            ps.free_all()
        elif kind == 4:                     # a transpose through PSUM
            acc = ps.allocate(128, 512).tile(F32, (128,))
            prog.append(isa.nc_transpose(dst=acc, data=a[:, :128]))
            prog.append(isa.activation(dst=b[:, :128], op="tanh", data=acc))
            ps.free_all()
        elif kind == 5:                     # a register reduction (ScalarE), read out later
            res = fresh(cols=1)
            prog.append(isa.activation(dst=fresh(), op="exp", data=a, scale=0.01, reduce_cmd="reset_reduce"))
            prog.append(isa.activation(dst=fresh(), op="identity", data=b, reduce_cmd="reduce", reduce_res=res))
        elif kind == 6:                     # a store
            prog.append(isa.dma_copy(dst=out[stores * 128:(stores + 1) * 128, :], src=a))
            stores += 1
        elif kind == 7:                     # the input updated in place (read again by later loads)
            row = rnd.randrange(0, 512 - 128 + 1, 32)
            prog.append(isa.dma_copy(dst=io[row:row + 128, :], src=a))
        elif kind == 8:
            prog.append(isa.memset(dst=a[:, rnd.randrange(256):][:, :1], value=rnd.uniform(-1, 1)))
        elif kind == 9 and len(tiles) > 8:  # a tile freed: a later one takes its bytes
            tiles.remove(a)
        elif kind == 9:                     # random bits (a barrier: the generator's state), stored as floats
            bits = sb.allocate(128, 1024).tile(torch.int32, (256,))
            prog.append(isa.rng(dst=bits))
            prog.append(isa.dma_copy(dst=out[stores * 128:(stores + 1) * 128, :], src=bits))
            stores += 1
        else:
            prog.append(isa.tensor_reduce(dst=fresh(cols=1), data=a, op="add", axis=1))
        if stores == 32:
            break
    args = [ArgSlot("x", (512, 256), F32), ArgSlot("io", (512, 256), F32), ArgSlot("out", (4096, 256), F32, "output")]
    gen = torch.Generator().manual_seed(seed)
    return Program(prog, args, f"random{seed}"), [torch.randn(512, 256, generator=gen),
                                                  torch.randn(512, 256, generator=gen), torch.zeros(4096, 256)]


@pytest.mark.parametrize("seed", range(6))
def test_random_programs_in_demand_order_give_the_same_bits(seed):
    program, tensors = _random_program(seed)
    order = host_order.demand_order(program.instructions)
    assert order != program.instructions and sorted(map(id, order)) == sorted(map(id, program.instructions))
    _assert_same_runs(program, tensors)


def test_a_load_runs_right_before_its_first_reader():
    """Loads issued at the start move down to the instruction that reads them (the results no instruction reads run
    in program order, each after what it needs; the store also waits for the loads: it writes HBM)."""
    tiles = [tile("sbuf", F32, (128, 64), offset=256 * i) for i in range(4)]
    loads = [isa.dma_copy(dst=t, src=tile("hbm:x", F32, (128, 64))) for t in tiles]
    uses = [isa.activation(dst=t, op="exp", data=t) for t in tiles]
    store = isa.dma_copy(dst=tile("hbm:out", F32, (128, 64)), src=tiles[0])
    order = host_order.demand_order([*loads, *uses, store])
    assert order == (loads[1], uses[1], loads[2], uses[2], loads[3], uses[3], loads[0], uses[0], store)


def test_a_write_of_one_hbm_slot_keeps_its_order_with_every_hbm_access():
    """Two slots may be bound to one tensor (an in-place op's input and output): a load of ``x`` after a store into
    ``out`` must still see that store when both are the same tensor."""
    a, b = tile("sbuf", F32, (128, 64), offset=0), tile("sbuf", F32, (128, 64), offset=256)
    first, second = tile("hbm:x", F32, (256, 64))[:128], tile("hbm:x", F32, (256, 64))[128:]
    program = Program([isa.dma_copy(dst=a, src=first),
                       isa.activation(dst=a, op="exp", data=a),
                       isa.dma_copy(dst=tile("hbm:out", F32, (256, 64))[128:], src=a),  # x[128:] when out is x
                       isa.dma_copy(dst=b, src=second),
                       isa.dma_copy(dst=tile("hbm:out", F32, (256, 64))[:128], src=b)],
                      [ArgSlot("x", (256, 64), F32), ArgSlot("out", (256, 64), F32, "output")], "aliased")
    preds = host_order.predecessors(program.instructions)
    assert 2 in preds[3] and 3 in preds[4]
    x = torch.randn(256, 64)
    for order in (False, True):
        shared = x.clone()
        NeuronCore("trn2", host_order=order).run_bound(program, [shared, shared])
        assert torch.equal(shared[:128], torch.exp(x[:128])) and torch.equal(shared[128:], shared[:128])


def test_register_reductions_of_one_engine_keep_their_order():
    """Reductions into ScalarE's registers on unrelated tiles depend on each other through the registers: the reset
    runs first although its tile is stored last."""
    t = [tile("sbuf", F32, (128, 64), offset=256 * i) for i in range(4)]
    res = tile("sbuf", F32, (128, 1), offset=2048)
    prog = [isa.memset(dst=t[0], value=1.0), isa.memset(dst=t[1], value=2.0),
            isa.activation(dst=t[2], op="identity", data=t[0], reduce_cmd="reset_reduce"),
            isa.activation(dst=t[3], op="identity", data=t[1], reduce_cmd="reduce", reduce_res=res),
            isa.dma_copy(dst=tile("hbm:out", F32, (128, 1)), src=res),
            isa.dma_copy(dst=tile("hbm:out2", F32, (128, 64)), src=t[2])]
    assert 2 in host_order.predecessors(prog)[3]
    program = Program(prog, [ArgSlot("out", (128, 1), F32, "output"), ArgSlot("out2", (128, 64), F32, "output")],
                      "registers")
    for out, _ in _runs(program, [None, None]):
        assert torch.equal(out, torch.full((128, 1), 64 * 3.0))


def test_nothing_moves_past_a_barrier():
    """An instruction outside REORDERABLE (random bits here) keeps everything before it before it and everything
    after after: the load before it runs before it although only the last instruction reads it."""
    t, bits = tile("sbuf", F32, (128, 64), offset=0), tile("sbuf", torch.int32, (128, 64), offset=1024)
    load = isa.dma_copy(dst=t, src=tile("hbm:x", F32, (128, 64)))
    rng = isa.rng(dst=bits)
    use = isa.activation(dst=t, op="exp", data=t)
    assert type(rng) not in host_order.REORDERABLE
    assert host_order.demand_order([load, rng, use]) == (load, rng, use)


def test_barriers_keep_their_order():
    """Two random-bit instructions in a row: the second stays after the first (the generator's state), though the
    store depth first reaches the second before the copy of the first's tile."""
    a, b = tile("sbuf", torch.int32, (128, 64), offset=0), tile("sbuf", torch.int32, (128, 64), offset=256)
    copy = tile("sbuf", torch.int32, (128, 64), offset=512)
    program = Program([isa.rng(dst=a), isa.rng(dst=b), isa.tensor_copy(dst=copy, src=a),
                       isa.dma_copy(dst=tile("hbm:out_a", torch.int32, (128, 64)), src=copy),
                       isa.dma_copy(dst=tile("hbm:out_b", torch.int32, (128, 64)), src=b)],
                      [ArgSlot("out_a", (128, 64), torch.int32, "output"),
                       ArgSlot("out_b", (128, 64), torch.int32, "output")], "rng")
    assert host_order.predecessors(program.instructions)[1] == [0]
    _assert_same_runs(program, [None, None])


def test_an_indirect_dma_is_a_barrier():
    idx = tile("sbuf", torch.int32, (128, 1), offset=0)
    gather = isa.dma_copy(dst=tile("sbuf", F32, (128, 64), offset=1024), src=TABLE, src_index=idx)
    assert not host_order._reorderable(gather)
    assert host_order._reorderable(isa.dma_copy(dst=idx, src=tile("hbm:idx", torch.int32, (128, 1))))


def test_an_error_in_a_reordered_run_names_the_programs_instruction():
    """The run raises at the same instruction in either order (a gather index out of range), named as in the
    program."""
    far, idx = tile("sbuf", F32, (128, 64), offset=4096), tile("sbuf", torch.int32, (128, 1), offset=0)
    program = Program([isa.dma_copy(dst=idx, src=tile("hbm:idx", torch.int32, (128, 1))),
                       isa.memset(dst=far, value=1.0),
                       isa.dma_copy(dst=far, src=TABLE, src_index=idx),
                       isa.dma_copy(dst=tile("hbm:out", F32, (128, 64)), src=far)],
                      [ArgSlot("idx", (128, 1), torch.int32), ArgSlot("table", (16, 64), F32),
                       ArgSlot("out", (128, 64), F32, "output")], "gather")
    messages = []
    for order in (False, True):
        with pytest.raises(SimulatorError) as e:
            NeuronCore("trn2", host_order=order).run_bound(
                program, [torch.full((128, 1), 99, dtype=torch.int32), torch.randn(16, 64), None])
        messages.append(str(e.value))
    assert messages[0] == messages[1] and messages[0].startswith("dma_copy:")


def test_a_compiled_training_step_in_demand_order_gives_the_same_bits(compiled_step_runs):
    """Every program of a compiled model's forward, backward and optimizer step, replayed in program order and in
    demand order."""
    moved = 0
    for program, tensors in compiled_step_runs:
        moved += host_order.demand_order(program.instructions) != program.instructions
        _assert_same_runs(program, tensors)
    assert moved >= 2


def test_a_program_with_an_instruction_that_will_raise_runs_in_program_order():
    """A tile beyond this core's SBUF (its step cannot be made: execute raises it): the run keeps program order, so
    it stops before the store that follows in the program, which demand order would have run first (the input
    updated in place would be changed by a run that raised)."""
    t0, copy = tile("sbuf", F32, (128, 64), offset=0), tile("sbuf", F32, (128, 64), offset=256)
    beyond = tile("sbuf", F32, (128, 64), offset=NeuronCore("trn2").sbuf.bytes_per_partition)
    prog = [isa.dma_copy(dst=t0, src=tile("hbm:x", F32, (128, 64))),
            isa.activation(dst=t0, op="exp", data=t0),
            isa.memset(dst=beyond, value=1.0),
            isa.dma_copy(dst=tile("hbm:x", F32, (128, 64)), src=t0),
            isa.tensor_copy(dst=copy, src=beyond),
            isa.dma_copy(dst=tile("hbm:out", F32, (128, 64)), src=copy)]
    assert host_order.demand_order(prog).index(prog[3]) < host_order.demand_order(prog).index(prog[2])
    program = Program(prog, [ArgSlot("x", (128, 64), F32), ArgSlot("out", (128, 64), F32, "output")], "raises")
    x = torch.randn(128, 64)
    for order in (False, True):
        bound = x.clone()
        with pytest.raises(SimulatorError, match="memset: dst"):
            NeuronCore("trn2", host_order=order).run_bound(program, [bound, None])
        assert torch.equal(bound, x)
