"""ATen ops composed from lowered ones on the device: vector products (``dot``, ``vdot``,
``addmv``) on the matmul kernel, ``trace``, ``roll``, ``equal``, ``norm``, ``nll_loss2d`` (the 2-D loss
as ``nll_loss`` over [N*H*W, C] rows), ``max_unpool2d`` (a scatter into zeros), ``angle`` of real
numbers (a select) and ``isin`` (blocks of all-pairs comparisons).

Bad inputs raise the CPU's own exception: the op is re-run on CPU twins of the arguments (zeros of the
same shapes and dtypes), so the type and message match without reimplementing every check.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import canonicalize_dim

import torchneuron.nki.language as nl
from torchneuron.kernels import tilemath as tm
from torchneuron.ops.base import (aten, DEVICE_DTYPES, FLOATS, meta_twin, on_one_device, overload, raise_like_cpu,
                                  type_name, Unsupported, variants)
from torchneuron.ops.matmul import add_scaled, MATMUL_DTYPES, mm_into
from torchneuron.ops.nn import reduce_loss
from torchneuron.ops.pointwise import register_pointwise, unary
from torchneuron.ops.registry import lowering, refuse_other_out_dtypes, register_out


# ---- vector products -------------------------------------------------------------------------------

def _dot_lowering(name: str) -> None:
    op = getattr(aten, name).default

    def kernel(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``sum(self * other)`` of two vectors: a [1, n] x [n, 1] matmul (fp32 PSUM accumulation)."""
        if not on_one_device(self, other):
            raise Unsupported("operands on more than one device")
        if self.dim() != 1 or other.dim() != 1 or self.shape != other.shape or self.dtype != other.dtype:
            raise_like_cpu(op, self, other)
        if self.dtype not in MATMUL_DTYPES:
            raise Unsupported("a dtype the matmul lacks")
        n = self.shape[0]
        return mm_into(self.view(1, n), other.view(n, 1), None).reshape(())
    lowering(name)(kernel)


_dot_lowering("dot")
_dot_lowering("vdot")   # real inputs: no conjugation


def _addmv_lowering(name: str) -> None:
    inplace = name == "addmv_"
    op = aten.addmv_.default if inplace else aten.addmv.default

    def kernel(self: torch.Tensor, mat: torch.Tensor, vec: torch.Tensor, *, beta: Any = 1, alpha: Any = 1,
               into: torch.Tensor | None = None) -> torch.Tensor:
        """``beta * self + alpha * (mat @ vec)``: one matmul launch and one element-wise launch (the sum written into
        ``into``, ``register_out``'s destination, when given)."""
        if not on_one_device(self, mat, vec):
            raise Unsupported("operands on more than one device")
        ok = (mat.dim() == 2 and vec.dim() == 1 and mat.shape[1] == vec.shape[0] and self.dim() <= 1
              and self.shape in ((), (1,), (mat.shape[0],)) and mat.dtype == vec.dtype == self.dtype
              and (not inplace or self.shape == (mat.shape[0],)))
        if not ok:
            raise_like_cpu(op, self, mat, vec, beta=beta, alpha=alpha)
        if mat.dtype not in MATMUL_DTYPES:
            raise Unsupported("a dtype the matmul lacks")
        prod = mm_into(mat, vec.reshape(-1, 1), None).reshape(mat.shape[0])
        if inplace:
            return self.copy_(add_scaled(prod, self, beta, alpha, None))
        res = add_scaled(prod, self, beta, alpha, into)
        return res if into is None else into
    kernel.__name__ = kernel.__qualname__ = name
    lowering(name)(kernel)
    if not inplace:
        # the CPU's structured kernel refuses an out= unlike the matrix ("Expected out tensor to have dtype ...");
        # a contiguous out= of the result's shape and dtype takes the sum directly
        register_out("addmv.out", kernel, cast=refuse_other_out_dtypes("addmv.out", lambda self, mat, *a, **k: mat.dtype),
                     into=lambda self, mat, vec, **k: ((mat.shape[0],), mat.dtype) if mat.dim() == 2 else None)


for _name in ("addmv", "addmv_"):
    _addmv_lowering(_name)


@lowering("trace")
def trace(self: torch.Tensor) -> torch.Tensor:
    """The sum of the diagonal (a strided view, reduced on the device)."""
    if not on_one_device(self) or self.dtype not in FLOATS:
        raise Unsupported
    if self.dim() != 2:
        raise_like_cpu(aten.trace.default, self)
    if self.numel() == 0:
        return torch.zeros((), dtype=self.dtype, device=self.device)
    return self.diagonal().sum()


