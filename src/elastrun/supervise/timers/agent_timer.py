"""The agent's handle on the file-timer watchdog (``TORCHELASTIC_ENABLE_FILE_TIMER``)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import cast

from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import ConfigError
from elastrun.supervise.timers.file_server import FileTimerServer, OnExpired
from elastrun.wire.timer import TORCHELASTIC_TIMER_FILE, file_timer_enabled

__all__ = ["AgentFileTimer"]


class AgentFileTimer:
    """The agent's file-timer watchdog: one :class:`FileTimerServer` for the agent's
    lifetime, started before the first workers, and the workers it reaped, so that the
    agent can name the expired timer when it sees such a worker exit.

    Args:
        file_path: the FIFO path (``TORCHELASTIC_TIMER_FILE`` of the agent's
            environment, as torch honours it); None for a fresh private directory.
        max_interval: the watchdog's longest sleep. Timers are acted on when they run
            out whatever this is; it bounds how stale the progress time can get.
        on_expired: also called with ``(pid, scope_id, signal)`` before a worker is
            signalled (on the watchdog thread).
        clock: the wall clock for expiration times.
    """

    def __init__(
        self,
        file_path: str | None = None,
        *,
        max_interval: float = 1.0,
        on_expired: OnExpired | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not max_interval > 0:
            raise ConfigError("max_interval", max_interval, "must be a positive number of seconds")
        self._new_server = functools.partial(
            FileTimerServer,
            file_path,
            max_interval=max_interval,
            on_expired=self._record,
            clock=clock,
        )
        self._on_expired = on_expired
        self._clock = clock
        self._server: FileTimerServer | None = None
        self._expired: dict[int, str] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AgentFileTimer | None:
        """The watchdog the agent's environment asks for, or None when it asks for none.

        Raises:
            ConfigError: ``TORCHELASTIC_ENABLE_FILE_TIMER`` is neither empty, ``0`` nor
                ``1`` (torch silently treats anything but ``1`` as off).
        """
        if not file_timer_enabled(env):
            return None
        return cls(env.get(TORCHELASTIC_TIMER_FILE) or None)

    @property
    def file_path(self) -> str | None:
        """The FIFO path while running, else None."""
        return self._server.file_path if self._server is not None else None

    def start(self, run_id: str) -> str:
        """Start the watchdog (if not running) and return the FIFO path for the workers.

        Also forgets reaps recorded before: pids of an earlier round may be reused.

        Raises:
            OSError: the FIFO could not be created.
        """
        with self._lock:
            self._expired.clear()
        if self._server is None:
            server = self._new_server(run_id)
            server.start()
            self._server = server
        return cast(str, self._server.file_path)

    def _record(self, pid: int, scope_id: str, sig: int) -> None:
        with self._lock:
            self._expired[pid] = scope_id
        if self._on_expired is not None:
            self._on_expired(pid, scope_id, sig)

    def expired_pids(self) -> dict[int, str]:
        """pid -> scope of workers reaped for an expired timer since the last call.

        A pid is recorded before its signal is sent, so it is here by the time the
        agent sees that worker exit.
        """
        with self._lock:
            out, self._expired = self._expired, {}
        return out

    def get_last_progress_time(self) -> int:
        """The watchdog's last pass (wall-clock second); now when it is not running."""
        if self._server is None:
            return int(self._clock.time())
        return self._server.get_last_progress_time()

    def stop(self) -> None:
        """Stop the watchdog and remove its FIFO. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def __repr__(self) -> str:
        return (
            f"AgentFileTimer(file_path={self.file_path!r}, running={self._server is not None}, "
            f"unreported_expired={len(self._expired)})"
        )
