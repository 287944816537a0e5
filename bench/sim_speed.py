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
* Large tiles: host time of one instruction divided by the time of the equivalent torch
  call on ordinary contiguous tensors (1.0 = no simulator overhead).

Run: ``.venv/bin/python bench/sim_speed.py``. Timings are the best of several repeats.
"""
from __future__ import annotations

import math
import time
from typing import Callable

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


def main() -> None:
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

    core = NeuronCore("trn2")
    print("\nLarge tiles ([128, 2048] unless named): simulator host time vs the same torch op")
    print(f"  {'instruction':36s} {'sim us':>9s} {'torch us':>9s} {'ratio':>6s}")
    for name, instr, ref in large_tiles(core):
        sim = best_us(lambda: core.execute(instr), 20)
        direct = best_us(ref, 20)
        print(f"  {name:36s} {sim:9.1f} {direct:9.1f} {sim / direct:6.2f}")


if __name__ == "__main__":
    main()