# ---- roll, equal ---------------------------------------------------------------------------------

@lowering("roll")
def roll(self: torch.Tensor, shifts: Sequence[int], dims: Sequence[int] = ()) -> torch.Tensor:
    """Each rolled dim as two slices joined by ``cat`` (strided copies); no dims rolls the flattened tensor."""
    shifts, dims = list(shifts), list(dims)
    if not on_one_device(self):
        raise Unsupported("a tensor off the device")
    if not shifts or (not dims and len(shifts) != 1) or (dims and len(shifts) != len(dims)) or \
            any(not -max(self.dim(), 1) <= d < max(self.dim(), 1) for d in dims):
        raise_like_cpu(aten.roll.default, self, shifts, dims)
    if self.numel() == 0:
        return self.clone()
    if not dims:
        return roll(self.reshape(-1), shifts, [0]).view(self.shape)
    res = self
    for s, d in zip(shifts, dims):
        d = d % max(self.dim(), 1)
        n = res.shape[d]
        s = s % n
        if s:
            res = torch.cat([res.narrow(d, n - s, s), res.narrow(d, 0, n - s)], d)
    return res if res is not self else self.clone()


@lowering("equal")
def equal(self: torch.Tensor, other: torch.Tensor) -> bool:
    """Same shape and every element equal (NaN never is): one comparison, one reduction, one host read."""
    if not on_one_device(self, other):
        raise Unsupported
    if self.shape != other.shape:
        return False
    if self.numel() == 0:
        return True
    return bool(torch.eq(self, other).all().item())


# ---- norm ------------------------------------------------------------------------------------------

def _norm_lowering(name: str, out_name: str) -> None:
    op = overload(name)

    def kernel(self: torch.Tensor, p: Any = None, dim: Sequence[int] = (), keepdim: bool = False, *,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """The vector p-norm over ``dim`` (2 when ``p`` is None): ``linalg_vector_norm``."""
        if not on_one_device(self):
            raise Unsupported("operands on more than one device")
        if not self.is_floating_point() or (dtype is not None and (not dtype.is_floating_point or
                                                                   torch.promote_types(self.dtype, dtype) != dtype)):
            # (a dtype= the input narrows into: "should be convertible without narrowing")
            raise_like_cpu(op, self, p, dim, keepdim, **({"dtype": dtype} if dtype is not None else {}))
        return torch.linalg.vector_norm(self, 2 if p is None else p, list(dim) or None, keepdim, dtype=dtype)
    lowering(name)(kernel)
    # the CPU kernel refuses an out= unlike its result: dtype=, else the input's real dtype
    register_out(out_name, kernel, cast=refuse_other_out_dtypes(
        out_name, lambda self, *a, dtype=None, **k: dtype or _real_dtype(self.dtype)))


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}.get(dtype,
                                                                                                                 dtype)


_norm_lowering("norm.ScalarOpt_dim", "norm.out")
_norm_lowering("norm.ScalarOpt_dim_dtype", "norm.dtype_out")


# ---- losses, unpooling -------------------------------------------------------------------------------

def _nll2d_ok(self: torch.Tensor, target: torch.Tensor) -> bool:
    return (self.dim() == 4 and target.dim() == 3 and self.shape[0] == target.shape[0]
            and tuple(self.shape[2:]) == tuple(target.shape[1:]))


def _rows(self: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] as [N*H*W, C] rows: the class dim moved last (one device copy)."""
    return self.permute(0, 2, 3, 1).reshape(-1, self.shape[1])


@lowering("nll_loss2d_forward")
def nll_loss2d_forward(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int,
                       ignore_index: int):
    """``nll_loss_forward`` over the pixels' rows; 'none' reshaped back to [N, H, W]."""
    op = aten.nll_loss2d_forward.default
    if not on_one_device(self, target, weight) or self.dtype not in FLOATS:
        raise Unsupported("operands on more than one device, or a dtype the engines lack")
    if not _nll2d_ok(self, target):
        raise_like_cpu(op, self, target, weight, reduction, ignore_index)
    if self.numel() == 0 or target.numel() == 0:
        raise Unsupported("an empty input")
    loss, total = aten.nll_loss_forward(_rows(self), target.reshape(-1), weight, reduction, ignore_index)
    return (loss.reshape(target.shape) if reduction == 0 else loss), total


