"""Memories and access patterns: allocation, bounds, dtype views, strided tiles, HBM binding."""
from __future__ import annotations

import gc
import mmap
import pickle

import pytest
import torch

from torchneuron.sim import AP, ArgSlot, Footprint, Memory, NeuronCore, Program, SimulatorError, tile
from torchneuron.sim import memory
from torchneuron.sim.specs import chip_spec

from .conftest import FLOATS, INTS, rand


def test_core_memories_come_from_the_spec():
    for chip in ("trn1", "trn2", "trn3"):
        spec = chip_spec(chip)
        core = NeuronCore(chip)
        assert tuple(core.sbuf.data.shape) == (spec.sbuf_partitions, spec.sbuf_bytes_per_partition)
        assert tuple(core.psum.data.shape) == (128, 16 * 1024)
        assert core.psum.bank_bytes == 2048
        assert core.sbuf.data.dtype == torch.uint8


@pytest.mark.parametrize("nan_fill", [False, True])
def test_on_chip_memories_are_filled_padded_rows_in_huge_page_aligned_bytes(nan_fill):
    # SBUF/PSUM rows ROW_PAD bytes apart, every byte 0 (NaN fill: 0xFF), writable through to the memory's views; the
    # host bytes start on a huge page (Linux), and stay valid once nothing but the tensor refers to their mapping
    core = NeuronCore("trn2", nan_fill=nan_fill)
    for mem in (core.sbuf, core.psum):
        data = mem.data
        assert data.stride() == (mem.bytes_per_partition + memory.ROW_PAD, 1)
        assert int(data.min()) == int(data.max()) == (memory.NAN_BYTE if nan_fill else 0)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            assert data.data_ptr() % memory.HUGE_PAGE == 0
        data[-1, -1] = 7
        assert int(mem.typed(torch.uint8)[-1, -1]) == 7
    block = memory.host_bytes(3 * memory.HUGE_PAGE + 5)
    gc.collect()
    block.fill_(3)
    assert block.numel() == 3 * memory.HUGE_PAGE + 5 and int(block.sum()) == 3 * block.numel()


def test_allocate_next_fit_free_and_reuse():
    m = Memory("sbuf", 128, 4096)
    a = m.allocate(128, 1000)
    b = m.allocate(128, 100)
    assert (a.offset, b.offset) == (0, 1000)  # 4-byte aligned after a
    c = m.allocate(64, 502, start_partition=64)
    assert c.offset == 1100
    m.free(b)
    d = m.allocate(128, 96)  # next fit: after c (its end 1602 aligned to 1604), not in b's hole
    assert d.offset == 1604
    with pytest.raises(SimulatorError, match="overflow"):
        m.allocate(128, 2400)  # no hole holds it, before or after the cursor
    m.free_all()
    assert m.regions == ()
    with pytest.raises(SimulatorError, match="not allocated"):
        m.free(a)


def test_next_fit_reuses_a_freed_box_last():
    m = Memory("sbuf", 2, 4096)
    x, y = m.allocate(2, 1024), m.allocate(2, 1024)
    m.free(x)
    assert m.allocate(2, 1024).offset == 2048   # first fit would hand out x's box at once
    assert m.allocate(2, 1024).offset == 3072
    assert m.allocate(2, 1024).offset == 0      # past the capacity: wraps around to x's box
    with pytest.raises(SimulatorError, match="overflow"):
        m.allocate(2, 4)
    assert y.offset == 1024


def test_allocations_side_by_side_in_partitions():
    m = Memory("sbuf", 128, 1024)
    top = m.allocate(64, 1024)
    bottom = m.allocate(64, 1024, start_partition=64)
    assert (top.offset, bottom.offset) == (0, 0)


def test_overflow_names_memory_request_and_capacity():
    m = Memory("sbuf", 128, 4096)
    m.allocate(128, 4000)
    with pytest.raises(SimulatorError) as e:
        m.allocate(128, 200)
    msg = str(e.value)
    assert "sbuf overflow" in msg and "128 partitions x 200 bytes" in msg and "4096 bytes" in msg
    with pytest.raises(SimulatorError, match="129 partitions"):
        m.allocate(129, 4)
    core = NeuronCore("trn2")
    with pytest.raises(SimulatorError, match=r"psum overflow.*16384 bytes"):
        core.psum.allocate(128, 17 * 1024)


def test_psum_allocations_stay_inside_one_bank():
    m = Memory("psum", 128, 16 * 1024, bank_bytes=2048)
    a = m.allocate(128, 1536)
    b = m.allocate(128, 1024)  # would straddle banks 0/1 at 1536: moves to 2048
    assert (a.offset, b.offset) == (0, 2048)
    c = m.allocate(128, 4096)  # larger than a bank: starts at a bank boundary
    assert c.offset % 2048 == 0 and c.offset >= 3072


