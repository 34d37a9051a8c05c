"""One node's liveness in the dynamic rendezvous, and its watch of the running round.

A node is alive while its lease is: ``ctl/nodes/<node>`` is bound to it and a keep-alive
thread renews it (no writes at all). While a round runs, a watch thread flags a
re-formation when one is due. ``Liveness`` holds what both threads share: the lease,
the round this node is in, which nodes are known to be its members, and whether the
round must re-form, the node was lost or the store is gone; ``lock`` guards the round.
It starts and joins the two threads; what each does is its part's: the lease's
(``lease.LeaseKeeper``) and the watch's (``watch.RoundWatcher``).

Who watches the round for whom (its closer and deputy for the quiet members) is
``quiet``'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import Clock
from elastrun.core.errors import StoreUnavailableError
from elastrun.core.threads import join_thread, start_thread
from elastrun.rendezvous import quiet
from elastrun.rendezvous.closing import Called
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.lease import REVOKE_BOUND, LeaseKeeper
from elastrun.rendezvous.members import page_count, page_entries, page_of
from elastrun.rendezvous.running import RoundWatch
from elastrun.rendezvous.watch import WATCH_SPAN, RoundWatcher
from elastrun.store.api import Store

__all__ = ["REVOKE_BOUND", "WATCH_SPAN", "DecidedRows", "Liveness"]

log = logging.getLogger("elastrun.rendezvous")

#: The full member list of round ``n`` (of its given decision, else the committed one),
#: as the joining protocol reads it.
DecidedRows = Callable[[int, str | None], list[list[Any]]]


class Liveness:
    """This node's lease, the round it is in, and the threads that watch both.

    Args:
        store: the run's store.
        keys: the run's keys.
        node_id: this node.
        ttl: the lease's time to live (``heartbeat_timeout``): a silent node is dropped.
        max_nodes: the run's upper bound (a spare's join is no reason to re-form).
        clock: for the keep-alive's pacing.
        stop: set when this node leaves; ends both threads.
        life: the threads' cancel scope (``leave`` cancels it: the watch ends at once).
        decided_rows: reads a round's full member list.
    """

    #: When the store last acknowledged the lease (monotonic; None: never).
    acked_at: float | None
    # The running round (``enter``), guarded by ``lock``: its number, this node's rank in
    # it, its size in nodes, the id of its decision, the store revision it was decided
    # at (``since``), whether every node alive then is a member (``all_live``), and its
    # closer, when a member, and deputy, who watch for it (``watchers``); and whether it
    # must re-form (``reform``).
    round: int | None
    rank: int | None
    size: int
    _decision: str
    since: int
    all_live: bool
    watchers: quiet.Watchers
    reform: bool
    _membership: dict[str, bool]  # nodes known to be in the round, or not
    _member_list: tuple[str, ...] | None  # read only when needed
    #: The round in which this node gave notice (``Outcome.step_away``).
    away: int | None
    #: Decides round n+1 at once (``closing.decide_ahead``); called by the watch thread
    #: of round n's closer once round n must re-form, with why, whether this node takes
    #: part (not when it is kept out itself or its workers finished: then it only calls
    #: the quiet members to join), and how long to leave the decision to rank 0 first.
    ahead: Callable[[int, str, bool, float], None] | None
    #: What the call that woke this quiet member brought of the next round (its join
    #: takes it: ``joining.join``).
    called: Called | None
    #: Set once the store is given up (it stopped answering for its whole reconnect
    #: window): the one line saying so; every later call ends with it.
    gone: str | None
    #: Why the running round must re-form (for the agent's log line).
    change_reason: str

    def __init__(
        self,
        store: Store,
        keys: RunKeys,
        node_id: str,
        *,
        ttl: float,
        max_nodes: int,
        clock: Clock,
        stop: threading.Event,
        life: CancelScope,
        decided_rows: DecidedRows,
    ) -> None:
        self._store = store
        self._keys = keys
        self._node_id = node_id
        self._stop = stop
        self._decided_rows = decided_rows
        self.lock = threading.Lock()
        self.lease: int | None = None
        self.acked_at = None
        self.entered = threading.Event()  # set while a round runs and has not re-formed
        self._set_round(None, None, 0, "", 0, all_live=False, watchers=quiet.EVERYONE)
        self._threads: list[threading.Thread] = []
        self.away = None
        self.callback: Callable[[], None] | None = None
        self.ahead = None
        #: Clear while ``ahead`` runs: the node's own join waits for it.
        self.ahead_idle = threading.Event()
        self.ahead_idle.set()
        self.called = None
        self.lost = False
        self.gone = None
        self.change_reason = ""
        self._lease = LeaseKeeper(
            self, store, keys, node_id, ttl=ttl, clock=clock, stop=stop, life=life
        )
        self._watch = RoundWatcher(
            self, store, keys, node_id, max_nodes=max_nodes, stop=stop, life=life
        )

    # -- the lease (``lease.LeaseKeeper``) -------------------------------------------------

    def renew(self) -> bool:
        """Whether this node still holds its lease (a joining node asks first)."""
        return self._lease.renew()

    def register(self, info: dict[str, object]) -> None:
        """Take a fresh lease and announce this node (``info``) under it."""
        self._lease.register(info)
        if not self._threads:
            self._spawn(self._lease.keep_alive_loop, "keepalive")

    def revoke(self) -> None:
        """Forget the lease and revoke it (``leave``: this node's keys vanish at once)."""
        self._lease.revoke()

    def wait_for_others_to_leave(self, timeout: float | None) -> None:
        """Wait until no other node holds a lease (None: for as long as it takes), in the
        calling thread's current scope: its cancellation (the launcher's stop request)
        ends only this wait, and leaving goes on."""
        self._lease.wait_for_others_to_leave(timeout)

    # -- the threads ---------------------------------------------------------------------

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        self._threads.append(start_thread(target, name=f"elastrun-rdzv-{name}"))

    def wake(self) -> None:
        """Wake the watch thread (``leave``: so that it sees the stop)."""
        self.entered.set()

    def join(self) -> None:
        """Wait (briefly) for the threads to end once ``stop`` is set."""
        for t in self._threads:
            join_thread(t, 5)
        self._threads.clear()

    def store_gone(self, exc: StoreUnavailableError) -> str:
        """The store stopped answering for its whole reconnect window (``read_timeout``
        after it went silent; the client shares that one window between all calls):
        give it up for good, wake the agent, and return the line that says so."""
        with self.lock:
            if self.gone is None:
                self.gone = (
                    f"the rendezvous store at {exc.address} stopped answering "
                    f"{exc.silent_for:.0f}s ago; stopping"
                )
                log.debug("giving up the store: %s", exc)
            gone = self.gone
        self.change_reason = gone
        self.lost = True
        if not self._stop.is_set():  # after ``leave``: nobody to wake any more
            self.notify()
        return gone

    def mark_lost(self, reason: str) -> None:
        log.warning("%s", reason)
        self.change_reason = reason
        self.lost = True
        self.notify()

    # -- the running round ---------------------------------------------------------------

    def enter(
        self,
        n: int,
        rank: int,
        size: int,
        decision: str,
        since: int,
        *,
        all_live: bool = False,
        watchers: quiet.Watchers = quiet.EVERYONE,
    ) -> None:
        """This node entered round ``n`` (decided at store revision ``since``; with
        ``all_live``, every node alive then is a member; ``watchers``: who watches it for
        the others): watch it."""
        with self.lock:
            self._set_round(n, rank, size, decision, since, all_live=all_live, watchers=watchers)
            self._membership = {self._node_id: True}
            self.entered.set()
        if not any(t.name.endswith("watch") for t in self._threads):
            self._spawn(self._watch.watch_loop, "watch")

    def _set_round(
        self,
        n: int | None,
        rank: int | None,
        size: int,
        decision: str,
        since: int,
        *,
        all_live: bool,
        watchers: quiet.Watchers,
    ) -> None:
        """Hold round ``n`` as the running one (none yet: when made), not re-forming,
        with no member known but what ``enter`` adds (the caller holds ``lock``)."""
        self.round, self.rank, self.size, self._decision = n, rank, size, decision
        self.since, self.all_live, self.watchers = since, all_live, watchers
        self._membership = {}
        self._member_list = None
        self.reform = False

    def forget_round(self) -> None:
        """This node sat out rounds (a cool-down): it joins the next as a newcomer, not
        as a member of its last round asking for its rank back."""
        with self.lock:
            self.round = self.rank = None
            self.entered.clear()

    # -- the watch (``watch.RoundWatcher``) ------------------------------------------------

    def round_watch(self, n: int, size: int) -> RoundWatch:
        """A view of round ``n`` (of ``size``) that events keep up to date."""
        return self._watch.round_watch(n, size)

    def reload(self, view: RoundWatch, n: int) -> int:
        """Load ``view`` of round ``n`` from full reads; the revision to watch from."""
        return self._watch.reload(view, n)

    def check_reform(self) -> bool:
        """Whether the running round must re-form, from full reads (for tests and
        tools; the watch thread keeps the same answer from events)."""
        return self._watch.check_reform()

    def notify(self) -> None:
        """Tell the agent (``callback``) that the running round must re-form."""
        if self.callback is not None:
            self.callback()

    # -- who is in the round -------------------------------------------------------------

    def live_nodes(self) -> set[str]:
        found, _ = self._store.get_prefix(self._keys.nodes)
        cut = len(self._keys.nodes)
        return {k[cut:] for k in found}

    def member_ids(self) -> tuple[str, ...]:
        """The members of the current round (one full read, then remembered)."""
        with self.lock:
            n, decision, known = self.round, self._decision, self._member_list
        if known is not None or n is None:
            return known or ()
        ids = tuple(str(row[0]) for row in self._decided_rows(n, decision))
        with self.lock:
            if self.round == n:
                self._member_list = ids
        return ids

    def is_member(self, node: str) -> bool:
        """Whether ``node`` is in the current round: one read of its member page, whose
        entries are remembered (a loss among N members costs each member one read)."""
        with self.lock:
            n, decision, size = self.round, self._decision, self.size
            known = self._membership.get(node)
        if known is not None or n is None:
            return bool(known)
        key = self._keys.members(n, decision, page_of(node, page_count(size)))
        entries = page_entries(self._store.get(key))
        with self.lock:
            if self.round == n:
                self._membership.update(dict.fromkeys(entries, True))
                self._membership.setdefault(node, False)
        return node in entries

    def __repr__(self) -> str:
        return (
            f"Liveness(node={self._node_id!r}, lease={self.lease}, round={self.round}, "
            f"reform={self.reform}, lost={self.lost}, gone={self.gone is not None})"
        )
