"""Command lines read their defaults from the config dataclasses: one source of truth."""

from __future__ import annotations

import dataclasses
from typing import Any


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (its default_factory called if it has one)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default.")
    raise ValueError(f"{cls.__name__} has no field {name!r}.")
