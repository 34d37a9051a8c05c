"""A process's TCP sockets, read from ``/proc``, and cutting its own connections.

In-process recovery needs both sides: the agent lists the endpoints its workers listen
on (their process groups' listeners), and a recovering worker shuts down its own
connections to those endpoints, so that peers blocked reading from it fail at once
(see ``elastrun.inprocess.worker.cut``). Endpoints are kept in ``/proc/net/tcp``'s own form,
``HEXADDR:HEXPORT``, which is all either side compares.

Linux only; elsewhere every function finds nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"
_ESTABLISHED = "01"


@dataclass(frozen=True)
class TcpSocket:
    """One row of the TCP table: the two ends and the state (``0A`` is LISTEN, ``01``
    ESTABLISHED)."""

    local: str
    remote: str
    state: str

    @property
    def listening(self) -> bool:
        return self.state == _LISTEN

    @property
    def established(self) -> bool:
        return self.state == _ESTABLISHED


def socket_fds(pid: int) -> dict[int, str]:
    """``{fd: socket inode}`` of a process (the ones that can be read)."""
    out = {}
    base = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{base}/{name}")
                if target.startswith("socket:["):
                    out[int(name)] = target[8:-1]
    return out


def tcp_table() -> dict[str, TcpSocket]:
    """``{inode: TcpSocket}`` of every TCP socket of this network namespace."""
    table = {}
    for path in _TABLES:
        with contextlib.suppress(OSError), open(path, encoding="ascii") as fh:
            next(fh, None)
            for line in fh:
                fields = line.split()
                if len(fields) > 9:
                    table[fields[9]] = TcpSocket(fields[1], fields[2], fields[3])
    return table


def listening_endpoints(pids: Iterable[int]) -> list[str]:
    """The endpoints these processes listen on (sorted, without repeats)."""
    table = tcp_table()
    rows = (table.get(inode) for pid in pids for inode in socket_fds(pid).values())
    return sorted({row.local for row in rows if row is not None and row.listening})


def connected_to(pid: int, ends: Endpoints) -> bool:
    """Whether process ``pid`` has an established connection to or from any of ``ends``."""
    table = tcp_table()
    rows = (table.get(inode) for inode in socket_fds(pid).values())
    return any(
        row is not None and row.established and (row.local in ends or row.remote in ends)
        for row in rows
    )


class Endpoints:
    """A set of listening endpoints; a wildcard address (all zeros) matches any address
    on its port."""

    def __init__(self, endpoints: Iterable[str]) -> None:
        self._exact = set()
        self._ports = set()
        for end in endpoints:
            addr, _, port = end.rpartition(":")
            if addr.strip("0"):
                self._exact.add(end)
            else:
                self._ports.add(port)

    def __contains__(self, end: object) -> bool:
        return isinstance(end, str) and (
            end in self._exact or end.rpartition(":")[2] in self._ports
        )

    def __bool__(self) -> bool:
        return bool(self._exact or self._ports)

    def __repr__(self) -> str:
        return f"Endpoints(exact={len(self._exact)}, ports={len(self._ports)})"


def shut_down_own(
    select: Callable[[TcpSocket], bool], table: dict[str, TcpSocket] | None = None
) -> int:
    """Shut down (both directions) this process's TCP sockets that ``select`` picks;
    returns how many. The descriptors stay open: their owners close them.

    Args:
        table: the TCP table, when the caller read it just now (reading it costs
            milliseconds per thousand sockets of the namespace).
    """
    ours = socket_fds(os.getpid())  # (it and tcp_table find nothing where /proc fails)
    if table is None:
        table = tcp_table() if ours else {}
    cut = 0
    for fd, inode in ours.items():
        entry = table.get(inode)
        if entry is None or entry.listening or not select(entry):
            continue
        cut += _shut_down(fd, inode)
    return cut


def _shut_down(fd: int, inode: str) -> int:
    """Shut down the socket at ``fd`` if it is still the one with ``inode`` (another
    thread may have closed it since the table was read, and a new socket may have the
    number now); 1 if it was shut down."""
    try:
        dup = os.dup(fd)
    except OSError:
        return 0
    try:
        if str(os.fstat(dup).st_ino) != inode:
            return 0
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return 0
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0
    finally:
        sock.close()  # closes the duplicate
