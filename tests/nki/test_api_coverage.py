"""How much of the published NKI API ``torchneuron.nki`` implements, name by name.

The reference is the public API of the Neuron SDK (``aws-neuron/aws-neuron-sdk``, folder ``nki/api/nki/``:
``isa/__init__.py``, ``language/__init__.py``, ``collectives/__init__.py``), read at commit ``REFERENCE_COMMIT``:
every public module-level name (functions, classes, constants, dtypes) of each module. ``MISSING`` lists what we
do not have yet; every other name must exist in our module, and every listed one must still be absent (so the
list stays honest as entries land). The fraction implemented may only go up: ``FLOOR`` is the last measured one.
"""
from __future__ import annotations

import importlib
import inspect

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

# The reference's parameters of every function, in order: an implemented function accepts them, the positional
# ones in that order (ours may add parameters after them).
SIGNATURES: dict[str, dict[str, str]] = {
    "isa": {
        "get_nc_sub_version": "",
        "get_nc_version": "",
        "dma_copy": "dst src priority oob_mode dge_mode engine name",
        "tensor_copy": "dst src engine name",
        "memset": "dst value engine name",
        "tensor_copy_predicated": "dst src predicate reverse_pred name",
        "nc_matmul": ("dst stationary moving is_stationary_onezero is_moving_onezero is_transpose accumulate "
                      "tile_position tile_size perf_mode name"),
        "nc_matmul_mx": "dst stationary moving stationary_scale moving_scale tile_position tile_size accumulate name",
        "nc_transpose": "dst data engine name",
        "dma_transpose": "dst src axes priority dge_mode oob_mode name",
        "tensor_tensor": "dst data1 data2 op engine name",
        "tensor_scalar": "dst data op0 operand0 reverse0 op1 operand1 reverse1 engine name",
        "tensor_reduce": "dst op data axis negate keepdims name",
        "tensor_partition_reduce": "dst op data name",
        "tensor_scalar_cumulative": "dst src op0 op1 imm0 imm1 reduce_cmd name",
        "activation": "dst op data bias scale reduce_op reduce_res reduce_cmd name",
        "activation_reduce": "dst op data reduce_op reduce_res bias scale name",
        "activate2": ("dst op data imm0 imm1 op0 op1 relu_param reverse0 reverse1 reduce_op reduce_res "
                      "reduce_cmd name"),
        "iota": "dst pattern offset channel_multiplier name",
        "affine_select": "dst pattern channel_multiplier on_true_tile on_false_value cmp_op offset name",
        "local_gather": "dst src_buffer index num_elem_per_idx num_valid_indices name",
        "nc_n_gather": "dst data indices name",
        "bn_stats": "dst data name",
        "bn_aggr": "dst data name",
        "tensor_tensor_scan": "dst data0 data1 initial op0 op1 reverse0 reverse1 name",
        "nc_stream_shuffle": "dst src shuffle_mask name",
        "rng": "dst engine name",
        "dropout": "dst data prob name",
        "set_rng_seed": "src_seeds name",
        "rand_set_state": "src_seeds engine name",
        "rand_get_state": "dst engine name",
        "rand2": "dst min max name",
        "exponential": "dst src max_value reduce_res reduce_cmd reduce_init name",
        "reciprocal": "dst data name",
        "max8": "dst src name",
        "sequence_bounds": "dst segment_ids name",
        "scalar_tensor_tensor": "dst data op0 operand0 op1 operand1 reverse0 reverse1 name",
        "tensor_scalar_reduce": ("dst data op0 operand0 reduce_op reduce_res reverse0 reduce_cmd reduce_init "
                                 "reduce_res_negate name"),
        "core_barrier": "data cores engine name",
        "dma_compute": "dst srcs reduce_op scales unique_indices oob_mode name",
        "quantize_mx": "dst src dst_scale name",
        "range_select": ("dst on_true_tile comp_op0 comp_op1 bound0 bound1 reduce_cmd reduce_res reduce_op "
                         "range_start on_false_value name"),
        "select_reduce": "dst predicate on_true on_false reduce_res reduce_cmd reduce_op reverse_pred name",
        "sendrecv": "src dst send_to_rank recv_from_rank pipe_id dma_engine name",
        "register_alloc": "x",
        "register_move": "dst src",
        "register_load": "dst src",
        "register_store": "dst src",
        "nc_find_index8": "dst data vals name",
        "nc_match_replace8": "dst data vals imm dst_idx name",
        "nonzero_with_count": "dst src index_offset padding_val name",
        "topk": "val_dst idx_dst src n name",
    },
    "language": {
        "is_hbm": "buffer",
        "is_on_chip": "buffer",
        "is_psum": "buffer",
        "is_sbuf": "buffer",
        "add": "x y dtype",
        "subtract": "x y dtype",
        "multiply": "x y dtype",
        "divide": "x y dtype",
        "maximum": "x y dtype",
        "minimum": "x y dtype",
        "abs_max": "x y dtype",
        "abs_min": "x y dtype",
        "abs": "x dtype",
        "square": "x dtype",
        "power": "x y dtype",
        "equal": "x y dtype",
        "not_equal": "x y dtype",
        "less": "x y dtype",
        "less_equal": "x y dtype",
        "greater": "x y dtype",
        "greater_equal": "x y dtype",
        "bitwise_and": "x y dtype",
        "bitwise_or": "x y dtype",
        "bitwise_xor": "x y dtype",
        "invert": "x dtype",
        "left_shift": "x y dtype",
        "right_shift": "x y dtype",
        "logical_and": "x y dtype",
        "logical_or": "x y dtype",
        "logical_xor": "x y dtype",
        "logical_not": "x dtype",
        "exp": "x dtype",
        "log": "x dtype",
        "sqrt": "x dtype",
        "rsqrt": "x dtype",
        "tanh": "x dtype",
        "sigmoid": "x dtype",
        "relu": "x dtype",
        "gelu": "x dtype",
        "gelu_apprx_sigmoid": "x dtype",
        "gelu_apprx_tanh": "x dtype",
        "gelu_dx": "x dtype",
        "gelu_apprx_sigmoid_dx": "x dtype",
        "silu": "x dtype",
        "silu_dx": "x dtype",
        "softplus": "x dtype",
        "mish": "x dtype",
        "erf": "x dtype",
        "erf_dx": "x dtype",
        "reciprocal": "x dtype",
        "copy": "x dtype",
        "sin": "x dtype",
        "cos": "x dtype",
        "tan": "x dtype",
        "arctan": "x dtype",
        "ceil": "x dtype",
        "floor": "x dtype",
        "trunc": "x dtype",
        "negative": "x dtype",
        "sign": "x dtype",
        "fmod": "x y dtype",
        "mod": "x y dtype",
        "sum": "x axis dtype keepdims",
        "max": "x axis dtype keepdims",
        "min": "x axis dtype keepdims",
        "mean": "x axis dtype keepdims",
        "prod": "x axis dtype keepdims",
        "var": "x axis dtype keepdims",
        "all": "x axis dtype",
        "softmax": "x axis dtype",
        "rms_norm": "x w axis n epsilon dtype compute_dtype",
        "where": "condition x y dtype",
        "dropout": "x rate dtype",
        "ones": "shape dtype buffer name",
        "full": "shape fill_value dtype buffer name",
        "zeros_like": "x dtype buffer name",
        "empty_like": "x dtype buffer name",
        "random_seed": "seed",
        "expand_dims": "x axis",
        "broadcast_to": "x shape dtype",
        "transpose": "x dtype",
        "matmul": "x y transpose_x",
        "no_reorder": "",
        "load_transpose2d": "src dtype",
        "gather_flattened": "data indices axis dtype",
        "ds": "start size",
        "affine_range": "start stop step",
        "sequential_range": "start stop step",
        "static_range": "start stop step",
        "dynamic_range": "start stop step",
        "fori_loop": "lower upper body_fun step",
        "while_loop": "init body_fun",
        "ndarray": "shape dtype buffer name address",
        "zeros": "shape dtype buffer name",
        "load": "src dtype",
        "store": "dst value",
        "program_id": "axis",
        "num_programs": "axes",
        "program_ndim": "",
        "shared_constant": "constant",
        "shared_identity_matrix": "n dtype dst",
        "device_print": "print_prefix tensor",
        "rand": "shape dtype buffer name",
    },
    "collectives": {
        "all_reduce": "srcs dsts replica_group op priority name",
        "all_gather": "srcs dsts replica_group collective_dim priority name",
        "all_gather_v": "srcs dsts replica_group metadata_tensor recv_counts_known has_rdispls priority name",
        "reduce_scatter": "srcs dsts replica_group collective_dim op priority name",
        "all_to_all": "srcs dsts replica_group collective_dim priority name",
        "all_to_all_v": "srcs dsts replica_group metadata_tensor recv_counts_known has_rdispls priority name",
        "collective_permute": "srcs dsts source_target_pairs priority name",
        "collective_permute_implicit": "srcs_by_channel dsts_by_channel replica_group channel_ids priority name",
        "collective_permute_implicit_reduce": ("srcs0_by_channel srcs1_by_channel dsts_by_channel "
                                               "replica_group op channel_ids priority name"),
        "collective_permute_implicit_current_processing_rank_id": "iteration_id replica_group channel_id name",
        "rank_id": "name",
    },
}

