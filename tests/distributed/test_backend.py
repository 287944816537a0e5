"""The ``neuron`` backend's registration, Work objects, DeviceMesh/DTensor, and simulated time.

One 2-rank world (default group created with no backend named, as on a CUDA machine)
checks: which backend each way of naming it gives, per device; async Work; DTensor over a
DeviceMesh against the full tensor; and the collective's simulated time against the ring
formula computed here from the chip's published figures.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from distributed.world import run_world_once

WORLD = 2
NBYTES = 1 << 20


def backend_worker(rank: int, world: int, trace_path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from torchneuron.runtime import profiler

    out: dict = {}
    names = {}
    for label, group in (("default", dist.group.WORLD), ("neuron", dist.new_group(backend="neuron")),
                         ("mixed", dist.new_group(backend="cpu:gloo,neuron:neuron"))):
        names[label] = {d: type(group._get_backend(torch.device(d))).__name__ for d in ("cpu", "neuron")
                        if label != "default" or d == "neuron"}
        x = torch.full((3,), float(rank + 1), device="neuron")
        dist.all_reduce(x, group=group)
        c = torch.full((3,), float(rank + 1))
        if label != "default":  # a group made with no backend serves the accelerator only, as with NCCL
            dist.all_reduce(c, group=group)
        out[f"sum-{label}"] = (x.cpu(), c)
    out["names"] = names

    # async Work: done, its future holds the neuron tensor
    x = torch.arange(4.0, device="neuron") * (rank + 1)
    work = dist.all_reduce(x, async_op=True)
    out["wait"] = work.wait()
    value = work.get_future().value()
    out["future"] = (value[0].device.type, value[0].cpu(), x.cpu())

    # DTensor on a DeviceMesh: Shard(0) from rank 0's data, gathered back
    mesh = init_device_mesh("neuron", (world,))
    full = torch.arange(24.0).reshape(6, 4) * (rank + 1)  # only rank 0's copy counts (src_data_rank=0)
    dt = distribute_tensor(full.to("neuron"), mesh, [Shard(0)])
    out["dtensor_local"] = dt.to_local().cpu()
    out["dtensor_full"] = dt.redistribute(mesh, [Replicate()]).to_local().cpu()

    # a random op on a sharded DTensor draws the local shard from this rank's generator (as on CPU meshes)
    torch.neuron.manual_seed(100 + rank)
    expected = torch.empty(3, 4, device="neuron").normal_()
    torch.neuron.manual_seed(100 + rank)
    dt = distribute_tensor(torch.zeros(6, 4, device="neuron"), mesh, [Shard(0)])
    torch.nn.init.normal_(dt)
    out["dtensor_random"] = (dt.to_local().cpu(), expected.cpu())

    # simulated time: skew the clocks, then one all-reduce of NBYTES
    stream = torch.neuron.current_stream()
    torch.neuron.synchronize()
    from torchneuron import _C

    y = torch.ones(NBYTES // 4, device="neuron")
    _C._advance_stream_clock(rank, stream.stream_id, 7000 * (rank + 1))
    before = torch.neuron.stream_clock_ns(stream)
    with profiler.record() as records:
        dist.all_reduce(y)
    after = torch.neuron.stream_clock_ns(stream)
    clocks = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(clocks, torch.tensor([before]), group=dist.new_group(backend="gloo"))
    (rec,) = [r for r in records if r.name == "all_reduce"]
    out["timing"] = dict(before=before, after=after, clocks=[int(c) for c in clocks], start=rec.start_ns,
                         end=rec.end_ns, wait=rec.wait_ns, device_time=rec.device_time_ns, level=rec.level)
    profiler.to_chrome_trace(trace_path.format(rank=rank), records)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world_once(tmp_path_factory, "backend", backend_worker, WORLD,
                          lambda base: (str(base / "trace-{rank}.json"),), backend=None)


def test_each_way_of_naming_the_backend(results):
    world_results, _ = results
    for r in world_results:
        assert r["names"]["default"] == {"neuron": "_ProcessGroupNeuron"}
        assert r["names"]["neuron"] == {"cpu": "_ProcessGroupNeuron", "neuron": "_ProcessGroupNeuron"}
        assert r["names"]["mixed"] == {"cpu": "ProcessGroupGloo", "neuron": "_ProcessGroupNeuron"}
        for label in ("default", "neuron", "mixed"):
            x, c = r[f"sum-{label}"]
            assert torch.equal(x, torch.full((3,), 3.0))
            if label != "default":
                assert torch.equal(c, torch.full((3,), 3.0))


def test_async_work_is_done_and_its_future_holds_the_neuron_tensor(results):
    for r in results[0]:
        assert r["wait"] is True
        device_type, value, x = r["future"]
        assert device_type == "neuron"
        assert torch.equal(value, torch.arange(4.0) * 3) and torch.equal(x, value)


def test_dtensor_shards_and_gathers_rank0_data(results):
    full = torch.arange(24.0).reshape(6, 4)
    for rank, r in enumerate(results[0]):
        assert torch.equal(r["dtensor_local"], full.chunk(WORLD)[rank])
        assert torch.equal(r["dtensor_full"], full)


def test_dtensor_random_ops_use_each_ranks_generator(results):
    draws = []
    for r in results[0]:
        local, expected = r["dtensor_random"]
        assert torch.equal(local, expected)
        draws.append(local)
    assert not torch.equal(draws[0], draws[1])  # the ranks' seeds differ, so do their shards


def test_all_reduce_time_and_record(results):
    from torchneuron.config import CONFIG

    spec = CONFIG.chip
    # two cores of one chip: ring all-reduce at each core's HBM share, 1 us per step (docs/hardware-model.md)
    bandwidth = spec.hbm_bytes_per_second / spec.cores_per_chip
    expected = 2 * (WORLD - 1) / WORLD * NBYTES / bandwidth * 1e9 + 2 * (WORLD - 1) * 1000.0
    ends = set()
    for r in results[0]:
        t = r["timing"]
        assert t["level"] == "core"
        assert t["device_time"] == pytest.approx(expected, abs=1.0)  # whole nanoseconds
        start = max(t["clocks"])
        assert t["start"] == t["before"] and t["wait"] == start - t["before"]
        assert t["end"] == t["after"] == start + round(expected)
        ends.add(t["end"])
    assert len(ends) == 1  # every rank leaves the collective at the same time


def test_collectives_appear_in_the_chrome_trace(results):
    world_results, path = results
    for rank, r in enumerate(world_results):
        trace = json.load(open(path / f"trace-{rank}.json"))
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] == "all_reduce"]
        assert len(events) == 1
        (event,) = events
        assert event["pid"] == rank and event["args"]["op"] == "c10d::allreduce (SUM)"
        assert event["ts"] * 1000.0 == pytest.approx(r["timing"]["start"])
        assert (event["ts"] + event["dur"]) * 1000.0 == pytest.approx(r["timing"]["end"])


def test_import_torch_alone_registers_the_backend():
    # a fresh process that never imports torchneuron itself (the device autoloads)
    code = ("import torch.distributed as dist; "
            "print(dist.Backend.default_device_backend_map.get('neuron'), dist.Backend.backend_capability['neuron'], "
            "dist.Backend.default_device_backend_map.get('cpu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "neuron ['cpu', 'neuron'] gloo"
