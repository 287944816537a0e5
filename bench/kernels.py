"""Kernel library benchmark: simulated time (nki.profile, trn2), achieved TFLOPS or GB/s, fraction of the
modelled roofline, and host wall time, per kernel and shape. Prints figures; asserts nothing.

    .venv/bin/python bench/kernels.py            # full set (4096^3 matmul: ~20 s of host time)
    .venv/bin/python bench/kernels.py --quick    # smaller shapes
"""
from __future__ import annotations

import sys
import time

import torch

import torchneuron.nki.language as nl
from torchneuron import nki
from torchneuron.kernels import elementwise
from torchneuron.kernels.matmul import matmul_kernel
from torchneuron.kernels.norms import layer_norm_kernel
from torchneuron.kernels.reduction import reduce_kernel
from torchneuron.kernels.softmax import softmax_kernel
from torchneuron.kernels.transpose import permute_kernel

CHIP = "trn2"


def row(name, shape, rep, wall, target):
    unit = f"{rep.achieved_tflops:7.1f} TFLOPS" if rep.flops and rep.bound == "compute" else \
        f"{rep.achieved_gbps:7.1f} GB/s  "
    print(f"{name:<22} {shape:<22} {rep.device_time_ns / 1e3:10.1f} us  {unit}  roofline {rep.roofline_fraction:6.1%}"
          f"  ({rep.bound}, target {target})  host {wall:6.2f} s", flush=True)


def timed(fn):
    t = time.perf_counter()
    rep = fn()
    return rep, time.perf_counter() - t


def main(quick: bool) -> None:
    torch.manual_seed(0)
    print(f"chip {CHIP}: simulated device time per kernel launch (launch overhead excluded)")
    n = 2048 if quick else 4096
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    for ta in (True, False):
        rep, wall = timed(lambda: nki.profile(matmul_kernel, CHIP)(a, b, transpose_a=ta))
        row(f"matmul bf16 A{'[K,M]' if ta else '[M,K]'}", f"{n}x{n}x{n}", rep, wall, ">= 90% TensorE")
    m = 2048
    a2, b2 = torch.randn(m, m).bfloat16(), torch.randn(m, m).bfloat16()
    for ta in (True, False):
        rep, wall = timed(lambda: nki.profile(matmul_kernel, CHIP)(a2, b2, transpose_a=ta, transpose_b=True))
        row(f"matmul bf16 A{'[K,M]' if ta else '[M,K]'} B[N,K]", f"{m}x{m}x{m}", rep, wall, "-")
    a32, b32 = torch.randn(1024, 1024), torch.randn(1024, 1024)
    rep, wall = timed(lambda: nki.profile(matmul_kernel, CHIP)(a32, b32, transpose_a=True))
    row("matmul fp32 A[K,M]", "1024x1024x1024", rep, wall, "-")
    elems = (8 if quick else 32) * 1024 * 1024 // 4
    x, y = torch.randn(elems), torch.randn(elems)
    rep, wall = timed(lambda: elementwise(nl.add, x, y, profile=True, chip=CHIP))
    row("add fp32", f"2 x {elems * 4 >> 20} MiB", rep, wall, ">= 80% DMA")
    print(f"{'':<22} {'':<22} (DMA bandwidth of one core 368 GB/s: {rep.achieved_gbps / 368:.1%})")
    rows = 2048 if quick else 8192
    s = torch.randn(rows, 4096)
    rep, wall = timed(lambda: nki.profile(softmax_kernel, CHIP)(s))
    row("softmax fp32", f"{rows}x4096", rep, wall, ">= 60% HBM")
    w, bb = torch.randn(4096), torch.randn(4096)
    rep, wall = timed(lambda: nki.profile(layer_norm_kernel, CHIP)(s, w, bb))
    row("layer_norm fp32", f"{rows}x4096", rep, wall, ">= 60% HBM")
    long = torch.randn(rows // 16, 65536)      # rows beyond SBUF: the online two-pass path
    one_pass = 2 * long.numel() * 4            # bytes of one read + one write: the true lower bound
    rep, wall = timed(lambda: nki.profile(softmax_kernel, CHIP)(long))
    row("softmax fp32 long rows", f"{rows // 16}x65536", rep, wall, "x read twice")
    print(f"{'':<45} (of the one-read bound: {rep.roofline_fraction * one_pass / (rep.hbm_bytes_read + rep.hbm_bytes_written):.1%})")
    wl, bl = torch.randn(65536), torch.randn(65536)
    rep, wall = timed(lambda: nki.profile(layer_norm_kernel, CHIP)(long, wl, bl))
    row("layer_norm fp32 long", f"{rows // 16}x65536", rep, wall, "x read twice")
    print(f"{'':<45} (of the one-read bound: {rep.roofline_fraction * one_pass / (rep.hbm_bytes_read + rep.hbm_bytes_written):.1%})")
    r = torch.randn(1, 4096, 4096)             # reduce a non-last dim: [A, R, B] with R = 4096
    for op in ("sum", "max", "argmax"):
        rep, wall = timed(lambda: nki.profile(reduce_kernel, CHIP)(r, op=op))
        row(f"{op} fp32 dim 0", "4096x4096 -> 4096", rep, wall, "-")
    t = torch.randn(4096, 4096)
    rep, wall = timed(lambda: nki.profile(permute_kernel, CHIP)(t.reshape(-1), shape=(4096, 4096), perm=(1, 0)))
    row("transpose fp32", "4096x4096", rep, wall, "-")
    t = torch.randn(8, 64, 112 * 112)          # NCHW -> NHWC
    rep, wall = timed(lambda: nki.profile(permute_kernel, CHIP)(t.reshape(-1), shape=(8, 64, 12544), perm=(0, 2, 1)))
    row("permute fp32 NCHW>NHWC", "8x64x112x112", rep, wall, "-")


if __name__ == "__main__":
    main("--quick" in sys.argv)
