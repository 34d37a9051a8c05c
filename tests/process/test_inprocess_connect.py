"""In-process synchronisation: a worker reaching the store of a round that a newer round
has replaced moves on within one short try of torch's client, not after its timeout."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from elastrun.inprocess.worker import sync

pytest.importorskip("torch")


def test_a_round_store_that_stops_after_the_first_connect_costs_one_short_try() -> None:
    # What made two survivors miss a round's 5 s join bound (they were then replaced):
    # the store of their round took the plain connect of ``_connect``, then stopped (the
    # agent had abandoned the round), and a newer round was announced meanwhile. torch's
    # client retries a refused port for its whole timeout, with one retry of its own, and
    # nothing interrupts it: 9.6 s with the old 5 s tries, 2.3 s with 1 s ones here.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    newer_round = threading.Event()

    def stop_after_the_first_connect() -> None:
        conn, _ = listener.accept()
        conn.close()
        listener.close()
        newer_round.set()

    store = threading.Thread(target=stop_after_the_first_connect)
    store.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(sync.Superseded, match="round 3 was superseded"):
            sync._connect("127.0.0.1", port, 3, newer_round.is_set)
    finally:
        took = time.monotonic() - t0
        store.join(10)
        listener.close()
    assert took < 6.0, f"reaching the stopped store took {took:.1f}s"
