"""A core's shared step scratch (``NeuronCore.scratch``): the steps of instructions of one shape share their host
buffers (products, operand conversions, activation buffers), and programs whose like instructions interleave give the
bits they give with a buffer of each instruction's own."""
from __future__ import annotations

import torch

from torchneuron.sim import ArgSlot, NeuronCore, Program, isa, tile

F32, BF16 = torch.float32, torch.bfloat16


def test_one_buffer_per_shape_dtype_and_tag():
    core = NeuronCore("trn2")
    a = core.scratch((128, 64), F32, "product")
    assert core.scratch((128, 64), F32, "product") is a
    others = [core.scratch((128, 64), F32, "moving"), core.scratch((128, 64), BF16, "product"),
              core.scratch((64, 128), F32, "product"), NeuronCore("trn2").scratch((128, 64), F32, "product")]
    assert all(o is not a and o.data_ptr() != a.data_ptr() for o in others)
    assert [tuple(o.shape) for o in others[:3]] == [(128, 64), (128, 64), (64, 128)] and others[1].dtype == BF16


def _interleaved() -> Program:
    """Like instructions interleaved: two accumulation chains of bf16 products (conversion and product scratch) into
    two PSUM tiles taking turns, GELU and its derivative of two tiles each, read straight from SBUF and loaded first
    (a scale), all stored."""
    x, out = tile("hbm:x", F32, (128, 1024)), tile("hbm:out", F32, (10 * 128, 256))
    y = tile("hbm:y", F32, (128, 512))
    xs = [tile("sbuf", F32, (128, 256), offset=1024 * i) for i in range(4)]
    ws = [tile("sbuf", BF16, (128, 128), offset=8192 + 256 * i) for i in range(4)]
    acc = [tile("psum", F32, (128, 128), offset=2048 * i) for i in range(2)]
    res = [tile("sbuf", F32, (128, 256), offset=16384 + 1024 * i) for i in range(10)]
    ys = [tile("sbuf", F32, (128, 256), offset=28672 + 1024 * i) for i in range(2)]
    prog = [isa.dma_copy(dst=t, src=x[:, 256 * i:256 * (i + 1)]) for i, t in enumerate(xs)]
    prog += [isa.dma_copy(dst=t, src=y[:, 256 * i:256 * (i + 1)]) for i, t in enumerate(ys)]
    prog += [isa.tensor_copy(dst=w, src=xs[i][:, :128]) for i, w in enumerate(ws)]
    for k in range(4):   # chain 0 takes ws[k] x ws[k+1], chain 1 ws[k+1] x ws[k]: each step between the other's
        for c in range(2):
            a, b = ws[k], ws[(k + 1) % 4]
            prog.append(isa.nc_matmul(dst=acc[c], stationary=a if c == 0 else b, moving=b if c == 0 else a,
                                      accumulate=k > 0))
    prog += [isa.tensor_copy(dst=res[c][:, :128], src=acc[c]) for c in range(2)]
    for i, op in enumerate(("gelu_dx", "gelu", "gelu_dx", "gelu")):
        prog.append(isa.activation(dst=res[2 + i], op=op, data=xs[i]))
    prog += [isa.activation(dst=res[6 + i], op="gelu_dx", data=xs[i], scale=0.5) for i in range(2)]
    # exp of masked scores (its clamped route, with mask buffers) taking turns with GELU's
    for i in range(2):
        prog += [isa.activation(dst=res[8 + i], op="exp", data=ys[i]),
                 isa.activation(dst=res[2 + i], op="gelu_dx" if i == 0 else "gelu", data=xs[i])]
    prog += [isa.dma_copy(dst=out[128 * i:128 * (i + 1)], src=r) for i, r in enumerate(res)]
    return Program(prog, [ArgSlot("x", (128, 1024), F32), ArgSlot("y", (128, 512), F32),
                          ArgSlot("out", (10 * 128, 256), F32, "output")])


def test_interleaved_like_instructions_give_the_bits_of_their_own_buffers(monkeypatch):
    program = _interleaved()
    x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(0))
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 1e-40, -30.0])
    for i in range(4):   # in each tile's columns the products do not read
        x[i, 256 * i + 128:256 * i + 136] = special
    y = torch.randn(128, 512, generator=torch.Generator().manual_seed(1))
    y[:, 100:] = torch.where(torch.rand(128, 412, generator=torch.Generator().manual_seed(2)) < 0.5, -1e30, y[:, 100:])
    inputs = {"x": x, "y": y}
    shared = NeuronCore("trn2", pack_tiles=False).run(program, {k: v.clone() for k, v in inputs.items()},
                                                      timed=False).outputs["out"]
    monkeypatch.setattr(NeuronCore, "scratch", lambda self, shape, dtype=F32, tag="": torch.empty(shape, dtype=dtype))
    for instr in program.instructions:   # (a matmul keeps its views and buffers per core)
        instr.__dict__.pop("_mm", None)
    own = NeuronCore("trn2", pack_tiles=False).run(program, {k: v.clone() for k, v in inputs.items()},
                                                   timed=False).outputs["out"]
    assert torch.equal(shared.view(torch.int32), own.view(torch.int32))
    # and what they compute (fp32 products of bf16-rounded values; PyTorch's GELU)
    w = [x[:, 256 * i:256 * i + 128].to(BF16).float() for i in range(4)]
    chain = sum(w[k].T @ w[(k + 1) % 4] for k in range(4))
    assert torch.allclose(shared[:128, :128], chain, rtol=1e-5, atol=1e-3)
    gelu, ref = shared[3 * 128:4 * 128], torch.nn.functional.gelu(x[:, 256:512].contiguous())
    assert torch.equal(gelu[1, 128:136].isnan(), ref[1, 128:136].isnan())   # (PyTorch's CPU GELU of +-inf: NaN)
    assert torch.allclose(gelu, ref, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert torch.equal(shared[8 * 128:], torch.cat([torch.exp(y[:, :256]), torch.exp(y[:, 256:])]))
