"""How fast the NeuronCore simulator itself runs (host time, not simulated device time).

* Launch: host microseconds per ``torchneuron.runtime.launch`` of a cached 4-instruction
  kernel (64x384 fp32 add: 2 DMA loads, 1 tensor_tensor, 1 DMA store) on a neuron device,
  split into the launch machinery (target: at most 30 us) and the instructions' execution,
  for the checked path (dict of tensors) and the unchecked fast path (list, ``check=False``).
* Small tiles: host microseconds per executed instruction, i.e. the simulator's fixed cost
  per instruction (target: under 10 us), through ``core.execute`` and as the prepared step a
  program run uses. Measured, not asserted.
* Programs: a traced program of many small instructions run functionally, then with the
  timing model (the first timed run schedules; later runs reuse the cached schedule).
* Transposes: host microseconds of a TensorE transpose (SBUF tile into PSUM) in a copy batch, against
  torch's ``copy_`` of the transposed view (what the transpose's own step calls).
* Cold tiles: host microseconds of an instruction's step on one SBUF tile, and on tiles spread over all of SBUF
  (a program whose tiles span SBUF, as the compiled demo's do, reads and writes bytes no longer in the host's
  caches).
* Packed tiles: host microseconds per instruction of a program whose tiles spread over all of SBUF, run as it is
  and with its tiles packed into few host bytes (``sim.host_layout``, what a core does with such a program).
* Matmul runs: host microseconds per matmul of a run of small overwriting matmuls stepping through SBUF and PSUM
  (attention's per-head products), run as one batched step (``tensor_engine.batch_matmuls``) against each
  matmul's own step.
* Large tiles: host time of one instruction divided by the time of the equivalent torch
  call on ordinary contiguous tensors (1.0 = no simulator overhead).
* Tutorials (``--tutorials``): host seconds to trace and functionally simulate each public NKI tutorial
  kernel at its tutorial's shapes (target: at most 10 s each), its result checked against the tutorial's
  NumPy/torch reference at the tutorial's tolerance. The kernels are not part of this repository: they are
  read at run time from a git copy of ``aws-neuron/nki-samples`` (``--samples PATH`` or
  ``TORCHNEURON_NKI_SAMPLES``; otherwise a copy next to this checkout is looked for) at pinned commits, with
  NKI imports aliased to TorchNeuron's; without a copy the cases are reported as skipped. ``--check`` also
  prints a digest of each kernel's outputs and program and its simulated device time, to compare runs of two
  versions of the simulator (a host-speed change must leave all three unchanged).

Run: ``.venv/bin/python bench/sim_speed.py`` (``--tutorials [--only NAME] [--check]``). Timings are the
best of several repeats, except the tutorials' (one cold run each: tracing is part of what is measured).
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

import torch
import torch.nn.functional as F

from torchneuron.sim import ArgSlot, NeuronCore, Program, isa, tile

F32, BF16 = torch.float32, torch.bfloat16


def best_us(fn: Callable[[], object], number: int, repeat: int = 7) -> float:
    """Best-of-``repeat`` mean microseconds per call of ``fn`` over ``number`` calls."""
    fn()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


def alloc(core: NeuronCore, shape, dtype, memory: str = "sbuf"):
    region = core.memory(memory).allocate(shape[0], math.prod(shape[1:]) * dtype.itemsize)
    ap = region.tile(dtype, tuple(shape[1:]))
    ap.write(core, torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype))
    return ap


def small_tiles(core: NeuronCore) -> dict[str, isa.Instr]:
    p, f = 8, 16
    a, b, c = (alloc(core, (p, f), F32) for _ in range(3))
    h = alloc(core, (p, f), BF16)
    col = alloc(core, (p, 1), F32)
    core.bind("x", torch.zeros(p, f))
    return {
        "dma_copy (HBM->SBUF)": isa.dma_copy(dst=a, src=tile("hbm:x", F32, (p, f))),
        "dma_copy gather (HBM rows->SBUF)": isa.dma_copy(dst=a, src=tile("hbm:x", F32, (p, f)),
                                                         src_index=alloc(core, (p, 1), torch.int32)),
        "tensor_copy fp32->bf16": isa.tensor_copy(dst=h, src=a),
        "tensor_tensor add fp32": isa.tensor_tensor(dst=c, data1=a, data2=b, op="add"),
        "tensor_tensor mul bf16": isa.tensor_tensor(dst=h, data1=h, data2=a, op="multiply"),
        "tensor_scalar mul,add": isa.tensor_scalar(dst=c, data=a, op0="multiply", operand0=2.0, op1="add",
                                                   operand1=col),
        "activation exp+scale+bias": isa.activation(dst=c, op="exp", data=a, scale=0.5, bias=col),
        "tensor_reduce add": isa.tensor_reduce(dst=col, op="add", data=a, axis=1),
        "memset": isa.memset(dst=c, value=0.0),
        "iota": isa.iota(dst=c, pattern=[[1, f]]),
        "nc_matmul 8x16x16 bf16": isa.nc_matmul(dst=alloc(core, (16, 16), F32, "psum"),
                                                 stationary=alloc(core, (p, 16), BF16),
                                                 moving=alloc(core, (p, 16), BF16)),
        "nc_transpose (TensorE)": isa.nc_transpose(dst=alloc(core, (f, p), F32, "psum"), data=a),
        # the demo's attention tile: its step writes PSUM with one torch.mm (execute: into a buffer, then copied)
        "nc_matmul 64x64x16 fp32 (no acc)": isa.nc_matmul(dst=alloc(core, (64, 16), F32, "psum"),
                                                           stationary=alloc(core, (64, 64), F32),
                                                           moving=alloc(core, (64, 16), F32), accumulate=False),
    }


def add_kernel(shape=(64, 384), dtype=F32) -> Program:
    """out = a + b as an eager op's library kernel would run it: load both, add, store."""
    p, f = shape
    row = f * dtype.itemsize
    sa, sb, so = (tile("sbuf", dtype, (p, f), offset=i * row) for i in range(3))
    body = [isa.dma_copy(dst=sa, src=tile("hbm:a", dtype, shape), queue=0),
            isa.dma_copy(dst=sb, src=tile("hbm:b", dtype, shape), queue=1),
            isa.tensor_tensor(dst=so, data1=sa, data2=sb, op="add"),
            isa.dma_copy(dst=tile("hbm:out", dtype, shape), src=so)]
    args = [ArgSlot("a", shape, dtype), ArgSlot("b", shape, dtype), ArgSlot("out", shape, dtype, "output")]
    return Program(body, args, "add")


