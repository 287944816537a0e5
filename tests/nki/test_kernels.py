"""NKI-style kernels on the simulator: results against NumPy/PyTorch, profiles, caching, limits, aliases."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.sim import SimulatorError
from tests.nki import kernels as K

RNG = np.random.default_rng(0)


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_tensor_add_numpy_and_torch():
    a, b = randn(256, 1024), randn(256, 1024)
    np.testing.assert_allclose(nki.simulate(K.tensor_add)(a, b), a + b, rtol=1e-6)
    ta, tb = torch.from_numpy(a).bfloat16(), torch.from_numpy(b).bfloat16()
    out = K.tensor_add(ta, tb)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ta + tb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiled_matmul(dtype):
    lhsT, rhs = torch.randn(256, 256).to(dtype), torch.randn(256, 512).to(dtype)
    out = K.matmul(lhsT, rhs)
    ref = lhsT.float().T @ rhs.float()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 if dtype == torch.float32 else 0.3)


def test_softmax_rows():
    x = randn(256, 384) * 4
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(K.softmax(x), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_layernorm_matches_torch():
    x, g, b = randn(256, 384), randn(384), randn(384)
    ref = torch.nn.functional.layer_norm(torch.from_numpy(x), (384,), torch.from_numpy(g), torch.from_numpy(b))
    np.testing.assert_allclose(K.layernorm(x, g, b), ref.numpy(), rtol=1e-4, atol=1e-4)
    ref = torch.nn.functional.layer_norm(torch.from_numpy(x), (384,))
    np.testing.assert_allclose(K.layernorm_bn(x), ref.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("grid", [2, 4, (2, 1)])
def test_spmd_grid(grid):
    x = randn(256, 64)
    np.testing.assert_allclose(K.spmd_scale[grid](x, 3.0), 3 * x, rtol=1e-6)


def test_nl_convenience_ops():
    @nki.jit
    def k(x, y):
        out = nl.ndarray((128, 128), nl.float32, buffer=nl.shared_hbm)
        s = nl.ndarray((128, 1), nl.float32, buffer=nl.shared_hbm)
        a, b = nl.load(x), nl.load(y)
        mm = nl.copy(nl.matmul(a, b))                    # a @ b (transpose inserted)
        t = nl.maximum(nl.exp(mm * 0.01), 1.0) - nl.transpose(b)[...]
        nl.store(out, t)
        nl.store(s, nl.sum(t, axis=1, keepdims=True))
        return out, s
    x, y = randn(128, 128), randn(128, 128)
    out, s = k(x, y)
    ref = np.maximum(np.exp((x @ y) * 0.01), 1.0) - y.T
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s[:, 0], ref.sum(1), rtol=1e-4, atol=1e-3)


def test_profile_report_and_chrome_trace(tmp_path):
    lhsT, rhs = torch.randn(256, 256).bfloat16(), torch.randn(256, 512).bfloat16()
    rep = nki.profile(K.matmul, chip="trn2")(lhsT, rhs)
    M, K_, N = 256, 256, 512
    assert rep.device_time_ns > 0 and rep.flops == 2 * M * N * K_
    assert rep.hbm_bytes_read == (M // 128) * (N // 512) * (K_ * 128 + K_ * 512) * 2  # every (m, n) reloads its K strip
    assert rep.hbm_bytes_written == M * N * 2
    assert set(rep.engine_busy_ns) == {"tensor", "vector", "scalar", "gpsimd", "dma"}
    assert rep.engine_busy_ns["tensor"] > 0 and rep.engine_busy_ns["dma"] > 0
    assert rep.achieved_tflops == pytest.approx(rep.flops / rep.device_time_ns / 1e3)
    assert 0 < rep.roofline_fraction <= 1.0 and rep.achieved_gbps > 0
    torch.testing.assert_close(rep.outputs.float(), lhsT.float().T @ rhs.float(), rtol=1e-2, atol=0.3)
    path = rep.to_chrome_trace(str(tmp_path / "mm.json"))
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == rep.instructions == len(rep.program.instructions)
    assert {e["name"] for e in spans} == {"dma_copy", "nc_matmul", "tensor_copy"}


def test_profile_chip_from_env(monkeypatch):
    a = randn(128, 512)
    monkeypatch.setenv("TORCHNEURON_CHIP", "trn1")
    assert nki.profile(K.tensor_add)(a, a).chip == "trn1"
    assert nki.profile(K.tensor_add, chip="trn2")(a, a).chip == "trn2"


def test_trace_is_cached_per_signature():
    @nki.jit
    def k(x, scale):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.multiply(nl.load(x), scale))
        return out
    x = randn(128, 64)
    k(x, 2.0)
    k(randn(128, 64), 2.0)
    assert k.trace_count == 1
    np.testing.assert_allclose(k(x, 3.0), 3 * x, rtol=1e-6)  # a new meta-parameter: a new trace
    k(randn(64, 64), 3.0)
    assert k.trace_count == 3


def test_partition_limit_is_a_simulator_error():
    with pytest.raises(SimulatorError, match="128 partitions"):
        nki.simulate(_load_all)(randn(256, 64))


def _load_all(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.load(x))  # 256 partitions: too many
    return out


def test_matmul_moving_limit_is_a_simulator_error():
    @nki.jit
    def k(a, b):
        out = nl.ndarray((128, 1024), nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((128, 1024), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=nl.load(a), moving=nl.load(b))
        return out
    with pytest.raises(SimulatorError, match="gemm_moving_fmax"):
        k(randn(128, 128), randn(128, 1024))


def test_install_import_aliases_in_subprocess():
    code = ("import torchneuron.nki as tn; tn.install_import_aliases(); "
            "import nki, nki.language as nl, nki.isa as nisa, nki.collectives as ncc; "
            "import torchneuron.nki.language as ours; assert nl is ours and nki.jit is tn.jit; "
            "assert ncc is tn.collectives; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_install_import_aliases_refuses_a_real_nki(monkeypatch):
    import types
    monkeypatch.setitem(sys.modules, "nki", types.ModuleType("nki"))
    with pytest.raises(ImportError, match="real NKI installation"):
        nki.install_import_aliases()


@nki.jit
def copy_rounded_kernel(x):
    """x [128, 64] fp32 -> a copy rounded to bf16 but held in an fp32 tile (the tutorials' ``dtype=``)."""
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r, src=t, dtype=nl.bfloat16)
    nisa.dma_copy(dst=out, src=r)
    return out


def test_tensor_copy_dtype_rounds_through_that_dtype():
    x = randn(128, 64)
    got = nki.simulate(copy_rounded_kernel)(x)
    want = torch.from_numpy(x).bfloat16().float().numpy()
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, x)  # the rounding happened


@nki.jit
def _double_tile(t):
    """A sub-kernel helper: 2 * t of an SBUF tile."""
    return nl.multiply(t, 2.0)


@nki.jit
def _profiles_a_helper(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    nl.store(out, nki.profile(_double_tile)(t))   # inside a trace: the helper runs inline, as a call would
    return out


def test_profile_inside_a_kernel_being_traced_runs_the_helper_inline():
    x = randn(128, 64)
    np.testing.assert_array_equal(nki.simulate(_profiles_a_helper)(x), 2 * x)
