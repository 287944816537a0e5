"""The HBM caching allocator: statistics, caching, peaks, OOM, storage resize, pinned memory.

References: the rounding rule (blocks are multiples of 512 bytes), the chip spec table
for capacity, and the statistics taken before an operation.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

import torchneuron  # noqa: F401
from torchneuron.sim.specs import CHIPS

pytestmark = pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")

CHIP = CHIPS[os.environ.get("TORCHNEURON_CHIP", "trn2").strip().lower()]
ROUND = 512


def rounded(nbytes: int) -> int:
    return -(-nbytes // ROUND) * ROUND


def fmt_bytes(b: int) -> str:
    """The allocator's own formatting of byte counts in messages."""
    if b >= 1 << 30:
        return f"{b / (1 << 30):.2f} GiB"
    if b >= 1 << 20:
        return f"{b / (1 << 20):.2f} MiB"
    return f"{b} bytes"


def _u8(n: int, device: str = "neuron") -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=device)


@pytest.fixture(autouse=True)
def _clean_cache():
    # Exact accounting: free earlier garbage now and let no collection run mid-test; start
    # without cached blocks so a request gets a block of exactly its rounded size.
    gc.collect()
    gc.disable()
    torch.neuron.empty_cache()
    yield
    gc.enable()
    torch.neuron.empty_cache()


@pytest.mark.parametrize("nbytes", [1, 511, 512, 513, 1000, 4096, 100_000, (1 << 20) + 1, 3 << 20])
def test_allocated_grows_by_rounded_size_and_returns(nbytes):
    base = torch.neuron.memory_allocated()
    base_requested = torch.neuron.memory_stats()["requested_bytes.all.current"]
    t = _u8(nbytes)
    assert torch.neuron.memory_allocated() - base == rounded(nbytes)
    assert torch.neuron.memory_stats()["requested_bytes.all.current"] - base_requested == nbytes
    assert torch.neuron.memory_reserved() >= torch.neuron.memory_allocated()
    del t
    assert torch.neuron.memory_allocated() == base
    assert torch.neuron.memory_stats()["requested_bytes.all.current"] == base_requested


def test_dtype_and_shape_size():
    base = torch.neuron.memory_allocated()
    t = torch.empty(3, 7, 11, dtype=torch.float64, device="neuron")
    assert torch.neuron.memory_allocated() - base == rounded(3 * 7 * 11 * 8)
    del t
    assert torch.neuron.memory_allocated() == base


def test_zero_size_tensor_allocates_nothing():
    base = torch.neuron.memory_stats()
    t = torch.empty(0, device="neuron")
    after = torch.neuron.memory_stats()
    assert after["allocated_bytes.all.current"] == base["allocated_bytes.all.current"]
    assert after["allocation.all.allocated"] == base["allocation.all.allocated"]
    assert t.numel() == 0


def test_freed_block_is_cached_and_reused():
    base_alloc = torch.neuron.memory_allocated()
    base_reserved = torch.neuron.memory_reserved()
    t = _u8(10_000)
    ptr = t.data_ptr()
    del t
    assert torch.neuron.memory_allocated() == base_alloc
    assert torch.neuron.memory_reserved() - base_reserved == rounded(10_000)  # kept in the cache
    segments = torch.neuron.memory_stats()["segment.all.current"]
    u = _u8(10_000)
    assert u.data_ptr() == ptr  # the cached block served the request
    assert torch.neuron.memory_stats()["segment.all.current"] == segments
    assert torch.neuron.memory_reserved() - base_reserved == rounded(10_000)
    del u


def test_empty_cache_makes_reserved_equal_allocated():
    keep = _u8(5000)
    for n in (700, 9000, 2 << 20):
        _u8(n)  # freed at once: cached
    assert torch.neuron.memory_reserved() > torch.neuron.memory_allocated()
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated()
    stats = torch.neuron.memory_stats()
    assert stats["reserved_bytes.all.current"] == stats["allocated_bytes.all.current"]
    assert keep.numel() == 5000


