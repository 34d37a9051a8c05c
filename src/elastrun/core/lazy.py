"""Names a module resolves on first use, so that importing it stays cheap.

A package on the launch path re-exports names whose modules are costly to import
(asyncio, statistics) or belong to another side of the tree: ``lazy_getattr`` builds
the module-level ``__getattr__`` that imports the owner of a name when it is first
read (PEP 562).
"""

from __future__ import annotations

import importlib

# Worker-side packages use this on their import path: not typing's TYPE_CHECKING, and
# the annotations' types only for type checkers.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


def lazy_getattr(module: str, owners: Mapping[str, str]) -> Callable[[str], object]:
    """A ``__getattr__`` for ``module`` that loads each name of ``owners`` (name ->
    owning module) when it is first read; any other name is an ``AttributeError``."""
    table = dict(owners)

    def __getattr__(name: str) -> object:
        owner = table.get(name)
        if owner is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module(owner), name)

    return __getattr__
