"""Current-generation NKI features beyond the basics: ``nl.ndarray(address=)`` placement, ``nc_matmul`` PE tiling
and FP8 double-row mode, and trace-time ``fori_loop`` / ``while_loop`` / ``dynamic_range``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.sim import IndexOutOfRange, Program, SimulatorError
from torchneuron.sim.isa import NcMatmulTiled
from torchneuron.sim.specs import chip_spec

RNG = np.random.default_rng(5)
SBUF_BYTES = chip_spec("trn2").sbuf_bytes_per_partition
PSUM_BYTES = chip_spec("trn2").psum_bytes_per_partition


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def boxes(program, memory: str):
    """(instruction index, operand name, partitions, byte range) of every operand in ``memory``."""
    out = []
    for i, instr in enumerate(program.instructions):
        for name, ap in instr.operands():
            if ap.memory == memory:
                out.append((i, name, (ap.start_partition, ap.start_partition + ap.partitions), ap.byte_range))
    return out


def meets(a, b) -> bool:
    (p0, p1), (b0, b1) = a
    (q0, q1), (c0, c1) = b
    return p0 < q1 and q0 < p1 and b0 < c1 and c0 < b1


# ---- nl.ndarray(address=) ------------------------------------------------------------------------

@nki.jit
def pinned_scale_kernel(a, partition, offset):
    """out = 3 * a with the working tile pinned at (partition, offset)."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf, address=(partition, offset))
    nisa.dma_copy(dst=t, src=a)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=3.0)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_ndarray_address_places_the_tile_there():
    a = randn(32, 256)
    rep = nki.profile(pinned_scale_kernel)(a, 64, 4096)
    np.testing.assert_allclose(rep.outputs, 3 * a, rtol=1e-6)
    sb = boxes(rep.program, "sbuf")
    assert sb and all(p == (64, 96) and r == (4096, 4096 + 256 * 4) for _, _, p, r in sb)


