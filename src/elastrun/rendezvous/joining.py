"""Joining a rendezvous round, sans I/O: the protocol as a generator of store operations.

``join(ctx, prev_round, prev_rank)`` is the whole of a node's side of forming a round:
it yields operations (``ops``: ``Get``, ``Put``, ``Watch`` ...) and is sent their results; it
yields notes (``Progress``, ``Closed``) for the driver to show; it raises the
rendezvous errors; it returns the round it entered as a ``Joined``. It never touches a
store, a socket, a thread or a logger, so one copy of the protocol serves every driver:
``drive`` (the synchronous handler in ``dynamic.py``) and the benchmarks' asyncio
participant, which awaits each operation instead. A driver sends an operation's result
back with ``send`` and an exception it raised with ``throw`` (the protocol handles
``StoreCompactedError`` itself and lets everything else propagate).

Time is the one input not sent: the context's clock is read directly (tests inject a
fake one). The keys and the decisions are ``decide.py``'s.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastrun.core.clock import Clock
from elastrun.core.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
    StoreCompactedError,
)
from elastrun.rendezvous.decide import (
    Bounds,
    RoundView,
    Verdict,
    apply_events,
)
from elastrun.rendezvous.entering import (
    agree_master,
    decided_rows,
    master_of,
    member_page,
    read_when_set,
    rows_of,
)
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.members import place_in
from elastrun.rendezvous.ops import (
    Closed,
    CompareSet,
    Finished,
    Get,
    GetPrefix,
    Op,
    Progress,
    Protocol,
    Put,
    PutAll,
    ReadAll,
    Seen,
    Wait,
    Watch,
    advance,
    drive,
    dump,
    load,
)

# The operations and the drivers' step are ``ops``'s, and what a node reads of a decided
# round ``entering``'s, re-exported here.
__all__ = [
    "AUDIT_EVERY",
    "FOLLOW_EVERY",
    "PROGRESS_EVERY",
    "Called",
    "Closed",
    "CompareSet",
    "Context",
    "Finished",
    "Get",
    "GetPrefix",
    "Joined",
    "Op",
    "Progress",
    "Protocol",
    "Put",
    "PutAll",
    "ReadAll",
    "Seen",
    "Wait",
    "Watch",
    "advance",
    "agree_master",
    "audit",
    "closed_error",
    "commit",
    "decide",
    "decide_ahead",
    "decided_rows",
    "drive",
    "follower_progress",
    "join",
    "join_round",
    "load_view",
    "member_page",
    "newest_round",
    "parse_result",
    "publish",
    "read_when_set",
    "rows_of",
    "timeout_error",
]

#: How often the closer publishes its progress (a follower shows it every FOLLOW_EVERY).
PROGRESS_EVERY = 5.0
#: How often a node waiting for the closer shows the closer's progress. Each look costs
#: the node a few requests; with tens of thousands of nodes waiting on one store, every
#: 5 s made these looks most of the store's work while a round formed.
FOLLOW_EVERY = 30.0
#: How often a waiting node that is not the closer checks the round itself once its
#: join deadline has passed (a closer that decides nothing must not hold it forever).
AUDIT_EVERY = 30.0


@dataclass(frozen=True)
class Context:
    """What the protocol knows of the node and the run."""

    keys: RunKeys
    node_id: str
    info: dict[str, Any]  # addr, role, local_world_size
    bounds: Bounds
    join_timeout: float
    run_id: str
    clock: Clock
    new_port: Callable[[], int]
    progress_every: float = PROGRESS_EVERY
    audit_every: float = AUDIT_EVERY
    follow_every: float = FOLLOW_EVERY


@dataclass(frozen=True)
class Joined:
    """The round this node entered."""

    n: int
    rank: int
    result: dict[str, Any]  # the round's small result: id, size, shape, rev
    master: tuple[str, int]


# -- the protocol -------------------------------------------------------------------------


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


def join(
    ctx: Context,
    prev_round: int | None,
    prev_rank: int | None,
    held: int | None = None,
    called: Called | None = None,
) -> Protocol:
    """Join the next round (a spare moves on to the one after) and enter it.

    ``prev_round`` and ``prev_rank``: the round this node was last in and the group rank
    it asks to keep; ``held`` its actual rank in that round when it differs (a static
    node asks for its fixed rank). A node that was in a round joins the one right after
    it first, without asking which round is the newest: a re-formation may have been
    decided with this node in it already (``decide.presume``), and it must enter that
    round, not the one after the newest. ``called``: what the call that woke this node
    brought of the round after its own (then it enters with no read at all).
    """
    held = prev_rank if held is None else held
    deadline = ctx.clock.monotonic() + ctx.join_timeout
    n = (yield from newest_round(ctx)) + 1 if prev_round is None else prev_round + 1
    while True:
        known = called if called is not None and called.n == n else None
        result, out, rev = yield from join_round(ctx, n, prev_rank, deadline, known)
        place = place_in(result, ctx.node_id, prev_round, held)
        if place.known:
            rank = place.rank
        else:
            page = yield from member_page(
                ctx, n, str(result["id"]), int(result["size"]), ctx.node_id
            )
            entry = page.get(ctx.node_id)
            rank = None if entry is None else int(str(entry[0]))
        if rank is not None:
            head = result.get("head")
            master = yield from agree_master(
                ctx, n, rank, out, rev, head if isinstance(head, str) else None
            )
            if master is not None:
                return Joined(n, rank, result, master)
            # Rank 0 died before it gave its address (it was counted in alive, and its
            # lease ended since): this round never starts. Join the next, as a member
            # of this one (its decider counts in the live members of this round).
            prev_round, prev_rank, held = n, rank, rank
            n += 1
            continue
        # Not a member: a spare waits for room in the round after this one (or after the
        # newest, when rounds formed without this node meanwhile).
        n = max(n, (yield from newest_round(ctx))) + 1


def newest_round(ctx: Context) -> Protocol:
    """The newest closed round (-1: none yet)."""
    current = yield Get(ctx.keys.current)
    return int(current) if current is not None else -1


def join_round(
    ctx: Context, n: int, prev_rank: int | None, deadline: float, known: Called | None = None
) -> Protocol:
    """Join round ``n``; return its result, what this node last saw of ``out/`` (which
    may hold the master address already) and the revision it saw it at.

    A round already decided is entered with one read: its result (and, once rank 0 has
    written it, the master address) under ``out/``. Otherwise the node writes its join,
    and the first node to claim ``out/closer`` decides the round (``decide``); the others
    watch only ``out/`` for the result, and one of them takes over when the closer's
    claim vanishes with its lease. ``known``: what a call brought of ``out/`` (not read).
    """
    k = ctx.keys
    out, result_key, closer_key = k.out(n), k.result(n), k.closer(n)
    if known is not None:
        found, rev = dict(known.out), known.rev
    else:
        found, rev = yield GetPrefix(out)
    raw = found.get(result_key)
    if raw is not None:
        # Decided: a node in it (presumed) needs no join, and a spare's join would come
        # too late for it anyway (it joins the round after).
        return parse_result(ctx, raw), found, rev
    join_value = dump({**ctx.info, "prev_rank": prev_rank})
    yield Put(k.join_prefix(n) + ctx.node_id, join_value, leased=True)
    now = ctx.clock.monotonic()
    next_progress = now + ctx.follow_every
    audit_at = deadline
    while True:
        raw = found.get(result_key)
        if raw is not None:
            return parse_result(ctx, raw), found, rev
        if closer_key not in found:
            won, claim = yield CompareSet(closer_key, None, ctx.node_id.encode(), leased=True)
            if won:
                decided = yield from decide(ctx, n, deadline)
                return parse_result(ctx, decided), {result_key: decided}, None
            if claim is not None:
                # Another node claimed it first: watch on from ``rev`` (its claim, and
                # whatever followed, come as events). After a loss thousands of
                # survivors race for the claim; a read after each lost race doubled
                # their requests.
                found[closer_key] = claim
                continue
            found, rev = yield GetPrefix(out)
            continue
        now = ctx.clock.monotonic()
        if now >= audit_at:
            audit_at = yield from audit(ctx, n, deadline, now)
            found, rev = yield GetPrefix(out)
            continue
        if now >= next_progress:
            yield from follower_progress(ctx, n)
            next_progress = now + ctx.follow_every
        wait = max(0.0, min(next_progress, audit_at) - now) + 0.01
        try:
            res = yield Watch(out, rev, wait)
        except StoreCompactedError:
            found, rev = yield GetPrefix(out)
            continue
        rev = res.revision
        apply_events(found, res.events)


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
            yield Put(k.next_call(n - 1), dump({"join": True, "why": view.why()}))
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
    Without ``joins`` (this node is kept out for a cool-down, or its workers finished the
    round) it only calls the quiet members to join, saying ``why``. With ``defer``, it
    first leaves that long to the other watcher, rank 0, whose decision carries its
    address (the others then enter reading nothing, instead of waiting for rank 0's agent
    to write it)."""
    k = ctx.keys
    if not joins:
        yield Put(k.next_call(n - 1), dump({"join": True, "why": why}))
        return
    found, rev = yield GetPrefix(k.out(n))
    if k.result(n) in found:
        return
    join_value = dump({**ctx.info, "prev_rank": prev_rank})
    yield Put(k.join_prefix(n) + ctx.node_id, join_value, leased=True)
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
        yield Put(k.next_call(n - 1), dump({"join": True, "why": view.why()}))
        return
    won, _ = yield CompareSet(k.closer(n), None, ctx.node_id.encode(), leased=True)
    if not won:
        return
    if view.closed is not None:
        yield from publish_closed(ctx, n, view)
        return
    held = load((yield from commit(ctx, n, view, verdict.members, rev, ctx.node_id, call=False)))
    if not isinstance(held, dict) or held.get("closer") != ctx.node_id:
        return  # another decision holds: its decider made the call
    call: dict[str, object] = {"join": False, "why": view.why(), "result": held}
    if held.get("head") == ctx.node_id:
        # Rank 0's address goes out with the decision and the call: the others enter
        # with what the call brings, and read nothing.
        master = master_of(ctx)
        yield Put(k.master(n), master)
        call["master"] = load(master)
    yield Put(k.next_call(n - 1), dump(call))


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


