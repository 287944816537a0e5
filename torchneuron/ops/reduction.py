"""Reductions on the device: sum, mean, prod, amax/amin, max/min (values and indices), argmax/argmin,
var and std (composed: mean, squared deviations, sum).

Every call becomes one launch of ``kernels.reduction.reduce_kernel`` over an [outer, R, inner]
view of the input, R being the reduced elements. Reduced dims that are adjacent in a contiguous
input are that view for free; otherwise the input is permuted so the reduced dims come together
and made dense on the device first. Indices come out of the kernel as int32 and are widened to
PyTorch's int64 on the device. Floating inputs (fp32, bf16, fp16) run on the device; integer sums
and products (int64 results), empty inputs and other dtypes take the CPU fallback.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import canonicalize_dim

from torchneuron.kernels.reduction import reduce_kernel
from torchneuron.ops.base import FLOATS, type_name, Unsupported
from torchneuron.ops.elementwise import dense, to_int64, write_result
from torchneuron.ops.int64_elementwise import int_reduce  # exact integer sums (fp32 is exact only below 2**24)
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering, register_out

INT_SUM = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _dims(x: torch.Tensor, dim: Any) -> list[int]:
    """The reduced dims, canonical and sorted (None or [] means all), with PyTorch's errors."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    out = [canonicalize_dim(max(x.dim(), 1), d) for d in dims]
    for d in out:
        if out.count(d) > 1:
            raise RuntimeError(f"dim {d} appears multiple times in the list of dims")
    return sorted(d for d in out if d < x.dim() or x.dim() == 0)


def _reduce(x: torch.Tensor, dims: list[int], op: str, keepdim: bool) -> torch.Tensor:
    """``op`` over ``dims`` of ``x`` by one kernel launch; the result has PyTorch's reduced shape."""
    if x.dtype in INT_SUM and (op == "sum" or (op in ("max", "min") and x.numel())):
        return int_reduce(x, dims, op, keepdim)
    if x.dtype not in FLOATS:
        raise Unsupported
    if x.dim() > 64:
        raise RuntimeError("only tensors with up to 64 dims are supported")
    kept = [d for d in range(x.dim()) if d not in dims]
    out_shape = [1 if d in dims else n for d, n in enumerate(x.shape)] if keepdim else [x.shape[d] for d in kept]
    if x.numel() == 0:  # nothing to read: the reduction's value over no elements (extremes have none)
        empty_value = {"sum": 0.0, "prod": 1.0, "mean": float("nan")}.get(op)
        if empty_value is None and _prod(out_shape) != 0:
            raise Unsupported  # the CPU's error for an extreme over an empty dim
        out_dtype = torch.int64 if op in ("argmax", "argmin") else x.dtype
        return torch.full(out_shape, 0 if empty_value is None else empty_value, dtype=out_dtype, device=x.device)
    if x.dim() == 0:
        view = x.reshape(1, 1, 1)
    else:
        lo, hi = (dims[0], dims[-1]) if dims else (0, -1)
        if dims and dims == list(range(lo, hi + 1)) and x.is_contiguous():
            outer, inner = x.shape[:lo], x.shape[hi + 1:]
            R = 1
            for d in dims:
                R *= x.shape[d]
            view = x.reshape(_prod(outer), R, _prod(inner))
        else:  # bring the reduced dims last (a device copy), then [kept, R, 1]
            moved = dense(x.permute(*kept, *dims))
            R = _prod(x.shape[d] for d in dims)
            view = moved.reshape(_prod(x.shape[d] for d in kept), R, 1)
    (res,) = call_kernel(reduce_kernel, {"x": view}, {"op": op}, op=f"aten::{op}")
    if op in ("argmax", "argmin"):
        res = to_int64(res)
    return res.reshape(out_shape)


