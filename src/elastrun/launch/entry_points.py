"""Plugins named on the command line, found in entry points without importing them."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata

__all__ = ["find_entry_point"]


def find_entry_point(groups: Sequence[str], name: str) -> metadata.EntryPoint | None:
    """The first entry point called ``name`` in ``groups`` (in that order), or None."""
    for group in groups:
        for entry in metadata.entry_points(group=group).select(name=name):
            return entry
    return None
