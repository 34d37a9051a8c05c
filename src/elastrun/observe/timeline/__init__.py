"""What happened to a job, from its event log (``elastrun timeline``).

Reads an event log written by ``--event-log-handler file:PATH`` (one JSON object per
line: ``name``, ``source``, ``timestamp``, ``metadata``) and prints

* every event on one line, with its time relative to the first event;
* a summary per agent: rendezvous rounds, each attempt (when its workers started, how
  long they ran, how it ended, which ranks failed with which exit code) and how long
  each restart took (from the failure to workers running again);

and, with ``--html``, writes a self-contained page with an SVG chart of the same
(attempts as bars, rendezvous rounds above them, failures as markers; no scripts).

Events of several agents in one file (a shared file system) are shown in one lane per
agent, told apart by the ``hostname`` and ``agent_pid`` metadata when present.
Timestamps are milliseconds since the epoch; a value below 1e11 is taken as seconds,
so hand-written or foreign logs also work. A line that is not a JSON object (say, the
torn last line of a killed writer) is skipped and counted.
"""

from __future__ import annotations

from elastrun.observe.timeline.model import (
    Attempt,
    Failure,
    Lane,
    Restart,
    Span,
    Timeline,
    TimelineEvent,
    build_timeline,
    describe_exitcode,
    load_timeline,
    parse_events,
)
from elastrun.observe.timeline.svg import render_html, render_svg
from elastrun.observe.timeline.text import format_metadata, render_text

__all__ = [
    "Attempt",
    "Failure",
    "Lane",
    "Restart",
    "Span",
    "Timeline",
    "TimelineEvent",
    "build_timeline",
    "describe_exitcode",
    "format_metadata",
    "load_timeline",
    "parse_events",
    "render_html",
    "render_svg",
    "render_text",
]
