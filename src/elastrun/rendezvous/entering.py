"""Entering a decided round, sans I/O (the operations of ``joining``): the page with a
node's rank, the whole member list, and rank 0's address (``MASTER_ADDR``/``PORT``),
which the others wait for while rank 0's node lives.

Generators of store operations like ``joining``'s, which uses them and re-exports them;
a ``joining.Context`` gives the keys, the clock and the node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastrun.core.errors import (
    RendezvousConnectionError,
    StoreCompactedError,
    StoreTimeoutError,
)
from elastrun.rendezvous.decide import apply_events
from elastrun.rendezvous.members import page_count, page_entries, page_of, rows_of_pages
from elastrun.rendezvous.ops import Get, GetPrefix, Protocol, Put, Watch, dump, load

if TYPE_CHECKING:
    from elastrun.rendezvous.joining import Context

#: How often a member waiting for rank 0's address checks that rank 0's node lives: a
#: node counted into a re-formation alive can die before it writes the address.
MASTER_CHECK_EVERY = 5.0


def agree_master(
    ctx: Context,
    n: int,
    rank: int,
    out: dict[str, bytes] | None = None,
    rev: int | None = None,
    head: str | None = None,
) -> Protocol:
    """MASTER_ADDR/PORT of round ``n``: its rank 0 picks them, the others read them.

    The address lives under ``out/`` beside the result: a node that read ``out/`` (``out``,
    at revision ``rev``) after rank 0 wrote it has it already, and one that read it before
    watches on from there (one request instead of a read and a watch). ``head``: rank 0's
    node; while waiting, a member checks every ``MASTER_CHECK_EVERY`` seconds that it still
    lives, and gets None when it is gone (see ``read_when_set``)."""
    key = ctx.keys.master(n)
    mine = out.get(key) if rank == 0 and out is not None else None
    if mine is not None and _written_by(mine, ctx.node_id):
        raw = mine  # written ahead, with the decision (``closing.decide_ahead``)
    elif rank == 0:
        raw = master_of(ctx)
        yield Put(key, raw)
    elif out is not None and (known := out.get(key)) is not None:
        raw = known
    else:
        seen = (out, rev) if out is not None and rev is not None else None
        alive = None if head is None else ctx.keys.nodes + head
        found = yield from read_when_set(ctx, key, ctx.join_timeout, seen, alive)
        if found is None:
            return None
        raw = found
    data = load(raw)
    if not isinstance(data, dict):
        raise RendezvousConnectionError(f"unreadable master address of round {n}")
    return str(data["addr"]), int(data["port"])


def master_of(ctx: Context) -> bytes:
    """This node's address as rank 0's, with a fresh port for the workers' store."""
    return dump({"addr": ctx.info["addr"], "port": ctx.new_port(), "node": ctx.node_id})


def _written_by(raw: bytes, node: str) -> bool:
    data = load(raw)
    return isinstance(data, dict) and data.get("node") == node


def read_when_set(
    ctx: Context,
    key: str,
    timeout: float,
    seen: tuple[dict[str, bytes], int] | None = None,
    alive: str | None = None,
) -> Protocol:
    """The value of ``key`` once it is set. A read, then (while absent) a watch that
    brings the value: one request when the key is there, and one answer after it is set
    (a wait, then a read, made every node of a large round ask twice after rank 0 wrote
    the master address). ``seen``: a read already made (what it found, its revision).
    ``alive``: a key that must exist meanwhile, read every ``MASTER_CHECK_EVERY`` seconds
    of waiting; None once it is gone. Raises ``StoreTimeoutError`` after ``timeout``."""
    deadline = ctx.clock.monotonic() + timeout
    found, rev = seen if seen is not None else (yield GetPrefix(key))
    while (raw := found.get(key)) is None:
        left = deadline - ctx.clock.monotonic()
        if left <= 0:
            raise StoreTimeoutError(f"timed out after {timeout:.3g}s waiting for {[key]}")
        try:
            res = yield Watch(key, rev, left if alive is None else min(left, MASTER_CHECK_EVERY))
        except StoreCompactedError:
            found, rev = yield GetPrefix(key)
            continue
        rev = res.revision
        apply_events(found, res.events)
        if key not in found and alive is not None and (yield Get(alive)) is None:
            return None
    return raw


def decided_rows(ctx: Context, n: int, decision: str | None = None) -> Protocol:
    """The full member list of round ``n``'s committed decision, in group-rank order
    (``[[node, addr, role, local_world_size], ...]``; empty when ``decision`` is given
    and is not the committed one)."""
    return (yield from rows_of(ctx, n, (yield Get(ctx.keys.result(n))), decision))


def rows_of(ctx: Context, n: int, raw: bytes | None, decision: str | None = None) -> Protocol:
    """``decided_rows`` of round ``n`` whose result (as read) is ``raw``."""
    result = load(raw)
    if not isinstance(result, dict) or "id" not in result or "size" not in result:
        return []
    if decision is not None and decision != str(result["id"]):
        return []
    # One prefix read for all pages: the next round's closer reads them right after a
    # loss, on the re-forming's critical path (a read per page cost N/PAGE_SIZE round trips).
    found, _ = yield GetPrefix(ctx.keys.members_prefix(n, str(result["id"])))
    return rows_of_pages(list(found.values()))


def member_page(ctx: Context, n: int, decision: str, size: int, node: str) -> Protocol:
    """The entries of the page of ``node`` in a decision of ``size`` members (``node`` is
    a member when it has an entry: ``[rank, addr, role, local_world_size]``)."""
    key = ctx.keys.members(n, decision, page_of(node, page_count(size)))
    return page_entries((yield Get(key)))
