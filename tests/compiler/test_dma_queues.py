"""compiler/dma_queues.py: queue allocation moves a transfer off a queue held by a waiting one; values unchanged."""
from __future__ import annotations

import dataclasses

import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.compiler.dma_queues import allocate_dma_queues
from torchneuron.nki.tracing import DMA_QUEUES
from torchneuron.sim import Engine
from torchneuron.sim.specs import chip_spec

SPEC = chip_spec("trn2")
STEPS = 24   # element-wise passes of each chain: long against one transfer


@nki.jit
def two_chains(a, b):
    """A VectorE chain on ``a`` stored on queue 1, then enough transfers to wrap round-robin to queue 1 again: the
    last loads ``b``, whose ScalarE chain is independent of the first."""
    out_a = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    out_b = nl.ndarray(b.shape, b.dtype, buffer=nl.shared_hbm)
    x = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=a)                                      # queue 0
    for _ in range(STEPS):
        nisa.tensor_scalar(dst=x, data=x, op0=nl.multiply, operand0=1.0001)
    nisa.dma_copy(dst=out_a, src=x)                                  # queue 1: waits for the chain
    spare = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    for _ in range(DMA_QUEUES - 1):                                  # queues 2 .. 15, 0
        nisa.dma_copy(dst=spare, src=a)
    y = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=y, src=b)                                      # queue 1 again, behind the store
    for _ in range(STEPS):
        nisa.activation(dst=y, op=nl.exp, data=y, scale=-1.0)
    nisa.dma_copy(dst=out_b, src=y)
    return out_a, out_b


def test_a_ready_transfer_leaves_the_queue_a_waiting_one_holds():
    a, b = torch.rand(128, 512), torch.rand(128, 512)
    program = two_chains.trace((), {"a": a, "b": b}, SPEC).program
    allocated = allocate_dma_queues(program, SPEC)
    before, after = program.schedule(SPEC).device_time_ns, allocated.schedule(SPEC).device_time_ns
    assert after < 0.8 * before                                      # the chains overlap instead of following
    moved = 0
    for i, j in zip(program.instructions, allocated.instructions):   # the same instructions, only queues differ
        if i.engine is Engine.DMA:
            moved += i.queue != j.queue
            j = dataclasses.replace(j, queue=i.queue)
        assert j == i
    assert moved


def test_allocation_never_makes_a_program_slower():
    a, b = torch.rand(128, 64), torch.rand(128, 64)
    program = two_chains.trace((), {"a": a, "b": b}, SPEC).program
    for p in (program, allocate_dma_queues(program, SPEC)):
        assert allocate_dma_queues(p, SPEC).schedule(SPEC).device_time_ns <= p.schedule(SPEC).device_time_ns
