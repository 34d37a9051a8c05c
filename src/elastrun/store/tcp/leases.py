"""The tcp store's lease bookkeeping: TTL timers, owners, and the grace after a drop.

Leases belong to the connection that granted them. When it drops, its leases are
revoked after a short grace (``grace``, capped by each lease's TTL) unless the client
reconnects first and names them in its hello: a SIGKILLed agent's keys vanish within
about two seconds, while a brief network blip costs nothing. TTLs are enforced by one
timer per lease, so a watcher hears of an expiry when it happens, not at the next
request. Runs on the server's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastrun.store.memory import MemoryStore
from elastrun.store.tcp.numbering import Numbering

if TYPE_CHECKING:
    from elastrun.store.tcp.connection import Connection

# The server's logger: these lines are the store server's to its operator.
log = logging.getLogger("elastrun.store.tcp.server")


@dataclass(slots=True, eq=False)
class LeaseInfo:
    """What the loop knows of a lease: its TTL timer and the connection holding it."""

    ttl: float
    deadline: float
    owner: Connection | None
    timer: asyncio.TimerHandle | None = None
    grace: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        owner = "orphaned" if self.owner is None else repr(self.owner)
        return f"LeaseInfo(ttl={self.ttl}, deadline={self.deadline:.3f}, {owner})"


@dataclass(eq=False)
class LeaseTable:
    """The live leases of one store, as the loop tracks them.

    Args:
        loop: the server's event loop (its clock and timers).
        store: the store that grants and expires the leases.
        grace: how long a dropped connection's leases wait to be resumed.
        numbering: wire ids, for what the log says.
        publish: called after a lease ended, to wake the watchers of its keys.
    """

    loop: asyncio.AbstractEventLoop
    store: MemoryStore
    grace: float
    numbering: Numbering
    publish: Callable[[], None]
    _leases: dict[int, LeaseInfo] = field(default_factory=dict, init=False)

    def __len__(self) -> int:
        return len(self._leases)

    def __repr__(self) -> str:
        return f"LeaseTable(leases={len(self._leases)}, grace={self.grace})"

    def track(self, lease: int, ttl: float, owner: Connection) -> None:
        """Start the TTL timer of a lease ``owner`` was just granted."""
        # Taken after the store call, so never earlier than the store's own deadline.
        info = LeaseInfo(ttl, self.loop.time() + ttl, owner)
        info.timer = self.loop.call_at(info.deadline, self._on_deadline, lease)
        self._leases[lease] = info
        owner.leases.add(lease)

    def forget(self, lease: int) -> None:
        """Stop tracking a lease that ended (revoked, expired, not resumed)."""
        info = self._leases.pop(lease, None)
        if info is None:
            return
        for handle in (info.timer, info.grace):
            if handle is not None:
                handle.cancel()
        if info.owner is not None:
            info.owner.leases.discard(lease)

    def kept_alive(self, lease: int, alive: bool) -> None:
        """The store answered a keep-alive: push the deadline on, or forget the lease."""
        info = self._leases.get(lease)
        if not alive:
            self.forget(lease)
        elif info is not None:
            info.deadline = self.loop.time() + info.ttl  # its timer re-arms when it fires

    def _on_deadline(self, lease: int) -> None:
        info = self._leases.get(lease)
        if info is None:
            return
        if info.deadline > self.loop.time():  # kept alive since: sleep again
            info.timer = self.loop.call_at(info.deadline, self._on_deadline, lease)
            return
        # The store expires leases lazily, on its next operation: make one, so the
        # deletes happen (and watchers hear of them) now.
        self.store.get("")
        self.forget(lease)
        self.publish()

    def _on_grace_over(self, lease: int) -> None:
        info = self._leases.get(lease)
        if info is None or info.owner is not None:
            return
        log.info(
            "lease %d revoked: its connection dropped and was not resumed",
            self.numbering.lease_out(lease),
        )
        self.store.revoke_lease(lease)
        self.forget(lease)
        self.publish()

    def orphan(self, conn: Connection) -> None:
        """``conn`` is gone: its leases end after the grace unless resumed."""
        for lease in list(conn.leases):
            info = self._leases.get(lease)
            if info is None or info.owner is not conn:
                continue
            info.owner = None
            info.grace = self.loop.call_later(min(self.grace, info.ttl), self._on_grace_over, lease)
        conn.leases.clear()

    def resume(self, conn: Connection, wanted: list[int]) -> tuple[list[int], list[int]]:
        """Re-attach leases named (by wire id) in a hello to ``conn``; returns (resumed,
        lost), as wire ids."""
        resumed, lost = [], []
        for wire in wanted:
            lease = self.numbering.lease_in(wire)
            info = self._leases.get(lease)
            if info is None or not self.store.keep_alive(lease):
                self.forget(lease)
                lost.append(wire)
                continue
            if info.owner is not None and info.owner is not conn:
                info.owner.leases.discard(lease)  # an old connection not yet seen closed
            if info.grace is not None:
                info.grace.cancel()
                info.grace = None
            info.owner = conn
            info.deadline = self.loop.time() + info.ttl
            conn.leases.add(lease)
            resumed.append(wire)
        self.publish()
        return resumed, lost
