"""Packed host layouts (``sim.host_layout``): a long static program run with its SBUF tiles packed on the host gives
bit for bit what the program run as it is gives, and programs the packing cannot prove equivalent run as they are."""
from __future__ import annotations

import random

import pytest
import torch

from torchneuron.sim import AP, ArgSlot, NeuronCore, Program, SimulatorError, host_layout, isa, tile
from torchneuron.sim.memory import IndexOutOfRange

F32 = torch.float32
ROWS, COLS = 128, 1024  # each store of a tile fills one [128, 1024] block of the output


def _plain_and_packed(program: Program, inputs: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The program's outputs run as it is and run packed (each on its own core)."""
    outs = []
    for pack in (False, True):
        core = NeuronCore("trn2", pack_tiles=pack)
        outs.append(core.run(program, {k: v.clone() for k, v in inputs.items()}, timed=False).outputs)
    return outs[0], outs[1]


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def _random_program(seed: int, steps: int = 240) -> tuple[Program, dict[str, torch.Tensor]]:
    """A program of fp32 tiles allocated next fit (so they spread over SBUF and reuse each other's bytes), written
    and read whole, in column slices, every other column and in place, through PSUM and at partition offsets."""
    rnd = random.Random(seed)
    core = NeuronCore("trn2")
    sb = core.sbuf
    src = tile("hbm:x", F32, (ROWS, COLS))
    prog: list = []
    live: list = []  # (region, tile)
    stores = 0

    def new_tile():
        parts = rnd.choice((128, 64, 32))
        start = rnd.choice((0, 128 - parts))
        cols = rnd.choice((64, 256, 512, 1024))
        region = sb.allocate(parts, cols * 4, start_partition=start)
        t = region.tile(F32, (cols,))
        prog.append(isa.dma_copy(dst=t, src=src[rnd.randrange(0, ROWS - parts + 1):][:parts, :cols]))
        live.append((region, t))
        return t

    def same_shape(t):
        return [u for _, u in live if u.shape == t.shape]

    for _ in range(steps):
        if len(live) < 4:
            new_tile()
            continue
        _, a = rnd.choice(live)
        kind = rnd.randrange(9)
        if kind == 0:    # free a tile: later tiles take its bytes
            region, _ = live.pop(rnd.randrange(len(live)))
            sb.free(region)
        elif kind == 1:  # element-wise into a fresh tile
            b = rnd.choice(same_shape(a))
            out = sb.allocate(a.partitions, a.shape[1] * 4, start_partition=a.start_partition)
            t = out.tile(F32, (a.shape[1],))
            prog.append(isa.tensor_tensor(dst=t, data1=a, data2=b, op=rnd.choice(("add", "multiply", "subtract"))))
            live.append((out, t))
        elif kind == 2:  # in place
            b = rnd.choice(same_shape(a))
            prog.append(isa.tensor_tensor(dst=a, data1=a, data2=b, op="add"))
        elif kind == 3:  # a dense column slice rewritten (the rest of the tile keeps its bytes)
            c0 = rnd.randrange(a.shape[1] // 2)
            part = a[:, c0:c0 + a.shape[1] // 2]
            prog.append(isa.tensor_scalar(dst=part, data=part, op0="multiply", operand0=rnd.uniform(-2, 2)))
        elif kind == 4:  # every other column written (a strided write)
            b = rnd.choice(same_shape(a))
            prog.append(isa.activation(dst=a[:, ::2], op="tanh", data=b[:, 1::2]))
        elif kind == 5 and a.shape[1] >= a.partitions:  # through PSUM: a matmul and its copy out
            k = a.partitions
            n = min(a.shape[1], 512)
            acc = core.psum.allocate(k, n * 4).tile(F32, (n,))
            prog.append(isa.nc_matmul(dst=acc, stationary=a[:, :k], moving=a[:, :n], accumulate=False))
            prog.append(isa.tensor_copy(dst=a[:, :n], src=acc))
            core.psum.free_all()
        elif kind == 6:  # a store
            prog.append(isa.dma_copy(dst=tile("hbm:out", F32, (64 * ROWS, COLS))[stores * ROWS:][:a.partitions,
                                                                                               :a.shape[1]], src=a))
            stores += 1
        elif kind == 7:  # a column filled on its own
            prog.append(isa.memset(dst=a[:, :1], value=rnd.uniform(-1, 1)))
        else:
            new_tile()
        if stores == 63:
            break
    for _, t in live:
        if stores == 64:
            break
        prog.append(isa.dma_copy(dst=tile("hbm:out", F32, (64 * ROWS, COLS))[stores * ROWS:][:t.partitions,
                                                                                           :t.shape[1]], src=t))
        stores += 1
    args = [ArgSlot("x", (ROWS, COLS), F32), ArgSlot("out", (64 * ROWS, COLS), F32, "output")]
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))
    return Program(prog, args, f"random{seed}"), {"x": x}


@pytest.mark.parametrize("seed", range(6))
def test_random_programs_packed_give_the_same_bits(seed):
    program, inputs = _random_program(seed)
    instructions = host_layout.packed(program, NeuronCore("trn2").sbuf.bytes_per_partition)
    assert instructions is not None, "the program should be packed"
    moved = [old for old, new in zip(program.instructions, instructions) if old is not new]
    assert moved
    plain, packed = _plain_and_packed(program, inputs)
    assert _same_bits(plain, packed)


def test_packed_program_keeps_its_tiles_in_fewer_host_bytes():
    program, _ = _random_program(0)
    instructions = host_layout.packed(program, NeuronCore("trn2").sbuf.bytes_per_partition)
    reach = [max(ap.byte_range[1] for i in instrs for _, ap in i.operands() if ap.memory == "sbuf")
             for instrs in (program.instructions, instructions)]
    assert reach[1] < reach[0] // 2


def _long_program(*middle, args: tuple[ArgSlot, ...] = ()) -> Program:
    """A tile written far up SBUF (beyond MIN_SPAN), the ``middle`` instructions, then [128, 64] tiles stored; the
    program's arguments are x, out, out2 and ``args``."""
    far = tile("sbuf", F32, (128, 64), offset=host_layout.MIN_SPAN + 4096)
    near = tile("sbuf", F32, (128, 64), offset=0)
    prog = [isa.dma_copy(dst=far, src=tile("hbm:x", F32, (128, 64))), *middle,
            isa.dma_copy(dst=tile("hbm:out", F32, (128, 64)), src=far),
            isa.dma_copy(dst=tile("hbm:out2", F32, (128, 64)), src=near)]
    return Program(prog, [ArgSlot("x", (128, 64), F32), ArgSlot("out", (128, 64), F32, "output"),
                          ArgSlot("out2", (128, 64), F32, "output"), *args], "long")


def test_a_program_reading_sbuf_it_never_wrote_runs_as_it_is():
    near = tile("sbuf", F32, (128, 64), offset=0)
    far = tile("sbuf", F32, (128, 64), offset=host_layout.MIN_SPAN + 4096)
    reads_unwritten = _long_program(isa.tensor_tensor(dst=far, data1=far, data2=near, op="add"))
    assert host_layout.packed(reads_unwritten, 1 << 20) is None
    writes_first = _long_program(isa.memset(dst=near, value=1.0),
                                 isa.tensor_tensor(dst=far, data1=far, data2=near, op="add"))
    assert host_layout.packed(writes_first, 1 << 20) is not None
    # the run reads what the core's SBUF holds there, packing or not
    core = NeuronCore("trn2")
    core.sbuf.data[:, :256].view(F32).fill_(3.0)
    x = torch.randn(128, 64)
    out = core.run(reads_unwritten, {"x": x}, timed=False).outputs
    assert torch.equal(out["out"], x + 3.0) and torch.equal(out["out2"], torch.full((128, 64), 3.0))


def test_a_read_of_some_unwritten_bytes_is_refused():
    near = tile("sbuf", F32, (128, 64), offset=0)
    half = tile("sbuf", F32, (128, 32), offset=0)
    partial = _long_program(isa.memset(dst=half, value=1.0),
                            isa.tensor_copy(dst=tile("sbuf", F32, (128, 64), offset=4096), src=near))
    assert host_layout.packed(partial, 1 << 20) is None
    strided = _long_program(isa.memset(dst=near[:, ::2], value=1.0),
                            isa.tensor_copy(dst=tile("sbuf", F32, (128, 64), offset=4096), src=near))
    assert host_layout.packed(strided, 1 << 20) is None
    both = _long_program(isa.memset(dst=near[:, ::2], value=1.0), isa.memset(dst=near[:, 1::2], value=2.0),
                         isa.tensor_copy(dst=tile("sbuf", F32, (128, 64), offset=4096), src=near))
    assert host_layout.packed(both, 1 << 20) is not None


def test_short_programs_unknown_instructions_and_dynamic_loops_run_as_they_are():
    near = tile("sbuf", F32, (128, 64), offset=0)
    short = Program([isa.memset(dst=near, value=1.0), isa.dma_copy(dst=tile("hbm:out", F32, (128, 64)), src=near)],
                    [ArgSlot("out", (128, 64), F32, "output")])
    assert host_layout.packed(short, 1 << 20) is None
    mask = tile("sbuf", torch.uint8, (128, 64), offset=8192)
    predicated = _long_program(isa.memset(dst=near, value=1.0), isa.memset(dst=mask, value=1),
                               isa.tensor_copy_predicated(dst=near, src=near, predicate=mask))
    assert host_layout.packed(predicated, 1 << 20) is None
    loop = _long_program(isa.memset(dst=near, value=1.0), isa.loop_begin(counter=0, limit=1, end=3, start_imm=0,
                                                                          stop_imm=2),
                         isa.loop_end(counter=0, limit=1, stride=1, begin=2))
    assert loop.dynamic and host_layout.packed(loop, 1 << 20) is None


def test_a_packing_beyond_sbuf_is_refused():
    program, _ = _random_program(1)
    assert host_layout.packed(program, host_layout.MIN_SPAN + 8192) is None


FAR = tile("sbuf", F32, (128, 64), offset=host_layout.MIN_SPAN + 4096)


def _gather_program(oob_mode: str) -> Program:
    """``_long_program`` gathering rows of a 16-row table into its far tile by indices loaded into SBUF."""
    table = AP("hbm:table", F32, ((64, 128), (1, 64)))  # dim 0 indexed: rows of 64
    idx = tile("sbuf", torch.int32, (128, 1), offset=1024)
    program = _long_program(isa.memset(dst=tile("sbuf", F32, (128, 64), offset=0), value=1.0),
                            isa.dma_copy(dst=idx, src=tile("hbm:idx", torch.int32, (128, 1))),
                            isa.dma_copy(dst=FAR, src=table, src_index=idx, oob_mode=oob_mode),
                            args=(ArgSlot("table", (16, 64), F32), ArgSlot("idx", (128, 1), torch.int32)))
    assert host_layout.packed(program, 1 << 20) is not None
    return program


def test_an_indirect_dma_skipping_rows_keeps_the_old_bytes():
    """A gather with oob_mode="skip" leaves the rows out of range as they were: the packed run keeps them."""
    program = _gather_program("skip")
    instructions = host_layout.packed(program, 1 << 20)
    # the gather stays with the tile it updates
    assert instructions[0].dst.offset == instructions[3].dst.offset != FAR.offset
    inputs = {"x": torch.randn(128, 64), "table": torch.randn(16, 64),
              "idx": torch.randint(-4, 20, (128, 1), dtype=torch.int32)}
    plain, packed = _plain_and_packed(program, inputs)
    assert _same_bits(plain, packed)
    skipped = (inputs["idx"][:, 0] < 0) | (inputs["idx"][:, 0] >= 16)
    assert skipped.any() and torch.equal(plain["out"][skipped], inputs["x"][skipped])


def test_errors_name_the_programs_instruction():
    program = _gather_program("error")
    inputs = {"x": torch.randn(128, 64), "table": torch.randn(16, 64), "idx": torch.full((128, 1), 99, dtype=torch.int32)}
    messages = []
    for pack in (False, True):
        with pytest.raises(IndexOutOfRange) as e:
            NeuronCore("trn2", pack_tiles=pack).run(program, inputs, timed=False)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and messages[0].startswith("dma_copy:")


def _plan_packed(core: NeuronCore, program: Program, fresh: bool = True) -> bool:
    core.run_bound(program, [torch.randn(128, 64), None, None], fresh=fresh)
    return any(plan.originals for plan in core._plans.values())


def test_which_runs_are_packed():
    program = _long_program(isa.memset(dst=tile("sbuf", F32, (128, 64), offset=0), value=1.0))
    assert _plan_packed(NeuronCore("trn2"), program)
    assert not _plan_packed(NeuronCore("trn2", pack_tiles=False), program)
    assert not _plan_packed(NeuronCore("trn2", nan_fill=True), program)       # NaN fill shows the program's layout
    assert not _plan_packed(NeuronCore("trn2"), program, fresh=False)         # a continued kernel: on-chip state


def test_a_multi_core_launch_runs_its_programs_as_they_are():
    from torchneuron.nki import multicore
    from torchneuron.sim.specs import chip_spec
    assert not any(c.pack_tiles for c in multicore.chip_cores(chip_spec("trn2"), 2))


def test_sbuf_overflow_is_still_reported():
    beyond = tile("sbuf", F32, (128, 64), offset=NeuronCore("trn2").sbuf.bytes_per_partition)
    program = _long_program(isa.memset(dst=tile("sbuf", F32, (128, 64), offset=0), value=1.0),
                            isa.memset(dst=beyond, value=1.0))
    assert host_layout.packed(program, NeuronCore("trn2").sbuf.bytes_per_partition) is None
    with pytest.raises(SimulatorError, match="memset: dst"):
        NeuronCore("trn2").run(program, {"x": torch.randn(128, 64)}, timed=False)


def test_a_compiled_training_step_packed_gives_the_same_bits(monkeypatch, compiled_step_runs):
    """Every program of a compiled model's forward, backward and optimizer step, replayed as it is and packed (all
    sizes packed here: this model's programs are shorter than MIN_SPAN)."""
    monkeypatch.setattr(host_layout, "MIN_SPAN", 0)
    spec = NeuronCore("trn2").spec
    packed = 0
    for program, tensors in compiled_step_runs:
        packed += host_layout.packed(program, spec.sbuf_bytes_per_partition) is not None
        outs = [NeuronCore(spec, pack_tiles=pack).run_bound(program, [None if t is None else t.clone()
                                                                       for t in tensors])
                for pack in (False, True)]
        for a, b in zip(*outs):
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), program.name
    assert packed >= 2


