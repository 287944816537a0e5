"""How much of the published NKI API ``torchneuron.nki`` implements, name by name.

The reference is the public API of the Neuron SDK (``aws-neuron/aws-neuron-sdk``, folder ``nki/api/nki/``:
``isa/__init__.py``, ``language/__init__.py``, ``collectives/__init__.py``), read at commit ``REFERENCE_COMMIT``:
every public module-level name (functions, classes, constants, dtypes) of each module. ``MISSING`` lists what we
do not have yet; every other name must exist in our module, and every listed one must still be absent (so the
list stays honest as entries land). The fraction implemented may only go up: ``FLOOR`` is the last measured one.
"""
from __future__ import annotations

import importlib

import pytest

REFERENCE_COMMIT = "81ce03ae261e12925e53437a0f690478e6366155"  # aws-neuron/aws-neuron-sdk, 2026-08-21 (NKI 0.6.0)

REFERENCE: dict[str, tuple[str, ...]] = {
    "isa": (
        # deprecated engine constants, enums, target queries and handles
        "tensor_engine", "vector_engine", "scalar_engine", "gpsimd_engine", "unknown_engine", "engine", "reduce_cmd",
        "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version", "dma_engine", "NkiInstruction", "NkiValidationError",
        "VirtualRegister", "get_nc_sub_version", "get_nc_version",
        # instructions
        "dma_copy", "tensor_copy", "memset", "tensor_copy_predicated", "nc_matmul", "nc_matmul_mx", "nc_transpose",
        "dma_transpose", "tensor_tensor", "tensor_scalar", "tensor_reduce", "tensor_partition_reduce",
        "tensor_scalar_cumulative", "activation", "activation_reduce", "activate2", "iota", "affine_select",
        "local_gather", "nc_n_gather", "bn_stats", "bn_aggr", "tensor_tensor_scan", "nc_stream_shuffle", "rng",
        "dropout", "set_rng_seed", "rand_set_state", "rand_get_state", "rand2", "exponential", "reciprocal", "max8",
        "sequence_bounds", "scalar_tensor_tensor", "tensor_scalar_reduce", "core_barrier", "dma_compute",
        "quantize_mx", "range_select", "select_reduce", "sendrecv", "register_alloc", "register_move",
        "register_load", "register_store", "nc_find_index8", "nc_match_replace8", "nonzero_with_count", "topk",
    ),
    "language": (
        # dtypes, memory regions, constants, classes
        "DType", "bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32", "bfloat16",
        "tfloat32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e5m2_x4", "float8_e4m3fn_x4",
        "float8_e8m0fnu", "float4_e2m1fn_x4", "sbuf", "psum", "hbm", "private_hbm", "shared_hbm", "tile_size",
        "average", "prelu", "bypass", "MemoryRegion", "NKIObject", "NkiTensor",
        # memory predicates
        "is_hbm", "is_on_chip", "is_psum", "is_sbuf",
        # element-wise math, comparisons, logic, bits
        "add", "subtract", "multiply", "divide", "maximum", "minimum", "abs_max", "abs_min", "abs", "square",
        "power", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "bitwise_and", "bitwise_or",
        "bitwise_xor", "invert", "left_shift", "right_shift", "logical_and", "logical_or", "logical_xor",
        "logical_not",
        # activation functions and their derivatives
        "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "gelu_apprx_sigmoid", "gelu_apprx_tanh",
        "gelu_dx", "gelu_apprx_sigmoid_dx", "silu", "silu_dx", "softplus", "mish", "erf", "erf_dx", "reciprocal",
        "copy", "sin", "cos", "tan", "arctan", "ceil", "floor", "trunc", "negative", "sign", "fmod", "mod",
        # reductions and composites
        "sum", "max", "min", "mean", "prod", "var", "all", "softmax", "rms_norm", "where", "dropout",
        # creation and manipulation
        "ones", "full", "zeros_like", "empty_like", "random_seed", "expand_dims", "broadcast_to", "transpose",
        "matmul", "no_reorder", "load_transpose2d", "gather_flattened", "ds",
        # loops, control flow
        "affine_range", "sequential_range", "static_range", "dynamic_range", "fori_loop", "while_loop",
        # tensors, movement, SPMD, misc
        "ndarray", "zeros", "load", "store", "program_id", "num_programs", "program_ndim", "shared_constant",
        "shared_identity_matrix", "device_print", "rand",
    ),
    "collectives": (
        "ReplicaGroup", "all_reduce", "all_gather", "all_gather_v", "reduce_scatter", "all_to_all", "all_to_all_v",
        "collective_permute", "collective_permute_implicit", "collective_permute_implicit_reduce",
        "collective_permute_implicit_current_processing_rank_id", "rank_id",
    ),
}

# Not implemented yet, per module (each must be absent from ours; remove a name when it lands).
MISSING: dict[str, frozenset[str]] = {
    "isa": frozenset({
        "core_barrier", "sendrecv",
    }),
    "language": frozenset({"tfloat32"}),
    "collectives": frozenset(REFERENCE["collectives"]),
}

FLOOR = 198 / 213  # the implemented fraction may not fall below the last measured one


def _module(name: str):
    try:
        return importlib.import_module(f"torchneuron.nki.{name}")
    except ModuleNotFoundError:
        return None


def test_reference_lists_have_no_duplicates_and_missing_names_are_reference_names():
    for mod, names in REFERENCE.items():
        assert len(names) == len(set(names)), mod
        assert MISSING[mod] <= set(names), sorted(MISSING[mod] - set(names))


@pytest.mark.parametrize("mod", sorted(REFERENCE))
def test_every_name_claimed_implemented_exists(mod):
    ours = _module(mod)
    claimed = [n for n in REFERENCE[mod] if n not in MISSING[mod]]
    absent = [n for n in claimed if ours is None or not hasattr(ours, n)]
    assert not absent, f"torchneuron.nki.{mod} lacks {absent} (claimed implemented: not in MISSING)"


@pytest.mark.parametrize("mod", sorted(REFERENCE))
def test_names_listed_missing_are_absent(mod):
    ours = _module(mod)
    present = sorted(n for n in MISSING[mod] if ours is not None and hasattr(ours, n))
    assert not present, f"torchneuron.nki.{mod} has {present} now: remove them from MISSING"


def test_fraction_implemented_does_not_regress():
    total = sum(len(v) for v in REFERENCE.values())
    done = total - sum(len(v) for v in MISSING.values())
    for mod, names in REFERENCE.items():
        have = len(names) - len(MISSING[mod])
        print(f"nki.{mod}: {have}/{len(names)} ({have / len(names):.0%})")
    print(f"NKI API coverage: {done}/{total} = {done / total:.1%} (reference {REFERENCE_COMMIT[:7]})")
    assert done / total >= FLOOR - 1e-12, f"coverage {done}/{total} fell below the floor {FLOOR:.3f}"
