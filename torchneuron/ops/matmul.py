"""Matrix products on the device: ``mm``, ``bmm``, ``addmm``, ``baddbmm`` on the tiled matmul kernel.

``matmul``, ``linear`` and ``einsum`` are CompositeImplicitAutograd in PyTorch: they decompose
into these (plus views), so they run here too. An operand that is the transpose of a contiguous
matrix (``w.t()`` in ``linear``) is handed to the kernel in its stored layout with
``transpose_a`` / ``transpose_b``, so no copy is made; other strided operands are made dense on
the device first. Each product is one launch of the matmul kernel, a contraction longer than the
kernel keeps in SBUF (``max_contraction``: ~14k-38k bf16, ~7k-19k fp32 depending on the layouts)
included: the kernel sums its K chunks in fp32 itself. ``bmm`` is one launch of the batched kernel.
``addmm`` with a bias row (``linear``: beta = alpha = 1) adds it inside the matmul launch, at the
PSUM eviction; an input of the result's shape (any alpha, beta != 0) is summed at the product's store by
``addmm_kernel``, in the same launch; otherwise ``addmm``/``baddbmm`` add ``beta * input`` with one element-wise launch. fp32, bf16 and fp16 run on the device (fp32 PSUM
accumulation); other dtypes take the CPU fallback. The ``out=`` forms are derived by ``register_out``: a contiguous
``out=`` of the result's shape and dtype is handed to the kernel as its destination (``into=``), saving the copy.
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron.kernels.matmul import addmm_kernel, bmm_kernel, fuses_bias, matmul_kernel
from torchneuron.kernels import tilemath as tm
from torchneuron.ops.base import FLOATS, on_one_device, type_name, Unsupported
from torchneuron.ops.elementwise import dense, KIND, run_pointwise
from torchneuron.ops.kernel_call import call_kernel, PlanCache, traced_kernel
from torchneuron.ops.registry import LOWERED, lowering, refuse_other_out_dtypes, register_out

MATMUL_DTYPES = FLOATS


def _given_transposed(t: torch.Tensor) -> bool | None:
    """Whether the kernel reads a 2-D operand in its stored layout transposed (``w.t()``), not as it is; None where
    neither layout is contiguous (the operand is made dense first)."""
    if t.is_contiguous():
        return False
    if t.t().is_contiguous():
        return True
    return None


def _operand(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 2-D operand as the kernel reads it: (tensor, given transposed)."""
    transposed = _given_transposed(t)
    if transposed is None:
        return dense(t), False
    return (t.t() if transposed else t), transposed


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (2-D, same dtype, one device) by one kernel launch, written into ``out`` when given;
    plus a [1, N] ``bias`` row added in the kernel (``_bias_row`` decides when)."""
    M, N = a.shape[0], b.shape[1]
    if a.shape[1] == 0 or M == 0 or N == 0:  # an empty contraction sums nothing: zeros
        res = torch.zeros((M, N), dtype=a.dtype, device=a.device)
        return res if out is None else out.copy_(res)
    (ka, ta), (kb, tb) = _operand(a), _operand(b)
    direct = out is not None and out.is_contiguous() and out.dtype == a.dtype
    operands = {"a": ka, "b": kb} if bias is None else {"a": ka, "b": kb, "bias": bias}
    (res,) = call_kernel(matmul_kernel, operands, {"transpose_a": ta, "transpose_b": tb},
                         [out if direct else None], op="aten::mm" if bias is None else "aten::addmm")
    if out is not None and not direct:
        out.copy_(res)
        return out
    return out if direct else res


def _check_mm(a: torch.Tensor, b: torch.Tensor, name: str = "mm") -> None:
    if a.dim() != 2:
        raise RuntimeError("self must be a matrix")
    if b.dim() != 2:
        raise RuntimeError("mat2 must be a matrix")
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and "
                           f"{b.shape[0]}x{b.shape[1]})")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {_cpp_name(a.dtype)} != "
                           f"{_cpp_name(b.dtype)}")


def _cpp_name(dtype: torch.dtype) -> str:
    """The C++ type name PyTorch's matmul messages use (``float``, ``c10::BFloat16``)."""
    return {torch.float32: "float", torch.float64: "double", torch.bfloat16: "c10::BFloat16",
            torch.float16: "c10::Half", torch.int64: "long int", torch.int32: "int"}.get(dtype, str(dtype))


def _on_device(*ts: torch.Tensor) -> bool:
    """Tensors of a matmul dtype on one neuron device."""
    return on_one_device(*ts) and all(t.dtype in MATMUL_DTYPES for t in ts)


