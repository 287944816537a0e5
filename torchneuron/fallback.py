"""The CPU fallback's public face: which ops ran on the CPU, and strict mode.

An ATen op with no neuron kernel runs on the CPU over the same memory. Each such op
warns once, is counted here, and raises NotImplementedError naming the op when
strict mode is on (``TORCHNEURON_STRICT=1`` or ``set_strict(True)``).
"""
from __future__ import annotations

from torchneuron import _C


def fallback_counts() -> dict[str, int]:
    """Calls per op (``'aten::name.overload'``) that ran through the CPU fallback."""
    return dict(sorted(_C._fallback_counts()))


def reset_fallback_counts() -> None:
    """Forget the counts (warnings are shown again for ops seen afterwards)."""
    _C._reset_fallback_counts()


def set_strict(strict: bool) -> None:
    """Turn strict mode on or off: in strict mode a fallback raises NotImplementedError."""
    _C._set_strict(bool(strict))


def is_strict() -> bool:
    """Whether strict mode is on."""
    return _C._strict()
