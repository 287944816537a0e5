"""SBUF spilling (``torchneuron/nki/liveness.py``, step 5): when the tiles a kernel keeps in use need more SBUF
than there is, tiles leave SBUF between their accesses (Belady's rule picks them): a tile the kernel wrote goes
to a private HBM scratch buffer and back by DMAs on queues of their own; a tile holding what the kernel loaded
from HBM nothing writes is loaded from there again (and a load whose tile would only leave is issued later).
Loads back are issued as early as they do no harm. Values stay exact and the time includes the traffic.
Kernels that fit are traced exactly as before; what no spilling can fit raises."""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from torchneuron import nki
from torchneuron.nki import legacy
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.nki.legacy import language as lnl
from torchneuron.nki.tracing import DMA_QUEUES, SPILL_DMA_QUEUES
from torchneuron.sim import SimulatorError
from torchneuron.sim.specs import chip_spec

RNG = np.random.default_rng(7)
TILE = 512                      # fp32 columns of the test tiles: 2 KiB per partition
SMALL_SBUF = 8 * 4 * TILE       # room for 8 of them
SMALL = dataclasses.replace(chip_spec("trn2"), name="trn2-small-sbuf", sbuf_bytes_per_partition=SMALL_SBUF)
ROOMY = dataclasses.replace(chip_spec("trn2"), name="trn2-roomy-sbuf")


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def loads_from(program, memory: str) -> list:
    """The DMAs that read ``memory`` (an HBM buffer), in program order."""
    return [i for i in program.instructions if i.opcode == "dma_copy" and i.src.memory == memory]


def first_compute(program) -> int:
    """The index of the first instruction that is not a DMA."""
    return next(k for k, i in enumerate(program.instructions) if i.engine.value != "dma")


def spill_moves(program) -> collections.Counter:
    """DMA stores to and loads from the SBUF spill scratch buffer."""
    moves = collections.Counter()
    for i in program.instructions:
        if i.opcode == "dma_copy" and i.dst.memory.startswith("hbm:sbuf_spill"):
            moves["store"] += 1
        elif i.opcode == "dma_copy" and i.src.memory.startswith("hbm:sbuf_spill"):
            moves["load"] += 1
    return moves


def sbuf_end(program) -> int:
    """The highest SBUF byte any operand reaches."""
    return max((ap.byte_range[1] for i in program.instructions for _, ap in i.operands() if ap.memory == "sbuf"),
               default=0)


@nki.jit
def reversed_sum_kernel(x, zeroed=None):
    """Load every [128, 512] column block of ``x`` into its own tile, then add them up in reverse order: all
    blocks are live at once, and the first loaded is needed last. ``zeroed`` (an argument, maybe ``x``): its
    first block is zeroed once the blocks are loaded."""
    n = x.shape[1] // TILE
    out = nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.shared_hbm)
    tiles = []
    for i in range(n):
        t = nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[:, i * TILE:(i + 1) * TILE])
        tiles.append(t)
    if zeroed is not None:
        zeros = nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        nisa.dma_copy(dst=zeroed[:, 0:TILE], src=zeros)
    acc = nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=acc, src=tiles[-1])
    for t in reversed(tiles[:-1]):
        nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
    nisa.dma_copy(dst=out, src=acc)
    return out


