"""Sampling kernels: random numbers of the common distributions, and counting for ranks and inverse CDFs.

``sample_kernel(seed, params, n, dist, dtype)``: a flat [n] tensor of ``dtype`` drawn from ``dist``.
The core's PRNG is seeded once per launch from ``seed`` (a [1, 1] int32 tensor the host draws from
the neuron generator), so a launch is a pure function of its inputs: ``torch.manual_seed`` and
``get_rng_state``/``set_rng_state`` reproduce it. The distribution's parameters arrive in
``params``, a [1, 4] fp32 tensor broadcast to a [128, 4] tile of per-partition columns, so one
Program serves every mean, bound or probability. Per [p, f] tile (the blocks of
``kernels.random._tiles``), 24 of VectorE ``rng``'s random bits scaled by 2**-24 give uniforms u in
[0, 1) (``rand2`` exists only from NeuronCore-v4) and the engines turn them into the distribution:

    uniform      lo + u * (hi - lo), capped at the largest value of dtype below hi   (a, b, c = lo, hi, cap)
    normal       mean + std * sqrt(-2 log(1 - u1)) * cos(2 pi u2)   (Box-Muller)      (a, b = mean, std)
    log_normal   exp(normal)                                                          (a, b = mean, std)
    exponential  log(1 - u) capped at -eps/2 (never 0), times -1 / lambda             (a, b = -1/lambda, -eps/2)
    geometric    max(1, ceil(log(1 - u) / log(1 - p)))                                (a = 1 / log1p(-p))
    cauchy       median + sigma * tan(pi u - pi / 2)                                  (a, b = median, sigma)
    bernoulli    u < p  (1.0 or 0.0)                                                  (a = p)

``log(1 - u)`` is one ScalarE activation (``scale=-1, bias=1``); 1 - u is exact in fp32, and
never 0, so no log(0). The store casts the fp32 tile to ``dtype``.

``randint_kernel(seed, low, span, n, dtype)``: integers ``low + bits mod span`` from 32 random bits
per element (``nisa.rng`` into a uint32 tile; the ALU computes integer ops exactly), stored as
``dtype`` (int32 or a float dtype; the caller widens to int64 on the device).

``count_kernel(table, values, strict)``: ``out[r, s] = #{k : table[r, k] < values[r, s]}``
(``<=`` unless ``strict``), as int32. Inverse-CDF sampling (``multinomial``: the index of a
uniform u in a row's cumulative sums is the number of sums <= u) and ranks (``randperm``: the rank
of each of n distinct random keys among them is a uniformly random permutation) are this count.
A row of ``table`` is broadcast to all partitions; each partition holds one value of ``values`` as
a column, and one ``tensor_scalar_reduce`` per column chunk compares and counts.
"""
from __future__ import annotations

import math

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import DMA_ROW_BYTES, PMAX, check_sbuf
from torchneuron.kernels.random import _tiles

DISTRIBUTIONS = ("uniform", "normal", "log_normal", "exponential", "geometric", "cauchy", "bernoulli")
KCHUNK = 4096            # table columns compared per instruction in count_kernel
ONE, MINUS_HALF_PI = 4, 5  # constant columns after the 4 parameters: ScalarE biases (tiles on NeuronCore-v2)


def _uniform(t, pp, ff):
    """Uniforms in [0, 1) into the fp32 tile ``t[:pp, :ff]``: random bits written over its words, the top 24 kept."""
    bits = t[:pp, :ff].ap([[ff, pp], [1, ff]], dtype=nl.uint32)
    nisa.rng(dst=bits)
    nisa.tensor_scalar(dst=bits, data=bits, op0=nl.right_shift, operand0=8)
    nisa.tensor_scalar(dst=t[:pp, :ff], data=bits, op0=nl.multiply, operand0=2.0 ** -24)


def _log1m(dst, u, col, pp, ff):
    """``log(1 - u)`` (ScalarE: the function of ``u * -1 + 1``, the 1 a bias column as NeuronCore-v2 needs)."""
    nisa.activation(dst=dst[:pp, :ff], op=nl.log, data=u[:pp, :ff], scale=-1.0, bias=col(ONE))