def launch_costs() -> dict[str, float]:
    """Host us per launch of the cached add kernel, and of its parts."""
    import torchneuron  # noqa: F401  (registers the neuron device)
    from torchneuron import _C, runtime

    prog = add_kernel()
    a, b = torch.randn(64, 384).to("neuron"), torch.randn(64, 384).to("neuron")
    out = torch.empty(64, 384, device="neuron")
    args, order = {"a": a, "b": b, "out": out}, [a, b, out]
    core = runtime.core(0)
    runtime.launch(prog, args)  # prepares the program for the core, schedules it
    host = [_C._alias_as_cpu(t) for t in order]
    plan = core._plan(prog)
    steps = [step for _, step, _ in plan.entries]

    def execute() -> None:  # the instructions alone, as a launch runs them
        for step in steps:
            step(host)

    empty = Program((), prog.args, "empty")
    for _ in range(2000):  # steady state: the profiler's record list and the garbage collector warmed up
        runtime.launch(prog, args)
    costs = {
        "launch (dict, checked)": best_us(lambda: runtime.launch(prog, args), 200, 15),
        "launch (list, check=False)": best_us(lambda: runtime.launch(prog, order, check=False), 200, 15),
        "instruction execution": best_us(execute, 200, 15),
        "launch of a 0-instruction kernel (dict, checked)": best_us(lambda: runtime.launch(empty, args), 200, 15),
        "launch of a 0-instruction kernel (list, check=False)":
            best_us(lambda: runtime.launch(empty, order, check=False), 200, 15),
    }
    assert torch.equal(out.cpu(), a.cpu() + b.cpu())
    runtime.profiler.clear()
    return costs


def small_program(core: NeuronCore, n: int = 1000) -> Program:
    """n small instructions, a realistic mix: loads, elementwise work, stores."""
    p, f = 16, 64
    tiles = [alloc(core, (p, f), F32) for _ in range(8)]
    x = tile("hbm:x", F32, (p, f))
    y = tile("hbm:y", F32, (p, f))
    body = []
    for i in range(n):
        t0, t1, t2 = tiles[i % 8], tiles[(i + 1) % 8], tiles[(i + 2) % 8]
        kind = i % 5
        if kind == 0:
            body.append(isa.dma_copy(dst=t0, src=x, queue=i % 4))
        elif kind == 1:
            body.append(isa.tensor_tensor(dst=t2, data1=t0, data2=t1, op="add"))
        elif kind == 2:
            body.append(isa.tensor_scalar(dst=t1, data=t2, op0="multiply", operand0=0.5))
        elif kind == 3:
            body.append(isa.activation(dst=t0, op="tanh", data=t1))
        else:
            body.append(isa.dma_copy(dst=y, src=t2, queue=i % 4))
    return Program(body, [ArgSlot("x", (p, f), F32), ArgSlot("y", (p, f), F32, "output")], "small_mix")


