"""int64 comparisons, selections, negation, products and exact integer reductions on a core without
64-bit integers.

An int64 is its little-endian pair of int32 words (low, high), as in ``kernels/int64.py``. The low
words are read as uint32 and the high words as int32 (strided DMAs over the word pairs); every
integer op on the engines is exact on such tiles, so:

- a comparison compares the high words (signed) and, where they are equal, the low words (unsigned);
- maximum/minimum/where/abs select whole values: both words are chosen by one 0/1 mask;
- bitwise and/or/xor work on each word alone;
- neg is ``-low`` (wrapping mod 2**32) with a borrow ``low != 0`` out of the high word; sign reads
  the high word's sign, or ``low != 0`` when it is zero;
- ``int64_mul`` multiplies 16-bit digits (products < 2**32) and sums them by columns with carries;
- ``int_sum`` sums rows of 8-32-bit ints (or int64 words) exactly: each value is split into 16-bit
  pieces whose block sums cannot overflow int32, the running sums are renormalised to 16-bit digits
  after each block, and the top digit wraps mod 2**32 as int64 sums wrap in PyTorch;
- ``int64_extreme`` (row max/min) takes the high words' extreme, then the low words' extreme among
  the elements that attain it.
"""
from __future__ import annotations


from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, flat_blocks
from torchneuron.kernels.int64 import word as _word

F = 2048          # elements per partition of one block (8 KiB int32 rows)
CMP = {"eq": nl.equal, "ne": nl.not_equal, "lt": nl.less, "le": nl.less_equal, "gt": nl.greater,
       "ge": nl.greater_equal}
STRICT = {"lt": nl.less, "le": nl.less, "gt": nl.greater, "ge": nl.greater}   # decides on unequal high words


def _load(t, s, p, w):
    """(low as uint32, high as int32) SBUF tiles of a block of an int64 word tensor."""
    lo = nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)
    hi = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=lo[:p], src=_word(t, s, p, w, 0, nl.uint32))
    nisa.dma_copy(dst=hi[:p], src=_word(t, s, p, w, 1, nl.int32))
    return lo, hi


def _compare(alo, ahi, blo, bhi, op, p, w):
    """0/1 int32 tile of ``a op b`` for int64 values given as words."""
    res = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
    heq = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
    low = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=heq[:p], data1=ahi[:p], data2=bhi[:p], op=nl.equal)
    nisa.tensor_tensor(dst=low[:p], data1=alo[:p], data2=blo[:p], op=CMP[op])    # unsigned: uint32 tiles
    if op == "eq":
        nisa.tensor_tensor(dst=res[:p], data1=heq[:p], data2=low[:p], op=nl.multiply)
    elif op == "ne":
        nisa.tensor_scalar(dst=heq[:p], data=heq[:p], op0=nl.subtract, operand0=1, reverse0=True)
        nisa.tensor_tensor(dst=res[:p], data1=heq[:p], data2=low[:p], op=nl.maximum)
    else:  # strict on the high words, else the low words' verdict
        nisa.tensor_tensor(dst=res[:p], data1=ahi[:p], data2=bhi[:p], op=STRICT[op])
        nisa.tensor_tensor(dst=heq[:p], data1=heq[:p], data2=low[:p], op=nl.multiply)
        nisa.tensor_tensor(dst=res[:p], data1=res[:p], data2=heq[:p], op=nl.add)
    return res


def _select(m, x, y, p, w, dtype):
    """``m ? x : y`` per element (m 0/1) as ``y + m * (x - y)``: exact, the engines compute ints in 64 bits."""
    d = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
    r = nl.ndarray((PMAX, w), dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=d[:p], data1=x[:p], data2=y[:p], op=nl.subtract)
    nisa.tensor_tensor(dst=d[:p], data1=d[:p], data2=m[:p], op=nl.multiply)
    nisa.tensor_tensor(dst=r[:p], data1=y[:p], data2=d[:p], op=nl.add)
    return r


