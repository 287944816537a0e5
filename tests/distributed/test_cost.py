"""The collective cost model and the topology, pinned to the spec table and the formulas of
docs/hardware-model.md ("Collectives"); and Tensor.record_stream on neuron tensors."""
from __future__ import annotations

import math

import pytest
import torch

from torchneuron.distributed import cost
from torchneuron.distributed.topology import LINKS, links, local_world_size, placement
from torchneuron.sim.specs import chip_spec

TRN2 = chip_spec("trn2")
LINK = links(TRN2)
MiB = 1 << 20


def test_placement_levels_follow_cores_chips_and_nodes():
    # trn2: 8 cores per chip; 64 ranks per node here
    assert placement([0, 1], TRN2, 64).level() == "core"
    assert placement([0, 8], TRN2, 64).level() == "chip"
    assert placement([0, 64], TRN2, 64).level() == "node"
    four_chips = placement(range(32), TRN2, 64)
    assert four_chips.max_per_chip() == 8 and four_chips.max_per_node() == 32


def test_bandwidth_is_the_slowest_level_shared_by_its_ranks():
    one_chip = cost.path(placement([0, 1, 2, 3], TRN2, 64), TRN2, LINK)
    assert one_chip.bytes_per_s == TRN2.hbm_bytes_per_second / TRN2.cores_per_chip
    assert one_chip.latency_ns == 1000.0
    # 2 chips, 8 cores each: each core gets 1/8 of its chip's NeuronLink-v3 1.28 TB/s
    two_chips = cost.path(placement(range(16), TRN2, 64), TRN2, LINK)
    assert two_chips.bytes_per_s == 1.28e12 / 8 and two_chips.latency_ns == 2000.0
    # 2 nodes of one rank each: the node's 3.2 Tbps EFA, unless the core's HBM share is slower
    two_nodes = cost.path(placement([0, 1], TRN2, 1), TRN2, LINK)
    assert two_nodes.bytes_per_s == min(3.2e12 / 8, TRN2.hbm_bytes_per_second / TRN2.cores_per_chip)
    assert two_nodes.latency_ns == LINKS["trn2"].efa_latency_ns
    # 2 nodes of 16 ranks: 16 ranks share the node's EFA
    busy_nodes = cost.path(placement(range(32), TRN2, 16), TRN2, LINK)
    assert busy_nodes.bytes_per_s == 3.2e12 / 8 / 16


@pytest.mark.parametrize("kind,bandwidth_factor,latency_steps", [
    ("all_reduce", lambda p: 2 * (p - 1) / p, lambda p: 2 * (p - 1)),
    ("all_gather", lambda p: (p - 1) / p, lambda p: p - 1),
    ("reduce_scatter", lambda p: (p - 1) / p, lambda p: p - 1),
    ("all_to_all", lambda p: (p - 1) / p, lambda p: p - 1),
    ("broadcast", lambda p: 1.0, lambda p: math.ceil(math.log2(p))),
    ("reduce", lambda p: 1.0, lambda p: math.ceil(math.log2(p))),
    ("gather", lambda p: (p - 1) / p, lambda p: math.ceil(math.log2(p))),
    ("scatter", lambda p: (p - 1) / p, lambda p: math.ceil(math.log2(p))),
    ("barrier", lambda p: 0.0, lambda p: math.ceil(math.log2(p))),
])
@pytest.mark.parametrize("p", [2, 3, 8, 16])
def test_formulas(kind, bandwidth_factor, latency_steps, p):
    place = placement(range(p), TRN2, 64)
    route = cost.path(place, TRN2, LINK)
    expected = bandwidth_factor(p) * 4 * MiB / route.bytes_per_s * 1e9 + latency_steps(p) * route.latency_ns
    assert cost.collective_ns(kind, 4 * MiB, place, TRN2, LINK) == round(expected)


def test_send_recv_and_single_rank():
    pair = placement([0, 9], TRN2, 64)  # two chips
    bandwidth = min(1.28e12, TRN2.hbm_bytes_per_second / TRN2.cores_per_chip)  # one rank per chip
    assert cost.collective_ns("send", MiB, pair, TRN2, LINK) == round(MiB / bandwidth * 1e9 + 2000.0)
    assert cost.collective_ns("all_reduce", MiB, placement([3], TRN2, 64), TRN2, LINK) == 0


def test_unknown_kind_and_bad_local_world_size(monkeypatch):
    with pytest.raises(ValueError, match="unknown collective kind"):
        cost.collective_ns("allreduce", 1, placement([0, 1], TRN2, 64), TRN2, LINK)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        local_world_size(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_world_size(4) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_world_size(4) == 4


def test_record_stream_on_neuron_tensors():
    t = torch.ones(4, device="neuron")
    t.record_stream(torch.neuron.Stream())  # execution is in stream order: nothing to defer
    with pytest.raises(RuntimeError, match="expected a neuron stream"):
        t.record_stream(torch.Stream(device="cpu"))
