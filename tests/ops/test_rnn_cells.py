"""The fused LSTM/GRU cell ops (one kernel launch each) against float64 references of their math, the modules
built on them against the CPU's unfused ``nn.LSTM``/``nn.GRU``, and their argument errors.

Tolerances: the kernels compute in fp32 from inputs exact in their dtype and round each result once, so a result
is within half an ulp of the dtype (plus a few fp32 ulps of the sigmoid/tanh/product chain) of the float64 value:
one ulp of the dtype (``EPS``) relative to the result's magnitude, and as absolute slack for results near 0 (every
value here is an activation or a product of O(1) terms, so its error is at most EPS times O(1)). A bias gradient
sums N rounded gate gradients: its error is at most EPS/2 * sum |d| for their roundings plus EPS/2 * |sum| for its
own.
"""
import pytest
import torch

from tests.ops.conftest import to_n
from torchneuron.runtime import profiler

EPS = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # fp32: 16 fp32 ulps
DTYPES = list(EPS)


def _ref_lstm(ig, hg, cx, b1, b2):
    gates = ig + hg + (b1 + b2 if b1 is not None else 0)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    return o * cy.tanh(), cy, torch.cat([i, f, g, o], 1)


def _ref_lstm_backward(ghy, gcy, cx, cy, ws):
    i, f, g, o = ws.chunk(4, 1)
    t = cy.tanh()
    ghy = torch.zeros_like(cx) if ghy is None else ghy
    gc = ghy * o * (1 - t * t) + (0 if gcy is None else gcy)
    d = torch.cat([gc * g * i * (1 - i), gc * cx * f * (1 - f), gc * i * (1 - g * g), ghy * t * o * (1 - o)], 1)
    return d, gc * f


def _ref_gru(ig, hg, hx, b1, b2):
    if b1 is not None:
        ig, hg = ig + b1, hg + b2
    (ir, iz, i_n), (hr, hz, hn) = ig.chunk(3, 1), hg.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (i_n + r * hn).tanh()
    return n + z * (hx - n), torch.cat([r, z, n, hx, hn], 1)


def _ref_gru_backward(ghy, ws):
    r, z, n, hx, hn = ws.chunk(5, 1)
    d_n = ghy * (1 - z) * (1 - n * n)
    d_z = ghy * (hx - n) * z * (1 - z)
    d_r = d_n * hn * r * (1 - r)
    return torch.cat([d_r, d_z, d_n], 1), torch.cat([d_r, d_z, d_n * r], 1), ghy * z


