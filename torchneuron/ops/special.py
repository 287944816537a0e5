"""Special functions and less common activations on the device: element-wise launches whose tile math
lives in ``tilemath_special`` (lgamma, digamma, polygamma, erfinv, erfc, Bessel I0/I1, logaddexp,
nextafter, frexp, incomplete gamma, ...), registered with ``pointwise.register_pointwise`` like the rest of the
element-wise ops. CTC loss lives in ``ctc`` (imported at the end, so importing this module registers it).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND

from torchneuron.kernels import tilemath_special as ts
from torchneuron.ops.base import aten, on_one_device, overload_exists, Unsupported, variants
from torchneuron.ops.elementwise import run_pointwise
from torchneuron.ops.pointwise import at_common_dtype, register_pointwise, x_log
from torchneuron.ops.registry import lowering, register_out

POLYGAMMA_MAX_N = 6


def _unary(fn: Callable) -> Callable:
    """The build function of a one-operand op."""
    def build(x, *_):
        return fn, [x]
    return build


def _binary(fn: Callable) -> Callable:
    """The build function of a two-operand op."""
    def build(a, b):
        return fn, [a, b]
    return build


def _names(*names: str) -> list[str]:
    return [n for n in names if overload_exists(n)]


_CPU_VERDICTS: dict = {}   # (op, argument dtypes) -> None or the CPU's (exception type, message)


def _twin(a: Any, numel: int) -> Any:
    return torch.zeros(numel, dtype=a.dtype) if isinstance(a, torch.Tensor) else a


def check_dtypes_like_cpu(op: torch._ops.OpOverload, *args: Any, numel: int = 1) -> None:
    """Raise what the CPU kernel raises for these argument dtypes ("not implemented for 'Int'"), found
    once per dtype combination by running ``op`` on small CPU twins (``numel`` zeros each)."""
    key = (op, *(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args))
    if key not in _CPU_VERDICTS:
        try:
            op(*[_twin(a, numel) for a in args])
            _CPU_VERDICTS[key] = None
        except Exception as e:  # noqa: BLE001 (any refusal is re-raised as is)
            _CPU_VERDICTS[key] = (type(e), str(e))
    verdict = _CPU_VERDICTS[key]
    if verdict is not None:
        raise verdict[0](verdict[1])


def _guarded(op: torch._ops.OpOverload, build: Callable) -> Callable:
    """``build`` after the CPU's dtype check of its tensor arguments."""
    def checked(*args, **kwargs):
        check_dtypes_like_cpu(op, *[a for a in args if isinstance(a, torch.Tensor)])
        return build(*args, **kwargs)
    return checked


# unary special functions: ints compute in float
for _name, _fn in {"lgamma": ts.lgamma, "digamma": ts.digamma, "erfinv": ts.erfinv, "erfc": ts.erfc,
                   "i0": ts.i0}.items():
    register_pointwise(variants(_name, ""), _unary(_fn), KIND.INT_TO_FLOAT)
for _name, _fn in {"special_i0e": ts.i0e, "special_i1": ts.i1, "special_i1e": ts.i1e,
                   "special_entr": ts.entr, "special_erfcx": ts.erfcx, "special_log_ndtr": ts.log_ndtr}.items():
    register_pointwise(_names(_name, f"{_name}.out"), _guarded(getattr(aten, _name).default, _unary(_fn)),
               KIND.INT_TO_FLOAT)


def _polygamma(n, x):
    if n < 0:
        raise RuntimeError("polygamma(n, x) does not support negative n.")
    if n > POLYGAMMA_MAX_N:
        raise Unsupported  # the asymptotic series after a shift of 10 loses fp32 accuracy for larger n
    return ts.polygamma(n), [x]


register_pointwise(["polygamma", "polygamma.out"], _polygamma, KIND.INT_TO_FLOAT)

# binary
register_pointwise(["logaddexp", "logaddexp.out"],
                   at_common_dtype(_guarded(aten.logaddexp.default, _binary(ts.logaddexp))), KIND.INT_TO_FLOAT)
register_pointwise(["logaddexp2", "logaddexp2.out"],
                   at_common_dtype(_guarded(aten.logaddexp2.default, _binary(ts.logaddexp2))), KIND.INT_TO_FLOAT)
