"""Eager mode on the simulated core: host cost and simulated device time, measured in one run.

Prints
  1. the host wall time of a GPT training step (the demo's model: forward, backward, gradient
     clipping, AdamW) on neuron against the CPU, as a ratio (target <= 3x), and the same ratio for
     a training step of each test model (tests/test_native_training.py's GPT in fp32 and under bf16
     autocast and its LSTM, tests/test_training.py's CNN and transformer; target <= 5x);
  2. the host cost of one small op whose kernel is cached (8x8 ``a + b``): the total per call,
     the part spent executing the kernel's instructions in the simulator, and the rest, which
     is dispatch (PyTorch dispatcher, lowering, kernel cache, launch bookkeeping), and the calling
     thread's CPU time per call (robust to other processes on a shared machine); target <= 20 us;
  3. the simulated trn2 time of one training step, its kernel launches, and the model FLOPs
     utilization that time implies on one core;
  4. a table of eager matrix products at large shapes (squares, an LLM MLP projection and the
     products its backward computes, attention's batched products) in bf16 and fp32: kernel
     launches per call, simulated time, TFLOPS, % of TensorE peak and % of the op's roofline
     (the larger of its FLOPs at peak and its operands and result moved once at DMA bandwidth).
     These shapes are far too large to execute on the host, so the table is measured under
     ``runtime.timing_only()``: each launch is traced and scheduled as usual (the schedule does
     not depend on the data) but its instructions are not executed;
  5. the other heavy ops (convolution, attention, norms, softmax, cross-entropy, fused AdamW) at large
     shapes as % of their roofline, measured the same way (target >= 70%).
A benchmark reports; it does not assert.

Host times are taken with torch on one intra-op thread unless ``--threads`` says otherwise.

Run:  python bench/eager.py [--steps 5] [--threads 1] [--only products|host] [--size quick|default|full]   (``make bench``)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch

import torchneuron
from torchneuron import runtime
from torchneuron.runtime import profiler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import shakespeare_gpt as demo  # noqa: E402  (the demo's model and training step)

TESTS = Path(__file__).resolve().parent.parent / "tests"

warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")


def training_setup(device: torch.device, cfg: demo.Config, batches: list) -> tuple:
    """The demo's model and AdamW on ``device``, and a function running one training step."""
    model = demo.build_model(cfg, 0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    def loss_of(i: int) -> torch.Tensor:
        x, y = (t.to(device) for t in batches[i % len(batches)])
        return model(x, y)[1]
    return model, training_step(loss_of, opt, clip=model.parameters())


def training_step(loss_of: Callable[[int], torch.Tensor], opt: torch.optim.Optimizer,
                  clip: Iterable[torch.Tensor] | None = None) -> Callable[[int], float]:
    """Step i of a training loop: ``loss_of(i)``, its backward, gradients clipped to norm 1 (of ``clip``, if
    given), the optimizer's step; returns the loss."""
    params = None if clip is None else list(clip)

    def step(i: int) -> float:
        loss = loss_of(i)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if params is not None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()
    return step


def time_steps(steps: dict, n: int) -> tuple[dict, dict]:
    """Per device, the median host wall seconds per step and the least process CPU seconds per step
    (the devices alternating; CPU time is what a shared, loaded machine distorts least)."""
    wall: dict = {k: [] for k in steps}
    cpu: dict = {k: [] for k in steps}
    for i in range(n):
        for name, fn in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn(i)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {k: statistics.median(v) for k, v in wall.items()}, {k: min(v) for k, v in cpu.items()}


def _test_module(name: str):
    """A test module of the repository, imported for its model classes."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module(name)


def model_step_builders() -> dict[str, Callable[[torch.device], Callable[[int], float]]]:
    """Per test model, a function building it on a device (same seed on every device) and returning its
    training step (the test's loss, backward, optimizer step; its own batch shapes)."""
    native, training = _test_module("test_native_training"), _test_module("test_training")
    F = torch.nn.functional

    def gpt(autocast: bool) -> Callable[[torch.device], Callable[[int], float]]:
        def build(device: torch.device) -> Callable[[int], float]:
            torch.manual_seed(0)
            model = native.TinyGPT().to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
            batches = [torch.randint(0, 40, (4, 17), generator=torch.Generator().manual_seed(i)) for i in range(4)]

            def loss_of(i: int) -> torch.Tensor:
                idx = batches[i % len(batches)]
                x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)
                with torch.autocast(device.type, torch.bfloat16) if autocast else contextlib.nullcontext():
                    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            return training_step(loss_of, opt, clip=model.parameters())
        return build

    def lstm(device: torch.device) -> Callable[[int], float]:
        torch.manual_seed(0)
        model = native.SeqModel().to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(2)
        batches = [(torch.randn(4, 9, 6, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(4)]

        def loss_of(i: int) -> torch.Tensor:
            x, y = batches[i % len(batches)]
            return F.mse_loss(model(x.to(device)), y.to(device))
        return training_step(loss_of, opt)

    def case(name: str) -> Callable[[torch.device], Callable[[int], float]]:
        model_class, make_batches, loss_fn = training.CASES[name]

        def build(device: torch.device) -> Callable[[int], float]:
            torch.manual_seed(0)
            model = model_class().to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=training.LR, weight_decay=0.05)
            batches = make_batches(torch.Generator().manual_seed(1))[:4]

            def loss_of(i: int) -> torch.Tensor:
                x, y = batches[i % len(batches)]
                return loss_fn(model, x.to(device), y.to(device))
            return training_step(loss_of, opt)
        return build

    return {"TinyGPT fp32": gpt(False), "TinyGPT bf16 autocast": gpt(True), "LSTM (2 layers)": lstm,
            "SmallCNN": case("cnn"), "TinyTransformerLM": case("transformer")}


def models_table(n: int) -> None:
    """Print each test model's training step on neuron against the CPU (host wall and process CPU time)."""
    print(f"\ntest models' training steps, host time per step (wall: median of {n}; CPU: least of {n}; "
          f"target <= 5x):")
    print(f"  {'model':<22} {'neuron ms':>10} {'cpu ms':>8} {'ratio':>6}   {'CPU-time ratio':>14}")
    for name, build in model_step_builders().items():
        steps = {"neuron": build(torch.device("neuron")), "cpu": build(torch.device("cpu"))}
        for i in range(2):   # warm-up: traces every kernel once
            for fn in steps.values():
                fn(i)
        wall, cpu = time_steps(steps, n)
        print(f"  {name:<22} {wall['neuron'] * 1e3:>10.1f} {wall['cpu'] * 1e3:>8.1f} "
              f"{wall['neuron'] / wall['cpu']:>5.1f}x   {cpu['neuron'] / cpu['cpu']:>13.1f}x", flush=True)


def small_op_cost(reps: int = 2000, rounds: int = 5) -> tuple[float, float, float, float]:
    """(total, instruction execution, dispatch, thread CPU) host microseconds of one cached 8x8 ``a + b``:
    the round of ``reps`` calls with the least total (a shared machine only ever adds time); the thread's
    CPU time per call is the least over the rounds (what another process's load distorts least)."""
    a, b = torch.randn(8, 8, device="neuron"), torch.randn(8, 8, device="neuron")
    for _ in range(200):
        a + b
    core = runtime.core(0)
    spent = [0.0]
    run_bound = core.run_bound

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run_bound(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    core.run_bound = timed
    best, cpu = None, None
    try:
        for _ in range(rounds):
            spent[0] = 0.0
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(reps):
                a + b
            total = (time.perf_counter() - start) / reps * 1e6
            used = (time.thread_time() - start_cpu) / reps * 1e6
            cpu = used if cpu is None else min(cpu, used)
            sim = spent[0] / reps * 1e6
            if best is None or total < best[0]:
                best = (total, sim, total - sim)
    finally:
        del core.run_bound
    return (*best, cpu)


def _bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


SIZES = {  # squares; tokens, model width, MLP width, a long contraction; (heads, sequence, head dim) per attention shape
    "quick": ((1024, 2048), (2048, 1024, 3584, 8192), ((8, 1024, 128), (8, 1024, 64))),
    "default": ((1024, 2048, 4096), (2048, 4096, 11008, 11008), ((16, 2048, 128), (16, 2048, 64), (32, 512, 64))),
    "full": ((1024, 2048, 4096, 8192), (8192, 4096, 14336, 14336), ((32, 2048, 128), (16, 4096, 64), (64, 512, 128))),
}


TM = 128   # TensorE's stationary tile (rows of A per transpose)


def _transposed_a_floor(batch: int, M: int, K: int, N: int, dtype: torch.dtype) -> float:
    """Seconds TensorE needs for ``A @ B`` with A given as [M, K] (attention's P @ V): every 128 x 128 block of A
    is transposed on TensorE before its matmul (the model's cycles for both: ``sim/timing.tensor_cycles``)."""
    t = runtime.core(0).spec.tensor
    fp32 = dtype == torch.float32
    transpose = max(TM, min(t.mm_init_latency_cycles, TM)) * (t.fp32_transpose_factor if fp32 else 1)
    matmul = max(min(t.mm_init_latency_cycles, TM), min(N, 512)) * (t.fp32_factor if fp32 else 1)
    blocks = batch * -(-M // TM) * -(-K // TM) * -(-N // 512)
    return blocks * (transpose + matmul) / t.clock_hz


def _short_k_floor(batch: int, L: int, d: int, dtype: torch.dtype) -> float:
    """Seconds TensorE needs for ``Q @ K.T`` with Q, K given as [L, d] (a head dim d <= 128): each 128-row block of
    Q and of K transposed once, then [128, 512] output tiles at one column per cycle (a head dim of 64 in PE-array
    row halves, two at a time)."""
    t = runtime.core(0).spec.tensor
    fp32 = dtype == torch.float32
    transposes = 2 * -(-L // TM) * TM * (t.fp32_transpose_factor if fp32 else 1)
    tile = 512 * (t.fp32_factor if fp32 else 1) * (0.5 if d <= 64 else 1)
    return batch * (transposes + -(-L // TM) * -(-L // 512) * tile) / t.clock_hz


def product_cases(dtype: torch.dtype, size: str) -> list[tuple[str, str, Callable, int, int, float]]:
    """(op, shape, call, FLOPs, bytes of operands and result, seconds of TensorE work the operand layout adds or 0)
    per matrix product of the table."""
    def mk(*shape: int) -> torch.Tensor:   # contents never read: the table only schedules
        return torch.empty(shape, dtype=dtype, device="neuron")
    squares, (T, D, F, KL), attention = SIZES[size]
    cases = []
    for n in squares:
        a, b = mk(n, n), mk(n, n)
        cases.append(("mm", f"{n}x{n} @ {n}x{n}", lambda a=a, b=b: torch.mm(a, b), 2 * n ** 3, 3 * _bytes(a), 0.0))
    x, w, bias, dy = mk(T, D), mk(F, D), mk(F), mk(T, F)
    fl, io = 2 * T * D * F, _bytes(x, w, dy)
    cases += [
        ("linear", f"x {T}x{D}, W {F}x{D}", lambda: torch.nn.functional.linear(x, w), fl, io, 0.0),
        ("linear+bias", f"x {T}x{D}, W {F}x{D}", lambda: torch.nn.functional.linear(x, w, bias), fl, io, 0.0),
        ("matmul dy@W", f"{T}x{F} @ {F}x{D}", lambda: dy @ w, fl, io, 0.0),
        ("matmul dy.T@x", f"({T}x{F}).T @ {T}x{D}", lambda: dy.t() @ x, fl, io, 0.0),
    ]
    xl, wl = mk(T, KL), mk(D, KL)   # a contraction past what one pass keeps in SBUF (fp32): K chunks, one launch
    cases.append(("linear long K", f"x {T}x{KL}, W {D}x{KL}", lambda: torch.nn.functional.linear(xl, wl),
                  2 * T * KL * D, _bytes(xl, wl) + T * D * xl.element_size(), 0.0))
    for n, (B, S, hd) in enumerate(attention):
        q, k, v, p = mk(B, S, hd), mk(B, S, hd), mk(B, S, hd), mk(B, S, S)
        fl, io = 2 * B * S * S * hd, _bytes(q, k, p)
        cases += [
            ("bmm q@k.T", f"{B}x{S}x{hd} @ ({B}x{S}x{hd}).T", lambda q=q, k=k: torch.bmm(q, k.transpose(1, 2)), fl, io,
             _short_k_floor(B, S, hd, dtype)),
            ("bmm p@v", f"{B}x{S}x{S} @ {B}x{S}x{hd}", lambda p=p, v=v: torch.bmm(p, v), fl, io,
             _transposed_a_floor(B, S, S, hd, dtype)),
            ("bmm p.T@dO", f"({B}x{S}x{S}).T @ {B}x{S}x{hd}", lambda p=p, v=v: torch.bmm(p.transpose(1, 2), v), fl,
             io, 0.0),
        ]
        if n == 0:
            cases.append(("baddbmm", f"{B}x{S}x{hd} @ ({B}x{S}x{hd}).T",
                          lambda p=p, q=q, k=k: torch.baddbmm(p, q, k.transpose(1, 2)), fl, _bytes(q, k, p, p), 0.0))
    return cases


def products_table(size: str) -> None:
    """Print the matrix-product table (simulated trn2 time per op call, launch overhead included)."""
    spec = runtime.core(0).spec
    bw = min(spec.hbm_bytes_per_second_per_core, spec.dma_bytes_per_second_per_core)
    print(f"\neager matrix products on the simulated {spec.name} core (time per op call incl. launch overhead; "
          f"roofline: max(FLOPs at peak, bytes once at {bw / 1e9:.0f} GB/s); % achievable: against the roofline or "
          f"the TensorE time the layout needs, whichever is longer (Q @ K.T: Q and K, P @ V: P transposed on TensorE); a "
          f"head dim of 64 fills half the PE rows, its matmuls alternate row halves (PE tiling), so peak stays the "
          f"bound):")
    print(f"  {'op':<14} {'dtype':<8} {'shape':<32} {'launches':>8} {'time us':>10} {'TFLOPS':>7} "
          f"{'% peak':>7} {'% roofline':>10} {'% achievable':>12}   host s")
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        peak = spec.tensor_peak_flops(name)
        for op, shape, fn, flops, nbytes, floor in product_cases(dtype, size):
            t0 = time.perf_counter()
            with runtime.timing_only(), profiler.record() as rs:
                fn()
            host = time.perf_counter() - t0
            ns = sum(r.end_ns - r.start_ns for r in rs)
            bound = max(flops / peak, nbytes / bw) * 1e9
            achievable = f"{max(bound, floor * 1e9) / ns:>12.1%}" if floor else f"{'':>12}"
            print(f"  {op:<14} {name:<8} {shape:<32} {len(rs):>8} {ns / 1e3:>10.1f} "
                  f"{flops / ns / 1e3:>7.1f} {flops / ns / peak * 1e9:>7.1%} {bound / ns:>10.1%} {achievable}   "
                  f"{host:6.1f}", flush=True)


def heavy_cases(size: str) -> list[tuple[str, str, Callable, Callable, float, int, str]]:
    """(op, shape, setup, measured call, FLOPs, bytes moved at least once, peak dtype) per heavy op of the table:
    ``setup()`` runs first (unmeasured: a forward whose backward is measured), then the measured call."""
    bf, f32 = torch.bfloat16, torch.float32
    big = size != "quick"

    def mk(*shape: int, dtype: torch.dtype = bf, grad: bool = False) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="neuron").requires_grad_(grad)

    def nbytes(*ts: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in ts)
    cases = []
    N, C, H = (8, 128, 56) if big else (2, 64, 28)                       # conv: batch, channels, height = width
    x, w, gy = mk(N, C, H, H), mk(C, C, 3, 3), mk(N, C, H, H)
    fl = 2 * N * C * H * H * C * 9
    cases.append(("conv2d 3x3", f"{N}x{C}x{H}x{H}, {C} filters", lambda: None,
                  lambda: torch.nn.functional.conv2d(x, w, padding=1), fl, nbytes(x, w, gy), "bfloat16"))
    cases.append(("conv2d bwd", f"{N}x{C}x{H}x{H}, {C} filters", lambda: None,
                  lambda: torch.ops.aten.convolution_backward(gy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                              [True, True, False]),
                  2 * fl, nbytes(x, w, gy, x, w), "bfloat16"))
    Hh, S, D = (16, 2048, 128) if big else (4, 512, 64)                   # attention: heads, sequence, head dim
    q, k, v, go = mk(1, Hh, S, D, grad=True), mk(1, Hh, S, D, grad=True), mk(1, Hh, S, D, grad=True), mk(1, Hh, S, D)
    att = 4 * Hh * S * S * D
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases.append(("attention fwd", f"{Hh} heads x {S} x {D}", lambda: None, lambda: sdpa(q, k, v), att,
                  4 * nbytes(q), "bfloat16"))
    held = {}
    cases.append(("attention bwd", f"{Hh} heads x {S} x {D}", lambda: held.update(o=sdpa(q, k, v)),
                  lambda: held.pop("o").backward(go), 2.5 * att, 8 * nbytes(q), "bfloat16"))
    T, Dm, V = (8192, 4096, 32000) if big else (1024, 1024, 8000)       # tokens, width, vocabulary
    xs, wn, bn = mk(T, Dm), mk(Dm), mk(Dm)
    cases += [
        ("layer_norm", f"{T}x{Dm}", lambda: None, lambda: torch.nn.functional.layer_norm(xs, (Dm,), wn, bn), 0,
         2 * nbytes(xs), "bfloat16"),
        ("rms_norm", f"{T}x{Dm}", lambda: None, lambda: torch.nn.functional.rms_norm(xs, (Dm,), wn), 0,
         2 * nbytes(xs), "bfloat16"),
        ("softmax", f"{T}x{Dm}", lambda: None, lambda: torch.softmax(xs, -1), 0, 2 * nbytes(xs), "bfloat16"),
    ]
    xg, wg = mk(T, Dm, grad=True), mk(Dm, grad=True)   # backward: x and dy read, dx written
    cases.append(("rms_norm bwd", f"{T}x{Dm}", lambda: held.update(r=torch.nn.functional.rms_norm(xg, (Dm,), wg)),
                  lambda: held.pop("r").backward(xs), 0, 3 * nbytes(xs), "bfloat16"))
    logits = mk(T // 2, V, grad=True)
    target = torch.zeros(T // 2, dtype=torch.int64).to("neuron")   # (written by a transfer: valid classes)
    ce = torch.nn.functional.cross_entropy
    cases.append(("cross_entropy", f"{T // 2}x{V}", lambda: None, lambda: ce(logits, target), 0, nbytes(logits),
                  "bfloat16"))
    cases.append(("cross_entropy bwd", f"{T // 2}x{V}", lambda: held.update(l=ce(logits, target)),
                  lambda: held.pop("l").backward(), 0, 2 * nbytes(logits), "bfloat16"))
    P = (4, 4096, 4096) if big else (4, 1024, 1024)                     # AdamW: fp32 parameters
    params = [mk(*P[1:], dtype=f32, grad=True) for _ in range(P[0])]
    for p in params:
        p.grad = mk(*P[1:], dtype=f32)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for p in params:   # the state of a later step (its step count written by a transfer: read on the host)
        opt.state[p] = {"step": torch.tensor(3.0).to("neuron"), "exp_avg": mk(*P[1:], dtype=f32),
                        "exp_avg_sq": mk(*P[1:], dtype=f32)}
    n = sum(p.numel() for p in params)
    cases.append(("AdamW fused", f"{P[0]} x {P[1]}x{P[2]} fp32", lambda: None, opt.step, 0, 7 * 4 * n, "float32"))
    return cases


def heavy_table(size: str) -> None:
    """Print the other heavy ops as % of their roofline bound (simulated, launch overhead included)."""
    spec = runtime.core(0).spec
    bw = min(spec.hbm_bytes_per_second_per_core, spec.dma_bytes_per_second_per_core)
    print(f"\nother heavy eager ops (bf16 unless stated; roofline: max(FLOPs at TensorE peak, bytes once at "
          f"{bw / 1e9:.0f} GB/s); target >= 70%):")
    print(f"  {'op':<18} {'shape':<30} {'launches':>8} {'time us':>10} {'bound us':>9} {'% roofline':>10}   host s")
    for op, shape, setup, fn, flops, nbytes, dt in heavy_cases(size):
        t0 = time.perf_counter()
        try:
            with runtime.timing_only(), _range_flags_unread():
                setup()
                with profiler.record() as rs:
                    fn()
        except Exception as e:   # a benchmark reports what fails and goes on
            print(f"  {op:<18} {shape:<30} fails: {type(e).__name__}: {str(e).splitlines()[0][:90]}", flush=True)
            continue
        host = time.perf_counter() - t0
        ns = sum(r.end_ns - r.start_ns for r in rs)
        bound = max(flops / spec.tensor_peak_flops(dt), nbytes / bw) * 1e9
        print(f"  {op:<18} {shape:<30} {len(rs):>8} {ns / 1e3:>10.1f} {bound / 1e3:>9.1f} {bound / ns:>10.1%}   "
              f"{host:6.1f}", flush=True)
        if len(rs) > 1:          # where a multi-launch op's time goes
            print(f"  {'':<18} = " + " + ".join(f"{r.name} {(r.end_ns - r.start_ns) / 1e3:.0f}" for r in rs), flush=True)


@contextlib.contextmanager
def _range_flags_unread():
    """Under ``timing_only`` no instruction writes data, so a kernel's out-of-range flags (nll_loss's and the fused
    cross-entropy's target counts) read back garbage: the check that raises IndexError on them is skipped while measuring."""
    nn_ops = importlib.import_module("torchneuron.ops.nn")
    check = nn_ops._raise_bad_target
    nn_ops._raise_bad_target = lambda *args: None
    try:
        yield
    finally:
        nn_ops._raise_bad_target = check


def main() -> None:
    """Measure and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per device")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for the whole run (default 1: both devices' host work on one "
                             "thread, the neuron device's is mostly single-threaded anyway; on a shared machine a "
                             "CPU reference with more threads than free cores measures the scheduler, not the work)")
    parser.add_argument("--only", choices=("host", "products", "heavy"), help="print only this part")
    parser.add_argument("--size", choices=tuple(SIZES), default="default",
                        help="shapes of the matrix products (full: squares to 8192, an 8192-token LLM MLP; "
                             "tens of minutes of host time)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only in (None, "products"):
        products_table(args.size)
    if args.only in (None, "heavy"):
        heavy_table(args.size)
    if args.only in ("products", "heavy"):
        return
    torch.manual_seed(0)
    cfg = demo.Config(vocab_size=65)
    data = torch.randint(0, 65, (20000,))
    batches = demo.make_batches(data, cfg, 0)[:8]
    neuron, cpu = torch.device("neuron"), torch.device("cpu")
    model, step_neuron = training_setup(neuron, cfg, batches)
    _, step_cpu = training_setup(cpu, cfg, batches)
    torchneuron.reset_fallback_counts()
    for i in range(2):  # warm-up: traces every kernel once
        step_neuron(i)
        step_cpu(i)
    med, least_cpu = time_steps({"neuron": step_neuron, "cpu": step_cpu}, args.steps)
    print(f"GPT training step ({cfg.n_layer} layers, d_model {cfg.d_model}, batch {cfg.batch_size}x{cfg.block_size}), "
          f"host wall time, median of {args.steps}:")
    print(f"  neuron {med['neuron'] * 1e3:8.1f} ms   cpu {med['cpu'] * 1e3:8.1f} ms   "
          f"ratio {med['neuron'] / med['cpu']:.1f}x (target <= 3x)")
    print(f"  process CPU time, least of {args.steps}: neuron {least_cpu['neuron'] * 1e3:.1f} ms   "
          f"cpu {least_cpu['cpu'] * 1e3:.1f} ms   ratio {least_cpu['neuron'] / least_cpu['cpu']:.1f}x")
    fb = sum(torchneuron.fallback_counts().values())
    print(f"  CPU fallbacks in the neuron steps: {fb}; eager kernel programs cached: {torchneuron.ops.cache_size()}")

    models_table(args.steps)

    total, sim, dispatch, cpu = small_op_cost()
    print("\nsmall op with a cached kernel (8x8 a + b), host time per call (least of 5 rounds):")
    print(f"  total {total:6.1f} us = instruction execution {sim:6.1f} us + dispatch {dispatch:6.1f} us "
          f"(target <= 20 us); thread CPU time {cpu:6.1f} us")

    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    with profiler.record() as records:
        start.record()
        step_neuron(0)
        end.record()
    device_ms = start.elapsed_time(end)
    spec = runtime.core(0).spec
    n_params = sum(p.numel() for p in model.parameters())
    flops = demo.step_flops(cfg, n_params)
    busy = sum(r.device_time_ns for r in records) / 1e6
    print(f"\nsimulated {spec.name} training step: {device_ms:.3f} ms over {len(records)} kernel launches "
          f"({busy:.3f} ms executing kernels, the rest launch overhead)")
    print(f"  model FLOPs {flops / 1e9:.3f} GFLOP -> MFU {flops / (device_ms * 1e-3) / spec.tensor_peak_flops('float32'):.2%} "
          f"of one core's fp32 TensorE peak")


if __name__ == "__main__":
    main()