def large_tiles(core: NeuronCore) -> list[tuple[str, isa.Instr, Callable[[], object]]]:
    p, f = 128, 2048
    a32, b32, c32 = (alloc(core, (p, f), F32) for _ in range(3))
    a16, b16, c16 = (alloc(core, (p, f), BF16) for _ in range(3))
    r32 = alloc(core, (p, 1), F32)
    t = {k: v.read(core) for k, v in dict(a32=a32, b32=b32, a16=a16, b16=b16).items()}
    o32, o16, o1 = torch.empty(p, f), torch.empty(p, f, dtype=BF16), torch.empty(p)
    host = torch.randn(p, 4096)
    core.bind("h", host)
    s_sb, m_sb = alloc(core, (128, 128), BF16), alloc(core, (128, 512), BF16)
    s_t, m_t = s_sb.read(core), m_sb.read(core)
    acc = alloc(core, (128, 512), F32, "psum")
    o_mm = torch.empty(128, 512)
    return [
        ("dma_copy 128x4096 fp32 HBM->SBUF",
         isa.dma_copy(dst=alloc(core, (p, 4096), F32), src=tile("hbm:h", F32, (p, 4096))),
         lambda: torch.empty(p, 4096).copy_(host)),
        ("tensor_copy fp32->bf16", isa.tensor_copy(dst=c16, src=a32), lambda: o16.copy_(t["a32"])),
        ("tensor_tensor add fp32", isa.tensor_tensor(dst=c32, data1=a32, data2=b32, op="add"),
         lambda: torch.add(t["a32"], t["b32"], out=o32)),
        ("tensor_tensor add bf16", isa.tensor_tensor(dst=c16, data1=a16, data2=b16, op="add"),
         lambda: torch.add(t["a16"], t["b16"], out=o16)),
        ("tensor_scalar mul,add fp32", isa.tensor_scalar(dst=c32, data=a32, op0="multiply", operand0=2.0, op1="add",
                                                         operand1=1.0),
         lambda: torch.mul(t["a32"], 2.0, out=o32).add_(1.0)),
        ("activation exp fp32", isa.activation(dst=c32, op="exp", data=a32), lambda: torch.exp(t["a32"], out=o32)),
        ("activation gelu bf16", isa.activation(dst=c16, op="gelu", data=a16), lambda: o16.copy_(F.gelu(t["a16"]))),
        ("tensor_reduce add fp32", isa.tensor_reduce(dst=r32, op="add", data=a32, axis=1),
         lambda: torch.sum(t["a32"], 1, out=o1)),
        ("nc_matmul 128x128x512 bf16", isa.nc_matmul(dst=acc, stationary=s_sb, moving=m_sb, accumulate=True),
         lambda: o_mm.add_(s_t.T @ m_t)),
    ]


# ---------------------------------------------------------------------------------------------------------------
# public NKI tutorial kernels
# ---------------------------------------------------------------------------------------------------------------
SAMPLES_HEAD = "6905a68a122f937e68403727759f035ddd144f95"    # aws-neuron/nki-samples: current tutorials
SAMPLES_LEGACY = "7af4e4d0210b2baf98cfa2bd033b06fc8ac60355"  # the parent of 8370e11, which removed the legacy ones
TUTORIALS = "src/nki_samples/tutorials/"


@dataclass(frozen=True)
class Tutorial:
    """One tutorial kernel at its tutorial's shapes: where it is, its arguments and its reference result."""

    name: str
    commit: str
    path: str                                   # under TUTORIALS
    kernel: str                                 # the module attribute the tutorial calls
    shapes: str
    inputs: Callable[[np.random.Generator], tuple]
    reference: Callable[..., Any]               # the expected output from the same arguments
    atol: float                                 # the tutorial's own tolerance (np.allclose)
    rtol: float
    needs: tuple[str, ...] = ()                 # sibling modules the kernel file imports by name


def transposes_in_a_batch() -> list[tuple[str, float, float]]:
    """(tile, host us of one transpose in a copy batch, host us of copy_ of the transposed view) for SBUF tiles
    transposed into PSUM, as a TensorE transpose moves them."""
    from torchneuron import _C  # the runtime's batch runner (the simulator alone has none)
    core, rows = NeuronCore("trn2"), []
    for dtype in (F32, BF16):
        for p, f in ((128, 128), (64, 128), (128, 64)):
            data = core.sbuf.data.view(dtype)[:p, :f]
            data.copy_(torch.randn(p, f).to(dtype))
            dst = core.psum.data.view(dtype)[:f, :p]
            batch = _C._CopyBatch([([f, p], dtype.itemsize, dst, data.T)])
            rows.append((f"{str(dtype)[6:]} [{p}, {f}]", best_us(lambda: batch.run([]), 300),
                         best_us(lambda: dst.copy_(data.T), 300)))
    return rows


