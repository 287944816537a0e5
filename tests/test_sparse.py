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


def test_sparse_ops_are_refused_in_strict_mode():
    s = DENSE.to("neuron").to_sparse()
    torchneuron.set_strict(True)
    try:
        with pytest.raises(NotImplementedError, match="STRICT"):
            torch.sparse.mm(s, torch.ones(3, 2, device="neuron"))
    finally:
        torchneuron.set_strict(False)


def test_in_place_and_out_variants_write_into_the_device_tensors():
    s, d = DENSE.to_sparse(), torch.randn(2, 3)
    sn, dn = s.to("neuron"), d.to("neuron")
    assert dn.add_(sn) is dn and dn.device.type == "neuron"            # dense += sparse (SparseAdam)
    torch.testing.assert_close(dn.cpu(), d.add_(s))
    c = sn.clone()
    assert c.mul_(2) is c and c._values().device.type == "neuron"
    torch.testing.assert_close(c.to_dense().cpu(), 2 * DENSE)
    torch.testing.assert_close(sn.to_dense().cpu(), DENSE)              # the clone was a copy
    out = torch.zeros(2, 3).to_sparse().to("neuron")
    assert torch.add(sn, sn, out=out) is out and out._indices().device.type == "neuron"
    torch.testing.assert_close(out.to_dense().cpu(), torch.add(s, s).to_dense())
    dense_out = torch.empty(0, device="neuron")                          # resized like on the CPU
    torch.add(torch.ones(2, 3, device="neuron"), sn, out=dense_out)
    torch.testing.assert_close(dense_out.cpu(), torch.add(torch.ones(2, 3), s))
    t = torch.empty((2, 3), layout=torch.sparse_coo, device="neuron")
    t.copy_(s)                                                           # sparse copy_ across devices
    torch.testing.assert_close(t.to_dense().cpu(), DENSE)


def test_in_place_into_compressed_layouts_is_refused_cleanly():
    c = DENSE.to_sparse_csr().to("neuron")
    with pytest.raises((NotImplementedError, RuntimeError)):
        c.mul_(2)
    torch.testing.assert_close(c.to_dense().cpu(), DENSE)                # unchanged
    torch.testing.assert_close(c.clone().to_dense().cpu(), DENSE)


@pytest.mark.parametrize("optimizer", ["SparseAdam", "SGD", "Adagrad"])
def test_sparse_embedding_gradients_train_like_cpu(optimizer):
    torch.manual_seed(0)
    cpu = torch.nn.Embedding(10, 3, sparse=True)
    dev = torch.nn.Embedding(10, 3, sparse=True).to("neuron")
    dev.weight.data.copy_(cpu.weight.data)
    opts = [getattr(torch.optim, optimizer)(m.parameters(), lr=0.1) for m in (cpu, dev)]
    idx = torch.tensor([1, 4, 4, 7])
    for _ in range(3):
        for m, opt, i in ((cpu, opts[0], idx), (dev, opts[1], idx.to("neuron"))):
            opt.zero_grad()
            m(i).pow(2).sum().backward()
            opt.step()
    assert dev.weight.grad.is_sparse and dev.weight.grad.device.type == "neuron"
    torch.testing.assert_close(dev.weight.detach().cpu(), cpu.weight.detach())


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
def test_sparse_mm_reduce_gradients_match_cpu(reduce):
    """``torch.sparse.mm(csr, dense, reduce)`` falls back with its dense operand's ``requires_grad`` kept on the
    CPU copy: the CPU kernel returns the amax/amin positions only then, and their backward indexed an empty
    tensor (a crash) when the copy lost it."""
    torch.manual_seed(0)
    a = torch.randn(6, 5).relu().to_sparse_csr()
    b = torch.randn(5, 3)
    grads = []
    for device in ("cpu", "neuron"):
        x = b.clone().to(device).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = torch.sparse.mm(a.to(device), x, reduce)
            (y * torch.arange(3.0, device=device)).sum().backward()
        grads.append((y.detach().cpu(), x.grad.cpu()))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])
