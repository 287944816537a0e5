"""The ``torch.neuron`` device module, device placement, views, Module conversion and errors.

Every figure is checked against a reference: the chip spec table, PyTorch on the CPU,
or the environment the process was started with.
"""
from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import torchneuron  # noqa: F401  (registers the device even with autoload disabled)
from torchneuron.sim.specs import CHIPS

pytestmark = pytest.mark.filterwarnings("ignore:The operator .* has no neuron kernel")

CHIP = CHIPS[os.environ.get("TORCHNEURON_CHIP", "trn2").strip().lower()]
EXPECTED_COUNT = int(os.environ.get("TORCHNEURON_NUM_DEVICES", "").strip() or CHIP.cores_per_chip)
needs_two = pytest.mark.skipif(EXPECTED_COUNT < 2, reason="needs two neuron devices")


@pytest.fixture(autouse=True)
def _restore_current_device():
    previous = torch.neuron.current_device()
    torch.neuron.set_device(0)  # each test starts from the default device of a fresh process
    yield
    torch.neuron.set_device(previous)


@pytest.fixture
def no_gc():
    """Exact allocator accounting: free earlier garbage now and let no collection run mid-test."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _alloc_state() -> list[tuple[int, int]]:
    return [(torch.neuron.memory_allocated(i), torch.neuron.memory_reserved(i))
            for i in range(torch.neuron.device_count())]


# ---- the device module -------------------------------------------------------------

def test_registered_device_module():
    assert torch._C._get_privateuse1_backend_name() == "neuron"
    assert torch.get_device_module("neuron") is torch.neuron
    assert torch.neuron.is_available() is True


def test_device_count_matches_environment_or_spec():
    assert torch.neuron.device_count() == EXPECTED_COUNT


def test_current_device_and_set_device():
    assert torch.neuron.current_device() == 0
    last = torch.neuron.device_count() - 1
    torch.neuron.set_device(last)
    assert torch.neuron.current_device() == last
    assert torch.ones(2, device="neuron").device == torch.device("neuron", last)
    torch.neuron.set_device(torch.device("neuron", 0))
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device(f"neuron:{last}")
    assert torch.neuron.current_device() == last


@needs_two
def test_device_context_manager_restores_previous():
    assert torch.neuron.current_device() == 0
    with torch.neuron.device(1):
        assert torch.neuron.current_device() == 1
        assert torch.empty(3, device="neuron").device == torch.device("neuron:1")
        with torch.neuron.device("neuron:0"):
            assert torch.neuron.current_device() == 0
        assert torch.neuron.current_device() == 1
    assert torch.neuron.current_device() == 0
    # Restored on an exception too.
    with pytest.raises(KeyError):
        with torch.neuron.device(torch.device("neuron", 1)):
            raise KeyError("boom")
    assert torch.neuron.current_device() == 0
    # None is a no-op.
    with torch.neuron.device(None):
        assert torch.neuron.current_device() == 0


@needs_two
def test_explicit_index_places_tensor_on_that_device(no_gc):
    before = [torch.neuron.memory_allocated(i) for i in (0, 1)]
    t = torch.ones(1000, device=torch.device("neuron:1"))  # 4000 bytes -> 4096
    assert t.device == torch.device("neuron", 1)
    assert t.get_device() == 1
    assert t.untyped_storage().device == torch.device("neuron", 1)
    assert torch.neuron.memory_allocated(1) - before[1] == 4096
    assert torch.neuron.memory_allocated(0) == before[0]
    assert torch.neuron.current_device() == 0
    torch.testing.assert_close(t.cpu(), torch.ones(1000))
    # Copy between devices.
    u = t.to("neuron:0")
    assert u.device == torch.device("neuron:0")
    torch.testing.assert_close(u.cpu(), torch.ones(1000))


@needs_two
def test_factory_through_fallback_places_storage_on_indexed_device(no_gc):
    before = [torch.neuron.memory_allocated(i) for i in (0, 1)]
    t = torch.arange(8.0, device="neuron:1")
    assert t.device == torch.device("neuron:1")
    torch.testing.assert_close(t.cpu(), torch.arange(8.0))
    assert t.untyped_storage().device == torch.device("neuron:1")
    assert torch.neuron.memory_allocated(1) - before[1] == 512
    assert torch.neuron.memory_allocated(0) == before[0]


@needs_two
def test_out_argument_resized_on_its_own_device():
    a = torch.ones(4, device="neuron:1")
    out = torch.empty(0, device="neuron:1")
    torch.add(a, a, out=out)
    torch.testing.assert_close(out.cpu(), torch.full((4,), 2.0))
    assert out.untyped_storage().device == torch.device("neuron:1")


def test_get_device_properties_from_spec_table():
    props = torch.neuron.get_device_properties()
    assert props.total_memory == CHIP.hbm_bytes_per_chip // CHIP.cores_per_chip
    assert props.chip == CHIP.name
    assert props.core_generation == CHIP.core_generation
    assert props.cores_per_chip == CHIP.cores_per_chip
    assert CHIP.name in props.name and CHIP.core_generation in props.name
    last = torch.neuron.device_count() - 1
    for dev in (last, f"neuron:{last}", torch.device("neuron", last)):
        assert torch.neuron.get_device_properties(dev).total_memory == CHIP.hbm_bytes_per_core
    assert torch.neuron.get_device_name() == props.name
    assert torch.neuron.get_device_name(0) == f"{CHIP.core_generation} ({CHIP.name})"


def test_is_bf16_supported_and_bf16_tensors():
    assert torch.neuron.is_bf16_supported() is True
    x = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    y = x.to("neuron")
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.cpu(), x)


# ---- Tensor / Module / storage helpers --------------------------------------------------

def test_tensor_neuron_and_is_neuron():
    x = torch.arange(6.0).reshape(2, 3)
    assert x.is_neuron is False
    y = x.neuron()
    assert y.is_neuron is True
    assert y.device == torch.device("neuron", 0)
    assert torch.equal(y.cpu(), x)
    last = torch.neuron.device_count() - 1
    assert x.neuron(last).device == torch.device("neuron", last)
    assert x.neuron(f"neuron:{last}").device == torch.device("neuron", last)
    assert y.neuron() is y  # already there: no copy, like .cuda()


def test_module_neuron_returns_self_and_moves_everything():
    m = nn.BatchNorm1d(3)
    assert m.neuron() is m
    for t in list(m.parameters()) + list(m.buffers()):
        assert t.device == torch.device("neuron", 0)
    last = torch.neuron.device_count() - 1
    m.neuron(last)
    assert all(p.device == torch.device("neuron", last) for p in m.parameters())


def test_storage_neuron_and_is_neuron():
    cpu_storage = torch.arange(4, dtype=torch.float32).untyped_storage()
    assert cpu_storage.is_neuron is False
    s = cpu_storage.neuron()
    assert s.is_neuron is True
    assert s.device == torch.device("neuron", 0)
    assert s.nbytes() == cpu_storage.nbytes()
    back = torch.empty(0).set_(s.cpu()).view(torch.float32)
    assert torch.equal(back, torch.arange(4, dtype=torch.float32))


# ---- views keep strides and storage ---------------------------------------------------

_VIEWS = {
    "t": lambda x: x.t(),
    "t_row": lambda x: x.t()[0],
    "t_col": lambda x: x.t()[:, 1],
    "slice": lambda x: x[1:, ::2],
    "narrow": lambda x: x.narrow(1, 1, 2),
    "view": lambda x: x.view(4, 3),
    "unsqueeze_expand": lambda x: x[0].unsqueeze(0).expand(5, 4),
    "as_strided": lambda x: x.as_strided((2, 3), (1, 3), 2),
    "permute_slice": lambda x: x.reshape(2, 2, 3).permute(2, 0, 1)[1:],
    "diagonal": lambda x: x.diagonal(),
}


@pytest.mark.parametrize("name", sorted(_VIEWS))
def test_views_match_cpu(name):
    make = _VIEWS[name]
    base_cpu = torch.arange(12.0).reshape(3, 4)
    base = base_cpu.to("neuron")
    v, v_cpu = make(base), make(base_cpu)
    assert v.device == base.device
    assert v.shape == v_cpu.shape
    assert v.stride() == v_cpu.stride()
    assert v.storage_offset() == v_cpu.storage_offset()
    assert v.is_contiguous() == v_cpu.is_contiguous()
    assert v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert torch.equal(v.cpu(), v_cpu)
    assert torch.equal(v.contiguous().cpu(), v_cpu.contiguous())


def test_writes_through_a_view_reach_the_base():
    base_cpu = torch.arange(12.0).reshape(3, 4)
    base = base_cpu.to("neuron")
    for b in (base, base_cpu):
        b.t()[1].fill_(-1.0)
        b[:, 3].mul_(10.0)
    assert torch.equal(base.cpu(), base_cpu)


# ---- Module.to converts in place ------------------------------------------------------------

class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx) * self.scale)


def test_module_to_keeps_parameter_objects():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    lin(torch.randn(4, 3)).sum().backward()
    weight, bias = lin.weight, lin.bias
    weight_cpu, grad_cpu = weight.detach().clone(), weight.grad.clone()
    assert lin.to("neuron") is lin
    assert lin.weight is weight and lin.bias is bias
    assert isinstance(weight, nn.Parameter) and weight.requires_grad and weight.is_leaf
    assert weight.device == torch.device("neuron", 0)
    assert torch.equal(weight.detach().cpu(), weight_cpu)
    assert weight.grad.device == torch.device("neuron", 0)
    assert torch.equal(weight.grad.cpu(), grad_cpu)
    lin.cpu()
    assert lin.weight is weight and weight.device.type == "cpu"
    assert torch.equal(weight.detach(), weight_cpu)


def test_tied_weights_stay_tied_through_to_and_cpu():
    torch.manual_seed(0)
    m = _TiedLM()
    idx = torch.tensor([[1, 2, 3]])
    expected = m(idx).detach()
    w = m.emb.weight
    m.to("neuron")
    assert m.emb.weight is w and m.head.weight is w
    assert len(list(m.parameters())) == 1
    assert m.scale.device == torch.device("neuron", 0)
    torch.testing.assert_close(m(idx.to("neuron")).detach().cpu(), expected)
    # An update through one module is seen by the other (same tensor).
    with torch.no_grad():
        m.head.weight.add_(1.0)
    assert torch.equal(m.emb.weight.detach().cpu(), m.head.weight.detach().cpu())
    m.cpu()
    assert m.emb.weight is w and m.head.weight is w and w.device.type == "cpu"
    m.neuron()
    assert m.head.weight is m.emb.weight is w and w.is_neuron


def test_lazy_module_moved_before_its_first_forward_initializes_on_neuron():
    """As on CUDA: uninitialized parameters/buffers stay uninitialized (device and dtype follow the
    move) and the first forward fills them in on the device; the result matches the CPU module."""
    from torch.nn.parameter import UninitializedBuffer, UninitializedParameter
    m = nn.Sequential(nn.LazyLinear(5), nn.LazyBatchNorm1d()).to("neuron", torch.bfloat16)
    assert isinstance(m[0].weight, UninitializedParameter) and isinstance(m[1].running_mean, UninitializedBuffer)
    assert m[0].weight.device == torch.device("neuron", 0) and m[0].weight.dtype == torch.bfloat16
    assert m[1].num_batches_tracked.dtype == torch.int64             # integer buffers keep their dtype
    x = torch.randn(4, 3)
    y = m(x.to("neuron", torch.bfloat16))
    assert type(m[0].weight) is nn.Parameter and m[0].weight.shape == (5, 3) and m[0].weight.is_neuron
    assert m[1].running_mean.shape == (5,) and m[1].running_mean.dtype == torch.bfloat16
    ref = copy.deepcopy(m).cpu()
    torch.testing.assert_close(y.cpu(), ref(x.bfloat16()), atol=2e-2, rtol=2e-2)
    back = nn.LazyLinear(2).to("neuron").cpu()
    assert isinstance(back.weight, UninitializedParameter) and back.weight.device.type == "cpu"


def test_failed_module_to_leaves_lazy_parameters_in_place():
    m = nn.LazyLinear(3)
    w = m.weight
    with pytest.raises(RuntimeError):
        m.to("neuron:99")
    assert m.weight is w and w.device.type == "cpu"


@pytest.mark.parametrize("value", [
    torch.tensor([1.5, 1e-8, 1e5]), torch.tensor([[1, 2], [3, 4]]), torch.tensor([True, False]),
    torch.tensor([0.25, -2.0]).bfloat16(), torch.tensor(2.5), torch.empty(0, 3), torch.arange(3000.0),
    torch.tensor([float("nan"), float("inf"), 1.0])])
def test_printing_formats_the_values_like_the_cpu_without_fallbacks(value):
    """The formatter's float64 inspection runs on a host copy: same text, no fallback even in strict mode."""
    torchneuron.reset_fallback_counts()
    before = torchneuron.is_strict()
    torchneuron.set_strict(True)
    try:
        text = repr(value.to("neuron"))
    finally:
        torchneuron.set_strict(before)
    assert "device='neuron:0'" in text
    def bare(t: str) -> str:          # the text without the device suffix, layout whitespace and commas
        return "".join(t.replace("device='neuron:0'", "").replace(",", " ").split())
    assert bare(text) == bare(repr(value))
    assert not torchneuron.fallback_counts()


