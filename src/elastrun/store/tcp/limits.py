"""Descriptor limits and bounded logging for a server that strangers can connect to.

No asyncio here: the launcher raises its descriptor limit at start through this module
without importing the server.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable

#: Descriptors a process serving the store keeps for its own work (spawning workers,
#: log files, pipes): the store stops accepting connections before it eats into them.
MIN_RESERVE = 64
MAX_RESERVE = 1024


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; returns the new limit.

    Each client connection holds a descriptor, and the common soft limit (1024) is
    below "thousands of agents". Child processes inherit the raised limit.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
    return soft


def fd_limit() -> int:
    """This process's open-file soft limit (a large number when unlimited)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def fd_reserve(limit: int) -> int:
    """How many descriptors to keep free under ``limit``: an eighth of it, within
    ``MIN_RESERVE`` .. ``MAX_RESERVE``."""
    return max(MIN_RESERVE, min(MAX_RESERVE, limit // 8))


def open_fds() -> int | None:
    """How many descriptors this process has open (None where the system cannot say)."""
    for where in ("/proc/self/fd", "/dev/fd"):
        try:
            return max(0, len(os.listdir(where)) - 1)  # less the one listdir held
        except OSError:
            continue
    return None


class LogLimiter:
    """At most ``burst`` log lines per kind every ``every`` seconds; the first line of a
    later period says how many were held back. For lines that a stranger can cause once
    per connection: a flood costs a few lines, not a line per connection."""

    def __init__(
        self,
        logger: logging.Logger,
        clock: Callable[[], float],
        every: float = 10.0,
        burst: int = 5,
    ) -> None:
        self._log = logger
        self._clock = clock
        self._every = every
        self._burst = burst
        self._period: dict[str, tuple[float, int]] = {}  # kind -> (start, lines logged)
        self._held: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        now = self._clock()
        start, logged = self._period.get(kind, (-math.inf, 0))
        if now - start >= self._every:
            start, logged = now, 0
        if logged >= self._burst:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._period[kind] = (start, logged + 1)
        held = self._held.pop(kind, 0)
        if held:
            msg += " (and %d more like it, not logged)"
            args = (*args, held)
        self._log.log(level, msg, *args)

    def __repr__(self) -> str:
        return f"LogLimiter({self._burst} per {self._every}s, held={self._held})"
