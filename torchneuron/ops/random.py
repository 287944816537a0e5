"""Random and factory ops on the device: the distributions of ``Tensor.*_``, ``randperm``, ``multinomial``,
``linspace``, ``logspace`` and ``eye``.

Random numbers are drawn by the NeuronCore's PRNG (``kernels/sampling.py``), seeded per launch from
a 32-bit seed the host takes from the neuron generator (the op's ``generator=`` or the default
generator of the tensor's device), which advances it. So, as on CUDA: ``torch.manual_seed`` makes a
run reproducible, each call draws new numbers, ``get_rng_state``/``set_rng_state`` replay them, a
neuron ``generator=`` is honoured and leaves the default one alone, and a CPU generator with a neuron
tensor raises. The values differ from the CPU's for the same seed (CUDA's do too); their
distribution is the same. ``torch.randn``/``rand``/``randint``/``randn_like``/``bernoulli``/``normal``
with floats are CompositeExplicitAutograd: they reach these kernels through ``normal_``,
``uniform_``, ``random_`` and ``bernoulli_``.

Arguments are validated by running the CPU op on an empty tensor of the same dtype (no numbers are
drawn, no generator moves), so errors carry PyTorch's exact messages, before any seed is drawn.
float64 tensors get fp32 draws made on the device, widened by ``copy_`` (the core has no float64): their
values have fp32's resolution; ``random_`` into float64 beyond 2**24 and dtypes the CPU refuses take the
CPU fallback, which draws from the CPU generator the neuron generator wraps.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND

import torchneuron.nki.language as nl
from torchneuron.kernels.sampling import count_kernel, randint_kernel, sample_kernel
from torchneuron.ops.base import aten, DEVICE_DTYPES, draw_seed, FLOATS, neuron_generator, Unsupported
from torchneuron.ops.elementwise import check_no_internal_overlap, dense, device_copy, run_pointwise
from torchneuron.ops.indexing import arange_values
from torchneuron.ops.kernel_call import call_kernel, host_operand, scalar_operand
from torchneuron.ops.registry import lowering
from torchneuron.ops.sort import sort_lines


INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
RANDPERM_MAX = 16384            # ranks by all-pairs comparison: n**2 / 128 element ops; larger n sorts the keys
COUNT_MAX = 1 << 24            # categories multinomial's fp32 cumulative sums count exactly


# ---- generators and seeds ------------------------------------------------------------------------

def _seed_operand(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return scalar_operand(draw_seed(neuron_generator(generator, device)), torch.int32, device)


def _params(values: list[float], device: torch.device) -> torch.Tensor:
    """A [1, 4] fp32 device tensor of a distribution's parameters (written straight to device memory)."""
    return host_operand(torch.tensor([list(values) + [0.0] * (4 - len(values))], dtype=torch.float64), torch.float32,
                        device)


def _validate(op: Any, dtype: torch.dtype, *args: Any, **kwargs: Any) -> None:
    """Run ``op`` on an empty CPU tensor of ``dtype``: PyTorch's checks and messages, no numbers drawn."""
    op(torch.empty(0, dtype=dtype), *args, **kwargs)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a sampling kernel stores for a result of ``dtype`` (int64: int32, widened after)."""
    if dtype == torch.int64:
        return torch.int32
    return dtype if dtype in DEVICE_DTYPES and (dtype in FLOATS or dtype in INTS) else None


def _into(self: torch.Tensor, kernel: Any, inputs: dict, meta: dict, op: str) -> torch.Tensor:
    """Launch a sampling kernel for ``self.numel()`` values and write them into ``self`` (any strides)."""
    kdt = meta["dtype"]
    if self.is_contiguous() and kdt == self.dtype:
        call_kernel(kernel, inputs, meta, [self.view(-1)], op=op)
    else:
        (flat,) = call_kernel(kernel, inputs, meta, op=op)
        device_copy(self, flat.view(self.shape))
    return self


def _sample_(self: torch.Tensor, dist: str, params: list[float], generator: torch.Generator | None,
             op: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fill ``self`` with draws of ``dist`` made on its device."""
    if self.numel() == 0:
        return self
    check_no_internal_overlap(self)  # an expanded self: PyTorch's RuntimeError, before any draw
    kdt = dtype or _kernel_dtype(self.dtype)
    inputs = {"seed": _seed_operand(generator, self.device), "params": _params(params, self.device)}
    return _into(self, sample_kernel, inputs, {"n": self.numel(), "dist": dist, "dtype": kdt}, op)


