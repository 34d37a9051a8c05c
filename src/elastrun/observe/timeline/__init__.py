"""``elastrun timeline EVENTS.jsonl [--html OUT.html]``: what happened to a job.

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

import argparse
import sys

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
    "timeline_main",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elastrun timeline",
        description="Show what happened to a job, from its --event-log-handler file:PATH log.",
    )
    p.add_argument("events", metavar="EVENTS.jsonl", help="the event log to read")
    p.add_argument("--html", metavar="OUT.html", help="also write a page with a chart")
    return p


def timeline_main(argv: list[str]) -> int:
    """Run ``elastrun timeline`` with ``argv`` (the arguments after ``timeline``).

    Prints the text timeline to stdout; returns 0, or 2 for a usage error or a file
    that cannot be read or written (with one line on stderr).
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage error already
        return exc.code if isinstance(exc.code, int) else 2
    try:
        tl = load_timeline(args.events)
    except OSError as exc:
        print(
            f"elastrun timeline: error: cannot read {args.events}: {exc.strerror}", file=sys.stderr
        )
        return 2
    sys.stdout.write(render_text(tl))
    if args.html:
        try:
            with open(args.html, "w", encoding="utf-8") as fh:
                fh.write(render_html(tl))
        except OSError as exc:
            print(
                f"elastrun timeline: error: cannot write {args.html}: {exc.strerror}",
                file=sys.stderr,
            )
            return 2
        print(f"chart written to {args.html}")
    return 0
