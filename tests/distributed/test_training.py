"""DDP, FSDP2 (fp32 and bf16 policy), tensor parallel and FSDP2 x TP under torchrun, and DDP
over two torchrun "nodes", each against single-device training of the same model.

``examples/distributed/train_parallel.py`` trains 20 steps and, on rank 0, trains the same
model on one neuron device on the whole batch (the bf16 policy against a single-device
emulation of it: bf16 compute per data-parallel slice, fp32 gradient mean). Only the order
of floating-point sums differs (all-reduce vs one batch), so losses and final parameters
must agree to 1e-4 relative: fp32 rounding (~1e-7) grown over 20 AdamW steps stays far
below it, while a missing or wrong gradient exchange moves them by 1e-3 or more.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "distributed" / "train_parallel.py"
TOLERANCE = 1e-4


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _check(reports: list[dict], expected: list[str], level: str) -> None:
    assert [r["parallel"] for r in reports] == expected
    for r in reports:
        assert r["steps"] == 20 and len(r["losses"]) == 20
        assert r["max_loss_relative_error"] <= TOLERANCE, r["parallel"]
        assert r["max_param_relative_error"] <= TOLERANCE, r["parallel"]
        assert r["collectives"] > 0 and r["levels"] == [level]


@pytest.mark.parametrize("ranks,parallel", [(2, "ddp,fsdp,fsdp-bf16,tp"), (4, "fsdp-tp")])
def test_parallel_training_matches_single_device(tmp_path, ranks, parallel):
    report = tmp_path / "report.json"
    proc = subprocess.run(_torchrun("--standalone", "--nproc-per-node", str(ranks), str(SCRIPT),
                                    "--parallel", parallel, "--report", str(report)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check(json.loads(report.read_text()), parallel.split(","), "core")


# Runs a script with the main thread keeping the GIL until it blocks (a switch interval of 100 s instead of 5 ms)
_HOLD_GIL = """
import runpy, sys
sys.setswitchinterval(100.0)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ranks_exit_right_after_their_last_collective(tmp_path):
    # Gloo's worker threads once destroyed the works of finished collectives, which hold tensors made in Python,
    # taking the GIL; one still waiting for it when the interpreter finalized ended its thread inside a noexcept
    # destructor ("terminate called without an active exception"). Holding the GIL on the main thread made the
    # workers wait past the exit of the ranks that leave right after their last all-gather: with the fused
    # cross-entropy's autograd kernel registered (its removal at exit shifts the exit sequence), most runs aborted.
    wrapper = tmp_path / "hold_gil.py"
    wrapper.write_text(_HOLD_GIL)
    proc = subprocess.run(_torchrun("--standalone", "--nproc-per-node", "4", str(wrapper), str(SCRIPT),
                                    "--parallel", "fsdp-tp", "--steps", "3"),
                          capture_output=True, text=True, timeout=600)
    assert "terminate called" not in proc.stderr
    assert proc.returncode == 0, proc.stderr[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_across_two_nodes_on_one_machine(tmp_path):
    # the command real hosts run, with the rendezvous on localhost: one process per "node"
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE",)}
    report = tmp_path / "report.json"
    nodes = [subprocess.Popen(_torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                                        "--master-addr", "127.0.0.1", "--master-port", port, str(SCRIPT),
                                        "--parallel", "ddp", "--report", str(report)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for n in range(2)]
    outputs = [n.communicate(timeout=600) for n in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-4000:]
    _check(json.loads(report.read_text()), ["ddp"], "node")  # the collectives crossed EFA in the model
