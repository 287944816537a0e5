"""Element-wise ops read their inputs at the common dtype, as the CPU's TensorIterator does.

With a bfloat16 or float16 result, PyTorch casts every input of another dtype (a Python number, a 0-dim tensor
of a wider float, an integer tensor) to that dtype before the kernel's float32 math: ``bf16 + 0.3`` adds
0.30078125 and ``fp16 % 70000.0`` is a remainder by inf. ``mul`` and ``div`` read a scalar second operand in
float32 instead (their CPU kernels' ``original_scalar_value``), as do addcmul's ``value`` and lerp's scalar
weight. Reading the unrounded value gave other results than the CPU in a third of the elements of ``bf16 + 0.3``
and in nine of ten of ``bf16 % 0.3``.

The inputs are short floats (multiples of 1/16 below 4 in magnitude), so every product and sum of the exact ops
is exact in float32 and the result's only rounding is the final one to the dtype, the same on every CPU: those
are compared bit for bit. Ops computed with transcendental functions, whose float32 results may differ from
the CPU's in the last bit, are compared within one unit in the last place of the dtype, with a scalar whose
rounding changes the result by far more than that (70000 is inf in float16).
"""
from __future__ import annotations

import pytest
import torch

DEVICE = "neuron"

HALF = [torch.bfloat16, torch.float16]
N = 2048


def _short(dtype: torch.dtype, seed: int, positive: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1 if positive else -63, 64, (N,), generator=g)
    return (k.float() / 16).to(dtype)


def _scalars(kind: str, value: float, device: str) -> object:
    """``value`` as the second operand of kind: a Python float, a CPU 0-dim float32 tensor (what PyTorch makes of
    a Python number it wraps), or a 0-dim float32 tensor on ``device``."""
    if kind == "python":
        return value
    return torch.tensor(value, dtype=torch.float32, device="cpu" if kind == "cpu_0d" else device)


def _same(cpu: torch.Tensor, dev: torch.Tensor) -> None:
    assert dev.dtype == cpu.dtype
    dev = dev.cpu()
    both_nan = cpu.isnan() & dev.isnan() if cpu.is_floating_point() else torch.zeros_like(cpu, dtype=torch.bool)
    bad = ~((cpu == dev) | both_nan)
    assert not bad.any(), f"{int(bad.sum())} of {cpu.numel()} differ: cpu {cpu[bad][:4].tolist()} " \
                          f"device {dev[bad][:4].tolist()}"