def test_peak_and_reset_peak_memory_stats():
    torch.neuron.reset_peak_memory_stats()
    base = torch.neuron.memory_allocated()
    assert torch.neuron.max_memory_allocated() == base
    assert torch.neuron.max_memory_reserved() == torch.neuron.memory_reserved()
    a = _u8(3000)
    b = _u8(70_000)
    peak = base + rounded(3000) + rounded(70_000)
    del a, b
    c = _u8(1000)
    assert torch.neuron.memory_allocated() == base + rounded(1000)
    assert torch.neuron.max_memory_allocated() == peak
    assert torch.neuron.memory_stats()["allocated_bytes.all.peak"] == peak
    assert torch.neuron.max_memory_reserved() >= peak
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == base + rounded(1000)
    del c


def test_reset_accumulated_memory_stats():
    _u8(1000)
    assert torch.neuron.memory_stats()["allocation.all.allocated"] > 0
    torch.neuron.reset_accumulated_memory_stats()
    stats = torch.neuron.memory_stats()
    assert stats["allocation.all.allocated"] == 0 and stats["allocation.all.freed"] == 0
    t = _u8(1000)
    del t
    stats = torch.neuron.memory_stats()
    assert stats["allocation.all.allocated"] == 1 and stats["allocation.all.freed"] == 1
    assert stats["allocated_bytes.all.allocated"] == rounded(1000)


def test_mem_get_info():
    keep = _u8(123_456)
    _u8(50_000)  # cached
    free, total = torch.neuron.mem_get_info()
    assert total == CHIP.hbm_bytes_per_chip // CHIP.cores_per_chip
    assert free + torch.neuron.memory_reserved() == total
    assert torch.neuron.mem_get_info(0) == torch.neuron.mem_get_info("neuron:0") == (free, total)
    del keep


def test_memory_stats_keys_agree_with_functions():
    before = torch.neuron.memory_stats()
    t = _u8(777)
    stats = torch.neuron.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "allocated_bytes.all.allocated",
                "allocated_bytes.all.freed", "reserved_bytes.all.current", "active_bytes.all.current",
                "requested_bytes.all.current", "allocation.all.current", "segment.all.current",
                "allocated_bytes.small_pool.current", "allocated_bytes.large_pool.current",
                "num_ooms", "num_alloc_retries"):
        assert key in stats, key
    assert stats["allocated_bytes.all.current"] == torch.neuron.memory_allocated()
    assert stats["reserved_bytes.all.current"] == torch.neuron.memory_reserved()
    assert stats["allocated_bytes.all.peak"] == torch.neuron.max_memory_allocated()
    assert stats["allocated_bytes.all.current"] == (
        stats["allocated_bytes.small_pool.current"] + stats["allocated_bytes.large_pool.current"])
    for kind in ("allocated_bytes", "active_bytes"):
        assert stats[f"{kind}.all.allocated"] - before[f"{kind}.all.allocated"] == rounded(777)
        assert stats[f"{kind}.all.current"] - before[f"{kind}.all.current"] == rounded(777)
    assert stats["requested_bytes.all.current"] - before["requested_bytes.all.current"] == 777
    assert stats["allocation.all.allocated"] - before["allocation.all.allocated"] == 1
    del t
    after = torch.neuron.memory_stats()
    assert after["allocated_bytes.all.freed"] - stats["allocated_bytes.all.freed"] == rounded(777)
    assert after["allocation.all.freed"] - stats["allocation.all.freed"] == 1


def test_small_and_large_pools():
    small = torch.neuron.memory_stats()["allocated_bytes.small_pool.current"]
    large = torch.neuron.memory_stats()["allocated_bytes.large_pool.current"]
    a = _u8(1 << 20)        # 1 MiB: small pool
    b = _u8((1 << 20) + 1)  # just above: large pool
    stats = torch.neuron.memory_stats()
    assert stats["allocated_bytes.small_pool.current"] - small == 1 << 20
    assert stats["allocated_bytes.large_pool.current"] - large == rounded((1 << 20) + 1)
    del a, b


def test_memory_summary():
    t = _u8(4096)
    s = torch.neuron.memory_summary()
    assert isinstance(s, str)
    assert "neuron:0" in s
    assert "Allocated memory" in s and "Reserved memory" in s
    assert fmt_bytes(CHIP.hbm_bytes_per_core) in s
    last = torch.neuron.device_count() - 1
    assert f"neuron:{last}" in torch.neuron.memory_summary(last)
    del t


