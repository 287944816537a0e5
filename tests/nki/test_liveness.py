"""On-chip tiles placed by liveness: a tile that does not fit while earlier tiles are still bound in Python
reuses the boxes of tiles no later instruction touches (``torchneuron/nki/liveness.py``); kernels that fit
keep the boxes their Python lifetimes gave them (double buffering); a tile that fits nowhere raises."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from torchneuron import nki
from torchneuron.nki import legacy
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.nki.legacy import isa as lisa, language as lnl
from torchneuron.sim import SimulatorError
from torchneuron.sim.specs import chip_spec

RNG = np.random.default_rng(11)
PSUM_BYTES = chip_spec("trn2").psum_bytes_per_partition
SBUF_BYTES = chip_spec("trn2").sbuf_bytes_per_partition


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def on_chip_ends(program) -> dict[str, int]:
    """The highest byte each on-chip memory's operands reach."""
    ends = {"sbuf": 0, "psum": 0}
    for instr in program.instructions:
        for _, ap in instr.operands():
            if ap.on_chip:
                ends[ap.memory] = max(ends[ap.memory], ap.byte_range[1])
    return ends


@nki.jit
def blocks_matmul_kernel(a, b, banks):
    """out[i] = a[:, i-th 128 columns].T @ b, one PSUM tile of ``banks`` banks per i; the previous i's
    PSUM tile stays bound to ``acc`` while the next one is allocated (the attention tutorials' pattern)."""
    k, n = b.shape
    tiles = a.shape[1] // 128
    out = nl.ndarray((tiles * 128, n), nl.float32, buffer=nl.shared_hbm)
    b_sb = nl.load(b)
    for i in nl.affine_range(tiles):
        a_sb = nl.load(a[:, i * 128:(i + 1) * 128])
        acc = nl.ndarray((128, banks, 512), nl.float32, buffer=nl.psum)
        for j in nl.affine_range(banks):
            nisa.nc_matmul(dst=acc[:, j, :], stationary=a_sb, moving=b_sb[:, j * 512:(j + 1) * 512])
        res = nl.copy(acc.reshape((128, banks * 512)))
        nl.store(out[i * 128:(i + 1) * 128, :], res)
    return out


def test_tile_still_bound_in_python_is_reused_by_liveness():
    banks = 6  # two 12 KiB PSUM tiles never fit in 16 KiB: the previous one must be reclaimed
    a, b = randn(128, 3 * 128), randn(128, banks * 512)
    out = blocks_matmul_kernel(a, b, banks)
    ref = np.concatenate([a[:, i * 128:(i + 1) * 128].T @ b for i in range(3)])
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)
    program = nki.profile(blocks_matmul_kernel)(a, b, banks).program
    assert on_chip_ends(program)["psum"] <= PSUM_BYTES


@nki.jit
def kept_then_written_kernel(x, y, banks, read_only):
    """``keep`` (one PSUM bank) is written first and touched again at the end (read, or written and then
    read); in between, tiles of ``banks`` banks overflow while their predecessors are still bound."""
    out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
    sums = nl.ndarray((3 * 128, banks * 512), nl.float32, buffer=nl.shared_hbm)
    x_sb, y_sb = nl.load(x), nl.load(y)
    keep = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=keep, stationary=x_sb, moving=y_sb[:, 0:512])
    for i in nl.affine_range(3):
        big = nl.ndarray((128, banks, 512), nl.float32, buffer=nl.psum)
        for j in nl.affine_range(banks):
            nisa.nc_matmul(dst=big[:, j, :], stationary=x_sb, moving=y_sb[:, j * 512:(j + 1) * 512])
        nl.store(sums[i * 128:(i + 1) * 128, :], nl.copy(big.reshape((128, banks * 512))))
    if not read_only:  # written again through the long-held tile: its box must still be its own
        nisa.nc_matmul(dst=keep, stationary=x_sb, moving=y_sb[:, 512:1024], accumulate=True)
    nl.store(out, nl.copy(keep))
    return out, sums


