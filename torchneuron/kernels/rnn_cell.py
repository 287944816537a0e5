"""Fused recurrent cells: one LSTM or GRU time step (forward or backward) in one launch.

The four kernels follow the math of PyTorch's fused CUDA cells (``_thnn_fused_lstm_cell`` and
``_thnn_fused_gru_cell`` and their backward ops): element-wise work in fp32 whatever the storage dtype,
each result rounded once to it when stored, and the bias gradients summed over the batch from the
rounded gate gradients (CUDA's ``grad_gates.sum(0)``).

Layout: batch rows on the partitions, a block of w <= W hidden columns of every gate in the free dim,
so one DMA moves the same column block of all gates ([p, gates, w] through an access pattern whose
middle stride is H). Every input is a 1-D HBM span read through its view's (row, column) strides, so the
strided views the recurrent loop hands over (a step's slice of the output gradient) are read where they
lie instead of being copied first.

    for each column block of w hidden columns (w <= W):
        load the biases' blocks broadcast over the partitions                 DMA
        for each block of 128 batch rows:
            load the gate blocks and the state                                DMA
            gate sums, products, derivatives                                  VectorE (GpSimdE: a few)
            sigmoid / tanh                                                    ScalarE
            store the results (the DMA casts fp32 to the storage dtype)       DMA
            bias gradients += ones^T @ rounded gate gradients                 TensorE, PSUM (fp32)
        store the bias gradients' block                                       DMA

With W = 128 the backward's PSUM row (4 gates x 128 fp32) fills one bank. Tiles of the last NBUF row
blocks stay alive, so loads, compute and stores of consecutive blocks overlap.

A GRU layer's step may also fold in its hidden-state product (``w_hh`` given; one block of rows and of columns:
N <= 128, H <= 128, so gates x H fp32 fit one PSUM bank; an LSTM layer of that size runs as one launch per layer,
``kernels.rnn_sequence``): the forward takes h_{t-1} instead of the hidden gates and forms them first,

    load h_{t-1}^T [H, N] and W_hh^T [H, gates * H] (hidden on the partitions)  DMA
    hidden gates = h_{t-1} @ W_hh^T into one PSUM bank (fp32)                   TensorE
    the cell as above, its adds reading the hidden gates from PSUM              VectorE

and the backward follows the cell's backward with the previous hidden state's gradient,

    for each 128-column chunk of the rounded hidden-gate gradients [N, gates * H]:
        transpose it to [<=128, N]                                           TensorE (PSUM), VectorE (to SBUF)
        load W_hh's matching rows [<=128, H]                                 DMA
        grad_h_prev (+)= chunk @ rows into one PSUM bank (fp32)              TensorE
    grad_h_prev += the given addend (the output's gradient at t - 1)         VectorE
    store grad_h_prev                                                        DMA

in the product kernel's order (one K <= 128 product forward; 128-row contraction chunks accumulated in order
backward, the addend added to the fp32 sum), so fp32 results equal the two-launch path's.
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, PSUM_FP32, check_sbuf

W = 128          # hidden columns per block: 4 LSTM gates x 128 fp32 fill one PSUM bank
NBUF = 2         # row blocks whose tiles stay alive (loads of one overlap the compute of the previous)


def _load(dst, src, view, r0: int, p: int, c0: int, w: int, gates: int = 0, H: int = 0) -> None:
    """DMA rows [r0, r0 + p) of a 2-D view (``view`` = (row stride, column stride) over the 1-D span ``src``)
    into ``dst``: columns [c0, c0 + w) as [p, w], or with ``gates`` those columns of each of ``gates`` blocks
    of H columns as [p, gates, w]."""
    rs, cs = view
    pattern = [[rs, p], [cs * H, gates], [cs, w]] if gates else [[rs, p], [cs, w]]
    nisa.dma_copy(dst=dst, src=src.ap(pattern, offset=r0 * rs + c0 * cs))


def _store(dst, src, r0: int, p: int, c0: int, w: int, gates: int = 0, H: int = 0) -> None:
    """DMA ``src`` ([p, w] or [p, gates, w]) into rows [r0, r0 + p) of a contiguous [N, gates * H] (or [N, H])
    HBM result, columns [c0, c0 + w) of each gate block."""
    row = gates * H if gates else dst.shape[1]
    pattern = [[row, p], [H, gates], [1, w]] if gates else [[row, p], [1, w]]
    nisa.dma_copy(dst=dst.ap(pattern, offset=r0 * row + c0), src=src)


def _bias_block(bias, view, p: int, c0: int, w: int, gates: int, H: int):
    """A [128, gates, w] fp32 tile holding columns [c0, c0 + w) of each gate block of a 1-D bias on every
    partition (``view``: its (0, element stride))."""
    t = nl.ndarray((PMAX, gates, w), nl.float32, buffer=nl.sbuf)
    _, cs = view
    nisa.dma_copy(dst=t[:p], src=bias.ap([[0, p], [cs * H, gates], [cs, w]], offset=c0 * cs))
    return t


def _f32(shape):
    return nl.ndarray((PMAX, *shape), nl.float32, buffer=nl.sbuf)


def _mul(dst, a, b, engine=None):
    nisa.tensor_tensor(dst=dst, data1=a, data2=b, op=nl.multiply, engine=engine)


def _add(dst, a, b, engine=None):
    nisa.tensor_tensor(dst=dst, data1=a, data2=b, op=nl.add, engine=engine)


def _sub(dst, a, b, engine=None):
    nisa.tensor_tensor(dst=dst, data1=a, data2=b, op=nl.subtract, engine=engine)


def _one_minus(dst, a, engine=None):
    """dst = 1 - a."""
    nisa.tensor_scalar(dst=dst, data=a, op0=nl.subtract, operand0=1.0, reverse0=True, engine=engine)


def _check_fused(N: int, H: int, gates: int, what: str) -> None:
    """The limits of a step with its hidden-state product in the launch: one block of rows and of columns."""
    assert N <= PMAX, f"{what}: batch {N} exceeds the {PMAX} partitions of one row block"
    assert H <= W and gates * H <= PSUM_FP32, f"{what}: {gates} x {H} hidden gates exceed one PSUM bank"


def fused_product_fits(N: int, H: int, gates: int) -> bool:
    """Whether a step of batch N and hidden size H can fold its hidden-state product into the cell's launch."""
    return N <= PMAX and H <= W and gates * H <= PSUM_FP32


