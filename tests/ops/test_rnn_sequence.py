"""Whole ``nn.LSTM`` / ``nn.GRU`` sequences on neuron (``aten::lstm.input`` / ``aten::gru.input`` through
``ops.rnn._LstmSequence`` / ``_FusedSequence``) against the CPU's module on the same weights and inputs, the configurations that keep
PyTorch's composition, and the launches a training step takes.

Tolerances: the device and the CPU's module evaluate the same math with the same roundings in other orders (one
product for all time steps' input projections, one for each weight's gradient over all steps, where the CPU sums
per-step products). Each result is a sum of first-order rounding errors: every step's gate pre-activations are
K-term products (K = input size + hidden size), each off by at most K unit roundoffs of their scale, and a result
collects at most T such steps per layer; a weight gradient is a product over T * B rows. So in fp32 the device is
within ``T * L * (I + H + B) * u`` of the float64 module relative to the result's scale (at least 1), and so is
the CPU; the two are compared with the sum of both bounds. In bf16/fp16 that bound is larger than the values, so
there the device must be as accurate as the CPU's module in the dtype: off the float64 module by at most twice the
CPU's error plus one ulp of the dtype (as the cell tests' module comparison).
"""
import collections

import pytest
import torch

from tests.ops.conftest import to_n
from torchneuron.runtime import profiler

U = {torch.float32: 2.0 ** -24}                                   # fp32 unit roundoff
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
I, H, B = 5, 7, 3


def _modules(cls, layers: int, batch_first: bool, bias: bool, dtype=torch.float32, hidden: int = H, inputs: int = I,
             **kw):
    """(float64 reference, CPU module in ``dtype``, neuron module in ``dtype``) with the same weights."""
    torch.manual_seed(layers * 10 + batch_first * 2 + bias)
    ref = cls(inputs, hidden, num_layers=layers, batch_first=batch_first, bias=bias, **kw).double()
    cpu = cls(inputs, hidden, num_layers=layers, batch_first=batch_first, bias=bias, **kw)
    dev = cls(inputs, hidden, num_layers=layers, batch_first=batch_first, bias=bias, **kw)
    cpu.load_state_dict(ref.state_dict())
    dev.load_state_dict(ref.state_dict())
    return ref, cpu.to(dtype), dev.to(dtype).to("neuron")


def _run(m, x, state, grads, device: str, dtype) -> list[torch.Tensor]:
    """Outputs and every gradient (input, initial states, parameters) of ``m`` on ``device`` in ``dtype``: the
    outputs' gradients are ``grads`` (None: that output unused)."""
    x = x.detach().to(dtype).to(device).clone().requires_grad_()
    state = None if state is None else tuple(s.detach().to(dtype).to(device).clone().requires_grad_() for s in state)
    y, hn = m(x, None if state is None else (state if len(state) == 2 else state[0]))
    outs = [y] + (list(hn) if isinstance(hn, tuple) else [hn])
    used = [(o, g.to(dtype).to(device)) for o, g in zip(outs, grads) if g is not None]
    torch.autograd.backward([o for o, _ in used], [g for _, g in used])
    res = outs + [x.grad] + ([] if state is None else [s.grad for s in state]) + [p.grad for p in m.parameters()]
    return [t.detach().cpu().double() for t in res]


