"""The workers' store as the agent hosts it (``LazyTorchWireServer``): it listens at
once, starts serving at the first client, and closing it ends its thread at once,
whether a client came or not (no descriptor left open: the ``no_leaks`` fixture)."""

from __future__ import annotations

import socket
import threading
import time

from elastrun.store.torchwire.lazy import LazyTorchWireServer


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name.startswith("elastrun")]


def test_closing_before_any_client_ends_the_waiting_thread_at_once_and_frees_the_port() -> None:
    before = set(threading.enumerate())
    server = LazyTorchWireServer("127.0.0.1", 0)
    port = server.start()
    mine = _new_threads(before)
    assert [t.name for t in mine] == ["elastrun-workers-store"]
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < 1.0  # woken, not left to its join bound
    assert not [t.name for t in mine if t.is_alive()]
    assert not server.serving
    server.close()  # idempotent
    # What it says of itself and its port outlives its sockets (a log line after close).
    assert (server.port, repr(server)) == (port, f"LazyTorchWireServer(127.0.0.1:{port}, closed)")
    with socket.socket() as sock:  # the listening socket is closed
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_the_first_client_starts_the_server_and_closing_stops_it() -> None:
    before = set(threading.enumerate())
    server = LazyTorchWireServer("127.0.0.1", 0)
    port = server.start()
    waiting = _new_threads(before)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            deadline = time.monotonic() + 10
            while not server.serving:
                assert time.monotonic() < deadline, "no server after a client connected"
                time.sleep(0.01)
    finally:
        mine = [t for t in _new_threads(before) if t not in waiting]
        server.close()
    assert [t.name for t in waiting] == ["elastrun-workers-store"]
    assert [t.name for t in mine] == [f"elastrun-torchwire 127.0.0.1:{port}"]
    assert not [t.name for t in waiting + mine if t.is_alive()]
