"""Advanced indexing by integer index tensors in one launch (``x[idx]``) or two (``x[idx] = v``): results equal
to the CPU's in every data dtype, negative and int64 indices, several indexed dims, and the CPU's errors
for indices out of range with the target untouched."""
import pytest
import torch

from tests.ops.conftest import to_n
from torchneuron.kernels.indexing import index_rows
from torchneuron.runtime import profiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8, torch.bool]


def _data(shape, dtype):
    x = torch.randn(shape) * 100
    return x > 0 if dtype == torch.bool else x.to(dtype)


def _names(fn):
    with profiler.record() as recs:
        out = fn()
    return out, [r.name for r in recs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("itype", [torch.int64, torch.int32])
def test_rows_by_an_index_tensor_is_one_launch(itype, dtype, strict):
    x = _data((300, 7), dtype)
    idx = torch.tensor([[3, -1, 0], [299, -300, 150]], dtype=itype)
    got, names = _names(lambda: to_n(x)[to_n(idx)])
    assert names == ["index_rows"]
    assert got.dtype == dtype and torch.equal(got.cpu(), x[idx])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_several_dims_broadcast_and_trailing_dims(dtype, strict):
    x = _data((5, 6, 4, 3), dtype)
    i, j = torch.tensor([[0], [-1], [2]]), torch.tensor([1, -6, 5, 0], dtype=torch.int32)
    for key in ((i, j), (torch.tensor([4, 0]), torch.tensor([5, 1]), torch.tensor([-4, 3]))):
        assert torch.equal(to_n(x)[tuple(to_n(t) for t in key)].cpu(), x[key])
    k = torch.tensor([2, 0, 2])
    assert torch.equal(to_n(x)[:, to_n(k)].cpu(), x[:, k])          # not the leading dim: permuted first
    assert torch.equal(to_n(x)[1:, :, to_n(k)].cpu(), x[1:, :, k])  # of a view


@pytest.mark.parametrize("bad", [[7], [-8], [2, 9], [2 ** 32 + 1], [-(2 ** 32) - 1], [2 ** 40]])
def test_out_of_range_raises_the_cpu_error(bad):
    # int64 values beyond int32 must not alias a valid row through their low word
    x, idx = torch.randn(7, 3), torch.tensor(bad)
    with pytest.raises(IndexError) as cpu:
        x[idx]
    with pytest.raises(IndexError) as dev:
        to_n(x)[to_n(idx)]
    assert str(dev.value) == str(cpu.value)


def test_out_of_range_in_a_later_dim_raises(strict):
    # (1, 7) would be row 1 * 7 + 7 = 14, a valid flat row of the 2 x 7 table: each dim is checked on its own
    x = torch.randn(3, 7)
    with pytest.raises(IndexError):
        to_n(x)[to_n(torch.tensor([1])), to_n(torch.tensor([7]))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_put_is_two_launches(dtype, strict):
    x = _data((50, 4), dtype)
    idx, v = torch.tensor([4, -1, 20]), _data((3, 4), dtype)
    want = x.clone()
    want[idx] = v
    nx = to_n(x)
    _, names = _names(lambda: nx.index_put_((to_n(idx),), to_n(v)))
    assert names == ["index_rows", "scatter_rows"]
    assert torch.equal(nx.cpu(), want)


def test_index_put_broadcast_values_and_two_dims(strict):
    x = torch.randn(6, 5, 3)
    i, j = torch.tensor([0, 5, -2]), torch.tensor([4, 0, 1], dtype=torch.int32)
    want, nx = x.clone(), to_n(x)
    want[i, j] = torch.tensor([1.0, 2.0, 3.0])
    nx[to_n(i), to_n(j)] = to_n(torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(nx.cpu(), want)


def test_index_put_out_of_range_leaves_the_target_unchanged():
    x = torch.randn(6, 2)
    nx = to_n(x)
    with pytest.raises(IndexError):
        nx[to_n(torch.tensor([0, 6]))] = to_n(torch.ones(2, 2))   # the first row is valid: still nothing written
    assert torch.equal(nx.cpu(), x)


def test_kernel_rows_and_flags():
    table = torch.arange(24.0).reshape(12, 2)
    i0, i1 = torch.tensor([0, -1, 2]), torch.tensor([3, 0, -4], dtype=torch.int32)
    rows = index_rows(table, i0.view(torch.int32), i1, sizes=(3, 4), wide=(True, False), gather=False)
    assert rows.tolist() == [3, 8, 8]
    got = index_rows(table, i0.view(torch.int32), i1, sizes=(3, 4), wide=(True, False))
    assert torch.equal(got, table[torch.tensor([3, 8, 8])])


def test_indices_that_do_not_broadcast_raise_the_cpu_error():
    x, key = torch.randn(4, 5), (torch.tensor([0, 1]), torch.tensor([0, 1, 2]))
    with pytest.raises(IndexError) as cpu:
        x[key]
    with pytest.raises(IndexError) as dev:
        to_n(x)[tuple(to_n(k) for k in key)]
    assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_by_a_mask_is_two_launches(dtype, strict):
    # the mask scanned on the device, the count read by the host (one sync, as on CUDA), rows moved by rank
    x = _data((200, 3), dtype)
    mask = torch.rand(200) > 0.6
    got, names = _names(lambda: to_n(x)[to_n(mask)])
    assert names == ["scan_rows", "mask_rows"]
    assert got.dtype == dtype and torch.equal(got.cpu(), x[mask])


@pytest.mark.parametrize("fill", [None, False, True])
def test_masks_over_leading_dims_and_empty_or_full_selections(fill, strict):
    x = torch.randn(6, 7, 2)
    mask = torch.rand(6, 7) > 0.5 if fill is None else torch.full((6, 7), fill)
    assert torch.equal(to_n(x)[to_n(mask)].cpu(), x[mask])
    m1 = torch.rand(6) > 0.5
    assert torch.equal(to_n(x)[to_n(m1)].cpu(), x[m1])


def test_mask_of_the_wrong_shape_raises_the_cpu_error():
    x, mask = torch.randn(4, 5), torch.ones(5, dtype=torch.bool)
    with pytest.raises(IndexError) as cpu:
        x[mask]
    with pytest.raises(IndexError) as dev:
        to_n(x)[to_n(mask)]
    assert str(dev.value) == str(cpu.value)
