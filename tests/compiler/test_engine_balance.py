"""compiler/engine_balance.py: element-wise instructions moved off a busy engine to one that can run them; the
program gets faster (never slower) and computes the same values bit for bit."""
from __future__ import annotations

import dataclasses

import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.compiler.engine_balance import MOVABLE, _placements, balance_engines
from torchneuron.sim import Engine, NeuronCore
from torchneuron.sim.specs import chip_spec

SPEC = chip_spec("trn2")
CHAINS = 6    # independent chains of element-wise ops, all placed on VectorE
STEPS = 8


@nki.jit
def vector_only(a):
    """CHAINS independent chains on VectorE (scalings, an add of a column, a subtract of a tile and copies, some
    through PSUM): one engine runs everything while GpSimd and ScalarE idle."""
    out = nl.ndarray((CHAINS, *a.shape), a.dtype, buffer=nl.shared_hbm)
    x = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=a)
    col = nl.ndarray((a.shape[0], 1), a.dtype, buffer=nl.sbuf)
    nisa.memset(dst=col, value=0.25)
    for c in range(CHAINS):
        y = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=x, op0=nl.multiply, operand0=1.0 + c / 7)
        for s in range(STEPS):
            nisa.tensor_scalar(dst=y, data=y, op0=nl.add, operand0=col)
            nisa.tensor_scalar(dst=y, data=y, op0=nl.subtract, operand0=0.5 + s)   # (not a ScalarE operator)
            nisa.tensor_tensor(dst=y, data1=y, data2=x, op=nl.multiply)
            p = nl.ndarray(a.shape, a.dtype, buffer=nl.psum)
            nisa.tensor_copy(dst=p, src=y, engine=nisa.vector_engine)
            nisa.tensor_copy(dst=y, src=p, engine=nisa.vector_engine)   # from PSUM: never on GpSimd
        nisa.dma_copy(dst=out[c], src=y)
    return out


def _run(program, a):
    return NeuronCore(SPEC).run(program, {"a": a}, timed=False).bindings


def test_busy_engine_work_moves_to_idle_engines_with_the_same_values():
    a = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    program = vector_only.trace((), {"a": a}, SPEC).program
    balanced = balance_engines(program, SPEC)
    before, after = program.schedule(SPEC), balanced.schedule(SPEC)
    assert after.device_time_ns < 0.8 * before.device_time_ns
    assert after.engine_busy_ns["gpsimd"] > 0 and after.engine_busy_ns["scalar"] > 0
    moved = 0
    for old, new in zip(program.instructions, balanced.instructions):   # the same instructions, only engines differ
        if new.engine is not old.engine:
            moved += 1
            ci = new.cost_inputs()
            assert not (new.engine is Engine.GPSIMD and "psum" in (*ci.in_memories, ci.out_memory))
            assert not (new.engine is Engine.SCALAR and getattr(new, "op0", None) == "subtract")
            new = dataclasses.replace(new, engine=old.engine)
        assert new == old
    assert moved
    got, want = _run(balanced, a), _run(program, a)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_balance_never_makes_a_program_slower():
    a = torch.randn(128, 64)
    program = vector_only.trace((), {"a": a}, SPEC).program
    for p in (program, balance_engines(program, SPEC)):
        assert balance_engines(p, SPEC).schedule(SPEC).device_time_ns <= p.schedule(SPEC).device_time_ns


def test_placements_keep_psum_off_gpsimd_and_scalar_operators_to_multiply_and_add():
    """The engines an instruction may move to: GpSimd reads and writes no PSUM; ScalarE's tensor_scalar runs only
    multiply and add; a bitvec operator stays on VectorE; an instruction of one engine only never moves."""
    program = vector_only.trace((), {"a": torch.randn(128, 64)}, SPEC).program
    seen = set()
    for ins in program.instructions:
        engines = {p.engine for p in _placements(ins, MOVABLE)}
        ci = ins.cost_inputs()
        key = (ins.opcode, getattr(ins, "op0", None), "psum" in (*ci.in_memories, ci.out_memory))
        seen.add(key)
        if ins.opcode not in MOVABLE:
            assert engines == {ins.engine}
        elif key[2]:
            assert Engine.GPSIMD not in engines and Engine.VECTOR in engines
        elif key[1] == "subtract":
            assert engines == {Engine.VECTOR, Engine.GPSIMD}
        elif ins.opcode != "tensor_tensor":
            assert engines == {Engine.VECTOR, Engine.GPSIMD, Engine.SCALAR}
    assert {("tensor_copy", None, True), ("tensor_scalar", "subtract", False), ("tensor_scalar", "add", False),
            ("tensor_tensor", None, False)} <= seen
