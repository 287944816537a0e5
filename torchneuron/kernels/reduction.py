"""Reductions along any dim: sum, mean, prod, max, min, argmax, argmin.

The host view is [outer, R, inner] with R the reduced dim. The reduced dim always ends on the free
axis of an fp32 tile, with every DMA reading contiguous runs:

    inner == 1: 128 rows of [outer, R] on the partitions, R in column blocks of RW (8 Ki) along the
                free axis (contiguous rows); a running result combines the blocks
    outer == 1, inner <= 512 (a bias gradient, or inner == 1: a whole tensor): rows grouped G per
                partition, reduced over their G rows into a running [128, inner]; at the end one
                TensorE transpose per 128 columns puts the 128 partials on the free axis, reduced
                there (all ops but arg*)
    inner  > 1: rows (o, r) of (no outer indices x up to 128 reduced positions) on the partitions,
                512 contiguous inner columns per load (2 KiB runs); four nc_transpose (TensorE,
                bit-exact) put 128 inner positions on the partitions and (o, r) on the free axis of
                one PSUM bank; the reduction reads PSUM; results [128 inner, 4, no] are transposed
                back once per block of columns and stored as contiguous rows of out[o, inner]
    per block:  tensor_reduce over the free axis (VectorE), combined with the running result;
                argmax: max8 + nc_find_index8 (first index of the maximum), argmin the same on -x;
                NaN: sum/max/min propagate it like PyTorch, arg* return the first NaN's index
                (a second max8/nc_find_index8 on the x != x mask)

Tiles of the last NBUF blocks stay alive so loads overlap the reductions. Any R and inner size.
Not modelled exactly: when a +inf comes before the first NaN of a reduced row arg* still return the
first NaN (as PyTorch does); indices are carried in fp32 (exact below 2**24 elements per row).
"""
from __future__ import annotations

import collections

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, as_tensor, cdiv, load_grouped, prod, row_blocks

NBUF = 3
RW = 8192        # reduced elements per block of the inner == 1 path (32 KiB fp32 per partition)
IW = 512         # inner columns per load of the inner > 1 path (4 transposes)
OPS = {"sum": nl.add, "mean": nl.add, "prod": nl.multiply, "max": nl.maximum, "min": nl.minimum}
ARG = ("argmax", "argmin")
BIG = float(1 << 24)


def _col(p=PMAX, n=1):
    return nl.ndarray((p, n), nl.float32, buffer=nl.sbuf)


