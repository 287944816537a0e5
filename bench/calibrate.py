"""Calibration of the timing model: public NKI kernels and microbenchmarks whose Trainium timings are
published, simulated on the matching chip model, each against its published figure.

    .venv/bin/python bench/calibrate.py               # every case at the published shapes (hours of host time)
    .venv/bin/python bench/calibrate.py --quick       # the cases that take seconds
    .venv/bin/python bench/calibrate.py --only mamba  # cases whose name contains a word
    .venv/bin/python bench/calibrate.py --reduced     # the large kernels on 1/8 of their outer loop (~15 min)

Prints, per case, simulated vs published time and their ratio, then one summary line over the tuned cases
(geometric-mean error, worst ratio) and one over the held-out cases, which were not looked at while the model's
parameters were chosen. docs/hardware-model.md ("Calibration") lists the cases with their sources.

The public kernels are not part of this repository: they are read at run time from a git copy of
``aws-neuron/aws-neuron-sdk`` (``--sdk PATH`` or ``TORCHNEURON_NKI_SDK``; otherwise a copy next to this checkout is
looked for) at the commits that published the figures, and traced with TorchNeuron's NKI
(``torchneuron.nki.install_import_aliases``). Cases whose source cannot be found are reported as skipped. The
microbenchmarks are our own small kernels that do what the published measurement describes.

Only the schedule is computed (the kernels are traced, not executed: the figures are times, not values).
``--reduced`` runs the large kernels over 1/8 of the outermost loop whose iterations are independent (M or N of
the matmuls, the channels of Mamba) and multiplies the time by 8: the loop body is the same, so the time scales
with its trip count up to the kernel's ramp-up and drain (microseconds against milliseconds). The table says
which figures were measured so.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import textwrap
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from torchneuron import nki
from torchneuron.sim.memory import SimulatorError
from torchneuron.sim.specs import ChipSpec, chip_spec

# aws-neuron/aws-neuron-sdk commits holding the published figures and the kernels they were measured with.
TUTORIALS_COMMIT = "4eba310fef29e52e4924ae31c3adb0229f3e834e"   # Neuron SDK 2.23 (general/nki/...)
CURRENT_COMMIT = "81ce03ae261e12925e53437a0f690478e6366155"     # NKI 0.6 docs (nki/...)
MM_KERNELS = "general/nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py"
MAMBA_KERNELS = "general/nki/examples/fused_mamba/mamba_nki_kernels.py"
KOPT_PAGE = "nki/guides/tutorials/kernel-optimization.rst"


@dataclass(frozen=True)
class Case:
    """One published measurement and how to reproduce it on the simulator."""

    name: str
    chip: str
    published_ns: float
    source: str                       # document (and section) of the figure
    what: str                         # kernel, shapes, dtypes
    measure: Callable[[ChipSpec, "Sdk", int], float]   # simulated ns; the int: 1, or 8 for --reduced
    held_out: bool = False
    quick: bool = False               # seconds of host time


# ---------------------------------------------------------------------------------------------------------------
# the public sources
# ---------------------------------------------------------------------------------------------------------------
class Sdk:
    """Read-only access to a git copy of aws-neuron/aws-neuron-sdk."""

    def __init__(self, git_dir: Path | None):
        self.git_dir = git_dir
        self._modules: dict[tuple[str, str], types.ModuleType] = {}

    def show(self, commit: str, path: str) -> str:
        """The text of ``path`` at ``commit``."""
        if self.git_dir is None:
            raise FileNotFoundError("no copy of aws-neuron/aws-neuron-sdk (pass --sdk or set TORCHNEURON_NKI_SDK)")
        out = subprocess.run(["git", "--git-dir", str(self.git_dir), "show", f"{commit}:{path}"],
                             capture_output=True, text=True)
        if out.returncode:
            raise FileNotFoundError(f"{commit[:8]}:{path} not in {self.git_dir}: {out.stderr.strip()}")
        return out.stdout

    def module(self, commit: str, path: str, source: str | None = None) -> types.ModuleType:
        """Execute a kernel file (or ``source`` taken from it) as a module, NKI imports aliased to TorchNeuron's."""
        key = (commit, path if source is None else f"{path}#{hash(source)}")
        if key not in self._modules:
            nki.install_import_aliases()
            text = self.show(commit, path) if source is None else source
            mod = types.ModuleType(Path(path).stem)
            mod.__file__ = f"{commit[:8]}/{path}"
            exec(compile(text, mod.__file__, "exec"), mod.__dict__)
            self._modules[key] = mod
        return self._modules[key]

    def rst_kernel(self, commit: str, path: str, nth: int) -> types.ModuleType:
        """The ``nth`` Python code block of an .rst page that defines an ``@nki.jit`` kernel, as a module."""
        blocks, lines, i = [], self.show(commit, path).splitlines(), 0
        while i < len(lines):
            if re.match(r"\s*\.\. code-block:: python\s*$", lines[i]):
                indent = len(lines[i]) - len(lines[i].lstrip())
                body, i = [], i + 1
                while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                    body.append(lines[i])
                    i += 1
                code = textwrap.dedent("\n".join(body))
                if "@nki.jit" in code:
                    blocks.append(code)
            else:
                i += 1
        # the page sets NEURON_PLATFORM_TARGET_OVERRIDE for the real compiler; the chip is ours to choose here
        code = "\n".join(ln for ln in blocks[nth].splitlines() if "os.environ" not in ln)
        return self.module(commit, path, code)


