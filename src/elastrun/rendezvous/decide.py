"""Rendezvous decisions as pure functions of (state, now): when a round closes, who is in
it and with which group rank; and the closer's view of a forming round, kept from watch
events (a running member's is ``running.RoundWatch``). The
handler (``dynamic.py``, with ``liveness.py`` and ``outcome.py``) feeds them what the store
said and applies the decision; nothing here touches the store or the clock.
"""

from __future__ import annotations

import enum
import itertools
import json
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.members import MemberRow, changes_from, member_pages
from elastrun.rendezvous.ops import load_doc
from elastrun.store.api import EventKind, WatchEvent


@dataclass(frozen=True)
class Joiner:
    """A node that asked to join a round."""

    node_id: str
    revision: int  # store revision of its join: the join order
    prev_rank: int | None = None  # its group rank in the previous round, if any


class Verdict(enum.Enum):
    WAIT = "wait"  # not enough nodes yet, or last call still running
    CLOSE = "close"  # close the round now with the chosen members
    TIMEOUT = "timeout"  # the join deadline passed below the minimum


@dataclass(frozen=True)
class RoundDecision:
    verdict: Verdict
    members: tuple[str, ...] = ()  # node ids in group-rank order (CLOSE only)
    wake_at: float | None = None  # when to decide again if nothing changes (WAIT)


def order_members(joiners: Sequence[Joiner], max_nodes: int) -> tuple[str, ...]:
    """Pick at most ``max_nodes`` joiners and order them by group rank.

    Nodes of the previous round come first (they hold state and warm caches), then by
    join order. A node keeps its previous group rank when that rank is still below the
    world size and no one else claims it; the others fill the free ranks in join order.
    Deterministic: every agent computes the same answer from the same joiners.
    """
    ranked = sorted(
        joiners,
        key=lambda j: (j.prev_rank is None, j.prev_rank or 0, j.revision, j.node_id),
    )
    chosen = ranked[:max_nodes]
    world = len(chosen)
    slots: list[str | None] = [None] * world
    rest: list[Joiner] = []
    for j in chosen:
        if j.prev_rank is not None and j.prev_rank < world and slots[j.prev_rank] is None:
            slots[j.prev_rank] = j.node_id
        else:
            rest.append(j)
    rest.sort(key=lambda j: (j.revision, j.node_id))
    it = iter(rest)
    return tuple(s if s is not None else next(it).node_id for s in slots)


def lead(members: tuple[str, ...], previous: Sequence[str], node: str) -> tuple[str, ...]:
    """``members`` with ``node`` (the decider) at group rank 0 when the previous round's
    rank 0 is not among them: the node ``order_members`` put there takes the decider's
    rank instead. The decider knows its own address, which then goes out with the
    decision: the others need not wait for a new rank 0's agent to write it (a second
    wake-up of every member, about a second at 10,000 nodes)."""
    if not previous or previous[0] in members or node not in members or members[0] == node:
        return members
    at = members.index(node)
    swapped = list(members)
    swapped[0], swapped[at] = node, members[0]
    return tuple(swapped)


