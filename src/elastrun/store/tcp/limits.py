"""Descriptor limits, listening sockets and bounded logging for a server that strangers
can connect to.

No asyncio here: the launcher raises its descriptor limit at start through this module
without importing the server, and the workers' store binds its sockets with it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("elastrun.store.tcp.server")

#: Descriptors a process serving the store keeps for its own work (spawning workers,
#: log files, pipes): the store stops accepting connections before it eats into them.
MIN_RESERVE = 64
MAX_RESERVE = 1024
_BIND_ATTEMPTS = 20
#: Errors that mean "this machine has no such address family or address": skip it
#: when the name has other addresses (``localhost`` on a host without IPv6).
_UNUSABLE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


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


def _addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, str]]:
    if host == "localhost":
        # Both loopbacks whatever /etc/hosts says: a client may resolve "localhost"
        # to either, and must find us on both.
        return [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    ip = (socket.AF_INET, socket.AF_INET6)
    return list(dict.fromkeys((f, str(sa[0])) for f, _, _, _, sa in infos if f in ip))


def _listener(
    family: socket.AddressFamily, addr: str, port: int, backlog: int | None
) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # Without this the IPv6 socket would also claim the IPv4 port.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((addr, port))
        if backlog is not None:
            sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def bind_listeners(host: str, port: int, backlog: int | None = None) -> list[socket.socket]:
    """Sockets bound to every address of ``host`` (``""``: every interface), all on one
    port, and listening when ``backlog`` is given. Shared by our store server and the
    torch-wire server. ``port`` 0 picks a free port (the same one on every address,
    retried when another address already has it).

    Raises:
        OSError: no address of ``host`` could be bound.
    """
    addrs = _addresses(host, port)
    for attempt in range(_BIND_ATTEMPTS):
        socks: list[socket.socket] = []
        chosen = port
        try:
            for family, addr in addrs:
                try:
                    sock = _listener(family, addr, chosen, backlog)
                except OSError as exc:
                    if exc.errno in _UNUSABLE and len(addrs) > 1:
                        log.debug("not listening on %s: %s", addr, exc)
                        continue
                    raise
                socks.append(sock)
                chosen = sock.getsockname()[1]
            if not socks:
                raise OSError(errno.EADDRNOTAVAIL, f"no usable address for {host!r}")
            return socks
        except OSError as exc:
            for sock in socks:
                sock.close()
            # With port 0 and several addresses, the port the first one got may be
            # taken on another: pick again.
            if port == 0 and exc.errno == errno.EADDRINUSE and attempt < _BIND_ATTEMPTS - 1:
                continue
            raise
    raise AssertionError("unreachable")  # pragma: no cover  # the loop returns or raises


@dataclass(eq=False)
class LogLimiter:
    """At most ``burst`` log lines per kind every ``every`` seconds; the first line of a
    later period says how many were held back (``held``, %-formatted with their count).
    For lines that a stranger can cause once per connection: a flood costs a few lines,
    not a line per connection."""

    logger: logging.Logger
    clock: Callable[[], float]
    every: float = 10.0
    burst: int = 5
    held: str = " (and %d more like it, not logged)"
    #: kind -> (start of its period, lines logged in it)
    _period: dict[str, tuple[float, int]] = field(default_factory=dict, init=False)
    _held: dict[str, int] = field(default_factory=dict, init=False)

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        now = self.clock()
        start, logged = self._period.get(kind, (-math.inf, 0))
        if now - start >= self.every:
            start, logged = now, 0
        if logged >= self.burst:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._period[kind] = (start, logged + 1)
        held = self._held.pop(kind, 0)
        if held:
            msg += self.held
            args = (*args, held)
        self.logger.log(level, msg, *args)

    def __repr__(self) -> str:
        return f"LogLimiter({self.burst} per {self.every}s, held={self._held})"