def _hidden_gates(h, h_name: str, w_hh, views: dict, N: int, H: int, gates: int, what: str):
    """None without ``w_hh``; else a [128, gates, H] fp32 PSUM tile whose first N rows are h @ W_hh^T (h: [N, H],
    W_hh: [gates * H, H], spans read through their (row, column) strides in ``views``), as one product of
    contraction H on TensorE."""
    if w_hh is None:
        return None
    _check_fused(N, H, gates, what)
    dt = w_hh.dtype
    hT, wT = nl.ndarray((PMAX, PMAX), dt, buffer=nl.sbuf), nl.ndarray((PMAX, gates * H), dt, buffer=nl.sbuf)
    (hr, hc), (wr, wc) = views[h_name], views["w_hh"]
    nisa.dma_copy(dst=hT[:H, :N], src=h.ap([[hc, H], [hr, N]], offset=0))                  # DMA: h^T
    nisa.dma_copy(dst=wT[:H], src=w_hh.ap([[wc, H], [wr, gates * H]], offset=0))          # DMA: W_hh^T
    bank = nl.ndarray((PMAX, gates, H), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=bank.reshape((PMAX, gates * H))[:N], stationary=hT[:H, :N], moving=wT[:H],
                   accumulate=False)                                                       # TensorE
    return bank


