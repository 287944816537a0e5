"""Complex tensors on the device: created, moved, viewed, saved and printed like CPU tensors; their
arithmetic takes the counted CPU fallback and equals the CPU's (no native lowering computes on them);
rotary position embeddings in the LLaMA/TorchTitan style match the CPU forward and backward."""
import io

import pytest
import torch

import torchneuron
from tests.ops.conftest import to_n

torch.manual_seed(0)
U = 2.0 ** -24
COMPLEX = [torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", COMPLEX + [torch.complex32])
def test_create_and_move_both_ways(dtype):
    a = torch.randn(5, 7, dtype=torch.complex64).to(dtype)
    n = a.to("neuron")
    assert n.device.type == "neuron" and n.dtype == dtype
    wide = torch.complex128      # (the CPU's torch.equal has no complex32 kernel)
    assert torch.equal(n.cpu().to(wide), a.to(wide))
    z = torch.zeros(3, 4, dtype=dtype, device="neuron")
    assert z.dtype == dtype and torch.equal(z.cpu().to(wide), torch.zeros(3, 4, dtype=wide))
    e = torch.empty_strided((2, 3), (1, 2), dtype=dtype, device="neuron")
    assert e.stride() == (1, 2) and e.dtype == dtype


@pytest.mark.parametrize("dtype", COMPLEX)
def test_factories(dtype):
    assert torch.equal(torch.ones(4, dtype=dtype, device="neuron").cpu(), torch.ones(4, dtype=dtype))
    assert torch.equal(torch.full((2, 2), 1 - 2j, dtype=dtype, device="neuron").cpu(),
                       torch.full((2, 2), 1 - 2j, dtype=dtype))
    assert torch.equal(torch.tensor([1 + 2j, 3j], device="neuron").cpu(), torch.tensor([1 + 2j, 3j]))
    x = torch.randn(4, 8)
    assert torch.equal(to_n(x).to(dtype).cpu(), x.to(dtype))


def test_randn_is_standard_complex_normal():
    # real and imaginary parts are independent N(0, 1/2), as on the CPU; 20000 draws: the sample variance of
    # each part has standard error sqrt(2/n) * 1/2 = 0.005, the mean 0.005 -> 6 sigma bounds
    r = torch.randn(20000, dtype=torch.complex64, device="neuron").cpu()
    assert r.dtype == torch.complex64 and r.isfinite().all()
    for part in (r.real, r.imag):
        assert abs(part.mean().item()) < 0.03 and abs(part.var().item() - 0.5) < 0.03
    assert abs((r.real * r.imag).mean().item()) < 0.03


def test_views_alias_the_device_memory():
    a = torch.randn(4, 6, dtype=torch.complex64)
    n = to_n(a)
    assert torch.equal(torch.view_as_real(n).cpu(), torch.view_as_real(a))
    assert torch.view_as_real(n).data_ptr() == n.data_ptr()
    assert torch.equal(n.real.cpu(), a.real) and torch.equal(n.imag.cpu(), a.imag)
    assert torch.equal(n[1:3, ::2].cpu(), a[1:3, ::2])
    assert torch.equal(n.t().cpu(), a.t()) and torch.equal(n.t().contiguous().cpu(), a.t().contiguous())
    assert torch.equal(n.reshape(3, 8).cpu(), a.reshape(3, 8))
    assert torch.equal(torch.view_as_complex(torch.view_as_real(n)).cpu(), a)
    pairs = to_n(torch.randn(3, 2))
    assert torch.equal(torch.view_as_complex(pairs).cpu(), torch.view_as_complex(pairs.cpu()))
    # writes through the views land in the complex tensor
    n.real[0] = 5.0
    n.imag[:, 1] = -1.0
    a.real[0] = 5.0
    a.imag[:, 1] = -1.0
    assert torch.equal(n.cpu(), a)
    torch.view_as_real(n)[2, 3, 1] = 7.0
    a[2, 3] = complex(a[2, 3].real.item(), 7.0)
    assert torch.equal(n.cpu(), a)


def test_conjugate_and_negative_views():
    a = torch.randn(3, 4, dtype=torch.complex64)
    n = to_n(a)
    assert n.conj().is_conj()
    assert torch.equal(n.conj().cpu(), a.conj())
    assert torch.equal(n.conj().imag.cpu(), a.conj().imag)
    assert torch.equal(n.conj().resolve_conj().cpu(), a.conj().resolve_conj())
    assert n.conj()[1, 2].item() == a.conj()[1, 2].item()
    assert torch.equal((n.conj().imag + 1).cpu(), a.conj().imag + 1)
    # a CPU tensor copied into a conjugate view of a neuron tensor stores its conjugate
    b = torch.randn(3, 4, dtype=torch.complex64)
    n.conj().copy_(b)
    assert torch.equal(n.cpu(), b.conj())


def test_save_load_and_print():
    a = torch.randn(2, 3, dtype=torch.complex64)
    n = to_n(a)
    buf = io.BytesIO()
    torch.save({"x": n, "row": n[1]}, buf)
    buf.seek(0)
    back = torch.load(buf)
    assert back["x"].device == n.device and torch.equal(back["x"].cpu(), a)
    assert back["row"].untyped_storage().data_ptr() == back["x"].untyped_storage().data_ptr()
    buf.seek(0)
    assert torch.equal(torch.load(buf, map_location="cpu")["x"], a)
    # the same text as the CPU's, with the device named (the formatter may wrap it onto its own line)
    assert " ".join(repr(n).split()) == " ".join(repr(a).split())[:-1] + ", device='neuron:0')"
    assert " ".join(str(n.conj()).split()) == " ".join(str(a.conj()).split())[:-1] + ", device='neuron:0')"


def _ops():
    """Ops of every lowered family called on complex operands (element-wise, reductions, products, copies,
    indexing, shapes): each must equal the CPU's result."""
    return {
        "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
        "mul_scalar": lambda a, b: a * (2 - 1j), "add_real": lambda a, b: a + b.real,
        "mm": lambda a, b: a @ b.T, "bmm": lambda a, b: torch.bmm(a[None], b.T[None]),
        "addmm": lambda a, b: torch.addmm(a[:, :3], a, b.T),
        "sum": lambda a, b: a.sum(), "sum_dim": lambda a, b: a.sum(1), "mean": lambda a, b: a.mean(0),
        "prod": lambda a, b: a.prod(1), "cumsum": lambda a, b: a.cumsum(1),
        "abs": lambda a, b: a.abs(), "exp": lambda a, b: torch.exp(a), "log": lambda a, b: torch.log(a),
        "sqrt": lambda a, b: a.sqrt(), "sin": lambda a, b: a.sin(), "tanh": lambda a, b: a.tanh(),
        "sigmoid": lambda a, b: a.sigmoid(), "reciprocal": lambda a, b: a.reciprocal(), "neg": lambda a, b: -a,
        "pow": lambda a, b: a ** 2, "pow_t": lambda a, b: a ** b, "square": lambda a, b: a.square(),
        "conj": lambda a, b: a.conj(), "conj_physical": lambda a, b: torch.conj_physical(a),
        "angle": lambda a, b: a.angle(), "sgn": lambda a, b: a.sgn(), "real": lambda a, b: a.real * 1,
        "eq": lambda a, b: a == b, "ne": lambda a, b: a != a, "isfinite": lambda a, b: a.isfinite(),
        "isnan": lambda a, b: a.isnan(), "where": lambda a, b: torch.where(a.real > 0, a, b),
        "clone": lambda a, b: a.clone(), "contiguous": lambda a, b: a.t().contiguous(),
        "cat": lambda a, b: torch.cat([a, b]), "stack": lambda a, b: torch.stack([a, b]),
        "flip": lambda a, b: a.flip(0), "roll": lambda a, b: a.roll(1, 1), "tril": lambda a, b: a.tril(),
        "index_select": lambda a, b: a.index_select(0, torch.tensor([2, 0], device=a.device)),
        "getitem": lambda a, b: a[torch.tensor([1, 1, 0], device=a.device)],
        "masked_fill": lambda a, b: a.masked_fill(a.real > 0, 1j), "fill": lambda a, b: a.clone().fill_(2 + 3j),
        "zero": lambda a, b: a.clone().zero_(), "mul_": lambda a, b: a.clone().mul_(b),
        "linalg_norm": lambda a, b: torch.linalg.vector_norm(a), "softmax_real": lambda a, b: a.abs().softmax(1),
        "dot": lambda a, b: torch.dot(a[0], b[0]), "vdot": lambda a, b: torch.vdot(a[0], b[0]),
        "matmul_conj": lambda a, b: a @ b.conj().T, "einsum": lambda a, b: torch.einsum("ij,kj->ik", a, b),
        "to_real": lambda a, b: a.real.to(torch.complex64), "polar": lambda a, b: torch.polar(a.abs(), a.angle()),
        "complex": lambda a, b: torch.complex(a.real, b.imag), "sum_dtype": lambda a, b: a.real.sum(dtype=torch.cfloat),
        "isclose": lambda a, b: torch.isclose(a, a + 1e-9),
    }


# ops that compute on the device: |z| = max * sqrt(1 + (min/max)^2) of the parts (four roundings: within 2 ulp
# where the CPU's hypot is correctly rounded), and what is computed from it inherits that (softmax: through
# exp, x * 2 ulp relative for |x| < 4)
DEVICE_ULPS = {"abs": 2, "polar": 3, "softmax_real": 8}


@pytest.mark.parametrize("name", sorted(_ops()))
def test_ops_equal_cpu(name):
    fn = _ops()[name]
    a = torch.randn(3, 5, dtype=torch.complex64)
    b = torch.randn(3, 5, dtype=torch.complex64)
    expected = fn(a, b)
    got = fn(to_n(a), to_n(b))
    assert got.device.type == "neuron"
    # the CPU kernel runs on the same values: bit-identical, except where the device computes
    torch.testing.assert_close(got.cpu(), expected, atol=0, rtol=DEVICE_ULPS.get(name, 0) * 2 * U, equal_nan=True)


def test_abs_of_extreme_and_special_values():
    inf, nan = float("inf"), float("nan")
    z = torch.tensor([1e-30 + 1e-30j, 1e30 + 1e30j, 1e-30 + 1e30j, 3e38 + 3e38j, 0j, complex(1e-45, 0), 3 + 4j,
                      complex(inf, nan), complex(nan, -inf), complex(nan, 1), complex(inf, inf), complex(-inf, 0)],
                     dtype=torch.complex64)
    torch.testing.assert_close(to_n(z).abs().cpu(), z.abs(), atol=0, rtol=4 * U, equal_nan=True)
    torch.testing.assert_close(to_n(z).conj().abs().cpu(), z.abs(), atol=0, rtol=4 * U, equal_nan=True)


def test_complex_ops_are_counted_fallbacks():
    a = to_n(torch.randn(4, dtype=torch.complex64))
    torchneuron.reset_fallback_counts()
    (a * a).sum()
    counts = torchneuron.fallback_counts()
    assert counts.get("aten::mul.Tensor") == 1 and counts.get("aten::sum") == 1
    before = torchneuron.is_strict()
    torchneuron.set_strict(True)
    try:
        with pytest.raises(NotImplementedError, match="aten::mul.Tensor"):
            a * a
        # moving, viewing and printing need no fallback
        b = torch.randn(3, dtype=torch.complex64).to("neuron")
        torch.view_as_real(b).cpu()
        b.conj().cpu()
        repr(b)
    finally:
        torchneuron.set_strict(before)


# ---- rotary position embeddings (LLaMA / TorchTitan) --------------------------------------------------

def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def test_rotary_embedding_forward_and_backward():
    bs, seq, heads, head_dim = 2, 16, 4, 32
    q = torch.randn(bs, seq, heads, head_dim)
    k = torch.randn(bs, seq, heads, head_dim)
    freqs = precompute_freqs_cis(head_dim, seq)
    w = torch.randn(bs, seq, heads, head_dim)

    def run(dev):
        qd, kd = q.to(dev).requires_grad_(), k.to(dev).requires_grad_()
        oq, ok = apply_rotary_emb(qd, kd, freqs.to(dev))
        ((oq * w.to(dev)).sum() + (ok * ok).sum()).backward()
        return oq, ok, qd.grad, kd.grad

    for got, exp in zip(run("neuron"), run("cpu")):
        assert got.device.type == "neuron"
        # each output is one complex product (a c - b d): within 2 ulp of |a||c| + |b||d| <= |x| |f|
        torch.testing.assert_close(got.detach().cpu(), exp.detach(), atol=4 * U * exp.abs().max().item(), rtol=0)