SLOT = 1024   # SBUF bytes per partition between the cold tiles' slots (a [128, 128] fp32 tile and a [128, 64] one)


def cold_tiles() -> list[tuple[str, float, float]]:
    """(instruction, host us per run of its step on tiles at one SBUF offset, host us per run when consecutive runs
    take tiles from slots spread over all of SBUF): the second is what a program whose tiles span SBUF pays (the
    compiled demo's forward and backward programs use 221-223 KiB of each partition's 224, eager kernels mostly
    under 16 KiB), its tiles' host bytes no longer in the host's caches."""
    core = NeuronCore("trn2")
    values = core.sbuf.typed(F32)
    values.copy_(torch.randn(values.shape))
    slots = core.sbuf.bytes_per_partition // SLOT - 1
    t = lambda dtype, free, slot, at=0: tile("sbuf", dtype, (128, *free), offset=SLOT * slot + at)  # noqa: E731
    makers = {
        "tensor_copy fp32 [128, 128]": lambda i: isa.tensor_copy(dst=t(F32, (128,), i + 1), src=t(F32, (128,), i)),
        "nc_transpose fp32 [128, 128]": lambda i: isa.nc_transpose(dst=tile("psum", F32, (128, 128)),
                                                                   data=t(F32, (128,), i)),
        "nc_matmul fp32 K=M=128, N=64": lambda i: isa.nc_matmul(dst=tile("psum", F32, (128, 64)),
                                                                stationary=t(F32, (128,), i),
                                                                moving=t(F32, (64,), i, 512), accumulate=False),
    }
    rows = []
    for name, make in makers.items():
        steps = [make(i).step(core, {}) for i in range(slots)]
        hot = best_us(lambda: steps[0]([]), 200)

        def sweep() -> None:
            for step in steps:
                step([])
        rows.append((name, hot, best_us(sweep, 1, 5) / len(steps)))
    return rows


def packed_program() -> tuple[str, float, float]:
    """(program, host us per instruction run as it is, packed on the host): a chain of [128, 256] fp32 tiles, each
    loaded, added to the one before and stored, allocated next fit so they spread over all of SBUF (as a compiled
    program's do); packed (``sim.host_layout``), the live tiles share a few KiB of host bytes."""
    slots = NeuronCore("trn2").sbuf.bytes_per_partition // SLOT - 1
    x, out = tile("hbm:x", F32, (128, 256)), tile("hbm:out", F32, (slots * 128, 256))
    t = lambda slot: tile("sbuf", F32, (128, 256), offset=SLOT * slot)  # noqa: E731
    prog = [isa.dma_copy(dst=t(0), src=x)]
    for i in range(1, slots):
        prog += [isa.dma_copy(dst=t(i), src=x), isa.tensor_tensor(dst=t(i), data1=t(i), data2=t(i - 1), op="add"),
                 isa.dma_copy(dst=out[128 * i:128 * (i + 1)], src=t(i))]
    program = Program(prog, [ArgSlot("x", (128, 256), F32), ArgSlot("out", (slots * 128, 256), F32, "output")])
    bound = [torch.randn(128, 256), torch.empty(slots * 128, 256)]
    us = [best_us(lambda: NeuronCore.run_bound(core, program, bound), 3, repeat=5) / len(prog)
          for core in (NeuronCore("trn2", pack_tiles=False), NeuronCore("trn2"))]
    return f"{len(prog)} instructions, {slots} [128, 256] fp32 tiles", us[0], us[1]


def _bf16(*shape: int, rng: np.random.Generator) -> torch.Tensor:
    return torch.from_numpy(rng.random(shape, dtype=np.float32)).to(torch.bfloat16)


def _ref_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The attention tutorial's NumPy reference: softmax(q.T @ k) @ v.T, q/k/v [d_head, seqlen]."""
    qk = q.T.astype(np.float64) @ k
    e = np.exp(qk - qk.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)) @ v.T


def _ref_sd_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    s = (q.astype(np.float64) * 0.125) @ k.T
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)) @ v


def _ref_mamba(delta, u, a, b, c) -> np.ndarray:
    """The Mamba tutorial's layer: a sequential scan of exp(delta*A) * state + delta*B*u, summed against C."""
    delta, u, a, b, c = (x.astype(np.float64) for x in (delta, u, a, b, c))
    d_a = np.exp(delta[:, :, None, :] * a[None, :, :, None])
    d_bu = delta[:, :, None, :] * b[:, None, :, :] * u[:, :, None, :]
    state, out = np.zeros(d_a.shape[:-1]), np.empty(delta.shape)
    for i in range(delta.shape[-1]):
        state = d_a[..., i] * state + d_bu[..., i]
        out[..., i] = (c[:, None, :, i] * state).sum(-1)
    return out