def _close(dev: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert dev.dtype == dtype and dev.shape == ref.shape
    eps = EPS[dtype]
    torch.testing.assert_close(dev.cpu().double(), ref, atol=eps, rtol=eps)


def _bias_close(dev: torch.Tensor, d_rounded: torch.Tensor, dtype: torch.dtype) -> None:
    """A bias gradient against the float64 batch sum of the rounded gate gradients it sums (see the docstring)."""
    ref = d_rounded.sum(0)
    bound = EPS[dtype] / 2 * (d_rounded.abs().sum(0) + ref.abs()) + 1e-30
    err = (dev.cpu().double() - ref).abs()
    assert dev.dtype == dtype and bool((err <= bound).all()), f"bias gradient off by {(err / bound).max():.2f} bounds"


def _launches(fn):
    with profiler.record() as recs:
        out = fn()
    return out, [r.name for r in recs]


def _rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _cell_inputs(gates: int, N: int, H: int, dtype: torch.dtype, bias: bool, gen: torch.Generator):
    """(input gates, hidden gates, state, input bias, hidden bias) of a cell on the CPU, and their neuron copies."""
    ts = (_rand(N, gates * H, dtype=dtype, gen=gen, scale=2), _rand(N, gates * H, dtype=dtype, gen=gen, scale=2),
          _rand(N, H, dtype=dtype, gen=gen))
    ts += (_rand(gates * H, dtype=dtype, gen=gen), _rand(gates * H, dtype=dtype, gen=gen)) if bias else (None, None)
    return ts, [None if t is None else to_n(t) for t in ts]



def _forward_checked(gates: int, op, kernel: str, ref, N: int, H: int, dtype: torch.dtype, bias: bool,
                     gen: torch.Generator) -> tuple:
    """A cell's forward on the device from ``_cell_inputs``: one launch of ``kernel``, each output against ``ref``
    on the float64 inputs; returns (CPU inputs, device arguments, device outputs)."""
    cpu, args = _cell_inputs(gates, N, H, dtype, bias, gen)
    outs, names = _launches(lambda: op(*args))
    assert names == [kernel]
    for dev, want in zip(outs, ref(*(None if t is None else t.double() for t in cpu))):
        _close(dev, want, dtype)
    return cpu, args, outs

# N, H: one row block and a partial column block; several row blocks and column blocks (128 + 2 of each)
SHAPES = [(4, 12), (130, 130)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("N,H", SHAPES)
def test_lstm_cell_forward_and_backward(dtype, bias, N, H, strict):
    gen = torch.Generator().manual_seed(N + H)
    (_, _, cx, _, _), args, (hy, cy, ws) = _forward_checked(4, torch.ops.aten._thnn_fused_lstm_cell, "lstm_cell_kernel",
                                                            _ref_lstm, N, H, dtype, bias, gen)
    # the backward from this step's own saved state; grad_hy, grad_cy or both
    grads = _rand(N, H, dtype=dtype, gen=gen), _rand(N, H, dtype=dtype, gen=gen)
    for given in ((True, True), (True, False), (False, True)):
        ghy, gcy = (g if k else None for g, k in zip(grads, given))
        dev_args = [None if t is None else to_n(t) for t in (ghy, gcy)] + [args[2], cy, ws]
        res, names = _launches(lambda: torch.ops.aten._thnn_fused_lstm_cell_backward_impl(*dev_args, bias))
        assert names == ["lstm_cell_backward_kernel"]
        d, dcx = _ref_lstm_backward(*(None if t is None else t.cpu().double() for t in (ghy, gcy, cx, cy, ws)))
        _close(res[0], d, dtype)
        _close(res[1], dcx, dtype)
        if bias:
            _bias_close(res[2], res[0].cpu().double(), dtype)
        else:
            assert res[2] is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("N,H", SHAPES)
def test_gru_cell_forward_and_backward(dtype, bias, N, H, strict):
    gen = torch.Generator().manual_seed(N + H)
    _, _, (hy, ws) = _forward_checked(3, torch.ops.aten._thnn_fused_gru_cell, "gru_cell_kernel", _ref_gru, N, H, dtype,
                                      bias, gen)
    ghy = _rand(N, H, dtype=dtype, gen=gen)
    res, names = _launches(lambda: torch.ops.aten._thnn_fused_gru_cell_backward(to_n(ghy), ws, bias))
    assert names == ["gru_cell_backward_kernel"]
    for dev, ref in zip(res, _ref_gru_backward(ghy.double(), ws.cpu().double())):
        _close(dev, ref, dtype)
    if bias:
        _bias_close(res[3], res[0].cpu().double(), dtype)
        _bias_close(res[4], res[1].cpu().double(), dtype)
    else:
        assert res[3] is None and res[4] is None


def test_strided_operands_are_read_in_place(strict):
    """A step's slice of a [N, T, H] gradient and a transposed state are read through their strides: one launch,
    no copy, the same results as contiguous operands."""
    gen = torch.Generator().manual_seed(5)
    N, T, H = 3, 4, 6
    ig, hg, cx = _rand(N, 4 * H, dtype=torch.float32, gen=gen), _rand(N, 4 * H, dtype=torch.float32, gen=gen), \
        _rand(H, N, dtype=torch.float32, gen=gen).t()
    big = to_n(_rand(N, T, H, dtype=torch.float32, gen=gen))
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(to_n(ig), to_n(hg), to_n(cx))
    _close(hy, _ref_lstm(ig.double(), hg.double(), cx.double(), None, None)[0], torch.float32)
    res, names = _launches(lambda: torch.ops.aten._thnn_fused_lstm_cell_backward_impl(big[:, 1], None, to_n(cx), cy,
                                                                                       ws, True))
    assert names == ["lstm_cell_backward_kernel"]
    d, dcx = _ref_lstm_backward(big[:, 1].cpu().double(), None, cx.double(), cy.cpu().double(), ws.cpu().double())
    _close(res[0], d, torch.float32)
    _close(res[1], dcx, torch.float32)
    grad, names = _launches(lambda: torch.ops.aten._thnn_fused_gru_cell_backward(big[:, 2], to_n(
        torch.ones(N, 5 * H)), False))
    assert names == ["gru_cell_backward_kernel"]


def test_lstm_backward_without_gradients_returns_nothing():
    x = to_n(torch.ones(2, 3))
    assert torch.ops.aten._thnn_fused_lstm_cell_backward_impl(None, None, x, x, to_n(torch.ones(2, 12)), True) == \
        (None, None, None)


def test_float64_cells_match_the_reference():
    """float64 (accepted by the CUDA cells; not an engine dtype) runs composed of element-wise ops."""
    gen = torch.Generator().manual_seed(3)
    ig, hg, cx = (_rand(2, 8, dtype=torch.float64, gen=gen) for _ in range(3))
    cx = cx[:, :2]
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(to_n(ig), to_n(hg), to_n(cx))
    for dev, ref in zip((hy, cy, ws), _ref_lstm(ig, hg, cx, None, None)):
        torch.testing.assert_close(dev.cpu(), ref)
    d, dcx, _ = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(hy, None, to_n(cx), cy, ws, False)
    for dev, ref in zip((d, dcx), _ref_lstm_backward(hy.cpu(), None, cx, cy.cpu(), ws.cpu())):
        torch.testing.assert_close(dev.cpu(), ref)
    hy, ws = torch.ops.aten._thnn_fused_gru_cell(to_n(ig[:, :6]), to_n(hg[:, :6]), to_n(cx))
    for dev, ref in zip((hy, ws), _ref_gru(ig[:, :6], hg[:, :6], cx, None, None)):
        torch.testing.assert_close(dev.cpu(), ref)
    res = torch.ops.aten._thnn_fused_gru_cell_backward(hy, ws, False)
    for dev, ref in zip(res, _ref_gru_backward(hy.cpu(), ws.cpu())):
        torch.testing.assert_close(dev.cpu(), ref)


def _bad_calls():
    f, h = torch.float32, torch.float16
    z = lambda *s, dtype=f: torch.zeros(*s, dtype=dtype)  # noqa: E731
    lstm, gru = torch.ops.aten._thnn_fused_lstm_cell, torch.ops.aten._thnn_fused_gru_cell
    lstm_b, gru_b = torch.ops.aten._thnn_fused_lstm_cell_backward_impl, torch.ops.aten._thnn_fused_gru_cell_backward
    return [  # (op, args, the error PyTorch raises)
        (lstm, (z(2, 8, 1), z(2, 8, 1), z(2, 2)), RuntimeError),              # 3-D gates
        (lstm, (z(2, 8), z(2, 4), z(2, 2)), RuntimeError),                    # gate sizes differ
        (lstm, (z(2, 8), z(2, 8), z(2, 3)), RuntimeError),                    # state of the wrong size
        (lstm, (z(2, 8), z(2, 8), z(2, 2), z(7), z(7)), RuntimeError),         # bias of the wrong width
        (lstm, (z(2, 8), z(2, 8), z(2, 2), z(8), z(4)), RuntimeError),         # biases differ
        (lstm, (z(2, 8), z(2, 8), z(2, 2, dtype=h)), RuntimeError),            # mixed dtypes
        (lstm, (z(2, 8, dtype=torch.int32),) * 2 + (z(2, 2, dtype=torch.int32),), NotImplementedError),
        (gru, (z(2, 6), z(2, 6), z(2, 3)), RuntimeError),
        (gru, (z(2, 6), z(2, 6, dtype=h), z(2, 2)), RuntimeError),
        (lstm_b, (z(2, 2), None, z(2, 2), z(2, 3), z(2, 8), True), RuntimeError),   # cy of the wrong size
        (lstm_b, (z(2, 2), None, z(2, 2), z(2, 2), z(2, 7), True), RuntimeError),   # workspace of the wrong size
        (lstm_b, (z(2, 2, 1), None, z(2, 2), z(2, 2), z(2, 8), True), RuntimeError),
        (gru_b, (z(2, 2), z(2, 9), True), RuntimeError),
        (gru_b, (z(2), z(2, 5), True), RuntimeError),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_arguments_raise_what_pytorch_raises(case):
    op, args, error = _bad_calls()[case]
    if op in (torch.ops.aten._thnn_fused_lstm_cell, torch.ops.aten._thnn_fused_lstm_cell_backward_impl) and \
            error is RuntimeError and not any(t.dtype == torch.float16 for t in args if isinstance(t, torch.Tensor)):
        with pytest.raises(error):   # PyTorch's own size checks (its meta kernel; the CPU has none of these ops)
            op(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in args))
    with pytest.raises(error):
        op(*(to_n(t) if isinstance(t, torch.Tensor) else t for t in args))


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_low_precision_modules_as_accurate_as_the_cpu(cls, dtype, bias, strict):
    """bf16/fp16 ``nn.LSTM``/``nn.GRU`` outputs and gradients: off the float64 module by at most twice what the
    CPU's unfused module in that dtype is (it rounds every intermediate; the fused cells round each result once)
    plus one ulp of the dtype."""
    torch.manual_seed(0)
    ref = cls(5, 8, num_layers=2, batch_first=True, bias=bias).double()
    cpu, dev = cls(5, 8, num_layers=2, batch_first=True, bias=bias), cls(5, 8, num_layers=2, batch_first=True,
                                                                         bias=bias)
    cpu.load_state_dict(ref.state_dict())
    dev.load_state_dict(ref.state_dict())
    cpu, dev = cpu.to(dtype), dev.to(dtype).to("neuron")
    x, g = torch.randn(3, 6, 5, dtype=torch.float64), torch.randn(3, 6, 8, dtype=torch.float64)
    x, g = x.to(dtype).double(), g.to(dtype).double()   # the same inputs for every module
    outs = {}
    for name, m, device in (("ref", ref, "cpu"), ("cpu", cpu, "cpu"), ("dev", dev, "neuron")):
        dt = torch.float64 if name == "ref" else dtype
        xi = x.to(dt).to(device)
        y = m(xi)[0]
        y.backward(g.to(dt).to(device))
        outs[name] = [y.detach().cpu().double()] + [p.grad.cpu().double() for p in m.parameters()]
    for r, c, d in zip(outs["ref"], outs["cpu"], outs["dev"]):
        cpu_err = (c - r).abs().max().item()
        dev_err = (d - r).abs().max().item()
        assert dev_err <= 2 * cpu_err + EPS[dtype] * max(1.0, r.abs().max().item()), (dev_err, cpu_err)


def test_gru_step_launches_one_kernel_per_cell(strict):
    """A 2-layer GRU's forward and backward over T steps: one launch per cell and direction, and no copies of
    the gradient slices the recurrent loop hands the cells (an LSTM of this size runs a layer per launch)."""
    torch.manual_seed(0)
    m = torch.nn.GRU(6, 12, num_layers=2).to("neuron")
    x = to_n(torch.randn(9, 4, 6))
    with profiler.record() as recs:
        m(x)[0].sum().backward()
    ops = [r.op for r in recs]
    assert ops.count("aten::_thnn_fused_gru_cell") == 18
    assert ops.count("aten::_thnn_fused_gru_cell_backward") == 18
    assert ops.count("aten::copy_") <= 2        # the module's zero initial state and the sum's gradient at most


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_propagate_as_in_the_math(dtype, strict):
    """±inf gate pre-activations saturate the activations, NaN propagates, a state at the dtype's largest value
    stays finite where the math does: the float64 reference on the same inputs, NaN where it has NaN."""
    big = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(9)
    N, H = 2, 4
    (ig, hg, cx, b1, b2), _ = _cell_inputs(4, N, H, dtype, True, gen)
    ig[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0], dtype=dtype)   # four gates' columns
    ig[1, ::H] = torch.tensor([float("inf"), -float("inf"), -float("inf"), float("inf")], dtype=dtype)
    cx[1, 0], cx[1, 1] = big, -big
    args = [to_n(t) for t in (ig, hg, cx, b1, b2)]
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(*args)
    refs = _ref_lstm(*(t.double() for t in (ig, hg, cx, b1, b2)))
    for dev, ref in zip((hy, cy, ws), refs):
        eps = EPS[dtype]
        torch.testing.assert_close(dev.cpu().double(), ref.to(dtype).double(), atol=eps, rtol=eps, equal_nan=True)
    (ig3, hg3, hx, c1, c2), _ = _cell_inputs(3, N, H, dtype, True, gen)
    ig3[0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=dtype)
    ig3[1, ::H] = torch.tensor([-float("inf"), float("inf"), float("inf")], dtype=dtype)
    hy, ws = torch.ops.aten._thnn_fused_gru_cell(*(to_n(t) for t in (ig3, hg3, hx, c1, c2)))
    for dev, ref in zip((hy, ws), _ref_gru(*(t.double() for t in (ig3, hg3, hx, c1, c2)))):
        torch.testing.assert_close(dev.cpu().double(), ref.to(dtype).double(), atol=EPS[dtype], rtol=EPS[dtype],
                                   equal_nan=True)


@pytest.mark.parametrize("N,H", [(0, 3), (2, 0)])
def test_empty_cells(N, H, strict):
    """An empty batch or hidden size: results of the CUDA cells' shapes, the bias gradients (sums over no rows) zero."""
    z = lambda *s: to_n(torch.zeros(*s))  # noqa: E731
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(z(N, 4 * H), z(N, 4 * H), z(N, H), z(4 * H), z(4 * H))
    assert (hy.shape, cy.shape, ws.shape) == ((N, H), (N, H), (N, 4 * H))
    d, dcx, db = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(z(N, H), None, z(N, H), cy, ws, True)
    assert (d.shape, dcx.shape) == ((N, 4 * H), (N, H))
    torch.testing.assert_close(db.cpu(), torch.zeros(4 * H))
    hy, ws = torch.ops.aten._thnn_fused_gru_cell(z(N, 3 * H), z(N, 3 * H), z(N, H))
    assert (hy.shape, ws.shape) == ((N, H), (N, 5 * H))
    res = torch.ops.aten._thnn_fused_gru_cell_backward(z(N, H), ws, True)
    assert [t.shape for t in res[:3]] == [(N, 3 * H), (N, 3 * H), (N, H)]
    for b in res[3:]:
        torch.testing.assert_close(b.cpu(), torch.zeros(3 * H))


@pytest.mark.parametrize("N,H", [(129, 4), (2, 129)])
def test_hidden_product_beyond_one_launch_is_refused(N, H):
    """A step whose batch exceeds the 128 partitions or whose gates exceed one block of 128 hidden columns
    cannot form its hidden-state product in the cell's launch, nor an LSTM layer run as one launch: the kernels
    state their limits (the sequence takes the two-launch path for such shapes)."""
    from torchneuron.kernels.rnn_cell import fused_product_fits, gru_cell_backward_kernel, gru_cell_kernel
    from torchneuron.kernels.rnn_sequence import lstm_sequence_kernel, sequence_fits
    from torchneuron.ops.kernel_call import call_kernel
    from torchneuron.ops.rnn import _step_with_product
    assert not fused_product_fits(N, H, 3) and not sequence_fits(N, H)
    assert fused_product_fits(128, 128, 3) and sequence_fits(128, 128)
    state = to_n(torch.zeros(N, H))
    w_hh, gate_rows = to_n(torch.zeros(3 * H, H)), to_n(torch.zeros(N, 3 * H))
    with pytest.raises(AssertionError, match="partitions|PSUM bank"):
        _step_with_product(gru_cell_kernel, "cell", N, H, igates=gate_rows, prev=state, w_hh=w_hh)
    workspace = to_n(torch.zeros(N, 5 * H))   # [r, z, n, hx, gh_n]
    with pytest.raises(AssertionError, match="partitions|PSUM bank"):
        _step_with_product(gru_cell_backward_kernel, "cell backward", N, H, w_hh=w_hh, grad_hy=state,
                           workspace=workspace)
    w4, gates = to_n(torch.zeros(4 * H, H)), to_n(torch.zeros(2 * N * 4 * H))
    views = (("igates", (N * 4 * H, 4 * H, 1)), ("h0", (H, 1)), ("c0", (H, 1)), ("w_hh", (H, 1)))
    with pytest.raises(AssertionError, match="exceeds one block"):
        call_kernel(lstm_sequence_kernel, {"igates": gates, "h0": state.view(-1), "c0": state.view(-1), "w_hh": w4.view(-1)},
                    {"T": 2, "N": N, "H": H, "views": views})