def _arg_block(data, p, w, r0):
    """(value, index) columns of the first maximum of data[:p, :w] (any NaN wins: its first index)."""
    W8 = max(w, 8)
    if w < 8:                                    # max8 needs 8 elements: pad with -inf
        pad = nl.ndarray((PMAX, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=pad[:p], value=float("-inf"))
        nisa.tensor_copy(dst=pad[:p, :w], src=data)
        data = pad[:p]
    m8 = nl.ndarray((PMAX, 8), nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=m8[:p], src=data)
    i8 = nl.ndarray((PMAX, 8), nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=i8[:p], data=data, vals=m8[:p])
    # the NaN mask: its first 1 is the first NaN (the index is only used where the max is NaN)
    nan = nl.ndarray((PMAX, W8), nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=nan[:p], data1=data, data2=data, op=nl.not_equal, engine=nisa.gpsimd_engine)
    n8 = nl.ndarray((PMAX, 8), nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=n8[:p], src=nan[:p])
    j8 = nl.ndarray((PMAX, 8), nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=j8[:p], data=nan[:p], vals=n8[:p])
    idx, nidx, isn = _col(), _col(), _col()
    nisa.tensor_copy(dst=idx[:p], src=i8[:p, 0:1])
    nisa.tensor_copy(dst=nidx[:p], src=j8[:p, 0:1])
    nisa.tensor_tensor(dst=isn[:p], data1=m8[:p, 0:1], data2=m8[:p, 0:1], op=nl.not_equal)
    nisa.tensor_tensor(dst=nidx[:p], data1=nidx[:p], data2=idx[:p], op=nl.subtract)       # idx += isn*(nidx-idx)
    nisa.scalar_tensor_tensor(dst=idx[:p], data=nidx[:p], op0=nl.multiply, operand0=isn[:p], op1=nl.add,
                              operand1=idx[:p])
    if r0:
        nisa.tensor_scalar(dst=idx[:p], data=idx[:p], op0=nl.add, operand0=float(r0))
    return m8[:p, 0:1], idx[:p]


def _arg_combine(m, i, mc, ic, p, w=1):
    """Running (m, i) <- (mc, ic) where mc > m, or mc is NaN and m is not (earlier blocks win ties);
    all four are [p, w] columns."""
    take, t2, nan_c, d = (_col(PMAX, w)[:p, :w] for _ in range(4))
    nisa.tensor_tensor(dst=take, data1=mc, data2=m, op=nl.greater)
    nisa.tensor_tensor(dst=t2, data1=m, data2=m, op=nl.equal)                # m is not NaN
    nisa.tensor_tensor(dst=nan_c, data1=mc, data2=mc, op=nl.not_equal)
    nisa.tensor_tensor(dst=t2, data1=t2, data2=nan_c, op=nl.multiply)
    nisa.tensor_tensor(dst=take, data1=take, data2=t2, op=nl.maximum)
    nisa.tensor_tensor(dst=d, data1=ic, data2=i, op=nl.subtract)
    if w == 1:
        nisa.scalar_tensor_tensor(dst=i, data=d, op0=nl.multiply, operand0=take, op1=nl.add, operand1=i)
    else:                                                                    # (P, 1) operands only
        nisa.tensor_tensor(dst=d, data1=d, data2=take, op=nl.multiply)
        nisa.tensor_tensor(dst=i, data1=i, data2=d, op=nl.add)
    nisa.tensor_tensor(dst=m, data1=m, data2=mc, op=nl.maximum)              # NaN propagates


def _arg_columns(view, pw, ns, no, rp, r0, desc):
    """(max, first index) of every row view[:pw, s, o, :rp] at once, as [pw, ns*no] columns: the max by
    one reduction, then the first position equal to it (or the first NaN: x == NaN is never true, so
    the NaN mask alone marks the hits of a row holding one) scored by rp - r and taken by a max."""
    k, shape = ns * no, (PMAX, 4, no, rp)
    m, sc = _col(PMAX, 4 * no), _col(PMAX, 4 * no)
    nisa.tensor_reduce(dst=m[:pw, :k].reshape((pw, ns, no)), op=nl.maximum, data=view, axis=(3,))
    hit, nan = (nl.ndarray(shape, nl.float32, buffer=nl.sbuf) for _ in range(2))
    # the NaN mask on GpSimd (it runs ahead: nothing of VectorE's feeds it), the rest on VectorE
    nisa.tensor_tensor(dst=nan[:pw, :ns], data1=view, data2=view, op=nl.not_equal, engine=nisa.gpsimd_engine)
    for s in range(ns):
        for o in range(no):
            c = s * no + o                   # hit = (x == max) or x is NaN, one fused pass per row
            nisa.scalar_tensor_tensor(dst=hit[:pw, s, o], data=view[:, s, o], op0=nl.equal, operand0=m[:pw, c:c + 1],
                                      op1=nl.maximum, operand1=nan[:pw, s, o])
    nisa.tensor_tensor(dst=hit[:pw, :ns], data1=hit[:pw, :ns], op=nl.multiply,
                       data2=desc[:pw, :rp].ap([[desc.shape[1], pw], [0, ns], [0, no], [1, rp]]))
    nisa.tensor_reduce(dst=sc[:pw, :k].reshape((pw, ns, no)), op=nl.maximum, data=hit[:pw, :ns], axis=(3,))
    # first index = r0 + RP - score (desc holds RP - r for r < RP)
    nisa.tensor_scalar(dst=sc[:pw, :k], data=sc[:pw, :k], op0=nl.subtract, operand0=float(r0 + desc.shape[1]),
                       reverse0=True)
    return m[:pw, :k], sc[:pw, :k]


def _reduce_rows(x, out, op, O, R):
    """inner == 1: rows on partitions, R in blocks of RW along the free axis."""
    flat = x.reshape((O, R))
    ring = collections.deque(maxlen=NBUF)
    for r0 in range(0, O, PMAX):
        p = min(PMAX, O - r0)
        acc = idx = None
        for c0 in range(0, R, RW):
            w = min(RW, R - c0)
            t = nl.ndarray((PMAX, RW), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=t[:p, :w], src=flat[r0:r0 + p, c0:c0 + w])
            if op in ARG:
                if op == "argmin":               # argmin(x) = argmax(-x) (NaN stays NaN)
                    nisa.activation(dst=t[:p, :w], op=nl.identity, data=t[:p, :w], scale=-1.0)
                mc, ic = _arg_block(t[:p, :w], p, w, c0)
                if acc is None:
                    acc, idx = _col(), _col()
                    nisa.tensor_copy(dst=acc[:p], src=mc)
                    nisa.tensor_copy(dst=idx[:p], src=ic)
                else:
                    _arg_combine(acc[:p], idx[:p], mc, ic, p)
            else:
                part = _col()
                nisa.tensor_reduce(dst=part[:p], op=OPS[op], data=t[:p, :w], axis=(1,))
                if acc is None:
                    acc = part
                else:
                    nisa.tensor_tensor(dst=acc[:p], data1=acc[:p], data2=part[:p], op=OPS[op])
            ring.append(t)
        res = idx if op in ARG else acc
        if op == "mean":
            nisa.tensor_scalar(dst=res[:p], data=res[:p], op0=nl.multiply, operand0=1.0 / R)
        nisa.dma_copy(dst=out[r0:r0 + p, :], src=res[:p])
        ring.append((acc, idx))


def _reduce_inner(x, out, op, O, R, I):
    """inner > 1: (o, r) rows on partitions, 512 inner columns per load, TensorE transposes."""
    NO = max(1, min(PMAX // R, 32, O)) if R < PMAX else 1     # outer indices per tile (4 * NO <= 128 results)
    RP = min(R, PMAX)                                        # reduced positions per tile
    xf = x.reshape((O * R * I,))
    of = out.reshape((O * I,))
    ring = collections.deque(maxlen=NBUF)
    desc = None
    if op in ARG:                                            # RP - r along the free axis: scores first hits
        desc = nl.ndarray((PMAX, RP), nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=desc, pattern=[[-1, RP]], offset=RP)
    for o0 in range(0, O, NO):
        no = min(NO, O - o0)
        for i0 in range(0, I, IW):
            iw = min(IW, I - i0)
            ns = cdiv(iw, PMAX)
            pw = min(PMAX, iw)                               # inner positions on the partitions
            acc = _col(PMAX, 4 * no)                         # results [128 inner, slice, o]
            idx = _col(PMAX, 4 * no) if op in ARG else None
            for r0 in range(0, R, RP):
                rp = min(RP, R - r0)
                rows = no * rp
                t = nl.ndarray((PMAX, IW), nl.float32, buffer=nl.sbuf)
                src = xf.ap([[R * I, no], [I, rp], [1, iw]], offset=o0 * R * I + r0 * I + i0)
                nisa.dma_copy(dst=t[:rows, :iw], src=src)
                tp = nl.ndarray((PMAX, 4, PMAX), nl.float32, buffer=nl.psum)
                for s in range(ns):
                    w = min(PMAX, iw - s * PMAX)
                    nisa.nc_transpose(dst=tp[:w, s, :rows], data=t[:rows, s * PMAX:s * PMAX + w])
                # (a ragged last slice leaves partitions >= w of its column unused: never stored)
                view = tp[:pw, :ns, :rows].reshape((pw, ns, no, rp))
                if op in ARG:
                    # to SBUF on ScalarE (GpSimd cannot read PSUM); argmin(x) = argmax(-x) (NaN stays NaN)
                    ev = nl.ndarray((PMAX, 4, no, rp), nl.float32, buffer=nl.sbuf)
                    nisa.activation(dst=ev[:pw, :ns], op=nl.identity, data=view, scale=-1.0 if op == "argmin" else 1.0)
                    view = ev[:pw, :ns]
                    mc, ic = _arg_columns(view, pw, ns, no, rp, r0, desc)
                    k = ns * no
                    if r0 == 0:
                        nisa.tensor_copy(dst=acc[:pw, :k], src=mc)
                        nisa.tensor_copy(dst=idx[:pw, :k], src=ic)
                    else:
                        _arg_combine(acc[:pw, :k], idx[:pw, :k], mc, ic, pw, k)
                    ring.append((t, tp, view, mc, ic))
                    continue
                part = acc if r0 == 0 else _col(PMAX, 4 * no)
                nisa.tensor_reduce(dst=part[:pw, :ns * no].reshape((pw, ns, no)), op=OPS[op], data=view, axis=(3,))
                if r0:
                    nisa.tensor_tensor(dst=acc[:pw, :ns * no], data1=acc[:pw, :ns * no], data2=part[:pw, :ns * no],
                                       op=OPS[op])
                ring.append((t, tp, part))
            res = idx if op in ARG else acc
            if op == "mean":
                nisa.tensor_scalar(dst=res[:pw, :ns * no], data=res[:pw, :ns * no], op0=nl.multiply, operand0=1.0 / R)
            # results back to rows: [128 inner, (s, o)] -> [(s, o), 128 inner], stored as runs of 128
            rt = nl.ndarray((4 * NO, PMAX), nl.float32, buffer=nl.psum)
            nisa.nc_transpose(dst=rt[:ns * no, :pw], data=res[:pw, :ns * no])
            ro = nl.ndarray((4 * NO, PMAX), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=ro[:ns * no, :pw], src=rt[:ns * no, :pw])
            full = iw // PMAX if iw >= PMAX else 0           # whole slices, then a ragged one
            if full:
                dst = of.ap([[PMAX, full], [I, no], [1, PMAX]], offset=o0 * I + i0)
                nisa.dma_copy(dst=dst, src=ro[:full * no, :PMAX])
            if full < ns:
                w = iw - full * PMAX
                dst = of.ap([[I, no], [1, w]], offset=o0 * I + i0 + full * PMAX)
                nisa.dma_copy(dst=dst, src=ro[full * no:ns * no, :w])
            ring.append((acc, idx, rt, ro))


IDENTITY = {"sum": 0.0, "mean": 0.0, "prod": 1.0, "max": float("-inf"), "min": float("inf")}


def _reduce_leading(x, out, op, R, I, pre=None, post=None):
    """outer == 1, inner <= 512 (a bias gradient: sum over the rows of [R, I]): rows grouped G per
    partition ([128, G, I] tiles, one DMA each), each tile reduced over its G rows into a running
    [128, I] (the op's identity where a partition has no rows); at the end the 128 partials of each
    column are brought to the free axis by one TensorE transpose per 128 columns and reduced there.
    ``pre``: a tile function applied to each loaded tile first; ``post``: one applied to each column of
    results before its store (``norm2_kernel``'s squares and square root)."""
    flat = x.reshape((R, I))
    blocks, G = row_blocks(R, I)
    acc = _col(PMAX, I)
    nisa.memset(dst=acc, value=IDENTITY[op])
    ring = collections.deque(maxlen=NBUF)
    for r0, p, g in blocks:
        t = load_grouped(flat, r0, p, g)
        rows = t[:p] if pre is None else pre(t[:p])
        part = _col(PMAX, I)
        nisa.tensor_reduce(dst=part[:p], op=OPS[op], data=rows.ap([[g * I, p], [1, I], [I, g]]), axis=(2,))
        nisa.tensor_tensor(dst=acc[:p], data1=acc[:p], data2=part[:p], op=OPS[op])
        ring.append((t, rows, part))
    for i0 in range(0, I, PMAX):
        w = min(PMAX, I - i0)
        tp = nl.ndarray((PMAX, PMAX), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=tp[:w, :], data=acc[:, i0:i0 + w])
        res = _col()
        nisa.tensor_reduce(dst=res[:w], op=OPS[op], data=tp[:w, :], axis=(1,))
        if op == "mean":
            nisa.tensor_scalar(dst=res[:w], data=res[:w], op0=nl.multiply, operand0=1.0 / R)
        col = res[:w] if post is None else post(res[:w])
        nisa.dma_copy(dst=out.ap([[1, w], [1, 1]], offset=i0), src=col)
        ring.append((tp, res, col))


@nki.jit
def reduce_kernel(x, op="sum", out_dtype=None):
    """Reduce the middle dim of [outer, R, inner]; returns [outer, inner] in ``out_dtype`` (default x's; the
    accumulation is fp32 either way, so ``sum(bf16, dtype=fp32)`` is one pass; argmax/argmin: int32 indices)."""
    O, R, I = x.shape
    assert op in (*OPS, *ARG), f"reduce: unknown op {op!r}"
    assert R >= 1, "reduce: the reduced dim is empty"
    if op in ARG:
        assert R < 1 << 24, f"{op}: the reduced dim has {R} elements; indices are exact below 2**24"
    out = nl.ndarray((O, I), nl.int32 if op in ARG else out_dtype or x.dtype, buffer=nl.shared_hbm)
    if O == 1 and I <= 4 * PMAX and op not in ARG:   # a whole-tensor reduction too: spread over 128 partitions
        _reduce_leading(x, out, op, R, I)
    elif I == 1:
        _reduce_rows(x, out, op, O, R)
    else:
        _reduce_inner(x, out, op, O, R, I)
    return out


@nki.jit
def norm2_kernel(x):
    """The 2-norm of all of ``x`` ([N, 1], a float dtype) as (1, 1) of x's dtype, in one launch of what the
    element-wise |x|, its square, the sum and the square root launch one by one, with the same arithmetic in
    the same order (bit-identical): VectorE squares each loaded tile in fp32 (|x| squared is x squared), the
    squares are summed as ``reduce_kernel`` sums a whole tensor, ScalarE takes the square root in fp32, and the
    store rounds it once to x's dtype (an fp16 sum of squares would overflow past 65504; fp32 does not)."""
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    norm2_into(x, out)
    return out


def norm2_into(x, out) -> None:
    """``norm2_kernel``'s instructions: the 2-norm of all of ``x`` ([N, 1]) stored into the (1, 1) ``out`` (its
    dtype rounds the fp32 square root once); ``foreach_norm_kernel`` runs them for each tensor of a list."""
    N = x.shape[0]
    assert tuple(x.shape) == (N, 1) and N >= 1, f"norm2: x is {x.shape}, not [N >= 1, 1]"
    _reduce_leading(x, out, "sum", N, 1, pre=lambda t: nl.multiply(t, t), post=nl.sqrt)


def reduce(x, dim: int, op: str = "sum", keepdim: bool = False):
    """``torch.<op>(x, dim)`` (sum, mean, prod, max and min values, argmax, argmin) through the simulator."""
    x = as_tensor(x)
    assert op in (*OPS, *ARG), f"unknown reduction {op!r}"
    if x.dim() == 0:
        x = x.reshape(1)
        r = reduce(x, 0, op, False)
        return r.reshape(())
    dim = dim % x.dim()
    O, R, I = prod(x.shape[:dim]), x.shape[dim], prod(x.shape[dim + 1:])
    r = reduce_kernel(x.reshape(O, R, I), op=op)
    shape = list(x.shape)
    shape[dim] = 1
    r = r.reshape(shape)
    r = r.long() if op in ARG else r
    return r if keepdim else r.squeeze(dim)


def sum(x, dim, keepdim=False):  # noqa: A001
    """``torch.sum(x, dim)``."""
    return reduce(x, dim, "sum", keepdim)


def mean(x, dim, keepdim=False):
    """``torch.mean(x, dim)``."""
    return reduce(x, dim, "mean", keepdim)


def amax(x, dim, keepdim=False):
    """``torch.amax(x, dim)``."""
    return reduce(x, dim, "max", keepdim)


def amin(x, dim, keepdim=False):
    """``torch.amin(x, dim)``."""
    return reduce(x, dim, "min", keepdim)


def argmax(x, dim, keepdim=False):
    """``torch.argmax(x, dim)`` (first index of the maximum; of the first NaN if any)."""
    return reduce(x, dim, "argmax", keepdim)


def argmin(x, dim, keepdim=False):
    """``torch.argmin(x, dim)`` (first index of the minimum; of the first NaN if any)."""
    return reduce(x, dim, "argmin", keepdim)


def prod_(x, dim, keepdim=False):
    """``torch.prod(x, dim)`` (fp32 on chip)."""
    return reduce(x, dim, "prod", keepdim)
