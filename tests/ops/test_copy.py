"""Copies, fills and casts run on the device (strict mode) and match the CPU."""
import pytest
import torch

import torchneuron
from tests.ops.conftest import to_n

torch.manual_seed(0)
X = torch.randn(6, 10, 4)


@pytest.mark.parametrize("view", ["t", "slice", "permute", "expand", "step"])
def test_strided_copies(view, strict):
    make = {"t": lambda t: t[0].t(), "slice": lambda t: t[1:4, 2:9], "permute": lambda t: t.permute(2, 0, 1),
            "expand": lambda t: t[:, :1].expand(6, 5, 4), "step": lambda t: t[::2, ::3]}[view]
    got = make(to_n(X)).contiguous()
    assert got.is_contiguous()
    torch.testing.assert_close(got.cpu(), make(X).contiguous())
    dst = to_n(torch.zeros(6, 10, 4))
    make(dst).copy_(make(to_n(X)) * 1) if view != "expand" else None   # write through a strided view
    if view != "expand":
        ref = torch.zeros(6, 10, 4)
        make(ref).copy_(make(X))
        torch.testing.assert_close(dst.cpu(), ref)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                     (torch.float32, torch.int32), (torch.int32, torch.float16),
                                     (torch.float32, torch.bool), (torch.int32, torch.int64),
                                     (torch.int64, torch.int32), (torch.int64, torch.float32),
                                     (torch.float32, torch.int64), (torch.int64, torch.int64),
                                     (torch.float64, torch.float64)])
def test_casts(src, dst, strict):
    x = (X * 1000).to(src)
    torch.testing.assert_close(to_n(x).to(dst).cpu(), x.to(dst))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaNs compared as NaNs (their payload may differ between CPUs' conversions)."""
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.dtype.itemsize]
    return bool(((a.view(ints) == b.view(ints)) | (a.isnan() & b.isnan())).all())


def test_float32_to_float64_is_exact(strict):
    # every fp32 class: random bit patterns, subnormals, signed zeros, inf, NaN, the extremes
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (3000,), dtype=torch.int32)
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 1.1754942e-38,
                          1.17549435e-38, 3.4028235e38, 1.0, -2.5, 1e-40])
    x = torch.cat([bits.view(torch.float32), edges])
    assert _same_bits(to_n(x).double().cpu(), x.double())
    h = torch.randn(64, dtype=torch.float16)
    assert _same_bits(to_n(h).double().cpu(), h.double())


def test_float64_to_float32_rounds_like_cpu(strict):
    # random doubles over the whole exponent range (fp32 overflow, subnormal and underflow included),
    # round-to-nearest-even ties at normal and subnormal magnitudes, NaN and inf
    bits = torch.randint(-2 ** 62, 2 ** 62, (2000,), dtype=torch.int64).view(torch.float64)
    scaled = torch.randn(2000, dtype=torch.float64) * 2.0 ** torch.randint(-160, 140, (2000,)).double()
    tiny = 2.0 ** -149
    edges = torch.tensor([tiny * 0.5, tiny * 1.5, tiny * 2.5, tiny * 0.5000001, 2.0 ** -126 * (1 - 2 ** -25),
                          1 + 2.0 ** -24, 1 + 3 * 2.0 ** -24, 3.4028235677973366e38, 3.4028236e38, 1e300, -1e-300,
                          float("nan"), float("inf"), -float("inf"), 0.0, -0.0], dtype=torch.float64)
    d = torch.cat([bits, scaled, edges])
    assert _same_bits(to_n(d).float().cpu(), d.float())
    assert _same_bits(to_n(d).bfloat16().cpu(), d.bfloat16())  # through fp32, as the CPU casts


def test_float64_conversions_through_views(strict):
    m = torch.randn(6, 8)
    assert torch.equal(to_n(m).t().double().cpu(), m.t().double())
    assert torch.equal(to_n(m.double())[:, ::2].float().cpu(), m[:, ::2])
    dst = to_n(torch.zeros(8, 6, dtype=torch.float64))
    dst.t().copy_(to_n(m))  # write through a transposed float64 view
    assert torch.equal(dst.cpu(), m.t().double())
    assert torch.equal(to_n(torch.tensor(2.5)).double().cpu(), torch.tensor(2.5, dtype=torch.float64))


