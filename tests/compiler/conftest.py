"""Compiler tests: a private program cache directory, and Dynamo's caches reset around each test."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", str(tmp_path / "cache"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
