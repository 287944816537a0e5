"""Multi-tensor element-wise kernels: one launch applies a tile function to every tensor of a list
(what ``torch._foreach_*`` ops and the optimizers built on them do), instead of one launch each.

``foreach_kernel(count, arity)`` is the kernel for ``count`` groups of ``arity`` operands: group i
is the i-th tensor of each list (same shape, given flat as (1, n_i)) or a (1, 1) scalar operand.
Each group is streamed by the element-wise template's body (``kernels.elementwise``), so one
group's tiles are those of a single-tensor launch: the results are bit-identical to it, and the
groups' loads, compute and stores overlap across engines in one program.
"""
from __future__ import annotations

import functools
import inspect

from torchneuron import nki
import torchneuron.nki.language as nl
from torchneuron.kernels.elementwise import NAMES, _body


def operand_name(group: int, position: int) -> str:
    """The kernel argument holding operand ``position`` of group ``group``."""
    return f"{NAMES[position]}{group}"


@functools.cache
def foreach_kernel(count: int, arity: int) -> nki.Kernel:
    """The kernel over ``count`` groups of ``arity`` operands (arguments ``a0, b0, ..., a1, ...``, plus
    ``fn``, the tile function, and ``out_dtype``); it returns one output per group."""
    assert 1 <= arity <= len(NAMES), f"foreach_kernel: {arity} operands per group (at most {len(NAMES)})"
    names = [operand_name(i, j) for i in range(count) for j in range(arity)]

    def body(**kw):
        fn, out_dtype = kw["fn"], kw["out_dtype"]
        return tuple(_body([kw[operand_name(i, j)] for j in range(arity)], fn, out_dtype) for i in range(count))

    kind = inspect.Parameter.KEYWORD_ONLY
    body.__signature__ = inspect.Signature(
        [inspect.Parameter(n, kind) for n in names] + [inspect.Parameter("fn", kind),
                                                       inspect.Parameter("out_dtype", kind, default=nl.float32)])
    body.__name__ = body.__qualname__ = f"foreach{arity}_x{count}"
    return nki.jit(body)


@functools.cache
def foreach_sum_kernel(count: int) -> nki.Kernel:
    """The kernel summing each of ``count`` flat tensors (arguments ``a0, a1, ...``, each (1, n_i)): one
    (1, 1) output per tensor, each reduced exactly as ``reduce_kernel`` reduces a whole tensor."""
    from torchneuron.kernels.reduction import _reduce_rows

    def body(**kw):
        outs = []
        for i in range(count):
            x = kw[operand_name(i, 0)]
            out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
            _reduce_rows(x, out, "sum", 1, x.shape[1])
            outs.append(out)
        return tuple(outs)

    kind = inspect.Parameter.KEYWORD_ONLY
    body.__signature__ = inspect.Signature([inspect.Parameter(operand_name(i, 0), kind) for i in range(count)])
    body.__name__ = body.__qualname__ = f"foreach_sum_x{count}"
    return nki.jit(body)
