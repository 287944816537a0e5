"""FFT on the simulated core: DFT matrix products on TensorE (``torchneuron/ops/fft.py``).

Prints, per transform length (a batch of rows, fp32 / complex64):
  1. the simulated trn2 time per call (launch overhead included), its kernel launches, and the fraction of
     the TensorE fp32 roofline the DFT products reach (their FLOPs at fp32 peak, or their bytes once at DMA
     bandwidth, whichever is larger); beside it the fraction an FFT's 2.5 N log2 N real FLOPs per row would
     be of that time (how much of the work is the O(N^2) of a direct DFT);
  2. the accuracy: the largest error against a float64 FFT, relative to the rms output, for the device and
     for the CPU's FFT in fp32, and their ratio;
and the Whisper log-mel spectrogram (n_fft 400, hop 160, 80 mel bins) of 30 s of 16 kHz audio.
A benchmark reports; it does not assert.

Run:  python bench/fft.py [--quick]
"""
from __future__ import annotations

import math
import sys
import time
import warnings

import torch

from torchneuron import runtime
from torchneuron.runtime import profiler

warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")


def device_time(fn) -> tuple[float, int]:
    """(simulated ns, launches) of ``fn()`` on neuron (executed: the transform reads its input once)."""
    torch.neuron.synchronize()
    with profiler.record() as rs:
        fn()
    torch.neuron.synchronize()
    return sum(r.end_ns - r.start_ns for r in rs), len(rs)


def error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error against the float64 reference, relative to the reference's rms."""
    ref = ref.to(torch.complex128)
    return ((got.cpu().to(torch.complex128) - ref).abs().max() / ref.abs().pow(2).mean().sqrt()).item()


def transforms(quick: bool) -> None:
    spec = runtime.core(0).spec
    peak = spec.tensor_peak_flops("float32")
    bw = min(spec.hbm_bytes_per_second_per_core, spec.dma_bytes_per_second_per_core)
    rows = 128 if quick else 512
    lengths = (64, 400, 1024, 2048) if quick else (64, 256, 400, 1024, 2048, 4096, 16384)
    print(f"FFT of {rows} rows on the simulated {spec.name} core (time per call incl. launch overhead; roofline: "
          f"max(DFT-product FLOPs at fp32 peak {peak / 1e12:.0f} TFLOPS, bytes once at {bw / 1e9:.0f} GB/s))")
    print(f"  {'op':<6} {'N':>6} {'stages':>6} {'launches':>8} {'time us':>9} {'% roofline':>10} {'FFT flops %':>11}"
          f" {'err dev':>9} {'err cpu':>9} {'ratio':>6}   host s")
    from torchneuron.ops import fft as nfft
    for n in lengths:
        x = torch.randn(rows, n)
        ref = torch.fft.rfft(x.double())
        cpu = torch.fft.rfft(x)
        xn = x.to("neuron")
        t0 = time.perf_counter()
        ns, launches = device_time(lambda: torch.fft.rfft(xn))
        got = torch.fft.rfft(xn)
        host = time.perf_counter() - t0
        direct = n <= nfft.DIRECT_MAX or nfft._split(n) is None
        stages = 1 if direct else 2
        if direct:
            flops = 2 * rows * n * 2 * (n // 2 + 1)
        else:
            n1, n2 = nfft._split(n)
            flops = 2 * rows * n * 2 * n1 + 2 * rows * (2 * n) * 2 * n2
        nbytes = rows * n * 4 + rows * (n // 2 + 1) * 8
        bound = max(flops / peak, nbytes / bw) * 1e9
        fft_flops = rows * 2.5 * n * math.log2(n)
        e_dev, e_cpu = error(got, ref), error(cpu, ref)
        print(f"  {'rfft':<6} {n:>6} {stages:>6} {launches:>8} {ns / 1e3:>9.1f} {bound / ns:>10.1%} "
              f"{fft_flops / peak * 1e9 / ns:>11.2%} {e_dev:>9.2e} {e_cpu:>9.2e} {e_dev / e_cpu:>6.1f}   {host:6.1f}",
              flush=True)


def log_mel(quick: bool) -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    from tests.ops.test_fft import log_mel as features, mel_filters
    seconds = 3 if quick else 30
    audio = torch.randn(seconds * 16000) * 0.1
    filters = mel_filters(16000, 400, 80)
    an, fn = audio.to("neuron"), filters.to("neuron")
    t0 = time.perf_counter()
    ns, launches = device_time(lambda: features(an, fn))
    host = time.perf_counter() - t0
    spec = runtime.core(0).spec
    frames = seconds * 100 + 1
    flops = 2 * frames * 400 * 402 + 2 * 80 * 201 * frames
    bound = flops / spec.tensor_peak_flops("float32") * 1e9
    exp = features(audio, filters)[0]
    got = features(an, fn)[0].cpu()
    print(f"\nWhisper log-mel, {seconds} s of 16 kHz audio ({frames} frames of 400, 80 mel bins): {launches} launches,"
          f" {ns / 1e3:.1f} us simulated (TensorE fp32 bound of its two products {bound / 1e3:.1f} us: {bound / ns:.1%}),"
          f" max |neuron - cpu| {(got - exp).abs().max().item():.2e}; host {host:.1f} s")


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    torch.manual_seed(0)
    transforms(quick)
    log_mel(quick)
