"""Fixtures for the runtime tests: small programs built from simulator instructions, and a
fresh device/stream state per test."""
from __future__ import annotations

import pytest
import torch

import torchneuron  # noqa: F401
from torchneuron.sim import ArgSlot, Program, isa, tile

F32 = torch.float32
SHAPE = (128, 512)


def add_program(shape=SHAPE, dtype=F32, name: str = "add") -> Program:
    """out = a + b: DMA both operands HBM->SBUF (two queues), VectorE add, DMA SBUF->HBM."""
    p, f = shape
    row = f * dtype.itemsize
    sa, sb, so = (tile("sbuf", dtype, (p, f), offset=i * row) for i in range(3))
    instrs = [isa.dma_copy(dst=sa, src=tile("hbm:a", dtype, shape), queue=0),
              isa.dma_copy(dst=sb, src=tile("hbm:b", dtype, shape), queue=1),
              isa.tensor_tensor(dst=so, data1=sa, data2=sb, op="add"),
              isa.dma_copy(dst=tile("hbm:out", dtype, shape), src=so)]
    args = [ArgSlot("a", shape, dtype), ArgSlot("b", shape, dtype), ArgSlot("out", shape, dtype, "output")]
    return Program(instrs, args, name)


def operands(device="neuron:0", seed: int = 0, shape=SHAPE, dtype=F32):
    """CPU a, b and their neuron copies plus a zeroed neuron output."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    return a, b, {"a": a.to(device), "b": b.to(device), "out": torch.zeros(shape, dtype=dtype, device=device)}


def clock(stream: torch.Stream) -> int:
    return torch.neuron.stream_clock_ns(stream)


@pytest.fixture(scope="session")
def add():
    return add_program()


@pytest.fixture(autouse=True)
def _default_streams(default_device_and_streams):
    """Each test starts on device 0 with default streams current; restored afterwards."""
    yield