def _store(out, s, p, w, lo, hi):
    nisa.dma_copy(dst=out.ap([[2 * w, p], [2, w]], offset=2 * s, dtype=nl.uint32), src=lo[:p])
    nisa.dma_copy(dst=out.ap([[2 * w, p], [2, w]], offset=2 * s + 1, dtype=nl.int32), src=hi[:p])


def _n(a, b):
    n = max(a.shape[0], b.shape[0])
    assert a.shape[1] == 2 and b.shape[1] == 2 and {a.shape[0], b.shape[0]} <= {1, n}, \
        "int64 operands are [n, 2] words ([1, 2]: one value for all)"
    return n


@nki.jit
def int64_compare(a, b, op):
    """``a op b`` (eq/ne/lt/le/gt/ge) as bool [n] for int64 values given as [n, 2] int32 words."""
    n = _n(a, b)
    out = nl.ndarray((n,), nl.bool_, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n, F):
        alo, ahi = _load(a, s, p, w)
        blo, bhi = _load(b, s, p, w)
        res = _compare(alo, ahi, blo, bhi, op, p, w)
        nisa.dma_copy(dst=out[s:s + p * w].reshape((p, w)), src=res[:p])
    return out


@nki.jit
def int64_minmax(a, b, op):
    """Element-wise ``maximum`` (op "max") or ``minimum`` ("min") of int64 words [n, 2]; returns [n, 2] words."""
    n = _n(a, b)
    out = nl.ndarray((n, 2), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n, F):
        alo, ahi = _load(a, s, p, w)
        blo, bhi = _load(b, s, p, w)
        m = _compare(alo, ahi, blo, bhi, "gt" if op == "max" else "lt", p, w)
        _store(out, s, p, w, _select(m, alo, blo, p, w, nl.uint32), _select(m, ahi, bhi, p, w, nl.int32))
    return out


@nki.jit
def int64_where(c, a, b):
    """``c ? a : b`` with c a 0/1 [n] (or [1]) int tensor and a, b int64 words [n, 2] (or [1, 2])."""
    n = max(_n(a, b), c.shape[0])
    assert {a.shape[0], b.shape[0], c.shape[0]} <= {1, n}, "int64_where: operands are [n] or one value"
    out = nl.ndarray((n, 2), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n, F):
        alo, ahi = _load(a, s, p, w)
        blo, bhi = _load(b, s, p, w)
        m = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
        src = c.ap([[0, p], [0, w]]) if c.shape[0] == 1 else c[s:s + p * w].reshape((p, w))
        nisa.dma_copy(dst=m[:p], src=src)
        nisa.tensor_scalar(dst=m[:p], data=m[:p], op0=nl.not_equal, operand0=0)   # uint8 conditions: any nonzero
        _store(out, s, p, w, _select(m, alo, blo, p, w, nl.uint32), _select(m, ahi, bhi, p, w, nl.int32))
    return out