# ---- errors leave no trace -------------------------------------------------------------

def test_out_of_range_device_index_raises(no_gc):
    n = torch.neuron.device_count()
    before = _alloc_state()
    cases = [
        lambda: torch.ones(2, device=f"neuron:{n}"),
        lambda: torch.empty(2).to(f"neuron:{n}"),
        lambda: torch.neuron.set_device(n),
        lambda: torch.neuron.get_device_properties(n),
    ]
    for case in cases:
        with pytest.raises(RuntimeError, match=f"neuron:{n}"):
            case()
        assert _alloc_state() == before
        assert torch.neuron.current_device() == 0


def test_mixing_neuron_and_cpu_tensor_raises(no_gc):
    a = torch.ones(3, 4, device="neuron")
    b = torch.ones(3, 4)
    before = _alloc_state()
    for op in (lambda: a + b, lambda: b * a, lambda: torch.mm(a, b.t()), lambda: torch.cat([a, b])):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            op()
        assert _alloc_state() == before
    # A 0-dim CPU tensor is allowed, as on CUDA.
    torch.testing.assert_close((a * torch.tensor(3.0)).cpu(), torch.full((3, 4), 3.0))


@needs_two
def test_mixing_two_neuron_devices_raises(no_gc):
    a = torch.ones(3, device="neuron:0")
    b = torch.ones(3, device="neuron:1")
    before = _alloc_state()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + b
    assert _alloc_state() == before


