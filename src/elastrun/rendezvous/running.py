"""What a member of a running round watches for: the reasons to re-form, kept up to date
from watch events at O(1) per change (pure: the handler feeds it what the store said)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from elastrun.rendezvous.keys import RunKeys
from elastrun.store.api import EventKind, WatchEvent


class RoundWatch:
    """What a member of running round ``n`` watches for: the reasons to re-form.

    Members do not hold the whole member list (with N nodes that would be O(N^2) bytes
    through the store): ``is_member`` answers for one node when an event needs it (the
    handler reads that node's member page, then remembers). With ``all_live`` (the
    round's result says every node alive at its revision is a member) the view answers
    itself for every node it has not seen register since: thousands of members that see
    one lease end then read nothing.
    """

    def __init__(
        self,
        keys: RunKeys,
        n: int,
        size: int,
        max_nodes: int,
        is_member: Callable[[str], bool],
        *,
        all_live: bool = False,
    ) -> None:
        self._keys = keys
        self._next = keys.join_prefix(n + 1)
        self._failed = keys.failed(n)
        self._done = keys.done(n)
        self._size = size
        self._max = max_nodes
        self._is_member = is_member
        self.lost: set[str] = set()
        #: Members whose workers finished this round (their leaving is no loss).
        self.finished: set[str] = set()
        self.next_joiners: set[str] = set()
        self.failed = False
        self.closed = False
        self.all_live = all_live
        #: Nodes that registered after the round's revision (``all_live`` says nothing
        #: of them).
        self.arrived: set[str] = set()
        #: Members kept out for a cool-down since (a member counted in before it joined,
        #: ``decide.presume``, that failed the check it ran first: it never comes).
        self.excluded: set[str] = set()

    def member(self, node: str) -> bool:
        """Whether ``node`` is a member: known at once under ``all_live`` for a node alive
        at the round's revision, else asked of ``is_member``."""
        return (self.all_live and node not in self.arrived) or self._is_member(node)

    def load(
        self,
        members: Sequence[str],
        nodes: Sequence[str],
        next_joins: Sequence[str],
        failed: bool,
        closed: bool,
        done: Sequence[str] = (),
    ) -> None:
        """Start from full reads (full keys), e.g. after the store compacted history."""
        cut = len(self._keys.nodes)
        self.all_live = False  # the live nodes now are not those at the round's revision
        self.finished = {k[len(self._done) :] for k in done}
        self.lost = set(members) - {k[cut:] for k in nodes} - self.finished
        self.next_joiners = {k[len(self._next) :] for k in next_joins}
        self.failed, self.closed = failed, closed

    def apply(self, events: Sequence[WatchEvent]) -> None:
        for e in events:
            put = e.kind is EventKind.PUT
            if e.key.startswith(self._next):
                node = e.key[len(self._next) :]
                (self.next_joiners.add if put else self.next_joiners.discard)(node)
            elif e.key.startswith(self._done):
                if put:
                    node = e.key[len(self._done) :]
                    self.finished.add(node)
                    self.lost.discard(node)
            elif e.key.startswith(self._keys.nodes):
                node = e.key[len(self._keys.nodes) :]
                if put:
                    self.lost.discard(node)
                    self.arrived.add(node)
                elif node not in self.finished and self.member(node):
                    self.lost.add(node)
            elif e.key.startswith(self._keys.excluded_prefix):
                node = e.key[len(self._keys.excluded_prefix) :]
                if put and node not in self.finished and self.member(node):
                    self.excluded.add(node)
            elif e.key == self._failed and put:
                self.failed = True
            elif e.key == self._keys.closed and put:
                self.closed = True

    def reason(self) -> str | None:
        """Why the round must re-form now, or None.

        Yes when the run was closed, a worker failed somewhere, a member is gone (its
        lease ended) before its workers finished or was excluded (``self.excluded``; not
        seen again after a re-read, ``load``), a member already asks for the next
        round, or a newcomer waits and there is room for it. A newcomer at full size is
        a spare and disturbs no one, and so is a member that finished and left (its
        exit barrier timed out): the others' workers run on to their own end.
        """
        if self.closed:
            return "the run was closed by another node"
        if self.failed:
            return "a worker failed on another node"
        if self.lost:
            return f"lost {len(self.lost)} node(s): {', '.join(sorted(self.lost))}"
        if self.excluded:
            return f"member(s) kept out for a cool-down: {', '.join(sorted(self.excluded))}"
        if not self.next_joiners:
            return None
        if any(self.member(j) for j in self.next_joiners):
            return "node(s) of this round are joining the next one"
        if self._size < self._max:
            return "new node(s) are waiting to join"
        return None
