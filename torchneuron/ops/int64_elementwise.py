"""int64 element-wise ops and integer reductions on the device (the core has no 64-bit integer ALU).

The kernels (``kernels/int64_words.py``) work on int64 tensors as [n, 2] int32
words. This module does for them what ``pointwise.run_pointwise`` does for the other dtypes:
PyTorch's type promotion, broadcasting, the ``out=`` / in-place checks with PyTorch's messages, and
the writes into targets. It registers in ``pointwise.ALTERNATIVES``, which the element-wise
lowerings try before the CPU fallback:

- int64 results: comparisons (eq, ne, lt, le, gt, ge; one launch, bool result), maximum/minimum,
  clamp/clamp_min/clamp_max, neg, abs, sign/sgn, bitwise and/or/xor/not, add/sub/rsub (any int
  operands and broadcasts, via ``int64_add``), mul (exact mod 2**64), and ``where`` (registered for
  when its lowering consults ALTERNATIVES), shifts (``bitwise_left/right_shift``, ``<<``, ``>>``: across both
  words), integer division (floor_divide, remainder, fmod, div with a rounding mode: 64-step long division;
  a zero divisor raises the CPU's ``ZeroDivisionError``, read with one sync), and gcd/lcm (the CPU's Euclid
  loop, one division launch and one sync per step). Operands promoted to int64 (narrower ints, bools,
  Python ints) are widened on the device. Shifts and divisions of 8-32-bit ints run the same kernels on
  widened operands, their results wrapped back to the narrow dtype (what the CPU's narrow math gives);
  gcd/lcm of those take the CPU fallback (its abs wraps at the narrow dtype's minimum).
- float results: an int64 operand promoted to a float dtype (``x / 3``, ``x * 0.5``, ``exp(x)``,
  ``x > 0.5``) is cast to it on the device and the op runs on the ordinary float path, as the CPU
  casts to the common dtype.

``int_reduce`` is the integer path of ``reduction._reduce``: exact int64 sums of bools, 8-32-bit
ints and int64 tensors, and exact max/min of them (computed on int64).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import elementwise_dtypes

from torchneuron.kernels.int64_words import (int64_add, int64_bitwise, int64_compare, int64_divmod, int64_extreme,
                                            int64_minmax, int64_mul, int64_shift, int64_unary, int64_where)
from torchneuron.kernels.int64_words import int_sum as _sum_kernel
from torchneuron.kernels import tilemath
from torchneuron.ops import pointwise
from torchneuron.ops.base import aten, DEVICE_DTYPES, FLOATS, resize_out, Unsupported, variants
from torchneuron.ops.elementwise import (broadcast_shape, check_overlap, check_target, dense, device_copy, promote,
                                         to_int64)
from torchneuron.ops.kernel_call import call_kernel
from torchneuron.ops.registry import lowering

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
NARROW_INTS = (torch.int8, torch.int16, torch.int32, torch.uint8)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as 1-D with stride 1 (size-1 dims of a contiguous tensor may carry any stride)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous int64 tensor's values as [n, 2] int32 words."""
    return _flat(t).view(torch.int32).view(-1, 2)


def _operands(args: list, device_out: torch.Tensor | None) -> tuple[list, torch.device] | None:
    """Operands with CPU 0-dim tensors made Python scalars (weak, as on CUDA); None: not ours to run."""
    device, ops = None, []
    for o in args:
        if isinstance(o, torch.Tensor):
            if o.device.type == "cpu" and o.dim() == 0:
                o = o.item()
            elif o.device.type != "neuron" or (device is not None and o.device != device):
                return None  # the fallback raises PyTorch's device error
            else:
                device = o.device
        elif not isinstance(o, (int, float, bool)):
            return None
        ops.append(o)
    if device is None or (device_out is not None and device_out.device != device):
        return None
    return ops, device


