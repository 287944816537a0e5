"""What the eager lowerings share, once each: the refusal exception, dtype sets, device guards, ATen
overload lookup, CPU-identical errors, the constant-table cache, seed drawing, a view's storage span and the
resizing of ``out=`` tensors.

This module is the bottom of ``torchneuron.ops``: it imports no other ops module, so every lowering
module can build on it without an import cycle.
"""
from __future__ import annotations

import functools

from typing import Any, Callable, NoReturn, Sequence

import torch

from torchneuron.neuron.random import default_generators

aten = torch.ops.aten

# dtypes the NeuronCore computes and stores (torchneuron.sim.numerics.DTYPES)
DEVICE_DTYPES = frozenset({torch.bool, torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16, torch.uint32,
                           torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2})
# the float dtypes the engines compute in (fp8 is a storage format)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALF_FLOATS = (torch.bfloat16, torch.float16)   # the 2-byte ones: PyTorch computes them in fp32 (opmath)


class Unsupported(Exception):
    """A lowering cannot run this call on the device: its registration takes the CPU fallback.

    The fallback runs the overload the lowering was called for on the arguments it was called with, or
    ``fallback`` = ``(overload, args, kwargs)`` when the lowering names another call: the ``out=``
    overload of a result it has already allocated, or arguments it has normalised."""

    def __init__(self, reason: str = "",
                 fallback: tuple[torch._ops.OpOverload, tuple, dict[str, Any]] | None = None) -> None:
        super().__init__(reason)
        self.fallback = fallback


# ---- scalars ----------------------------------------------------------------------------------------

_ROUNDED_SCALARS: dict = {}
_ROUNDED_SCALARS_LIMIT = 4096   # entries before the memo starts over


def rounded_scalar(v: int | float, dtype: torch.dtype) -> int | float:
    """A Python number as PyTorch converts its wrapped tensor (int64 or float64) to ``dtype`` (an input read at
    its kernel's common dtype: ``bf16 + 0.3`` adds 0.30078125)."""
    key = (type(v), v, dtype)
    hit = _ROUNDED_SCALARS.get(key)
    if hit is None:
        wrapped = torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int64)
        hit = remember(_ROUNDED_SCALARS, key, wrapped.to(dtype).item(), _ROUNDED_SCALARS_LIMIT)
    return hit


# ---- memory ------------------------------------------------------------------------------------------

def storage_span(t: torch.Tensor) -> torch.Tensor:
    """The contiguous 1-D run of storage a (non-empty) view covers, starting at its first element: what a
    kernel binds to read or write the view through its strides."""
    n = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.as_strided((n,), (1,), t.storage_offset())


def resize_out(out: torch.Tensor, shape: Sequence[int], warn: bool = True) -> None:
    """Resize an ``out=`` tensor to ``shape`` as ATen's ``resize_output`` does: unchanged when the shape
    matches, else resized, with ATen's deprecation warning when it had elements (unless not ``warn``: the
    CPU kernels that resize their ``out=`` quietly)."""
    if tuple(out.shape) == tuple(shape):
        return
    if out.numel() and warn:
        # ATen's own check on a storage-less twin raises the warning, word for word (Python's copy differs)
        torch._C._VariableFunctions._resize_output_(torch.empty(out.shape, device="meta"), list(shape),
                                                    torch.device("meta"))
    out.resize_(shape)


# ---- ATen overloads ---------------------------------------------------------------------------------

def overload(name: str) -> torch._ops.OpOverload:
    """The ATen overload ``name`` ("add.Tensor"; "relu" is the default overload)."""
    packet, _, ov = name.partition(".")
    return getattr(getattr(aten, packet), ov or "default")


def overload_exists(name: str) -> bool:
    """Whether ATen has the overload ``name``."""
    try:
        overload(name)
        return True
    except AttributeError:
        return False


def variants(base: str, *overloads: str) -> list[str]:
    """The functional, in-place and ``out=`` overloads of ``base`` for each overload ("" = default):
    ``add.Tensor``, ``add_.Tensor``, ``add.out``; ``add.Scalar``, ``add_.Scalar``, ``add.Scalar_out``."""
    names = []
    for i, ov in enumerate(overloads):
        suffix = f".{ov}" if ov else ""
        outs = [f"{base}.{ov}_out"] if ov else []
        if i == 0:
            outs.append(f"{base}.out")
        names += [n for n in (f"{base}{suffix}", f"{base}_{suffix}") if overload_exists(n)]
        names += [n for n in outs if overload_exists(n)][:1]
    return names


# ---- device guards ----------------------------------------------------------------------------------

def on_one_device(*ts: Any) -> bool:
    """Every argument that is not None is a tensor, all on one neuron device."""
    dev = None
    for t in ts:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.device.type != "neuron" or (dev is not None and t.device != dev):
            return False
        dev = t.device
    return True


def floats_on_one_device(*ts: torch.Tensor | None) -> bool:
    """``on_one_device`` for float tensors of a dtype the engines compute in."""
    return on_one_device(*ts) and all(t is None or t.dtype in FLOATS for t in ts)


# ---- errors as the CPU raises them ------------------------------------------------------------------

def type_name(dtype: torch.dtype) -> str:
    """The scalar type name PyTorch's messages use ("Float", "Long", ...)."""
    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
            torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
            torch.uint8: "Byte", torch.bool: "Bool"}.get(dtype, str(dtype).removeprefix("torch."))


