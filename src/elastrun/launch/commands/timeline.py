"""``elastrun timeline EVENTS.jsonl [--html OUT.html]``: what happened to a job.

Reads an event log written by ``--event-log-handler file:PATH``, prints the timeline and
with ``--html`` writes a page with a chart; the work is :mod:`elastrun.observe.timeline`.
"""

from __future__ import annotations

import argparse
import sys

from elastrun.observe.timeline import load_timeline, render_html, render_text

__all__ = ["timeline_main"]


def timeline_main(argv: list[str]) -> int:
    """Run ``elastrun timeline`` with ``argv`` (the arguments after ``timeline``).

    Prints the text timeline to stdout; returns 0, or 2 for a usage error or a file
    that cannot be read or written (with one line on stderr).
    """
    parser = argparse.ArgumentParser(
        prog="elastrun timeline",
        description="Show what happened to a job, from its --event-log-handler file:PATH log.",
    )
    parser.add_argument("events", metavar="EVENTS.jsonl", help="the event log to read")
    parser.add_argument("--html", metavar="OUT.html", help="also write a page with a chart")
    try:
        args = parser.parse_args(argv)
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
