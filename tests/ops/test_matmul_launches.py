"""Eager matrix products: one kernel launch per call for long contractions and transposed operands, the
bias of ``linear`` added inside that launch, and results within the fp32-accumulation bound of a float64
reference in every matmul dtype."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import to_n
from torchneuron import runtime
from torchneuron.kernels.matmul import max_contraction
from torchneuron.runtime import profiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps


def _check(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``out`` against the float64 ``a @ b (+ bias)`` of the same rounded operands: the products summed in
    fp32 (a random-walk bound of 4 sqrt(K) eps32 times the summed magnitudes) and rounded once to the
    result dtype (its eps relative to the exact value)."""
    ref = a.double() @ b.double()
    mag = a.double().abs() @ b.double().abs()
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    tol = 4 * a.shape[-1] ** 0.5 * torch.finfo(torch.float32).eps * mag + torch.finfo(out.dtype).eps * ref.abs()
    err = (out.cpu().double() - ref).abs()
    assert out.dtype == a.dtype and out.shape == ref.shape
    assert bool((err <= tol).all()), f"error exceeds the bound by up to {float((err - tol).max()):.3g}"


def _launches(fn):
    with profiler.record() as recs:
        out = fn()
    return out, [r.name for r in recs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["plain", "a_t", "b_t", "both_t"])
