"""A decision's members in pages: each node reads the one page with its rank.

Each node must learn its own rank, and only the next round's closer (and tools) the
whole list. One key per member made the closer write N keys one after another after the
last join (the slowest part of a large rendezvous); one key for the whole list made
every node read O(N) bytes. Pages of PAGE_SIZE members, a member on the page its id
hashes to, cost the closer N / PAGE_SIZE writes and each node one read of O(PAGE_SIZE)
bytes; the page count follows from the round's size. Pure: no store, no I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastrun.rendezvous.ops import load_doc

#: Members per page (on average: a member's page is chosen by a hash of its id).
PAGE_SIZE = 16

#: A member: node id, address, role, local world size.
MemberRow = tuple[str, str, str, int]


def page_count(size: int) -> int:
    """How many pages a decision of ``size`` members has."""
    return max(1, -(-size // PAGE_SIZE))


def page_of(node: str, pages: int) -> int:
    """The page of ``node``'s entry (a stable hash: every process agrees)."""
    return zlib.crc32(node.encode()) % pages


def member_pages(rows: Sequence[MemberRow]) -> list[dict[str, object]]:
    """``rows`` (in group-rank order) as pages: ``{"members": {node: [rank, addr, role,
    local_world_size]}}``."""
    pages: list[dict[str, list[object]]] = [{} for _ in range(page_count(len(rows)))]
    for rank, (node, addr, role, lws) in enumerate(rows):
        pages[page_of(node, len(pages))][node] = [rank, addr, role, lws]
    return [{"members": page} for page in pages]


def page_entries(raw: bytes | None) -> dict[str, list[object]]:
    """The entries of a page as stored (empty when absent or unreadable)."""
    members = load_doc(raw).get("members")
    return members if isinstance(members, dict) else {}


def rows_of_pages(pages: Sequence[bytes | None]) -> list[list[object]]:
    """The members of all of a decision's pages, in group-rank order:
    ``[[node, addr, role, local_world_size], ...]``."""
    entries = [(int(str(e[0])), node, e) for raw in pages for node, e in page_entries(raw).items()]
    entries.sort(key=lambda item: item[0])
    return [[node, e[1], e[2], e[3]] for _, node, e in entries]


# -- a decision's changes from the previous round ---------------------------------------
#
# After a loss, the next round is mostly the previous one: every survivor keeps its group
# rank, and a few nodes move into the lost ranks. A result that lists those few changes
# lets each survivor compute its own rank from the result it already reads, instead of
# reading its page too (at 10,000 nodes the pages were most of the bytes a re-formation
# moved through the store). The pages are still written: the next round's closer and
# tools read them, and a node the changes do not answer for reads its page as before.

#: The most changes (moved plus dropped nodes) a result lists; beyond, nodes read pages.
CHANGES_MAX = 64


def changes_from(previous: Sequence[str], members: Sequence[str]) -> dict[str, object] | None:
    """What a decision ``members`` (group-rank order) changed from ``previous`` (the
    previous round's members, in its group-rank order): ``{"moved": {node: rank},
    "dropped": [node]}``. ``moved``: each member whose rank is not its previous one (a
    newcomer too); ``dropped``: each previous member left out. None when they are more
    than ``CHANGES_MAX`` (or there is no previous round)."""
    if not previous:
        return None
    before = {node: rank for rank, node in enumerate(previous)}
    moved = {node: rank for rank, node in enumerate(members) if before.get(node) != rank}
    if len(moved) > CHANGES_MAX:
        return None
    chosen = set(members)
    dropped = [node for node in previous if node not in chosen]
    if len(moved) + len(dropped) > CHANGES_MAX:
        return None
    return {"moved": moved, "dropped": dropped}


@dataclass(frozen=True)
class Place:
    """What a result says of one node's place: ``known`` False when it cannot tell (the
    node reads its page); else ``rank`` (None: the node is not a member)."""

    known: bool
    rank: int | None = None


def place_in(
    result: Mapping[str, object], node: str, prev_round: int | None, held: int | None
) -> Place:
    """``node``'s place in a decision, from its ``result`` alone: answered when the result
    lists its changes from round ``prev_round``, in which ``node`` held group rank
    ``held``."""
    since = result.get("from")
    if not isinstance(since, dict) or prev_round is None or held is None:
        return Place(False)
    moved, dropped = since.get("moved"), since.get("dropped")
    size = result.get("size")
    if since.get("round") != prev_round or not isinstance(moved, dict):
        return Place(False)
    if not isinstance(dropped, list) or not isinstance(size, int):
        return Place(False)
    rank = moved.get(node)
    if isinstance(rank, int) and not isinstance(rank, bool):
        return Place(True, rank)
    if node in dropped:
        return Place(True, None)
    return Place(True, held) if 0 <= held < size else Place(False)
