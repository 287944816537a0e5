"""compiler/dma_order.py: transfers move ahead of ones that wait for compute, never past an instruction they
conflict with (read after write, write after read, write after write); values unchanged."""
from __future__ import annotations

import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.compiler.dma_order import LATEST, conflicts, latest_starts, order_dma, order_transfers
from torchneuron.nki.tracing import DMA_QUEUES
from torchneuron.sim import NeuronCore
from torchneuron.sim.specs import chip_spec

SPEC = chip_spec("trn2")
STEPS = 24   # element-wise passes of each chain: long against one transfer


@nki.jit
def queues_held(a, b):
    """A VectorE chain on ``a`` whose result is stored on every DMA queue, then a load of ``b`` (ready at the start)
    and an independent ScalarE chain: in program order the load waits behind a store on whichever queue it takes."""
    out_a = nl.ndarray((DMA_QUEUES, *a.shape), a.dtype, buffer=nl.shared_hbm)
    out_b = nl.ndarray(b.shape, b.dtype, buffer=nl.shared_hbm)
    x = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=a)
    for _ in range(STEPS):
        nisa.tensor_scalar(dst=x, data=x, op0=nl.multiply, operand0=1.0001)
    for q in range(DMA_QUEUES):
        nisa.dma_copy(dst=out_a[q], src=x)
    y = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=y, src=b)
    for _ in range(STEPS):
        nisa.activation(dst=y, op=nl.exp, data=y, scale=-1.0)
    nisa.dma_copy(dst=out_b, src=y)
    return out_a, out_b


@nki.jit
def hazards(a, b):
    """Transfers whose producers finish early but which must stay behind other instructions: ``b`` is loaded into
    the tile the chain on ``a`` used (write after read: after the chain's result is stored), that store is read
    back through HBM (read after write) and ``out`` is written twice (write after write: the second value stays)."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    scratch = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    back = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    x = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=a)
    for _ in range(STEPS):
        nisa.tensor_scalar(dst=x, data=x, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=scratch, src=x)
    nisa.dma_copy(dst=out, src=x)
    nisa.dma_copy(dst=x, src=b)                     # reuses x: only after both stores read it
    z = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=z, src=scratch)               # the chain's result, through HBM
    nisa.tensor_scalar(dst=x, data=x, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=out, src=x)                   # 2 * b replaces the chain's result in ``out``
    nisa.dma_copy(dst=back, src=z)
    return out, back


def _run(program, a, b):
    bindings = NeuronCore(SPEC).run(program, {"a": a, "b": b}, timed=False).bindings
    return {s.name: bindings[s.name] for s in program.args if s.kind == "output"}


def test_a_ready_load_moves_ahead_of_stores_that_wait_on_every_queue():
    a, b = torch.rand(128, 512), torch.rand(128, 512)
    program = queues_held.trace((), {"a": a, "b": b}, SPEC).program
    ordered = order_dma(program, SPEC)
    assert ordered.schedule(SPEC).device_time_ns < 0.8 * program.schedule(SPEC).device_time_ns
    outs, want = _run(ordered, a, b), _run(program, a, b)
    assert outs.keys() == want.keys() and all(torch.equal(outs[k], want[k]) for k in want)


def test_ordering_keeps_every_conflicting_pair_and_the_values():
    a, b = torch.rand(128, 64), torch.rand(128, 64)
    program = hazards.trace((), {"a": a, "b": b}, SPEC).program
    timeline = program.schedule(SPEC)
    want = _run(program, a, b)
    out = want[[s.name for s in program.args if s.kind == "output"][0]]
    torch.testing.assert_close(out, 2 * b)
    before = conflicts(program)
    moved = [order_transfers(program, timeline, before, eagerness) for eagerness in (1.0, 0.5)]
    assert all(m is not None for m in moved)
    moved = [m for m, _ in moved]
    pairs = {(program.instructions[p], program.instructions[i]) for i, ps in enumerate(before) for p in ps}
    for m in moved:
        position = {id(ins): k for k, ins in enumerate(m.instructions)}
        index = {id(ins): k for k, ins in enumerate(program.instructions)}
        assert [index[id(ins)] for ins in m.instructions] != list(range(len(program.instructions)))
        for p, i in pairs:
            assert position[id(p)] < position[id(i)]
        got = _run(m, a, b)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_ordering_never_makes_a_program_slower():
    a, b = torch.rand(128, 64), torch.rand(128, 64)
    for kernel in (queues_held, hazards):
        program = kernel.trace((), {"a": a, "b": b}, SPEC).program
        assert order_dma(program, SPEC).schedule(SPEC).device_time_ns <= program.schedule(SPEC).device_time_ns


@nki.jit
def slack(a, b):
    """Two loads ready at the start, each over all 128 partitions (every DMA engine): ``a``, first in program order,
    is only copied back out; ``b`` feeds a long ScalarE chain, so every nanosecond it waits behind ``a`` is added to
    the program."""
    out_a = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    out_b = nl.ndarray(b.shape, b.dtype, buffer=nl.shared_hbm)
    x = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=a)
    y = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=y, src=b)
    nisa.dma_copy(dst=out_a, src=x)
    for _ in range(STEPS):
        nisa.activation(dst=y, op=nl.exp, data=y, scale=-1.0)
    nisa.dma_copy(dst=out_b, src=y)
    return out_a, out_b


def test_latest_start_puts_the_transfer_with_least_slack_first():
    a, b = torch.rand(128, 512), torch.rand(128, 64)
    program = slack.trace((), {"a": a, "b": b}, SPEC).program
    timeline = program.schedule(SPEC)
    preds = conflicts(program)
    latest = latest_starts(timeline, preds)
    # the length of the program is reached from every instruction on its longest chain: its latest start is its start
    end = max(range(len(preds)), key=timeline.end_ns.__getitem__)
    assert abs(latest[end] - timeline.start_ns[end]) < 1e-6
    load_a, load_b = 0, 1
    assert latest[load_b] < latest[load_a]
    moved, position = order_transfers(program, timeline, preds, LATEST)
    assert position[load_b] < position[load_a]
    ordered = order_dma(program, SPEC)
    assert ordered.schedule(SPEC).device_time_ns < timeline.device_time_ns
    for got, want in ((_run(moved, a, b), _run(program, a, b)), (_run(ordered, a, b), _run(program, a, b))):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