def test_dense_tile_geometry():
    t = tile("sbuf", "bfloat16", (128, 4, 256), start_partition=0, offset=64)
    assert t.shape == (128, 4, 256) and t.pattern == ((256, 4), (1, 256))
    assert t.free_elems == 1024 and t.numel == 128 * 1024 and t.nbytes == 128 * 2048
    assert t.byte_range == (64, 64 + 2048)
    assert t.footprint() == Footprint("sbuf", (0, 128), (64, 2112))
    assert t.kind == "sbuf" and t.on_chip and t.contiguous_run == 1024 and t.inner_contiguous
    h = tile("hbm:x", torch.float32, (8, 16))
    assert h.shape == (8, 16) and not h.on_chip and h.kind == "hbm"
    assert h.footprint() == Footprint("hbm:x", (0, 1), (0, 512))


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool, torch.uint16, torch.uint32])
def test_write_read_round_trip_every_dtype(core, dtype):
    x = rand((16, 3, 5), dtype, seed=1)
    t = core.sbuf.allocate(16, 64).tile(dtype, (3, 5))
    t.write(core, x)
    got = t.read(core)
    assert got.dtype == dtype and got.shape == (16, 3, 5)
    as_bits = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)  # fp8 has no torch.equal
    assert torch.equal(as_bits(got), as_bits(x))


def test_write_casts_like_pytorch(core):
    t = core.sbuf.allocate(4, 64).tile(torch.bfloat16, (8,))
    x = torch.randn(4, 8)
    t.write(core, x)
    assert torch.equal(t.read(core), x.to(torch.bfloat16))
    t.write(core, 2.5)
    assert torch.equal(t.read(core), torch.full((4, 8), 2.5, dtype=torch.bfloat16))


