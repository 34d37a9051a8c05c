"""The closer's side of a round, sans I/O (the operations of ``joining``): following the
joiners and the live nodes and deciding (``decide``, or ``audit`` past the join
deadline), publishing the decision (``commit``, ``publish``), and, for the closer and
deputy of a running round, deciding the next round ahead (``decide_ahead``) and the call
that wakes the round's quiet members (``Called``; see ``quiet``).

Generators of store operations like ``joining``'s, which drives them and re-exports them;
a ``joining.Context`` gives the keys, the clock, the bounds and the node.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastrun.core.errors import RendezvousTimeoutError, StoreCompactedError
from elastrun.rendezvous.decide import RoundView, Verdict, lead
from elastrun.rendezvous.entering import master_of, rows_of
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.ops import (
    Closed,
    CompareSet,
    Get,
    GetPrefix,
    Progress,
    Protocol,
    Put,
    PutAll,
    ReadAll,
    Seen,
    Watch,
    dump,
    load,
)

if TYPE_CHECKING:
    from elastrun.rendezvous.joining import Context


def join_record(ctx: Context, n: int, prev_rank: int | None) -> Put:
    """This node's join of round ``n``, asking for group rank ``prev_rank`` (bound to its
    lease: it vanishes with the node)."""
    value = dump({**ctx.info, "prev_rank": prev_rank})
    return Put(ctx.keys.join_prefix(n) + ctx.node_id, value, leased=True)


# -- the call to a running round's quiet members ---------------------------------------------


def call_to_join(why: str) -> bytes:
    """The call saying that the next round waits for every member's join."""
    return dump({"join": True, "why": why})


def call_to_enter(why: str, result: dict[str, Any], master: bytes | None = None) -> bytes:
    """The call saying that the next round was decided: its ``result``, and rank 0's
    address when it went out with the decision."""
    call: dict[str, Any] = {"join": False, "why": why, "result": result}
    if master is not None:
        call["master"] = load(master)
    return dump(call)


@dataclass(frozen=True)
class Called:
    """What a call to a quiet member brought of round ``n``'s ``out/`` (the result, and
    rank 0's address when it went out with it), complete as of store revision ``rev``:
    the decision's (rank 0 writes its address after it, perhaps before the call)."""

    n: int
    out: dict[str, bytes]
    rev: int

    @classmethod
    def of(cls, keys: RunKeys, n: int, call: bytes) -> Called | None:
        """From the call to round ``n-1``'s quiet members, when it carries round n's
        result."""
        data = load(call)
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, dict) or not isinstance(rev := result.get("rev"), int):
            return None
        out = {keys.result(n): dump(result)}
        if isinstance(data, dict) and isinstance(data.get("master"), dict):
            out[keys.master(n)] = dump(data["master"])
        return cls(n, out, rev)


# -- deciding ------------------------------------------------------------------------------


def decide(ctx: Context, n: int, deadline: float) -> Protocol:
    """As the closer of round ``n``: follow the joiners and live nodes from watch
    events and close the round when ``decide_round`` says so. Returns the result."""
    s, k = ctx.bounds, ctx.keys
    view, rev = yield from load_view(ctx, n)
    call_started: float | None = None
    next_progress = ctx.clock.monotonic()
    seen = -1
    called = False
    while True:
        if view.closed is not None:
            return (yield from publish_closed(ctx, n, view))
        joined = len(view.joins)
        if joined != seen:
            yield Seen(n, joined)
            seen = joined
        now = ctx.clock.monotonic()
        started = view.started()
        if call_started is None and started and joined >= s.min_nodes:
            call_started = now
        verdict = view.decide(s, now=now, call_started_at=call_started, join_deadline=deadline)
        if verdict.verdict is Verdict.CLOSE:
            return (yield from commit(ctx, n, view, verdict.members, rev, ctx.node_id))
        if verdict.verdict is Verdict.TIMEOUT:
            raise timeout_error(ctx, n, joined)
        if started and n > 0 and not called:
            # The re-formation waits for joins: call the previous round's quiet members,
            # who would otherwise wait for a decision (see ``decide_ahead``).
            yield Put(k.next_call(n - 1), call_to_join(view.why()))
            called = True
        if now >= next_progress:
            raw = yield Get(k.result(n))  # closed by a node auditing the round
            if raw is not None:
                return raw
            status = {
                "joined": joined,
                "started": started,
                "last_call_in": (
                    verdict.wake_at - now
                    if verdict.wake_at is not None and joined >= s.min_nodes
                    else None
                ),
                "timeout_in": deadline - now,
            }
            yield Put(k.status(n), dump(status))
            yield Progress(n, status)
            next_progress = now + ctx.progress_every
        wait = max(0.0, next_progress - now) + 0.01
        if verdict.wake_at is not None:
            wait = min(wait, max(0.0, verdict.wake_at - now) + 0.01)
        try:
            res = yield Watch(k.ctl, rev, wait)
        except StoreCompactedError:
            view, rev = yield from load_view(ctx, n)
            continue
        view.apply(res.events)
        rev = res.revision


