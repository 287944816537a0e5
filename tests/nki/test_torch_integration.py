"""NKI kernels on neuron tensors (launched on the device's stream) and as PyTorch custom ops."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torchneuron import nki, runtime
from torchneuron.runtime import profiler
import torchneuron.nki.language as nl
from tests.nki import kernels as K

pytestmark = pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel yet")


def randn(*shape, dtype=torch.float32, device="neuron", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


# ---------------------------------------------------------------- kernels on neuron tensors

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_on_neuron_matches_cpu(dtype):
    a, b = randn(128, 512, dtype=dtype, seed=1), randn(128, 512, dtype=dtype, seed=2)
    with profiler.record() as rs:
        out = K.tensor_add(a, b)
    assert out.device == a.device and out.dtype == dtype and out.shape == a.shape
    torch.testing.assert_close(out.cpu(), K.tensor_add(a.cpu(), b.cpu()))
    torch.testing.assert_close(out.cpu(), a.cpu() + b.cpu())
    assert [r.name for r in rs] == ["tensor_add"] and rs[0].device == 0


def test_softmax_on_neuron_matches_cpu():
    x = randn(128, 256, seed=3) * 4
    out = K.softmax(x)
    assert out.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), K.softmax(x.cpu()))
    torch.testing.assert_close(out.cpu(), torch.softmax(x.cpu(), dim=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grid", [2, (2, 1)])
def test_spmd_grid_on_neuron(grid):
    x = randn(256, 64, seed=4)
    with profiler.record() as rs:
        out = K.spmd_scale[grid](x, 3.0)
    assert len(rs) == 1  # one launch runs every instance
    torch.testing.assert_close(out.cpu(), 3 * x.cpu())


def test_trace_cached_per_signature_on_device():
    x = randn(128, 64, seed=5)
    K.spmd_scale[1](x, 2.0)
    before = K.spmd_scale.trace_count
    K.spmd_scale[1](x, 2.0)
    K.spmd_scale[1](randn(128, 64, seed=6), 2.0)
    assert K.spmd_scale.trace_count == before
    K.spmd_scale[1](x, 5.0)  # a new meta-parameter traces again
    assert K.spmd_scale.trace_count == before + 1


def test_stream_clock_advances_by_profile_time_plus_overhead():
    a, b = randn(256, 512, seed=7), randn(256, 512, seed=8)
    spec = runtime.core(0).spec
    device_ns = nki.profile(K.tensor_add, chip=spec)(a.cpu(), b.cpu()).device_time_ns
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    K.tensor_add(a, b)
    end.record()
    end.synchronize()
    rec = profiler.records()[-1]
    assert rec.name == "tensor_add"
    assert rec.device_time_ns == pytest.approx(device_ns)
    assert rec.launch_overhead_ns == spec.runtime.kernel_launch_overhead_ns
    expected_ns = round(device_ns + spec.runtime.kernel_launch_overhead_ns)
    assert rec.end_ns - rec.start_ns == expected_ns
    assert start.elapsed_time(end) == pytest.approx(expected_ns / 1e6, abs=1e-6)  # ms


def test_profile_on_neuron_launches_through_the_runtime():
    # nki.profile on neuron tensors launches like a call (one LaunchRecord, stream clock advanced by
    # device time + overhead) and reports from that launch: same figures as the CPU-path profile
    a, b = randn(256, 512, seed=9), randn(256, 512, seed=10)
    spec = runtime.core(0).spec
    cpu = nki.profile(K.tensor_add, chip=spec)(a.cpu(), b.cpu())
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    with profiler.record() as rs:
        rep = nki.profile(K.tensor_add)(a, b)
    end.record()
    end.synchronize()
    assert rep.outputs.device == a.device and rep.outputs.dtype == a.dtype
    torch.testing.assert_close(rep.outputs.cpu(), cpu.outputs)
    assert rep.chip == cpu.chip == spec.name
    assert rep.device_time_ns == pytest.approx(cpu.device_time_ns)
    assert (rep.flops, rep.hbm_bytes_read, rep.hbm_bytes_written, rep.instructions) == \
        (cpu.flops, cpu.hbm_bytes_read, cpu.hbm_bytes_written, cpu.instructions)
    assert rep.engine_busy_ns == pytest.approx(cpu.engine_busy_ns)
    assert rep.roofline_fraction == pytest.approx(cpu.roofline_fraction)
    assert rep.start_ns == pytest.approx(cpu.start_ns) and rep.end_ns == pytest.approx(cpu.end_ns)
    assert len(rs) == 1 and rs[0].name == "tensor_add"
    assert rep.launch is not None and rep.launch.device_time_ns == rep.device_time_ns
    expected_ns = round(rep.device_time_ns + spec.runtime.kernel_launch_overhead_ns)
    assert rs[0].end_ns - rs[0].start_ns == expected_ns
    assert start.elapsed_time(end) == pytest.approx(expected_ns / 1e6, abs=1e-6)  # ms


def test_profile_on_neuron_chrome_trace_and_grid(tmp_path):
    import json
    x = randn(256, 64, seed=11)
    rep = nki.profile(K.spmd_scale[2])(x, 3.0)
    torch.testing.assert_close(rep.outputs.cpu(), 3 * x.cpu())
    cpu = nki.profile(K.spmd_scale[2], chip=runtime.core(0).spec)(x.cpu(), 3.0)
    assert rep.device_time_ns == pytest.approx(cpu.device_time_ns)
    events = json.load(open(rep.to_chrome_trace(str(tmp_path / "t.json"))))["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == rep.instructions
    assert max(e["ts"] + e["dur"] for e in events if e["ph"] == "X") == pytest.approx(rep.device_time_ns / 1e3)


def test_profile_on_neuron_rejects_another_chip_and_mixed_devices():
    a, b = randn(128, 512, seed=12), randn(128, 512, seed=13)
    other = next(c for c in ("trn1", "trn2", "trn3") if c != runtime.core(0).spec.name)
    before = len(profiler.records())
    with pytest.raises(ValueError, match="chip"):
        nki.profile(K.tensor_add, chip=other)(a, b)
    with pytest.raises(RuntimeError, match="same device"):
        nki.profile(K.tensor_add)(a, b.cpu())
    assert len(profiler.records()) == before


def test_launch_on_current_stream_and_device():
    s = torch.neuron.Stream()
    x = randn(128, 64, seed=9)
    with torch.neuron.stream(s):
        with profiler.record() as rs:
            K.spmd_scale[1](x, 2.0)
    assert rs[0].stream == s.stream_id
    y = randn(128, 64, device="neuron:1", seed=9)
    with profiler.record() as rs:
        out = K.spmd_scale[1](y, 2.0)
    assert out.device == torch.device("neuron", 1) and rs[0].device == 1
    torch.testing.assert_close(out.cpu(), 2 * y.cpu())


def test_non_contiguous_input_on_neuron():
    a = randn(512, 128, seed=10).t()  # a strided view
    b = randn(128, 512, seed=11)
    assert not a.is_contiguous()
    torch.testing.assert_close(K.tensor_add(a, b).cpu(), a.cpu() + b.cpu())


@nki.jit
def _store_into(x, y):
    """Writes x + y into x (an input) and returns nothing."""
    t = nl.load(x)
    nl.store(x, nl.add(t, nl.load(y)))


def test_kernel_writing_an_input_writes_the_neuron_tensor():
    x, y = randn(128, 32, seed=12), randn(128, 32, seed=13)
    ref = x.cpu() + y.cpu()
    _store_into(x, y)
    torch.testing.assert_close(x.cpu(), ref)
    xt = randn(32, 128, seed=12).t()  # strided: written back through the view
    ref = xt.cpu() + y.cpu()
    _store_into(xt, y)
    torch.testing.assert_close(xt.cpu(), ref)


def test_mixed_devices_raise_runtime_error_and_launch_nothing():
    a = randn(128, 512, seed=14)
    before = len(profiler.records())
    with pytest.raises(RuntimeError, match="same device.*neuron:0 and cpu"):
        K.tensor_add(a, a.cpu())
    with pytest.raises(RuntimeError, match="same device"):
        K.tensor_add(a, np.ones((128, 512), np.float32))
    with pytest.raises(RuntimeError, match="same device.*neuron:0 and neuron:1"):
        K.tensor_add(a, a.to("neuron:1"))
    assert len(profiler.records()) == before


def test_unsupported_dtype_raises_type_error():
    with pytest.raises(TypeError, match="float64"):
        K.tensor_add(randn(128, 512, dtype=torch.float64), randn(128, 512, dtype=torch.float64))


# ---------------------------------------------------------------- custom ops

@nki.jit
def scaled_add_kernel(a, b, alpha):
    """out = a + alpha * b over row tiles of 128."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    for i in nl.affine_range(a.shape[0] // P):
        rows = slice(i * P, (i + 1) * P)
        nl.store(out[rows, :], nl.add(nl.load(a[rows, :]), nl.multiply(nl.load(b[rows, :]), alpha)))
    return out