def reversed_sum_reference(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(128, -1, TILE)
    acc = blocks[:, -1].copy()
    for i in range(blocks.shape[1] - 2, -1, -1):
        acc = acc + blocks[:, i]  # fp32, the kernel's order
    return acc


def test_live_tiles_beyond_sbuf_spill_and_stay_exact():
    x = randn(128, 12 * TILE)  # 12 tiles of 2 KiB (+ the accumulator) against room for 8
    out, report, traced = reversed_sum_kernel.run((x,), {}, chip=SMALL)
    np.testing.assert_array_equal(out, reversed_sum_reference(x))
    program = traced.program
    assert sbuf_end(program) <= SMALL_SBUF
    # Belady: the 5 tiles that do not fit beside the accumulator are those needed last (the first loaded). They
    # hold x's blocks and nothing writes x, so nothing is stored: their loads are issued later, each right after
    # an instruction whose tile is not needed again (the first moment with room), and every block is loaded once
    assert not spill_moves(program) and not any(a.name.startswith("sbuf_spill") for a in program.args)
    loads = loads_from(program, "hbm:x")
    assert sorted(i.src.offset for i in loads) == [b * TILE * 4 for b in range(12)]
    late = [k for k, i in enumerate(program.instructions) if i in loads and k > first_compute(program)]
    assert [program.instructions[k].src.offset // (4 * TILE) for k in late] == [4, 3, 2, 1, 0]
    assert all(program.instructions[k - 1].opcode in ("tensor_copy", "tensor_tensor") for k in late)


def test_spill_traffic_is_timed():
    x = randn(128, 10 * TILE)
    spilled = rounds_kernel.trace((x,), {"rounds": 3}, SMALL).program
    roomy = rounds_kernel.trace((x,), {"rounds": 3}, ROOMY).program
    assert not spill_moves(roomy)
    timeline = spilled.schedule(SMALL)
    assert timeline.device_time_ns > roomy.schedule(ROOMY).device_time_ns
    moves = spill_moves(spilled)
    spill_bytes = sum(i.cost_inputs().dma_bytes for i in spilled.instructions if i.opcode == "dma_copy"
                      and "sbuf_spill" in i.src.memory + i.dst.memory)
    assert spill_bytes == (moves["store"] + moves["load"]) * 128 * 4 * TILE  # [128, 512] fp32 tiles
    reloads_from_x = len(loads_from(spilled, "hbm:x")) - len(loads_from(roomy, "hbm:x"))
    assert timeline.dma_bytes == sum(i.cost_inputs().dma_bytes for i in roomy.instructions
                                     if i.opcode == "dma_copy") + spill_bytes + reloads_from_x * 128 * 4 * TILE


@nki.jit
def rounds_kernel(x, rounds):
    """``n`` accumulators (one per [128, 512] block of ``x``), each updated in every round: written tiles that
    leave SBUF and come back several times."""
    n = x.shape[1] // TILE
    out = nl.ndarray((128, n * TILE), dtype=nl.float32, buffer=nl.shared_hbm)
    accs = []
    for i in range(n):
        a = nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x[:, i * TILE:(i + 1) * TILE])
        accs.append(a)
    for r in range(rounds):
        for i in range(n):
            nisa.tensor_scalar(dst=accs[i], data=accs[i], op0=nl.multiply, operand0=1.5, op1=nl.add,
                               operand1=float(r + i))
    for i in range(n):
        nisa.dma_copy(dst=out[:, i * TILE:(i + 1) * TILE], src=accs[i])
    return out


def test_tiles_written_after_reload_are_stored_again():
    x = randn(128, 10 * TILE)
    out, _, traced = rounds_kernel.run((x,), {"rounds": 3}, chip=SMALL)
    ref = x.reshape(128, 10, TILE).copy()
    for r in range(3):
        for i in range(10):
            ref[:, i] = (ref[:, i] * np.float32(1.5)).astype(np.float32) + np.float32(r + i)
    np.testing.assert_array_equal(out, ref.reshape(128, -1))
    moves = spill_moves(traced.program)
    assert moves["load"] >= 3 and moves["store"] >= moves["load"] - 2  # every reloaded tile is written again


@nki.jit
def reloaded_rounds_kernel(x, rounds):
    """``n`` tiles, each loaded from its block of ``x`` at the start of every round, updated, and stored to the
    round's part of the output: tiles written before they leave SBUF, then loaded whole by the kernel again."""
    n = x.shape[1] // TILE
    out = nl.ndarray((128, rounds * n * TILE), dtype=nl.float32, buffer=nl.shared_hbm)
    tiles = [nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.sbuf) for _ in range(n)]
    for r in range(rounds):
        for i in range(n):
            nisa.dma_copy(dst=tiles[i], src=x[:, i * TILE:(i + 1) * TILE])
        for i in range(n):
            nisa.tensor_scalar(dst=tiles[i], data=tiles[i], op0=nl.multiply, operand0=1.5, op1=nl.add,
                               operand1=float(r + i))
        for i in range(n):
            nisa.dma_copy(dst=out[:, (r * n + i) * TILE:(r * n + i + 1) * TILE], src=tiles[i])
    return out


def test_written_tiles_are_stored_and_loaded_tiles_loaded_again():
    x = randn(128, 10 * TILE)
    out, _, traced = reloaded_rounds_kernel.run((x,), {"rounds": 2}, chip=SMALL)
    blocks = x.reshape(128, 10, TILE)
    ref = [(blocks * np.float32(1.5)).astype(np.float32) + (np.arange(10) + r).astype(np.float32)[None, :, None]
           for r in range(2)]  # fp32, the kernel's order
    np.testing.assert_array_equal(out, np.concatenate([b.reshape(128, -1) for b in ref], axis=1))
    moves = spill_moves(traced.program)
    assert moves["store"] > 0 and moves["store"] == moves["load"]  # every stored tile comes back once
    assert len(loads_from(traced.program, "hbm:x")) >= 20
    assert sbuf_end(traced.program) <= SMALL_SBUF


def test_kernels_that_fit_are_traced_as_before():
    x = randn(128, 6 * TILE)  # 6 tiles + the accumulator fit in 8
    small = reversed_sum_kernel.trace((x,), {}, SMALL).program
    roomy = reversed_sum_kernel.trace((x,), {}, ROOMY).program
    assert not spill_moves(small)
    assert [i.opcode for i in small.instructions] == [i.opcode for i in roomy.instructions]
    assert [a.name for a in small.args] == [a.name for a in roomy.args]


@nki.jit
def one_tile_kernel(x):
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_a_tile_larger_than_sbuf_raises():
    with pytest.raises(SimulatorError, match="sbuf overflow: cannot allocate 128 partitions x 20480 bytes"):
        one_tile_kernel.trace((np.zeros((128, 5 * 1024), np.float32),), {}, SMALL)


