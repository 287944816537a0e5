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


def test_int64_sign_and_range(strict):
    x = torch.tensor([-5, 0, 7, -(2 ** 31), 2 ** 31 - 1], dtype=torch.int32)
    torch.testing.assert_close(to_n(x).long().cpu(), x.long())
    y = torch.tensor([-5, 3, 2 ** 40 + 3, -(2 ** 35)], dtype=torch.int64)
    torch.testing.assert_close(to_n(y).float().cpu(), y.float())


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