def load_view(ctx: Context, n: int) -> Protocol:
    """The closer's view of round ``n`` from full reads, and the revision it holds at.

    The reads go out at once (``ReadAll``), so each may answer at another revision; the
    changes under ``ctl/`` since the oldest of them are then applied up to the newest
    (replaying a change a read already saw is harmless: each event sets or removes one
    key), so that the view holds at one revision: the result's ``all_live`` says who was
    alive at exactly that revision."""
    k = ctx.keys
    reads: tuple[Get | GetPrefix, ...] = (
        GetPrefix(k.join_prefix(n)), GetPrefix(k.nodes), GetPrefix(k.excluded_prefix),
        Get(k.closed), Get(k.result(n - 1)),
        # What makes a member of round n-1 join this round itself (``must_join``).
        GetPrefix(k.failed(n - 1)), GetPrefix(k.done(n - 1)), GetPrefix(k.away_prefix),
    )  # fmt: skip
    answers = yield ReadAll(reads if n > 0 else reads[:4])
    (joins, r1), (nodes, r2), (excluded, r3), closed = answers[:4]
    more: dict[str, bytes] = {}
    revs = [r1, r2, r3]
    for found, r in answers[5:]:
        more.update(found)
        revs.append(r)
    rows = (yield from rows_of(ctx, n - 1, answers[4])) if n > 0 else []
    view = RoundView(k, n, [str(row[0]) for row in rows], rows=rows)
    view.load(joins, list(nodes), closed, list(excluded), more)
    rev, newest = min(revs), max(revs)
    while rev < newest:
        try:
            res = yield Watch(k.ctl, rev, 0.0)
        except StoreCompactedError:
            return (yield from load_view(ctx, n))
        view.apply(res.events)
        if res.revision <= rev:
            break
        rev = res.revision
    return view, rev


def audit(ctx: Context, n: int, deadline: float, now: float) -> Protocol:
    """Past its join deadline, a waiting node checks the round itself: it times out
    below the minimum, closes a round that should be closed, and otherwise waits on
    (the closer is in its last call, or this node is a spare). Returns when to check
    again."""
    view, rev = yield from load_view(ctx, n)
    verdict = view.decide(ctx.bounds, now=now, call_started_at=None, join_deadline=deadline)
    if verdict.verdict is Verdict.TIMEOUT:
        raise timeout_error(ctx, n, len(view.joins))
    if verdict.verdict is Verdict.CLOSE:
        yield from commit(ctx, n, view, verdict.members, rev)
    return now + ctx.audit_every


def decide_ahead(
    ctx: Context,
    n: int,
    prev_rank: int | None,
    why: str,
    *,
    joins: bool = True,
    defer: float = 0.0,
) -> Protocol:
    """As the closer of round ``n-1``, which watches it for its quiet members: join round
    ``n`` and decide it at once, before this node's agent has stopped its workers.

    A quiet member of round n-1 watches nothing but the call its closer (or whoever
    decides round n) leaves at ``next_call(n-1)``: the round after it was decided, so it
    enters with one read; or the round waits for joins (a failed round), so it joins as
    everyone did before. After the loss of one node of N, the closer alone notices it and
    the N-1 others are woken once, by the answer.

    Nothing more happens when the round is decided or claimed already (its decider makes
    the call). The claim is taken only to close the round at once: a round that must wait
    is left to whoever joins and claims it, so that no claim waits on this node's agent.
    Without ``joins`` (this node is kept out for a cool-down, its workers finished the
    round, or it gave notice) it only calls the quiet members to join, saying ``why``.
    With ``defer``, it first leaves that long to the other watcher, rank 0, whose
    decision carries its address (the others then enter reading nothing, instead of
    waiting for rank 0's agent to write it)."""
    k = ctx.keys
    if not joins:
        yield Put(k.next_call(n - 1), call_to_join(why))
        return
    found, rev = yield GetPrefix(k.out(n))
    if k.result(n) in found:
        return
    yield join_record(ctx, n, prev_rank)
    if k.closer(n) in found:
        return
    if defer > 0:
        try:
            res = yield Watch(k.out(n), rev, defer)
        except StoreCompactedError:
            return  # (this node's agent joins next, and decides if nobody did)
        if res.events:
            return  # rank 0 claimed the round
    view, rev = yield from load_view(ctx, n)
    now = ctx.clock.monotonic()
    s = ctx.bounds
    verdict = view.decide(s, now=now, call_started_at=None, join_deadline=now + ctx.join_timeout)
    if view.closed is None and verdict.verdict is not Verdict.CLOSE:
        yield Put(k.next_call(n - 1), call_to_join(view.why()))
        return
    won, _ = yield CompareSet(k.closer(n), None, ctx.node_id.encode(), leased=True)
    if won:
        yield from _close_ahead(ctx, n, view, verdict.members, rev)


