"""FFTs on the device: ``_fft_r2c``, ``_fft_c2c`` and ``_fft_c2r`` (what every ``torch.fft`` function, ``stft``
and ``istft`` dispatch to) as DFT matrix products on TensorE.

The NeuronCore has no complex arithmetic, so a complex tensor is handled as its two real parts (strided
fp32 views of its storage, ``view_as_real``). One stage transforms one dim: the rows of that dim, real and
imaginary parts side by side, times a real DFT matrix holding the cosines and sines,

    [Re | Im] @ [[C, sS], [-sS, C]] = [Re' | Im']      (c2c; r2c keeps the first row block, c2r the first
                                                        column block of a Hermitian-weighted matrix)

one fp32 ``mm`` launch per stage (fp32 products, fp32 PSUM accumulation). The matrices are built on the host
in float64 from exact angle indices ``(j * k) mod N``, rounded once to fp32, scaled by the ``norm=`` factor of
their dim and kept on the device (``base.device_table``). n-D transforms run one stage per dim (r2c on the last
dim first, c2r on it last, as pocketfft orders them).

Accuracy: an output of a direct DFT of length N sums N products; in fp32 its error is below ~N * eps * max|x|
and in practice (blocked fp32 accumulation, 128 products per PSUM pass) within 2x of pocketfft's O(log N) eps
on random data up to N = 4096 (``bench/fft.py`` prints the ratio). Lengths up to ``DIRECT_MAX`` take one
stage; longer lengths N = N1 * N2 with both factors up to ``DIRECT_MAX`` take two stages with a twiddle
multiplication between them (the four-step FFT), so their error is that of two short DFTs; a length that is
neither (a prime above ``DIRECT_MAX`` up to ``DIRECT_LIMIT`` takes one long stage) takes the CPU fallback.

Also on the CPU fallback (counted): float64/complex128 (no fp64 arithmetic), and any input holding NaN or inf,
found by one device reduction and a host read: a matrix product spreads a NaN (or inf * 0) into the real and
imaginary part of every output, where pocketfft's butterflies leave some parts finite.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from torchneuron.ops.base import FLOATS, Unsupported, checked, device_table
from torchneuron.ops.registry import complex_lowering, lowering

aten = torch.ops.aten

DIRECT_MAX = 1024    # longest dim one DFT stage transforms when the length factors (tables of 2N x 2N fp32)
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
    """The real matrix of one DFT stage over a dim of length ``n`` (fp32, host): ``c2c`` [2n, 2n_out] maps
    [Re | Im] to [Re' | Im']; ``r2c`` [n, 2n_out] maps a real row to [Re' | Im']; ``c2r`` [2n, n_out] maps the
    first n = n_out // 2 + 1 Hermitian coefficients [Re | Im] to the n_out real samples."""
    if kind == "c2r":
        c, s = _cos_sin(n, n_out, n_out, 1)
        weight = torch.full((n, 1), 2.0, dtype=torch.float64)   # each coefficient stands for itself and its mirror
        weight[0] = 1.0
        if n_out % 2 == 0 and n == n_out // 2 + 1:
            weight[-1] = 1.0
        w = torch.cat([weight * c, -weight * s], 0)
    else:
        c, s = _cos_sin(n, n_out, n, sign)
        w = torch.cat([c, s], 1)
        if kind == "c2c":
            w = torch.cat([w, torch.cat([-s, c], 1)], 0)
    return (w * scale).float()


def twiddles(n1: int, n2: int, sign: int) -> torch.Tensor:
    """The four-step FFT's twiddle factors exp(sign * 2 pi i k1 n2 / (n1 n2)) as [2, n1, n2] fp32 (cos, sin)."""
    c, s = _cos_sin(n1, n2, n1 * n2, sign)
    return torch.stack([c, s]).float()


# ---- stages --------------------------------------------------------------------------------------------

def _norm_scale(normalization: int, n: int) -> float:
    """The factor ``norm=`` applies for one transformed dim of signal length n (0: none, 1: ortho, 2: 1/n)."""
    return (1.0, 1.0 / math.sqrt(n), 1.0 / n)[normalization]