@nki.jit
def pinned_over_auto_kernel(a):
    """A tile pinned over the box the allocator already gave a tile still in use: the earlier tile moves."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    x = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)          # first fit: bytes [0, 2048)
    nisa.dma_copy(dst=x, src=a)
    y = nl.ndarray((64, 512), nl.float32, buffer=nl.sbuf, address=(64, 1024))
    nisa.tensor_copy(dst=y, src=x[64:128, :])
    z = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=z[64:128], data=y, op0=nl.multiply, operand0=2.0)
    nisa.tensor_copy(dst=z[0:64], src=x[0:64])                      # x is still read after y is written
    nisa.dma_copy(dst=out, src=z)
    return out


def test_ndarray_address_moves_an_overlapping_auto_tile():
    a = randn(128, 512)
    rep = nki.profile(pinned_over_auto_kernel)(a)
    ref = a.copy()
    ref[64:] *= 2
    np.testing.assert_array_equal(rep.outputs, ref)
    pinned = ((64, 128), (1024, 3072))
    sb = boxes(rep.program, "sbuf")
    assert any(p == pinned[0] and r == pinned[1] for _, _, p, r in sb)
    # every other operand (x and z) stays off the pinned box
    assert all(not meets((p, r), pinned) or (p, r) == pinned for _, _, p, r in sb)
    assert max(r[1] for *_, r in sb) <= SBUF_BYTES


@nki.jit
def pinned_psum_survives_kernel(a, b, x, iters):
    """A PSUM tile pinned at bank 0 holds ``x`` throughout while every iteration allocates an 8 KiB PSUM tile
    with the previous one still bound in Python (so the liveness pass places them)."""
    out = nl.ndarray((iters * 128, 2048), nl.float32, buffer=nl.shared_hbm)
    keep = nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 0))
    xs = nl.load(x)
    nisa.tensor_copy(dst=keep, src=xs)
    b_sb = nl.load(b)
    acc = None
    for i in range(iters):
        a_sb = nl.load(a[:, i * 128:(i + 1) * 128])
        acc = nl.ndarray((128, 4, 512), nl.float32, buffer=nl.psum)
        for j in range(4):
            nisa.nc_matmul(dst=acc[:, j, :], stationary=a_sb, moving=b_sb[:, j * 512:(j + 1) * 512])
        res = nl.copy(acc.reshape((128, 2048)))
        nl.store(out[i * 128:(i + 1) * 128, :], res)
    kept = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
    nl.store(kept, nl.copy(keep))
    return out, kept


def test_ndarray_address_liveness_keeps_other_tiles_off_a_live_pinned_tile():
    a, b, x = randn(128, 3 * 128), randn(128, 2048), randn(128, 512)
    rep = nki.profile(pinned_psum_survives_kernel)(a, b, x, 3)
    out, kept = rep.outputs
    ref = np.concatenate([a[:, i * 128:(i + 1) * 128].T @ b for i in range(3)])
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(kept, x)            # no matmul landed on the pinned bank
    ps = boxes(rep.program, "psum")
    assert max(r[1] for *_, r in ps) <= PSUM_BYTES
    assert sum(1 for *_, r in ps if r[0] < 2048) == 2  # only the pinned tile's write and read use bank 0


@nki.jit
def pinned_in_loop_kernel(a, iters):
    """Each iteration pins a new tile at the same box (the previous one is still bound while it is made)."""
    out = nl.ndarray((iters, *a.shape), a.dtype, buffer=nl.shared_hbm)
    for i in range(iters):
        t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf, address=(0, 512))
        nisa.dma_copy(dst=t, src=a)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(i))
        nisa.dma_copy(dst=out[i], src=t)
    return out


def test_ndarray_address_reused_box_across_iterations():
    a = randn(128, 64)
    rep = nki.profile(pinned_in_loop_kernel)(a, 3)
    np.testing.assert_allclose(rep.outputs, np.stack([a + i for i in range(3)]), rtol=1e-6)
    assert {(p, r) for _, _, p, r in boxes(rep.program, "sbuf")} == {((0, 128), (512, 512 + 256))}


@nki.jit
def pinned_alias_kernel(a):
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf, address=(0, 0))
    u = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf, address=(0, 128))   # overlaps t, both in use below
    nisa.dma_copy(dst=t, src=a)
    nisa.dma_copy(dst=u, src=a)
    nisa.tensor_tensor(dst=u, data1=t, data2=u, op=nl.add)
    nisa.dma_copy(dst=out, src=u)
    return out


@nki.jit
def pinned_bad_kernel(a, shape, address, buffer):
    nl.ndarray(shape, nl.float32, buffer=buffer, address=address)   # the placement itself raises
    return a


@pytest.mark.parametrize("shape, address, buffer, match", [
    ((64, 128), (100, 0), "sbuf", "partitions \\[100, 164\\)"),
    ((128, 128), (0, SBUF_BYTES - 256), "sbuf", "sbuf overflow"),
    ((128, 128), (-1, 0), "sbuf", "sbuf overflow"),
    ((128, 512), (0, 1024), "psum", "crosses a 2048-byte PSUM bank"),
    ((128, 128), (0, PSUM_BYTES), "psum", "psum overflow"),
    ((128, 128), (0, 2), "sbuf", "multiple of the element size"),
    ((128, 128), (0, 0), "shared_hbm", "have no address"),
])
def test_ndarray_address_errors(shape, address, buffer, match):
    with pytest.raises(SimulatorError, match=match):
        nki.simulate(pinned_bad_kernel)(randn(2, 2), shape, address, getattr(nl, buffer))


def test_ndarray_address_bad_tuple_and_aliasing():
    with pytest.raises(TypeError, match="partition_offset, free_offset_bytes"):
        nki.simulate(pinned_bad_kernel)(randn(2, 2), (128, 4), (0,), nl.sbuf)
    with pytest.raises(SimulatorError, match="two tiles placed with address="):
        nki.simulate(pinned_alias_kernel)(randn(128, 64))


# ---- nc_matmul tile_position / tile_size / perf_mode ------------------------------------------------

@nki.jit
def quadrant_kernel(a, b, tiled):
    """Four independent 64x64-stationary matmuls, one per PE-array quadrant when ``tiled``."""
    out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
    a_sb, b_sb = nl.load(a), nl.load(b)
    acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    for r in range(2):
        for c in range(2):
            kw = dict(tile_position=(r * 64, c * 64), tile_size=(64, 64)) if tiled else {}
            nisa.nc_matmul(dst=acc[c * 64:(c + 1) * 64, r * 256:(r + 1) * 256],
                           stationary=a_sb[r * 64:(r + 1) * 64, c * 64:(c + 1) * 64],
                           moving=b_sb[r * 64:(r + 1) * 64, r * 256:(r + 1) * 256], **kw)
    nl.store(out, nl.copy(acc))
    return out


def quadrant_ref(a, b):
    ref = np.zeros((128, 512), np.float32)
    for r in range(2):
        for c in range(2):
            ref[c * 64:(c + 1) * 64, r * 256:(r + 1) * 256] = \
                a[r * 64:(r + 1) * 64, c * 64:(c + 1) * 64].T @ b[r * 64:(r + 1) * 64, r * 256:(r + 1) * 256]
    return ref


@pytest.mark.parametrize("chip", ["trn1", "trn2", "trn3"])
def test_nc_matmul_pe_tiling_matches_and_costs_its_share(chip):
    a, b = randn(128, 128), randn(128, 512)
    tiled = nki.profile(quadrant_kernel, chip=chip)(a, b, True)
    plain = nki.profile(quadrant_kernel, chip=chip)(a, b, False)
    np.testing.assert_allclose(tiled.outputs, quadrant_ref(a, b), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(tiled.outputs, plain.outputs)
    assert sum(isinstance(i, NcMatmulTiled) for i in tiled.program.instructions) == 4
    # each quadrant matmul holds a quarter of the array, so the four take the time of one plain matmul
    assert tiled.engine_busy_ns["tensor"] == pytest.approx(plain.engine_busy_ns["tensor"] / 4)
    assert tiled.flops == plain.flops


def test_nc_matmul_tiled_program_serializes():
    a, b = randn(128, 128), randn(128, 512)
    program = nki.profile(quadrant_kernel)(a, b, True).program
    again = Program.from_bytes(program.to_bytes())
    tiled = [i for i in again.instructions if isinstance(i, NcMatmulTiled)]
    assert len(tiled) == 4 and tiled[3].tile_position == (64, 64) and tiled[3].tile_size == (64, 64)


@nki.jit
def tiled_matmul_kernel(k, m, position, size, chip_n=128):
    st = nl.ndarray((k, m), nl.bfloat16, buffer=nl.sbuf)
    mv = nl.ndarray((k, chip_n), nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(dst=st, value=1.0)
    nisa.memset(dst=mv, value=1.0)
    acc = nl.ndarray((m, chip_n), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=st, moving=mv, tile_position=position, tile_size=size)
    out = nl.ndarray((m, chip_n), nl.float32, buffer=nl.shared_hbm)
    nl.store(out, nl.copy(acc))
    return out


@pytest.mark.parametrize("k, m, position, size, match", [
    (64, 32, (0, 0), (32, 32), "has 64 partitions \\(K\\); the PE tile has 32 rows"),
    (32, 64, (0, 0), (32, 32), "has 64 elements per partition \\(M\\); the PE tile has 32 columns"),
    (32, 32, (16, 0), (32, 32), "start row 16"),
    (32, 32, (96, 64), (64, 64), "start row 96"),
    (32, 32, (0, 0), (48, 32), "row size 48"),
    (32, 32, (0, 0), (), "set both"),
    (32, 32, (), (32, 32), "set both"),
])
def test_nc_matmul_tiling_errors(k, m, position, size, match):
    with pytest.raises(SimulatorError, match=match):
        nki.simulate(tiled_matmul_kernel)(k, m, position, size)


def test_nc_matmul_tiling_32_needs_nc_v3():
    out = nki.simulate(tiled_matmul_kernel)(32, 32, (96, 32), (32, 32))
    np.testing.assert_array_equal(out, np.full((32, 128), 32.0, np.float32))
    with pytest.raises(SimulatorError, match="64 or 128"):
        nki.profile(tiled_matmul_kernel, chip="trn1")(32, 32, (96, 32), (32, 32))
    out = nki.profile(tiled_matmul_kernel, chip="trn1")(64, 64, (64, 0), (64, 128)).outputs
    np.testing.assert_array_equal(out, np.full((64, 128), 64.0, np.float32))


@nki.jit
def double_row_kernel(a, b, mode, tile=None):
    """dst[M, N] = a[256, M].T @ b[256, N] with the contraction laid out as [128, 2, ...]: one double-row
    matmul (``mode``) or two plain fp8 matmuls."""
    k, two, m = a.shape
    n = b.shape[2]
    out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
    st = nl.ndarray((k, two, m), a.dtype, buffer=nl.sbuf)
    mv = nl.ndarray((k, two, n), b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=st, src=a)
    nisa.dma_copy(dst=mv, src=b)
    acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
    if mode:
        kw = dict(tile_position=(0, 0), tile_size=tile) if tile else {}
        nisa.nc_matmul(dst=acc, stationary=st, moving=mv, perf_mode=nisa.matmul_perf_mode.double_row, **kw)
    else:
        nisa.nc_matmul(dst=acc, stationary=st[:, 0], moving=mv[:, 0])
        nisa.nc_matmul(dst=acc, stationary=st[:, 1], moving=mv[:, 1], accumulate=True)
    nl.store(out, nl.copy(acc))
    return out


def fp8(*shape, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    return torch.from_numpy(randn(*shape)).to(dtype)


@pytest.mark.parametrize("chip", ["trn2", "trn3"])
def test_nc_matmul_double_row_matches_and_doubles_throughput(chip):
    a, b = fp8(128, 2, 64), fp8(128, 2, 256, dtype=torch.float8_e5m2)
    ref = a.float().reshape(256, 64).T @ b.float().reshape(256, 256)
    fast = nki.profile(double_row_kernel, chip=chip)(a, b, True)
    slow = nki.profile(double_row_kernel, chip=chip)(a, b, False)
    torch.testing.assert_close(fast.outputs, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fast.outputs, slow.outputs, rtol=1e-6, atol=1e-5)
    assert fast.engine_busy_ns["tensor"] == pytest.approx(slow.engine_busy_ns["tensor"] / 2)
    assert fast.flops == slow.flops == 2 * 256 * 64 * 256
    # row tiling combines with double row (half the rows: half the time again)
    half = nki.profile(double_row_kernel, chip=chip)(a[:64].contiguous(), b[:64].contiguous(), True, (64, 128))
    ref_half = a[:64].float().reshape(128, 64).T @ b[:64].float().reshape(128, 256)
    torch.testing.assert_close(half.outputs, ref_half, rtol=1e-5, atol=1e-4)
    assert half.engine_busy_ns["tensor"] == pytest.approx(fast.engine_busy_ns["tensor"] / 2)


def test_nc_matmul_double_row_errors():
    a, b = fp8(128, 2, 64), fp8(128, 2, 256)
    with pytest.raises(SimulatorError, match="double_row .*needs NeuronCore-v3 or newer; trn1 is NeuronCore-v2"):
        nki.profile(double_row_kernel, chip="trn1")(a, b, True)
    with pytest.raises(SimulatorError, match="takes fp8"):
        nki.simulate(double_row_kernel)(a.to(torch.bfloat16), b.to(torch.bfloat16), True)
    with pytest.raises(SimulatorError, match="first free dim must be 2"):
        nki.simulate(double_row_kernel)(fp8(128, 4, 64), fp8(128, 4, 256), True)
    with pytest.raises(SimulatorError, match="cannot be combined with column tiling"):
        nki.simulate(double_row_kernel)(a, b, True, (128, 64))


# ---- fori_loop / while_loop / dynamic_range ---------------------------------------------------------

@nki.jit
def loop_kernel(a, kind, n):
    """out[i] = a * (i + 1) for i < n, written by a loop of the given kind."""
    out = nl.ndarray((n, *a.shape), a.dtype, buffer=nl.shared_hbm)
    x = nl.load(a)

    def body(i):
        y = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=x, op0=nl.multiply, operand0=float(i + 1))
        nisa.dma_copy(dst=out[i], src=y)

    if kind == "fori":
        nl.fori_loop(0, n, body)
    elif kind == "while":
        def countdown(r):
            body(n - r)
            return r - 1
        nl.while_loop(n, countdown)
    elif kind == "dynamic":
        for i in nl.dynamic_range(n):
            body(i)
    else:
        for i in nl.sequential_range(n):
            body(i)
    return out


@pytest.mark.parametrize("kind", ["fori", "while", "dynamic"])
def test_trace_time_loops_match_sequential_range(kind):
    a = randn(128, 64)
    rep = nki.profile(loop_kernel)(a, kind, 4)
    np.testing.assert_allclose(rep.outputs, np.stack([a * (i + 1) for i in range(4)]), rtol=1e-6)
    seq = nki.profile(loop_kernel)(a, "sequential", 4)
    assert [i.opcode for i in rep.program.instructions] == [i.opcode for i in seq.program.instructions]
    assert rep.device_time_ns == pytest.approx(seq.device_time_ns)


@nki.jit
def fori_step_kernel(a):
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    x = nl.load(a)
    nisa.memset(dst=x[:, 0:1], value=0.0)

    def body(j):
        nisa.tensor_scalar(dst=x[:, j:j + 1], data=x[:, j:j + 1], op0=nl.multiply, operand0=-1.0)

    nl.fori_loop(1, a.shape[1], body, step=3)
    for j in nl.dynamic_range(2, a.shape[1], 3):
        nisa.tensor_scalar(dst=x[:, j:j + 1], data=x[:, j:j + 1], op0=nl.add, operand0=10.0)
    nl.store(out, x)
    return out


def test_fori_loop_step_and_dynamic_range_start_stop_step():
    a = randn(4, 10)
    ref = a.copy()
    ref[:, 0] = 0
    ref[:, 1::3] *= -1
    ref[:, 2::3] += 10
    np.testing.assert_allclose(nki.simulate(fori_step_kernel)(a), ref, rtol=1e-6)


@nki.jit
def bad_loop_kernel(a, case):
    x = nl.load(a)
    if case == "step0":
        nl.fori_loop(0, 4, lambda i: None, step=0)
    elif case == "tensor_bound":
        nl.fori_loop(0, x, lambda i: None)
    elif case == "tensor_range":
        nl.dynamic_range(x)
    elif case == "not_callable":
        nl.fori_loop(0, 4, 3)
    elif case == "no_condition":
        nl.while_loop(2, lambda r: None)
    elif case == "tensor_init":
        nl.while_loop(x, lambda r: 0)
    return a


@pytest.mark.parametrize("case, exc, match", [
    ("step0", ValueError, "positive"),
    ("tensor_bound", NotImplementedError, "load it into a register"),
    ("tensor_range", NotImplementedError, "load it into a register"),
    ("not_callable", TypeError, "body_fun must be callable"),
    ("no_condition", TypeError, "condition returned by the while_loop body"),
    ("tensor_init", NotImplementedError, "load it into a register"),
])
def test_loop_errors(case, exc, match):
    with pytest.raises(exc, match=match):
        nki.simulate(bad_loop_kernel)(randn(2, 2), case)


def test_while_loop_zero_init_runs_no_iteration():
    calls = []

    @nki.jit
    def k(a):
        nl.while_loop(0, lambda r: calls.append(r) or 0)
        return a

    nki.simulate(k)(randn(2, 2))
    assert calls == []


# ---- .ap(scalar_offset=...) ------------------------------------------------------------------------

@nki.jit
def scalar_gather_kernel(table, start, rows, oob=nisa.oob_mode.error, dge=nisa.dge_mode.unknown):
    """out = table[start : start + rows] with ``start`` read from device memory when the DMA runs."""
    n = table.shape[1]
    out = nl.ndarray((rows, n), table.dtype, buffer=nl.shared_hbm)
    s = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=start)
    t = nl.ndarray((rows, n), table.dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=-1.0)
    nisa.dma_copy(dst=t, src=table.ap([[n, rows], [1, n]], scalar_offset=s), oob_mode=oob, dge_mode=dge)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def scalar_scatter_kernel(table, start, values):
    """table[start : start + rows] = values (in place), ``start`` read at run time."""
    rows, n = values.shape
    s = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=start)
    v = nl.load(values)
    nisa.dma_copy(dst=table.ap([[n, rows], [1, n]], offset=0, scalar_offset=s), src=v)
    return table


def test_ap_scalar_offset_gather_reads_the_runtime_row():
    table = randn(100, 64)
    for start in (0, 10, 68):
        rep = nki.profile(scalar_gather_kernel)(table, np.array([[start]], np.int32), 32)
        np.testing.assert_array_equal(rep.outputs, table[start:start + 32])
    assert "dma_copy_dynamic" in [i.opcode for i in rep.program.instructions]
    assert rep.hbm_bytes_read == 4 + 32 * 64 * 4      # the start row and the gathered rows
    again = Program.from_bytes(rep.program.to_bytes())
    assert [i.opcode for i in again.instructions] == [i.opcode for i in rep.program.instructions]


def test_ap_scalar_offset_scatter_writes_the_runtime_row():
    table, values = randn(50, 16), randn(8, 16)
    ref = table.copy()
    ref[20:28] = values
    out = nki.simulate(scalar_scatter_kernel)(table.copy(), np.array([[20]], np.int32), values)
    np.testing.assert_array_equal(out, ref)


def test_ap_scalar_offset_out_of_bounds():
    table = randn(100, 64)
    out = nki.simulate(scalar_gather_kernel)(table, np.array([[80]], np.int32), 32, nisa.oob_mode.skip)
    np.testing.assert_array_equal(out[:20], table[80:])
    assert (out[20:] == -1).all()                      # rows past the end are skipped, not written
    with pytest.raises(IndexOutOfRange, match="src_offset = 80 moves rows \\[80, 112\\).*outside its 100 rows"):
        nki.simulate(scalar_gather_kernel)(table, np.array([[80]], np.int32), 32)
    with pytest.raises(SimulatorError, match="outside"):
        nki.simulate(scalar_gather_kernel)(table, np.array([[-1]], np.int32), 32)


@nki.jit
def static_scalar_offset_kernel(a):
    out = nl.ndarray((4, 8), a.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 8), a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a.ap([[32, 4], [2, 8]], offset=1, scalar_offset=3, indirect_dim=1))
    nisa.dma_copy(dst=out, src=t)
    return out


def test_ap_scalar_offset_known_at_trace_time_is_a_static_shift():
    a = randn(4, 32)
    flat = a.reshape(-1)
    ref = np.stack([flat[r * 32 + 1 + 3 * 2 + np.arange(8) * 2] for r in range(4)])  # dim 1 starts 3 steps on
    np.testing.assert_array_equal(nki.simulate(static_scalar_offset_kernel)(a), ref)


@nki.jit
def bad_scalar_offset_kernel(table, case):
    s = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=s, value=0)
    t = nl.ndarray((8, 16), table.dtype, buffer=nl.sbuf)
    if case == "on_chip":
        t.ap([[16, 8], [1, 16]], scalar_offset=s)
    elif case == "both":
        table.ap([[16, 8], [1, 16]], scalar_offset=s, vector_offset=s)
    elif case == "dim1":
        table.ap([[16, 8], [1, 16]], scalar_offset=s, indirect_dim=1)
    elif case == "float_tile":
        f = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=f, value=0.0)
        nisa.dma_copy(dst=t, src=table.ap([[16, 8], [1, 16]], scalar_offset=f))
    elif case == "wide_tile":
        w = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=w, value=0)
        nisa.dma_copy(dst=t, src=table.ap([[16, 8], [1, 16]], scalar_offset=w))
    elif case == "dge_none":
        nisa.dma_copy(dst=t, src=table.ap([[16, 8], [1, 16]], scalar_offset=s), dge_mode=nisa.dge_mode.none)
    return table


@pytest.mark.parametrize("case, match", [
    ("on_chip", "moves dim 0 of an HBM tensor"),
    ("both", "cannot be combined"),
    ("dim1", "moves dim 0 of an HBM tensor"),
    ("float_tile", "need integer dtypes"),
    ("wide_tile", "a scalar offset is one \\[1, 1\\] value"),
    ("dge_none", "needs swdge or hwdge"),
])
def test_ap_scalar_offset_errors(case, match):
    with pytest.raises(SimulatorError, match=match):
        nki.simulate(bad_scalar_offset_kernel)(randn(16, 16), case)


def test_legacy_nc_matmul_takes_pe_tiling_too():
    from torchneuron.nki import legacy
    from torchneuron.nki.legacy import isa as lisa, language as lnl

    @legacy.jit
    def k(a, b):
        out = lnl.ndarray((64, 512), dtype=lnl.float32, buffer=lnl.shared_hbm)
        x, y = lnl.load(a), lnl.load(b)
        acc = lnl.zeros((64, 512), lnl.float32, buffer=lnl.psum)
        acc += lisa.nc_matmul(x[0:64, 0:64], y[0:64, :], tile_position=(0, 0), tile_size=(64, 64))
        acc += lisa.nc_matmul(x[64:128, 0:64], y[64:128, :], tile_position=(64, 0), tile_size=(64, 64))
        lnl.store(out, value=acc)
        return out

    a, b = randn(128, 64), randn(128, 512)
    rep = nki.profile(k)(a, b)
    np.testing.assert_allclose(rep.outputs, a.T @ b, rtol=1e-4, atol=1e-4)
    assert [i.opcode for i in rep.program.instructions].count("nc_matmul_tiled") == 2


# ---- MX: quantize_mx / nc_matmul_mx (trn3) ----------------------------------------------------------

MX_EMAX = {"float8_e4m3fn": (8, 448.0), "float8_e5m2": (15, 57344.0)}


def mx_quantize_ref(x: torch.Tensor, fmt: str):
    """Independent reference: (values [P, F, 4] as the format rounds them, scale exponents [P // 8, F])."""
    p, f4 = x.shape
    f = f4 // 4
    emax, fmax = MX_EMAX[fmt]
    xf = x.float().numpy().reshape(p // 8, 8, f, 4)
    bits = xf.view(np.int32)
    exp = ((bits >> 23) & 0xFF).max(axis=(1, 3))
    scale = np.maximum(exp - emax, 0)
    q = np.clip(xf / 2.0 ** (scale[:, None, :, None].astype(np.float64) - 127), -fmax, fmax)
    q = torch.from_numpy(q.astype(np.float32)).to(getattr(torch, fmt)).float().numpy()
    return q.reshape(p, f, 4), scale.astype(np.uint8)


@nki.jit(platform_target="trn3")
def mx_matmul_kernel(st, mv, st_fmt, mv_fmt, dst_dtype=nl.float32):
    """Quantize bf16 st [K, 4M] and mv [K, 4N] on device, then one MX matmul; also returns the scale tiles."""
    k, m, n = st.shape[0], st.shape[1] // 4, mv.shape[1] // 4
    s_bf, m_bf = nl.load(st), nl.load(mv)
    sq, mq = nl.ndarray((k, m), st_fmt, buffer=nl.sbuf), nl.ndarray((k, n), mv_fmt, buffer=nl.sbuf)
    ss, ms = nl.ndarray((k, m), nl.uint8, buffer=nl.sbuf), nl.ndarray((k, n), nl.uint8, buffer=nl.sbuf)
    nisa.memset(dst=ss, value=0)
    nisa.memset(dst=ms, value=0)
    nisa.quantize_mx(dst=sq, src=s_bf, dst_scale=ss)
    nisa.quantize_mx(dst=mq, src=m_bf, dst_scale=ms)
    acc = nl.ndarray((m, n), dst_dtype, buffer=nl.psum)
    nisa.nc_matmul_mx(dst=acc, stationary=sq, moving=mq, stationary_scale=ss, moving_scale=ms)
    out = nl.ndarray((m, n), dst_dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.copy(acc))
    scales = nl.ndarray((k, m), nl.uint8, buffer=nl.shared_hbm)
    nl.store(scales, ss)
    return out, scales


@pytest.mark.parametrize("k", [32, 128])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_quantize_mx_and_nc_matmul_mx_match_an_independent_reference(k, fmt):
    m, n = 64, 256
    st = torch.from_numpy(randn(k, 4 * m) * 3).bfloat16()
    mv = torch.from_numpy(randn(k, 4 * n)).bfloat16()
    mv[:8, :4] = 0                                     # an all-zero scale group: scale 2^-127
    x4 = getattr(nl, f"{fmt}_x4")
    rep = nki.profile(mx_matmul_kernel)(st, mv, x4, x4)
    out, scales = rep.outputs
    (sq, s_exp), (mq, m_exp) = mx_quantize_ref(st, fmt), mx_quantize_ref(mv, fmt)
    rows = [(g // 4) * 32 + g % 4 for g in range(k // 8)]  # scales sit in the first 4 partitions of each quadrant
    np.testing.assert_array_equal(scales.numpy()[rows], s_exp)
    assert m_exp[0, 0] == 0
    deq = lambda q, e: q * 2.0 ** (np.repeat(e, 8, 0)[:, :, None].astype(np.float64) - 127)  # noqa: E731
    ref = np.einsum("pmj,pnj->mn", deq(sq, s_exp), deq(mq, m_exp))
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)
    exact = st.float().reshape(k, m, 4).numpy()
    assert np.abs(ref - np.einsum("pmj,pnj->mn", exact, mv.float().reshape(k, n, 4).numpy())).max() < \
        0.1 * np.abs(ref).max()                        # quantization error stays small
    mm = [i for i in rep.program.instructions if i.opcode == "nc_matmul_mx"][0]
    assert mm.cost_inputs().matmul_kmn == (4 * k, m, n) and rep.flops >= 2 * 4 * k * m * n


def test_nc_matmul_mx_bf16_dst_and_one_pass_timing():
    st, mv = torch.from_numpy(randn(128, 512)).bfloat16(), torch.from_numpy(randn(128, 2048)).bfloat16()
    f32 = nki.profile(mx_matmul_kernel)(st, mv, nl.float8_e4m3fn_x4, nl.float8_e4m3fn_x4)
    b16 = nki.profile(mx_matmul_kernel)(st, mv, nl.float8_e4m3fn_x4, nl.float8_e4m3fn_x4, nl.bfloat16)
    assert b16.outputs[0].dtype == torch.bfloat16
    torch.testing.assert_close(b16.outputs[0].float(), f32.outputs[0], rtol=1e-2, atol=1e-1)
    # a 512-deep MX contraction is one pass: N = 512 cycles, like one 128-deep bf16 matmul of the same M, N
    assert f32.engine_busy_ns["tensor"] == pytest.approx(512 / chip_spec("trn3").clock_hz("tensor") * 1e9)


def fp4_pack(codes: np.ndarray) -> np.ndarray:
    """[P, F, 4] e2m1 codes (0..15) -> [P, F] uint16 x4 elements (value j in nibble j from the low end)."""
    c = codes.astype(np.uint16)
    return c[..., 0] | (c[..., 1] << 4) | (c[..., 2] << 8) | (c[..., 3] << 12)


@nki.jit(platform_target="trn3")
def mx_offline_kernel(st_data, st_scale, mv_data, mv_scale, st_fmt, mv_fmt):
    """MX matmul of already quantized data (HBM storage integers viewed as x4) with quadrant-layout scales."""
    k, m = st_data.shape
    n = mv_data.shape[1]
    sq, mq = nl.ndarray((k, m), st_fmt, buffer=nl.sbuf), nl.ndarray((k, n), mv_fmt, buffer=nl.sbuf)
    nisa.dma_copy(dst=sq, src=st_data.ap([[m, k], [1, m]], dtype=st_fmt))
    nisa.dma_copy(dst=mq, src=mv_data.ap([[n, k], [1, n]], dtype=mv_fmt))
    ss, ms = nl.load(st_scale), nl.load(mv_scale)
    acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(dst=acc, stationary=sq, moving=mq, stationary_scale=ss, moving_scale=ms,
                      tile_position=(0, 0), tile_size=(32, 128))
    out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
    nl.store(out, nl.copy(acc))
    return out


def test_nc_matmul_mx_fp4_offline_data_and_row_tiling():
    fp4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    k, m, n = 32, 16, 64
    s_codes, m_codes = RNG.integers(0, 16, (k, m, 4)), RNG.integers(0, 16, (k, n, 4))
    s_scale = RNG.integers(120, 134, (4, m)).astype(np.uint8)
    m_scale = RNG.integers(120, 134, (4, n)).astype(np.uint8)
    st_data = torch.from_numpy(fp4_pack(s_codes).astype(np.int32)).to(torch.uint16)
    mv_data = torch.from_numpy(fp4_pack(m_codes).astype(np.int32)).to(torch.uint16)
    rep = nki.profile(mx_offline_kernel)(st_data, torch.from_numpy(s_scale), mv_data, torch.from_numpy(m_scale),
                                         nl.float4_e2m1fn_x4, nl.float4_e2m1fn_x4)
    deq = lambda c, s: fp4[c] * 2.0 ** (np.repeat(s, 8, 0)[:, :, None].astype(np.float64) - 127)  # noqa: E731
    ref = np.einsum("pmj,pnj->mn", deq(s_codes, s_scale), deq(m_codes, m_scale))
    np.testing.assert_allclose(rep.outputs.numpy(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())  # fp32 sums


@nki.jit(platform_target="trn3")
def bad_mx_kernel(case):
    x = nl.ndarray((32, 16), nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(dst=x, value=1.0)
    q = nl.ndarray((32, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    s = nl.ndarray((4, 4), nl.uint8, buffer=nl.sbuf)
    acc = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
    if case == "plain_dst":
        nisa.quantize_mx(dst=nl.ndarray((32, 4), nl.uint32, buffer=nl.sbuf), src=x, dst_scale=s)
    elif case == "fp4_quantize":
        nisa.quantize_mx(dst=nl.ndarray((32, 4), nl.float4_e2m1fn_x4, buffer=nl.sbuf), src=x, dst_scale=s)
    elif case == "fp32_src":
        nisa.quantize_mx(dst=q, src=nl.ndarray((32, 16), nl.float32, buffer=nl.sbuf), dst_scale=s)
    elif case == "partitions":
        nisa.quantize_mx(dst=q[0:16], src=x[0:16], dst_scale=s)
    elif case == "small_scale":
        nisa.quantize_mx(dst=q, src=x, dst_scale=s[0:2])
    elif case == "psum_src":
        nisa.nc_matmul_mx(dst=acc, stationary=q, moving=q, stationary_scale=s, moving_scale=s,
                          tile_position=(0, 32), tile_size=(32, 32))
    elif case == "odd_m":
        nisa.nc_matmul_mx(dst=acc[0:3, :], stationary=q[:, 0:3], moving=q, stationary_scale=s, moving_scale=s)
    return x


@pytest.mark.parametrize("case, match", [
    ("plain_dst", "must be MX x4 data"),
    ("fp4_quantize", "produces fp8 MX data"),
    ("fp32_src", "takes bfloat16 or float16"),
    ("partitions", "multiple of 32"),
    ("small_scale", "need 4"),
    ("psum_src", "tiles rows only"),
    ("odd_m", "must be even"),
])
def test_mx_errors(case, match):
    with pytest.raises(SimulatorError, match=match):
        nki.simulate(bad_mx_kernel)(case)


def test_mx_needs_trn3():
    st, mv = torch.from_numpy(randn(32, 64)).bfloat16(), torch.from_numpy(randn(32, 64)).bfloat16()
    with pytest.raises(SimulatorError, match="NeuronCore-v4 \\(trn3\\); trn2 is NeuronCore-v3"):
        nki.profile(mx_matmul_kernel, chip="trn2")(st, mv, nl.float8_e4m3fn_x4, nl.float8_e4m3fn_x4)


@nki.jit
def scatter_rows_kernel(scale):
    """Spread 4-row groups of ``scale`` into the first 4 partitions of each 32-partition quadrant with on-chip
    ``.ap(offset=...)`` (the offset counts elements of the [partitions, pitch] layout: whole rows move partitions)."""
    rows, f = scale.shape
    t = nl.ndarray((128, f), scale.dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0)
    for q in range(rows // 4):
        nisa.dma_copy(src=scale.ap([[f, 4], [1, f]], offset=4 * q * f), dst=t.ap([[f, 4], [1, f]], offset=32 * q * f))
    out = nl.ndarray((128, f), scale.dtype, buffer=nl.shared_hbm)
    nl.store(out, t)
    return out


def test_on_chip_ap_offset_moves_partitions():
    scale = RNG.integers(0, 255, (16, 8)).astype(np.uint8)
    out = nki.simulate(scatter_rows_kernel)(scale)
    ref = np.zeros((128, 8), np.uint8)
    for q in range(4):
        ref[32 * q:32 * q + 4] = scale[4 * q:4 * q + 4]
    np.testing.assert_array_equal(out, ref)