def find_sdk(explicit: str | None) -> Path | None:
    """The git directory of a copy of aws-neuron/aws-neuron-sdk: --sdk, TORCHNEURON_NKI_SDK, or one near here."""
    here = Path(__file__).resolve().parent.parent
    given = explicit or os.environ.get("TORCHNEURON_NKI_SDK")
    candidates = [given] if given else []          # a path given is the only one looked at
    for base in () if given else (here.parent, here.parent.parent):
        candidates += [base / ".mirror" / "aws-neuron+aws-neuron-sdk" / "repo", base / "aws-neuron-sdk"]
    for c in candidates:
        if not c:
            continue
        p = Path(c)
        for git_dir in (p / ".git", p):
            if (git_dir / "HEAD").is_file() and (git_dir / "objects").is_dir():
                return git_dir
    return None


# ---------------------------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------------------------
def kernel_ns(kernel, args: tuple, spec: ChipSpec, **kwargs) -> float:
    """Simulated device time of one launch (trace and schedule only; launch overhead excluded)."""
    traced = kernel.trace(args, kwargs, spec)
    return traced.program.schedule(spec).device_time_ns


def empty(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def matmul_args(m_div: int, n_div: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """lhsT [8192, 4096 / m_div] and rhs [8192, 8192 / n_div]: the tutorials' [4096,8192] @ [8192,8192]."""
    return empty(8192, 4096 // m_div, dtype=dtype), empty(8192, 8192 // n_div, dtype=dtype)


def mm_tutorial(kernel_name: str, n_outer: bool = False) -> Callable[[ChipSpec, Sdk, int], float]:
    """The NKI matmul tutorial's benchmark, bf16 (``n_outer``: the kernel's outermost loop is over N)."""
    def measure(spec: ChipSpec, sdk: Sdk, div: int) -> float:
        k = getattr(sdk.module(TUTORIALS_COMMIT, MM_KERNELS), kernel_name)
        args = matmul_args(1 if n_outer else div, div if n_outer else 1, torch.bfloat16)
        return div * kernel_ns(k, args, spec)
    return measure


def kopt_tutorial(nth: int, n_outer: bool = False,
                  dtype: torch.dtype = torch.float32) -> Callable[[ChipSpec, Sdk, int], float]:
    """The kernel-optimization guide's matmul versions (fp32 there; bf16 as the matmul tutorial's algorithm)."""
    def measure(spec: ChipSpec, sdk: Sdk, div: int) -> float:
        k = sdk.rst_kernel(CURRENT_COMMIT, KOPT_PAGE, nth).matrix_multiply_kernel
        args = matmul_args(1 if n_outer else div, div if n_outer else 1, dtype)
        return div * kernel_ns(k, args, spec)
    return measure


def mamba(version: str, channels: int, seq_len: int) -> Callable[[ChipSpec, Sdk, int], float]:
    """The fused Mamba tutorial's kernels, fp32, batch 1, state size 16 (``div`` divides the channels)."""
    def measure(spec: ChipSpec, sdk: Sdk, div: int) -> float:
        k = getattr(sdk.module(TUTORIALS_COMMIT, MAMBA_KERNELS), version)
        b, s, c = 1, 16, max(128, channels // div)
        args = (empty(b, c, seq_len), empty(b, c, seq_len), empty(c, s), empty(b, s, seq_len), empty(b, s, seq_len))
        return channels / c * kernel_ns(k, args, spec)
    return measure


def dma_single_engine(spec: ChipSpec, sdk: Sdk, div: int = 1) -> float:
    """DMAO example 1: a [4, 4096] bf16 HBM->SBUF load (one DMA engine); the engine's busy time for it."""
    from torchneuron.sim.timing import dma_cost
    import torchneuron.nki.isa as nisa
    import torchneuron.nki.language as nl

    @nki.jit
    def load4(x):
        t = nl.ndarray((4, 4096), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        out = nl.ndarray((4, 1), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t[:, 0:1])
        return out

    prog = load4.trace((empty(4, 4096, dtype=torch.bfloat16),), {}, spec).program
    load = next(i for i in prog.instructions if i.cost_inputs().dma_bytes == 4 * 4096 * 2)
    return dma_cost(load.cost_inputs(), spec).engine_ns


def dependent_activations(spec: ChipSpec, sdk: Sdk, div: int = 1) -> float:
    """PG Opt #5a: back-to-back IDENTITY activations on 1 element per partition, each reading the previous
    one's output; the interval between consecutive instructions (steady state)."""
    import torchneuron.nki.isa as nisa
    import torchneuron.nki.language as nl
    n = 64

    @nki.jit
    def chain(x):
        a = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        for i in range(n):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            nisa.activation(dst=dst, op=nl.copy, data=src)
        out = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a)
        return out

    prog = chain.trace((empty(128, 1),), {}, spec).program
    tl = prog.schedule(spec)
    starts = [tl.start_ns[i] for i, ins in enumerate(prog.instructions) if ins.cost_inputs().opcode == "activation"]
    return (starts[-1] - starts[len(starts) // 2]) / (len(starts) - 1 - len(starts) // 2)


# ---------------------------------------------------------------------------------------------------------------
# the cases
# ---------------------------------------------------------------------------------------------------------------
_MMT = "general/nki/tutorials/matrix_multiplication.rst @4eba310f, 'Testing Correctness and Benchmarking' table"
_MAMBA = "general/nki/tutorials/fused_mamba.rst @4eba310f"
_KOPT = "nki/guides/tutorials/kernel-optimization.rst @81ce03ae, profile nki/img/how-to/{}-full.png"
_MM_SHAPE = "[4096,8192] @ [8192,8192] bf16"
_KOPT_SHAPE = "[4096,8192] @ [8192,8192] fp32"

CASES: list[Case] = [
    Case("DMA one engine 32 KiB", "trn2", 1416.0, "nki/get-started/about/nki-dma-overview.rst @81ce03ae, example 1",
         "[4, 4096] bf16 HBM->SBUF, one engine's transfer", dma_single_engine, quick=True),
    Case("dependent 1-elem activations", "trn1", 189.0, "nki/deep-dives/nki_perf_guide.rst @81ce03ae, Opt #5a",
         "[128, 1] fp32 IDENTITY chain, interval", dependent_activations, quick=True),
    Case("mm tutorial tiled", "trn1", 51.80e6, _MMT, _MM_SHAPE + ", nki_matmul_tiled_", mm_tutorial("nki_matmul_tiled_")),
    Case("mm tutorial opt1 hoist", "trn1", 42.96e6, _MMT, _MM_SHAPE + ", nki_matmul_hoist_load_",
         mm_tutorial("nki_matmul_hoist_load_"), held_out=True),
    Case("mm tutorial opt2 block free", "trn1", 22.07e6, _MMT, _MM_SHAPE + ", nki_matmul_block_free_dimension_",
         mm_tutorial("nki_matmul_block_free_dimension_")),
    Case("mm tutorial opt3 fully opt", "trn1", 6.97e6, _MMT, _MM_SHAPE + ", nki_matmul_fully_optimized_",
         mm_tutorial("nki_matmul_fully_optimized_", n_outer=True)),
    # The same four algorithms written against the current NKI (the kernel-optimization guide's versions, whose
    # tile sizes and block factors are the matmul tutorial's), in bf16 on trn1: the tutorial's figures without the
    # earlier-generation front-end's lowering of `tile[...] = nl.load(...)` (docs: Calibration).
    Case("mm algorithm tiled, nki 0.6", "trn1", 51.80e6, _MMT, _MM_SHAPE + ", kernel-opt guide v2 in bf16",
         kopt_tutorial(1, dtype=torch.bfloat16)),
    Case("mm algorithm hoist, nki 0.6", "trn1", 42.96e6, _MMT, _MM_SHAPE + ", kernel-opt guide v3 in bf16",
         kopt_tutorial(2, dtype=torch.bfloat16), held_out=True),
    Case("mm algorithm block free, nki 0.6", "trn1", 22.07e6, _MMT, _MM_SHAPE + ", kernel-opt guide v4 in bf16",
         kopt_tutorial(3, dtype=torch.bfloat16)),
    Case("mm algorithm fully opt, nki 0.6", "trn1", 6.97e6, _MMT, _MM_SHAPE + ", kernel-opt guide v5 in bf16",
         kopt_tutorial(4, n_outer=True, dtype=torch.bfloat16)),
    Case("mamba v1 256 ch", "trn1", 172.93e3, _MAMBA + ", 'Hooray!' (mamba_v1 profile)",
         "mamba_v1, [1, 256, 512], state 16, fp32", mamba("mamba_v1", 256, 512), quick=True),
    Case("mamba v1 4096 ch", "trn1", 2.34e6, _MAMBA + ", 'Increasing input channels size'",
         "mamba_v1, [1, 4096, 512], state 16, fp32", mamba("mamba_v1", 4096, 512), held_out=True),
    Case("mamba v2 4096 ch", "trn1", 1.61e6, _MAMBA + ", 'Minimizing data reloading by loop reordering'",
         "mamba_v2, [1, 4096, 512], state 16, fp32", mamba("mamba_v2", 4096, 512)),
    Case("mamba v3 seq 1024", "trn1", 3.3e6, _MAMBA + ", scaling table (mamba_v3, seq_len 1024)",
         "mamba_v3, [1, 4096, 1024], state 16, fp32", mamba("mamba_v3", 4096, 1024), held_out=True),
    Case("kopt v2 tiled", "trn2", 39.89e6, _KOPT.format("v2"), _KOPT_SHAPE + ", tiled", kopt_tutorial(1)),
    Case("kopt v3 hoisted", "trn2", 28.20e6, _KOPT.format("v3"), _KOPT_SHAPE + ", loads hoisted", kopt_tutorial(2),
         held_out=True),
    Case("kopt v4 block free", "trn2", 28.41e6, _KOPT.format("v4"), _KOPT_SHAPE + ", free dims blocked "
         "(320 KiB of tiles per partition against 224: spilled to HBM)", kopt_tutorial(3), held_out=True),
    Case("kopt v5 block all", "trn2", 28.30e6, _KOPT.format("v5"), _KOPT_SHAPE + ", all dims blocked",
         kopt_tutorial(4, n_outer=True)),
]


def summary(label: str, ratios: list[float]) -> str:
    """Geometric-mean error (exp of the mean |log ratio|) and the worst ratio of a set of cases."""
    if not ratios:
        return f"{label}: no cases"
    gm = math.exp(sum(abs(math.log(r)) for r in ratios) / len(ratios)) - 1
    worst = max(ratios, key=lambda r: abs(math.log(r)))
    inside = sum(1 for r in ratios if 0.75 <= r <= 1.25)
    return (f"{label}: {len(ratios)} cases, geometric-mean error {gm:.1%}, worst ratio {worst:.2f}, "
            f"{inside}/{len(ratios)} within +-25%")


def main() -> None:
    """Run the cases and print the table and the summary lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the cases that take seconds")
    parser.add_argument("--only", default="", help="only cases whose name contains this")
    parser.add_argument("--sdk", default=None, help="a git copy of aws-neuron/aws-neuron-sdk")
    parser.add_argument("--reduced", action="store_true", help="large kernels on 1/8 of their outer loop, time x 8")
    args = parser.parse_args()
    sdk = Sdk(find_sdk(args.sdk))
    print(f"sources: {sdk.git_dir or 'none found (tutorial cases skipped)'}")
    print(f"{'case':<30} {'chip':<5} {'published':>12} {'simulated':>12} {'ratio':>6}  {'host':>6}  what")
    tuned: list[float] = []
    held: list[float] = []
    for case in CASES:
        if (args.quick and not case.quick) or args.only not in case.name:
            continue
        t0 = time.perf_counter()
        try:
            div = 8 if args.reduced and not case.quick else 1
            sim = case.measure(chip_spec(case.chip), sdk, div)
        except FileNotFoundError as exc:
            print(f"{case.name:<30} {case.chip:<5} skipped: {exc}")
            continue
        except SimulatorError as exc:   # a kernel the simulator refuses (a hardware limit broken)
            print(f"{case.name:<30} {case.chip:<5} not simulated: {str(exc)[:120]}")
            continue
        ratio = sim / case.published_ns
        (held if case.held_out else tuned).append(ratio)
        mark = (" (held out)" if case.held_out else "") + (" [1/8 x 8]" if div > 1 else "")
        print(f"{case.name:<30} {case.chip:<5} {fmt(case.published_ns):>12} {fmt(sim):>12} {ratio:6.2f}  "
              f"{time.perf_counter() - t0:5.0f}s  {case.what}{mark}", flush=True)
    print(summary("tuned", tuned))
    print(summary("held out", held))


def fmt(ns: float) -> str:
    """A time with a readable unit."""
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} us"
    return f"{ns:.0f} ns"


if __name__ == "__main__":
    sys.exit(main())
