"""Stragglers: workers (or nodes) whose steps stay slower than their peers'.

Pure logic over step times keyed by anything hashable: local ranks on one node (from a
snapshot, :func:`step_times`), or nodes of a job (from :class:`NodeSummary` values each
node publishes, :func:`summarize`). Time is cut into windows of ``window`` seconds; in
each, a key's step time is the mean of what was observed of it. A key is a straggler
once its step time was above ``factor`` times the median of its peers' (every other
key's) in ``windows`` consecutive windows -- one slow window (a checkpoint, a noisy
neighbour) is not enough. It is reported, never killed; it stops being one at the first
window in which it keeps up.

What step times can show: under synchronous data parallelism every rank waits for the
slowest in each collective, so all ranks' intervals between optimizer steps are the
same and a slow rank does not stand out from them. These intervals show stragglers
among workers that do not wait for each other (independent workers, or nodes of
different jobs sharing a pool); for synchronous jobs feed the detector each worker's
own busy time when one is measured.

What the agent feeds it (:func:`pace_times`): each worker's moving average step time, or
the time since its last report when that is longer -- so a worker that slowed down
badly or stopped shows at once, not only after its next report.

The defaults (:class:`StragglerSettings`: 2x the median for 3 windows of 10 s) report
a rank that stayed twice as slow as its peers for half a minute. Workers of equal speed
are far from that even on a busy 2-CPU machine: scheduling noise is milliseconds per
step, and a one-off pause (a checkpoint, a garbage collection) fills one window, not
three in a row.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Generic, TypeVar

from elastrun.core.errors import ConfigError
from elastrun.core.values import check_number, parse_seconds
from elastrun.pace.agent.record import ProgressRecord

__all__ = [
    "NodeSummary",
    "Straggler",
    "StragglerDetector",
    "StragglerSettings",
    "pace_times",
    "parse_straggler_factor",
    "step_times",
    "summarize",
]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Straggler(Generic[K]):
    """A key whose step time stayed above ``factor`` times its peers' median."""

    key: K
    step_time: float  # its mean step time in the last window, seconds
    peer_median: float  # the median of its peers' in that window
    windows: int  # consecutive slow windows so far

    @property
    def ratio(self) -> float:
        return self.step_time / self.peer_median if self.peer_median > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"{self.key}: {self.step_time:.3g} s per step, {self.ratio:.2f}x its peers' median"
            f" ({self.peer_median:.3g} s) for {self.windows} windows"
        )


@dataclass(frozen=True)
class StragglerSettings:
    """How stragglers are found (``--straggler-factor``, ``--straggler-window``).

    A rank (or a node) is reported once its step time was above ``factor`` times its
    peers' median in ``windows`` consecutive windows of ``window`` seconds.

    Raises:
        ConfigError: a value out of range.
    """

    factor: float = 2.0
    windows: int = 3
    window: float = 10.0

    def __post_init__(self) -> None:
        check_number(self.factor, "--straggler-factor", low=1.0, low_open=True, high=1000.0)
        check_number(self.windows, "StragglerSettings.windows", integer=True, low=1)
        parse_seconds(self.window, "--straggler-window", low_open=True)


def parse_straggler_factor(value: str | float, field: str = "--straggler-factor") -> float | None:
    """``--straggler-factor``: a number above 1, or ``off`` / ``0`` (None: no detection).

    Raises:
        ConfigError: naming ``field`` and the value as given.
    """
    if isinstance(value, str) and value.strip().lower() in ("off", "0", "0.0"):
        return None
    if not isinstance(value, str) and value == 0:
        return None
    try:
        return check_number(value, field, low=1.0, low_open=True, high=1000.0)
    except ConfigError:
        raise ConfigError(field, value, "must be a number > 1 and <= 1000, or off") from None


