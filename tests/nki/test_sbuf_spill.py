"""SBUF spilling (``torchneuron/nki/liveness.py``, step 5): when the tiles a kernel keeps in use need more SBUF
than there is, tiles leave SBUF for a private HBM scratch buffer between their accesses (Belady's rule picks
them) through DMA stores and loads added to the program, so the values stay exact and the time includes the
traffic. Kernels that fit are traced exactly as before; what no spilling can fit raises."""
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
from torchneuron.sim import SimulatorError
from torchneuron.sim.specs import chip_spec

RNG = np.random.default_rng(7)
TILE = 512                      # fp32 columns of the test tiles: 2 KiB per partition
SMALL_SBUF = 8 * 4 * TILE       # room for 8 of them
SMALL = dataclasses.replace(chip_spec("trn2"), name="trn2-small-sbuf", sbuf_bytes_per_partition=SMALL_SBUF)
ROOMY = dataclasses.replace(chip_spec("trn2"), name="trn2-roomy-sbuf")


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


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
def reversed_sum_kernel(x):
    """Load every [128, 512] column block of ``x`` into its own tile, then add them up in reverse order: all
    blocks are live at once, and the first loaded is needed last."""
    n = x.shape[1] // TILE
    out = nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.shared_hbm)
    tiles = []
    for i in range(n):
        t = nl.ndarray((128, TILE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[:, i * TILE:(i + 1) * TILE])
        tiles.append(t)
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
    assert any(a.name.startswith("sbuf_spill") for a in program.args)
    # Belady: the 5 tiles that do not fit beside the accumulator are those needed last (the first loaded); each
    # is stored once (written once) and loaded back once
    assert spill_moves(program) == {"store": 5, "load": 5}
    stored = [i.src for i in program.instructions if i.opcode == "dma_copy" and i.dst.memory.startswith("hbm:sbuf")]
    loads_from_x = [i for i in program.instructions if i.opcode == "dma_copy" and i.src.memory == "hbm:x"]
    assert [i.dst.offset for i in loads_from_x[:5]] == [s.offset for s in stored]


def test_spill_traffic_is_timed():
    x = randn(128, 12 * TILE)
    spilled = reversed_sum_kernel.trace((x,), {}, SMALL).program
    roomy = reversed_sum_kernel.trace((x,), {}, ROOMY).program
    assert not spill_moves(roomy)
    timeline = spilled.schedule(SMALL)
    assert timeline.device_time_ns > roomy.schedule(ROOMY).device_time_ns
    spill_bytes = sum(i.cost_inputs().dma_bytes for i in spilled.instructions if i.opcode == "dma_copy"
                      and "sbuf_spill" in i.src.memory + i.dst.memory)
    assert spill_bytes == 10 * 128 * 4 * TILE  # 5 stores and 5 loads of a [128, 512] fp32 tile
    assert timeline.dma_bytes == sum(i.cost_inputs().dma_bytes for i in roomy.instructions
                                     if i.opcode == "dma_copy") + spill_bytes


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
    assert spill_moves(traced.program)["load"] > 0
    assert sbuf_end(traced.program) <= SMALL_SBUF
