"""``nki.typing``: type annotations for kernel arguments (``def k(a: nt.tensor[128, 512]): ...``).

Annotations are documentation only, as in NKI: the tracer takes shapes and dtypes from the arguments."""
from __future__ import annotations

from typing import Any


class TensorAnnotation:
    """What ``nt.tensor[...]`` returns: the subscript, kept for reading (never checked)."""

    def __init__(self, spec: Any):
        self.spec = spec

    def __repr__(self) -> str:
        return f"nki.typing.tensor[{self.spec!r}]"


class _TensorType:
    """``nt.tensor``: subscript it with a shape (and optionally a dtype) to annotate a kernel argument."""

    def __getitem__(self, spec: Any) -> TensorAnnotation:
        return TensorAnnotation(spec)

    def __repr__(self) -> str:
        return "nki.typing.tensor"


tensor = _TensorType()

__all__ = ["tensor", "TensorAnnotation"]