def _compare(cls, layers, batch_first, bias, T, with_state=True, used=(True, True, True), dtype=torch.float32,
             batch=B, hidden=H, inputs=I):
    ref, cpu, dev = _modules(cls, layers, batch_first, bias, dtype, hidden, inputs)
    gen = torch.Generator().manual_seed(T)
    shape = (batch, T, inputs) if batch_first else (T, batch, inputs)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).double()
    nstate = 2 if cls is torch.nn.LSTM else 1
    state = tuple(torch.randn(layers, batch, hidden, generator=gen, dtype=torch.float64).to(dtype).double()
                  for _ in range(nstate)) if with_state else None
    out_shape = (batch, T, hidden) if batch_first else (T, batch, hidden)
    grads = [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).double() if u else None
             for s, u in zip([out_shape] + [(layers, batch, hidden)] * nstate, used)]
    r = _run(ref, x, state, grads, "cpu", torch.float64)
    c = _run(cpu, x, state, grads, "cpu", dtype)
    with profiler.record() as recs:
        d = _run(dev, x, state, grads, "neuron", dtype)
    assert len(r) == len(c) == len(d)
    for k, (rt, ct, dt) in enumerate(zip(r, c, d)):
        assert dt.shape == rt.shape, k
        scale = max(1.0, rt.abs().max().item())
        if dtype == torch.float32:
            bound = T * layers * (inputs + hidden + batch) * U[dtype] * scale
            torch.testing.assert_close(dt, ct, atol=2 * bound, rtol=0, msg=f"result {k}")
        else:
            cpu_err, dev_err = (ct - rt).abs().max().item(), (dt - rt).abs().max().item()
            assert dev_err <= 2 * cpu_err + ULP[dtype] * scale, (k, dev_err, cpu_err)
    return collections.Counter(r.op for r in recs)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_sequence_matches_the_cpu(cls, layers, batch_first, bias, strict):
    _compare(cls, layers, batch_first, bias, T=6)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("T,with_state,used", [
    (1, True, (True, True, True)),       # one time step
    (5, False, (True, True, True)),      # no initial state (the module's zeros)
    (5, True, (True, False, False)),     # only the output used: no gradient reaches h_n, c_n
    (5, True, (False, True, False)),     # only h_n used: none reaches the output
    (5, True, (False, False, True)),     # only c_n used
])
def test_edge_configurations_match_the_cpu(cls, T, with_state, used, strict):
    if cls is torch.nn.GRU:
        used = used[:2]
        if not any(used):
            pytest.skip("the GRU has no c_n")
    _compare(cls, 2, True, True, T, with_state, used)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch_first", [False, True])
def test_low_precision_as_accurate_as_the_cpu(cls, dtype, batch_first, strict):
    _compare(cls, 2, batch_first, True, T=6, dtype=dtype)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("batch,hidden,one_launch", [
    (3, 7, True),          # the LSTM: one launch per layer; the GRU: the hidden-state product inside each cell's launch
    (1, 1, True),          # the smallest layer
    (128, 4, True),        # the batch fills the 128 partitions
    (4, 128, True),        # the hidden size fills one block of 128 columns (several blocks of time steps each way)
    (129, 4, False),       # a batch beyond one block of 128 rows: a product and a cell per step
    (2, 129, False),       # a hidden size beyond one block of 128 columns (the GRU's 3 x 129 gates fit a bank)
])
def test_recurrence_in_one_launch_where_it_fits(cls, batch, hidden, one_launch, strict):
    """Where the batch and the gates fit one kernel's tiles (batch <= 128, hidden <= 128 so that the gates fit a
    PSUM bank) an LSTM layer's recurrence is one launch forward and one backward (the input products in them where
    they fit), a GRU step one launch each way; else a product besides each cell. The results match the CPU either
    way."""
    T, layers = 3, 2
    ops = _compare(cls, layers, False, True, T, batch=batch, hidden=hidden)
    products = ops["aten::mm"] + ops["aten::addmm"]
    if cls is torch.nn.LSTM and one_launch:
        from torchneuron.kernels.rnn_sequence import projection_fits
        assert ops["aten::lstm"] == ops["aten::lstm_backward"] == layers, ops
        # an input product only for a layer whose input does not join the hidden product (hidden 128 here)
        assert products == (0 if projection_fits(hidden, max(I, hidden)) else layers), ops
        assert ops["aten::_thnn_fused_lstm_cell"] == 0, ops
        return
    # per layer the input projection and the three weight-gradient products; per step two more without fusion
    assert products == layers * 4 + (0 if one_launch else 2 * T * layers), ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_first", [False, True])
