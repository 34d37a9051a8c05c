"""The in-process round under way on this node: who must synchronise, by when, and how
it ends.

``InprocessRecovery`` begins a round when it leads the workers into one (a failure
recovered in place, or a node's workers joining); from then on this part alone holds
it. The in-place rung asks it where the round stands at every pass of the loop
(:class:`RoundState`), and ends it: complete when every worker of the round has
synchronised, given up when it is late or the group re-forms, and with the kept workers
that never reached it (stuck in a collective that did not fail) killed, so that the
next round replaces them.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elastrun.agent.attempt import Attempt
from elastrun.core.clock import Clock
from elastrun.core.tcp_sockets import Endpoints
from elastrun.inprocess.agent.hub import InprocessHub
from elastrun.inprocess.agent.stuck import CONFIRM, SURE_AFTER, blocked_for_good, end_stuck
from elastrun.observe.sinks import EventSink, MetricSink
from elastrun.supervise.processes.stacks import request_stacks

__all__ = ["InprocessRound", "RoundState"]

log = logging.getLogger("elastrun.agent")


class RoundState(enum.Enum):
    """Where an in-process round stands."""

    IDLE = "idle"  # none is under way
    WAITING = "waiting"  # not every worker has synchronised yet
    DONE = "done"  # every worker has: the round is complete
    LATE = "late"  # past its bound: the group restarts


@dataclass
class _Round:
    """An in-process round under way."""

    number: int
    started: float  # monotonic
    expected: dict[int, int]  # local rank -> pid of every worker of the round
    replaced: dict[int, int]  # local rank -> pid of the replacements
    after_failure: bool  # a recovery (not a node joining): judged by the stall guard
    peers: Endpoints  # where the workers listened when it began (the round's cut)
    ended: set[int] = dataclasses.field(default_factory=set)  # stuck, and killed
    # local rank -> since when it was found blocked for good at every look (monotonic)
    blocked: dict[int, float] = dataclasses.field(default_factory=dict)
    why: str = ""  # how ``stuck`` last found workers stuck, as the log line says it


class InprocessRound:
    """The round under way (at most one), from its start to its end.

    Args:
        hub: the channel to the workers, when it is open (their hello, join and sync).
        clock: the agent's.
        events, metrics: where the round's end is recorded.
        timeout: how long a round may take until every worker has synchronised.
        join_timeout: how long a kept worker may take to reach the round; one that
            waits in a gloo collective with no connection left is replaced sooner
            (``inprocess.agent.stuck``).
        blocked: how such a worker is told (``stuck.blocked_for_good``: tests stand in).
    """

    def __init__(
        self,
        hub: Callable[[], InprocessHub | None],
        clock: Clock,
        events: EventSink,
        metrics: MetricSink,
        *,
        timeout: float,
        join_timeout: float,
        blocked: Callable[[int, Endpoints], bool] = blocked_for_good,
    ) -> None:
        self._hub = hub
        self._clock = clock
        self._events = events
        self._metrics = metrics
        self._timeout = timeout
        self._join_timeout = join_timeout
        self._blocked = blocked
        self._current: _Round | None = None

    def begin(
        self,
        number: int,
        expected: dict[int, int],
        replaced: dict[int, int],
        *,
        after_failure: bool,
        cut: Sequence[str] = (),
    ) -> None:
        """Round ``number`` is under way: every worker of ``expected`` (local rank ->
        pid), ``replaced`` among them, is to synchronise within the bound (``cut``: the
        listeners the round's message told the workers to cut)."""
        self._current = _Round(
            number,
            self._clock.monotonic(),
            dict(expected),
            dict(replaced),
            after_failure,
            Endpoints(cut),
        )

    @property
    def under_way(self) -> bool:
        return self._current is not None

    def state(self) -> RoundState:
        """Where the round under way stands (a query: nothing changes)."""
        current, hub = self._current, self._hub()
        if current is None or hub is None:
            return RoundState.IDLE
        if all(hub.synced(lr, pid, current.number) for lr, pid in current.expected.items()):
            return RoundState.DONE
        if self._clock.monotonic() >= current.started + self._timeout:
            return RoundState.LATE
        return RoundState.WAITING

    def complete(self) -> int | None:
        """End the round under way, every worker having synchronised (``DONE``), and
        record it; returns the commit it restored after a failure (None: a node joined,
        or no round was under way)."""
        current, hub = self._current, self._hub()
        if current is None or hub is None:
            return None
        took = self._clock.monotonic() - current.started
        self._current = None
        log.info("in-process round %d complete in %.0f ms", current.number, took * 1000)
        self._metrics.put("agent.inprocess.duration_ms", took * 1000)
        self._events.record(
            "agent.inprocess_recovered",
            {"round": current.number, "duration_ms": round(took * 1000, 3)},
        )
        if not current.after_failure:
            return None
        return max(hub.commit(lr) for lr in current.expected)

    def stuck(self) -> list[int]:
        """The local ranks of kept workers that have not reached the round under way
        within the join bound, or are blocked for good in a gloo collective
        ``SURE_AFTER`` seconds into it, at every look for ``CONFIRM`` seconds (stuck in
        a collective that never fails)."""
        current, hub = self._current, self._hub()
        if current is None or hub is None:
            return []
        now = self._clock.monotonic()
        waited = now - current.started
        if waited < min(SURE_AFTER - CONFIRM, self._join_timeout):
            return []
        absent = [
            lr
            for lr, pid in sorted(current.expected.items())
            if lr not in current.replaced
            and lr not in current.ended
            and not hub.joined(lr, pid, current.number)
        ]
        if waited >= self._join_timeout:
            current.why = f"within {self._join_timeout:.0f}s (stuck in a collective"
            return absent
        found = []
        for lr in absent:
            if not self._blocked(current.expected[lr], current.peers):
                current.blocked.pop(lr, None)
            elif now - current.blocked.setdefault(lr, now) >= CONFIRM:
                found.append(lr)
        current.why = (
            "(blocked for good in a gloo collective, its connections to the round's "
            f"workers gone, {waited:.1f}s into the round"
        )
        return found

    def end_stuck(self, attempt: Attempt, local_ranks: list[int]) -> None:
        """Keep the stacks of the stuck workers, then SIGKILL them: the loop replaces
        them in place as failed workers, in the next round (``inprocess.agent.stuck``)."""
        current = self._current
        assert current is not None
        current.ended.update(local_ranks)
        end_stuck(attempt, local_ranks, current.number, current.why, self._events)

    def laggards(self) -> list[int]:
        """The local ranks of the round under way that have not synchronised yet."""
        current, hub = self._current, self._hub()
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
            + "; restarting all workers"
        )

    def abandon(self, why: str) -> None:
        """Give the round up (the loop restarts the whole group)."""
        current, self._current = self._current, None
        if current is None:
            return
        log.warning("in-process round %d abandoned: %s", current.number, why)
        self._events.record("agent.inprocess_abandoned", {"round": current.number, "why": why})

    def __repr__(self) -> str:
        number = None if self._current is None else self._current.number
        return f"InprocessRound(under_way={number})"
