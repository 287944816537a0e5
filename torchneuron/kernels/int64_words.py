"""int64 kernels on a core without 64-bit integers: each int64 is its little-endian pair of int32 words.

The low words are read as uint32 and the high words as int32: each block's pairs move by one contiguous DMA
and GpSimd copies split them into word tiles (a DMA of every other word would move 4-byte pieces, about 30x
slower), and stores interleave them back the same way; every integer op on the engines is exact on such
tiles, so:

- ``int64_add`` adds the low words (the uint32 store wraps mod 2**32), derives the carry as
  ``sum < a_low`` (an unsigned overflow) and adds the high words plus the carry (int32 wraps, as int64
  overflow wraps in PyTorch);

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
  the elements that attain it;
- ``int64_shift`` shifts both words by the count mod 32 and moves a whole word for counts of 32..63
  (no engine shift is ever by 32 bits or more);
- ``int64_divmod`` divides the magnitudes by restoring long division, one quotient bit per step, and
  applies the signs (trunc/floor quotients, fmod/remainder remainders).
"""
from __future__ import annotations


from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, flat_blocks

F = 2048          # elements per partition of one block (8 KiB int32 rows)
CMP = {"eq": nl.equal, "ne": nl.not_equal, "lt": nl.less, "le": nl.less_equal, "gt": nl.greater,
       "ge": nl.greater_equal}
STRICT = {"lt": nl.less, "le": nl.less, "gt": nl.greater, "ge": nl.greater}   # decides on unequal high words


def word_block(t, s, p, w, k, dtype):
    """The [p, w] block of word k (0 low, 1 high) of elements s.. of a [n, 2] word tensor ([1, 2]: broadcast)."""
    if t.shape[0] == 1:
        return t.ap([[0, p], [0, w]], offset=k, dtype=dtype)
    return t.ap([[2 * w, p], [2, w]], offset=2 * s + k, dtype=dtype)


def _half(pairs, p, w, k, dtype):
    """Word k of the [p, 2w] SBUF tile of word pairs, as a stride-2 [p, w] view."""
    return pairs[:p, :2 * w].ap([[2 * w, p], [2, w]], offset=k, dtype=dtype)


def _words_in(t, s, p, w, dtypes):
    """Word tiles (low, high; of ``dtypes``) of elements s.. of a [n, 2] word tensor: the block's pairs move by one
    contiguous DMA (a DMA of every other word moves 4-byte pieces) and two engine copies split them."""
    if t.shape[0] == 1:                      # one value for all: a broadcast of each word
        lo, hi = (nl.ndarray((PMAX, w), dt, buffer=nl.sbuf) for dt in dtypes)
        nisa.dma_copy(dst=lo[:p], src=word_block(t, s, p, w, 0, dtypes[0]))
        nisa.dma_copy(dst=hi[:p], src=word_block(t, s, p, w, 1, dtypes[1]))
        return lo, hi
    return _split(t.ap([[2 * w, p], [1, 2 * w]], offset=2 * s), p, w, dtypes)


def _split(src, p, w, dtypes):
    """Word tiles (low, high; of ``dtypes``) of the [p, 2w] HBM word pairs ``src``: one DMA, then two GpSimd
    copies (they leave VectorE to the arithmetic)."""
    lo, hi = (nl.ndarray((PMAX, w), dt, buffer=nl.sbuf) for dt in dtypes)
    pairs = nl.ndarray((PMAX, 2 * w), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=pairs[:p, :2 * w], src=src)
    nisa.tensor_copy(dst=lo[:p], src=_half(pairs, p, w, 0, dtypes[0]), engine=nisa.engine.gpsimd)
    nisa.tensor_copy(dst=hi[:p], src=_half(pairs, p, w, 1, dtypes[1]), engine=nisa.engine.gpsimd)
    return lo, hi


@nki.jit
def int64_add(a, b):
    """``a + b`` for int64 values given as [n, 2] int32 words (``b`` may be [1, 2]: one value for all)."""
    n, nb = a.shape[0], b.shape[0]
    assert a.shape[1] == 2 and b.shape[1] == 2 and nb in (1, n), "int64_add: operands are [n, 2] words"
    out = nl.ndarray((n, 2), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n):
        lo_a, hi_a = _load(a, s, p, w)
        lo_b, hi_b = _load(b, s, p, w)
        lo = nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)
        carry = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=lo[:p], data1=lo_a[:p], data2=lo_b[:p], op=nl.add)          # wraps mod 2**32
        nisa.tensor_tensor(dst=carry[:p], data1=lo[:p], data2=lo_a[:p], op=nl.less)       # unsigned overflow
        nisa.tensor_tensor(dst=hi_a[:p], data1=hi_a[:p], data2=hi_b[:p], op=nl.add)
        nisa.tensor_tensor(dst=hi_a[:p], data1=hi_a[:p], data2=carry[:p], op=nl.add)
        _store(out, s, p, w, lo, hi_a)
    return out


