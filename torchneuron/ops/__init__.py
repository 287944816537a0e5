"""Eager ATen kernels of the ``neuron`` device: ATen ops lowered to launches of library kernels.

Importing this package registers every lowering (``torchneuron.ops.registry``); ops without one
take the C++ CPU fallback. One module per op family: ``copy`` (copies, fills), ``pointwise``
(element-wise math, comparisons, ``where``, ``clamp``), ``matmul`` (mm, bmm, addmm, baddbmm).
"""
from torchneuron.ops import cnn, copy, indexing, matmul, nn, optim, pointwise, int64, random, reduction, rnn, scatter, sort  # noqa: F401  (registration happens on import)
from torchneuron.ops import misc, special  # noqa: F401  (registration on import; after the families they build on)
from torchneuron.ops import resample  # noqa: F401  (registration on import; builds on cnn)
from torchneuron.ops import reduction_extra, distance, linalg, foreach, attention, transformer  # noqa: F401  (registration on import; compose the families above)
from torchneuron.ops.kernel_call import cache_size
from torchneuron.ops.registry import LOWERED

__all__ = ["LOWERED", "cache_size"]
