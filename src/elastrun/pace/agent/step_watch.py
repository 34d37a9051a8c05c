"""The workers' pace as the agent follows it: step metrics, and stragglers reported.

One ``PaceWatch`` per agent samples the progress board about once a second
(:meth:`PaceWatch.due`, :meth:`PaceWatch.sample`): each worker's step counter, last step
and step time go to the metric sink, and the pure :class:`StragglerDetector` compares
the workers of this node. Across nodes, each agent publishes a summary of its own
workers through the rendezvous store and the agent of group rank 0 compares the nodes
(:mod:`elastrun.pace.agent.exchange`); without a store of that kind (a single node, a
handler of another kind) detection stays node-local.

A straggler is reported -- one warning, an ``agent.straggler`` event, the
``worker.straggler`` / ``node.straggler`` gauge -- and never stopped; when it keeps up
again, an info line and an ``agent.straggler_cleared`` event say so. Detection needs no
``--hang-timeout``: only progress reports (optimizer steps, ``elastrun.progress()``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.observe.sinks import EventSink, EventValue, MetricSink, labelled
from elastrun.pace.agent.exchange import NodeExchange
from elastrun.pace.agent.record import Snapshot
from elastrun.pace.agent.straggler import (
    Straggler,
    StragglerDetector,
    StragglerSettings,
    pace_times,
    summarize,
)
from elastrun.rendezvous.keys import RunKeys
from elastrun.store.api import Store

log = logging.getLogger("elastrun.agent")

#: How often the board is sampled (at most; a short ``--straggler-window`` samples
#: four times per window).
SAMPLE_EVERY = 1.0
#: Bounds of the period of the job-wide exchange (half a window within them).
EXCHANGE_MIN, EXCHANGE_MAX = 0.5, 5.0


class PaceWatch:
    """Step metrics and straggler reports of one agent.

    Args:
        settings: how stragglers are found; None: metrics only.
        events, metrics: where reports go.
        clock: the monotonic clock of the samples (the workers' report clock).
    """

    def __init__(
        self,
        settings: StragglerSettings | None,
        events: EventSink,
        metrics: MetricSink,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._settings = settings
        self._events = events
        self._metrics = metrics
        self._clock = clock
        self._every = SAMPLE_EVERY if settings is None else min(SAMPLE_EVERY, settings.window / 4)
        self._next = 0.0
        self._attempt = 0
        self._ranks: dict[int, int] = {}  # local rank -> global rank
        self._seen: dict[int, tuple[int, int, float]] = {}  # lr -> (pid, reports, last report)
        self._local: StragglerDetector[int] | None = None
        self._nodes: StragglerDetector[str] | None = None
        self._exchange: NodeExchange | None = None
        self._slowest: dict[str, int] = {}  # node -> the global rank of its slowest worker

    def start_round(
        self, store: object, run_id: str, round: int, group_rank: int, group_world_size: int
    ) -> None:
        """A new rendezvous round: publish (and, on group rank 0, compare) node summaries
        through ``store`` when it is a rendezvous store and there are several nodes."""
        self.close()
        settings = self._settings
        if settings is None or group_world_size < 2 or not isinstance(store, Store):
            return
        every = min(EXCHANGE_MAX, max(EXCHANGE_MIN, settings.window / 2))
        prefix = RunKeys.of_run(run_id).pace(round)
        reader = group_rank == 0
        self._exchange = NodeExchange(store, prefix, str(group_rank), reader=reader, every=every)
        self._exchange.start()
        if reader:
            self._nodes = StragglerDetector(settings.factor, settings.windows, settings.window)

    def start_attempt(self, number: int, ranks: Mapping[int, int]) -> None:
        """New workers (``ranks``: local rank -> global rank): their peers start afresh."""
        self._clear(self._local, "rank")
        self._attempt = number
        self._ranks = dict(ranks)
        self._seen = {}
        s = self._settings
        self._local = StragglerDetector(s.factor, s.windows, s.window) if s else None
        self._next = self._clock.monotonic() + self._every

    def due(self) -> bool:
        """Whether it is time for :meth:`sample`."""
        return self._clock.monotonic() >= self._next

    def sample(self, snapshot: Snapshot, running: Iterable[int]) -> None:
        """Take one sample: ``snapshot`` of every worker, ``running`` those still running
        (only they are compared)."""
        now = self._clock.monotonic()
        self._next = now + self._every
        self._count_steps(snapshot)
        if self._local is None:
            return
        alive = set(running)
        times = pace_times({lr: r for lr, r in snapshot.items() if lr in alive}, now)
        before = set(self._local.stragglers)
        for straggler in self._local.observe(times, now):
            self._report(straggler, "rank")
        self._cleared(before, self._local, "rank")
        self._exchange_summaries(times, now)

    def _count_steps(self, snapshot: Snapshot) -> None:
        """Each worker's steps since the last sample (a counter), its last step and its
        mean step time over the interval (a histogram observation)."""
        for lr, rec in snapshot.items():
            pid, reports, last = self._seen.get(lr, (rec.pid, 0, -1.0))
            if pid != rec.pid:  # a new worker in this slot
                reports, last = 0, -1.0
            self._seen[lr] = (rec.pid, rec.reports, rec.last_report)
            new = rec.reports - reports
            if new <= 0:
                continue
            labels = {"rank": self._ranks.get(lr, lr), "local_rank": lr}
            self._metrics.put(labelled("worker.steps", **labels), new)
            self._metrics.put(labelled("worker.step", **labels), rec.step)
            if last >= 0:
                duration_ms = (rec.last_report - last) / new * 1000
                self._metrics.put(labelled("worker.step.duration_ms", **labels), duration_ms)

    def _exchange_summaries(self, times: Mapping[int, float], now: float) -> None:
        exchange = self._exchange
        if exchange is None:
            return
        summary = summarize("", times, self._ranks)
        if summary is not None:
            exchange.offer(summary)
        summaries = exchange.take()
        if summaries is None or self._nodes is None:
            return
        self._slowest = {s.node: s.slowest_rank for s in summaries}
        before = set(self._nodes.stragglers)
        for straggler in self._nodes.observe_nodes(summaries, now):
            self._report(straggler, "node")
        self._cleared(before, self._nodes, "node")

    def _report(self, s: Straggler[int] | Straggler[str], scope: str) -> None:
        settings = self._settings
        assert settings is not None, "stragglers are only found with settings"
        gauge, meta, who = self._identify(s.key, scope)
        if scope == "node":
            slowest = self._slowest.get(str(s.key), -1)
            meta["rank"] = slowest
            who += f" (its slowest: rank {slowest})"
        meta.update(
            attempt=self._attempt, step_time=round(s.step_time, 6),
            peer_median=round(s.peer_median, 6), ratio=round(s.ratio, 3), windows=s.windows,
        )  # fmt: skip
        log.warning(
            "%s is a straggler: %.3gs per step, %.1fx the median of its peers (%.3gs) for %d "
            "windows of %gs (--straggler-factor %g); it is not stopped",
            who, s.step_time, s.ratio, s.peer_median, s.windows, settings.window, settings.factor,
        )  # fmt: skip
        # The count first: a scrape that shows the gauge then shows the report too.
        self._metrics.put("agent.stragglers", 1)
        self._metrics.put(gauge, 1)
        self._events.record("agent.straggler", meta)

    def _cleared(
        self,
        before: set[int] | set[str],
        detector: StragglerDetector[int] | StragglerDetector[str],
        scope: str,
    ) -> None:
        """Report the stragglers of ``before`` that kept up in the last window."""
        for key in before - set(detector.stragglers):
            gauge, meta, who = self._identify(key, scope)
            log.info("%s, a straggler, keeps up again", who)
            self._metrics.put(gauge, 0)
            self._events.record("agent.straggler_cleared", meta)

    def _clear(
        self, detector: StragglerDetector[int] | StragglerDetector[str] | None, scope: str
    ) -> None:
        """Its workers (or the round) ended: the gauges of its stragglers go back to 0."""
        if detector is not None:
            for key in detector.stragglers:
                self._metrics.put(self._identify(key, scope)[0], 0)

    def _identify(self, key: int | str, scope: str) -> tuple[str, dict[str, EventValue], str]:
        """The gauge's name, the event's metadata and the log's words for one straggler."""
        if scope == "rank":
            lr = int(key)
            rank = self._ranks.get(lr, lr)
            return (
                labelled("worker.straggler", rank=rank, local_rank=lr),
                {"scope": scope, "rank": rank, "local_rank": lr},
                f"rank {rank} (local rank {lr})",
            )
        return (
            labelled("node.straggler", group_rank=str(key)),
            {"scope": scope, "group_rank": int(key)},
            f"node of group rank {key}",
        )

    def close(self) -> None:
        """Stop the job-wide exchange of this round (and forget the nodes). Never raises."""
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.close()
        self._clear(self._nodes, "node")
        self._nodes = None

    def __repr__(self) -> str:
        return (
            f"PaceWatch(settings={self._settings!r}, attempt={self._attempt}, "
            f"local={self._local!r}, nodes={self._nodes!r}, exchange={self._exchange!r})"
        )