def _ref_layernorm(x, eps, gamma, beta) -> np.ndarray:
    x = x.astype(np.float64)
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta


def _attention_inputs(seqlen: int) -> Callable[[np.random.Generator], tuple]:
    return lambda rng: tuple(((rng.random((128, seqlen)) - 0.5) * 2).astype(np.float32) for _ in range(3))


def _mamba_inputs(rng: np.random.Generator) -> tuple:
    """The fused Mamba kernels' default size (batch 1, 256 channels, state 16, seq 2048), random data with a
    negative A (the tutorial's advice: a positive one overflows the scan and hides numerical errors)."""
    b, c, s, n = 1, 256, 16, 2048
    return (rng.random((b, c, n), dtype=np.float32), rng.random((b, c, n), dtype=np.float32),
            -rng.random((c, s), dtype=np.float32), rng.random((b, s, n), dtype=np.float32),
            rng.random((b, s, n), dtype=np.float32))


def _matmul_inputs(m: int, k: int, n: int) -> Callable[[np.random.Generator], tuple]:
    return lambda rng: (_bf16(k, m, rng=rng), _bf16(k, n, rng=rng))     # (lhsT, rhs)


def _ref_matmul(lhs_t: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    return lhs_t.double().T @ rhs.double()


_ATTN = "attention_fwd_performance/attention_kernels.py"
_MM = "matrix_multiplication/matrix_multiplication_nki_kernels.py"
_MAMBA = "fused_mamba/mamba_nki_kernels.py"
_LN = "layernorm/layernorm_nki_kernel.py"
_MM_LARGE = "[4096,1024] @ [1024,2048] bf16"

TUTORIAL_CASES: list[Tutorial] = [
    Tutorial("tensor_add", SAMPLES_LEGACY, "tensor_addition/tensor_addition_nki_kernels.py", "nki_tensor_add",
             "[256,1024] fp16, grid 2x2", lambda rng: tuple(rng.random((256, 1024)).astype(np.float16) for _ in "ab"),
             lambda a, b: a + b, 1e-4, 1e-2),
    Tutorial("tensor_add spmd 2 NC", SAMPLES_LEGACY, "tensor_addition/spmd_multiple_nc_tensor_addition_nki_kernels.py",
             "nki_tensor_add_nc2", "[512,2048] bf16, grid (spmd_dim(2, nc(2)), 4)",
             lambda rng: (_bf16(512, 2048, rng=rng), _bf16(512, 2048, rng=rng)), lambda a, b: a + b, 1e-4, 1e-2,
             needs=("tensor_addition/spmd_tensor_addition_nki_kernels.py",)),
    Tutorial("transpose2d", SAMPLES_LEGACY, "transpose2d/transpose2d_nki_kernels.py", "tensor_transpose2D_kernel_",
             "[5, 3x4] int8", lambda rng: (np.arange(60, dtype=np.int8).reshape(5, 12), (3, 4)),
             lambda a, s: a.reshape(5, *s).transpose(0, 2, 1).reshape(5, -1), 0, 0),
    Tutorial("average_pool2d", SAMPLES_LEGACY, "average_pool2d/average_pool2d_nki_kernels.py", "tensor_avgpool_kernel",
             "[2,6,6] bf16, pool 2", lambda rng: (torch.arange(72, dtype=torch.bfloat16).reshape(2, 6, 6), 2),
             lambda x, p: F.avg_pool2d(x, p, p), 0, 0),
    Tutorial("matmul basic", SAMPLES_LEGACY, _MM, "nki_matmul_basic_", "[64,128] @ [128,512] bf16",
             _matmul_inputs(64, 128, 512), _ref_matmul, 1e-4, 1e-2),
    *(Tutorial(f"matmul {v}", SAMPLES_LEGACY, _MM, f"nki_matmul_{v}_", _MM_LARGE, _matmul_inputs(4096, 1024, 2048),
               _ref_matmul, 1e-4, 1e-2)
      for v in ("tiled", "hoist_load", "block_free_dimension", "fully_optimized")),
    *(Tutorial(f"mamba {v}", SAMPLES_LEGACY, _MAMBA, f"mamba_{v}", "batch 1, 256 ch, state 16, seq 2048, fp32",
               _mamba_inputs, _ref_mamba, 1e-2, 1e-2) for v in ("v1", "v2", "v3")),
    *(Tutorial(f"layernorm {v}", SAMPLES_LEGACY, _LN, f"nki_layernorm_kernel_{v}", "[4096,8192] fp32",
               lambda rng: (rng.random((4096, 8192), dtype=np.float32), 1e-5, rng.random(8192, dtype=np.float32),
                            rng.random(8192, dtype=np.float32)), _ref_layernorm, 1e-3, 1e-2) for v in ("v1", "v2")),
    Tutorial("rmsnorm", SAMPLES_LEGACY, "rmsnorm/rmsnorm_nki_kernels.py", "nki_rmsnorm_kernel", "[128,512] fp32",
             lambda rng: (rng.random((128, 512), dtype=np.float32), rng.random(512, dtype=np.float32)),
             lambda a, g: a / np.sqrt((a.astype(np.float64) ** 2).mean(1, keepdims=True)) * g, 1e-4, 1e-2),
    Tutorial("softmax", SAMPLES_LEGACY, "softmax/softmax_nki_kernels.py", "nki_softmax_kernel", "[2,5] fp32",
             lambda rng: (np.array([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]], dtype=np.float32),),
             lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True), 1e-5, 1e-5),
    Tutorial("sd_attention", SAMPLES_LEGACY, "sd_attention/sd_attention_nki_kernels.py",
             "fused_self_attn_for_SD_small_head_size", "q,k,v [4096,64] fp32",
             lambda rng: tuple(rng.random((4096, 64), dtype=np.float32) for _ in "qkv"), _ref_sd_attention, 1e-5, 1e-3),
    *(Tutorial(f"attention {v}", SAMPLES_HEAD, _ATTN, f"attn_fwd_{v}", "d_head 128, seqlen 128, fp32",
               _attention_inputs(128), _ref_attention, 1e-2, 0) for v in ("v1", "v2")),
    *(Tutorial(f"attention {v}", SAMPLES_HEAD, _ATTN, f"attn_fwd_{v}", "d_head 128, seqlen 4096, fp32",
               _attention_inputs(4096), _ref_attention, 1e-2, 0)
      for v in ("v3", "v4", "v5", "v6", "v7", "v8", "v8a", "v9", "v10", "v11")),
]