def _load(t, s, p, w):
    """(low as uint32, high as int32) SBUF tiles of a block of an int64 word tensor."""
    return _words_in(t, s, p, w, (nl.uint32, nl.int32))


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


def _negate(lo, hi, p, w, hi_dtype=nl.int32):
    """``-(lo, hi)`` as (low uint32, high ``hi_dtype``) tiles, and the borrow ``lo != 0`` (an int32 0/1 tile)."""
    nlo = nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)
    nhi = nl.ndarray((PMAX, w), hi_dtype, buffer=nl.sbuf)
    borrow = nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nlo[:p], data=lo[:p], op0=nl.multiply, operand0=-1)         # the store wraps mod 2**32
    nisa.tensor_scalar(dst=borrow[:p], data=lo[:p], op0=nl.not_equal, operand0=0)
    nisa.tensor_scalar(dst=nhi[:p], data=hi[:p], op0=nl.multiply, operand0=-1)
    nisa.tensor_tensor(dst=nhi[:p], data1=nhi[:p], data2=borrow[:p], op=nl.subtract)   # the store wraps
    return nlo, nhi, borrow


def _store(out, s, p, w, lo, hi):
    """Store word tiles (low, high; each of its own dtype) as elements s.. of the [n, 2] word tensor ``out``:
    two engine copies interleave them, one contiguous DMA writes the pairs."""
    pairs = nl.ndarray((PMAX, 2 * w), nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=_half(pairs, p, w, 0, lo.dtype), src=lo[:p])
    nisa.tensor_copy(dst=_half(pairs, p, w, 1, hi.dtype), src=hi[:p])
    nisa.dma_copy(dst=out.ap([[2 * w, p], [1, 2 * w]], offset=2 * s), src=pairs[:p, :2 * w])


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
        nlo, nhi, borrow = _negate(lo, hi, p, w)
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
                lo, top = _split(flat.ap([[W, p], [1, 2 * w]], offset=r0 * W + 2 * c0), p, w, (nl.uint32, nl.int32))
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
            lo, hi = _split(flat.ap([[W, p], [1, 2 * w]], offset=r0 * W + 2 * c0), p, w, (nl.uint32, nl.int32))
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
    for word in _words_in(t, s, p, w, (nl.uint32, nl.uint32)):                 # both words unsigned: mod 2**64
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
        _store(out, s, p, w, col[0], col[2])
    return out


def _u32(w):
    return nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf)


def _i32(w):
    return nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf)


