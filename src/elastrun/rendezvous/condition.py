"""One node's liveness as one value, ``NodeCondition``, and the moves that change it.

The lease, the round the node is in and whether it must re-form change on three threads
(the keep-alive, the watch of the round, the agent's calls). As fields written one at a
time from four classes, a reader saw half a move, and which change may follow which was
written nowhere. Each event is a pure function here, from the value before to the one
after; ``Liveness.move`` applies it under a lock and readers take ``Liveness.now``. A
move that cannot follow the value it meets is a bug: ``IllegalTransitionError``. One
that a race brings late is none, and changes nothing (a re-formation flagged for a
round the node has left, an acknowledgement of a lease it no longer holds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from elastrun.core.errors import IllegalTransitionError
from elastrun.rendezvous import quiet
from elastrun.rendezvous.closing import Called


@dataclass(frozen=True)
class CurrentRound:
    """The round a node is in: its number ``n``, the node's ``rank`` in it, its ``size``
    in nodes, the id of its ``decision``, the store revision it was decided at
    (``since``), whether every node alive then is a member (``all_live``), and who
    watches it for the others (``watchers``)."""

    n: int
    rank: int
    size: int
    decision: str
    since: int
    all_live: bool = False
    watchers: quiet.Watchers = quiet.EVERYONE


@dataclass(frozen=True)
class NodeCondition:
    """One node's liveness at one moment (``Liveness.now``)."""

    lease: int | None = None  # None: none yet, or revoked by ``leave``
    acked_at: float | None = None  # when the store last acknowledged it (monotonic)
    #: The others consider the node gone (its lease ended, no keep-alive acknowledged for
    #: most of the TTL, or the store is gone): it takes a fresh lease.
    lost: bool = False
    #: Once the store is given up, the one line saying so: every later call ends with it.
    gone: str | None = None
    round: CurrentRound | None = None  # None: none yet, or forgotten after a cool-down
    reform: bool = False  # the round must re-form
    change_reason: str = ""  # why (or why the node was lost), for the agent's log line
    away: int | None = None  # the round in which it gave notice (``Outcome.step_away``)
    #: What the call that woke this quiet member brought of the next round (its next
    #: join takes it: ``joining.join``).
    called: Called | None = None

    @property
    def n(self) -> int | None:
        """The number of the round the node is in (None: none)."""
        return None if self.round is None else self.round.n

    @property
    def rank(self) -> int | None:
        """The node's rank in that round (None: none)."""
        return None if self.round is None else self.round.rank

    @property
    def running(self) -> bool:
        """Whether its round runs: entered, with no re-formation flagged since."""
        return self.round is not None and not self.reform


# -- the lease: the agent's joins, the keep-alive thread ------------------------------------


def registered(c: NodeCondition, lease: int, at: float) -> NodeCondition:
    """A fresh lease, acknowledged at ``at``: the node is no longer lost."""
    if c.lease is not None and not c.lost:
        raise IllegalTransitionError(f"lease {lease} taken while lease {c.lease} is alive")
    return replace(c, lease=lease, acked_at=at, lost=False)


def renewed(c: NodeCondition, lease: int, at: float) -> NodeCondition:
    """The store acknowledged ``lease`` at ``at`` (late, for a lease no longer held: no
    change)."""
    return replace(c, acked_at=at) if c.lease == lease else c


def revoked(c: NodeCondition) -> NodeCondition:
    """The node gave its lease up (``leave``)."""
    return replace(c, lease=None)


def expired(c: NodeCondition) -> NodeCondition:
    """A join found the lease ended (``LeaseExpiredError``): it takes a fresh one."""
    return replace(c, lost=True)


def marked_lost(c: NodeCondition, reason: str) -> NodeCondition:
    """The others consider the node gone, for ``reason``."""
    return replace(c, lost=True, change_reason=reason)


def store_gone(c: NodeCondition, line: str) -> NodeCondition:
    """The store is given up, as ``line`` says (the first line given stays)."""
    gone = line if c.gone is None else c.gone
    return replace(c, gone=gone, lost=True, change_reason=gone)


# -- the round: the agent enters it, the watch thread flags its re-formation ---------------


def entered(c: NodeCondition, new: CurrentRound) -> NodeCondition:
    """The node entered round ``new``, which runs."""
    if not 0 <= new.rank < new.size:
        raise IllegalTransitionError(f"entered round {new.n} at rank {new.rank} of {new.size}")
    if c.round is not None and new.n <= c.round.n:
        raise IllegalTransitionError(f"entered round {new.n} from round {c.round.n}")
    return replace(c, round=new, reform=False)


def reform_flagged(c: NodeCondition, n: int, reason: str) -> NodeCondition:
    """Round ``n`` must re-form, for ``reason`` (once; late for another round: no change)."""
    return c if c.n != n or c.reform else replace(c, reform=True, change_reason=reason)


def woken(c: NodeCondition, called: Called | None) -> NodeCondition:
    """The call that woke this quiet member brought ``called`` of the next round."""
    return replace(c, called=called)


def joining(c: NodeCondition) -> NodeCondition:
    """The node joins the next round: it takes the call that woke it."""
    return replace(c, reform=False, called=None)


def stepped_away(c: NodeCondition) -> NodeCondition:
    """The node gave notice in its round: it does not re-join at once."""
    if c.round is None:
        raise IllegalTransitionError("stepped away outside any round")
    return replace(c, away=c.round.n)


def forgotten(c: NodeCondition) -> NodeCondition:
    """The node sat out rounds (a cool-down): it joins the next as a newcomer."""
    return replace(c, round=None)
