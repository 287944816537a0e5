"""The NeuronCore hardware model: chip specs, numerics, memories, the instruction set, the core,
programs and the timing model."""
from torchneuron.sim.specs import CHIPS, ChipSpec, chip_spec
from torchneuron.sim.instruction import CostInputs, Engine, Footprint, Instruction
from torchneuron.sim.memory import AP, IndexOutOfRange, Memory, Region, SimulatorError, tile
from torchneuron.sim import isa, numerics
from torchneuron.sim.isa import OPCODES
from torchneuron.sim.program import ArgSlot, Program
from torchneuron.sim.core import NeuronCore, RunReport

__all__ = ["CHIPS", "ChipSpec", "chip_spec", "CostInputs", "Engine", "Footprint", "Instruction", "AP", "Memory",
           "Region", "SimulatorError", "IndexOutOfRange", "tile", "isa", "numerics", "OPCODES", "ArgSlot", "Program", "NeuronCore",
           "RunReport"]