def _as_int64(o: Any, shape: tuple, device: torch.device) -> torch.Tensor | None:
    """Operand ``o`` as [n, 2] words of int64 values of ``shape`` (or [1, 2]: one value for all)."""
    if not isinstance(o, torch.Tensor):
        if isinstance(o, float) or not INT64_MIN <= int(o) <= INT64_MAX:
            return None
        return _words(torch.tensor([int(o)], dtype=torch.int64).to(device))
    if o.dtype != torch.int64:
        if o.dtype not in DEVICE_DTYPES or o.is_floating_point():
            return None
        o = to_int64(o)
    if o.numel() == 1:
        return _words(dense(o))
    if tuple(o.shape) != shape:
        o = o.expand(shape)
    return _words(dense(o))


def _write(res: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """``res`` itself, or copied into the already checked (and resized) target."""
    if target is None:
        return res
    device_copy(target, res)
    return target


def _checked_target(target: torch.Tensor | None, inplace: bool, shape: tuple, result: torch.dtype,
                    tensors: list) -> None:
    """TensorIterator's checks of an out= / in-place target, raised before anything runs; resizes out=."""
    if target is None:
        return
    check_target(target, shape, result, inplace)
    if target.numel():
        check_overlap(target, tensors)
    if not inplace and tuple(target.shape) != shape:
        resize_out(target, shape)


def _run(op: Callable, kind: KIND, operands: list, target: torch.Tensor | None, inplace: bool,
         int64_fn: Callable[[list, tuple, torch.device], torch.Tensor | None],
         result_dtype: torch.dtype | None = None, narrow: bool = False) -> torch.Tensor | None:
    """Promote, check and run an element-wise op with an int64 operand or target; None: not handled here.
    ``narrow``: ops on 8-32-bit ints run too, computed in int64 and wrapped to their dtype (for ops whose
    narrow results are the int64 results wrapped: division, shifts)."""
    found = _operands(operands, target)
    if found is None:
        return None
    args, device = found
    tensors = [o for o in args if isinstance(o, torch.Tensor)]
    compute, result = promote(operands, kind)
    result = result_dtype or result
    widened = narrow and compute in NARROW_INTS and all(
        isinstance(o, torch.Tensor) or torch.iinfo(compute).min <= o <= torch.iinfo(compute).max for o in args)
    if not widened and not any(t.dtype == torch.int64 for t in tensors) and (target is None
                                                                                 or target.dtype != torch.int64):
        return None
    shape = broadcast_shape([tuple(t.shape) for t in tensors])
    if compute != torch.int64 and not widened:
        if compute not in FLOATS:
            return None
        # the CPU casts the int64 operands to the operands' common dtype (bf16 with a bf16 tensor, not the
        # fp32 it computes in), then runs the usual path
        common = elementwise_dtypes(*operands, type_promotion_kind=KIND.NO_OPMATH)[0]
        to = common if common.is_floating_point else compute
        cast = [o.to(to) if isinstance(o, torch.Tensor) and o.dtype == torch.int64 else o for o in args]
        _checked_target(target, inplace, shape, result, tensors)
        return _write(op(*cast), target)
    _checked_target(target, inplace, shape, result, tensors)
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        res = torch.empty(shape, dtype=result, device=device)
        return target if target is not None else res
    res = int64_fn(args, shape, device)
    if res is None:
        return None
    res = res.view(shape)
    if widened:  # the CPU computes in the narrow dtype: its results are the int64 ones wrapped to it
        narrowed = torch.empty(shape, dtype=compute, device=device)
        device_copy(narrowed, res)
        res = narrowed
    return _write(res, target)


def _binary_kernel(kernel: Any, meta: dict, name: str) -> Callable:
    def run(args: list, shape: tuple, device: torch.device) -> torch.Tensor | None:
        words = [_as_int64(o, shape, device) for o in args]
        if any(w is None for w in words):
            return None
        (res,) = call_kernel(kernel, {"a": words[0], "b": words[1]}, meta, op=f"aten::{name}")
        return res if res.dtype == torch.bool else res.view(torch.int64)
    return run


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _comparison(name: str) -> Callable:
    op = getattr(aten, name)

    def alternative(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
        """``name`` with an int64 operand: one launch comparing high then low words."""
        x, y = args[0], _arg(args, kwargs, 1, "other")
        return _run(op, KIND.ALWAYS_BOOL, [x, y], x if inplace else out, inplace,
                    _binary_kernel(int64_compare, {"op": name}, name), torch.bool)
    return alternative


def _minmax(name: str) -> Callable:
    op = getattr(aten, name)

    def alternative(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
        """``maximum``/``minimum`` with an int64 operand: a select on both words."""
        x, y = args[0], _arg(args, kwargs, 1, "other")
        return _run(op, KIND.DEFAULT, [x, y], x if inplace else out, inplace,
                    _binary_kernel(int64_minmax, {"op": name[:3]}, name))
    return alternative


def _bitwise(name: str) -> Callable:
    op = getattr(aten, f"bitwise_{name}")

    def alternative(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
        """bitwise and/or/xor with an int64 operand: each word on its own."""
        x, y = args[0], _arg(args, kwargs, 1, "other")
        if any(isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point()) for v in (x, y)):
            return None  # the CPU's "not implemented for 'Float'" error
        return _run(op, KIND.DEFAULT, [x, y], x if inplace else out, inplace,
                    _binary_kernel(int64_bitwise, {"op": name}, f"bitwise_{name}"))
    return alternative


def _bitwise_not(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
    """``~x`` of int64: xor with all ones."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int64:
        return None
    run = _binary_kernel(int64_bitwise, {"op": "xor"}, "bitwise_not")
    return _run(aten.bitwise_not, KIND.DEFAULT, [x], x if inplace else out, inplace,
                lambda a, shape, device: run([a[0], -1], shape, device))


def _unary(name: str) -> Callable:
    op = getattr(aten, name)

    def alternative(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
        """``neg``/``abs``/``sign`` of int64: the two's complement negation across both words, selected by sign
        for abs."""
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int64:
            return None
        kind = "sign" if name == "sgn" else name

        def run(a: list, shape: tuple, device: torch.device) -> torch.Tensor:
            (res,) = call_kernel(int64_unary, {"a": _as_int64(a[0], shape, device)}, {"op": kind}, op=f"aten::{name}")
            return res.view(torch.int64)
        return _run(op, KIND.DEFAULT, [x], x if inplace else out, inplace, run)
    return alternative


def _clamp(name: str) -> Callable:
    op = getattr(aten, name)

    def alternative(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
        """clamp of int64 values: a maximum with ``min`` then a minimum with ``max`` (so min > max gives max)."""
        x = args[0]
        if name == "clamp":
            lo, hi = _arg(args, kwargs, 1, "min"), _arg(args, kwargs, 2, "max")
        elif name == "clamp_min":
            lo, hi = _arg(args, kwargs, 1, "min"), None
        else:
            lo, hi = None, _arg(args, kwargs, 1, "max")
        bounds = [(b, k) for b, k in ((lo, "max"), (hi, "min")) if b is not None]

        def run(a: list, shape: tuple, device: torch.device) -> torch.Tensor | None:
            res = _as_int64(a[0], shape, device)
            for b, (_, k) in zip(a[1:], bounds):
                w = _as_int64(b, shape, device)
                if w is None:
                    return None
                if res.shape[0] == 1 and w.shape[0] > 1:  # a one-value x against full bounds: make x full
                    res = _words(dense(res.view(torch.int64).view(()).expand(shape)))
                (r,) = call_kernel(int64_minmax, {"a": res, "b": w}, {"op": k}, op=f"aten::{name}")
                res = r
            return res.view(torch.int64)

        def on_floats(*v: Any) -> torch.Tensor:
            rest = iter(v[1:])
            if name != "clamp":
                return op(v[0], next(rest))
            return op(v[0], next(rest) if lo is not None else None, next(rest) if hi is not None else None)
        operands = [x] + [b for b, _ in bounds]
        return _run(on_floats, KIND.DEFAULT, operands, x if inplace else out, inplace, run)
    return alternative


def _where(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
    """``where(cond, x, y)`` with an int64 operand: one select of both words by the condition."""
    cond, x, y = args[0], _arg(args, kwargs, 1, "self"), _arg(args, kwargs, 2, "other")
    if not (isinstance(cond, torch.Tensor) and cond.device.type == "neuron"
            and cond.dtype in (torch.bool, torch.uint8)):
        return None

    def run(a: list, shape: tuple, device: torch.device) -> torch.Tensor | None:
        c = _flat(dense(a[0] if a[0].numel() == 1 else a[0].expand(shape)))
        words = [_as_int64(o, shape, device) for o in a[1:]]
        if any(w is None for w in words):
            return None
        (res,) = call_kernel(int64_where, {"c": c, "a": words[0], "b": words[1]}, op="aten::where")
        return res.view(torch.int64)
    # cond (bool) takes part in the promotion as the lowest kind: it never changes an int64 result
    return _run(aten.where, KIND.NO_OPMATH, [cond, x, y], out, False, run)


def _add_words(args: list, shape: tuple, device: torch.device, sign: int, alpha: Any) -> torch.Tensor | None:
    """``x + sign * alpha * y`` of int64 operands of any int dtype and broadcast."""
    x, y = args
    if not isinstance(y, torch.Tensor):
        y, sign, alpha = sign * alpha * int(y), 1, 1
    a, b = _as_int64(x, shape, device), _as_int64(y, shape, device)
    if a is None or b is None:
        return None
    if alpha != 1:
        scale = _as_int64(alpha, shape, device)
        if scale is None:
            return None
        (b,) = call_kernel(int64_mul, {"a": b, "b": scale}, op="aten::add")
    if a.shape[0] < b.shape[0]:  # the kernel broadcasts only its second operand
        if sign == 1:
            a, b = b, a
        else:
            a = _words(dense(a.view(torch.int64).view(()).expand(shape)))
    if sign == -1:
        (b,) = call_kernel(int64_unary, {"a": b}, {"op": "neg"}, op="aten::sub")
    (res,) = call_kernel(int64_add, {"a": a, "b": b}, op="aten::add" if sign == 1 else "aten::sub")
    return res.view(torch.int64)


def _has_float(values: list) -> bool:
    """Whether a float scalar or tensor is among ``values``."""
    return any(isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point()) for v in values)


def _shift(name: str) -> Callable:
    op = getattr(aten, f"bitwise_{name}_shift")

    def alternative(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
        """``bitwise_{left,right}_shift`` with an int64 operand: across both words (counts outside [0, 64)
        give 0, or the sign fill for a right shift, as on the CPU)."""
        x, y = args[0], _arg(args, kwargs, 1, "other")
        if _has_float([x, y]):
            return None  # the CPU's "not implemented for 'Float'" error
        return _run(op, KIND.DEFAULT, [x, y], x if inplace else out, inplace,
                    _binary_kernel(int64_shift, {"op": name}, f"bitwise_{name}_shift"), narrow=True)
    return alternative


def _register_operator_shifts() -> None:
    """``x << y`` / ``x >> y`` and their in-place forms (``__lshift__``, ``__ilshift__``, ...): the shifts above."""
    for d, direction in (("l", "left"), ("r", "right")):
        for packet, inplace in ((f"__{d}shift__", False), (f"__i{d}shift__", True)):
            for ov in ("Tensor", "Scalar") if inplace else ("Tensor", "Scalar", "Tensor_out", "Scalar_out"):
                def kernel(self: torch.Tensor, other: Any, *, out: torch.Tensor | None = None,
                           _inplace: bool = inplace, _alt: Callable = _shift(direction)) -> torch.Tensor:
                    res = _alt((self, other), {}, out, _inplace)
                    if res is None:
                        raise Unsupported("operands the int64 shift does not handle (a float, several devices)")
                    return res
                lowering(f"{packet}.{ov}")(kernel)


def _no_tile(*args: Any, **kwargs: Any) -> None:
    """Element-wise ops with only an int64 path: the other dtypes take the CPU fallback."""
    raise Unsupported


def _nonzero_divisor(y: Any) -> None:
    """The CPU's error for an integer division by zero (one device reduction and a sync for a tensor)."""
    zero = int(y) == 0 if not isinstance(y, torch.Tensor) else bool(torch.eq(y, 0).any().item())
    if zero:
        raise RuntimeError("ZeroDivisionError")


def _bucket(n: int) -> int:
    """The length a long-division launch pads n elements to: few distinct shapes, so few ~1000-instruction
    traces (powers of two from 128, then multiples of 8192: one or two [128, f] blocks each)."""
    if n > 8192:
        return -(-n // 8192) * 8192
    return max(128, 1 << (n - 1).bit_length())


def _divmod_words(a: torch.Tensor, b: torch.Tensor, mode: str, op: str) -> torch.Tensor:
    """``int64_divmod`` of [n, 2] / [1, 2] words, launched on a padded length; returns [n, 2] words."""
    n = max(a.shape[0], b.shape[0])
    N = _bucket(n)
    if N != n:  # the padding's quotients are garbage, never read (no exception on the device)
        a, b = (w if w.shape[0] == 1 else torch.cat([w, w.new_empty((N - n, 2))]) for w in (a, b))
    (res,) = call_kernel(int64_divmod, {"a": a, "b": b}, {"mode": mode}, op=op)
    return res[:n]


def _divide(args: list, shape: tuple, device: torch.device, mode: str) -> torch.Tensor | None:
    """Integer ``args[0] / args[1]`` rounded by ``mode`` (or its remainder) as int64 on the device."""
    a, b = _as_int64(args[0], shape, device), _as_int64(args[1], shape, device)
    if a is None or b is None:
        return None
    _nonzero_divisor(args[1])
    return _divmod_words(a, b, mode, f"aten::{mode}").view(torch.int64)


def _gcd_words(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gcd of [n, 2] int64 words the way the CPU computes it: Euclid's ``(x, y) <- (y % x, x)`` on
    ``|a|, |b|`` (abs wraps at -2**63, the remainder takes the dividend's sign, so gcd(-2**63, 6) is -2 there
    too), each step a division launch, until every pair holds a zero (one sync per step)."""
    n = max(a.shape[0], b.shape[0])
    full = [dense(w.view(torch.int64).view(()).expand(n)) if w.shape[0] < n else w.view(torch.int64).view(n)
            for w in (a, b)]
    x, y = (call_kernel(int64_unary, {"a": _words(t)}, {"op": "abs"}, op="aten::gcd")[0].view(torch.int64).view(n)
            for t in full)
    while bool(torch.logical_and(torch.ne(x, 0), torch.ne(y, 0)).any().item()):
        # x == 0: y % 0 leaves y (the kernel's defined zero-divisor remainder), so a finished pair only swaps
        x, y = _divmod_words(_words(y), _words(x), "fmod", "aten::gcd").view(torch.int64).view(n), x
    (g,) = call_kernel(int64_bitwise, {"a": _words(x), "b": _words(y)}, {"op": "or"}, op="aten::gcd")
    return g


def _gcd(name: str) -> Callable:
    op = getattr(aten, name)

    def alternative(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
        """``gcd``/``lcm`` with an int64 operand: Euclid over the long division; lcm is ``|a / g * b|`` (0 where
        g is 0), wrapping as on the CPU."""
        x, y = args[0], _arg(args, kwargs, 1, "other")
        if _has_float([x, y]) or not all(isinstance(v, torch.Tensor) for v in (x, y)):
            return None

        def run(a: list, shape: tuple, device: torch.device) -> torch.Tensor | None:
            wa, wb = _as_int64(a[0], shape, device), _as_int64(a[1], shape, device)
            if wa is None or wb is None:
                return None
            g = _gcd_words(wa, wb)
            if name == "gcd":
                return g.view(torch.int64)
            (m,) = call_kernel(int64_mul, {"a": _divmod_words(wa, g, "trunc", "aten::lcm"), "b": wb}, op="aten::lcm")
            (m,) = call_kernel(int64_unary, {"a": m}, {"op": "abs"}, op="aten::lcm")
            zero = torch.eq(g.view(torch.int64).view(-1), 0)
            (res,) = call_kernel(int64_where, {"c": zero, "a": _as_int64(0, shape, device), "b": m}, op="aten::lcm")
            return res.view(torch.int64)
        return _run(op, KIND.DEFAULT, [x, y], x if inplace else out, inplace, run)
    return alternative


def _division(name: str) -> Callable:
    op = getattr(aten, name)

    def alternative(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
        """floor_divide, remainder, fmod and div with a rounding mode of int64 operands: 64-bit long division
        on the device; a zero divisor raises as on the CPU."""
        x, y = args[0], _arg(args, kwargs, 1, "other")
        mode = {"floor_divide": "floor", "remainder": "remainder", "fmod": "fmod"}.get(name)
        mode = mode or _arg(args, kwargs, 2, "rounding_mode")
        if mode is None or _has_float([x, y]):
            return None  # true division or a float operand: the float path
        return _run(op, KIND.DEFAULT, [x, y], x if inplace else out, inplace,
                    lambda a, shape, device: _divide(a, shape, device, mode), narrow=True)
    return alternative


def _promoted(name: str, kind: KIND, previous: Callable | None = None, sign: int = 0) -> Callable:
    """An alternative for ``name`` with int64 operands: the op's own int64 kernel first (``previous``), then
    int64 add/sub (``sign``) or mul for any int operands, else the float path when a float operand promotes."""
    op = getattr(aten, name)

    def alternative(args: tuple, kwargs: dict, out: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
        if previous is not None:
            res = previous(args, kwargs, out, inplace)
            if res is not None:
                return res
        operands = [a for a in args if isinstance(a, (torch.Tensor, int, float, bool))]
        if name in ("sub", "rsub") and any(isinstance(a, bool) or (isinstance(a, torch.Tensor)
                                                                     and a.dtype == torch.bool) for a in operands):
            raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. If you are trying "
                               "to invert a mask, use the `~` or `logical_not()` operator instead.")
        extra = {k: v for k, v in kwargs.items() if k not in ("self", "other")}
        alpha = extra.get("alpha", 1)
        k = KIND.DEFAULT if extra.get("rounding_mode") is not None else kind
        if name == "mul":
            int64_fn = _binary_kernel(int64_mul, {}, "mul")
        elif sign and isinstance(alpha, int):
            int64_fn = (lambda a, shape, device: _add_words(a[::-1] if name == "rsub" else a, shape, device, sign,
                                                            alpha))
        else:
            int64_fn = (lambda *_: None)
        return _run(lambda *v: op(*v, **extra), k, operands, args[0] if inplace else out, inplace, int64_fn)
    return alternative


def int_reduce(x: torch.Tensor, dims: list[int], op: str, keepdim: bool) -> torch.Tensor:
    """Exact ``sum`` (as int64, PyTorch's result dtype) or ``max``/``min`` (in x's dtype) over ``dims`` of an
    integer or bool tensor."""
    if op == "sum":
        return int_sum(x, dims, keepdim)
    res = int_sum(x if x.dtype == torch.int64 else to_int64(x), dims, keepdim, op)
    return res if x.dtype == torch.int64 else res.to(x.dtype)


def int_sum(x: torch.Tensor, dims: list[int], keepdim: bool, op: str = "sum") -> torch.Tensor:
    """Exact sum (or, for int64 ``x``, max/min) over ``dims`` of an integer or bool tensor, as int64."""
    kept = [d for d in range(x.dim()) if d not in dims]
    out_shape = [1 if d in dims else n for d, n in enumerate(x.shape)] if keepdim else [x.shape[d] for d in kept]
    if x.numel() == 0:
        return torch.zeros(out_shape, dtype=torch.int64, device=x.device)
    K = 1
    for d in kept:
        K *= x.shape[d]
    R = x.numel() // K
    moved = dense(x.permute(*kept, *dims)) if x.dim() else x
    if K == 1 and R > 4096:  # one long row: partial sums on up to 128 rows, then their sum
        P = max(p for p in range(1, 129) if R % p == 0)
        part = _launch(moved.reshape(P, R // P), op)
        return _launch(part.reshape(1, P), op).reshape(out_shape)
    return _launch(moved.reshape(K, R), op).reshape(out_shape)


def _launch(x: torch.Tensor, op: str) -> torch.Tensor:
    """Row sums (or int64 max/min) of a contiguous [K, R] integer tensor as int64 [K]."""
    words = x.dtype == torch.int64
    K, R = x.shape
    src = _flat(x).view(torch.int32).view(K, 2 * R) if words else _flat(x).view(K, R)
    if op != "sum":
        (res,) = call_kernel(int64_extreme, {"x": src}, {"op": op}, op=f"aten::{op}")
    else:
        (res,) = call_kernel(_sum_kernel, {"x": src}, {"words": words}, op="aten::sum")
    return res.view(torch.int64).view(-1)


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    pointwise.ALTERNATIVES[_name] = _comparison(_name)
for _name in ("maximum", "minimum"):
    pointwise.ALTERNATIVES[_name] = _minmax(_name)
for _name in ("and", "or", "xor"):
    pointwise.ALTERNATIVES[f"bitwise_{_name}"] = _bitwise(_name)
pointwise.ALTERNATIVES["bitwise_not"] = _bitwise_not
for _name in ("neg", "abs", "sign", "sgn"):
    pointwise.ALTERNATIVES[_name] = _unary(_name)
for _name in ("clamp", "clamp_min", "clamp_max"):
    pointwise.ALTERNATIVES[_name] = _clamp(_name)
for _name, _sign in (("add", 1), ("sub", -1)):
    pointwise.ALTERNATIVES[_name] = _promoted(_name, KIND.DEFAULT, pointwise.ALTERNATIVES.get(_name), _sign)
pointwise.ALTERNATIVES["rsub"] = _promoted("rsub", KIND.DEFAULT, sign=-1)   # y - x: the operands swapped
for _name in ("mul", "hypot", "pow"):
    pointwise.ALTERNATIVES[_name] = _promoted(_name, KIND.DEFAULT)
for _name in ("remainder", "fmod", "floor_divide"):
    pointwise.ALTERNATIVES[_name] = _promoted(_name, KIND.DEFAULT, _division(_name))
pointwise.ALTERNATIVES["div"] = _promoted("div", KIND.INT_TO_FLOAT, _division("div"))
for _name in ("atan2", "copysign", "xlogy", *pointwise.UNARY_FLOAT):
    pointwise.ALTERNATIVES[_name] = _promoted(_name, KIND.INT_TO_FLOAT)
_register_operator_shifts()
# ``7 % x``: floats by the usual tile function, int64 by the long division (via ALTERNATIVES["remainder"])
pointwise.register_pointwise(["remainder.Scalar_Tensor", "remainder.Scalar_Tensor_out"],
                     pointwise.float_only(tilemath.remainder), KIND.DEFAULT)
for _name in ("gcd", "lcm"):
    pointwise.ALTERNATIVES[_name] = _gcd(_name)
    pointwise.register_pointwise(variants(_name, ""), _no_tile, KIND.DEFAULT)
for _name in ("left", "right"):
    pointwise.ALTERNATIVES[f"bitwise_{_name}_shift"] = _shift(_name)
    pointwise.register_pointwise(variants(f"bitwise_{_name}_shift", "Tensor", "Tensor_Scalar", "Scalar_Tensor"),
                         _no_tile, KIND.DEFAULT)
# where's lowering (pointwise.where_lowering) does not consult ALTERNATIVES yet: ready for when it does
pointwise.ALTERNATIVES["where"] = _where
