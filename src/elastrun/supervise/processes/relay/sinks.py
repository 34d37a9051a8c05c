"""The relay's descriptors: what a worker gets for its stdout/stderr, and where bytes go.

A :class:`Sink` is where the relay thread writes (a log file, the console, a filtered
file); it stops taking output after its first write error, so one full disk or closed
console never stops the others. :class:`FdSink` writes to a descriptor; the console can
also be a Python text stream (``relay.console``).
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["CloseAt", "FdSink", "Sink", "WorkerStdio", "close_quietly", "logger", "open_log"]

# One logger for the whole relay package (console and output use it), named for it.
logger = logging.getLogger("elastrun.supervise.processes.relay")

_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
_FILE_MODE = 0o666  # the umask applies, as with open()
#: Longest wait for a non-blocking console to become writable before re-checking.
_WRITABLE_POLL = 1.0


def open_log(path: str, *, append: bool = False) -> int:
    """Open (create, truncate -- or append to) a log file for writing; close-on-exec.

    Raises:
        OSError: the file cannot be opened.
    """
    flags = (_FILE_FLAGS & ~os.O_TRUNC) | os.O_APPEND if append else _FILE_FLAGS
    return os.open(path, flags, _FILE_MODE)


def close_quietly(fd: int, what: str) -> None:
    """Close ``fd``; a failure is logged as a warning naming ``what``, never raised."""
    try:
        os.close(fd)
    except OSError as exc:
        logger.warning("could not close %s (fd %d): %s", what, fd, exc)


@dataclass(frozen=True)
class WorkerStdio:
    """The descriptors one worker gets for its stdout and stderr.

    ``None`` means "inherit the launcher's". Give them to ``Popen`` as ``stdout=`` and
    ``stderr=`` (or ``dup2`` them in a forked child), then call :meth:`close_in_parent`
    whether or not the start succeeded: the relay sees a stream's end only when every
    copy of the pipe's write end is closed.

    Attributes:
        stdout_fd, stderr_fd: descriptors for the child, created close-on-exec.
        owned_fds: descriptors created for the child that the parent must close.
    """

    stdout_fd: int | None
    stderr_fd: int | None
    owned_fds: list[int] = field(default_factory=list, repr=False, compare=False)

    def close_in_parent(self) -> None:
        """Close the parent's copies of the descriptors made for the child; idempotent."""
        while self.owned_fds:
            close_quietly(self.owned_fds.pop(), "worker stdio")


#: The relay's drain deadline (monotonic), read at each wait; None while it is open.
CloseAt = Callable[[], float | None]


class Sink(Protocol):
    """Where the relay thread writes bytes; it stops taking output after an error.

    ``path`` and ``local_rank`` are set for a worker's log file, so that a failure to
    write it can be told to the failure report (``""`` and None otherwise).
    """

    name: str
    path: str
    local_rank: int | None

    def write(self, data: bytes | bytearray, close_at: CloseAt) -> OSError | None:
        """Write all of ``data`` unless the sink is dead; returns the error that killed
        it, if that was an ``OSError``. Never raises."""

    def close(self) -> None:
        """Take no more output; release what the sink owns. Idempotent."""


class FdSink:
    """A descriptor the relay thread writes to (closed by :meth:`close` if ``owned``)."""

    def __init__(
        self, fd: int, name: str, *, owned: bool, path: str = "", local_rank: int | None = None
    ) -> None:
        self.fd = fd
        self.name = name
        self.owned = owned
        self.path = path
        self.local_rank = local_rank
        self.dead = fd < 0

    def write(self, data: bytes | bytearray, close_at: CloseAt) -> OSError | None:
        """Write all of ``data``; see :class:`Sink`.

        A console someone made non-blocking is waited for, but not past ``close_at()``:
        the rest of ``data`` is then dropped. Any other write error marks the sink dead.
        """
        if self.dead:
            return None
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.fd, view)
            except BlockingIOError:
                # Someone made the console non-blocking; wait for room, not past close.
                if not _wait_writable(self.fd, close_at()):
                    logger.warning("%s stayed full until the deadline; output dropped", self.name)
                    return None
                continue
            except OSError as exc:
                self.dead = True
                logger.warning(
                    "cannot write to %s (%s); its output is dropped from now on", self.name, exc
                )
                return exc
            view = view[written:]
        return None

    def close(self) -> None:
        if self.owned and self.fd >= 0:
            close_quietly(self.fd, self.name)
        self.fd = -1
        self.dead = True

    def __repr__(self) -> str:
        return f"FdSink({self.name!r}, fd={self.fd}, dead={self.dead})"


def _wait_writable(fd: int, close_at: float | None) -> bool:
    timeout = _WRITABLE_POLL if close_at is None else close_at - time.monotonic()
    if timeout <= 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    poller.poll(timeout * 1000.0)
    return True