def decide_round(
    joiners: Sequence[Joiner],
    previous_live: set[str],
    *,
    min_nodes: int,
    max_nodes: int,
    now: float,
    call_started_at: float | None,
    last_call: float,
    join_deadline: float,
    first_round: bool,
    excluded: AbstractSet[str] = frozenset(),
    previous: Sequence[str] = (),
    must_join: AbstractSet[str] = frozenset(),
) -> RoundDecision:
    """Whether a forming round should close now.

    ``previous_live`` are the members of the previous round that are still alive.
    ``excluded`` are nodes kept out for a cool-down (``exclusion``): as joiners they
    wait like spares, and a round waits for none of them, so a spare takes an excluded
    member's place at once. ``previous`` is the previous round's members in group-rank
    order: given, a re-formation that has begun counts its live members that have not
    joined yet as joined, with their previous ranks (``presume``), except those in
    ``must_join`` (``RoundView.must_join``), who count once they join themselves.

    * The job's first round closes at once with ``max_nodes`` joiners, or with at least
      ``min_nodes`` when the last call (started when the minimum was reached) ends;
      below the minimum it times out at the join deadline.
    * A later round is a re-formation. Until a previous member joins it, its joiners are
      spares waiting for room: it stays open, with no deadline. Once re-formation has
      begun it closes as soon as every live previous member has joined (a restart after
      a failure or the loss of a node waits for no one), or at ``max_nodes``, or with at
      least the minimum when the last call ends; below the minimum it times out. With
      ``previous`` given, every live previous member not in ``must_join`` counts as
      joined from the start.
    """
    if excluded:
        joiners = [j for j in joiners if j.node_id not in excluded]
        previous_live = previous_live - excluded
    joined = {j.node_id for j in joiners}
    pending = previous_live - joined
    if not first_round and pending and not previous_live & joined:
        return RoundDecision(Verdict.WAIT)
    if not first_round and pending and previous:
        joiners = presume(joiners, pending - must_join, previous)
        pending &= must_join
    count = len(joiners)
    if count >= max_nodes:
        return RoundDecision(Verdict.CLOSE, order_members(joiners, max_nodes))
    if count >= min_nodes:
        call_ends = (call_started_at if call_started_at is not None else now) + last_call
        if (not first_round and not pending) or now >= call_ends:
            return RoundDecision(Verdict.CLOSE, order_members(joiners, max_nodes))
        return RoundDecision(Verdict.WAIT, wake_at=call_ends)
    if now >= join_deadline:
        return RoundDecision(Verdict.TIMEOUT)
    return RoundDecision(Verdict.WAIT, wake_at=join_deadline)


def presume(
    joiners: Sequence[Joiner], pending: AbstractSet[str], previous: Sequence[str]
) -> list[Joiner]:
    """``joiners`` and the ``pending`` previous members, each with its rank in
    ``previous`` (the previous round's members in group-rank order), as if they had joined.

    Why a re-formation need not wait for them: once one member of a running round joins
    the next round, every other live member re-forms too (its watch sees that join, the
    loss or the failure that started it) and joins with its current rank as
    ``prev_rank``. Waiting for thousands of joins to arrive only delays the answer those
    joins would give: ``order_members`` over the presumed joiners gives every member the
    rank the full joins would give. A presumed member that dies meanwhile is seen by the
    new round's members (they watch from the decision's revision) and the group re-forms
    once more; one that joins late finds itself in the round already decided.
    """
    rank = {node: i for i, node in enumerate(previous)}
    presumed = [Joiner(node, 0, rank.get(node)) for node in sorted(pending)]
    return [*joiners, *presumed]


# -- the closer's view, kept up to date from watch events at O(1) per change (re-reading
# whole prefixes made a rendezvous of N nodes cost O(N^2) reads) ----------------------


JSONDoc = dict[str, object]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _toggle(nodes: set[str], node: str, present: bool) -> None:
    (nodes.add if present else nodes.discard)(node)


@dataclass(frozen=True)
class Away:
    """A member's notice that it does not re-join the round after ``round`` at once
    (``ctl/away/<node>``, bound to its lease): the next round's closer must not presume
    it (``RoundView.must_join``). Written before the member does what would make the
    others re-form (stop its workers), so that the closer always sees it first.

    Why a notice and not the lease alone: the lease of a node that is going lives on
    while its workers stop (up to the shutdown timeout); a full re-join would wait for
    that node's join, which never comes, and close without it once its lease ends. A
    presumed node would instead be a member of a round that must re-form once more.
    """

    round: int
    why: str

    def dump(self) -> bytes:
        return json.dumps({"v": 1, "round": self.round, "why": self.why}).encode()

    @staticmethod
    def load(raw: bytes | None) -> int | None:
        """The round a notice is about (None: absent or unreadable)."""
        data = load_doc(raw)
        return _int(data.get("round")) if data.get("v") == 1 else None


class Bounds(Protocol):
    """What a decision needs of the rendezvous settings."""

    @property
    def min_nodes(self) -> int: ...

    @property
    def max_nodes(self) -> int: ...

    @property
    def last_call_timeout(self) -> float: ...


def apply_events(found: dict[str, bytes], events: Sequence[WatchEvent]) -> None:
    """Bring a prefix read up to date with the watch events that followed it."""
    for e in events:
        if e.kind is EventKind.PUT and e.value is not None:
            found[e.key] = e.value
        else:
            found.pop(e.key, None)


