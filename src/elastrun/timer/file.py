"""Timers over a named pipe (FIFO): the workers' client, and torch's names for the rest.

A worker's :class:`FileTimerClient` writes each request as one JSON line to the FIFO of
the agent's watchdog (``TORCHELASTIC_TIMER_FILE``), in a single ``write`` of at most
``PIPE_BUF`` bytes, which the kernel keeps whole even when many workers write at once.

The watchdog (:class:`FileTimerServer`, :class:`AgentFileTimer`) is the agent's, in
:mod:`elastrun.supervise.timers`; the wire format is :mod:`elastrun.wire.timer`. Their
names are importable from here, as torch's users expect, but loaded only when asked for.
"""

from __future__ import annotations

import errno
import os
import select
import signal as _signal
import stat
import time

from elastrun.core.lazy import lazy_getattr
from elastrun.timer.api import TimerClient
from elastrun.wire.timer import (
    TORCHELASTIC_ENABLE_FILE_TIMER,
    TORCHELASTIC_TIMER_FILE,
    FileTimerRequest,
    TimerRequestError,
    file_timer_enabled,
)

__all__ = [
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "AgentFileTimer",  # noqa: F822  # lazy: __getattr__
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",  # noqa: F822  # lazy: __getattr__
    "ReapDecision",  # noqa: F822  # lazy: __getattr__
    "TimerRequestError",
    "file_timer_enabled",
    "plan_reaps",  # noqa: F822  # lazy: __getattr__
]

_OPEN_ATTEMPTS = 10
_OPEN_RETRY_INTERVAL = 0.1

#: The agent side's names, loaded on first use (a string, not an import statement: the
#: worker-side package must not depend on the agent's; see pyproject's contracts).
_AGENT_SIDE = {
    "FileTimerServer": "elastrun.supervise.timers.file_server",
    "ReapDecision": "elastrun.supervise.timers.file_server",
    "plan_reaps": "elastrun.supervise.timers.file_server",
    "AgentFileTimer": "elastrun.supervise.timers.agent_timer",
}


__getattr__ = lazy_getattr(__name__, _AGENT_SIDE)


class FileTimerClient(TimerClient):
    """Client of :class:`FileTimerServer`: writes requests to its FIFO.

    The worker id is this process's pid. Each request opens the FIFO without blocking
    (a server that is gone must not hang the worker), writes one line and closes it.

    Args:
        file_path: the FIFO the server created (``TORCHELASTIC_TIMER_FILE``).
        signal: the signal the server sends when a timer runs out; 0 or less asks the
            server only to report it.
    """

    def __init__(self, file_path: str, signal: int = _signal.SIGKILL) -> None:
        self._file_path = file_path
        self.signal = signal

    def _open(self) -> int:
        last: OSError | None = None
        for attempt in range(_OPEN_ATTEMPTS):
            if attempt:
                time.sleep(_OPEN_RETRY_INTERVAL)
            try:
                # ENXIO: no reader has the FIFO open (the server is not up, or gone).
                fd = os.open(self._file_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                last = exc
                continue
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            last = OSError(errno.EINVAL, "not a FIFO", self._file_path)
        raise BrokenPipeError(
            f"timer server is not available at {self._file_path}: {last}"
        ) from last

    def _send(self, request: FileTimerRequest) -> None:
        payload = (request.to_json() + "\n").encode()
        # Writes of at most PIPE_BUF bytes are atomic: lines of concurrent workers never
        # interleave. A longer one could, so it is refused.
        if len(payload) > select.PIPE_BUF:
            raise RuntimeError(
                f"timer request of {len(payload)} bytes exceeds PIPE_BUF ({select.PIPE_BUF}); "
                f"use a shorter scope id: {payload[:200]!r}"
            )
        fd = self._open()
        try:
            for attempt in range(_OPEN_ATTEMPTS):
                if attempt:
                    time.sleep(_OPEN_RETRY_INTERVAL)
                try:
                    os.write(fd, payload)
                    return
                except BlockingIOError:
                    continue  # the pipe is full; the server drains it continuously
            raise BrokenPipeError(f"timer server at {self._file_path} is not reading")
        finally:
            os.close(fd)

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm ``scope_id`` for this pid.

        Raises:
            BrokenPipeError: the server is not available.
            RuntimeError: the request is longer than ``PIPE_BUF``.
        """
        self._send(FileTimerRequest(os.getpid(), scope_id, expiration_time, self.signal))

    def release(self, scope_id: str) -> None:
        """Disarm ``scope_id`` for this pid (expiration time -1).

        Raises:
            BrokenPipeError: the server is not available.
        """
        self._send(FileTimerRequest(os.getpid(), scope_id, -1, 0))

    def __repr__(self) -> str:
        return f"FileTimerClient(file_path={self._file_path!r}, signal={self.signal})"
