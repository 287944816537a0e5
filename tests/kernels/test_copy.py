"""kernels/copy.py against PyTorch's views and casts: strided copies, several views in one launch, int64 widening."""
import pytest
import torch

from torchneuron.kernels.copy import multi_copy, strided_copy, widen_int64
from torchneuron.sim.specs import chip_spec


def test_strided_copy_writes_a_transposed_view_exactly():
    src = torch.randn(300, 7)
    dst = torch.zeros(7 * 300)
    strided_copy(dst, src.reshape(-1), (0, (7, 300), (300, 1)), (0, (7, 300), (1, 7)))
    assert torch.equal(dst.view(7, 300), src.T)


def test_strided_copy_casts_and_broadcasts_with_stride_0():
    src = torch.randn(5)
    dst = torch.zeros(4 * 5, dtype=torch.bfloat16)
    strided_copy(dst, src, (0, (4, 5), (5, 1)), (0, (4, 5), (0, 1)))
    assert torch.equal(dst.view(4, 5), src.to(torch.bfloat16).expand(4, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [2.5, -0.0, float("inf"), float("nan"), 65504.0, 1e-30])
def test_one_value_broadcast_is_filled_through_sbuf(dtype, value):
    """``expand`` of a scalar into a large contiguous float tensor: the same values (the DMA's cast of the
    fp32 source, -0.0's sign, NaN) in a handful of instructions instead of a descriptor per element."""
    src = torch.tensor([7.0, value])
    n = 3 * 128 * 2048 + 77                          # full tiles and a ragged tail
    dst = torch.zeros(n + 5, dtype=dtype)
    strided_copy(dst, src, (3, (n,), (1,)), (1, (n,), (0,)))
    want = torch.zeros(n + 5, dtype=dtype)
    want[3:3 + n] = src[1].to(dtype)
    assert torch.equal(dst.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    prog = strided_copy.trace((), dict(dst=dst, src=src, dst_view=(3, (n,), (1,)), src_view=(1, (n,), (0,))),
                              chip_spec("trn2")).program
    assert len(prog.instructions) <= 8


def test_multi_copy_places_each_source_in_its_view():
    a, b = torch.randn(3, 4), torch.randn(2, 4)
    dst = torch.zeros(5 * 4)
    views = (((0, (3, 4), (4, 1)), (0, (3, 4), (4, 1))), ((12, (2, 4), (4, 1)), (0, (2, 4), (4, 1))))
    multi_copy(2)(dst=dst, src0=a.reshape(-1), src1=b.reshape(-1), views=views)
    assert torch.equal(dst.view(5, 4), torch.cat([a, b]))


@pytest.mark.parametrize("n", [1, 129, 5000])
def test_widen_int64_sign_extends(n):
    src = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32)
    dst = torch.zeros(2 * n, dtype=torch.int32)
    widen_int64(dst, src)
    assert torch.equal(dst.view(torch.int64), src.to(torch.int64))