def _draw(dist, y, w, col, pp, ff):
    """Draw ``dist`` into the fp32 tile ``y[:pp, :ff]`` (``w`` a scratch tile, ``col(i)`` parameter i)."""
    if dist == "uniform":
        _uniform(y, pp, ff)
        nisa.tensor_tensor(dst=w[:pp, 0:1], data1=col(1), data2=col(0), op=nl.subtract)
        nisa.tensor_scalar(dst=y[:pp, :ff], data=y[:pp, :ff], op0=nl.multiply, operand0=w[:pp, 0:1], op1=nl.add,
                           operand1=col(0))
        # lo + u * (hi - lo) may round up to hi: cap at the largest value of the dtype below hi
        nisa.tensor_scalar(dst=y[:pp, :ff], data=y[:pp, :ff], op0=nl.minimum, operand0=col(2))
    elif dist in ("normal", "log_normal"):
        _uniform(y, pp, ff)
        _uniform(w, pp, ff)
        _log1m(y, y, col, pp, ff)
        nisa.activation(dst=y[:pp, :ff], op=nl.sqrt, data=y[:pp, :ff], scale=-2.0)
        nisa.activation(dst=w[:pp, :ff], op=nl.cos, data=w[:pp, :ff], scale=2.0 * math.pi)
        nisa.scalar_tensor_tensor(dst=y[:pp, :ff], data=y[:pp, :ff], op0=nl.multiply, operand0=col(1),
                                  op1=nl.multiply, operand1=w[:pp, :ff])
        if dist == "log_normal":
            nisa.activation(dst=y[:pp, :ff], op=nl.exp, data=y[:pp, :ff], bias=col(0))
        else:
            nisa.tensor_scalar(dst=y[:pp, :ff], data=y[:pp, :ff], op0=nl.add, operand0=col(0))
    elif dist == "exponential":
        _uniform(y, pp, ff)
        _log1m(y, y, col, pp, ff)
        # as CUDA does: log(1 - u) = 0 would give 0, which the distribution excludes
        nisa.tensor_scalar(dst=y[:pp, :ff], data=y[:pp, :ff], op0=nl.minimum, operand0=col(1),
                           op1=nl.multiply, operand1=col(0))
    elif dist == "geometric":
        _uniform(y, pp, ff)
        _log1m(y, y, col, pp, ff)
        nisa.activation(dst=y[:pp, :ff], op="ceil", data=y[:pp, :ff], scale=col(0))
        nisa.tensor_scalar(dst=y[:pp, :ff], data=y[:pp, :ff], op0=nl.maximum, operand0=1.0)
    elif dist == "cauchy":
        _uniform(y, pp, ff)
        nisa.activation(dst=y[:pp, :ff], op="tan", data=y[:pp, :ff], scale=math.pi, bias=col(MINUS_HALF_PI))
        nisa.tensor_scalar(dst=y[:pp, :ff], data=y[:pp, :ff], op0=nl.multiply, operand0=col(1),
                           op1=nl.add, operand1=col(0))
    elif dist == "bernoulli":
        _uniform(y, pp, ff)
        nisa.tensor_scalar(dst=y[:pp, :ff], data=y[:pp, :ff], op0=nl.less, operand0=col(0))
    else:
        raise AssertionError(f"sample_kernel: unknown distribution {dist!r} (one of {DISTRIBUTIONS})")


def _seed(seed):
    """Seed the core's PRNG from the [1, 1] int32 ``seed``: the launch's stream of random numbers."""
    assert tuple(seed.shape) == (1, 1) and seed.dtype == nl.int32, "sampling: seed is a [1, 1] int32 tensor"
    s_t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s_t, src=seed)
    nisa.set_rng_seed(src_seeds=s_t)


