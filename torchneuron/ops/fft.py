"""FFTs on the device: ``_fft_r2c``, ``_fft_c2c`` and ``_fft_c2r`` (what every ``torch.fft`` function, ``stft``
and ``istft`` dispatch to) as DFT matrix products on TensorE.

The NeuronCore has no complex arithmetic, so a complex tensor is handled as the real pairs it stores (re, im
interleaved: ``view_as_real``). One stage transforms one dim: its rows, read as [re0, im0, re1, im1, ...], times
a real DFT matrix holding the cosines and sines in the same interleaved order, so the product's output rows are
the transformed complex64 rows themselves (c2c; r2c multiplies real rows, c2r a Hermitian-weighted matrix
gives real rows): one fp32 ``mm`` launch per stage (fp32 products, fp32 PSUM accumulation), plus a device copy
when the dim is not the contiguous last one. The matrices are built on the host in float64 from exact angle
indices ``(j * k) mod N``, rounded once to fp32, scaled by the ``norm=`` factor of their dim and kept on the
device (``base.device_table``). n-D transforms run one stage per dim (r2c on the last dim first, c2r on it
last, as the CPU's FFT libraries order them).

Accuracy: an output of a direct DFT of length N sums N products; in fp32 its error is below ~N * eps * max|x|
and in practice (blocked fp32 accumulation, 128 products per PSUM pass) within 4x of the CPU FFT's O(log N) eps
on random data (``bench/fft.py`` prints the ratio). Lengths up to ``DIRECT_MAX`` take one
stage; longer lengths N = N1 * N2 with both factors up to ``DIRECT_MAX`` take two stages with a twiddle
multiplication between them (the four-step FFT), so their error is that of two short DFTs; a length that is
neither takes one long stage up to ``DIRECT_LIMIT`` and the CPU fallback beyond.

Also on the CPU fallback (counted): float64/complex128 (no fp64 arithmetic), ``out=`` (complex operands the
registry refuses), and any input holding NaN or inf,
found by one device reduction and a host read: a matrix product spreads a NaN (or inf * 0) into the real and
imaginary part of every output, where the CPU FFT's butterflies leave some parts finite.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from torchneuron.ops.base import FLOATS, Unsupported, aten, checked, device_table
from torchneuron.ops.registry import complex_lowering, lowering


DIRECT_MAX = 2048    # longest dim one DFT stage transforms when the length factors (tables of 2N x 2N fp32, 64 MiB)
DIRECT_LIMIT = 4096  # longest dim transformed in one stage at all (lengths that do not factor)


# ---- DFT tables (host-built in float64, rounded to fp32 once, cached on the device) ----------------------

def _cos_sin(rows: int, cols: int, n: int, sign: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign * sin of 2 pi j k / n for j < rows, k < cols (float64), exact at multiples of pi/2."""
    r = torch.outer(torch.arange(rows, dtype=torch.int64), torch.arange(cols, dtype=torch.int64)) % n
    angle = r.double() * (2 * math.pi / n)
    c, s = torch.cos(angle), torch.sin(angle)
    quarter = (4 * r) % n == 0                       # angles 0, pi/2, pi, 3pi/2: exact zeros and ones
    q = (4 * r // n) % 4
    c = torch.where(quarter, torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)[q], c)
    s = torch.where(quarter, torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=torch.float64)[q], s)
    return c, sign * s


