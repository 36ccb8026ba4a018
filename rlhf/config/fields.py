"""`doc`: a config dataclass field with its default, one line of documentation and its range."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def doc(default: Any, text: str, **kwargs: Any) -> Any:
    """A dataclass field with a default (or factory) and a one-line description."""
    if callable(default):
        return field(default_factory=default, metadata={"doc": text, **kwargs})
    return field(default=default, metadata={"doc": text, **kwargs})