def _rows(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple]:
    """``t`` with ``dim`` last, as rows [B, n] (a device copy when the view needs one), and the batch shape."""
    moved = t.movedim(dim, -1)
    return moved.reshape(-1, moved.shape[-1]), tuple(moved.shape[:-1])


def _unrows(rows: torch.Tensor, batch: tuple, dim: int) -> torch.Tensor:
    """Rows [B, n] back to the batch shape with their dim at ``dim``."""
    return rows.reshape(*batch, rows.shape[-1]).movedim(-1, dim)


def _direct(re: torch.Tensor, im: torch.Tensor | None, dim: int, kind: str, n_out: int, sign: int,
            scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One DFT stage over ``dim`` as one fp32 matrix product (im None: a real input)."""
    n = re.shape[dim]
    a, batch = _rows(re, dim)
    lhs = a if im is None else torch.cat([a, _rows(im, dim)[0]], 1)
    w = device_table(re.device, dft_matrix, kind, n, n_out, sign, scale)
    out = lhs @ w
    if kind == "c2r":
        return _unrows(out, batch, dim), None
    return _unrows(out[:, :n_out], batch, dim), _unrows(out[:, n_out:], batch, dim)


def _split(n: int) -> tuple[int, int] | None:
    """n = n1 * n2 with both factors up to DIRECT_MAX, n1 the one nearest sqrt(n) (None if there is none)."""
    best = None
    for n1 in range(2, math.isqrt(n) + 1):
        if n % n1 == 0 and n // n1 <= DIRECT_MAX:
            best = (n1, n // n1)
    return best


def _c2c(re: torch.Tensor, im: torch.Tensor | None, dim: int, sign: int,
         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The complex DFT of length n over ``dim``: one stage up to DIRECT_MAX, else the four-step FFT."""
    n = re.shape[dim]
    if n <= DIRECT_MAX or _split(n) is None:
        kind = "r2c" if im is None else "c2c"
        return _direct(re, im, dim, kind, n, sign, scale)
    n1, n2 = _split(n)
    # index n = n2 * a + b: DFT over a (length n1, output index k1), twiddle exp(sign 2 pi i k1 b / n), DFT
    # over b (length n2, output k2); the result's index is k1 + n1 * k2
    shape = lambda t: t.reshape(*t.shape[:dim], n1, n2, *t.shape[dim + 1:])  # noqa: E731
    re, im = _direct(shape(re), None if im is None else shape(im), dim, "r2c" if im is None else "c2c",
                     n1, sign, scale)
    tw = device_table(re.device, twiddles, n1, n2, sign)
    tail = (1,) * (re.dim() - dim - 2)
    tc, ts = tw[0].reshape(n1, n2, *tail), tw[1].reshape(n1, n2, *tail)
    re, im = re * tc - im * ts, re * ts + im * tc
    re, im = _direct(re, im, dim + 1, "c2c", n2, sign, 1.0)
    flat = lambda t: t.transpose(dim, dim + 1).reshape(*t.shape[:dim], n, *t.shape[dim + 2:])  # noqa: E731
    return flat(re), flat(im)


def _c2r_last(re: torch.Tensor, im: torch.Tensor, dim: int, n_out: int,
              scale: float) -> torch.Tensor:
    """The real inverse DFT of length n_out over ``dim`` from its first n_out // 2 + 1 coefficients."""
    half = n_out // 2 + 1
    re, im = re.narrow(dim, 0, half), im.narrow(dim, 0, half)
    if n_out <= DIRECT_MAX or _split(n_out) is None:
        return _direct(re, im, dim, "c2r", n_out, 1, scale)[0]
    # the full Hermitian spectrum X[k] = conj(X[n - k]), then the complex inverse; its real part
    mirror = n_out - half
    re_m = re.narrow(dim, 1, mirror).flip(dim)
    im_m = im.narrow(dim, 1, mirror).flip(dim)
    full_re = torch.cat([re, re_m], dim)
    full_im = torch.cat([im, -im_m], dim)
    return _c2c(full_re, full_im, dim, 1, scale)[0]


# ---- the ATen ops ---------------------------------------------------------------------------------------

def _transformable(x: torch.Tensor, dims: Sequence[int], lengths: Sequence[int], dtype: torch.dtype) -> None:
    """Raise Unsupported unless the device runs this transform: fp32/complex64 on neuron, non-empty, every
    length within the limits, and every value finite (one device reduction and a host read)."""
    if x.device.type != "neuron" or x.dtype != dtype or x.is_conj() or x.is_neg() or x.numel() == 0 or not dims:
        raise Unsupported
    for n in lengths:
        if n > DIRECT_LIMIT and _split(n) is None:
            raise Unsupported
    values = torch.view_as_real(x) if x.is_complex() else x
    if not bool(torch.isfinite(values).all()):
        raise Unsupported


def _parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The real and imaginary parts of a complex64 neuron tensor, as strided fp32 views of its storage."""
    pairs = torch.view_as_real(x)
    return pairs[..., 0], pairs[..., 1]


def _complex(re: torch.Tensor, im: torch.Tensor) -> torch.Tensor:
    """A new complex64 tensor holding re + i im (two strided device copies into its storage)."""
    out = torch.empty(re.shape, dtype=torch.complex64, device=re.device)
    pairs = torch.view_as_real(out)
    pairs[..., 0].copy_(re)
    pairs[..., 1].copy_(im)
    return out


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
        re, im = _direct(self, None, last, "r2c", n // 2 + 1 if onesided else n, -1, scale)
    else:
        re, im = _c2c(self, None, last, -1, scale)
        if onesided:
            re, im = re.narrow(last, 0, n // 2 + 1), im.narrow(last, 0, n // 2 + 1)
    for d in reversed(dims[:-1]):
        re, im = _c2c(re, im, d, -1, _norm_scale(normalization, self.shape[d]))
    return _complex(re, im)


@lowering("_fft_c2c", complex_operands=True)
def fft_c2c(self: torch.Tensor, dim: Sequence[int], normalization: int, forward: bool) -> torch.Tensor:
    """``_fft_c2c``: the forward or inverse DFT of a complex64 tensor over ``dim``."""
    checked(aten._fft_c2c.default, self, dim, normalization, forward)
    dims = _wrap(dim, self.dim())
    _transformable(self, dims, [self.shape[d] for d in dims], torch.complex64)
    re, im = _parts(self)
    sign = -1 if forward else 1
    for d in reversed(dims):
        re, im = _c2c(re, im, d, sign, _norm_scale(normalization, self.shape[d]))
    return _complex(re, im)


@lowering("_fft_c2r", complex_operands=True)
def fft_c2r(self: torch.Tensor, dim: Sequence[int], normalization: int, last_dim_size: int) -> torch.Tensor:
    """``_fft_c2r``: the real inverse DFT over ``dim`` of a complex64 tensor holding the non-negative
    frequencies of its last dim (``last_dim_size`` real samples out)."""
    checked(aten._fft_c2r.default, self, dim, normalization, last_dim_size)
    dims = _wrap(dim, self.dim())
    _transformable(self, dims, [self.shape[d] for d in dims[:-1]] + [last_dim_size], torch.complex64)
    if self.shape[dims[-1]] not in (last_dim_size // 2 + 1, last_dim_size):   # what the CPU kernel accepts
        raise Unsupported
    re, im = _parts(self)
    for d in reversed(dims[:-1]):
        re, im = _c2c(re, im, d, 1, _norm_scale(normalization, self.shape[d]))
    return _c2r_last(re, im, dims[-1], last_dim_size, _norm_scale(normalization, last_dim_size))



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
    """``abs`` of a complex64 tensor (a spectrum's magnitude): the hypotenuse of its parts, as the CPU computes
    |z|, on the device."""
    if self.device.type != "neuron" or self.dtype != torch.complex64 or self.is_neg():
        raise Unsupported
    re, im = _parts(self.conj() if self.is_conj() else self)   # |conj(z)| = |z|
    return torch.hypot(re, im)