@dataclass(frozen=True)
class NodeSummary:
    """One node's step times in a few numbers, for job-wide detection.

    ``step_time`` is the slowest rank's (a node is as slow as its slowest worker).
    """

    node: str
    ranks: int
    step_time: float
    median: float
    slowest_rank: int
    seq: int = 0  # the publisher's count: a reader tells a fresh summary from a stale one

    #: The version of :meth:`to_json`'s document.
    VERSION = 1

    def to_json(self) -> bytes:
        """A small versioned JSON document (what a node publishes in the store)."""
        return json.dumps({"version": self.VERSION, **asdict(self)}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> NodeSummary | None:
        """The summary in ``raw``; None for anything else (another version, garbage)."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("version") != cls.VERSION:
                return None
            return cls(
                str(data["node"]), int(data["ranks"]), float(data["step_time"]),
                float(data["median"]), int(data["slowest_rank"]), int(data.get("seq", 0)),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None


def _median(values: Iterable[float]) -> float:
    # Not statistics.median: that module (fractions, decimal) costs the launch 10 ms.
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def step_times(snapshot: Mapping[int, ProgressRecord]) -> dict[int, float]:
    """``{local_rank: step time}`` of the workers of a snapshot that have one."""
    return {rank: rec.step_time for rank, rec in snapshot.items() if rec.step_time is not None}


def pace_times(snapshot: Mapping[int, ProgressRecord], now: float) -> dict[int, float]:
    """``{local_rank: pace}`` of the workers with a step time: the moving average step
    time, or the time since the last report (``now``: monotonic) when that is longer."""
    return {
        rank: max(rec.step_time, now - rec.last_report)
        for rank, rec in snapshot.items()
        if rec.step_time is not None
    }


def summarize(
    node: str, times: Mapping[int, float], ranks: Mapping[int, int] | None = None
) -> NodeSummary | None:
    """The summary of one node's ``{local_rank: step time}`` (None: no worker has one
    yet); ``ranks`` gives a local rank's global rank, for the slowest worker's."""
    if not times:
        return None
    slowest = max(times, key=lambda lr: (times[lr], -lr))
    rank = (ranks or {}).get(slowest, slowest)
    return NodeSummary(node, len(times), times[slowest], _median(times.values()), rank)


class StragglerDetector(Generic[K]):
    """Finds keys slower than ``factor`` times their peers' median for ``windows`` windows.

    Args:
        factor: how much slower than the peers' median counts as slow (> 1).
        windows: consecutive slow windows before a key is reported.
        window: the length of a window in seconds.
        min_peers: the fewest peers a key is compared with (fewer: never a straggler).

    Raises:
        ConfigError: a value out of range.
    """

    def __init__(
        self, factor: float = 1.5, windows: int = 3, window: float = 30.0, min_peers: int = 1
    ) -> None:
        self.factor = check_number(factor, "factor", low=1.0, low_open=True, high=1000.0)
        self.windows = int(check_number(windows, "windows", integer=True, low=1))
        self.window = parse_seconds(window, "window", low_open=True)
        self.min_peers = int(check_number(min_peers, "min_peers", integer=True, low=1))
        self._start: float | None = None
        self._sums: dict[K, tuple[float, int]] = {}
        self._streak: dict[K, int] = {}
        self._current: dict[K, Straggler[K]] = {}

    def observe(self, times: Mapping[K, float | None], now: float) -> list[Straggler[K]]:
        """Add one observation of step times (``None``: none yet) at ``now``.

        A window covers the observations from its first to the last before ``window``
        seconds have passed; the first observation after that closes it.

        Returns:
            The keys that became stragglers in the window this observation closed.
        """
        if self._start is None:
            self._start = now
        new: list[Straggler[K]] = []
        if now - self._start >= self.window:
            means = {key: total / count for key, (total, count) in self._sums.items()}
            self._sums = {}
            self._start = now
            new = self._close_window(means)
        for key, value in times.items():
            if value is not None and value > 0:
                total, count = self._sums.get(key, (0.0, 0))
                self._sums[key] = (total + value, count + 1)
        return new

    def observe_nodes(self, summaries: Iterable[NodeSummary], now: float) -> list[Straggler[K]]:
        """:meth:`observe` keyed by node name (a detector of ``str`` keys)."""
        return self.observe({s.node: s.step_time for s in summaries}, now)  # type: ignore[misc]  # K is str for nodes

    def _close_window(self, means: Mapping[K, float]) -> list[Straggler[K]]:
        new: list[Straggler[K]] = []
        for key in list(self._streak):
            if key not in means:  # gone, or silent for a whole window: start over
                del self._streak[key]
                self._current.pop(key, None)
        for key, mean in means.items():
            peers = [m for k, m in means.items() if k != key]
            median = _median(peers) if len(peers) >= self.min_peers else 0.0
            if median <= 0 or mean <= self.factor * median:
                self._streak.pop(key, None)
                self._current.pop(key, None)
                continue
            streak = self._streak.get(key, 0) + 1
            self._streak[key] = streak
            if streak >= self.windows:
                straggler = Straggler(key, mean, median, streak)
                if key not in self._current:
                    new.append(straggler)
                self._current[key] = straggler
        return new

    @property
    def stragglers(self) -> dict[K, Straggler[K]]:
        """The keys that are stragglers now (as of the last closed window)."""
        return dict(self._current)

    def __repr__(self) -> str:
        return (
            f"StragglerDetector(factor={self.factor}, windows={self.windows}, "
            f"window={self.window}, stragglers={sorted(map(str, self._current))})"
        )
