"""Simulated time of a collective: ring and tree formulas over the group's placement.

``p`` ranks, ``S`` bytes, ``B`` the bandwidth each rank gets on the slowest level the
group spans, ``a`` that level's per-message latency (``docs/hardware-model.md``,
"Collectives", derives and cites each term):

    all_reduce                      2 (p-1)/p * S/B + 2 (p-1) a   (ring: reduce-scatter + all-gather)
    all_gather, reduce_scatter      (p-1)/p * S/B + (p-1) a       (S: the full, gathered size)
    all_to_all                      (p-1)/p * S/B + (p-1) a       (S: what one rank sends)
    broadcast, reduce               S/B + ceil(log2 p) a          (pipelined tree)
    gather, scatter                 (p-1)/p * S/B + ceil(log2 p) a (S: the root's whole buffer)
    barrier                         ceil(log2 p) a
    send / recv                     S/B + a                       (B, a: the pair's level)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torchneuron.distributed.topology import LinkSpec, Placement
from torchneuron.sim.specs import ChipSpec

#: Collective kinds the model knows, by the formula they follow.
RING_ALL_REDUCE = frozenset({"all_reduce"})
RING_ONE_PASS = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
TREE_PIPELINED = frozenset({"broadcast", "reduce"})
ROOTED = frozenset({"gather", "scatter"})
KINDS = RING_ALL_REDUCE | RING_ONE_PASS | TREE_PIPELINED | ROOTED | {"barrier", "send", "recv"}


@dataclass(frozen=True)
class Path:
    """What one rank of a group gets: bandwidth (bytes/s) and per-message latency (ns)."""

    bytes_per_s: float
    latency_ns: float
    level: str


def path(place: Placement, spec: ChipSpec, link: LinkSpec) -> Path:
    """The bandwidth and latency of the slowest level ``place`` spans."""
    level = place.level()
    bandwidth = link.core_bytes_per_s
    latency = link.core_latency_ns
    if level in ("chip", "node"):
        bandwidth = min(bandwidth, spec.interconnect.neuronlink_bytes_per_s_per_chip / place.max_per_chip())
        latency = link.neuronlink_latency_ns
    if level == "node":
        bandwidth = min(bandwidth, link.efa_bytes_per_s_per_node / place.max_per_node())
        latency = link.efa_latency_ns
    return Path(bandwidth, latency, level)


def collective_ns(kind: str, nbytes: int, place: Placement, spec: ChipSpec, link: LinkSpec) -> int:
    """Simulated nanoseconds a ``kind`` collective of ``nbytes`` takes on the group ``place``."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {sorted(KINDS)}")
    p = place.size
    if p <= 1:
        return 0
    route = path(place, spec, link)
    transfer = nbytes / route.bytes_per_s * 1e9  # S/B in ns
    a = route.latency_ns
    steps = math.ceil(math.log2(p))
    if kind in RING_ALL_REDUCE:
        ns = 2 * (p - 1) / p * transfer + 2 * (p - 1) * a
    elif kind in RING_ONE_PASS:
        ns = (p - 1) / p * transfer + (p - 1) * a
    elif kind in TREE_PIPELINED:
        ns = transfer + steps * a
    elif kind in ROOTED:
        ns = (p - 1) / p * transfer + steps * a
    elif kind == "barrier":
        ns = steps * a
    else:  # send / recv: the pair's own path
        ns = transfer + a
    return max(0, round(ns))
