"""The tcp store's blocked requests, indexed by what wakes them.

A ``watch`` waits for a change under a prefix, a ``wait`` for the creation of a key; each
holds a future here. After every change the service reads the new events once and wakes
only the futures whose prefix or keys they touch: thousands of idle watchers cost a
future each -- no thread each, and no polling.
"""

from __future__ import annotations

import asyncio

from elastrun.store.api import EventKind, WatchEvent

_Index = dict[str, set[asyncio.Future[None]]]


class Waiters:
    """Blocked requests, indexed by what wakes them: a change under a prefix (watch) or
    the creation of a key (wait). A change costs a look at each distinct prefix, not at
    each waiter: thousands of nodes watching the same prefix cost one look."""

    def __init__(self) -> None:
        self.by_prefix: _Index = {}
        self.by_key: _Index = {}

    def __len__(self) -> int:
        return sum(map(len, self.by_prefix.values())) + sum(map(len, self.by_key.values()))

    def __bool__(self) -> bool:
        return bool(self.by_prefix or self.by_key)

    def __repr__(self) -> str:
        return (
            f"Waiters(prefixes={len(self.by_prefix)}, keys={len(self.by_key)}, futures={len(self)})"
        )

    def add(self, index: _Index, what: str, fut: asyncio.Future[None]) -> None:
        """File ``fut`` under ``what`` (a prefix or a key) in ``index``."""
        index.setdefault(what, set()).add(fut)

    def remove(self, index: _Index, what: str, fut: asyncio.Future[None]) -> None:
        """Take ``fut`` out of ``index`` again (done or given up)."""
        futs = index.get(what)
        if futs is not None:
            futs.discard(fut)
            if not futs:
                del index[what]

    def wake(self, events: tuple[WatchEvent, ...] | None) -> None:
        """Wake the futures that ``events`` concern; every one when ``events`` is None
        (more changed at once than the history keeps)."""
        if events is None:
            woken = [f for futs in (*self.by_prefix.values(), *self.by_key.values()) for f in futs]
        else:
            woken = []
            prefixes = list(self.by_prefix.items())
            for e in events:
                for prefix, futs in prefixes:
                    if e.key.startswith(prefix):
                        woken.extend(futs)
                if e.kind is EventKind.PUT:
                    woken.extend(self.by_key.get(e.key, ()))
        for fut in woken:
            if not fut.done():
                fut.set_result(None)
