"""Registers and dynamic loops: trip counts and conditions read from device data when the kernel runs, as real
loops of the program (one traced program, different data, different trip counts), with branch and register
costs in the timing model; against NumPy references, including the published examples."""
from __future__ import annotations

import numpy as np
import pytest

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.sim import SimulatorError

RNG = np.random.default_rng(5)


@nki.jit
def repeat_add(x, count):
    """acc = x added ``count`` times, count read from HBM at run time."""
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    acc = nl.zeros(x.shape, nl.float32)
    n_sb = nl.ndarray((1, 1), nl.int32)
    nisa.dma_copy(dst=n_sb, src=count)
    n = nisa.register_alloc()
    nisa.register_load(n, n_sb)

    def body(i):
        nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
    nl.fori_loop(0, n, body)
    nl.store(out, acc)
    return out


def test_fori_loop_runtime_trip_count_is_one_program():
    x = RNG.standard_normal((64, 128)).astype(np.float32)
    reports = {}
    for n in (0, 1, 3, 7):
        rep = nki.profile(repeat_add)(x, np.array([[n]], np.int32))
        want = np.zeros_like(x)
        for _ in range(n):
            want = want + x  # fp32 additions in the same order
        np.testing.assert_array_equal(rep.outputs, want)
        reports[n] = rep
    assert repeat_add.trace_count == 1           # traced once: the loop is in the program, not unrolled
    assert len({r.instructions for r in reports.values()}) == 1
    from torchneuron.sim import Program
    program = reports[3].program
    assert Program.from_bytes(program.to_bytes()).instructions == program.instructions  # the loop serializes
    ops = [i.opcode for i in program.instructions]
    assert ops.count("tensor_tensor") == 1 and "loop_begin" in ops and "loop_end" in ops
    t = {n: r.device_time_ns for n, r in reports.items()}
    assert t[0] < t[1] < t[3] < t[7]
    step = (t[7] - t[3]) / 4                      # each iteration costs the same
    assert (t[3] - t[1]) / 2 == pytest.approx(step, rel=1e-6)
    spec = nki.resolve_chip("trn2")
    add_ns = 2 * 128 / spec.vector.clock_hz * 1e9   # tensor_tensor fp32 from SBUF: 2N VectorE cycles
    assert step > add_ns                          # plus the branch and the index copy of every iteration


def test_documented_while_loop_counts_down():
    @nki.jit
    def k(data, count_input):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        val = nl.ndarray((1, 1), nl.float32)
        nisa.dma_copy(dst=val, src=data)
        acc = nl.zeros((1, 1), nl.float32)
        count_sb = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=count_sb, src=count_input)
        one_sb = nl.ndarray((1, 1), nl.int32)
        nisa.memset(dst=one_sb, value=1)
        reg = nisa.register_alloc()
        nisa.register_load(reg, count_sb)

        def body(r):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=val, op=nl.add)
            nisa.tensor_tensor(dst=count_sb, data1=count_sb, data2=one_sb, op=nl.subtract)
            nisa.register_load(r, count_sb)
            return r
        nl.while_loop(reg, body)
        nl.store(out, acc)
        return out

    for n in (0, 1, 5):
        got = k(np.array([[2.5]], np.float32), np.array([[n]], np.int32))
        assert got.tolist() == [[2.5 * n]]


def test_documented_dynamic_range_over_a_register():
    @nki.jit
    def k(input_tensor):
        out_tensor = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        reg = nisa.register_alloc(5)
        for _ in nl.dynamic_range(reg):
            tile = nl.load(input_tensor[0:128, 0:512])
            result = nl.multiply(tile, tile)
            nl.store(out_tensor[0:128, 0:512], result)
        return out_tensor

    x = RNG.standard_normal((128, 512)).astype(np.float32)
    rep = nki.profile(k)(x)
    np.testing.assert_array_equal(rep.outputs, x * x)
    assert [i.opcode for i in rep.program.instructions].count("dma_copy") == 2   # one load, one store: not unrolled
    assert len(rep.start_ns) > len(rep.program.instructions)                   # five executed iterations


def test_loop_index_register_as_a_runtime_row_offset():
    @nki.jit
    def k(data, n_rows):
        out = nl.ndarray(data.shape, nl.float32, buffer=nl.shared_hbm)
        zeros = nl.zeros(data.shape, nl.float32)
        nisa.dma_copy(dst=out, src=zeros)
        n_sb = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=n_sb, src=n_rows)
        n = nisa.register_alloc()
        nisa.register_load(n, n_sb)
        row = nl.ndarray((1, data.shape[1]), nl.float32)

        def body(i):
            f = data.shape[1]
            nisa.dma_copy(dst=row, src=data.ap([[f, 1], [1, f]], scalar_offset=i))
            nisa.dma_copy(dst=out.ap([[f, 1], [1, f]], scalar_offset=i), src=row)
        nl.fori_loop(0, n, body)
        return out

    data = RNG.standard_normal((16, 8)).astype(np.float32)
    for n in (3, 16):
        want = np.zeros_like(data)
        want[:n] = data[:n]
        np.testing.assert_array_equal(k(data, np.array([[n]], np.int32)), want)


def test_register_store_move_and_python_use_raises():
    @nki.jit
    def k(x):
        out = nl.ndarray((1, 2), nl.int32, buffer=nl.shared_hbm)
        a = nisa.register_alloc(41)
        b = nisa.register_alloc()
        nisa.register_move(b, a)
        t = nl.ndarray((1, 2), nl.int32)
        nisa.register_store(t[:, 0:1], b)
        nisa.register_move(b, -7)
        nisa.register_store(t[:, 1:2], b)
        with pytest.raises(TypeError, match="known only when the kernel runs"):
            if a:
                pass
        with pytest.raises(TypeError, match="known only when the kernel runs"):
            range(a)
        nl.store(out, t)
        return out

    assert k(np.zeros((1, 1), np.float32)).tolist() == [[41, -7]]


def test_nested_dynamic_loops_and_endless_loop_guard():
    @nki.jit
    def k(x, counts):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        c = nl.load(counts)
        one = nl.full((1, 1), 1.0, nl.float32)
        acc = nl.zeros((1, 1), nl.float32)
        outer, inner = nisa.register_alloc(), nisa.register_alloc()
        nisa.register_load(outer, c[:, 0:1])
        nisa.register_load(inner, c[:, 1:2])
        for _ in nl.dynamic_range(outer):
            for _ in nl.dynamic_range(1, inner):
                nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)
        nl.store(out, acc)
        return out

    assert k(np.zeros((1, 1), np.float32), np.array([[3, 5]], np.int32)).tolist() == [[12.0]]
    assert k(np.zeros((1, 1), np.float32), np.array([[4, 0]], np.int32)).tolist() == [[0.0]]

    @nki.jit
    def forever(x):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        one = nl.full((1, 1), 1.0, nl.float32)
        reg = nisa.register_alloc(1)
        nl.while_loop(reg, lambda r: r)
        nl.store(out, one)
        return out

    import torchneuron.sim.core as core
    old, core.MAX_DYNAMIC_STEPS = core.MAX_DYNAMIC_STEPS, 10_000
    try:
        with pytest.raises(SimulatorError, match="an endless loop"):
            forever(np.zeros((1, 1), np.float32))
    finally:
        core.MAX_DYNAMIC_STEPS = old
