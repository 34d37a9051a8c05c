"""One node's lease in the dynamic rendezvous: taking it, keeping it alive, giving it up.

A node is alive while its lease is: ``ctl/nodes/<node>`` is bound to it and the
keep-alive thread (``LeaseKeeper.keep_alive_loop``, in ``Liveness``'s nursery) renews it,
with no writes at all.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.clock import Clock, Deadline
from elastrun.core.errors import StoreCompactedError, StoreError, StoreUnavailableError
from elastrun.rendezvous import condition
from elastrun.rendezvous.decide import apply_events
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.ops import dump
from elastrun.store.api import Store

if TYPE_CHECKING:
    from elastrun.rendezvous.liveness import Liveness

log = logging.getLogger("elastrun.rendezvous")

#: How long ``revoke`` may take.
REVOKE_BOUND = 2.0


class _Ack(enum.Enum):
    """What one keep-alive learnt."""

    ALIVE = "acknowledged"
    EXPIRED = "the lease had expired"
    NONE = "no answer"
    GONE = "the store was given up, or this node left"


@dataclass(frozen=True, eq=False)
class LeaseKeeper:
    """Takes, renews and revokes this node's lease: moves of the node's condition
    (``Liveness.move``). It holds no state of its own.

    Args:
        live: the node's liveness, whose ``lease``, ``acked_at`` and ``lost`` it moves.
        store: the run's store.
        keys: the run's keys.
        node_id: this node.
        ttl: the lease's time to live (``heartbeat_timeout``): a silent node is dropped.
        clock: for the keep-alive's pacing.
    """

    live: Liveness
    store: Store
    keys: RunKeys
    node_id: str
    ttl: float
    clock: Clock

    def renew(self) -> bool:
        """Whether this node still holds its lease (a joining node asks first)."""
        live, now = self.live, self.live.now
        if now.lease is not None and not now.lost:
            # The store acknowledged it moments ago (the keep-alive thread asks every
            # TTL/3): no need to ask again. After a loss among N nodes, N survivors
            # asking at once was a tenth of the re-formation's requests. A lease that
            # ended since shows when the join writes under it (the handler then takes
            # a fresh one), or at the keep-alive thread's next ask.
            acked = now.acked_at
            if acked is not None and self.clock.monotonic() - acked < self.ttl / 3:
                return True
            # A node thawed after SIGSTOP (or back from a partition) may re-form before
            # its keep-alive thread noticed that the lease ended: ask the store.
            if self.store.keep_alive(now.lease):
                live.move(condition.renewed, now.lease, self.clock.monotonic())
                return True
            live.mark_lost("this node's lease expired: the others consider it gone")
        return False

    def register(self, info: dict[str, object]) -> None:
        """Take a fresh lease and announce this node (``info``) under it."""
        lease = self.store.grant_lease(self.ttl)
        self.live.move(condition.registered, lease, self.clock.monotonic())
        self.store.set(self.keys.nodes + self.node_id, dump(info), lease=lease)

    def revoke(self) -> None:
        """Forget the lease and revoke it (``leave``: this node's keys vanish at once).

        In a scope of its own: leaving goes on after a stop request (the caller's scope
        may be cancelled already). Bounded by ``REVOKE_BOUND``, a deadline the store
        honours: a store that is already gone must not hold the exit for its whole
        reconnect window (the lease then expires by itself).
        """
        was, _ = self.live.move(condition.revoked)
        lease = was.lease
        if lease is None or was.gone is not None:
            return
        with CancelScope(deadline=Deadline.after(REVOKE_BOUND)) as scope, scope.active():
            try:
                self.store.revoke_lease(lease)
            except StoreError as exc:
                log.debug("could not revoke lease %d (it expires by itself): %s", lease, exc)

    def wait_for_others_to_leave(self, timeout: float | None) -> None:
        """Wait until no other node holds a lease (None: for as long as it takes), in the
        calling thread's current scope: its cancellation (the launcher's stop request)
        ends only this wait, and leaving goes on."""
        deadline = Deadline.after(timeout if timeout is not None else 1e9, self.clock)
        nodes, me = self.keys.nodes, self.keys.nodes + self.node_id
        try:
            found, rev = self.store.get_prefix(nodes)
            while set(found) - {me} and not deadline.expired():
                try:
                    res = self.store.watch(nodes, rev, min(deadline.remaining(), 5.0))
                except StoreCompactedError:
                    found, rev = self.store.get_prefix(nodes)
                    continue
                rev = res.revision
                apply_events(found, res.events)
            if others := set(found) - {me}:
                log.warning("%d node(s) still attached to the store; closing it", len(others))
        except StoreError as exc:
            log.debug("while waiting for the other nodes to leave: %s", exc)
        except Cancelled as exc:
            log.warning("stopped waiting for the other nodes to leave (%s)", exc.reason)

    def keep_alive_loop(self, life: CancelScope) -> None:
        """The keep-alive thread: renew the lease every TTL/3 until this node leaves
        (``leave`` cancels ``life``: its sleep raises ``Cancelled``)."""
        live = self.live
        ttl = self.ttl
        interval = ttl / 3
        last_ack = self.clock.monotonic()
        while True:
            life.sleep(interval)
            held = live.now
            if (lease := held.lease) is None or held.lost:
                last_ack = self.clock.monotonic()
                continue
            answer = self._ask_keep_alive(life, lease, interval)
            now = self.clock.monotonic()
            if answer is _Ack.ALIVE:
                last_ack = now
                live.move(condition.renewed, lease, now)
            elif answer is _Ack.EXPIRED:
                live.mark_lost("this node's lease expired: the others consider it gone")
            elif answer is _Ack.NONE and now - last_ack >= ttl - interval:
                # The others drop us when the TTL passes; stop our workers before that,
                # so a cut-off node never trains beside the re-formed group.
                live.mark_lost(
                    f"no keep-alive acknowledged for {now - last_ack:.0f}s: assuming this "
                    "node was dropped (network partition or store down)"
                )

    def _ask_keep_alive(self, life: CancelScope, lease: int, interval: float) -> _Ack:
        """One keep-alive, ended by the interval: a store that does not answer (a
        partition leaves the connection open and silent) must not hold this loop for
        its timeout. The deadline is the call's own scope's, which the store honours;
        the call is over when this returns (no thread is left behind to finish it). A
        store that stays silent is still found out: the client leaves the unanswered
        request owed, and once an owed answer is ``read_timeout`` overdue the next call
        that notices -- a keep-alive here, the watch thread's watch, the agent's next
        call -- gives the store up with ``StoreUnavailableError`` (``store_gone``)."""
        with life.child(interval) as scope, scope.active():
            try:
                alive = self.store.keep_alive(lease)
            except StoreUnavailableError as exc:
                self.live.store_gone(exc)
                return _Ack.GONE
            except StoreError as exc:  # StoreTimeoutError: no answer within the interval
                log.debug("keep-alive of lease %d not acknowledged: %s", lease, exc)
                return _Ack.NONE
            except Cancelled:  # ``leave``: the loop's next sleep ends it
                return _Ack.GONE
        return _Ack.ALIVE if alive else _Ack.EXPIRED

    def __repr__(self) -> str:
        return f"LeaseKeeper(node={self.node_id!r}, lease={self.live.now.lease}, ttl={self.ttl})"
