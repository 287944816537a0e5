"""``nki.collectives``: collective communication between the ranks of a multi-core launch.

A rank is one instance of ``kernel[n](...)``: its row-major program id, running on its own NeuronCore of the
chip (``nki.multicore``). Every rank calls the same collectives in the same order (SPMD); each call is one
cross-core instruction, run when the ranks reach it and timed by the process group's cost model
(``torchneuron.distributed.cost``) for its size and the placement of its replica group.

Reductions (``nl.add``, ``nl.minimum``, ``nl.maximum``) combine the ranks' values in fp32 (integers exactly)
in replica-group order and round once to the destination dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from torchneuron.distributed.topology import links
from torchneuron.nki import multicore
from torchneuron.nki.isa import NkiInstruction, VirtualRegister, _emit, _needs, register_alloc
from torchneuron.nki.tracing import NKIObject, NkiTensor, current
from torchneuron.sim.numerics import alu_op

__all__ = ["ReplicaGroup", "all_reduce", "all_gather", "all_gather_v", "reduce_scatter", "all_to_all", "all_to_all_v",
           "collective_permute", "collective_permute_implicit", "collective_permute_implicit_reduce",
           "collective_permute_implicit_current_processing_rank_id", "rank_id"]

# chips whose instances connect through a NeuronSwitch fabric (the all_to_all_v reference: Trn3)
NEURON_SWITCH_CHIPS = ("trn3",)


@dataclass
class ReplicaGroup(NKIObject):
    """``ReplicaGroup([[0, 1], [2, 3]])``: rank lists that each run the collective among themselves (no overlap)."""

    groups: Any

    def ranks(self, what: str) -> tuple[tuple[int, ...], ...]:
        """The rank lists, checked against the launch being traced (ValueError: overlapping or unknown ranks)."""
        try:
            return multicore.check_group(self.groups, current().world, what)
        except ValueError as e:
            if "is not a rank of the launch" in str(e):
                raise ValueError(f"{e}; launch several ranks with kernel.ranks(n)") from None
            raise


def _group(replica_group: Any, what: str) -> tuple[tuple[int, ...], ...]:
    if not isinstance(replica_group, ReplicaGroup):
        raise TypeError(f"{what}: replica_group must be an nki.collectives.ReplicaGroup, got "
                        f"{type(replica_group).__name__}")
    return replica_group.ranks(what)


def _tensors(values: Any, what: str, name: str) -> list[NkiTensor]:
    if isinstance(values, NkiTensor) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{what}: {name} is a list of tensors, got {type(values).__name__}")
    for t in values:
        if not isinstance(t, NkiTensor):
            raise TypeError(f"{what}: {name} holds tensors, got {type(t).__name__}")
    return list(values)


def _memory(t: NkiTensor) -> str:
    return "sbuf" if t.buffer.name == "sbuf" else "hbm" if not t.buffer.on_chip else t.buffer.name


def _operands(srcs: Any, dsts: Any, what: str, sbuf: bool = True) -> tuple[list[NkiTensor], list[NkiTensor]]:
    """srcs/dsts checked: equal counts, one memory (HBM, or SBUF where ``sbuf``), one tensor when on SBUF."""
    srcs, dsts = _tensors(srcs, what, "srcs"), _tensors(dsts, what, "dsts")
    if not srcs or len(srcs) != len(dsts):
        raise ValueError(f"{what}: srcs and dsts must hold the same number of tensors (at least one), got "
                         f"{len(srcs)} and {len(dsts)}")
    kinds = {_memory(t) for t in (*srcs, *dsts)}
    if kinds - {"hbm", "sbuf"}:
        raise ValueError(f"{what}: tensors live on HBM or SBUF, not {sorted(kinds - {'hbm', 'sbuf'})}")
    if len(kinds) > 1:
        raise ValueError(f"{what}: all tensors must be on HBM or all on SBUF; got a mix")
    if "sbuf" in kinds and not sbuf:
        raise ValueError(f"{what}: tensors must be on HBM (SBUF is not supported for {what})")
    if "sbuf" in kinds and len(srcs) > 1:
        raise ValueError(f"{what}: coalesced collectives (several tensors) need HBM tensors; got {len(srcs)} on SBUF")
    for s, d in zip(srcs, dsts):
        if s.dtype != d.dtype:
            raise TypeError(f"{what}: src {s.dtype} and dst {d.dtype} must have the same dtype")
    return srcs, dsts


def _op(op: Any, what: str) -> str:
    name = alu_op(op)
    if name not in multicore.REDUCE_OPS:
        raise ValueError(f"{what}: op must be nl.add, nl.minimum or nl.maximum, got {op!r}")
    return name


def _dim(collective_dim: int, t: NkiTensor, allowed: Sequence[int], what: str) -> int:
    d = int(collective_dim)
    if d not in allowed:
        raise ValueError(f"{what}: collective_dim={collective_dim}; supported on {_memory(t).upper()}: "
                         f"{', '.join(map(str, allowed))}")
    if _memory(t) == "sbuf" and len(t.shape) != 2:
        raise ValueError(f"{what}: SBUF collectives take 2-D tiles (one free dim), got shape {list(t.shape)}")
    return d


def _emit_collective(kind: str, srcs: Sequence[NkiTensor], dsts: Sequence[NkiTensor], **fields: Any) -> NkiInstruction:
    trace = current()
    return _emit(multicore.CrossCore, kind=kind, rank=trace.rank, lane=trace.instance, srcs=tuple(t.access for t in srcs),
                 dsts=tuple(t.access for t in dsts), engine="dma", **fields)


def _shape_error(what: str, s: NkiTensor, d: NkiTensor, rule: str) -> ValueError:
    return ValueError(f"{what}: src {list(s.shape)} and dst {list(d.shape)}: {rule}")


def all_reduce(srcs: List[NkiTensor], dsts: List[NkiTensor], replica_group: ReplicaGroup, op: Any,
               priority: Optional[int] = None, name: Optional[str] = None) -> NkiInstruction:
    """Every rank of each group gets, in each ``dsts[i]``, the reduction of the group's ``srcs[i]``."""
    what = "all_reduce"
    srcs, dsts = _operands(srcs, dsts, what)
    groups, reduce = _group(replica_group, what), _op(op, what)
    for s, d in zip(srcs, dsts):
        if tuple(s.shape) != tuple(d.shape):
            raise _shape_error(what, s, d, "must have the same shape")
    _priority(priority, what)
    return _emit_collective(what, srcs, dsts, groups=groups, op=reduce)