def test_per_device_accounting():
    last = torch.neuron.device_count() - 1
    if last == 0:
        pytest.skip("needs two neuron devices")
    before0, before1 = torch.neuron.memory_allocated(0), torch.neuron.memory_allocated(last)
    t = torch.empty(300, device=f"neuron:{last}")  # 1200 bytes
    assert torch.neuron.memory_allocated(last) - before1 == rounded(1200)
    assert torch.neuron.memory_allocated(0) == before0
    del t
    assert torch.neuron.memory_allocated(last) == before1


# ---- out of memory -------------------------------------------------------------------------

_VOLATILE = {"num_ooms", "num_alloc_retries"}


def _stable(stats):
    return {k: v for k, v in stats.items() if k not in _VOLATILE}


def test_oom_message_and_state_unchanged():
    keep = _u8(3 << 20)
    before = torch.neuron.memory_stats()
    capacity = torch.neuron.mem_get_info()[1]
    assert capacity == CHIP.hbm_bytes_per_core
    request = 2 * capacity
    with pytest.raises(torch.OutOfMemoryError) as info:
        _u8(request)
    msg = str(info.value)
    assert "neuron:0" in msg
    assert fmt_bytes(request) in msg                                   # requested
    assert fmt_bytes(capacity) in msg                                  # capacity
    assert fmt_bytes(before["allocated_bytes.all.current"]) in msg     # allocated
    assert fmt_bytes(before["reserved_bytes.all.current"]) in msg      # reserved
    assert "allocated" in msg and "reserved" in msg
    after = torch.neuron.memory_stats()
    assert _stable(after) == _stable(before)
    assert after["num_ooms"] == before["num_ooms"] + 1
    # New allocations work and are accounted as usual.
    t = _u8(2000)
    assert torch.neuron.memory_allocated() == before["allocated_bytes.all.current"] + rounded(2000)
    assert torch.equal(t.fill_(7).cpu(), torch.full((2000,), 7, dtype=torch.uint8))
    del keep, t


def test_oom_is_also_a_runtime_error_and_on_other_device():
    last = torch.neuron.device_count() - 1
    with pytest.raises(RuntimeError):  # torch.OutOfMemoryError subclasses RuntimeError
        _u8(2 * CHIP.hbm_bytes_per_core)
    before = torch.neuron.memory_stats(last)
    with pytest.raises(torch.OutOfMemoryError, match=f"neuron:{last}"):
        _u8(CHIP.hbm_bytes_per_core + 1, device=f"neuron:{last}")
    assert _stable(torch.neuron.memory_stats(last)) == _stable(before)


def test_oom_with_cached_blocks_leaves_stats_unchanged():
    _u8(20_000)  # freed at once: a cached block
    before = torch.neuron.memory_stats()
    assert before["reserved_bytes.all.current"] > before["allocated_bytes.all.current"]
    with pytest.raises(torch.OutOfMemoryError):
        _u8(2 * CHIP.hbm_bytes_per_core)
    assert _stable(torch.neuron.memory_stats()) == _stable(before)


def test_request_that_fits_after_freeing_cache_succeeds():
    # Cached blocks + the new request exceed the capacity, the request alone does not: the
    # allocator must release its cache and succeed (counted as a retry), not raise.
    # (Host memory is only reserved, never touched: about half the core's HBM at a time.)
    free = torch.neuron.mem_get_info()[0]
    cached_size = free // 2 // ROUND * ROUND
    request = free - cached_size + ROUND  # larger than the cached block, so it cannot reuse it
    assert request > cached_size and cached_size + request > free and request <= free
    _u8(cached_size)  # freed at once: cached
    assert torch.neuron.mem_get_info()[0] == free - cached_size
    base = torch.neuron.memory_allocated()
    retries = torch.neuron.memory_stats()["num_alloc_retries"]
    big = _u8(request)
    assert big.numel() == request
    assert torch.neuron.memory_allocated() - base == rounded(request)
    assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated()  # cache was released
    assert torch.neuron.memory_stats()["num_alloc_retries"] == retries + 1
    del big


# ---- storage resize ---------------------------------------------------------------------