def test_int64_sign_and_range(strict):
    x = torch.tensor([-5, 0, 7, -(2 ** 31), 2 ** 31 - 1], dtype=torch.int32)
    torch.testing.assert_close(to_n(x).long().cpu(), x.long())
    y = torch.tensor([-5, 3, 2 ** 40 + 3, -(2 ** 35)], dtype=torch.int64)
    torch.testing.assert_close(to_n(y).float().cpu(), y.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_to_int64_beyond_int32_is_exact(dtype, strict):
    # an int32 step saturated every value past 2**31 (a masked logsumexp's -inf came back as -2**31): the two
    # words are computed from the float; in range, int64(x) is trunc(x) exactly, a known answer
    bits = torch.randint(-2 ** 31, 2 ** 31, (4096,), dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).to(dtype)
    edges = [0.0, -0.0, -0.7, 2.5, 2.0 ** 31, -2.0 ** 31, 2.0 ** 31 - 128, -(2.0 ** 31 + 256), 2.0 ** 32, -2.0 ** 32,
             3e9, -3e9, 2.0 ** 40, 1.5e10, -2.0 ** 63, 65504.0, -65504.0]
    x = torch.cat([x, torch.tensor(edges).to(dtype)])
    x = x[x.abs() < 2.0 ** 63]     # (fp16: the edges past 65504 are inf)
    want = torch.tensor([int(v) for v in x.double().tolist()], dtype=torch.int64)
    assert torch.equal(to_n(x).long().cpu(), want)
    assert torch.equal(to_n(x)[::2].long().cpu(), want[::2])
    out = torch.empty(len(x), 2, dtype=torch.int64, device="neuron")[:, 1]
    out.copy_(to_n(x))
    assert torch.equal(out.cpu(), want)
    # NaN, infinities and magnitudes from 2**63 have no int64: the CPU's conversion decides (x86: INT64_MIN)
    beyond = torch.tensor([float("nan"), float("inf"), -float("inf"), 2.0 ** 63, -2.0 ** 64]).to(dtype)
    assert torch.equal(to_n(beyond).long().cpu(), beyond.long())


def test_fills_and_factories(strict):
    torch.testing.assert_close(torch.full((3, 5), -2.5, device="neuron").cpu(), torch.full((3, 5), -2.5))
    torch.testing.assert_close(torch.zeros(4, dtype=torch.int64, device="neuron").cpu(), torch.zeros(4, dtype=torch.int64))
    torch.testing.assert_close(torch.ones(2, 3, dtype=torch.bfloat16, device="neuron").cpu(),
                               torch.ones(2, 3, dtype=torch.bfloat16))
    t = to_n(X)
    t[:, 3].fill_(7)
    ref = X.clone()
    ref[:, 3] = 7
    torch.testing.assert_close(t.cpu(), ref)
    t.fill_(torch.tensor(1.5, device="neuron"))
    torch.testing.assert_close(t.cpu(), torch.full_like(X, 1.5))


def test_copies_advance_the_device_clock_and_free_temporaries():
    x = to_n(X)
    before = torch.neuron.memory_allocated()
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    y = x.transpose(0, 2).contiguous()
    end.record()
    assert end.elapsed_time(start) < 0 < start.elapsed_time(end)
    del y
    assert torch.neuron.memory_allocated() == before


def test_bad_copies_match_cpu():
    before = torchneuron.fallback_counts().get("aten::copy_", 0)
    with pytest.raises(RuntimeError) as cpu:
        torch.zeros(3, 4).copy_(torch.zeros(5))
    with pytest.raises(RuntimeError) as dev:
        to_n(torch.zeros(3, 4)).copy_(to_n(torch.zeros(5)))
    assert type(dev.value) is type(cpu.value)
    with pytest.raises(RuntimeError, match="0-dimension"):
        to_n(X).fill_(to_n(torch.ones(2)))
    assert torchneuron.fallback_counts().get("aten::copy_", 0) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64,
                                   torch.uint8, torch.bool, torch.complex64])