def find_samples(explicit: str | None) -> Path | None:
    """The git directory of a copy of aws-neuron/nki-samples: --samples, TORCHNEURON_NKI_SAMPLES, or one near here."""
    given = explicit or os.environ.get("TORCHNEURON_NKI_SAMPLES")
    here = Path(__file__).resolve().parent.parent
    bases = [Path(given)] if given else [b / sub for b in (here.parent, here.parent.parent)
                                         for sub in (Path(".mirror/aws-neuron+nki-samples/repo"), Path("nki-samples"))]
    for base in bases:
        for git_dir in (base / ".git", base):
            if (git_dir / "HEAD").is_file() and (git_dir / "objects").is_dir():
                return git_dir
    return None


def _stub_missing(names: tuple[str, ...]) -> None:
    """Empty modules for imports the tutorial files make but whose kernels do not use (the Neuron torch
    bridge, which only exists on Trainium hosts)."""
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in sys.modules:
                try:
                    __import__(sub)
                except ImportError:
                    sys.modules[sub] = types.ModuleType(sub, "stub: not used by the kernels")


def _digest(value: Any) -> str:
    arrays = value if isinstance(value, (tuple, list)) else (value,)
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.contiguous().view(torch.uint8).numpy().tobytes() if isinstance(a, torch.Tensor)
                 else np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:12]


def _max_error(out: Any, ref: Any, atol: float, rtol: float) -> tuple[float, bool]:
    """The largest |out - ref| and whether np.allclose(out, ref, atol, rtol) holds (the tutorials' check)."""
    o = (out.float() if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out))).double()
    r = (ref if isinstance(ref, torch.Tensor) else torch.from_numpy(np.asarray(ref))).double()
    if o.shape != r.shape:
        return math.inf, False
    return float((o - r).abs().max()), bool(torch.allclose(o, r, rtol=rtol, atol=atol))


