"""Hang verdicts: which workers stopped making progress, from their last reports.

Pure logic: a :class:`HangDetector` reads a snapshot (``{local_rank: ProgressRecord}``)
and the time, and says whether any worker has been silent past its timeout. It keeps no
state: a worker is armed by its first report (a worker that never reports -- a script
without an optimizer and without ``elastrun.progress()`` -- is never hung), and disarmed
when its record is reset for a new worker.

``--hang-timeout SECONDS`` is one timeout for every worker. ``--hang-timeout auto``
(:class:`AutoTimeout`) derives each worker's from its own history::

    timeout = max(floor, factor * longest)       floor = warmup_floor (1800 s) during the
                                                         first warmup_reports (10) reports,
                                                         then 600 s; factor = 3

where ``longest`` is the longest interval between two of its reports so far. Why:

* ``auto`` must never kill a healthy job, so what it has not seen yet is covered by a
  floor that matches torch's own collective timeouts: 10 minutes (the default of NCCL
  process groups), and 30 minutes (``default_pg_timeout``, gloo's) while the job warms
  up. A hung job is then found no later than torch itself would give up -- but with
  every rank's stacks, and without depending on a collective being the thing stuck.
* Warm-up: the slow first step itself is not timed (a worker is armed by its first
  report), but the next few may still be slow -- recompilations, autotuning, caches
  filled, buckets rebuilt -- so for the first ``warmup_reports`` reports the floor is
  ``warmup_floor``.
* Periodic pauses with no optimizer step -- checkpoint saves, evaluation passes -- show
  up in ``longest`` once they happened, and ``factor`` leaves room for one that is
  slower than the last (a busier file system). The first such pause must fit in the
  floor; a job whose first evaluation takes longer than 10 minutes should report
  progress from its evaluation loop (``elastrun.progress()``) or use a fixed timeout.
* The mean step time is not used: ``longest`` is never below it, and a hang is judged
  on gaps, not on the typical pace.

The verdict names every armed rank, longest silent first, and the ranks that stopped
first: those whose last report is the earliest, within half a step (ranks of one
synchronous job stop at the same step, their last reports a jitter apart; naming one of
them as the culprit would be a guess -- the stack dump tells which one is stuck where).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import ConfigError
from elastrun.core.values import MAX_SECONDS, check_number, parse_seconds
from elastrun.pace.agent.record import ProgressRecord

__all__ = [
    "AutoTimeout",
    "HangDetector",
    "HangVerdict",
    "RankSilence",
    "parse_hang_timeout",
]


@dataclass(frozen=True)
class AutoTimeout:
    """``--hang-timeout auto``: each worker's timeout from its own report history.

    ``max(warmup_floor if reports < warmup_reports else floor, factor * longest)``; see
    the module's documentation for the reasoning.

    Raises:
        ConfigError: a negative or non-finite floor, a factor below 1, or no warm-up
            reports.
    """

    floor: float = 600.0
    warmup_floor: float = 1800.0
    warmup_reports: int = 10
    factor: float = 3.0

    def __post_init__(self) -> None:
        parse_seconds(self.floor, "AutoTimeout.floor", low_open=True)
        parse_seconds(self.warmup_floor, "AutoTimeout.warmup_floor", low_open=True)
        check_number(self.warmup_reports, "AutoTimeout.warmup_reports", integer=True, low=1)
        check_number(self.factor, "AutoTimeout.factor", low=1.0, high=1000.0)

    def timeout_for(self, record: ProgressRecord) -> float:
        """The timeout of the worker whose last report is ``record``, in seconds."""
        floor = self.warmup_floor if record.reports < self.warmup_reports else self.floor
        return max(floor, self.factor * (record.longest or 0.0))

    def __str__(self) -> str:
        return "auto"


def parse_hang_timeout(value: str | float, field: str = "--hang-timeout") -> float | AutoTimeout:
    """``--hang-timeout``: a positive number of seconds, or ``auto``.

    Raises:
        ConfigError: naming ``field`` and the value as given.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AutoTimeout()
    try:
        return parse_seconds(value, field, low_open=True)
    except ConfigError:
        raise ConfigError(
            field, value, f"must be a number of seconds > 0 and <= {MAX_SECONDS} (a year), or auto"
        ) from None


