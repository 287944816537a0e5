"""torch.fft, stft and istft on the device (strict mode: DFT matrix products on TensorE) against the CPU's
FFT (MKL or pocketfft), within the error of an fp32 DFT; bad arguments raise as on the CPU; NaN/inf, float64 and lengths
the device does not transform take the counted CPU fallback and match the CPU exactly."""
import io
import math

import pytest
import torch

import torchneuron
from torchneuron.ops import fft as nfft
from tests.ops.conftest import assert_raises_like_cpu, to_n

torch.manual_seed(0)
U = 2.0 ** -24   # fp32 unit roundoff


def dft_atol(x: torch.Tensor, lengths: list[int], scale: float = 1.0) -> float:
    """The error bound of a DFT of ``lengths`` (the transformed dims' lengths) computed by fp32 matrix
    products: each output sums M = prod(lengths) products of |x| <= max|x|, so its fp32 error is below
    ~M * u * max|x| (times the norm= scale); the CPU FFT's own error (O(log M) u) is far below it."""
    m = math.prod(lengths)
    mx = x.abs().max().item() if x.numel() else 0.0
    return 2 * m * U * mx * scale + 1e-30


def norm_scale(norm: str | None, m: int, inverse: bool) -> float:
    """The factor norm= applies to a transform over m points (forward or inverse direction)."""
    if norm == "ortho":
        return m ** -0.5
    if (norm == "forward") != inverse:       # "forward" scales the forward transform, None/"backward" the inverse
        return 1.0 / m if (norm == "forward" or inverse) else 1.0
    return 1.0


def check(fn, x: torch.Tensor, lengths: list[int], scale: float) -> None:
    expected = fn(x)
    got = fn(to_n(x))
    assert got.device.type == "neuron" and got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.cpu(), expected, atol=dft_atol(x, lengths, scale), rtol=0)


