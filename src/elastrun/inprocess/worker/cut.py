"""Cutting a broken process group's connections to the other workers.

When a peer dies, a rank blocked in a collective with *another* survivor (a ring
allreduce waits on its neighbour, not on the dead rank) is freed only when that
survivor's connections close -- and destroying the survivor's group does not close them
until its own pending collectives end, which wait on the first rank: each waits for the
other. So a recovering worker shuts down its connections to the other workers:

- when the round comes, those to (and from) every endpoint the round's workers listen
  on, on every node: the agents collect them (``core.tcp_sockets``) and the round's
  message carries them; the channel's thread cuts them as the message arrives, also
  while the training function still runs, and with them those to the workers of its
  own node (below): under load a survivor was now and then left blocked for good on a
  same-node peer whose connection the listeners' cut had not reached;
- before tearing its group down, those to the workers of its own node (processes with
  the same parent), found in ``/proc`` (reading the TCP table costs milliseconds):
  when no round came yet (the agent may wait on the other nodes, or not know of the
  failure yet), and again when it came first, for a group made since (the round's list
  names the listeners the agent found when it led the round).

The peers' blocked reads then fail at once and they recover too. Linux only; elsewhere
nothing is cut and a stuck round ends at the agent's bound with a whole-group restart.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from elastrun.core.procinfo import children
from elastrun.core.tcp_sockets import Endpoints, shut_down_own, socket_fds, tcp_table


def cut_peer_connections() -> int:
    """Shut down this process's TCP connections to its sibling workers; returns how
    many were cut."""
    try:
        siblings = [pid for pid in children(os.getppid()) if pid != os.getpid()]
        if not siblings:
            return 0
        table = tcp_table()
        peer_ends = {table[inode].local for pid in siblings
                     for inode in socket_fds(pid).values() if inode in table}  # fmt: skip
    except OSError:
        return 0
    return shut_down_own(lambda s: s.remote in peer_ends, table)


def cut_connections(listeners: Iterable[str]) -> int:
    """Shut down this process's TCP connections to or from any of ``listeners`` (the
    round's workers' listening endpoints); returns how many were cut."""
    ends = Endpoints(listeners)
    if not ends:
        return 0
    return shut_down_own(lambda s: s.local in ends or s.remote in ends)
