"""The foundation under the lowerings: the one refusal rule, derived ``out=`` variants, the one program
cache (kernels without inputs included) and launch errors mapped by type."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import torchneuron
import torchneuron.ops
from torchneuron.ops import cache_size
from torchneuron.ops.indexing import arange_values

from .conftest import assert_raises_like_cpu, to_n


def _fallbacks(op: str) -> int:
    return torchneuron.fallback_counts().get(op, 0)


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_a_refusing_lowering_takes_the_counted_cpu_fallback():
    x = torch.randn(1, 2, 3, 3, dtype=torch.float64)       # float64: the device's upsampling refuses it
    before = _fallbacks("aten::upsample_nearest2d")
    got = torch.nn.functional.interpolate(to_n(x), scale_factor=2)
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), torch.nn.functional.interpolate(x, scale_factor=2), atol=0, rtol=0)
    assert _fallbacks("aten::upsample_nearest2d") == before + 1


def test_strict_mode_turns_the_refusal_into_an_error_naming_the_op(strict):
    x = to_n(torch.randn(1, 2, 3, 3, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="upsample_nearest2d"):
        torch.nn.functional.interpolate(x, scale_factor=2)


# lowering modules whose inline fallbacks are still to become refusals (no more than these may remain)
_INLINE_FALLBACKS_LEFT = {"matmul": 4, "normalization": 1, "optim": 5}


def test_no_lowering_module_calls_the_cpu_fallback_itself():
    found = {}
    for path in sorted(Path(torchneuron.ops.__file__).parent.glob("*.py")):
        if path.stem == "registry":   # the one place the refusal becomes the fallback
            continue
        tree = ast.parse(path.read_text())
        uses = sum(isinstance(node, ast.Name) and node.id == "cpu_fallback" for node in ast.walk(tree))
        if uses > _INLINE_FALLBACKS_LEFT.get(path.stem, 0):
            found[path.stem] = uses
    assert found == {}, "raise Unsupported (naming another call in fallback=) instead of calling cpu_fallback"


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_a_refusal_that_names_its_fallback_runs_that_call_counted():
    before = _fallbacks("aten::eye.m_out")
    out = to_n(torch.empty(0, dtype=torch.float64))       # float64: the device does not store it
    got = torch.eye(3, out=out)                             # eye.out refuses with eye.m_out(3, 3, out=out)
    assert got is out and got.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), torch.eye(3, dtype=torch.float64), atol=0, rtol=0)
    assert _fallbacks("aten::eye.m_out") == before + 1


def test_strict_mode_refuses_a_named_fallback_naming_its_op(strict):
    with pytest.raises(NotImplementedError, match="eye"):
        torch.eye(3, out=to_n(torch.empty(0, dtype=torch.float64)))


def test_a_derived_out_variant_writes_into_the_given_tensor(strict):
    x = torch.randn(1, 2, 3, 3)
    expected = torch.nn.functional.interpolate(x, size=(5, 4))
    out = to_n(torch.empty(expected.shape))
    res = torch._C._nn.upsample_nearest2d(to_n(x), [5, 4], out=out)
    assert res is out
    torch.testing.assert_close(out.cpu(), expected, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")
def test_a_derived_out_variant_of_another_dtype_falls_back_like_the_cpu():
    x = torch.randn(1, 2, 3, 3)
    before = _fallbacks("aten::upsample_nearest2d.out")
    assert_raises_like_cpu(lambda conv: torch._C._nn.upsample_nearest2d(
        conv(x), [5, 4], out=conv(torch.empty(1, 2, 5, 4, dtype=torch.float64))))
    assert _fallbacks("aten::upsample_nearest2d.out") == before + 1


def test_a_kernel_without_inputs_is_traced_once_in_the_one_program_cache(strict):
    device = torch.device("neuron", 0)
    before = cache_size()
    first = arange_values(1237, device)
    traced = cache_size()
    second = arange_values(1237, device)
    assert traced == before + 1 and cache_size() == traced
    for values in (first, second):
        torch.testing.assert_close(values.cpu(), torch.arange(1237, dtype=torch.int32), atol=0, rtol=0)


def test_an_index_outside_the_table_raises_the_cpus_index_error(strict):
    table = torch.randn(5, 3)
    assert_raises_like_cpu(lambda conv: torch.index_select(conv(table), 0, conv(torch.tensor([1, 5, 0]))))
    assert_raises_like_cpu(lambda conv: torch.nn.functional.embedding(conv(torch.tensor([[0, -1]])), conv(table)))
