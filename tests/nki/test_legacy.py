"""The earlier NKI generation (neuronxcc.nki style) on the simulator: torchneuron.nki.legacy directly and
through ``from neuronxcc import nki`` after install_import_aliases() (in a subprocess)."""
from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

import torchneuron.nki as tn
from torchneuron.nki import legacy as nki
from torchneuron.nki.legacy import isa as nisa, language as nl
from tests.nki.legacy_kernels import build

K = build(nki, nl, nisa)
RNG = np.random.default_rng(0)


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _layernorm_ref(x, g, b):
    mu, var = x.mean(1, keepdims=True), x.var(1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * g + b


def test_tensor_add_ragged_mask():
    a, b = randn(300, 256), randn(300, 256)   # last row tile: 44 of 128 partitions
    np.testing.assert_allclose(K["tensor_add"](a, b), a + b, rtol=1e-6)


def test_tiled_matmul_psum_accumulation():
    lhsT, rhs = randn(384, 128), randn(384, 512)
    np.testing.assert_allclose(K["matmul"](lhsT, rhs), lhsT.T @ rhs, rtol=1e-4, atol=1e-3)
    rep = nki.profile(K["matmul"])(lhsT, rhs)
    ops = [i.opcode for i in rep.program.instructions]
    assert ops.count("nc_matmul") == 3  # `acc += nisa.nc_matmul(...)` re-targets the matmul: no extra copies


def test_block_dims_and_nl_matmul():
    lhsT, rhs = randn(256, 128), randn(256, 512)
    ref = lhsT.T @ rhs - lhsT[:128].T @ rhs[:128]
    np.testing.assert_allclose(K["matmul_blocks"](lhsT, rhs), ref, rtol=1e-4, atol=1e-3)


def test_softmax_masked():
    x = randn(200, 384) * 3
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(K["softmax"](x), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_layernorm_two_styles():
    x, g, b = randn(200, 384), randn(384), randn(384)
    o1, o2 = K["layernorm"](x, g, b)
    np.testing.assert_allclose(o1, _layernorm_ref(x, g, b), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(o2, _layernorm_ref(x, g, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("grid", [(2, 2), (2, 1), (2, 4)])
def test_spmd_2d_grid(grid):
    a, b = randn(256, 512), randn(256, 512)
    np.testing.assert_allclose(K["spmd_add"][grid](a, b), a + b, rtol=1e-6)


def test_simulate_kernel_and_benchmark():
    a, b = randn(128, 512), randn(128, 512)
    np.testing.assert_allclose(nki.simulate_kernel(K["tensor_add"], a, b), a + b, rtol=1e-6)
    np.testing.assert_allclose(nki.simulate_kernel(K["spmd_add"][2, 1], a, b), a + b, rtol=1e-6)
    bench = nki.benchmark(warmup=5, iters=10)(K["tensor_add"].fn)
    np.testing.assert_allclose(bench(a, b), a + b, rtol=1e-6)
    assert bench.benchmark_result.nc_latency.get_latency_percentile(50) > 0
    np.testing.assert_allclose(nki.baremetal(K["tensor_add"].fn)(a, b), a + b, rtol=1e-6)


def test_index_helpers():
    g = nl.mgrid[0:4, 0:8]
    assert g.p.terms and g.x.terms and len(g) == 2
    from torchneuron.nki.legacy._tile import boxes, is_box, restriction
    i_p, i_f = nl.arange(4)[:, None], nl.arange(4)[None, :]
    tri = i_p < i_f                                   # a triangle, not a box
    assert not is_box(tri) and restriction(tri) == {0: (0, 3), 1: (1, 3)}   # its bounding box
    assert boxes(tri) == [{0: (0, 1), 1: (1, 3)}, {0: (1, 1), 1: (2, 2)}, {0: (2, 1), 1: (3, 1)}]
    assert is_box(i_p < 3) and boxes(i_p < 3) == [{0: (0, 3)}]


_SUBPROCESS = r"""
import numpy as np, sys
import torchneuron.nki as tn
tn.install_import_aliases()
from neuronxcc import nki
import neuronxcc.nki.language as nl
import neuronxcc.nki.isa as nisa
import neuronxcc.nki.typing as nt
import torchneuron.nki.legacy as legacy
assert nki is legacy and nl is legacy.language and nisa is legacy.isa
sys.path.insert(0, {root!r})
from tests.nki.legacy_kernels import build
K = build(nki, nl, nisa)
r = np.random.default_rng(1)
f = lambda *s: r.standard_normal(s).astype(np.float32)
a, b = f(300, 256), f(300, 256)
np.testing.assert_allclose(K["tensor_add"](a, b), a + b, rtol=1e-6)
l, rr = f(256, 128), f(256, 512)
np.testing.assert_allclose(nki.simulate_kernel(K["matmul"], l, rr), l.T @ rr, rtol=1e-4, atol=1e-3)
x = f(130, 256)
e = np.exp(x - x.max(1, keepdims=True))
np.testing.assert_allclose(K["softmax"](x), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
g, bb = f(256), f(256)
mu, v = x.mean(1, keepdims=True), x.var(1, keepdims=True)
np.testing.assert_allclose(K["layernorm"](x, g, bb)[0], (x - mu) / np.sqrt(v + 1e-5) * g + bb, rtol=1e-4, atol=1e-4)
a, b = f(256, 512), f(256, 512)
np.testing.assert_allclose(K["spmd_add"][2, 2](a, b), a + b, rtol=1e-6)
print("ok")
"""


def test_neuronxcc_aliases_in_subprocess():
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _SUBPROCESS.format(root=root)], capture_output=True, text=True,
                       timeout=120, cwd=root)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_aliases_refuse_a_real_neuronxcc(monkeypatch):
    # Start from a clean slate: pytest may have imported tests/nki as `nki`, and an earlier
    # test in this process may have installed the aliases.
    for name in [m for m in sys.modules if m == "nki" or m.startswith(("nki.", "neuronxcc"))]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "neuronxcc", types.ModuleType("neuronxcc"))
    with pytest.raises(ImportError, match="real neuronxcc"):
        tn.install_import_aliases()
    monkeypatch.setitem(sys.modules, "neuronxcc.nki", types.ModuleType("neuronxcc.nki"))
    with pytest.raises(ImportError, match="real NKI"):
        tn.install_import_aliases()


def test_spmd_dim_and_nc_place_instances_on_the_named_cores():
    """S-legacy test_nki_spmd_grid.py: ``nl.spmd_dim(g, nl.nc(2))`` runs instance (n, m) on NC n % 2;
    ``nl.nc(2) * 2`` (= ``spmd_dim(nl.nc(2), 2)``) runs instances 0-1 on NC 0 and 2-3 on NC 1."""
    from tests.nki.kernels import spmd_scale  # a current-generation kernel: the grid form is the same
    from torchneuron.sim.specs import chip_spec

    a, b = randn(512, 512), randn(512, 512)
    rep = tn.profile(K["spmd_add"][nl.spmd_dim(2, nl.nc(2)), 2])(a, b)
    assert [rep.program.core_of(i) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # (n, m) on n % 2
    np.testing.assert_allclose(rep.outputs, a + b, rtol=1e-6)
    for grid in (nl.nc(2) * 2, nl.spmd_dim(nl.nc(2), 2)):
        rep = tn.profile(spmd_scale[grid])(randn(256, 64), 2.0)
        assert [rep.program.core_of(i) for i in range(4)] == [0, 0, 1, 1]
        times = [p.schedule(chip_spec("trn2")).device_time_ns for p in rep.program.instances]
        assert rep.device_time_ns == pytest.approx(max(times[0] + times[1], times[2] + times[3]))
    rep = tn.profile(spmd_scale[2 * nl.nc(2)])(randn(256, 64), 2.0)
    assert [rep.program.core_of(i) for i in range(4)] == [0, 1, 0, 1]
