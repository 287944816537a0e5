"""torch.optim optimizers on neuron against the CPU, driven by PyTorch's OptimizerInfo database (``optim_db``).

For every OptimizerInfo and each of its inputs (the keyword sets ``optim_inputs_func`` gives for the CPU,
plus ``foreach=True`` and ``fused=True`` where the optimizer has those implementations), a small model is
trained three steps on both devices from the same weights; after every step the parameters, and at the
end the optimizer state (moments, step counts), must match the CPU. The model is a Linear-Tanh-Linear MLP,
without biases for Muon (2-D parameters only), and an ``Embedding(sparse=True)`` for SparseAdam.
No step may take the CPU fallback, except SparseAdam's sparse ops (every sparse op does, by design).
Error inputs raise the exception type the database names, with the parameters on neuron.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

import torchneuron

warnings.filterwarnings("ignore", message=r".*has no neuron kernel yet.*")
OPTIMIZERS = {o.name: o for o in optim_db}
TOL = {"atol": 1e-5, "rtol": 1e-5}
LOOSE = {
    # 20 inner iterations and a line search per step amplify rounding: on the CPU alone, float32 and
    # float64 runs end 1.4e-3 apart after three steps
    "LBFGS": {"atol": 2e-3, "rtol": 5e-2},
    # Newton-Schulz iterations in bfloat16: a matmul summing in another order rounds some elements
    # one bf16 ulp apart (0.4%), and five cubic iterations grow that
    "Muon": {"atol": 1e-3, "rtol": 5e-2},
}
# LBFGS's curvature state (H_diag, the direction history) is ill-conditioned by construction: float32
# and float64 runs on the CPU alone give H_diags apart by 4x after three steps, so only its
# parameters are compared
NO_STATE_CHECK = {"LBFGS"}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "SparseAdam":
        return torch.nn.Embedding(10, 3, sparse=True)
    bias = name != "Muon"
    return torch.nn.Sequential(torch.nn.Linear(4, 5, bias=bias), torch.nn.Tanh(), torch.nn.Linear(5, 2, bias=bias))


def _on_neuron(value):
    return value.to("neuron") if isinstance(value, torch.Tensor) else value


def _variants(info) -> list[tuple[str, dict]]:
    """(description, kwargs) of every input to run: the database's, then foreach and fused."""
    inputs = info.optim_inputs_func(device="cpu", dtype=torch.float32)
    out = [(i.desc, dict(i.kwargs)) for i in inputs]
    base = dict(inputs[0].kwargs) if inputs else {}
    for impl in ("foreach", "fused"):
        if impl in info.supported_impls:
            out.append((impl, {**base, impl: True}))
    return out


def _train(name: str, model: torch.nn.Module, optimizer, x: torch.Tensor) -> None:
    def closure():
        optimizer.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss
    if name == "LBFGS":
        optimizer.step(closure)
    else:
        closure()
        optimizer.step()


def _state_tensors(optimizer) -> list[tuple[str, torch.Tensor]]:
    return [(f"{i}.{k}", v) for i, st in optimizer.state_dict()["state"].items() for k, v in sorted(st.items())
            if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_cpu(name):
    info = OPTIMIZERS[name]
    tol = LOOSE.get(name, TOL)
    torchneuron.reset_fallback_counts()
    for desc, kwargs in _variants(info):
        cpu = _model(name)
        dev = copy.deepcopy(cpu).to("neuron")
        opt_cpu = info.optim_cls(cpu.parameters(), **kwargs)
        opt_dev = info.optim_cls(dev.parameters(), **{k: _on_neuron(v) for k, v in kwargs.items()})
        x = torch.randint(0, 10, (6,)) if name == "SparseAdam" else torch.randn(8, 4)
        for step in range(3):
            _train(name, cpu, opt_cpu, x)
            _train(name, dev, opt_dev, x.to("neuron"))
            for (pname, a), b in zip(cpu.named_parameters(), dev.parameters()):
                assert b.device.type == "neuron"
                torch.testing.assert_close(b.detach().cpu(), a.detach(), **tol,
                                           msg=lambda m: f"{desc}, step {step}, {pname}: {m}")
        if name in NO_STATE_CHECK:
            continue
        state_cpu, state_dev = _state_tensors(opt_cpu), _state_tensors(opt_dev)
        assert [k for k, _ in state_cpu] == [k for k, _ in state_dev]
        for (key, a), (_, b) in zip(state_cpu, state_dev):
            torch.testing.assert_close(b.cpu(), a, **tol, msg=lambda m: f"{desc}, state {key}: {m}")
    if name != "SparseAdam":
        assert not torchneuron.fallback_counts(), f"CPU fallbacks: {dict(torchneuron.fallback_counts())}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_error_inputs_raise_like_cpu(name):
    info = OPTIMIZERS[name]
    checked = 0
    for case in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        spec = case.optimizer_error_input
        params = spec.params
        tensors = [p for p in params if isinstance(p, torch.Tensor)] if isinstance(params, list) else []
        if any(t.is_complex() for t in tensors):
            continue                                  # complex tensors never live on neuron
        if tensors and len(tensors) == len(params):
            moved: dict[int, torch.Tensor] = {}       # a parameter listed twice stays one tensor
            for t in tensors:
                if id(t) not in moved:
                    moved[id(t)] = t.detach().to("neuron").requires_grad_(t.requires_grad)
                    moved[id(t)].grad = None if t.grad is None else t.grad.to("neuron")
            params = [moved[id(t)] for t in tensors]
        expect = pytest.warns if issubclass(case.error_type, Warning) else pytest.raises
        with expect(case.error_type):
            optimizer = info.optim_cls(params, **spec.kwargs)
            if case.error_on == OptimizerErrorEnum.STEP_ERROR:
                optimizer.step()
        checked += 1
    assert checked