# ---- configuration through the environment (fresh processes) ---------------------------------

def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TORCHNEURON_")}
    environ.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)


def test_chip_trn1_from_environment():
    trn1 = CHIPS["trn1"]
    r = _run("import torch\n"
             "print(torch.neuron.device_count())\n"
             "print(torch.neuron.get_device_properties(1).total_memory)\n"
             "print(torch.neuron.mem_get_info(1)[1])\n"
             "print(torch.neuron.get_device_properties(0).chip)\n",
             TORCHNEURON_CHIP="trn1")
    assert r.returncode == 0, r.stderr
    count, total, info_total, chip = r.stdout.split()
    assert int(count) == trn1.cores_per_chip == 2
    assert int(total) == int(info_total) == trn1.hbm_bytes_per_chip // trn1.cores_per_chip
    assert chip == "trn1"


def test_unknown_chip_is_a_clear_value_error():
    r = _run("import torch\n"
             "try:\n"
             "    import torchneuron\n"
             "except ValueError as e:\n"
             "    print('ValueError:', e)\n",
             TORCHNEURON_CHIP="bogus", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ValueError:"), r.stdout + r.stderr
    assert "'bogus'" in r.stdout
    for name in CHIPS:
        assert name in r.stdout


def test_module_to_while_a_graph_holds_a_parameter():
    """LayerNorm's autograd node saves its weight, so swapping is refused; conversion still completes."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 6, bias=False))
    m[2].weight = m[0].weight
    x = torch.tensor([1, 2, 3])
    ref = m(x)                       # keeps a graph that holds LayerNorm.weight
    m.to("neuron")
    assert all(p.device.type == "neuron" for p in m.parameters())
    assert m[0].weight is m[2].weight
    torch.testing.assert_close(m(x.to("neuron")).cpu(), ref.detach())


def test_set_device_of_a_negative_index_is_a_no_op_like_cuda():
    before = torch.neuron.current_device()
    torch.neuron.set_device(-1)
    assert torch.neuron.current_device() == before
    with pytest.raises(RuntimeError, match="Invalid device index"):
        torch.neuron.set_device(torch.neuron.device_count())
    assert torch.neuron.current_device() == before


def test_set_device_needs_an_index_like_cuda():
    before = torch.neuron.current_device()
    with pytest.raises(ValueError, match="index"):
        torch.neuron.set_device("neuron")
    assert torch.neuron.current_device() == before


def test_alias_as_cpu_shares_the_device_bytes():
    """The runtime's bridge: a CPU tensor over a neuron tensor's memory, same view geometry."""
    from torchneuron import _C

    base = torch.arange(12.0).view(3, 4)
    x = base.to("neuron")
    view = x.t()[1:]
    alias = _C._alias_as_cpu(view)
    assert alias.device.type == "cpu"
    assert (alias.shape, alias.stride(), alias.storage_offset()) == (view.shape, view.stride(), view.storage_offset())
    torch.testing.assert_close(alias, base.t()[1:])
    alias.fill_(-1.0)                         # writes land in device memory
    expected = base.clone()
    expected.t()[1:] = -1.0
    torch.testing.assert_close(x.cpu(), expected)
    with pytest.raises(RuntimeError, match="neuron tensor"):
        _C._alias_as_cpu(base)
