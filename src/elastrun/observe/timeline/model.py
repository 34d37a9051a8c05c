"""The timeline's model: reading an event log and replaying it into attempts.

See ``elastrun.observe.timeline`` for the file format and what the timeline shows.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from elastrun.core.values import finite_float
from elastrun.observe.sinks import EventValue

# The agent's lifecycle events that the timeline understands; any other event is listed
# and drawn as a plain mark.
RENDEZVOUS = "agent.rendezvous"
WORKERS_STARTED = "agent.workers_started"
WORKER_FAILED = "agent.worker_failed"
RESTART = "agent.restart"
MEMBERSHIP_CHANGE = "agent.membership_change"
FAILED = "agent.failed"
SUCCEEDED = "agent.succeeded"
STATE = "agent.state"
SIGNAL = "agent.signal"

_SECONDS_BELOW = 1e11  # as ms this is 1973; as seconds, the year 5138


@dataclass(frozen=True)
class TimelineEvent:
    """One event of the log, with its time in ms and the lane (agent) it belongs to."""

    index: int
    name: str
    source: str
    t_ms: float
    metadata: dict[str, EventValue]
    lane: str


@dataclass(frozen=True)
class Failure:
    """A worker that failed: when, its global rank and its exit code (<0: signal)."""

    t_ms: float
    rank: int | None
    exitcode: int | None

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a worker"
        return f"{who} {describe_exitcode(self.exitcode)}"


@dataclass
class Attempt:
    """One run of the local workers, from their start to how it ended."""

    number: int
    start_ms: float
    end_ms: float | None = None
    outcome: str = "running"  # running | restarted | re-formed | failed | succeeded | stopped
    detail: str = ""
    failures: list[Failure] = field(default_factory=list)
    restart: Restart | None = None  # the restart that followed this attempt's failure


@dataclass
class Span:
    """A rendezvous round: from entering it to its completion."""

    start_ms: float
    end_ms: float
    label: str


@dataclass
class Restart:
    """From a failure to workers running again (``running_ms`` None: never)."""

    number: int
    failed_ms: float
    running_ms: float | None = None


@dataclass
class Lane:
    """Everything one agent did."""

    name: str
    attempts: list[Attempt] = field(default_factory=list)
    rendezvous: list[Span] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)
    marks: list[TimelineEvent] = field(default_factory=list)
    outcome: str = ""
    open: Attempt | None = None
    pending: Restart | None = None


@dataclass
class Timeline:
    """The events of one log, in time order, and what they add up to per agent."""

    source: str
    events: list[TimelineEvent]
    lanes: dict[str, Lane]
    skipped: int = 0

    @property
    def start_ms(self) -> float:
        return self.events[0].t_ms if self.events else 0.0

    @property
    def end_ms(self) -> float:
        return self.events[-1].t_ms if self.events else 0.0


# --------------------------------------------------------------------------- reading


def describe_exitcode(code: int | None) -> str:
    """``exit code 3``, ``killed by SIGKILL``, or ``exit code unknown``."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _to_ms(value: object) -> float:
    number = finite_float(value)
    if number is None:
        return 0.0
    return number * 1000.0 if abs(number) < _SECONDS_BELOW else number


#: Metadata that tells agents apart (see ``JsonLinesEventSink(context=...)``).
LANE_KEYS = ("hostname", "agent_pid")


def _lane_of(metadata: dict[str, EventValue]) -> str:
    host, pid = (metadata.get(k) for k in LANE_KEYS)
    if host is None and pid is None:
        return "agent"
    return str(host) if pid is None else f"{host or 'agent'} (pid {pid})"


def parse_events(lines: Iterable[str]) -> tuple[list[TimelineEvent], int]:
    """Parse JSON lines into events in time order; returns them and the skipped count."""
    events: list[TimelineEvent] = []
    skipped = 0
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            skipped += 1
            continue
        raw = obj.get("metadata")
        metadata: dict[str, EventValue] = dict(raw) if isinstance(raw, dict) else {}
        events.append(
            TimelineEvent(
                index=index,
                name=obj["name"],
                source=str(obj.get("source", "")),
                t_ms=_to_ms(obj.get("timestamp")),
                metadata=metadata,
                lane=_lane_of(metadata),
            )
        )
    events.sort(key=lambda e: (e.t_ms, e.index))
    return events, skipped


def load_timeline(path: str) -> Timeline:
    """Read an event log and build its timeline.

    Raises:
        OSError: when the file cannot be read.
    """
    with open(path, encoding="utf-8", errors="replace") as fh:
        events, skipped = parse_events(fh)
    return build_timeline(events, source=path, skipped=skipped)


# --------------------------------------------------------------------------- building


def _int(value: EventValue) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (ValueError, OverflowError):  # text that is no number, NaN, Infinity
        return None


def _ms(value: EventValue) -> float:
    return max(0.0, finite_float(value) or 0.0)


def _close(lane: Lane, t_ms: float, outcome: str, detail: str = "") -> None:
    attempt = lane.open
    if attempt is None:
        return
    attempt.end_ms = max(t_ms, attempt.start_ms)
    attempt.outcome = outcome
    attempt.detail = detail
    lane.open = None


