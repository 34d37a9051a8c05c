"""The file timers' wire format and the variables that turn them on.

A worker's :class:`~elastrun.timer.FileTimerClient` writes each request as one JSON
line (the keys torch writes) to the FIFO that the agent's
:class:`~elastrun.supervise.timers.FileTimerServer` reads. Both ends import this module
and nothing of each other: the worker never loads the agent's watchdog, and the agent
never loads the workers' client.

**Version.** The format is torch's, byte for byte, so that torch's client and server
interoperate with ours: every line carries torch's own ``"version": 1``, which is
:data:`VERSION`. elastrun adds no key of its own (torch's server would not know it). A
line of another version is refused (:class:`TimerRequestError`, which the server logs,
dropping the line); a line without the key is read as version 1.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import cast

from elastrun.core.errors import ConfigError, ElastrunError
from elastrun.core.timers import TimerRequest
from elastrun.wire.env import TIMER_FILE_ENV as TORCHELASTIC_TIMER_FILE

__all__ = [
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "VERSION",
    "FileTimerRequest",
    "TimerRequestError",
    "file_timer_enabled",
]

#: The ``version`` of every request line (torch's, which writes 1).
VERSION = 1

TORCHELASTIC_ENABLE_FILE_TIMER = "TORCHELASTIC_ENABLE_FILE_TIMER"


class TimerRequestError(ElastrunError, ValueError):
    """A line on the timer FIFO is not a valid file-timer request."""


class FileTimerRequest(TimerRequest):
    """A :class:`TimerRequest` of the file timers: the worker is a pid, with a signal.

    Args:
        worker_pid: the pid to signal when the timer runs out.
        scope_id: names the timer within the worker.
        expiration_time: wall-clock second at which it runs out; negative releases.
        signal: the signal to send; 0 or less means "report, but do not signal".
    """

    __slots__ = ("signal", "version")

    def __init__(
        self, worker_pid: int, scope_id: str, expiration_time: float, signal: int = 0
    ) -> None:
        super().__init__(worker_pid, scope_id, expiration_time)
        self.version = VERSION
        self.signal = signal

    @property
    def worker_pid(self) -> int:
        return cast(int, self.worker_id)

    def _key(self) -> tuple[object, ...]:
        return (*super()._key(), self.version, self.signal)

    def to_json(self) -> str:
        """The wire form: one JSON object, the same keys torch writes."""
        return json.dumps(
            {
                "version": self.version,
                "pid": self.worker_pid,
                "scope_id": self.scope_id,
                "expiration_time": self.expiration_time,
                "signal": self.signal,
            }
        )

    @classmethod
    def from_json(cls, line: str | bytes) -> FileTimerRequest:
        """Parse one wire line.

        Raises:
            TimerRequestError: not JSON, not an object, a missing or mistyped field, or
                an unknown version.
        """
        try:
            data = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise TimerRequestError(f"not JSON: {line[:200]!r}") from exc
        if not isinstance(data, dict):
            raise TimerRequestError(f"not a JSON object: {line[:200]!r}")
        version = data.get("version", VERSION)
        pid, scope_id = data.get("pid"), data.get("scope_id")
        expiration, sig = data.get("expiration_time"), data.get("signal", 0)
        if version != VERSION or isinstance(version, bool):
            raise TimerRequestError(
                f"unknown timer request version {version!r} (this server reads {VERSION})"
            )
        if not isinstance(pid, int) or not isinstance(scope_id, str) or not _is_int(sig):
            raise TimerRequestError(f"bad pid, scope_id or signal in {data!r}")
        if isinstance(pid, bool) or isinstance(expiration, bool):
            raise TimerRequestError(f"a boolean where a number belongs in {data!r}")
        if not isinstance(expiration, int | float):
            raise TimerRequestError(f"bad expiration_time in {data!r}")
        return cls(pid, scope_id, float(expiration), sig)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def file_timer_enabled(env: Mapping[str, str]) -> bool:
    """Whether ``TORCHELASTIC_ENABLE_FILE_TIMER`` is ``1`` (unset, empty or ``0``: off).

    Raises:
        ConfigError: any other value, naming the variable.
    """
    raw = env.get(TORCHELASTIC_ENABLE_FILE_TIMER, "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(TORCHELASTIC_ENABLE_FILE_TIMER, raw, "must be 1 (on), 0 or empty (off)")
    return raw == "1"