@nki.jit
def scaled_add_backward(grad, a, b, alpha):
    """(grad_a, grad_b) = (grad, alpha * grad)."""
    ga = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    gb = nl.ndarray(b.shape, b.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    for i in nl.affine_range(a.shape[0] // P):
        rows = slice(i * P, (i + 1) * P)
        g = nl.load(grad[rows, :])
        nl.store(ga[rows, :], g)
        nl.store(gb[rows, :], nl.multiply(g, alpha))
    return ga, gb


@nki.custom_op("tn_test::scaled_add", kernel=scaled_add_kernel, backward=scaled_add_backward)
def scaled_add(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    torch._check(a.shape == b.shape, lambda: f"a and b must have the same shape, got {list(a.shape)} and "
                                             f"{list(b.shape)}")
    torch._check(a.dim() == 2 and a.shape[0] % 128 == 0, lambda: "a must be [128 * k, n]")
    torch._check(a.dtype == b.dtype, lambda: f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    return torch.empty_like(a)


def _softmax_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


softmax_op = nki.custom_op("tn_test::softmax", K.softmax, fake=_softmax_fake)


@pytest.mark.parametrize("device", ["neuron", "cpu"])
def test_custom_op_forward_and_backward_match_pytorch(device):
    a0, b0 = randn(128, 64, device=device, seed=20), randn(128, 64, device=device, seed=21)
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    w = randn(128, 64, device="cpu", seed=22)
    out = scaled_add(a, b, 0.5)
    assert out.device == a.device and out.requires_grad
    loss = (out.cpu() * w).sum()
    loss.backward()
    ra, rb = a0.cpu().requires_grad_(), b0.cpu().requires_grad_()
    ((ra + 0.5 * rb) * w).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), (ra + 0.5 * rb).detach())
    assert a.grad.device == a.device and b.grad.device == b.device
    torch.testing.assert_close(a.grad.cpu(), ra.grad)
    torch.testing.assert_close(b.grad.cpu(), rb.grad)


def test_custom_op_is_a_torch_op_and_launches_on_device():
    x = randn(128, 96, seed=23)
    with profiler.record() as rs:
        y = torch.ops.tn_test.softmax(x)
    assert [(r.name, r.op) for r in rs] == [("softmax", "tn_test::softmax")]
    torch.testing.assert_close(y.cpu(), torch.softmax(x.cpu(), 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(softmax_op(x.cpu()), torch.softmax(x.cpu(), 1), rtol=1e-5, atol=1e-6)


def test_opcheck_on_neuron_and_cpu():
    a, b = randn(128, 32, seed=24).requires_grad_(), randn(128, 32, seed=25).requires_grad_()
    # PyTorch's autograd_registration check knows only CPU/CUDA/XPU devices: run it on CPU
    torch.library.opcheck(scaled_add, (a, b, 2.0),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(scaled_add, (a.detach().cpu().requires_grad_(), b.detach().cpu().requires_grad_(), 2.0))
    torch.library.opcheck(softmax_op, (randn(128, 32, device="cpu", seed=26),))


@pytest.mark.parametrize("device", ["neuron", "cpu"])
def test_torch_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()

    def fn(x, y):
        return torch.ops.tn_test.softmax(scaled_add(x, y, 2.0) * 0.5)

    x, y = randn(128, 64, device=device, seed=27), randn(128, 64, device=device, seed=28)
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, y).cpu(), fn(x, y).cpu())
    grad_fn = torch.compile(lambda x, y: (scaled_add(x, y, 2.0) * 3.0).sum(), backend="eager", fullgraph=True)
    xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
    grad_fn(xg, yg).backward()  # the registered backward kernel runs under compile too
    assert xg.grad.device == x.device
    torch.testing.assert_close(xg.grad.cpu(), torch.full((128, 64), 3.0))
    torch.testing.assert_close(yg.grad.cpu(), torch.full((128, 64), 6.0))


def test_custom_op_bad_inputs():
    a = randn(128, 64, seed=29)
    with pytest.raises(RuntimeError, match="same device"):
        scaled_add(a, a.cpu(), 1.0)
    with pytest.raises(RuntimeError, match="same shape"):
        scaled_add(a, randn(128, 32, seed=30), 1.0)
    with pytest.raises(RuntimeError, match="same dtype"):
        scaled_add(a, a.bfloat16(), 1.0)
    with pytest.raises(TypeError, match="float64"):
        scaled_add(a.double(), a.double(), 1.0)
    with pytest.raises(TypeError, match="fake"):
        nki.custom_op("tn_test::no_fake")(K.tensor_add)
    with pytest.raises(ValueError, match="namespace::name"):
        nki.custom_op("no_namespace", K.tensor_add, fake=_softmax_fake)


def test_kernel_disagreeing_with_its_fake_is_reported():
    def wrong_fake(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], 1)

    op = nki.custom_op("tn_test::wrong_softmax", K.softmax, fake=wrong_fake)
    with pytest.raises(RuntimeError, match="fake implementation says"):
        op(randn(128, 32, seed=31))


def _scale_fake(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scale_setup(ctx, inputs, output):
    ctx.factor = inputs[1]


def _scale_backward(ctx, grad):
    return torch.ops.tn_test.scale(grad.contiguous(), ctx.factor), None  # the backward is the op itself


scale_op = nki.custom_op("tn_test::scale", K.spmd_scale[2], fake=_scale_fake, backward=_scale_backward,
                         setup_context=_scale_setup)


@pytest.mark.parametrize("device", ["neuron", "cpu"])
def test_custom_op_with_grid_and_pytorch_style_backward(device):
    x = randn(256, 32, device=device, seed=32).requires_grad_()
    with profiler.record() as rs:
        y = scale_op(x, 3.0)
        y.backward(torch.ones_like(y))
    torch.testing.assert_close(y.detach().cpu(), 3 * x.detach().cpu())
    torch.testing.assert_close(x.grad.cpu(), torch.full((256, 32), 3.0))
    ours = [r for r in rs if r.name == "spmd_scale"]  # ones_like(y) is a device launch too (a fill)
    assert len(ours) == (2 if device == "neuron" else 0)  # forward and backward launches on the device
