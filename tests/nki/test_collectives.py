"""``nki.collectives`` on a launch of several ranks (``kernel.ranks(n)``): results against NumPy, replica groups
and ``rank_id`` as documented, times equal to the process group's cost formula, and the errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torchneuron import nki
import torchneuron.nki.collectives as ncc
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.distributed.cost import collective_ns
from torchneuron.distributed.topology import links, placement
from torchneuron.sim import SimulatorError
from torchneuron.sim.specs import chip_spec

RNG = np.random.default_rng(12)
TRN2 = chip_spec("trn2")


def _ints(*shape: int) -> np.ndarray:
    """Integer-valued fp32 data: sums of a few of them are exact in fp32, so reductions compare bit for bit."""
    return RNG.integers(-1000, 1000, shape).astype(np.float32)


def _groups(world: int, size: int) -> list[list[int]]:
    return [list(range(g, g + size)) for g in range(0, world, size)]


@nki.jit
def all_reduce_kernel(x, groups, op):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    ncc.all_reduce(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup(groups), op=op)
    return out


@pytest.mark.parametrize("world,size", [(2, 2), (4, 4), (4, 2)])
def test_all_reduce_is_the_group_sum_min_max(world, size):
    x = _ints(world, 128, 64)
    groups = _groups(world, size)
    for op, ref in ((nl.add, np.sum), (nl.maximum, np.max), (nl.minimum, np.min)):
        out = all_reduce_kernel.ranks(world)(x, groups, op)
        for g in groups:
            for r in g:
                np.testing.assert_array_equal(out[r], ref(x[g], axis=0))


def test_all_reduce_of_random_fp32_within_its_summation_bound_and_bf16_rounded_once():
    x = RNG.standard_normal((4, 64, 32)).astype(np.float32)
    out = all_reduce_kernel.ranks(4)(x, [[0, 1, 2, 3]], nl.add)
    exact = x.astype(np.float64).sum(0)
    assert np.all(np.abs(out[2] - exact) <= 3 * 2**-24 * np.abs(x).astype(np.float64).sum(0))  # 3 fp32 adds
    xb = torch.from_numpy(x).bfloat16()
    out = all_reduce_kernel.ranks(4)(xb, [[0, 1, 2, 3]], nl.add)
    fp32 = ((xb[0].float() + xb[1].float()) + xb[2].float()) + xb[3].float()  # group order, in fp32
    assert out.dtype == torch.bfloat16 and torch.equal(out[1], fp32.bfloat16())


@nki.jit
def gather_kernel(x, groups):
    out = nl.ndarray((len(groups[0]) * x.shape[0], x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    ncc.all_gather(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup(groups), collective_dim=0)
    return out


@nki.jit
def sbuf_gather_kernel(x, groups):
    p = len(groups[0])
    out = nl.ndarray((x.shape[0], p * x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    mine = nl.load(x)
    whole = nl.ndarray((x.shape[0], p * x.shape[1]), x.dtype, buffer=nl.sbuf)
    ncc.all_gather(srcs=[mine], dsts=[whole], replica_group=ncc.ReplicaGroup(groups), collective_dim=1)
    nl.store(out, whole)
    return out


def test_all_gather_on_hbm_and_sbuf_in_group_order():
    x = _ints(4, 32, 16)
    groups = [[3, 1], [0, 2]]
    out = gather_kernel.ranks(4)(x, groups)
    for g in groups:
        for r in g:
            np.testing.assert_array_equal(out[r], np.concatenate([x[q] for q in g], axis=0))
    out = sbuf_gather_kernel.ranks(4)(x, groups)
    for g in groups:
        for r in g:
            np.testing.assert_array_equal(out[r], np.concatenate([x[q] for q in g], axis=1))


def test_reduce_scatter_and_all_to_all():
    @nki.jit
    def rs(x):
        out = nl.ndarray((x.shape[0] // 4, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
        ncc.reduce_scatter(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1, 2, 3]]), collective_dim=0,
                           op=nl.add)
        return out

    @nki.jit
    def a2a(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        ncc.all_to_all(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1, 2, 3]]), collective_dim=0)
        return out

    x = _ints(4, 64, 8)
    out = rs.ranks(4)(x)
    for j in range(4):
        np.testing.assert_array_equal(out[j], x[:, 16 * j:16 * (j + 1)].sum(0))
    out = a2a.ranks(4)(x)
    for j in range(4):
        np.testing.assert_array_equal(out[j], np.concatenate([x[i, 16 * j:16 * (j + 1)] for i in range(4)]))


def test_coalesced_all_reduce_reduces_each_tensor():
    @nki.jit
    def two(a, b):
        oa = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        ob = nl.ndarray(b.shape, b.dtype, buffer=nl.shared_hbm)
        ncc.all_reduce(srcs=[a, b], dsts=[oa, ob], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)
        return oa, ob

    a, b = _ints(2, 16, 8), RNG.integers(-9, 9, (2, 4, 4)).astype(np.int32)
    oa, ob = two.ranks(2)(a, b)
    np.testing.assert_array_equal(oa[1], a.sum(0))
    np.testing.assert_array_equal(ob[0], b.sum(0))


def test_collective_permute_and_the_implicit_ring():
    @nki.jit
    def swap(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)  # a rank no pair targets keeps its own data
        ncc.collective_permute(srcs=[x], dsts=[out], source_target_pairs=[(0, 1), (1, 0), (2, 3)])
        return out

    x = _ints(4, 8, 8)
    out = swap.ranks(4)(x)
    for r, src in ((0, 1), (1, 0), (3, 2), (2, 2)):
        np.testing.assert_array_equal(out[r], x[src])

    @nki.jit
    def ring(x, y):
        g = ncc.ReplicaGroup([[0, 1, 2], [3]])
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        red = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        ncc.collective_permute_implicit(srcs_by_channel=[[x]], dsts_by_channel=[[out]], replica_group=g)
        ncc.collective_permute_implicit_reduce(srcs0_by_channel=[[x]], srcs1_by_channel=[[y]],
                                               dsts_by_channel=[[red]], replica_group=g, op=nl.maximum)
        return out, red

    x, y = _ints(4, 8, 8), _ints(4, 8, 8)
    out, red = ring.ranks(4)(x, y)
    for r, pred in ((0, 2), (1, 0), (2, 1), (3, 3)):
        np.testing.assert_array_equal(out[r], x[pred])
        np.testing.assert_array_equal(red[r], np.maximum(x[pred], y[pred]))


def test_rank_id_and_the_ring_step_rank_ids():
    @nki.jit
    def ids(x):
        out = nl.ndarray((1, 4), nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t[0:1, 0:1], value=ncc.rank_id())
        g = ncc.ReplicaGroup([[0, 2, 1]])
        for step in range(3):
            reg = ncc.collective_permute_implicit_current_processing_rank_id(iteration_id=step, replica_group=g)
            nisa.register_store(dst=t[0:1, step + 1:step + 2], src=reg)
        nl.store(out, t)
        return out

    out = ids.ranks(3)(np.zeros((3, 1), np.float32))
    ring = [0, 2, 1]
    for r in range(3):
        k = ring.index(r)
        assert out[r].tolist() == [[r] + [ring[(k - s) % 3] for s in range(3)]]


def test_variable_length_all_gather_and_all_to_all():
    p = 4

    @nki.jit
    def agv(x, meta):
        out = nl.ndarray((p * 8,), x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=nl.ndarray((p * 8,), x.dtype, buffer=nl.shared_hbm))
        ncc.all_gather_v(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([list(range(p))]),
                         metadata_tensor=meta)
        return out, meta

    x = _ints(p, 16)
    meta = np.zeros((p, 3, p), np.uint32)
    for r in range(p):
        meta[r, 0, 0], meta[r, 1, 0] = r + 2, r  # rank r sends r+2 elements from element r
    out, got = agv[2].ranks(p)(x, meta.copy())   # LNC=2, 4 ranks on one trn2 chip: the published deployment
    for r in range(p):
        for s in range(p):
            np.testing.assert_array_equal(out[r][8 * s:8 * s + s + 2], x[s, s:2 * s + 2])
        assert got[r][2].tolist() == [s + 2 for s in range(p)]  # row 2: the counts received

    # all_to_all_v on trn3 (NeuronSwitch): LNC=2, the rank list every rank of two devices (4 ranks a device)
    q = 8

    @nki.jit
    def a2av(x, meta):
        out = nl.ndarray((q * 8,), x.dtype, buffer=nl.shared_hbm)
        ncc.all_to_all_v(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([list(range(q))]),
                         metadata_tensor=meta, recv_counts_known=True)
        return out

    x = _ints(q, 32)
    meta = np.zeros((q, 3, q), np.uint32)
    for s in range(q):
        for d in range(q):
            meta[s, 0, d], meta[s, 1, d] = (s + d) % 3 + 1, 4 * d  # to d: (s+d)%3+1 elements from 4d
    out = nki.profile(a2av[2].ranks(q), chip="trn3")(x, meta).outputs
    for d in range(q):
        for s in range(q):
            n = (s + d) % 3 + 1
            np.testing.assert_array_equal(out[d][8 * s:8 * s + n], x[s, 4 * d:4 * d + n])


@nki.jit
def a2av_groups(x, meta, groups):
    out = nl.ndarray((16,), x.dtype, buffer=nl.shared_hbm)
    ncc.all_to_all_v(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup(groups), metadata_tensor=meta,
                     recv_counts_known=True)
    return out


def test_all_to_all_v_keeps_its_published_deployment_limits():
    # NeuronSwitch (trn3): "requires LNC=2 and more than one participating device ... every device participating in
    # that rank-list must have all of its ranks ... sequential ranks"; other chips: "only inter-node replica groups:
    # each rank-list contains same-indexed ranks from different nodes"; has_rdispls only on NeuronSwitch
    x = _ints(34, 16)
    meta = np.zeros((34, 3, 2), np.uint32)
    meta[:, 0, :] = 2
    with pytest.raises(NotImplementedError, match="only LNC=2 is supported"):
        nki.profile(a2av_groups.ranks(8), chip="trn3")(x[:8], np.zeros((8, 3, 8), np.uint32), [list(range(8))])
    with pytest.raises(ValueError, match=r"every rank of more than one device, in order .* got \[0, 1, 2, 3\]"):
        nki.profile(a2av_groups[2].ranks(8), chip="trn3")(x[:8], np.zeros((8, 3, 4), np.uint32),
                                                          [[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(ValueError, match=r"only inter-node rank lists .* 128 ranks a node\), got \[0, 1\]"):
        a2av_groups.ranks(2)(x[:2], meta[:2], [[0, 1]])
    # trn1: 32 cores a node, so ranks r and r + 32 are same-indexed ranks of two nodes
    out = nki.profile(a2av_groups.ranks(34), chip="trn1")(x, meta, [[0, 32], [1, 33]]).outputs
    for r, peer in ((0, 32), (32, 0), (1, 33)):
        mine, theirs = (0, 1) if r < 32 else (1, 0)
        np.testing.assert_array_equal(out[r][8 * mine:8 * mine + 2], x[r, :2])
        np.testing.assert_array_equal(out[r][8 * theirs:8 * theirs + 2], x[peer, :2])


def test_all_gather_v_keeps_its_published_deployment_limits():
    # "Only LNC=2 is supported"; "Each rank-list must have exactly 4 ranks (intra-chip)"
    @nki.jit
    def agv(x, meta, groups):
        out = nl.ndarray((16,), x.dtype, buffer=nl.shared_hbm)
        ncc.all_gather_v(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup(groups), metadata_tensor=meta)
        return out

    x, meta = _ints(8, 16), np.zeros((8, 3, 4), np.uint32)
    with pytest.raises(NotImplementedError, match="only LNC=2 is supported"):
        agv.ranks(4)(x[:4], meta[:4], [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"4 ranks on one chip .* got \[0, 1\]"):
        agv[2].ranks(4)(x[:4], np.zeros((4, 3, 2), np.uint32), [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"got \[0, 1, 2, 4\] \(4 ranks of two cores per trn2 chip\)"):
        agv[2].ranks(8)(x, meta, [[0, 1, 2, 4], [3, 5, 6, 7]])


def _collective_time(kernel, x, *args) -> float:
    return nki.profile(kernel)(x, *args).device_time_ns


def test_times_are_the_process_group_formula_for_size_and_placement():
    x = _ints(4, 128, 64)
    link = links(TRN2)
    per_node = TRN2.cores_per_chip * link.chips_per_node
    nbytes = 128 * 64 * 4
    # 4 ranks on the 4 first cores of one chip: core level
    want = collective_ns("all_reduce", nbytes, placement(range(4), TRN2, per_node), TRN2, link)
    assert _collective_time(all_reduce_kernel.ranks(4), x[:4], [[0, 1, 2, 3]], nl.add) == want
    assert want == round(2 * 3 / 4 * nbytes / TRN2.hbm_bytes_per_second_per_core * 1e9 + 2 * 3 * link.core_latency_ns)
    # 4 ranks on trn1 (2 cores per chip): two chips, NeuronLink (each chip's link shared by its 2 ranks)
    trn1 = chip_spec("trn1")
    on_chips = placement(range(4), trn1, trn1.cores_per_chip * links(trn1).chips_per_node)
    assert on_chips.level() == "chip"
    want = collective_ns("all_reduce", nbytes, on_chips, trn1, links(trn1))
    rep = nki.profile(all_reduce_kernel.ranks(4), chip="trn1")(x[:4], [[0, 1, 2, 3]], nl.add)
    assert rep.device_time_ns == want
    assert want == round(2 * 3 / 4 * nbytes / (trn1.interconnect.neuronlink_bytes_per_s_per_chip / 2) * 1e9
                         + 2 * 3 * links(trn1).neuronlink_latency_ns)
    # all-gather: S is the gathered size
    want = collective_ns("all_gather", 2 * nbytes, placement(range(2), TRN2, per_node), TRN2, link)
    assert _collective_time(gather_kernel.ranks(2), x[:2], [[0, 1]]) == want
    # LNC=2: rank r's instances are cores 2r, 2r+1; a collective's endpoints are cores 0 and 2
    assert _collective_time(shared_all_reduce[2].ranks(2), x[:2]) >= collective_ns(
        "all_reduce", nbytes, placement([0, 2], TRN2, per_node), TRN2, link)


@nki.jit
def shared_all_reduce(x):
    """LNC=2 per rank: both instances name the rank's shared tensors; the rank reduces once."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    ncc.all_reduce(srcs=[x], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)
    return out


