"""CTC loss on the device (``_ctc_loss`` and ``_ctc_loss_backward``): the alpha recursion over time in log
space, one element-wise launch (plus the skip term's add) per time step over all batch elements and
extended label positions at once.

Layout: each time step's alphas are one flat row of ``N * W`` values, ``W = 2 + L`` per batch element
(``L = 2 * max_target_length + 1`` extended positions after two -inf pad columns). The three
predecessors of position ``p`` (``p``, ``p - 1``, ``p - 2``) are then contiguous slices of the previous
row, and the pads keep each batch element's recursion from reading its neighbour's. The betas of the
backward are the alphas of the reversed problem (each sequence reversed in time within its input length
and in position within its extended target), so one recursion serves both. The backward runs the alphas
again beside the betas, both scaled at each step (see ``_Problem.alphas``), and normalizes the posterior at
each time step: the forward's log alphas round at the magnitude of the log likelihood, the scaled ones near
0, which keeps the gradient well inside the CPU's error against float64. The lengths are read on the
host (the ``int[]`` overloads already have them; the Tensor overloads sync once) to plan the loop.
"""
from __future__ import annotations

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND

import torchneuron.nki.language as nl
from torchneuron.kernels import tilemath as tm
from torchneuron.kernels import tilemath_special as ts
from torchneuron.ops.base import aten, Unsupported
from torchneuron.ops.elementwise import run_pointwise
from torchneuron.ops.registry import lowering

NEG_INF = float("-inf")
PAD = 2    # -inf columns before each batch element's positions: the reach of the skip transition


def _check(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: list[int], target_lengths: list[int],
           blank: int) -> None:
    """Raise the CPU kernel's error for invalid lengths or shapes (found by running it on zero twins), and
    Unsupported for what the recursion does not handle (the CPU kernel then runs)."""
    if log_probs.device.type != "neuron" or targets.device != log_probs.device or \
            log_probs.dtype != torch.float32 or targets.dtype not in (torch.int32, torch.int64):
        raise Unsupported
    if log_probs.dim() == 3 and targets.dim() in (1, 2):
        t_max, n, c = log_probs.shape
        if len(input_lengths) == n and len(target_lengths) == n and 0 <= blank < c and \
                all(0 <= il <= t_max for il in input_lengths) and all(tl >= 0 for tl in target_lengths) and \
                (targets.shape[0] == n and all(tl <= targets.shape[1] for tl in target_lengths)
                 if targets.dim() == 2 else sum(target_lengths) <= targets.shape[0]):
            return
    aten._ctc_loss.default(torch.zeros(log_probs.shape), torch.zeros(targets.shape, dtype=targets.dtype),
                           input_lengths, target_lengths, blank, False)
    raise Unsupported