def meta_twin(x: Any) -> Any:
    """A meta tensor standing for a device tensor (shape, strides, dtype; lists and tuples mapped), to run
    PyTorch's own argument checks without touching data."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(meta_twin(v) for v in x)
    return x


def meta_run(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """``op`` on meta twins: raises what the CPU kernel raises for bad arguments, returns the output meta."""
    return op(*meta_twin(args), **{k: meta_twin(v) for k, v in kwargs.items()})


def _signature(x: Any) -> Any:
    """What a meta kernel reads of an argument, hashable: a tensor's (shape, strides, dtype); lists as tuples."""
    if isinstance(x, torch.Tensor):
        return _TensorSignature(tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    return x


class _TensorSignature(tuple):
    """A tensor argument of ``meta_run_cached``: (shape, strides, dtype)."""

    def __new__(cls, shape: tuple, stride: tuple, dtype: torch.dtype):
        return super().__new__(cls, (shape, stride, dtype))


def _from_signature(x: Any) -> Any:
    if isinstance(x, _TensorSignature):
        return torch.empty_strided(x[0], x[1], dtype=x[2], device="meta")
    if isinstance(x, tuple):
        return [_from_signature(v) for v in x]
    return x


@functools.lru_cache(maxsize=512)
def _meta_run_signature(op: torch._ops.OpOverload, args: tuple) -> Any:
    return op(*(_from_signature(a) for a in args))


def meta_run_cached(op: torch._ops.OpOverload, *args: Any) -> Any:
    """``meta_run`` once per signature (the tensors' shapes, strides and dtypes and the other arguments): an op
    called again at the same shapes skips PyTorch's meta kernel (~0.1 ms); a call that raises is not cached, so
    bad arguments raise every time. The result is shared between calls: read its shapes, do not modify it."""
    return _meta_run_signature(op, tuple(_signature(a) for a in args))


def zeros_twin(x: Any) -> Any:
    """CPU zeros standing for tensors (of their shapes and dtypes; lists and tuples mapped, other values kept):
    what a CPU kernel is run on to meet its argument checks."""
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(zeros_twin(v) for v in x)
    return x


def _cpu_twin(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu_twin(v) for v in x)
    return x


def raise_like_cpu(op: torch._ops.OpOverload, *args: Any, with_data: bool = False, **kwargs: Any) -> NoReturn:
    """Run ``op`` on CPU twins of the arguments so the call raises the CPU's exception (type and message).

    ``with_data=False``: the twins are zeros of the arguments' shapes and dtypes (argument checks; a
    RuntimeError if the CPU accepts them). ``with_data=True``: copies of the values without ``out=``
    (data-dependent checks such as index bounds; an IndexError if the CPU accepts them)."""
    if with_data:
        op(*_cpu_twin(args), **{k: _cpu_twin(v) for k, v in kwargs.items() if k != "out"})
        raise IndexError("index out of range")
    op(*zeros_twin(args), **{k: zeros_twin(v) for k, v in kwargs.items()})
    raise RuntimeError(f"{op}: arguments the device cannot run")


def checked(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """PyTorch's shape and dtype checks for ``op``: run on meta twins (the result's meta); when they refuse,
    the CPU's own exception (type and message) from the op run on zero-filled CPU twins."""
    try:
        return meta_run(op, *args, **kwargs)
    except Exception:
        raise_like_cpu(op, *args, **kwargs)


# ---- bounded memos ------------------------------------------------------------------------------------

def remember(memo: dict, key: Any, value: Any, limit: int) -> Any:
    """Store ``value`` under ``key`` and return it; a memo past ``limit`` entries starts over first (a program
    that keeps changing shapes must not grow it without bound)."""
    if len(memo) > limit:
        memo.clear()
    memo[key] = value
    return value


# ---- constant tables ---------------------------------------------------------------------------------

_DEVICE_TABLES: dict[tuple, torch.Tensor] = {}
_TABLE_LIMIT = 512   # tables kept before the cache starts over (a program that keeps changing shapes)


def device_table(device: torch.device, builder: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``builder(*args)`` (a host-built constant: window indices, weights) on the device, uploaded once per
    device, builder and arguments."""
    key = (device.index, builder, args)
    t = _DEVICE_TABLES.get(key)
    if t is None:
        t = remember(_DEVICE_TABLES, key, builder(*args).to(device), _TABLE_LIMIT)
    return t


# ---- random seeds ------------------------------------------------------------------------------------

def neuron_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """The neuron generator an op on ``device`` draws from; a generator of another device type raises."""
    if generator is None:
        return default_generators[device.index if device.index is not None else 0]
    if generator.device.type != "neuron":
        raise RuntimeError(f"Expected a 'neuron' device type for generator but found '{generator.device.type}'")
    return generator


def draw_seed(generator: torch.Generator, low: int = -2 ** 31, high: int = 2 ** 31) -> int:
    """A seed in [low, high) for one launch, taken from ``generator`` (which advances, as a draw does)."""
    # a neuron generator's state is the state of the CPU engine it wraps: step a private copy of that
    # engine and write it back, so the global CPU generator is never touched
    host = torch.Generator()
    host.set_state(generator.get_state())
    seed = int(torch.randint(low, high, (1,), generator=host).item())
    generator.set_state(host.get_state())
    return seed