@nki.jit
def int64_shift(a, b, op):
    """``a << b`` (op "left") or ``a >> b`` ("right", arithmetic) of int64 words [n, 2] by int64 counts given
    as words [n, 2] (either may be [1, 2]). Counts outside [0, 64) give 0 (left) or the sign fill (right), as
    the CPU's kernel does. Every engine shift is by 0..31 bits: a count of 32..63 moves a whole word."""
    n = _n(a, b)
    out = nl.ndarray((n, 2), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n, F):
        lo, hi = _load(a, s, p, w)
        clo, chi = _load(b, s, p, w)
        ok, big, k, rk = _i32(w), _i32(w), _i32(w), _i32(w)
        nisa.tensor_scalar(dst=ok[:p], data=chi[:p], op0=nl.equal, operand0=0)
        nisa.tensor_scalar(dst=big[:p], data=clo[:p], op0=nl.less, operand0=64)
        nisa.tensor_tensor(dst=ok[:p], data1=ok[:p], data2=big[:p], op=nl.multiply)          # 0 <= count < 64
        nisa.tensor_scalar(dst=big[:p], data=clo[:p], op0=nl.right_shift, operand0=5, op1=nl.bitwise_and,
                           operand1=1)                                                       # count >= 32
        nisa.tensor_scalar(dst=k[:p], data=clo[:p], op0=nl.bitwise_and, operand0=31)
        nisa.tensor_scalar(dst=rk[:p], data=k[:p], op0=nl.subtract, operand0=31, reverse0=True)   # 31 - k
        slo, shi, cross = _u32(w), _i32(w), _u32(w)
        if op == "left":
            nisa.tensor_tensor(dst=slo[:p], data1=lo[:p], data2=k[:p], op=nl.left_shift)      # the store wraps
            nisa.tensor_tensor(dst=shi[:p], data1=hi[:p], data2=k[:p], op=nl.left_shift)
            # the low word's top k bits move up: (lo >> 1) >> (31 - k) never shifts by 32
            nisa.tensor_scalar(dst=cross[:p], data=lo[:p], op0=nl.right_shift, operand0=1)
            nisa.tensor_tensor(dst=cross[:p], data1=cross[:p], data2=rk[:p], op=nl.right_shift)
            nisa.tensor_tensor(dst=shi[:p], data1=shi[:p], data2=cross[:p], op=nl.bitwise_or)
            rhi = _select(big, slo, shi, p, w, nl.int32)                                      # count >= 32: lo << k
            nisa.tensor_scalar(dst=big[:p], data=big[:p], op0=nl.subtract, operand0=1, reverse0=True)
            nisa.tensor_tensor(dst=big[:p], data1=big[:p], data2=ok[:p], op=nl.multiply)      # keep the low word
            nisa.tensor_tensor(dst=slo[:p], data1=slo[:p], data2=big[:p], op=nl.multiply)
            nisa.tensor_tensor(dst=rhi[:p], data1=rhi[:p], data2=ok[:p], op=nl.multiply)
            _store(out, s, p, w, slo, rhi)
        else:
            sign = _i32(w)
            nisa.tensor_scalar(dst=sign[:p], data=hi[:p], op0=nl.right_shift, operand0=31)    # 0 or -1
            nisa.tensor_tensor(dst=shi[:p], data1=hi[:p], data2=k[:p], op=nl.right_shift)     # arithmetic: int32
            nisa.tensor_tensor(dst=slo[:p], data1=lo[:p], data2=k[:p], op=nl.right_shift)     # logical: uint32
            # the high word's low k bits move down: (hi << 1) << (31 - k), wrapped to 32 bits
            nisa.tensor_scalar(dst=cross[:p], data=hi[:p], op0=nl.left_shift, operand0=1)
            nisa.tensor_tensor(dst=cross[:p], data1=cross[:p], data2=rk[:p], op=nl.left_shift)
            nisa.tensor_tensor(dst=slo[:p], data1=slo[:p], data2=cross[:p], op=nl.bitwise_or)
            rlo = _select(big, shi, slo, p, w, nl.uint32)                                     # count >= 32: hi >> k
            rhi = _select(big, sign, shi, p, w, nl.int32)
            _store(out, s, p, w, _select(ok, rlo, sign, p, w, nl.uint32), _select(ok, rhi, sign, p, w, nl.int32))
    return out


DIV_F = 512       # elements per partition of a division block: about 20 live tiles of 2 KiB per partition


def _magnitude(t, s, p, w):
    """(|x| low, |x| high) uint32 tiles of a block of int64 words and the sign (int32 0/1: x < 0)."""
    lo, hi = _load(t, s, p, w)
    neg = _i32(w)
    nisa.tensor_scalar(dst=neg[:p], data=hi[:p], op0=nl.less, operand0=0)
    nlo, nhi, _ = _negate(lo, hi, p, w, nl.uint32)
    return _select(neg, nlo, lo, p, w, nl.uint32), _select(neg, nhi, hi, p, w, nl.uint32), neg


def _udivmod(nlo, nhi, dlo, dhi, p, w):
    """Unsigned 64-bit ``n // d`` and ``n % d`` (d <= 2**63, nonzero) by restoring long division: 64 steps
    of bringing down the dividend's next bit into the remainder and subtracting d where it fits, which sets
    that quotient bit. Returns (q lo, q hi, r lo, r hi)."""
    rlo, rhi, qlo, qhi = _u32(w), _u32(w), _u32(w), _u32(w)
    for t in (rlo, rhi, qlo, qhi):
        nisa.memset(dst=t[:p], value=0)
    bit, b1, m, md = _u32(w), _u32(w), _u32(w), _u32(w)
    for i in range(64):
        src, q, k = (nhi, qhi, 63 - i) if i < 32 else (nlo, qlo, 31 - i % 32)
        nisa.tensor_scalar(dst=bit[:p], data=src[:p], op0=nl.right_shift, operand0=k % 32, op1=nl.bitwise_and,
                           operand1=1)
        if i >= 32:  # r < 2**i before this step: only then can its low word's top bit carry into the high word
            nisa.tensor_scalar(dst=b1[:p], data=rlo[:p], op0=nl.right_shift, operand0=31)
            nisa.scalar_tensor_tensor(dst=rhi[:p], data=rhi[:p], op0=nl.multiply, operand0=2, op1=nl.add,
                                      operand1=b1[:p])
        nisa.scalar_tensor_tensor(dst=rlo[:p], data=rlo[:p], op0=nl.multiply, operand0=2, op1=nl.add, operand1=bit[:p])
        # r >= d: no borrow out of r - d. r < 2**64 and d's high word <= 2**31, so dhi + borrow fits 32 bits
        nisa.tensor_tensor(dst=b1[:p], data1=rlo[:p], data2=dlo[:p], op=nl.less)
        nisa.tensor_tensor(dst=bit[:p], data1=dhi[:p], data2=b1[:p], op=nl.add)
        nisa.tensor_tensor(dst=m[:p], data1=rhi[:p], data2=bit[:p], op=nl.greater_equal)
        nisa.tensor_tensor(dst=md[:p], data1=dlo[:p], data2=m[:p], op=nl.multiply)
        nisa.tensor_tensor(dst=rlo[:p], data1=rlo[:p], data2=md[:p], op=nl.subtract)          # the store wraps
        nisa.tensor_tensor(dst=bit[:p], data1=bit[:p], data2=m[:p], op=nl.multiply)
        nisa.tensor_tensor(dst=rhi[:p], data1=rhi[:p], data2=bit[:p], op=nl.subtract)
        nisa.scalar_tensor_tensor(dst=q[:p], data=q[:p], op0=nl.multiply, operand0=2, op1=nl.add, operand1=m[:p])
    return qlo, qhi, rlo, rhi


