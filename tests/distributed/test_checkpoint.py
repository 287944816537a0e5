"""Distributed checkpointing of an FSDP2-sharded model on neuron: saved by 4 ranks, loaded by
2 (resharded), every parameter and optimizer state bit-exact.

One 4-rank world saves; then ranks 0 and 1 alone (a 2-rank process group and mesh, as a
2-rank job would have) build a differently initialized model, shard it over their 2 ranks
and load the checkpoint. (One world instead of two saves a world's start-up time.)"""
from __future__ import annotations

import pytest
import torch

from distributed.world import run_world_once

SIZES = (13, 24, 7)  # odd sizes: the shards of 4 and of 2 ranks are uneven and differ


def _model(seed: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in zip(SIZES, SIZES[1:])]
    return torch.nn.Sequential(*layers).to(device)


def _sharded(seed: int, mesh):
    from torch.distributed.fsdp import fully_shard

    model = _model(seed, torch.device("neuron", torch.neuron.current_device()))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _full(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _full(v).items()})
        elif isinstance(v, torch.Tensor):
            out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
    return out


def checkpoint_worker(rank: int, world: int, path: str) -> dict:
    """Save on all 4 ranks; load on ranks 0 and 1; return the full states saved and loaded."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    model, opt = _sharded(seed=1, mesh=init_device_mesh("neuron", (world,)))
    x = torch.randn(5, SIZES[0], generator=torch.Generator().manual_seed(rank)).to("neuron")
    model(x).square().mean().backward()
    opt.step()  # parameters and Adam's moments now differ from any initialization
    model_state, opt_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=path)
    out = {"saved": {"model": _full(model_state), "optim": _full(opt_state)}}

    pair = dist.new_group([0, 1])
    if rank < 2:
        model, opt = _sharded(seed=2, mesh=DeviceMesh.from_group(pair, "neuron"))
        model(torch.randn(5, SIZES[0]).to("neuron")).sum().backward()
        opt.step()  # creates the optimizer state that the load overwrites
        model_state, opt_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": opt_state}
        dcp.load(state, checkpoint_id=path, process_group=pair)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        model_state, opt_state = get_state_dict(model, opt)
        out["loaded"] = {"model": _full(model_state), "optim": _full(opt_state),
                         "shards": {n: (p.to_local().device.type, p.device_mesh.size())
                                    for n, p in model.named_parameters()}}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world_once(tmp_path_factory, "checkpoint", checkpoint_worker, 4,
                          lambda base: (str(base / "checkpoint"),))[0]


def test_save_on_4_load_on_2_is_bit_exact(results):
    reference = results[0]["saved"]
    assert set(reference["model"]) == {f"{i}.{w}" for i in (0, 1) for w in ("weight", "bias")}
    assert any(k.endswith("exp_avg_sq") for k in reference["optim"])
    for r in results[:2]:
        loaded = r["loaded"]
        assert set(loaded["shards"].values()) == {("neuron", 2)}
        for part in ("model", "optim"):
            assert set(loaded[part]) == set(reference[part])
            for k, v in reference[part].items():
                assert torch.equal(loaded[part][k], v), f"{part} {k}"
