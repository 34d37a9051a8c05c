"""The ranks' reports of their memory checkpoints, read by the agent: events and metrics.

Each rank that uses ``elastrun.checkpoint`` keeps its totals in the node directory
(``report-rank-<R>.json``, :mod:`elastrun.wire.checkpoint`; written by
``checkpoint.worker.report``). The agent reads them -- on the loop's passes about once
a second, when a failure is answered, and once more before the directory is removed --
and says what changed since it last looked:

- a load: the event ``agent.checkpoint_restored`` (rank, local rank, the step restored,
  how long the load took) and the metrics ``checkpoint.restored_step`` and
  ``checkpoint.restore.duration_ms``;
- saves: ``checkpoint.saves`` (a counter), the means of the saves since the last look
  of ``checkpoint.blocked.duration_ms`` (the training thread's wait),
  ``checkpoint.save.duration_ms`` (until the rank's step is written) and
  ``checkpoint.lag.duration_ms`` (the copy lag: until the step is complete on every
  rank), and ``checkpoint.step``, the newest step complete on every rank;
- a worker's last report, once a restarted worker's replaces it or the run ends: the
  event ``agent.checkpoint_saves`` with its totals and means (one per worker process
  that saved: the timeline's summary).

Every metric is labelled with the rank and the local rank. Plain files and JSON, no
torch. A report that cannot be read (half a file cannot be: they are renamed into
place; another version can) is skipped, said once per file at debug level.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

from elastrun.checkpoint.agent.holdings import read_reports
from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.observe.sinks import EventSink, EventValue, MetricSink, labelled
from elastrun.wire.checkpoint import RankReport

__all__ = ["REPORT_EVERY", "CheckpointReports", "summary"]

log = logging.getLogger("elastrun.agent")

#: Seconds between two looks on the loop's passes (the metrics' resolution).
REPORT_EVERY = 1.0


@dataclass
class _Seen:
    """The last report read of one rank, and whether its summary was recorded."""

    report: RankReport
    summarised: bool = False


class CheckpointReports:
    """Reads the ranks' reports in the node directory; records events and metrics.

    Args:
        directory: the node directory's path now (None: none was made).
        events, metrics: where they go.
        clock: the monotonic clock of :meth:`due`.
        every: seconds between two looks (:meth:`due`).
    """

    def __init__(
        self,
        directory: Callable[[], str | None],
        events: EventSink,
        metrics: MetricSink,
        clock: Clock = SYSTEM_CLOCK,
        every: float = REPORT_EVERY,
    ) -> None:
        self._directory = directory
        self._events = events
        self._metrics = metrics
        self._clock = clock
        self._every = every
        self._next = clock.monotonic() + every
        self._seen: dict[int, _Seen] = {}
        self._unreadable: set[str] = set()

    def due(self) -> bool:
        """Whether it is time to :meth:`collect` (about once every ``every`` seconds)."""
        return self._clock.monotonic() >= self._next

    def collect(self) -> None:
        """Read every rank's report and record what is new since the last look."""
        self._next = self._clock.monotonic() + self._every
        restored = [r for r in map(self._take, self._read()) if r is not None]
        if restored:
            # One line for the node's ranks (each has its event).
            steps = sorted({r.restored for r in restored if r.restored is not None})
            log.info(
                "memory checkpoint: rank(s) %s restored step %s from memory (the slowest "
                "load took %.0f ms)",
                ", ".join(str(r.rank) for r in restored),
                ", ".join(map(str, steps)),
                max(r.restore_s for r in restored) * 1000,
            )

    def finish(self) -> None:
        """The last look before the directory goes: collect, then record the summary of
        every worker not yet summarised (idempotent)."""
        self.collect()
        for seen in self._seen.values():
            self._summarise(seen)

    def newest(self, pids: Collection[int]) -> int | None:
        """The newest step complete on every rank, as the workers ``pids`` last
        reported it when read (None: none of them reported one). Reports of other
        processes -- a rank of an earlier, larger world -- do not count."""
        steps = [
            s.report.newest
            for s in self._seen.values()
            if s.report.pid in pids and s.report.newest is not None
        ]
        return max(steps) if steps else None

    # -- reading -------------------------------------------------------------------------

    def _read(self) -> list[RankReport]:
        path = self._directory()
        return [] if path is None else read_reports(path, self._skipped)

    def _skipped(self, name: str, exc: Exception) -> None:
        if name not in self._unreadable:
            self._unreadable.add(name)
            log.debug("memory checkpoints: %s skipped: %s", name, exc)

    # -- what changed --------------------------------------------------------------------

    def _take(self, report: RankReport) -> RankReport | None:
        """Record what ``report`` says that is new; returns it when it says that a
        step was restored."""
        seen = self._seen.get(report.rank)
        if seen is not None and seen.report == report:
            return None
        if seen is None or seen.report.pid != report.pid:
            if seen is not None:
                self._summarise(seen)  # a restarted worker's report replaced it
            before = RankReport(rank=report.rank, local_rank=report.local_rank, pid=report.pid)
        else:
            before = seen.report
        self._seen[report.rank] = _Seen(report)
        self._record_saves(before, report)
        if report.loads > before.loads and report.restored is not None:
            self._record_restore(report)
            return report
        return None

    def _name(self, metric: str, report: RankReport) -> str:
        return labelled(metric, rank=report.rank, local_rank=report.local_rank)

    def _record_restore(self, report: RankReport) -> None:
        assert report.restored is not None  # (checked by the caller)
        took_ms = report.restore_s * 1000
        self._metrics.put(self._name("checkpoint.restored_step", report), report.restored)
        self._metrics.put(self._name("checkpoint.restore.duration_ms", report), took_ms)
        self._events.record(
            "agent.checkpoint_restored",
            {
                "rank": report.rank,
                "local_rank": report.local_rank,
                "pid": report.pid,
                "step": report.restored,
                "duration_ms": round(took_ms, 3),
            },
        )

    def _record_saves(self, before: RankReport, now: RankReport) -> None:
        saves = now.saves - before.saves
        if saves <= 0:
            return
        self._metrics.put(self._name("checkpoint.saves", now), saves)
        blocked = (now.blocked_s - before.blocked_s) / saves
        self._metrics.put(self._name("checkpoint.blocked.duration_ms", now), blocked * 1000)
        complete = now.complete - before.complete
        if complete > 0:
            written = (now.save_s - before.save_s) / complete
            lag = (now.lag_s - before.lag_s) / complete
            self._metrics.put(self._name("checkpoint.save.duration_ms", now), written * 1000)
            self._metrics.put(self._name("checkpoint.lag.duration_ms", now), lag * 1000)
        if now.newest is not None:
            self._metrics.put(self._name("checkpoint.step", now), now.newest)

    def _summarise(self, seen: _Seen) -> None:
        """Record a worker's totals once (only a worker that saved has any)."""
        r = seen.report
        if seen.summarised or r.saves == 0:
            return
        seen.summarised = True
        self._events.record("agent.checkpoint_saves", summary(r))

    def __repr__(self) -> str:
        return f"CheckpointReports(ranks={sorted(self._seen)}, every={self._every})"


def summary(report: RankReport) -> dict[str, EventValue]:
    """A worker's totals as an event's metadata: its counts, the mean of each time
    in milliseconds, and the newest step complete on every rank."""

    def mean_ms(total: float, count: int) -> float | None:
        return round(total / count * 1000, 3) if count else None

    return {
        "rank": report.rank,
        "local_rank": report.local_rank,
        "pid": report.pid,
        "saves": report.saves,
        "complete": report.complete,
        "blocked_ms": mean_ms(report.blocked_s, report.saves),
        "save_ms": mean_ms(report.save_s, report.complete),
        "lag_ms": mean_ms(report.lag_s, report.complete),
        "newest": report.newest,
    }
