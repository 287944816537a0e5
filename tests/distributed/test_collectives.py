"""Every collective of the ``neuron`` backend on neuron tensors, against Gloo on CPU tensors.

One 3-rank world runs each collective twice with the same inputs: on neuron tensors
through the ``neuron`` backend, and on CPU tensors through a Gloo group (the reference
backend). Gloo moves the neuron tensors' bytes too, so results must be bit-identical
(tolerance 0: same algorithm, same reduction order, same rounding). A few results are
also checked against their formula (sums of small integers, concatenations), so a
broken reference cannot hide a broken result.
"""
from __future__ import annotations

import pytest
import torch

from distributed.world import run_world_once

WORLD = 3
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _data(rank: int, salt: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The same tensor wherever it is made: seeded by rank and case."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(-5, 6, shape, generator=g).to(dtype)


def collectives_worker(rank: int, world: int) -> dict:
    """Run every case on neuron (default group) and on CPU (a gloo group); return both results."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    gloo = dist.new_group(backend="gloo")
    results: dict[str, tuple[list, list]] = {}
    salt = [0]

    def case(name, shapes, dtype, run):
        """``run(inputs, group, device)`` -> output tensors; inputs are made identically on both devices."""
        salt[0] += 1
        inputs = [_data(rank, salt[0] * 10 + i, s, dtype) for i, s in enumerate(shapes)]
        on_neuron = run([t.to("neuron") for t in inputs], None, "neuron")
        on_cpu = run([t.clone() for t in inputs], gloo, "cpu")
        results[name] = ([t.cpu() for t in on_neuron], [t.clone() for t in on_cpu])

    for dtype in FLOATS:
        for op in OPS:
            def all_reduce(ts, group, device, op=op):
                dist.all_reduce(ts[0], op=getattr(dist.ReduceOp, op), group=group)
                return ts
            case(f"all_reduce-{op}-{dtype}", [(5, 7)], dtype, all_reduce)
    for dtype in (torch.float32, torch.bfloat16):
        # PREMUL_SUM (FSDP2's gradient division): Gloo lacks it; the reference is its definition,
        # each rank's input times the factor, then a Gloo SUM
        def premul_all_reduce(ts, group, device):
            if device == "neuron":
                dist.all_reduce(ts[0], op=dist._make_nccl_premul_sum(0.3), group=group)
                return ts
            scaled = ts[0] * 0.3
            dist.all_reduce(scaled, group=group)
            return [scaled]
        case(f"all_reduce-PREMUL_SUM-{dtype}", [(5, 7)], dtype, premul_all_reduce)

        def premul_reduce_scatter(ts, group, device):
            out = torch.empty(2, 5, dtype=ts[0].dtype, device=device)
            if device == "neuron":
                dist.reduce_scatter_tensor(out, ts[0], op=dist._make_nccl_premul_sum(0.3), group=group)
            else:
                dist.reduce_scatter_tensor(out, ts[0] * 0.3, group=group)
            return [out]
        case(f"reduce_scatter_tensor-PREMUL_SUM-{dtype}", [(world * 2, 5)], dtype, premul_reduce_scatter)
    for dtype in (torch.int32, torch.int64):
        for op in ("SUM", "MAX", "PRODUCT"):
            case(f"all_reduce-{op}-{dtype}", [(9,)], dtype,
                 lambda ts, group, device, op=op: dist.all_reduce(ts[0], op=getattr(dist.ReduceOp, op), group=group)
                 or ts)
    for dtype in (torch.float32, torch.bfloat16):
        case(f"broadcast-{dtype}", [(4, 3)], dtype,
             lambda ts, group, device: dist.broadcast(ts[0], src=1, group=group) or ts)
        case(f"reduce-{dtype}", [(6,)], dtype,
             lambda ts, group, device: dist.reduce(ts[0], dst=2, group=group) or ts)

        def all_gather(ts, group, device):
            outs = [torch.empty_like(ts[0]) for _ in range(world)]
            dist.all_gather(outs, ts[0], group=group)
            return outs
        case(f"all_gather-{dtype}", [(2, 5)], dtype, all_gather)

        def all_gather_into_tensor(ts, group, device):
            out = torch.empty(world * 4, 3, dtype=ts[0].dtype, device=device)
            dist.all_gather_into_tensor(out, ts[0], group=group)
            return [out]
        case(f"all_gather_into_tensor-{dtype}", [(4, 3)], dtype, all_gather_into_tensor)

        for op in ("SUM", "AVG", "MAX"):
            def reduce_scatter_tensor(ts, group, device, op=op):
                out = torch.empty(2, 5, dtype=ts[0].dtype, device=device)
                dist.reduce_scatter_tensor(out, ts[0], op=getattr(dist.ReduceOp, op), group=group)
                return [out]
            case(f"reduce_scatter_tensor-{op}-{dtype}", [(world * 2, 5)], dtype, reduce_scatter_tensor)

        def reduce_scatter(ts, group, device):
            out = torch.empty_like(ts[0])
            dist.reduce_scatter(out, ts, group=group)
            return [out]
        case(f"reduce_scatter-{dtype}", [(3,)] * world, dtype, reduce_scatter)

        def all_to_all(ts, group, device):
            outs = [torch.empty_like(t) for t in ts]
            dist.all_to_all(outs, ts, group=group)
            return outs
        case(f"all_to_all-{dtype}", [(2, 2)] * world, dtype, all_to_all)

        def all_to_all_single(ts, group, device):
            out = torch.empty_like(ts[0])
            dist.all_to_all_single(out, ts[0], group=group)
            return [out]
        case(f"all_to_all_single-{dtype}", [(world * 2, 3)], dtype, all_to_all_single)

        # uneven splits: rank r sends r + 1 rows to each rank and receives (peer + 1) from each
        def all_to_all_uneven(ts, group, device):
            out = torch.empty(sum(p + 1 for p in range(world)), 2, dtype=ts[0].dtype, device=device)
            dist.all_to_all_single(out, ts[0], [p + 1 for p in range(world)], [rank + 1] * world, group=group)
            return [out]
        case(f"all_to_all_single_uneven-{dtype}", [(world * (rank + 1), 2)], dtype, all_to_all_uneven)

        def gather(ts, group, device):
            outs = [torch.empty_like(ts[0]) for _ in range(world)] if rank == 0 else None
            dist.gather(ts[0], outs, dst=0, group=group)
            return outs or []
        case(f"gather-{dtype}", [(3, 2)], dtype, gather)

        def scatter(ts, group, device):
            out = torch.empty_like(ts[0])
            dist.scatter(out, list(ts) if rank == 1 else None, src=1, group=group)
            return [out]
        case(f"scatter-{dtype}", [(4,)] * world, dtype, scatter)

        def send_recv(ts, group, device):
            # a ring: each rank posts its receive and its send, then waits for both
            g = group or dist.group.WORLD
            peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
            out = torch.empty_like(ts[0])
            ops = [dist.P2POp(dist.irecv, out, peer_prev, g), dist.P2POp(dist.isend, ts[0], peer_next, g)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            return [out]
        case(f"send_recv-{dtype}", [(3, 3)], dtype, send_recv)

        def functional(ts, group, device):
            g = group or dist.group.WORLD
            a = funcol.all_reduce(ts[0], "sum", g)
            b = funcol.all_gather_tensor(ts[0], 0, g)
            c = funcol.reduce_scatter_tensor(ts[0], "sum", 0, g)
            return [funcol.wait_tensor(x) for x in (a, b, c)]
        case(f"functional-{dtype}", [(world * 2, 4)], dtype, functional)

    # 8-bit floats move as their bytes (Gloo has no such dtype): the reference moves the same bytes
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        def float8_moves(ts, group, device):
            if device == "cpu":
                ts = [t.view(torch.uint8) for t in ts]
            gathered = [torch.empty_like(ts[0]) for _ in range(world)]
            dist.all_gather(gathered, ts[0], group=group)
            dist.broadcast(ts[1], src=2, group=group)
            outs = [*gathered, ts[1]]
            return [t.view(dtype) for t in outs] if device == "cpu" else outs
        case(f"float8-all_gather-broadcast-{dtype}", [(3, 4), (5,)], dtype, float8_moves)

    # a subgroup of ranks 0 and 2 (rank 1 is not a member of either group)
    sub_neuron, sub_gloo = dist.new_group([0, 2]), dist.new_group([0, 2], backend="gloo")

    def subgroup(ts, group, device):
        g = sub_neuron if group is None else sub_gloo
        if rank in (0, 2):
            dist.all_reduce(ts[0], group=g)
        return ts
    case("subgroup-all_reduce", [(5,)], torch.float32, subgroup)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    return run_world_once(tmp_path_factory, "collectives", collectives_worker, WORLD)[0]


def _case_names() -> list[str]:
    names = [f"all_reduce-{op}-{d}" for d in FLOATS for op in OPS]
    names += [f"{c}-PREMUL_SUM-{d}" for d in (torch.float32, torch.bfloat16)
              for c in ("all_reduce", "reduce_scatter_tensor")]
    names += [f"all_reduce-{op}-{d}" for d in (torch.int32, torch.int64) for op in ("SUM", "MAX", "PRODUCT")]
    for d in (torch.float32, torch.bfloat16):
        names += [f"{c}-{d}" for c in ("broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                                       "all_to_all", "all_to_all_single", "all_to_all_single_uneven", "gather",
                                       "scatter", "send_recv", "functional")]
        names += [f"reduce_scatter_tensor-{op}-{d}" for op in ("SUM", "AVG", "MAX")]
    names += [f"float8-all_gather-broadcast-{d}" for d in (torch.float8_e4m3fn, torch.float8_e5m2)]
    return names + ["subgroup-all_reduce"]


@pytest.mark.parametrize("name", _case_names())
def test_matches_gloo_on_cpu(world_results, name):
    for rank, results in enumerate(world_results):
        on_neuron, on_cpu = results[name]
        assert len(on_neuron) == len(on_cpu), f"rank {rank}"
        for n, c in zip(on_neuron, on_cpu):
            assert n.dtype == c.dtype and n.shape == c.shape, f"rank {rank}"
            if n.dtype.itemsize == 1 and n.dtype.is_floating_point:  # 8-bit floats: compare their bytes
                n, c = n.view(torch.uint8), c.view(torch.uint8)
            torch.testing.assert_close(n, c, rtol=0, atol=0, equal_nan=True, msg=f"{name} on rank {rank}")


def test_sums_and_gathers_match_their_formula(world_results):
    # int32 sums are exact; float32 all_gather is a concatenation of each rank's data
    salts = {n: i + 1 for i, n in enumerate(world_results[0])}  # cases were made in this order
    expected_sum = sum(_data(r, salts["all_reduce-SUM-torch.int32"] * 10, (9,), torch.int32) for r in range(WORLD))
    expected_gather = [_data(r, salts["all_gather-torch.float32"] * 10, (2, 5), torch.float32) for r in range(WORLD)]
    for results in world_results:
        assert torch.equal(results["all_reduce-SUM-torch.int32"][0][0], expected_sum)
        for got, want in zip(results["all_gather-torch.float32"][0], expected_gather):
            assert torch.equal(got, want)
