"""In-process recovery, the agent's side: replace only the failed workers and lead the
others into the next round (the workers' side is ``elastrun.inprocess``).

When every worker of the attempt uses ``elastrun.inprocess.run`` (each said hello on
the hub), a failure does not stop the survivors. Alone in its round, the node serves a
fresh workers' store itself (``recover``). With other nodes, every node keeps its
workers running through the rendezvous and, once the new round has formed, they agree
on it through the rendezvous store (``inprocess.agent.agree``): when all kept theirs,
each node leads its workers into the round with the round's ranks (``recover_round``);
the world shrinks in place when a node was lost. Either way the agent starts a
replacement for each failed local rank with the round's environment and announces the
round to the survivors, whose failed collectives brought them to wait for it, naming
every worker's listeners so that no survivor stays blocked on a broken connection. The
round is complete when every local worker, replacements included, has synchronised its
state; when that does not happen within the bound, the loop falls back to restarting
the whole group.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from elastrun.agent.attempt import Attempt, AttemptSetup
from elastrun.agent.bootstrap_store import BootstrapStore
from elastrun.agent.plan import LaunchPlan
from elastrun.agent.workers import WorkerProcesses
from elastrun.core.clock import Clock
from elastrun.core.tcp_sockets import listening_endpoints
from elastrun.inprocess.agent.agree import Agreement, Offer
from elastrun.inprocess.agent.answer import Answering
from elastrun.inprocess.agent.bounds import RecoveryBounds
from elastrun.inprocess.agent.hub import InprocessHub
from elastrun.inprocess.agent.round import InprocessRound
from elastrun.observe.sinks import EventSink, MetricSink
from elastrun.supervise.processes.procset import Exit
from elastrun.wire import inprocess as wire
from elastrun.wire.env import RESTART_COUNT_ENV

log = logging.getLogger("elastrun.agent")

#: Why a failure is not recovered in place when no running worker holds the state.
STATE_LOST = (
    "every worker that held the training's state has failed (each running worker is a "
    "replacement that had not taken a commit yet)"
)
#: Why, when a worker said so (``CommitLostError``; its traceback says which commit).
COMMIT_LOST = "a worker found the round's newest commit held by no rank (CommitLostError)"


def _world(plan: LaunchPlan) -> int:
    return plan.workers[0].ranks.world_size if plan.workers else 0


class InprocessRecovery:
    """Decides whether a failure is recovered in place, and carries the recovery out.

    Args:
        workers: starts the replacements.
        store: the workers' bootstrap store this node serves (re-hosted per round).
        events, metrics: where the recovery is recorded.
        clock: the agent's.
        wake: wakes the agent loop (the hub calls it on every worker message).
        bounds: how long a round may take, a kept worker may take to reach it, and "no
            peer failed" is held back.
    """

    def __init__(
        self,
        *,
        workers: WorkerProcesses,
        store: BootstrapStore,
        events: EventSink,
        metrics: MetricSink,
        clock: Clock,
        wake: Callable[[], None],
        bounds: RecoveryBounds,
    ) -> None:
        self._workers = workers
        self._store = store
        self._events = events
        self._wake = wake
        #: The bound on a round's synchronisation.
        self.timeout = bounds.timeout
        self._answering = Answering(clock, bounds.answer_hold, bounds.loss_bound)
        self._hub: InprocessHub | None = None
        self._rounds = 0
        #: The round under way (the in-place rung follows it to its end).
        self.round = InprocessRound(
            lambda: self._hub,
            clock,
            events,
            metrics,
            timeout=bounds.timeout,
            join_timeout=bounds.join_timeout,
        )
        # Workers started into an in-process round (replacements, and a joining node's
        # workers), local rank -> pid: they run the same script as the workers that
        # opted in, so they are in-process workers from their start, before their hello
        # (a second failure that comes first leads to another round, not a group restart).
        self._started: dict[int, int] = {}
        self._lost_said: int | None = None  # the attempt whose lost state was said

    def open(self) -> dict[str, str]:
        """Listen for workers; returns the variables that tell a worker where (the value
        of the plan's ``ELASTRUN_INPROCESS_SOCKET``)."""
        if self._hub is None:
            self._hub = InprocessHub(self._wake)
        return self._hub.env()

    @property
    def is_open(self) -> bool:
        """Whether workers can opt in (the hub listens)."""
        return self._hub is not None

    def close(self) -> None:
        if self._hub is not None:
            self._hub.close()
            self._hub = None

    # -- deciding -------------------------------------------------------------------------

    def _in_process(self, hub: InprocessHub, local_rank: int, pid: int) -> bool:
        """Whether that worker recovers in place: it said hello, or it was started into
        an in-process round."""
        return hub.opted_in(local_rank, pid) or self._started.get(local_rank) == pid

    def why_not(self, attempt: Attempt, failed: list[Exit], *, alone: bool) -> str | None:
        """Why this failure cannot be recovered in place (None: it can). ``alone``: the
        node is alone in its round (else the workers are kept through the rendezvous,
        and the nodes agree on the round)."""
        hub = self._hub
        if hub is None:
            return "in-process recovery is off"
        if self.round.under_way:
            return "a worker failed while the last in-process recovery was under way"
        if alone and not self._store.serving:
            return "the workers' store is not this agent's"
        survivors = attempt.procs.running()
        if not survivors:
            return "no worker survived"
        pids = attempt.procs.pids()
        if any(ex.exitcode == 0 for ex in attempt.procs.exits.values()):
            return "a worker already finished"
        if not all(self._in_process(hub, ex.local_rank, ex.pid) for ex in failed):
            return "a failed worker did not use elastrun.inprocess"
        if not all(self._in_process(hub, lr, pids[lr]) for lr in survivors):
            return "not every worker uses elastrun.inprocess"
        if alone and not self._holds_state(hub, attempt):
            return self._state_lost(hub, attempt)
        return None

    def _holds_state(self, hub: InprocessHub, attempt: Attempt) -> bool:
        """Whether a running worker of ``attempt`` holds the training's state: one that
        started with the attempt (it trained from the script's start), or one started
        into an in-process round that took a round's commit since; none, when a worker
        found the newest commit lost. Without one, the newest commit went with the
        workers that held it, and an in-process round of the others would silently
        train again from the script's start: the node does not recover in place alone,
        and says so in its offer with other nodes (``inprocess.agent.agree``)."""
        pids = attempt.procs.pids()
        return not hub.said_lost(pids) and any(
            self._started.get(lr) != pids[lr] or hub.has_synced(lr, pids[lr])
            for lr in attempt.procs.running()
        )

    def _state_lost(self, hub: InprocessHub, attempt: Attempt) -> str:
        why = COMMIT_LOST if hub.said_lost(attempt.procs.pids()) else STATE_LOST
        if self._lost_said != attempt.number:  # (said once an attempt)
            self._lost_said = attempt.number
            log.warning(
                "%s: not recovering in place; the group restarts and the script loads "
                "its own checkpoint", why,
            )  # fmt: skip
        return why

    def offer(self, attempt: Attempt, kept: bool) -> Offer:
        """What this node brings to the agreement on a round across nodes, having kept
        the workers of ``attempt`` (``kept``) or not (it then refuses)."""
        if not kept:
            return Offer(False, self._rounds)
        holds = self._hub is not None and self._holds_state(self._hub, attempt)
        return Offer(True, self._rounds, tuple(self._listeners(attempt)), holds=holds)

    def offer_fresh(self, previous: Attempt | None) -> Offer:
        """What this node brings when it starts its workers afresh: they can join an
        in-process round when this agent has had no workers yet (the others run the same
        script) or when its last workers all used ``elastrun.inprocess``."""
        hub = self._hub
        able = hub is not None and (
            previous is None
            or all(self._in_process(hub, lr, pid) for lr, pid in previous.procs.pids().items())
        )
        return Offer(False, self._rounds, fresh=able)

    def into_round(self, plan: LaunchPlan, round_no: int) -> LaunchPlan:
        """``plan`` with its workers started in in-process round ``round_no`` (they take
        the newest commit of the round's kept workers before training)."""
        workers = tuple(
            dataclasses.replace(w, env={**w.env, wire.ROUND_ENV: str(round_no)})
            for w in plan.workers
        )
        return dataclasses.replace(plan, workers=workers)

    def joined_fresh(self, attempt: Attempt, round_no: int) -> None:
        """The workers of ``attempt`` were started into round ``round_no`` (the world
        grows in place): the round is complete when they have all synchronised."""
        self._rounds = round_no
        pids = attempt.procs.pids()
        self.round.begin(round_no, pids, pids, after_failure=False)
        self._started.update(pids)
        log.warning(
            "joining in-process round %d: %d new worker(s) take the newest commit of the "
            "workers that kept running; the world is now %d ranks",
            round_no, len(pids), _world(attempt.plan),
        )  # fmt: skip
        self._events.record(
            "agent.inprocess_round", {"round": round_no, "ranks": "", "survivors": 0}
        )

    # -- answering: did a peer fail? -------------------------------------------------------

    def answer(self, attempt: Attempt, reforming: Callable[[], bool]) -> None:
        """Answer the workers' questions that can be answered now (see ``Answering``);
        ``reforming``: whether the rendezvous says the group re-forms."""
        if self._hub is not None:
            self._answering.answer(self._hub, attempt, self._rounds, reforming)

    def next_answer_in(self) -> float | None:
        """Seconds until a question's hold ends (None: none waits): the loop wakes by
        then to answer it."""
        return self._answering.next_in()

    # -- recovering -----------------------------------------------------------------------

    def recover(self, attempt: Attempt, failed: list[Exit], restart_count: int) -> None:
        """Alone in the round: replace the failed workers and announce the next round,
        on a fresh workers' store this agent serves.

        Raises what starting a replacement raises (the loop then restarts the group).
        """
        self._rounds += 1
        port = self._store.rehost(attempt.plan.facts.master_addr)
        envs = {
            lr: {**env, "MASTER_PORT": str(port), RESTART_COUNT_ENV: str(restart_count)}
            for lr, env in attempt.setup.envs.items()
        }
        setup = dataclasses.replace(attempt.setup, envs=envs)
        self._lead(attempt, setup, self._listeners(attempt), after_failure=True)

    def recover_round(
        self,
        attempt: Attempt,
        plan: LaunchPlan,
        agreement: Agreement,
        restart_count: int,
        *,
        after_failure: bool,
    ) -> None:
        """Every node of the new rendezvous round kept its workers: lead this node's into
        the agreed round, with the round's ranks and store, replacing those that failed
        (``after_failure``: a local worker failed, rather than nodes changing).

        Raises what starting a replacement raises (the loop then restarts the group).
        """
        self._rounds = agreement.round
        envs = {}
        for w in plan.workers:
            envs[w.local_rank] = {
                **attempt.setup.envs[w.local_rank],
                **{k: v for k, v in w.env.items() if k in wire.ROUND_VARIABLES},
                RESTART_COUNT_ENV: str(restart_count),
            }
        setup = dataclasses.replace(attempt.setup, plan=plan, envs=envs)
        # The nodes' listeners as each read them for its offer, and this node's read
        # again now: a group its workers made since has a listener the agreement lacks,
        # and this node's workers cutting their side frees the other nodes' ends too.
        cut = sorted(set(agreement.listeners) | set(self._listeners(attempt)))
        self._lead(attempt, setup, cut, after_failure=after_failure)

    def _listeners(self, attempt: Attempt) -> list[str]:
        pids = attempt.procs.pids()
        return listening_endpoints(pids[lr] for lr in attempt.procs.running())

    def _lead(
        self, attempt: Attempt, setup: AttemptSetup, cut: list[str], *, after_failure: bool
    ) -> None:
        """Announce round ``self._rounds`` to the running workers and replace the others."""
        hub = self._hub
        assert hub is not None
        n = self._rounds
        envs = {lr: {**env, wire.ROUND_ENV: str(n)} for lr, env in setup.envs.items()}
        setup = dataclasses.replace(setup, envs=envs)
        before, after = _world(attempt.setup.plan), _world(setup.plan)
        pids = attempt.procs.pids()
        survivors = {lr: pids[lr] for lr in attempt.procs.running()}
        attempt.setup = setup
        hub.announce(n, envs, survivors, cut)
        failed = sorted(set(pids) - set(survivors))
        replaced: dict[int, int] = {}
        for lr in failed:
            replaced[lr] = self._started[lr] = self._workers.replace_worker(attempt, setup, lr)
        self._workers.update_ranks(setup.plan)
        self.round.begin(
            n, {**survivors, **replaced}, replaced, after_failure=after_failure, cut=cut
        )
        ranks = [attempt.global_rank(lr) for lr in sorted(replaced)]
        what = [f"{len(survivors)} worker(s) keep their processes"]
        if replaced:
            what.insert(0, f"replaced rank(s) {ranks} (pids {sorted(replaced.values())})")
        if before != after:
            what.append(f"the world goes from {before} to {after} ranks")
        if replaced or after < before:
            log.warning("recovering in place (round %d): %s", n, "; ".join(what))
        else:  # a node joined
            log.info("growing in place (round %d): %s", n, "; ".join(what))
        self._events.record(
            "agent.inprocess_round",
            {"round": n, "ranks": ",".join(map(str, ranks)), "survivors": len(survivors)},
        )

    def __repr__(self) -> str:
        return f"InprocessRecovery(hub={self._hub!r}, rounds={self._rounds})"
