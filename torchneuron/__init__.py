"""TorchNeuron: AWS NeuronCore as a PyTorch device, on a built-in NeuronCore simulator.

``import torch`` registers the ``neuron`` device through the ``torch.backends`` entry
point; ``import torchneuron`` does the same explicitly.
"""


def _autoload() -> None:
    """Entry point run by ``import torch``: importing this package registers the device."""


# Defined before ``import torch`` so that ``import torchneuron`` first, which imports
# torch, which runs the entry point, finds _autoload on the half-imported package.
import torch  # noqa: E402

from torchneuron import _C  # noqa: E402  (registers allocator, guard, hooks, core ops)
from torchneuron.config import CONFIG  # noqa: E402


def _register() -> None:
    if torch._C._get_privateuse1_backend_name() == "neuron":
        return
    _C._configure(CONFIG.num_devices, CONFIG.chip.hbm_bytes_per_core)
    _C._set_strict(CONFIG.strict)
    # Backward of neuron ops runs on the thread that calls backward(), not on autograd's device
    # thread: that thread frees Python-owned tensors after backward() has returned, so a program
    # ending right after backward() could abort ("terminate called without an active exception")
    # when the free met the interpreter's shutdown. The device's launches are serialized by its
    # core lock, so a device thread gained no overlap. Thread-local: set for the importing thread.
    torch.autograd.set_multithreading_enabled(False)
    torch.utils.rename_privateuse1_backend("neuron")
    from torchneuron import neuron as device_module

    torch._register_device_module("neuron", device_module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=False, for_packed_sequence=True, for_storage=True)
    from torchneuron import _encoder_fast_path, _module_conversion, _printing

    _module_conversion.install()
    _printing.install()
    _encoder_fast_path.install()
    from torchneuron import ops  # noqa: F401  (the eager ATen kernels register on import)
    from torchneuron.compiler.backend import install_default_backend, skip_device_frames

    install_default_backend()  # torch.compile's default backend runs neuron graphs through ours
    skip_device_frames()       # and TorchDynamo never traces the eager kernels or the simulator
    from torchneuron import distributed

    distributed.register()  # the `neuron` torch.distributed backend


_register()

from torchneuron.fallback import fallback_counts, is_strict, reset_fallback_counts, set_strict  # noqa: E402

__version__ = "0.1.0"
__all__ = ["CONFIG", "fallback_counts", "is_strict", "reset_fallback_counts", "set_strict"]