def _prod(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _cast_input(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or dtype == x.dtype:
        return x
    if dtype in INT_SUM[1:] and x.dtype in INT_SUM:  # integer sums run in int64; the caller casts the result
        return x
    if dtype not in FLOATS:
        raise Unsupported
    return x.to(dtype)


def _lower(name: str, op: str, *, has_dtype: bool = True, default_dims: bool = False):

    def kernel(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = kwargs.get("out")
        if self.device.type != "neuron" or (out is not None and out.device != self.device):
            raise Unsupported
        if default_dims:  # sum(x, dtype=None), prod(x, dtype=None) ... over everything
            dim, keepdim = None, False
            dtype = args[0] if args else kwargs.get("dtype")
        else:
            dim = args[0] if args else kwargs.get("dim")
            keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
            dtype = (args[2] if len(args) > 2 else kwargs.get("dtype")) if has_dtype else None
        if op == "mean" and not (self.is_floating_point() or self.is_complex()) and dtype is None:
            raise RuntimeError(f"mean(): could not infer output dtype. Input dtype must be either a floating "
                               f"point or complex dtype. Got: {type_name(self.dtype)}")
        if op == "mean" and dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise RuntimeError(f"mean(): could not infer output dtype. Optional dtype must be either a floating "
                               f"point or complex dtype. Got: {type_name(dtype)}")
        if dtype is None and out is not None and has_dtype:
            dtype = out.dtype
        if out is not None and not has_dtype and out.dtype != self.dtype:
            raise RuntimeError(f"Expected the dtype for input and out to match, but got "
                               f"{type_name(self.dtype)} for input's dtype and {type_name(out.dtype)} for "
                               "out's dtype.")
        x = _cast_input(self, dtype)
        dims = _dims(x, dim)
        if op in ("max", "min") and x.numel() == 0:
            _check_empty_extreme(name.partition(".")[0], x, dim, dims)
        if op == "mean" and not x.is_floating_point():
            raise Unsupported
        res = _reduce(x, dims, op, bool(keepdim))
        if dtype is not None and res.dtype != dtype:  # an integer sum in another int dtype: wraps like the CPU
            res = res.to(dtype)
        return write_result(res, out)
    lowering(name)(kernel)


def _check_empty_extreme(name: str, x: torch.Tensor, dim: Any, dims: list[int]) -> None:
    """amax/amin of an empty tensor: PyTorch's errors (no identity element to return)."""
    if not dim:
        raise RuntimeError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0. Specify "
                           "the reduction dim with the 'dim' argument.")
    for d in dims:
        if x.shape[d] == 0:
            raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")


for _name in ("sum.dim_IntList", "sum.IntList_out"):
    _lower(_name, "sum")
_lower("sum", "sum", default_dims=True)
for _name in ("mean.dim", "mean.out"):
    _lower(_name, "mean")
_lower("mean", "mean", default_dims=True)
for _name, _op in (("amax", "max"), ("amax.out", "max"), ("amin", "min"), ("amin.out", "min")):
    _lower(_name, _op, has_dtype=False)
for _name in ("prod.dim_int", "prod.int_out"):
    _lower(_name, "prod")
_lower("prod", "prod", default_dims=True)


def _full_extreme(name: str, op: str):

    def kernel(self: torch.Tensor) -> torch.Tensor:
        if self.numel() == 0:
            raise RuntimeError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0. Specify "
                               "the reduction dim with the 'dim' argument.")
        return _reduce(self, list(range(self.dim())), op, False)
    lowering(name)(kernel)


_full_extreme("max", "max")
_full_extreme("min", "min")


def _with_indices(name: str, op: str):

    def kernel(self: torch.Tensor, dim: int, keepdim: bool = False, **kwargs: Any):
        outs = [kwargs.get(k) for k in ("max", "max_values", "min", "min_indices", "indices") if k in kwargs]
        if not outs and self.dim() == 0 and self.device.type == "neuron":   # a scalar is its own extreme
            canonicalize_dim(1, dim)                                        # IndexError as on CPU
            return self.clone(), torch.zeros((), dtype=torch.int64, device=self.device)
        if outs or self.dim() == 0 or self.numel() == 0:
            raise Unsupported
        d = _dims(self, dim)
        values = _reduce(self, d, op, keepdim)
        indices = _reduce(self, d, f"arg{op}", keepdim)
        return values, indices
    lowering(name)(kernel)


_with_indices("max.dim", "max")
_with_indices("min.dim", "min")


def _arg(name: str, op: str):

    def kernel(self: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
        if self.numel() == 0 or self.device.type != "neuron":
            raise Unsupported
        if dim is None:
            res = _reduce(self.reshape(-1), [0], op, False)
            return res.reshape([1] * self.dim()) if keepdim else res
        return _reduce(self, _dims(self, dim), op, keepdim)
    kernel.__name__ = kernel.__qualname__ = name
    lowering(name)(kernel)
    register_out(f"{name}.out", kernel)


_arg("argmax", "argmax")
_arg("argmin", "argmin")


def _var_lowering(name: str, take_sqrt: bool):
    def kernel(self: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> torch.Tensor:
        """var/std as sum((x - mean)**2) / (N - correction), each step a device launch."""
        if self.dtype not in FLOATS:
            raise Unsupported("a dtype the engines lack")
        dims = _dims(self, dim)
        n = _prod(self.shape[d] for d in dims) if self.dim() else 1
        if self.numel() == 0:  # no elements: NaN for each (empty) group, as on CPU
            shape = [1 if d in dims else s for d, s in enumerate(self.shape)] if keepdim else \
                [s for d, s in enumerate(self.shape) if d not in dims]
            return torch.full(shape, float("nan"), dtype=self.dtype, device=self.device)
        c = 1 if correction is None else correction
        # fp16/bf16 accumulate in fp32 as the CPU does (an fp16 sum of squares overflows past 65504)
        x = self.to(torch.float32) if self.dtype in (torch.float16, torch.bfloat16) else self
        d = x - x.mean(dims, keepdim=True) if dims else x - x
        res = (d * d).sum(dims, keepdim=keepdim) if dims else d * d
        res = res / max(n - c, 0)
        return (res.sqrt() if take_sqrt else res).to(self.dtype)
    kernel.__name__ = kernel.__qualname__ = name.partition(".")[0]
    lowering(name)(kernel)
    register_out(f"{name}_out", kernel)


_var_lowering("var.correction", False)
_var_lowering("std.correction", True)


def _any_all(name: str, is_all: bool):
    def kernel(self: torch.Tensor, dim: Any = None, keepdim: bool = False, *, out=None) -> torch.Tensor:
        """all/any: the min/max over the dims of (x != 0) in fp32, as bool."""
        if self.device.type != "neuron" or self.dtype.is_complex or \
                (out is not None and (out.device != self.device or out.dtype not in (torch.bool, torch.uint8))):
            raise Unsupported("a tensor off the device, a complex input, or an out= unlike a bool result")
        if self.numel() == 0:  # the empty identity: all() is True, any() is False
            dims = _dims(self, dim)
            shape = [1 if d in dims else n for d, n in enumerate(self.shape)] if keepdim else \
                [n for d, n in enumerate(self.shape) if d not in dims]
            res = torch.full(shape, is_all, dtype=torch.uint8 if self.dtype == torch.uint8 else torch.bool,
                             device=self.device)
            return write_result(res, out)
        flags = (self != 0).to(torch.float32)
        res = _reduce(flags, _dims(self, dim), "min" if is_all else "max", bool(keepdim)) != 0
        if self.dtype == torch.uint8:
            res = res.to(torch.uint8)
        return write_result(res, out)
    lowering(name)(kernel)


for _name in ("all", "all.dim", "all.dims", "all.out", "all.dims_out", "all.all_out"):
    _any_all(_name, True)
for _name in ("any", "any.dim", "any.dims", "any.out", "any.dims_out", "any.all_out"):
    _any_all(_name, False)


@lowering("linalg_vector_norm")
def linalg_vector_norm(self: torch.Tensor, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,  # noqa: A002
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """Vector p-norms: inf/-inf as amax/amin of |x|, 0 as a count of non-zeros, p as (sum |x|**p)**(1/p)."""
    if not (self.is_floating_point() or self.is_complex()):
        raise RuntimeError(f"linalg.vector_norm: Expected a floating point or complex tensor as input. Got "
                           f"{type_name(self.dtype)}")
    x = self if dtype is None else self.to(dtype) if dtype in FLOATS else None
    if x is None or x.dtype not in FLOATS or x.numel() == 0:
        raise Unsupported("a dtype the engines lack, or an empty input")
    dims = _dims(x, dim)
    # fp16/bf16 accumulate in fp32 and round once, as the CPU does (fp16 sums of squares overflow past 65504)
    a = x.abs().to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x.abs()
    p = float(ord)
    if p == float("inf"):
        res = _reduce(a, dims, "max", keepdim)
    elif p == float("-inf"):
        res = _reduce(a, dims, "min", keepdim)
    elif p == 0:
        res = _reduce((a != 0).to(a.dtype), dims, "sum", keepdim)
    elif p == 1:
        res = _reduce(a, dims, "sum", keepdim)
    elif p == 2:
        res = _reduce(a * a, dims, "sum", keepdim).sqrt()
    else:
        res = _reduce(a.pow(p), dims, "sum", keepdim).pow(1.0 / p)
    return res.to(x.dtype)


register_out("linalg_vector_norm.out", linalg_vector_norm)
