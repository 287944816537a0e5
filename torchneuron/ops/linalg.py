"""Small dense linear algebra on the device, composed from lowered ops: Cholesky factorisation
(``cholesky``, ``linalg_cholesky_ex``), triangular solves (``triangular_solve``,
``linalg_solve_triangular``), and what is built on them (``cholesky_solve``, ``cholesky_inverse``);
LU with partial pivoting (``linalg_lu_factor_ex``, ``linalg_lu``, ``lu_unpack``, ``linalg_lu_solve``,
``_linalg_slogdet``, ``_linalg_det``); Householder QR (``geqrf``, ``linalg_qr``, ``ormqr``,
``linalg_householder_product``).

All are the unblocked column algorithms LAPACK uses for small matrices (``potf2``, ``trsv``-style
substitution, ``getf2``, ``geqr2``/``org2r``/``orm2r``), run over the whole batch at once: step j is a
few vector ops and one batched matrix-vector product, so an n x n problem is O(n) launches. That suits
the small matrices these ops meet in models (covariances, Gaussian-process kernels); above ``MAX_N``
rows, and for dtypes other than fp32 (the CPU's LAPACK kernels take fp32/fp64 only), the CPU fallback
runs. LU and QR steps work on whole matrices under row/column masks rather than on shrinking
slices, so an n-step factorisation compiles its kernels once (per shape), not n times.

A Cholesky factorisation that meets a non-positive pivot is handed to the CPU fallback (one
device-to-host read of the failure flags per call): the CPU then raises its ``LinAlgError`` with
the failing minor, or returns its own ``info`` and partial factor for ``linalg_cholesky_ex``. An LU
factorisation goes on past a zero pivot, as LAPACK's does, and reports it in ``info``.

``linalg_matrix_exp`` stays on the CPU: its float32 result for the OpInfo samples (1-norms near 28, so
several squarings) is itself off the float64 one by up to ~30x the fp32 comparison tolerance, so no
independent fp32 evaluation (Taylor or Pade, checked) lands within tolerance of it.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from torchneuron.ops.base import aten, checked, meta_run, resize_out, Unsupported
from torchneuron.ops.registry import lowering, refuse_other_out_dtypes, register_out

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


def _restrided(op: torch._ops.OpOverload) -> Callable[..., None]:
    """``register_out``'s ``resize=`` for the structured CPU kernels of the factorisations (``op`` their functional
    form): an ``out=`` tensor of another shape than its result is resized (with ATen's warning) and given the
    result's strides, column-major where LAPACK's are, as those kernels restride it; one of the right shape keeps
    its strides."""
    def resize(outs: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        metas = meta_run(op, *args, **kwargs)
        for out, meta in zip(outs, metas):
            if tuple(out.shape) != tuple(meta.shape):
                resize_out(out, meta.shape)
                out.as_strided_(meta.shape, meta.stride())
    return resize


def _derive_out(name: str, functional: Callable, dtypes: Callable[..., tuple[torch.dtype, ...]],
                op: torch._ops.OpOverload | None = None) -> None:
    """``name``'s ``out=`` tensors written with ``functional``'s results, as ``register_out`` writes them: the CPU
    kernel refuses ``out=`` tensors of other dtypes than ``dtypes(*args, **kwargs)`` (its own error, raised on the
    device) and, for a structured kernel (``op``, the functional form), restrides the ones it resizes."""
    register_out(name, functional, cast=refuse_other_out_dtypes(name, dtypes),
                 resize=_restrided(op) if op is not None else None)


@lowering("cholesky")
def cholesky(self: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """``torch.cholesky`` (deprecated in PyTorch, still an op)."""
    chol = _factor(self, upper) if _runs_here(self) and _square(self) else None
    if chol is None:  # bad arguments, or not positive-definite: the CPU raises its error
        raise Unsupported("bad arguments or a matrix that is not positive-definite: the CPU raises its error")
    return chol


register_out("cholesky.out", cholesky)


@lowering("linalg_cholesky_ex")
def linalg_cholesky_ex(self: torch.Tensor, *, upper: bool = False,
                       check_errors: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.cholesky_ex`` (and so ``torch.linalg.cholesky``): the factor and a zero ``info``."""
    chol = _factor(self, upper) if _runs_here(self) and _square(self) else None
    if chol is None:
        raise Unsupported("bad arguments or a matrix that is not positive-definite: the CPU raises its error")
    return chol, torch.zeros(self.shape[:-2], dtype=torch.int32, device=self.device)


_derive_out("linalg_cholesky_ex.L", linalg_cholesky_ex, lambda self, **kw: (self.dtype, torch.int32),
            aten.linalg_cholesky_ex.default)


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


@lowering("triangular_solve")
def triangular_solve(self: torch.Tensor, A: torch.Tensor, upper: bool = True, transpose: bool = False,
                     unitriangular: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.triangular_solve``: (the solution of ``op(A) X = self``, a copy of ``A``)."""
    if not (_runs_here(self, A) and _square(A) and A.size(-1) == self.size(-2)):
        raise Unsupported("tensors off the device, or shapes the solve does not take")
    coeff = A.mT if transpose else A
    sol = _solve(coeff, self, upper != transpose, unitriangular)
    batch = torch.broadcast_shapes(self.shape[:-2], A.shape[:-2])
    return sol, A.expand(*batch, *A.shape[-2:]).clone()


_derive_out("triangular_solve.X", triangular_solve, lambda self, A, *a, **kw: (self.dtype, A.dtype),
            aten.triangular_solve.default)


@lowering("linalg_solve_triangular")
def linalg_solve_triangular(self: torch.Tensor, B: torch.Tensor, *, upper: bool, left: bool = True,
                            unitriangular: bool = False) -> torch.Tensor:
    """``torch.linalg.solve_triangular``: ``X A = B`` (``left=False``) is ``A^T X^T = B^T``."""
    if not (_runs_here(self, B) and _square(self)) or self.size(-1) != B.size(-2 if left else -1):
        raise Unsupported("tensors off the device, or shapes the solve does not take")
    if left:
        return _solve(self, B, upper, unitriangular)
    return _solve(self.mT, B.mT, not upper, unitriangular).mT


register_out("linalg_solve_triangular.out", linalg_solve_triangular)


@lowering("_cholesky_solve_helper")
def cholesky_solve_helper(self: torch.Tensor, A: torch.Tensor, upper: bool) -> torch.Tensor:
    """``cholesky_solve``'s kernel: ``L L^T X = self`` as two triangular solves."""
    if not (_runs_here(self, A) and _square(A)) or A.size(-1) != self.size(-2):
        raise Unsupported
    chol = A.mT if upper else A
    return _solve(chol.mT, _solve(chol, self, False), True)


@lowering("cholesky_inverse")
def cholesky_inverse(self: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """``(L L^T)^-1 = L^-T L^-1``, with ``L^-1`` from a solve against the identity."""
    if not (_runs_here(self) and _square(self)):
        raise Unsupported("a tensor off the device, or a non-square matrix")
    n = self.size(-1)
    chol = self.mT if upper else self
    eye = torch.eye(n, dtype=self.dtype, device=self.device).expand(*self.shape[:-2], n, n)
    inv = _solve(chol, eye, False)
    return inv.mT @ inv


register_out("cholesky_inverse.out", cholesky_inverse)


# ---- LU factorisation with partial pivoting (getrf) and what is built on it ---------------------------

def _native(op: torch._ops.OpOverload, *args, **kwargs) -> Any:
    """The meta results of ``op`` (shapes) when this module runs the call on the device, else None (the
    caller takes the CPU fallback). On one neuron device, PyTorch's argument checks come first and raise
    the CPU's exception; then the floating tensors must be fp32 with matrix dims within ``MAX_N``."""
    ts = [a for a in args if isinstance(a, torch.Tensor)]
    if ts[0].device.type != "neuron" or any(t.device != ts[0].device for t in ts):
        return None
    metas = checked(op, *args, **kwargs)
    if all(t.dtype == torch.float32 and max(t.shape[-2:], default=0) <= MAX_N for t in ts if t.is_floating_point()):
        return metas
    return None


def _batched(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., m, n] as one batch dim [B, m, n] (B may be 0)."""
    return t.reshape(math.prod(t.shape[:-2]), *t.shape[-2:])


def _lu_factor(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(LU, 1-based int32 pivots, int32 info) of a batch [B, m, n], as LAPACK's ``getf2``: step j picks the
    first row of largest |a| in column j at or below the diagonal (``i?amax``), swaps it up, divides the column below
    by the pivot (skipped for an exact zero, which sets ``info`` to the first such j + 1 and goes on) and
    takes the rank-1 update of the trailing block. Each step works on whole [B, m, n] tensors under
    row/column masks, so every step reuses the kernels the first one compiled."""
    b, m, n = a.shape
    k = min(m, n)
    rows = torch.arange(m, device=a.device)
    cols = torch.arange(n, device=a.device)
    a = a.contiguous()
    pivots, zeros = [], []
    for j in range(k if a.numel() else 0):
        mag = a[:, :, j].abs()
        # LAPACK's i?amax keeps the first maximum and never moves to a NaN: one at row j wins, others lose
        mag = torch.where(mag != mag, torch.where(rows == j, math.inf, -0.5), mag)
        p = torch.where(rows >= j, mag, -1.0).argmax(-1, keepdim=True)                       # [B, 1]
        pivots.append(p)
        swap = torch.where(rows == j, p, torch.where(rows == p, j, rows))                   # [B, m]
        a = a.gather(1, swap.unsqueeze(-1).expand(b, m, n))
        d = a[:, j:j + 1, j]
        zero = d == 0
        zeros.append(zero)
        if j + 1 < m:
            low = a[:, :, j] / torch.where(zero, 1.0, d)                                   # L's column j, below
            # the update touches the trailing block only (a masked product could make 0 * inf = NaN elsewhere)
            trail = (rows > j).unsqueeze(-1) & (cols > j)
            a = torch.where(trail, a - low.unsqueeze(-1) * a[:, j:j + 1, :], a)
            a[:, :, j] = torch.where(rows > j, low, a[:, :, j])
    if not pivots:
        return a.clone(), a.new_ones((b, k), dtype=torch.int32), a.new_zeros((b,), dtype=torch.int32)
    zero = torch.cat(zeros, -1)
    info = torch.where(zero.any(-1), zero.float().argmax(-1) + 1, 0).int()
    return a, (torch.cat(pivots, -1) + 1).int(), info


def _perm(pivots: torch.Tensor, m: int) -> torch.Tensor:
    """The row order ``perm`` [B, m] (int64) with ``LU = A[perm]``, from LAPACK's sequential swaps
    (row j with row ``pivots[j] - 1``)."""
    rows = torch.arange(m, device=pivots.device)
    perm = rows.expand(pivots.shape[0], m)
    piv = pivots.long() - 1
    for j in range(pivots.shape[-1]):
        p = piv[:, j:j + 1]
        perm = torch.where(rows == j, perm.gather(1, p), torch.where(rows == p, perm[:, j:j + 1], perm))
    return perm


@lowering("linalg_lu_factor_ex")
def linalg_lu_factor_ex(A: torch.Tensor, *, pivot: bool = True,
                        check_errors: bool = False) -> tuple[torch.Tensor, ...]:
    """``torch.linalg.lu_factor_ex`` (so ``lu``, ``linalg.lu_factor``): getrf over the batch."""
    if _native(aten.linalg_lu_factor_ex.default, A) is None or not pivot:   # the CPU refuses pivot=False
        raise Unsupported("what the device's LU does not take, or pivot=False (the CPU refuses it)")
    m, n = A.shape[-2:]
    lu, piv, inf = _lu_factor(_batched(A))
    if check_errors and bool((inf > 0).any()):   # the CPU raises its LinAlgError naming the batch element
        raise Unsupported("a singular matrix under check_errors: the CPU raises its LinAlgError")
    return lu.reshape(A.shape), piv.reshape(*A.shape[:-2], min(m, n)), inf.reshape(A.shape[:-2])


_derive_out("linalg_lu_factor_ex.out", linalg_lu_factor_ex, lambda A, **kw: (A.dtype, torch.int32, torch.int32),
            aten.linalg_lu_factor_ex.default)


def _lu_solve(lu: torch.Tensor, pivots: torch.Tensor, b: torch.Tensor, adjoint: bool) -> torch.Tensor:
    """X with ``A X = B`` (``A^T X = B`` when ``adjoint``) for ``A = P L U`` given as getrf's (LU, pivots),
    batch dims already broadcast and flattened: the row permutation and two triangular solves."""
    n = lu.size(-1)
    perm = _perm(pivots, n).unsqueeze(-1).expand(b.shape)
    if not adjoint:   # L U X = P^T B, whose row i is B's row perm[i]
        return _solve(lu, _solve(lu, b.gather(1, perm), False, True), True)
    y = _solve(lu.mT, _solve(lu.mT, b, False), True, True)   # U^T L^T (P^T X) = B
    return torch.empty_like(y).scatter_(1, perm, y)          # X's row perm[i] is row i of P^T X


@lowering("linalg_lu_solve")
def linalg_lu_solve(LU: torch.Tensor, pivots: torch.Tensor, B: torch.Tensor, *, left: bool = True,
                    adjoint: bool = False) -> torch.Tensor:
    """``torch.linalg.lu_solve`` (so ``lu_solve``): ``X A = B`` is ``A^T X^T = B^T``."""
    meta = _native(aten.linalg_lu_solve.default, LU, pivots, B, left=left, adjoint=adjoint)
    if meta is None:
        raise Unsupported("what the device's LU solve does not take")
    shape = meta.shape
    if math.prod(shape) == 0:
        return B.new_zeros(shape)
    n = LU.size(-1)
    rhs = B if left else B.mT
    batch = shape[:-2]
    lu = _batched(LU.expand(*batch, n, n))
    piv = pivots.expand(*batch, n).reshape(-1, n)
    x = _lu_solve(lu, piv, _batched(rhs.expand(*batch, *rhs.shape[-2:])), adjoint == left)
    x = x.reshape(*batch, *rhs.shape[-2:])
    return x if left else x.mT


register_out("linalg_lu_solve.out", linalg_lu_solve)


def _unpack(lu: torch.Tensor, piv: torch.Tensor, data: bool = True,
            perm: bool = True) -> tuple[torch.Tensor | None, ...]:
    """(P, L, U) of getrf's output [B, m, n] (P None unless ``perm``, L and U None unless ``data``)."""
    m, n = lu.shape[-2:]
    k = min(m, n)
    p = low = up = None
    if perm:
        rows = torch.arange(m, device=lu.device)
        p = (_perm(piv, m).unsqueeze(-2) == rows.unsqueeze(-1)).float()   # P[r, i] = 1 where perm[i] == r
    if data:
        low = lu[..., :k].tril(-1) + torch.eye(m, k, device=lu.device)
        up = lu[..., :k, :].triu()
    return p, low, up


@lowering("lu_unpack")
def lu_unpack(LU_data: torch.Tensor, LU_pivots: torch.Tensor, unpack_data: bool = True,
              unpack_pivots: bool = True) -> tuple[torch.Tensor, ...]:
    """``torch.lu_unpack``: the permutation matrix and the unit-lower and upper factors."""
    metas = _native(aten.lu_unpack.default, LU_data, LU_pivots, unpack_data, unpack_pivots)
    if metas is None:
        raise Unsupported("what the device's unpacking does not take")
    m, n = LU_data.shape[-2:]
    if LU_data.numel() == 0:
        res = tuple(LU_data.new_zeros(t.shape) for t in metas)
    else:
        k = min(m, n)
        p, low, up = _unpack(_batched(LU_data), LU_pivots.reshape(-1, k), unpack_data, unpack_pivots)
        batch = LU_data.shape[:-2]
        res = (p.reshape(*batch, m, m) if p is not None else LU_data.new_empty(metas[0].shape),
               low.reshape(*batch, m, k) if low is not None else LU_data.new_empty(metas[1].shape),
               up.reshape(*batch, k, n) if up is not None else LU_data.new_empty(metas[2].shape))
    return res


_derive_out("lu_unpack.out", lu_unpack, lambda LU_data, *a, **kw: (LU_data.dtype,) * 3, aten.lu_unpack.default)


@lowering("linalg_lu")
def linalg_lu(A: torch.Tensor, *, pivot: bool = True) -> tuple[torch.Tensor, ...]:
    """``torch.linalg.lu``: getrf, then unpacked."""
    if _native(aten.linalg_lu.default, A) is None or not pivot:
        raise Unsupported("what the device's LU does not take, or pivot=False (the CPU refuses it)")
    m, n = A.shape[-2:]
    k, batch = min(m, n), A.shape[:-2]
    if A.numel() == 0:
        res = (A.new_zeros(*batch, m, m), A.new_zeros(*batch, m, k), A.new_zeros(*batch, k, n))
    else:
        lu, piv, _ = _lu_factor(_batched(A))
        p, low, up = _unpack(lu, piv)
        res = (p.reshape(*batch, m, m), low.reshape(*batch, m, k), up.reshape(*batch, k, n))
    return res


_derive_out("linalg_lu.out", linalg_lu, lambda A, **kw: (A.dtype,) * 3, aten.linalg_lu.default)


def _det_parts(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(LU, pivots, diagonal of U, the permutation's sign) of square matrices [B, n, n]."""
    lu, piv, _ = _lu_factor(a)
    swaps = (piv != torch.arange(1, a.size(-1) + 1, device=a.device, dtype=torch.int32)).sum(-1)
    return lu, piv, lu.diagonal(dim1=-2, dim2=-1), 1.0 - 2.0 * (swaps % 2).float()


def _det_family(op: torch._ops.OpOverload, A: torch.Tensor, empty: Callable,
                from_lu: Callable) -> tuple[torch.Tensor, ...]:
    """slogdet/det: the CPU fallback, the empty-batch and 0 x 0 cases (``empty(batch)``), or
    ``from_lu(lu, pivots, diag U, the permutation's sign)`` over the batch."""
    metas = _native(op, A)
    if metas is None:
        raise Unsupported("what the device's LU does not take")
    n, batch = A.size(-1), A.shape[:-2]
    if math.prod(batch) == 0:
        res = tuple(torch.empty(t.shape, dtype=t.dtype, device=A.device) for t in metas)
    elif n == 0:   # the empty product: det 1
        res = empty(batch)
    else:
        # as the CPU: a contiguous A is factored as A^T (same determinant), and the backward (linalg_det_backward)
        # reads the saved LU and pivots as that factorisation
        lu, piv, diag, psign = _det_parts(_batched(A.mT if A.is_contiguous() else A))
        lu = torch.empty_strided(metas[-2].shape, metas[-2].stride(), dtype=A.dtype, device=A.device).copy_(
            lu.reshape(A.shape))
        res = from_lu(lu, piv.reshape(*batch, n), diag, psign, batch)
    return res


@lowering("_linalg_slogdet")
def linalg_slogdet(A: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``torch.linalg.slogdet`` (so ``logdet``): from the LU, the sign of prod(diag U) times the
    permutation's, and the sum of log|diag U|."""
    return _det_family(
        aten._linalg_slogdet.default, A,
        lambda batch: (A.new_ones(batch), A.new_zeros(batch), A.new_empty(A.shape),
                       A.new_empty((*batch, 0), dtype=torch.int32)),
        lambda lu, piv, diag, psign, batch: ((psign * diag.sign().prod(-1)).reshape(batch),
                                             diag.abs().log().sum(-1).reshape(batch), lu, piv))


# (the device's A is float32: its logabsdet's real dtype is float32 too)
_derive_out("_linalg_slogdet.sign", linalg_slogdet, lambda A: (A.dtype, A.dtype.to_real(), A.dtype, torch.int32),
            aten._linalg_slogdet.default)


@lowering("_linalg_det")
def linalg_det(A: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``torch.linalg.det`` (so ``det``): prod(diag U) times the permutation's sign."""
    return _det_family(
        aten._linalg_det.default, A,
        lambda batch: (A.new_ones(batch), A.new_empty(A.shape), A.new_empty((*batch, 0), dtype=torch.int32)),
        lambda lu, piv, diag, psign, batch: ((psign * diag.prod(-1)).reshape(batch), lu, piv))


_derive_out("_linalg_det.result", linalg_det, lambda A: (A.dtype, A.dtype, torch.int32), aten._linalg_det.default)


# ---- Householder QR (geqrf) and the products with its Q (orgqr, ormqr) ---------------------------------

def _geqrf(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(reflectors and R, tau [B, min(m, n)]) of a batch [B, m, n], as LAPACK's ``geqr2``/``larfg``: column
    j's reflector ``H = I - tau v v^T`` (``v_j = 1``) maps (alpha, x) to (beta, 0) with
    ``beta = -sign(alpha) |(alpha, x)|``, ``tau = (beta - alpha) / beta`` and ``v = x / (alpha - beta)``;
    ``x = 0`` gives ``tau = 0`` (H = I). Masked whole-matrix steps, as in ``_lu_factor``."""
    b, m, n = a.shape
    rows = torch.arange(m, device=a.device)
    cols = torch.arange(n, device=a.device)
    taus = []
    for j in range(min(m, n) if a.numel() else 0):
        col = a[:, :, j]
        alpha = a[:, j:j + 1, j]
        below = torch.where(rows > j, col, 0.0)
        xnorm = torch.linalg.vector_norm(below, dim=-1, keepdim=True)
        moves = xnorm != 0
        beta = -torch.copysign(torch.hypot(alpha, xnorm), alpha)
        tau = torch.where(moves, (beta - alpha) / beta, 0.0)
        v = torch.where(rows > j, below / torch.where(moves, alpha - beta, 1.0), torch.where(rows == j, 1.0, 0.0))
        w = tau * (v.unsqueeze(1) @ a).squeeze(1)                                  # tau v^T A
        trail = (rows >= j).unsqueeze(-1) & (cols > j)   # H acts on rows j.. of the columns after j only
        a = torch.where(trail, a - v.unsqueeze(-1) * w.unsqueeze(1), a)
        a[:, :, j] = torch.where(rows > j, v, torch.where(rows == j, torch.where(moves, beta, alpha), col))
        taus.append(tau)
    if not taus:   # nothing to factor (an empty matrix): a copy, never the input itself
        return a.clone(), a.new_zeros((b, min(m, n)))
    return a, torch.cat(taus, -1)


def _apply_q(refl: torch.Tensor, tau: torch.Tensor, c: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``Q C`` (``Q^T C`` when ``transpose``) for ``Q = H_0 ... H_{k-1}`` whose reflectors are stored below
    the diagonal of ``refl`` [B, m, >= k] with ``tau`` [B, k], and ``C`` [B, m, p]: one reflector at a time,
    ``H C = C - v (tau (v^T C))``, rounded as LAPACK's ``larf`` (its ``ger`` scales ``w = v^T C`` by tau, then
    multiplies by v): orgqr's backward amplifies the forward's last bits far beyond fp32's tolerance on the
    non-orthogonal reflectors of PyTorch's samples, and ``(tau v) w`` put gradients off where the CPU's
    were not."""
    m, k = refl.size(-2), tau.size(-1)
    if k == 0 or c.numel() == 0:
        return c.clone()
    vs = refl[..., :k].tril(-1) + torch.eye(m, k, device=c.device)
    for j in (range(k) if transpose else reversed(range(k))):
        v = vs[:, :, j:j + 1]                                                     # [B, m, 1]
        c = c - v * (tau[:, j:j + 1].unsqueeze(-1) * (v.mT @ c))
    return c


@lowering("geqrf")
def geqrf(self: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``torch.geqrf``: the reflectors below the diagonal, R on and above it, and the ``tau`` factors."""
    if not (self.device.type == "neuron" and self.dtype == torch.float32 and self.dim() >= 2
            and max(self.shape[-2:]) <= MAX_N):   # geqrf has no meta kernel: the CPU checks a 1-d input
        raise Unsupported("a tensor off the device, a dtype other than float32, or a matrix beyond MAX_N")
    m, n = self.shape[-2:]
    qr, t = _geqrf(_batched(self))
    return qr.reshape(self.shape), t.reshape(*self.shape[:-2], min(m, n))


def _geqrf_resize(outs: list[torch.Tensor], self: torch.Tensor) -> None:
    """``register_out``'s ``resize=`` for geqrf, whose CPU kernel is not structured: an empty ``a`` out= is made
    batched column-major (LAPACK's layout), a non-empty one of another shape resized contiguous (with ATen's
    warning); ``tau`` resized contiguous."""
    a, tau = outs
    m, n = self.shape[-2:]
    if tuple(a.shape) != tuple(self.shape):
        column_major = a.numel() == 0
        resize_out(a, self.shape)
        if column_major:
            a.as_strided_(self.shape, (*a.stride()[:-2], 1, m))
    resize_out(tau, (*self.shape[:-2], min(m, n)))


# (the CPU kernel writes float64 out= tensors of a float32 input: that takes its fallback)
register_out("geqrf.a", geqrf, cast=refuse_other_out_dtypes("geqrf.a", lambda self: (self.dtype, self.dtype)),
             resize=_geqrf_resize)


@lowering("linalg_qr")
def linalg_qr(A: torch.Tensor, mode: str = "reduced") -> tuple[torch.Tensor, ...]:
    """``torch.linalg.qr`` (so ``qr``): geqrf, then Q as the reflectors applied to the identity's first
    columns (orgqr) and R as the upper triangle."""
    metas = _native(aten.linalg_qr.default, A, mode)
    if metas is None:
        raise Unsupported("what the device's QR does not take")
    q_meta, r_meta = metas
    m, n = A.shape[-2:]
    batch = A.shape[:-2]
    refl, tau = _geqrf(_batched(A))
    r = refl[:, :r_meta.size(-2), :]
    r = (r.triu() if r.numel() else r.clone()).reshape(r_meta.shape)   # triu takes no empty tensor
    if mode == "r":
        q = A.new_empty(q_meta.shape)
    else:
        cols = q_meta.size(-1)
        eye = torch.eye(m, cols, device=A.device).expand(refl.size(0), m, cols)
        q = _apply_q(refl, tau, eye, False).reshape(*batch, m, cols)
    return q, r


_derive_out("linalg_qr.out", linalg_qr, lambda A, *a, **kw: (A.dtype, A.dtype), aten.linalg_qr.default)


@lowering("linalg_householder_product")
def linalg_householder_product(input: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.householder_product`` (orgqr): the first n columns of ``H_0 ... H_{k-1}``."""
    meta = _native(aten.linalg_householder_product.default, input, tau)
    if meta is None:
        raise Unsupported("what the device's Householder product does not take")
    shape = meta.shape
    m, n = input.shape[-2:]
    refl = _batched(input)
    eye = torch.eye(m, n, device=input.device).expand(refl.size(0), m, n)
    return _apply_q(refl, tau.reshape(refl.size(0), tau.size(-1)), eye, False).reshape(shape)


register_out("linalg_householder_product.out", linalg_householder_product)


@lowering("ormqr")
def ormqr(self: torch.Tensor, input2: torch.Tensor, input3: torch.Tensor, left: bool = True,
          transpose: bool = False) -> torch.Tensor:
    """``torch.ormqr``: ``op(Q) C`` or ``C op(Q)`` with Q from geqrf's output; ``C Q`` is ``(Q^T C^T)^T``."""
    meta = _native(aten.ormqr.default, self, input2, input3, left, transpose)
    if meta is None:
        raise Unsupported("what the device's ormqr does not take")
    shape = meta.shape
    refl = _batched(self)
    tau = input2.reshape(refl.size(0), input2.size(-1))
    c = _batched(input3)
    res = _apply_q(refl, tau, c, transpose) if left else _apply_q(refl, tau, c.mT, not transpose).mT
    return res.reshape(shape)


register_out("ormqr.out", ormqr)