def _float64_native(self: torch.Tensor) -> bool:
    """Whether a float64 draw runs on the device: drawn in fp32 (no float64 on the core), then widened."""
    return self.dtype == torch.float64 and self.device.type == "neuron"


def _widened(self: torch.Tensor, draw: Any) -> torch.Tensor:
    """Fill float64 ``self`` with fp32 draws made by ``draw(tmp)`` on the device, widened by ``copy_``."""
    if self.numel() == 0:
        return self
    tmp = torch.empty(self.shape, dtype=torch.float32, device=self.device)
    draw(tmp)
    return self.copy_(tmp)


def _float_draw(op: torch._ops.OpOverload, dist: str, self: torch.Tensor, args: list, generator: Any,
                params: Any, widen: bool = True) -> torch.Tensor:
    """Fill float ``self`` by ``op(self, *args)``'s distribution ``dist``: PyTorch's argument checks, then
    float64 as widened fp32 draws (when ``widen``), the CPU fallback for what the device cannot draw, else
    ``params(dtype)`` (or the list ``params``) handed to the sampling kernel."""
    _validate(op, self.dtype, *args)
    if widen and _float64_native(self):
        return _widened(self, lambda t: _float_draw(op, dist, t, args, generator, params))
    if not _native(self) or self.dtype not in FLOATS:
        raise Unsupported("a tensor off the device, or a dtype the sampler lacks")
    return _sample_(self, dist, params(self.dtype) if callable(params) else params, generator, op._schema.name)


def _native(self: torch.Tensor, *tensors: Any) -> bool:
    """Whether the draw can run on the device: a dtype it stores, other tensors on the same device."""
    return (_kernel_dtype(self.dtype) is not None and self.device.type == "neuron"
            and all(not isinstance(t, torch.Tensor) or t.device == self.device for t in tensors))


# ---- in-place distributions ----------------------------------------------------------------------