@nki.jit
def int64_unary(a, op):
    """``-a`` (op "neg"), ``|a|`` ("abs") or ``sign(a)`` ("sign") of int64 words [n, 2]; wraps at -2**63 like
    PyTorch."""
    n = a.shape[0]
    out = nl.ndarray((n, 2), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n, F):
        lo, hi = _load(a, s, p, w)
        nlo = nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)
        nhi = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
        borrow = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=nlo[:p], data=lo[:p], op0=nl.multiply, operand0=-1)         # the store wraps mod 2**32
        nisa.tensor_scalar(dst=borrow[:p], data=lo[:p], op0=nl.not_equal, operand0=0)
        nisa.tensor_scalar(dst=nhi[:p], data=hi[:p], op0=nl.multiply, operand0=-1)
        nisa.tensor_tensor(dst=nhi[:p], data1=nhi[:p], data2=borrow[:p], op=nl.subtract)   # int32 store wraps
        if op == "sign":  # low word: 1, 0 or -1 (all ones); high word: 0 or -1
            pos = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=nhi[:p], data=hi[:p], op0=nl.less, operand0=0)             # negative
            nisa.tensor_scalar(dst=pos[:p], data=hi[:p], op0=nl.greater, operand0=0)
            zero = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=zero[:p], data=hi[:p], op0=nl.equal, operand0=0)
            nisa.tensor_tensor(dst=zero[:p], data1=zero[:p], data2=borrow[:p], op=nl.multiply)   # hi == 0, lo != 0
            nisa.tensor_tensor(dst=pos[:p], data1=pos[:p], data2=zero[:p], op=nl.maximum)
            nisa.tensor_tensor(dst=nlo[:p], data1=pos[:p], data2=nhi[:p], op=nl.subtract)     # the store wraps -1
            nisa.tensor_scalar(dst=nhi[:p], data=nhi[:p], op0=nl.multiply, operand0=-1)
        if op == "abs":
            m = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=m[:p], data=hi[:p], op0=nl.less, operand0=0)
            nlo, nhi = _select(m, nlo, lo, p, w, nl.uint32), _select(m, nhi, hi, p, w, nl.int32)
        _store(out, s, p, w, nlo, nhi)
    return out


@nki.jit
def int64_bitwise(a, b, op):
    """Element-wise bitwise and/or/xor of int64 words [n, 2] (each word on its own); returns [n, 2] words."""
    n = _n(a, b)
    out = nl.ndarray((n, 2), nl.int32, buffer=nl.shared_hbm)
    fn = {"and": nl.bitwise_and, "or": nl.bitwise_or, "xor": nl.bitwise_xor}[op]
    for s, p, w in flat_blocks(n, F):
        alo, ahi = _load(a, s, p, w)
        blo, bhi = _load(b, s, p, w)
        nisa.tensor_tensor(dst=alo[:p], data1=alo[:p], data2=blo[:p], op=fn)
        nisa.tensor_tensor(dst=ahi[:p], data1=ahi[:p], data2=bhi[:p], op=fn)
        _store(out, s, p, w, alo, ahi)
    return out


def _col(dtype=nl.int32):
    return nl.ndarray((PMAX, 1), dtype, buffer=nl.sbuf)


