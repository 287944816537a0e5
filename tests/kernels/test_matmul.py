import pytest
import torch

from torchneuron import nki
from torchneuron.kernels import matmul
from torchneuron import runtime
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels.matmul import (MAX_K_PASSES, Epilogue, Then, addmm_kernel, bmm_group_size, bmm_kernel,
                                         chains_product, epilogue_reserve, fuses_row_sums, matmul_kernel,
                                         max_contraction, panel_width)
from tests.kernels.conftest import DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (127, 129, 300), (129, 300, 513), (128, 128, 512)])
def test_matmul_matches_torch(mkn, transpose_a, dtype):
    M, K, N = mkn
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    out = matmul(a.T.contiguous() if transpose_a else a, b, transpose_a=transpose_a)
    assert out.dtype == dtype and out.shape == (M, N)
    close(out, (a.float() @ b.float()), dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_matmul_contraction_beyond_one_pass_sums_k_chunks_in_fp32(transpose_a, transpose_b, dtype):
    # past the longest contraction one pass keeps in SBUF (a partial last K tile, ragged M and N), the K chunks'
    # partial sums are kept in fp32 in the same launch: the bound is that of one fp32 accumulation
    isz = torch.tensor([], dtype=dtype).element_size()
    budget = runtime.core(0).spec.sbuf_bytes_per_partition
    K = max_contraction(isz, transpose_a, transpose_b, budget) + 300
    M, N = 130, 515
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    out = matmul_kernel(a.T.contiguous() if transpose_a else a, b.T.contiguous() if transpose_b else b,
                        transpose_a=transpose_a, transpose_b=transpose_b)
    assert out.dtype == dtype and out.shape == (M, N)
    _accumulation_close(out, a, b, dtype)


def test_matmul_mismatched_k():
    with pytest.raises(AssertionError, match="contraction"):
        matmul(torch.zeros(4, 5), torch.zeros(6, 4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("mkn", [(300, 1100, 1700), (384, 256, 3100), (129, 40, 1537)])
def test_matmul_several_panels_and_strips(mkn, transpose_a, dtype):
    # several N panels and M strips (with partial K/M/N tiles): with A as [M, K] the first panel
    # transposes each strip (pipelined) and stores it to an HBM scratch that later panels read
    M, K, N = mkn
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    out = matmul(a.T.contiguous() if transpose_a else a, b, transpose_a=transpose_a)
    assert out.dtype == dtype and out.shape == (M, N)
    close(out, (a.float() @ b.float()), dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (127, 129, 300), (129, 300, 513), (513, 127, 129),
                                 (300, 513, 1), (1, 300, 513), (300, 1100, 1700)])
def test_matmul_transpose_b_matches_torch(mkn, transpose_a, dtype):
    # B given as [N, K] (A @ B.T): each B panel is built by TensorE transposes of [128, K] row blocks
    M, K, N = mkn
    a, b = torch.randn(M, K).to(dtype), torch.randn(N, K).to(dtype)
    out = matmul(a.T.contiguous() if transpose_a else a, b, transpose_a=transpose_a, transpose_b=True)
    assert out.dtype == dtype and out.shape == (M, N)
    close(out, (a.float() @ b.float().T), dtype, scale=2.0)


def test_matmul_transpose_b_mismatched_k():
    with pytest.raises(AssertionError, match="contraction"):
        matmul(torch.zeros(4, 5), torch.zeros(4, 6), transpose_b=True)


def _bmm_operands(B, M, K, N, transpose_a, transpose_b, dtype):
    """Random batched operands in the stored layouts the kernel reads, and the fp32 reference product."""
    a, b = torch.randn(B, M, K).to(dtype), torch.randn(B, K, N).to(dtype)
    ref = a.float() @ b.float()
    a_in = a.transpose(1, 2).contiguous() if transpose_a else a
    b_in = b.transpose(1, 2).contiguous() if transpose_b else b
    return a_in, b_in, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("bmkn", [(64, 64, 16, 64), (64, 16, 64, 64), (13, 65, 100, 1), (5, 1, 1, 1),
                                  (3, 128, 128, 512), (11, 100, 65, 130)])
def test_bmm_small_matrices_grouped(bmkn, transpose_a, transpose_b, dtype):
    # each entry fits one TensorE tile: groups of entries share loads, one PSUM bank, one eviction and
    # one store; the batch need not divide into whole groups and rows need not fill 128-row chunks
    a, b, ref = _bmm_operands(*bmkn, transpose_a, transpose_b, dtype)
    out = bmm_kernel(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    assert out.dtype == dtype and out.shape == ref.shape
    close(out, ref, dtype, scale=2.0)


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_bmm_small_matrices_fp16(transpose_a, transpose_b):
    # fp16 transposes pack 1024 columns per PSUM bank, like bf16
    a, b, ref = _bmm_operands(13, 65, 100, 7, transpose_a, transpose_b, torch.float16)
    out = bmm_kernel(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    assert out.dtype == torch.float16
    close(out, ref, torch.bfloat16, scale=2.0)


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_bmm_large_matrices_per_entry(transpose_a, transpose_b):
    # M above one TensorE tile: each entry takes the tiled matmul loop nest
    a, b, ref = _bmm_operands(2, 129, 20, 30, transpose_a, transpose_b, torch.float32)
    close(bmm_kernel(a, b, transpose_a=transpose_a, transpose_b=transpose_b), ref, torch.float32, scale=2.0)


def _bmm_accumulation_close(out, a, b, dtype):
    """``out`` [B, M, N] against the float64 product of the same operands (as [B, M, K] @ [B, K, N]): fp32
    accumulation over K (4 sqrt(K) eps32 of the summed magnitudes) plus one rounding to ``dtype``."""
    ref = a.double() @ b.double()
    mag = a.double().abs() @ b.double().abs()
    tol = 4 * a.shape[-1] ** 0.5 * torch.finfo(torch.float32).eps * mag + torch.finfo(dtype).eps * ref.abs()
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.double() - ref).abs()
    assert bool((err <= tol + 1e-30).all()), f"max error {float((err - tol).max()):.3g} beyond the bound"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("bmkn", [
    (2, 1030, 64, 700),     # one contraction tile (K = 64, half the PE rows): row groups of r rows per partition,
    (1, 300, 128, 513),     # a ragged last group (fewer than 128 rows, one per partition), N past one PSUM bank
    (3, 260, 300, 64),      # a long contraction into a narrow output: K = 2 whole tiles + 44 rows
    (2, 700, 1030, 100),    # ... several row groups, N not dividing a PSUM bank
    (1, 130, 129, 512),     # ... K one row past a tile, N one whole bank
])
def test_bmm_streamed_paths(bmkn, transpose_a, transpose_b, dtype):
    # attention-shaped entries (K <= 128, or N <= 512 with B as [K, N]) are streamed: rows staged r per partition,
    # the contraction split over partitions as q * KT + t; B as [N, K] with a long K keeps the per-entry loop nest
    B, M, K, N = bmkn
    a, b = torch.randn(B, M, K).to(dtype), torch.randn(B, K, N).to(dtype)
    out = bmm_kernel(a.transpose(1, 2).contiguous() if transpose_a else a,
                     b.transpose(1, 2).contiguous() if transpose_b else b,
                     transpose_a=transpose_a, transpose_b=transpose_b)
    _bmm_accumulation_close(out, a, b, dtype)


@pytest.mark.parametrize("transpose_a", [False, True])
def test_bmm_streamed_entries_stay_independent(transpose_a):
    # the streamed paths share staging tiles across row groups and entries but no contraction: inf/NaN in one
    # entry's operand reach only the outputs that contract with it
    a, b = torch.randn(2, 300, 260), torch.randn(2, 260, 64)
    a[0, 5, 7] = float("inf")
    b[1, 200, 3] = float("nan")
    out = bmm_kernel(a.transpose(1, 2).contiguous() if transpose_a else a, b, transpose_a=transpose_a)
    ref = a @ b
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isinf(out), torch.isinf(ref))
    # the finite outputs contract only finite operands: the fp32 bound of those (non-finite ones zeroed)
    fin = torch.isfinite(ref)
    _bmm_accumulation_close(torch.where(fin, out, 0), torch.where(torch.isfinite(a), a, 0) * fin.any(-1, keepdim=True),
                            torch.where(torch.isfinite(b), b, 0) * fin.any(-2, keepdim=True), torch.float32)


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("bmkn", [(64, 64, 16, 64), (64, 64, 64, 16), (64, 16, 64, 64)])
def test_bmm_small_matrices_instruction_count(bmkn, transpose_a, transpose_b):
    # the grouped path: per group of G entries G matmuls, one load per operand in its K-major layout
    # (else one load, one TensorE transpose per 128 rows and one eviction), one eviction, one store
    B, M, K, N = bmkn
    G = bmm_group_size(M, N, 4, transpose_a, transpose_b)
    groups = -(-B // G)
    load_a = 1 if transpose_a else 2 + -(-G * M // 128)
    load_b = 1 if not transpose_b else 2 + -(-G * N // 128)
    a, b, ref = _bmm_operands(B, M, K, N, transpose_a, transpose_b, torch.float32)
    report = nki.profile(bmm_kernel)(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    assert report.instructions <= groups * (G + load_a + load_b + 2) < 3 * B
    close(report.outputs, ref, torch.float32, scale=2.0)


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_bmm_grouped_entries_stay_independent(transpose_a, transpose_b):
    # a group shares tiles and TensorE transposes but no contraction: inf/NaN in one entry stay in it
    a, b, _ = _bmm_operands(9, 64, 16, 64, transpose_a, transpose_b, torch.float32)
    a[3].fill_(float("inf"))
    b[5].view(-1)[7] = float("nan")
    ref = (a.transpose(1, 2) if transpose_a else a) @ (b.transpose(1, 2) if transpose_b else b)
    out = bmm_kernel(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    torch.testing.assert_close(out, ref, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("mkn", [(1024, 64, 192), (1030, 65, 64), (129, 1, 512), (2050, 128, 1), (5, 3, 7),
                                 (1030, 256, 64), (300, 512, 100), (129, 200, 512)])
def test_matmul_grouped_row_chunks(mkn, transpose_a, transpose_b, dtype):
    # K <= 512, N <= 512: B loaded once, A's 128-row chunks in groups (one load, one transpose eviction
    # per K tile, one output eviction and store per group); partial K tiles, chunks and groups
    M, K, N = mkn
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    report = nki.profile(matmul_kernel)(
        a.T.contiguous() if transpose_a else a, b.T.contiguous() if transpose_b else b,
        transpose_a=transpose_a, transpose_b=transpose_b)
    close(report.outputs, a.float() @ b.float(), dtype, scale=2.0)
    chunks, kt = -(-M // 128), -(-K // 128)
    per_chunk = kt if transpose_a else 2 * kt    # the matmuls (+ their transposes)
    assert report.instructions <= chunks * per_chunk + (4 + 2 * kt) * chunks + 4 * kt + 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn,transpose_b", [((1030, 64, 192), True), ((300, 256, 64), False), ((5, 3, 1), True),
                                             ((130, 600, 1100), False), ((4, 600, 3), True), ((129, 700, 520), True)])
def test_matmul_adds_a_bias_row_at_the_eviction(mkn, transpose_b, dtype):
    # the grouped path (K, N <= 512) and the tiled one (several panels, each with its own bias row)
    M, K, N = mkn
    a, b, bias = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype), torch.randn(1, N).to(dtype)
    report = nki.profile(matmul_kernel)(a, b.T.contiguous() if transpose_b else b, transpose_b=transpose_b, bias=bias)
    close(report.outputs, torch.addmm(bias.float(), a.float(), b.float()), dtype, scale=2.0)


def _accumulation_close(out, a, b, dtype):
    """``out`` against the float64 product of the same (rounded) operands: fp32 PSUM accumulation over K
    (a random-walk bound, 4 sqrt(K) eps32 of the magnitudes summed) plus one rounding to ``dtype``."""
    ref = a.double() @ b.double()
    mag = a.double().abs() @ b.double().abs()
    K = a.shape[1]
    tol = 4 * K ** 0.5 * torch.finfo(torch.float32).eps * mag + torch.finfo(dtype).eps * ref.abs()
    err = (out.double() - ref).abs()
    assert bool((err <= tol + 1e-30).all()), f"max error {float((err - tol).max()):.3g} beyond the bound"


SPEC = runtime.core(0).spec


# a weight gradient dY^T @ X: K = tokens (partial last K tile), M = dY's columns (a partial strip), N = X's
# columns (N > 512 with K <= 512: one pass of the loop nest, not the grouped path)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", [(256, 1024, 64), (64, 1000, 257), (130, 300, 600)])
def test_matmul_row_sums_are_a_column_of_the_same_product(mkn, dtype):
    M, K, N = mkn
    assert fuses_row_sums(M, K, N, dtype, True, False, SPEC)
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    a[0, 5], a[1, 7], a[2, 3], a[2, 9] = float("inf"), float("nan"), float("inf"), float("-inf")
    a[3] = -0.0   # a row of negative zeros sums to -0.0, as the CPU's sum does
    out, sums = matmul_kernel(a.T.contiguous(), b, transpose_a=True, row_sums=True)
    assert sums.dtype == dtype and sums.shape == (M,)
    # the product is the one the kernel computes without the column of ones, bit for bit
    torch.testing.assert_close(out, matmul_kernel(a.T.contiguous(), b, transpose_a=True), rtol=0, atol=0,
                               equal_nan=True)
    want = a.double().sum(1)
    assert torch.isposinf(sums[0]) and torch.isnan(sums[1]) and torch.isnan(sums[2])
    assert sums[3].item() == 0.0 and torch.signbit(sums[3]) == torch.signbit(a[3].sum())
    finite = torch.isfinite(want)
    _accumulation_close(sums[finite][:, None], a[finite], torch.ones(K, 1, dtype=dtype), dtype)


def test_row_sums_only_where_a_column_fits_beside_one_pass():
    # A as [M, K] or B as [N, K]: no column of ones to append; N a multiple of 512: no room in the last bank;
    # K <= 512 and N <= 512: the grouped path
    assert not fuses_row_sums(256, 1024, 64, torch.float32, False, False, SPEC)
    assert not fuses_row_sums(256, 1024, 64, torch.float32, True, True, SPEC)
    assert not fuses_row_sums(256, 1024, 512, torch.float32, True, False, SPEC)
    assert not fuses_row_sums(256, 300, 64, torch.float32, True, False, SPEC)
    with pytest.raises(AssertionError, match="row sums"):
        matmul_kernel(torch.zeros(300, 256), torch.zeros(300, 64), transpose_a=True, row_sums=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_matmul_long_contraction_narrow_panels(transpose_a, transpose_b, dtype):
    # a contraction so long that the B panel is narrower than one PSUM bank (or than 3-4 banks), so the
    # panels tile N in steps of 128 columns; one pass over K per output tile, no partial sums
    isz = torch.tensor([], dtype=dtype).element_size()
    budget = runtime.core(0).spec.sbuf_bytes_per_partition   # (the chip the kernel is traced for)
    K = min(max_contraction(isz, transpose_a, transpose_b, budget), 12800)
    M, N = 130, 700
    assert panel_width(K, N, isz, transpose_a, transpose_b, budget) < 1536
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    out = matmul_kernel(a.T.contiguous() if transpose_a else a, b.T.contiguous() if transpose_b else b,
                        transpose_a=transpose_a, transpose_b=transpose_b)
    assert out.dtype == dtype and out.shape == (M, N)
    _accumulation_close(out, a, b, dtype)


def test_panel_width_and_max_contraction_fit_sbuf():
    budget = runtime.core(0).spec.sbuf_bytes_per_partition
    for isz in (2, 4):
        for ta in (False, True):
            for tb in (False, True):
                k = max_contraction(isz, ta, tb, budget)
                assert panel_width(k, 4096, isz, ta, tb, budget) >= 128
                assert panel_width(k + 128, 4096, isz, ta, tb, budget) == 0
                assert panel_width(4096, 4096, isz, ta, tb, budget) % 128 == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", [(700, 600, 130), (300, 700, 256), (129, 1030, 1)])
def test_matmul_a_given_as_km_narrow_output_loads_several_strips_at_once(mkn, dtype):
    # A as [K, M] with N <= 256: up to 4 stationary strips per DMA (a partial last group, a partial K tile)
    M, K, N = mkn
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    out = matmul_kernel(a.T.contiguous(), b, transpose_a=True)
    assert out.dtype == dtype and out.shape == (M, N)
    _accumulation_close(out, a, b, dtype)


# (M, K, N), transpose_a, transpose_b, bias: the grouped path (K, N <= 512) and the tiled one, each layout
FOLD_CASES = [((300, 200, 100), False, False, False), ((768, 1024, 640), True, False, False),
              ((130, 1030, 600), False, True, True), ((1024, 768, 768), False, True, True),
              ((256, 64, 96), True, False, True),
              # A's rows as row blocks (each partition's rows of a group one run): groups of 4 and of 2 chunks
              ((1024, 64, 192), False, False, True), ((640, 96, 256), False, True, False)]


def _fold_operands(mkn, transpose_a, transpose_b, bias, dtype):
    """(A, B, the kernel's layout and bias arguments) of one FOLD_CASES case."""
    M, K, N = mkn
    a = torch.randn((K, M) if transpose_a else (M, K)).to(dtype)
    b = torch.randn((N, K) if transpose_b else (K, N)).to(dtype)
    return a, b, dict(transpose_a=transpose_a, transpose_b=transpose_b,
                      bias=torch.randn(1, N).to(dtype) if bias else None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mkn,transpose_a,transpose_b,bias", FOLD_CASES)
def test_matmul_widened_output_is_the_rounded_product_cast_exactly(mkn, transpose_a, transpose_b, bias, dtype):
    # out_dtype=float32: the grouped and the tiled path round the product to the operands' dtype at the
    # eviction, as without it, and the store widens exactly: equal to the narrow result cast to float32
    a, b, kw = _fold_operands(mkn, transpose_a, transpose_b, bias, dtype)
    narrow = torch.as_tensor(matmul_kernel(a, b, **kw))
    wide = torch.as_tensor(matmul_kernel(a, b, out_dtype=torch.float32, **kw))
    assert narrow.dtype == dtype and wide.dtype == torch.float32
    assert torch.equal(wide, narrow.float())


def test_matmul_widening_only_from_two_byte_operands_to_float32():
    a = torch.randn(8, 8)
    with pytest.raises(AssertionError, match="out_dtype widens 2-byte operands"):
        matmul_kernel(a, a, out_dtype=torch.float32)
    with pytest.raises(AssertionError, match="out_dtype widens 2-byte operands"):
        matmul_kernel(a.bfloat16(), a.bfloat16(), out_dtype=torch.float16)


def _add_tiles(x, r):
    """An epilogue's tile function: the product plus the residual, in fp32."""
    y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y, data1=x, data2=r, op=nl.add)
    return y


@nki.jit
def _matmul_plus(a, b, r, bias=None, transpose_a=False, transpose_b=False):
    return matmul_kernel(a, b, transpose_a=transpose_a, transpose_b=transpose_b, bias=bias,
                         epilogue=Epilogue(_add_tiles, (r,), r.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mkn,transpose_a,transpose_b,bias", FOLD_CASES)
def test_matmul_epilogue_equals_the_stored_product_then_the_pass(mkn, transpose_a, transpose_b, bias, dtype):
    # the grouped and the tiled path: each block is the product rounded as it would be stored, then the
    # epilogue's fp32 math, rounded once at the store, exactly what a separate element-wise pass computes
    a, b, kw = _fold_operands(mkn, transpose_a, transpose_b, bias, dtype)
    r = torch.randn(mkn[0], mkn[2]).to(dtype)
    product = torch.as_tensor(matmul_kernel(a, b, **kw))
    got = torch.as_tensor(_matmul_plus(a, b, r, **kw))
    assert got.dtype == dtype and torch.equal(got, (product.float() + r.float()).to(dtype))


@nki.jit
def _matmul_plus_kept(a, b, r, bias=None, transpose_a=False, transpose_b=False):
    return matmul_kernel(a, b, transpose_a=transpose_a, transpose_b=transpose_b, bias=bias,
                         epilogue=Epilogue(_add_tiles, (r,), r.dtype, keep_product=True))


def _k_chunked_case(dtype):
    """Operands whose contraction is past one pass (the K-chunked loop nest) with a ragged M and N."""
    isz = torch.tensor([], dtype=dtype).element_size()
    K = max_contraction(isz, False, False, runtime.core(0).spec.sbuf_bytes_per_partition) + 300
    return (130, K, 515), False, False, False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(FOLD_CASES) + 1))
def test_matmul_epilogue_keeping_the_product_stores_both(case, dtype):
    # a product the graph still needs (an activation's saved input): the kernel returns the epilogue's result
    # and the product, each exactly what the plain kernel and a separate pass store (every loop nest: grouped
    # rows, tiled, K chunks)
    mkn, transpose_a, transpose_b, bias = FOLD_CASES[case] if case < len(FOLD_CASES) else _k_chunked_case(dtype)
    a, b, kw = _fold_operands(mkn, transpose_a, transpose_b, bias, dtype)
    r = torch.randn(mkn[0], mkn[2]).to(dtype)
    want = torch.as_tensor(matmul_kernel(a, b, **kw))
    got, product = (torch.as_tensor(t) for t in _matmul_plus_kept(a, b, r, **kw))
    assert product.dtype == dtype and torch.equal(product, want)
    assert got.dtype == dtype and torch.equal(got, (want.float() + r.float()).to(dtype))


EDGES = {torch.bfloat16: [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.0e38, 2.0**-133],
         torch.float16: [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 2.0**-24]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [0, 3, len(FOLD_CASES)])
def test_matmul_epilogue_moves_two_byte_blocks_as_two_bytes(case, dtype):
    # 2-byte epilogue operands are loaded as they are and widened on chip, and a kept product is stored from the
    # evicted tile: no DMA of the kernel casts (a casting DMA is priced at the wider side's bytes); values as the
    # product and a separate pass give them, edges of the dtype (inf, NaN, its largest finite, subnormals) too
    mkn, transpose_a, transpose_b, bias = FOLD_CASES[case] if case < len(FOLD_CASES) else _k_chunked_case(dtype)
    a, b, kw = _fold_operands(mkn, transpose_a, transpose_b, bias, dtype)
    r = torch.randn(mkn[0], mkn[2]).to(dtype)
    r.view(-1)[:len(EDGES[dtype])] = torch.tensor(EDGES[dtype], dtype=dtype)
    want = torch.as_tensor(matmul_kernel(a, b, **kw))
    got, product = (torch.as_tensor(t) for t in _matmul_plus_kept(a, b, r, **kw))
    assert torch.equal(product, want)
    torch.testing.assert_close(got, (want.float() + r.float()).to(dtype), rtol=0, atol=0, equal_nan=True)
    program = _matmul_plus_kept.trace((a, b, r), kw, runtime.core(0).spec).program
    product_slot = program.args[-1].name   # (the returned product: the last output slot)
    moved = [i for i in program.instructions if i.opcode == "dma_copy"
             and {i.src.memory, i.dst.memory} & {"hbm:r", f"hbm:{product_slot}"}]
    assert moved and all(i.src.dtype == i.dst.dtype for i in moved if i.src.memory == "hbm:r")
    if case < len(FOLD_CASES):   # (the K-chunked nest's product is its fp32 total, rounded: stored from fp32)
        assert all(i.src.dtype == i.dst.dtype for i in moved)


@nki.jit
def _chained(a, b, r, b2, r2=None, bias=None, transpose_b=False, bias2=None, transpose_b2=False, keep=False):
    """(A @ B + bias + r, [the product], (that) @ B2 + bias2 [+ r2]) by one kernel: the second product chained."""
    second = None if r2 is None else Epilogue(_add_tiles, (r2,), r2.dtype)
    return matmul_kernel(a, b, transpose_b=transpose_b, bias=bias,
                         epilogue=Epilogue(_add_tiles, (r,), r.dtype, keep_product=keep),
                         then=Then(b2, transpose_b2, bias2, second))


CHAIN_CASES = [(1024, 64, 256, 64),    # the demo's MLP: 4 row blocks of 2 chunks, 2 K tiles of the result
               (640, 300, 100, 128),   # 4-chunk blocks and a 1-chunk tail block, a partial K tile (100 columns)
               (384, 96, 512, 200)]    # 1-chunk blocks, the result's 512 columns as 4 K tiles


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("transpose_b2", [False, True])
@pytest.mark.parametrize("second", ["mm", "addmm", "addmm+epilogue"])
@pytest.mark.parametrize("mkn2", CHAIN_CASES)
def test_chained_product_equals_the_two_kernels(mkn2, second, transpose_b2, keep):
    # the epilogue's result Y goes on from SBUF into Y @ B2 (+ its bias, its own epilogue): every result equals the
    # first kernel's and then a second kernel's over the stored Y, bit for bit, infinities and NaNs in Y too
    M, K, N, N2 = mkn2
    a, b, bias = torch.randn(M, K), torch.randn(N, K), torch.randn(1, N)
    r = torch.randn(M, N)
    r.view(-1)[:7] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.0e38, 2.0**-149])
    b2 = torch.randn((N2, N) if transpose_b2 else (N, N2))
    bias2 = torch.randn(1, N2) if second != "mm" else None
    r2 = torch.randn(M, N2) if second == "addmm+epilogue" else None
    *first, got = (torch.as_tensor(t) for t in _chained(a, b, r, b2, r2, bias=bias, transpose_b=True, bias2=bias2,
                                                        transpose_b2=transpose_b2, keep=keep))
    want_first = _matmul_plus_kept(a, b, r, bias=bias, transpose_b=True)
    y = torch.as_tensor(want_first[0])
    want = (_matmul_plus(y, b2, r2, bias=bias2, transpose_b=transpose_b2) if r2 is not None
            else matmul_kernel(y, b2, transpose_b=transpose_b2, bias=bias2))
    for g, w in zip(first + [got], list(want_first[:1 + keep]) + [want]):
        torch.testing.assert_close(g, torch.as_tensor(w), rtol=0, atol=0, equal_nan=True)
    assert got.isnan().any()   # (the NaN of Y reached its row of the second product)


def test_chained_product_only_where_the_kernel_can_chain():
    # fp32 throughout (a 2-byte result is rounded by its store), A as [M, K] in whole 128-row chunks, the grouped
    # path's K and N, each row block's second product in one PSUM bank
    f32, bf16 = torch.float32, torch.bfloat16
    assert chains_product(1024, 64, 256, 64, False, f32, f32, f32)
    assert chains_product(512, 512, 512, 512, False, f32, f32, f32)
    assert not chains_product(1024, 64, 256, 64, False, bf16, f32, f32)
    assert not chains_product(1024, 64, 256, 64, False, f32, bf16, bf16)
    assert not chains_product(1000, 64, 256, 64, False, f32, f32, f32)
    assert not chains_product(1024, 64, 256, 64, True, f32, f32, f32)
    assert not chains_product(1024, 513, 256, 64, False, f32, f32, f32)
    assert not chains_product(1024, 64, 513, 64, False, f32, f32, f32)
    assert not chains_product(1024, 64, 256, 257, False, f32, f32, f32)   # 2 chunks of 257 fp32: two banks
    a, b, r = torch.randn(200, 64), torch.randn(64, 256), torch.randn(200, 256)
    with pytest.raises(AssertionError, match="no chained product"):
        _chained(a, b, r, torch.randn(256, 64))
    with pytest.raises(AssertionError, match="contracts the result's 256 columns"):
        _chained(a[:128], b, r[:128], torch.randn(200, 64))


def test_matmul_epilogue_operands_must_span_the_output():
    a, r = torch.randn(8, 8), torch.randn(8, 4)
    with pytest.raises(AssertionError, match="epilogue operands"):
        _matmul_plus(a, a, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("epilogue", ["none", "bias", "addmm"])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_long_contraction_layouts_fit_sbuf_as_traced(transpose_a, transpose_b, epilogue, dtype, monkeypatch):
    # An LLM MLP's long contraction (K = 11008) at M = 1024 in every layout, with a bias row or addmm's scaled sum:
    # one pass of narrow panels or K chunks of wide ones (``k_passes``). Traced only (cheap): every tile must get
    # its box when allocated. A tile left past the capacity is placed later by liveness, and that failed where the
    # epilogue's tiles or the next B panel were not in the budget (fp32, A as [K, M], addmm: SBUF overflow).
    from torchneuron.nki import tracing

    def placed_later(*args, **kwargs):
        raise AssertionError("a tile did not fit SBUF when it was allocated")
    monkeypatch.setattr(tracing, "place_by_liveness", placed_later)
    M, K, N = 1024, 11008, 1536
    a = torch.empty((K, M) if transpose_a else (M, K), dtype=dtype)
    b = torch.empty((N, K) if transpose_b else (K, N), dtype=dtype)
    layouts = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    spec = runtime.core(0).spec
    if epilogue == "addmm":   # a fresh cache: a signature traced before would not be traced again
        nki.jit(addmm_kernel.fn).trace((a, b, torch.empty(M, N, dtype=dtype)), dict(layouts, alpha=2.0,
                                                                                           beta=0.5), spec)
    else:
        bias = torch.empty(1, N, dtype=dtype) if epilogue == "bias" else None
        nki.jit(matmul_kernel.fn).trace((a, b), dict(layouts, bias=bias), spec)


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_addmm_over_k_chunks_rounds_once(transpose_a, transpose_b):
    # beta * C + alpha * (A @ B) past the contraction one pass holds: the partial sums in fp32 across passes, the
    # scaled sum formed from the fp32 total and rounded once (against float64: one rounding of the result plus the
    # fp32 accumulation's random-walk bound)
    dtype = torch.bfloat16
    K = max_contraction(2, transpose_a, transpose_b, runtime.core(0).spec.sbuf_bytes_per_partition) + 300
    M, N, alpha, beta = 130, 300, 2.0, 0.5
    gen = torch.Generator().manual_seed(K)
    a, b = (torch.randn(M, K, generator=gen) / K ** 0.5).to(dtype), torch.randn(K, N, generator=gen).to(dtype)
    c = torch.randn(M, N, generator=gen).to(dtype)
    got = torch.as_tensor(addmm_kernel(a.T.contiguous() if transpose_a else a,
                                              b.T.contiguous() if transpose_b else b, c, transpose_a=transpose_a,
                                              transpose_b=transpose_b, alpha=alpha, beta=beta)).double()
    exact = beta * c.double() + alpha * (a.double() @ b.double())
    terms = beta * c.double().abs() + alpha * (a.double().abs() @ b.double().abs())
    bound = torch.finfo(dtype).eps / 2 * exact.abs() + 4 * K ** 0.5 * torch.finfo(torch.float32).eps * terms
    assert bool(((got - exact).abs() <= bound + 1e-30).all()), float(((got - exact).abs() / bound).max())


def test_contraction_longer_than_the_weighed_chunks():
    # K needing more equal chunks than the byte model's first choices (a grid_sample backward's K = 131072 with
    # M = 199, N = 3 asserted "not even one K tile fits"): the fewest chunks that fit, against float64 within the
    # fp32 accumulation's random-walk bound
    budget = runtime.core(0).spec.sbuf_bytes_per_partition - epilogue_reserve(1)
    limit = max_contraction(4, False, False, budget, True, stage_isz=4)
    K, M, N = (MAX_K_PASSES + 1) * limit + 200, 9, 3
    gen = torch.Generator().manual_seed(K)
    a, b = torch.randn(M, K, generator=gen), torch.randn(K, N, generator=gen)
    got = torch.as_tensor(matmul_kernel(a, b)).double()
    exact = a.double() @ b.double()
    bound = 4 * K ** 0.5 * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs())
    assert bool(((got - exact).abs() <= bound).all()), float(((got - exact).abs() / bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.125, 1.0), (0.3, -1.7)])
@pytest.mark.parametrize("K,N,transpose_a,transpose_b", [
    (64, 600, False, True),    # one contraction tile (Q @ K.T): A's rows transposed on TensorE, B as [N, K]
    (100, 600, True, False),   # one contraction tile, A given as [K, M], B as [K, N]
    (300, 64, False, False),   # a long contraction into a narrow output (P @ V), A's rows transposed
    (300, 64, True, False),    # the same with A given as [K, M] (P.T @ dO)
])
def test_batched_scaled_sum_formed_at_the_eviction(K, N, transpose_a, transpose_b, alpha, beta, dtype):
    # baddbmm's streamed paths add beta * C to the fp32 accumulator as it leaves PSUM (alpha applied there first)
    # and round once. Against float64: one rounding of the result (eps/2), the fp32 accumulation's random-walk
    # bound (4 sqrt(K) eps32 of the terms) and the fp32 roundings of alpha * product and beta * C (eps32 each).
    # C holds inf and NaN at a few places: they reach the result there and nowhere else (entries and rows
    # share tiles, never a sum).
    Bt, M = 2, 300
    gen = torch.Generator().manual_seed(K + N)
    a = (torch.randn(Bt, M, K, generator=gen) / K ** 0.5).to(dtype)
    b = torch.randn(Bt, K, N, generator=gen).to(dtype)
    c = torch.randn(Bt, M, N, generator=gen).to(dtype)
    c[0, 5, 7], c[1, 299, N - 1], c[1, 130, 0] = float("inf"), float("-inf"), float("nan")
    got = torch.as_tensor(addmm_kernel(a.transpose(1, 2).contiguous() if transpose_a else a,
                                       b.transpose(1, 2).contiguous() if transpose_b else b, c,
                                       transpose_a=transpose_a, transpose_b=transpose_b, alpha=alpha, beta=beta))
    assert got.dtype == dtype and got.shape == (Bt, M, N)
    got = got.double()
    exact = beta * c.double() + alpha * (a.double() @ b.double())
    special = ~exact.isfinite()
    assert int(special.sum()) == 3
    assert bool((got[special].isnan() == exact[special].isnan()).all())
    assert bool((got[special & ~exact.isnan()] == exact[special & ~exact.isnan()]).all())
    terms = (abs(beta) * c.double().abs() + abs(alpha) * (a.double().abs() @ b.double().abs()))[~special]
    eps32 = torch.finfo(torch.float32).eps
    bound = torch.finfo(dtype).eps / 2 * exact[~special].abs() + (4 * K ** 0.5 + 2) * eps32 * terms
    err = (got[~special] - exact[~special]).abs()
    assert bool((err <= bound + torch.finfo(dtype).tiny).all()), float((err / bound).max())
