"""kernels/foreach.py: one launch over a list of tensors gives each tensor's element-wise result."""
import pytest
import torch

import torchneuron.nki.language as nl

from torchneuron.kernels.foreach import foreach_kernel, foreach_norm_kernel, operand_name
from torchneuron.kernels.reduction import norm2_kernel


def test_a_binary_op_over_a_list_of_tensors():
    xs = [torch.randn(1, n) for n in (5, 300, 4096)]
    ys = [torch.randn(1, n) for n in (5, 300, 4096)]
    args = {}
    for i, (x, y) in enumerate(zip(xs, ys)):
        args[operand_name(i, 0)], args[operand_name(i, 1)] = x, y
    outs = foreach_kernel(3, 2, ("full", "full"))(**args, fn=nl.multiply, out_dtype=nl.float32)
    for out, x, y in zip(outs, xs, ys):
        assert torch.equal(out, x * y)          # one fp32 rounding, as the CPU's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norms_of_a_list_of_tensors(dtype):
    # squares and sums in fp32 (fp16 squares of 40000 do not overflow), each norm rounded once to the dtype: within
    # n fp32 roundings of the float64 norm, plus the final rounding to the dtype; bit for bit norm2_kernel's (each
    # tensor's norm by its instructions)
    xs = [torch.randn(1, n).to(dtype) for n in (1, 200, 10000)]
    xs[1][0, :3] = torch.tensor([40000.0, -30000.0, 0.0]).to(dtype) if dtype == torch.float16 else xs[1][0, :3]
    norms = foreach_norm_kernel(3)(**{operand_name(i, 0): x for i, x in enumerate(xs)}, out_dtype=dtype)
    eps = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    for got, x in zip(norms, xs):
        exact = torch.linalg.vector_norm(x.double())
        assert got.shape == (1, 1) and got.dtype == dtype
        assert torch.equal(got, norm2_kernel(x.reshape(-1, 1)))
        assert abs(got.double().reshape(()) - exact) <= (x.numel() * 2.0**-24 + eps) * exact


def test_scalar_operands_are_one_argument_each():
    # a shared scalar is one (1, 1) argument and per-group scalars one (count, 1) argument: row i is group i's
    xs = [torch.randn(1, n) for n in (5, 300, 129)]
    ys = [torch.randn(1, n) for n in (5, 300, 129)]
    alpha = torch.tensor([[0.5]])
    weights = torch.tensor([[1.5], [-2.0], [0.25]])
    args = {operand_name(0, 2): alpha, operand_name(0, 3): weights}
    for i, (x, y) in enumerate(zip(xs, ys)):
        args[operand_name(i, 0)], args[operand_name(i, 1)] = x, y
    kernel = foreach_kernel(3, 4, ("full", "full", "shared", "each"))
    outs = kernel(**args, fn=lambda x, y, a, w: nl.multiply(nl.add(x, nl.multiply(y, a)), w), out_dtype=nl.float32)
    for i, (out, x, y) in enumerate(zip(outs, xs, ys)):
        assert torch.equal(out, (x + y * 0.5) * weights[i, 0])   # each step one fp32 rounding, as the CPU's
    with pytest.raises(AssertionError, match="each operand 3"):   # one scalar per group, not one for all
        kernel(**{**args, operand_name(0, 3): alpha}, fn=lambda x, y, a, w: x, out_dtype=nl.float32)


def test_in_place_kernel_writes_over_the_first_operands():
    xs = [torch.randn(1, n) for n in (5, 300, 4096)]
    ys = [torch.randn(1, n) for n in (5, 300, 4096)]
    want = [x * y for x, y in zip(xs, ys)]
    args = {}
    for i, (x, y) in enumerate(zip(xs, ys)):
        args[operand_name(i, 0)], args[operand_name(i, 1)] = x, y
    assert foreach_kernel(3, 2, ("full", "full"), inplace=True)(**args, fn=nl.multiply, out_dtype=nl.float32) is None
    for x, w in zip(xs, want):
        assert torch.equal(x, w)