def publish(
    ctx: Context, n: int, value: bytes, size: int | None = None, why: str | None = ""
) -> Protocol:
    """Write the result of round ``n`` unless someone did; return the one that holds.

    ``size`` is the number of members (None: the result says the run was closed). The
    writer then calls round n-1's quiet members (``decide_ahead``), saying ``why`` it
    re-formed (None: the caller calls them).
    """
    won, current = yield CompareSet(ctx.keys.result(n), None, value)
    if not won:
        return current
    if n > 0 and why is not None:
        call = {"join": False, "why": why, "result": load(value)}
        yield Put(ctx.keys.next_call(n - 1), dump(call))
    if size is not None:
        yield Put(ctx.keys.current, str(n).encode())
        yield Closed(n, size)
    return value


def follower_progress(ctx: Context, n: int) -> Protocol:
    closed = yield Get(ctx.keys.closed)
    if closed is not None:
        raise closed_error(ctx, closed)
    status = load((yield Get(ctx.keys.status(n))))
    yield Progress(n, status if isinstance(status, dict) else None)


# -- outcomes -------------------------------------------------------------------------------


def parse_result(ctx: Context, raw: bytes) -> dict[str, Any]:
    result = load(raw)
    if not isinstance(result, dict):
        raise RendezvousConnectionError(f"unreadable rendezvous result: {raw[:80]!r}")
    if "closed" in result:
        raise closed_error(ctx, str(result["closed"]).encode())
    return result


def timeout_error(ctx: Context, n: int, count: int) -> RendezvousTimeoutError:
    return RendezvousTimeoutError(
        f"rendezvous round {n} timed out after {ctx.join_timeout:.0f}s "
        f"with {count} node(s); at least {ctx.bounds.min_nodes} needed"
    )


def closed_error(ctx: Context, reason: bytes) -> RendezvousClosedError:
    return RendezvousClosedError(
        f"run {ctx.run_id!r} has ended ({reason.decode('utf-8', 'replace')}); "
        "it accepts no more nodes"
    )
