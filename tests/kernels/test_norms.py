import pytest
import torch
import torch.nn.functional as F

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels import (layer_norm, layer_norm_backward, layer_norm_bwd_kernel, layer_norm_kernel, norms,
                                 rms_norm, rms_norm_backward)
from torchneuron.kernels.matmul import Epilogue, Then, matmul_kernel
from tests.kernels.conftest import DTYPES, close

SHAPES = [(1, 1), (127, 129), (300, 513), (2, 3, 300), (1030, 64)]   # (1030, 64): 8 rows per partition + a tail
LONG = [(3, 5003), (130, 1801)]   # rows beyond the single pass (forward > ~4700, backward > ~1700)


def _inputs(shape, dtype):
    D = shape[-1]
    return ((torch.randn(shape) * 2 + 1).to(dtype), torch.randn(D).to(dtype), torch.randn(D).to(dtype),
            torch.randn(shape).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + LONG)
def test_forward(shape, dtype):
    x, w, b, _ = _inputs(shape, dtype)
    D = shape[-1]
    close(layer_norm(x, w, b), F.layer_norm(x.float(), (D,), w.float(), b.float()), dtype, scale=2.0)
    close(rms_norm(x, w), F.rms_norm(x.float(), (D,), w.float(), 1e-6), dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + LONG)
def test_backward(shape, dtype):
    x, w, b, dy = _inputs(shape, dtype)
    D = shape[-1]
    xr, wr, br = (t.float().requires_grad_() for t in (x, w, b))
    F.layer_norm(xr, (D,), wr, br).backward(dy.float())
    dx, dw, db = layer_norm_backward(dy, x, w)
    rows = x.numel() // D   # weight grads sum over rows: scale the tolerance with the row count
    close(dx, xr.grad, dtype, scale=2.0)
    close(dw, wr.grad, dtype, scale=max(2.0, rows / 50))
    close(db, br.grad, dtype, scale=max(2.0, rows / 50))
    xr.grad = wr.grad = None
    F.rms_norm(xr, (D,), wr, 1e-6).backward(dy.float())
    dx, dw = rms_norm_backward(dy, x, w)
    close(dx, xr.grad, dtype, scale=2.0)
    close(dw, wr.grad, dtype, scale=max(2.0, rows / 50))


def test_long_rows_over_several_super_blocks(monkeypatch):
    # super-blocks of one row block: per-row scalars per super-block, dw/db added across super-blocks
    import importlib
    nm = importlib.import_module("torchneuron.kernels.norms")
    monkeypatch.setattr(nm, "SB", 1)
    shape, D = (300, 1803), 1803
    x, w, b, dy = _inputs(shape, torch.float32)
    x = x + 100.0                        # a large mean: the variance must not cancel
    xr, wr, br = (t.requires_grad_() for t in (x.clone(), w.clone(), b.clone()))
    F.layer_norm(xr, (D,), wr, br).backward(dy)
    dx, dw, db = layer_norm_backward(dy, x, w)
    close(dx, xr.grad, torch.float32, scale=20.0)
    close(dw, wr.grad, torch.float32, scale=20.0)
    close(db, br.grad, torch.float32, scale=20.0)
    x2 = torch.randn(257, 4900) + 100.0
    w2, b2 = torch.randn(4900), torch.randn(4900)
    close(layer_norm(x2, w2, b2), F.layer_norm(x2, (4900,), w2, b2), torch.float32, scale=10.0)


@pytest.mark.parametrize("shape", [(130, 300), (129, 5003)])
def test_forward_returns_row_statistics(shape):
    # stats=True: (out, mean, rstd) as (N, 1) fp32, the values native_layer_norm saves for the backward
    from torchneuron.kernels import layer_norm_kernel
    x, w, b, _ = _inputs(shape, torch.float32)
    out, mean, rstd = layer_norm_kernel(x, w, b, eps=1e-5, stats=True)
    want = torch.native_layer_norm(x, [shape[-1]], w, b, 1e-5)
    for got, ref in zip((out, mean, rstd), want):
        assert got.shape == ref.shape and got.dtype == torch.float32
        close(got, ref, torch.float32, scale=2.0)
    # RMS norm: (out, rstd), as _fused_rms_norm returns them; the backward from that rstd equals recomputing
    from torchneuron.kernels import layer_norm_bwd_kernel
    out, rstd = layer_norm_kernel(x, w, b, eps=1e-5, rms=True, stats=True)
    want_out, want_rstd = torch.ops.aten._fused_rms_norm(x, [shape[-1]], w, 1e-5)
    close(out, want_out, torch.float32, scale=2.0)
    assert rstd.shape == want_rstd.reshape(-1, 1).shape
    close(rstd, want_rstd.reshape(-1, 1), torch.float32, scale=2.0)
    dy = torch.randn(shape)
    saved = layer_norm_bwd_kernel(dy, x, w, rms=True, rstd=rstd)
    for got, ref in zip(saved[:2], layer_norm_bwd_kernel(dy, x, w, eps=1e-5, rms=True)[:2]):
        close(got, ref, torch.float32, scale=2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_round_once(dtype):
    # 2-byte inputs stay 2-byte in SBUF; every result is the fp32 computation rounded once to the dtype: within
    # one ulp (2u relative) of the rounded fp32 reference, plus the fp32 computations' own difference (a few
    # roundings of terms up to ~10, ~1e-5) where a result cancels towards 0
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    x, w, b, _ = _inputs((260, 1536), dtype)
    ref = F.layer_norm(x.float(), (1536,), w.float(), b.float()).to(dtype)
    got = layer_norm(x, w, b)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-5, rtol=2 * u)
    ref = F.rms_norm(x.float(), (1536,), w.float(), 1e-6).to(dtype)
    torch.testing.assert_close(rms_norm(x, w).float(), ref.float(), atol=1e-5, rtol=2 * u)


