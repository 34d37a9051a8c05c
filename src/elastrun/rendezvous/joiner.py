"""Joining rounds of the dynamic rendezvous: one node's driver of ``joining``.

``joining`` writes the protocol once, as a generator of store operations; ``Joiner``
performs them against the run's store, for the agent's join (holding a lease first) and
for the watch thread of a round's closer, which decides the next round ahead. It enters
the round it joined: ``Liveness`` then watches it, and the agent gets its
``RendezvousInfo``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import Clock
from elastrun.core.errors import LeaseExpiredError
from elastrun.rendezvous import condition, joining, quiet
from elastrun.rendezvous.api import MemberInfo, RendezvousInfo, RendezvousStoreInfo
from elastrun.rendezvous.condition import CurrentRound
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.liveness import Liveness
from elastrun.rendezvous.local import free_port
from elastrun.rendezvous.progress import ProgressLine, round_status
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.api import Store

log = logging.getLogger("elastrun.rendezvous")

#: How long a node's join waits for its watch thread to finish deciding the next round
#: ahead (``Liveness.ahead``); past it the join goes on beside it.
AHEAD_BOUND = 30.0


@dataclass(eq=False)
class Joiner:
    """Joins this node to the next round and enters it.

    Args:
        store: the run's store.
        settings: the run's settings (bounds, join timeout, run id).
        node: what this node brings to a round (``node``: the agent may change it).
        keys: the run's keys.
        live: this node's lease and round.
        clock: the rendezvous's clock.
        life: the handler's own scope (``leave`` cancels it): deciding ahead runs in it.
        fixed_rank: the group rank this node always asks for (a static rendezvous).
    """

    store: Store
    settings: RendezvousSettings
    node: NodeDesc
    keys: RunKeys
    live: Liveness
    _: KW_ONLY
    clock: Clock
    life: CancelScope
    fixed_rank: int | None = None
    seen: int = field(default=0, init=False)  # joiners this node's last decision saw
    #: The waiting line's progress, shown while a join waits (ended by the caller).
    progress_line: ProgressLine = field(init=False)

    def __post_init__(self) -> None:
        self.progress_line = ProgressLine(log, self.clock)

    def is_closed(self) -> bool:
        """Whether the run is closed (late nodes are refused)."""
        return self.store.get(self.keys.closed) is not None

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and enter it, in the calling thread's current scope.

        Raises:
            RendezvousClosedError: the run is closed.
            StoreError: the store failed (the handler says which way).
        """
        # This node, the running round's closer, may be deciding the next round ahead
        # (its watch thread): join once it is done (joining meanwhile would only race it).
        self.live.ahead_idle.wait(AHEAD_BOUND)
        self.register()
        was, _ = self.live.move(condition.joining)  # it takes the call that woke it
        prev_round, held, called = was.n, was.rank, was.called
        prev_rank = self._prev_rank(held)
        protocol = joining.join(self._context(), prev_round, prev_rank, held, called)
        try:
            joined = joining.drive(protocol, self._perform)
        except LeaseExpiredError:
            # The lease ended since the store last acknowledged it (``renew`` trusts a
            # recent acknowledgement); the join wrote nothing under it. Take a fresh one.
            self.live.move(condition.expired)
            self.register()
            protocol = joining.join(self._context(), prev_round, prev_rank, held)
            joined = joining.drive(protocol, self._perform)
        assert isinstance(joined, joining.Joined)
        return self._enter_round(joined)

    def _prev_rank(self, held: int | None) -> int | None:
        """The group rank this node asks to keep (static: its rank never changes)."""
        return self.fixed_rank if self.fixed_rank is not None else held

    def decide_ahead(self, n: int, why: str, joins: bool, defer: float) -> None:
        """From the watch thread of round ``n``'s closer: decide round n+1 at once
        (``closing.decide_ahead``), in the handler's own scope (``leave`` ends it)."""
        prev_rank = self._prev_rank(self.live.now.rank)
        protocol = joining.decide_ahead(
            self._context(), n + 1, prev_rank, why, joins=joins, defer=defer
        )
        with self.life.child() as scope, scope.active():
            joining.drive(protocol, self._perform)

    def register(self) -> None:
        """Hold a lease before joining: keep a live one, else take a fresh one (a closed
        run refuses this node)."""
        if self.live.keeper.renew():
            return
        if (closed := self.store.get(self.keys.closed)) is not None:
            raise joining.closed_error(self._context(), closed)
        self.live.register(self._node_info())

    def _node_info(self) -> dict[str, Any]:
        me = self.node
        return {"addr": me.addr, "role": me.role, "local_world_size": me.local_world_size}

    def _context(self) -> joining.Context:
        return joining.Context(
            keys=self.keys,
            node_id=self.node.node_id,
            info=self._node_info(),
            bounds=self.settings,
            join_timeout=self.settings.join_timeout,
            run_id=self.settings.run_id,
            clock=self.clock,
            new_port=free_port,
        )

    def _perform(self, op: joining.Op) -> Any:
        """Carry out one operation of the joining protocol (see ``joining``)."""
        store, lease = self.store, self.live.now.lease
        match op:
            case joining.Get(key):
                return store.get(key)
            case joining.GetPrefix(prefix):
                return store.get_prefix(prefix)
            case joining.Put(key, value, leased):
                return store.set(key, value, lease=lease if leased else None)
            case joining.ReadAll(reads):
                return [self._perform(read) for read in reads]
            case joining.PutAll(items):
                for key, value in items:
                    store.set(key, value)
                return None
            case joining.CompareSet(key, expected, value, leased):
                return store.compare_set(key, expected, value, lease=lease if leased else None)
            case joining.Watch(prefix, after, timeout):
                return store.watch(prefix, after, timeout)
            case joining.Wait(keys, timeout):
                return store.wait(list(keys), timeout)
            case joining.Progress(n, status):
                return self._progress(n, status)
            case joining.Seen(_, joined):
                self.seen = joined
                return None
            case joining.Closed(n, size):
                self.progress_line.end()
                log.info("rendezvous round %d closed with %d node(s)", n, size)
                return None
        raise AssertionError(f"unknown rendezvous operation {op!r}")

    def _progress(self, n: int, status: dict[str, Any] | None) -> None:
        s = self.settings
        self.progress_line.show(*round_status(n, status, s.min_nodes, s.max_nodes))

    def decided_rows(self, n: int, decision: str | None = None) -> list[list[Any]]:
        rows = joining.drive(joining.decided_rows(self._context(), n, decision), self._perform)
        assert isinstance(rows, list)
        return rows

    def _member_infos(self, n: int, decision: str) -> tuple[MemberInfo, ...]:
        return tuple(
            MemberInfo(str(r[0]), str(r[1]), str(r[2]), int(r[3]))
            for r in self.decided_rows(n, decision)
        )

    def _enter_round(self, joined: joining.Joined) -> RendezvousInfo:
        n, rank, result = joined.n, joined.rank, joined.result
        decision, size = str(result["id"]), int(result["size"])
        shape = tuple((str(r), int(lws), int(c)) for r, lws, c in result.get("shape", ()))
        rev, all_live = int(result.get("rev", 0)), bool(result.get("all_live"))
        watchers = quiet.Watchers.of(result)
        self.live.enter(CurrentRound(n, rank, size, decision, rev, all_live, watchers))
        return RendezvousInfo(
            self.store, rank, size, RendezvousStoreInfo(*joined.master), round=n,
            members=functools.partial(self._member_infos, n, decision), shape=shape,
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"Joiner(node={self.node.node_id!r}, round={self.live.now.n}, "
            f"rank={self.live.now.rank}, seen={self.seen})"
        )
