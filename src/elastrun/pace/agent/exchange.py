"""Job-wide stragglers: each node's step-time summary through one small store key.

Every node's agent writes its summary (:class:`NodeSummary`, about 150 bytes) to
``rounds/<n>/pace/<group rank>`` every ``every`` seconds; the agent of group rank 0 also
reads that prefix (one ``get_prefix``) and compares the nodes. The store sees one small
write per node and one read in all per period: O(nodes), where every node reading every
other's would be O(nodes^2). The keys are not under ``ctl/``, so no rendezvous watcher
wakes for them.

The store calls run in a thread of their own: a slow or unreachable store must never
hold up the agent's loop, which watches the workers. The loop hands over its latest
summary (:meth:`NodeExchange.offer`) and takes what was read (:meth:`NodeExchange.take`):
a lock and a reference each. A store error is logged once; the exchange keeps trying
and nothing here ever fails the job.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from elastrun.core.cancel import CancelScope
from elastrun.core.errors import StoreError
from elastrun.core.threads import Nursery
from elastrun.pace.agent.straggler import NodeSummary
from elastrun.store.api import Store

log = logging.getLogger("elastrun.agent")

#: A node whose summary did not change in this many reads in a row is left out (its
#: agent stopped publishing: frozen, or its workers are done).
STALE_READS = 3
#: How long :meth:`NodeExchange.close` waits for the thread to end.
CLOSE_WAIT = 2.0


class NodeExchange:
    """Publishes this node's summary; the reader (group rank 0) also collects every node's.

    Args:
        store: the rendezvous store of the round.
        prefix: the round's pace prefix (``RunKeys.pace(round)``).
        node: this node's key under ``prefix`` (its group rank).
        reader: whether this node reads every node's summaries.
        every: seconds between two exchanges.

    The constructor does no I/O; :meth:`start` starts the thread, :meth:`close` stops it.
    """

    def __init__(self, store: Store, prefix: str, node: str, *, reader: bool, every: float):
        self._store = store
        self._prefix = prefix
        self._node = node
        self.reader = reader
        self._every = every
        self._lock = threading.Lock()
        self._nursery = Nursery(join_timeout=CLOSE_WAIT)
        self._offered: NodeSummary | None = None
        self._seq = 0
        self._read: list[NodeSummary] | None = None
        self._seen: dict[str, tuple[int, int]] = {}  # node -> (seq, reads unchanged)
        self._failed = False

    def start(self) -> None:
        """Start exchanging (a daemon thread). Idempotent."""
        if not self._nursery.running() and not self._nursery.closed:
            self._nursery.start(self._run, name=f"elastrun-pace-{self._node}")

    def offer(self, summary: NodeSummary) -> None:
        """This node's latest summary, published at the next exchange."""
        with self._lock:
            self._offered = summary

    def take(self) -> list[NodeSummary] | None:
        """The fresh summaries of every node read since the last call (None: no read)."""
        with self._lock:
            read, self._read = self._read, None
        return read

    def _run(self, scope: CancelScope) -> None:
        while True:  # until closing cancels the scope (its sleep, or a store call, raises)
            scope.sleep(self._every)
            try:
                self._exchange_once()
            except (StoreError, OSError) as exc:  # OSError: a closed connection
                if not self._failed:
                    log.warning("stragglers: cannot reach the store (%s); will retry", exc)
                self._failed = True
            else:
                self._failed = False

    def _exchange_once(self) -> None:
        with self._lock:
            summary, self._offered = self._offered, None
        if summary is not None:
            self._seq += 1
            summary = dataclasses.replace(summary, node=self._node, seq=self._seq)
            self._store.set(self._prefix + self._node, summary.to_json())
        if not self.reader:
            return
        values, _ = self._store.get_prefix(self._prefix)
        fresh = []
        for key, raw in values.items():
            got = NodeSummary.from_json(raw)
            if got is None:
                continue
            node = key[len(self._prefix) :]
            seq, unchanged = self._seen.get(node, (-1, 0))
            unchanged = unchanged + 1 if got.seq == seq else 0
            self._seen[node] = (got.seq, unchanged)
            if unchanged < STALE_READS:
                fresh.append(dataclasses.replace(got, node=node))
        with self._lock:
            self._read = fresh

    def close(self) -> None:
        """Stop exchanging (a store call under way is cancelled). Never raises."""
        self._nursery.close()  # a thread still running past CLOSE_WAIT is left (a daemon)

    def __repr__(self) -> str:
        return (
            f"NodeExchange(prefix={self._prefix!r}, node={self._node!r}, "
            f"reader={self.reader}, published={self._seq})"
        )
