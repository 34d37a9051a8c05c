"""In-process recovery, the agent's side: replace only the failed workers and lead the
others into the next round (the workers' side is ``elastrun.inprocess``).

When every worker of the attempt uses ``elastrun.inprocess.run`` (each said hello on
the hub) and the node is alone in its round, a failure does not stop the survivors. The
agent serves a fresh workers' store, starts a replacement for each failed local rank
with the next in-process round's environment, and announces that round to the
survivors, whose failed collectives brought them to wait for it. The round is complete
when every one of them, replacements included, has synchronised its state; when that
does not happen within the bound, the loop falls back to restarting the whole group.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from elastrun.agent.attempt import Attempt
from elastrun.agent.bootstrap_store import BootstrapStore
from elastrun.agent.inprocess_hub import InprocessHub
from elastrun.agent.workers import WorkerProcesses
from elastrun.core import inprocess_wire as wire
from elastrun.core.clock import Clock
from elastrun.core.values import parse_seconds
from elastrun.observe.sinks import EventSink, MetricSink
from elastrun.supervise.processes.procset import Exit
from elastrun.supervise.processes.stacks import request_stacks

log = logging.getLogger("elastrun.agent")

#: How long the survivors and the replacements have to synchronise (seconds) by
#: default; ``ELASTRUN_INPROCESS_TIMEOUT`` sets it.
DEFAULT_TIMEOUT = 60.0
TIMEOUT_ENV = "ELASTRUN_INPROCESS_TIMEOUT"
#: ``ELASTRUN_INPROCESS=0`` turns in-process recovery off (every failure restarts the
#: whole group, as for scripts that do not use ``elastrun.inprocess``).
INPROCESS_ENV = "ELASTRUN_INPROCESS"


def inprocess_timeout(environ: Mapping[str, str]) -> float:
    """The bound on an in-process round, from ``ELASTRUN_INPROCESS_TIMEOUT``.

    Raises:
        ConfigError: not a positive, finite number of seconds.
    """
    raw = environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT
    return parse_seconds(raw, TIMEOUT_ENV, low_open=True)


@dataclass
class _Round:
    """An in-process round under way."""

    number: int
    started: float  # monotonic
    deadline: float  # monotonic
    expected: dict[int, int]  # local rank -> pid of every worker of the round
    replaced: dict[int, int]  # local rank -> pid of the replacements


class InprocessRecovery:
    """Decides whether a failure is recovered in place, and carries the recovery out.

    Args:
        workers: starts the replacements.
        store: the workers' bootstrap store this node serves (re-hosted per round).
        events, metrics: where the recovery is recorded.
        clock: the agent's.
        wake: wakes the agent loop (the hub calls it on every worker message).
        timeout: the bound on a round's synchronisation.
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
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self._workers = workers
        self._store = store
        self._events = events
        self._metrics = metrics
        self._clock = clock
        self._wake = wake
        self._timeout = timeout
        self._hub: InprocessHub | None = None
        self._rounds = 0
        self._current: _Round | None = None

    def open(self, environ: MutableMapping[str, str]) -> None:
        """Listen for workers, and tell every worker where (through ``environ``)."""
        if self._hub is None:
            self._hub = InprocessHub(self._wake)
            environ.update(self._hub.env())

    def close(self) -> None:
        if self._hub is not None:
            self._hub.close()
            self._hub = None

    # -- deciding -------------------------------------------------------------------------

    def why_not(self, attempt: Attempt, failed: list[Exit], nodes: int) -> str | None:
        """Why this failure cannot be recovered in place (None: it can)."""
        hub = self._hub
        if hub is None:
            return "in-process recovery is off"
        if self._current is not None:
            return "a worker failed while the last in-process recovery was under way"
        if nodes > 1:
            return "in-process recovery works within one node for now"
        if not self._store.serving:
            return "the workers' store is not this agent's"
        survivors = attempt.procs.running()
        if not survivors:
            return "no worker survived"
        pids = attempt.procs.pids()
        if not all(hub.opted_in(ex.local_rank, ex.pid) for ex in failed):
            return "a failed worker did not use elastrun.inprocess"
        if not all(hub.opted_in(lr, pids[lr]) for lr in survivors):
            return "not every worker uses elastrun.inprocess"
        return None

    # -- recovering -----------------------------------------------------------------------

    def recover(self, attempt: Attempt, failed: list[Exit], restart_count: int) -> None:
        """Replace the failed workers and announce the next round to the survivors.

        Raises what starting a replacement raises (the loop then restarts the group).
        """
        hub = self._hub
        assert hub is not None
        self._rounds += 1
        n = self._rounds
        port = self._store.rehost(attempt.plan.facts.master_addr)
        envs = {
            lr: {
                **env,
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                wire.ROUND_ENV: str(n),
            }
            for lr, env in attempt.setup.envs.items()
        }
        setup = dataclasses.replace(attempt.setup, envs=envs)
        pids = attempt.procs.pids()
        survivors = {lr: pids[lr] for lr in attempt.procs.running()}
        hub.announce(n, envs, survivors)
        replaced = {
            ex.local_rank: self._workers.replace_worker(attempt, setup, ex.local_rank)
            for ex in failed
        }
        now = self._clock.monotonic()
        self._current = _Round(n, now, now + self._timeout, {**survivors, **replaced}, replaced)
        ranks = [attempt.global_rank(lr) for lr in sorted(replaced)]
        log.warning(
            "recovering in place (round %d): replaced rank(s) %s (pids %s); %d worker(s) "
            "keep their processes",
            n, ranks, sorted(replaced.values()), len(survivors),
        )  # fmt: skip
        self._events.record(
            "agent.inprocess_round",
            {"round": n, "ranks": ",".join(map(str, ranks)), "survivors": len(survivors)},
        )

    @property
    def under_way(self) -> bool:
        return self._current is not None

    def progress(self) -> str:
        """``"done"`` (the round is complete), ``"waiting"``, ``"late"`` (past the
        bound: restart the group) or ``"idle"`` (no round under way)."""
        current, hub = self._current, self._hub
        if current is None or hub is None:
            return "idle"
        if all(hub.synced(lr, pid, current.number) for lr, pid in current.expected.items()):
            took = self._clock.monotonic() - current.started
            self._current = None
            log.info("in-process round %d complete in %.0f ms", current.number, took * 1000)
            self._metrics.put("agent.inprocess.duration_ms", took * 1000)
            self._events.record(
                "agent.inprocess_recovered",
                {"round": current.number, "duration_ms": round(took * 1000, 3)},
            )
            return "done"
        if self._clock.monotonic() >= current.deadline:
            return "late"
        return "waiting"

    def laggards(self) -> list[int]:
        """The local ranks of the round under way that have not synchronised yet."""
        current, hub = self._current, self._hub
        if current is None or hub is None:
            return []
        return sorted(
            lr for lr, pid in current.expected.items() if not hub.synced(lr, pid, current.number)
        )

    def abandon_late(self, attempt: Attempt) -> None:
        """Give up a round past its bound, keeping the stacks of the workers that did
        not synchronise (in their attempt directories) and naming them."""
        dumps = request_stacks(attempt.stack_requests(self.laggards()))
        where = ", ".join(
            f"rank {attempt.global_rank(lr)}: {d.path}" for lr, d in sorted(dumps.items()) if d.text
        )
        self.abandon(
            "not every worker synchronised in time"
            + (f" (stacks of those that did not: {where})" if where else "")
        )

    def abandon(self, why: str) -> None:
        """Give the round up (the loop restarts the whole group)."""
        current, self._current = self._current, None
        if current is None:
            return
        log.warning(
            "in-process round %d abandoned: %s; restarting all workers", current.number, why
        )
        self._events.record("agent.inprocess_abandoned", {"round": current.number, "why": why})

    def __repr__(self) -> str:
        return f"InprocessRecovery(hub={self._hub!r}, rounds={self._rounds})"
