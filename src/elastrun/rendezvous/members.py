"""A decision's members in pages: each node reads the one page with its rank.

Each node must learn its own rank, and only the next round's closer (and tools) the
whole list. One key per member made the closer write N keys one after another after the
last join (the slowest part of a large rendezvous); one key for the whole list made
every node read O(N) bytes. Pages of PAGE_SIZE members, a member on the page its id
hashes to, cost the closer N / PAGE_SIZE writes and each node one read of O(PAGE_SIZE)
bytes; the page count follows from the round's size. Pure: no store, no I/O.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence

#: Members per page (on average: a member's page is chosen by a hash of its id).
PAGE_SIZE = 64

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
    try:
        data = json.loads(raw) if raw is not None else None
    except ValueError:
        return {}
    members = data.get("members") if isinstance(data, dict) else None
    return members if isinstance(members, dict) else {}


def rows_of_pages(pages: Sequence[bytes | None]) -> list[list[object]]:
    """The members of all of a decision's pages, in group-rank order:
    ``[[node, addr, role, local_world_size], ...]``."""
    entries = [(int(str(e[0])), node, e) for raw in pages for node, e in page_entries(raw).items()]
    entries.sort(key=lambda item: item[0])
    return [[node, e[1], e[2], e[3]] for _, node, e in entries]