def test_a_run_of_matmuls_stays_one_batched_product():
    """Consecutive overwriting matmuls whose operands step by constant offsets run as one product: packing keeps
    their operands' distances, so the packed plan batches them too (with the same bits)."""
    base = host_layout.MIN_SPAN + 4096
    lhs = [tile("sbuf", F32, (128, 64), offset=base + 2048 * i) for i in range(4)]
    rhs = [tile("sbuf", F32, (128, 128), offset=base + 1024 + 2048 * i) for i in range(4)]
    acc = [tile("psum", F32, (64, 128), offset=512 * i) for i in range(4)]
    res = tile("sbuf", F32, (64, 512), offset=0)
    x = tile("hbm:x", F32, (128, 1024))
    # loaded out of order: first fit alone would place them by their loads, not at constant steps
    order = [2, 0, 3, 1]
    prog = [isa.dma_copy(dst=t[i], src=x[:, 64 * i:64 * i + t[i].shape[1]]) for i in order for t in (lhs, rhs)]
    prog += [isa.nc_matmul(dst=a, stationary=s, moving=m, accumulate=False) for s, m, a in zip(lhs, rhs, acc)]
    prog += [isa.tensor_copy(dst=res[:, 128 * i:128 * (i + 1)], src=a) for i, a in enumerate(acc)]
    prog.append(isa.dma_copy(dst=tile("hbm:out", F32, (64, 512)), src=res))
    program = Program(prog, [ArgSlot("x", (128, 1024), F32), ArgSlot("out", (64, 512), F32, "output")], "mm_run")
    assert host_layout.packed(program, 1 << 20) is not None
    lengths = []
    for pack in (False, True):
        core = NeuronCore("trn2", pack_tiles=pack)
        plan = core._plan(program, pack)
        assert bool(plan.originals) == pack
        lengths.append(len(plan.batched))
    assert lengths[0] == lengths[1] <= len(prog) - 3  # (the four products: one entry)
    plain, packed = _plain_and_packed(program, {"x": torch.randn(128, 1024)})
    assert _same_bits(plain, packed)