# (each operand's device index, shape, strides and dtype) -> the plan of an ``mm`` of such operands that passed the
# checks and launched the matmul kernel (extra: whether each operand is given transposed): a training step's
# products repeat their signatures, and a replay binds the operands without the checks, the layout tests and the
# trace key (~4 us of ~15 a call)
_MM_PLANS = PlanCache()


def _mm_key(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """What an ``mm``'s checks and trace depend on in its operands (a CPU tensor's device index is -1)."""
    return (a.get_device(), a.shape, a.stride(), a.dtype, b.get_device(), b.shape, b.stride(), b.dtype)


@lowering("mm")
def mm(self: torch.Tensor, mat2: torch.Tensor, *, into: torch.Tensor | None = None) -> torch.Tensor:
    """``self @ mat2`` for matrices (written into ``into``, ``register_out``'s destination, when given)."""
    key = _mm_key(self, mat2) if into is None else None
    plan = _MM_PLANS.get(key)
    if plan is not None:
        ta, tb = plan.extra
        (res,) = plan.launch((self.t() if ta else self, mat2.t() if tb else mat2), key[0], "aten::mm")
        return res
    if not _on_device(self, mat2):
        raise Unsupported("operands are not matmul dtypes on one neuron device")
    _check_mm(self, mat2)
    ta, tb = _given_transposed(self), _given_transposed(mat2)
    if key is None or ta is None or tb is None or 0 in self.shape or 0 in mat2.shape:
        return mm_into(self, mat2, into)      # (an empty product, or an operand the kernel needs made dense)
    ka, kb = self.t() if ta else self, mat2.t() if tb else mat2
    traced = traced_kernel(matmul_kernel, {"a": ka, "b": kb}, {"transpose_a": ta, "transpose_b": tb})
    plan = _MM_PLANS.keep(key, traced, {"a": 0, "b": 1}, extra=(ta, tb))
    (res,) = plan.launch((ka, kb), key[0], "aten::mm")
    return res


def _result_of(batched: bool, first: int):
    """``register_out``'s ``into=`` for a product of the operands ``first`` and ``first + 1`` (their dtype): the
    result's (shape, dtype), or None for operands of the wrong rank (the kernel's checks raise)."""
    def meta(*args: Any, **kwargs: Any) -> tuple | None:
        a, b = args[first], args[first + 1]
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != 2 + batched or \
                b.dim() != 2 + batched:
            return None
        return ((a.shape[0], a.shape[1], b.shape[2]) if batched else (a.shape[0], b.shape[-1])), a.dtype
    return meta


def _dtype_of(i: int):
    """The result dtype of a product: its operand ``i``'s."""
    return lambda *args, **kwargs: args[i].dtype


# the CPU's structured kernels refuse an out= unlike the operands ("Expected out tensor to have dtype ...")
register_out("mm.out", mm, cast=refuse_other_out_dtypes("mm.out", _dtype_of(0)), into=_result_of(False, 0))


def _check_bmm(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 3:
        raise RuntimeError("batch1 must be a 3D tensor")
    if b.dim() != 3:
        raise RuntimeError("batch2 must be a 3D tensor")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise RuntimeError(f"Expected size for first two dimensions of batch2 tensor to be: [{a.shape[0]}, "
                           f"{a.shape[2]}] but got: [{b.shape[0]}, {b.shape[1]}].")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected scalar type {type_name(a.dtype)} but found {type_name(b.dtype)}")


@lowering("bmm")
def bmm(self: torch.Tensor, mat2: torch.Tensor, *, into: torch.Tensor | None = None) -> torch.Tensor:
    """Batched ``self[i] @ mat2[i]``: one launch of the batched kernel (written into ``into`` when given)."""
    if not _on_device(self, mat2):
        raise Unsupported("operands are not matmul dtypes on one neuron device")
    _check_bmm(self, mat2)
    shape = (self.shape[0], self.shape[1], mat2.shape[2])
    if 0 in shape or self.shape[2] == 0:
        res = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return res if into is None else into.copy_(res)
    (ka, ta), (kb, tb) = _batched_operand(self), _batched_operand(mat2)
    (res,) = call_kernel(bmm_kernel, {"a": ka, "b": kb}, {"transpose_a": ta, "transpose_b": tb}, [into],
                         op="aten::bmm")
    return res if into is None else into


register_out("bmm.out", bmm, cast=refuse_other_out_dtypes("bmm.out", _dtype_of(0)), into=_result_of(True, 0))


def _batched_operand(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 3-D operand as the batched kernel reads it: (tensor, its matrices given transposed)."""
    if t.is_contiguous():
        return t, False
    if t.transpose(1, 2).is_contiguous():
        return t.transpose(1, 2), True
    return dense(t), False


def add_scaled(res: torch.Tensor, inp: torch.Tensor, beta: Any, alpha: Any, out: torch.Tensor) -> torch.Tensor:
    """``out = beta * inp + alpha * res`` (beta == 0 ignores inp, NaN included, as PyTorch does)."""
    if beta == 0:
        return run_pointwise(tm.mul, [res, alpha], KIND.DEFAULT, out, inplace=False, op="aten::addmm")
    return run_pointwise(tm.addmm_epilogue, [res, inp, alpha, beta], KIND.DEFAULT, out, inplace=False,
                         op="aten::addmm")


def _bias_row(inp: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: Any, alpha: Any) -> torch.Tensor | None:
    """``inp`` as the [1, N] row ``matmul_kernel`` adds at its eviction (``linear``'s bias), or None where
    the sum takes its own launch (scaled terms, another shape or dtype)."""
    N = b.shape[1]
    if beta != 1 or alpha != 1 or inp.dtype != a.dtype or inp.numel() != N or tuple(inp.shape) not in ((N,), (1, N)) \
            or not fuses_bias(a.shape[1], N) or 0 in a.shape or N == 0:
        return None
    return dense(inp).reshape(1, N)


def _fused_sum_operands(inp, a, b, beta, shape: tuple, batched: bool) -> dict | None:
    """The ``addmm_kernel`` operands of ``beta * inp + alpha * (a @ b)`` when ``inp`` has the result's shape and
    dtype (the sum formed at the product's store), or None where it takes its own launch: a broadcast input,
    beta == 0 (the input ignored, NaN included), an empty contraction, or batch entries the grouped
    small-matrix kernel takes."""
    K = a.shape[-1]
    if tuple(inp.shape) != shape or inp.dtype != a.dtype or beta == 0 or 0 in shape or K == 0:
        return None
    if batched:
        (ka, ta), (kb, tb) = _batched_operand(a), _batched_operand(b)
        if shape[1] <= 128 and K <= 128 and shape[2] <= 512:
            return None
    else:
        (ka, ta), (kb, tb) = _operand(a), _operand(b)
    return {"a": ka, "b": kb, "c": dense(inp), "transpose_a": ta, "transpose_b": tb}


def _addmm(inp, a, b, beta, alpha, out, batched: bool):
    """``beta * inp + alpha * (a @ b)``, written into ``out`` (the result's shape and dtype, contiguous) when given."""
    check = _check_bmm if batched else _check_mm
    check(a, b)
    shape = (a.shape[0], a.shape[1], b.shape[2]) if batched else (a.shape[0], b.shape[1])
    bias = None if batched else _bias_row(inp, a, b, beta, alpha)
    if bias is not None:
        return mm_into(a, b, out, bias)
    torch.broadcast_shapes(inp.shape, shape)   # (PyTorch's error for an input that does not broadcast)
    fused = _fused_sum_operands(inp, a, b, beta, shape, batched)
    if fused is not None:
        meta = {"transpose_a": fused.pop("transpose_a"), "transpose_b": fused.pop("transpose_b"),
                "alpha": float(alpha), "beta": float(beta)}
        (res,) = call_kernel(addmm_kernel, fused, meta, [out], op="aten::baddbmm" if batched else "aten::addmm")
        return res if out is None else out
    if out is None:
        out = torch.empty(shape, dtype=a.dtype, device=a.device)
    if a.dtype in (torch.bfloat16, torch.float16):
        # the CPU adds beta * input to the fp32 products and rounds once: a product rounded to the dtype first
        # is a second rounding (a broadcast attention mask plus scores ~400 came out two fp16 units off)
        a32, b32 = a.float(), b.float()
        prod = bmm(a32, b32) if batched else mm_into(a32, b32, None)
        prod = prod if alpha == 1 else prod * alpha
        return out.copy_(prod if beta == 0 else prod + (inp.float() if beta == 1 else inp.float() * beta))
    prod = bmm(a, b) if batched else mm_into(a, b, None)
    if beta == 1 and alpha == 1:
        return run_pointwise(tm.add, [prod, inp], KIND.DEFAULT, out, inplace=False, op="aten::addmm")
    return add_scaled(prod, inp, beta, alpha, out)


# (the operands' ``_mm_key``, the input's device, shape, strides and dtype, beta, alpha) -> the plan of an ``addmm``
# whose input is ``linear``'s bias row, added in the matmul launch (extra: whether each operand is given transposed)
_BIAS_PLANS = PlanCache()


def _bias_product_planned(key: tuple, inp: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: Any,
                          alpha: Any) -> torch.Tensor | None:
    """``addmm``'s first call of signature ``key`` (operands on one device, checked): launch and keep its plan when
    the input is a contiguous bias row the matmul launch adds and neither operand needs a dense copy; else None."""
    _check_mm(a, b)
    ta, tb = _given_transposed(a), _given_transposed(b)
    if not inp.is_contiguous() or ta is None or tb is None:   # (before _bias_row, which would copy a strided input)
        return None
    bias = _bias_row(inp, a, b, beta, alpha)
    if bias is None:
        return None
    ka, kb = a.t() if ta else a, b.t() if tb else b
    traced = traced_kernel(matmul_kernel, {"a": ka, "b": kb, "bias": bias}, {"transpose_a": ta, "transpose_b": tb})
    plan = _BIAS_PLANS.keep(key, traced, {"a": 0, "b": 1, "bias": 2}, extra=(ta, tb))
    return plan.launch((ka, kb, inp), key[0][0], "aten::addmm")[0]


def _addmm_kernel(op_name: str, batched: bool):
    inplace = op_name.endswith("_")
    planned = not inplace and not batched

    def kernel(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1,
               into: torch.Tensor | None = None) -> torch.Tensor:
        key = None
        if planned and into is None:   # a repeated linear layer's product and bias: the plan of its signature
            key = (_mm_key(mat1, mat2), input.get_device(), input.shape, input.stride(), input.dtype, beta, alpha)
            plan = _BIAS_PLANS.get(key)
            if plan is not None:
                ta, tb = plan.extra
                return plan.launch((mat1.t() if ta else mat1, mat2.t() if tb else mat2, input), key[0][0],
                                   "aten::addmm")[0]
        if not _on_device(input, mat1, mat2):
            raise Unsupported("operands are not matmul dtypes on one neuron device")
        if inplace:
            return input.copy_(_addmm(input, mat1, mat2, beta, alpha, None, batched))
        if key is not None:
            res = _bias_product_planned(key, input, mat1, mat2, beta, alpha)
            if res is not None:
                return res
        res = _addmm(input, mat1, mat2, beta, alpha, into, batched)
        return res if into is None else into
    kernel.__name__ = kernel.__qualname__ = op_name
    kernel.__doc__ = f"``{op_name}``: ``beta * input + alpha * (mat1 @ mat2)``."
    return kernel


for _name, _batched in (("addmm", False), ("addmm_", False), ("baddbmm", True), ("baddbmm_", True)):
    lowering(_name)(_addmm_kernel(_name, _batched))
    if not _name.endswith("_"):
        register_out(f"{_name}.out", LOWERED[_name], cast=refuse_other_out_dtypes(f"{_name}.out", _dtype_of(1)),
                     into=_result_of(_batched, 1))


@lowering("addbmm")
def addbmm(input: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1,
           into: torch.Tensor | None = None) -> torch.Tensor:
    """``beta * input + alpha * sum_i batch1[i] @ batch2[i]``: one batched matmul, a sum over the batch (written
    into ``into`` when given)."""
    if not _on_device(input, batch1, batch2):
        raise Unsupported("operands are not matmul dtypes on one neuron device")
    _check_bmm(batch1, batch2)
    shape = (batch1.shape[1], batch2.shape[2])
    torch.broadcast_shapes(input.shape, shape)
    prod = bmm(batch1, batch2).sum(0) if batch1.shape[0] else torch.zeros(shape, dtype=input.dtype,
                                                                             device=input.device)
    out = into if into is not None else torch.empty(shape, dtype=input.dtype, device=input.device)
    add_scaled(prod, input, beta, alpha, out)
    return out


def _addbmm_result(input: torch.Tensor, batch1: Any, batch2: Any, **kwargs: Any) -> tuple | None:
    if not isinstance(batch1, torch.Tensor) or not isinstance(batch2, torch.Tensor) or batch1.dim() != 3 or \
            batch2.dim() != 3:
        return None
    return (batch1.shape[1], batch2.shape[2]), input.dtype


# (the CPU's addbmm refuses an out= unlike the batches with its addmm_'s "self and mat2 must have the same dtype",
# and resizes a wrong-shaped out= quietly)
register_out("addbmm.out", addbmm, warn_resize=False, cast=refuse_other_out_dtypes("addbmm.out", _dtype_of(1)),
             into=_addbmm_result)
