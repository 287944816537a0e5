"""int64 addition on a core without 64-bit integer arithmetic: two 32-bit words with a carry.

Each int64 is its little-endian pair of int32 words (low, high). Per [128, F] block the kernel
loads the low words as uint32 and the high words as int32 (strided DMAs over the word pairs),
adds the low words (VectorE computes exactly and the uint32 store wraps mod 2**32), derives the
carry as ``sum < a_low`` (an unsigned overflow), adds the high words plus the carry (int32 wraps,
as int64 overflow wraps in PyTorch) and stores both words back interleaved.
"""
from __future__ import annotations

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, flat_blocks


def word(t, s, p, w, k, dtype):
    """The [p, w] block of word k (0 low, 1 high) of elements s.. of a [n, 2] word tensor ([1, 2]: broadcast)."""
    if t.shape[0] == 1:
        return t.ap([[0, p], [0, w]], offset=k, dtype=dtype)
    return t.ap([[2 * w, p], [2, w]], offset=2 * s + k, dtype=dtype)


@nki.jit
def int64_add(a, b):
    """``a + b`` for int64 values given as [n, 2] int32 words (``b`` may be [1, 2]: one value for all)."""
    n, nb = a.shape[0], b.shape[0]
    assert a.shape[1] == 2 and b.shape[1] == 2 and nb in (1, n), "int64_add: operands are [n, 2] words"
    out = nl.ndarray((n, 2), nl.int32, buffer=nl.shared_hbm)
    for s, p, w in flat_blocks(n):
        lo_a, lo_b, lo = (nl.ndarray((PMAX, w), nl.uint32, buffer=nl.sbuf) for _ in range(3))
        hi_a, hi_b, carry = (nl.ndarray((PMAX, w), nl.int32, buffer=nl.sbuf) for _ in range(3))
        nisa.dma_copy(dst=lo_a[:p], src=word(a, s, p, w, 0, nl.uint32))
        nisa.dma_copy(dst=hi_a[:p], src=word(a, s, p, w, 1, nl.int32))
        nisa.dma_copy(dst=lo_b[:p], src=word(b, s, p, w, 0, nl.uint32))
        nisa.dma_copy(dst=hi_b[:p], src=word(b, s, p, w, 1, nl.int32))
        nisa.tensor_tensor(dst=lo[:p], data1=lo_a[:p], data2=lo_b[:p], op=nl.add)          # wraps mod 2**32
        nisa.tensor_tensor(dst=carry[:p], data1=lo[:p], data2=lo_a[:p], op=nl.less)       # unsigned overflow
        nisa.tensor_tensor(dst=hi_a[:p], data1=hi_a[:p], data2=hi_b[:p], op=nl.add)
        nisa.tensor_tensor(dst=hi_a[:p], data1=hi_a[:p], data2=carry[:p], op=nl.add)
        nisa.dma_copy(dst=word(out, s, p, w, 0, nl.uint32), src=lo[:p])
        nisa.dma_copy(dst=word(out, s, p, w, 1, nl.int32), src=hi_a[:p])
    return out
