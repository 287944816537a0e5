"""The registry of eager ATen kernels for the ``neuron`` device.

``@lowering("add.Tensor", "add_.Tensor", "add.out")`` installs a Python kernel for those ATen
overloads on PyTorch's PrivateUse1 dispatch key (``torch.library``), below autograd: a kernel
sees plain tensors and every op it calls re-dispatches without recording a graph.

One refusal rule: a kernel that meets inputs it cannot run on the device (a dtype the NeuronCore
lacks, a CPU tensor argument) raises ``Unsupported``, and the registration turns that into the
CPU fallback of the overload it was called for: the same boxed CPU fallback unregistered
operators take, so it is counted, warned about once, refused under ``TORCHNEURON_STRICT=1``, and
checks devices the way PyTorch does. A kernel that must fall back to another call (the ``out=``
overload of a result it already allocated) names it: ``Unsupported(reason, fallback=(op, args,
kwargs))``. No lowering calls ``cpu_fallback`` itself. ``register_out`` derives an ``out=``
overload from its functional kernel, casting into an ``out=`` tensor of another dtype where the CPU does, or
handing the kernel the ``out=`` tensor to write into (``into=``) where that saves a copy.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._prims_common import canonicalize_dim

from torchneuron import _C
from torchneuron.ops.base import overload, resize_out, Unsupported, zeros_twin
from torchneuron.ops.elementwise import aliases_itself, can_copy, share_bytes, write_result

__all__ = ["COMPLEX_LOWERED", "LOWERED", "Unsupported", "complex_lowering", "cpu_fallback", "lowering",
           "out_dtype_error", "refuse_other_out_dtypes", "register_out", "resize_reduced_outs"]


_LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (kept alive for the process)
LOWERED: dict[str, Callable] = {}             # overload name ("add.Tensor") -> its neuron kernel
COMPLEX_LOWERED: dict[torch._ops.OpOverload, Callable] = {}   # overload -> its kernel for complex operands


def _has_complex(values: Any) -> bool:
    """Whether call arguments hold a complex tensor, Python complex or complex dtype (in lists too)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.is_complex():
                return True
        elif isinstance(v, complex) or (isinstance(v, torch.dtype) and v.is_complex):
            return True
        elif isinstance(v, (list, tuple)) and _has_complex(v):
            return True
    return False


def _refusing_to_cpu(fn: Callable, op: torch._ops.OpOverload, complex_operands: bool = False) -> Callable:
    """``fn`` with ``Unsupported`` turned into the CPU fallback of ``op`` on the same arguments (or of the
    call the refusal names). Unless ``complex_operands``, a call with complex operands is refused before
    ``fn`` sees it: the engines compute in real arithmetic only."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        try:
            if not complex_operands and (_has_complex(args) or (kwargs and _has_complex(kwargs.values()))):
                if op not in COMPLEX_LOWERED:
                    raise Unsupported("complex operands")
                return COMPLEX_LOWERED[op](*args, **kwargs)
            return fn(*args, **kwargs)
        except Unsupported as refusal:
            target, args, kwargs = refusal.fallback or (op, args, kwargs)
        # outside the handler: an error of the fallback (strict mode's) is not chained to the refusal
        return cpu_fallback(target, *args, **kwargs)
    kernel.__name__, kernel.__qualname__, kernel.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    return kernel


def lowering(*names: str, complex_operands: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated function as the neuron kernel of the ATen overloads ``names`` (one that takes
    complex operands itself says so with ``complex_operands``; the others never see them)."""
    def register(fn: Callable) -> Callable:
        for name in names:
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CompositeImplicitAutograd") and \
                    not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Autograd"):
                # it decomposes before reaching a backend; a backend kernel would bypass its autograd (an op with an
                # autograd kernel of its own, as _fused_rms_norm, runs that one above a backend kernel)
                raise RuntimeError(f"aten::{name} is CompositeImplicitAutograd: lower what it decomposes into")
            if name in LOWERED:
                raise RuntimeError(f"aten::{name} already has a neuron kernel ({LOWERED[name].__qualname__})")
            _LIB.impl(name, _refusing_to_cpu(fn, overload(name), complex_operands), "PrivateUse1")
            LOWERED[name] = fn
        return fn
    return register


