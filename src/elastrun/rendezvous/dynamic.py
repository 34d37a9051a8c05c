"""The dynamic rendezvous, written once against the store model (DESIGN.md section 4;
the keys of a run, and what each holds, are listed in ``keys``).

Every node writes O(1) keys per round, and liveness costs no writes at all (a lease
keep-alive). One node per round, the closer (whoever first claims ``out/closer``), keeps
a view of the joiners and live nodes from watch events on ``ctl/`` and decides; the
others watch only ``out/`` and take over if the closer's lease ends. While a round runs,
its closer and a deputy watch ``ctl/`` for the other members (``quiet``). Each node
reads only the small result and the page holding its own rank, never the whole member
list. So each change costs O(1) per interested node and a round of N nodes costs O(N)
store traffic. Nothing polls.

A re-formation does not wait for every member to join again: the closer counts the live
members in with their ranks (``decide.presume``; after a failed round each joins itself,
``RoundView.must_join``), its result lists the few rank changes (``members.changes_from``),
and after a loss the closer or its deputy decides the next round at once and calls the
others, who enter reading nothing (``closing.decide_ahead``).

The handler is a facade over its parts: ``Joiner`` (joining rounds), ``Liveness`` (the
lease and the round, with ``LeaseKeeper`` and ``RoundWatcher`` on their threads),
``Outcome`` (the budget, the exit barrier and the run's closing), ``Exclusions`` (the
nodes that sit out a cool-down) and ``AgentCalls`` (the agent's calls in progress, which
``leave`` ends).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import RendezvousConnectionError, StoreError
from elastrun.rendezvous.api import RendezvousHandler, RendezvousInfo
from elastrun.rendezvous.calls import AgentCalls
from elastrun.rendezvous.elastic import StoreSeat
from elastrun.rendezvous.excluding import Exclusions
from elastrun.rendezvous.joiner import AHEAD_BOUND, Joiner
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.liveness import Liveness
from elastrun.rendezvous.outcome import Outcome
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.api import Store

__all__ = ["AHEAD_BOUND", "DynamicRendezvousHandler", "NodeDesc", "RendezvousSettings"]

log = logging.getLogger("elastrun.rendezvous")


class DynamicRendezvousHandler(RendezvousHandler):
    """One node's side of the dynamic rendezvous over any ``Store``.

    Beyond torch's handler methods it offers what the agent uses for elasticity
    (``elastic.ElasticRendezvous``): ``set_change_callback`` (called from a watch thread
    when the running round must re-form), ``outcome`` (the job-wide restart budget and
    the exit barrier) and ``exclusions``. It composes its parts (the module docstring
    names them) and delegates to them.
    """

    def __init__(
        self,
        store: Store,
        settings: RendezvousSettings,
        node: NodeDesc,
        *,
        backend: str = "c10d",
        clock: Clock = SYSTEM_CLOCK,
        on_shutdown: Callable[[], None] | None = None,
        fixed_rank: int | None = None,
        hosting: bool = False,
    ) -> None:
        self._hosting = hosting
        self._store = store
        self.settings = settings
        self._backend = backend
        self._clock = clock
        self._on_shutdown = on_shutdown
        self._keys = RunKeys.of_run(settings.run_id)
        self._stop = threading.Event()
        self._life = CancelScope()  # the handler's own threads: cancelled by ``leave``
        self._liveness = Liveness(
            store, self._keys, node.node_id,
            ttl=settings.heartbeat_timeout, max_nodes=settings.max_nodes, clock=clock,
            life=self._life, decided_rows=self._decided_rows,
        )  # fmt: skip
        self._joiner = Joiner(
            store, settings, node, self._keys, self._liveness,
            clock=clock, life=self._life, fixed_rank=fixed_rank,
        )  # fmt: skip
        self._liveness.ahead = self._joiner.decide_ahead
        self._calls = AgentCalls(self._stop, self._liveness.store_gone)
        #: The nodes that sit out a cool-down (``elastic.ExclusionBoard``).
        self.exclusions = Exclusions(
            store, self._keys, self._liveness, self._calls,
            node_id=node.node_id, addr=node.addr, clock=clock, min_nodes=settings.min_nodes,
        )  # fmt: skip
        #: The job's restart budget and the exit barrier (``elastic.JobOutcome``).
        self.outcome = Outcome(
            store, self._keys, self._liveness, self._calls, self.exclusions,
            node_id=node.node_id, addr=node.addr, clock=clock,
        )  # fmt: skip
        self.loss_bound = settings.heartbeat_timeout  # a vanished node's lease then ends

    # -- torch-compatible surface ------------------------------------------------------

    @property
    def seen(self) -> int:
        """Joiners the last decision of this node saw, as the closer."""
        return self._joiner.seen

    @property
    def change_reason(self) -> str:
        return self._liveness.now.change_reason

    def get_backend(self) -> str:
        return self._backend

    @property
    def agent_hosts_bootstrap_store(self) -> bool:
        return True

    def get_run_id(self) -> str:
        return self.settings.run_id

    def is_closed(self) -> bool:
        return self._joiner.is_closed()

    def set_closed(self, reason: str = "closed") -> None:
        self.outcome.close(reason)

    def num_nodes_waiting(self) -> int:
        """1 when the running round must re-form (nodes waiting, lost, or a failure).
        ``RendezvousConnectionError`` once the store is given up, as torch's handler: the
        agent then stops its workers and exits instead of re-forming without a store."""
        now = self._liveness.now
        if now.gone is not None:
            raise RendezvousConnectionError(now.gone)
        return 1 if (now.reform or now.lost) else 0

    def shutdown(self, close: bool = True) -> bool:
        """Close the run (once a job ends, late agents are refused) and leave.

        The node that serves the store waits (up to ``close_timeout``) for the other
        nodes to leave before its store goes away under them.
        """
        keeper, bound = self._liveness.keeper, self.settings.close_timeout
        closed = False
        if self._liveness.now.gone is not None:
            pass  # nothing to close: the store is gone
        elif self.outcome.left_unfinished:
            # The job goes on without this node; its outcome is not known yet.
            if self._hosting:
                log.warning(
                    "this node serves the rendezvous store: it keeps serving until the "
                    "other nodes leave"
                )
                keeper.wait_for_others_to_leave(None)
        elif not close:
            # This node ends on an error of its own; the others decide for themselves.
            if self._hosting:
                keeper.wait_for_others_to_leave(bound)
        else:
            closed = self.outcome.close_within("finished", self._life, bound)
            if not closed:
                log.warning("could not close the rendezvous (the store is unreachable)")
            elif self._hosting:
                keeper.wait_for_others_to_leave(bound)
        self.leave()
        return closed

    def leave(self) -> None:
        """Stop watching, revoke the lease (our keys vanish at once), close the store."""
        self._stop.set()  # the agent's calls (``AgentCalls``)
        self._life.cancel("this node left the rendezvous")
        self._calls.cancel_all("this node left the rendezvous")
        self._liveness.keeper.revoke()
        self._liveness.join()
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None

    # -- elastrun's additions ------------------------------------------------------------

    def set_node_info(self, role: str, local_world_size: int) -> None:
        """What this node brings to a round (the agent tells it before joining)."""
        me = self._joiner.node
        self._joiner.node = NodeDesc(me.node_id, me.addr, role, local_world_size)

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        self._liveness.callback = callback

    def step_away(self, why: str) -> None:
        self.outcome.step_away(why)

    def store_seat(self) -> StoreSeat:
        """This node's place in this run's store, once this node holds a lease."""
        with self._calls.call():
            self._joiner.register()
        me, lease, clock = self._joiner.node, self._liveness.now.lease, self._clock
        return StoreSeat(self._store, self._keys.prefix, me.node_id, me.addr, lease, clock)

    # -- joining -------------------------------------------------------------------------

    def next_round(self, scope: CancelScope) -> RendezvousInfo:
        """``next_rendezvous`` with every store wait in ``scope`` (``elastic``)."""
        with scope.active():
            return self.next_rendezvous()

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            if (gone := self._liveness.now.gone) is not None:
                raise RendezvousConnectionError(gone)
            with self._calls.call():
                return self._joiner.next_rendezvous()
        except StoreError as exc:
            raise RendezvousConnectionError(f"rendezvous store failed: {exc}") from exc
        finally:
            self._joiner.progress_line.end()

    def _decided_rows(self, n: int, decision: str | None = None) -> list[list[Any]]:
        # For the liveness, built before the joiner (which needs it) that reads them.
        return self._joiner.decided_rows(n, decision)

    def _check_reform(self) -> bool:
        """``RoundWatcher.check_reform`` (for tests and tools)."""
        return self._liveness.watcher.check_reform()

    def __repr__(self) -> str:
        return (
            f"DynamicRendezvousHandler(run_id={self.settings.run_id!r}, "
            f"node={self._joiner.node.node_id!r}, round={self._liveness.now.n}, "
            f"rank={self._liveness.now.rank})"
        )