def test_one_element_fills_write_the_value_without_a_kernel(dtype, strict):
    """A one-element fill is the host's write of the value (what a fill kernel's scalar operand costs): no launch,
    the CPU's conversion of the value, and the neighbouring elements of a one-element view untouched."""
    from torchneuron.runtime import profiler
    value = {torch.bool: True, torch.complex64: 2.5 - 1j}.get(dtype, 100.75 if dtype.is_floating_point else 100)
    base = torch.arange(12).reshape(3, 4).to(dtype)
    t = base.to("neuron")
    scalar, one = torch.zeros((), dtype=dtype, device="neuron"), torch.zeros(1, 1, dtype=dtype, device="neuron")
    with profiler.record() as records:
        t[1:2, 2:3].t().fill_(value)
        scalar.fill_(value)
        one.fill_(value)
        seed = torch.ones_like(scalar)
    assert not records
    ref = base.clone()
    ref[1:2, 2:3].fill_(value)
    assert torch.equal(t.cpu(), ref)
    assert torch.equal(scalar.cpu(), torch.zeros((), dtype=dtype).fill_(value))
    assert torch.equal(one.cpu(), torch.zeros(1, 1, dtype=dtype).fill_(value))
    assert torch.equal(seed.cpu(), torch.ones((), dtype=dtype))
    with profiler.record() as records:   # more elements: the fill kernel, as before
        t[1].fill_(value)
    assert len(records) == 1
    ref[1].fill_(value)
    assert torch.equal(t.cpu(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float64])
def test_a_repeated_copy_reuses_its_plan_at_any_offset(dtype, strict, monkeypatch):
    """A copy of a signature met before (dtypes, sizes, strides) launches its traced program on the spans of the
    new views: other storage offsets and values give the CPU's result, and nothing is traced again; another
    dtype, shape or stride at the same call site is a new signature (int64 and float64 move as int32 words)."""
    from torchneuron.ops import elementwise
    base = (torch.randn(8, 9, 6) * 1e6).to(dtype)
    if dtype == torch.int64:
        base = base + (2 ** 40) * torch.sign(base).to(dtype)   # high words that an int32 copy would lose
    src, dst = to_n(base), to_n(torch.zeros(8, 9, 6, dtype=dtype))
    ref = torch.zeros(8, 9, 6, dtype=dtype)
    dst[0, 1:4].copy_(src[0, 2:5].t().t())       # the first copy of this signature traces its program
    ref[0, 1:4].copy_(base[0, 2:5])
    monkeypatch.setattr(elementwise, "traced_kernel", None)    # a second trace would fail
    for i in range(1, 4):                       # the same signature at other offsets of both storages
        dst[i, 5 - i:8 - i].copy_(src[7 - i, i:i + 3])
        ref[i, 5 - i:8 - i].copy_(base[7 - i, i:i + 3])
    assert torch.equal(dst.cpu(), ref)
    monkeypatch.undo()
    dst[4, 1:4].copy_(src[5, :6, :3].t())       # the first signature's sizes and dtypes, the source transposed
    ref[4, 1:4].copy_(base[5, :6, :3].t())
    for view in (lambda t: t[0, 1:5], lambda t: t[1, 1:4, ::2], lambda t: t[2].t()[:, 1:4]):
        view(dst).copy_(view(src) if dtype != torch.bfloat16 else view(src).float())   # new signatures
        view(ref).copy_(view(base) if dtype != torch.bfloat16 else view(base).float())
    assert torch.equal(dst.cpu(), ref)


def test_a_planned_copy_still_refuses_bad_shapes():
    x, y = to_n(torch.zeros(3, 4)), to_n(torch.ones(3, 4))
    x.copy_(y)
    x.copy_(y)                                   # a planned signature
    with pytest.raises(RuntimeError) as cpu:
        torch.zeros(3, 4).copy_(torch.zeros(5))
    with pytest.raises(RuntimeError) as dev:
        x.copy_(to_n(torch.zeros(5)))
    assert type(dev.value) is type(cpu.value) and torch.equal(x.cpu(), torch.ones(3, 4))
