"""Plugins named on the command line, found in entry points without importing them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib import metadata

__all__ = ["find_entry_point"]


def find_entry_point(groups: Sequence[str], name: str) -> metadata.EntryPoint | None:
    """The first entry point called ``name`` in ``groups`` (in that order), or None."""
    from importlib import metadata  # ~10 ms: only a plugin's name gets here

    found = (e for group in groups for e in metadata.entry_points(group=group).select(name=name))
    return next(found, None)