class _Problem:
    """The extended labels, emissions and masks of one CTC call in the flat layout (index maps and masks
    built on the host and transferred, which keeps the number of distinct kernels small)."""

    def __init__(self, log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: list[int],
                 target_lengths: list[int], blank: int):
        self.t_max, self.n, _ = log_probs.shape
        self.il, self.tl, self.blank = input_lengths, target_lengths, blank
        self.dev = log_probs.device
        self.length = 2 * max(target_lengths, default=0) + 1
        self.width = PAD + self.length
        col = torch.arange(self.width)
        self.valid = (col >= PAD) & (col < torch.tensor([PAD + 2 * tl + 1 for tl in target_lengths])[:, None])
        self.ext = self._extended_labels(targets)
        penalty = torch.where(self.valid, 0.0, NEG_INF).to(self.dev)
        index = self.ext.unsqueeze(0).expand(self.t_max, self.n, self.width)
        self.emit = (torch.gather(log_probs, 2, index) + penalty).reshape(self.t_max, -1)

    def _extended_labels(self, targets: torch.Tensor) -> torch.Tensor:
        """(N, W) int64: the targets at odd positions, blank elsewhere (pads, even positions, past a batch
        element's target length): one row gather from the targets with a blank appended."""
        starts = [b * targets.shape[1] for b in range(self.n)] if targets.dim() == 2 else \
            [sum(self.tl[:b]) for b in range(self.n)]
        blank_at = targets.numel()
        idx = [[starts[b] + (c - PAD) // 2 if self.valid[b, c] and (c - PAD) % 2 else blank_at
                for c in range(self.width)] for b in range(self.n)]
        # class ids as int32 rows for the gather; the int64 copy is what torch.gather takes
        source = torch.cat([targets.reshape(-1).to(torch.int32),
                            torch.tensor([self.blank], dtype=torch.int32).to(self.dev)])
        ext = source.index_select(0, torch.tensor(idx, dtype=torch.int64).reshape(-1).to(self.dev))
        return ext.reshape(self.n, self.width).to(torch.int64)

    def skip_penalty(self, ext: torch.Tensor) -> torch.Tensor:
        """0 where the transition from two positions back is allowed (a label differing from the one two
        positions back), -inf elsewhere: flat, for the positions from 2 on."""
        col = torch.arange(self.width)
        odd_label = ((col >= PAD + 3) & ((col - PAD) % 2 == 1)).repeat(self.n)[2:].to(self.dev)
        flat = ext.reshape(-1)
        return torch.where((flat[2:] != flat[:-2]) & odd_label, 0.0, NEG_INF)

    def alphas(self, emit: torch.Tensor, skip_pen: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        """(T, N * W) log alphas of emissions ``emit``: row -1 is a virtual start (0 before each first
        position, read as the predecessor of positions 0 and 1), so every row is one step.

        ``scaled``: each step's row less its batch element's largest value of the row before (taken off the
        emissions), so row t holds log alpha_t - c_t with c_t a sum of t such maxima, not known here. The
        plain log alphas grow to |log alpha| of the sequence's whole log likelihood, and each step rounds
        at that magnitude (T steps of u |log alpha|, a relative error of the probabilities: ~1e-4 over 50
        steps of a likelihood of e^-150); the scaled rows stay within a few units of 0 where the
        probability mass is, so a step's rounding is u times that."""
        n, w = self.n, self.width
        first = torch.full((self.t_max + 1, n, w), NEG_INF)
        first[0, :, PAD] = 0.0
        alpha = first.reshape(self.t_max + 1, -1).to(self.dev)
        for t in range(1, self.t_max + 1):
            prev = alpha[t - 1]
            skip = prev[:-2] + skip_pen    # the element-wise kernel takes at most 4 operands
            e = emit[t - 1]
            if scaled:
                top = prev.view(n, w).amax(1, keepdim=True)
                e = run_pointwise(_less_finite, [e.view(n, w), top], KIND.DEFAULT, op="aten::_ctc_loss").view(-1)
            run_pointwise(ts.ctc_alpha_step, [prev[2:], prev[1:-1], skip, e[2:]], KIND.DEFAULT,
                          alpha[t, 2:], op="aten::_ctc_loss")
        return alpha[1:]

    def reversal(self, in_time: bool = True) -> torch.Tensor:
        """Flat indices into a (T, N * W) row block mapping (t, b, s) to (il_b - 1 - t, b, 2 tl_b - s), a pad
        (-inf) outside the lengths: the same map takes the problem to its reverse and back. Not
        ``in_time``: the positions of one (N, W) row only."""
        n, w = self.n, self.width
        t = torch.arange(self.t_max if in_time else 1)[:, None, None]
        s = torch.arange(w)[None, None, :] - PAD
        il = torch.tensor(self.il)[None, :, None] if in_time else 1
        tl = torch.tensor(self.tl)[None, :, None]
        b = torch.arange(n)[None, :, None]
        rt, rs = il - 1 - t, 2 * tl - s
        inside = (rt >= 0) & (s >= 0) & (rs >= 0)
        return torch.where(inside, rt * n * w + b * w + PAD + rs, b * w).reshape(-1).to(self.dev)

    def negative_log_likelihood(self, alpha: torch.Tensor) -> torch.Tensor:
        """``-log(alpha[last label] + alpha[blank after it])`` at each batch element's last time step."""
        n, w = self.n, self.width
        ends = [max((il - 1) * n * w + b * w + PAD + 2 * tl, 1)
                for b, (il, tl) in enumerate(zip(self.il, self.tl))]
        end = torch.tensor(ends, dtype=torch.int64).to(self.dev)
        flat = alpha.reshape(-1)
        nll = -torch.logaddexp(flat.index_select(0, end), flat.index_select(0, end - 1))
        empty = [il == 0 for il in self.il]
        if any(empty):   # no input: likelihood 1 of an empty target, else 0
            fixed = torch.tensor([0.0 if tl == 0 else float("inf") for tl in self.tl])
            nll = torch.where(torch.tensor(empty).to(self.dev), fixed.to(self.dev), nll)
        return nll


def _less_finite(e, top):
    """``e - top``, ``e`` where ``top`` is not finite (a row of no reachable position: its step stays -inf)."""
    return tm.where(tm.isinf(top), e, nl.subtract(e, top))


def ctc_forward(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: list[int],
                target_lengths: list[int], blank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(neg_log_likelihood (N,), log_alpha (N, T, 2 * max_target_length + 1)) as the CPU kernel; log_alpha
    past a batch element's lengths (left unwritten there) holds the recursion's values or -inf."""
    p = _Problem(log_probs, targets, input_lengths, target_lengths, blank)
    alpha = p.alphas(p.emit, p.skip_penalty(p.ext))
    log_alpha = alpha.reshape(p.t_max, p.n, p.width)[:, :, PAD:].permute(1, 0, 2).contiguous()
    return p.negative_log_likelihood(alpha), log_alpha


def ctc_backward(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: list[int],
                 target_lengths: list[int], nll: torch.Tensor, log_alpha: torch.Tensor, blank: int,
                 zero_infinity: bool) -> torch.Tensor:
    """d loss / d log_probs: ``(exp(lp) - sum_{s: l'_s = c} exp(alpha + beta - lp + nll)) * grad`` below each
    input length, 0 past it; nan for an impossible target (inf nll), 0 there with ``zero_infinity``.
    ``alpha + beta - lp + nll`` is taken as the scaled alphas and betas less their log-sum-exp over the
    positions at each time step (equal to it: the likelihood is that sum at any t), so ``log_alpha`` is not
    read; ``nll`` marks the impossible targets."""
    p = _Problem(log_probs, targets, input_lengths, target_lengths, blank)
    t_max, n, w = p.t_max, p.n, p.width
    rev = p.reversal()
    # the reversed labels: a row gather of int32 class ids (as in _extended_labels)
    ext_rev = p.ext.to(torch.int32).reshape(-1).index_select(0, p.reversal(in_time=False)).reshape(n, w)
    emit_rev = p.emit.reshape(-1).index_select(0, rev).reshape(t_max, -1)
    beta = p.alphas(emit_rev, p.skip_penalty(ext_rev), scaled=True)
    beta = beta.reshape(-1).index_select(0, rev).reshape(t_max, n, w)[:, :, PAD:]
    alpha = p.alphas(p.emit, p.skip_penalty(p.ext), scaled=True).reshape(t_max, n, w)[:, :, PAD:]
    emit = p.emit.reshape(t_max, n, w)[:, :, PAD:]
    inside = torch.tensor([[[t < il and bool(p.valid[b, s]) for s in range(PAD, w)]
                            for b, il in enumerate(input_lengths)] for t in range(t_max)]).to(p.dev)
    # the posterior of each (t, position), alpha_t beta_t / y_t (both hold the emission once) over its sum
    # at t, which is the likelihood whatever t (every path is at one position at each time step): the scaled
    # alphas and betas differ from the true ones by a constant of each (t, batch element), which the
    # normalization takes off, and the (T, N, L) sums are of values near 0, not of the log likelihood
    # (log_alpha + beta + nll rounds at its magnitude)
    log_post = torch.where(inside & (emit > NEG_INF), alpha + beta - emit, NEG_INF)   # -inf - -inf: none
    log_total = torch.logsumexp(log_post, 2, keepdim=True)
    log_post = log_post - torch.where(torch.isinf(log_total), 0.0, log_total)
    occupancy = torch.zeros_like(log_probs).scatter_add_(
        2, p.ext[:, PAD:].unsqueeze(0).expand(t_max, n, p.length), torch.exp(log_post))
    g = (torch.exp(log_probs) - occupancy) * grad[None, :, None]
    # the CPU's exp(lp) - exp(log occupancy + nll - lp) is nan where lp = -inf (its occupancy is 0 there)
    g = torch.where(log_probs == NEG_INF, float("nan"), g)
    live = torch.tensor([[t < il for il in input_lengths] for t in range(t_max)]).to(p.dev)[:, :, None]
    impossible = torch.isinf(nll)[None, :, None]
    g = torch.where(live & impossible, 0.0 if zero_infinity else float("nan"), g)
    return torch.where(live, g, 0.0)


def _lengths(lengths) -> list[int]:
    return lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)


@lowering("_ctc_loss", "_ctc_loss.Tensor")
def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths, target_lengths, blank: int = 0,
             zero_infinity: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """CTC's negative log likelihood per batch element and the alphas (zero_infinity is the caller's)."""
    il, tl = _lengths(input_lengths), _lengths(target_lengths)
    _check(log_probs, targets, il, tl, blank)
    return ctc_forward(log_probs, targets, il, tl, blank)


@lowering("_ctc_loss_backward", "_ctc_loss_backward.Tensor")
def ctc_loss_backward(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor, input_lengths,
                      target_lengths, neg_log_likelihood: torch.Tensor, log_alpha: torch.Tensor, blank: int,
                      zero_infinity: bool = False) -> torch.Tensor:
    """The gradient of ``_ctc_loss``'s negative log likelihood with respect to ``log_probs``."""
    il, tl = _lengths(input_lengths), _lengths(target_lengths)
    _check(log_probs, targets, il, tl, blank)
    if not all(t.device == log_probs.device for t in (grad, neg_log_likelihood, log_alpha)) or \
            tuple(log_alpha.shape) != (log_probs.shape[1], log_probs.shape[0], 2 * max(tl, default=0) + 1):
        raise Unsupported
    return ctc_backward(grad, log_probs, targets, il, tl, neg_log_likelihood, log_alpha, blank, zero_infinity)