def complex_lowering(*names: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the kernel of the lowered overloads ``names`` for calls with complex
    operands (which their own kernels never see)."""
    def register(fn: Callable) -> Callable:
        for name in names:
            if name not in LOWERED:
                raise RuntimeError(f"aten::{name} has no neuron kernel to take its complex operands")
            COMPLEX_LOWERED[overload(name)] = fn
        return fn
    return register


def cpu_fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Run ``op`` through the CPU fallback (counted; an error naming the op in strict mode)."""
    schema = op._schema
    # a Python kernel receives wrapped-number operands as Python scalars: the schema wants tensors
    tensor_args = {a.name for a in schema.arguments if str(a.type) == "Tensor"}
    # a 0-d tensor stands in for the wrapped number; a float one is fp32 (the wrapped number's promotion) unless a
    # float64 operand computes in float64, where an fp32 scalar would round it (x * sqrt(0.5) off by 3e-8)
    f64 = any(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in (*args, *kwargs.values()))

    def number(v: Any) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float64) if f64 and isinstance(v, float) else torch.tensor(v)
    args = tuple(number(v) if a.name in tensor_args and isinstance(v, (int, float, bool, complex)) else v
                 for a, v in zip(schema.arguments, args))
    kwargs = {k: number(v) if k in tensor_args and isinstance(v, (int, float, bool, complex)) else v
              for k, v in kwargs.items()}
    return _C._cpu_fallback(schema.name, schema.overload_name, *args, **kwargs)


