"""The SBUF-im2col convolution kernels against float64 CPU convolutions of the same (dtype-rounded) values.

Tolerance as in test_conv.py: products of dtype operands are exact in fp32 and accumulate in fp32 over K terms
(C * KH * KW for the output, N * OH * OW for the weight gradient), then round once to the output dtype."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight

from torchneuron.kernels.conv import dims_of
from torchneuron.kernels.conv_im2col import (COLS_BYTES, conv2d_im2col_backward_kernel, conv2d_im2col_kernel,
                                             conv2d_im2col_wgrad_kernel, im2col_fits)
from tests.kernels.test_conv import DTYPES, GRAD_DTYPES, case, grad_case, within

# (N, C, H, W, O, kh, kw, padding, dilation): stride 1, one group, C * kh * kw <= 128
CASES = {
    "stem 3x3": (16, 3, 16, 16, 8, 3, 3, (1, 1), (1, 1)),           # 2 batches of transposes, a partial one
    "small CNN's second conv": (16, 8, 8, 8, 16, 3, 3, (1, 1), (1, 1)),
    "valid, no padding": (2, 5, 7, 9, 6, 3, 2, (0, 0), (1, 1)),
    "dilated, padding beyond a window": (3, 4, 9, 8, 5, 3, 3, (3, 2), (2, 2)),
    "kernel > input": (2, 4, 3, 3, 4, 5, 5, (2, 2), (1, 1)),
    "1x1, 128 rows": (2, 128, 5, 6, 7, 1, 1, (0, 0), (1, 1)),
    "1-D as H=1": (2, 5, 1, 40, 7, 1, 5, (0, 2), (1, 1)),
    "image groups": (5, 2, 40, 50, 3, 3, 3, (1, 1), (1, 1)),       # 4 images per group of patches (fp32)
    "output tiles": (2, 3, 6, 5, 130, 3, 3, (1, 1), (1, 1)),        # forward only: O > 128
}
WGRAD = [n for n in CASES if n != "output tiles"]


def _case(name, dtype, bias=False):
    N, C, H, W, O, kh, kw, p, d = CASES[name]
    return (N, C, H, W, O, kh, kw, p, d), case(N, C, H, W, O, kh, kw, (1, 1), p, d, 1, dtype, bias=bias)


def test_cases_take_the_paths_they_name():
    for name, (N, C, H, W, O, kh, kw, p, d) in CASES.items():
        dims = (dims_of(H, kh, 1, (p[0], p[0]), d[0]), dims_of(W, kw, 1, (p[1], p[1]), d[1]))
        assert im2col_fits(C, O, 1, dims, 4, wgrad=name in WGRAD), name
    dims = (dims_of(40, 3, 1, (1, 1), 1), dims_of(50, 3, 1, (1, 1), 1))
    assert 1 < COLS_BYTES // (40 * 50 * 4) < 5                         # "image groups": several groups at fp32
    assert not im2col_fits(15, 8, 1, dims, 4)                          # 135 patch rows
    assert not im2col_fits(4, 8, 2, dims, 4)                           # groups
    assert not im2col_fits(4, 8, 1, (dims_of(40, 3, 2, (1, 1), 1), dims[1]), 4)   # stride 2
    assert not im2col_fits(4, 130, 1, dims, 4, wgrad=True)             # weight gradient of > 128 outputs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_forward(name, dtype):
    (N, C, H, W, O, kh, kw, p, d), (x, w, b, dims) = _case(name, dtype, bias=name.startswith("s"))
    out = conv2d_im2col_kernel(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), dims=dims)
    ref = F.conv2d(x, w, b, 1, p, d)
    mag = F.conv2d(x.abs(), w.abs(), None if b is None else b.abs(), 1, p, d)
    within(out, ref, mag, C * kh * kw + 1, dtype)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("name", WGRAD)
def test_weight_gradient(name, dtype):
    (N, C, H, W, O, kh, kw, p, d), (x, w, _, dims) = _case(name, dtype)
    gy = torch.randn(N, O, dims[0].out, dims[1].out).to(dtype).double()
    out = conv2d_im2col_wgrad_kernel(x.to(dtype), gy.to(dtype), dims=dims, kernel=(kh, kw))
    within(out, conv2d_weight(x, w.shape, gy, 1, p, d), conv2d_weight(x.abs(), w.shape, gy.abs(), 1, p, d),
           N * dims[0].out * dims[1].out, dtype)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("name", ["stem 3x3", "small CNN's second conv", "1-D as H=1"])
def test_both_gradients_in_one_launch(name, dtype):
    (N, C, H, W, O, kh, kw, p, d), (x, w, _, dims) = _case(name, dtype)
    gy, gdims = grad_case(N, O, H, W, p, dims, dtype)
    gx, gw = conv2d_im2col_backward_kernel(x.to(dtype), gy.to(dtype), w.to(dtype), dims=dims, gdims=gdims)
    within(gx, conv2d_input(x.shape, w, gy, 1, p, d), conv2d_input(x.shape, w.abs(), gy.abs(), 1, p, d),
           O * kh * kw, dtype)
    within(gw, conv2d_weight(x, w.shape, gy, 1, p, d), conv2d_weight(x.abs(), w.shape, gy.abs(), 1, p, d),
           N * dims[0].out * dims[1].out, dtype)


@pytest.mark.parametrize("name", ["stem 3x3", "dilated, padding beyond a window", "image groups"])
def test_non_finite_values_reach_the_sums_that_read_them(name):
    # an inf / NaN of x reaches exactly the outputs and weight entries whose sums read it, padding counted as the
    # zeros it is (as the CPU's im2col does), in the first and last columns and rows and in the last image
    (N, C, H, W, O, kh, kw, p, d), (x, w, _, dims) = _case(name, torch.float32)
    x[0, 0, :, 0], x[N - 1, C - 1, H - 1, W // 2], x[N // 2, 0, H // 2, W - 1] = float("inf"), float("nan"), -float("inf")
    gy = torch.randn(N, O, dims[0].out, dims[1].out).double()
    for got, ref in ((conv2d_im2col_kernel(x.float(), w.float(), dims=dims), F.conv2d(x, w, None, 1, p, d)),
                     (conv2d_im2col_wgrad_kernel(x.float(), gy.float(), dims=dims, kernel=(kh, kw)),
                      conv2d_weight(x, w.shape, gy, 1, p, d))):
        for f in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(f(got), f(ref.float()))
        assert (got.isfinite() | ~ref.isfinite()).all()
