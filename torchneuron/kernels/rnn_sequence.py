"""A whole LSTM layer over a sequence in one launch, forward and backward: the time loop runs inside the kernel.

The forward runs the recurrence with W_hh^T and the state on chip: per step one product on TensorE gives the gates'
pre-activations, the cell's element-wise work runs in fp32, the new hidden state is rounded to the storage dtype
(the next step's matmul operand, as stored between per-step launches) and the cell state rounded as well (the
value the next step reads; h uses the unrounded one, as PyTorch's fused cell does). Where [h_t; x_t; 1; 1] fits
the 128 contraction rows the step's product also takes the input projection and both biases (moving operand
[W_hh^T; W_ih^T; b_ih; b_hh], loaded once); otherwise the caller hands every step's input projection in (one
product for all steps) and the kernel adds it. The backward runs the steps in reverse with the hidden and cell
state gradients carried on chip in fp32, and accumulates the weight and bias gradients over all steps in PSUM.
Batch rows sit on the partitions; both kernels need one block of rows and of columns (N <= 128, H <= 128).

Forward, per block of ``nb`` time steps (as many as fit the SBUF budget ``BLOCK_BYTES``):

    load the block's x_t^T and set the ones rows (or load its input projections and add the biases)   DMA
    for each step t:
        h_t^T = transpose(h_t) into the step's stationary operand                 TensorE, VectorE (PSUM to SBUF)
        pre-activations = [h_t; x_t; 1; 1]^T-stack @ [W_hh^T; W_ih^T; b_ih; b_hh] into one PSUM bank (fp32)
                          (or h_t @ W_hh^T + the input projection)                TensorE (VectorE)
        i, f, o = sigmoid, g = tanh, read from PSUM                              ScalarE
        c_{t+1} = f * c_t + i * g; h_{t+1} = o * tanh(c_{t+1})                   VectorE, GpSimdE, ScalarE
    store the outputs h_{t+1}, the inputs h_t, the states c_{t+1}, the workspace  DMA

The workspace (fp32, [T, N, 5H]) holds each step's activated gates and tanh(c_{t+1}), the backward's operands.

Backward, per block (loaded when a step of it is reached):

    load the workspace, c_t, h_t (and x_t) and the output's gradient of the block's steps   DMA
    the steps' gate derivatives times their partners (vectorized over the block)  VectorE, GpSimdE
    for each step t, last first, with dh (gradient of h_{t+1}) and dc:
        gc = dh * o * (1 - tanh(c)^2) + dc                                        VectorE
        d_gates = [gc * g * i(1-i), gc * c_t * f(1-f), gc * i * (1-g^2), dh * tanh(c) * o(1-o)]
                                                           (rounded to the storage dtype)   VectorE
        dc = gc * f                                                               GpSimdE
        per 128-column chunk of d_gates: transpose it (TensorE, VectorE), then
            [dh | dx_t] (+)= chunk @ [W_hh | W_ih]'s rows into one PSUM bank        TensorE
            [grad W_hh | grad W_ih | grad bias] rows (+)= d_gates^T @ [h_t | x_t | 1]   TensorE (PSUM, all steps)
        [dh | dx_t] = PSUM + the output's gradient at step t - 1                  VectorE
    store the block's input gradients dx (or, where x_t does not fit, the gate gradients)   DMA

so W_ih's and the input's gradients cost no instruction of their own per step: x_t's columns ride along h_t's
(hidden + input + 1 <= 512 fp32 columns, one PSUM bank row; beyond, the caller forms them from the stored gate
gradients with two products).
"""
from __future__ import annotations

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, PSUM_FP32, cdiv, check_sbuf
from torchneuron.kernels.rnn_cell import _add, _mul, _one_minus

BLOCK_BYTES = 32 * 1024    # SBUF bytes per partition for one block of time steps' tiles (two blocks stay alive)
FWD_STEP_WORDS = 11        # fp32 words per hidden column a forward step keeps: 4 projections, 5 workspace, c, h
BWD_STEP_WORDS = 24        # ... a backward step: 5 workspace, c, h, the output's gradient, 3 x 4 derivatives, dg


def sequence_fits(N: int, H: int) -> bool:
    """Whether an LSTM layer of batch N and hidden size H runs as one sequence launch: one block of 128 batch
    rows, hidden columns and 4 x H fp32 gates in a PSUM bank."""
    return 1 <= N <= PMAX and 1 <= H <= PMAX and 4 * H <= PSUM_FP32


