"""The NeuronCore hardware model: chip specs now; memories, engines and timing to come."""
from torchneuron.sim.specs import CHIPS, ChipSpec, chip_spec

__all__ = ["CHIPS", "ChipSpec", "chip_spec"]
