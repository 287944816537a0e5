"""Run a function on every rank of a small local world (spawned processes), collect results.

``run_world(fn, 2, tmp_path)`` spawns two processes; each sets the torchrun environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), joins a process group through a file
store in ``tmp_path``, makes ``neuron:LOCAL_RANK`` its device, runs ``fn(rank, world_size,
*args)`` and saves what it returns; the caller gets the list of per-rank results. A world
that does not finish within ``timeout`` seconds is killed and raises TimeoutError.

``run_world_once`` runs a world once per test session even under pytest-xdist, whose
workers would otherwise each start their own copy for a module-scoped fixture.
"""
from __future__ import annotations

import datetime
import os
import pathlib
import time
from typing import Any, Callable

from filelock import FileLock

import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world_size: int, out_dir: str, backend: str | None, pg_timeout_s: float,
           args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    import torchneuron  # noqa: F401  (registers the backend, as `import torch` does by autoload)

    torch.neuron.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{out_dir}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable, world_size: int, tmp_path: pathlib.Path, *args: Any, backend: str | None = "neuron",
              timeout: float = 120.0, pg_timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results."""
    import torch

    ctx = mp.start_processes(_entry, args=(fn, world_size, str(tmp_path), backend, pg_timeout_s, args),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"the {world_size}-rank world did not finish within {timeout} s")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def run_world_once(tmp_path_factory: Any, key: str, fn: Callable, world_size: int,
                   args_for: Callable[[pathlib.Path], tuple] = lambda base: (), **kwargs: Any
                   ) -> tuple[list[Any], pathlib.Path]:
    """``run_world(fn, world_size, base, *args_for(base))`` once per session; return its results and
    ``base``, a directory shared by the session's xdist workers (the first one runs the world, the
    others wait for it and read its results)."""
    import torch

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's own
    base = root / f"world-{key}"
    with FileLock(str(base) + ".lock"):
        done = base / "done"
        if not done.exists():
            base.mkdir(exist_ok=True)
            run_world(fn, world_size, base, *args_for(base), **kwargs)
            done.touch()
    return [torch.load(base / f"rank{r}.pt", weights_only=False) for r in range(world_size)], base
