"""The runtime: neuron devices and their simulated cores, kernel launch on streams, and
profiler records.

    from torchneuron.runtime import launch, profiler
    rec = launch(program, {"a": a, "b": b, "out": out})   # neuron tensors, zero copy
    rec.device_time_ns, rec.end_ns - rec.start_ns          # kernel time; stream time incl. overhead
"""
from torchneuron.runtime.device import core, device_index, host_memory
from torchneuron.runtime.record import InstructionEvent, LaunchRecord
from torchneuron.runtime import profiler
from torchneuron.runtime.launch import launch, timing_only

__all__ = ["core", "device_index", "host_memory", "InstructionEvent", "LaunchRecord", "profiler", "launch", "timing_only"]
