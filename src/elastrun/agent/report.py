"""What the agent tells the outside world at each step: log lines, metrics, events.

``AgentReport`` holds the sinks and the restart budget (whose counts every report
carries), so the loop says what happened in one call and the wording lives in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from elastrun.agent import failures
from elastrun.agent.attempt import Attempt
from elastrun.agent.policy import RestartBudget
from elastrun.observe.sinks import EventSink, EventValue, MetricSink
from elastrun.rendezvous.api import RendezvousInfo
from elastrun.supervise.processes.procset import Exit

log = logging.getLogger("elastrun.agent")


class AgentReport:
    """Reports the agent's steps to its event and metric sinks (and its log)."""

    def __init__(self, events: EventSink, metrics: MetricSink, budget: RestartBudget) -> None:
        self._events = events
        self._metrics = metrics
        self._budget = budget

    def rendezvous(self, info: RendezvousInfo, took_ms: float) -> None:
        self._metrics.put("agent.rendezvous.duration_ms", took_ms)
        self._metrics.put("agent.group_rank", info.rank)
        self._metrics.put("agent.group_world_size", info.world_size)
        self._events.record(
            "agent.rendezvous",
            {
                "round": info.round,
                "group_rank": info.rank,
                "group_world_size": info.world_size,
                "duration_ms": round(took_ms, 3),
            },
        )

    def workers_started(self, attempt: Attempt, took_ms: float) -> None:
        budget = self._budget
        used = budget.used()  # (read once: a job-wide count lives in the store)
        procs = attempt.procs.processes
        pids = [procs[w.local_rank].pid for w in attempt.plan.workers]
        log.info(
            "started %d worker(s) (attempt %d, restart %d of %d) in %.0f ms; %s",
            len(pids),
            attempt.number,
            used,
            budget.limit,
            took_ms,
            ", ".join(
                f"rank {w.ranks.global_rank}: pid {pid}"
                for w, pid in zip(attempt.plan.workers, pids, strict=True)
            ),
        )
        self._metrics.put("agent.workers_start.duration_ms", took_ms)
        self._metrics.put("agent.world_size", attempt.plan.workers[0].ranks.world_size)
        self._metrics.put("agent.remaining_restarts", budget.limit - used)
        self._events.record(
            "agent.workers_started",
            {
                "attempt": attempt.number,
                "restart_count": used,
                "duration_ms": round(took_ms, 3),
                "pids": ",".join(str(pid) for pid in pids),
            },
        )

    def membership_change(self, reason: str) -> None:
        self._events.record("agent.membership_change", {"reason": reason})
        self._metrics.put("agent.membership_changes", 1)

    def restart(
        self,
        attempt: Attempt,
        failed: list[Exit],
        reasons: Mapping[int, str],
        *,
        in_place: bool = False,
        from_memory: int | None = None,
    ) -> str:
        """Log, count and record a restart after ``failed`` (the first one caused it;
        ``in_place``: only the failed workers are replaced; ``from_memory``: the step of
        the node's memory checkpoints the restarted workers' state comes from); returns
        the failure's history line (``attempt N: rank R (...) exited ...``)."""
        budget = self._budget
        first = failed[0]
        rank = attempt.global_rank(first.local_rank)
        what = failures.describe_exit(first.exitcode)
        if first.pid in reasons:
            what = f"{what} ({reasons[first.pid]})"
        how = "replacing it in place" if in_place else "restarting all workers"
        if from_memory is not None:
            how = f"{how}, state from memory at step {from_memory}"
        log.warning(
            "worker rank %d (local rank %d, pid %d) %s; %s (restart %d of %d)",
            rank, first.local_rank, first.pid, what, how, budget.used(), budget.limit,
        )  # fmt: skip
        self._metrics.put("agent.restarts", 1)
        self._metrics.put("agent.worker_failures", len(failed))
        failures.record_failures(self._events, attempt, failed, restart=True)
        event: dict[str, EventValue] = {
            "attempt": attempt.number,
            "rank": rank,
            "exitcode": first.exitcode,
            "restart_count": budget.used(),
            "in_place": in_place,
        }
        if from_memory is not None:
            event["from_memory_step"] = from_memory
        self._events.record("agent.restart", event)
        where = f"local {first.local_rank}, pid {first.pid}"
        return f"attempt {attempt.number}: rank {rank} ({where}) {what}"

    def failed(self, failures_count: int) -> None:
        self._events.record(
            "agent.failed", {"failures": failures_count, "restarts": self._budget.used()}
        )

    def succeeded(self, workers: int) -> None:
        self._events.record("agent.succeeded", {"restarts": self._budget.used()})
        log.info("all %d worker(s) finished successfully", workers)

    def __repr__(self) -> str:
        return f"AgentReport(events={self._events!r}, metrics={self._metrics!r})"