def _aliased_cpu_twin() -> Callable[[Any], Any]:
    """A function making CPU copies of tensors (in lists, tuples and dicts too) that share memory where the
    originals do: each storage is copied once, each tensor re-made as the same view of its copy (once: a tensor
    met twice, an input passed as out=, is one twin, so a resize of one is a resize of the other)."""
    images: dict[int, torch.Tensor] = {}
    twins: dict[int, torch.Tensor] = {}     # a tensor passed twice (an input as out=) is one twin

    def twin(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if id(v) in twins:
                return twins[id(v)]
            storage = v.untyped_storage()
            if storage._cdata not in images:      # (keyed by the storage itself: empty ones share data_ptr 0)
                raw = torch.empty(0, dtype=torch.uint8, device=v.device).set_(storage)
                images[storage._cdata] = raw.cpu()
            twins[id(v)] = torch.empty(0, dtype=v.dtype).set_(images[storage._cdata].untyped_storage(),
                                                              v.storage_offset(), v.shape, v.stride())
            return twins[id(v)]
        if isinstance(v, (list, tuple)):
            return type(v)(twin(x) for x in v)
        if isinstance(v, dict):
            return {k: twin(x) for k, x in v.items()}
        return v
    return twin


def _shared(out: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether an ``out=`` tensor shares bytes with ``t``, or is empty on ``t``'s storage (which a resize grows)."""
    return share_bytes(out, t) or (not out.numel() and out.device == t.device and
                                   out.untyped_storage()._cdata == t.untyped_storage()._cdata)


def _grows_into(out: torch.Tensor, shape: Any, t: torch.Tensor) -> bool:
    """Whether an ``out=`` tensor of another shape, once resized to ``shape`` (contiguous from its offset, as
    ``resize_`` makes it), would share bytes with ``t``, on its storage."""
    if tuple(out.shape) == tuple(shape) or not t.numel() or t.device != out.device or \
            out.untyped_storage()._cdata != t.untyped_storage()._cdata:
        return False
    n = 1
    for s in shape:
        n *= s
    lo = out.data_ptr()
    lo_t = t.data_ptr()
    hi_t = lo_t + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    return n > 0 and lo_t < lo + n * out.element_size() and lo < hi_t


# the C++ type names of PyTorch's structured-kernel messages ("Expected out tensor to have dtype float, ...")
_CPP_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int", torch.int16: "short int",
              torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool",
              torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>"}


def out_dtype_error(expected: torch.dtype, got: torch.dtype) -> RuntimeError:
    """The refusal of a structured CPU kernel (``sum``, ``prod``, ``mean``, ``max.dim`` ...) given an ``out=``
    tensor of another dtype than the one it computes, word for word."""
    return RuntimeError(f"Expected out tensor to have dtype {_CPP_NAMES.get(expected, str(expected))}, but got "
                        f"{_CPP_NAMES.get(got, str(got))} instead")


def refuse_other_out_dtypes(name: str, result_dtype: Callable[..., torch.dtype | tuple[torch.dtype, ...]]
                            ) -> Callable[..., None]:
    """A ``cast=`` hook for the ``out=`` overload ``name`` of an op whose CPU kernel refuses an ``out=`` tensor of
    another dtype than its result (``result_dtype(*args, **kwargs)``, or a tuple of each result's dtype for an op
    of several ``out=`` tensors, as the factorisations' int32 pivots beside their float factors): for such a
    tensor the CPU kernel is run on CPU zeros of the arguments (keyword ones too: searchsorted's ``sorter``) with
    an empty ``out=`` tensor of that dtype, raising its own error after its own
    earlier checks (an argument's before the ``out=`` dtype's), word for word; a call it accepts after all takes
    the CPU fallback. An ``out=`` tensor of the result's dtype passes, to the functional kernel's checks."""
    op = overload(name)
    out_names = [a.name for a in op._schema.arguments if a.is_out]

    def check(outs: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        expected = result_dtype(*args, **kwargs)
        if not isinstance(expected, tuple):
            expected = (expected,) * len(outs)
        if all(o.dtype == e for o, e in zip(outs, expected)):
            return
        op(*zeros_twin(args), **{k: zeros_twin(v) for k, v in kwargs.items()},
           **{n: torch.empty(0, dtype=o.dtype) for n, o in zip(out_names, outs)})
        raise Unsupported("an out= tensor of another dtype the CPU kernel accepts")
    return check


def _on_aliased_cpu_image(op: torch._ops.OpOverload, out_names: list[str], args: tuple, kwargs: dict,
                          outs: list[torch.Tensor]) -> Any:
    """``op`` with ``out=`` tensors that alias themselves, an input or each other, run by the CPU kernel on a CPU
    image of the memory that keeps the aliasing (an empty ``out=`` that is an input, or a view of one, overlaps it
    once resized). The boxed fallback would copy each tensor on its own, losing the aliasing, and refuses partial
    overlaps the CPU kernel accepts. Where the CPU kernel raises (its overlap errors), that is the error; where it
    computes, the call is counted as the CPU fallback of ``op`` (refused in strict mode) and the image of each
    ``out=`` tensor's memory is written back to the device, resized as the CPU resized it."""
    twin = _aliased_cpu_twin()
    cpu_outs = [twin(o) for o in outs]
    op(*twin(args), **twin(kwargs), **dict(zip(out_names, cpu_outs)))
    # counted as the fallback it is: the boxed fallback runs the op once more into new out= tensors, its result
    # unused (the count, the once-per-op warning and strict mode's refusal live in the C++ fallback; the new
    # tensors are empty, so the resize warning is the CPU kernel's one above)
    cpu_fallback(op, *args, **kwargs, **{n: torch.empty(0, dtype=o.dtype, device=o.device)
                                          for n, o in zip(out_names, outs)})
    written = set()
    for o, c in zip(outs, cpu_outs):
        if tuple(o.shape) != tuple(c.shape):
            o.resize_(c.shape)               # (the CPU kernel has warned about the resize)
        storage = o.untyped_storage()
        if storage._cdata in written:
            continue
        written.add(storage._cdata)
        image = torch.empty(0, dtype=torch.uint8).set_(c.untyped_storage())
        raw = torch.empty(0, dtype=torch.uint8, device=o.device).set_(storage)
        n = min(raw.numel(), image.numel())
        raw[:n].copy_(image[:n])
    return tuple(outs) if len(outs) > 1 else outs[0]


def resize_reduced_outs(outs: list[torch.Tensor], self: torch.Tensor, dim: int, keepdim: bool) -> None:
    """Resize the (values, indices) ``out=`` tensors of a reduction with indices over ``dim`` (``kthvalue``) as its
    CPU kernel does: one of the reduced rank unsqueezed at ``dim`` first, resized to the kept-dim shape (ATen's
    warning naming those shapes), then squeezed at ``dim`` unless ``keepdim``."""
    d = canonicalize_dim(max(self.dim(), 1), dim)
    shape = list(self.shape)
    if shape:
        shape[d] = 1
    for out in outs:
        if not keepdim and out.dim() == self.dim() - 1:
            out.unsqueeze_(d)
        resize_out(out, shape)
    if not keepdim:
        for out in outs:
            out.squeeze_(d)


def register_out(name: str, functional: Callable, warn_resize: bool = True, dtype_from_out: bool = False,
                 cast: Callable[..., None] | None = None, resize: Callable[..., None] | None = None,
                 into: Callable[..., tuple[Any, torch.dtype] | None] | None = None,
                 write: Callable[..., torch.Tensor] | None = None) -> None:
    """Register the ``out=`` overload ``name`` as ``functional`` (its functional form's kernel) with each result
    written into its ``out=`` tensor, resized first as PyTorch resizes (with its warning when the tensor had
    elements; ``warn_resize=False`` for an op whose CPU kernel resizes quietly). ``dtype_from_out``: an op whose
    ``dtype=`` argument, when not given, is the ``out=`` tensor's dtype (the CPU's reductions compute in it).

    ``cast``: the CPU kernel's checks of its ``out=`` tensors' dtypes, for an op whose CPU kernel writes its result
    into an ``out=`` tensor of another dtype cast, or refuses one itself: called as ``cast(outs, *args, **kwargs)``
    (the ``out=`` tensors, then the call's arguments) before anything is computed, it raises the CPU's refusal, in
    the CPU's order of checks, or ``Unsupported`` for a case the device leaves to the CPU kernel. A result of
    another dtype than an ``out=`` tensor that passed is written into it cast on the device (or, for a conversion
    the device lacks, by the CPU fallback of ``name``). Without ``cast``, an ``out=`` tensor of another dtype than
    its result takes that fallback, which casts or raises as the CPU does. ``resize``: for an op whose CPU kernel
    resizes its ``out=`` tensors its own way, ``resize(outs, *args, **kwargs)`` resizes them to their results'
    shapes.

    ``into``: for a kernel that can write its result straight into a destination tensor, saving the copy (the
    matrix products). ``into(*args, **kwargs)`` gives the result's (shape, dtype) without computing it, or None
    where it cannot tell; when the (single) ``out=`` tensor has that shape and dtype, is contiguous, lies on the
    inputs' device and shares memory with none of them (an aliasing one never gets here: see below), the kernel is
    called as ``functional(*args, into=out, **kwargs)`` and writes its result into it, returning it; any other
    ``out=`` tensor takes the normal path (the result computed, then written into it resized). A result the kernel
    returns that is not the ``out=`` tensor is written into it as usual.

    ``write``: for an op whose CPU kernel writes its result into its (single) ``out=`` tensor its own way rather
    than resizing the tensor to the result's shape (binary cross-entropy's write through the tensor's squeezed
    view, then weight and reduce it in place): ``write(result, out, *args, **kwargs)`` does that, in place of the
    resize and copy, and returns the ``out=`` tensor.

    The CPU kernel also decides for the ``out=`` tensors whose semantics are its own: one on another device than
    its result (the fallback of ``name``), one whose elements alias each other or that shares memory with an input
    or another ``out=`` tensor, or would once resized to its result's shape (run on a CPU image of the memory that
    keeps the aliasing: its overlap error, or its result written back, counted as the fallback)."""
    op = overload(name)
    out_names = [a.name for a in op._schema.arguments if a.is_out]

    def out_variant(*args: Any, **kwargs: Any) -> Any:
        outs = [kwargs.pop(n) for n in out_names]
        if any(o.device.type != "neuron" for o in outs):
            raise Unsupported("an out= tensor off the device")
        inputs = [t for v in (*args, *kwargs.values()) for t in (v if isinstance(v, (list, tuple)) else [v])
                  if isinstance(t, torch.Tensor)]
        if any(aliases_itself(o) or any(_shared(o, t) for t in inputs + outs[:i]) for i, o in enumerate(outs)):
            return _on_aliased_cpu_image(op, out_names, args, kwargs, outs)
        if cast is not None:
            cast(outs, *args, **kwargs)
        given = dict(kwargs)
        if dtype_from_out and kwargs.get("dtype") is None:
            kwargs["dtype"] = outs[0].dtype
        call_kwargs = kwargs
        if into is not None and len(outs) == 1 and outs[0].is_contiguous() and \
                all(t.device == outs[0].device for t in inputs):
            meta = into(*args, **kwargs)
            if meta is not None and tuple(outs[0].shape) == tuple(meta[0]) and outs[0].dtype == meta[1]:
                call_kwargs = {**kwargs, "into": outs[0]}
        try:
            res = functional(*args, **call_kwargs)
        except Unsupported as refusal:
            if refusal.fallback is None:
                raise
            # a call the functional kernel names (the out= overload of its own result) would fill that result,
            # not the out= tensor: the fallback is this overload's, on the arguments it was called with
            raise Unsupported(str(refusal)) from None
        results = res if isinstance(res, tuple) else (res,)
        if any(o.device != r.device for o, r in zip(outs, results)):
            raise Unsupported("an out= tensor on another device than its result")
        if any(o.dtype != r.dtype and (cast is None or not can_copy(o, r)) for o, r in zip(outs, results)):
            raise Unsupported("an out= tensor of another dtype than its result" if cast is None else
                              "a conversion into the out= tensor's dtype that the device lacks")
        if any(_grows_into(o, r.shape, t) for i, (o, r) in enumerate(zip(outs, results))
               for t in inputs + outs[:i] + outs[i + 1:]):
            # an out= tensor the resize makes overlap an input or another out=: the CPU kernel decides (as above)
            return _on_aliased_cpu_image(op, out_names, args, given, outs)
        if resize is not None:
            resize(outs, *args, **kwargs)
        written = tuple(o if r is o else write(r, o, *args, **kwargs) if write is not None else
                        write_result(r, o, warn_resize) for r, o in zip(results, outs))
        return written if isinstance(res, tuple) else written[0]

    out_variant.__name__ = out_variant.__qualname__ = f"{functional.__name__}_out"
    out_variant.__doc__ = f"``{name}``: {functional.__name__}'s result written into the ``out=`` tensor."
    lowering(name)(out_variant)