def tutorial_speed(only: str, samples: str | None, check: bool, threads: int) -> None:
    """Host seconds per public NKI tutorial kernel, traced and simulated functionally at the tutorial's shapes."""
    # torch's intra-op threads barely help the simulator's tile-sized calls, and on a busy machine each parallel
    # call waits for a descheduled thread (measured: 2-3x the host time at 2 threads under load)
    torch.set_num_threads(threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from calibrate import Sdk   # the reader of a git copy of public kernels, shared with the calibration
    from torchneuron import nki
    from torchneuron.nki import resolve_chip

    source = Sdk(find_samples(samples))
    print(f"Public NKI tutorial kernels, traced and simulated functionally (host seconds; target <= 10 s; "
          f"torch threads = {threads})\nsources: {source.git_dir or 'none found (cases skipped)'}")
    _stub_missing(("torch_xla.core.xla_model",))
    traced: list = []
    run = nki.Kernel.run

    def recording_run(self, args, kwargs, chip=None, timed=False):
        result = run(self, args, kwargs, chip, timed)
        traced.append((result[2].program, resolve_chip(chip or self.options.get("platform_target"))))
        return result

    nki.Kernel.run = recording_run
    print(f"  {'kernel':24s} {'host s':>7s}  {'max |err|':>9s}  shapes" + ("  [output, program, device ns]" if check else ""))
    exact = any(case.name == only for case in TUTORIAL_CASES)   # "attention v1" is not also v10 and v11
    for case in TUTORIAL_CASES:
        if (case.name != only) if exact else (only not in case.name):
            continue
        try:
            for dep in case.needs:
                sys.modules[Path(dep).stem] = source.module(case.commit, TUTORIALS + dep)
            kernel = getattr(source.module(case.commit, TUTORIALS + case.path), case.kernel)
        except FileNotFoundError as exc:
            why = exc if source.git_dir else "no copy of aws-neuron/nki-samples (pass --samples or set " \
                                             "TORCHNEURON_NKI_SAMPLES)"
            print(f"  {case.name:24s} skipped: {why}")
            continue
        except ModuleNotFoundError as exc:   # a package the tutorial's module imports (sd_attention: scipy)
            print(f"  {case.name:24s} skipped: the tutorial imports {exc.name!r}, not installed here")
            continue
        args = case.inputs(np.random.default_rng(0))
        traced.clear()
        t0 = time.perf_counter()
        out = kernel(*args)
        host = time.perf_counter() - t0
        err, ok = _max_error(out, case.reference(*args), case.atol, case.rtol)
        line = f"  {case.name:24s} {host:7.1f}  {err:9.2e}{'' if ok else ' MISMATCH'}  {case.shapes}"
        if check:
            ns = sum(p.schedule(spec).device_time_ns for p, spec in traced)
            programs = hashlib.sha256(b"".join(p.to_bytes() for p, _ in traced)).hexdigest()[:12]
            line += f"  [{_digest(out)}, {programs}, {ns:.0f}]"
        print(line, flush=True)
    nki.Kernel.run = run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tutorials", action="store_true", help="host seconds per public NKI tutorial kernel")
    parser.add_argument("--only", default="", help="with --tutorials: only kernels whose name contains this")
    parser.add_argument("--samples", default=None, help="a git copy of aws-neuron/nki-samples")
    parser.add_argument("--check", action="store_true", help="with --tutorials: digests and device time per kernel")
    parser.add_argument("--threads", type=int, default=1, help="with --tutorials: torch intra-op threads (default 1)")
    args = parser.parse_args()
    if args.tutorials:
        tutorial_speed(args.only, args.samples, args.check, args.threads)
        return
    simulator_speed()


def matmul_runs() -> list[tuple[str, float, float]]:
    """(run, host us per matmul as one batched step, host us per matmul through each one's own step) for runs of
    overwriting matmuls whose operands and results step through SBUF and PSUM by a constant offset, at the small
    attention shapes of bench/eager.py's models and the demo's."""
    from torchneuron.sim.isa.tensor_engine import batch_matmuls
    rows = []
    for dtype, (k, m, n), count in ((F32, (16, 16, 8), 16), (BF16, (16, 16, 16), 8), (F32, (64, 64, 16), 4)):
        core = NeuronCore("trn2")
        core.sbuf.typed(dtype).copy_(torch.randn(core.sbuf.typed(dtype).shape).to(dtype))
        size = dtype.itemsize
        instrs = [isa.nc_matmul(dst=tile("psum", F32, (m, n), offset=4 * n * j),
                                stationary=tile("sbuf", dtype, (k, m), offset=m * size * j),
                                moving=tile("sbuf", dtype, (k, n), offset=8192 + n * size * j),
                                accumulate=False) for j in range(count)]
        entries = [(i, i.step(core, {}), None) for i in instrs]
        batched = [step for _, step, _ in batch_matmuls(core, entries)]
        each = [step for _, step, _ in entries]

        def run(steps: list) -> None:
            for step in steps:
                step([])
        rows.append((f"{count} x {str(dtype)[6:]} K={k} M={m} N={n} ({len(batched)} call(s))",
                     best_us(lambda: run(batched), 200) / count, best_us(lambda: run(each), 200) / count))
    return rows


def simulator_speed() -> None:
    """The launch, per-instruction and large-tile host costs."""
    torch.set_num_threads(1)  # the simulator is single-threaded per core; compare like with like
    print("NeuronCore simulator speed (host time; torch threads = 1)\n")
    costs = launch_costs()
    execute = costs["instruction execution"]
    print("Launch of a cached 4-instruction kernel (64x384 fp32 add), host us per launch")
    for path in ("dict, checked", "list, check=False"):
        total = costs[f"launch ({path})"]
        print(f"  launch ({path}){'':{20 - len(path)}s} {total:7.1f} us = machinery {total - execute:5.1f} us "
              f"(target <= 30) + instructions {execute:5.1f} us")
    for path in ("dict, checked", "list, check=False"):
        print(f"  0-instruction kernel ({path}){'':{6 - len(path) + 14}s}{costs[f'launch of a 0-instruction kernel ({path})']:7.1f} us")

    core = NeuronCore("trn2")
    print("\nSmall tiles ([8, 16]): host microseconds per executed instruction (target < 10 us)")
    print(f"  {'instruction':32s} {'execute':>9s} {'step':>7s}")
    slots = {"hbm:x": (0, ArgSlot("x", (8, 16), F32))}
    host = [torch.zeros(8, 16)]
    for name, instr in small_tiles(core).items():
        step = instr.step(core, slots)
        fast = f"{best_us(lambda: step(host), 300):5.1f} us" if step is not None else "      -"
        print(f"  {name:32s} {best_us(lambda: core.execute(instr), 300):6.1f} us {fast}")

    core = NeuronCore("trn2")
    prog = small_program(core)
    n = len(prog.instructions)
    x = {"x": torch.randn(16, 64)}
    functional = best_us(lambda: core.run(prog, x, timed=False), 3, repeat=5) / n
    t0 = time.perf_counter()
    core.run(prog, x)
    first_timed = (time.perf_counter() - t0) * 1e6 / n
    timed = best_us(lambda: core.run(prog, x), 3, repeat=5) / n
    print(f"\nProgram of {n} small instructions ([16, 64] tiles, mixed DMA/Vector/Scalar), per instruction:")
    print(f"  functional run (timed=False)     {functional:7.1f} us")
    print(f"  first timed run (scheduling)     {first_timed:7.1f} us")
    print(f"  later timed runs (cached)        {timed:7.1f} us")
    data = prog.to_bytes()
    print(f"  serialize / deserialize          {best_us(prog.to_bytes, 3, 3) / n:7.1f} us / "
          f"{best_us(lambda: Program.from_bytes(data), 3, 3) / n:.1f} us ({len(data) / n:.0f} bytes)")

    print("\nTensorE transposes out of SBUF into PSUM in a copy batch (_C._CopyBatch) vs torch's copy_ of the "
          "transposed view (each transpose's own step)")
    print(f"  {'tile':24s} {'batch us':>9s} {'copy_ us':>9s} {'ratio':>6s}")
    for name, batch_us, copy_us in transposes_in_a_batch():
        print(f"  {name:24s} {batch_us:9.2f} {copy_us:9.2f} {batch_us / copy_us:6.2f}")

    print("\nCold tiles: host us per instruction step on one SBUF tile, and on tiles spread over all of SBUF")
    print(f"  {'instruction':32s} {'one tile':>9s} {'spread':>9s} {'ratio':>6s}")
    for name, hot_us, spread_us in cold_tiles():
        print(f"  {name:32s} {hot_us:9.2f} {spread_us:9.2f} {spread_us / hot_us:6.2f}")

    name, plain_us, packed_us = packed_program()
    print("\nPacked tiles: host us per instruction of a program whose tiles spread over SBUF, run as it is vs with its")
    print("tiles packed on the host (sim.host_layout)")
    print(f"  {name:44s} {plain_us:8.2f} {packed_us:8.2f} {packed_us / plain_us:6.2f}")

    print("\nMatmul runs: host us per matmul, the run as one batched step vs each matmul's own step")
    print(f"  {'run':44s} {'batched':>8s} {'each':>8s} {'ratio':>6s}")
    for name, batched_us, each_us in matmul_runs():
        print(f"  {name:44s} {batched_us:8.2f} {each_us:8.2f} {batched_us / each_us:6.2f}")

    core = NeuronCore("trn2")
    print("\nLarge tiles ([128, 2048] unless named): simulator host time vs the same torch op")
    print(f"  {'instruction':36s} {'sim us':>9s} {'torch us':>9s} {'ratio':>6s}")
    for name, instr, ref in large_tiles(core):
        sim = best_us(lambda: core.execute(instr), 20)
        direct = best_us(ref, 20)
        print(f"  {name:36s} {sim:9.1f} {direct:9.1f} {sim / direct:6.2f}")


if __name__ == "__main__":
    main()