def _add_failure(lane: Lane, failure: Failure) -> None:
    attempt = lane.open or (lane.attempts[-1] if lane.attempts else None)
    if attempt is None:
        return
    if failure.rank is not None and any(f.rank == failure.rank for f in attempt.failures):
        return  # already known from an agent.worker_failed event
    attempt.failures.append(failure)


def _on_rendezvous(lane: Lane, ev: TimelineEvent) -> None:
    start = ev.t_ms - _ms(ev.metadata.get("duration_ms"))
    _close(lane, start, "re-formed", "the group was re-formed")
    parts = [f"round {ev.metadata.get('round', '?')}"]
    if "group_rank" in ev.metadata:
        parts.append(f"group rank {ev.metadata['group_rank']}")
    if "group_world_size" in ev.metadata:
        parts.append(f"{ev.metadata['group_world_size']} node(s)")
    lane.rendezvous.append(Span(start, ev.t_ms, ", ".join(parts)))


def _on_started(lane: Lane, ev: TimelineEvent) -> None:
    _close(lane, ev.t_ms, "re-formed", "the group was re-formed")
    number = _int(ev.metadata.get("attempt"))
    start = ev.t_ms - _ms(ev.metadata.get("duration_ms"))
    attempt = Attempt(number if number is not None else len(lane.attempts), start)
    lane.attempts.append(attempt)
    lane.open = attempt
    if lane.pending is not None:
        lane.pending.running_ms = ev.t_ms
        lane.pending = None


def _failure_of(ev: TimelineEvent) -> Failure:
    meta = ev.metadata
    code = meta.get("exitcode", meta.get("exit_code"))
    return Failure(ev.t_ms, _int(meta.get("rank")), _int(code))


def _on_restart(lane: Lane, ev: TimelineEvent) -> None:
    failure = _failure_of(ev)
    _add_failure(lane, failure)
    number = _int(ev.metadata.get("restart_count"))
    restart = Restart(number if number is not None else len(lane.restarts) + 1, ev.t_ms)
    if lane.open is not None:
        lane.open.restart = restart
    _close(lane, ev.t_ms, "restarted", f"{failure.describe()}; restarting")
    lane.restarts.append(restart)
    lane.pending = restart


def _restarts_note(meta: dict[str, EventValue]) -> str:
    n = _int(meta.get("restarts"))
    if not n:
        return ""
    return " after 1 restart" if n == 1 else f" after {n} restarts"


def _on_failed(lane: Lane, ev: TimelineEvent) -> None:
    _close(lane, ev.t_ms, "failed", "the restart budget ran out")
    n = _int(ev.metadata.get("failures"))
    what = f": {n} worker(s) failed" if n is not None else ""
    lane.outcome = f"failed{_restarts_note(ev.metadata)}{what}"


def _on_succeeded(lane: Lane, ev: TimelineEvent) -> None:
    _close(lane, ev.t_ms, "succeeded")
    lane.outcome = f"succeeded{_restarts_note(ev.metadata)}"


def _on_signal(lane: Lane, ev: TimelineEvent) -> None:
    name = ev.metadata.get("signal", "a signal")
    _close(lane, ev.t_ms, "stopped", f"stopped by {name}")
    lane.outcome = f"stopped by {name}"


def _on_state(lane: Lane, ev: TimelineEvent) -> None:
    to = ev.metadata.get("to")
    if to == "STOPPED":
        _close(lane, ev.t_ms, "re-formed", "the group was re-formed")
    elif to == "FAILED":
        _close(lane, ev.t_ms, "failed", "the restart budget ran out")
    elif to == "SUCCEEDED":
        _close(lane, ev.t_ms, "succeeded")


_HANDLERS: dict[str, Callable[[Lane, TimelineEvent], None]] = {
    RENDEZVOUS: _on_rendezvous,
    WORKERS_STARTED: _on_started,
    WORKER_FAILED: lambda lane, ev: _add_failure(lane, _failure_of(ev)),
    RESTART: _on_restart,
    MEMBERSHIP_CHANGE: lambda lane, ev: _close(lane, ev.t_ms, "re-formed", "nodes joined or left"),
    FAILED: _on_failed,
    SUCCEEDED: _on_succeeded,
    SIGNAL: _on_signal,
    STATE: _on_state,
}


def build_timeline(events: list[TimelineEvent], *, source: str = "", skipped: int = 0) -> Timeline:
    """Replay events (in time order) into attempts, rendezvous rounds and restarts."""
    lanes: dict[str, Lane] = {}
    for ev in events:
        lane = lanes.setdefault(ev.lane, Lane(ev.lane))
        handler = _HANDLERS.get(ev.name)
        if handler is not None:
            handler(lane, ev)
        else:
            lane.marks.append(ev)
    end = events[-1].t_ms if events else 0.0
    for lane in lanes.values():
        _close(lane, end, "running", "still running at the last event")
    return Timeline(source, events, lanes, skipped)