@lowering("normal_")
def normal_(self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.normal_(mean, std)``: Box-Muller on the device."""
    return _float_draw(aten.normal_.default, "normal", self, [mean, std], generator, [mean, std])


@lowering("uniform_")
def uniform_(self: torch.Tensor, from_: float = 0.0, to: float = 1.0, *,
             generator: torch.Generator | None = None, **kwargs: Any) -> torch.Tensor:
    """``self.uniform_(from, to)``: values in [from, to) of self's dtype."""
    from_ = kwargs.pop("from", from_)
    return _float_draw(aten.uniform_.default, "uniform", self, [from_, to], generator,
                       lambda dtype: [from_, to, max(float(from_), _largest_below(float(to), dtype))],
                       widen=all(_fp32_exact(v) for v in (from_, to)))  # else fp32 draws could leave [from, to)


def _fp32_exact(x: float) -> bool:
    """Whether ``x`` is a value of fp32."""
    return torch.tensor(float(x), dtype=torch.float64).to(torch.float32).item() == float(x)


def _largest_below(x: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` below ``x`` (a float dtype of at most 32 bits)."""
    t = torch.tensor([x], dtype=torch.float64).to(dtype)
    v = t.item()
    if v < x:
        return v
    bits = t.view(torch.int32 if dtype.itemsize == 4 else torch.int16)
    if v > 0:
        bits -= 1
    elif v < 0:
        bits += 1
    else:           # below zero: the negative value of the smallest magnitude (sign bit and 1)
        bits.fill_(-(2 ** (8 * dtype.itemsize - 1)) + 1)
    return bits.view(dtype).item()


@lowering("exponential_")
def exponential_(self: torch.Tensor, lambd: float = 1.0, *,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.exponential_(lambd)``: ``-log(1 - u) / lambd``, never 0 (as on CUDA)."""
    return _float_draw(aten.exponential_.default, "exponential", self, [lambd], generator,
                       lambda dtype: [-1.0 / lambd, -torch.finfo(dtype).eps / 2])


@lowering("geometric_")
def geometric_(self: torch.Tensor, p: float, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.geometric_(p)``: trials to the first success, ``ceil(log(1 - u) / log(1 - p))``."""
    _validate(aten.geometric_.default, self.dtype, p)
    inv = 1.0 / math.log1p(-p)
    # log(1 - u) >= -17 in fp32: the largest draw is about -17 * inv; it must fit the stored dtype
    fits = self.dtype in FLOATS or -17.0 * inv < 2 ** 31
    if not _native(self) or self.dtype == torch.bool or not fits:
        raise Unsupported
    return _sample_(self, "geometric", [inv], generator, "aten::geometric_")


@lowering("log_normal_")
def log_normal_(self: torch.Tensor, mean: float = 1.0, std: float = 2.0, *,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.log_normal_(mean, std)``: ``exp`` of a normal draw."""
    return _float_draw(aten.log_normal_.default, "log_normal", self, [mean, std], generator, [mean, std])


@lowering("cauchy_")
def cauchy_(self: torch.Tensor, median: float = 0.0, sigma: float = 1.0, *,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.cauchy_(median, sigma)``: ``median + sigma * tan(pi (u - 1/2))``."""
    return _float_draw(aten.cauchy_.default, "cauchy", self, [median, sigma], generator, [median, sigma])


@lowering("bernoulli_.float")
def bernoulli_float_(self: torch.Tensor, p: float = 0.5, *,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.bernoulli_(p)``: 1 with probability p, else 0, in self's dtype."""
    _validate(aten.bernoulli_.float, self.dtype, p)
    if _float64_native(self):
        return _widened(self, lambda t: bernoulli_float_(t, p, generator=generator))
    if not _native(self):
        raise Unsupported("a tensor off the device, or a dtype the sampler lacks")
    return _sample_(self, "bernoulli", [p], generator, "aten::bernoulli_")


@lowering("bernoulli_.Tensor")
def bernoulli_tensor_(self: torch.Tensor, p: torch.Tensor, *,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.bernoulli_(p)`` with a tensor of probabilities (broadcast to self): ``uniform < p``."""
    if not _native(self, p) or p.dtype not in FLOATS:
        raise Unsupported("tensors on more than one device, or probabilities of a dtype the engines lack")
    p = p.expand(self.shape)    # PyTorch's error if p does not broadcast to self
    if self.numel() == 0:
        return self
    check_no_internal_overlap(self)
    if not bool(torch.logical_and(p >= 0, p <= 1).all()):     # NaN fails both: CPU's check, before any draw
        torch.empty(1).bernoulli_(torch.tensor([math.nan]), generator=torch.Generator())   # its exact error
    u = torch.empty(self.shape, dtype=torch.float32, device=self.device)
    _sample_(u, "uniform", [0.0, 1.0, _largest_below(1.0, torch.float32)], generator, "aten::bernoulli_")
    device_copy(self, torch.lt(u, p))
    return self


@lowering("bernoulli.out")
def bernoulli_out(self: torch.Tensor, *, generator: torch.Generator | None = None,
                  out: torch.Tensor) -> torch.Tensor:
    """``torch.bernoulli(p, out=out)``."""
    if out.device != self.device or not _native(out, self) or self.dtype not in FLOATS:
        raise Unsupported
    if out.shape != self.shape:
        out.resize_(self.shape)
    return bernoulli_tensor_(out, self, generator=generator)


# ---- random integers -----------------------------------------------------------------------------

def _int_range(dtype: torch.dtype) -> tuple[int, int]:
    """[low, high) that ``random_()`` without bounds draws from for ``dtype``."""
    if dtype.is_floating_point:
        digits = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11, torch.float64: 53}[dtype]
        return 0, 2 ** digits + 1                              # integers up to 2**digits, inclusive
    if dtype == torch.bool:
        return 0, 2
    return 0, torch.iinfo(dtype).max + 1


def _random(self: torch.Tensor, low: int, high: int, generator: torch.Generator | None) -> torch.Tensor:
    span = high - low
    if _float64_native(self) and -2 ** 24 <= low and high <= 2 ** 24 + 1:
        # integers up to 2**24 are exact in fp32: drawn as fp32, widened
        return _widened(self, lambda t: _random(t, low, high, generator))
    kdt = _kernel_dtype(self.dtype)
    # 32-bit lanes: the bounds and every value must fit int32
    if not _native(self) or not (0 < span < 2 ** 31 and -2 ** 31 <= low and high <= 2 ** 31):
        raise Unsupported("a tensor off the device, or bounds outside int32")
    if self.numel() == 0:
        return self
    if self.dtype == torch.bool:
        kdt = torch.int32
    inputs = {"seed": _seed_operand(generator, self.device), "low": scalar_operand(low, torch.int32, self.device),
              "span": scalar_operand(span, torch.int32, self.device)}
    return _into(self, randint_kernel, inputs, {"n": self.numel(), "dtype": kdt}, "aten::random_")


@lowering("random_")
def random_(self: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.random_()``: integers over the dtype's range (floats: up to 2**mantissa digits)."""
    _validate(aten.random_.default, self.dtype)
    low, high = _int_range(self.dtype)
    return _random(self, low, high, generator)


@lowering("random_.from")
def random_from_(self: torch.Tensor, from_: int, to: int | None, *,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.random_(from, to)`` (``to=None``: up to the dtype's largest value)."""
    _validate(getattr(aten.random_, "from"), self.dtype, from_, to)
    high = to if to is not None else _int_range(self.dtype)[1]
    return _random(self, from_, high, generator)


@lowering("random_.to")
def random_to_(self: torch.Tensor, to: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """``self.random_(to)``: integers in [0, to)."""
    _validate(aten.random_.to, self.dtype, to)
    return _random(self, 0, to, generator)


# ---- normal with tensor moments ------------------------------------------------------------------

def _resize(out: torch.Tensor, shape: tuple) -> None:
    if tuple(out.shape) != tuple(shape):
        out.resize_(shape)


def _check_std(std: torch.Tensor) -> None:
    # one device reduction and a sync, as CUDA's check does; NaN fails it too
    if std.numel() and not bool(torch.amin(std).item() >= 0.0):
        raise RuntimeError("normal expects all elements of std >= 0.0")


def _normal_into(out: torch.Tensor, mean: Any, std: Any, generator: torch.Generator | None) -> torch.Tensor:
    """PyTorch's recipe: ``out.normal_(0, std)`` (a float std) or ``out.normal_().mul_(std)``, then ``+ mean``."""
    if isinstance(std, torch.Tensor):
        _check_std(std)
    _resize(out, torch.broadcast_shapes(*(t.shape for t in (mean, std) if isinstance(t, torch.Tensor))))
    if out.numel() == 0:
        return out
    normal_(out, 0.0, std if not isinstance(std, torch.Tensor) else 1.0, generator=generator)
    if isinstance(std, torch.Tensor):
        out.mul_(std)
    return out.add_(mean)


def _normal_native(out: torch.Tensor | None, mean: Any, std: Any) -> bool:
    tensors = [t for t in (out, mean, std) if isinstance(t, torch.Tensor)]
    return all(t.device == tensors[0].device and t.device.type == "neuron" and t.dtype in FLOATS for t in tensors)


@lowering("normal.Tensor_float")
def normal_tensor_float(mean: torch.Tensor, std: float = 1.0, *,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.normal(mean_tensor, std)``."""
    _validate(aten.normal.Tensor_float, mean.dtype, std)
    if not _normal_native(None, mean, std):
        raise Unsupported
    return _normal_into(torch.empty(mean.shape, dtype=mean.dtype, device=mean.device), mean, std, generator)


@lowering("normal.Tensor_float_out")
def normal_tensor_float_out(mean: torch.Tensor, std: float = 1.0, *, generator: torch.Generator | None = None,
                            out: torch.Tensor) -> torch.Tensor:
    """``torch.normal(mean_tensor, std, out=out)``."""
    _validate(aten.normal.Tensor_float, mean.dtype, std)
    if not _normal_native(out, mean, std):
        raise Unsupported
    return _normal_into(out, mean, std, generator)


@lowering("normal.float_Tensor")
def normal_float_tensor(mean: float, std: torch.Tensor, *,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.normal(mean, std_tensor)``."""
    if not _normal_native(None, mean, std):
        raise Unsupported
    return _normal_into(torch.empty(std.shape, dtype=std.dtype, device=std.device), mean, std, generator)


@lowering("normal.float_Tensor_out")
def normal_float_tensor_out(mean: float, std: torch.Tensor, *, generator: torch.Generator | None = None,
                            out: torch.Tensor) -> torch.Tensor:
    """``torch.normal(mean, std_tensor, out=out)``."""
    if not _normal_native(out, mean, std):
        raise Unsupported
    return _normal_into(out, mean, std, generator)


@lowering("normal.Tensor_Tensor")
def normal_tensor_tensor(mean: torch.Tensor, std: torch.Tensor, *,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.normal(mean_tensor, std_tensor)`` (broadcast; mean's dtype)."""
    if not _normal_native(None, mean, std):
        raise Unsupported
    return _normal_into(torch.empty(0, dtype=mean.dtype, device=mean.device), mean, std, generator)


@lowering("normal.Tensor_Tensor_out")
def normal_tensor_tensor_out(mean: torch.Tensor, std: torch.Tensor, *, generator: torch.Generator | None = None,
                             out: torch.Tensor) -> torch.Tensor:
    """``torch.normal(mean_tensor, std_tensor, out=out)``."""
    if not _normal_native(out, mean, std):
        raise Unsupported
    return _normal_into(out, mean, std, generator)


# ---- permutations and categorical draws ----------------------------------------------------------

@lowering("randperm.generator_out")
def randperm_out(n: int, *, generator: torch.Generator | None = None, out: torch.Tensor) -> torch.Tensor:
    """``torch.randperm(n, out=out)``: the ranks of n distinct random keys (a uniform permutation)."""
    if n < 0:
        raise RuntimeError(f"n must be non-negative, got{n}")
    exact = {torch.int64: 2 ** 63, torch.int32: 2 ** 31, torch.int16: 2 ** 15, torch.float32: 2 ** 24}
    if out.device.type != "neuron" or n >= 1 << 24 or n > exact.get(out.dtype, 0):
        raise Unsupported
    _resize(out, (n,))
    if n == 0:
        return out
    # key = (random high bits) * 2**k + index: distinct keys (ties broken by index), so their ranks are
    # a permutation, uniform up to the 2**-(31-k) chance that two keys share their random part
    k = max(1, (n - 1).bit_length())
    high = torch.empty(n, dtype=torch.int32, device=out.device)
    _random(high, 0, 2 ** (31 - k), generator)
    keys = torch.add(arange_values(n, out.device), high, alpha=2 ** k).view(1, n)
    if n > RANDPERM_MAX:        # the sort order of the distinct keys (a sort, not all-pairs counts)
        device_copy(out, sort_lines(keys.view(n), 0, False)[1].to(out.dtype))
        return out
    (ranks,) = call_kernel(count_kernel, {"table": keys, "values": keys}, {"strict": True}, op="aten::randperm")
    device_copy(out, ranks.view(n))
    return out


def _multinomial_checks(self: torch.Tensor, n_sample: int, replacement: bool) -> None:
    # PyTorch's argument checks on a 0-row distribution: nothing drawn (a private generator besides)
    shape = (0, self.shape[-1]) if self.dim() in (1, 2) else (0,) * self.dim()
    aten.multinomial.default(torch.empty(shape, dtype=self.dtype), n_sample, replacement, generator=torch.Generator())


@lowering("multinomial")
def multinomial(self: torch.Tensor, num_samples: int, replacement: bool = False, *,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.multinomial(probs, n, replacement)``."""
    out = torch.empty(0, dtype=torch.int64, device=self.device)
    return multinomial_out(self, num_samples, replacement, generator=generator, out=out)


@lowering("multinomial.out")
def multinomial_out(self: torch.Tensor, num_samples: int, replacement: bool = False, *,
                    generator: torch.Generator | None = None, out: torch.Tensor) -> torch.Tensor:
    """``torch.multinomial(probs, n, replacement, out=out)``: inverse CDF with replacement, else
    PyTorch's exponential race (``argmax``/``topk`` of ``p / Exp(1)``)."""
    if out.device != self.device:
        raise RuntimeError("multinomial arguments must have the same device")
    _multinomial_checks(self, num_samples, replacement)
    if out.dtype != torch.int64:
        raise RuntimeError(f"multinomial expects Long tensor out, got: {out.dtype}")
    if self.dtype not in FLOATS:
        # named: ``multinomial`` calls this with the result it allocated, which the CPU then fills
        raise Unsupported("probabilities of a dtype the engines lack",
                          fallback=(aten.multinomial.out, (self, num_samples, replacement),
                                    {"generator": generator, "out": out}))
    rows = self.shape[0] if self.dim() == 2 else 1
    k = self.shape[-1]
    shape = (rows, num_samples) if self.dim() == 2 else (num_samples,)
    _resize(out, shape)
    if rows == 0:
        return out
    gen = neuron_generator(generator, self.device)
    p = dense(self).view(rows, k)
    if p.dtype != torch.float32:
        p = p.to(torch.float32)
    cdf = torch.cumsum(p, 1)
    total = cdf[:, k - 1:k]
    # CPU's checks (one sync): no NaN, inf or negative element; every row sums above 0
    stats = torch.stack([torch.amin(p), torch.amin(total), torch.amax(total)]).cpu()
    if not (stats[0] >= 0 and stats[2] < math.inf):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if not stats[1] > 0:
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    if not replacement or num_samples == 1:
        q = torch.empty((rows, k), dtype=torch.float32, device=self.device)
        exponential_(q, 1.0, generator=gen)
        q = torch.div(p, q)
        idx = torch.argmax(q, 1, keepdim=True) if num_samples == 1 else torch.topk(q, num_samples, 1).indices
        device_copy(out, idx.view(shape))
        return out
    u = torch.empty((rows, num_samples), dtype=torch.float32, device=self.device)
    _sample_(u, "uniform", [0.0, 1.0, _largest_below(1.0, torch.float32)], gen, "aten::multinomial")
    u = torch.mul(u, total)
    (idx,) = call_kernel(count_kernel, {"table": dense(cdf), "values": u}, {"strict": False},
                         op="aten::multinomial")
    # u * total can round up to the total: the count is then k; the last category it is
    device_copy(out, torch.clamp_max(idx, k - 1).view(shape))
    return out


# ---- linspace, logspace, eye ---------------------------------------------------------------------

def _linspace_head(i, start, step):
    """``start + step * i``: the first half of linspace (PyTorch's formula)."""
    return nl.add(start, nl.multiply(i, step))


def _linspace_tail(i, end, step, last):
    """``end - step * (last - i)``: the second half, counted back from ``end`` (PyTorch's formula)."""
    return nl.add(end, nl.multiply(nl.subtract(i, last), step))


def _linspace_into(out: torch.Tensor, start: float, end: float, steps: int) -> None:
    """Fill a contiguous float [steps] tensor the way PyTorch's kernel does: from start up to the middle,
    from end down past it (so both ends are exact)."""
    dt = out.dtype
    rnd = lambda v: torch.tensor(v, dtype=torch.float64).to(dt).item()  # noqa: E731  (scalar_t values)
    start, end = rnd(start), rnd(end)
    if steps == 1:
        out.fill_(start)
        return
    step = rnd((end - start) / (steps - 1))
    half = steps // 2
    if dt in (torch.bfloat16, torch.float16):
        # PyTorch's kernel computes in scalar_t: the step from the rounded difference, the index converted to
        # the dtype, and each product and sum rounded to it (fp32 intermediates give other roundings)
        step = rnd(rnd(end - start) / rnd(steps - 1))
        counts = (arange_values(half, out.device), torch.flip(arange_values(steps - half, out.device), (0,)))
        for part, count, sign, base in ((out[:half], counts[0], 1.0, start), (out[half:], counts[1], -1.0, end)):
            if part.numel():
                torch.add(torch.mul(count.to(dt), step * sign), base, out=part)
        return
    if half:
        i = arange_values(half, out.device)
        run_pointwise(_linspace_head, [i, float(start), float(step)], KIND.DEFAULT, out[:half], op="aten::linspace")
    j = arange_values(steps - half, out.device)
    # idx = half + j: end - step * (steps - 1 - idx) = end + step * (j - (steps - 1 - half))
    run_pointwise(_linspace_tail, [j, float(end), float(step), steps - 1 - half], KIND.DEFAULT, out[half:],
                  op="aten::linspace")


def _real(v: Any) -> bool:
    return not isinstance(v, complex) and not (isinstance(v, torch.Tensor) and v.is_complex())


@lowering("linspace.out")
def linspace_out(start: Any, end: Any, steps: int, *, out: torch.Tensor) -> torch.Tensor:
    """``torch.linspace(start, end, steps, out=out)`` for float results."""
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    if out.dtype not in FLOATS or not (_real(start) and _real(end)):
        raise Unsupported
    _resize(out, (steps,))
    if steps:
        target = out if out.is_contiguous() else torch.empty(steps, dtype=out.dtype, device=out.device)
        _linspace_into(target, float(start), float(end), steps)
        if target is not out:
            device_copy(out, target)
    return out


@lowering("logspace.out")
def logspace_out(start: Any, end: Any, steps: int, base: float = 10.0, *, out: torch.Tensor) -> torch.Tensor:
    """``torch.logspace(start, end, steps, base, out=out)``: ``base ** linspace`` for float results."""
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    if out.dtype not in FLOATS or not (_real(start) and _real(end)):
        raise Unsupported
    _resize(out, (steps,))
    if steps:
        # the exponents in fp32 whatever out's dtype: a bf16 exponent would be off by up to 2**-8 * |end|
        exponents = torch.empty(steps, dtype=torch.float32, device=out.device)
        _linspace_into(exponents, float(start), float(end), steps)
        device_copy(out, torch.pow(float(base), exponents))
    return out


@lowering("eye.m_out")
def eye_m_out(n: int, m: int, *, out: torch.Tensor) -> torch.Tensor:
    """``torch.eye(n, m, out=out)``: row index == column index, from two iotas."""
    if n < 0:
        raise RuntimeError(f"n must be greater or equal to 0, got {n}")
    if m < 0:
        raise RuntimeError(f"m must be greater or equal to 0, got {m}")
    if out.dtype not in DEVICE_DTYPES and out.dtype != torch.int64:
        # named: ``eye.out`` calls this with m = n
        raise Unsupported("a dtype the device lacks", fallback=(aten.eye.m_out, (n, m), {"out": out}))
    _resize(out, (n, m))
    if n and m:
        rows = arange_values(n, out.device).view(n, 1)
        cols = arange_values(m, out.device).view(1, m)
        device_copy(out, torch.eq(rows, cols))
    return out


@lowering("eye.out")
def eye_out(n: int, *, out: torch.Tensor) -> torch.Tensor:
    """``torch.eye(n, out=out)``."""
    if n < 0:
        raise RuntimeError(f"n must be greater or equal to 0, got {n}")
    return eye_m_out(n, n, out=out)
