"""What one torch-wire store server accepts (:class:`Limits`), and how it tells of
clients that break the rules without flooding the log (:class:`Complaints`)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from elastrun.core.errors import ConfigError
from elastrun.store.tcp.limits import LogLimiter
from elastrun.store.torchwire import codec as c

log = logging.getLogger("elastrun.store.torchwire")


class Complaints(LogLimiter):
    """Warnings about misbehaving clients, at most ``burst`` per ``period`` seconds.

    A job whose every worker misbehaves the same way (thousands of them) must not
    write thousands of lines: the rest are counted and summed up in the next line
    that is let through.
    """

    def __init__(self, clock: Callable[[], float], burst: int = 10, period: float = 60.0) -> None:
        super().__init__(log, clock, period, burst, " (%d similar messages suppressed)")
        self.total = 0

    def __call__(self, message: str, *args: object) -> None:
        self.total += 1
        self.log(logging.WARNING, "", message, *args)


#: Linux gives an accepted socket its listener's options (TCP_NODELAY and the keep-alive
#: settings): the server sets them once on its listening sockets, rather than with five
#: system calls per connection -- in a burst, thousands of them. Elsewhere, per connection.
LISTENER_OPTIONS_INHERITED = sys.platform == "linux"

#: Every worker of a large job connects; the process's descriptor limit is the real cap.
DEFAULT_MAX_CONNECTIONS = 65536


@dataclass(frozen=True, slots=True)
class Limits:
    """What one server accepts; raises ``ConfigError`` naming a bad field.

    ``max_connections``: clients served at once. ``max_frame``: the largest request in
    bytes, in practice the largest value. ``max_key``: the longest key in bytes.
    ``max_handshakes``: connections not validated yet, at once (None: every descriptor
    above the reserve, see ``TorchWireServer``).
    """

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_frame: int = c.DEFAULT_MAX_FRAME
    max_key: int = c.DEFAULT_MAX_KEY
    max_handshakes: int | None = None

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ConfigError("max_connections", self.max_connections, "must be at least 1")
        if self.max_handshakes is not None and self.max_handshakes < 1:
            raise ConfigError("max_handshakes", self.max_handshakes, "must be at least 1")
        if self.max_frame < 64:
            raise ConfigError("max_frame", self.max_frame, "must be at least 64 bytes")
        if not 1 <= self.max_key <= self.max_frame:
            raise ConfigError(
                "max_key", self.max_key, f"must be in 1..{self.max_frame} (max_frame)"
            )
