"""Fixtures shared by the test packages."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def default_device_and_streams():
    """Start as a fresh process does (device 0, default streams current); restore afterwards."""
    device = torch.neuron.current_device()
    streams = [torch.neuron.current_stream(i) for i in range(torch.neuron.device_count())]
    for i in range(torch.neuron.device_count()):
        torch.accelerator.set_stream(torch.neuron.default_stream(i))
    torch.neuron.set_device(0)
    yield
    for s in streams:
        torch.accelerator.set_stream(s)
    torch.neuron.set_device(device)