def test_lstm_sequence_over_several_blocks_of_steps_matches_the_cpu(dtype, batch_first, strict):
    """A sequence longer than one block of time steps the sequence kernels keep on chip (hidden 32: 23 steps a
    block forward, 10 backward): the states and their gradients carried across the blocks."""
    from torchneuron.kernels.rnn_sequence import BWD_STEP_WORDS, FWD_STEP_WORDS, _steps_per_block
    T, hidden = 25, 32
    assert _steps_per_block(hidden, FWD_STEP_WORDS) < T and 2 * _steps_per_block(hidden, BWD_STEP_WORDS) < T
    ops = _compare(torch.nn.LSTM, 2, batch_first, True, T, dtype=dtype, hidden=hidden)
    assert ops["aten::lstm"] == ops["aten::lstm_backward"] == 2, ops


@pytest.mark.parametrize("dtype,batch_first,used", [
    (torch.float32, False, (True, True, True)),
    (torch.float32, True, (True, True, True)),
    (torch.bfloat16, True, (True, True, True)),
    (torch.float32, True, (False, True, False)),      # only h_n used: the launches hand on h_n's gradient alone
    (torch.float32, True, (False, False, True)),      # only c_n used
])
def test_lstm_sequence_longer_than_one_launch_matches_the_cpu(dtype, batch_first, used, monkeypatch, strict):
    """A sequence longer than SEQUENCE_STEPS runs as several launches a layer each way (4 + 4 + 2 steps here), the
    states and their gradients handed from one launch to the next, W_hh's and the biases' gradients summed."""
    import torchneuron.ops.rnn as rnn
    monkeypatch.setattr(rnn, "SEQUENCE_STEPS", 4)
    ops = _compare(torch.nn.LSTM, 2, batch_first, True, 10, used=used, dtype=dtype)
    assert ops["aten::lstm"] == ops["aten::lstm_backward"] == 2 * 3, ops


@pytest.mark.parametrize("inputs,in_forward,in_backward", [
    (119, True, True),      # hidden + input + 2 = 128 contraction rows: the projection in the forward's product
    (120, False, True),
    (504, False, True),     # hidden + input + 1 = 512 columns: x_t beside h_t in the backward's PSUM row
    (505, False, False),
])
def test_lstm_input_products_in_the_launches_where_they_fit(inputs, in_forward, in_backward, strict):
    """The input projection (and the biases) join each forward step's hidden product while [h_t; x_t; 1; 1] fits
    the 128 contraction rows, else one product for all steps; W_ih's gradient and the input's are formed in the
    backward's launch while x_t fits beside h_t in a PSUM row (hidden + input + 1 <= 512 fp32 columns), else as
    two products of the stored gate gradients. The results match the CPU either way."""
    from torchneuron.kernels.rnn_sequence import input_fits, projection_fits
    assert projection_fits(H, inputs) == in_forward and input_fits(H, inputs) == in_backward
    ops = _compare(torch.nn.LSTM, 1, True, True, 4, inputs=inputs)
    assert ops["aten::mm"] + ops["aten::addmm"] == (0 if in_forward else 1) + (0 if in_backward else 2), ops


def test_lstm_initial_states_as_strided_views_match_the_cpu(strict):
    """Initial states that are permuted views ([batch, layers, hidden] storage seen as [layers, batch, hidden]):
    the states read through their strides, h_n, c_n and the states' gradients made contiguous, all as the CPU's."""
    ref, cpu, dev = _modules(torch.nn.LSTM, 2, False, True)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, B, I, generator=gen)
    h, c = (torch.randn(B, 2, H, generator=gen).transpose(0, 1) for _ in range(2))
    results = []
    for m, device in ((cpu, "cpu"), (dev, "neuron")):
        hd, cd = (torch.empty(B, 2, H, device=device).transpose(0, 1).copy_(t).requires_grad_() for t in (h, c))
        assert not hd.is_contiguous()
        y, (hn, cn) = m(x.to(device), (hd, cd))
        (y.sum() + 2 * hn.sum() + 3 * cn.sum()).backward()
        results.append([t.detach().cpu() for t in (y, hn, cn, hd.grad, cd.grad)])
    bound = 4 * 2 * (I + H + B) * U[torch.float32]
    for ct, dt in zip(*results):
        torch.testing.assert_close(dt, ct, atol=2 * bound, rtol=0)


