"""One node's liveness in the dynamic rendezvous, and its watch of the running round.

A node is alive while its lease is: ``ctl/nodes/<node>`` is bound to it and a keep-alive
thread renews it (no writes at all). While a round runs, a watch thread flags a
re-formation when one is due. ``Liveness`` holds what both threads share: the lease,
the round this node is in, which nodes are known to be its members, and whether the
round must re-form, the node was lost or the store is gone; ``lock`` guards the round.

Who watches the round for whom (its closer and deputy for the quiet members) is
``quiet``'s.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.clock import Clock, Deadline
from elastrun.core.errors import (
    RendezvousError,
    StoreCompactedError,
    StoreError,
    StoreUnavailableError,
)
from elastrun.core.threads import join_thread, start_thread
from elastrun.rendezvous import quiet
from elastrun.rendezvous.closing import Called
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.members import page_count, page_entries, page_of
from elastrun.rendezvous.running import RoundWatch
from elastrun.store.api import EventKind, Store

log = logging.getLogger("elastrun.rendezvous")

#: How long one watch of a running round lasts before it is renewed (``leave`` ends it
#: at once; renewing costs one request).
WATCH_SPAN = 60.0

#: How long ``revoke`` may take.
REVOKE_BOUND = 2.0

#: The full member list of round ``n`` (of its given decision, else the committed one),
#: as the joining protocol reads it.
DecidedRows = Callable[[int, str | None], list[list[Any]]]


class _Ack(enum.Enum):
    """What one keep-alive learnt."""

    ALIVE = "acknowledged"
    EXPIRED = "the lease had expired"
    NONE = "no answer"
    GONE = "the store was given up, or this node left"


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
        self._ttl = ttl
        self._max_nodes = max_nodes
        self._clock = clock
        self._stop = stop
        self._life = life
        self._decided_rows = decided_rows
        self.lock = threading.Lock()
        self.lease: int | None = None
        #: When the store last acknowledged the lease (monotonic; None: never).
        self.acked_at: float | None = None
        self.round: int | None = None
        self.rank: int | None = None
        self.size = 0  # nodes in the current round
        self._decision = ""  # the id of the current round's decision
        self._membership: dict[str, bool] = {}  # nodes known to be in it, or not
        self._member_list: tuple[str, ...] | None = None  # read only when needed
        self._since = 0  # the store revision the current round was decided at
        self._all_live = False  # every node alive at ``_since`` is a member
        self._entered = threading.Event()  # set while a round runs and has not re-formed
        self._threads: list[threading.Thread] = []
        # The current round's closer, when a member, and its deputy: they watch for it.
        self._watchers = quiet.EVERYONE
        #: The round in which this node gave notice (``Outcome.step_away``).
        self.away: int | None = None
        self.callback: Callable[[], None] | None = None
        #: Decides round n+1 at once (``closing.decide_ahead``); called by the watch
        #: thread of round n's closer once round n must re-form, with why, whether this
        #: node takes part (not when it is kept out itself or its workers finished: then
        #: it only calls the quiet members to join), and how long to leave the decision
        #: to rank 0 first.
        self.ahead: Callable[[int, str, bool, float], None] | None = None
        #: Clear while ``ahead`` runs: the node's own join waits for it.
        self.ahead_idle = threading.Event()
        self.ahead_idle.set()
        #: What the call that woke this quiet member brought of the next round (its
        #: join takes it: ``joining.join``).
        self.called: Called | None = None
        self.reform = False
        self.lost = False
        # Set once the store is given up (it stopped answering for its whole reconnect
        # window): the one line saying so; every later call ends with it.
        self.gone: str | None = None
        #: Why the running round must re-form (for the agent's log line).
        self.change_reason = ""

    # -- the lease -----------------------------------------------------------------------

    def renew(self) -> bool:
        """Whether this node still holds its lease (a joining node asks first)."""
        if self.lease is not None and not self.lost:
            # The store acknowledged it moments ago (the keep-alive thread asks every
            # TTL/3): no need to ask again. After a loss among N nodes, N survivors
            # asking at once was a tenth of the re-formation's requests. A lease that
            # ended since shows when the join writes under it (the handler then takes
            # a fresh one), or at the keep-alive thread's next ask.
            acked = self.acked_at
            if acked is not None and self._clock.monotonic() - acked < self._ttl / 3:
                return True
            # A node thawed after SIGSTOP (or back from a partition) may re-form before
            # its keep-alive thread noticed that the lease ended: ask the store.
            if self._store.keep_alive(self.lease):
                self.acked_at = self._clock.monotonic()
                return True
            self.mark_lost("this node's lease expired: the others consider it gone")
        return False

    def register(self, info: dict[str, object]) -> None:
        """Take a fresh lease and announce this node (``info``) under it."""
        self.lost = False
        self.lease = self._store.grant_lease(self._ttl)
        self.acked_at = self._clock.monotonic()
        self._store.set(
            self._keys.nodes + self._node_id,
            json.dumps(info, sort_keys=True).encode(),
            lease=self.lease,
        )
        if not self._threads:
            self._spawn(self._keep_alive_loop, "keepalive")

    def revoke(self) -> None:
        """Forget the lease and revoke it (``leave``: this node's keys vanish at once).

        In a scope of its own: leaving goes on after a stop request (the caller's scope
        may be cancelled already). Bounded by ``REVOKE_BOUND``, a deadline the store
        honours: a store that is already gone must not hold the exit for its whole
        reconnect window (the lease then expires by itself).
        """
        lease, self.lease = self.lease, None
        if lease is None or self.gone is not None:
            return
        with CancelScope(deadline=Deadline.after(REVOKE_BOUND)) as scope, scope.active():
            try:
                self._store.revoke_lease(lease)
            except StoreError as exc:
                log.debug("could not revoke lease %d (it expires by itself): %s", lease, exc)

    def wait_for_others_to_leave(self, timeout: float | None) -> None:
        """Wait until no other node holds a lease (None: for as long as it takes), in the
        calling thread's current scope: its cancellation (the launcher's stop request)
        ends only this wait, and leaving goes on."""
        deadline = Deadline.after(timeout if timeout is not None else 1e9, self._clock)
        nodes = self._keys.nodes
        try:
            found, rev = self._store.get_prefix(nodes)
            others = set(found) - {nodes + self._node_id}
            while others and not deadline.expired():
                try:
                    res = self._store.watch(nodes, rev, min(deadline.remaining(), 5.0))
                except StoreCompactedError:
                    found, rev = self._store.get_prefix(nodes)
                    others = set(found) - {nodes + self._node_id}
                    continue
                rev = res.revision
                for e in res.events:
                    (others.add if e.kind is EventKind.PUT else others.discard)(e.key)
                others.discard(nodes + self._node_id)
            if others:
                log.warning("%d node(s) still attached to the store; closing it", len(others))
        except StoreError as exc:
            log.debug("while waiting for the other nodes to leave: %s", exc)
        except Cancelled as exc:
            log.warning("stopped waiting for the other nodes to leave (%s)", exc.reason)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        self._threads.append(start_thread(target, name=f"elastrun-rdzv-{name}"))

    def wake(self) -> None:
        """Wake the watch thread (``leave``: so that it sees the stop)."""
        self._entered.set()

    def join(self) -> None:
        """Wait (briefly) for the threads to end once ``stop`` is set."""
        for t in self._threads:
            join_thread(t, 5)
        self._threads.clear()

    def _keep_alive_loop(self) -> None:
        ttl = self._ttl
        interval = ttl / 3
        last_ack = self._clock.monotonic()
        while not self._stop.wait(interval):
            lease = self.lease
            if lease is None or self.lost:
                last_ack = self._clock.monotonic()
                continue
            answer = self._ask_keep_alive(lease, interval)
            now = self._clock.monotonic()
            if answer is _Ack.ALIVE:
                last_ack = now
                self.acked_at = now
            elif answer is _Ack.EXPIRED:
                self.mark_lost("this node's lease expired: the others consider it gone")
            elif answer is _Ack.NONE and now - last_ack >= ttl - interval:
                # The others drop us when the TTL passes; stop our workers before that,
                # so a cut-off node never trains beside the re-formed group.
                self.mark_lost(
                    f"no keep-alive acknowledged for {now - last_ack:.0f}s: assuming this "
                    "node was dropped (network partition or store down)"
                )

    def _ask_keep_alive(self, lease: int, interval: float) -> _Ack:
        """One keep-alive, ended by the interval: a store that does not answer (a
        partition leaves the connection open and silent) must not hold this loop for
        its timeout. The deadline is the call's own scope's, which the store honours;
        the call is over when this returns (no thread is left behind to finish it). A
        store that stays silent is still found out: the client leaves the unanswered
        request owed, and once an owed answer is ``read_timeout`` overdue the next call
        that notices -- a keep-alive here, the watch thread's watch, the agent's next
        call -- gives the store up with ``StoreUnavailableError`` (``store_gone``)."""
        with self._life.child(interval) as scope, scope.active():
            try:
                alive = self._store.keep_alive(lease)
            except StoreUnavailableError as exc:
                self.store_gone(exc)
                return _Ack.GONE
            except StoreError as exc:  # StoreTimeoutError: no answer within the interval
                log.debug("keep-alive of lease %d not acknowledged: %s", lease, exc)
                return _Ack.NONE
            except Cancelled:  # ``leave``: the loop sees the stop
                return _Ack.GONE
        return _Ack.ALIVE if alive else _Ack.EXPIRED

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
            self._notify()
        return gone

    def mark_lost(self, reason: str) -> None:
        log.warning("%s", reason)
        self.change_reason = reason
        self.lost = True
        self._notify()

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
            self.round, self.rank, self.size, self._decision = n, rank, size, decision
            self._watchers = watchers
            self._membership = {self._node_id: True}
            self._member_list = None
            self._since = since
            self._all_live = all_live
            self.reform = False
            self._entered.set()
        if not any(t.name.endswith("watch") for t in self._threads):
            self._spawn(self._watch_loop, "watch")

    def forget_round(self) -> None:
        """This node sat out rounds (a cool-down): it joins the next as a newcomer, not
        as a member of its last round asking for its rank back."""
        with self.lock:
            self.round = self.rank = None
            self._entered.clear()

    def _watch_loop(self) -> None:
        """Follow ``ctl/`` while a round runs; flag a re-formation when one is due.

        Between a re-formation and the next round this thread sleeps: the joining code
        watches what it needs, and N members reading every join of the next round would
        cost O(N^2).
        """
        watching: tuple[int, RoundWatch, int] | None = None  # round, view, revision
        following: tuple[int, int] | None = None  # round, revision (a quiet member)
        while not self._stop.is_set():
            with self.lock:
                n, size, since, idle = self.round, self.size, self._since, self.reform
                watchers = self._watchers
            if n is None or idle:
                self._entered.wait()  # set by the next round, and by ``leave``
                continue
            me = self._node_id
            try:
                if watchers.quiet(me):
                    rev = following[1] if following is not None and following[0] == n else since
                    following = (n, self._follow_closer(n, size, watchers, rev))
                    continue
                if watching is None or watching[0] != n:
                    watching = (n, self.round_watch(n, size), since)
                _, view, rev = watching
                try:
                    # Long: ``leave`` cancels it, and a new round's events reach the
                    # old watch too (then the loop moves on to the new round's view).
                    res = self._store.watch(self._keys.ctl, rev, WATCH_SPAN, scope=self._life)
                except StoreCompactedError as exc:
                    # The store dropped old history (etcd auto-compaction): re-read.
                    log.debug("rendezvous watch resumes after compaction: %s", exc)
                    view = self.round_watch(n, size)
                    watching = (n, view, self.reload(view, n))
                    continue
                view.apply(res.events)
                watching = (n, view, res.revision)
                reason = view.reason()
                if reason is not None:
                    # Kept out, its workers finished (it re-forms only if its exit
                    # barrier says so), or it gave notice: it only calls the others.
                    joins = me not in view.excluded | view.finished and self.away != n
                    defer = watchers.defer(me, view.lost)
                    self._flag_reform(
                        n, reason, ahead=watchers.watches(me), joins=joins, defer=defer
                    )
            except Cancelled:
                return
            except StoreUnavailableError as exc:
                self.store_gone(exc)
                self._stop.wait(1.0)
            except StoreError as exc:
                if not self._stop.is_set():
                    log.warning("rendezvous watch interrupted: %s", exc)
                    self._stop.wait(1.0)

    def _follow_closer(self, n: int, size: int, watchers: quiet.Watchers, rev: int) -> int:
        """As a quiet member, one watch of round ``n`` (of ``size``)'s closer
        (``quiet.follow_closer``); the revision to watch on from."""
        rev, why, call = quiet.follow_closer(
            self._store, self._keys, n, watchers, rev, scope=self._life, span=WATCH_SPAN, size=size
        )
        if why is not None:
            self.called = None if call is None else Called.of(self._keys, n + 1, call)
            self._flag_reform(n, why)
        return rev

    def round_watch(self, n: int, size: int) -> RoundWatch:
        return RoundWatch(
            self._keys, n, size, self._max_nodes, self.is_member, all_live=self._all_live
        )

    def reload(self, view: RoundWatch, n: int) -> int:
        """Load ``view`` of round ``n`` from full reads; the revision to watch from."""
        k = self._keys
        nodes, rev = self._store.get_prefix(k.nodes)
        joins, _ = self._store.get_prefix(k.join_prefix(n + 1))
        done, _ = self._store.get_prefix(k.done(n))
        failed = self._store.get(k.failed(n)) is not None
        members = self.member_ids()
        closed = self._store.get(k.closed) is not None
        view.load(members, list(nodes), list(joins), failed, closed, list(done))
        return rev

    def _flag_reform(
        self, n: int, reason: str, *, ahead: bool = False, joins: bool = True, defer: float = 0
    ) -> None:
        """Flag that round ``n`` must re-form; with ``ahead`` (this node watches the round
        for the others: its closer or deputy), then decide the next round at once for
        everyone (``self.ahead``; ``joins``: this node takes part in it; ``defer``: how
        long it leaves the decision to rank 0 first)."""
        ahead = ahead and self.ahead is not None
        with self.lock:
            if self.round != n or self.reform:
                return
            self.change_reason = reason
            self.reform = True
            self._entered.clear()
            if ahead:
                self.ahead_idle.clear()  # before the agent hears of it and joins
        self._notify()
        if ahead and self.ahead is not None:
            try:
                self.ahead(n, reason, joins, defer)
            except (StoreError, RendezvousError) as exc:
                # The node's own join goes on as usual (and decides, if nobody did).
                log.debug("could not decide round %d ahead: %s", n + 1, exc)
            finally:
                self.ahead_idle.set()

    def check_reform(self) -> bool:
        """Whether the running round must re-form, from full reads (for tests and
        tools; the watch thread keeps the same answer from events)."""
        with self.lock:
            n, size = self.round, self.size
        if n is None or self.reform:
            return self.reform
        view = self.round_watch(n, size)
        self.reload(view, n)
        reason = view.reason()
        if reason is not None:
            self._flag_reform(n, reason)
        return self.reform

    def _notify(self) -> None:
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