def dft_matrix(kind: str, n: int, n_out: int, sign: int, scale: float) -> torch.Tensor:
    """The real matrix of one DFT stage over a dim of length ``n`` (fp32, host), complex values interleaved as
    complex64 stores them (re0, im0, re1, ...): ``c2c`` [2n, 2n_out]; ``r2c`` [n, 2n_out] from real rows;
    ``c2r`` [2n, n_out] from the first n = n_out // 2 + 1 Hermitian coefficients to the n_out real samples."""
    if kind == "c2r":
        c, s = _cos_sin(n, n_out, n_out, 1)
        weight = torch.full((n, 1), 2.0, dtype=torch.float64)   # each coefficient stands for itself and its mirror
        weight[0] = 1.0
        if n_out % 2 == 0 and n == n_out // 2 + 1:
            weight[-1] = 1.0
        w = torch.stack([weight * c, -weight * s], 1).reshape(2 * n, n_out)
    else:
        c, s = _cos_sin(n, n_out, n, sign)
        w = torch.stack([c, s], 2).reshape(n, 2 * n_out)                       # a real row's re' and im'
        if kind == "c2c":
            w = torch.stack([w, torch.stack([-s, c], 2).reshape(n, 2 * n_out)], 1).reshape(2 * n, 2 * n_out)
    return (w * scale).float()


def twiddles(n1: int, n2: int, sign: int) -> torch.Tensor:
    """The four-step FFT's twiddle factors exp(sign * 2 pi i k1 n2 / (n1 n2)) as [2, n1, n2] fp32 (cos, sin)."""
    c, s = _cos_sin(n1, n2, n1 * n2, sign)
    return torch.stack([c, s]).float()


# ---- stages --------------------------------------------------------------------------------------------

def _norm_scale(normalization: int, n: int) -> float:
    """The factor ``norm=`` applies for one transformed dim of signal length n (0: none, 1: ortho, 2: 1/n)."""
    return (1.0, 1.0 / math.sqrt(n), 1.0 / n)[normalization]


def _direct(x: torch.Tensor, dim: int, kind: str, n_out: int, sign: int, scale: float) -> torch.Tensor:
    """One DFT stage over ``dim`` as one fp32 matrix product on the rows of that dim (a device copy first when
    the dim is not already the contiguous last one); complex rows are read as their interleaved parts and a
    complex result is the product's output itself."""
    n = x.shape[dim]
    moved = x.movedim(dim, -1)
    batch = tuple(moved.shape[:-1])
    rows = moved.reshape(-1, n)
    lhs = torch.view_as_real(rows).reshape(-1, 2 * n) if rows.is_complex() else rows
    out = lhs @ device_table(x.device, dft_matrix, kind, n, n_out, sign, scale)
    if kind != "c2r":
        out = torch.view_as_complex(out.view(-1, n_out, 2))
    return out.reshape(*batch, n_out).movedim(-1, dim)


