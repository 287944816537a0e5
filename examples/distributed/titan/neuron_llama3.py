"""TorchTitan's llama3 debug model, configured to train on this machine (``--module neuron_llama3``).

``llama3_debugmodel`` with the overrides TorchTitan needs here: rotary embeddings from cos/sin
tables instead of complex numbers (neuron has no complex dtypes; without the long-context
"llama" frequency scaling, which only the complex form implements); causal SDPA attention
(torch's FlexAttention refuses devices other than CUDA/CPU/HPU/MPS, so attention spans the
packed documents of a sequence instead of stopping at their boundaries); a short sequence
and small batch (every op runs on the simulated core), no activation checkpointing,
validation or checkpoint saving, fp32 parameters in FSDP2 (so the neuron and the CPU run
compute the same thing; ``--training.mixed-precision-param bfloat16`` turns bf16 back on),
and the offline tokenizer and text that ``titan_llama3.py`` writes into ``--hf-assets-path``
and ``--dataloader.dataset-path``.
"""
from __future__ import annotations

import os
import sys
import types

import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.validate import Validator
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.rope import CosSinRoPE
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

if not hasattr(dist, "set_timeout"):
    # TorchTitan 0.3.0 calls torch.distributed.set_timeout after the first step, an API newer than
    # torch 2.13, whose equivalent is the private _set_pg_timeout.
    dist.set_timeout = dist.distributed_c10d._set_pg_timeout


def _cpu_device_module() -> types.SimpleNamespace:
    """What TorchTitan calls on its device module, for a run on CPU ranks (the reference run)."""
    properties = types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return types.SimpleNamespace(
        current_device=lambda: 0, set_device=lambda device: None, device_count=lambda: 1,
        synchronize=lambda device=None: None, get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: properties, memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None)


if os.environ.get("TITAN_ON_CPU") == "1":
    # The reference run, on CPU ranks (started with TORCH_DEVICE_BACKEND_AUTOLOAD=0, so no
    # accelerator): TorchTitan would fall back to "cuda", so the modules that copied its device
    # type and module at import are pointed at the CPU. FSDP2 reduces TorchTitan's gradients with
    # PREMUL_SUM, which stock Gloo refuses: CPU tensors go to the `neuron` backend, which hands
    # them straight to Gloo, premultiplying for PREMUL_SUM as NCCL defines it.
    module = _cpu_device_module()
    for name, loaded in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(loaded, "device_type", None) == "cuda":
            loaded.device_type = "cpu"
            if hasattr(loaded, "device_module"):
                loaded.device_module = module
    import torchneuron.distributed  # noqa: F401  (registers the backend)

    dist.Backend.default_device_backend_map["cpu"] = "neuron"


def llama3_debugmodel_neuron() -> Trainer.Config:
    """The debug model (6 layers, width 256, vocab 2048) at sequence 64, batch 2, 10 steps."""
    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:
        # rotary embedding on cos/sin tables: neuron has no complex dtypes (ComplexRoPE's)
        rope = layer.attention.rope
        layer.attention.rope = CosSinRoPE.Config(dim=rope.dim, max_seq_len=2048, theta=rope.theta, scaling="none")
        # causal SDPA (TorchTitan's maskless backend): FlexAttention accepts CUDA/CPU/HPU/MPS tensors only
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.training.steps = 10
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint = None
    config.validator = Validator.Config(enable=False)
    config.checkpoint = CheckpointManager.Config(enable=False)
    # TorchTitan's default "spmd_types" path stops in fully_shard ("all parameters must be DTensors
    # on the full SPMD mesh"); "partial_dtensor" uses DTensor for the model-parallel axes only
    config.parallelism.spmd_backend = "partial_dtensor"
    config.metrics.enable_tensorboard = False
    return config