@pytest.mark.parametrize("chip", ["trn1", "trn2"])
@pytest.mark.parametrize("saved", [False, True])
def test_backward_of_1024_wide_rows_fits_every_chip(chip, saved):
    """Rows of 1024: two per partition would overflow trn1's 192 KiB of SBUF, so the kernel takes one row per
    partition there; both chips match float64 within fp32 rounding of the row sums (dx) and column sums (dw)."""
    from torchneuron import nki
    from torchneuron.kernels.norms import layer_norm_bwd_kernel
    N, D = 384, 1024
    x, dy, w = torch.randn(N, D), torch.randn(N, D), torch.randn(D)
    stats = dict(mean=x.mean(1, keepdim=True), rstd=(x.var(1, unbiased=False, keepdim=True) + 1e-5).rsqrt())
    dx, dw, db = nki.profile(layer_norm_bwd_kernel, chip)(dy, x, w, **(stats if saved else {})).outputs
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, torch.zeros(D)))
    F.layer_norm(xr, (D,), wr, br, eps=1e-5).backward(dy.double())
    u = 2.0**-24
    for got, want, n in ((dx, xr.grad, D), (dw.flatten(), wr.grad, N), (db.flatten(), br.grad, N)):
        assert (got.double() - want).abs().max() <= 8 * n * u * want.abs().max()


@pytest.mark.parametrize("N,D", [(512, 2048), (1030, 768)])
def test_forward_statistics_keep_a_large_mean_in_every_row_block(N, D):
    """Row blocks alternate between VectorE (bn_stats) and ScalarE (the mean, then squared deviations from it)
    statistics; short rows (D = 768: two per partition, then a tail of one) take bn_stats per row. Rows of mean
    1000 and spread 1: a sum of x^2 minus the squared mean would lose the variance to cancellation (fp32 sums of
    ~1e6 carry errors ~sqrt(D) * 2**-24 * 1e6 ~ 3, against a variance of 1); the two-pass forms keep rstd within
    2 D 2**-24 plus the squared error of the mean (D 2**-24 * 1000)**2 / var."""
    from torchneuron.kernels import layer_norm_kernel
    x, w, b = torch.randn(N, D) + 1000.0, torch.randn(D), torch.randn(D)
    out, mean, rstd = layer_norm_kernel(x, w, b, eps=1e-5, stats=True)
    ref_out, ref_mean, ref_rstd = torch.native_layer_norm(x.double(), [D], w.double(), b.double(), 1e-5)
    e = 2.0 ** -24
    rel = 2 * D * e + (D * e * 1000.0) ** 2
    assert ((rstd.double() - ref_rstd).abs() <= rel * ref_rstd).all()
    assert ((mean.double() - ref_mean).abs() <= D * e * 1000.0).all()
    # out = (x - mean) * rstd * w + b: the mean's error over the spread, rstd's relative error, times |w|, plus b
    bound = (D * e * 1000.0 * ref_rstd + rel * (x.double() - ref_mean).abs() * ref_rstd) * w.double().abs() \
        + 8 * e * (ref_out.abs() + b.double().abs() + 1)
    assert ((out.double() - ref_out).abs() <= bound).all()


