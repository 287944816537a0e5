"""What tracing sees is what runs: for the ops of the fast OpInfo set (every family the eager layer lowers),
the sizes and strides FakeTensor tracing computes for a neuron op's outputs (PyTorch's meta kernels, what
Dynamo and AOTAutograd build graphs from) equal those of the real neuron kernel's outputs. A mismatch
breaks compiled graphs: a ``view`` the trace allowed fails on the real tensor.

Strides of size-1 dims carry no layout and are not compared. Ops whose samples the device refuses or
whose fake run is unsupported are skipped sample by sample.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.opinfo.harness import _tensors, find_ops, load_op_db, op_key, to_neuron
from tests.opinfo.test_opinfo_fast import FAST_OPS

pytestmark = pytest.mark.filterwarnings("ignore:.*has no neuron kernel yet.*:UserWarning")
SAMPLES = 3
OPS = [op for op in find_ops(FAST_OPS, load_op_db()) if torch.float32 in op.dtypes]
# strict xfails: fixing the op makes the test fail until its entry goes
KNOWN: dict[str, str] = {}
PARAMS = [pytest.param(op, id=op_key(op), marks=[pytest.mark.xfail(strict=True, reason=KNOWN[op_key(op)])]
                       if op_key(op) in KNOWN else []) for op in OPS]


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


def _fake(mode: FakeTensorMode, x):
    if isinstance(x, torch.Tensor):
        return mode.from_tensor(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_fake(mode, v) for v in x)
    if isinstance(x, dict):
        return {k: _fake(mode, v) for k, v in x.items()}
    return x


def _check(fn, args: tuple, kwargs: dict) -> None:
    real = fn(*args, **kwargs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = fn(*_fake(mode, args), **_fake(mode, kwargs))
    for i, (r, f) in enumerate(zip(_tensors(real), _tensors(fake))):
        if r.numel() > 1:
            assert _layout(r) == _layout(f), f"output {i}: real {r.shape}/{r.stride()}, traced {f.shape}/{f.stride()}"


@pytest.mark.parametrize("op", PARAMS)
def test_traced_strides_equal_real_strides(op):
    ran = 0
    for sample in list(op.sample_inputs("cpu", torch.float32))[:SAMPLES]:
        parts = to_neuron((sample.input, sample.args, sample.kwargs))
        inp, args, kwargs = parts
        try:
            op(inp, *args, **kwargs)
        except Exception:  # noqa: BLE001 (a sample the device or the CPU refuses: not this test's business)
            continue
        try:
            _check(lambda x, *a, **k: op(x, *a, **k), (inp, *args), kwargs)
        except (NotImplementedError, torch._subclasses.fake_tensor.UnsupportedOperatorException,
                torch._subclasses.fake_tensor.DynamicOutputShapeException,
                torch._subclasses.fake_tensor.DataDependentOutputException):   # no static layout to compare
            continue
        ran += 1
    if not ran:
        pytest.skip("no sample ran on both")


@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_strides_survive_transpose_reshape(causal):
    """The graph of issue #12: attention's output transposed and reshaped, traced by aot_eager on neuron."""
    q, k, v = (torch.randn(2, 3, 8, 16, device="neuron") for _ in range(3))
    _check(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), (q, k, v), {})
    fn = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal).transpose(1, 2).reshape(2, 8, 48)  # noqa: E731
    got = torch.compile(fn, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got.cpu(), fn(q.cpu(), k.cpu(), v.cpu()))