@nki.jit
def wide_add_kernel(x, y):
    """One instruction reading two tiles that together need more SBUF than there is."""
    a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    b = nl.ndarray(y.shape, dtype=y.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=b, src=y)
    nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a)
    return out


def test_operands_that_need_more_than_sbuf_at_once_raise():
    x = np.zeros((128, 3 * 1024), np.float32)  # 12 KiB each, 24 KiB at once against 16 KiB
    with pytest.raises(SimulatorError, match="spilling other tiles to HBM cannot make room"):
        wide_add_kernel.trace((x, x), {}, SMALL)


@legacy.jit
def legacy_reversed_sum_kernel(x):
    """``reversed_sum_kernel`` in the earlier-generation front-end: ``nl.load`` tiles and ``nl.add``."""
    n = x.shape[1] // TILE
    out = lnl.ndarray((128, TILE), dtype=lnl.float32, buffer=lnl.shared_hbm)
    tiles = [lnl.load(x[:, i * TILE:(i + 1) * TILE]) for i in range(n)]
    acc = tiles[-1]
    for t in reversed(tiles[:-1]):
        acc = lnl.add(acc, t)
    lnl.store(out, acc)
    return out


def test_legacy_kernels_spill_too():
    x = randn(128, 12 * TILE)
    out, _, traced = legacy_reversed_sum_kernel.run((x,), {}, chip=SMALL)
    np.testing.assert_array_equal(out, reversed_sum_reference(x))
    program = traced.program
    late = [i for i in loads_from(program, "hbm:x") if program.instructions.index(i) > first_compute(program)]
    assert late  # the blocks that did not fit were loaded while the sum ran
    assert sbuf_end(program) <= SMALL_SBUF


@nki.jit
def there_and_back_kernel(x):
    """Every [128, 512] block of ``x`` loaded into its own tile, summed forwards, then backwards: the tiles the
    first pass leaves are needed again by the second."""
    n = x.shape[1] // TILE
    out = nl.ndarray((128, 2 * TILE), dtype=nl.float32, buffer=nl.shared_hbm)
    tiles = []
    for i in range(n):
        t = nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[:, i * TILE:(i + 1) * TILE])
        tiles.append(t)
    for half, order in enumerate((tiles, tiles[::-1])):
        acc = nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=acc, src=order[0])
        for t in order[1:]:
            nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
        nisa.dma_copy(dst=out[:, half * TILE:(half + 1) * TILE], src=acc)
    return out


def there_and_back_reference(x: np.ndarray) -> np.ndarray:
    blocks = [x[:, i * TILE:(i + 1) * TILE] for i in range(x.shape[1] // TILE)]
    out = []
    for order in (blocks, blocks[::-1]):
        acc = order[0].copy()
        for b in order[1:]:
            acc = acc + b  # fp32, the kernel's order
        out.append(acc)
    return np.concatenate(out, axis=1)


def test_loaded_tiles_leave_without_a_store_and_come_back_from_their_source():
    x = randn(128, 12 * TILE)
    out, _, traced = there_and_back_kernel.run((x,), {}, chip=SMALL)
    np.testing.assert_array_equal(out, there_and_back_reference(x))
    program = traced.program
    assert not spill_moves(program)  # nothing was written to a tile before it left
    loads = loads_from(program, "hbm:x")
    assert {i.src.offset for i in loads} == {b * TILE * 4 for b in range(12)} and len(loads) > 12
    # the kernel's own loads keep its queues; a block loaded again goes on a spill queue
    seen, again = set(), []
    for i in loads:
        (again if i.src.offset in seen else []).append(i)
        seen.add(i.src.offset)
    assert again and all(i.queue >= DMA_QUEUES for i in again)
    assert sbuf_end(program) <= SMALL_SBUF


@pytest.mark.parametrize("same", [True, False], ids=["x twice", "another argument"])
def test_a_source_the_kernel_may_write_is_not_loaded_from_again(same):
    # a tile loaded from x cannot be loaded from it again when the kernel writes an argument (the caller may
    # have passed x twice): a tile that leaves is stored
    x = randn(128, 12 * TILE)
    given = x.copy()
    out, _, traced = reversed_sum_kernel.run((given, given if same else np.zeros_like(x)), {}, chip=SMALL)
    np.testing.assert_array_equal(out, reversed_sum_reference(x))  # the blocks as they were loaded
    program = traced.program
    assert spill_moves(program)["store"] > 0
    assert len(loads_from(program, "hbm:x")) == 12


def test_spill_dmas_use_queues_of_their_own():
    x = randn(128, 10 * TILE)
    program = rounds_kernel.trace((x,), {"rounds": 3}, SMALL).program
    spill = [i for i in program.instructions if i.opcode == "dma_copy" and "sbuf_spill" in i.src.memory + i.dst.memory]
    assert spill and [i.queue for i in spill] == [DMA_QUEUES + k % SPILL_DMA_QUEUES for k in range(len(spill))]
    others = [i for i in program.instructions if i.opcode == "dma_copy" and i not in spill]
    assert all(i.queue < DMA_QUEUES for i in others)