@functools.cache
def _split(n: int) -> tuple[int, int] | None:
    """n = n1 * n2 with both factors up to DIRECT_MAX, n1 the one nearest sqrt(n) (None if there is none)."""
    best = None
    for n1 in range(2, math.isqrt(n) + 1):
        if n % n1 == 0 and n // n1 <= DIRECT_MAX:
            best = (n1, n // n1)
    return best


def _c2c(x: torch.Tensor, dim: int, sign: int, scale: float) -> torch.Tensor:
    """The complex DFT of length n over ``dim`` (of a complex64 or a real fp32 ``x``): one stage up to
    DIRECT_MAX, else the four-step FFT."""
    n = x.shape[dim]
    kind = "c2c" if x.is_complex() else "r2c"
    if n <= DIRECT_MAX or _split(n) is None:
        return _direct(x, dim, kind, n, sign, scale)
    n1, n2 = _split(n)
    # index n = n2 * a + b: DFT over a (length n1, output index k1), twiddle exp(sign 2 pi i k1 b / n), DFT
    # over b (length n2, output k2); the result's index is k1 + n1 * k2
    y = _direct(x.reshape(*x.shape[:dim], n1, n2, *x.shape[dim + 1:]), dim, kind, n1, sign, scale)
    tw = device_table(x.device, twiddles, n1, n2, sign)
    tail = (1,) * (y.dim() - dim - 2)
    tc, ts = tw[0].reshape(n1, n2, *tail), tw[1].reshape(n1, n2, *tail)
    parts = torch.view_as_real(y)
    re, im = parts[..., 0], parts[..., 1]
    y = torch.view_as_complex(torch.stack([re * tc - im * ts, re * ts + im * tc], -1))
    y = _direct(y, dim + 1, "c2c", n2, sign, 1.0)
    return y.transpose(dim, dim + 1).reshape(*y.shape[:dim], n, *y.shape[dim + 2:])


def _c2r_last(x: torch.Tensor, dim: int, n_out: int, scale: float) -> torch.Tensor:
    """The real inverse DFT of length n_out over ``dim`` from its first n_out // 2 + 1 coefficients."""
    half = n_out // 2 + 1
    x = x.narrow(dim, 0, half)
    if n_out <= DIRECT_MAX or _split(n_out) is None:
        return _direct(x, dim, "c2r", n_out, 1, scale)
    # the full Hermitian spectrum X[k] = conj(X[n - k]) (on the parts), then the complex inverse; its real part
    parts = torch.view_as_real(x)
    mirror = parts.narrow(dim, 1, n_out - half).flip(dim) * torch.tensor([1.0, -1.0], device=x.device)
    full = torch.view_as_complex(torch.cat([parts, mirror], dim))
    return torch.view_as_real(_c2c(full, dim, 1, scale))[..., 0].contiguous()


# ---- the ATen ops ---------------------------------------------------------------------------------------

def _transformable(x: torch.Tensor, dims: Sequence[int], lengths: Sequence[int], dtype: torch.dtype) -> None:
    """Raise Unsupported unless the device runs this transform: fp32/complex64 on neuron, non-empty, every
    length within the limits, and every value finite (one device sum and a host read)."""
    if x.device.type != "neuron" or x.dtype != dtype or x.is_conj() or x.is_neg() or x.numel() == 0 or not dims:
        raise Unsupported
    for n in lengths:
        if n > DIRECT_LIMIT and _split(n) is None:
            raise Unsupported
    # the sum is finite iff every value is, unless it overflows (then the CPU computes it: still right)
    values = torch.view_as_real(x) if x.is_complex() else x
    if not math.isfinite(values.sum().item()):
        raise Unsupported


def _wrap(dims: Sequence[int], ndim: int) -> list[int]:
    """``dims`` as non-negative dims (already validated)."""
    return [d % ndim for d in dims]


@lowering("_fft_r2c", complex_operands=True)
def fft_r2c(self: torch.Tensor, dim: Sequence[int], normalization: int, onesided: bool) -> torch.Tensor:
    """``_fft_r2c``: the DFT of a real fp32 tensor over ``dim`` (only the non-negative frequencies of the last
    dim when ``onesided``)."""
    checked(aten._fft_r2c.default, self, dim, normalization, onesided)
    dims = _wrap(dim, self.dim())
    _transformable(self, dims, [self.shape[d] for d in dims], torch.float32)
    last = dims[-1]
    n = self.shape[last]
    scale = _norm_scale(normalization, n)
    if n <= DIRECT_MAX or _split(n) is None:
        y = _direct(self, last, "r2c", n // 2 + 1 if onesided else n, -1, scale)
    else:
        y = _c2c(self, last, -1, scale)
        if onesided:
            y = y.narrow(last, 0, n // 2 + 1)
    for d in reversed(dims[:-1]):
        y = _c2c(y, d, -1, _norm_scale(normalization, self.shape[d]))
    return y.contiguous()


@lowering("_fft_c2c", complex_operands=True)
def fft_c2c(self: torch.Tensor, dim: Sequence[int], normalization: int, forward: bool) -> torch.Tensor:
    """``_fft_c2c``: the forward or inverse DFT of a complex64 tensor over ``dim``."""
    checked(aten._fft_c2c.default, self, dim, normalization, forward)
    dims = _wrap(dim, self.dim())
    _transformable(self, dims, [self.shape[d] for d in dims], torch.complex64)
    y = self
    for d in reversed(dims):
        y = _c2c(y, d, -1 if forward else 1, _norm_scale(normalization, self.shape[d]))
    return y.contiguous()


@lowering("_fft_c2r", complex_operands=True)
def fft_c2r(self: torch.Tensor, dim: Sequence[int], normalization: int, last_dim_size: int) -> torch.Tensor:
    """``_fft_c2r``: the real inverse DFT over ``dim`` of a complex64 tensor holding the non-negative
    frequencies of its last dim (``last_dim_size`` real samples out)."""
    checked(aten._fft_c2r.default, self, dim, normalization, last_dim_size)
    dims = _wrap(dim, self.dim())
    _transformable(self, dims, [self.shape[d] for d in dims[:-1]] + [last_dim_size], torch.complex64)
    if self.shape[dims[-1]] not in (last_dim_size // 2 + 1, last_dim_size):   # what the CPU kernel accepts
        raise Unsupported
    y = self
    for d in reversed(dims[:-1]):
        y = _c2c(y, d, 1, _norm_scale(normalization, self.shape[d]))
    return _c2r_last(y, dims[-1], last_dim_size, _norm_scale(normalization, last_dim_size)).contiguous()


@lowering("conj_physical.out", complex_operands=True)
def conj_physical_out(self: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """``conj_physical`` of a complex64 tensor into ``out`` (what ``ihfftn`` applies to its result): the parts
    copied, the imaginary ones negated, on the device."""
    if not (self.device == out.device and self.device.type == "neuron" and self.dtype == out.dtype == torch.complex64
            and out.shape == self.shape and not (self.is_neg() or out.is_conj() or out.is_neg())):
        raise Unsupported
    return out.copy_(self.conj())


@lowering("unfold_backward")
def unfold_backward(grad_in: torch.Tensor, input_sizes: Sequence[int], dim: int, size: int,
                    step: int) -> torch.Tensor:
    """``unfold_backward``, the overlap-add of windows (``istft``, the gradient of ``Tensor.unfold``): the windows
    added into zeros in groups whose members do not overlap, one in-place add per group."""
    if grad_in.device.type != "neuron" or grad_in.dtype not in FLOATS or not input_sizes or step < 1:
        raise Unsupported
    dim = dim % len(input_sizes)
    out = torch.zeros(list(input_sizes), dtype=grad_in.dtype, device=grad_in.device)
    n = grad_in.shape[dim]
    group = -(-size // step)                  # windows this many apart never overlap
    for r in range(min(group, n)):
        count = -(-(n - r) // group)
        pick = [slice(None)] * grad_in.dim()
        pick[dim] = slice(r, None, group)
        windows = out.narrow(dim, r * step, out.shape[dim] - r * step).unfold(dim, size, group * step)
        windows.narrow(dim, 0, count).add_(grad_in[tuple(pick)])
    return out


@complex_lowering("abs")
def complex_abs(self: torch.Tensor) -> torch.Tensor:
    """``abs`` of a complex64 tensor (a spectrum's magnitude) on the device: max(|re|, |im|) * sqrt(1 + r^2) with
    r = min / max, which neither overflows nor underflows where the parts' squares would (within 2 ulp of the
    CPU's correctly rounded hypot); an infinite part gives inf even beside a NaN, as C's hypot does."""
    if self.device.type != "neuron" or self.dtype != torch.complex64 or self.is_neg():
        raise Unsupported
    parts = torch.view_as_real(self.conj() if self.is_conj() else self).abs()   # |conj(z)| = |z|
    a, b = parts[..., 0], parts[..., 1]
    big, small = torch.maximum(a, b), torch.minimum(a, b)
    ratio = torch.where((big == 0) | big.isinf(), 0.0, small / big)
    return torch.where(a.isinf() | b.isinf(), float("inf"), big * torch.sqrt(1 + ratio * ratio))
