"""Training batch norm of fp32 activations in one launch each way: channels on the partitions, every value of a
channel (all images and positions) on the free axis of one SBUF tile.

Forward, per tile of <= 128 channels: load x[:, c, :] ([c, N, HW], one DMA), sum -> mean, deviations, sum of
squares -> invstd = rsqrt(var_sum / n + eps), the running statistics' update, and out = x * alpha + beta with
alpha = invstd * w, beta = b - mean * alpha (per-partition scalars). Backward: sum(g), sum(g * (x - mean)), and
grad_input = (g - sum(g) / n - (x - mean) * k) * invstd * w with k = sum(g * dev) * invstd^2 / n. The formulas and
their order of operations are the element-wise lowering's (``ops.normalization``), one instruction per step
instead of one launch per step; that lowering serves what these do not take (other dtypes, eval mode, channels
whose values do not fit one tile).
"""
from __future__ import annotations

from torchneuron import nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.kernels._common import PMAX, tiles

CHANNEL_ELEMS = 8192     # values per channel one tile holds (32 KiB fp32 per partition; two such tiles live)


def batch_norm_fits(n: int, hw: int) -> bool:
    """Whether these kernels take a batch norm of ``n`` images of ``hw`` positions per channel."""
    return 0 < n * hw <= CHANNEL_ELEMS


def _col():
    return nl.ndarray((PMAX, 1), nl.float32, buffer=nl.sbuf)


def _channels(t, c0: int, cp: int):
    """The [cp, N, HW] view of channels [c0, c0 + cp) of t [N, C, HW]."""
    N, C, HW = t.shape
    return t.ap([[HW, cp], [C * HW, N], [1, HW]], offset=c0 * HW)


def _load_col(v, c0: int, cp: int):
    """SBUF [cp, 1]: elements [c0, c0 + cp) of the vector v [C]."""
    t = _col()
    nisa.dma_copy(dst=t[:cp], src=v.ap([[1, cp], [1, 1]], offset=c0))
    return t


def _store_col(v, c0: int, cp: int, t) -> None:
    nisa.dma_copy(dst=v.ap([[1, cp], [1, 1]], offset=c0), src=t[:cp])


@nki.jit
def batch_norm_train_kernel(x, weight=None, bias=None, running_mean=None, running_var=None, momentum=0.1,
                            eps=1e-5):
    """(out, save_mean, save_invstd[, new running_mean, new running_var]) of training batch norm of fp32 x
    [N, C, HW] (the running statistics' new values only when they are given)."""
    N, C, HW = x.shape
    n = N * HW
    assert batch_norm_fits(N, HW), f"batch_norm: {n} values per channel do not fit one tile"
    assert x.dtype == nl.float32, "batch_norm: the fused kernel takes fp32"
    out = nl.ndarray((N, C, HW), nl.float32, buffer=nl.shared_hbm)
    save_mean = nl.ndarray((C,), nl.float32, buffer=nl.shared_hbm)
    save_invstd = nl.ndarray((C,), nl.float32, buffer=nl.shared_hbm)
    running = running_mean is not None
    assert running == (running_var is not None), "batch_norm: both running statistics or neither"
    if running:
        new_mean = nl.ndarray((C,), nl.float32, buffer=nl.shared_hbm)
        new_var = nl.ndarray((C,), nl.float32, buffer=nl.shared_hbm)
    for c0, cp in tiles(C):
        t = nl.ndarray((PMAX, N, HW), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:cp], src=_channels(x, c0, cp))
        mean, var_sum, invstd = _col(), _col(), _col()
        nisa.tensor_reduce(dst=mean[:cp], op=nl.add, data=t[:cp], axis=(1, 2))
        nisa.tensor_scalar(dst=mean[:cp], data=mean[:cp], op0=nl.multiply, operand0=1.0 / n)
        dev = nl.ndarray((PMAX, N, HW), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=dev[:cp], data=t[:cp], op0=nl.subtract, operand0=mean[:cp])
        nisa.tensor_tensor(dst=dev[:cp], data1=dev[:cp], data2=dev[:cp], op=nl.multiply)
        nisa.tensor_reduce(dst=var_sum[:cp], op=nl.add, data=dev[:cp], axis=(1, 2))
        nisa.tensor_scalar(dst=invstd[:cp], data=var_sum[:cp], op0=nl.divide, operand0=float(n), op1=nl.add,
                           operand1=float(eps))
        nisa.activation(dst=invstd[:cp], op=nl.rsqrt, data=invstd[:cp])
        _store_col(save_mean, c0, cp, mean)
        _store_col(save_invstd, c0, cp, invstd)
        if running:     # running * (1 - momentum) + batch * momentum, the variance unbiased
            for old_v, new_v, batch in ((running_mean, new_mean, mean), (running_var, new_var, None)):
                r, b = _load_col(old_v, c0, cp), _col()
                if batch is None:
                    nisa.tensor_scalar(dst=b[:cp], data=var_sum[:cp], op0=nl.divide, operand0=float(max(n - 1, 1)))
                    batch = b
                nisa.tensor_scalar(dst=b[:cp], data=batch[:cp], op0=nl.multiply, operand0=float(momentum))
                nisa.scalar_tensor_tensor(dst=r[:cp], data=r[:cp], op0=nl.multiply, operand0=float(1 - momentum),
                                          op1=nl.add, operand1=b[:cp])
                _store_col(new_v, c0, cp, r)
        alpha, beta = _col(), _col()
        if weight is not None:
            w = _load_col(weight, c0, cp)
            nisa.tensor_tensor(dst=alpha[:cp], data1=invstd[:cp], data2=w[:cp], op=nl.multiply)
        else:
            nisa.tensor_copy(dst=alpha[:cp], src=invstd[:cp])
        nisa.tensor_tensor(dst=beta[:cp], data1=mean[:cp], data2=alpha[:cp], op=nl.multiply)
        if bias is not None:   # b - mean * alpha
            b = _load_col(bias, c0, cp)
            nisa.tensor_tensor(dst=beta[:cp], data1=b[:cp], data2=beta[:cp], op=nl.subtract)
        else:                  # -(mean * alpha)
            nisa.tensor_scalar(dst=beta[:cp], data=beta[:cp], op0=nl.multiply, operand0=-1.0)
        y = nl.ndarray((PMAX, N, HW), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y[:cp], data=t[:cp], op0=nl.multiply, operand0=alpha[:cp], op1=nl.add,
                           operand1=beta[:cp])
        nisa.dma_copy(dst=_channels(out, c0, cp), src=y[:cp])
    if running:
        return out, save_mean, save_invstd, new_mean, new_var
    return out, save_mean, save_invstd


