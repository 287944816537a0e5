"""The NeuronCore instruction set: one frozen dataclass per ``nki.isa`` instruction, a module per engine.

Names, argument names and engines follow ``nki.isa`` (``reference/nki-api.md`` section 7.3).
Each instruction states its limits in ``check`` (run at construction, so a kernel fails
where it builds the bad instruction), runs functionally in ``execute(core)`` on torch CPU
tensors, and describes itself to the timing model through the ``Instruction`` protocol of
``instruction.py``: ``engine``, ``queue``, ``reads()``, ``writes()`` and ``cost_inputs()``.

Operands are ``AP`` access patterns; "(P,1) operand" means a tile with the data's partition
count and one element per partition, broadcast along the free dims. Scalars are Python
numbers. ALU operators and activation functions are named as in ``nki.language``
(``"add"``, ``"maximum"``, ``"exp"``, ``"gelu_apprx_tanh"``...); numpy/legacy aliases such as
``np.max`` or ``"max"`` are accepted and stored canonically.

Modules: ``common`` (limits, the ``Instr`` base class, operand loading and step planning), ``dma``,
``tensor_engine``, ``vector_engine``, ``scalar_engine``, ``gpsimd_engine``, ``mx`` (the NC-v4
microscaling pair), ``selection`` (predicated copies, selects, segment bounds, nonzero indices,
match-and-replace), ``movement`` (on-chip shuffles and gathers without DMA) and ``control`` (registers and
dynamic loops). ``OPCODES`` maps every ``nki.isa`` name to its class (program deserialization and
the kernel language look classes up there).
"""
from torchneuron.sim.isa.common import (BN_STATS_FMAX, COMPARE_OPS, DGE_MODES, FMAX_PSUM, FMAX_SBUF,
                                        GEMM_MOVING_FMAX, GEMM_STATIONARY_FMAX, MATMUL_DTYPES, MAX8_FMAX, MAX8_FMIN,
                                        OOB_MODES, PSUM_BANK_BYTES, REDUCE_CMDS, TENSOR_TRANSPOSE_MAX,
                                        VECTOR_TRANSPOSE_MAX, Instr, Operand, Scalar, Step)
from torchneuron.sim.isa.control import (LoopBegin, LoopEnd, RegisterLoad, RegisterMove, RegisterStore, WhileBegin,
                                         WhileEnd)
from torchneuron.sim.isa.dma import DevicePrint, DmaCompute, DmaCopy, DmaCopyDynamic, DmaTranspose, dma_modes
from torchneuron.sim.isa.gpsimd_engine import (AffineSelect, Dropout, Iota, Memset, Rand2, RandGetState, RandSetState, Rng,
                                              SetRngSeed)
from torchneuron.sim.isa.mx import MX_FORMATS, MX_GROUP_PARTITIONS, NcMatmulMx, QuantizeMx, mx_scales, mx_unpack
from torchneuron.sim.isa.movement import LocalGather, NcNGather, NcStreamShuffle
from torchneuron.sim.isa.scalar_engine import Activate2, Activation
from torchneuron.sim.isa.selection import (NcMatchReplace8, NonzeroWithCount, RangeSelect, SelectReduce, SequenceBounds,
                                           TensorCopyPredicated, TopK)
from torchneuron.sim.isa.tensor_engine import (FP8, PE_COLS, PE_ROWS, PE_TILE_SIZES, PERF_MODES, NcMatmul,
                                               NcMatmulTiled, NcTranspose)
from torchneuron.sim.isa.vector_engine import (BnAggr, BnStats, Exponential, Max8, NcFindIndex8, Reciprocal,
                                               ScalarTensorTensor, TensorCopy, TensorPartitionReduce, TensorReduce,
                                               TensorScalar, TensorScalarCumulative, TensorScalarReduce, TensorTensor,
                                               TensorTensorScan)

# The instruction set, by nki.isa name (serialization and the kernel language look classes up here).
OPCODES: dict[str, type[Instr]] = {cls.opcode: cls for cls in (
    DmaCopy, DmaTranspose, DmaCopyDynamic, NcMatmul, NcMatmulTiled, NcTranspose, QuantizeMx, NcMatmulMx, TensorCopy,
    TensorTensor, TensorScalar, ScalarTensorTensor, Reciprocal, Activation, TensorReduce, TensorPartitionReduce,
    TensorScalarReduce, TensorTensorScan, Iota, Memset, AffineSelect, BnStats, BnAggr, Max8, NcFindIndex8, Rng,
    SetRngSeed, Rand2, Dropout, TensorCopyPredicated, SelectReduce, RangeSelect, SequenceBounds, NonzeroWithCount,
    NcMatchReplace8, NcStreamShuffle, NcNGather, LocalGather, TensorScalarCumulative, Exponential, Activate2,
    DmaCompute, DevicePrint, RegisterMove, RegisterLoad, RegisterStore, LoopBegin, LoopEnd, WhileBegin, WhileEnd,
    RandGetState, RandSetState, TopK)}

# nki.isa-style lowercase aliases: isa.nc_matmul(dst=..., stationary=..., moving=...) builds the instruction
dma_copy, dma_transpose, dma_copy_dynamic = DmaCopy, DmaTranspose, DmaCopyDynamic
nc_matmul, nc_matmul_tiled, nc_transpose, quantize_mx, nc_matmul_mx = (NcMatmul, NcMatmulTiled, NcTranspose, QuantizeMx,
                                                                       NcMatmulMx)
tensor_copy, tensor_tensor, tensor_scalar = TensorCopy, TensorTensor, TensorScalar
scalar_tensor_tensor, reciprocal, activation = ScalarTensorTensor, Reciprocal, Activation
tensor_reduce, tensor_partition_reduce, tensor_scalar_reduce = TensorReduce, TensorPartitionReduce, TensorScalarReduce
tensor_tensor_scan, iota, memset, affine_select = TensorTensorScan, Iota, Memset, AffineSelect
bn_stats, bn_aggr, max8, nc_find_index8 = BnStats, BnAggr, Max8, NcFindIndex8
rng, set_rng_seed, rand2, dropout = Rng, SetRngSeed, Rand2, Dropout
tensor_copy_predicated, select_reduce, range_select = TensorCopyPredicated, SelectReduce, RangeSelect
sequence_bounds, nonzero_with_count, nc_match_replace8 = SequenceBounds, NonzeroWithCount, NcMatchReplace8
nc_stream_shuffle, nc_n_gather, local_gather = NcStreamShuffle, NcNGather, LocalGather
tensor_scalar_cumulative, exponential, activate2, dma_compute = (TensorScalarCumulative, Exponential, Activate2,
                                                                 DmaCompute)
device_print = DevicePrint
register_move, register_load, register_store = RegisterMove, RegisterLoad, RegisterStore
loop_begin, loop_end, while_begin, while_end = LoopBegin, LoopEnd, WhileBegin, WhileEnd
rand_get_state, rand_set_state, topk = RandGetState, RandSetState, TopK

__all__ = [n for n in dir() if not n.startswith("_")]
