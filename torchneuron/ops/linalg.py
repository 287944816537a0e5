"""Small dense linear algebra on the device, composed from lowered ops: Cholesky factorisation
(``cholesky``, ``linalg_cholesky_ex``), triangular solves (``triangular_solve``,
``linalg_solve_triangular``), and what is built on them (``cholesky_solve``, ``cholesky_inverse``).

Both are the unblocked column algorithms LAPACK uses for small matrices (``potf2``, ``trsv``-style
substitution), run over the whole batch at once: step j is a few vector ops and one batched
matrix-vector product, so an n x n problem is O(n) launches. That suits the small matrices these
ops meet in models (covariances, Gaussian-process kernels); above ``MAX_N`` rows, and for dtypes
other than fp32 (the CPU's LAPACK kernels take fp32/fp64 only), the CPU fallback runs.

A Cholesky factorisation that meets a non-positive pivot is handed to the CPU fallback (one
device-to-host read of the failure flags per call): the CPU then raises its ``LinAlgError`` with
the failing minor, or returns its own ``info`` and partial factor for ``linalg_cholesky_ex``.
"""
from __future__ import annotations

import math

import torch

from torchneuron.ops.copy import write_result
from torchneuron.ops.registry import cpu_fallback, lowering

aten = torch.ops.aten
MAX_N = 256  # rows beyond which the O(n)-launch loops are left to the CPU


def _runs_here(*ts: torch.Tensor) -> bool:
    """fp32 tensors of one neuron device, small enough for the column loops."""
    dev = ts[0].device
    return all(t.device == dev and t.dtype == torch.float32 and t.dim() >= 2 for t in ts) \
        and dev.type == "neuron" and ts[0].size(-1) <= MAX_N


def _lower_cholesky(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, failed) for a batch [B, n, n], reading its lower triangle: column j takes the pivot
    ``a_jj - |L_j,:j|^2`` (failed where it is not > 0, NaN included) and scales the column below it."""
    b, n = a.shape[0], a.shape[-1]
    chol = torch.zeros_like(a)
    failed = torch.zeros(b, dtype=torch.bool, device=a.device)
    for j in range(n):
        row = chol[:, j, :j]
        pivot = a[:, j, j] - (row * row).sum(-1) if j else a[:, j, j]
        failed |= ~(pivot > 0)
        d = pivot.sqrt()
        chol[:, j, j] = d
        if j + 1 < n:
            col = a[:, j + 1:, j]
            if j:
                col = col - (chol[:, j + 1:, :j] @ row.unsqueeze(-1)).squeeze(-1)
            chol[:, j + 1:, j] = col / d.unsqueeze(-1)
    return chol, failed


def _factor(self: torch.Tensor, upper: bool) -> torch.Tensor | None:
    """The Cholesky factor of ``self`` (batched), or None when a matrix is not positive-definite."""
    n = self.size(-1)
    if self.numel() == 0:
        return torch.empty_like(self)
    a = self.mT if upper else self   # the upper factor is the transposed lower one of the transpose
    chol, failed = _lower_cholesky(a.reshape(-1, n, n))
    if bool(failed.any()):
        return None
    chol = chol.reshape(self.shape)
    return chol.mT.contiguous() if upper else chol


def _square(t: torch.Tensor) -> bool:
    return t.size(-1) == t.size(-2)


@lowering("cholesky", "cholesky.out")
def cholesky(self: torch.Tensor, upper: bool = False, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.cholesky`` (deprecated in PyTorch, still an op)."""
    chol = _factor(self, upper) if _runs_here(self) and _square(self) else None
    if chol is None:  # bad arguments, or not positive-definite: the CPU raises its error
        overload = aten.cholesky.out if out is not None else aten.cholesky.default
        return cpu_fallback(overload, self, upper, **({} if out is None else {"out": out}))
    return write_result(chol, out)


@lowering("linalg_cholesky_ex", "linalg_cholesky_ex.L")
def linalg_cholesky_ex(self: torch.Tensor, *, upper: bool = False, check_errors: bool = False,
                       L: torch.Tensor | None = None, info: torch.Tensor | None = None):
    """``torch.linalg.cholesky_ex`` (and so ``torch.linalg.cholesky``): the factor and a zero ``info``."""
    overload = aten.linalg_cholesky_ex.L if L is not None else aten.linalg_cholesky_ex.default
    outs = {} if L is None else {"L": L, "info": info}
    chol = _factor(self, upper) if _runs_here(self) and _square(self) else None
    if chol is None:
        return cpu_fallback(overload, self, upper=upper, check_errors=check_errors, **outs)
    zero = torch.zeros(self.shape[:-2], dtype=torch.int32, device=self.device)
    if L is None:
        return chol, zero
    return write_result(chol, L), write_result(zero, info)


