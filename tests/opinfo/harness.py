"""Run PyTorch OpInfo samples on ``neuron`` and compare them with the CPU.

For one OpInfo (``torch.testing._internal.common_methods_invocations.op_db``) and one
dtype, :func:`run_op`

1. draws the OpInfo's ``sample_inputs("cpu", dtype)`` under a fixed seed, one sample at
   a time;
2. copies each sample to ``neuron`` (input, args, kwargs; recursively through
   lists, tuples and dicts) *before* the CPU run, so in-place ops see the same data on
   both devices; a tensor is copied together with its whole storage and re-viewed
   with the same sizes, strides and storage offset, so views and ``as_strided``
   samples mean the same thing on both devices;
3. runs the op on both and compares the outputs (the neuron ones moved back to the
   CPU) with ``torch.testing.assert_close(..., equal_nan=True)`` at the OpInfo's
   tolerance for the dtype when it declares one, PyTorch's defaults otherwise; a tensor
   computed on neuron must also live on neuron;
4. runs ``op.error_inputs("cpu")`` and checks that whatever exception type the CPU
   raises, neuron raises the same type.

Outputs of random ops (and of ``empty*``, whose memory is uninitialized), and of the
samples of attention ops that apply dropout, are compared by shape, dtype and device only.

Device arguments in samples are the one non-tensor that is rewritten: a ``"cpu"``
device (string or ``torch.device``) becomes ``neuron``, otherwise factory ops
(``ones``, ``arange``, ``randn``, ``Tensor.to(device)``, ...) would never reach the
device. Tensors on other devices (``meta`` in some error inputs) stay where they are,
and so do the few arguments an op requires on the CPU (``_CPU_ARGS``). A sample with
neither a tensor nor a device argument (``arange(5)``) never reaches neuron: skipped.

The device rejects complex dtypes on purpose (a TypeError). Complex-only ops are
skipped, and so is each sample that takes a complex tensor, or whose neuron run raises
that TypeError (a complex output or intermediate). An op none of whose samples could run
is reported as skipped, with the reason.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
import traceback
import warnings
from typing import Iterable

import torch

import torchneuron

# The CPU fallback warns once per op; here that is expected.
warnings.filterwarnings("ignore", message=r".*has no neuron kernel yet.*")

DEVICE = "neuron"
DEFAULT_SEED = 1234
# Dtype order used when an op does not support float32: the first one it supports.
DTYPE_PREFERENCE = (torch.float32, torch.int64, torch.bool, torch.float64, torch.bfloat16, torch.float16,
                    torch.int32, torch.int16, torch.int8, torch.uint8, torch.float8_e4m3fn,
                    torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)

STATUS_PASSED = "passed"
STATUS_FAILED = "failed"
STATUS_SKIPPED = "skipped"


class OpSkipped(Exception):
    """The op (or all of its samples) cannot be tested on neuron by design."""


class SampleSkipped(Exception):
    """This one sample cannot be tested on neuron by design (e.g. complex tensors)."""


class OpTimeout(Exception):
    """The op ran past its time budget."""


# ---------------------------------------------------------------------------
# Op identity and classification


def op_key(op) -> str:
    """A unique, readable id: ``name`` or ``name.variant``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def find_ops(keys: Iterable[str], ops=None) -> list:
    """OpInfos by key; a bare op name selects all its variants. Unknown keys raise."""
    if ops is None:
        ops = load_op_db()
    wanted = [k.strip() for k in keys if k.strip()]
    found, missing = [], []
    for k in wanted:
        hits = [op for op in ops if op_key(op) == k]
        if not hits:
            hits = [op for op in ops if op.name == k]
        if not hits:
            missing.append(k)
        for op in hits:
            if op not in found:
                found.append(op)
    if missing:
        raise KeyError(f"no OpInfo named {', '.join(missing)}")
    return found


_OP_DB = None


def load_op_db() -> list:
    global _OP_DB
    if _OP_DB is None:
        from torch.testing._internal.common_methods_invocations import op_db

        _OP_DB = list(op_db)
    return _OP_DB


# Outputs that are random or uninitialized: compare shape/dtype/device only. Matched
# against the last dotted component of op.name, whole words only (``__rand__`` is
# bitwise and, ``nn.functional.normalize`` is deterministic).
_RANDOM_NAME = re.compile(
    r"^(rand|randn|randint|rand_like|randn_like|randint_like|normal|log_normal|bernoulli|"
    r"multinomial|uniform|cauchy|exponential|geometric|rrelu|"
    r"empty|empty_like|empty_strided|empty_permuted|new_empty|new_empty_strided|"
    r"fractional_max_pool2d|fractional_max_pool3d|"
    # randomized algorithms: a random projection drawn from the device's generator (PyTorch's own
    # OpInfos skip their CPU comparison: "output is non-deterministic")
    r"svd_lowrank|pca_lowrank)$"
    r"|dropout")
# Deterministic despite their names.
_NOT_RANDOM = {"native_dropout_backward", "signal.windows.exponential",
               "nn.functional.feature_alpha_dropout.without_train"}


def is_random_op(op) -> bool:
    if op.name in _NOT_RANDOM or op_key(op) in _NOT_RANDOM:
        return False
    return bool(_RANDOM_NAME.search(op.name.rsplit(".", 1)[-1]))


# Ops random only in the samples that apply dropout: {op name: (kwarg, index in
# sample.args)} of the dropout probability. Those samples are compared by shape, dtype
# and device only (the device draws its masks with its own generator).
_DROPOUT_ARG = {
    "nn.functional.scaled_dot_product_attention": ("dropout_p", 3),
    "nn.functional.multi_head_attention_forward": ("dropout_p", 9),
}


def is_random_sample(op, sample) -> bool:
    """Whether this sample of an otherwise deterministic op applies dropout (p > 0, training)."""
    where = _DROPOUT_ARG.get(op.name)
    if where is None:
        return False
    kwarg, index = where
    p = sample.kwargs.get(kwarg, sample.args[index] if len(sample.args) > index else 0.0)
    return bool(p) and bool(sample.kwargs.get("training", True))


