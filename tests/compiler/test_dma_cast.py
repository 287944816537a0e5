"""A lone cast between float dtypes in a program is DMAs from HBM to HBM (``kernel_lowerings.dma_cast``): no engine
instruction, and bit for bit the CPU's conversion (a DMA casts through fp32 and rounds to nearest even, as
``Tensor.to`` does), edges included: ties, ±0, ±inf, NaN, values past the target's range, subnormals."""
from __future__ import annotations

import pytest
import torch

from torchneuron.compiler import reports

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _values(dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` values of ``dtype``: random ones of every magnitude, then the edges."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, (n,), generator=g))
    edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 65519.0, 65520.0, -65520.0,
                          1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11,     # ties of bf16, fp16
                          3.4e38, -3.4e38, 1e-40, -1e-40, 2 ** -126, 6e-8, 2 ** -24, 2 ** -25],
                         dtype=torch.float64)
    x[:edges.numel()] = edges
    return x.to(dtype)


def _engines(dump) -> set[str]:
    """The engines of every instruction in the dumped programs."""
    engines = set()
    for listing in dump.rglob("program_s*.txt"):
        for line in listing.read_text().splitlines()[2:]:
            engines.add(line.split()[3])
    return engines


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
@pytest.mark.parametrize("n", [1000, 300_007])   # one DMA; several (1 MiB of source each) and a partial last one
def test_a_lone_cast_is_dmas_and_rounds_as_the_cpu(src, dst, n, tmp_path, monkeypatch):
    if src == dst:
        pytest.skip("not a cast")
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path))
    x = _values(src, n)
    got = torch.compile(lambda t: t.to(dst), backend="neuron")(x.to("neuron")).cpu()
    assert got.dtype == dst
    torch.testing.assert_close(got, x.to(dst), rtol=0, atol=0, equal_nan=True)
    assert reports()[-1].segments == 1
    assert _engines(tmp_path) == {"dma"}


def test_a_strided_cast_takes_the_element_wise_pass(tmp_path, monkeypatch):
    """A transposed operand is not one contiguous span: the element-wise template casts it, with the same values."""
    monkeypatch.setenv("TORCHNEURON_DUMP_DIR", str(tmp_path))
    x = _values(torch.float32, 96 * 130).reshape(96, 130)
    got = torch.compile(lambda t: t.t().to(torch.bfloat16), backend="neuron")(x.to("neuron")).cpu()
    torch.testing.assert_close(got, x.t().to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    assert _engines(tmp_path) != {"dma"}


def test_a_cast_read_by_a_product_under_autocast_matches_eager():
    """``nn.Linear`` under bf16 autocast: its weight's cast is DMAs, and the product equals eager's bit for bit."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(200, 300).to("neuron")
    x = torch.randn(64, 200, device="neuron")
    with torch.autocast("neuron", torch.bfloat16):
        want = lin(x).cpu()
        got = torch.compile(lin, backend="neuron")(x).cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
