"""Partition broadcasts (``x.broadcast_to((P, F))`` of a one-partition row): the TensorE matmul by a constant
row of ones, read from PSUM by the instructions that use it where the ISA allows (``nki.forwarding``), else
copied to SBUF. Each kernel is checked against a NumPy reference (exact: the broadcast moves values, and each
reference op is the same fp32 operation) and by the instructions of its program."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.nki import legacy
from torchneuron.nki.forwarding import forward
from torchneuron.nki.legacy import isa as lnisa, language as lnl
from torchneuron.sim import tile as ap_tile
from torchneuron.sim.isa import Memset, TensorCopy, TensorTensor

RNG = np.random.default_rng(16)


def ops(program) -> Counter:
    """Instructions of a program by opcode."""
    return Counter(i.opcode for i in program.instructions)


def psum_copies(program) -> int:
    """Copies out of PSUM in a program."""
    return sum(i.opcode == "tensor_copy" and i.src.kind == "psum" for i in program.instructions)


def psum_readers(program) -> list[str]:
    """The opcodes of the Vector/Scalar instructions that read an operand from PSUM."""
    return [i.opcode for i in program.instructions
            if i.engine.value in ("vector", "scalar") and any(f.memory == "psum" for f in i.reads())]


def output_tile_and_broadcast(x, row) -> tuple:
    """In a kernel: an fp32 HBM output shaped like ``x``, ``x`` loaded, and ``row`` broadcast to its shape."""
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    return out, nl.load(x), nl.load(row).broadcast_to(tuple(x.shape))


def tile_and_row(f: int) -> tuple[np.ndarray, np.ndarray]:
    """A random fp32 [128, f] tile and [1, f] row."""
    return RNG.standard_normal((128, f), dtype=np.float32), RNG.standard_normal((1, f), dtype=np.float32)


def test_broadcast_read_from_psum_by_its_tensor_tensor():
    @nki.jit
    def k(x, row):
        out, t, b = output_tile_and_broadcast(x, row)
        nl.store(out, nl.multiply(t, b))
        return out

    x, row = tile_and_row(512)
    rep = nki.profile(k, chip="trn1")(x, row)
    np.testing.assert_array_equal(rep.outputs, x * row)
    c = ops(rep.program)
    # one matmul into PSUM, no copy out of it, one memset (the row of ones)
    assert (c["nc_matmul"], psum_copies(rep.program), c["memset"], c["tensor_tensor"]) == (1, 0, 1, 1)
    assert psum_readers(rep.program) == ["tensor_tensor"]


def test_one_row_of_ones_for_every_broadcast_and_each_kept_in_psum_while_held():
    states = 4

    @nki.jit
    def k(x, rows):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        acc = nl.zeros((128, 256), nl.float32)
        for s in nl.affine_range(states):
            b = nl.load(rows[s:s + 1, :]).broadcast_to((128, 256))
            acc[...] = nl.add(acc, nl.multiply(t, b))
        nl.store(out, acc)
        return out

    x, rows = RNG.standard_normal((128, 256), dtype=np.float32), RNG.standard_normal((states, 256), dtype=np.float32)
    rep = nki.profile(k, chip="trn1")(x, rows)
    want = np.zeros((128, 256), np.float32)
    for s in range(states):
        want = want + x * rows[s]
    np.testing.assert_array_equal(rep.outputs, want)
    c = ops(rep.program)
    assert (c["nc_matmul"], psum_copies(rep.program)) == (states, 0)
    assert c["memset"] == 2   # the accumulator's zeros and one row of ones
    assert psum_readers(rep.program).count("tensor_tensor") == states


def test_mamba_like_legacy_loop_reads_each_broadcast_from_psum():
    """The fused Mamba tutorial's per-state body (earlier-generation NKI): both broadcasts per state read
    from PSUM, no copies, one row of ones."""
    states, seq = 3, 128

    @legacy.jit
    def k(delta, u, a, b, c):
        out = lnl.ndarray(delta.shape, dtype=delta.dtype, buffer=lnl.shared_hbm)
        acc = lnl.zeros((128, seq), dtype=delta.dtype)
        d_i, u_i = lnl.load(delta), lnl.load(u)
        for s in lnl.affine_range(states):
            a_i = lnl.load(a[0:128, s])
            d_a = lnisa.activation(op=lnl.exp, data=d_i, scale=a_i)
            b_i = lnl.load(b[s:s + 1, 0:seq])
            d_u = lnisa.tensor_tensor(d_i, u_i, op=lnl.multiply)
            d_bu = lnisa.tensor_tensor(d_u, b_i.broadcast_to((128, seq)), op=lnl.multiply)
            scan = lnisa.tensor_tensor_scan(d_a, d_bu, initial=0, op0=np.multiply, op1=np.add)
            c_i = lnl.load(c[s:s + 1, 0:seq])
            acc[0:128, 0:seq] += lnisa.tensor_tensor(scan, c_i.broadcast_to((128, seq)), op=lnl.multiply)
        lnl.store(out[0:128, 0:seq], acc[0:128, 0:seq])
        return out

    f32 = np.float32
    delta, u = RNG.uniform(0, 0.1, (128, seq)).astype(f32), RNG.standard_normal((128, seq), dtype=f32)
    a = -RNG.uniform(0.5, 1.5, (128, states)).astype(f32)
    b, c = RNG.standard_normal((states, seq), dtype=f32), RNG.standard_normal((states, seq), dtype=f32)
    rep = legacy.profile(k, chip="trn1")(delta, u, a, b, c)
    # the reference in float64; the kernel rounds each step to fp32 (exp, products, a `seq`-step scan whose
    # terms decay by exp(delta * A) <= 1, and `states` sums): a few ulps of the output's magnitude per step
    d64, u64 = delta.astype(np.float64), u.astype(np.float64)
    want = np.zeros((128, seq))
    for s in range(states):
        da, dbu = np.exp(d64 * a[:, s:s + 1]), d64 * u64 * b[s]
        h, scan = np.zeros(128), np.empty((128, seq))
        for i in range(seq):
            h = da[:, i] * h + dbu[:, i]
            scan[:, i] = h
        want += scan * c[s]
    scale = np.abs(want).max()
    np.testing.assert_allclose(rep.outputs, want, rtol=0, atol=8 * seq * states * 2.0 ** -24 * scale)
    cnt = ops(rep.program)
    assert (cnt["nc_matmul"], psum_copies(rep.program), cnt["memset"]) == (2 * states, 0, 2)
    assert psum_readers(rep.program).count("tensor_tensor") == 2 * states
    # delta * u, the same in every state, is computed once (its repeats are dropped, their readers read it)
    assert cnt["tensor_tensor"] == 3 * states + 1


def test_a_broadcast_stored_by_dma_is_copied_to_sbuf():
    @nki.jit
    def k(row):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.load(row).broadcast_to((128, 64)))   # DMA cannot read PSUM
        return out

    row = RNG.standard_normal((1, 64), dtype=np.float32)
    rep = nki.profile(k, chip="trn1")(row)
    np.testing.assert_array_equal(rep.outputs, np.repeat(row, 128, 0))
    assert psum_copies(rep.program) == 1


def test_a_broadcast_next_to_a_psum_operand_is_copied_to_sbuf():
    @nki.jit
    def k(x, row):
        out = nl.ndarray((128, 128), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        p = nl.matmul(t, t, transpose_x=True)                 # a PSUM tile: the other operand cannot be in PSUM too
        nl.store(out, nl.add(p, nl.load(row).broadcast_to((128, 128))))
        return out

    x, row = tile_and_row(128)
    rep = nki.profile(k, chip="trn1")(x, row)
    ref = (torch.from_numpy(x).double().T @ torch.from_numpy(x).double()).numpy()
    # fp32 matmul over 128 terms of |x| ~ 1, then one fp32 add
    np.testing.assert_allclose(rep.outputs, ref + row, rtol=0, atol=128 * 2.0 ** -23 * (np.abs(x) ** 2).sum(0).max())
    assert psum_copies(rep.program) == 1   # the broadcast's: the add reads the matmul's PSUM tile


@pytest.mark.parametrize("dtype, f", [(nl.bfloat16, 256), (nl.float32, 1024)])
def test_cast_or_multi_bank_broadcasts_keep_their_copies(dtype, f):
    """A bf16 broadcast is copied with a cast (fp32 PSUM -> bf16), a 1024-wide fp32 one spans two PSUM banks
    (two matmuls, two copies) while its reader reads all of it: neither is forwarded."""
    @nki.jit
    def k(x, row):
        out = nl.ndarray(x.shape, dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.multiply(nl.load(x), nl.load(row).broadcast_to((128, f))))
        return out

    torch_dtype = torch.bfloat16 if dtype == nl.bfloat16 else torch.float32
    x = torch.randn(128, f, generator=torch.Generator().manual_seed(3)).to(torch_dtype)
    row = torch.randn(1, f, generator=torch.Generator().manual_seed(4)).to(torch_dtype)
    rep = nki.profile(k, chip="trn1")(x, row)
    torch.testing.assert_close(rep.outputs, x * row, rtol=0, atol=0)
    c = ops(rep.program)
    assert (c["nc_matmul"], psum_copies(rep.program)) == ((1, 1) if f == 256 else (2, 2))


def test_ones_row_set_in_a_dynamic_loop_is_set_again_after_it():
    """A row of ones first set inside a dynamic loop that runs zero times is not reused after the loop."""
    @nki.jit
    def k(x, row, n):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        r = nl.load(row)
        reg = nisa.register_alloc()
        nisa.register_load(reg, nl.load(n))
        for _ in nl.dynamic_range(reg):
            nl.store(out, nl.multiply(t, r.broadcast_to((128, 64))))
        nl.store(out, nl.add(t, r.broadcast_to((128, 64))))
        return out

    x, row = tile_and_row(64)
    rep = nki.profile(k, chip="trn1")(x, row, np.array([[0]], np.int32))
    np.testing.assert_array_equal(rep.outputs, x + row)
    assert ops(rep.program)["memset"] == 2   # one row of ones in the loop, one after it


# ---- the pass on hand-made programs --------------------------------------------------------------------

S = ap_tile("sbuf", "float32", (128, 64), offset=0)
S2 = ap_tile("sbuf", "float32", (128, 64), offset=4096)
OUT = ap_tile("sbuf", "float32", (128, 64), offset=8192)
P = ap_tile("psum", "float32", (128, 64), offset=0)


def _copy_and_read(*between) -> list:
    return [TensorCopy(dst=S, src=P), *between, TensorTensor(dst=OUT, data1=S2, data2=S, op="multiply")]


def test_pass_forwards_a_reader_of_an_unchanged_psum_source():
    program, kept = forward(_copy_and_read(), {0})
    assert kept == [1]
    assert program[0].data2 == P and program[0].data1 == S2


def test_pass_keeps_the_copy_when_the_psum_source_is_overwritten_before_the_reader():
    original = _copy_and_read(Memset(dst=P, value=0.0))
    program, kept = forward(original, {0})
    assert program == original and kept == [0, 1, 2]


def test_pass_keeps_the_copy_when_part_of_it_is_overwritten_and_the_rest_read():
    half = ap_tile("sbuf", "float32", (128, 32), offset=0)
    rest = ap_tile("sbuf", "float32", (128, 32), offset=128)
    original = [TensorCopy(dst=S, src=P), Memset(dst=half, value=0.0),
                TensorTensor(dst=ap_tile("sbuf", "float32", (128, 32), offset=8192), data1=rest, data2=rest,
                             op="add")]
    program, kept = forward(original, {0})
    assert program == original


def test_pass_stops_at_a_full_overwrite_and_keeps_later_readers():
    rewrite = Memset(dst=S, value=2.0)
    later = TensorTensor(dst=OUT, data1=S2, data2=S, op="add")   # reads the memset's values, not the copy's
    program, kept = forward([*_copy_and_read(), rewrite, later], {0})
    assert kept == [1, 2, 3] and program[0].data2 == P and program[1] is rewrite and program[2] is later


# ---- recomputations: an element-wise result computed again from unchanged operands --------------------

def test_a_result_recomputed_from_unchanged_operands_is_computed_once():
    @legacy.jit
    def k(x, y, w):
        out = lnl.ndarray((4, 128, 64), dtype=lnl.float32, buffer=lnl.shared_hbm)
        a, b = lnl.load(x), lnl.load(y)
        for i in lnl.affine_range(4):
            prod = lnisa.tensor_tensor(a, b, op=lnl.multiply)       # the same every iteration
            lnl.store(out[i], lnisa.tensor_tensor(prod, lnl.load(w[i]), op=lnl.add))
        return out

    x, y = RNG.standard_normal((128, 64), dtype=np.float32), RNG.standard_normal((128, 64), dtype=np.float32)
    w = RNG.standard_normal((4, 128, 64), dtype=np.float32)
    rep = legacy.profile(k, chip="trn1")(x, y, w)
    np.testing.assert_array_equal(rep.outputs, x * y + w)
    assert ops(rep.program)["tensor_tensor"] == 1 + 4


def test_a_result_whose_operand_changed_is_computed_again():
    @legacy.jit
    def k(x, y):
        out = lnl.ndarray((3, 128, 64), dtype=lnl.float32, buffer=lnl.shared_hbm)
        a, b = lnl.load(x), lnl.load(y)
        for i in lnl.affine_range(3):
            lnl.store(out[i], lnisa.tensor_tensor(a, b, op=lnl.multiply))
            b[...] = lnl.add(b, 1.0)                                # b changes between the products
        return out

    x, y = RNG.standard_normal((128, 64), dtype=np.float32), RNG.standard_normal((128, 64), dtype=np.float32)
    rep = legacy.profile(k, chip="trn1")(x, y)
    # the reference makes the same fp32 operations: b + 1, then + 1 again
    b1 = y + np.float32(1)
    np.testing.assert_array_equal(rep.outputs, np.stack([x * y, x * b1, x * (b1 + np.float32(1))]))
    assert ops(rep.program)["tensor_tensor"] == 3


def test_a_result_written_over_after_it_was_computed_is_computed_again():
    @legacy.jit
    def k(x, y):
        out = lnl.ndarray((2, 128, 64), dtype=lnl.float32, buffer=lnl.shared_hbm)
        a, b = lnl.load(x), lnl.load(y)
        first = lnisa.tensor_tensor(a, b, op=lnl.multiply)
        first[...] = lnl.add(first, 1.0)                            # the earlier result no longer holds a * b
        again = lnisa.tensor_tensor(a, b, op=lnl.multiply)
        lnl.store(out[0], first)
        lnl.store(out[1], again)
        return out

    x, y = RNG.standard_normal((128, 64), dtype=np.float32), RNG.standard_normal((128, 64), dtype=np.float32)
    rep = legacy.profile(k, chip="trn1")(x, y)
    np.testing.assert_array_equal(rep.outputs, np.stack([x * y + np.float32(1), x * y]))
    assert ops(rep.program)["tensor_tensor"] == 2


A = ap_tile("sbuf", "float32", (128, 64), offset=12288)


def test_pass_drops_a_repeat_and_points_its_readers_at_the_first_result():
    first = TensorTensor(dst=S, data1=A, data2=S2, op="multiply")
    repeat = TensorTensor(dst=OUT, data1=A, data2=S2, op="multiply")
    reader = TensorTensor(dst=ap_tile("sbuf", "float32", (128, 64), offset=16384), data1=OUT, data2=A, op="add")
    program, kept = forward([first, repeat, reader], (), [(1, 0)])
    assert kept == [0, 2] and program[1].data1 == S


def test_pass_keeps_a_repeat_whose_operand_was_written_in_between():
    first = TensorTensor(dst=S, data1=A, data2=S2, op="multiply")
    original = [first, Memset(dst=A, value=1.0), TensorTensor(dst=OUT, data1=A, data2=S2, op="multiply"),
                TensorTensor(dst=ap_tile("sbuf", "float32", (128, 64), offset=16384), data1=OUT, data2=A, op="add")]
    program, kept = forward(original, (), [(2, 0)])
    assert program == original


def test_depends_on_pairs_keep_their_instructions_when_copies_are_dropped():
    @nki.jit
    def k(x, row):
        out, t, b = output_tile_and_broadcast(x, row)
        scratch, prod = nl.ndarray((128, 64), nl.float32), nl.ndarray((128, 64), nl.float32)
        first = nisa.memset(dst=scratch, value=0.0)
        nisa.tensor_tensor(dst=prod, data1=t, data2=b, op=nl.multiply).depends_on(first)
        nl.store(out, nl.add(prod, scratch))
        return out

    x, row = tile_and_row(64)
    rep = nki.profile(k, chip="trn1")(x, row)
    np.testing.assert_array_equal(rep.outputs, x * row)
    assert psum_copies(rep.program) == 0
    ins = rep.program.instructions
    (consumer, producer), = rep.program.after
    assert ins[consumer].opcode == "tensor_tensor" and ins[consumer].data2.kind == "psum"
    assert ins[producer].opcode == "memset" and ins[producer].value == 0.0
