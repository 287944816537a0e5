"""The ``nki.language`` entries added for the published API, run in kernels against NumPy/PyTorch references
(including the documented examples), with their limits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.sim import SimulatorError

RNG = np.random.default_rng(7)
F32_EPS = 2.0 ** -23


def run(fn, *arrays, chip: str = "trn2", out_dtype=nl.float32):
    """Load each array into SBUF, apply ``fn`` to the tiles and return the stored result as NumPy."""
    def body(*hbm):
        r = fn(*[nl.load(a) for a in hbm])
        out = nl.ndarray(r.shape, out_dtype, buffer=nl.shared_hbm)
        nl.store(out, r if r.buffer.name != "psum" else nl.copy(r))
        return out

    kernel = [lambda a: body(a), lambda a, b: body(a, b), lambda a, b, c: body(a, b, c)][len(arrays) - 1]
    return nki.profile(nki.jit(kernel), chip=chip)(*arrays).outputs


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def test_memory_predicates_and_region_enum():
    assert nl.is_sbuf(nl.sbuf) and nl.is_psum(nl.psum) and nl.is_hbm(nl.hbm) and nl.is_hbm(nl.shared_hbm)
    assert nl.is_on_chip(nl.psum) and not nl.is_on_chip(nl.private_hbm) and not nl.is_hbm(nl.sbuf)
    assert nl.is_psum(nl.MemoryRegion.psum) and nl.is_hbm(nl.MemoryRegion.shared_hbm)
    with pytest.raises(TypeError, match="memory region"):
        nl.is_sbuf("dram")
    assert isinstance(nl.NkiTensor.__mro__[1](), nl.NKIObject) and issubclass(nl.NkiTensor, nl.NKIObject)
    assert nl.DType is torch.dtype and nl.bypass == "bypass"


DERIVATIVES = {
    "gelu_dx": lambda x: torch.func.vmap(torch.func.grad(lambda v: torch.nn.functional.gelu(v)))(x),
    "gelu_apprx_sigmoid_dx": lambda x: torch.func.vmap(torch.func.grad(lambda v: v * torch.sigmoid(1.702 * v)))(x),
    "silu_dx": lambda x: torch.func.vmap(torch.func.grad(torch.nn.functional.silu))(x),
    "erf_dx": lambda x: torch.func.vmap(torch.func.grad(torch.erf))(x),
    "mish": torch.nn.functional.mish, "tan": torch.tan, "arctan": torch.atan, "ceil": torch.ceil,
    "floor": torch.floor, "trunc": torch.trunc,
}


@pytest.mark.parametrize("name", sorted(DERIVATIVES))
def test_activation_functions_against_torch(name):
    x = randn(64, 96, scale=1.2)
    got = run(getattr(nl, name), x)
    want = DERIVATIVES[name](torch.from_numpy(x).double().reshape(-1)).reshape(64, 96).float().numpy()
    # fp32 evaluation of a smooth function: a few ulps of the result, or of 1 near zero crossings
    np.testing.assert_allclose(got, want, rtol=64 * F32_EPS, atol=64 * F32_EPS)


def test_ceil_floor_trunc_documented_examples():
    x = np.array([[3.2, -3.7, 3.7, -3.2]], np.float32)
    assert run(nl.ceil, x).tolist() == [[4.0, -3.0, 4.0, -3.0]]
    assert run(nl.floor, x).tolist() == [[3.0, -4.0, 3.0, -4.0]]
    assert run(nl.trunc, x).tolist() == [[3.0, -3.0, 3.0, -3.0]]


def test_fmod_and_mod_follow_numpy_signs():
    x = randn(32, 64, scale=10)
    y = randn(32, 64, scale=3)
    y[np.abs(y) < 0.1] = 0.5
    np.testing.assert_array_equal(run(nl.fmod, x, y), np.fmod(x, y))
    np.testing.assert_allclose(run(nl.mod, x, y), np.mod(x, y), rtol=0, atol=4 * F32_EPS * 10)
    np.testing.assert_allclose(run(lambda a: nl.mod(a, 3.0), x), np.mod(x, np.float32(3.0)), atol=4 * F32_EPS * 10)


def test_abs_max_abs_min_documented_examples_on_trn3_only():
    a, b = np.full((128, 512), -5.0, np.float32), np.full((128, 1), 3.0, np.float32)
    assert (run(nl.abs_max, a, b, chip="trn3") == -5.0).all()
    assert (run(nl.abs_min, a, b, chip="trn3") == 3.0).all()
    one, minus = np.full((128, 512), 1.0, np.float32), np.full((128, 1), -1.0, np.float32)
    assert (run(nl.abs_max, one, minus, chip="trn3") == -1.0).all()  # ties give y
    x, y = randn(16, 40), randn(16, 40)
    np.testing.assert_array_equal(run(nl.abs_max, x, y, chip="trn3"), np.where(np.abs(x) > np.abs(y), x, y))
    with pytest.raises(SimulatorError, match="nl.abs_max: needs NeuronCore-v4 or newer; trn2 is NeuronCore-v3"):
        run(nl.abs_max, a, b)


def test_invert_and_logical_not():
    x = RNG.integers(-1000, 1000, (8, 16)).astype(np.int32)
    np.testing.assert_array_equal(run(nl.invert, x, out_dtype=nl.int32), np.invert(x))
    u = RNG.integers(0, 255, (8, 16)).astype(np.uint8)
    np.testing.assert_array_equal(run(nl.invert, u, out_dtype=nl.uint8), np.invert(u))
    b = RNG.integers(0, 2, (8, 16)).astype(np.float32)
    np.testing.assert_array_equal(run(nl.logical_not, b), np.logical_not(b).astype(np.float32))
    with pytest.raises(SimulatorError, match="integer tile"):
        run(nl.invert, b)


def test_prod_all_var_reductions():
    x = 1 + randn(32, 8, 16, scale=0.1)  # near 1: 128 factors neither overflow nor underflow
    # 127 fp32 roundings of at most 2**-24 each against the float64 product
    np.testing.assert_allclose(run(lambda t: nl.prod(t, axis=(1, 2)), x),
                               np.prod(x.reshape(32, -1).astype(np.float64), 1, keepdims=True), rtol=128 * F32_EPS)
    nz = np.where(RNG.random((32, 40)) < 0.05, 0, 1).astype(np.float32)
    np.testing.assert_array_equal(run(lambda t: nl.all(t, axis=1), nz), nz.all(1).astype(np.float32).reshape(32, 1))
    v = randn(32, 8, 16, scale=4) + 3
    got = run(lambda t: nl.var(t, axis=2), v)
    np.testing.assert_allclose(got, v.astype(np.float64).var(2, keepdims=True), rtol=32 * F32_EPS, atol=1e-6)


def test_softmax_documented_uniform_and_random():
    ones = np.ones((128, 512), np.float32)
    np.testing.assert_allclose(run(lambda t: nl.softmax(t, axis=1), ones), np.full((128, 512), 1 / 512), rtol=4 * F32_EPS)
    x = randn(64, 4, 50, scale=5)
    e = np.exp(x - x.max(2, keepdims=True))
    np.testing.assert_allclose(run(lambda t: nl.softmax(t, axis=2), x), e / e.sum(2, keepdims=True),
                               rtol=128 * F32_EPS, atol=1e-9)


def test_rms_norm_documented_example_and_weights():
    x, w = np.full((128, 512), 2.0, np.float32), np.ones((128, 512), np.float32)
    np.testing.assert_allclose(run(lambda a, b: nl.rms_norm(a, b, axis=1, n=512), x, w),
                               x / np.sqrt(4.0 + 1e-6), rtol=8 * F32_EPS)
    x, w = randn(64, 300), randn(64, 1)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).sum(1, keepdims=True) / 300 + 1e-6) * w
    np.testing.assert_allclose(run(lambda a, b: nl.rms_norm(a, b, axis=1, n=300), x, w), ref, rtol=512 * F32_EPS)


def test_where_documented_examples_and_random():
    c1, c0 = np.ones((128, 512), np.float32), np.zeros((128, 512), np.float32)
    ten, five = np.full((128, 512), 10.0, np.float32), np.full((128, 512), 5.0, np.float32)
    assert (run(nl.where, c1, ten, c0) == 10).all() and (run(nl.where, c0, ten, five) == 5).all()
    c = (RNG.random((32, 64)) < 0.5).astype(np.float32)
    x, y = randn(32, 64), randn(32, 64)
    x[0, 0] = np.inf
    np.testing.assert_array_equal(run(nl.where, c, x, y), np.where(c != 0, x, y))
    np.testing.assert_array_equal(run(lambda a, b: nl.where(a, b, -1.5), c, x), np.where(c != 0, x, -1.5))


def test_dropout_rand_and_random_seed():
    x = np.ones((128, 256), np.float32)
    got = run(lambda t: nl.dropout(t, 0.25), x)
    assert set(np.unique(got)) <= {0.0, 1.0}
    kept = got.mean()  # binomial: 32768 draws, standard deviation sqrt(p(1-p)/n) = 0.0024
    assert abs(kept - 0.75) < 5 * math.sqrt(0.25 * 0.75 / got.size)

    def seeded(t):
        seed = nl.full((1, 1), 42, nl.int32)
        nl.random_seed(seed)
        a = nl.rand(t.shape, nl.float32)
        nl.random_seed(seed)
        b = nl.rand(t.shape, nl.float32)
        return nl.subtract(a, b)

    assert (run(seeded, x) == 0).all()
    u = run(lambda t: nl.rand(t.shape, nl.float32), x)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u.size)


def test_creation_helpers():
    x = randn(16, 24)
    assert (run(lambda t: nl.ones(t.shape, nl.float32), x) == 1).all()
    assert (run(lambda t: nl.zeros_like(t), x) == 0).all()

    def like(t):
        e = nl.empty_like(t, dtype=nl.bfloat16)
        assert tuple(e.shape) == tuple(t.shape) and e.dtype == nl.bfloat16 and nl.is_sbuf(e.buffer)
        nisa.tensor_copy(dst=e, src=t)
        return e
    np.testing.assert_array_equal(run(like, x), torch.from_numpy(x).bfloat16().float().numpy())

    def expand(t):
        v = nl.expand_dims(t, 1)
        assert tuple(v.shape) == (16, 1, 24)
        with pytest.raises(SimulatorError, match="partition dim"):
            nl.expand_dims(t, 0)
        return nl.copy(v)
    np.testing.assert_array_equal(run(expand, x), x.reshape(16, 1, 24))


def test_identity_matrix_and_no_reorder():
    def ident(t):
        with nl.no_reorder():
            return nl.shared_identity_matrix(n=128, dtype=nl.float32)
    np.testing.assert_array_equal(run(ident, np.zeros((1, 1), np.float32)), np.eye(128, dtype=np.float32))


def test_load_transpose2d_and_gather_flattened():
    a = randn(96, 64)

    @nki.jit
    def tr(src):
        out = nl.ndarray((64, 96), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, nl.load_transpose2d(src, dtype=nl.bfloat16))
        return out
    np.testing.assert_array_equal(nki.simulate(tr)(a), torch.from_numpy(a.T.copy()).bfloat16().float().numpy())

    data = randn(128, 512)
    idx = RNG.integers(0, 512, (128, 512)).astype(np.int32)
    np.testing.assert_array_equal(run(nl.gather_flattened, data, idx), np.take_along_axis(data, idx, 1))


def test_device_print_prints_when_the_kernel_runs(capfd):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)

    def show(t):
        nl.device_print("tile:", t)
        return nl.copy(t)
    run(show, x)
    assert "tile: [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]" in capfd.readouterr().out


def test_partition_average_token():
    x = randn(64, 32)

    def avg(t):
        out = nl.ndarray((1, 32), nl.float32)
        nisa.tensor_partition_reduce(dst=out, op=nl.average, data=t)
        return out
    np.testing.assert_allclose(run(avg, x), x.mean(0, keepdims=True), rtol=64 * F32_EPS, atol=1e-7)


def test_broadcast_to_with_dtype():
    col = randn(32, 1)
    got = run(lambda t: nl.broadcast_to(t, (32, 8), dtype=nl.bfloat16), col)
    np.testing.assert_array_equal(got, np.repeat(torch.from_numpy(col).bfloat16().float().numpy(), 8, 1))