def test_collectives_with_two_cores_per_rank():
    x = _ints(2, 128, 64)
    out = shared_all_reduce[2].ranks(2)(x)
    np.testing.assert_array_equal(out[0], x.sum(0))
    np.testing.assert_array_equal(out[1], x.sum(0))

    @nki.jit
    def on_sbuf(x):
        t = nl.load(x)
        ncc.all_reduce(srcs=[t], dsts=[t], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)

    with pytest.raises(NotImplementedError, match="must be the rank's shared HBM tensors"):
        on_sbuf[2].ranks(2)(x)


def test_bad_groups_shapes_and_operands_raise():
    x = _ints(4, 16, 8)
    with pytest.raises(ValueError, match="rank 1 appears twice"):
        all_reduce_kernel.ranks(4)(x, [[0, 1], [1, 2]], nl.add)
    with pytest.raises(ValueError, match="rank 4 of replica group .* is not a rank of the launch"):
        all_reduce_kernel.ranks(4)(x, [[0, 4]], nl.add)
    with pytest.raises(ValueError, match="op must be nl.add, nl.minimum or nl.maximum"):
        all_reduce_kernel.ranks(4)(x, [[0, 1]], nl.multiply)
    with pytest.raises(ValueError, match=r"for a group of 1 ranks dst must have shape \[16, 8\], got \[48, 8\]"):
        gather_kernel.ranks(4)(x, [[0, 1, 2], [3]])  # out sized for 3: the group of 1 disagrees
    with pytest.raises(ValueError, match=r"not a rank of the launch \(ranks 0..0\); launch several ranks with"):
        all_reduce_kernel(x[0], [[0, 1]], nl.add)
    with pytest.raises(ValueError, match="argument 'x' must hold one slice per rank"):
        all_reduce_kernel.ranks(3)(x, [[0, 1]], nl.add)

    @nki.jit
    def mixed(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        ncc.all_reduce(srcs=[nl.load(x)], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)

    with pytest.raises(ValueError, match="all tensors must be on HBM or all on SBUF"):
        mixed.ranks(2)(x[:2])

    @nki.jit
    def rank_shapes(x):  # SPMD broken: rank 1 reduces a different shape
        rows = 8 if ncc.rank_id() == 0 else 4
        out = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
        ncc.all_reduce(srcs=[x[0:rows, :]], dsts=[out], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)
        return out

    with pytest.raises(SimulatorError, match="disagree on cross-core instruction 0"):
        rank_shapes.ranks(2)(x[:2])

    @nki.jit
    def a2a_sbuf(x):
        t = nl.load(x)
        ncc.all_to_all(srcs=[t], dsts=[t], replica_group=ncc.ReplicaGroup([[0, 1]]), collective_dim=0)

    with pytest.raises(ValueError, match="tensors must be on HBM"):
        a2a_sbuf.ranks(2)(x[:2])
    with pytest.raises(ValueError, match="receives twice"):
        nki.jit(lambda x: ncc.collective_permute([x], [x], [(0, 1), (2, 1)])).ranks(4)(x)