@lowering("nll_loss2d_backward")
def nll_loss2d_backward(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                        weight: torch.Tensor | None, reduction: int, ignore_index: int, total_weight: torch.Tensor):
    """``nll_loss_backward`` over the pixels' rows, moved back to [N, C, H, W]."""
    op = aten.nll_loss2d_backward.default
    args = (grad_output, self, target, weight, reduction, ignore_index, total_weight)
    if not on_one_device(grad_output, self, target, weight) or self.dtype not in FLOATS:
        raise Unsupported("operands on more than one device, or a dtype the engines lack")
    if not _nll2d_ok(self, target):
        raise_like_cpu(op, *args)
    if self.numel() == 0 or target.numel() == 0:
        raise Unsupported("an empty input")
    g = grad_output.reshape(-1) if reduction == 0 else grad_output
    rows = aten.nll_loss_backward(g, _rows(self), target.reshape(-1), weight, reduction, ignore_index, total_weight)
    N, C, H, W = self.shape
    return rows.reshape(N, H, W, C).permute(0, 3, 1, 2).contiguous()


@lowering("max_unpool2d")
def max_unpool2d(self: torch.Tensor, indices: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    """Zeros of the output size, ``self`` scattered at ``indices`` into each plane's flat H*W."""
    if not on_one_device(self, indices) or self.dtype not in FLOATS:
        raise Unsupported("operands on more than one device, or a dtype the engines lack")
    oh, ow = (list(output_size) + [0, 0])[:2]
    ok = (len(output_size) == 2 and self.dim() in (3, 4) and indices.dtype == torch.int64
          and indices.shape == self.shape and all(n > 0 for n in self.shape[-3:]) and oh > 0 and ow > 0)
    if not ok:
        raise_like_cpu(aten.max_unpool2d.default, self, indices, output_size)
    lead = tuple(self.shape[:-2])
    planes = self.reshape(-1, self.shape[-2] * self.shape[-1])
    idx = indices.reshape(planes.shape)
    # indices are int64: range-check their int32 words (low in [0, oh*ow), high 0), one host read
    words = idx.contiguous().view(torch.int32).view(-1, 2)
    bad = (words[:, 1] != 0) | (words[:, 0] < 0) | (words[:, 0] >= oh * ow)
    if bool(bad.any().item()):
        # the CPU's loop keeps the last invalid index it meets
        last = bad.numel() - 1 - int(bad.flip(0).to(torch.float32).argmax().item())
        value = int(idx.reshape(-1)[last:last + 1].cpu().item())
        raise RuntimeError(f"Found an invalid max index: {value} (output volumes are of size {oh}x{ow})")
    res = torch.zeros((planes.shape[0], oh * ow), dtype=self.dtype, device=self.device)
    res.scatter_(1, idx, planes)
    return res.reshape(*lead, oh, ow)


register_out("max_unpool2d.out", max_unpool2d, warn_resize=False)   # the CPU kernel resizes quietly


# ---- robust regression losses ------------------------------------------------------------------------

def _loss_ok(*ts: torch.Tensor | None) -> bool:
    real = [t for t in ts if t is not None]
    return on_one_device(*real) and all(t.dtype in FLOATS and t.dtype == real[0].dtype for t in real)


def _piecewise_loss(name: str, quadratic_scale: bool) -> None:
    """smooth_l1 (``quadratic_scale``: 0.5 z^2 / beta | z - beta/2) or huber (0.5 z^2 | delta (z - delta/2))."""
    op = getattr(aten, name)

    def kernel(self: torch.Tensor, target: torch.Tensor, reduction: int = 1, param: float = 1.0) -> torch.Tensor:
        if on_one_device(self, target) and (param < 0 or (param == 0 and not quadratic_scale)):
            raise_like_cpu(op.default, self, target, reduction, param)   # the CPU's range message
        if not _loss_ok(self, target) or param == 0:   # beta == 0: smooth_l1 is l1 (host)
            raise Unsupported("operands on more than one device, mixed or unsupported dtypes, or beta 0")
        # bf16/fp16: each element's loss computed in fp32 and rounded once: as the CPU's kernels do for huber@fp16
        # and smooth_l1@bf16, and at least as exact as theirs, which round every step, for the other two
        # (rounding self - target first had put huber@fp16 results a unit off the CPU's)
        wide = self.dtype in (torch.float16, torch.bfloat16)
        z = ((self.float() - target.float()) if wide else (self - target)).abs()
        if quadratic_scale:
            losses = torch.where(z < param, z * z * (0.5 / param), z - 0.5 * param)
        else:
            losses = torch.where(z < param, z * z * 0.5, (z - 0.5 * param) * param)
        return reduce_loss(losses.to(self.dtype) if wide else losses, reduction)
    kernel.__name__ = kernel.__qualname__ = name
    lowering(name)(kernel)
    register_out(f"{name}.out", kernel)


def _piecewise_loss_backward(name: str, out_name: str, quadratic_scale: bool) -> None:
    """The gradients: ``norm * g * clamp(x / beta, -1, 1)`` (smooth_l1), ``norm * g * clamp(x, -delta, delta)``
    (huber), ``x = self - target``, ``norm`` 1/numel for the mean."""
    def kernel(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor, reduction: int,
               param: float) -> torch.Tensor:
        if not _loss_ok(grad_output, self, target) or param <= 0:
            raise Unsupported("operands on more than one device, mixed or unsupported dtypes, or beta/delta <= 0")
        x = self - target
        slope = (x / param).clamp(-1, 1) if quadratic_scale else x.clamp(-param, param)
        norm = 1.0 / self.numel() if reduction == 1 else 1.0
        res = slope * grad_output * norm
        shape = torch.broadcast_shapes(self.shape, target.shape)
        return res.expand(shape).contiguous() if res.shape != shape else res
    kernel.__name__ = kernel.__qualname__ = name
    lowering(name)(kernel)
    register_out(f"{name}.{out_name}", kernel)


_piecewise_loss("smooth_l1_loss", True)
_piecewise_loss("huber_loss", False)
_piecewise_loss_backward("smooth_l1_loss_backward", "grad_input", True)
_piecewise_loss_backward("huber_loss_backward", "out", False)


@lowering("linalg_cross")
def linalg_cross(self: torch.Tensor, other: torch.Tensor, *, dim: int = -1) -> torch.Tensor:
    """3-vector cross products along ``dim`` (broadcast), from the components' products."""
    if self.dim() != other.dim():
        raise RuntimeError("linalg.cross: inputs must have the same number of dimensions.")
    d = canonicalize_dim(self.dim(), dim)          # IndexError for a dim out of range, as on CPU
    if self.shape[d] != 3 or other.shape[d] != 3:
        raise RuntimeError(f"linalg.cross: inputs dimension {dim} must have length 3. Got {self.shape[d]} and "
                           f"{other.shape[d]}")
    if self.dtype != other.dtype or not self.is_floating_point():
        raise Unsupported("mixed or non-float dtypes")
    a = [self.select(d, i) for i in range(3)]
    b = [other.select(d, i) for i in range(3)]
    return torch.stack([a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]], d)