def pick_dtype(op, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype to test ``op`` at: ``dtype`` if given, else the first CPU-supported one of
    DTYPE_PREFERENCE (float32 first). Raises OpSkipped for ops with none of these."""
    supported = op.supported_dtypes("cpu")
    if dtype is not None:
        if dtype.is_complex:
            raise OpSkipped(f"complex dtype {dtype}: the neuron device rejects complex dtypes")
        if dtype not in supported:
            raise OpSkipped(f"{dtype} is not supported by this op on the CPU")
        return dtype
    for d in DTYPE_PREFERENCE:
        if d in supported:
            return d
    if not supported:
        raise OpSkipped("no CPU dtypes (a CUDA-only op)")
    if all(d.is_complex for d in supported):
        raise OpSkipped("complex-only op: the neuron device rejects complex dtypes")
    names = ", ".join(sorted(str(d).replace("torch.", "") for d in supported))
    raise OpSkipped(f"supports no dtype the harness tests (only {names})")


def tolerance_for(op, dtype: torch.dtype) -> tuple[float | None, float | None]:
    """(atol, rtol) the OpInfo declares for ``dtype``, or (None, None) for the defaults.

    Reads ``toleranceOverride`` and ``precisionOverride`` decorators, whether applied to
    every test of the op or through a DecorateInfo that is not tied to another device
    (CUDA, MPS, ...). When several apply, the loosest wins, and neither bound is tighter
    than PyTorch's default for the dtype.
    """
    from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    candidates = []
    for deco in getattr(op, "decorators", ()) or ():
        if isinstance(deco, DecorateInfo):
            if deco.device_type not in (None, "cpu") or not deco.active_if:
                continue
            if deco.dtypes is not None and dtype not in deco.dtypes:
                continue
            candidates.extend(deco.decorators)
        else:
            candidates.append(deco)
    atol = rtol = None
    for deco in candidates:
        if isinstance(deco, toleranceOverride) and dtype in deco.d:
            t = deco.d[dtype]
            atol = t.atol if atol is None else max(atol, t.atol)
            rtol = t.rtol if rtol is None else max(rtol, t.rtol)
        elif isinstance(deco, precisionOverride) and dtype in deco.d:
            a = deco.d[dtype]
            atol = a if atol is None else max(atol, a)
    if atol is None:
        return None, None
    # Never tighter than PyTorch's defaults for the dtype: some overrides tighten one bound
    # for one CPU-only test (matmul's test_noncontiguous_samples: atol=0), which a comparison
    # of two devices with different accumulation orders cannot meet. precisionOverride sets
    # only atol: the default rtol applies.
    from torch.testing._comparison import default_tolerances

    default_rtol, default_atol = default_tolerances(dtype)
    return max(atol, default_atol), max(rtol or 0.0, default_rtol)


# ---------------------------------------------------------------------------
# Moving samples


def _is_cpu_device(x) -> bool:
    if isinstance(x, torch.device):
        return x.type == "cpu"
    return isinstance(x, str) and x in ("cpu", "cpu:0")


def _has(obj, pred) -> bool:
    if isinstance(obj, torch.Tensor):
        return pred(obj)
    if isinstance(obj, (list, tuple)):
        return any(_has(o, pred) for o in obj)
    if isinstance(obj, dict):
        return any(_has(o, pred) for o in obj.values())
    return False


def _tensors(obj) -> list:
    """The tensors in ``obj``, depth first (lists, tuples, dict values)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def has_complex(obj) -> bool:
    return _has(obj, lambda t: t.is_complex())


def is_complex_rejection(exc: BaseException) -> bool:
    """The TypeError the device raises, by design, for any complex tensor."""
    return isinstance(exc, TypeError) and "neuron does not support complex dtypes" in str(exc)


def involves_neuron(obj) -> bool:
    """Whether a (moved) sample holds a neuron tensor or names the neuron device."""
    if isinstance(obj, torch.Tensor):
        return obj.device.type == DEVICE
    if isinstance(obj, torch.device):
        return obj.type == DEVICE
    if isinstance(obj, str):
        return obj == DEVICE
    if isinstance(obj, (list, tuple)):
        return any(involves_neuron(o) for o in obj)
    if isinstance(obj, dict):
        return any(involves_neuron(o) for o in obj.values())
    return False


def _tensor_to_neuron(t: torch.Tensor, cache: dict) -> torch.Tensor:
    """A neuron copy of ``t`` with the same sizes, strides and storage offset, and the
    same storage shared with other tensors of the sample that shared it on the CPU (the
    same tensor passed twice, e.g. as input and as out=, stays one tensor)."""
    same = cache.get(("id", id(t)))
    if same is not None:
        return same[1]
    out = _tensor_to_neuron_new(t, cache)
    cache[("id", id(t))] = (t, out)  # t kept alive so that its id stays unique
    return out


def _tensor_to_neuron_new(t: torch.Tensor, cache: dict) -> torch.Tensor:
    if t.layout != torch.strided or t.is_quantized:
        out = t.detach().to(DEVICE)
    else:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), t.dtype)
        base = cache.get(key) if storage.data_ptr() else None
        if base is None:
            n = storage.nbytes() // t.element_size()
            flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (n,), (1,))
            base = flat.to(DEVICE)
            if storage.data_ptr():
                cache[key] = base
        out = base.as_strided(t.size(), t.stride(), t.storage_offset())
        if t.is_neg():
            out = torch._neg_view(out)
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def to_neuron(obj, cache: dict | None = None):
    """Copy tensors in ``obj`` to neuron (recursively); map CPU devices to neuron;
    leave everything else alone."""
    if cache is None:
        cache = {}
    if isinstance(obj, torch.Tensor):
        # Only CPU tensors move; a meta tensor in an error input stays meta.
        return _tensor_to_neuron(obj, cache) if obj.device.type == "cpu" else obj
    if isinstance(obj, torch.device) and obj.type == "cpu":
        return torch.device(DEVICE)
    if isinstance(obj, str) and _is_cpu_device(obj):
        return DEVICE
    if isinstance(obj, list):
        return [to_neuron(o, cache) for o in obj]
    if isinstance(obj, tuple):
        items = [to_neuron(o, cache) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: to_neuron(v, cache) for k, v in obj.items()}
    return obj


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list):
        return [to_cpu(o) for o in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------
# Comparing outputs


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return f"{type(x).__name__}({x!r})"[:200]


def compare(actual, expected, *, atol=None, rtol=None, meta_only=False, path="output",
            check_device=True) -> None:
    """Assert that ``actual`` (computed on neuron) matches ``expected`` (on the CPU)."""
    kw = {"atol": atol, "rtol": rtol, "meta_only": meta_only, "check_device": check_device}
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{path}: expected {_describe(expected)}, got {_describe(actual)}")
        if check_device and expected.device.type == "cpu" and actual.device.type != DEVICE:
            raise AssertionError(f"{path}: a tensor computed on neuron came back on {actual.device}")
        if actual.shape != expected.shape:
            raise AssertionError(f"{path}: shape {tuple(actual.shape)} != CPU's {tuple(expected.shape)}")
        if actual.dtype != expected.dtype:
            raise AssertionError(f"{path}: dtype {actual.dtype} != CPU's {expected.dtype}")
        if meta_only or expected.device.type != "cpu":
            return
        tol = {} if atol is None else {"atol": atol, "rtol": rtol}
        a = actual.detach().cpu()
        e = expected.detach()
        if a.layout != torch.strided or e.layout != torch.strided:
            a, e = a.to_dense(), e.to_dense()
        torch.testing.assert_close(a, e, equal_nan=True, check_device=False, check_layout=False,
                                   msg=lambda m: f"{path}: {m}", **tol)
        return
    if isinstance(expected, (list, tuple)) and not isinstance(expected, torch.Size):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise AssertionError(f"{path}: expected {type(expected).__name__} of {len(expected)}, "
                                 f"got {_describe(actual)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            compare(a, e, path=f"{path}[{i}]", **kw)
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise AssertionError(f"{path}: expected dict with keys {list(expected)}, got {_describe(actual)}")
        for k in expected:
            compare(actual[k], expected[k], path=f"{path}[{k!r}]", **kw)
        return
    if isinstance(expected, float) and isinstance(actual, (int, float)) and not meta_only:
        tol = {} if atol is None else {"atol": atol, "rtol": rtol}
        torch.testing.assert_close(float(actual), expected, equal_nan=True,
                                   msg=lambda m: f"{path}: {m}", **tol)
        return
    if meta_only and isinstance(expected, (int, float)) and not isinstance(expected, bool):
        if type(actual) is not type(expected):
            raise AssertionError(f"{path}: expected {_describe(expected)}, got {_describe(actual)}")
        return
    if type(actual) is not type(expected) or actual != expected:
        raise AssertionError(f"{path}: expected {_describe(expected)}, got {_describe(actual)}")


# ---------------------------------------------------------------------------
# Running one op


@dataclasses.dataclass
class OpResult:
    key: str
    name: str
    variant: str
    dtype: str = ""
    status: str = STATUS_PASSED
    error: str = ""
    samples_passed: int = 0
    samples_skipped: int = 0
    grads_checked: int = 0   # samples whose input gradients were compared too
    error_inputs_checked: int = 0
    error_inputs_skipped: int = 0
    notes: list = dataclasses.field(default_factory=list)
    fallback_ops: dict = dataclasses.field(default_factory=dict)
    error_input_fallback_ops: dict = dataclasses.field(default_factory=dict)  # part of fallback_ops
    sample_layouts: list = dataclasses.field(default_factory=list)  # non-strided input layouts seen
    seconds: float = 0.0
    traceback: str = ""

    @property
    def fallback_calls(self) -> int:
        return sum(self.fallback_ops.values())


def _seeded(iterable, seed: int):
    """Iterate ``iterable`` re-seeding the CPU RNGs before each item, so a sample does
    not depend on how much randomness the previous op runs consumed."""
    import random

    it = iter(iterable)
    i = 0
    while True:
        torch.manual_seed(seed + i)
        random.seed(seed + i)
        try:
            import numpy

            numpy.random.seed((seed + i) % 2**32)
        except ImportError:  # pragma: no cover
            pass
        try:
            item = next(it)
        except StopIteration:
            return
        except Exception as e:
            e.add_note(f"generating input {i}: the OpInfo's own generator failed on the CPU")
            raise
        yield item
        i += 1


def _sparse_layouts(sample) -> set[str]:
    """The non-strided layouts (sparse COO/CSR/...) of the tensors in a sample."""
    return {str(t.layout).replace("torch.", "") for t in _tensors(_parts(sample)) if t.layout != torch.strided}


def _sample_str(sample) -> str:
    try:
        s = repr(sample)
    except Exception:  # noqa: BLE001
        s = "<unprintable sample>"
    return s if len(s) <= 600 else s[:600] + "..."


def _parts(sample) -> tuple:
    return (sample.input, tuple(sample.args), dict(sample.kwargs))


def _device_resolved(parts: tuple) -> tuple:
    """``parts`` with what PyTorch resolves per device type made the device's for the CPU run too: the chunked
    ``linear_cross_entropy``'s ``acc_policy="auto"`` and ``chunking_method="auto"`` are "accurate" and
    "aspect_ratio" on the CPU but, from PyTorch's own table (``_AUTO_DEFAULTS``), "compact" and "aspect_ratio:2"
    on an unlisted device such as neuron (as on CUDA): another precision and other chunks, whose 2-byte sums
    round differently; the comparison is of the same algorithm."""
    options = parts[2].get("options")
    auto = {k for k in ("acc_policy", "chunking_method") if getattr(options, k, None) == "auto"}
    if getattr(options, "batch_chunk_size", None) is not None:
        auto.discard("chunking_method")   # (an explicit chunk size turns the heuristic off on every device)
    if not auto or not isinstance(parts[0], torch.Tensor):
        return parts
    from torch.nn.modules import linear_cross_entropy_options as lce
    picked = lce._AUTO_DEFAULTS.get(("neuron", parts[0].dtype), lce._AUTO_FALLBACK)
    resolved = {k: getattr(picked, k) for k in auto}
    return parts[0], parts[1], {**parts[2], "options": dataclasses.replace(options, **resolved)}


class _StayOnCpu:
    """Wraps a sample argument that the op requires on the CPU (see _CPU_ARGS)."""

    def __init__(self, value):
        self.value = value


# Arguments an op requires on the CPU whatever the device of its input; their OpInfo
# samples build them on the CPU on every device. {op name: positional arg indices}.
_CPU_ARGS = {
    "tensor_split": {0},  # tensor_indices_or_sections must be a CPU int64 tensor
}

# Error inputs where the CPU's own kernel raises a different exception type than the
# device-generic one, which the OpInfo itself declares for non-CPU devices:
# {op name: {(CPU exception type, accepted device exception type)}}.
_ACCEPTED_ERROR_TYPES = {
    # narrow_copy_dense_cpu checks dim with TORCH_CHECK (RuntimeError); the generic
    # kernel goes through narrow(), an IndexError (see error_inputs_narrow_narrow_copy).
    "narrow_copy": {(RuntimeError, IndexError)},
}


def _move_parts(op, parts: tuple) -> tuple:
    inp, args, kwargs = parts
    keep = _CPU_ARGS.get(op.name, ())
    args = tuple(_StayOnCpu(a) if i in keep else a for i, a in enumerate(args))
    inp, args, kwargs = to_neuron((inp, args, kwargs))
    args = tuple(a.value if isinstance(a, _StayOnCpu) else a for a in args)
    return inp, args, kwargs


def _run(op, parts: tuple):
    inp, args, kwargs = parts
    return op(inp, *args, **kwargs)


# Ops whose results are sums of products (a reduction of K terms per output element). Their float results
# depend on the summation order, which differs between the device and the CPU, and between CPUs (vector
# width, threads): the difference is a few units of rounding of the *terms' magnitude*, not of the result,
# so a result that cancels to near zero can differ by more than a result-relative tolerance allows.
ACCUMULATING = ("nn.functional.conv", "conv", "nn.functional.linear", "nn.functional.bilinear", "mm", "bmm", "addmm",
                "addmv", "addbmm", "baddbmm", "addr", "matmul", "__rmatmul__", "mv", "dot", "vdot", "inner", "einsum",
                "tensordot", "linalg.multi_dot", "chain_matmul")
ORDER_ULPS = 64   # ~sqrt(K) rounding units of sum(|terms|) for the reduction lengths of OpInfo samples (K <= 4096)


def _accumulating(op) -> bool:
    return any(op.name == n or op.name.startswith(n) for n in ACCUMULATING)


def _abs64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().abs().double()
    if isinstance(x, (list, tuple)):
        return type(x)(_abs64(v) for v in x)
    if isinstance(x, dict):
        return {k: _abs64(v) for k, v in x.items()}
    return x


def _fft_term_magnitudes(op, parts: tuple) -> torch.Tensor | None:
    """A bound on sum(|terms|) for every output element of an FFT op: each output is a sum of inputs times
    twiddles of modulus 1 (times the norm's scale), so its sum(|terms|) is at most the transform of |x| at zero
    frequency, the largest value of that transform; twice that for the Hermitian ops (hfft, irfft), whose stored
    inputs each stand for two terms."""
    x = parts[0]
    if not isinstance(x, torch.Tensor):
        return None
    try:
        out = _run(op, (x.detach().abs().double(), *parts[1:]))
    except Exception:  # noqa: BLE001 (the plain tolerance)
        return None
    if not isinstance(out, torch.Tensor) or out.numel() == 0:
        return None
    return torch.full(out.shape, 2 * float(out.abs().amax()), dtype=torch.float64)


def term_magnitudes(op, parts: tuple) -> torch.Tensor | None:
    """Per output element, sum(|terms|) of a sum of products: the op on the inputs' absolute values in float64
    (None when the op is not one, or that cannot be run)."""
    if op.name.startswith("fft."):
        return _fft_term_magnitudes(op, parts)
    if not _accumulating(op):
        return None
    try:
        bound = _run(op, _abs64(parts))
    except Exception:  # noqa: BLE001 (an op that will not take float64 / abs inputs: the plain tolerance)
        return None
    return bound if isinstance(bound, torch.Tensor) else None


def within_summation_order(actual, expected, bound, ulps: float = ORDER_ULPS):
    """``expected`` with each element that ``actual`` matches within ``ulps`` rounding units of its terms'
    magnitude (``bound``, from ``term_magnitudes``) replaced by ``actual``'s: the plain comparison that follows
    then checks everything else (shapes, dtypes, NaN, elements further off)."""
    if bound is None or not isinstance(actual, torch.Tensor) or not expected.is_floating_point() \
            or bound.shape != expected.shape or actual.shape != expected.shape:
        return expected
    a = actual.detach().cpu()
    slack = ulps * torch.finfo(expected.dtype).eps / 2 * bound
    close = (a.double() - expected.detach().double()).abs() <= slack
    return torch.where(close, a.to(expected.dtype), expected.detach())


REDUCED_FLOATS = (torch.bfloat16, torch.float16)


def _to64(obj, dtypes: tuple = REDUCED_FLOATS):
    """``obj`` with its float tensors of ``dtypes`` (by default the reduced-precision ones, bf16 and fp16) as
    float64, and those dtypes (a factory's ``dtype=``) as float64, recursively."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().double() if obj.dtype in dtypes else obj
    if isinstance(obj, torch.dtype):
        return torch.float64 if obj in dtypes else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to64(o, dtypes) for o in obj)
    if isinstance(obj, dict):
        return {k: _to64(v, dtypes) for k, v in obj.items()}
    return obj


def within_reference_error(exact, actual, expected, atol: float | None, rtol: float | None):
    """``expected`` (an fp32 result) with each element where ``actual`` is as close to ``exact`` (the float64
    result of the same inputs) as the CPU's is, give or take the comparison's own tolerance, replaced by
    ``actual``'s. Where a result is ill-conditioned (a solve, a gradient of cancelling terms), both devices
    carry errors much larger than a rounding of the result, in different directions; the CPU's own error on
    the sample is not held against the device, which must still be within tolerance of the exact value beyond
    it. A device result further off than that still fails the plain comparison that follows."""
    if not isinstance(expected, torch.Tensor) or expected.dtype != torch.float32 \
            or not isinstance(actual, torch.Tensor) or actual.shape != expected.shape \
            or not isinstance(exact, torch.Tensor) or exact.shape != expected.shape \
            or torch.strided not in {expected.layout} & {actual.layout} & {exact.layout}:
        return expected
    from torch.testing._comparison import default_tolerances

    rtol0, atol0 = default_tolerances(torch.float32)
    atol, rtol = (atol0, rtol0) if atol is None else (atol, rtol)
    a, e, x = actual.detach().cpu().double(), expected.detach().double(), exact.detach().double()
    ok = (a - x).abs() <= (e - x).abs() + atol + rtol * x.abs()
    return torch.where(ok, actual.detach().cpu(), expected.detach())


def _compared_beyond_reference_error(compare_fn, exact_fn, actual, expected, atol, rtol) -> None:
    """``compare_fn(actual, expected)``; when it fails on an fp32 result, again after ``within_reference_error``
    against ``exact_fn()`` (float64 on the same inputs, run only then)."""
    try:
        compare_fn(actual, expected)
        return
    except AssertionError:
        if not any(t.dtype == torch.float32 for t in _tensors(expected)):
            raise
        try:
            exact = exact_fn()
        except Exception:  # noqa: BLE001 (an op that will not take float64 inputs: the plain comparison)
            exact = None
        if exact is None:
            raise
    compare_fn(actual, _each_result(lambda x, a, e: within_reference_error(x, a, e, atol, rtol), exact, actual,
                                    expected))


def at_least_as_exact(exact, actual, expected):
    """``expected`` with each element of a bf16/fp16 result where ``actual`` is at least as close as the CPU's
    to ``exact`` (the float64 result of the same rounded inputs), up to one rounding of the result, replaced by
    ``actual``'s. The CPU rounds some intermediates to the dtype (``x + alpha * y``, a loss's weighted sum,
    ``linspace``'s steps) where the device keeps fp32: both are right to within their own rounding, and a
    result that cancels can leave them further apart than a result-relative tolerance allows. The plain
    comparison that follows checks everything else: a device result less exact than the CPU's still fails."""
    if not isinstance(expected, torch.Tensor) or expected.dtype not in REDUCED_FLOATS \
            or not isinstance(actual, torch.Tensor) or actual.shape != expected.shape \
            or not isinstance(exact, torch.Tensor) or exact.shape != expected.shape \
            or torch.strided not in {expected.layout} & {actual.layout} & {exact.layout}:
        return expected
    a, e, x = actual.detach().cpu().double(), expected.detach().double(), exact.detach().double()
    ok = (a - x).abs() <= (e - x).abs() + torch.finfo(expected.dtype).eps / 2 * x.abs()
    return torch.where(ok, actual.detach().cpu(), expected.detach())


def _each_result(check, exact, actual, expected):
    """``check(exact, actual, expected)`` on a tensor result, or on each tensor of a tuple or list of results
    (an op returning several: attention's output and weights, a norm's output and statistics)."""
    if isinstance(expected, torch.Tensor):
        return check(exact, actual, expected)
    if isinstance(expected, (tuple, list)) and isinstance(actual, (tuple, list)) \
            and isinstance(exact, (tuple, list)) and len(actual) == len(expected) == len(exact):
        items = [check(x, a, e) if isinstance(e, torch.Tensor) else e for x, a, e in zip(exact, actual, expected)]
        return type(expected)(*items) if hasattr(expected, "_fields") else type(expected)(items)
    return expected


# Ops whose index results may order tied values either way unless asked to be stable: {name: the position
# of ``dim`` among the positional arguments after the input}.
_TIE_ORDER_FREE = {"sort": 0, "argsort": 0, "topk": 1}
# Sorts with no stable flag that return values only (compared as they are): which of tied values takes which
# gradient is unspecified too
_UNSTABLE_VALUE_SORTS = {"msort"}


def _same_values_at(inp: torch.Tensor, dim: int, a: torch.Tensor, e: torch.Tensor) -> bool:
    """Whether index tensors ``a`` and ``e`` pick the same values of ``inp`` along ``dim``, each index at most
    once per line (they differ only in which of tied values comes first, or is taken)."""
    if a.shape != e.shape or a.dtype != e.dtype or inp.dim() == 0:
        return torch.equal(a, e)
    a, e = a.detach().cpu(), e.detach()
    if a.shape[dim] > 1 and (a.sort(dim).values.diff(dim=dim) == 0).any():
        return False
    return torch.equal(inp.gather(dim, a).view(-1).nan_to_num(), inp.gather(dim, e).view(-1).nan_to_num())


# Reductions that return (value, index of an element holding it): any such index is right. {name: position
# of ``dim`` among the positional arguments after the input}.
_ANY_INDEX_OF_VALUE = {"kthvalue": 1, "mode": 0, "median": 0, "nanmedian": 0}


def _index_holds_value(inp: torch.Tensor, dim: int, keepdim: bool, values: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether ``idx`` (a reduction's index result along ``dim``) points at elements equal to ``values``."""
    if inp.dim() == 0:
        return bool((idx == 0).all())
    i = idx.detach().cpu()
    i = i if keepdim else i.unsqueeze(dim)
    if i.numel() and (i.min() < 0 or i.max() >= inp.shape[dim]):
        return False
    picked = inp.gather(dim, i).reshape(values.shape)
    return torch.equal(picked.nan_to_num(), values.detach().cpu().nan_to_num())


def any_index_of_value(op, parts: tuple, actual, expected):
    """``expected`` with the index result of ``kthvalue``/``mode``/``median`` replaced by ``actual``'s where it
    points at an element holding the (still compared) value: which of tied elements is unspecified."""
    pos = _ANY_INDEX_OF_VALUE.get(op.name)
    inp, args, kwargs = parts
    if pos is None or not isinstance(inp, torch.Tensor) or not isinstance(expected, tuple) \
            or not isinstance(actual, tuple) or len(expected) != 2 or len(actual) != 2:
        return expected
    dim = args[pos] if len(args) > pos else kwargs.get("dim", -1)
    keepdim = args[pos + 1] if len(args) > pos + 1 else kwargs.get("keepdim", False)
    if not _index_holds_value(inp, dim, keepdim, expected[0], actual[1]):
        return expected
    idx = actual[1].detach().cpu()
    return type(expected)((expected[0], idx)) if hasattr(expected, "_fields") else (expected[0], idx)


def tie_order_free(op, parts: tuple, actual, expected):
    """``expected`` with the index results of an unstable sort (``sort``, ``argsort``, ``topk``) replaced by
    ``actual``'s where those only order tied values differently: the order of ties is unspecified (bf16 and
    integer inputs have many), and the values themselves are still compared."""
    pos = _TIE_ORDER_FREE.get(op.name)
    inp, args, kwargs = parts
    if pos is None or kwargs.get("stable") or not isinstance(inp, torch.Tensor):
        return expected
    dim = args[pos] if len(args) > pos else kwargs.get("dim", -1)
    if isinstance(expected, torch.Tensor):
        return actual.detach().cpu() if isinstance(actual, torch.Tensor) and _same_values_at(
            inp, dim, actual, expected) else expected
    if isinstance(expected, tuple) and isinstance(actual, tuple) and len(expected) == 2 == len(actual):
        idx = actual[1].detach().cpu() if _same_values_at(inp, dim, actual[1], expected[1]) else expected[1]
        return type(expected)((expected[0], idx)) if hasattr(expected, "_fields") else (expected[0], idx)
    return expected


def check_sample(op, sample, *, atol=None, rtol=None, meta_only=False) -> None:
    """Run one CPU sample on both devices and compare; raises AssertionError on a
    mismatch, SampleSkipped for a complex sample that neuron rejects."""
    parts = _device_resolved(_parts(sample))
    if has_complex(parts):
        raise SampleSkipped("complex input tensors")
    if (sample.kwargs or {}).get("dropout_p", 0) > 0:  # the device draws its own dropout masks (as CUDA does)
        meta_only = True
    neuron_parts = _move_parts(op, parts)  # before the CPU run: in-place ops mutate inputs
    if not involves_neuron(neuron_parts):
        raise SampleSkipped("no tensor or device argument: the op would run on the CPU")
    inputs_before = parts[0].detach().clone() if isinstance(parts[0], torch.Tensor) and (
        op.name in _TIE_ORDER_FREE or op.name in _ANY_INDEX_OF_VALUE) else None
    reduced = _has(parts, lambda t: t.dtype in REDUCED_FLOATS) or any(
        v in REDUCED_FLOATS for v in (*parts[1], *parts[2].values()) if isinstance(v, torch.dtype))
    parts64 = _to64(parts) if not meta_only and reduced else None
    try:
        expected = _run(op, parts)
        cpu_exc = None
    except Exception as e:  # noqa: BLE001
        expected, cpu_exc = None, e
    try:
        actual = _run(op, neuron_parts)
        neuron_exc = None
    except Exception as e:  # noqa: BLE001
        actual, neuron_exc = None, e
    if cpu_exc is not None:
        # A sample the CPU itself rejects: neuron must reject it the same way.
        if neuron_exc is None:
            raise AssertionError(f"CPU raised {type(cpu_exc).__name__}: {cpu_exc} but neuron did not")
        if type(neuron_exc) is not type(cpu_exc):
            raise AssertionError(f"CPU raised {type(cpu_exc).__name__}, neuron raised "
                                 f"{type(neuron_exc).__name__}: {neuron_exc}") from neuron_exc
        raise SampleSkipped(f"raises {type(cpu_exc).__name__} on CPU and on neuron")
    if neuron_exc is not None:
        if is_complex_rejection(neuron_exc):
            why = "complex output" if has_complex(expected) else "complex intermediate"
            raise SampleSkipped(f"{why}: rejected by neuron with TypeError (by design)")
        raise neuron_exc
    if inputs_before is not None:
        expected = tie_order_free(op, (inputs_before, *parts[1:]), actual, expected)
        expected = any_index_of_value(op, (inputs_before, *parts[1:]), actual, expected)
    bound = term_magnitudes(op, parts) if isinstance(expected, torch.Tensor) and not meta_only else None
    expected = within_summation_order(actual, expected, bound)
    if parts64 is not None and any(t.dtype in REDUCED_FLOATS for t in _tensors(expected)):
        try:
            exact = _run(op, parts64)
        except Exception:  # noqa: BLE001 (an op that will not take float64 inputs: the plain comparison)
            exact = None
        expected = _each_result(at_least_as_exact, exact, actual, expected)
    if meta_only:
        compare(actual, expected, atol=atol, rtol=rtol, meta_only=meta_only)
    else:
        _compared_beyond_reference_error(lambda a, e: compare(a, e, atol=atol, rtol=rtol),
                                         lambda: _run(op, _to64(parts, (torch.float32,))), actual, expected, atol, rtol)
    # In-place updates of the input tensors (running stats, out=, in-place variants) must
    # match too.
    compare(_tensors(neuron_parts), _tensors(parts), atol=atol, rtol=rtol, meta_only=meta_only,
            path="input tensors after the op", check_device=False)


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided \
        and t.device.type in ("cpu", DEVICE)


def _with_grad_leaves(obj, leaves: list):
    """``obj`` with each float tensor (recursively) replaced by a detached copy that requires grad, appended
    to ``leaves`` in depth-first order."""
    if _differentiable(obj):
        leaf = obj.detach().clone().requires_grad_(True)
        leaves.append(leaf)
        return leaf
    if isinstance(obj, list):
        return [_with_grad_leaves(o, leaves) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_with_grad_leaves(o, leaves) for o in obj)
    if isinstance(obj, dict):
        return {k: _with_grad_leaves(v, leaves) for k, v in obj.items()}
    return obj


def _vjp(op, parts: tuple, cotangents: list | None, seed: int):
    """(outputs that require grad, cotangents, input gradients) of the op on ``parts`` with its float inputs as
    fresh leaves; cotangents drawn (seeded, on the CPU) when not given. None when nothing is differentiable."""
    leaves: list = []
    parts = _with_grad_leaves(parts, leaves)
    if not leaves:
        return None
    outs = [t for t in _tensors(_run(op, parts)) if isinstance(t, torch.Tensor) and t.requires_grad
            and t.is_floating_point()]
    if not outs:
        return None
    if cotangents is None:
        gen = torch.Generator().manual_seed(seed)
        cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.dtype) for o in outs]
    cots = [c.to(o.device) for c, o in zip(cotangents, outs)]
    grads = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
    return outs, cotangents, list(grads)


def grad_term_magnitudes(op, parts: tuple, cotangents: list) -> list | None:
    """Per input-gradient element, sum(|terms|) of a sum of products' vector-Jacobian product: the op's VJP on
    the inputs' absolute values with the cotangents' absolute values, in float64 (None when not a sum of
    products, or that cannot be run). Exact for ops linear in each input (matmul, convolution)."""
    if not _accumulating(op):
        return None
    try:
        res = _vjp(op, _abs64(parts), [c.abs().double() for c in cotangents], 0)
    except Exception:  # noqa: BLE001 (an op that will not take float64 / abs inputs: the plain tolerance)
        return None
    return None if res is None else res[2]


def _expanded64(obj, shape, broadcast: list):
    """``obj`` with its float tensors in float64, each differentiable one smaller than ``shape`` expanded to it
    (a copy); ``broadcast`` gets, per differentiable tensor in depth-first order, its shape if expanded, else None."""
    if _differentiable(obj):
        small = tuple(obj.shape) != tuple(shape)
        broadcast.append(obj.shape if small else None)
        t = obj.detach().double()
        return t.expand(shape).clone() if small else t
    if isinstance(obj, list):
        return [_expanded64(o, shape, broadcast) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_expanded64(o, shape, broadcast) for o in obj)
    if isinstance(obj, dict):
        return {k: _expanded64(v, shape, broadcast) for k, v in obj.items()}
    return obj


def broadcast_grad_term_magnitudes(op, parts: tuple, cotangents: list) -> tuple[list, list] | None:
    """For an element-wise binary op, (sum(|terms|), rounding units) per input gradient: the gradient of an input
    broadcast to the output's shape sums one term per output element over the broadcast dims, the K terms read
    off the VJP with that input expanded (float64); each side's result is then within (K - 1) units for the sum
    plus ~4 for a term (a product of a few rounded factors) of sum(|terms|), so the two within 2 (K + 3). None
    for other ops; (None, _) for an input that is not broadcast (the plain tolerance)."""
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo

    if not isinstance(op, BinaryUfuncInfo) or len(cotangents) != 1:
        return None
    shape = cotangents[0].shape
    broadcast: list = []
    try:
        expanded = _expanded64(parts, shape, broadcast)
        if not any(broadcast):
            return None
        res = _vjp(op, expanded, [cotangents[0].double()], 0)
    except Exception:  # noqa: BLE001 (an op that will not take float64 or expanded inputs: the plain tolerance)
        return None
    if res is None or len(res[2]) != len(broadcast):
        return None
    bounds, ulps = [], []
    for g, small in zip(res[2], broadcast):
        if small is None or g is None:
            bounds.append(None)
            ulps.append(ORDER_ULPS)
            continue
        bounds.append(g.abs().sum_to_size(small))
        ulps.append(2 * (math.prod(shape) // max(math.prod(small), 1) + 3))
    return bounds, ulps


def _normalize_grad_terms(parts: tuple, cotangents: list) -> tuple[list, list] | None:
    """``F.normalize``'s input gradient g / n - dn/dx * sum_j(g_j x_j) / n**2 (n the p-norm over ``dim``,
    clamped to ``eps``) is a difference of two terms that cancel exactly where the normalized dim has one
    element (sign(x): gradient 0); per element, (sum(|terms|), rounding units). Each side rounds the norm's
    K-term sum and its p-th root (relative error up to (K + 2) units, times 1/p through the root) and a few
    products and quotients of each term: within (K + 8) max(1, 1/|p|) units of the terms, the two within
    twice that. None for p = 0 or infinite (the plain comparison)."""
    x, args, kwargs = parts
    p = float(args[0] if args else kwargs.get("p", 2.0))
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 1)
    eps = float(args[2] if len(args) > 2 else kwargs.get("eps", 1e-12))
    if not isinstance(x, torch.Tensor) or len(cotangents) != 1 or not math.isfinite(p) or p == 0 or x.dim() == 0:
        return None
    x, g = x.detach().double(), cotangents[0].double().abs()
    n = x.abs().pow(p).sum(dim, keepdim=True).pow(1 / p)
    denom = n.clamp_min(eps)
    dn = x.abs().pow(p - 1) * n.pow(1 - p) * (n > eps)            # |dn/dx_i|, 0 where the clamp holds
    terms = g / denom + dn * (g * x.abs()).sum(dim, keepdim=True) / denom ** 2
    K = x.shape[dim]
    return [terms], [2 * (K + 8) * max(1.0, 1 / abs(p))]


# Ops whose input gradient is a difference of terms that can cancel, with a bound on each side's error derived
# from their formula: {op name: fn(parts, cotangents) -> (per-input sum(|terms|), rounding units) or None}.
GRAD_TERMS = {"nn.functional.normalize": _normalize_grad_terms}


def check_sample_grads(op, sample, *, atol=None, rtol=None, seed: int = DEFAULT_SEED) -> str:
    """Compare the input gradients (a VJP with seeded random cotangents) of one sample on neuron with the
    CPU's; returns 'checked' or why not. Raises AssertionError on a mismatch."""
    parts = _device_resolved(_parts(sample))
    if has_complex(parts):
        return "skipped: complex inputs"
    inp = parts[0]
    if (op.name in _TIE_ORDER_FREE and not parts[2].get("stable") or op.name in _ANY_INDEX_OF_VALUE
            or op.name in _UNSTABLE_VALUE_SORTS) \
            and isinstance(inp, torch.Tensor) and inp.unique().numel() < inp.numel():
        return "skipped: which of tied values takes the gradient is unspecified"
    try:
        expected = _vjp(op, parts, None, seed)
    except Exception as e:  # noqa: BLE001 (in-place on a leaf, a non-differentiable path: no gradient to check)
        return f"skipped: the CPU's backward raised {type(e).__name__}"
    if expected is None:
        return "skipped: no differentiable output"
    outs, cots, grads = expected
    try:
        actual = _vjp(op, _move_parts(op, parts), cots, seed)
    except Exception as e:
        if is_complex_rejection(e):
            return "skipped: a complex intermediate in the backward"
        raise
    if actual is None or len(actual[2]) != len(grads):
        raise AssertionError("neuron's result has other differentiable outputs or inputs than the CPU's")
    bounds, ulps = grad_term_magnitudes(op, parts, cots), [ORDER_ULPS] * len(grads)
    if bounds is None and op.name in GRAD_TERMS:
        bounds, ulps = GRAD_TERMS[op.name](parts, cots) or (None, ulps)
    if bounds is None:
        bounds, ulps = broadcast_grad_term_magnitudes(op, parts, cots) or ([None] * len(grads), ulps)
    exact = [None] * len(grads)
    if any(g is not None and g.dtype in REDUCED_FLOATS for g in grads):
        try:
            exact = _vjp(op, _to64(parts), [_to64(c) for c in cots], seed)[2]
        except Exception:  # noqa: BLE001 (an op that will not take float64 inputs: the plain comparison)
            pass
    cache: list = []

    def exact32() -> list:
        """The float64 input gradients of the fp32 inputs (computed once, when a comparison needs them)."""
        if not cache:
            cache.append(_vjp(op, _to64(parts, (torch.float32,)), [c.double() for c in cots], seed)[2])
        return cache[0]

    for i, (a, e, b, u, x) in enumerate(zip(actual[2], grads, bounds, ulps, exact)):
        if (a is None) != (e is None):
            raise AssertionError(f"gradient of input {i}: {'none' if a is None else 'a tensor'} on neuron, "
                                 f"{'none' if e is None else 'a tensor'} on the CPU")
        if e is not None:
            e = at_least_as_exact(x, a, within_summation_order(a, e, b, u))
            _compared_beyond_reference_error(
                lambda a_, e_, i=i: compare(a_, e_, atol=atol, rtol=rtol, path=f"gradient of input {i}"),
                lambda i=i: exact32()[i], a, e, atol, rtol)
    return "checked"


def check_error_input(op, error_input) -> str:
    """Run an ErrorInput on both devices; returns 'checked' or 'skipped' (with why).
    Raises AssertionError when neuron does not raise the CPU's exception type."""
    parts = _parts(error_input.sample_input)
    if has_complex(parts):
        return "skipped: complex inputs"
    neuron_parts = _move_parts(op, parts)
    try:
        _run(op, parts)
        return "skipped: does not raise on CPU"
    except Exception as e:  # noqa: BLE001
        cpu_exc = e
    try:
        _run(op, neuron_parts)
    except Exception as e:  # noqa: BLE001
        if type(e) is not type(cpu_exc):
            if is_complex_rejection(e):
                return "skipped: neuron rejects a complex tensor by design"
            if (type(cpu_exc), type(e)) in _ACCEPTED_ERROR_TYPES.get(op.name, ()):
                return "checked"
            raise AssertionError(
                f"CPU raised {type(cpu_exc).__name__}({str(cpu_exc)[:150]!r}), neuron raised "
                f"{type(e).__name__}({str(e)[:300]!r})") from e
        regex = error_input.error_regex
        if regex and re.search(regex, str(cpu_exc)) and not re.search(regex, str(e)):
            return f"checked; message differs: {str(e)[:120]}"
        return "checked"
    raise AssertionError(f"CPU raised {type(cpu_exc).__name__}({str(cpu_exc)[:200]!r}) "
                         f"but neuron returned normally")


def _fallback_delta(before: dict, after: dict) -> dict:
    """Fallback calls per ATen op between two ``torchneuron.fallback_counts()`` snapshots."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0) > 0}


def run_op(op, dtype: torch.dtype | None = None, *, seed: int = DEFAULT_SEED,
           time_budget: float | None = None, max_samples: int | None = None,
           samples: bool = True, error_inputs: bool = True, raise_errors: bool = False,
           grads: bool = False) -> OpResult:
    """Test one OpInfo at one dtype: its samples and/or its error inputs, and with ``grads`` the input
    gradients of its samples when it supports autograd at a float dtype. Never raises unless
    ``raise_errors`` (then the first failure is re-raised, and a skip raises OpSkipped)."""
    res = OpResult(key=op_key(op), name=op.name, variant=op.variant_test_name or "")
    start = time.monotonic()
    deadline = None if time_budget is None else start + time_budget
    before = torchneuron.fallback_counts()
    before_errors = None  # the counts when the error inputs start
    layouts: set[str] = set()
    dropout_samples = 0
    sample_skips: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=FutureWarning)
            dtype = pick_dtype(op, dtype)
            res.dtype = str(dtype).replace("torch.", "")
            atol, rtol = tolerance_for(op, dtype)
            meta_only = is_random_op(op)
            if meta_only:
                res.notes.append("random op: compared shape/dtype/device only")
            grads = grads and op.supports_autograd and dtype.is_floating_point and not meta_only
            sample_iter = op.sample_inputs("cpu", dtype, set_seed=False) if samples else ()
            for i, sample in enumerate(_seeded(sample_iter, seed)):
                if max_samples is not None and i >= max_samples:
                    break
                layouts.update(_sparse_layouts(sample))
                random_sample = is_random_sample(op, sample)
                dropout_samples += random_sample
                try:
                    check_sample(op, sample, atol=atol, rtol=rtol, meta_only=meta_only or random_sample)
                    res.samples_passed += 1
                    if grads and not random_sample:
                        if check_sample_grads(op, sample, atol=atol, rtol=rtol, seed=seed + i) == "checked":
                            res.grads_checked += 1
                except SampleSkipped as e:
                    res.samples_skipped += 1
                    sample_skips.append(str(e))
                except Exception as e:
                    e.add_note(f"sample {i}: {_sample_str(sample)}")
                    raise
                if deadline is not None and time.monotonic() > deadline:
                    raise OpTimeout(f"time budget of {time_budget:.0f}s exceeded after "
                                    f"{res.samples_passed + res.samples_skipped} samples")
            if error_inputs and op.error_inputs_func is not None:
                before_errors = torchneuron.fallback_counts()
                errs = op.error_inputs("cpu", set_seed=False)
                for i, err in enumerate(_seeded(errs, seed + 100_000)):
                    try:
                        outcome = check_error_input(op, err)
                    except Exception as e:
                        e.add_note(f"error input {i}: {_sample_str(err.sample_input)}")
                        raise
                    if outcome.startswith("checked"):
                        res.error_inputs_checked += 1
                        if outcome != "checked" and len(res.notes) < 4:
                            res.notes.append(outcome[len("checked; "):])
                    else:
                        res.error_inputs_skipped += 1
                    if deadline is not None and time.monotonic() > deadline:
                        raise OpTimeout(f"time budget of {time_budget:.0f}s exceeded in error inputs")
            if dropout_samples:
                res.notes.append(f"{dropout_samples} samples with dropout: compared shape/dtype/device only")
            if samples and res.samples_passed == 0:
                why = sample_skips[0] if sample_skips else "no samples"
                raise OpSkipped(f"no sample runnable on neuron ({why})")
            if sample_skips:
                res.notes.append(f"{len(sample_skips)} samples skipped ({sample_skips[0]})")
    except OpSkipped as e:
        res.status, res.error = STATUS_SKIPPED, str(e)
        if raise_errors:
            raise
    except Exception as e:  # noqa: BLE001
        res.status = STATUS_FAILED
        where = [n.split(":", 1)[0] for n in getattr(e, "__notes__", ())]
        res.error = (f"[{where[0]}] " if where else "") + f"{type(e).__name__}: {e}"
        res.traceback = "".join(traceback.format_exception(e))
        if raise_errors:
            raise
    finally:
        res.seconds = time.monotonic() - start
        after = torchneuron.fallback_counts()
        res.fallback_ops = _fallback_delta(before, after)
        if before_errors is not None:
            res.error_input_fallback_ops = _fallback_delta(before_errors, after)
        res.sample_layouts = sorted(layouts)
    return res


def check_op(op, dtype: torch.dtype | None = None, **kwargs) -> OpResult:
    """run_op for tests: raises the first failure, OpSkipped for a skipped op."""
    return run_op(op, dtype, raise_errors=True, **kwargs)


__all__ = [
    "OpResult", "OpSkipped", "OpTimeout", "check_op", "check_sample_grads", "compare", "find_ops", "is_random_op",
    "load_op_db", "op_key", "pick_dtype", "run_op", "to_cpu", "to_neuron", "tolerance_for",
]
