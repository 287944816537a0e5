"""PSUM spilling (``torchneuron/nki/liveness.py``, step 4): a PSUM tensor larger than PSUM whose tiles fit
nowhere lives in SBUF (or private HBM scratch when SBUF is full); writes go through a temporary PSUM bank
and a copy out, reads through the backing. Kernels whose PSUM fits are traced exactly as before."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from torchneuron import nki
from torchneuron.nki import legacy
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.nki.legacy import isa as lisa, language as lnl
from torchneuron.nki.tracing import DMA_QUEUES, SPILL_DMA_QUEUES
from torchneuron.sim import SimulatorError
from torchneuron.sim.specs import chip_spec

RNG = np.random.default_rng(5)
PSUM_BYTES = chip_spec("trn2").psum_bytes_per_partition
SBUF_BYTES = chip_spec("trn2").sbuf_bytes_per_partition
BANK_FP32 = 512  # fp32 elements of one 2 KiB PSUM bank


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def opcodes(program) -> collections.Counter:
    return collections.Counter(i.opcode for i in program.instructions)


def spill_slots(program) -> list[str]:
    return [a.name for a in program.args if a.name.startswith("psum_spill")]


def within_on_chip_capacity(program) -> bool:
    caps = {"sbuf": SBUF_BYTES, "psum": PSUM_BYTES}
    return all(ap.byte_range[1] <= caps[ap.memory] for i in program.instructions for _, ap in i.operands()
               if ap.on_chip)


@legacy.jit
def legacy_row_max_kernel(q, k, fill_sbuf):
    """attn_fwd_v3's scores pattern, small: every [128, 512] block of q.T @ k is computed into one PSUM tensor
    of (nq, nkv) blocks first, then each row's max is reduced and the max-shifted scores stored. ``fill_sbuf``:
    a tile that keeps most of SBUF busy throughout (so the spill goes to HBM)."""
    nq, nkv = q.shape[1] // 128, k.shape[1] // BANK_FP32
    shifted = lnl.ndarray((nq, 128, k.shape[1]), dtype=lnl.float32, buffer=lnl.shared_hbm)
    row_max = lnl.ndarray((nq, 128, 1), dtype=lnl.float32, buffer=lnl.shared_hbm)
    q_sb, k_sb = lnl.load(q), lnl.load(k)
    filler = lisa.memset((128, fill_sbuf), 0.0, dtype=lnl.float32) if fill_sbuf else None
    qk = lnl.ndarray((nq, nkv, lnl.par_dim(128), BANK_FP32), dtype=lnl.float32, buffer=lnl.psum)
    for i in lnl.affine_range(nq):
        for j in lnl.affine_range(nkv):
            qk[i, j, :, :] = lisa.nc_matmul(stationary=q_sb[:, i * 128:(i + 1) * 128],
                                            moving=k_sb[:, j * BANK_FP32:(j + 1) * BANK_FP32])
    for i in lnl.affine_range(nq):
        block_max = lnl.ndarray((lnl.par_dim(128), nkv), dtype=lnl.float32, buffer=lnl.sbuf)
        for j in lnl.affine_range(nkv):
            block_max[:, j] = lisa.tensor_reduce(op=lnl.max, data=qk[i, j], axis=1)
        m = lisa.tensor_reduce(op=lnl.max, data=block_max, axis=1)
        lnl.store(row_max[i], m)
        for j in lnl.affine_range(nkv):
            lnl.store(shifted[i, :, j * BANK_FP32:(j + 1) * BANK_FP32],
                      lisa.tensor_scalar(data=qk[i, j], op0=lnl.subtract, operand0=m))
    if filler is not None:  # read at the end: the filler is live over the whole kernel
        lnl.store(row_max[0], lisa.tensor_reduce(op=lnl.max, data=filler[:, 0:1], axis=1))
    return row_max, shifted


def row_max_reference(q, k):
    s = q.T @ k
    m = s.max(axis=1, keepdims=True)
    return m.reshape(-1, 128, 1), (s - m).reshape(-1, 128, k.shape[1])


def test_legacy_scores_larger_than_psum_spill_to_sbuf():
    q, k = randn(128, 2 * 128), randn(128, 5 * BANK_FP32)  # 2 x 5 banks: 20 KiB of PSUM, all live at once
    row_max, shifted = legacy_row_max_kernel(q, k, 0)
    ref_max, ref_shifted = row_max_reference(q, k)
    np.testing.assert_allclose(row_max, ref_max, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(shifted, ref_shifted, rtol=1e-4, atol=1e-3)
    program = nki.profile(legacy_row_max_kernel)(q, k, 0).program
    # one copy out of PSUM per spilled matmul, besides the 10 evictions of tensor_scalar's PSUM results
    assert opcodes(program)["tensor_copy"] == 10 + 10
    assert not spill_slots(program) and within_on_chip_capacity(program)


def test_legacy_scores_spill_to_hbm_when_sbuf_is_full():
    q, k = randn(128, 2 * 128), randn(128, 5 * BANK_FP32)
    fill = (SBUF_BYTES - 26 * 1024) // 4  # leaves less SBUF than q, k and the 20 KiB tensor need
    row_max, shifted = legacy_row_max_kernel(q, k, fill)
    ref_max, ref_shifted = row_max_reference(q, k)
    ref_max[0] = 0.0  # the filler's max overwrites the first row block
    np.testing.assert_allclose(row_max, ref_max, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(shifted, ref_shifted, rtol=1e-4, atol=1e-3)
    program = nki.profile(legacy_row_max_kernel)(q, k, fill).program
    ops = opcodes(program)
    # 10 spilled writes (copy out + DMA to HBM), 20 spilled reads (each a DMA back into SBUF); the kernel's own
    # DMAs are 2 loads and 2 + 10 + 1 stores
    assert ops["tensor_copy"] == 10 + 10 and ops["dma_copy"] == 10 + 20 + 2 + 13
    assert spill_slots(program) == ["psum_spill0"] and within_on_chip_capacity(program)
    # the spill DMAs alternate over the spill queues; the kernel's own keep its queues
    spill = [i for i in program.instructions if i.opcode == "dma_copy" and "psum_spill" in i.src.memory + i.dst.memory]
    assert [i.queue for i in spill] == [DMA_QUEUES + k % SPILL_DMA_QUEUES for k in range(30)]
    assert all(i.queue < DMA_QUEUES for i in program.instructions if i.opcode == "dma_copy" and i not in spill)


@nki.jit
def wide_psum_kernel(x, y, banks, accumulate_twice):
    """One current-style PSUM tile of ``banks`` banks (larger than PSUM: spilled), each bank one matmul, read
    back four banks per instruction."""
    out = nl.ndarray((128, banks * BANK_FP32), nl.float32, buffer=nl.shared_hbm)
    x_sb, y_sb = nl.load(x), nl.load(y)
    ps = nl.ndarray((128, banks, BANK_FP32), nl.float32, buffer=nl.psum)
    for j in nl.affine_range(banks):
        nisa.nc_matmul(dst=ps[:, j, :], stationary=x_sb, moving=y_sb[:, j * BANK_FP32:(j + 1) * BANK_FP32])
    if accumulate_twice:
        nisa.nc_matmul(dst=ps[:, 0, :], stationary=x_sb, moving=y_sb[:, 0:BANK_FP32], accumulate=True)
    for j in nl.affine_range(banks // 4):
        res = nl.ndarray((128, 4 * BANK_FP32), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=res, op=nl.exp, data=ps[:, 4 * j:4 * (j + 1), :].reshape((128, 4 * BANK_FP32)),
                        scale=0.01)
        nl.store(out[:, 4 * j * BANK_FP32:4 * (j + 1) * BANK_FP32], res)
    return out


def test_current_style_tile_larger_than_psum_is_spilled():
    x, y = randn(128, 128), randn(128, 12 * BANK_FP32)  # one 24 KiB PSUM tile
    out = wide_psum_kernel(x, y, 12, False)
    np.testing.assert_allclose(out, np.exp(0.01 * (x.T @ y)), rtol=1e-4, atol=1e-4)
    program = nki.profile(wide_psum_kernel)(x, y, 12, False).program
    assert opcodes(program)["tensor_copy"] == 12 and within_on_chip_capacity(program)


def test_accumulating_into_a_spilled_tensor_is_refused():
    x, y = randn(128, 128), randn(128, 12 * BANK_FP32)
    with pytest.raises(SimulatorError, match=r"nc_matmul .*accumulates into .*spilled.*accumulation into a "
                                             r"spilled PSUM tensor is not supported"):
        wide_psum_kernel(x, y, 12, True)


def test_kernels_whose_psum_fits_are_unchanged():
    # 2 x 2 banks of scores fit in PSUM: exactly the instructions the kernel emitted (no copies, no scratch)
    q, k = randn(128, 2 * 128), randn(128, 2 * BANK_FP32)
    program = nki.profile(legacy_row_max_kernel)(q, k, 0).program
    assert opcodes(program) == {"dma_copy": 2 + 2 + 4, "nc_matmul": 4, "tensor_reduce": 6, "tensor_scalar": 4,
                                "tensor_copy": 4}  # (the evictions of tensor_scalar's PSUM results)
    # 8 banks: the whole PSUM, placed (not spilled); 4 banks per read
    x, y = randn(128, 128), randn(128, 8 * BANK_FP32)
    program = nki.profile(wide_psum_kernel)(x, y, 8, False).program
    assert opcodes(program) == {"dma_copy": 2 + 2, "nc_matmul": 8, "activation": 2}
    assert not spill_slots(program)