def all_gather(srcs: List[NkiTensor], dsts: List[NkiTensor], replica_group: ReplicaGroup, collective_dim: int,
               priority: Optional[int] = None, name: Optional[str] = None) -> NkiInstruction:
    """Every rank of each group gets the group's ``srcs[i]`` concatenated along ``collective_dim`` (group order)."""
    what = "all_gather"
    srcs, dsts = _operands(srcs, dsts, what)
    groups = _group(replica_group, what)
    d = _dim(collective_dim, srcs[0], (0, 1) if _memory(srcs[0]) == "sbuf" else (0,), what)
    for s, t in zip(srcs, dsts):
        _check_split(what, s, t, d, groups, "dst")
    _priority(priority, what)
    return _emit_collective(what, srcs, dsts, groups=groups, dim=d)


def reduce_scatter(srcs: List[NkiTensor], dsts: List[NkiTensor], replica_group: ReplicaGroup, collective_dim: int,
                   op: Any, priority: Optional[int] = None, name: Optional[str] = None) -> NkiInstruction:
    """The group's ``srcs[i]`` reduced, split along ``collective_dim``: the rank at group position j gets chunk j."""
    what = "reduce_scatter"
    srcs, dsts = _operands(srcs, dsts, what)
    groups, reduce = _group(replica_group, what), _op(op, what)
    d = _dim(collective_dim, srcs[0], (0,), what)
    for s, t in zip(srcs, dsts):
        _check_split(what, t, s, d, groups, "src")
    _priority(priority, what)
    return _emit_collective(what, srcs, dsts, groups=groups, op=reduce, dim=d)


def all_to_all(srcs: List[NkiTensor], dsts: List[NkiTensor], replica_group: ReplicaGroup, collective_dim: int,
               priority: Optional[int] = None, name: Optional[str] = None) -> NkiInstruction:
    """Each ``srcs[i]`` split along ``collective_dim`` into one chunk per group rank; the rank at position j
    receives chunk j of every rank, concatenated in group order (HBM only)."""
    what = "all_to_all"
    srcs, dsts = _operands(srcs, dsts, what, sbuf=False)
    groups = _group(replica_group, what)
    d = _dim(collective_dim, srcs[0], (0,), what)
    for s, t in zip(srcs, dsts):
        if tuple(s.shape) != tuple(t.shape):
            raise _shape_error(what, s, t, "must have the same shape")
        _check_split(what, s, s, d, groups, "src")
    _priority(priority, what)
    return _emit_collective(what, srcs, dsts, groups=groups, dim=d)


