"""Faults: ranks that disagree on a collective get a clear error (and the group still works);
a rank that dies makes the others raise at once, and one that never joins a collective makes
the others raise after the process group's timeout, instead of hanging."""
from __future__ import annotations

import os
import time

import pytest
import torch

from distributed.world import run_world_once

PG_TIMEOUT_S = 20.0


def faults_worker(rank: int, world: int, result_path: str) -> dict:
    import torch.distributed as dist

    out: dict = {}
    x = torch.ones(4 + rank, device="neuron")  # rank 1 has one element more
    try:
        dist.all_reduce(x)
        out["mismatch"] = None
    except RuntimeError as e:
        out["mismatch"] = str(e)
    out["untouched"] = x.cpu()
    y = torch.full((2,), float(rank), device="neuron", dtype=torch.bfloat16 if rank else torch.float32)
    try:
        dist.broadcast(y, src=0)
        out["dtype_mismatch"] = None
    except RuntimeError as e:
        out["dtype_mismatch"] = str(e)
    f8 = torch.ones(4, device="neuron", dtype=torch.float8_e4m3fn)
    try:
        dist.all_reduce(f8)
        out["float8_reduce"] = None
    except RuntimeError as e:
        out["float8_reduce"] = str(e)
    base = torch.arange(12.0, device="neuron").reshape(3, 4)
    try:
        dist.all_reduce(base[:, 1:3])  # Gloo alone would reduce the wrong elements (its first 6 in memory)
        out["strided"] = None
    except RuntimeError as e:
        out["strided"] = str(e)
    out["strided_base"] = base.cpu()
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,)).to("neuron")
    try:
        dist.all_reduce(sparse)
        out["sparse"] = None
    except NotImplementedError as e:
        out["sparse"] = str(e)
    z = torch.full((3,), float(rank + 1), device="neuron")
    dist.all_reduce(z)  # the group still works after the refused collectives
    out["after"] = z.cpu()

    if rank == 1:
        torch.save(out, result_path.format(rank=rank))
        os._exit(0)  # dies without a word to the others
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8, device="neuron"))
        out["dead"] = None
    except RuntimeError as e:
        out["dead"] = type(e).__name__ + ": " + str(e).splitlines()[0]
    out["dead_after_s"] = time.monotonic() - start
    return out


HANG_TIMEOUT_S = 3.0


def hang_worker(rank: int, world: int) -> dict:
    """Rank 1 stays alive but never joins the all-reduce; rank 0 must give up after the timeout."""
    import torch.distributed as dist

    if rank == 1:
        time.sleep(HANG_TIMEOUT_S + 1.5)  # outlives the timeout, then leaves
        return {}
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8, device="neuron"))
        error = None
    except RuntimeError as e:
        error = str(e).splitlines()[0]
    return {"error": error, "after_s": time.monotonic() - start}


@pytest.fixture(scope="module")
def hang(tmp_path_factory):
    return run_world_once(tmp_path_factory, "hang", hang_worker, 2, pg_timeout_s=HANG_TIMEOUT_S, timeout=60)[0]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world_once(tmp_path_factory, "faults", faults_worker, 2, lambda base: (str(base / "rank{rank}.pt"),),
                          pg_timeout_s=PG_TIMEOUT_S, timeout=PG_TIMEOUT_S + 60)[0]


def test_shape_mismatch_is_a_clear_error_on_every_rank(results):
    for rank, r in enumerate(results):
        msg = r["mismatch"]
        assert msg is not None and "disagree" in msg
        assert "rank 0: allreduce(float32, shape [4]" in msg and "rank 1: allreduce(float32, shape [5]" in msg
        assert torch.equal(r["untouched"], torch.ones(4 + rank))  # nothing was exchanged


def test_dtype_mismatch_is_a_clear_error(results):
    for r in results:
        assert "rank 0: broadcast(float32" in r["dtype_mismatch"]
        assert "rank 1: broadcast(bfloat16" in r["dtype_mismatch"]


def test_float8_reductions_are_refused(results):
    for r in results:
        assert "all_reduce of torch.float8_e4m3fn tensors: 8-bit floats cannot be reduced" in r["float8_reduce"]


def test_non_contiguous_tensors_are_refused_on_every_rank(results):
    for r in results:
        assert r["strided"] == ("allreduce: Tensors must be contiguous; pass t.contiguous() (and copy the result "
                                "back into the view if it is an output)")
        assert torch.equal(r["strided_base"], torch.arange(12.0).reshape(3, 4))


def test_sparse_collectives_are_refused(results):
    # (they would otherwise take the generic CPU fallback and leave the tensor unreduced)
    for r in results:
        assert "c10d::allreduce_: collectives on sparse neuron tensors are not supported yet" in r["sparse"]


def test_group_still_works_after_a_refused_collective(results):
    for r in results:
        assert torch.equal(r["after"], torch.full((3,), 3.0))


def test_dead_rank_raises_within_the_timeout(results):
    r = results[0]
    assert r["dead"] is not None
    assert r["dead_after_s"] < PG_TIMEOUT_S + 5.0


def test_silent_rank_raises_after_the_timeout(hang):
    r = hang[0]
    assert r["error"] is not None and "timed out" in r["error"].lower()
    assert HANG_TIMEOUT_S - 0.5 <= r["after_s"] < HANG_TIMEOUT_S + 5.0