def projection_fits(H: int, I: int) -> bool:
    """Whether a forward step's input projection and biases join its hidden product: h_t^T, x_t^T and two rows of
    ones stacked on the 128 contraction partitions."""
    return H + I + 2 <= PMAX


def _check(T: int, N: int, H: int, what: str) -> None:
    assert T >= 1, f"{what}: an empty sequence"
    assert sequence_fits(N, H), f"{what}: batch {N} or hidden size {H} exceeds one block of 128 rows and columns"


def _steps_per_block(H: int, words: int) -> int:
    return max(1, BLOCK_BYTES // (words * H * 4))


def _blocks(T: int, tb: int) -> list[tuple[int, int]]:
    """(first step, steps) of each block of at most tb time steps."""
    return [(t0, min(tb, T - t0)) for t0 in range(0, T, tb)]


def _steps_ap(t, N: int, nb: int, width: int, t0: int, view=None, batch_first: bool = False, c0: int = 0):
    """A [N, nb, width] access pattern over steps [t0, t0 + nb) (columns from ``c0``) of a 3-D HBM tensor:
    ``view`` its (step, row, column) strides, else a contiguous [T, N, width] (or with ``batch_first``
    [N, T, width]) tensor."""
    if view is None:
        T = t.shape[1] if batch_first else t.shape[0]
        view = (width, T * width, 1) if batch_first else (N * width, width, 1)
    ts, rs, cs = view
    return t.ap([[rs, N], [ts, nb], [cs, width]], offset=t0 * ts + c0 * cs)


# the forward keeps the gates in the order [i, f, o, g] (PyTorch's is [i, f, g, o]): the three sigmoids are one
# activation. (PyTorch's first gate block, the kernel's first block, blocks) of each copy into that order:
GATE_ORDER = ((0, 0, 2), (3, 2, 1), (2, 3, 1))


def _rows_ap(t, N: int, H: int, view=None, offset: int = 0):
    """An [N, H] access pattern over a 2-D HBM view (``view``: its (row, column) strides; default contiguous)."""
    rs, cs = view if view is not None else (H, 1)
    return t.ap([[rs, N], [cs, H]], offset=offset)


def _repeat(tile, p: int, n: int, w: int):
    """A [p, n, w] view of the [p, w] tile ``tile`` repeated n times (stride 0): an operand broadcast over n."""
    return tile.ap([[w, p], [0, n], [1, w]])


@nki.jit
def lstm_sequence_kernel(h0, c0, w_hh, igates=None, x=None, w_ih=None, b_ih=None, b_hh=None, T=1, N=1, H=1, I=0, L=1,
                         layer=0, views=(), batch_first=False):
    """(out, hs, cs, workspace, h_n, c_n) of one LSTM layer over T steps from its input projections ``igates``,
    or from its input ``x`` [.., I] and ``w_ih`` where ``projection_fits`` (3-D tensors read through their (step,
    row, column) strides in ``views``; h0, c0 [N, H], the weights and the 1-D biases through theirs): out is [T, N, H] ([N, T, H] with ``batch_first``) holding h_1 .. h_T, hs [T, N, H] h_0 .. h_{T-1},
    cs [T + 1, N, H] c_0 .. c_T, the workspace [T, N, 5H] fp32 each step's [i, f, o, g, tanh(c_{t+1})]; h_n and c_n
    are [L, N, H] results of which this layer writes row ``layer`` (the caller binds one tensor for all layers)."""
    _check(T, N, H, "lstm sequence")
    views = dict(views)
    dt, f32 = w_hh.dtype, nl.float32
    G = 4 * H
    fold = x is not None
    K = H + I + (2 if b_ih is not None else 0) if fold else H     # the hidden product's contraction rows
    assert not fold or projection_fits(H, I), f"lstm sequence: {H} + {I} + 2 contraction rows exceed 128"
    tb = _steps_per_block(H, FWD_STEP_WORDS)
    check_sbuf(2 * tb * FWD_STEP_WORDS * H * 4 + tb * G * 4 + 2 * PMAX * 4, "lstm sequence")
    out = nl.ndarray((N, T, H) if batch_first else (T, N, H), dt, buffer=nl.shared_hbm)
    hs = nl.ndarray((T, N, H), dt, buffer=nl.shared_hbm)
    cs = nl.ndarray((T + 1, N, H), dt, buffer=nl.shared_hbm)
    ws = nl.ndarray((T, N, 5 * H), f32, buffer=nl.shared_hbm)
    h_n = nl.ndarray((L, N, H), dt, buffer=nl.shared_hbm)
    c_n = nl.ndarray((L, N, H), dt, buffer=nl.shared_hbm)

    # the moving operand, loaded once: W_hh^T [H, 4H] (folded: then W_ih^T [I, 4H], b_ih and b_hh as rows)
    wT = nl.ndarray((PMAX, G), dt, buffer=nl.sbuf)
    wr, wc = views["w_hh"]
    for src0, dst0, n in GATE_ORDER:                                                                # DMA
        nisa.dma_copy(dst=wT[:H, dst0 * H:(dst0 + n) * H], src=w_hh.ap([[wc, H], [wr, n * H]], offset=src0 * H * wr))
    bias = None
    if fold:
        wr, wc = views["w_ih"]
        for k, (b, name) in enumerate(((b_ih, "b_ih"), (b_hh, "b_hh")) if b_ih is not None else ()):
            for src0, dst0, n in GATE_ORDER:
                nisa.dma_copy(dst=wT[H + I + k:H + I + k + 1, dst0 * H:(dst0 + n) * H],
                              src=b.ap([[0, 1], [views[name][1], n * H]], offset=src0 * H * views[name][1]))
        for src0, dst0, n in GATE_ORDER:
            nisa.dma_copy(dst=wT[H:H + I, dst0 * H:(dst0 + n) * H],
                          src=w_ih.ap([[wc, I], [wr, n * H]], offset=src0 * H * wr))
    elif b_ih is not None:
        # b_ih + b_hh repeated over the partitions and a block's steps, added to each block's projections
        bias, other = (nl.ndarray((PMAX, tb, G), f32, buffer=nl.sbuf) for _ in range(2))
        for t, b, name in ((bias, b_ih, "b_ih"), (other, b_hh, "b_hh")):
            bs = views[name][1]
            for src0, dst0, n in GATE_ORDER:
                nisa.dma_copy(dst=t[:N, :, dst0 * H:(dst0 + n) * H],
                              src=b.ap([[0, N], [0, tb], [bs, n * H]], offset=src0 * H * bs))    # DMA
        _add(bias[:N], bias[:N], other[:N])                                                       # VectorE
    c_prev = nl.ndarray((PMAX, H), f32, buffer=nl.sbuf)[:N]           # the last step's [N, H] cell state
    nisa.dma_copy(dst=c_prev, src=_rows_ap(c0, N, H, views["c0"]))                                 # DMA
    nisa.dma_copy(dst=_rows_ap(cs, N, H), src=c_prev)                                              # DMA: c_0
    h_prev = None                                    # the last step's [N, H] hidden state (storage dtype)
    for t0, nb in _blocks(T, tb):
        # the stationary operands [h_t^T; x_t^T; 1; 1] of the block's steps (h_t^T written step by step)
        st = nl.ndarray((PMAX, nb, PMAX), dt, buffer=nl.sbuf)
        if fold:
            xs, xr, xc = views["x"]
            nisa.dma_copy(dst=st[H:H + I, :, :N], src=x.ap([[xc, I], [xs, nb], [xr, N]], offset=t0 * xs))   # DMA
            if K > H + I:
                nisa.memset(dst=st[H + I:K, :, :N], value=1.0)                                     # VectorE
        else:
            gi = nl.ndarray((PMAX, nb, 4, H), f32, buffer=nl.sbuf)
            for src0, dst0, n in GATE_ORDER:                                                        # DMA
                nisa.dma_copy(dst=gi.reshape((PMAX, nb, G))[:N, :, dst0 * H:(dst0 + n) * H],
                              src=_steps_ap(igates, N, nb, n * H, t0, views["igates"], c0=src0 * H))
            if bias is not None:
                _add(gi.reshape((PMAX, nb, G))[:N], gi.reshape((PMAX, nb, G))[:N], bias[:N, :nb])   # VectorE
        acts = nl.ndarray((PMAX, nb, 5, H), f32, buffer=nl.sbuf)     # [i, f, o, g, tanh(c_{t+1})] per step
        cb = nl.ndarray((PMAX, nb, H), dt, buffer=nl.sbuf)           # c_{t+1}, rounded
        hb = nl.ndarray((PMAX, nb + 1, H), dt, buffer=nl.sbuf)       # h_t0 .. h_{t0+nb}, rounded
        if h_prev is None:
            nisa.dma_copy(dst=hb[:N, 0], src=_rows_ap(h0, N, H, views["h0"]))                     # DMA
        else:
            nisa.tensor_copy(dst=hb[:N, 0], src=h_prev, engine=nisa.gpsimd_engine)               # GpSimdE
        for j in range(nb):
            tp = nl.ndarray((PMAX, PMAX), dt, buffer=nl.psum)
            nisa.nc_transpose(dst=tp[:H, :N], data=hb[:N, j])                                     # TensorE
            nisa.tensor_copy(dst=st[:H, j, :N], src=tp[:H, :N])                                   # VectorE
            # the gates' pre-activations (folded: all of them, the input projection and biases included)
            bank = nl.ndarray((PMAX, 4, H), f32, buffer=nl.psum)
            nisa.nc_matmul(dst=bank.reshape((PMAX, G))[:N], stationary=st[:K, j, :N], moving=wT[:K],
                           accumulate=False)                                                      # TensorE
            pre = bank
            if not fold:
                pre = nl.ndarray((PMAX, 4, H), f32, buffer=nl.sbuf)
                _add(pre[:N], gi[:N, j], bank[:N])                                                # VectorE
            a = acts[:N, j]
            nisa.activation(dst=a[:, 0:3], op=nl.sigmoid, data=pre[:N, 0:3])                      # ScalarE: i, f, o
            nisa.activation(dst=a[:, 3], op=nl.tanh, data=pre[:N, 3])                             # g
            fc, ig = nl.ndarray((PMAX, H), f32, buffer=nl.sbuf), nl.ndarray((PMAX, H), f32, buffer=nl.sbuf)
            _mul(fc[:N], a[:, 1], c_prev)                                                         # VectorE
            _mul(ig[:N], a[:, 0], a[:, 3], engine=nisa.gpsimd_engine)                             # GpSimdE
            c_new = cb[:N, j] if dt == f32 else nl.ndarray((PMAX, H), f32, buffer=nl.sbuf)[:N]
            _add(c_new, fc[:N], ig[:N])                                                           # VectorE
            nisa.activation(dst=a[:, 4], op=nl.tanh, data=c_new)                                  # ScalarE
            if dt != f32:
                nisa.tensor_copy(dst=cb[:N, j], src=c_new, engine=nisa.gpsimd_engine)             # GpSimdE: round
            _mul(hb[:N, j + 1], a[:, 2], a[:, 4])                                                 # VectorE
            c_prev = cb[:N, j]
        h_prev = hb[:N, nb]
        nisa.dma_copy(dst=_steps_ap(ws, N, nb, 5 * H, t0), src=acts.reshape((PMAX, nb, 5 * H))[:N])   # DMA
        nisa.dma_copy(dst=_steps_ap(hs, N, nb, H, t0), src=hb[:N, 0:nb])
        nisa.dma_copy(dst=_steps_ap(out, N, nb, H, t0, batch_first=batch_first), src=hb[:N, 1:nb + 1])
        nisa.dma_copy(dst=_steps_ap(cs, N, nb, H, t0 + 1), src=cb[:N])
    nisa.dma_copy(dst=_rows_ap(h_n, N, H, offset=layer * N * H), src=h_prev)                      # DMA
    nisa.dma_copy(dst=_rows_ap(c_n, N, H, offset=layer * N * H), src=c_prev)
    return out, hs, cs, ws, h_n, c_n


class _BackwardBlock:
    """A block of time steps' backward operands, loaded from HBM and prepared once for all its steps. ``cols``:
    the column ranges of the W product's moving operand (h_t, x_t, the ones column); ``dwidth`` the hidden
    product's width (dh, then dx when it is formed)."""

    def __init__(self, t0: int, nb: int, N: int, H: int, dt, ws, cs, hs, x, grad_out, views: dict, width: int,
                 dwidth: int, has_bias: bool):
        f32 = nl.float32
        self.t0 = t0
        wsb = nl.ndarray((PMAX, nb, 5, H), f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=wsb.reshape((PMAX, nb, 5 * H))[:N], src=_steps_ap(ws, N, nb, 5 * H, t0))    # DMA
        cx = nl.ndarray((PMAX, nb, H), f32, buffer=nl.sbuf)                  # c_t of each step
        nisa.dma_copy(dst=cx[:N], src=_steps_ap(cs, N, nb, H, t0))
        # [h_t | x_t | 1] of each step: the weight gradients' moving operand (the ones column sums the bias's)
        self.h = nl.ndarray((PMAX, nb, width), dt, buffer=nl.sbuf)
        nisa.dma_copy(dst=self.h[:N, :, 0:H], src=_steps_ap(hs, N, nb, H, t0))
        if x is not None:
            I = width - H - has_bias
            nisa.dma_copy(dst=self.h[:N, :, H:H + I], src=_steps_ap(x, N, nb, I, t0, views["x"]))
        if has_bias:
            nisa.memset(dst=self.h[:N, :, width - 1], value=1.0)                                   # VectorE
        self.grad_out = None
        if grad_out is not None:
            # the output's gradient, zero-padded to the hidden product's width (dx's columns add nothing)
            self.grad_out = nl.ndarray((PMAX, nb, dwidth), f32, buffer=nl.sbuf)
            nisa.dma_copy(dst=self.grad_out[:N, :, 0:H], src=_steps_ap(grad_out, N, nb, H, t0, views["grad_out"]))
            if dwidth > H:
                nisa.memset(dst=self.grad_out[:N, :, H:dwidth], value=0.0)
        a = wsb[:N, :, 0:4]
        self.acts = wsb
        # the gates' derivatives s(1-s) (i, f, o) and 1-g^2 (g) (the workspace's order: [i, f, o, g]), then each
        # times its partner in the chain rule, in PyTorch's gate order:
        # q = [i(1-i) * g, f(1-f) * c_t, (1-g^2) * i, o(1-o) * tanh(c_{t+1})]
        q, d = nl.ndarray((PMAX, nb, 4, H), f32, buffer=nl.sbuf), nl.ndarray((PMAX, nb, 4, H), f32, buffer=nl.sbuf)
        _one_minus(q[:N], a)                                                                       # VectorE
        _mul(d[:N], a, q[:N])
        nisa.scalar_tensor_tensor(dst=d[:N, :, 3], data=a[:, :, 3], op0=nl.add, operand0=1.0, op1=nl.multiply,
                                  operand1=q[:N, :, 3])                                            # (1 + g)(1 - g)
        _mul(q[:N, :, 0], d[:N, :, 0], a[:, :, 3])
        _mul(q[:N, :, 1], d[:N, :, 1], cx[:N], engine=nisa.gpsimd_engine)                          # GpSimdE
        _mul(q[:N, :, 2], d[:N, :, 3], a[:, :, 0])
        _mul(q[:N, :, 3], d[:N, :, 2], wsb[:N, :, 4], engine=nisa.gpsimd_engine)
        self.q = q
        # u = o * (1 - tanh(c_{t+1})^2): gc = dh * u + dc
        self.u = nl.ndarray((PMAX, nb, H), f32, buffer=nl.sbuf)
        _mul(self.u[:N], wsb[:N, :, 4], wsb[:N, :, 4])
        nisa.scalar_tensor_tensor(dst=self.u[:N], data=self.u[:N], op0=nl.subtract, operand0=1.0, reverse0=True,
                                  op1=nl.multiply, operand1=a[:, :, 2])
        self.dg = nl.ndarray((PMAX, nb, 4, H), dt, buffer=nl.sbuf)     # the gate gradients, rounded
        # per step [dh_t | dx_t]: the hidden product (+ the output's gradient at t - 1), fp32
        self.e = nl.ndarray((PMAX, nb, dwidth), f32, buffer=nl.sbuf)


def input_fits(H: int, I: int) -> bool:
    """Whether the sequence backward can also form W_ih's gradient and the input's (x_t beside h_t in one PSUM
    bank row: H + I + 1 fp32 columns)."""
    return H + I + 1 <= PSUM_FP32


@nki.jit
def lstm_sequence_backward_kernel(ws, cs, hs, w_hh, x=None, w_ih=None, grad_out=None, grad_hn=None, grad_cn=None,
                                  T=1, N=1, H=1, I=0, L=1, layer=0, views=(), batch_first=False, has_bias=False):
    """(grad_h0, grad_c0, grad_w_hh[, grad_b_ih, grad_b_hh], then grad_gates, or with ``x`` grad_w_ih[, grad_x]) of
    one LSTM layer from the forward's hs, cs and workspace (``lstm_sequence_kernel``) and the gradients of its
    output (3-D, read through its (step, row, column) strides), h_n and c_n ([N, H] views); any may be missing
    (zeros). grad_gates is [T, N, 4H] ([N, T, 4H] with ``batch_first``: the layer input's row order); with the
    layer's input ``x`` (3-D, [.., I]) W_ih's gradient is summed here instead, and with ``w_ih`` the input's
    gradient grad_x (x's layout) formed. Every result is in the storage dtype; grad_h0 and grad_c0 are [L, N, H]
    results of which this layer writes row ``layer``. The bias gradients are equal (the batch and step sum of the
    rounded gate gradients)."""
    _check(T, N, H, "lstm sequence backward")
    views = dict(views)
    dt, f32 = w_hh.dtype, nl.float32
    G = 4 * H
    if x is None:
        I = 0
    assert input_fits(H, I), f"lstm sequence backward: {H} + {I} + 1 weight-gradient columns exceed a PSUM bank"
    width = H + I + has_bias                   # the weight gradients' columns: W_hh's, W_ih's, the bias's
    dwidth = H + (I if w_ih is not None else 0)
    tb = _steps_per_block(H, BWD_STEP_WORDS + (3 * I + H - 1) // H)
    check_sbuf(2 * tb * (BWD_STEP_WORDS * H + 3 * I) * 4 + cdiv(G, PMAX) * dwidth * 4 + 8 * PMAX * 4,
               "lstm sequence backward")
    grad_h0 = nl.ndarray((L, N, H), dt, buffer=nl.shared_hbm)
    grad_c0 = nl.ndarray((L, N, H), dt, buffer=nl.shared_hbm)
    grad_w = nl.ndarray((G, H), dt, buffer=nl.shared_hbm)
    grad_b = [nl.ndarray((G,), dt, buffer=nl.shared_hbm) for _ in range(2)] if has_bias else []
    grad_gates = grad_w_ih = grad_x = None
    if x is None:
        grad_gates = nl.ndarray((N, T, G) if batch_first else (T, N, G), dt, buffer=nl.shared_hbm)
    else:
        grad_w_ih = nl.ndarray((G, I), dt, buffer=nl.shared_hbm)
    if w_ih is not None:
        grad_x = nl.ndarray((N, T, I) if batch_first else (T, N, I), dt, buffer=nl.shared_hbm)
    chunks = [(k0, min(PMAX, G - k0)) for k0 in range(0, G, PMAX)]
    rows = []                                                        # [W_hh | W_ih]'s rows per chunk: loaded once
    for k0, kw in chunks:
        r = nl.ndarray((PMAX, dwidth), dt, buffer=nl.sbuf)
        for w, name, c0, c in ((w_hh, "w_hh", 0, H), (w_ih, "w_ih", H, I)):
            if w is not None:
                wr, wc = views[name]
                nisa.dma_copy(dst=r[:kw, c0:c0 + c], src=w.ap([[wr, kw], [wc, c]], offset=k0 * wr))  # DMA
        rows.append(r)
    acc = [nl.ndarray((PMAX, width), f32, buffer=nl.psum) for _ in chunks]   # the weight gradients, all steps

    blocks = _blocks(T, tb)
    loaded: dict[int, _BackwardBlock] = {}

    def block_of(t: int) -> tuple[_BackwardBlock, int]:
        """The loaded block holding step t (the latest two stay alive) and t's index in it."""
        b = t // tb
        if b not in loaded:
            loaded[b] = _BackwardBlock(*blocks[b], N, H, dt, ws, cs, hs, x, grad_out, views, width, dwidth,
                                       has_bias)
            loaded.pop(b + 2, None)
        return loaded[b], t - blocks[b][0]

    # the gradient reaching h_T: h_n's plus the output's at the last step
    dh = nl.ndarray((PMAX, H), f32, buffer=nl.sbuf)[:N]
    last, j = block_of(T - 1)
    if grad_hn is not None:
        nisa.dma_copy(dst=dh, src=_rows_ap(grad_hn, N, H, views["grad_hn"]))                      # DMA
        if last.grad_out is not None:
            _add(dh, dh, last.grad_out[:N, j, 0:H])
    elif last.grad_out is not None:
        nisa.tensor_copy(dst=dh, src=last.grad_out[:N, j, 0:H])
    else:
        nisa.memset(dst=dh, value=0.0)
    dc = None
    if grad_cn is not None:
        dc = nl.ndarray((PMAX, H), f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=dc[:N], src=_rows_ap(grad_cn, N, H, views["grad_cn"]))
    for t in reversed(range(T)):
        blk, j = block_of(t)
        gc = nl.ndarray((PMAX, H), f32, buffer=nl.sbuf)
        _mul(gc[:N], dh, blk.u[:N, j])                                                             # VectorE
        if dc is not None:
            _add(gc[:N], gc[:N], dc[:N])
        dg = blk.dg[:N, j]
        _mul(dg[:, 0:3], _repeat(gc, N, 3, H), blk.q[:N, j, 0:3])                                   # VectorE
        _mul(dg[:, 3], dh, blk.q[:N, j, 3])
        dc = nl.ndarray((PMAX, H), f32, buffer=nl.sbuf)
        _mul(dc[:N], gc[:N], blk.acts[:N, j, 1], engine=nisa.gpsimd_engine)                         # GpSimdE
        flat = blk.dg.reshape((PMAX, blk.dg.shape[1], G))
        bank = nl.ndarray((PMAX, dwidth), f32, buffer=nl.psum)
        for k, (k0, kw) in enumerate(chunks):
            tp = nl.ndarray((PMAX, PMAX), dt, buffer=nl.psum)
            nisa.nc_transpose(dst=tp[:kw, :N], data=flat[:N, j, k0:k0 + kw])                      # TensorE
            chunk = nl.ndarray((PMAX, PMAX), dt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=chunk[:kw, :N], src=tp[:kw, :N])                                  # VectorE
            # [dh_t | dx_t] (+)= chunk @ [W_hh | W_ih] rows
            nisa.nc_matmul(dst=bank[:N], stationary=chunk[:kw, :N], moving=rows[k][:kw],
                           accumulate=k > 0)                                                       # TensorE
            # [grad W_hh | grad W_ih | grad bias] rows (+)= d_gates^T @ [h_t | x_t | 1]
            nisa.nc_matmul(dst=acc[k][:kw], stationary=flat[:N, j, k0:k0 + kw], moving=blk.h[:N, j],
                           accumulate=t < T - 1)                                                   # TensorE
        prev = block_of(t - 1) if t > 0 else None
        if prev is not None and prev[0].grad_out is not None:
            _add(blk.e[:N, j], bank[:N], prev[0].grad_out[:N, prev[1]])                           # VectorE
        else:
            nisa.tensor_copy(dst=blk.e[:N, j], src=bank[:N])
        dh = blk.e[:N, j, 0:H]
        if j == 0:
            nb = blk.dg.shape[1]
            if grad_gates is not None:
                nisa.dma_copy(dst=_steps_ap(grad_gates, N, nb, G, blk.t0, batch_first=batch_first),
                              src=blk.dg.reshape((PMAX, nb, G))[:N])                               # DMA
            if grad_x is not None:
                nisa.dma_copy(dst=_steps_ap(grad_x, N, nb, I, blk.t0, batch_first=batch_first),
                              src=blk.e[:N, :, H:dwidth])                                          # DMA
    nisa.dma_copy(dst=_rows_ap(grad_h0, N, H, offset=layer * N * H), src=dh)                        # DMA
    nisa.dma_copy(dst=_rows_ap(grad_c0, N, H, offset=layer * N * H), src=dc[:N])
    for (k0, kw), a in zip(chunks, acc):
        res = nl.ndarray((PMAX, width), dt, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res[:kw], src=a[:kw])                                                 # VectorE
        nisa.dma_copy(dst=grad_w.ap([[H, kw], [1, H]], offset=k0 * H), src=res[:kw, 0:H])          # DMA
        if grad_w_ih is not None:
            nisa.dma_copy(dst=grad_w_ih.ap([[I, kw], [1, I]], offset=k0 * I), src=res[:kw, H:H + I])
        for g in grad_b:
            nisa.dma_copy(dst=g.ap([[1, kw], [1, 1]], offset=k0), src=res[:kw, width - 1:width])
    results = (grad_h0, grad_c0, grad_w, *grad_b)
    if x is None:
        return results + (grad_gates,)
    return results + (grad_w_ih,) + ((grad_x,) if grad_x is not None else ())