def _solve_lower(a: torch.Tensor, b: torch.Tensor, unit: bool) -> torch.Tensor:
    """X with ``a @ X = b`` for lower-triangular ``a`` [B, n, n] and ``b`` [B, n, k], by forward
    substitution: row i is ``(b_i - a_i,:i X_:i) / a_ii``."""
    n = a.shape[-1]
    x = torch.empty_like(b)
    for i in range(n):
        r = b[:, i, :]
        if i:
            r = r - (a[:, i:i + 1, :i] @ x[:, :i, :]).squeeze(1)
        x[:, i, :] = r if unit else r / a[:, i, i].unsqueeze(-1)
    return x


def _solve(a: torch.Tensor, b: torch.Tensor, upper: bool, unit: bool = False) -> torch.Tensor:
    """X with ``a @ X = b`` for triangular ``a`` (batch dims broadcast): an upper system is the lower
    one of the matrices with rows and columns reversed."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    n, k = a.size(-1), b.size(-1)
    if math.prod(batch) * n * k == 0:
        return b.new_empty((*batch, n, k))
    a = a.expand(*batch, n, n).reshape(-1, n, n)
    b = b.expand(*batch, n, k).reshape(-1, n, k)
    if upper:
        return _solve_lower(a.flip(-1, -2), b.flip(-2), unit).flip(-2).reshape(*batch, n, k)
    return _solve_lower(a, b, unit).reshape(*batch, n, k)


@lowering("triangular_solve", "triangular_solve.X")
def triangular_solve(self: torch.Tensor, A: torch.Tensor, upper: bool = True, transpose: bool = False,
                     unitriangular: bool = False, *, X: torch.Tensor | None = None, M: torch.Tensor | None = None):
    """``torch.triangular_solve``: (the solution of ``op(A) X = self``, a copy of ``A``)."""
    if not (_runs_here(self, A) and _square(A) and A.size(-1) == self.size(-2)):
        overload = aten.triangular_solve.X if X is not None else aten.triangular_solve.default
        outs = {} if X is None else {"X": X, "M": M}
        return cpu_fallback(overload, self, A, upper, transpose, unitriangular, **outs)
    coeff = A.mT if transpose else A
    sol = _solve(coeff, self, upper != transpose, unitriangular)
    batch = torch.broadcast_shapes(self.shape[:-2], A.shape[:-2])
    cloned = A.expand(*batch, *A.shape[-2:]).clone()
    if X is None:
        return sol, cloned
    return write_result(sol, X), write_result(cloned, M)


@lowering("linalg_solve_triangular", "linalg_solve_triangular.out")
def linalg_solve_triangular(self: torch.Tensor, B: torch.Tensor, *, upper: bool, left: bool = True,
                            unitriangular: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.linalg.solve_triangular``: ``X A = B`` (``left=False``) is ``A^T X^T = B^T``."""
    if not (_runs_here(self, B) and _square(self)) or self.size(-1) != B.size(-2 if left else -1):
        overload = aten.linalg_solve_triangular.out if out is not None else aten.linalg_solve_triangular.default
        kw = {} if out is None else {"out": out}
        return cpu_fallback(overload, self, B, upper=upper, left=left, unitriangular=unitriangular, **kw)
    if left:
        return write_result(_solve(self, B, upper, unitriangular), out)
    return write_result(_solve(self.mT, B.mT, not upper, unitriangular).mT, out)


@lowering("_cholesky_solve_helper")
def cholesky_solve_helper(self: torch.Tensor, A: torch.Tensor, upper: bool) -> torch.Tensor:
    """``cholesky_solve``'s kernel: ``L L^T X = self`` as two triangular solves."""
    if not (_runs_here(self, A) and _square(A)) or A.size(-1) != self.size(-2):
        return cpu_fallback(aten._cholesky_solve_helper.default, self, A, upper)
    chol = A.mT if upper else A
    return _solve(chol.mT, _solve(chol, self, False), True)


@lowering("cholesky_inverse", "cholesky_inverse.out")
def cholesky_inverse(self: torch.Tensor, upper: bool = False, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(L L^T)^-1 = L^-T L^-1``, with ``L^-1`` from a solve against the identity."""
    if not (_runs_here(self) and _square(self)):
        overload = aten.cholesky_inverse.out if out is not None else aten.cholesky_inverse.default
        return cpu_fallback(overload, self, upper, **({} if out is None else {"out": out}))
    n = self.size(-1)
    chol = self.mT if upper else self
    eye = torch.eye(n, dtype=self.dtype, device=self.device).expand(*self.shape[:-2], n, n)
    inv = _solve(chol, eye, False)
    return write_result(inv.mT @ inv, out)