@nki.jit
def batch_norm_train_backward_kernel(g, x, mean, invstd, weight=None):
    """(grad_input, sum(g * (x - mean)) * invstd, sum(g)) per channel of training batch norm of fp32 x [N, C, HW]
    whose output gradient is g, from the saved mean and invstd (the second and third: the weight's and bias's
    gradients)."""
    N, C, HW = x.shape
    n = N * HW
    assert batch_norm_fits(N, HW), f"batch_norm: {n} values per channel do not fit one tile"
    assert x.dtype == g.dtype == nl.float32, "batch_norm: the fused kernel takes fp32"
    grad_input = nl.ndarray((N, C, HW), nl.float32, buffer=nl.shared_hbm)
    grad_weight = nl.ndarray((C,), nl.float32, buffer=nl.shared_hbm)
    grad_bias = nl.ndarray((C,), nl.float32, buffer=nl.shared_hbm)
    for c0, cp in tiles(C):
        gt = nl.ndarray((PMAX, N, HW), nl.float32, buffer=nl.sbuf)
        dev = nl.ndarray((PMAX, N, HW), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=gt[:cp], src=_channels(g, c0, cp))
        nisa.dma_copy(dst=dev[:cp], src=_channels(x, c0, cp))
        m, istd = _load_col(mean, c0, cp), _load_col(invstd, c0, cp)
        nisa.tensor_scalar(dst=dev[:cp], data=dev[:cp], op0=nl.subtract, operand0=m[:cp])
        sum_g, dot = _col(), _col()
        nisa.tensor_reduce(dst=sum_g[:cp], op=nl.add, data=gt[:cp], axis=(1, 2))
        prod = nl.ndarray((PMAX, N, HW), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[:cp], data1=gt[:cp], data2=dev[:cp], op=nl.multiply)
        nisa.tensor_reduce(dst=dot[:cp], op=nl.add, data=prod[:cp], axis=(1, 2))
        gw = _col()
        nisa.tensor_tensor(dst=gw[:cp], data1=dot[:cp], data2=istd[:cp], op=nl.multiply)
        _store_col(grad_weight, c0, cp, gw)
        _store_col(grad_bias, c0, cp, sum_g)
        # k = dot * invstd * invstd / n; scale = invstd * w
        k, mean_g, scale = _col(), _col(), _col()
        nisa.tensor_tensor(dst=k[:cp], data1=gw[:cp], data2=istd[:cp], op=nl.multiply)
        nisa.tensor_scalar(dst=k[:cp], data=k[:cp], op0=nl.divide, operand0=float(n))
        nisa.tensor_scalar(dst=mean_g[:cp], data=sum_g[:cp], op0=nl.divide, operand0=float(n))
        if weight is not None:
            w = _load_col(weight, c0, cp)
            nisa.tensor_tensor(dst=scale[:cp], data1=istd[:cp], data2=w[:cp], op=nl.multiply)
        else:
            nisa.tensor_copy(dst=scale[:cp], src=istd[:cp])
        # (g - mean_g - dev * k) * scale
        nisa.tensor_scalar(dst=gt[:cp], data=gt[:cp], op0=nl.subtract, operand0=mean_g[:cp])
        nisa.tensor_scalar(dst=dev[:cp], data=dev[:cp], op0=nl.multiply, operand0=k[:cp])
        nisa.tensor_tensor(dst=gt[:cp], data1=gt[:cp], data2=dev[:cp], op=nl.subtract)
        nisa.tensor_scalar(dst=gt[:cp], data=gt[:cp], op0=nl.multiply, operand0=scale[:cp])
        nisa.dma_copy(dst=_channels(grad_input, c0, cp), src=gt[:cp])
    return grad_input, grad_weight, grad_bias