def _hidden_grad(grad_gates, w_hh, w_view, addend, N: int, H: int, gates: int):
    """A [128, H] fp32 tile whose first N rows are grad_gates @ W_hh (+ ``addend``, an fp32 [128, H] tile or
    None): grad_gates ([128, gates, H] in the storage dtype) transposed on TensorE in 128-column chunks, each the
    stationary operand of a product with W_hh's matching rows, accumulated in order into one PSUM bank."""
    dt = w_hh.dtype
    flat = grad_gates.reshape((PMAX, gates * H))
    bank = nl.ndarray((PMAX, H), nl.float32, buffer=nl.psum)
    wr, wc = w_view
    for k, k0 in enumerate(range(0, gates * H, PMAX)):
        kw = min(PMAX, gates * H - k0)
        tp = nl.ndarray((PMAX, PMAX), dt, buffer=nl.psum)
        nisa.nc_transpose(dst=tp[:kw, :N], data=flat[:N, k0:k0 + kw])                     # TensorE
        chunk, rows = nl.ndarray((PMAX, PMAX), dt, buffer=nl.sbuf), nl.ndarray((PMAX, H), dt, buffer=nl.sbuf)
        nisa.tensor_copy(dst=chunk[:kw, :N], src=tp[:kw, :N])                              # VectorE
        nisa.dma_copy(dst=rows[:kw], src=w_hh.ap([[wr, kw], [wc, H]], offset=k0 * wr))    # DMA
        nisa.nc_matmul(dst=bank[:N], stationary=chunk[:kw, :N], moving=rows[:kw], accumulate=k > 0)   # TensorE
    out = _f32((H,))
    if addend is None:
        nisa.tensor_copy(dst=out[:N], src=bank[:N])
    else:
        _add(out[:N], bank[:N], addend[:N])
    return out


def _check(N: int, H: int, what: str, tiles: int) -> None:
    assert N >= 1 and H >= 1, f"{what}: empty problem [{N}, {H}]"
    # ``tiles``: [gates, w] fp32 tiles' worth of SBUF per row block (the kernel's count, rounded up)
    check_sbuf((NBUF + 1) * tiles * 4 * min(W, H) * 4, what)


@nki.jit
def lstm_cell_kernel(igates, prev, hgates, b_ih=None, b_hh=None, N=1, H=1, views=()):
    """(hy, cy, workspace) of one LSTM step over [N, 4H] gate pre-activations (1-D spans read through
    ``views``: (name, (row, column) strides) of each span given; prev is cx): i, f, o = sigmoid, g = tanh of
    igates + hgates + b_ih + b_hh; cy = f * cx + i * g; hy = o * tanh(cy); the workspace holds the activated
    gates [i, f, g, o]."""
    _check(N, H, "lstm cell", 5 + 2)
    views = dict(views)
    dt = igates.dtype
    hy = nl.ndarray((N, H), dt, buffer=nl.shared_hbm)
    cy = nl.ndarray((N, H), dt, buffer=nl.shared_hbm)
    ws = nl.ndarray((N, 4 * H), dt, buffer=nl.shared_hbm)
    ring = collections.deque(maxlen=NBUF)
    for c0 in range(0, H, W):
        w = min(W, H - c0)
        biases = [] if b_ih is None else [_bias_block(b, views[n], min(PMAX, N), c0, w, 4, H)
                                          for b, n in ((b_ih, "b_ih"), (b_hh, "b_hh"))]
        for r0 in range(0, N, PMAX):
            p = min(PMAX, N - r0)
            gates, hg, c = _f32((4, w)), _f32((4, w)), _f32((w,))
            _load(gates[:p], igates, views["igates"], r0, p, c0, w, 4, H)
            _load(hg[:p], hgates, views["hgates"], r0, p, c0, w, 4, H)
            _load(c[:p], prev, views["prev"], r0, p, c0, w)
            _add(gates[:p], gates[:p], hg[:p])                        # CUDA's order: (ig + hg) + b_ih + b_hh
            for b in biases:
                _add(gates[:p], gates[:p], b[:p])
            act = _f32((4, w))                                         # [i, f, g, o]
            nisa.activation(dst=act[:p, 0:2], op=nl.sigmoid, data=gates[:p, 0:2])
            nisa.activation(dst=act[:p, 2], op=nl.tanh, data=gates[:p, 2])
            nisa.activation(dst=act[:p, 3], op=nl.sigmoid, data=gates[:p, 3])
            fc, ig, c_new, t, h = _f32((w,)), _f32((w,)), _f32((w,)), _f32((w,)), _f32((w,))
            _mul(fc[:p], act[:p, 1], c[:p])
            _mul(ig[:p], act[:p, 0], act[:p, 2], engine=nisa.gpsimd_engine)
            _add(c_new[:p], fc[:p], ig[:p])
            nisa.activation(dst=t[:p], op=nl.tanh, data=c_new[:p])
            _mul(h[:p], act[:p, 3], t[:p])
            _store(ws, act[:p], r0, p, c0, w, 4, H)
            _store(cy, c_new[:p], r0, p, c0, w)
            _store(hy, h[:p], r0, p, c0, w)
            ring.append((gates, hg, c, act, fc, ig, c_new, t, h))
    return hy, cy, ws


