"""The inference fast path of nn.MultiheadAttention / nn.TransformerEncoderLayer (eval, no autograd) runs
on the device in strict mode and matches the CPU's fused kernels; _masked_softmax keeps the CPU's mask
rules and errors."""
import copy
import warnings

import pytest
import torch

from tests.ops.conftest import to_n

warnings.filterwarnings("ignore", message=".*Converting mask without torch.bool.*")
TOL = {"atol": 1e-4, "rtol": 1e-4, "equal_nan": True}


def _n(kw: dict) -> dict:
    return {k: to_n(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 32)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 5:], pad[1, 3:] = True, True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(7)
    return x, pad, causal


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_fast_path(norm_first, activation, strict):
    x, pad, causal = _inputs()
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0, norm_first=norm_first,
                                             activation=activation).eval()
    dev = copy.deepcopy(layer).to("neuron")
    with torch.no_grad():
        for kw in ({}, {"src_key_padding_mask": pad}, {"src_mask": causal, "is_causal": True},
                   {"src_mask": causal.isinf()}):
            torch.testing.assert_close(dev(to_n(x), **_n(kw)).cpu(), layer(x, **kw), **TOL)


def test_multihead_attention_fast_path(strict):
    x, pad, causal = _inputs()
    y = torch.randn(3, 5, 32)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    dev = copy.deepcopy(mha).to("neuron")
    cases = [((x, x, x), {"key_padding_mask": pad}), ((x, x, x), {}), ((x, x, x), {"average_attn_weights": False}),
             ((x, y, y), {}), ((x, x, x), {"need_weights": False}), ((x, x, x), {"attn_mask": causal.isinf()})]
    with torch.no_grad():
        for args, kw in cases:
            want = mha(*args, **kw)
            got = dev(*(to_n(a) for a in args), **_n(kw))
            torch.testing.assert_close(got[0].cpu(), want[0], **TOL)
            if want[1] is not None:
                torch.testing.assert_close(got[1].cpu(), want[1], **TOL)


@pytest.mark.parametrize("mask_type", [0, 1, 2])
def test_masked_softmax_mask_types(mask_type, strict):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 5)
    mask = {0: torch.rand(5, 5) > 0.6, 1: torch.rand(2, 5) > 0.6, 2: torch.rand(2, 3, 5, 5) > 0.6}[mask_type]
    mask[..., 0] = True if mask_type != 1 else mask[..., 0]
    for dim in (3, 2):
        want = torch._masked_softmax(x, mask, dim, mask_type)
        torch.testing.assert_close(torch._masked_softmax(to_n(x), to_n(mask), dim, mask_type).cpu(), want, **TOL)


def test_masked_softmax_errors_match_cpu():
    x = torch.randn(2, 3, 5, 5)
    for mask, mask_type in ((torch.zeros(2, 4, dtype=torch.bool), 1), (torch.zeros(4, 5, dtype=torch.bool), 0),
                            (torch.zeros(2, 3, 5, dtype=torch.bool), 2), (torch.zeros(5, 5), 0)):
        with pytest.raises(RuntimeError) as cpu:
            torch._masked_softmax(x, mask, 3, mask_type)
        with pytest.raises(RuntimeError) as dev:
            torch._masked_softmax(to_n(x), to_n(mask), 3, mask_type)
        assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("final_norm", [False, True])
def test_encoder_with_padding_mask_computes_the_nested_path_dense(final_norm, strict):
    # PyTorch packs the batch into a nested tensor here (padded outputs come back as zeros); the device
    # has none, so the same result is computed dense
    x, pad, _ = _inputs()
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    enc = torch.nn.TransformerEncoder(layer, 2, norm=torch.nn.LayerNorm(32) if final_norm else None,
                                      enable_nested_tensor=True).eval()
    dev = copy.deepcopy(enc).to("neuron")
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=pad)
        torch.testing.assert_close(dev(to_n(x), src_key_padding_mask=to_n(pad)).cpu(), want, **TOL)
    assert dev.use_nested_tensor and (dev.norm is not None) == final_norm      # the module is left as it was
    torch.testing.assert_close(dev(to_n(x), src_key_padding_mask=to_n(pad)).detach().cpu(),
                               enc(x, src_key_padding_mask=pad).detach(), **TOL)   # (autograd on: no fast path)