def test_long_contraction_is_one_launch(layout, dtype, strict):
    # K = 4100 was split into 2048-row chunks with fp32 partials (8 launches); now the kernel takes it whole,
    # with transposed operands read as they lie (no copy)
    M, K, N = 130, 4100, 260
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    na = to_n(a.t().contiguous()).t() if layout in ("a_t", "both_t") else to_n(a)
    nb = to_n(b.t().contiguous()).t() if layout in ("b_t", "both_t") else to_n(b)
    out, names = _launches(lambda: na @ nb)
    assert names == ["matmul_kernel"]
    _check(out, a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_with_bias_is_one_launch_on_the_tiled_path(dtype, strict):
    # K > 512 or N > 512 take the tiled loop nest; the bias row is added at its PSUM evictions
    x, w, bias = torch.randn(70, 600).to(dtype), torch.randn(700, 600).to(dtype), torch.randn(700).to(dtype)
    out, names = _launches(lambda: F.linear(to_n(x), to_n(w), to_n(bias)))
    assert names == ["matmul_kernel"]
    _check(out, x, w.t(), bias)


def test_linear_3d_input_with_bias(strict):
    x, w, bias = torch.randn(3, 50, 600), torch.randn(520, 600), torch.randn(520)
    out = F.linear(to_n(x), to_n(w), to_n(bias))
    _check(out.reshape(150, 520), x.reshape(150, 600), w.t(), bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_contraction_beyond_sbuf_is_one_launch(bias, dtype, strict):
    # with B given as [N, K], past the longest contraction one pass keeps in SBUF: the kernel sums equal chunks
    # of whole K tiles in fp32 (the bias added once) and rounds once; it was one launch per chunk plus the sums
    budget = runtime.core(0).spec.sbuf_bytes_per_partition
    K = max_contraction(torch.tensor([], dtype=dtype).element_size(), False, True, budget, bias) + 300
    x, w, b = (torch.randn(5, K).to(dtype), torch.randn(6, K).to(dtype), torch.randn(6).to(dtype))
    out, names = _launches(lambda: F.linear(to_n(x), to_n(w), to_n(b) if bias else None))
    assert names == ["matmul_kernel"]
    _check(out, x, w.t(), b if bias else None)


@pytest.mark.parametrize("batched", [False, True])
def test_scaled_sum_over_a_contraction_beyond_sbuf_is_one_launch(batched, strict):
    # the scaled sum at the store of the last K chunk's pass, from the total rounded to the dtype
    budget = runtime.core(0).spec.sbuf_bytes_per_partition
    K = max_contraction(2, True, False, budget, True) + 200
    lead = (2,) if batched else ()
    a, b = torch.randn(lead + (K, 70)).bfloat16(), torch.randn(lead + (K, 150)).bfloat16()
    c = torch.randn(lead + (70, 150)).bfloat16()
    op = torch.baddbmm if batched else torch.addmm
    out, names = _launches(lambda: op(to_n(c), to_n(a).transpose(-1, -2), to_n(b), beta=0.5, alpha=2.0))
    assert names == ["addmm_kernel"]
    prod = (a.transpose(-1, -2).double() @ b.double()).bfloat16().double()   # the product rounded, as a launch reads it
    ref = 0.5 * c.double() + 2.0 * prod
    mag = (a.transpose(-1, -2).double().abs() @ b.double().abs())
    # the product's fp32 sum of K terms, its rounding (relative eps_bf16), then the fp32 sum rounded to bf16
    tol = 2.0 * (4 * K ** 0.5 * EPS32 * mag + torch.finfo(torch.bfloat16).eps * prod.abs()) \
        + torch.finfo(torch.bfloat16).eps * ref.abs()
    assert bool(((out.cpu().double() - ref).abs() <= tol).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_accumulate_in_fp32(dtype, strict):
    # every product of the long contraction is summed in fp32: rounding partial sums to the half type
    # would lose ~sqrt(K) eps_half and fail the bound
    a = torch.full((4, 3000), 1.0).to(dtype)
    b = torch.rand(3000, 5).to(dtype)
    _check(to_n(a) @ to_n(b), a, b)


def test_out_and_inplace_variants_of_long_products(strict):
    a, b, c = torch.randn(40, 2500), torch.randn(2500, 30), torch.randn(40, 30)
    out = to_n(torch.empty(40, 30))
    torch.mm(to_n(a), to_n(b), out=out)
    _check(out, a, b)
    nc = to_n(c)
    nc.addmm_(to_n(a), to_n(b))
    _check(nc, a, b, c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["2d", "batched short K", "batched narrow"])
def test_scaled_sum_with_a_full_input_is_one_launch(shape, dtype, strict):
    # beta * C + alpha * (A @ B) with C of the result's shape: the sum is formed at the product's store (it was a
    # second, element-wise launch), from the product rounded to the dtype as that launch read it; batched, on both
    # streamed paths (one contraction tile; a long contraction into a narrow output)
    torch.manual_seed(0)
    batched = shape != "2d"
    sa, sb = {"2d": ((200, 300), (600, 300)), "batched short K": ((3, 200, 64), (3, 260, 64)),
              "batched narrow": ((3, 300, 260), (3, 260, 70))}[shape]
    given_t = shape != "batched narrow"            # B as [N, K]: a transposed operand, read as it lies
    a, bt = torch.randn(sa).to(dtype), torch.randn(sb).to(dtype)
    b = bt.transpose(-1, -2) if given_t else bt
    c = torch.randn(a.shape[:-1] + b.shape[-1:]).to(dtype)
    alpha, beta = 0.75, -1.5
    op = torch.baddbmm if batched else torch.addmm
    an, bn, cn = to_n(a), to_n(bt).transpose(-1, -2) if given_t else to_n(bt), to_n(c)
    out = torch.empty(c.shape, dtype=dtype, device="neuron")
    for call in (lambda: op(cn, an, bn, beta=beta, alpha=alpha), lambda: op(cn, an, bn, beta=beta, alpha=alpha, out=out)):
        res, names = _launches(call)
        assert names == ["addmm_kernel"]
        prod, mag = a.double() @ b.double(), a.double().abs() @ b.double().abs()
        eps = torch.finfo(dtype).eps
        prod_err = 4 * a.shape[-1] ** 0.5 * EPS32 * mag + eps * prod.abs()     # fp32 sums, rounded to the dtype
        ref = beta * c.double() + alpha * prod
        tol = abs(alpha) * prod_err + EPS32 * (abs(alpha) * prod.abs() + abs(beta) * c.double().abs()) \
            + eps * ref.abs()
        err = (res.cpu().double() - ref).abs()
        assert res.dtype == dtype and bool((err <= tol).all()), f"exceeds the bound by {float((err - tol).max()):.3g}"
    assert out.data_ptr() == res.data_ptr()


def test_scaled_sum_keeps_its_second_launch_where_the_input_broadcasts_or_beta_is_zero(strict):
    a, b = torch.randn(130, 70), torch.randn(70, 140)
    c = torch.full((130, 140), float("nan"))
    res, names = _launches(lambda: torch.addmm(to_n(c), to_n(a), to_n(b), beta=0, alpha=2))
    assert "addmm_kernel" not in names and not bool(res.cpu().isnan().any())   # beta == 0 ignores NaN input
    col = torch.randn(130, 1)
    res, names = _launches(lambda: torch.addmm(to_n(col), to_n(a), to_n(b), beta=0.5, alpha=2))
    torch.testing.assert_close(res.cpu(), torch.addmm(col, a, b, beta=0.5, alpha=2), rtol=1e-5, atol=1e-4)


def test_repeated_products_replay_the_plan_of_their_own_operands(strict, monkeypatch):
    # an mm keeps a plan per operand signature (device, shape, strides, dtype): operands of the same shapes in
    # other layouts (transposed, strided, bf16) called between repeats each get their own program's result, bit for
    # bit the unplanned path's, one launch each (a strided operand made dense first: its copy and the product); the
    # repeats replay the first call's; bad operands still raise PyTorch's errors and leave the plans as they were
    import torchneuron.ops.matmul as matmul
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(48, 40, generator=g), torch.randn(40, 24, generator=g)
    calls = {"plain": lambda: (to_n(a), to_n(b)),
             "a_t": lambda: (to_n(a.t().contiguous()).t(), to_n(b)),
             "b_t": lambda: (to_n(a), to_n(b.t().contiguous()).t()),
             "strided": lambda: (to_n(torch.cat([a, a], 1))[:, ::2], to_n(b)),
             "bf16": lambda: (to_n(a).bfloat16(), to_n(b).bfloat16())}
    monkeypatch.setattr(matmul, "_MM_PLANS", matmul.PlanCache())
    want = {}
    for name, make in calls.items():        # the unplanned path: a destination given (into=) takes no plan
        x, y = make()
        want[name] = torch.mm(x, y, out=torch.empty(48, 24, dtype=x.dtype, device="neuron")).cpu()
    for _ in range(2):
        for name, make in calls.items():
            x, y = make()
            got, names = _launches(lambda: torch.mm(x, y))
            assert torch.equal(got.cpu(), want[name]), name
            assert names == (["strided_copy", "matmul_kernel"] if name == "strided" else ["matmul_kernel"]), names
    assert len(matmul._MM_PLANS.keys()) == 4   # (the strided operand's product takes no plan)
    kept = matmul._MM_PLANS.keys()
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(to_n(a), to_n(a))
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.mm(to_n(a), to_n(b).bfloat16())
    assert matmul._MM_PLANS.keys() == kept


def test_repeated_linear_products_replay_the_plan_of_their_own_operands(strict, monkeypatch):
    # addmm with linear's bias row keeps a plan per signature (operands, input, beta, alpha): transposed and bf16
    # operands, a strided bias and scaled terms interleaved with repeats each give the unplanned path's bits (its
    # launches: the bias in the matmul launch, or its own element-wise launch when scaled); bad inputs still raise
    import torchneuron.ops.matmul as matmul
    g = torch.Generator().manual_seed(12)
    x, w, bias = torch.randn(48, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    calls = {"linear": lambda: (to_n(bias), to_n(x), to_n(w).t(), {}),
             "x_t": lambda: (to_n(bias), to_n(x.t().contiguous()).t(), to_n(w).t(), {}),
             "bf16": lambda: (to_n(bias).bfloat16(), to_n(x).bfloat16(), to_n(w).bfloat16().t(), {}),
             "strided bias": lambda: (to_n(torch.stack([bias, bias], 1))[:, 0], to_n(x), to_n(w).t(), {}),
             "scaled": lambda: (to_n(bias), to_n(x), to_n(w).t(), {"beta": 0.5, "alpha": 2.0})}
    monkeypatch.setattr(matmul, "_BIAS_PLANS", matmul.PlanCache())
    want = {}
    for name, make in calls.items():        # the unplanned path: a destination given (into=) takes no plan
        inp, a, b, kw = make()
        want[name] = torch.addmm(inp, a, b, **kw, out=torch.empty(48, 24, dtype=a.dtype, device="neuron")).cpu()
    for _ in range(2):
        for name, make in calls.items():
            inp, a, b, kw = make()
            got, names = _launches(lambda: torch.addmm(inp, a, b, **kw))
            assert torch.equal(got.cpu(), want[name]), name
            assert names == {"strided bias": ["strided_copy", "matmul_kernel"],
                             "scaled": ["matmul_kernel", "elementwise4"]}.get(name, ["matmul_kernel"]), names
    assert len(matmul._BIAS_PLANS.keys()) == 3   # (the strided bias and the scaled terms take no plan)
    _check(torch.addmm(to_n(bias), to_n(x), to_n(w).t()), x, w.t(), bias)
    kept = matmul._BIAS_PLANS.keys()
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.addmm(to_n(bias), to_n(x), to_n(w))
    with pytest.raises(RuntimeError):
        torch.addmm(to_n(torch.randn(5)), to_n(x), to_n(w).t())
    assert matmul._BIAS_PLANS.keys() == kept