def test_lstm_sequence_saturates_and_propagates_nan_as_the_cpu(strict):
    """An infinite input saturates the gates (finite states), a NaN input poisons its batch row from its step on
    and no other row: outputs and states NaN exactly where the CPU module's are, equal elsewhere."""
    ref, cpu, dev = _modules(torch.nn.LSTM, 2, False, True)
    x = torch.randn(6, B, I, generator=torch.Generator().manual_seed(8))
    x[1, 0, 2], x[2, 1, 0], x[3, 2, 4] = float("inf"), -float("inf"), float("nan")
    c = [cpu(x)[0], *cpu(x)[1]]
    d = [t.cpu() for t in (dev(to_n(x))[0], *dev(to_n(x))[1])]
    assert torch.isfinite(c[0][:, :2]).all() and torch.isnan(c[0][3:, 2]).all()
    bound = 6 * 2 * (I + H + B) * U[torch.float32]
    for ct, dt in zip(c, d):
        torch.testing.assert_close(dt, ct, atol=2 * bound, rtol=0, equal_nan=True)


def test_fp32_hidden_product_in_the_launch_equals_the_two_launch_path(monkeypatch, strict):
    """In fp32 the GRU's in-launch products take the product kernel's operands and contraction order and the
    addend is added to the fp32 sum as ``addmm`` adds it: outputs and gradients equal the two-launch path's bit
    for bit."""
    import torchneuron.ops.rnn as rnn
    results = []
    for fits in (rnn.fused_product_fits, lambda *shape: False):
        monkeypatch.setattr(rnn, "fused_product_fits", fits)
        ref, _, dev = _modules(torch.nn.GRU, 2, True, True)
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(B, 6, I, generator=gen)
        grads = [torch.randn(B, 6, H, generator=gen)] + [torch.randn(2, B, H, generator=gen)]
        results.append(_run(dev, x, None, grads, "neuron", torch.float32))
    for k, (fused, two_launch) in enumerate(zip(*results)):
        assert torch.equal(fused, two_launch), k


def _step_ops(m, x) -> collections.Counter:
    with profiler.record() as recs:
        m(x)[0].sum().backward()
    return collections.Counter(r.op for r in recs)


@pytest.mark.parametrize("layers,T", [(2, 9), (1, 4)])
def test_training_step_launches(layers, T, strict):
    """Forward: per layer one launch of the recurrence (the input projection in it). Backward: per layer one launch
    of the recurrence's backward (every weight's gradient and the layer input's formed in it); the module's two zero
    initial states and the summed output's gradient fill besides. Where
    PyTorch's composition takes 11 launches a step and layer (the step's 2 products, a product per weight and one
    for the input gradient, the engine's additions of each weight's per-step gradients)."""
    m = torch.nn.LSTM(6, 12, num_layers=layers, batch_first=True).to("neuron")
    x = to_n(torch.randn(4, T, 6)).requires_grad_()
    ops = _step_ops(m, x)
    assert ops["aten::lstm"] == ops["aten::lstm_backward"] == layers, ops
    assert ops["aten::mm"] + ops["aten::addmm"] == 0, ops
    assert sum(ops.values()) <= layers * 2 + 2 + 2, ops