def test_storage_resize_to_zero_and_back():
    base = torch.neuron.memory_allocated()
    t = torch.arange(256, dtype=torch.float32, device="neuron")  # 1024 bytes
    storage = t.untyped_storage()
    assert torch.neuron.memory_allocated() - base == 1024
    storage.resize_(0)
    assert storage.nbytes() == 0
    assert torch.neuron.memory_allocated() == base
    storage.resize_(1024)
    assert storage.nbytes() == 1024
    assert storage.device == torch.device("neuron", 0)
    assert torch.neuron.memory_allocated() - base == 1024
    t.copy_(torch.arange(256, dtype=torch.float32))
    assert torch.equal(t.cpu(), torch.arange(256, dtype=torch.float32))
    del t, storage
    assert torch.neuron.memory_allocated() == base


def _storage_floats(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage.cpu()).view(torch.float32)


def test_storage_resize_preserves_data():
    base = torch.neuron.memory_allocated()
    t = torch.arange(10, dtype=torch.float32, device="neuron")  # 40 bytes
    storage = t.untyped_storage()
    storage.resize_(4000)  # grow: the old 40 bytes are kept
    assert torch.neuron.memory_allocated() - base == rounded(4000)
    assert torch.equal(_storage_floats(storage)[:10], torch.arange(10, dtype=torch.float32))
    storage.resize_(16)  # shrink: the first 16 bytes are kept
    assert torch.neuron.memory_allocated() - base == rounded(16)
    assert torch.equal(_storage_floats(storage), torch.arange(4, dtype=torch.float32))
    del t, storage
    assert torch.neuron.memory_allocated() == base


def test_storage_resize_on_other_device():
    last = torch.neuron.device_count() - 1
    if last == 0:
        pytest.skip("needs two neuron devices")
    t = torch.ones(8, device=f"neuron:{last}")
    before0, before1 = torch.neuron.memory_allocated(0), torch.neuron.memory_allocated(last)
    storage = t.untyped_storage()
    storage.resize_(8000)
    assert storage.device == torch.device("neuron", last)
    assert torch.neuron.memory_allocated(last) - before1 == rounded(8000) - rounded(32)
    assert torch.neuron.memory_allocated(0) == before0
    assert torch.neuron.current_device() == 0
    assert torch.equal(_storage_floats(storage)[:8], torch.ones(8))


def test_storage_resize_oom_changes_nothing():
    t = torch.arange(4, dtype=torch.float32, device="neuron")
    storage = t.untyped_storage()
    before = torch.neuron.memory_stats()
    with pytest.raises(torch.OutOfMemoryError, match="neuron:0"):
        storage.resize_(2 * CHIP.hbm_bytes_per_core)
    assert storage.nbytes() == 16
    assert torch.equal(t.cpu(), torch.arange(4, dtype=torch.float32))
    assert _stable(torch.neuron.memory_stats()) == _stable(before)


# ---- pinned host memory -----------------------------------------------------------------------

def test_pinned_memory():
    plain = torch.arange(4.0)
    assert plain.is_pinned() is False
    pinned = plain.pin_memory()
    assert pinned.is_pinned() is True
    assert pinned.device.type == "cpu"
    assert torch.equal(pinned, plain)
    assert pinned[1:].is_pinned() is True  # a view into pinned memory
    assert torch.ones(4).pin_memory().is_pinned()
    assert torch.empty(3, pin_memory=True).is_pinned()
    moved = pinned.to("neuron", non_blocking=True)
    assert torch.equal(moved.cpu(), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_empty_is_filled_under_deterministic_algorithms_like_cpu(dtype):
    # torch.use_deterministic_algorithms(True) fills new memory as the CPU does (NaN for floats, the
    # largest value for integers), for empty and empty_strided, over memory a freed tensor left behind
    stale = torch.full((6, 5), 3, dtype=dtype, device="neuron")
    del stale
    torch.use_deterministic_algorithms(True)
    try:
        for make in (lambda device: torch.empty(6, 5, dtype=dtype, device=device),
                     lambda device: torch.empty_strided((6, 5), (1, 6), dtype=dtype, device=device)):
            ref = make("cpu")
            got = make("neuron").cpu()
            assert got.dtype == ref.dtype and got.shape == ref.shape
            torch.testing.assert_close(got, ref, equal_nan=True, rtol=0, atol=0)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.empty(6, 5, dtype=dtype, device="neuron")   # outside the mode: no fill, no error
