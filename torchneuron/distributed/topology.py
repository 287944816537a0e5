"""Where each rank sits: NeuronCores of one chip, chips of one node (NeuronLink), nodes (EFA).

A rank is one NeuronCore. Under torchrun, global rank ``g`` runs on node
``g // LOCAL_WORLD_SIZE`` as local rank ``g % LOCAL_WORLD_SIZE``, and local ranks fill
the node's chips in order: local rank ``l`` is on chip ``l // cores_per_chip``. The link
figures per chip model come from ``LINKS`` below (sources in ``docs/hardware-model.md``,
section "Collectives"); the chip model is ``TORCHNEURON_CHIP``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from torchneuron.sim.specs import ChipSpec


@dataclass(frozen=True)
class LinkSpec:
    """Bandwidth and per-message latency of each level of the interconnect."""

    core_bytes_per_s: float      # one core to another core of the same chip, per core
    core_latency_ns: float
    neuronlink_latency_ns: float  # one chip-to-chip hop
    efa_bytes_per_s_per_node: float
    efa_latency_ns: float
    chips_per_node: int


_INTRA_CHIP_LATENCY_NS = 1_000.0  # ASSUMPTION: a DMA descriptor round trip between cores
_NEURONLINK_LATENCY_NS = 2_000.0  # ASSUMPTION: no published figure; a few DMA hops
_EFA_LATENCY_NS = 15_000.0        # ASSUMPTION: typical EFA small-message latency (tens of us)

#: Per chip model. EFA and chips per node are the largest instance of each generation.
LINKS: dict[str, LinkSpec] = {
    "trn1": LinkSpec(core_bytes_per_s=0.0, core_latency_ns=_INTRA_CHIP_LATENCY_NS,
                     neuronlink_latency_ns=_NEURONLINK_LATENCY_NS,
                     efa_bytes_per_s_per_node=800e9 / 8,   # trn1.32xlarge: 800 Gbps EFA
                     efa_latency_ns=_EFA_LATENCY_NS, chips_per_node=16),  # trn1.32xlarge: 16 chips
    "trn2": LinkSpec(core_bytes_per_s=0.0, core_latency_ns=_INTRA_CHIP_LATENCY_NS,
                     neuronlink_latency_ns=_NEURONLINK_LATENCY_NS,
                     efa_bytes_per_s_per_node=3.2e12 / 8,  # trn2.48xlarge: 3.2 Tbps EFAv3
                     efa_latency_ns=_EFA_LATENCY_NS, chips_per_node=16),  # trn2.48xlarge: 16 chips
    "trn3": LinkSpec(core_bytes_per_s=0.0, core_latency_ns=_INTRA_CHIP_LATENCY_NS,
                     neuronlink_latency_ns=_NEURONLINK_LATENCY_NS,
                     efa_bytes_per_s_per_node=3.2e12 / 8,  # ASSUMPTION: as trn2 (no trn3 instance figure)
                     efa_latency_ns=_EFA_LATENCY_NS, chips_per_node=16),  # ASSUMPTION: as trn2
}


def links(spec: ChipSpec) -> LinkSpec:
    """The link figures of ``spec``'s chip; cores of one chip exchange data at each core's
    share of the chip's HBM bandwidth (an ASSUMPTION: transfers go HBM to HBM by DMA)."""
    base = LINKS[spec.name]
    return LinkSpec(core_bytes_per_s=spec.hbm_bytes_per_second_per_core, core_latency_ns=base.core_latency_ns,
                    neuronlink_latency_ns=base.neuronlink_latency_ns,
                    efa_bytes_per_s_per_node=base.efa_bytes_per_s_per_node, efa_latency_ns=base.efa_latency_ns,
                    chips_per_node=base.chips_per_node)


@dataclass(frozen=True)
class Placement:
    """The (node, chip) of every rank of one process group, in group-rank order."""

    nodes: tuple[int, ...]
    chips: tuple[tuple[int, int], ...]  # (node, chip within node)

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.nodes)

    def level(self) -> str:
        """The widest level the group spans: "core" (one chip), "chip" (one node) or "node"."""
        if len(set(self.nodes)) > 1:
            return "node"
        if len(set(self.chips)) > 1:
            return "chip"
        return "core"

    def max_per_chip(self) -> int:
        """Most ranks of the group on one chip (they share the chip's NeuronLink bandwidth)."""
        return max(self.chips.count(c) for c in set(self.chips))

    def max_per_node(self) -> int:
        """Most ranks of the group on one node (they share the node's EFA bandwidth)."""
        return max(self.nodes.count(n) for n in set(self.nodes))


def local_world_size(world_size: int) -> int:
    """Ranks per node: ``LOCAL_WORLD_SIZE`` (set by torchrun), else every rank on one node."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not raw:
        return world_size
    value = int(raw)
    if value < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r}: expected a positive integer")
    return value


def placement(global_ranks: Sequence[int], spec: ChipSpec, ranks_per_node: int) -> Placement:
    """Where the ranks ``global_ranks`` of a group sit, ``ranks_per_node`` ranks per node."""
    nodes, chips = [], []
    for g in global_ranks:
        node, local = divmod(int(g), ranks_per_node)
        nodes.append(node)
        chips.append((node, local // spec.cores_per_chip))
    return Placement(tuple(nodes), tuple(chips))