PSUM = NeuronCore("trn2").psum
PSUM_LAYOUT = (PSUM.bytes_per_partition, PSUM.bank_bytes)


def _banks(instructions) -> set[int]:
    """The PSUM banks the instructions' PSUM operands start in."""
    return {ap.byte_range[0] // PSUM.bank_bytes for i in instructions for _, ap in i.operands() if ap.memory == "psum"}


def _psum_program(seed: int, steps: int = 160) -> tuple[Program, dict[str, torch.Tensor]]:
    """Products accumulated in PSUM tiles allocated next fit over the banks: groups opened by an overwriting matmul or
    a transpose, or a tile written by a copy (no group open); matmuls adding (accumulate=True) and adding where a
    group is open (None) onto them, an activation rewriting part of a tile (closing the group there), tiles read out
    whole and freed (later tiles take their bytes)."""
    rnd = random.Random(seed)
    core = NeuronCore("trn2")
    x = tile("hbm:x", F32, (128, 1024))
    operands = [core.sbuf.allocate(128, 512 * 4).tile(F32, (512,)) for _ in range(3)]
    stage = core.sbuf.allocate(128, 512 * 4).tile(F32, (512,))
    prog: list = [isa.dma_copy(dst=t, src=x[:, 128 * i:128 * i + 512]) for i, t in enumerate(operands)]
    live: list = []  # (region, PSUM tile)
    stores = 0

    def product(acc, accumulate):
        a, b = rnd.choice(operands), rnd.choice(operands)
        c0 = rnd.randrange(0, 512 - acc.shape[1] + 1, 64)
        prog.append(isa.nc_matmul(dst=acc, stationary=a[:, :128], moving=b[:, c0:c0 + acc.shape[1]],
                                  accumulate=accumulate))

    for _ in range(steps):
        kind = rnd.randrange(7)
        if len(live) < 2 or kind == 0:
            if len(live) == 5:  # (PSUM holds 8 banks)
                core.psum.free(live.pop(rnd.randrange(5))[0])
            n = rnd.choice((64, 128, 256, 512))
            region = core.psum.allocate(128, n * 4)
            acc = region.tile(F32, (n,))
            first = rnd.randrange(3)
            if first == 0:
                product(acc, False)
            elif first == 1 and n == 128:
                prog.append(isa.nc_transpose(dst=acc, data=rnd.choice(operands)[:, :128]))
            else:
                prog.append(isa.tensor_copy(dst=acc, src=rnd.choice(operands)[:, :n]))
            live.append((region, acc))
            continue
        region, acc = rnd.choice(live)
        if kind in (1, 2):
            product(acc, True if kind == 1 else None)
        elif kind == 3:  # part of the tile rewritten by ScalarE: its group closes there
            half = acc[:, :acc.shape[1] // 2]
            prog.append(isa.activation(dst=half, op="tanh", data=rnd.choice(operands)[:, :half.shape[1]]))
        elif kind == 4 and stores < 63:  # read out and stored
            n = acc.shape[1]
            prog.append(isa.tensor_copy(dst=stage[:, :n], src=acc))
            prog.append(isa.dma_copy(dst=tile("hbm:out", F32, (64 * 128, 512))[stores * 128:][:128, :n], src=stage[:, :n]))
            stores += 1
        elif kind == 5:
            live.remove((region, acc))
            core.psum.free(region)
    args = [ArgSlot("x", (128, 1024), F32), ArgSlot("out", (64 * 128, 512), F32, "output")]
    x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(seed)) / 8
    return Program(prog, args, f"psum{seed}"), {"x": x}


@pytest.mark.parametrize("seed", range(6))
def test_random_psum_programs_packed_give_the_same_bits(seed):
    """PSUM is packed whole banks at a time: its accumulation groups' flags move with their tiles."""
    program, inputs = _psum_program(seed)
    instructions = host_layout.packed(program, 1 << 20, psum=PSUM_LAYOUT)
    assert instructions is not None, "the program's PSUM should be packed"
    assert len(_banks(instructions)) < len(_banks(program.instructions))
    assert all(new.dst.byte_range[0] % PSUM.bank_bytes == old.dst.byte_range[0] % PSUM.bank_bytes
               for old, new in zip(program.instructions, instructions) if new.dst.memory == "psum")
    assert host_layout.packed(program, 1 << 20) is None  # (SBUF alone: its tiles are too few to pack)
    plain, packed = _plain_and_packed(program, inputs)
    assert _same_bits(plain, packed)


def test_a_product_added_onto_psum_never_written_runs_as_it_is():
    """An accumulating matmul onto PSUM the program never wrote adds onto what the previous kernel left there (and
    accumulate=None looks at the group flags it left): such a program keeps its PSUM layout."""
    operand = tile("sbuf", F32, (128, 128), offset=0)
    far = tile("psum", F32, (128, 128), offset=3 * PSUM.bank_bytes)
    near = tile("psum", F32, (128, 128), offset=0)
    stage = tile("sbuf", F32, (128, 128), offset=1024)

    def program(accumulate):
        prog = [isa.dma_copy(dst=operand, src=tile("hbm:x", F32, (128, 128))),
                isa.nc_matmul(dst=near, stationary=operand, moving=operand, accumulate=False),
                isa.nc_matmul(dst=far, stationary=operand, moving=operand, accumulate=accumulate),
                isa.tensor_copy(dst=stage, src=far), isa.dma_copy(dst=tile("hbm:out", F32, (128, 128)), src=stage),
                isa.tensor_copy(dst=stage, src=near), isa.dma_copy(dst=tile("hbm:out2", F32, (128, 128)), src=stage)]
        return Program(prog, [ArgSlot("x", (128, 128), F32), ArgSlot("out", (128, 128), F32, "output"),
                              ArgSlot("out2", (128, 128), F32, "output")], "onto_unwritten")

    assert host_layout.packed(program(False), 1 << 20, psum=PSUM_LAYOUT) is not None
    for accumulate in (True, None):
        assert host_layout.packed(program(accumulate), 1 << 20, psum=PSUM_LAYOUT) is None
    # the run adds onto what the core's PSUM holds there, packing or not
    core = NeuronCore("trn2")
    core.psum.data[:, far.offset:far.offset + 512].view(F32).fill_(2.0)
    x = torch.randn(128, 128)
    out = core.run(program(True), {"x": x}, timed=False).outputs
    assert torch.allclose(out["out"], x.T @ x + 2.0, rtol=1e-5, atol=1e-4)
