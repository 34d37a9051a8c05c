"""The timeline as text: every event on a line, then a summary per agent."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from elastrun.observe.sinks import EventValue
from elastrun.observe.timeline.model import LANE_KEYS, Attempt, Lane, Timeline


def rel(tl: Timeline, t_ms: float) -> str:
    """``t_ms`` as seconds after the first event, e.g. ``+1.250s``."""
    return f"+{(t_ms - tl.start_ms) / 1000:.3f}s"


def secs(ms: float) -> str:
    """A duration in ms as seconds, e.g. ``0.150 s``."""
    return f"{ms / 1000:.3f} s"


def _value(value: EventValue) -> str:
    if isinstance(value, str):
        text = value if value and " " not in value and "\n" not in value else json.dumps(value)
        return text if len(text) <= 80 else text[:77] + "..."
    return json.dumps(value)


def format_metadata(metadata: dict[str, EventValue]) -> str:
    """``key=value`` pairs; strings with spaces are quoted, long ones cut."""
    return " ".join(f"{k}={_value(v)}" for k, v in metadata.items())


def header_lines(tl: Timeline) -> list[str]:
    """What the log is: its event count, start time and span, and skipped lines."""
    name = tl.source or "events"
    if not tl.events:
        lines = [f"{name}: no events"]
    else:
        when = datetime.fromtimestamp(tl.start_ms / 1000, tz=UTC)
        lines = [
            f"{name}: {len(tl.events)} event(s) from "
            f"{when:%Y-%m-%d %H:%M:%S}.{when.microsecond // 1000:03d} UTC, "
            f"over {secs(tl.end_ms - tl.start_ms)}"
        ]
    if tl.skipped:
        lines.append(f"({tl.skipped} line(s) that are not events were skipped)")
    return lines


def attempt_line(tl: Timeline, a: Attempt) -> str:
    """One attempt: when it ran, how long, how it ended and which workers failed."""
    end = a.end_ms if a.end_ms is not None else tl.end_ms
    line = (
        f"attempt {a.number}: {rel(tl, a.start_ms)} .. {rel(tl, end)} "
        f"({secs(end - a.start_ms)}), {a.outcome}"
    )
    if a.failures:
        line += ": " + ", ".join(f.describe() for f in a.failures)
    elif a.detail:
        line += f" ({a.detail})"
    return line


def _lane_summary(tl: Timeline, lane: Lane, indent: str) -> list[str]:
    out: list[str] = []
    if lane.rendezvous:
        total = sum(s.end_ms - s.start_ms for s in lane.rendezvous)
        longest = max(lane.rendezvous, key=lambda s: s.end_ms - s.start_ms)
        out.append(
            f"{indent}rendezvous: {len(lane.rendezvous)} round(s), {secs(total)} in total "
            f"(longest {secs(longest.end_ms - longest.start_ms)}: {longest.label})"
        )
    for a in lane.attempts:
        out.append(f"{indent}{attempt_line(tl, a)}")
        r = a.restart
        if r is None:
            continue
        if r.running_ms is None:
            out.append(f"{indent}  restart {r.number}: workers never ran again")
        else:
            out.append(
                f"{indent}  restart {r.number} took {secs(r.running_ms - r.failed_ms)} "
                f"(workers running again at {rel(tl, r.running_ms)})"
            )
    out.append(f"{indent}outcome: {lane.outcome or 'unknown (no final event)'}")
    return out


def render_text(tl: Timeline) -> str:
    """The timeline as text: every event, then a summary per agent."""
    lines = header_lines(tl)
    multi = len(tl.lanes) > 1
    width = max((len(e.name) for e in tl.events), default=0)
    if tl.events:
        lines.append("")
    for ev in tl.events:
        who = f"[{ev.lane}] " if multi else ""
        # The lane label already says which agent; do not repeat it on every line.
        shown = {k: v for k, v in ev.metadata.items() if not (multi and k in LANE_KEYS)}
        meta = format_metadata(shown)
        lines.append(f"{rel(tl, ev.t_ms):>12}  {who}{ev.name:<{width}}  {meta}".rstrip())
    if tl.lanes:
        lines += ["", "summary:"]
    for lane in tl.lanes.values():
        if multi:
            lines.append(f"  {lane.name}:")
        lines += _lane_summary(tl, lane, "    " if multi else "  ")
    return "\n".join(lines) + "\n"