NORMS = [None, "ortho", "forward"]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("n", [1, 2, 7, 16, 45, 400])
def test_1d_transforms_match_cpu(strict, n, norm):
    x = torch.randn(3, n)
    c = torch.randn(3, n, dtype=torch.complex64)
    check(lambda t: torch.fft.fft(t, norm=norm), x, [n], norm_scale(norm, n, False))
    check(lambda t: torch.fft.fft(t, norm=norm), c, [n], norm_scale(norm, n, False))
    check(lambda t: torch.fft.ifft(t, norm=norm), c, [n], norm_scale(norm, n, True))
    check(lambda t: torch.fft.rfft(t, norm=norm), x, [n], norm_scale(norm, n, False))
    check(lambda t: torch.fft.ihfft(t, norm=norm), x, [n], norm_scale(norm, n, True))
    check(lambda t: torch.fft.irfft(t, n=n, norm=norm), c[:, :n // 2 + 1], [n], norm_scale(norm, n, True))


@pytest.mark.parametrize("n", [5, 12, 33])
def test_n_pads_and_trims_and_dim(strict, n):
    x = torch.randn(4, 20, 3)
    check(lambda t: torch.fft.rfft(t, n=n, dim=1), x, [n], 1.0)
    check(lambda t: torch.fft.fft(t, n=n, dim=-2, norm="ortho"), x, [n], n ** -0.5)
    c = torch.randn(4, 20, 3, dtype=torch.complex64)
    check(lambda t: torch.fft.ifft(t[:, :min(n, 20)], n=min(n, 20), dim=1), c, [20], 1 / min(n, 20))
    check(lambda t: torch.fft.irfft(t, n=n, dim=1), c, [n], 1 / n)


def test_hfft_matches_cpu():
    # hfft conjugates its input first; the conjugate's copy is the only op that may leave the device
    c = torch.randn(5, 9, dtype=torch.complex64)
    for n in (16, 17):
        check(lambda t: torch.fft.hfft(t, n=n), c, [n], 1.0)


def test_nd_transforms_match_cpu(strict):
    x = torch.randn(2, 6, 10)
    c = torch.randn(2, 6, 10, dtype=torch.complex64)
    check(torch.fft.fft2, x, [6, 10], 1.0)
    check(lambda t: torch.fft.fftn(t, dim=(0, 2), norm="ortho"), c, [2, 10], 20 ** -0.5)
    check(lambda t: torch.fft.ifftn(t), c, [2, 6, 10], 1 / 120)
    check(torch.fft.rfft2, x, [6, 10], 1.0)
    check(lambda t: torch.fft.rfftn(t, s=(5, 12)), x, [2, 5, 12], 1.0)
    check(lambda t: torch.fft.irfft2(t, s=(6, 18)), c, [6, 18], 1 / 108)
    check(lambda t: torch.fft.irfftn(t, dim=(0, 1, 2), norm="forward"), c, [2, 6, 18], 1.0)
    check(lambda t: torch.fft.ihfft2(t), x, [6, 10], 1 / 60)


@pytest.mark.parametrize("n", [2053, 3000])
def test_long_lengths(strict, n):
    # beyond DIRECT_MAX a length that factors runs as two DFT stages with twiddles (the four-step FFT: 3000 =
    # 50 x 60), a prime one (2053) as one long stage
    assert n > nfft.DIRECT_MAX and (nfft._split(n) is None) == (n == 2053)
    x = torch.randn(2, n)
    check(torch.fft.rfft, x, [n], 1.0)
    c = torch.randn(2, n, dtype=torch.complex64)
    check(lambda t: torch.fft.ifft(t, norm="ortho"), c, [n], n ** -0.5)
    check(lambda t: torch.fft.irfft(t, n=n), c[:, :n // 2 + 1], [n], 1 / n)


def test_long_prime_length_falls_back():
    n = 4099                                       # prime, above DIRECT_LIMIT: no exact enough device plan
    assert n > nfft.DIRECT_LIMIT and nfft._split(n) is None
    x = torch.randn(1, n)
    torchneuron.reset_fallback_counts()
    assert torch.equal(torch.fft.rfft(to_n(x)).cpu(), torch.fft.rfft(x))
    assert torchneuron.fallback_counts().get("aten::_fft_r2c") == 1


def test_non_finite_input_falls_back_and_matches_cpu():
    # a matrix product spreads NaN into every real and imaginary part, the CPU FFT's butterflies do not
    x = torch.randn(3, 8)
    x[0, 0], x[1, 3], x[2, 5] = float("nan"), float("inf"), -float("inf")
    torchneuron.reset_fallback_counts()
    for fn in (torch.fft.fft, torch.fft.rfft, lambda t: torch.fft.irfft(torch.fft.rfft(t))):
        torch.testing.assert_close(fn(to_n(x)).cpu(), fn(x), equal_nan=True, atol=0, rtol=0)
    assert torchneuron.fallback_counts().get("aten::_fft_r2c", 0) >= 3


def test_non_finite_input_is_refused_in_strict_mode(strict):
    x = torch.randn(8)
    x[2] = float("nan")
    with pytest.raises(NotImplementedError, match="_fft_r2c"):
        torch.fft.rfft(to_n(x))


def test_other_dtypes_as_the_cpu():
    x = torch.randn(4, 8, dtype=torch.float64)
    # float64 and complex128 have no device arithmetic: the fallback gives the CPU's exact result
    assert torch.equal(torch.fft.rfft(to_n(x)).cpu(), torch.fft.rfft(x))
    c = torch.randn(4, 8, dtype=torch.complex128)
    assert torch.equal(torch.fft.fft(to_n(c)).cpu(), torch.fft.fft(c))
    # half precision: the CPU refuses, and so does the device with the same error
    for dt in (torch.float16, torch.bfloat16):
        assert_raises_like_cpu(lambda conv: torch.fft.rfft(conv(torch.randn(8).to(dt))))
    # integer input is promoted to float32, as on the CPU
    i = torch.arange(12, dtype=torch.int32).reshape(2, 6)
    check(torch.fft.rfft, i, [6], 1.0)


def test_bad_arguments_raise_like_cpu():
    x = torch.randn(3, 8)
    assert_raises_like_cpu(lambda conv: torch.fft.fft(conv(x), n=0))
    assert_raises_like_cpu(lambda conv: torch.fft.rfft(conv(x), n=-3))
    assert_raises_like_cpu(lambda conv: torch.fft.fft(conv(x), dim=2))
    assert_raises_like_cpu(lambda conv: torch.fft.fft(conv(x), norm="bad"))
    assert_raises_like_cpu(lambda conv: torch.fft.rfft(conv(x.to(torch.complex64))))
    assert_raises_like_cpu(lambda conv: torch.fft.fftn(conv(x), s=(4,), dim=(0, 1)))
    assert_raises_like_cpu(lambda conv: torch.fft.irfft(conv(x.to(torch.complex64)), n=0))
    assert_raises_like_cpu(lambda conv: torch.ops.aten._fft_r2c(conv(x), [3], 0, True))
    assert_raises_like_cpu(lambda conv: torch.ops.aten._fft_c2c(conv(x), [0], 0, True))


def test_out_variant_takes_the_fallback():
    # an out= tensor is complex (r2c, c2c) or the input is (c2r): the CPU fallback writes it, counted
    x = torch.randn(3, 10)
    out = to_n(torch.empty(3, 6, dtype=torch.complex64))
    torchneuron.reset_fallback_counts()
    res = torch.fft.rfft(to_n(x), out=out)
    assert res is out and torch.equal(out.cpu(), torch.fft.rfft(x))
    assert torchneuron.fallback_counts() == {"aten::_fft_r2c.out": 1}


def test_empty_input_as_the_cpu():
    # an empty batch goes to the CPU kernel (whose FFT library may refuse it: then so does the device)
    x = torch.randn(0, 8)
    try:
        expected = torch.fft.rfft(x)
    except RuntimeError:
        assert_raises_like_cpu(lambda conv: torch.fft.rfft(conv(x)))
    else:
        assert torch.fft.rfft(to_n(x)).shape == expected.shape


def test_gradients_match_cpu():
    x = torch.randn(4, 12)
    w = torch.randn(4, 7)

    def loss(t, dev):
        spec = torch.fft.rfft(t, norm="ortho")
        return (spec.abs() * w.to(dev)).sum() + torch.fft.irfft(spec, n=12).pow(2).sum()

    xc = x.clone().requires_grad_()
    loss(xc, "cpu").backward()
    xn = to_n(x).requires_grad_()
    loss(xn, "neuron").backward()
    # the gradient passes through a forward and an inverse transform of 12 points: twice the DFT bound,
    # at the magnitude of the upstream gradients (|w| and 2|x|)
    bound = 2 * dft_atol(torch.cat([w, 2 * x], 1), [12]) * 12
    torch.testing.assert_close(xn.grad.cpu(), xc.grad, atol=bound, rtol=0)


@pytest.mark.parametrize("center", [True, False])
def test_stft_istft_match_cpu(strict, center):
    sig = torch.randn(2, 1000)
    win = torch.hann_window(64) + (0.0 if center else 0.1)   # uncentred frames need a window nonzero at its ends

    def spec(t):
        return torch.stft(t, 64, hop_length=16, window=win.to(t.device), center=center, return_complex=True)

    check(spec, sig, [64], 1.0)
    s = spec(sig)
    length = 1000 if center else None
    y_cpu = torch.istft(s, 64, hop_length=16, window=win, center=center, length=length)
    y_n = torch.istft(to_n(s), 64, hop_length=16, window=to_n(win), center=center, length=length)
    # each sample: an inverse DFT of 64 points (bound at 1/64 scale) times the window, overlap-added over 4
    # frames and divided by the window-square sum (>= its minimum)
    wsq = torch.zeros(1000 + 64).index_add_(0, (torch.arange(s.shape[-1])[:, None] * 16 + torch.arange(64)).reshape(-1),
                                            (win ** 2).repeat(s.shape[-1]))
    wmin = wsq[32:1032].min().item() if center else wsq[:1000 - 64 + 16].clamp(min=1e-3).min().item()
    torch.testing.assert_close(y_n.cpu(), y_cpu, atol=4 * dft_atol(s, [64], 1 / 64) * win.max().item() / wmin, rtol=0)


def test_istft_overlap_add_refusal_as_cpu():
    # a hann window on uncentred frames is zero at the signal's ends: the CPU refuses, and so does the device
    s = torch.stft(torch.randn(1000), 64, 16, window=torch.hann_window(64), center=False, return_complex=True)
    for conv in (lambda t: t, to_n):   # (the message names the tensors' device)
        with pytest.raises(RuntimeError, match="window overlap add min: 1"):
            torch.istft(conv(s), 64, 16, window=conv(torch.hann_window(64)), center=False)


# ---- a Whisper-style log-mel spectrogram ------------------------------------------------------------

def mel_filters(sr: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """Slaney-style triangular mel filters [n_mels, n_fft // 2 + 1] (area-normalized), built in float64."""
    def hz_to_mel(f):
        f = torch.as_tensor(f, dtype=torch.float64)
        lin = f / (200.0 / 3)                              # linear below 1 kHz, logarithmic above
        log = 15.0 + torch.log(f / 1000.0) / (math.log(6.4) / 27.0)
        return torch.where(f >= 1000.0, log, lin)

    def mel_to_hz(m):
        lin = m * (200.0 / 3)
        log = 1000.0 * torch.exp((m - 15.0) * (math.log(6.4) / 27.0))
        return torch.where(m >= 15.0, log, lin)

    edges = mel_to_hz(torch.linspace(0.0, hz_to_mel(sr / 2).item(), n_mels + 2, dtype=torch.float64))
    freqs = torch.linspace(0.0, sr / 2, n_fft // 2 + 1, dtype=torch.float64)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    tri = torch.clamp(torch.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), min=0.0)
    return (tri * (2.0 / (hi - lo))).float()


def log_mel(audio: torch.Tensor, filters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whisper's feature: |STFT|^2 (n_fft 400, hop 160, hann), mel filterbank, log10, max-8 clamp, (x+4)/4;
    also the mel energies before the log."""
    win = torch.hann_window(400, device=audio.device)
    stft = torch.stft(audio, 400, 160, window=win, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    mel = filters @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0, mel


def test_whisper_log_mel_matches_cpu(strict):
    sr = 16000
    t = torch.arange(3 * sr) / sr
    audio = 0.3 * torch.sin(2 * math.pi * 440 * t) + 0.1 * torch.sin(2 * math.pi * 3100 * t) \
        + 0.02 * torch.randn(t.shape)
    filters = mel_filters(sr, 400, 80)
    exp, mel_cpu = log_mel(audio, filters)
    got, mel_n = log_mel(to_n(audio), to_n(filters))
    assert got.shape == exp.shape == (80, 300)
    # error bound of each mel energy: |X| is off by at most d = 400 u max|x w| (the DFT bound), so |X|^2 by
    # 2|X| d + d^2, summed through the filters; the filterbank product adds 201 u of its sum
    stft = torch.stft(audio, 400, 160, window=torch.hann_window(400), return_complex=True)[..., :-1]
    d = dft_atol(audio, [400]) / 2
    d_mel = filters @ (2 * stft.abs() * d + d * d) + 2 * 201 * U * mel_cpu
    # log10 turns a relative error into an absolute one; the clamps only shrink differences; the final
    # affine map divides by 4; a few ulp for log10 itself and the affine rounding
    floor = torch.maximum(mel_cpu.clamp(min=1e-10), 10 ** (mel_cpu.clamp(min=1e-10).log10().max() - 8))
    bound = d_mel / (floor * math.log(10)) / 4 + 8 * U * exp.abs()
    assert (got.cpu() - exp).abs().le(bound).all(), (got.cpu() - exp).abs().div(bound).max()


def test_fft_tensors_save_and_load():
    spec = torch.fft.rfft(to_n(torch.randn(3, 8)))
    buf = io.BytesIO()
    torch.save(spec, buf)
    buf.seek(0)
    back = torch.load(buf)
    assert back.device == spec.device and torch.equal(back.cpu(), spec.cpu())


@pytest.mark.parametrize("size,step", [(5, 2), (4, 4), (3, 5), (7, 3)])
def test_unfold_backward_matches_cpu(strict, size, step):
    # the overlap-add istft uses, as Tensor.unfold's gradient: each sample sums the windows covering it
    x = torch.randn(3, 23, 2)
    g = torch.randn(3, (23 - size) // step + 1, 2, size)
    expected = torch.ops.aten.unfold_backward(g, [3, 23, 2], 1, size, step)
    got = torch.ops.aten.unfold_backward(to_n(g), [3, 23, 2], 1, size, step)
    # at most ceil(size / step) windows cover a sample: that many fp32 additions, in any order
    torch.testing.assert_close(got.cpu(), expected, atol=2 * -(-size // step) * U * g.abs().max().item(), rtol=0)
    xn = to_n(x).requires_grad_()
    xn.unfold(1, size, step).backward(to_n(g))
    xc = x.clone().requires_grad_()
    xc.unfold(1, size, step).backward(g)
    torch.testing.assert_close(xn.grad.cpu(), xc.grad, atol=2 * -(-size // step) * U * g.abs().max().item(), rtol=0)