@nki.jit
def int_sum(x, words):
    """Exact row sums of x [O, R] (8-32-bit ints, or int64 as [O, 2R] int32 words when ``words``) as int64
    words [O, 2]."""
    O, W = x.shape
    R = W // 2 if words else W
    out = nl.ndarray((O, 2), nl.int32, buffer=nl.shared_hbm)
    flat = x.reshape((O * W,))
    for r0 in range(0, O, PMAX):
        p = min(PMAX, O - r0)
        # running sum = a2 * 2**32 + a1 * 2**16 + a0; a0, a1 kept as 16-bit digits between blocks
        acc = [_col(), _col(), _col()]
        for a in acc:
            nisa.memset(dst=a[:p], value=0)
        for c0 in range(0, R, F):
            w = min(F, R - c0)
            if words:
                lo = nl.ndarray((PMAX, F), nl.uint32, buffer=nl.sbuf)
                top = nl.ndarray((PMAX, F), nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(dst=lo[:p, :w], src=flat.ap([[W, p], [2, w]], offset=r0 * W + 2 * c0, dtype=nl.uint32))
                nisa.dma_copy(dst=top[:p, :w], src=flat.ap([[W, p], [2, w]], offset=r0 * W + 2 * c0 + 1,
                                                            dtype=nl.int32))
            else:
                lo = nl.ndarray((PMAX, F), nl.int32, buffer=nl.sbuf)     # the DMA widens 8/16-bit ints exactly
                nisa.dma_copy(dst=lo[:p, :w], src=x[r0:r0 + p, c0:c0 + w])
                top = None
            d0 = nl.ndarray((PMAX, F), nl.int32, buffer=nl.sbuf)
            d1 = nl.ndarray((PMAX, F), nl.int32, buffer=nl.sbuf)
            # 16-bit pieces: |block sums| <= 2048 * 2**16, far from int32's limit
            nisa.tensor_scalar(dst=d0[:p, :w], data=lo[:p, :w], op0=nl.bitwise_and, operand0=0xFFFF)
            nisa.tensor_scalar(dst=d1[:p, :w], data=lo[:p, :w], op0=nl.right_shift, operand0=16)  # signed for int32
            pieces = [d0, d1] + ([top] if top is not None else [])
            for a, d in zip(acc, pieces):
                part = _col()
                nisa.tensor_reduce(dst=part[:p], op=nl.add, data=d[:p, :w], axis=(1,))
                nisa.tensor_tensor(dst=a[:p], data1=a[:p], data2=part[:p], op=nl.add)  # a2 wraps like int64 sums
            for k in (0, 1):  # carry digit k's overflow into digit k + 1 (floor semantics: arithmetic shift)
                carry = _col()
                nisa.tensor_scalar(dst=carry[:p], data=acc[k][:p], op0=nl.right_shift, operand0=16)
                nisa.tensor_scalar(dst=acc[k][:p], data=acc[k][:p], op0=nl.bitwise_and, operand0=0xFFFF)
                nisa.tensor_tensor(dst=acc[k + 1][:p], data1=acc[k + 1][:p], data2=carry[:p], op=nl.add)
        low = _col(nl.uint32)
        nisa.scalar_tensor_tensor(dst=low[:p], data=acc[1][:p], op0=nl.multiply, operand0=65536, op1=nl.add,
                                  operand1=acc[0][:p])
        nisa.dma_copy(dst=out.ap([[2, p], [1, 1]], offset=2 * r0, dtype=nl.uint32), src=low[:p])
        nisa.dma_copy(dst=out.ap([[2, p], [1, 1]], offset=2 * r0 + 1, dtype=nl.int32), src=acc[2][:p])
    return out


@nki.jit
def int64_extreme(x, op):
    """Row maxima (op "max") or minima ("min") of int64 values given as [O, 2R] int32 words; returns [O, 2]
    words. The high words' extreme first (signed), then the low words' extreme (unsigned) among the elements
    whose high word attains it; blocks of a row combine by a two-word comparison."""
    O, W = x.shape
    R = W // 2
    out = nl.ndarray((O, 2), nl.int32, buffer=nl.shared_hbm)
    flat = x.reshape((O * W,))
    red = nl.maximum if op == "max" else nl.minimum
    for r0 in range(0, O, PMAX):
        p = min(PMAX, O - r0)
        best = None
        for c0 in range(0, R, F):
            w = min(F, R - c0)
            lo = nl.ndarray((PMAX, F), nl.uint32, buffer=nl.sbuf)
            hi = nl.ndarray((PMAX, F), nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=lo[:p, :w], src=flat.ap([[W, p], [2, w]], offset=r0 * W + 2 * c0, dtype=nl.uint32))
            nisa.dma_copy(dst=hi[:p, :w], src=flat.ap([[W, p], [2, w]], offset=r0 * W + 2 * c0 + 1, dtype=nl.int32))
            mh, ml = _col(), _col(nl.uint32)
            nisa.tensor_reduce(dst=mh[:p], op=red, data=hi[:p, :w], axis=(1,))
            mask = nl.ndarray((PMAX, F), nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=mask[:p, :w], data=hi[:p, :w], op0=nl.equal, operand0=mh[:p])
            cand = nl.ndarray((PMAX, F), nl.uint32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=cand[:p, :w], data1=lo[:p, :w], data2=mask[:p, :w], op=nl.multiply)
            if op == "min":  # elements off the extreme high word read as 2**32 - 1, which never wins a min
                nisa.tensor_scalar(dst=mask[:p, :w], data=mask[:p, :w], op0=nl.multiply, operand0=-0xFFFFFFFF,
                                   op1=nl.add, operand1=0xFFFFFFFF)
                nisa.tensor_tensor(dst=cand[:p, :w], data1=cand[:p, :w], data2=mask[:p, :w], op=nl.add)
            nisa.tensor_reduce(dst=ml[:p], op=red, data=cand[:p, :w], axis=(1,))
            if best is None:
                best = (ml, mh)
            else:
                take = _compare(ml, mh, best[0], best[1], "gt" if op == "max" else "lt", p, 1)
                best = (_select(take, ml, best[0], p, 1, nl.uint32), _select(take, mh, best[1], p, 1, nl.int32))
        nisa.dma_copy(dst=out.ap([[2, p], [1, 1]], offset=2 * r0, dtype=nl.uint32), src=best[0][:p])
        nisa.dma_copy(dst=out.ap([[2, p], [1, 1]], offset=2 * r0 + 1, dtype=nl.int32), src=best[1][:p])
    return out


def _digits(t, s, p, w):
    """The four 16-bit digits (least significant first) of a block of int64 words, as uint32 tiles."""
    out = []
    for k in (0, 1):
        word = nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=word[:p], src=_word(t, s, p, w, k, nl.uint32))   # both words unsigned: mod 2**64
        d0 = nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)
        d1 = nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=d0[:p], data=word[:p], op0=nl.bitwise_and, operand0=0xFFFF)
        nisa.tensor_scalar(dst=d1[:p], data=word[:p], op0=nl.right_shift, operand0=16)
        out += [d0, d1]
    return out