def _close_ahead(
    ctx: Context, n: int, view: RoundView, members: tuple[str, ...], rev: int
) -> Protocol:
    """``decide_ahead``, the round's closer now: decide round ``n`` and call round
    ``n-1``'s quiet members into it."""
    k = ctx.keys
    if view.closed is not None:
        yield from publish_closed(ctx, n, view)
        return
    members = lead(members, view.previous, ctx.node_id)  # rank 0 lost: the decider
    held = load((yield from commit(ctx, n, view, members, rev, ctx.node_id, call=False)))
    if not isinstance(held, dict) or held.get("closer") != ctx.node_id:
        return  # another decision holds: its decider made the call
    master = None
    if held.get("head") == ctx.node_id:
        # Rank 0's address goes out with the decision and the call: the others enter
        # with what the call brings, and read nothing.
        master = master_of(ctx)
        yield Put(k.master(n), master)
    yield Put(k.next_call(n - 1), call_to_enter(view.why(), held, master))


def commit(
    ctx: Context,
    n: int,
    view: RoundView,
    members: tuple[str, ...],
    rev: int,
    closer: str | None = None,
    *,
    call: bool = True,
) -> Protocol:
    """Publish a decision: the member pages (``decide.member_pages``), then the small
    result everyone waits for (the commit point: the first result written holds). Each
    node reads one page of it; only tools and the next round's closer read every page.
    ``closer``: the node holding the round's claim, when it is this one (a member that
    is will watch the round for the others). ``call``: publish calls the previous round's
    quiet members (else the caller does). Returns the result that holds."""
    k = ctx.keys
    decision = uuid.uuid4().hex[:12]
    pages, result = view.outcome(members, decision, rev, closer)
    yield PutAll(tuple((k.members(n, decision, i), dump(page)) for i, page in enumerate(pages)))
    return (yield from publish(ctx, n, dump(result), len(members), view.why() if call else None))


def publish_closed(ctx: Context, n: int, view: RoundView) -> Protocol:
    """Publish that the run was closed as round ``n``'s result."""
    assert view.closed is not None
    closed = {"closed": view.closed.decode("utf-8", "replace")}
    return (yield from publish(ctx, n, dump(closed), None, view.why()))


def publish(ctx: Context, n: int, value: bytes, size: int | None, why: str | None) -> Protocol:
    """Write the result of round ``n`` unless someone did; return the one that holds.

    ``size`` is the number of members (None: the result says the run was closed). The
    writer then calls round n-1's quiet members (``decide_ahead``), saying ``why`` it
    re-formed (None: the caller calls them).
    """
    won, current = yield CompareSet(ctx.keys.result(n), None, value)
    if not won:
        return current
    if n > 0 and why is not None:
        result = load(value)
        assert isinstance(result, dict)
        yield Put(ctx.keys.next_call(n - 1), call_to_enter(why, result))
    if size is not None:
        yield Put(ctx.keys.current, str(n).encode())
        yield Closed(n, size)
    return value


def timeout_error(ctx: Context, n: int, count: int) -> RendezvousTimeoutError:
    return RendezvousTimeoutError(
        f"rendezvous round {n} timed out after {ctx.join_timeout:.0f}s "
        f"with {count} node(s); at least {ctx.bounds.min_nodes} needed"
    )