# Not implemented yet, per module (each must be absent from ours; remove a name when it lands).
MISSING: dict[str, frozenset[str]] = {
    "isa": frozenset(),
    "language": frozenset(),
    "collectives": frozenset(),
}

FLOOR = 213 / 213  # the implemented fraction may not fall below the last measured one


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


@pytest.mark.parametrize("mod", sorted(REFERENCE))
def test_implemented_functions_take_the_published_parameters(mod):
    ours = _module(mod)
    wrong = []
    for name, params in SIGNATURES[mod].items():
        fn = getattr(ours, name, None) if ours is not None else None
        if fn is None:
            continue
        want = params.split()
        have = inspect.signature(fn).parameters
        positional = [p for p, v in have.items() if v.kind in (v.POSITIONAL_ONLY, v.POSITIONAL_OR_KEYWORD)]
        takes_kwargs = any(v.kind == v.VAR_KEYWORD for v in have.values())
        missing = [p for p in want if p not in have and not takes_kwargs]
        if missing or positional[:len(want)] != [p for p in want if p in positional]:
            wrong.append(f"{name}{tuple(have)} vs published ({', '.join(want)})")
    assert not wrong, "\n".join(wrong)


def test_signature_lists_cover_the_reference_functions():
    for mod, names in SIGNATURES.items():
        assert set(names) <= set(REFERENCE[mod]), sorted(set(names) - set(REFERENCE[mod]))
