"""Programs: values that run many times with different bindings, report time and traffic, and
round-trip through serialization."""
from __future__ import annotations

import pickle

import pytest
import torch

from torchneuron.sim import ArgSlot, NeuronCore, Program, RunReport, isa, tile

F32, BF16 = torch.float32, torch.bfloat16


def matmul_bias_gelu(core: NeuronCore, k: int = 256, m: int = 128, n: int = 512) -> Program:
    """out[m, n] = gelu(xT.T @ w + b) with K tiled by 128 and PSUM accumulation (a small real kernel)."""
    sb = core.sbuf
    xs = [sb.allocate(128, m * 2).tile(BF16, (m,)) for _ in range(k // 128)]
    ws = [sb.allocate(128, n * 2).tile(BF16, (n,)) for _ in range(k // 128)]
    bias = sb.allocate(m, 4).tile(F32, (1,))
    acc = core.psum.allocate(m, n * 4).tile(F32, (n,))
    out = sb.allocate(m, n * 2).tile(BF16, (n,))
    X, W = tile("hbm:xT", BF16, (k, m)), tile("hbm:w", BF16, (k, n))
    prog = [isa.dma_copy(dst=xs[i], src=X[i * 128:(i + 1) * 128], queue=0) for i in range(k // 128)]
    prog += [isa.dma_copy(dst=ws[i], src=W[i * 128:(i + 1) * 128], queue=1) for i in range(k // 128)]
    prog.append(isa.dma_copy(dst=bias, src=tile("hbm:b", F32, (m, 1)), queue=2))
    prog += [isa.nc_matmul(dst=acc, stationary=xs[i], moving=ws[i], accumulate=i > 0) for i in range(k // 128)]
    prog.append(isa.activation(dst=out, op="gelu", data=acc, bias=bias))
    prog.append(isa.dma_copy(dst=tile("hbm:out", BF16, (m, n)), src=out))
    args = [ArgSlot("xT", (k, m), BF16), ArgSlot("w", (k, n), BF16), ArgSlot("b", (m, 1), F32),
            ArgSlot("out", (m, n), BF16, "output")]
    return Program(prog, args, "matmul_bias_gelu")


def inputs(seed: int, k: int = 256, m: int = 128, n: int = 512):
    g = torch.Generator().manual_seed(seed)
    return {"xT": torch.randn(k, m, generator=g).to(BF16), "w": torch.randn(k, n, generator=g).to(BF16),
            "b": torch.randn(m, 1, generator=g)}


def reference(a):
    return torch.nn.functional.gelu(a["xT"].float().T @ a["w"].float() + a["b"]).to(BF16)


def test_program_runs_twice_with_different_bindings():
    core = NeuronCore("trn2")
    prog = matmul_bias_gelu(core)
    core.sbuf.free_all()  # allocations were a trace-time affair: the program is self-contained
    results = []
    for seed in (1, 2):
        a = inputs(seed)
        rep = core.run(prog, a)
        torch.testing.assert_close(rep.outputs["out"].float(), reference(a).float(), rtol=2e-2, atol=2e-2)
        results.append(rep)
    assert not torch.equal(results[0].outputs["out"], results[1].outputs["out"])
    rep = results[1]
    assert isinstance(rep, RunReport) and rep.instructions == len(prog.instructions)
    assert rep.device_time_ns > 0 and len(rep.start_ns) == len(rep.end_ns) == len(prog.instructions)
    assert all(e >= s for s, e in zip(rep.start_ns, rep.end_ns)) and max(rep.end_ns) <= rep.device_time_ns + 1e-6
    assert rep.engine_busy_ns["tensor"] > 0 and rep.engine_busy_ns["dma"] > 0 and rep.engine_busy_ns["scalar"] > 0
    assert rep.flops == 2 * 256 * 128 * 512 + prog.instructions[-2].cost_inputs().flops
    assert rep.hbm_bytes_read == (256 * 128 + 256 * 512) * 2 + 128 * 4
    assert rep.hbm_bytes_written == 128 * 512 * 2
    assert set(rep.bindings) == {"xT", "w", "b", "out"}
    # roofline: achieved rates over the chip's peaks, from the same device time
    roof = rep.roofline
    seconds = rep.device_time_ns * 1e-9
    spec = core.spec
    assert roof.tensor_fraction == pytest.approx(2 * 256 * 128 * 512 / seconds / spec.tensor_peak_flops("bfloat16"))
    assert roof.hbm_fraction == pytest.approx(roof.hbm_bytes / seconds / spec.hbm_bytes_per_second_per_core)
    assert 0 < roof.tensor_fraction < 1 and 0 < roof.dma_fraction < 1


def test_caller_bound_output_is_written_in_place():
    core = NeuronCore("trn2")
    prog = matmul_bias_gelu(core)
    a = inputs(3)
    out = torch.zeros(128, 512, dtype=BF16)
    rep = core.run(prog, {**a, "out": out}, timed=False)
    assert rep.outputs["out"] is out and rep.device_time_ns is None
    torch.testing.assert_close(out.float(), reference(a).float(), rtol=2e-2, atol=2e-2)


def test_the_schedule_is_computed_once_per_chip():
    core = NeuronCore("trn2")
    prog = matmul_bias_gelu(core)
    first = core.run(prog, inputs(1))
    second = core.run(prog, inputs(2))
    assert first.device_time_ns == second.device_time_ns
    assert prog.schedule(core.spec) is prog.schedule(core.spec)


def test_timing_depends_on_the_chip():
    times = {}
    for chip in ("trn1", "trn2"):
        core = NeuronCore(chip)
        times[chip] = core.run(matmul_bias_gelu(core), inputs(1)).device_time_ns
    assert times["trn1"] != times["trn2"]


def test_serialization_round_trip():
    core = NeuronCore("trn2")
    prog = matmul_bias_gelu(core)
    data = prog.to_bytes()
    assert isinstance(data, bytes) and data.startswith(b'{"format":1')
    back = Program.from_bytes(data)
    assert back == prog and back.to_bytes() == data
    a = inputs(4)
    other = NeuronCore("trn2")  # a different core runs the decoded program
    torch.testing.assert_close(other.run(back, a).outputs["out"], core.run(prog, a).outputs["out"], rtol=0, atol=0)
    assert pickle.loads(pickle.dumps(prog)) == prog


def test_serialization_covers_every_field_kind():
    core = NeuronCore("trn2")
    t = core.sbuf.allocate(8, 64).tile(F32, (16,))
    idx = core.sbuf.allocate(8, 4).tile(torch.int32, (1,))
    instrs = [
        isa.tensor_scalar(dst=t, data=t, op0="max", operand0=float("-inf"), op1="add", operand1=idx, engine="gpsimd"),
        isa.activation(dst=t, op=torch.exp, data=t, scale=float("nan"), reduce_cmd="reset_reduce", reduce_res=idx),
        isa.nc_transpose(dst=core.psum.allocate(16, 32).tile(F32, (8,)), data=t, engine="tensor"),
        isa.iota(dst=t, pattern=[[2, 4], [1, 4]], offset=-3),
        isa.dma_copy(dst=t, src=tile("hbm:x", F32, (8, 16)), oob_mode="skip", queue=5),
        isa.nc_matmul(dst=core.psum.allocate(16, 64).tile(F32, (16,)), stationary=t, moving=t, accumulate=None),
    ]
    prog = Program(instrs, [ArgSlot("x", (8, 16), F32, "scratch")])
    back = Program.from_bytes(prog.to_bytes())
    assert back.instructions[0] == prog.instructions[0]
    assert back.instructions[1].scale != back.instructions[1].scale  # NaN survives
    assert [i.cost_inputs() for i in back.instructions] == [i.cost_inputs() for i in prog.instructions]
    assert back.args == prog.args
    with pytest.raises(ValueError, match="format"):
        Program.from_bytes(b'{"format": 99}')


def test_scratch_and_output_slots_are_allocated_per_run():
    core = NeuronCore("trn2")
    t = core.sbuf.allocate(4, 16).tile(F32, (4,))
    prog = Program([isa.iota(dst=t, pattern=[[1, 4]], channel_multiplier=4),
                    isa.dma_copy(dst=tile("hbm:tmp", F32, (4, 4)), src=t),
                    isa.dma_copy(dst=tile("hbm:out", F32, (16,)), src=tile("hbm:tmp", F32, (16,)))],
                   [ArgSlot("tmp", (4, 4), F32, "scratch"), ArgSlot("out", (16,), F32, "output")])
    rep = core.run(prog)
    assert set(rep.outputs) == {"out"} and torch.equal(rep.outputs["out"], torch.arange(16.0))
    assert rep.hbm_bytes_read == 64 and rep.hbm_bytes_written == 128


def test_psum_accumulation_restarts_each_run():
    core = NeuronCore("trn2")
    s = core.sbuf.allocate(8, 8).tile(BF16, (4,))
    acc = core.psum.allocate(4, 16).tile(F32, (4,))
    prog = Program([isa.dma_copy(dst=s, src=tile("hbm:s", BF16, (8, 4))),
                    isa.nc_matmul(dst=acc, stationary=s, moving=s),  # accumulate=None: first write overwrites
                    isa.nc_matmul(dst=acc, stationary=s, moving=s),
                    isa.tensor_copy(dst=s[0:4], src=acc),
                    isa.dma_copy(dst=tile("hbm:out", BF16, (4, 4)), src=s[0:4])],
                   [ArgSlot("s", (8, 4), BF16), ArgSlot("out", (4, 4), BF16, "output")])
    x = torch.ones(8, 4, dtype=BF16)
    for _ in range(2):
        out = core.run(prog, {"s": x}, timed=False).outputs["out"]
        assert torch.equal(out, torch.full((4, 4), 16.0, dtype=BF16))
