"""Agreeing on an in-process round across nodes, through the rendezvous store.

When the group re-forms (a worker failed somewhere, a node was lost, or one joins), a
node whose workers all recover in place keeps them running through the rendezvous.
Once the new round has formed, every node writes what it offers to
``rounds/<n>/inprocess/<rank>`` (``RunKeys.inprocess``): whether it kept its workers,
or starts them afresh and they can join an in-process round (a node that joins, or one
whose last workers all used ``elastrun.inprocess``), the in-process round they run in,
and the endpoints they listen on. Every node then reads every offer and decides the
same way: when at least one node kept its workers, some kept worker still holds the
training's state (not every one is a replacement yet to synchronise), and every other
node can join, the round is recovered in place. Its number is one past the newest any
node ran; every listener goes to every kept worker, which cut their connections to them;
the nodes starting afresh start their workers in that round, so that they first take
the newest commit (the world grows in place). Otherwise every node restarts its workers, as for a
script that does not use ``elastrun.inprocess``.

A node that does not write its offer within the bound counts as a refusal: that node
is most likely gone, and the round will re-form again without it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from elastrun.core.errors import StoreError
from elastrun.store.api import Store

log = logging.getLogger("elastrun.agent")


@dataclass(frozen=True)
class Offer:
    """What one node brings to an in-process round."""

    kept: bool  # its workers kept running through the rendezvous
    round: int  # the in-process round they run in
    listeners: tuple[str, ...] = ()  # where they listen (``core.tcp_sockets`` form)
    fresh: bool = False  # not kept: it starts its workers afresh, and they can join
    # kept, and some worker holds the training's state (not only replacements that had
    # not synchronised yet: ``InprocessRecovery._holds_state``)
    holds: bool = True

    @property
    def joins(self) -> bool:
        """Whether this node takes part in an in-process round (kept, or fresh)."""
        return self.kept or self.fresh

    def to_json(self) -> bytes:
        return json.dumps(
            {"kept": self.kept, "fresh": self.fresh, "round": self.round,
             "listeners": list(self.listeners), "holds": self.holds},
            separators=(",", ":"),
        ).encode()  # fmt: skip

    @classmethod
    def from_json(cls, raw: bytes | None) -> Offer | None:
        """The offer in ``raw`` (None: missing or not an offer)."""
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            listeners = tuple(str(e) for e in data["listeners"])
            holds = bool(data.get("holds", True))
            return cls(
                bool(data["kept"]), int(data["round"]), listeners, bool(data["fresh"]), holds
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Agreement:
    """An in-process round every node of the rendezvous round takes part in."""

    round: int
    listeners: tuple[str, ...]


def agree(
    store: Store, prefix: str, rank: int, world: int, offer: Offer, timeout: float
) -> Agreement | None:
    """Write this node's ``offer`` and read every node's; the round they agree on, or
    None when every node restarts its workers. The wait observes the caller's current
    cancel scope (a signal ends it with ``Cancelled``)."""
    keys = [f"{prefix}{r}" for r in range(world)]
    try:
        store.set(keys[rank], offer.to_json())
        if not offer.joins:
            return None  # no need to wait: this node refuses, and every node restarts
        store.wait(keys, timeout)
        offers = [Offer.from_json(store.get(k)) for k in keys]
    except StoreError as exc:
        log.warning("in-process round: the other nodes' offers could not be read (%s)", exc)
        return None
    if not all(o is not None and o.joins for o in offers):
        return None
    got = [o for o in offers if o is not None]
    if not any(o.kept for o in got):
        return None  # every node starts afresh: an ordinary round
    if not any(o.kept and o.holds for o in got):
        log.warning(
            "every worker that held the training's state has failed (the kept workers are "
            "replacements that had not taken a commit yet): restarting the workers; the "
            "script loads its own checkpoint"
        )
        return None
    listeners = sorted({end for o in got for end in o.listeners})
    return Agreement(max(o.round for o in got) + 1, tuple(listeners))
