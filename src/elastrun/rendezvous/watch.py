"""The watch of the running round: the thread that flags a re-formation when one is due.

While a round runs, the watch thread (``RoundWatcher.watch_loop``, in ``Liveness``'s
nursery) follows ``ctl/`` from the revision the round was decided at, or, as a quiet
member, only the closer's claim (``quiet``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.errors import (
    RendezvousError,
    StoreCompactedError,
    StoreError,
    StoreUnavailableError,
)
from elastrun.rendezvous import condition, quiet
from elastrun.rendezvous.closing import Called
from elastrun.rendezvous.condition import CurrentRound
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.running import RoundWatch
from elastrun.store.api import Store

if TYPE_CHECKING:
    from elastrun.rendezvous.liveness import Liveness

log = logging.getLogger("elastrun.rendezvous")

#: How long one watch of a running round lasts before it is renewed (``leave`` ends it
#: at once; renewing costs one request).
WATCH_SPAN = 60.0


@dataclass(frozen=True, eq=False)
class RoundWatcher:
    """Watches the round this node is in for a re-formation, flagged as a move of the
    node's condition (``Liveness.move``). It holds no state of its own.

    Args:
        live: the node's liveness: the round, and where a re-formation is flagged.
        store: the run's store.
        keys: the run's keys.
        node_id: this node.
        max_nodes: the run's upper bound (a spare's join is no reason to re-form).
    """

    live: Liveness
    store: Store
    keys: RunKeys
    node_id: str
    max_nodes: int

    def watch_loop(self, life: CancelScope) -> None:
        """Follow ``ctl/`` while a round runs; flag a re-formation when one is due;
        until this node leaves (``leave`` cancels ``life``, and sets ``entered``).

        Between a re-formation and the next round this thread sleeps: the joining code
        watches what it needs, and N members reading every join of the next round would
        cost O(N^2).
        """
        live = self.live
        watching: tuple[int, RoundWatch, int] | None = None  # round, view, revision
        following: tuple[int, int] | None = None  # round, revision (a quiet member)
        while not life.cancelled:
            now = live.now
            if (r := now.round) is None or now.reform:
                live.entered.wait()  # set by the next round, and by ``leave``
                continue
            n, size, since, watchers, me = r.n, r.size, r.since, r.watchers, self.node_id
            try:
                if watchers.quiet(me):
                    rev = following[1] if following is not None and following[0] == n else since
                    following = (n, self._follow_closer(life, n, size, watchers, rev))
                    continue
                if watching is None or watching[0] != n:
                    watching = (n, self.round_watch(r), since)
                _, view, rev = watching
                try:
                    # Long: ``leave`` cancels it, and a new round's events reach the
                    # old watch too (then the loop moves on to the new round's view).
                    res = self.store.watch(self.keys.ctl, rev, WATCH_SPAN, scope=life)
                except StoreCompactedError as exc:
                    # The store dropped old history (etcd auto-compaction): re-read.
                    log.debug("rendezvous watch resumes after compaction: %s", exc)
                    view = self.round_watch(r)
                    watching = (n, view, self.reload(view, n))
                    continue
                view.apply(res.events)
                watching = (n, view, res.revision)
                reason = view.reason()
                if reason is not None:
                    # Kept out, its workers finished (it re-forms only if its exit
                    # barrier says so), or it gave notice: it only calls the others.
                    joins = me not in view.excluded | view.finished and live.now.away != n
                    defer = watchers.defer(me, view.lost)
                    self.flag_reform(
                        n, reason, ahead=watchers.watches(me), joins=joins, defer=defer
                    )
            except Cancelled:
                return
            except StoreUnavailableError as exc:
                live.store_gone(exc)
                life.sleep(1.0)
            except StoreError as exc:
                if not life.cancelled:
                    log.warning("rendezvous watch interrupted: %s", exc)
                    life.sleep(1.0)

    def _follow_closer(
        self, life: CancelScope, n: int, size: int, watchers: quiet.Watchers, rev: int
    ) -> int:
        """As a quiet member, one watch of round ``n`` (of ``size``)'s closer
        (``quiet.follow_closer``); the revision to watch on from."""
        rev, why, call = quiet.follow_closer(
            self.store, self.keys, n, watchers, rev, scope=life, span=WATCH_SPAN, size=size
        )
        if why is not None:
            called = None if call is None else Called.of(self.keys, n + 1, call)
            self.live.move(condition.woken, called)
            self.flag_reform(n, why)
        return rev

    def round_watch(self, r: CurrentRound) -> RoundWatch:
        """A view of round ``r`` that events keep up to date."""
        return RoundWatch(
            self.keys, r.n, r.size, self.max_nodes, self.live.is_member, all_live=r.all_live
        )

    def reload(self, view: RoundWatch, n: int) -> int:
        """Load ``view`` of round ``n`` from full reads; the revision to watch from."""
        k = self.keys
        nodes, rev = self.store.get_prefix(k.nodes)
        joins, _ = self.store.get_prefix(k.join_prefix(n + 1))
        done, _ = self.store.get_prefix(k.done(n))
        failed = self.store.get(k.failed(n)) is not None
        members = self.live.member_ids()
        closed = self.store.get(k.closed) is not None
        view.load(members, list(nodes), list(joins), failed, closed, list(done))
        return rev

    def flag_reform(
        self, n: int, reason: str, *, ahead: bool = False, joins: bool = True, defer: float = 0
    ) -> None:
        """Flag that round ``n`` must re-form; with ``ahead`` (this node watches the round
        for the others: its closer or deputy), then decide the next round at once for
        everyone (``live.ahead``; ``joins``: this node takes part in it; ``defer``: how
        long it leaves the decision to rank 0 first)."""
        live = self.live
        ahead = ahead and live.ahead is not None
        if ahead:
            live.ahead_idle.clear()  # before the agent can see the re-formation and join
        before, after = live.move(condition.reform_flagged, n, reason)
        if after is before:  # flagged already, or late: the node is in another round
            if ahead:
                live.ahead_idle.set()
            return
        live.notify()
        if ahead and live.ahead is not None:
            try:
                live.ahead(n, reason, joins, defer)
            except (StoreError, RendezvousError) as exc:
                # The node's own join goes on as usual (and decides, if nobody did).
                log.debug("could not decide round %d ahead: %s", n + 1, exc)
            finally:
                live.ahead_idle.set()

    def check_reform(self) -> bool:
        """Whether the running round must re-form, from full reads (for tests and
        tools; the watch thread keeps the same answer from events)."""
        now = self.live.now
        if (r := now.round) is None or now.reform:
            return now.reform
        view = self.round_watch(r)
        self.reload(view, r.n)
        reason = view.reason()
        if reason is not None:
            self.flag_reform(r.n, reason)
        return self.live.now.reform

    def __repr__(self) -> str:
        return f"RoundWatcher(node={self.node_id!r}, round={self.live.now.n})"