def test_dtype_views_share_bytes(core):
    t = core.sbuf.allocate(2, 16).tile(torch.float32, (4,))
    t.write(core, torch.ones(2, 4))
    as_int = AP("sbuf", torch.int32, ((1, 4),), 0, 2, t.offset)
    assert torch.equal(as_int.read(core), torch.full((2, 4), 0x3F800000, dtype=torch.int32))
    as_bf16 = t.bitcast(torch.bfloat16)
    assert as_bf16.shape == (2, 8)
    assert torch.equal(as_bf16.read(core)[:, 1::2], torch.ones(2, 4, dtype=torch.bfloat16))
    assert core.sbuf.typed(torch.float32).shape == (128, core.spec.sbuf_bytes_per_partition // 4)


def test_strided_four_free_dims(core):
    x = torch.arange(8 * 2 * 3 * 4 * 5, dtype=torch.float32).reshape(8, 2, 3, 4, 5)
    t = core.sbuf.allocate(8, x[0].numel() * 4).tile(torch.float32, (2, 3, 4, 5))
    t.write(core, x)
    v = t[:, 1, ::2, 1:4, ::3]
    assert v.shape == (8, 2, 3, 2)
    assert torch.equal(v.read(core), x[:, 1, ::2, 1:4, ::3])
    tr = AP("sbuf", torch.float32, ((1, 5), (5, 4), (20, 3), (60, 2)), 0, 8, t.offset)  # all dims reversed
    assert torch.equal(tr.read(core), x.permute(0, 4, 3, 2, 1))
    assert not tr.inner_contiguous and tr.contiguous_run == 1
    with pytest.raises(SimulatorError, match="5 pattern dims; the limit is 4"):
        AP("sbuf", torch.float32, ((1, 1),) * 5, 0, 8)


def test_indexing_partitions_and_ints(core):
    x = torch.arange(16 * 6, dtype=torch.float32).reshape(16, 6)
    t = core.sbuf.allocate(16, 24).tile(torch.float32, (6,))
    t.write(core, x)
    assert t[3].shape == (1, 6) and torch.equal(t[3].read(core), x[3:4])
    assert t[2:5, 4].shape == (3,) and torch.equal(t[2:5, 4].read(core), x[2:5, 4])
    assert torch.equal(t[..., -1].read(core), x[:, -1])
    with pytest.raises(SimulatorError, match="contiguous"):
        t[::2]
    with pytest.raises(IndexError):
        t[:, 6]


def test_reshape_is_a_view(core):
    x = torch.arange(4 * 24, dtype=torch.float32).reshape(4, 24)
    t = core.sbuf.allocate(4, 96).tile(torch.float32, (24,))
    t.write(core, x)
    r = t.reshape((4, 2, 3, 4))
    assert torch.equal(r.read(core), x.reshape(4, 2, 3, 4))
    assert torch.equal(r[:, 1].reshape((4, 12)).read(core), x.reshape(4, 2, 3, 4)[:, 1].reshape(4, 12))
    with pytest.raises(SimulatorError, match="not expressible"):
        r[:, :, 1].reshape((4, 8))
    with pytest.raises(SimulatorError, match="cannot reshape"):
        t.reshape((2, 48))


def test_hbm_binding_is_zero_copy(core):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    core.bind("x", x)
    a = tile("hbm:x", torch.float32, (3, 4))
    assert torch.equal(a.read(core), x)
    a[1].write(core, torch.full((4,), -1.0))
    assert torch.equal(x[1], torch.full((4,), -1.0))
    as_bytes = tile("hbm:x", torch.uint8, (48,))
    assert as_bytes.read(core).numel() == 48
    core.unbind("x")
    with pytest.raises(SimulatorError, match="no memory 'hbm:x'"):
        a.read(core)
    with pytest.raises(SimulatorError, match="contiguous"):
        core.bind("y", torch.zeros(4, 4).T)


def test_bounds_are_checked(core):
    past_end = AP("sbuf", torch.float32, ((1, 8),), 0, 1, core.spec.sbuf_bytes_per_partition - 16)
    with pytest.raises(SimulatorError, match=r"reaches partitions \[0, 1\) x bytes"):
        past_end.read(core)
    too_many = AP("psum", torch.float32, ((1, 8),), 100, 29, 0)
    with pytest.raises(SimulatorError, match="psum has 128 partitions"):
        too_many.read(core)
    core.bind("small", torch.zeros(4))
    with pytest.raises(SimulatorError, match=r"reaches bytes \[0, 20\) of hbm:small, which has 16 bytes"):
        tile("hbm:small", torch.float32, (5,)).read(core)


def test_pattern_validation():
    with pytest.raises(SimulatorError, match="not a non-negative multiple"):
        AP("sbuf", torch.float32, ((1, 4),), 0, 1, 2)
    with pytest.raises(SimulatorError, match="strides must be >= 0"):
        AP("sbuf", torch.float32, ((-1, 4),), 0, 1, 0)
    with pytest.raises(SimulatorError, match="no partition range"):
        AP("hbm:x", torch.float32, ((1, 4),), 3, 1, 0)


@pytest.mark.parametrize("partitions", [1, 4])
def test_overlapping_write_goes_through_a_temporary(core, partitions):
    t = core.sbuf.allocate(partitions, 64).tile(torch.float32, (16,))
    x = torch.arange(16.0).repeat(partitions, 1)
    t.write(core, x)
    t[:, 2:].write(core, t[:, :14].view(core))  # shift right by two, overlapping
    assert torch.equal(t.read(core), torch.cat([x[:, :2], x[:, :14]], 1))


def test_write_through_a_self_overlapping_pattern_is_an_error(core):
    t = AP("sbuf", torch.float32, ((0, 4),), 0, 1, 0)
    with pytest.raises(SimulatorError, match="cannot write"):
        t.write(core, torch.arange(4.0).reshape(1, 4))


def test_nan_fill_argument_and_environment(monkeypatch):
    monkeypatch.delenv("TORCHNEURON_SIM_NAN_FILL", raising=False)
    m = Memory("sbuf", 4, 64, nan_fill=True)
    t = m.allocate(4, 32).tile(torch.float32, (8,))
    assert torch.isnan(t.read(m)).all()
    t.write(m, torch.zeros(4, 8))
    m.free(m.regions[0])
    m.allocate(4, 32)
    again = m.allocate(4, 32)  # the memory holds two: next fit wraps around to the box written above
    assert again.offset == 0
    t2 = again.tile(torch.bfloat16, (16,))
    assert torch.isnan(t2.read(m).float()).all()  # re-allocation fills again
    for dt in (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        assert torch.isnan(AP("sbuf", dt, ((1, 4),), 0, 4, 0).read(m).float()).all()
    assert not Memory("sbuf", 4, 64).nan_fill
    monkeypatch.setenv("TORCHNEURON_SIM_NAN_FILL", "1")
    assert Memory("sbuf", 4, 64).nan_fill and NeuronCore("trn2").sbuf.nan_fill
    assert not Memory("sbuf", 4, 64, nan_fill=False).nan_fill


def test_ap_pickles_without_cached_views(core):
    t = core.sbuf.allocate(2, 8).tile(torch.float32, (2,))
    t.read(core)
    u = pickle.loads(pickle.dumps(t))
    assert u == t and hash(u) == hash(t) and "_view" not in u.__dict__


def test_the_core_binds_host_tensors_only(core):
    with pytest.raises(SimulatorError, match="must be a host \\(CPU\\) tensor, not one on meta"):
        core.bind("x", torch.zeros(2, 4, device="meta"))
    with pytest.raises(SimulatorError, match="must be a host"):
        core.run(Program([], [ArgSlot("x", (2, 4), torch.float32, "input")], "p"), {"x": torch.zeros(2, 4, device="meta")})
