"""kernels/foreach.py: one launch over a list of tensors gives each tensor's element-wise result."""
import torch

import torchneuron.nki.language as nl
from torchneuron.kernels.foreach import foreach_kernel, foreach_sum_kernel, operand_name


def test_a_binary_op_over_a_list_of_tensors():
    xs = [torch.randn(1, n) for n in (5, 300, 4096)]
    ys = [torch.randn(1, n) for n in (5, 300, 4096)]
    args = {}
    for i, (x, y) in enumerate(zip(xs, ys)):
        args[operand_name(i, 0)], args[operand_name(i, 1)] = x, y
    outs = foreach_kernel(3, 2, ("full", "full"))(**args, fn=nl.multiply, out_dtype=nl.float32)
    for out, x, y in zip(outs, xs, ys):
        assert torch.equal(out, x * y)          # one fp32 rounding, as the CPU's


def test_sums_of_a_list_of_tensors():
    xs = [torch.randn(1, n) for n in (1, 200, 10000)]
    sums = foreach_sum_kernel(3)(**{operand_name(i, 0): x for i, x in enumerate(xs)})
    for s, x in zip(sums, xs):
        torch.testing.assert_close(s.reshape(()), x.sum(), rtol=1e-5, atol=1e-5 * x.numel() ** 0.5)