@dataclass(frozen=True)
class RankSilence:
    """How long one armed worker has been silent, against its timeout."""

    local_rank: int
    step: int
    silent_for: float
    timeout: float

    @property
    def hung(self) -> bool:
        return self.silent_for >= self.timeout

    def describe(self) -> str:
        return (
            f"local rank {self.local_rank}: step {self.step}, silent {self.silent_for:.1f} s"
            f" (timeout {self.timeout:g} s)"
        )


@dataclass(frozen=True)
class HangVerdict:
    """At least one worker made no progress for its timeout.

    Attributes:
        at: when it was decided (monotonic seconds).
        ranks: every armed worker, the longest silent first.
        stopped_first: the local ranks whose last report is the earliest (within half
            a step): the first to stop, but not necessarily the cause.
    """

    at: float
    ranks: tuple[RankSilence, ...]
    stopped_first: tuple[int, ...]

    @property
    def hung(self) -> tuple[int, ...]:
        """The local ranks past their timeout, the longest silent first."""
        return tuple(r.local_rank for r in self.ranks if r.hung)

    def describe(self) -> str:
        """One line for the log and the event: who is hung, who stopped first, everyone."""
        hung = ", ".join(str(r) for r in self.hung)
        first = ", ".join(str(r) for r in self.stopped_first)
        every = "; ".join(r.describe() for r in self.ranks)
        return f"no progress from local rank(s) {hung}; stopped first: {first}; {every}"


class HangDetector:
    """Decides from snapshots whether workers stopped making progress.

    Args:
        timeout: seconds without a report after which an armed worker is hung, or an
            :class:`AutoTimeout` (``--hang-timeout auto``).
        clock: the monotonic clock of :meth:`check` without ``now`` (the workers'
            reports are on ``CLOCK_MONOTONIC``, which is the system clock's).

    Raises:
        ConfigError: a timeout that is not a positive, finite number of seconds.
    """

    def __init__(self, timeout: float | AutoTimeout, clock: Clock = SYSTEM_CLOCK) -> None:
        if not isinstance(timeout, AutoTimeout):
            timeout = parse_seconds(timeout, "--hang-timeout", low_open=True)
        self.timeout = timeout
        self._clock = clock

    def timeout_for(self, record: ProgressRecord) -> float:
        """The timeout of the worker whose last report is ``record``."""
        if isinstance(self.timeout, AutoTimeout):
            return self.timeout.timeout_for(record)
        return self.timeout

    def check(
        self, snapshot: Mapping[int, ProgressRecord], now: float | None = None
    ) -> HangVerdict | None:
        """The verdict on ``snapshot`` at ``now`` (default: the clock's); None: no hang.

        Only the workers in ``snapshot`` are judged: pass the ones still running.
        """
        if now is None:
            now = self._clock.monotonic()
        if not snapshot:
            return None
        order = sorted(snapshot.items(), key=lambda item: (item[1].last_report, item[0]))
        ranks = tuple(
            RankSilence(rank, rec.step, max(0.0, now - rec.last_report), self.timeout_for(rec))
            for rank, rec in order
        )
        if not any(r.hung for r in ranks):
            return None
        first = order[0][1]
        tie = 0.5 * (first.step_time or 0.0)
        stopped_first = tuple(
            rank for rank, rec in order if rec.last_report - first.last_report <= tie
        )
        return HangVerdict(now, ranks, stopped_first)

    def __repr__(self) -> str:
        return f"HangDetector(timeout={self.timeout})"
