"""nn modules on neuron against the CPU, driven by PyTorch's ModuleInfo database (``module_db``).

For every ModuleInfo, in training and in eval mode, each module input (float32; at most SAMPLES
per mode, ``TORCHNEURON_MODULE_SAMPLES=0`` runs them all):

1. the module is built on the CPU from the input's constructor arguments (a lazy module is
   materialised by one CPU forward first), copied, and the copy moved with ``.to("neuron")``;
2. the forward runs on both with the same inputs (moved by the OpInfo harness, views kept) and
   every output tensor is compared;
3. the same random gradient is back-propagated through the floating outputs on both, and the
   gradients of the inputs and of every parameter are compared; in eval mode the forward also runs
   under ``torch.no_grad()`` (the fused inference fast paths) and is compared;
4. CPU fallbacks are counted: a module may only use the ones listed in KNOWN_FALLBACKS.

Each module's error inputs (``module_error_inputs_func``) that fail in the forward must raise the
same exception type on neuron. Known failures are strict xfails in EXPECTED_FAILURES, with the reason.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch.testing._internal.common_modules import ModuleErrorEnum, module_db

import torchneuron

from .harness import _tensors, to_neuron

warnings.filterwarnings("ignore", message=r".*has no neuron kernel yet.*")
SAMPLES = int(os.environ.get("TORCHNEURON_MODULE_SAMPLES", "24")) or None
TOL = {"atol": 1e-4, "rtol": 1e-4, "equal_nan": True}

# module name -> ATen ops it may send to the CPU fallback, and why
KNOWN_FALLBACKS: dict[str, set[str]] = {}
EXPECTED_FAILURES: dict[str, str] = {}
MODULES = {m.name: m for m in module_db}


def _backward(outputs: list[torch.Tensor], grads: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
    if outputs and leaves:
        torch.autograd.backward(outputs, grads, inputs=leaves)


def _check_input(info, module_input, training: bool) -> None:
    """One module input: forward outputs, input and parameter gradients, neuron vs CPU."""
    ctor, fwd = module_input.constructor_input, module_input.forward_input
    torch.manual_seed(0)
    cpu = info.module_cls(*ctor.args, **ctor.kwargs).to(torch.float32).train(training)
    if info.is_lazy:
        with torch.no_grad():
            cpu(*fwd.args, **fwd.kwargs)
    dev = copy.deepcopy(cpu).to("neuron")
    args, kwargs = to_neuron((fwd.args, fwd.kwargs))
    torch.manual_seed(1)
    out_cpu = _tensors(cpu(*fwd.args, **fwd.kwargs))
    torch.manual_seed(1)
    out_dev = _tensors(dev(*args, **kwargs))
    assert len(out_dev) == len(out_cpu)
    for a, b in zip(out_cpu, out_dev):
        assert b.device.type == "neuron", "a module output left the device"
        torch.testing.assert_close(b.detach().cpu(), a.detach(), **TOL)
    pairs = [(a, b) for a, b in zip(out_cpu, out_dev) if a.requires_grad and a.dtype.is_floating_point]
    if not pairs:
        return
    grads = [torch.randn_like(a) for a, _ in pairs]
    leaves_cpu = [t for t in _tensors((fwd.args, fwd.kwargs)) if t.requires_grad]
    leaves_dev = [t for t in _tensors((args, kwargs)) if t.requires_grad]
    params = [(n, a, b) for (n, a), (_, b) in zip(cpu.named_parameters(), dev.named_parameters()) if a.requires_grad]
    _backward([a for a, _ in pairs], grads, leaves_cpu + [a for _, a, _ in params])
    _backward([b for _, b in pairs], [g.to("neuron") for g in grads], leaves_dev + [b for _, _, b in params])
    for a, b in zip(leaves_cpu, leaves_dev):
        if a.grad is not None:
            torch.testing.assert_close(b.grad.cpu(), a.grad, **TOL)
    for name, a, b in params:
        if a.grad is not None:
            torch.testing.assert_close(b.grad.cpu(), a.grad, **TOL, msg=lambda m: f"grad of {name}: {m}")


def _check_inference(info, module_input) -> None:
    """Eval mode without autograd (the modules' fused inference fast paths): outputs match the CPU."""
    ctor, fwd = module_input.constructor_input, module_input.forward_input
    torch.manual_seed(0)
    cpu = info.module_cls(*ctor.args, **ctor.kwargs).to(torch.float32).eval()
    with torch.no_grad():
        args_cpu, kwargs_cpu = _detached((fwd.args, fwd.kwargs))
        if info.is_lazy:
            cpu(*args_cpu, **kwargs_cpu)
        dev = copy.deepcopy(cpu).to("neuron")
        args, kwargs = to_neuron((args_cpu, kwargs_cpu))
        for a, b in zip(_tensors(cpu(*args_cpu, **kwargs_cpu)), _tensors(dev(*args, **kwargs))):
            torch.testing.assert_close(b.cpu(), a, **TOL)


def _detached(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    return obj


def _marks(name: str) -> list:
    reason = EXPECTED_FAILURES.get(name)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in MODULES])
def test_module_matches_cpu(name):
    info = MODULES[name]
    torchneuron.reset_fallback_counts()
    for training in (True, False):
        inputs = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                         training=training)
        inputs = [i for i in inputs if i.forward_input is not None][:SAMPLES]
        for module_input in inputs:
            _check_input(info, module_input, training)
            if not training:
                _check_inference(info, module_input)
    used = set(torchneuron.fallback_counts())
    assert used <= KNOWN_FALLBACKS.get(name, set()), f"{name} took the CPU fallback for {sorted(used)}"


ERRORS = [n for n, m in MODULES.items() if m.module_error_inputs_func is not None]


@pytest.mark.parametrize("name", ERRORS)
def test_module_error_inputs_raise_like_cpu(name):
    info = MODULES[name]
    cases = info.module_error_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=False,
                                          training=True)
    checked = 0
    for case in cases:
        if case.error_on != ModuleErrorEnum.FORWARD_ERROR:
            continue                                  # construction errors never reach the device
        ctor, fwd = case.module_error_input.constructor_input, case.module_error_input.forward_input
        module = info.module_cls(*ctor.args, **ctor.kwargs).to("neuron")
        args, kwargs = to_neuron((fwd.args, fwd.kwargs))
        with pytest.raises(case.error_type):
            module(*args, **kwargs)
        checked += 1
    if not checked:
        pytest.skip("only construction errors")
