"""The tcp store's blocked requests, indexed by what wakes them.

A ``watch`` waits for a change under a prefix, a ``wait`` for the creation of a key; each
holds a future here. After every change the service reads the new events once and wakes
only the futures whose prefix or keys they touch: thousands of idle watchers cost a
future each -- no thread each, and no polling. A watcher's future gets the events under
its prefix that woke it, so that it need not look for them again: a watcher that waited
while thousands of other keys changed would otherwise scan all of them once more, and
thousands of such watchers woken at once made one change cost O(N^2).
"""

from __future__ import annotations

import asyncio

from elastrun.store.api import EventKind, WatchEvent

#: What wakes a waiter: the events under its prefix (a watch), or None (a wait, or
#: more changed at once than the history keeps: the waiter looks for itself).
Woken = tuple[WatchEvent, ...] | None
_Index = dict[str, set[asyncio.Future[Woken]]]


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

    def add(self, index: _Index, what: str, fut: asyncio.Future[Woken]) -> None:
        """File ``fut`` under ``what`` (a prefix or a key) in ``index``."""
        index.setdefault(what, set()).add(fut)

    def remove(self, index: _Index, what: str, fut: asyncio.Future[Woken]) -> None:
        """Take ``fut`` out of ``index`` again (done or given up)."""
        futs = index.get(what)
        if futs is not None:
            futs.discard(fut)
            if not futs:
                del index[what]

    def wake(self, events: tuple[WatchEvent, ...] | None) -> None:
        """Wake the futures that ``events`` concern; every one when ``events`` is None
        (more changed at once than the history keeps)."""
        woken: list[tuple[asyncio.Future[Woken], Woken]] = []
        if events is None:
            for futs in (*self.by_prefix.values(), *self.by_key.values()):
                woken.extend((f, None) for f in futs)
        else:
            for prefix, futs in self.by_prefix.items():
                matched = tuple(e for e in events if e.key.startswith(prefix))
                if matched:
                    woken.extend((f, matched) for f in futs)
            for e in events:
                if e.kind is EventKind.PUT:
                    woken.extend((f, None) for f in self.by_key.get(e.key, ()))
        for fut, what in woken:
            if not fut.done():
                fut.set_result(what)
