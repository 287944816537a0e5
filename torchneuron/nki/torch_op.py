"""NKI kernels as PyTorch custom ops (``torch.library.custom_op`` style).

An NKI kernel called directly runs eagerly but is opaque to PyTorch: no autograd, no
``torch.compile``, no shape propagation. ``custom_op`` registers it as an operator
``namespace::name`` with

- a schema, inferred from a type-annotated *fake* function (or given as ``schema=``);
- the fake (meta) implementation, that function: it returns empty tensors of the output
  shapes and dtypes and may check its inputs with ``torch._check`` (it is also run on ``meta``
  copies of the inputs before each eager call, so bad shapes or dtypes raise there, before the
  kernel is traced, and a kernel whose results disagree with it is reported);
- the real implementation: the kernel, launched on the inputs' neuron device and current
  stream (``torchneuron.nki.on_device``), or, for CPU tensors, simulated on the host (inputs
  and outputs copied in and out of the simulated HBM);
- optionally a backward, registered with ``torch.library.register_autograd``: either a
  ``(ctx, *grads)`` function with its ``setup_context`` (PyTorch's convention), or an NKI
  *backward kernel*, itself registered as the op ``namespace::name_backward``. A backward kernel
  is called as ``bwd(*grad_outputs, *forward_args, **forward_kwonly_args)`` and returns one
  gradient per Tensor argument of the forward, in order (a tensor, or a tuple of them), each of
  that argument's shape and dtype.

Two equivalent spellings::

    @nki.custom_op("mylib::scaled_add", kernel=scaled_add_kernel, backward=scaled_add_bwd_kernel)
    def scaled_add(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
        torch._check(a.shape == b.shape, lambda: "a and b must have the same shape")
        return torch.empty_like(a)            # the fake: shapes and dtypes only

    scaled_add = nki.custom_op("mylib::scaled_add", scaled_add_kernel, fake=scaled_add_fake)

The result is torch's ``CustomOpDef``: call it, or ``torch.ops.mylib.scaled_add``; it works in
eager autograd and is captured by ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import torch

from torchneuron.nki import Kernel, jit
from torchneuron.nki import on_device

__all__ = ["custom_op"]


def custom_op(name: str, kernel: Callable | None = None, *, fake: Callable | None = None,
              schema: str | None = None, mutates_args: Iterable[str] | str = (),
              backward: Callable | None = None, setup_context: Callable | None = None,
              check_fake: bool = True) -> Any:
    """Register an NKI kernel as the PyTorch custom op ``name`` ("namespace::name").

    As a decorator: ``@custom_op(name, kernel=k)`` over the annotated fake function, or
    ``@custom_op(name, fake=f)`` over the kernel. As a call: ``custom_op(name, k, fake=f)``.

    ``kernel``: a ``@nki.jit`` kernel (a plain function is jitted) whose parameters are the op's
    arguments by name (``kernel[grid]`` for SPMD); it returns the op's outputs. ``fake``: the fake
    implementation (its annotations give the schema unless ``schema=`` is given, e.g.
    ``"(Tensor a, Tensor b, float alpha) -> Tensor"``). ``mutates_args``: as in
    ``torch.library.custom_op``. ``backward``: a backward kernel (``@nki.jit``), or a function
    ``(ctx, *grads) -> grads`` together with ``setup_context(ctx, inputs, output)``.
    ``check_fake``: run the fake on meta copies of the inputs before each eager call (input
    checks; outputs compared with the kernel's).

    Returns a ``torch._library.custom_ops.CustomOpDef`` (callable like the op).
    """
    if not isinstance(name, str) or name.count("::") != 1 or not all(name.split("::")):
        raise ValueError(f"custom_op: the name must be 'namespace::name', got {name!r}")

    def register(obj: Callable) -> Any:
        if kernel is not None:
            k, f = kernel, (fake if fake is not None else obj)
        else:
            k, f = obj, fake
        if f is None:
            raise TypeError(f"custom_op {name!r}: a fake (meta) implementation is required for shape "
                            f"propagation: pass fake=..., or decorate an annotated fake function and pass "
                            f"kernel=...")
        return _register(name, k if isinstance(k, Kernel) else jit(k), f, schema, mutates_args, backward,
                         setup_context, check_fake)

    if kernel is not None and fake is not None:
        return register(kernel)
    return register


def _register(name: str, kernel: Kernel, fake: Callable, schema: str | None, mutates_args: Any,
              backward: Callable | None, setup_context: Callable | None, check_fake: bool) -> Any:
    if schema is None:
        schema = torch.library.infer_schema(fake, mutates_args=mutates_args)
    parsed = torch._C.parse_schema("op" + schema)
    n_returns = len(parsed.returns)

    def impl(*args: Any, **kwargs: Any) -> Any:
        expected = _run_fake(fake, args, kwargs) if check_fake else None
        detached_args = tuple(_detach(v) for v in args)
        detached_kwargs = {n: _detach(v) for n, v in kwargs.items()}
        if on_device.has_neuron_tensor(detached_args, detached_kwargs):
            out = on_device.call_on_device(kernel, detached_args, detached_kwargs, op=name)
        else:
            if any(isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")
                   for v in (*args, *kwargs.values())):
                raise RuntimeError(f"{name}: NKI kernels run on neuron or CPU tensors")
            out = kernel(*detached_args, **detached_kwargs)
        out = _fresh(out, (*args, *kwargs.values()))
        if isinstance(out, list) and n_returns > 1:
            out = tuple(out)
        if expected is not None:
            _compare(name, out, expected)
        return out

    op = torch.library.custom_op(name, impl, mutates_args=mutates_args, schema=schema)
    op.register_fake(fake)
    if backward is not None:
        if isinstance(backward, Kernel):
            b, s = _kernel_autograd(name, parsed, schema, backward, check_fake)
            op.register_autograd(b, setup_context=s)
        else:
            op.register_autograd(backward, setup_context=setup_context)
    op.kernel = kernel
    return op


def _detach(v: Any) -> Any:
    return v.detach() if isinstance(v, torch.Tensor) else v


def _to_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_to_meta(x) for x in v)
    return v


def _run_fake(fake: Callable, args: tuple, kwargs: dict) -> Any:
    """The fake on meta copies of the inputs: its checks raise here, and it gives the expected outputs."""
    return fake(*(_to_meta(v) for v in args), **{n: _to_meta(v) for n, v in kwargs.items()})


def _leaves(out: Any) -> list:
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in _leaves(o)]
    return [out]


def _compare(name: str, out: Any, expected: Any) -> None:
    got, want = _leaves(out), _leaves(expected)
    if len(got) != len(want):
        raise RuntimeError(f"{name}: the kernel returned {len(got)} output(s) but the fake implementation "
                           f"returns {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, torch.Tensor) and (not isinstance(g, torch.Tensor) or g.shape != w.shape
                                            or g.dtype != w.dtype):
            desc = f"{type(g).__name__}" if not isinstance(g, torch.Tensor) else f"{list(g.shape)} {g.dtype}"
            raise RuntimeError(f"{name}: output {i} of the kernel is {desc} but the fake implementation "
                               f"says {list(w.shape)} {w.dtype}; fix the kernel or the fake")


def _fresh(out: Any, inputs: tuple) -> Any:
    """Outputs of a functional custom op may not alias its inputs: clone any that is an input."""
    ids = {id(v) for v in inputs if isinstance(v, torch.Tensor)}
    ptrs = {v.untyped_storage().data_ptr() for v in inputs if isinstance(v, torch.Tensor) and v.numel()}

    def fix(o: Any) -> Any:
        if isinstance(o, (tuple, list)):
            return type(o)(fix(x) for x in o)
        if isinstance(o, torch.Tensor) and (id(o) in ids or (o.numel() and o.untyped_storage().data_ptr() in ptrs)):
            return o.clone()
        return o
    return fix(out)


def _kernel_autograd(name: str, fwd: Any, fwd_schema: str, bwd_kernel: Kernel, check_fake: bool) -> tuple[Callable, Callable]:
    """``(backward, setup_context)`` that call ``bwd_kernel`` through the custom op ``name + "_backward"``."""
    args = list(fwd.arguments)
    tensor_pos = [i for i, a in enumerate(args) if str(a.type) == "Tensor"]
    if not tensor_pos:
        raise TypeError(f"custom_op {name!r}: a backward kernel needs at least one Tensor argument")
    n_grads = len(fwd.returns)
    if n_grads == 0 or any(str(r.type) != "Tensor" for r in fwd.returns):
        raise TypeError(f"custom_op {name!r}: a backward kernel needs the op to return Tensor(s), "
                        f"not {[str(r.type) for r in fwd.returns]}")
    grads = ", ".join(f"Tensor grad_{i}" for i in range(n_grads))
    inner = re.sub(r"\([a-z]+!?\)", "", fwd_schema[fwd_schema.index("(") + 1:fwd_schema.rindex(") ->")]).strip()
    params = grads + (", " + inner if inner else "")
    rets = "Tensor" if len(tensor_pos) == 1 else "(" + ", ".join(["Tensor"] * len(tensor_pos)) + ")"
    bwd_schema = f"({params}) -> {rets}"

    def bwd_fake(*a: Any, **kw: Any) -> Any:
        inputs = list(a[n_grads:]) + [kw[args[i].name] for i in range(len(args)) if args[i].kwarg_only]
        outs = [torch.empty_like(inputs[i], memory_format=torch.contiguous_format) for i in tensor_pos]
        return outs[0] if len(outs) == 1 else tuple(outs)

    bwd_op = _register(name + "_backward", bwd_kernel, bwd_fake, bwd_schema, (), None, None, check_fake)

    def setup(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.save_for_backward(*(inputs[i] for i in tensor_pos))
        ctx.others = [None if i in tensor_pos else v for i, v in enumerate(inputs)]
        outs = output if isinstance(output, (tuple, list)) else (output,)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]

    def backward(ctx: Any, *gs: Any) -> tuple:
        inputs = list(ctx.others)
        for i, t in zip(tensor_pos, ctx.saved_tensors):
            inputs[i] = t
        gs = tuple(g if g is not None else torch.zeros(s, dtype=d, device=dev)
                   for g, (s, d, dev) in zip(gs, ctx.out_meta))
        pos = [v for a, v in zip(args, inputs) if not a.kwarg_only]
        kw = {a.name: v for a, v in zip(args, inputs) if a.kwarg_only}
        res = bwd_op(*gs, *pos, **kw)
        res = res if isinstance(res, (tuple, list)) else (res,)
        out: list = [None] * len(args)
        for i, g in zip(tensor_pos, res):
            out[i] = g
        return tuple(out)

    return backward, setup
