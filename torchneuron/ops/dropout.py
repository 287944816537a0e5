"""Dropout on the device: ``kernels.random.dropout_kernel`` draws the mask with the core's PRNG, seeded per
launch from a seed the host draws from the device's generator (``torch.manual_seed`` makes it
reproducible); the backward is ``grad * mask * scale`` in one element-wise launch.

``native_dropout`` takes no generator argument, so the generic CPU fallback cannot serve it: inputs the
kernel does not run go to the C++ glue's dedicated CPU route (``torchneuron._C._fallback_native_dropout``).
"""
from __future__ import annotations


import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND

import torchneuron.nki.language as nl
from torchneuron import _C
from torchneuron.kernels.random import dropout_kernel
from torchneuron.ops.base import draw_seed, floats_on_one_device, neuron_generator, Unsupported
from torchneuron.ops.elementwise import dense, run_pointwise
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering


# ---- dropout --------------------------------------------------------------------------------------

@lowering("native_dropout")
def native_dropout(input: torch.Tensor, p: float, train: bool | None):
    """(out, mask) of dropout, the mask drawn on the device from the neuron generator."""
    if not floats_on_one_device(input) or input.numel() == 0 or not 0.0 <= p <= 1.0:
        return _C._fallback_native_dropout(input, p, train)
    if train is not None and not train:
        return input.clone(), torch.ones(input.shape, dtype=torch.bool, device=input.device)
    keep = 1.0 - p
    scale = 0.0 if keep == 0.0 else 1.0 / keep
    dev = input.device
    seed = torch.tensor([[draw_seed(neuron_generator(None, dev), 0, 2 ** 31 - 1)]], dtype=torch.int32).to(dev)
    out, mask = call_kernel(dropout_kernel, {"x": dense(input).reshape(-1), "seed": seed,
                                             "p": torch.tensor([[p]], dtype=torch.float32).to(dev),
                                             "scale": torch.tensor([[scale]], dtype=torch.float32).to(dev)},
                            op="aten::native_dropout")
    return out.view(input.shape), mask.view(input.shape)


def _dropout_grad_tile(g, m, s):
    """``g * mask * scale`` (the mask loads as 0.0 / 1.0)."""
    return nl.multiply(nl.multiply(g, m), s)


@lowering("native_dropout_backward")
def native_dropout_backward(grad_output: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``grad * mask * scale`` in one element-wise launch."""
    if not floats_on_one_device(grad_output) or mask.device != grad_output.device or mask.dtype != torch.bool:
        raise Unsupported
    return run_pointwise(_dropout_grad_tile, [grad_output, mask, float(scale)], KIND.DEFAULT,
                         result_dtype=grad_output.dtype, op="aten::native_dropout_backward")
