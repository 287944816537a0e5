"""``import torch`` registers neuron through the ``torch.backends`` entry point (fresh processes)."""
from __future__ import annotations

import os
import subprocess
import sys


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TORCHNEURON_")}
    environ.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    environ.update(env)
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=environ, capture_output=True,
                          text=True, timeout=120)


def test_import_torch_alone_registers_neuron():
    r = _run("import sys, torch\n"
             "t = torch.ones(2, device='neuron')\n"
             "print(t.device, t.sum().item(), 'torchneuron' in sys.modules, torch.neuron.device_count() > 0)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["neuron:0", "2.0", "True", "True"]


def test_autoload_disabled_until_import_torchneuron():
    r = _run("import sys, torch\n"
             "print('loaded:', 'torchneuron' in sys.modules)\n"
             "try:\n"
             "    torch.ones(2, device='neuron')\n"
             "    print('no error')\n"
             "except RuntimeError:\n"
             "    print('RuntimeError')\n"
             "import torchneuron\n"
             "t = torch.ones(2, device='neuron')\n"
             "print(t.device, t.sum().item())\n",
             TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["loaded: False", "RuntimeError", "neuron:0 2.0"]


def test_import_torchneuron_before_torch():
    r = _run("import torchneuron\n"
             "import torch\n"
             "t = torch.arange(3.0, device='neuron') * 2\n"
             "print(t.device, t.cpu().tolist(), torch.neuron.is_available())\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "neuron:0 [0.0, 2.0, 4.0] True"
