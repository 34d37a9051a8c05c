"""One node's liveness in the dynamic rendezvous, and its watch of the running round.

The lease's keep-alive thread (``lease.LeaseKeeper``) and the running round's watch thread
(``watch.RoundWatcher``) run in a nursery under the owner's scope (``leave`` cancels it,
``join`` closes the nursery). What both and the agent's calls share is one value,
``condition.NodeCondition`` (that module says how it moves).

Who watches the round for whom (its closer and deputy for the quiet members) is
``quiet``'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import Clock
from elastrun.core.errors import StoreUnavailableError
from elastrun.core.threads import Nursery
from elastrun.rendezvous import condition
from elastrun.rendezvous.condition import CurrentRound, NodeCondition
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.lease import REVOKE_BOUND, LeaseKeeper
from elastrun.rendezvous.members import page_count, page_entries, page_of
from elastrun.rendezvous.watch import WATCH_SPAN, RoundWatcher
from elastrun.store.api import Store

__all__ = ["REVOKE_BOUND", "WATCH_SPAN", "DecidedRows", "Liveness"]

log = logging.getLogger("elastrun.rendezvous")

#: The full member list of round ``n`` (of its given decision, else the committed one),
#: as the joining protocol reads it.
DecidedRows = Callable[[int, str | None], list[list[Any]]]

P = ParamSpec("P")


class Liveness:
    """This node's condition (``now``), and the threads that keep it: the lease's and the
    watch of the round it is in.

    Args:
        store: the run's store.
        keys: the run's keys.
        node_id: this node.
        ttl: the lease's time to live (``heartbeat_timeout``): a silent node is dropped.
        max_nodes: the run's upper bound (a spare's join is no reason to re-form).
        clock: for the keep-alive's pacing.
        life: the owner's scope: ``leave`` cancels it, which ends both threads at once.
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
        life: CancelScope,
        decided_rows: DecidedRows,
    ) -> None:
        self._store = store
        self._keys = keys
        self._node_id = node_id
        self._decided_rows = decided_rows
        # Guards ``now`` (its moves) and what is known of the round's members. Re-entrant: ``enter``
        # moves into a round and forgets the last one's members in one step.
        self._lock = threading.RLock()
        #: This node's condition: a snapshot, which no later move changes.
        self.now = NodeCondition()
        self._membership: dict[str, bool] = {}  # nodes known to be in the round, or not
        self._member_list: tuple[str, ...] | None = None  # read only when needed
        self.entered = threading.Event()  # set while a round runs and has not re-formed
        self._nursery = Nursery(life, join_timeout=5)
        self._nursery.scope.on_cancel(self.entered.set)  # the sleeping watch sees the stop
        self._started: set[str] = set()  # each thread runs once
        self.callback: Callable[[], None] | None = None
        #: Decides round n+1 at once (``closing.decide_ahead``); called by the watch thread
        #: of round n's closer once round n must re-form, with why, whether this node takes
        #: part (not when it is kept out itself or its workers finished: then it only calls
        #: the quiet members to join), and how long to leave the decision to rank 0 first.
        self.ahead: Callable[[int, str, bool, float], None] | None = None
        #: Clear while ``ahead`` runs: the node's own join waits for it.
        self.ahead_idle = threading.Event()
        self.ahead_idle.set()
        #: Its parts, each with its thread: the lease's and the watch of the round.
        self.keeper = LeaseKeeper(self, store, keys, node_id, ttl=ttl, clock=clock)
        self.watcher = RoundWatcher(self, store, keys, node_id, max_nodes=max_nodes)

    # -- the condition (``condition``) ---------------------------------------------------

    def move(
        self,
        step: Callable[Concatenate[NodeCondition, P], NodeCondition],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> tuple[NodeCondition, NodeCondition]:
        """Apply one of ``condition``'s moves; the condition before it and after it.

        Raises:
            IllegalTransitionError: the move cannot follow the condition (a bug).
        """
        with self._lock:
            before = self.now
            self.now = after = step(before, *args, **kwargs)
            # The watch thread sleeps while no round runs: between a re-formation and
            # the next round the joining code watches what it needs.
            if before.running and not after.running:
                self.entered.clear()
            elif after.running and after.round is not before.round:
                self.entered.set()
        return before, after

    # -- the threads ---------------------------------------------------------------------

    def register(self, info: dict[str, object]) -> None:
        """Take a fresh lease and announce this node (``info``) under it; keep it alive."""
        self.keeper.register(info)
        self._spawn(self.keeper.keep_alive_loop, "keepalive")

    def _spawn(self, target: Callable[[CancelScope], None], name: str) -> None:
        if name not in self._started and not self._nursery.closed:
            self._started.add(name)
            self._nursery.start(target, name=f"elastrun-rdzv-{name}")

    def join(self) -> None:
        """Stop the threads (if ``leave`` has not yet) and wait (briefly) for them."""
        self._nursery.close("this node left the rendezvous")

    def store_gone(self, exc: StoreUnavailableError) -> str:
        """The store stopped answering for its whole reconnect window (``read_timeout``
        after it went silent; the client shares that one window between all calls):
        give it up for good, wake the agent, and return the line that says so."""
        line = f"the rendezvous store at {exc.address} stopped answering "
        line += f"{exc.silent_for:.0f}s ago; stopping"
        before, after = self.move(condition.store_gone, line)
        if before.gone is None:
            log.debug("giving up the store: %s", exc)
        if not self._nursery.scope.cancelled:  # after ``leave``: nobody to wake any more
            self.notify()
        return after.change_reason

    def mark_lost(self, reason: str) -> None:
        """The others consider this node gone, for ``reason``: tell the agent."""
        log.warning("%s", reason)
        self.move(condition.marked_lost, reason)
        self.notify()

    # -- the running round ---------------------------------------------------------------

    def enter(self, new: CurrentRound) -> None:
        """This node entered round ``new``: watch it."""
        with self._lock:
            self.move(condition.entered, new)
            self._membership = {self._node_id: True}
            self._member_list = None
        self._spawn(self.watcher.watch_loop, "watch")

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
        with self._lock:
            r, known = self.now.round, self._member_list
        if known is not None or r is None:
            return known or ()
        ids = tuple(str(row[0]) for row in self._decided_rows(r.n, r.decision))
        with self._lock:
            if self.now.round is r:
                self._member_list = ids
        return ids

    def is_member(self, node: str) -> bool:
        """Whether ``node`` is in the current round: one read of its member page, whose
        entries are remembered (a loss among N members costs each member one read)."""
        with self._lock:
            r, known = self.now.round, self._membership.get(node)
        if known is not None or r is None:
            return bool(known)
        key = self._keys.members(r.n, r.decision, page_of(node, page_count(r.size)))
        entries = page_entries(self._store.get(key))
        with self._lock:
            if self.now.round is r:
                self._membership.update(dict.fromkeys(entries, True))
                self._membership.setdefault(node, False)
        return node in entries

    def __repr__(self) -> str:
        now = self.now
        return (
            f"Liveness(node={self._node_id!r}, lease={now.lease}, round={now.n}, "
            f"reform={now.reform}, lost={now.lost}, gone={now.gone is not None})"
        )