register_pointwise(["special_xlog1py", "special_xlog1py.out"], x_log(ts.xlog1py, ts.log1p_wide), KIND.INT_TO_FLOAT)


for _name, _fn in {"igamma": ts.igamma, "igammac": ts.igammac}.items():   # ints raise, as on the CPU
    register_pointwise(variants(_name, ""), at_common_dtype(_guarded(getattr(aten, _name).default, _binary(_fn))),
                       KIND.INT_TO_FLOAT)


def _heaviside(x, values):
    if isinstance(x, torch.Tensor) and isinstance(values, torch.Tensor) and x.dtype != values.dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes.")
    if x.dtype == torch.bool:
        raise Unsupported
    return ts.heaviside, [x, values]


register_pointwise(["heaviside", "heaviside_", "heaviside.out"], at_common_dtype(_heaviside), KIND.DEFAULT)


def _nextafter(a, b):
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise Unsupported  # half-width floats step in their own bits (CPU); others raise there
    return ts.nextafter, [a, b]


register_pointwise(["nextafter", "nextafter_", "nextafter.out"], _guarded(aten.nextafter.default, _nextafter), KIND.DEFAULT)

# activations and their gradients
register_pointwise(["log_sigmoid_backward", "log_sigmoid_backward.grad_input"],
           lambda g, x, buffer: (ts.log_sigmoid_backward, [g, x]), KIND.DEFAULT)


def _softshrink(x, lambd=0.5):
    if lambd < 0:  # the CPU's range check and message, run on a one-element twin
        aten.softshrink(torch.zeros(1, dtype=x.dtype), lambd)
    return ts.softshrink, [x, lambd]


register_pointwise(["softshrink", "softshrink.out"], _guarded(aten.softshrink.default, _softshrink), KIND.DEFAULT)
register_pointwise(["hardshrink", "hardshrink.out"], _guarded(aten.hardshrink.default, lambda x, lambd=0.5: (
    ts.hardshrink, [x, lambd])), KIND.DEFAULT)
register_pointwise(["softshrink_backward", "softshrink_backward.grad_input", "hardshrink_backward",
            "hardshrink_backward.grad_input"], lambda g, x, lambd: (ts.shrink_backward, [g, x, lambd]), KIND.DEFAULT)


def _logit_backward(g, x, eps=None):
    if eps is None or eps < 0:
        return ts.logit_backward, [g, x]
    return ts.logit_backward_eps, [g, x, eps, 1 - eps]


register_pointwise(["logit_backward", "logit_backward.grad_input"], _logit_backward, KIND.DEFAULT)