def _sign_select(m, lo, hi, p, w):
    """``-x`` where m (0/1) is set, else x, for x given as uint32 words."""
    nlo, nhi, _ = _negate(lo, hi, p, w, nl.uint32)
    return _select(m, nlo, lo, p, w, nl.uint32), _select(m, nhi, hi, p, w, nl.uint32)


@nki.jit
def int64_divmod(a, b, mode):
    """Integer division of int64 words [n, 2] by nonzero int64 words (either may be [1, 2]; the caller checks
    for zeros): the quotient rounded toward zero ("trunc") or down ("floor"), or the remainder with the
    dividend's sign ("fmod") or the divisor's ("remainder"). Magnitudes are divided as unsigned 64-bit values,
    then signs applied; -2**63 // -1 wraps to -2**63 as on the CPU. A zero divisor is defined too (every
    step subtracts 0): quotient all ones, remainder the dividend (fmod: ``x % 0 == x``, which gcd relies on)."""
    assert mode in ("trunc", "floor", "fmod", "remainder"), mode
    n = _n(a, b)
    out = nl.ndarray((n, 2), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n, DIV_F):
        nlo, nhi, sa = _magnitude(a, s, p, w)
        dlo, dhi, sb = _magnitude(b, s, p, w)
        qlo, qhi, rlo, rhi = _udivmod(nlo, nhi, dlo, dhi, p, w)
        differ, inexact = _i32(w), _i32(w)
        nisa.tensor_tensor(dst=differ[:p], data1=sa[:p], data2=sb[:p], op=nl.not_equal)
        nisa.tensor_tensor(dst=inexact[:p], data1=rlo[:p], data2=rhi[:p], op=nl.bitwise_or)
        nisa.tensor_scalar(dst=inexact[:p], data=inexact[:p], op0=nl.not_equal, operand0=0)
        nisa.tensor_tensor(dst=inexact[:p], data1=inexact[:p], data2=differ[:p], op=nl.multiply)
        if mode in ("trunc", "floor"):
            lo, hi = _sign_select(differ, qlo, qhi, p, w)
            if mode == "floor":   # a negative inexact quotient rounds down: -q - 1 is ~q
                nisa.tensor_scalar(dst=qlo[:p], data=qlo[:p], op0=nl.bitwise_xor, operand0=0xFFFFFFFF)
                nisa.tensor_scalar(dst=qhi[:p], data=qhi[:p], op0=nl.bitwise_xor, operand0=0xFFFFFFFF)
                lo, hi = _select(inexact, qlo, lo, p, w, nl.uint32), _select(inexact, qhi, hi, p, w, nl.uint32)
        elif mode == "fmod":
            lo, hi = _sign_select(sa, rlo, rhi, p, w)
        else:                 # signs differ and r != 0: |result| = d - r; the result takes the divisor's sign
            bw, clo, chi = _i32(w), _u32(w), _u32(w)
            nisa.tensor_tensor(dst=bw[:p], data1=dlo[:p], data2=rlo[:p], op=nl.less)
            nisa.tensor_tensor(dst=clo[:p], data1=dlo[:p], data2=rlo[:p], op=nl.subtract)
            nisa.tensor_tensor(dst=chi[:p], data1=dhi[:p], data2=rhi[:p], op=nl.subtract)
            nisa.tensor_tensor(dst=chi[:p], data1=chi[:p], data2=bw[:p], op=nl.subtract)
            lo, hi = _select(inexact, clo, rlo, p, w, nl.uint32), _select(inexact, chi, rhi, p, w, nl.uint32)
            lo, hi = _sign_select(sb, lo, hi, p, w)
        _store(out, s, p, w, lo, hi)
    return out
