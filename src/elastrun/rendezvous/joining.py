"""Joining a rendezvous round, sans I/O: the protocol as a generator of store operations.

``join(ctx, prev_round, prev_rank)`` is the whole of a node's side of forming a round:
it yields operations and notes (``ops``, which says how a driver runs it), raises the
rendezvous errors and returns the round it entered as a ``Joined``. It never touches a
store, a socket, a thread or a logger, so one copy of the protocol serves every driver.
It handles ``StoreCompactedError`` itself and lets every other error propagate.

Time is the one input not sent: the context's clock is read directly (tests inject a
fake one). The keys and the decisions are ``decide.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastrun.core.clock import Clock
from elastrun.core.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    StoreCompactedError,
)
from elastrun.rendezvous.closing import Called, audit, decide, decide_ahead, join_record
from elastrun.rendezvous.decide import Bounds, apply_events
from elastrun.rendezvous.entering import agree_master, decided_rows, member_page
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
    load,
)

# The operations and the drivers' step are ``ops``'s, the closer's side ``closing``'s and
# what a node reads of a decided round ``entering``'s, re-exported here.
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
    "decide",
    "decide_ahead",
    "decided_rows",
    "drive",
    "follower_progress",
    "join",
    "join_round",
    "member_page",
    "newest_round",
    "parse_result",
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
    found, rev = (dict(known.out), known.rev) if known is not None else (yield GetPrefix(out))
    raw = found.get(result_key)
    if raw is not None:
        # Decided: a node in it (presumed) needs no join, and a spare's join would come
        # too late for it anyway (it joins the round after).
        return parse_result(ctx, raw), found, rev
    yield join_record(ctx, n, prev_rank)
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


def closed_error(ctx: Context, reason: bytes) -> RendezvousClosedError:
    why = reason.decode("utf-8", "replace")
    return RendezvousClosedError(
        f"run {ctx.run_id!r} has ended ({why}); it accepts no more nodes", reason=why
    )
