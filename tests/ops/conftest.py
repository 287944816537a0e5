"""Shared fixtures of the eager-op tests: every test runs in strict mode unless it asks otherwise."""
import pytest
import torch

import torchneuron


@pytest.fixture
def strict():
    """Strict mode for one test: any CPU fallback raises, so passing means the ops ran on the device."""
    before = torchneuron.is_strict()
    torchneuron.set_strict(True)
    try:
        yield
    finally:
        torchneuron.set_strict(before)


def to_n(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's copy on neuron."""
    return t.to("neuron")


def assert_raises_like_cpu(call) -> None:
    """``call(convert)`` raises the same exception type and message with ``convert`` = identity (CPU
    tensors) and ``to_n`` (neuron tensors)."""
    with pytest.raises(Exception) as cpu:
        call(lambda t: t)
    with pytest.raises(type(cpu.value)) as dev:
        call(to_n)
    assert str(dev.value) == str(cpu.value)