@pytest.mark.parametrize("read_only", [True, False])
def test_tile_touched_later_keeps_its_box(read_only):
    x, y = randn(128, 128), randn(128, 6 * 512)
    out, sums = kept_then_written_kernel(x, y, 6, read_only)
    ref = x.T @ y[:, :512] + (0 if read_only else x.T @ y[:, 512:1024])
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(sums, np.tile(x.T @ y, (3, 1)), rtol=1e-4, atol=1e-3)


def test_tiles_that_fit_nowhere_even_by_liveness_raise():
    x, y = randn(128, 128), randn(128, 8 * 512)
    with pytest.raises(SimulatorError, match=r"psum overflow: .*even reusing the boxes of tiles no later "
                                             r"instruction touches.*16384 bytes"):
        kept_then_written_kernel(x, y, 8, False)  # all 8 banks while the kept bank is live: never fits


def test_a_single_tile_larger_than_the_memory_raises_where_it_is_allocated():
    # (a PSUM tensor larger than PSUM is spilled instead: tests/nki/test_psum_spill.py)
    @nki.jit
    def huge(x):
        nl.ndarray((128, nl.tile_size.sbuf_fmax_bytes // 4 + 1), nl.float32, buffer=nl.sbuf)
        return x

    with pytest.raises(SimulatorError, match=r"sbuf overflow: cannot allocate 128 partitions x"):
        huge(randn(4, 4))


@nki.jit
def ring_kernel(x, nbuf):
    """A streaming loop that keeps ``nbuf`` iterations' tiles alive (the library kernels' double buffering)."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    ring = collections.deque(maxlen=nbuf)
    for i in nl.affine_range(x.shape[0] // 128):
        t = nl.load(x[i * 128:(i + 1) * 128, :])
        nisa.activation(dst=t, op=nl.exp, data=t)
        nl.store(out[i * 128:(i + 1) * 128, :], t)
        ring.append(t)
    return out


def test_kernels_that_fit_keep_their_python_lifetime_boxes():
    x = randn(8 * 128, 256)
    np.testing.assert_allclose(ring_kernel(x, 3), np.exp(x), rtol=1e-5)
    program = nki.profile(ring_kernel)(x, 3).program
    loads = [i.dst.offset for i in program.instructions if i.opcode == "dma_copy" and i.dst.on_chip]
    # the ring's 3 tiles plus the one being loaded are in 4 distinct boxes, as Python held them (a pure
    # liveness allocator would put every load in one box: each tile is dead after its store); next-fit
    # allocation moves on through SBUF rather than reusing the box just released
    assert all(len(set(loads[i:i + 4])) == 4 for i in range(len(loads) - 3))
    assert len(set(loads)) == len(loads)


@nki.jit
def spmd_overflow_kernel(a, b):
    """Each SPMD instance overflows PSUM the same way (the liveness pass runs across instances)."""
    i = nl.program_id(0)
    out = nl.ndarray((2, a.shape[1], b.shape[1]), nl.float32, buffer=nl.shared_hbm)
    b_sb = nl.load(b)
    a_sb = nl.load(a[:, i * 128:(i + 1) * 128])
    tiles = []
    for r in nl.affine_range(2):
        acc = nl.ndarray((128, 6, 512), nl.float32, buffer=nl.psum)   # the previous `acc` stays in `tiles`
        for j in nl.affine_range(6):
            nisa.nc_matmul(dst=acc[:, j, :], stationary=a_sb, moving=b_sb[:, j * 512:(j + 1) * 512])
        nl.store(out[r, i * 128:(i + 1) * 128, :], nl.multiply(acc.reshape((128, 3072)), r + 1.0))
        tiles.append(acc)
    return out


def test_spmd_instances_each_placed():
    a, b = randn(128, 256), randn(128, 3072)
    out = spmd_overflow_kernel[2](a, b)
    np.testing.assert_allclose(out, np.stack([a.T @ b, 2 * (a.T @ b)]), rtol=1e-4, atol=1e-3)


@legacy.jit
def legacy_accumulate_kernel(a, b):
    """Legacy ``psum[...] += nisa.nc_matmul(...)`` (the re-targeted matmul) with the previous iteration's
    accumulator still bound while the next is allocated."""
    tiles = a.shape[1] // 128
    out = lnl.ndarray((tiles * 128, 6 * 512), dtype=lnl.float32, buffer=lnl.shared_hbm)
    b_sb = lnl.load(b)
    for i in lnl.affine_range(tiles):
        a_sb = lnl.load(a[:, i * 128:(i + 1) * 128])
        acc = lnl.zeros((6, lnl.par_dim(128), 512), dtype=lnl.float32, buffer=lnl.psum)
        for j in lnl.affine_range(6):
            acc[j] += lisa.nc_matmul(a_sb, b_sb[:, j * 512:(j + 1) * 512])
            acc[j] += lisa.nc_matmul(a_sb, b_sb[:, j * 512:(j + 1) * 512])
        for j in lnl.affine_range(6):
            lnl.store(out[i * 128:(i + 1) * 128, j * 512:(j + 1) * 512], value=lisa.tensor_copy(acc[j]))
    return out


def test_legacy_accumulators_placed_by_liveness():
    a, b = randn(128, 256), randn(128, 6 * 512)
    ref = 2 * np.concatenate([a[:, i * 128:(i + 1) * 128].T @ b for i in range(2)])
    np.testing.assert_allclose(legacy_accumulate_kernel(a, b), ref, rtol=1e-4, atol=1e-3)


def test_sbuf_overflow_is_placed_too():
    @nki.jit
    def sbuf_kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        f = x.shape[1] // 2
        prev = None
        for h in nl.affine_range(2):
            t = nl.load(x[:, h * f:(h + 1) * f])      # each tile 60% of SBUF; `prev` keeps the last one bound
            nisa.activation(dst=t, op=nl.exp, data=t)
            nl.store(out[:, h * f:(h + 1) * f], t)
            prev = t
        assert prev is not None
        return out

    n = (SBUF_BYTES * 6 // 10) // 4 * 2
    x = randn(128, n) * 0.1
    np.testing.assert_allclose(sbuf_kernel(x), np.exp(x), rtol=1e-5)


def _first_fit_by_scan(n: int, busy: list[tuple[int, int]], cap: int, bank: int, align: int) -> int | None:
    """The placement rule written out directly: try 0, then each busy range's aligned end (bank-adjusted) in
    order, and take the first that overlaps no range and ends within ``cap``."""
    for cand in [0, *(-(-end // align) * align for _, end in busy)]:
        if bank and (n > bank or cand // bank != (cand + n - 1) // bank):
            cand = -(-cand // bank) * bank
        if cand + n <= cap and all(cand + n <= s or e <= cand for s, e in busy):
            return cand
    return None


@pytest.mark.parametrize("bank", [0, 2048])
def test_first_fit_matches_the_direct_scan(bank):
    """The bisection first fit returns the offset the direct scan of every candidate against every range
    returns, on random busy lists with overlaps, duplicates, empty ranges and bank-crossing sizes."""
    from torchneuron.nki.liveness import _first_fit
    from torchneuron.sim.memory import Region
    rng = np.random.default_rng(5)
    cap, checked = 16384, collections.Counter()
    for _ in range(3000):
        busy = []
        for _ in range(int(rng.integers(0, 40))):
            s = int(rng.integers(0, cap)) // 4 * 4
            busy.append((s, s + int(rng.choice([0, 4, 64, 512, 2048, 3000]))))
        n = int(rng.choice([4, 64, 512, 1000, 2048, 4096]))
        align = int(rng.choice([4, 64]))
        busy.sort()
        got = _first_fit(Region("psum", 0, 128, 0, n), busy, cap, bank, align)
        assert got == _first_fit_by_scan(n, busy, cap, bank, align), (n, busy, align)
        checked[got is None] += 1
    assert checked[True] and checked[False]  # both outcomes were exercised
