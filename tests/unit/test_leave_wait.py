"""A node that serves the store waits for the others to leave; a stop request ends that
wait (and only it)."""

from __future__ import annotations

import threading
import time

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import SYSTEM_CLOCK
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.liveness import Liveness
from elastrun.store.memory import MemoryStore


def test_a_stop_request_ends_the_wait_for_the_other_nodes_to_leave() -> None:
    store = MemoryStore()
    keys = RunKeys.of_run("leave")
    store.set(keys.nodes + "other", b"{}")  # a node that never leaves
    liveness = Liveness(
        store,
        keys,
        "self",
        ttl=10.0,
        max_nodes=2,
        clock=SYSTEM_CLOCK,
        life=CancelScope(),
        decided_rows=lambda n, since: [],
    )
    stop = CancelScope()
    timer = threading.Timer(0.1, stop.cancel, args=("received SIGTERM",))
    try:
        timer.start()
        t0 = time.monotonic()
        with stop.active():
            liveness.keeper.wait_for_others_to_leave(None)  # returns: leaving goes on
        assert time.monotonic() - t0 < 2.0
    finally:
        timer.cancel()
        stop.close()