@nki.jit
def int64_mul(a, b):
    """``a * b`` mod 2**64 of int64 words [n, 2] (either may be [1, 2]): schoolbook on 16-bit digits, each
    digit product (< 2**32) split in 16-bit halves so every column sum stays far below 2**32."""
    n = _n(a, b)
    out = nl.ndarray((n, 2), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n, F):
        da, db = _digits(a, s, p, w), _digits(b, s, p, w)
        col = [nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf) for _ in range(4)]
        for c in col:
            nisa.memset(dst=c[:p], value=0)
        prod = nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)
        half = nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)
        for i in range(4):
            for j in range(4 - i):               # digit products beyond 2**64 drop out
                nisa.tensor_tensor(dst=prod[:p], data1=da[i][:p], data2=db[j][:p], op=nl.multiply)
                nisa.tensor_scalar(dst=half[:p], data=prod[:p], op0=nl.bitwise_and, operand0=0xFFFF)
                nisa.tensor_tensor(dst=col[i + j][:p], data1=col[i + j][:p], data2=half[:p], op=nl.add)
                if i + j < 3:
                    nisa.tensor_scalar(dst=half[:p], data=prod[:p], op0=nl.right_shift, operand0=16)
                    nisa.tensor_tensor(dst=col[i + j + 1][:p], data1=col[i + j + 1][:p], data2=half[:p], op=nl.add)
        for k in range(3):                       # carries: column sums are < 2**19
            nisa.tensor_scalar(dst=half[:p], data=col[k][:p], op0=nl.right_shift, operand0=16)
            nisa.tensor_tensor(dst=col[k + 1][:p], data1=col[k + 1][:p], data2=half[:p], op=nl.add)
            nisa.tensor_scalar(dst=col[k][:p], data=col[k][:p], op0=nl.bitwise_and, operand0=0xFFFF)
        nisa.tensor_scalar(dst=col[3][:p], data=col[3][:p], op0=nl.bitwise_and, operand0=0xFFFF)
        for k in (0, 2):                         # word = low digit + high digit * 2**16 (< 2**32)
            nisa.scalar_tensor_tensor(dst=col[k][:p], data=col[k + 1][:p], op0=nl.multiply, operand0=65536,
                                      op1=nl.add, operand1=col[k][:p])
        nisa.dma_copy(dst=out.ap([[2 * w, p], [2, w]], offset=2 * s, dtype=nl.uint32), src=col[0][:p])
        nisa.dma_copy(dst=out.ap([[2 * w, p], [2, w]], offset=2 * s + 1, dtype=nl.uint32), src=col[2][:p])
    return out
