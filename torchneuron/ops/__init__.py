"""Eager ATen kernels of the ``neuron`` device: ATen ops lowered to launches of library kernels.

Importing this package registers every lowering (``torchneuron.ops.registry``); ops without one
take the C++ CPU fallback. The shared foundation sits below the op families: ``base`` (dtype sets,
device guards, CPU-identical errors, overload helpers, constant tables, seeds), ``kernel_call`` (the
launch service), ``registry`` (registration and the one refusal rule) and ``elementwise`` (device
copies and element-wise launches). Each other module lowers one op family; none depends on the
order in which the families are imported.
"""
from torchneuron.ops import (  # noqa: F401  (registration happens on import)
    attention, composite, composite_reductions, convolution, copy, ctc, distance, dropout, foreach, indexing,
    int64_elementwise, linalg, matmul, nn, normalization, optim, pointwise, pooling, random, reduction, resample, rnn,
    sampling_grid, sampling_grid_backward, scatter, search, sort, special, transformer,
)
from torchneuron.ops import fft  # noqa: F401  (complex operands: torch.fft's ATen ops)
from torchneuron.ops.kernel_call import cache_size
from torchneuron.ops.registry import LOWERED

__all__ = ["LOWERED", "cache_size"]
