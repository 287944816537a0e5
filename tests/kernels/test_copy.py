"""kernels/copy.py against PyTorch's views and casts: strided copies, several views in one launch, int64 widening."""
import pytest
import torch

from torchneuron.kernels.copy import multi_copy, strided_copy, widen_int64


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
