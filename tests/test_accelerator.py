"""``torch.accelerator.*`` sees neuron as the current accelerator and agrees with ``torch.neuron``."""
from __future__ import annotations

import gc
import os

import pytest
import torch

import torchneuron  # noqa: F401
from torchneuron.sim.specs import CHIPS

pytestmark = pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")

CHIP = CHIPS[os.environ.get("TORCHNEURON_CHIP", "trn2").strip().lower()]
EXPECTED_COUNT = int(os.environ.get("TORCHNEURON_NUM_DEVICES", "").strip() or CHIP.cores_per_chip)
A = torch.accelerator


@pytest.fixture(autouse=True)
def _restore_current_device():
    previous = torch.neuron.current_device()
    torch.neuron.set_device(0)  # each test starts from the default device of a fresh process
    gc.collect()  # exact allocator accounting: no collection of earlier garbage mid-test
    gc.disable()
    yield
    gc.enable()
    torch.neuron.set_device(previous)


def test_current_accelerator_is_neuron():
    assert A.is_available() is True
    assert A.current_accelerator() == torch.device("neuron")
    assert A.current_accelerator().type == "neuron"


def test_device_count():
    assert A.device_count() == torch.neuron.device_count() == EXPECTED_COUNT


def test_set_and_current_device_index():
    last = A.device_count() - 1
    assert A.current_device_index() == torch.neuron.current_device() == 0
    A.set_device_index(last)
    assert A.current_device_index() == last
    assert torch.neuron.current_device() == last
    assert torch.empty(2, device="neuron").device == torch.device("neuron", last)
    A.set_device_index(0)
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device(last)
    assert A.current_device_index() == last


def test_device_index_context_manager():
    last = A.device_count() - 1
    with A.device_index(last):
        assert torch.neuron.current_device() == last
    assert torch.neuron.current_device() == 0


def test_set_device_index_out_of_range():
    n = A.device_count()
    with pytest.raises(RuntimeError, match=f"neuron:{n}"):
        A.set_device_index(n)
    assert A.current_device_index() == 0


def test_current_stream_and_synchronize():
    assert A.current_stream() == torch.neuron.current_stream()
    assert A.current_stream().device == torch.device("neuron", 0)
    s = torch.neuron.Stream()
    A.set_stream(s)
    try:
        assert torch.neuron.current_stream() == s
    finally:
        A.set_stream(torch.neuron.default_stream())
    x = torch.arange(4.0, device="neuron") + 1
    A.synchronize()
    A.synchronize(0)
    A.synchronize(torch.device("neuron", A.device_count() - 1))
    assert torch.equal(x.cpu(), torch.arange(4.0) + 1)


def test_memory_functions_agree_with_torch_neuron():
    last = A.device_count() - 1
    keep0 = torch.empty(1000, device="neuron")
    keep_last = torch.empty(3000, device=f"neuron:{last}")
    torch.empty(5000, device="neuron")  # freed at once: cached
    for dev in (0, last):
        assert A.memory_allocated(dev) == torch.neuron.memory_allocated(dev)
        assert A.memory_reserved(dev) == torch.neuron.memory_reserved(dev)
        assert A.max_memory_allocated(dev) == torch.neuron.max_memory_allocated(dev)
        assert A.max_memory_reserved(dev) == torch.neuron.max_memory_reserved(dev)
        assert A.memory_stats(dev) == torch.neuron.memory_stats(dev)
        assert A.get_memory_info(dev) == torch.neuron.mem_get_info(dev)
        assert A.get_memory_info(dev)[1] == CHIP.hbm_bytes_per_core
    assert A.memory_allocated() == torch.neuron.memory_allocated()
    before = A.memory_allocated(last)
    t = torch.empty(250, device=f"neuron:{last}")  # 1000 bytes -> 1024
    assert A.memory_allocated(last) - before == 1024
    del t
    assert A.memory_allocated(last) == before
    del keep0, keep_last


def test_empty_cache_agrees():
    torch.empty(20_000, device="neuron")  # freed at once: cached
    assert A.memory_reserved() > A.memory_allocated()
    A.empty_cache()
    assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated() == A.memory_allocated()
    free, total = A.get_memory_info()
    assert free + torch.neuron.memory_reserved() == total


def test_reset_peak_agrees():
    torch.empty(100_000, device="neuron")
    assert A.max_memory_allocated() >= 400_000
    A.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()