@lowering("log_sigmoid_forward", "log_sigmoid_forward.output")
def log_sigmoid_forward(self: torch.Tensor, *, output: torch.Tensor | None = None,
                        buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log sigmoid(x), the CPU kernel's buffer exp(-|x|)): two element-wise launches."""
    op = aten.log_sigmoid_forward.output if output is not None else aten.log_sigmoid_forward.default
    check_dtypes_like_cpu(aten.log_sigmoid_forward.default, self)
    out = run_pointwise(ts.log_sigmoid, [self], KIND.DEFAULT, output, op=str(op))
    buf = run_pointwise(ts.log_sigmoid_buffer, [self], KIND.DEFAULT, buffer, op=str(op))
    return out, buf


@lowering("frexp.Tensor_out")
def frexp_out(self: torch.Tensor, *, mantissa: torch.Tensor, exponent: torch.Tensor):
    """(mantissa, exponent) from the bits of fp32 ``self``: two element-wise launches."""
    op = aten.frexp.Tensor_out
    if not self.is_floating_point():
        raise RuntimeError("torch.frexp() only supports floating-point dtypes")
    if mantissa.dtype != self.dtype:
        raise RuntimeError("torch.frexp() expects mantissa to have dtype {} but got {}".format(
            self.dtype, mantissa.dtype))
    if exponent.dtype != torch.int32:
        raise RuntimeError(f"torch.frexp() expects exponent to have int dtype but got {exponent.dtype}")
    if self.dtype != torch.float32 or not on_one_device(self, mantissa, exponent):
        raise Unsupported("a dtype other than float32, or tensors on more than one device")
    run_pointwise(ts.frexp_mantissa, [self], KIND.DEFAULT, mantissa, op=str(op))
    run_pointwise(ts.frexp_exponent, [self], KIND.DEFAULT, exponent, result_dtype=torch.int32, op=str(op))
    return mantissa, exponent


@lowering("rrelu_with_noise")
def rrelu_with_noise(self: torch.Tensor, noise: torch.Tensor, lower: Any = 0.125, upper: Any = 1 / 3,
                     training: bool = False, generator: Any = None) -> torch.Tensor:
    """Evaluation: leaky_relu with the mean slope. Training: slopes drawn uniformly in [lower, upper] on the
    device for x <= 0 (1 elsewhere), written to ``noise`` (the device generator's draws, not the CPU's)."""
    if not self.is_floating_point() or not on_one_device(self, noise) or generator is not None or \
            (training and noise.shape != self.shape):
        raise Unsupported
    if not training:
        return torch.nn.functional.leaky_relu(self, (lower + upper) / 2)
    slopes = torch.empty_like(self).uniform_(lower, upper)
    noise.copy_(torch.where(self <= 0, slopes, torch.ones_like(self)))
    return self * noise


@lowering("_prelu_kernel")
def prelu_kernel(self: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x > 0 ? x : w * x`` (the weight already broadcastable, as ATen's prelu passes it)."""
    return run_pointwise(ts.prelu, [self, weight], KIND.DEFAULT, op="aten::_prelu_kernel")


@lowering("_prelu_kernel_backward")
def prelu_kernel_backward(grad: torch.Tensor, self: torch.Tensor, weight: torch.Tensor):
    """(grad_input, grad_weight): element-wise, then grad_weight summed to the weight's shape."""
    gi = run_pointwise(ts.prelu_grad_input, [grad, self, weight], KIND.DEFAULT, op="aten::_prelu_kernel_backward")
    gw_full = run_pointwise(ts.prelu_grad_weight, [grad, self], KIND.DEFAULT, op="aten::_prelu_kernel_backward")
    w = weight.reshape((1,) * (gw_full.dim() - weight.dim()) + tuple(weight.shape))
    dims = [d for d in range(gw_full.dim()) if w.shape[d] == 1 and gw_full.shape[d] != 1]
    gw = gw_full.sum(dims, keepdim=True) if dims else gw_full
    return gi, gw.reshape(weight.shape)


def _in_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 ``x`` in fp32 (the CPU's glu computes in fp32 and rounds once); others as they are."""
    return x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x


def _glu_halves(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    if x.dim() == 0:
        raise RuntimeError("glu does not support scalars because halving size must be even")
    dim = dim % x.dim() if -x.dim() <= dim < x.dim() else dim
    if not 0 <= dim < x.dim():
        raise IndexError(f"Dimension out of range (expected to be in range of [{-x.dim()}, {x.dim() - 1}], "
                         f"but got {dim})")
    n = x.shape[dim]
    if n % 2:
        raise RuntimeError(f"Halving dimension must be even, but dimension {dim} is size {n}")
    return x.narrow(dim, 0, n // 2), x.narrow(dim, n // 2, n // 2), dim


@lowering("glu")
def glu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``a * sigmoid(b)`` of the two halves along ``dim``."""
    check_dtypes_like_cpu(aten.glu.default, self, numel=2)   # glu halves its dim: two elements
    if self.dtype == torch.float64 or not on_one_device(self):
        raise Unsupported("float64, or a tensor off the device")
    a, b, _ = _glu_halves(_in_fp32(self), dim)
    return (a * torch.sigmoid(b)).to(self.dtype)


register_out("glu.out", glu)


@lowering("glu_backward")
def glu_backward(grad_output: torch.Tensor, self: torch.Tensor, dim: int) -> torch.Tensor:
    """(g * sigmoid(b), g * a * sigmoid(b) * (1 - sigmoid(b))) joined along ``dim``."""
    if not self.is_floating_point() or self.dtype == torch.float64 or not on_one_device(self, grad_output):
        raise Unsupported("a dtype the engines lack, or tensors on more than one device")
    a, b, d = _glu_halves(_in_fp32(self), dim)
    g = _in_fp32(grad_output)
    s = torch.sigmoid(b)
    ga = g * s
    gb = ga * a * (1 - s)
    return torch.cat([ga, gb], d).to(self.dtype)


register_out("glu_backward.grad_input", glu_backward)
