"""The timing rules added when the model was calibrated against published Trainium figures
(docs/hardware-model.md, "Calibration"), each checked against the formula it states."""
from __future__ import annotations

import dataclasses

import pytest

from torchneuron.sim.specs import CHIPS
from torchneuron.sim.timing import dma_cost, instruction_cost_ns, schedule
from tests.sim.test_timing import Fake, act, dma, hbm, mm, ps, sb, vec

TRN1, TRN2 = CHIPS["trn1"], CHIPS["trn2"]


def in_program_order(spec):
    return dataclasses.replace(spec, runtime=dataclasses.replace(spec.runtime, compiler_reorders=False))


def waiting_then_independent():
    """A matmul, a VectorE copy of its result (waits for it), then an independent VectorE op."""
    return [
        Fake(mm(), rd=(sb(0, 1024),), wr=(ps(0, 2048),)),
        Fake(vec("tensor_copy", 512, dts=("float32",), mems=("psum",)), rd=(ps(0, 2048),), wr=(sb(8192, 10240),)),
        Fake(vec("tensor_scalar", 512, dts=("float32",), mems=("sbuf",)), rd=(sb(20000, 22048),),
             wr=(sb(30000, 32048),)),
    ]


def test_an_engine_issues_an_independent_later_instruction_while_an_earlier_one_waits():
    # ISA (nl.no_reorder): the compiler may reorder independent operations; assumption 15: the
    # engine issues the ready instruction earliest in program order.
    prog = waiting_then_independent()
    spec = TRN2
    mm_ns, copy_ns, ts_ns = (instruction_cost_ns(p.ci, spec) for p in prog)
    dep = spec.vector.dependent_overhead_cycles / spec.vector.clock_hz * 1e9
    tl = schedule(prog, spec)
    assert tl.start_ns[2] == 0.0                                     # did not wait behind the copy
    assert tl.start_ns[1] == pytest.approx(max(mm_ns + dep, ts_ns))
    assert tl.device_time_ns == pytest.approx(max(mm_ns + dep, ts_ns) + copy_ns)
    # in program order the independent op waits for the copy
    tl0 = schedule(prog, in_program_order(spec))
    assert tl0.start_ns[2] == pytest.approx(mm_ns + dep + copy_ns)
    assert tl0.device_time_ns == pytest.approx(mm_ns + dep + copy_ns + ts_ns)


def test_ready_instructions_issue_in_program_order():
    # Three independent ops, all ready at 0: program order, back to back.
    prog = [Fake(vec("tensor_scalar", 512), rd=(sb(0, 2048),), wr=(sb(4096 * (i + 1), 4096 * (i + 1) + 2048),))
            for i in range(3)]
    d = instruction_cost_ns(prog[0].ci, TRN2)
    assert schedule(prog, TRN2).start_ns == pytest.approx([0, d, 2 * d])


def test_reordering_keeps_every_dependency():
    # c reads what a wrote and b overwrites what a read: each waits, whatever the issue order.
    a = Fake(act(512), rd=(sb(0, 2048),), wr=(sb(4096, 6144),))
    b = Fake(act(64), rd=(sb(60000, 60256),), wr=(sb(0, 256),))            # WAR on a's input
    c = Fake(act(64), rd=(sb(4096, 4352),), wr=(sb(70000, 70256),))        # RAW on a's output
    tl = schedule([a, b, c], TRN1)
    assert tl.start_ns[1] >= tl.end_ns[0] and tl.start_ns[2] >= tl.end_ns[0]
    assert tl.preds[1] == [0] and tl.preds[2] == [0]


def test_dma_queues_stay_first_in_first_out():
    # A DMA waiting for compute holds the later DMA of its queue (a hardware queue), not other queues.
    long = Fake(vec("tensor_tensor", 16384), rd=(sb(0, 65536), sb(65536, 131072)), wr=(sb(131072, 196608),))
    store = Fake(dma(128 * 4096, src="sbuf", dst="hbm"), rd=(sb(131072, 135168),), wr=(hbm("y", 0, 1 << 19),))
    load_same_q = Fake(dma(128 * 4096), rd=(hbm("x", 0, 1 << 19),), wr=(sb(200000, 204096),))
    tl = schedule([long, store, load_same_q], TRN2)
    assert tl.start_ns[2] >= tl.end_ns[1]


def test_default_dge_mode_costs_hardware_dge_where_there_is_one():
    # Assumption 9: the compiler's default mode on NC-v3+ is priced at hardware DGE's ~600 ns (A-v3, DGE);
    # software DGE and NC-v2 (no hardware DGE) pay the ~1300 ns semaphore-to-start (DMABW).
    for mode, trn2_ns, trn1_ns in ((None, 600, 1300), ("unknown", 600, 1300), ("none", 600, 1300),
                                   ("hwdge", 600, 1300), ("swdge", 1300, 1300)):
        assert dma_cost(dma(4096, dge=mode), TRN2).fixed_ns == trn2_ns
        assert dma_cost(dma(4096, dge=mode), TRN1).fixed_ns == trn1_ns


def test_an_engine_that_branches_keeps_program_order():
    # A dynamic loop's branch is control flow on the engine's sequencer: no reordering across it, so an
    # engine with a branch in the program issues in program order (assumption 15).
    branch = Fake(vec("branch", 1, dts=(), mems=()), rd=(sb(90000, 90004),), wr=())
    prog = waiting_then_independent() + [branch]
    mm_ns, copy_ns, _ = (instruction_cost_ns(p.ci, TRN2) for p in prog[:3])
    dep = TRN2.vector.dependent_overhead_cycles / TRN2.vector.clock_hz * 1e9
    tl = schedule(prog, TRN2)
    assert tl.start_ns[2] == pytest.approx(mm_ns + dep + copy_ns)
    assert tl.start_ns[:3] == pytest.approx(schedule(prog, in_program_order(TRN2)).start_ns[:3])