def _check_split(what: str, part: NkiTensor, whole: NkiTensor, d: int, groups: Any, name: str) -> None:
    """``whole`` (the tensor called ``name``) is ``p`` parts of ``part``'s shape along dim ``d`` for every group
    size p; for all-to-all (``part is whole``) dim ``d`` splits into p equal chunks."""
    for g in groups:
        p, want = len(g), list(part.shape)
        if d >= len(want):
            raise ValueError(f"{what}: collective_dim={d} is not a dim of shape {want}")
        if part is whole:
            if want[d] % p:
                raise ValueError(f"{what}: dim {d} of {want} does not split into {p} equal chunks (group {list(g)})")
            continue
        want[d] *= p
        if list(whole.shape) != want:
            raise ValueError(f"{what}: for a group of {p} ranks {name} must have shape {want}, got {list(whole.shape)}")


def _priority(priority: Optional[int], what: str) -> None:
    if priority is not None:
        _needs(f"{what}(priority=...)", 4)
        if not 0 <= int(priority) <= 3:
            raise ValueError(f"{what}: priority is {priority}; DMA QoS levels are 0-3")


def _variable(kind: str, srcs: Any, dsts: Any, replica_group: ReplicaGroup, metadata_tensor: NkiTensor,
              recv_counts_known: bool, has_rdispls: bool, priority: Optional[int]) -> NkiInstruction:
    srcs, dsts = _operands(srcs, dsts, kind, sbuf=False)
    if len(srcs) != 1:
        raise ValueError(f"{kind}: srcs and dsts hold exactly one tensor each, got {len(srcs)}")
    groups = _group(replica_group, kind)
    if kind == "all_gather_v":
        _all_gather_v_deployment(groups)
        if has_rdispls:
            raise NotImplementedError("all_gather_v: has_rdispls=True is not supported (as in the reference)")
    else:
        _all_to_all_v_deployment(groups, has_rdispls)
    if not isinstance(metadata_tensor, NkiTensor):
        raise TypeError(f"{kind}: metadata_tensor is a uint32 tensor, got {type(metadata_tensor).__name__}")
    rows = 4 if has_rdispls else 3
    p = {len(g) for g in groups}
    if len(p) != 1:
        raise ValueError(f"{kind}: the rank lists of the replica group must have one size, got {sorted(p)}")
    (p,) = p
    want = (rows, p) if _memory(metadata_tensor) == "hbm" else (1, rows, p)
    if str(metadata_tensor.dtype) != "torch.uint32" or tuple(metadata_tensor.shape) != want:
        raise ValueError(f"{kind}: metadata_tensor must be uint32 of shape {list(want)} on "
                         f"{_memory(metadata_tensor).upper()}, got {metadata_tensor.dtype}{list(metadata_tensor.shape)}")
    _priority(priority, kind)
    return _emit_collective(kind, srcs, dsts, groups=groups, metadata=metadata_tensor.access,
                            recv_counts_known=bool(recv_counts_known), has_rdispls=bool(has_rdispls))


