"""Sparse tensors on neuron: COO and CSR tensors live on the device (indices and values are
neuron tensors) and every sparse op runs through the counted CPU fallback, matching the CPU."""
import warnings

import pytest
import torch

import torchneuron

warnings.filterwarnings("ignore", message=".*has no neuron kernel.*")
warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
DENSE = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -3.0]])


def test_coo_tensor_lives_on_the_device():
    s = DENSE.to("neuron").to_sparse()
    assert s.layout == torch.sparse_coo and s.device.type == "neuron"
    assert s._indices().device.type == "neuron" and s._values().device.type == "neuron"
    assert s._nnz() == 3 and s.sparse_dim() == 2 and s.dense_dim() == 0
    torch.testing.assert_close(s.cpu().to_dense(), DENSE)
    made = torch.sparse_coo_tensor(torch.tensor([[0, 1], [2, 0]]), torch.tensor([4.0, 5.0]), (2, 3)).to("neuron")
    torch.testing.assert_close(made.to_dense().cpu(), made.cpu().to_dense())


def test_sparse_ops_fall_back_and_match_cpu():
    torchneuron.reset_fallback_counts()
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    csr = DENSE.to_sparse_csr()
    got = torch.sparse.sampled_addmm(csr.to("neuron"), a.to("neuron") @ torch.ones(3, 3, device="neuron"),
                                     torch.ones(3, 3, device="neuron"))
    want = torch.sparse.sampled_addmm(csr, a @ torch.ones(3, 3), torch.ones(3, 3))
    assert got.layout == torch.sparse_csr and got.device.type == "neuron"
    torch.testing.assert_close(got.cpu().to_dense(), want.to_dense())
    coo = DENSE.to_sparse()
    torch.testing.assert_close(torch.sparse.mm(coo.to("neuron"), b.to("neuron")).cpu(), torch.sparse.mm(coo, b))
    assert sum(torchneuron.fallback_counts().values()) > 0


def test_sparse_ops_are_refused_in_strict_mode_and_in_place_is_refused():
    s = DENSE.to("neuron").to_sparse()
    torchneuron.set_strict(True)
    try:
        with pytest.raises(NotImplementedError, match="STRICT"):
            torch.sparse.mm(s, torch.ones(3, 2, device="neuron"))
    finally:
        torchneuron.set_strict(False)
    with pytest.raises(NotImplementedError, match="in-place and out="):
        s.mul_(2)
