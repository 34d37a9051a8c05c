"""The node check's meeting place in the rendezvous store: who checks together, the
ports of the link tests, and every round's results, read alike by every node.

Nodes that check at the same time form a *wave*: the first opens it (``check/wave``,
a compare-and-set, with a closing time on the wall clock, ``WINDOW`` seconds on), the
others register under it until then, and the first node to see it close writes its
members (``check/<w>/members``, compare-and-set: one list wins, and every node reads that one).
A node that registered too late to be in it opens the next wave. Why a window rather
than the round's members: the check runs before a node joins, so that a bad node never
holds up a round; nodes launched together register within seconds of each other. Why
the wave never closes early: the nodes to expect are unknown (spares come on top of
``--nnodes``), and a node that misses a wave checks alone, for compute only.

Then every node drives the same ``nodecheck.Isolation`` from the same results: round
``k``'s results are ``check/<w>/r<k>/<node>``, each written with a compare-and-set that
expects no value. A node that waited for a peer's result until its own deadline writes
a "missing" record in that peer's place the same way, so a late result and the marker
cannot both be read: every node sees one value per key, and computes the same pairs.

The keys live outside ``ctl/``: no rendezvous watcher wakes for them. A wave's keys are
left behind (a few hundred bytes per node and wave); the registrations are bound to
the node's lease.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

from elastrun.core import cancel
from elastrun.core.clock import Clock
from elastrun.core.errors import StoreTimeoutError
from elastrun.core.values import finite_float
from elastrun.rendezvous.elastic import StoreSeat
from elastrun.rendezvous.exclusion import versioned_doc
from elastrun.store.api import Store

__all__ = ["WINDOW", "CheckBoard", "LinkResult", "Wave"]

#: Seconds a wave stays open for nodes to register.
WINDOW = 5.0
#: A node does not register in a wave that closes within this many seconds (or a
#: quarter of the window, if less): its write might land after the members were read.
MARGIN = 0.5
VERSION = 1


@dataclass(frozen=True)
class Wave:
    """The nodes checking together (sorted node ids), and their addresses."""

    id: int
    members: tuple[str, ...]
    addrs: dict[str, str]


@dataclass(frozen=True)
class LinkResult:
    """One node's result of one round: its link time (None: failed or missing) and, in
    the first round, its compute time (None: failed)."""

    link: float | None
    compute: float | None = None
    missing: bool = False


def _dump(doc: Mapping[str, object]) -> bytes:
    return json.dumps({"v": VERSION, **doc}, sort_keys=True).encode()


class CheckBoard:
    """This node's side of the node check in the store.

    Args:
        store: the rendezvous store.
        prefix: the run's prefix (``RunKeys.prefix``).
        node: this node's id.
        addr: this node's address (its link test listens there).
        lease: this node's lease (its registrations vanish with it).
        clock: wall-clock time for the wave's closing (read on other hosts).
        window: see ``WINDOW``.

    Every wait observes the calling thread's current cancel scope (``core.cancel``).
    Deadlines are ``time.monotonic()`` values: the check's processes run in real time.
    """

    def __init__(
        self,
        store: Store,
        prefix: str,
        node: str,
        addr: str,
        *,
        lease: int | None,
        clock: Clock,
        window: float = WINDOW,
    ) -> None:
        self._store = store
        self._root = prefix + "check/"
        self.node = node
        self.addr = addr
        self._lease = lease
        self._clock = clock
        self._window = window

    @classmethod
    def at(cls, seat: StoreSeat) -> CheckBoard:
        """The board in the run's store where the rendezvous seated this node."""
        return cls(
            seat.store, seat.prefix, seat.node, seat.addr, lease=seat.lease, clock=seat.clock
        )

    # -- the wave ------------------------------------------------------------------------

    def join(self, deadline: float) -> Wave:
        """Register in the open wave (or open one) and wait for it to close; the wave
        this node is a member of. ``deadline``: the monotonic time to give up by.

        Raises:
            StoreTimeoutError: no wave took this node in before ``deadline``.
        """
        while True:
            wave_id, until = self._open_wave()
            key = f"{self._root}{wave_id}/in/{self.node}"
            self._store.set(key, _dump({"addr": self.addr}), lease=self._lease)
            members = self._close(wave_id, until, deadline)
            if self.node in members:
                found, _ = self._store.get_prefix(f"{self._root}{wave_id}/in/")
                addrs = {}
                for k, raw in found.items():
                    doc = versioned_doc(raw, VERSION)
                    addrs[k.rsplit("/", 1)[1]] = str(doc.get("addr", "")) if doc else ""
                return Wave(wave_id, members, addrs)

    def _open_wave(self) -> tuple[int, float]:
        key = self._root + "wave"
        while True:
            raw = self._store.get(key)
            doc = versioned_doc(raw, VERSION) or {}
            number, until = doc.get("id"), finite_float(doc.get("until"))
            now = self._clock.time()
            margin = min(MARGIN, self._window / 4)
            if isinstance(number, int) and until is not None and now < until - margin:
                return number, until
            fresh = (number if isinstance(number, int) else 0) + 1, now + self._window
            won, _ = self._store.compare_set(key, raw, _dump({"id": fresh[0], "until": fresh[1]}))
            if won:
                return fresh

    def _close(self, wave_id: int, until: float, deadline: float) -> tuple[str, ...]:
        """The wave's members, once decided (by this node, or another that was first)."""
        key = f"{self._root}{wave_id}/members"
        prefix = f"{self._root}{wave_id}/in/"
        scope = cancel.current()
        while True:
            decided = versioned_doc(self._store.get(key), VERSION)
            members = decided.get("members") if decided is not None else None
            if isinstance(members, list):
                return tuple(str(m) for m in members)
            found, revision = self._store.get_prefix(prefix)
            left = until - self._clock.time()
            if left <= 0:
                names = sorted(k[len(prefix) :] for k in found)
                self._store.compare_set(key, None, _dump({"members": names}))
                continue  # read what won
            wait = min(left, deadline - time.monotonic(), scope.remaining())
            if wait <= 0:
                raise StoreTimeoutError("the node check's wave did not close in time")
            self._store.watch(prefix, revision, wait + 0.01)

    # -- the link tests' ports -----------------------------------------------------------

    def offer_port(self, wave: Wave, round_: int, port: int) -> None:
        """This node serves round ``round_``'s link test on ``port``."""
        self._store.set(self._key(wave, round_, "port", self.node), _dump({"port": port}))

    def partner_port(self, wave: Wave, round_: int, partner: str, deadline: float) -> int | None:
        """The port ``partner`` serves round ``round_``'s link test on (None: not by
        ``deadline``, or it failed to serve)."""
        key = self._key(wave, round_, "port", partner)
        try:
            self._store.wait([key], max(0.0, deadline - time.monotonic()))
        except StoreTimeoutError:
            return None
        doc = versioned_doc(self._store.get(key), VERSION)
        port = doc.get("port") if doc else None
        return port if isinstance(port, int) and port > 0 else None

    # -- results -------------------------------------------------------------------------

    def publish(self, wave: Wave, round_: int, result: LinkResult) -> None:
        """This node's result of round ``round_`` (ignored if a peer already marked it
        missing: every node must read one value)."""
        doc = {"link": result.link, "compute": result.compute}
        self._store.compare_set(self._key(wave, round_, "r", self.node), None, _dump(doc))

    def results(
        self, wave: Wave, round_: int, nodes: list[str], deadline: float
    ) -> dict[str, LinkResult]:
        """Round ``round_``'s results of ``nodes``, waited for until ``deadline`` (the
        monotonic time); those still absent then are marked missing, for every node."""
        keys = {n: self._key(wave, round_, "r", n) for n in nodes}
        try:
            self._store.wait(list(keys.values()), max(0.0, deadline - time.monotonic()))
        except StoreTimeoutError:
            marker = _dump({"link": None, "compute": None, "missing": True})
            for key in keys.values():
                self._store.compare_set(key, None, marker)
        found: dict[str, LinkResult] = {}
        for node, key in keys.items():
            doc = versioned_doc(self._store.get(key), VERSION) or {"missing": True}
            found[node] = LinkResult(
                finite_float(doc.get("link")),
                finite_float(doc.get("compute")),
                bool(doc.get("missing")),
            )
        return found

    def _key(self, wave: Wave, round_: int, kind: str, node: str) -> str:
        return f"{self._root}{wave.id}/{kind}{round_}/{node}"

    def __repr__(self) -> str:
        return f"CheckBoard(node={self.node!r}, addr={self.addr!r}, window={self._window})"
