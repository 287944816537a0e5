"""TorchNeuron's kernel library, written in ``torchneuron.nki`` (see docs/kernels.md).

Each family is one small file: a ``@nki.jit`` kernel (a commented loop nest over tiles that
asserts its limits) and a host entry taking CPU tensors.
"""
from torchneuron.kernels.elementwise import elementwise
from torchneuron.kernels.matmul import matmul, matmul_kernel
from torchneuron.kernels.norms import (layer_norm, layer_norm_backward, layer_norm_bwd_kernel, layer_norm_kernel,
                                       rms_norm, rms_norm_backward)
from torchneuron.kernels.reduction import amax, amin, argmax, argmin, mean, reduce, reduce_kernel
from torchneuron.kernels.reduction import prod_ as prod
from torchneuron.kernels.reduction import sum as sum  # noqa: PLC0414
from torchneuron.kernels.softmax import log_softmax, softmax, softmax_kernel
from torchneuron.kernels.transpose import permute, permute_kernel, transpose, transpose_kernel

__all__ = ["elementwise", "matmul", "matmul_kernel", "layer_norm", "layer_norm_backward", "layer_norm_kernel",
           "layer_norm_bwd_kernel", "rms_norm", "rms_norm_backward", "reduce", "reduce_kernel", "sum", "mean",
           "amax", "amin", "argmax", "argmin", "prod", "softmax", "log_softmax", "softmax_kernel", "transpose",
           "permute", "permute_kernel", "transpose_kernel"]
