"""Fixtures for the simulator tests: a fresh core and helpers that place tensors in its memories."""
from __future__ import annotations

import math

import pytest
import torch

from torchneuron.sim import AP, NeuronCore, Program, tile

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
INTS = [torch.int8, torch.int16, torch.int32, torch.uint8]


@pytest.fixture
def core() -> NeuronCore:
    return NeuronCore("trn2", nan_fill=False, seed=0)


def put(core: NeuronCore, x: torch.Tensor, memory: str = "sbuf", dtype: torch.dtype | None = None) -> AP:
    """Allocate an on-chip tile shaped like ``x`` (dim 0 = partitions) and store ``x`` in it."""
    dtype = dtype or x.dtype
    free = tuple(x.shape[1:])
    region = core.memory(memory).allocate(x.shape[0], max(math.prod(free) * dtype.itemsize, 1))
    ap = region.tile(dtype, free)
    ap.write(core, x)
    return ap


def empty(core: NeuronCore, shape, dtype: torch.dtype, memory: str = "sbuf") -> AP:
    """Allocate an on-chip tile without writing it."""
    region = core.memory(memory).allocate(shape[0], max(math.prod(shape[1:]) * dtype.itemsize, 1))
    return region.tile(dtype, tuple(shape[1:]))


def hbm(core: NeuronCore, name: str, x: torch.Tensor) -> AP:
    """Bind ``x`` as HBM buffer ``name`` and return a dense pattern over all of it."""
    core.bind(name, x)
    return tile(f"hbm:{name}", x.dtype, x.shape)


def rand(shape, dtype: torch.dtype, seed: int = 0, low: float = -3.0, high: float = 3.0) -> torch.Tensor:
    """Random values representable in ``dtype`` (ints in their range, bool as 0/1)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -1000), min(info.max, 1000)
        return torch.randint(lo, hi + 1, shape, generator=g).to(dtype)
    return (torch.rand(shape, generator=g) * (high - low) + low).to(dtype)


@pytest.fixture
def compiled_step_runs(monkeypatch) -> list[tuple[Program, list]]:
    """Every program of a small compiled model's forward, backward and AdamW step (two steps), once each, with clones
    of the tensors its first launch was given."""
    runs = []
    run_bound = NeuronCore.run_bound

    def recording(core, program, tensors, fresh=True):
        runs.append((program, [None if t is None else t.clone() for t in tensors]))
        return run_bound(core, program, tensors, fresh)

    monkeypatch.setattr(NeuronCore, "run_bound", recording)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 64)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward, step = torch.compile(model, backend="neuron"), torch.compile(opt.step, backend="neuron")
    x, y = torch.randn(256, 64).to("neuron"), torch.randn(256, 64).to("neuron")
    for _ in range(2):
        loss = torch.nn.functional.mse_loss(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        step()
    monkeypatch.setattr(NeuronCore, "run_bound", run_bound)
    return list({id(p): (p, t) for p, t in runs if isinstance(p, Program)}.values())