def test_double_backward_matches_the_cpu(strict):
    """A gradient built with ``create_graph`` (PyTorch's composition rerun and differentiated): the gradient of a
    function of the input gradient, against the CPU."""
    results = []
    for device in ("cpu", "neuron"):
        torch.manual_seed(1)
        m = torch.nn.LSTM(3, 4, num_layers=2).double().float().to(device)
        x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
        (gx,) = torch.autograd.grad(m(x)[0].pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        results.append([gx.detach().cpu()] + [p.grad.cpu() for p in m.parameters()])
    for c, d in zip(*results):
        torch.testing.assert_close(d, c, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_outputs_modified_in_place_before_the_backward(cls, strict):
    """The outputs may be modified in place before the backward (none of them is saved), as PyTorch's composition
    for accelerators allows (the CPU's oneDNN layer saves its output: the CPU reference modifies out of place)."""
    results = []
    for device in ("cpu", "neuron"):
        torch.manual_seed(3)
        m = cls(I, H, num_layers=2).to(device)
        x = torch.randn(4, B, I, generator=torch.Generator().manual_seed(4)).to(device).requires_grad_()
        y, hn = m(x)
        h = hn[0] if isinstance(hn, tuple) else hn
        if device == "cpu":
            y, h = y * 2, h + 1
        else:
            y.mul_(2)
            h.add_(1)
        (y.sum() + h.pow(2).sum()).backward()
        results.append([y.detach().cpu(), x.grad.cpu()] + [p.grad.cpu() for p in m.parameters()])
    for c, d in zip(*results):
        torch.testing.assert_close(d, c, atol=1e-5, rtol=1e-5)


# ---- configurations that keep PyTorch's composition ---------------------------------------------------------

def _fused(m, *args) -> bool:
    """Whether the module's forward took the whole-sequence path (one input product per layer, not one per step)."""
    with profiler.record() as recs:
        m(*args)
    T = args[0].shape[0] if args[0].dim() > 1 else 1
    return sum(r.op == "aten::mm" for r in recs) < 2 * T * m.num_layers


@pytest.mark.parametrize("kw", [dict(bidirectional=True), dict(proj_size=3), dict(dropout=0.5)])
def test_other_configurations_take_the_composition(kw):
    torch.manual_seed(0)
    cpu = torch.nn.LSTM(I, H, num_layers=2, **kw)
    dev = torch.nn.LSTM(I, H, num_layers=2, **kw).to("neuron")
    dev.load_state_dict(cpu.state_dict())
    x = torch.randn(4, B, I)
    assert not _fused(dev, to_n(x))
    if "dropout" in kw:          # random masks: the evaluation mode (no dropout) takes the whole-sequence path
        cpu.eval()
        dev.eval()
        assert _fused(dev, to_n(x))
    xc, xd = x.clone().requires_grad_(), to_n(x).requires_grad_()
    yc, yd = cpu(xc)[0], dev(xd)[0]
    yc.sum().backward()
    yd.sum().backward()
    torch.testing.assert_close(yd.cpu(), yc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, atol=1e-5, rtol=1e-5)
    for p, q in zip(cpu.parameters(), dev.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_float64_unbatched_and_packed_inputs_match_the_cpu(cls):
    torch.manual_seed(0)
    cpu = cls(I, H, num_layers=2)
    dev = cls(I, H, num_layers=2).to("neuron")
    dev.load_state_dict(cpu.state_dict())
    x = torch.randn(4, B, I)
    unbatched = cpu(x[:, 0])[0], dev(to_n(x[:, 0]))[0]
    packed_in = torch.nn.utils.rnn.pack_padded_sequence(x, [4, 3, 1])
    packed = cpu(packed_in)[0].data, dev(packed_in.to("neuron"))[0].data
    double = cpu.double()(x.double())[0], dev.double()(to_n(x.double()))[0]
    for c, d in (unbatched, packed, double):
        torch.testing.assert_close(d.cpu(), c, atol=1e-5, rtol=1e-5)


def test_mismatched_weights_raise_what_the_composition_raises():
    """A weight of the wrong shape or dtype is not taken by the whole-sequence path: PyTorch's composition raises
    its products' errors (the CPU raises for the dtype too; its oneDNN path does not check the shape)."""
    x, h = torch.randn(3, 2, 4), torch.zeros(1, 2, 5)
    good = [torch.randn(20, 4), torch.randn(20, 5), torch.randn(20), torch.randn(20)]
    with pytest.raises(RuntimeError):
        torch.ops.aten.lstm.input(x, [h, h], [good[0].double()] + good[1:], True, 1, 0.0, True, False, False)
    for params, message in (([torch.randn(20, 3)] + good[1:], "cannot be multiplied"),
                            ([good[0].double()] + good[1:], "same dtype")):
        with pytest.raises(RuntimeError, match=message):
            torch.ops.aten.lstm.input(to_n(x), [to_n(h), to_n(h)], [to_n(p) for p in params], True, 1, 0.0, True,
                                      False, False)