EXACT = {   # op(x, scalar): exact float32 math on short inputs
    "add": lambda x, s: x + s,
    "sub": lambda x, s: x - s,
    "rsub": lambda x, s: s - x if not isinstance(s, torch.Tensor) else torch.rsub(x, s),
    "add_alpha": lambda x, s: torch.add(x, s, alpha=3),
    "sub_alpha": lambda x, s: torch.sub(x, s, alpha=0.3) if not isinstance(s, torch.Tensor) else
    torch.sub(x, s, alpha=3),
    "mul": lambda x, s: x * s,
    "div": lambda x, s: x / s,
    "fmod": lambda x, s: torch.fmod(x, s),
    "remainder": lambda x, s: torch.remainder(x, s),
    "maximum": lambda x, s: torch.maximum(x, s if isinstance(s, torch.Tensor) else torch.tensor(s, device=x.device)),
    "eq": lambda x, s: x == s,
    "le": lambda x, s: x <= s,
}


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("kind", ["python", "cpu_0d", "device_0d"])
@pytest.mark.parametrize("op", list(EXACT))
@pytest.mark.parametrize("value", [0.3, 0.30078125, 257.0, 70000.0, -0.0])
def test_exact_ops_match_cpu(op, kind, dtype, value):
    x = _short(dtype, 0)
    if value == 0.30078125:
        x[:8] = value     # equal to the rounded 0.3: the comparisons see the rounding
    f = EXACT[op]
    _same(f(x, _scalars(kind, value, "cpu")), f(x.to(DEVICE), _scalars(kind, value, DEVICE)))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_alpha_of_tensor_add_is_read_in_dtype(dtype):
    x, y = _short(dtype, 1), _short(dtype, 2)
    for alpha in (0.3, 3, 1 / 3):
        _same(torch.add(x, y, alpha=alpha), torch.add(x.to(DEVICE), y.to(DEVICE), alpha=alpha))
        _same(torch.sub(x, y, alpha=alpha), torch.sub(x.to(DEVICE), y.to(DEVICE), alpha=alpha))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_integer_tensor_input_is_read_in_dtype(dtype):
    """An int32 tensor beside a 2-byte float one: rounded to the float dtype first (257 is 256 in bfloat16)."""
    x = _short(dtype, 3)
    k = torch.randint(-70000, 70000, (N,), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    k[:4] = torch.tensor([257, 259, 65519, 65520])
    for f in (torch.add, torch.sub, torch.mul, torch.maximum, torch.eq):
        _same(f(x, k), f(x.to(DEVICE), k.to(DEVICE)))


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("inplace", [False, True])
def test_inplace_and_out_forms(dtype, inplace):
    x = _short(dtype, 5)
    s = torch.tensor(0.3)
    if inplace:
        _same(x.clone().add_(s), x.to(DEVICE).add_(s.to(DEVICE)))
        _same(x.clone().sub_(0.3), x.to(DEVICE).sub_(0.3))
    else:
        out_cpu, out_dev = torch.empty(N, dtype=torch.float32), torch.empty(N, dtype=torch.float32, device=DEVICE)
        _same(torch.add(x, 0.3, out=out_cpu), torch.add(x.to(DEVICE), 0.3, out=out_dev))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_scalar_operands_read_in_float32(dtype):
    """addcmul/addcdiv's value and lerp's scalar weight stay float32 (the CPU kernels read them so), while a
    0-dim float32 tensor operand of the same ops is rounded to the dtype."""
    x, a, b = _short(dtype, 6), _short(dtype, 7), _short(dtype, 8, positive=True)
    d = lambda t: t.to(DEVICE)   # noqa: E731
    # value * a * b is not exact in float32: a CPU that fuses the multiply-add may round once where the device
    # rounds twice, one unit of the dtype at most after the final rounding
    for f in (torch.addcmul, torch.addcdiv):
        assert _ulps_apart(f(x, a, b, value=0.3), f(d(x), d(a), d(b), value=0.3)).max() <= 1
    s = torch.tensor(0.3)
    _same(torch.addcmul(x, a, s), torch.addcmul(d(x), d(a), d(s)))
    w = torch.tensor(0.375)   # exact in every dtype: the lerp formula's float32 products stay exact
    _same(torch.lerp(x, a, w), torch.lerp(d(x), d(a), d(w)))


def _ulps_apart(cpu: torch.Tensor, dev: torch.Tensor) -> torch.Tensor:
    """How many units in the last place of the dtype ``dev`` is from ``cpu`` (0 where both are nan or equal)."""
    dev = dev.cpu()
    eps = torch.finfo(cpu.dtype).eps
    tiny = torch.finfo(cpu.dtype).smallest_normal * eps
    c, d = cpu.double(), dev.double()
    same = (c == d) | (c.isnan() & d.isnan())
    ulp = torch.clamp(c.abs() * eps, min=tiny)
    return torch.where(same, torch.zeros_like(c), (c - d).abs() / ulp)


TRANSCENDENTAL = {
    "atan2": torch.atan2, "hypot": torch.hypot, "logaddexp": torch.logaddexp, "logaddexp2": torch.logaddexp2,
    "igamma": torch.igamma, "pow": torch.pow, "xlogy": torch.xlogy, "xlog1py": torch.special.xlog1py,
}


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("op", list(TRANSCENDENTAL))
def test_transcendental_ops_read_the_rounded_scalar(op, dtype):
    """Within one unit in the last place (the device's float32 transcendental may differ from the CPU's in its
    last bit), for scalars whose rounding moves the result far more: 70000 (inf in float16), 0.3."""
    x = _short(dtype, 9, positive=True)
    f = TRANSCENDENTAL[op]
    for value in (0.3, 70000.0):
        for kind in ("cpu_0d", "device_0d"):
            cpu = f(x, _scalars(kind, value, "cpu"))
            dev = f(x.to(DEVICE), _scalars(kind, value, DEVICE))
            far = _ulps_apart(cpu, dev)
            assert far.max() <= 1, f"{op}({value}): {float(far.max())} units in the last place apart"


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_foreach_add_and_sub_read_scalars_in_dtype(dtype):
    xs = [_short(dtype, 10 + i) for i in range(3)]
    ds = [t.to(DEVICE) for t in xs]
    for cpu, dev in ((torch._foreach_add(xs, 0.3), torch._foreach_add(ds, 0.3)),
                     (torch._foreach_sub(xs, [0.3, 0.7, 257.0]), torch._foreach_sub(ds, [0.3, 0.7, 257.0])),
                     (torch._foreach_add(xs, torch.tensor(0.3)), torch._foreach_add(ds, torch.tensor(0.3))),
                     (torch._foreach_add(xs, xs, alpha=0.3), torch._foreach_add(ds, ds, alpha=0.3)),
                     (torch._foreach_mul(xs, 0.3), torch._foreach_mul(ds, 0.3))):
        for c, d in zip(cpu, dev):
            _same(c, d)


def test_float32_results_unchanged():
    """Nothing is rounded when the common dtype is float32: a Python float is read as float32, as on the CPU."""
    x = _short(torch.float32, 12)
    for f in (lambda t: t + 0.3, lambda t: torch.fmod(t, 0.3), lambda t: t - torch.tensor(0.1, dtype=torch.float64)):
        _same(f(x), f(x.to(DEVICE)))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_compiled_graph_reads_scalars_as_eager(dtype):
    """The graph compiler's element-wise groups round a Python-number operand as the eager ops do."""
    x = _short(dtype, 13)

    def f(t):
        return (t + 0.3, t - 0.3, torch.rsub(t, 0.3), torch.sub(t, t * 2, alpha=0.3), (t.abs() + 1) ** 0.3,
                t == 0.30078125, t * 0.3, t / 0.3)
    compiled = torch.compile(f, backend="neuron", fullgraph=True)
    for cpu, dev in zip(f(x), compiled(x.to(DEVICE))):
        _same(cpu, dev)
