"""Cutting a broken process group's connections to the other workers.

When a peer dies, a rank blocked in a collective with *another* survivor (a ring
allreduce waits on its neighbour, not on the dead rank) is freed only when that
survivor's connections close -- and destroying the survivor's group does not close them
until its own pending collectives end, which wait on the first rank: each waits for the
other. So before tearing its group down, a recovering worker shuts down every TCP
connection it holds to another worker of its node (a process with the same parent, the
agent): the peers' blocked reads fail at once and they recover too.

Linux only (``/proc``); elsewhere nothing is cut and a stuck round ends at the agent's
bound with a whole-group restart.
"""

from __future__ import annotations

import contextlib
import os
import socket

_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def cut_peer_connections() -> int:
    """Shut down this process's TCP connections to its sibling workers; returns how
    many were cut."""
    try:
        me = os.getpid()
        siblings = _siblings(me, os.getppid())
        ours = _socket_fds(me)
        if not siblings or not ours:
            return 0
        table = _tcp_table()
        peer_ends = {table[inode][0] for pid in siblings for inode in _socket_fds(pid).values()
                     if inode in table}  # fmt: skip
    except OSError:
        return 0
    cut = 0
    for fd, inode in ours.items():
        ends = table.get(inode)
        if ends is None or ends[1] not in peer_ends:
            continue
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            finally:
                sock.close()
    return cut


def _siblings(me: int, parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
            # The command may contain spaces and parentheses: fields follow the last ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry))
    return found


def _socket_fds(pid: int) -> dict[int, str]:
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


def _tcp_table() -> dict[str, tuple[str, str]]:
    """``{inode: (local end, remote end)}`` of every TCP socket of this namespace."""
    table = {}
    for path in _TCP_TABLES:
        with contextlib.suppress(OSError), open(path, encoding="ascii") as fh:
            next(fh, None)
            for line in fh:
                fields = line.split()
                if len(fields) > 9:
                    table[fields[9]] = (fields[1], fields[2])
    return table