@nki.jit
def sample_kernel(seed, params, n, dist, dtype):
    """A flat [n] ``dtype`` tensor drawn from ``dist`` with ``params`` (see the module docstring)."""
    assert tuple(params.shape) == (1, 4) and params.dtype == nl.float32, "sample: params is a [1, 4] fp32 tensor"
    F = DMA_ROW_BYTES // 4
    check_sbuf(2 * 2 * F * 4 + 24, "sample")                  # y and scratch, double-buffered; the columns
    out = nl.ndarray((n,), dtype, buffer=nl.shared_hbm)
    _seed(seed)
    prm = nl.ndarray((PMAX, 6), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=prm[:, 0:4], src=params.broadcast_to((PMAX, 4)))
    nisa.memset(dst=prm[:, ONE:ONE + 1], value=1.0)
    nisa.memset(dst=prm[:, MINUS_HALF_PI:MINUS_HALF_PI + 1], value=-math.pi / 2)
    f = max(1, min(F, n // PMAX))
    keep = []
    for s, pp, ff in _tiles(n, f):
        y = nl.ndarray((PMAX, f), nl.float32, buffer=nl.sbuf)
        w = nl.ndarray((PMAX, f), nl.float32, buffer=nl.sbuf)
        _draw(dist, y, w, lambda i, pp=pp: prm[:pp, i:i + 1], pp, ff)
        nisa.dma_copy(dst=out[s:s + pp * ff].reshape((pp, ff)), src=y[:pp, :ff])
        keep = [y, w, *keep][:4]                               # two iterations' tiles alive: overlap
    return out


@nki.jit
def randint_kernel(seed, low, span, n, dtype):
    """A flat [n] ``dtype`` tensor of ``low + (32 random bits mod span)``."""
    assert tuple(low.shape) == (1, 1) and tuple(span.shape) == (1, 1), "randint: low and span are [1, 1] tensors"
    F = DMA_ROW_BYTES // 4
    check_sbuf(2 * 2 * F * 4 + 16, "randint")
    out = nl.ndarray((n,), dtype, buffer=nl.shared_hbm)
    _seed(seed)
    lo = nl.ndarray((PMAX, 1), low.dtype, buffer=nl.sbuf)
    sp = nl.ndarray((PMAX, 1), span.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=lo, src=low.broadcast_to((PMAX, 1)))
    nisa.dma_copy(dst=sp, src=span.broadcast_to((PMAX, 1)))
    f = max(1, min(F, n // PMAX))
    store = nl.int32 if dtype in (nl.int32, nl.int16, nl.int8, nl.uint8) else nl.float32
    keep = []
    for s, pp, ff in _tiles(n, f):
        bits = nl.ndarray((PMAX, f), nl.uint32, buffer=nl.sbuf)
        y = nl.ndarray((PMAX, f), store, buffer=nl.sbuf)
        nisa.rng(dst=bits[:pp, :ff])
        nisa.tensor_scalar(dst=y[:pp, :ff], data=bits[:pp, :ff], op0="mod", operand0=sp[:pp],
                           op1=nl.add, operand1=lo[:pp])
        nisa.dma_copy(dst=out[s:s + pp * ff].reshape((pp, ff)), src=y[:pp, :ff])
        keep = [bits, y, *keep][:4]
    return out


@nki.jit
def count_kernel(table, values, strict):
    """[R, S] int32 counts of ``table[r, :] < values[r, s]`` (``<=`` unless ``strict``)."""
    R, K = table.shape
    R2, S = values.shape
    assert R == R2, f"count: table has {R} rows, values {R2}"
    assert table.dtype == values.dtype, "count: table and values share a dtype"
    kc = min(K, KCHUNK)
    nchunks = -(-K // kc)
    check_sbuf(K * 4 + kc * 2 + nchunks * 4 + 16, "count")
    out = nl.ndarray((R, S), nl.int32, buffer=nl.shared_hbm)
    op = nl.less if strict else nl.less_equal
    for r in range(R):
        row = nl.ndarray((PMAX, K), table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=table[r:r + 1, :].broadcast_to((PMAX, K)))
        for s0 in range(0, S, PMAX):
            p = min(PMAX, S - s0)
            v = nl.ndarray((PMAX, 1), values.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=v[:p], src=values[r:r + 1, s0:s0 + p].reshape((p, 1)))
            parts = nl.ndarray((PMAX, nchunks), nl.float32, buffer=nl.sbuf)
            for c in range(nchunks):
                k0, k1 = c * kc, min(K, (c + 1) * kc)
                hits = nl.ndarray((PMAX, kc), nl.bfloat16, buffer=nl.sbuf)   # 0/1: exact in bf16
                nisa.tensor_scalar_reduce(dst=hits[:p, :k1 - k0], data=row[:p, k0:k1], op0=op, operand0=v[:p],
                                          reduce_op=nl.add, reduce_res=parts[:p, c:c + 1])
            cnt = nl.ndarray((PMAX, 1), nl.int32, buffer=nl.sbuf)
            if nchunks == 1:
                nisa.tensor_copy(dst=cnt[:p], src=parts[:p, 0:1])
            else:
                nisa.tensor_reduce(dst=cnt[:p], op=nl.add, data=parts[:p], axis=1, keepdims=True)
            nisa.dma_copy(dst=out[r:r + 1, s0:s0 + p].reshape((p, 1)), src=cnt[:p])
    return out
