"""Joining a round: the rendezvous, this node's launch plan for it, the workers' store.
Starting the workers is the loop's next step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from elastrun.agent.bootstrap_store import BootstrapStore
from elastrun.agent.plan import LaunchPlan
from elastrun.agent.planner import RoundPlanner
from elastrun.agent.report import AgentReport
from elastrun.core.clock import Clock
from elastrun.core.interrupt import Interruptible
from elastrun.pace.agent.step_watch import PaceWatch
from elastrun.rendezvous.api import RendezvousHandler, RendezvousInfo
from elastrun.rendezvous.elastic import ElasticRendezvous


class Rounds:
    """The rounds this node joins.

    Args:
        handler: the rendezvous handler.
        rdzv: its elastic view (``next_round`` waits in the shutdown scope).
        planner: records each round in the worker group and plans this node's workers.
        pace: the straggler watch (it exchanges step times through the round's store).
        report: reports the rendezvous.
        interruptible: runs the rendezvous wait so that a signal ends it.
        clock: the agent's.
        on_round: parts told of each round joined, before its workers start (the
            memory checkpoints' copies: each makes sure its node holds what the round's
            ranks will load); each must not raise.
    """

    def __init__(
        self,
        handler: RendezvousHandler,
        rdzv: ElasticRendezvous,
        planner: RoundPlanner,
        *,
        pace: PaceWatch,
        report: AgentReport,
        interruptible: Interruptible,
        clock: Clock,
        on_round: Sequence[Callable[[RendezvousInfo, LaunchPlan], None]] = (),
    ) -> None:
        self._handler = handler
        self._rdzv = rdzv
        self._planner = planner
        self._pace = pace
        self._report = report
        self._interruptible = interruptible
        self._clock = clock
        self._on_round = tuple(on_round)
        #: The workers' bootstrap store (MASTER_ADDR/PORT) of the current round, when this
        #: node is its group rank 0: it outlives every worker of the round (in-process
        #: rounds re-host it).
        self.bootstrap_store = BootstrapStore()

    def join(self) -> LaunchPlan:
        """Wait for the next round (after ``end`` of the previous one); returns this
        node's plan for it.

        Raises ``ShutdownRequested`` (a signal during the wait), the handler's
        ``RendezvousError``s, or ``RendezvousError`` when the workers' store cannot be
        served.
        """
        t0 = self._clock.monotonic()
        info = self._interruptible(self._rdzv.next_round, "rendezvous")
        rdzv_ms = (self._clock.monotonic() - t0) * 1000
        plan = self._planner.plan(info)
        self._pace.start_round(
            info.store, self._handler.get_run_id(), info.round, info.rank, info.world_size
        )
        self.bootstrap_store.host(plan, agents_host=self._handler.agent_hosts_bootstrap_store)
        self._report.rendezvous(info, rdzv_ms)
        for part in self._on_round:
            part(info, plan)
        return plan

    def end(self) -> None:
        """Stop serving the current round's workers' store, if this node serves it."""
        self.bootstrap_store.close()

    def __repr__(self) -> str:
        return f"Rounds(planner={self._planner!r}, store={self.bootstrap_store!r})"
