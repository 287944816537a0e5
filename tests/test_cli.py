"""The ``torchneuron`` console script, run as a subprocess on tiny scripts.

References: the chip spec table and device properties (``ls``); the launch log the script
records itself and its own HBM peak (``profile``); the fallback counts and the script's own
line numbers (``check``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchneuron.neuron.memory import format_bytes
from torchneuron.sim.specs import CHIPS, chip_spec

COMMAND = Path(sys.executable).parent / "torchneuron"

# Launches a few kernels, falls back once (SVD), records its own launches and HBM peak as the reference.
SCRIPT = '''\
import json, sys
import torch
from torchneuron.runtime import profiler
with profiler.record() as records:
    x = torch.randn(64, 64, device="neuron")
    y = (x @ x).relu()
    for _ in range(3):
        y = y * 0.5 + 1.0
    u = torch.linalg.svd(y).S  # FALLBACK
    total = (y.sum() + u.sum()).item()
json.dump({"argv": sys.argv[1:], "launches": [[r.name, r.device_time_ns] for r in records],
           "peak": torch.neuron.max_memory_allocated()}, open(sys.argv[1], "w"))
'''
CLEAN = '''\
import torch
x = torch.randn(16, 16, device="neuron")
print((x @ x).sum().item() == (x @ x).sum().item())
'''


def _run(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    assert COMMAND.exists(), f"{COMMAND} is missing: install the package (make setup) to get the console script"
    return subprocess.run([str(COMMAND), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(SCRIPT)
    return path


def test_ls_lists_devices_chip_and_versions():
    for chip in ("trn2", "trn1"):
        out = _run("ls", env={"TORCHNEURON_CHIP": chip, "TORCHNEURON_NUM_DEVICES": ""})
        assert out.returncode == 0, out.stderr
        spec = chip_spec(chip)
        text = out.stdout
        assert f"chip: {chip} ({spec.core_generation}), {spec.cores_per_chip} cores per chip" in text
        assert f"torch {torch.__version__}" in text and "torchneuron " in text
        rows = [line.split() for line in text.splitlines() if line.strip().startswith("neuron:")]
        assert [r[0] for r in rows] == [f"neuron:{i}" for i in range(spec.cores_per_chip)]
        for r in rows:
            assert " ".join(r[3:5]) == format_bytes(spec.hbm_bytes_per_core)


def test_profile_reports_the_launch_log(script, tmp_path):
    ref_path, trace = tmp_path / "ref.json", tmp_path / "out" / "trace.json"
    out = _run("profile", "--trace", str(trace), "--progress", "0", str(script), str(ref_path), "extra")
    assert out.returncode == 0, out.stderr
    ref = json.loads(ref_path.read_text())
    assert ref["argv"] == [str(ref_path), "extra"]
    launches = ref["launches"]
    text = out.stdout
    device_ms = sum(t for _, t in launches) / 1e6
    assert f"{len(launches):,} kernel launches, {device_ms:.3f} ms simulated device time" in text
    # the kernel table: each kernel's calls and device time, the largest first
    totals: dict[str, list] = {}
    for name, t in launches:
        totals.setdefault(name, []).append(t)
    table = text.split("top kernels by device time:")[1].split("engine utilization")[0].strip().splitlines()[1:]
    rows = {line.split()[0]: line.split() for line in table}
    assert set(rows) == set(totals)
    for name, ts in totals.items():
        assert int(rows[name][-6]) == len(ts)
        assert float(rows[name][-5]) == pytest.approx(sum(ts) / 1e6, abs=1e-3)
    order = [line.split()[0] for line in table]
    assert order == sorted(totals, key=lambda n: -sum(totals[n]))
    assert "aten::_linalg_svd" in text.split("CPU fallbacks:")[1]
    assert f"HBM peak: {format_bytes(ref['peak'])} allocated on neuron:0" in text
    for engine in ("dma", "tensor", "vector", "scalar", "gpsimd"):
        assert f"  {engine}" in text.split("engine utilization")[1]
    # the trace: torch.profiler's Chrome trace with one kernel event per launch, of its device time
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    assert [k["name"] for k in kernels] == [n for n, _ in launches]
    for k, (_, t) in zip(kernels, launches):
        assert k["dur"] == pytest.approx(t / 1000, abs=2e-3)
    assert any(e.get("cat") == "cpu_op" for e in events)


def test_profile_device_only_trace(script, tmp_path):
    ref_path, trace = tmp_path / "ref.json", tmp_path / "dev.json"
    out = _run("profile", "--device-only", "--trace", str(trace), str(script), str(ref_path))
    assert out.returncode == 0, out.stderr
    launches = json.loads(ref_path.read_text())["launches"]
    kernels = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert [k["name"] for k in kernels] == [n for n, _ in launches]
    for k, (_, t) in zip(kernels, launches):
        assert k["args"]["device_time_ns"] == pytest.approx(t)


def test_check_lists_fallbacks_with_call_sites(script, tmp_path):
    out = _run("check", str(script), str(tmp_path / "ref.json"), env={"TORCHNEURON_STRICT": "1"})
    assert out.returncode == 1, out.stdout + out.stderr  # a fallback fails the check, as strict mode would
    line = SCRIPT.splitlines().index(next(s for s in SCRIPT.splitlines() if "# FALLBACK" in s)) + 1
    listed = [s for s in out.stdout.splitlines() if "aten::_linalg_svd" in s]
    assert len(listed) == 1 and listed[0].rstrip().endswith(f"at {script}:{line} (<module>)")
    peak = json.loads((tmp_path / "ref.json").read_text())["peak"]
    for name, chip in CHIPS.items():
        verdict = "fits" if peak <= chip.hbm_bytes_per_core else "does NOT fit"
        assert f"  {name} ({chip.core_generation}, {format_bytes(chip.hbm_bytes_per_core)} HBM per core): {verdict}" \
            in out.stdout


def test_check_passes_a_clean_script(tmp_path):
    path = tmp_path / "clean.py"
    path.write_text(CLEAN)
    out = _run("check", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "none: every op ran on the device" in out.stdout


def test_failing_script_still_reports(tmp_path):
    path = tmp_path / "fails.py"
    path.write_text(CLEAN + "raise ValueError('boom')\n")
    out = _run("profile", "--trace", str(tmp_path / "t.json"), str(path))
    assert out.returncode == 1
    assert "ValueError: boom" in out.stderr
    assert "exit status 1" in out.stdout and "top kernels by device time" in out.stdout


def test_long_runs_show_progress(tmp_path):
    path = tmp_path / "slow.py"
    path.write_text(CLEAN + "import time\ntime.sleep(1.0)\n")
    out = _run("check", "--progress", "0.3", str(path))
    assert out.returncode == 0
    progress = [s for s in out.stderr.splitlines() if s.startswith("[torchneuron]")]
    assert progress and "kernel launches" in progress[-1]


def test_bad_usage(tmp_path):
    out = _run("profile", str(tmp_path / "missing.py"))
    assert out.returncode == 2 and "no such script" in out.stderr
    out = _run("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_python_dash_m_runs_the_same_command():
    out = subprocess.run([sys.executable, "-m", "torchneuron", "ls"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "neuron:0" in out.stdout
