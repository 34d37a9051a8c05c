"""How a long rendezvous wait shows its progress without flooding the log.

On a terminal: one status line, rewritten in place. In a log (a file, a pipe, a
scheduler's output): a line when what it says changes -- the number of nodes in -- and
otherwise at most every ``every`` seconds, so a ten-minute wait writes a handful of
lines, not one every few seconds.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from elastrun.core.clock import SYSTEM_CLOCK, Clock

#: Longest silence in a log while the wait goes on unchanged.
LOG_EVERY = 30.0


def round_status(
    n: int, status: Mapping[str, Any] | None, min_nodes: int, max_nodes: int
) -> tuple[object, str]:
    """What a joining node shows of round ``n``: the key that matters and the line.

    ``status`` is the closer's progress (None: this node waits for the round to close,
    not knowing more); a log gets a line when the count changes, else one every 30 s
    at most.
    """
    if status is None:
        return (n, "follower"), (
            f"rendezvous round {n}: waiting for it to close "
            f"(min {min_nodes}, max {max_nodes} node(s))"
        )
    if not status.get("started", True):
        return (n, "spare"), (
            f"waiting for round {n} to start: the running nodes re-form first, or this "
            f"node is a spare while the job runs at its maximum of {max_nodes} node(s)"
        )
    count = status.get("joined", 0)
    parts = [f"rendezvous round {n}: {count} node(s) in (min {min_nodes}, max {max_nodes})"]
    if status.get("last_call_in") is not None:
        parts.append(f"last call ends in {max(0.0, status['last_call_in']):.0f}s")
    elif status.get("timeout_in") is not None:
        parts.append(f"timeout in {max(0.0, status['timeout_in']):.0f}s")
    return (n, count), "; ".join(parts)


@dataclass(eq=False)
class ProgressLine:
    """One long wait's progress.

    Args:
        logger: where log lines go (not on a terminal).
        clock: for the pacing.
        stream: the terminal, when it is one (default: ``sys.stderr``).
        every: the longest silence in a log, in seconds.
    """

    logger: logging.Logger
    clock: Clock = SYSTEM_CLOCK
    stream: TextIO | None = None
    every: float = LOG_EVERY
    _key: object = field(default=None, init=False)
    _at: float | None = field(default=None, init=False)
    _open: bool = field(default=False, init=False)  # a terminal line waits for its newline

    def _tty(self) -> TextIO | None:
        stream = self.stream if self.stream is not None else sys.stderr
        try:
            return stream if stream.isatty() else None
        except (AttributeError, ValueError):
            return None  # closed or not a file

    def show(self, key: object, text: str) -> None:
        """Report ``text``; ``key`` is what matters (a new key is always shown)."""
        tty = self._tty()
        if tty is not None:
            tty.write(f"\r[elastrun] {text}\x1b[K")
            tty.flush()
            self._open = True
            return
        now = self.clock.monotonic()
        if key == self._key and self._at is not None and now - self._at < self.every:
            return
        self._key, self._at = key, now
        self.logger.info("%s", text)

    def end(self) -> None:
        """The wait is over: a terminal line gets its newline; the pacing restarts."""
        if self._open:
            tty = self._tty()
            if tty is not None:
                tty.write("\n")
                tty.flush()
            self._open = False
        self._key, self._at = None, None

    def __repr__(self) -> str:
        return f"ProgressLine(key={self._key!r}, open={self._open})"
