"""A registry: the one home of a concept's entries (objectives, engines), by name.

An entry is a frozen dataclass with a `name`; config validation, `--help`, the docs' tables and
every refusal read the entry, so adding one is one `register` call in one module.
"""

from __future__ import annotations

from typing import Protocol, TypeVar


class Named(Protocol):
    name: str


E = TypeVar("E", bound=Named)


class Registry(dict[str, E]):
    """Entries by name, in the order they were registered."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, entry: E) -> E:
        """Add `entry`; a name already there is refused (one home each)."""
        if entry.name in self:
            raise ValueError(f"{self.kind} {entry.name!r} is already registered")
        self[entry.name] = entry
        return entry