@pytest.mark.parametrize("N,D", [(1024, 64), (8192, 64), (300, 100), (128, 1024), (5, 64)])
def test_row_blocks_leave_several_blocks_in_flight(N, D):
    # the grouped norms' blocks: every row exactly once, G rows per partition within ROW_ELEMS, and at least
    # PIPELINE_BLOCKS full blocks wherever N has rows for them (one block would serialize DMA and the engines)
    from torchneuron.kernels._common import ROW_ELEMS, row_blocks
    from torchneuron.kernels.norms import PIPELINE_BLOCKS
    blocks, G = row_blocks(N, D, PIPELINE_BLOCKS)
    rows = [r for r0, p, g in blocks for r in range(r0, r0 + p * g)]
    assert rows == list(range(N)) and G * D <= max(D, ROW_ELEMS)
    full = sum(1 for _, p, g in blocks if g == G and p == 128)
    assert full >= min(PIPELINE_BLOCKS, N // 128)


def _add_tiles(x, r):
    """An epilogue's tile function: the product plus r, in fp32."""
    y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y, data1=x, data2=r, op=nl.add)
    return y


@nki.jit
def _norm_then(x, w, b, b2, bias2=None, r2=None, transpose_b2=False, rms=False):
    """layer_norm_kernel's (out, statistics..., out @ B2 + bias2 [+ r2]) with the product chained."""
    second = None if r2 is None else Epilogue(_add_tiles, (r2,), r2.dtype)
    return layer_norm_kernel(x, w, b, eps=1e-5, rms=rms, stats=True, then=Then(b2, transpose_b2, bias2, second))


def _assert_chained_as_two_kernels(got, chained, want, b2, bias2, r2, transpose_b2) -> None:
    """The chained kernel's results ``got`` + [``chained``] equal the norm kernel's ``want`` and the matmul kernel's
    over want[0] (B2, its bias, r2 added by its epilogue) bit for bit; row 3 of the input had an inf (a NaN row)."""
    if r2 is None:
        want_chained = matmul_kernel(want[0], b2, transpose_b=transpose_b2, bias=bias2)
    else:
        want_chained = _matmul_plus(want[0], b2, r2, bias=bias2, transpose_b=transpose_b2)
    for g, w_ in zip(got + [chained], want + [torch.as_tensor(want_chained)]):
        torch.testing.assert_close(g, w_, rtol=0, atol=0, equal_nan=True)
    assert chained[3].isnan().all() and not chained[8].isnan().any()


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("transpose_b2", [False, True])
@pytest.mark.parametrize("second", ["mm", "addmm", "addmm+epilogue"])
@pytest.mark.parametrize("nd2", [(1024, 64, 192), (256, 96, 200), (2048, 32, 100)])   # 2, 1 and 4 rows a partition
def test_chained_product_equals_the_norm_then_the_matmul(nd2, second, transpose_b2, rms):
    # the output's [128, G, D] blocks go on from SBUF into out @ B2 (+ its bias, its own epilogue): the norm's
    # results and the product equal the norm kernel's and then the matmul kernel's over the stored output, bit for
    # bit, infinities and NaNs in a row too
    N, D, N2 = nd2
    x, w, b, _ = _inputs((N, D), torch.float32)
    x[3, 5], x[7, 0] = float("inf"), float("nan")
    b2 = torch.randn((N2, D) if transpose_b2 else (D, N2))
    bias2 = torch.randn(1, N2) if second != "mm" else None
    r2 = torch.randn(N, N2) if second == "addmm+epilogue" else None
    *got, chained = (torch.as_tensor(t) for t in _norm_then(x, w, b, b2, bias2, r2, transpose_b2=transpose_b2,
                                                            rms=rms))
    want = [torch.as_tensor(t) for t in layer_norm_kernel(x, w, b, eps=1e-5, rms=rms, stats=True)]
    _assert_chained_as_two_kernels(got, chained, want, b2, bias2, r2, transpose_b2)


@nki.jit
def _matmul_plus(a, b, r, bias=None, transpose_b=False):
    return matmul_kernel(a, b, transpose_b=transpose_b, bias=bias, epilogue=Epilogue(_add_tiles, (r,), r.dtype))


def test_norm_chains_a_product_only_in_whole_grouped_blocks():
    f32 = torch.float32
    assert norms.chains_product(1024, 64, 192, 0, f32, f32)
    assert not norms.chains_product(1000, 64, 192, 0, f32, f32)           # a partial block
    assert not norms.chains_product(1024, 64, 192, 0, torch.bfloat16, f32)  # the output rounded by its store
    assert not norms.chains_product(1024, 2048, 64, 0, f32, f32)          # one row a partition (not grouped)
    assert not norms.chains_product(4096, 32, 64, 0, f32, f32)            # 8 rows a partition: 1024 columns
    x, w, b, _ = _inputs((1000, 64), f32)
    with pytest.raises(AssertionError, match="no chained product"):
        _norm_then(x, w, b, torch.randn(64, 32))