def _rounded(t, p: int, dt):
    """A [128, gates, w] tile whose first p rows are ``t``'s rounded to the storage dtype (``t`` itself for fp32):
    what is stored and summed."""
    if dt == nl.float32:
        return t
    r = nl.ndarray(tuple(t.shape), dt, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r[:p], src=t[:p])
    return r


def _rounded_row(t, p: int, dt):
    """A [128, w] fp32 tile whose first p rows are ``t``'s rounded to the storage dtype (``t`` itself for fp32):
    the value the two-launch path stores and adds later."""
    if dt == nl.float32:
        return t
    r = _rounded(t, p, dt)
    back = nl.ndarray(tuple(t.shape), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=back[:p], src=r[:p])
    return back


def _ones(dt):
    """A [128, 1] column of ones in the storage dtype: the stationary operand of the bias gradients' sums."""
    ones = nl.ndarray((PMAX, 1), dt, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    return ones


def _bias_grad(bank, ones, src, p: int, first: bool) -> None:
    """bank[0, :] (+)= the column sums of rows [0, p) of ``src`` ([128, gates, w] in the storage dtype) on
    TensorE."""
    flat = src.reshape((PMAX, src.shape[1] * src.shape[2]))
    nisa.nc_matmul(dst=bank, stationary=ones[:p, :], moving=flat[:p], accumulate=not first)


def _store_bias_grad(dst, bank, c0: int, w: int, gates: int, H: int) -> None:
    """Round a [1, gates * w] PSUM row to the storage dtype and store it as columns [c0, c0 + w) of each gate
    block of the 1-D ``dst``."""
    row = nl.ndarray((1, gates, w), dst.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=row.reshape((1, gates * w)), src=bank)
    nisa.dma_copy(dst=dst.ap([[0, 1], [H, gates], [1, w]], offset=c0), src=row)


@nki.jit
def lstm_cell_backward_kernel(cx, cy, workspace, grad_hy=None, grad_cy=None, N=1, H=1, views=(), has_bias=False):
    """(grad_gates, grad_cx[, grad_bias]) of one LSTM step from its saved activated gates (spans
    read through ``views``: (name, (row, column) strides) of each span given; a missing grad_hy or grad_cy counts
    as zeros): with gc = grad_hy * o * (1 - tanh(cy)^2) + grad_cy,
    d_i = gc * g * i(1-i), d_f = gc * cx * f(1-f), d_g = gc * i * (1-g^2), d_o = grad_hy * tanh(cy) * o(1-o);
    grad_cx = gc * f; grad_bias = the batch sum of the rounded [d_i, d_f, d_g, d_o]."""
    _check(N, H, "lstm cell backward", 5 + 3)
    views = dict(views)
    dt = workspace.dtype
    grad_gates = nl.ndarray((N, 4 * H), dt, buffer=nl.shared_hbm)
    grad_cx = nl.ndarray((N, H), dt, buffer=nl.shared_hbm)
    grad_bias = nl.ndarray((4 * H,), dt, buffer=nl.shared_hbm) if has_bias else None
    ones, ring = _ones(dt), collections.deque(maxlen=NBUF)
    for c0 in range(0, H, W):
        w = min(W, H - c0)
        assert 4 * w <= PSUM_FP32, f"lstm cell backward: {4 * w} bias columns exceed a PSUM bank"
        bank = nl.ndarray((1, 4 * w), nl.float32, buffer=nl.psum) if has_bias else None
        for i, r0 in enumerate(range(0, N, PMAX)):
            p = min(PMAX, N - r0)
            act, c, t = _f32((4, w)), _f32((w,)), _f32((w,))
            _load(act[:p], workspace, views["workspace"], r0, p, c0, w, 4, H)
            _load(c[:p], cx, views["cx"], r0, p, c0, w)
            _load(t[:p], cy, views["cy"], r0, p, c0, w)
            nisa.activation(dst=t[:p], op=nl.tanh, data=t[:p])     # tanh(cy)
            # the activations' derivatives in place of the gates: s(1-s) for i, f, o; 1-g^2 for g
            deriv, gate_scale = _f32((4, w)), _f32((4, w))
            _one_minus(gate_scale[:p], act[:p])                          # scratch until the scales are made
            _mul(deriv[:p], act[:p], gate_scale[:p])
            nisa.scalar_tensor_tensor(dst=deriv[:p, 2], data=act[:p, 2], op0=nl.add, operand0=1.0,
                                      op1=nl.multiply, operand1=gate_scale[:p, 2])   # (1 + g)(1 - g)
            gc = _f32((w,))
            if grad_hy is not None:
                gh = _f32((w,))
                _load(gh[:p], grad_hy, views["grad_hy"], r0, p, c0, w)
                # gc = grad_hy * o * (1 - tanh(cy)^2) (+ grad_cy); the o slot's scale is grad_hy * tanh(cy)
                _mul(gc[:p], t[:p], t[:p])
                nisa.scalar_tensor_tensor(dst=gc[:p], data=gc[:p], op0=nl.subtract, operand0=1.0, reverse0=True,
                                          op1=nl.multiply, operand1=act[:p, 3])
                _mul(gc[:p], gc[:p], gh[:p])
                _mul(gate_scale[:p, 3], gh[:p], t[:p], engine=nisa.gpsimd_engine)
                ring.append(gh)
            else:
                nisa.memset(dst=gc[:p], value=0.0)
                nisa.memset(dst=gate_scale[:p, 3], value=0.0)
            if grad_cy is not None:
                gcy = _f32((w,))
                _load(gcy[:p], grad_cy, views["grad_cy"], r0, p, c0, w)
                _add(gc[:p], gc[:p], gcy[:p])
                ring.append(gcy)
            _mul(gate_scale[:p, 0], gc[:p], act[:p, 2])                # d_i = gc * g * i(1-i)
            _mul(gate_scale[:p, 1], gc[:p], c[:p], engine=nisa.gpsimd_engine)   # d_f = gc * cx * f(1-f)
            _mul(gate_scale[:p, 2], gc[:p], act[:p, 0])                # d_g = gc * i * (1-g^2)
            dg = _f32((4, w))
            _mul(dg[:p], gate_scale[:p], deriv[:p])
            dcx = _f32((w,))
            _mul(dcx[:p], gc[:p], act[:p, 1], engine=nisa.gpsimd_engine)
            stored = _rounded(dg, p, dt)
            _store(grad_gates, stored[:p], r0, p, c0, w, 4, H)
            _store(grad_cx, dcx[:p], r0, p, c0, w)
            if has_bias:
                _bias_grad(bank, ones, stored, p, i == 0)
            ring.append((act, c, t, deriv, gate_scale, gc, dg, dcx, stored))
        if has_bias:
            _store_bias_grad(grad_bias, bank, c0, w, 4, H)
    return (grad_gates, grad_cx) + ((grad_bias,) if has_bias else ())


@nki.jit
def gru_cell_kernel(igates, prev, hgates=None, b_ih=None, b_hh=None, w_hh=None, N=1, H=1, views=()):
    """(hy, workspace) of one GRU step over [N, 3H] gate pre-activations (1-D spans read through ``views``:
    (name, (row, column) strides) of each span given; prev is hx): with gi = igates + b_ih and
    gh = hgates + b_hh, r, z = sigmoid(gi + gh) of the first two gates, n = tanh(gi_n + r * gh_n),
    hy = n + z * (hx - n); the workspace holds [r, z, n, hx, gh_n]. With ``w_hh`` (no hgates) the hidden gates
    are hx @ W_hh^T, formed here."""
    _check(N, H, "gru cell", 5 + 2)
    views = dict(views)
    dt = igates.dtype
    bank = _hidden_gates(prev, "prev", w_hh, views, N, H, 3, "gru cell")
    hy = nl.ndarray((N, H), dt, buffer=nl.shared_hbm)
    ws = nl.ndarray((N, 5 * H), dt, buffer=nl.shared_hbm)
    ring = collections.deque(maxlen=NBUF)
    for c0 in range(0, H, W):
        w = min(W, H - c0)
        biases = None if b_ih is None else [_bias_block(b, views[n], min(PMAX, N), c0, w, 3, H)
                                            for b, n in ((b_ih, "b_ih"), (b_hh, "b_hh"))]
        for r0 in range(0, N, PMAX):
            p = min(PMAX, N - r0)
            gi, gh, keep = _f32((3, w)), _f32((3, w)), _f32((5, w))   # keep: [r, z, n, hx, gh_n]
            _load(gi[:p], igates, views["igates"], r0, p, c0, w, 3, H)
            if bank is None:
                _load(gh[:p], hgates, views["hgates"], r0, p, c0, w, 3, H)
            _load(keep[:p, 3], prev, views["prev"], r0, p, c0, w)
            if biases is not None:
                _add(gi[:p], gi[:p], biases[0][:p])
                # (GpSimdE does not read PSUM: VectorE adds the bias to the hidden gates formed here)
                _add(gh[:p], gh[:p] if bank is None else bank[:p], biases[1][:p],
                     engine=nisa.gpsimd_engine if bank is None else None)
            elif bank is not None:
                nisa.tensor_copy(dst=gh[:p], src=bank[:p])        # VectorE: PSUM to SBUF
            nisa.tensor_copy(dst=keep[:p, 4], src=gh[:p, 2])
            rz = _f32((2, w))
            _add(rz[:p], gi[:p, 0:2], gh[:p, 0:2])
            nisa.activation(dst=keep[:p, 0:2], op=nl.sigmoid, data=rz[:p])
            pre = _f32((w,))
            _mul(pre[:p], keep[:p, 0], gh[:p, 2])
            _add(pre[:p], pre[:p], gi[:p, 2])
            nisa.activation(dst=keep[:p, 2], op=nl.tanh, data=pre[:p])
            d, h = _f32((w,)), _f32((w,))
            _sub(d[:p], keep[:p, 3], keep[:p, 2])                       # hy = n + z * (hx - n)
            _mul(d[:p], d[:p], keep[:p, 1])
            _add(h[:p], d[:p], keep[:p, 2])
            _store(ws, keep[:p], r0, p, c0, w, 5, H)
            _store(hy, h[:p], r0, p, c0, w)
            ring.append((gi, gh, keep, rz, pre, d, h))
    return hy, ws


@nki.jit
def gru_cell_backward_kernel(grad_hy, workspace, w_hh=None, grad_next=None, N=1, H=1, views=(), has_bias=False):
    """(grad_input_gates, grad_hidden_gates, grad_hx[, grad_input_bias, grad_hidden_bias]) of one GRU step from
    its workspace [r, z, n, hx, gh_n] (spans read through ``views``: (name, (row, column) strides) of each span
    given): d_n = grad_hy * (1-z) * (1-n^2), d_z = grad_hy * (hx-n) * z(1-z), d_r = d_n * gh_n * r(1-r);
    the input gates' gradient is [d_r, d_z, d_n], the hidden gates' [d_r, d_z, d_n * r], grad_hx = grad_hy * z;
    the bias gradients are the batch sums of the rounded gate gradients. With ``w_hh`` grad_hx is instead the
    previous hidden state's whole gradient: hidden gates' gradient @ W_hh + (grad_next + grad_hy * z)."""
    _check(N, H, "gru cell backward", 5 + 6)
    views = dict(views)
    if w_hh is not None:
        _check_fused(N, H, 3, "gru cell backward")
    dt = workspace.dtype
    grad_in = nl.ndarray((N, 3 * H), dt, buffer=nl.shared_hbm)
    grad_hid = nl.ndarray((N, 3 * H), dt, buffer=nl.shared_hbm)
    grad_hx = nl.ndarray((N, H), dt, buffer=nl.shared_hbm)
    bias_in = nl.ndarray((3 * H,), dt, buffer=nl.shared_hbm) if has_bias else None
    bias_hid = nl.ndarray((3 * H,), dt, buffer=nl.shared_hbm) if has_bias else None
    ones, ring = _ones(dt), collections.deque(maxlen=NBUF)
    for c0 in range(0, H, W):
        w = min(W, H - c0)
        assert 3 * w <= PSUM_FP32, f"gru cell backward: {3 * w} bias columns exceed a PSUM bank"
        banks = [nl.ndarray((1, 3 * w), nl.float32, buffer=nl.psum) for _ in range(2)] if has_bias else None
        for i, r0 in enumerate(range(0, N, PMAX)):
            p = min(PMAX, N - r0)
            keep, g = _f32((5, w)), _f32((w,))
            _load(g[:p], grad_hy, views["grad_hy"], r0, p, c0, w)
            _load(keep[:p], workspace, views["workspace"], r0, p, c0, w, 5, H)
            r, z, n, hx, hn = (keep[:p, k] for k in range(5))
            d_in, d_hid = _f32((3, w)), _f32((3, w))
            omz, t, u = _f32((w,)), _f32((w,)), _f32((w,))
            _one_minus(omz[:p], z)
            _mul(t[:p], n, n)                                            # d_n = g * (1-z) * (1-n^2)
            nisa.scalar_tensor_tensor(dst=t[:p], data=t[:p], op0=nl.subtract, operand0=1.0, reverse0=True,
                                      op1=nl.multiply, operand1=omz[:p])
            _mul(d_in[:p, 2], t[:p], g[:p])
            _sub(u[:p], hx, n, engine=nisa.gpsimd_engine)               # d_z = g * (hx-n) * z(1-z)
            _mul(u[:p], u[:p], g[:p], engine=nisa.gpsimd_engine)
            _mul(t[:p], z, omz[:p])
            _mul(d_in[:p, 1], u[:p], t[:p])
            _one_minus(t[:p], r)                                         # d_r = d_n * gh_n * r(1-r)
            _mul(t[:p], t[:p], r)
            _mul(u[:p], d_in[:p, 2], hn, engine=nisa.gpsimd_engine)
            _mul(d_in[:p, 0], u[:p], t[:p])
            nisa.tensor_copy(dst=d_hid[:p, 0:2], src=d_in[:p, 0:2], engine=nisa.gpsimd_engine)
            _mul(d_hid[:p, 2], d_in[:p, 2], r)
            dhx = _f32((w,))
            _mul(dhx[:p], g[:p], z, engine=nisa.gpsimd_engine)
            stored = [_rounded(d_in, p, dt), _rounded(d_hid, p, dt)]
            _store(grad_in, stored[0][:p], r0, p, c0, w, 3, H)
            _store(grad_hid, stored[1][:p], r0, p, c0, w, 3, H)
            if w_hh is not None:
                if grad_next is not None:
                    # the two-launch path's order: (output's gradient + direct path), then + the product
                    gn = _f32((w,))
                    _load(gn[:p], grad_next, views["grad_next"], r0, p, c0, w)
                    _add(dhx[:p], gn[:p], _rounded_row(dhx, p, dt)[:p])
                    ring.append(gn)
                else:
                    dhx = _rounded_row(dhx, p, dt)
                dhx = _hidden_grad(stored[1], w_hh, views["w_hh"], dhx, p, H, 3)
            _store(grad_hx, dhx[:p], r0, p, c0, w)
            if has_bias:
                for bank, s in zip(banks, stored):
                    _bias_grad(bank, ones, s, p, i == 0)
            ring.append((keep, g, d_in, d_hid, omz, t, u, dhx, stored))
        if has_bias:
            _store_bias_grad(bias_in, banks[0], c0, w, 3, H)
            _store_bias_grad(bias_hid, banks[1], c0, w, 3, H)
    return (grad_in, grad_hid, grad_hx, bias_in, bias_hid) if has_bias else (grad_in, grad_hid, grad_hx)
