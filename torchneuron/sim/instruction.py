"""The contract between the instruction set (isa.py) and the timing model (timing.py).

An instruction is executed functionally by the core (``execute``) and accounted by the
timing model, which sees it only through this interface: the engine queue it occupies,
the memory it reads and writes (for dependencies), and its ``CostInputs`` (for its
duration). Keeping the two apart lets the timing model be read, tested and tuned
without the numerics, and the numerics without the clock.
"""
from __future__ import annotations

import math

import enum
from dataclasses import dataclass
from typing import Protocol, Sequence


class Engine(enum.Enum):
    """The NeuronCore's instruction queues (each executes its instructions in order)."""

    TENSOR = "tensor"
    VECTOR = "vector"
    SCALAR = "scalar"
    GPSIMD = "gpsimd"
    DMA = "dma"


@dataclass(frozen=True)
class Footprint:
    """A conservative box of memory an instruction touches.

    ``memory`` is ``"sbuf"``, ``"psum"`` or ``"hbm:<buffer name>"``. On-chip memories are
    2-D: ``partitions`` is the half-open partition range and ``byte_range`` the half-open
    byte range inside each partition. HBM buffers are 1-D: ``partitions == (0, 1)``.

    A strided pattern whose contiguous chunks all start ``period`` bytes apart (a multiple of it) and
    are ``run`` < ``period`` bytes long touches, inside its byte range, only the bytes b with
    ``(b - byte_range[0]) % period < run``: rows of one head among the heads of a row, say. Two such
    boxes with disjoint phases share no byte even where their ranges interleave (``period`` 0: dense).
    """

    memory: str
    partitions: tuple[int, int]
    byte_range: tuple[int, int]
    period: int = 0
    run: int = 0

    def overlaps(self, other: "Footprint") -> bool:
        """Whether the two boxes share at least one byte."""
        return (self.memory == other.memory
                and self.partitions[0] < other.partitions[1] and other.partitions[0] < self.partitions[1]
                and self.byte_range[0] < other.byte_range[1] and other.byte_range[0] < self.byte_range[1]
                and not phases_disjoint(self.byte_range[0], self.period, self.run,
                                        other.byte_range[0], other.period, other.run))


def phases_disjoint(a0: int, pa: int, ra: int, b0: int, pb: int, rb: int) -> bool:
    """Whether two periodic byte sets (chunks of ``ra`` bytes every ``pa`` from ``a0``; ``pa`` 0: dense) are
    disjoint by their phases: modulo g = gcd(pa, pb) each set lies in one arc [start, start + run), so
    arcs that do not meet prove the sets disjoint (a sufficient test; ``False`` means they may meet)."""
    if not pa or not pb:
        return False
    g = math.gcd(pa, pb)
    if ra >= g or rb >= g:
        return False
    d = (b0 - a0) % g
    return ra <= d and d + rb <= g


@dataclass(frozen=True)
class CostInputs:
    """Everything the timing model needs to price one instruction (no data, only shape)."""

    opcode: str                          # nki.isa name: "nc_matmul", "tensor_tensor", "dma_copy", ...
    engine: Engine
    partitions: int                      # partitions the instruction spans
    free_elems: int                      # elements per partition of the main input ("N")
    in_dtypes: tuple[str, ...] = ()      # torch dtype names of tensor inputs, e.g. "bfloat16"
    out_dtype: str = "float32"
    in_memories: tuple[str, ...] = ()    # "sbuf" / "psum" / "hbm" per tensor input
    out_memory: str = "sbuf"
    contiguous: bool = True              # innermost free dim physically contiguous (stride 1)
    op: str | None = None                # ALU op or activation function name
    matmul_kmn: tuple[int, int, int] | None = None  # (K, M, N) for nc_matmul / nc_transpose
    dma_bytes: int = 0                   # bytes moved by a DMA
    dma_chunks: int = 0                  # contiguous chunks (descriptors) of a DMA
    dge_mode: str | None = None          # DMA descriptor generation: "hwdge" (NC-v3+), "swdge", "none"
    flops: int = 0                       # arithmetic operations, for roofline reports
    pe_fraction: float = 1.0             # share of the TensorE PE array a tiled nc_matmul occupies


class Instruction(Protocol):
    """What every instruction of isa.py offers to the core and the timing model."""

    engine: Engine
    queue: int  # queue index within the engine (DMA queues); 0 for compute engines

    def reads(self) -> Sequence[Footprint]:
        """Memory the instruction reads."""

    def writes(self) -> Sequence[Footprint]:
        """Memory the instruction writes."""

    def cost_inputs(self) -> CostInputs:
        """Shape facts the timing model prices."""