class RoundView:
    """What the closer of round ``n`` knows: the joiners and the live nodes.

    ``keys`` maps the names of DESIGN.md's key layout to full store keys (see
    ``RunKeys``); events under other keys are ignored.
    """

    def __init__(
        self,
        keys: RunKeys,
        n: int,
        previous: Sequence[str],
        *,
        rows: Sequence[Sequence[object]] = (),
    ) -> None:
        self._keys = keys
        self._join = keys.join_prefix(n)
        self.round = n
        self.previous = tuple(previous)
        #: What the previous round's members brought (address, role, local world size),
        #: by node: a member presumed to re-join (``presume``) has written nothing yet.
        self._brought: dict[str, JSONDoc] = {
            str(r[0]): {"addr": r[1], "role": r[2], "local_world_size": r[3]}
            for r in rows
            if len(r) >= 4
        }
        self.joins: dict[str, bytes] = {}
        self._joiners: dict[str, Joiner] = {}
        self.live: set[str] = set()
        #: Nodes kept out for a cool-down (``exclusion``).
        self.excluded: set[str] = set()
        self.closed: bytes | None = None
        #: What says that a member of round n-1 must join this round itself
        #: (``must_join``): who claimed that round's failure, who finished it, and who
        #: gave notice (``Away``) in it.
        self.failed_by: str | None = None
        self.finished: set[str] = set()
        self.away: set[str] = set()

    def load(
        self,
        joins: Mapping[str, bytes],
        nodes: Sequence[str],
        closed: bytes | None,
        excluded: Sequence[str] = (),
        more: Mapping[str, bytes] | None = None,
    ) -> None:
        """Start from full reads (``joins``, ``nodes`` and ``excluded`` as full keys;
        ``more``: other keys under ``ctl/`` as read, with their values)."""
        self.joins.clear()
        self._joiners.clear()
        self.failed_by, self.finished, self.away = None, set(), set()
        for key, value in joins.items():
            self._put_join(key[len(self._join) :], value)
        cut = len(self._keys.nodes)
        self.live = {k[cut:] for k in nodes}
        self.excluded = {k[len(self._keys.excluded_prefix) :] for k in excluded}
        self.closed = closed
        for key, value in (more or {}).items():
            self._take(key, value)

    def apply(self, events: Sequence[WatchEvent]) -> None:
        for e in events:
            put = e.kind is EventKind.PUT
            self._take(e.key, (e.value or b"") if put else None, e.revision)

    def _take(self, key: str, value: bytes | None, revision: int = 0) -> None:
        """One key under ``ctl/`` as it now is (``value`` None: deleted), changed at
        ``revision`` (0: as first read, before any change this view saw)."""
        k = self._keys
        if key.startswith(self._join):
            node = key[len(self._join) :]
            if value is not None:
                self._put_join(node, value, revision)
            else:
                self.joins.pop(node, None)
                self._joiners.pop(node, None)
        elif key.startswith(k.nodes):
            _toggle(self.live, key[len(k.nodes) :], value is not None)
        elif key.startswith(k.excluded_prefix):
            _toggle(self.excluded, key[len(k.excluded_prefix) :], value is not None)
        elif key == k.closed:
            self.closed = value
        elif self.round == 0:
            return
        elif key == k.failed(self.round - 1):
            claimer = load_doc(value).get("node")  # of the claim, if readable
            self.failed_by = claimer if isinstance(claimer, str) else None
        elif key.startswith(k.done(self.round - 1)):
            _toggle(self.finished, key[len(k.done(self.round - 1)) :], value is not None)
        elif key.startswith(k.away_prefix):
            away = Away.load(value) == self.round - 1
            _toggle(self.away, key[len(k.away_prefix) :], away)

    def _put_join(self, node: str, value: bytes, revision: int = 0) -> None:
        # The join order among newcomers: the revision of a join this view saw made;
        # those first read come before them, in node order (a read has no per-key
        # revisions). Without it a spare that waited longest lost its place to any
        # newcomer whose id sorts first.
        self.joins[node] = value
        self._joiners[node] = Joiner(node, revision, _int(load_doc(value).get("prev_rank")))

    def joiners(self) -> list[Joiner]:
        return list(self._joiners.values())

    def previous_live(self) -> set[str]:
        return set(self.previous) & self.live

    def must_join(self) -> set[str]:
        """The members of round n-1 that are in this round only once they join it
        themselves: a full re-join would not have them yet, or ever.

        * The node that claimed round n-1's failure: it counts a strike against itself
          next, and may be excluded, sit out a cool-down and be readmitted, all before
          it joins (presumed, it would take the place of the spare that replaces it), or
          find the job's budget spent and close the run.
        * Members that finished round n-1 (its exit barrier): each re-forms only when
          its barrier says so, and leaves when the barrier times out.
        * Members that gave notice (``Away``): a signal stops their agent, their agent
          gave up, or they check themselves before they re-join.
        * Every member, when round n-1 failed (a worker died somewhere): a node that died
          whole fails its peers' workers at once, and they re-join before its lease ends
          (the store's disconnect grace; a silent node's TTL). Presumed, the dead node
          would keep its place -- rank 0 among them, whose master address then never
          comes. So a failed round re-forms from the members that join, as it did before
          re-formations were decided at once; a lost lease or a newcomer still decides
          at once.
        """
        return set(self.previous) if self.failed_by is not None else self.finished | self.away

    def why(self) -> str:
        """Why round n-1 re-forms, as its members' watch would say (``RoundWatch.reason``):
        what the call to its quiet members carries."""
        if self.closed is not None:
            return "the run was closed by another node"
        if self.failed_by is not None:
            return "a worker failed on another node"
        lost = sorted(set(self.previous) - self.live - self.finished)
        if lost:
            return f"lost {len(lost)} node(s): {', '.join(lost[:8])}"
        kept_out = sorted(set(self.previous) & self.excluded)
        if kept_out:
            return f"member(s) kept out for a cool-down: {', '.join(kept_out[:8])}"
        if set(self._joiners) <= set(self.previous):
            return "node(s) of this round are joining the next one"
        return "new node(s) are waiting to join"

    def started(self) -> bool:
        """Whether this round is forming (not only spares waiting for room)."""
        return self.round == 0 or not self.previous_live().isdisjoint(self._joiners)

    def decide(
        self, bounds: Bounds, *, now: float, call_started_at: float | None, join_deadline: float
    ) -> RoundDecision:
        return decide_round(
            self.joiners(), self.previous_live(), min_nodes=bounds.min_nodes,
            max_nodes=bounds.max_nodes, now=now, call_started_at=call_started_at,
            last_call=bounds.last_call_timeout, join_deadline=join_deadline,
            first_round=self.round == 0, excluded=self.excluded, previous=self.previous,
            must_join=self.must_join(),
        )  # fmt: skip

    def outcome(
        self, members: Sequence[str], decision: str, rev: int, closer: str | None = None
    ) -> tuple[list[JSONDoc], JSONDoc]:
        """What closing the round with ``members`` publishes: the member pages (see
        ``member_pages``) and the small result everyone waits for (decision id, size,
        run-length shape, revision). The result also lists the few changes from the
        previous round's ranks when they are few (``from``: see ``changes_from``), and
        says ``all_live`` when every node alive at ``rev`` is a member (then a member
        that sees a node's lease end need not read a page to know it was a member), and
        names rank 0's node (``head``), and the ``closer`` when it is a member, with a
        ``deputy``: the two watch the running round for the others (``quiet``)."""
        rows: list[MemberRow] = []
        for m in members:
            raw = self.joins.get(m)
            d = self._brought.get(m, {}) if raw is None else load_doc(raw)
            role, lws = str(d.get("role", "")), int(str(d.get("local_world_size", 0)))
            rows.append((m, str(d.get("addr", "")), role, lws))
        shape = shape_of([row[2:] for row in rows])
        result: JSONDoc = {"id": decision, "size": len(rows), "rev": rev, "shape": shape}
        if members:  # rank 0's node: the others wait for its address while it lives
            result["head"] = members[0]
        if closer is not None and closer in members:
            result["closer"] = closer
            deputy = next((m for m in members[:2] if m != closer), None)
            if deputy is not None:
                result["deputy"] = deputy
        changes = changes_from(self.previous, members) if self.round > 0 else None
        if changes is not None:
            result["from"] = {"round": self.round - 1, **changes}
        if self.live <= set(members):
            result["all_live"] = True
        return member_pages(rows), result


def shape_of(slots: Sequence[tuple[str, int]]) -> list[list[object]]:
    """Run-length form of the members' (role, local world size) in group-rank order:
    ``[[role, local_world_size, count], ...]`` (one entry when the nodes are alike)."""
    return [[role, size, len(list(run))] for (role, size), run in itertools.groupby(slots)]
