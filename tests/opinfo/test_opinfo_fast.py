"""OpInfo samples on neuron against the CPU, for a fast subset of ``op_db`` (``make test``).

Two tests per op: ``test_op_samples`` (sample_inputs, outputs compared with the CPU)
and ``test_op_error_inputs`` (error_inputs raise the CPU's exception type; only for ops
that have error inputs). The whole op_db runs in ``make conformance``.

A known failure that cannot be fixed in the tests goes into EXPECTED_FAILURES, keyed by
(test, op key), with the reason; it is a strict xfail, so a fix makes the test fail
until the entry is removed.
"""
from __future__ import annotations

import pytest
import torch

from .harness import OpSkipped, check_op, find_ops, load_op_db, op_key

pytestmark = pytest.mark.filterwarnings("ignore:.*has no neuron kernel yet.*:UserWarning")

FAST_OPS = [
    # unary
    "abs", "neg", "exp", "log", "sqrt", "sin", "tanh", "sigmoid", "erf", "floor", "round", "sign",
    "reciprocal", "nan_to_num", "clamp", "bitwise_not",
    # binary
    "add", "sub", "mul", "div.no_rounding_mode", "div.floor_rounding", "pow", "maximum", "eq", "fmod",
    "remainder", "atan2", "where", "lerp", "addcmul", "bitwise_and",
    # reductions and scans
    "sum", "mean", "prod", "amax", "argmax", "max.reduction_with_dim", "min.reduction_no_dim", "var",
    "std", "logsumexp", "cumsum", "all", "any", "linalg.vector_norm",
    # matmul
    "mm", "bmm", "matmul", "addmm", "mv", "nn.functional.linear", "einsum", "baddbmm", "outer",
    # indexing
    "__getitem__", "index_select", "gather", "scatter", "scatter_add", "index_put", "index_add",
    "masked_fill", "masked_select", "take_along_dim", "nonzero",
    # shapes and views
    "view", "reshape", "permute", "transpose", "squeeze", "unsqueeze", "flatten", "expand", "cat",
    "stack", "split", "chunk", "narrow", "flip", "roll", "repeat", "tril", "triu", "as_strided",
    "select", "movedim", "clone", "resize_",
    # nn.functional
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.rms_norm",
    "nn.functional.group_norm", "nn.functional.batch_norm", "nn.functional.conv1d",
    "nn.functional.conv2d", "nn.functional.cross_entropy", "nn.functional.nll_loss",
    "nn.functional.mse_loss", "nn.functional.embedding", "nn.functional.gelu", "nn.functional.relu",
    "nn.functional.silu", "nn.functional.dropout", "nn.functional.avg_pool2d",
    "nn.functional.adaptive_avg_pool2d", "nn.functional.pad.constant",
    "nn.functional.scaled_dot_product_attention", "nn.functional.interpolate.nearest",
    "nn.functional.one_hot",
    # factories, conversions, sorting
    "ones", "full", "arange", "randn", "eye", "linspace", "to", "sort", "topk", "unique",
]

# {(test, op key): reason}; test is "samples" or "error_inputs".
EXPECTED_FAILURES: dict[tuple[str, str], str] = {}

_OPS = find_ops(FAST_OPS, load_op_db())
_UNKNOWN = {test_op for _, test_op in EXPECTED_FAILURES} - {op_key(op) for op in _OPS}
assert not _UNKNOWN, f"EXPECTED_FAILURES names ops outside FAST_OPS: {_UNKNOWN}"


def _params(test: str, ops) -> list:
    params = []
    for op in ops:
        reason = EXPECTED_FAILURES.get((test, op_key(op)))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(op, id=op_key(op), marks=marks))
    return params


def _check(op, **kwargs) -> None:
    try:
        check_op(op, time_budget=60, **kwargs)
    except OpSkipped as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("op", _params("samples", _OPS))
def test_op_samples(op):
    _check(op, error_inputs=False)


@pytest.mark.parametrize("op", _params("error_inputs", [op for op in _OPS if op.error_inputs_func is not None]))
def test_op_error_inputs(op):
    _check(op, samples=False)


# A representative subset at the other dtypes (``make conformance`` / ``make coverage`` take ``--dtypes all``
# and ``--grads`` for the whole op_db): element-wise, reductions, scans, matmul, norms, losses, indexing,
# sorting; each at the dtypes it supports of bf16, fp16, int32 and bool, and at float32 with gradients.
DTYPE_OPS = ["add", "mul", "div.no_rounding_mode", "exp", "abs", "clamp", "eq", "where", "sum", "mean", "amax",
             "argmax", "cumsum", "mm", "softmax", "log_softmax", "nn.functional.layer_norm",
             "nn.functional.conv2d", "nn.functional.cross_entropy", "index_add", "scatter_add", "gather", "cat",
             "sort"]
DTYPES = [torch.bfloat16, torch.float16, torch.int32, torch.bool]
GRAD_OPS = ["add", "mul", "div.no_rounding_mode", "exp", "sum", "mean", "amax", "cumsum", "mm", "softmax",
            "log_softmax", "nn.functional.layer_norm", "nn.functional.conv2d", "nn.functional.cross_entropy",
            "gather", "index_add", "cat", "nn.functional.gelu"]

# {(op key, dtype): reason}: known mismatches at a dtype, strict xfails.
DTYPE_EXPECTED_FAILURES: dict[tuple[str, torch.dtype], str] = {}


def _dtype_params() -> list:
    params = []
    for op in find_ops(DTYPE_OPS, load_op_db()):
        for dtype in DTYPES:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            reason = DTYPE_EXPECTED_FAILURES.get((op_key(op), dtype))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(op, dtype, id=f"{op_key(op)}-{str(dtype).removeprefix('torch.')}",
                                       marks=marks))
    return params


@pytest.mark.parametrize("op,dtype", _dtype_params())
def test_op_samples_at_dtype(op, dtype):
    _check(op, dtype=dtype, error_inputs=False, grads=dtype.is_floating_point)


@pytest.mark.parametrize("op", find_ops(GRAD_OPS, load_op_db()), ids=op_key)
def test_op_gradients(op):
    _check(op, dtype=torch.float32, error_inputs=False, grads=True)