register_out("linalg_cross.out", linalg_cross)


@lowering("channel_shuffle")
def channel_shuffle(self: torch.Tensor, groups: int) -> torch.Tensor:
    """Interleave channel groups: ``[b, g, c/g, *] -> [b, c/g, g, *]``, a strided copy on the device."""
    if self.dim() < 3 or groups <= 0 or self.shape[1] % groups:
        raise Unsupported
    b, c = self.shape[:2]
    rest = self.shape[2:]
    view = self.reshape(b, groups, c // groups, *rest).transpose(1, 2)
    return view.contiguous().reshape(self.shape)


def _triangle_indices(name: str, lower: bool):
    packet = getattr(aten, name)

    def kernel(row: int, col: int, offset: int = 0, *, dtype=torch.int64, layout=None, device=None,
               pin_memory=None) -> torch.Tensor:
        """The (2, N) coordinates of a matrix triangle: index metadata made on the host, then transferred
        (the values depend only on the sizes, like a factory's fill)."""
        host = packet.default(row, col, offset, dtype=dtype)
        return host.to(device)
    lowering(name)(kernel)


_triangle_indices("tril_indices", True)
_triangle_indices("triu_indices", False)


@lowering("repeat_interleave.Tensor")
def repeat_interleave(repeats: torch.Tensor, *, output_size: int | None = None) -> torch.Tensor:
    """``repeat_interleave(repeats)``: the repeat counts are read on the host (one sync, as CUDA does to size
    the output), the index vector is built there and transferred."""
    host = aten.repeat_interleave.Tensor(repeats.cpu(), output_size=output_size)   # the CPU's checks
    return host.to(repeats.device)


@lowering("renorm")
def renorm(self: torch.Tensor, p: float, dim: int, maxnorm: float) -> torch.Tensor:
    """Rescale each slice along ``dim`` whose p-norm exceeds ``maxnorm`` to that norm (CPU: 1e-7 guard)."""
    if self.dim() < 2:
        raise RuntimeError(f"renorm: input needs at least 2 dimensions, got {self.dim()} dimensions")
    if not self.is_floating_point() or self.dtype == torch.float64 or p <= 0 or maxnorm < 0:
        raise Unsupported("an unsupported dtype, p <= 0 or maxnorm < 0")
    d = canonicalize_dim(self.dim(), dim)
    others = [k for k in range(self.dim()) if k != d]
    norms = torch.linalg.vector_norm(self.float(), p, dim=others, keepdim=True)
    scale = torch.where(norms > maxnorm, maxnorm / (norms + 1e-7), 1.0)
    return (self.float() * scale).to(self.dtype)


register_out("renorm.out", renorm)


# ---- angle ---------------------------------------------------------------------------------------------

def _angle(x):
    """The argument of a real number: pi where x < 0, else 0; NaN stays NaN (a tile function)."""
    return tm.where(tm.isnan(x), x, nl.multiply(nl.less(x, 0), math.pi))


register_pointwise(variants("angle", ""), unary(_angle), KIND.INT_TO_FLOAT)


# ---- isin ----------------------------------------------------------------------------------------------

ISIN_LIMIT = 1 << 24      # elements of one [N, M] comparison block isin builds


def _isin_lowering(name: str) -> None:
    overload = getattr(aten.isin, name.partition(".")[2])

    def kernel(elements: Any, test_elements: Any, *, assume_unique: bool = False,
               invert: bool = False) -> torch.Tensor:
        """``torch.isin``: every element compared with every test element ([N, M] blocks), any() per element."""
        ts = [t for t in (elements, test_elements) if isinstance(t, torch.Tensor)]
        if any(t.dtype == torch.bool for t in ts):   # the CPU's refusal (its meta function has none)
            raise RuntimeError("Unsupported input type encountered for isin(): Bool")
        res_meta = overload(meta_twin(elements), meta_twin(test_elements), assume_unique=assume_unique,
                            invert=invert)
        if not on_one_device(*ts) or any(t.dtype not in DEVICE_DTYPES | {torch.int64} for t in ts):
            raise Unsupported("operands on more than one device, or a dtype the device lacks")
        x = elements.reshape(-1, 1) if isinstance(elements, torch.Tensor) else elements
        tests = test_elements.reshape(1, -1) if isinstance(test_elements, torch.Tensor) else test_elements
        N = x.shape[0] if isinstance(x, torch.Tensor) else 1
        M = tests.shape[1] if isinstance(tests, torch.Tensor) else 1
        if isinstance(x, torch.Tensor) and isinstance(tests, torch.Tensor) and N * M > 4 * ISIN_LIMIT:
            raise Unsupported("a comparison block beyond ISIN_LIMIT")
        step = max(1, ISIN_LIMIT // max(N, 1))
        hit = None
        for m0 in range(0, M, step):   # blocks of test elements, their hits or-ed together
            part = tests[:, m0:m0 + step] if isinstance(tests, torch.Tensor) else tests
            block = torch.eq(x, part) if isinstance(x, torch.Tensor) else torch.eq(part, x)
            block = block.any(-1) if block.dim() else block
            hit = block if hit is None else hit | block
        if hit is None:
            hit = torch.zeros((N,), dtype=torch.bool, device=ts[0].device)
        hit = hit.reshape(res_meta.shape)
        return ~hit if invert else hit
    kernel.__name__ = kernel.__qualname__ = "isin"
    lowering(name)(kernel)
    register_out(f"{name}_out", kernel)


for _name in ("isin.Tensor_Tensor", "isin.Tensor_Scalar", "isin.Scalar_Tensor"):
    _isin_lowering(_name)


@lowering("_nested_tensor_from_mask_left_aligned")
def nested_tensor_from_mask_left_aligned(t: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether every row of a [N, L] padding mask is ones then zeros (``nn.Transformer``'s fast-path check):
    the row's count of ones equals the index of its first zero, as the CPU kernel decides."""
    if mask.dtype != torch.bool:
        raise RuntimeError(f"Expected mask to be of ScalarType Bool, but got {type_name(mask.dtype)} instead.")
    if mask.dim() != 2:
        raise RuntimeError("Padding mask should be 2D")
    if t.dim() != 3:
        raise RuntimeError("Input should be a 3D tensor, N * L * D")
    if tuple(t.shape[:2]) != tuple(mask.shape):
        raise RuntimeError("Mask size should match input size")
    if mask.numel() == 0:
        return True
    ones = mask.to(torch.float32)                  # (counts exact in fp32 below 2**24)
    first_zero = torch.cat([ones, torch.zeros_like(ones[:, :1])], 1).argmin(1).to(torch.float32)
    return bool(torch.equal(ones.sum(1), first_zero))
