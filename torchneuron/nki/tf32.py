"""``nl.tfloat32``: TensorFloat-32 tensors (1 sign, 8 exponent and 10 mantissa bits: fp32's range with a 10-bit
mantissa, stored in a 32-bit container; aws-neuron-sdk ``about-neuron/arch/neuron-features/data-types.rst``).

A tensor allocated as ``nl.tfloat32`` holds fp32 storage (``NkiTensor.tf32``). An instruction writing it is
emitted as its TF32 variant (``variant``): it executes as the fp32 instruction, then rounds what it wrote to TF32
(round to nearest, ties to even: the rounding the engines' fp32 output conversions use for the other float
dtypes). A TensorE matmul whose two inputs are TF32 tensors is priced at the BF16/FP16/TF32 rate instead of
fp32's quarter rate (the reference's per-core figures: 79 BF16/FP16/TF32 vs 20 FP32 TFLOPS on NeuronCore-v3).
Its numerics need nothing more: TF32 x TF32 products are exact in fp32 and accumulate in fp32 PSUM.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from torchneuron.sim.isa import Instr
from torchneuron.sim.memory import AP

_LOW = 13                      # fp32 mantissa bits TF32 drops
_KEEP = ~((1 << _LOW) - 1) & 0xFFFFFFFF
_EXP = 0x7F800000


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32 (nearest, ties to even); inf kept, NaN kept a (quiet) NaN of the same sign,
    subnormals rounded on the same grid (fp32's exponent range), overflow past the largest TF32 value to inf."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
    odd = (mag >> _LOW) & 1
    rounded = (mag + (1 << (_LOW - 1)) - 1 + odd) & _KEEP
    nan = mag > _EXP
    rounded = torch.where(nan, (mag | 0x00400000) & _KEEP, torch.where(mag == _EXP, mag, rounded))
    word = sign | rounded
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)  # the same 32 bits, signed
    return word.view(torch.float32).reshape(x.shape)


def _round_written(instr: Instr, core: Any) -> None:
    for name in instr.tf32_writes:
        ap: AP = getattr(instr, name)
        view = ap.view(core)
        view.copy_(round_tf32(view))


@functools.lru_cache(maxsize=None)
def variant(cls: type) -> type:
    """``cls`` writing (``tf32_writes``) and reading (``tf32_reads``) TF32 tensors: it rounds what it writes to
    TF32, and prices a TensorE instruction whose inputs are all TF32 as TF32 (the BF16 rate)."""

    def execute(self, core):
        cls.execute(self, core)
        _round_written(self, core)

    def step(self, core, slots):
        return None  # executed through ``execute`` (the rounding needs the core's view of each write)

    def price(self):
        ci = cls.price(self)
        reads = [getattr(self, n) for n in self.tf32_reads]
        fp32_inputs = [d for d in ci.in_dtypes if d == "float32"]
        if self.engine.value == "tensor" and reads and len(reads) == len(fp32_inputs):
            ci = dataclasses.replace(ci, in_dtypes=tuple("tfloat32" if d == "float32" else d for d in ci.in_dtypes))
        return ci

    fields = [("tf32_writes", tuple, dataclasses.field(default=())),
              ("tf32_reads", tuple, dataclasses.field(default=()))]
    return dataclasses.make_dataclass(f"{cls.__name__}Tf32", fields, bases=(cls,), frozen=True,
                                      namespace={"execute": execute, "step": step, "price": price,
                                                 "__module__": __name__})
