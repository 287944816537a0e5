"""Runs of plain copies executed in one call (sim/copies.py, ``_C._CopyBatch``): bit for bit what each copy's
``execute`` does, only the copies the batch can do exactly are batched, and a short HBM binding raises."""
from __future__ import annotations

import math

import pytest
import torch

from torchneuron.sim import AP, ArgSlot, NeuronCore, Program, isa, tile
from torchneuron.sim.memory import writes_once
from tests.sim.test_steps import _reference

F32, BF16, I8, I16 = torch.float32, torch.bfloat16, torch.int8, torch.int16
P, F = 16, 24


def _sb(i: int, dtype=F32, free=(F,), parts: int = P):
    return tile("sbuf", dtype, (parts, *free), offset=512 * i)


def _program() -> Program:
    """Copies of each itemsize and layout a batch takes, mixed with ones it must leave to their steps."""
    x, y = tile("hbm:x", F32, (P, F)), tile("hbm:y", BF16, (P, F))
    q, w = tile("hbm:q", I8, (P, 32)), tile("hbm:w", I16, (P, 4))
    column = AP("hbm:x", F32, ((F, P), (0, 8)))              # each row's first value, 8 times (stride-0 read)
    body = [
        isa.dma_copy(dst=_sb(0), src=x),                                           # whole buffer
        isa.dma_copy(dst=_sb(1, F32, (F // 2,)), src=x[:, F // 2:]),               # strided HBM view
        isa.dma_copy(dst=_sb(2, BF16), src=y),                                     # 2-byte elements
        isa.dma_copy(dst=_sb(3, I8, (32,)), src=q),                                # 1-byte elements
        isa.dma_copy(dst=_sb(4, I16, (4,)), src=w),                                # 2-byte integers
        isa.dma_copy(dst=_sb(5, F32, (8,)), src=column),
        isa.dma_copy(dst=_sb(6, F32, (2, F // 2)), src=x),                         # a reshape, as a view
        isa.dma_copy(dst=_sb(17, F32, (2, F // 4)), src=x[:, 1::2]),               # strided, reshaped
        isa.dma_copy(dst=_sb(7, BF16), src=x),                                     # a cast: its step
        isa.tensor_copy(dst=_sb(8)[:, ::2], src=_sb(0)[:, 1::2]),                  # SBUF to SBUF, strided
        isa.tensor_copy(dst=_sb(9, BF16), src=_sb(2, BF16)),
        isa.tensor_tensor(dst=_sb(10), data1=_sb(0), data2=_sb(8), op="add"),      # ends the first run
        isa.dma_copy(dst=tile("hbm:o", F32, (P, F)), src=_sb(10)),
        isa.dma_copy(dst=tile("hbm:o", F32, (P, F))[:, :F // 2], src=_sb(1, F32, (F // 2,))),
        isa.dma_copy(dst=tile("hbm:o8", I8, (P, 32)), src=_sb(3, I8, (32,))),
        isa.dma_copy(dst=tile("hbm:o16", I16, (P, 4)), src=_sb(4, I16, (4,))),
        isa.dma_copy(dst=tile("hbm:ob", BF16, (P, F)), src=_sb(9, BF16)),
        isa.dma_copy(dst=tile("hbm:oc", F32, (P, 8)), src=_sb(5, F32, (8,))),
        # TensorE transposes open PSUM accumulation groups (after the batch's copies); a matmul with
        # accumulate=None then adds into the first and overwrites past it; identity activations evict PSUM
        isa.nc_transpose(dst=tile("psum", F32, (F, P)), data=_sb(0)),
        isa.nc_transpose(dst=tile("psum", BF16, (F, P), offset=2048), data=_sb(2, BF16)),
        isa.activation(dst=_sb(11), op="identity", data=_sb(8)),
        isa.nc_matmul(dst=tile("psum", F32, (F, P)), stationary=_sb(0), moving=_sb(12, F32, (P,))),
        isa.nc_matmul(dst=tile("psum", F32, (F, P), offset=4096), stationary=_sb(0), moving=_sb(12, F32, (P,))),
        isa.activation(dst=_sb(13, F32, (P,), parts=F), op="identity", data=tile("psum", F32, (F, P))),
        isa.nc_transpose(dst=_sb(14, F32, (P,), parts=F), data=_sb(0), engine="vector"),
        isa.tensor_copy(dst=_sb(16, BF16, (P,), parts=F), src=tile("psum", BF16, (F, P), offset=2048)),
        isa.activation(dst=_sb(15), op="identity", data=_sb(8), scale=2.0),               # scaled: its step
        isa.dma_copy(dst=tile("hbm:ot", F32, (F, P)), src=_sb(13, F32, (P,), parts=F)),
    ]
    args = [ArgSlot("x", (P, F), F32), ArgSlot("y", (P, F), BF16), ArgSlot("q", (P, 32), I8),
            ArgSlot("w", (P, 4), I16), ArgSlot("o", (P, F), F32, "output"), ArgSlot("o8", (P, 32), I8, "output"),
            ArgSlot("o16", (P, 4), I16, "output"), ArgSlot("ob", (P, F), BF16, "output"),
            ArgSlot("oc", (P, 8), F32, "output"), ArgSlot("ot", (F, P), F32, "output")]
    return Program(body, args, "copies")


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(P, F, generator=g)
    x.view(-1)[::5] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-40]).repeat(16)[:77]
    x.view(-1)[3] = torch.tensor(0x7FA00001, dtype=torch.int32).view(F32)   # a signalling NaN's payload
    return {"x": x, "y": torch.randn(P, F, generator=g).to(BF16),
            "q": torch.randint(-128, 128, (P, 32), dtype=I8, generator=g),
            "w": torch.randint(-2 ** 15, 2 ** 15, (P, 4), dtype=I16, generator=g)}


def test_batched_copies_are_bit_identical_to_execute():
    prog = _program()
    fast, slow = NeuronCore("trn2", host_order=False), NeuronCore("trn2")  # (the batches below: in program order)
    for seed in (1, 2):   # the second run reuses the prepared batches with new tensors
        for core in (fast, slow):
            core.sbuf.data.copy_(torch.randint(0, 256, core.sbuf.data.shape, dtype=torch.uint8,
                                               generator=torch.Generator().manual_seed(seed)))
        a = _inputs(seed)
        outs = fast.run(prog, a).outputs
        ref = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in prog.args if s.kind == "output"}
        _reference(slow, prog, {**{k: v.clone() for k, v in a.items()}, **ref})
        for name, t in outs.items():
            assert torch.equal(t.view(torch.uint8), ref[name].view(torch.uint8)), name
        assert torch.equal(fast.sbuf.data, slow.sbuf.data) and torch.equal(fast.psum.data, slow.psum.data)
        assert torch.equal(fast.psum.group_closed, slow.psum.group_closed)
    plan = fast._plan(prog)
    # runs of plain copies: the first eight (the reshape reads its source as a view in dst's shape), the two SBUF
    # copies, the six stores with the two transposes and the identity activation after them, the identity eviction
    # with the VectorE transpose and the PSUM copy, the last store; the cast, tensor_tensor, the matmuls and the
    # scaled activation keep their steps
    ins = prog.instructions
    first = [0, 8, 9, 11, 12, 21, 22, 23, 26, 27]
    assert [e[0] for e in plan.batched] == [ins[i] for i in first]
    assert [e[1] is plan.entries[i][1] for e, i in zip(plan.batched, first)] == [
        False, True, False, True, False, True, True, False, True, False]


def test_copies_that_could_differ_are_not_batched():
    x = tile("hbm:x", F32, (P, F))
    body = [isa.dma_copy(dst=tile("hbm:o", F32, (P, F)), src=x),                  # HBM to HBM
            isa.tensor_copy(dst=_sb(0)[:, 1:], src=_sb(0)[:, :F - 1]),           # overlapping in SBUF
            isa.tensor_copy(dst=tile("psum", F32, (P, F)), src=_sb(1)),          # writes PSUM
            isa.dma_copy(dst=_sb(2), src=x)]                                      # plain: batched
    prog = Program(body, [ArgSlot("x", (P, F), F32), ArgSlot("o", (P, F), F32, "output")])
    core = NeuronCore("trn2", host_order=False)  # (the entries below: in program order)
    core.run(prog, {"x": torch.randn(P, F)})
    plan = core._plan(prog)
    assert [e[0] for e in plan.batched] == list(prog.instructions)          # one entry each
    assert type(plan.batched[3][1]).__name__ == "method"                   # only the last is a batch


def test_a_short_binding_raises_instead_of_reaching_past_it():
    prog = Program([isa.dma_copy(dst=_sb(0), src=tile("hbm:x", F32, (P, F)))], [ArgSlot("x", (P, F), F32)])
    core = NeuronCore("trn2")
    before = core.sbuf.data.clone()
    with pytest.raises(RuntimeError, match="reach byte"):
        core.run_bound(prog, [torch.zeros(P * F - 1)])
    assert torch.equal(core.sbuf.data, before)


@pytest.mark.parametrize("sizes, strides, once", [
    ((4, 6), (6, 1), True), ((4, 6), (1, 4), True), ((4, 6), (0, 1), False), ((4, 6), (3, 1), False),
    ((1, 6), (0, 1), True), ((2, 3, 4), (1, 8, 2), True), ((2, 3, 4), (1, 2, 6), True), ((2, 3, 4), (1, 2, 5), False)])
def test_writes_once(sizes, strides, once):
    # against brute force: every index's offset distinct
    import itertools
    offsets = [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*map(range, sizes))]
    assert (len(set(offsets)) == len(offsets)) == once
    assert writes_once(sizes, strides) == once


def test_copies_through_a_byte_buffer_and_reshaped_destinations_match_execute():
    # a compiled program's arena: one uint8 slot its fp32/bf16 patterns reinterpret; and a source whose pattern
    # cannot be read in dst's shape as a view ((P, 2, 3, 4) with strides (4, 8, 1): the 2 and 3 dims do not
    # merge), so dst is viewed in the source's shape instead (the same row-major pairing of elements)
    arena = ArgSlot("arena", (4 * P * F + 2 * P * 2,), torch.uint8)
    x = tile("hbm:x", F32, (P, F))
    arena32, arena16 = AP("hbm:arena", F32, ((F, P), (1, F))), AP("hbm:arena", BF16, ((2, P), (1, 2)), offset=4 * P * F)
    body = [
        isa.dma_copy(dst=_sb(0), src=x),
        isa.dma_copy(dst=arena32, src=_sb(0)),                                    # SBUF into the arena, fp32
        isa.dma_copy(dst=_sb(1), src=arena32),                                    # and back
        isa.dma_copy(dst=_sb(2, F32, (6, 4)), src=AP("hbm:x", F32, ((F, P), (4, 2), (8, 3), (1, 4)))),
        isa.dma_copy(dst=arena16, src=_sb(3, BF16, (2,))),
        isa.dma_copy(dst=_sb(4, F32, (2,)), src=arena16),                         # a cast: its step
        isa.dma_copy(dst=tile("hbm:o", F32, (P, F)), src=_sb(1)),
        isa.dma_copy(dst=tile("hbm:o2", F32, (P, 6, 4)), src=_sb(2, F32, (6, 4))),
        isa.dma_copy(dst=tile("hbm:o3", F32, (P, 2)), src=_sb(4, F32, (2,))),
    ]
    outs_ = [ArgSlot("o", (P, F), F32, "output"), ArgSlot("o2", (P, 6, 4), F32, "output"),
             ArgSlot("o3", (P, 2), F32, "output")]
    prog = Program(body, [ArgSlot("x", (P, F), F32), arena, *outs_])
    fast, slow = NeuronCore("trn2"), NeuronCore("trn2")
    for seed in (1, 2):
        for core in (fast, slow):
            core.sbuf.data.copy_(torch.randint(0, 256, core.sbuf.data.shape, dtype=torch.uint8,
                                               generator=torch.Generator().manual_seed(seed)))
        a = _inputs(seed)["x"]
        buf = torch.randint(0, 256, arena.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        rep = fast.run(prog, {"x": a, "arena": buf.clone()})
        ref = {"x": a.clone(), "arena": buf.clone(), **{o.name: torch.zeros(o.shape) for o in outs_}}
        _reference(slow, prog, ref)
        for o in outs_:
            assert torch.equal(rep.outputs[o.name].view(torch.uint8), ref[o.name].view(torch.uint8)), o.name
        assert torch.equal(rep.bindings["arena"], ref["arena"])
        assert torch.equal(fast.sbuf.data, slow.sbuf.data)
    plan = fast._plan(prog)
    # the first five copies in one batch, then the cast (its step, reading the arena's bytes as bf16), then the
    # last three copies
    assert [e[0] for e in plan.batched] == [prog.instructions[i] for i in (0, 5, 6)]
    assert plan.batched[1][1] is plan.entries[5][1] is not None


# ---- transposed copies (register tiles of 2- and 4-byte elements in _CopyBatch) ------------------------------

def _bits(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes as ``dtype`` (NaNs of many payloads, signed zeros, subnormals among them for floats)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _copy_batch_of(copies):
    from torchneuron import _C
    return _C._CopyBatch([(list(dst.shape), dst.element_size(), dst, src) for dst, src in copies])


TRANSPOSE_DTYPES = [torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.float64]


@pytest.mark.parametrize("dtype", TRANSPOSE_DTYPES, ids=str)
@pytest.mark.parametrize("rows, cols", [(128, 128), (64, 128), (128, 64), (37, 61), (8, 8), (4, 9), (9, 4), (3, 128),
                                        (128, 1), (17, 16)])
def test_transposed_copies_match_torch_bit_for_bit(dtype, rows, cols):
    # dst dense along its rows reading a transposed source, and the mirror (a transposed destination); sources
    # and destinations inside larger buffers with padded row strides, as SBUF and PSUM tiles are
    src_buf, dst_buf = _bits((cols + 3, rows * 2 + 5), dtype, 1), _bits((rows + 2, cols + 7), dtype, 2)
    src = src_buf[1:cols + 1, 3:3 + rows].T                     # [rows, cols], dense along rows
    dst = dst_buf[2:2 + rows, 5:5 + cols]                       # dense along cols
    want = dst_buf.clone()
    want[2:2 + rows, 5:5 + cols] = src
    _copy_batch_of([(dst, src)]).run([])
    assert _same_bits(dst_buf, want)
    back_buf = _bits((cols + 1, rows + 3), dtype, 3)
    back = back_buf[:cols, 2:2 + rows].T                         # a transposed destination
    want = back_buf.clone()
    want[:cols, 2:2 + rows] = dst.T
    _copy_batch_of([(back, dst)]).run([])
    assert _same_bits(back_buf, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_transposed_copies_of_strided_and_batched_views_match_torch(dtype):
    # a step in the source's rows (every other column read), a leading batch dim, and a 3-d source whose two
    # free dims merge into the transposed one
    buf = _bits((40, 300), dtype, 4)
    src = buf[::2, 1:281:2].T                                   # [140, 20] with column stride 2
    out = _bits((140, 20), dtype, 5)
    batched_src = buf[:32, :96].reshape(32, 2, 48).permute(1, 2, 0)   # [2, 48, 32]: dims 1, 2 transposed
    batched_out = _bits((2, 48, 32), dtype, 6)
    want, want_batched = src.clone(), batched_src.clone()
    _copy_batch_of([(out, src), (batched_out, batched_src)]).run([])
    assert _same_bits(out, want)
    assert _same_bits(batched_out, want_batched)


def test_a_copy_of_16_byte_elements_is_refused():
    # complex128 items are not two 8-byte words to the batch: it refuses them instead of splitting them
    src = torch.randn(8, 8, dtype=torch.complex128)
    with pytest.raises(RuntimeError, match="16-byte"):
        _copy_batch_of([(torch.empty(8, 8, dtype=torch.complex128), src.T)])


def test_transposes_of_unflattened_sources_are_batched_and_match_execute():
    # data's free dims (2, 8) cut out of (2, 16) do not flatten into one: the batch pairs the elements with the
    # partition dim moved last instead; fp32 into PSUM (opening its group), bf16 into PSUM, and on VectorE
    cut32 = tile("sbuf", F32, (P, 2, 16))[:, :, 4:12]
    cut16 = tile("sbuf", BF16, (P, 2, 16), offset=512)[:, :, :8]
    body = [isa.dma_copy(dst=tile("sbuf", F32, (P, 2, 16)), src=tile("hbm:x", F32, (P, 2, 16))),
            isa.nc_transpose(dst=tile("psum", F32, (16, P)), data=cut32),
            isa.nc_transpose(dst=tile("psum", BF16, (16, P), offset=2048), data=cut16),
            isa.nc_transpose(dst=_sb(4, F32, (P,), parts=16), data=cut32, engine="vector"),
            isa.nc_matmul(dst=tile("psum", F32, (16, P)), stationary=_sb(5, F32, (16,)), moving=_sb(6, F32, (P,))),
            isa.dma_copy(dst=tile("hbm:o", F32, (16, P)), src=_sb(4, F32, (P,), parts=16))]
    prog = Program(body, [ArgSlot("x", (P, 2, 16), F32), ArgSlot("o", (16, P), F32, "output")])
    fast, slow = NeuronCore("trn2", host_order=False), NeuronCore("trn2")  # (the batches below: in program order)
    for seed in (1, 2):
        for core in (fast, slow):
            core.sbuf.data.copy_(torch.randint(0, 256, core.sbuf.data.shape, dtype=torch.uint8,
                                               generator=torch.Generator().manual_seed(seed)))
        x = _bits((P, 2, 16), F32, seed)
        out = fast.run(prog, {"x": x}).outputs["o"]
        ref = {"x": x.clone(), "o": torch.zeros(16, P)}
        _reference(slow, prog, ref)
        assert _same_bits(out, ref["o"])
        assert torch.equal(fast.sbuf.data, slow.sbuf.data) and torch.equal(fast.psum.data, slow.psum.data)
        assert torch.equal(fast.psum.group_closed, slow.psum.group_closed)
    plan = fast._plan(prog)
    assert [e[0] for e in plan.batched] == [prog.instructions[i] for i in (0, 4, 5)]  # the transposes batched
