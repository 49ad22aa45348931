"""`opt`, the schema's field maker, in a module of its own: schema.py and algorithm.py both build on it."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A schema field: default value (a list or dataclass type becomes a factory), help text, checks."""
    meta["help"] = help
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    if isinstance(default, type):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)