def _all_gather_v_deployment(groups: tuple[tuple[int, ...], ...]) -> None:
    """The published limits of all_gather_v: LNC=2 (two cores per rank), rank lists of exactly 4 ranks on one chip."""
    trace = current()
    if trace.instances != 2:
        raise NotImplementedError(f"all_gather_v: only LNC=2 is supported (as in the reference): launch two instances "
                                  f"per rank (kernel[2].ranks(n)), not {trace.instances}")
    per_chip = trace.spec.cores_per_chip
    for g in groups:
        if len(g) != 4 or len({r * 2 // per_chip for r in g}) != 1:
            raise ValueError(f"all_gather_v: each rank list must be 4 ranks on one chip (intra-chip, as in the "
                             f"reference), got {list(g)} ({per_chip // 2} ranks of two cores per "
                             f"{trace.spec.name} chip)")


def _all_to_all_v_deployment(groups: tuple[tuple[int, ...], ...], has_rdispls: bool) -> None:
    """The published limits of all_to_all_v. On a NeuronSwitch fabric: LNC=2, rank lists of whole devices (every
    rank of each device it touches, sequential), more than one device. Elsewhere: inter-node rank lists only
    (same-indexed ranks of different nodes), and no ``has_rdispls``."""
    trace = current()
    spec, lanes = trace.spec, trace.instances
    per_chip, per_node = spec.cores_per_chip, spec.cores_per_chip * links(spec).chips_per_node
    what = "all_to_all_v"
    if spec.name in NEURON_SWITCH_CHIPS:
        if lanes != 2:
            raise NotImplementedError(f"{what}: on {spec.name} (NeuronSwitch) only LNC=2 is supported: launch two "
                                      f"instances per rank (kernel[2].ranks(n)), not {lanes}")
        per_device = per_chip // 2
        for g in groups:
            devices = sorted({r // per_device for r in g})
            whole = [r for d in devices for r in range(d * per_device, (d + 1) * per_device)]
            if len(devices) < 2 or list(g) != whole:
                raise ValueError(f"{what}: on {spec.name} (NeuronSwitch) each rank list is every rank of more than "
                                 f"one device, in order ({per_device} ranks a device), got {list(g)}")
        return
    if has_rdispls:
        raise NotImplementedError(f"{what}: has_rdispls=True needs a NeuronSwitch fabric ({', '.join(NEURON_SWITCH_CHIPS)}); "
                                  f"{spec.name} has none")
    for g in groups:
        nodes = [r * lanes // per_node for r in g]
        if len(set(nodes)) != len(g) or len({r * lanes % per_node for r in g}) != 1:
            raise ValueError(f"{what}: on {spec.name} only inter-node rank lists are supported (same-indexed ranks "
                             f"of different nodes, {per_node // lanes} ranks a node), got {list(g)}")


def all_gather_v(srcs: List[NkiTensor], dsts: List[NkiTensor], replica_group: ReplicaGroup, metadata_tensor: NkiTensor,
                 recv_counts_known: bool = False, has_rdispls: bool = False, priority: Optional[int] = None,
                 name: Optional[str] = None) -> NkiInstruction:
    """Each rank's ``src[send_displ : send_displ + send_count]`` (row 0/1, first column) lands at every rank's dst
    slot of its group position (``dst.size / p`` elements each); row 2 receives the counts unless known."""
    return _variable("all_gather_v", srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls,
                     priority)


def all_to_all_v(srcs: List[NkiTensor], dsts: List[NkiTensor], replica_group: ReplicaGroup, metadata_tensor: NkiTensor,
                 recv_counts_known: bool = False, has_rdispls: bool = False, priority: Optional[int] = None,
                 name: Optional[str] = None) -> NkiInstruction:
    """All-to-all of flat buffers with per-destination counts and displacements read from ``metadata_tensor``
    when the kernel runs (rows: send counts, send displacements, receive counts, receive displacements)."""
    return _variable("all_to_all_v", srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls,
                     priority)


def collective_permute(srcs: List[NkiTensor], dsts: List[NkiTensor], source_target_pairs: List[Tuple[int, int]],
                       priority: Optional[int] = None, name: Optional[str] = None) -> NkiInstruction:
    """For every (source, target) pair, the target rank's ``dsts[0]`` receives the source rank's ``srcs[0]``."""
    what = "collective_permute"
    srcs, dsts = _operands(srcs, dsts, what, sbuf=False)
    if len(srcs) != 1:
        raise ValueError(f"{what}: coalesced collectives are not supported; srcs and dsts hold one tensor each")
    if tuple(srcs[0].shape) != tuple(dsts[0].shape):
        raise _shape_error(what, srcs[0], dsts[0], "must have the same shape")
    try:
        pairs = tuple((int(s), int(t)) for s, t in source_target_pairs)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: source_target_pairs is a list of (source, target) ranks, got "
                        f"{source_target_pairs!r}") from None
    n = current().world
    for s, t in pairs:
        if not (0 <= s < n and 0 <= t < n):
            raise ValueError(f"{what}: pair ({s}, {t}) names a rank outside the launch (ranks 0..{n - 1})")
    targets = [t for _, t in pairs]
    if len(set(targets)) != len(targets):
        raise ValueError(f"{what}: a rank receives twice in {list(map(list, pairs))}")
    _priority(priority, what)
    return _emit_collective(what, srcs, dsts, pairs=pairs)


def _channels(by_channel: Any, what: str, name: str) -> list[NkiTensor]:
    if not isinstance(by_channel, (list, tuple)) or not by_channel:
        raise TypeError(f"{what}: {name} is a list (one per channel) of one-tensor lists")
    out = []
    for c in by_channel:
        ts = _tensors(c, what, name)
        if len(ts) != 1:
            raise ValueError(f"{what}: each channel of {name} holds exactly one tensor, got {len(ts)}")
        out += ts
    return out


def _channel_ids(channel_ids: Any, count: int, what: str) -> None:
    ids = list(channel_ids)
    if ids != list(range(len(ids))) or len(ids) != count:
        raise ValueError(f"{what}: channel_ids must be consecutive from 0, one per channel ({count}), got {ids}")
    if count > 4:
        raise ValueError(f"{what}: {count} channels; at most 4 are available")


def collective_permute_implicit(srcs_by_channel: List[List[NkiTensor]], dsts_by_channel: List[List[NkiTensor]],
                                replica_group: ReplicaGroup, channel_ids: List[int] = [0],  # noqa: B006 (reference)
                                priority: Optional[int] = None, name: Optional[str] = None) -> NkiInstruction:
    """Ring step: each rank sends every channel's source to its successor in its rank list and receives its
    predecessor's into that channel's destination."""
    what = "collective_permute_implicit"
    srcs, dsts = _channels(srcs_by_channel, what, "srcs_by_channel"), _channels(dsts_by_channel, what, "dsts_by_channel")
    srcs, dsts = _operands(srcs, dsts, what, sbuf=False) if len(srcs) == 1 else _operands_many(srcs, dsts, what)
    _channel_ids(channel_ids, len(srcs), what)
    for s, d in zip(srcs, dsts):
        if tuple(s.shape) != tuple(d.shape):
            raise _shape_error(what, s, d, "must have the same shape")
    groups = _group(replica_group, what)
    _priority(priority, what)
    return _emit_collective(what, srcs, dsts, groups=groups)


def _operands_many(srcs: list, dsts: list, what: str) -> tuple[list, list]:
    """Per-channel tensors (one per channel): each pair checked like a single collective's."""
    if len(srcs) != len(dsts):
        raise ValueError(f"{what}: {len(srcs)} source channels and {len(dsts)} destination channels")
    for s, d in zip(srcs, dsts):
        _operands([s], [d], what, sbuf=False)
    return srcs, dsts


def collective_permute_implicit_reduce(srcs0_by_channel: List[List[NkiTensor]], srcs1_by_channel: List[List[NkiTensor]],
                                       dsts_by_channel: List[List[NkiTensor]], replica_group: ReplicaGroup, op: Any,
                                       channel_ids: List[int] = [0],  # noqa: B006 (the reference's default)
                                       priority: Optional[int] = None, name: Optional[str] = None) -> NkiInstruction:
    """Ring step with reduction: each rank sends ``op(srcs0, srcs1)`` to its successor; its destination receives
    its predecessor's."""
    what = "collective_permute_implicit_reduce"
    srcs0 = _channels(srcs0_by_channel, what, "srcs0_by_channel")
    srcs1 = _channels(srcs1_by_channel, what, "srcs1_by_channel")
    dsts = _channels(dsts_by_channel, what, "dsts_by_channel")
    _operands_many(srcs0, dsts, what)
    _operands_many(srcs1, dsts, what)
    _channel_ids(channel_ids, len(dsts), what)
    for a, b, d in zip(srcs0, srcs1, dsts):
        if not tuple(a.shape) == tuple(b.shape) == tuple(d.shape):
            raise ValueError(f"{what}: srcs0 {list(a.shape)}, srcs1 {list(b.shape)} and dsts {list(d.shape)} must "
                             f"have one shape")
    groups, reduce = _group(replica_group, what), _op(op, what)
    _priority(priority, what)
    return _emit_collective(what, srcs0, dsts, groups=groups, op=reduce, srcs1=tuple(t.access for t in srcs1))


def collective_permute_implicit_current_processing_rank_id(iteration_id: int, replica_group: ReplicaGroup,
                                                           channel_id: int = 0,
                                                           name: Optional[str] = None) -> VirtualRegister:
    """A register holding the rank whose data this rank processes at ring step ``iteration_id``: its own at
    step 0, then each predecessor in turn (steps known when the kernel is traced)."""
    what = "collective_permute_implicit_current_processing_rank_id"
    if isinstance(iteration_id, VirtualRegister):
        raise NotImplementedError(f"{what}: a register iteration_id (a dynamic loop) is not modelled; iterate with "
                                  f"range()")
    if not isinstance(iteration_id, (int, np.integer)) or int(iteration_id) < 0:
        raise ValueError(f"{what}: iteration_id is a non-negative integer, got {iteration_id!r}")
    if not 0 <= int(channel_id) < 4:
        raise ValueError(f"{what}: channel_id={channel_id}; channels are 0-3")
    groups = _group(replica_group, what)
    rank = current().rank
    where = multicore.ring_position(groups, rank)
    if where is None:
        raise ValueError(f"{what}: rank {rank} is in no rank list of the replica group {[list(g) for g in groups]}")
    g, k = where
    return register_alloc(g[(k - int(iteration_id)) % len(g)])


def rank_id(name: Optional[str] = None) -> int:
    """This rank's ID: its instance's row-major index in the launch (known when the kernel is traced)."""
    return current().rank
