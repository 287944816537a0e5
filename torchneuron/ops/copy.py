"""Copies and fills on the device: ``copy_``, ``fill_``, ``zero_`` as strided DMA kernels.

A copy between two tensors of one neuron device is ``elementwise.device_copy``. A fill is a copy
from a one-element device tensor broadcast with stride 0. Copies between the host and a device, or
between devices, stay with the C++ ``_copy_from``.
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron import _C
from torchneuron.ops.base import aten, DEVICE_DTYPES, Unsupported
from torchneuron.ops.elementwise import can_copy, device_copy
from torchneuron.ops.kernel_call import scalar_operand
from torchneuron.ops.registry import lowering


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _complex64_copy(self: torch.Tensor, src: torch.Tensor) -> bool:
    """``self.copy_(src)`` into complex64 on the device through its real and imaginary parts, when ``src`` is a
    conjugate view (resolved: the parts copied, the imaginary ones negated) or real (cast, the imaginary parts
    zeroed); False for anything else."""
    if self.dtype != torch.complex64 or self.is_conj() or self.is_neg() or src.is_neg():
        return False
    if src.dtype == torch.complex64 and src.is_conj():
        copy_(self, src.conj())
        torch.view_as_real(self)[..., 1].neg_()
        return True
    if src.dtype in DEVICE_DTYPES and src.dtype != torch.bool:
        torch.broadcast_shapes(src.shape, self.shape)
        parts = torch.view_as_real(self)
        parts[..., 0].copy_(src)
        parts[..., 1].zero_()
        return True
    return False


@lowering("copy_", complex_operands=True)
def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``self.copy_(src)``: a DMA kernel within one neuron device, else a host transfer."""
    if self.device == src.device and self.device.type == "neuron" and can_copy(self, src) \
            and not self.is_conj() and not src.is_conj() and not self.is_neg() and not src.is_neg():
        if src.shape != self.shape:
            torch.broadcast_shapes(src.shape, self.shape)  # RuntimeError for shapes that do not broadcast
        if self.numel() and not _same_data(self, src):
            device_copy(self, src)
        return self
    if self.device == src.device and self.device.type == "neuron" and _complex64_copy(self, src):
        return self
    if self.device == src.device:
        raise Unsupported("a dtype conversion the device lacks, or a conjugate or negative view")
    return aten._copy_from(src, self, non_blocking)


def fill(self: torch.Tensor, value: Any) -> torch.Tensor:
    """Fill ``self`` with a scalar on the device."""
    if self.numel() == 1 and not self.is_conj() and not self.is_neg():
        # The fill kernel's scalar operand is the host's write of one element into device memory; with one
        # element to fill, that write goes straight to the tensor and the kernel, which would copy it there,
        # is not launched (autograd's ``ones_like`` seed of ``loss.backward()``). The same bytes move either way.
        _C._alias_as_cpu(self).fill_(value)
    elif self.numel():
        device_copy(self, scalar_operand(value, self.dtype, self.device).view(()))
    return self


@lowering("fill_.Scalar", complex_operands=True)
def fill_scalar(self: torch.Tensor, value: Any) -> torch.Tensor:
    """``self.fill_(value)``."""
    if not can_copy(self, self):
        # named: fill_.Tensor and zero_ call this directly
        raise Unsupported("a dtype the device cannot store", fallback=(aten.fill_.Scalar, (self, value), {}))
    return fill(self, value)


@lowering("fill_.Tensor", complex_operands=True)
def fill_tensor(self: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``self.fill_(value)`` with a 0-dim tensor (read on the device when it lives there)."""
    if value.dim() != 0:
        raise RuntimeError(f"fill_ only supports 0-dimension value tensor but got tensor with {value.dim()} "
                           "dimensions.")
    if value.device != self.device or not can_copy(self, value):
        if value.device.type == "cpu":
            return fill_scalar(self, value.item())
        raise Unsupported
    if self.numel():
        device_copy(self, value)
    return self


@lowering("zero_", complex_operands=True)
def zero_(self: torch.Tensor) -> torch.Tensor:
    """``self.zero_()``."""
    return fill_scalar(self, False if self.dtype == torch.bool else 0)