@pytest.mark.parametrize("D", [96, 1100])   # grouped rows; one row a partition
def test_rms_backward_accumulates_no_bias_gradient(D, monkeypatch):
    # RMS norm has no bias: its backward keeps dw's column sums alone in PSUM and returns a db of +0.0; layer norm
    # keeps both (its dw and db as the CPU's within the fp32 sums' bound: test_backward)
    accumulators = []
    col_sums = norms._col_sums
    monkeypatch.setattr(norms, "_col_sums", lambda *a: accumulators.append(col_sums(*a)) or accumulators[-1])
    x, w, _, dy = _inputs((260, D), torch.float32)
    *_, db = layer_norm_bwd_kernel(dy, x, w, rms=True)
    db = torch.as_tensor(db)
    assert torch.equal(db, torch.zeros(1, D)) and not db.signbit().any()
    layer_norm_bwd_kernel(dy, x, w)
    assert [sorted(acc) for acc in accumulators] == [["dw"], ["db", "dw"]]


@nki.jit
def _norm_bwd_then(dy, x, w, mean, rstd, b2, r=None, bias2=None, r2=None, transpose_b2=False):
    """layer_norm_bwd_kernel's (dx [+ r], dw, db, that @ B2 + bias2 [+ r2]) with the product chained."""
    first = None if r is None else Epilogue(_add_tiles, (r,), r.dtype)
    second = None if r2 is None else Epilogue(_add_tiles, (r2,), r2.dtype)
    return layer_norm_bwd_kernel(dy, x, w, mean=mean, rstd=rstd, epilogue=first,
                                 then=Then(b2, transpose_b2, bias2, second))


@nki.jit
def _norm_bwd_plus(dy, x, w, mean, rstd, r):
    return layer_norm_bwd_kernel(dy, x, w, mean=mean, rstd=rstd, epilogue=Epilogue(_add_tiles, (r,), r.dtype))


@pytest.mark.parametrize("transpose_b2", [False, True])
@pytest.mark.parametrize("second", ["mm", "addmm+epilogue"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("nd2", [(1024, 64, 64), (256, 96, 200), (2048, 32, 100)])   # 2, 1 and 4 rows a partition
def test_backward_chained_product_equals_the_backward_then_the_matmul(nd2, residual, second, transpose_b2):
    # dx (through its epilogue, the residual add) goes on from SBUF into dx @ B2 (+ bias, its own epilogue): every
    # result equals the backward kernel's and then the matmul kernel's over the stored dx, bit for bit, inf/NaN too
    N, D, N2 = nd2
    x, w, b, dy = _inputs((N, D), torch.float32)
    _, mean, rstd = (torch.as_tensor(t) for t in layer_norm_kernel(x, w, b, eps=1e-5, stats=True))
    dy[3, 5], dy[7, 0] = float("inf"), float("nan")
    r = torch.randn(N, D) if residual else None
    b2 = torch.randn((N2, D) if transpose_b2 else (D, N2))
    bias2, r2 = (torch.randn(1, N2), torch.randn(N, N2)) if second != "mm" else (None, None)
    *got, chained = (torch.as_tensor(t) for t in _norm_bwd_then(dy, x, w, mean, rstd, b2, r, bias2, r2,
                                                                transpose_b2=transpose_b2))
    want = [torch.as_tensor(t) for t in (_norm_bwd_plus(dy, x, w, mean, rstd, r) if residual else
                                         layer_norm_bwd_kernel(dy, x, w, mean=mean, rstd=rstd))]
    _assert_chained_as_two_kernels(got, chained, want, b2, bias2, r2, transpose_b2)


def test_backward_chains_a_product_only_in_whole_grouped_blocks():
    f32 = torch.float32
    assert norms.bwd_chains_product(1024, 64, 64, 1, 0, f32, f32, f32)
    assert not norms.bwd_chains_product(1000, 64, 64, 1, 0, f32, f32, f32)           # a partial block
    assert not norms.bwd_chains_product(1024, 64, 64, 1, 0, f32, torch.bfloat16, f32)  # dx rounded by its store
    assert not norms.bwd_chains_product(1024, 1500, 64, None, 0, f32, f32, f32)      # one row a partition
    x, w, _, dy = _inputs((1000, 64), f32)
    with pytest.raises(AssertionError, match="no chained product"):
        layer_norm_bwd_kernel(dy, x, w, then=Then(torch.randn(64, 32)))
    with pytest.raises(AssertionError, match="follows layer norm's dx only"):
        layer_norm_bwd_kernel(dy[:1024], x[:1024], w, rms=True, then=Then(torch.randn(64, 32)))
