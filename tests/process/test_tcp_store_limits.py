"""The tcp store against strangers and low limits, as a real ``elastrun store`` process.

Connections that never authenticate are closed after the handshake timeout and capped
in number; the server keeps a reserve of descriptors under its limit, waiting (in the
listen backlog) for room instead of failing; a flood costs a few log lines, never a
line or a traceback per connection. Plus the client's one reconnect window per outage.
"""

from __future__ import annotations

import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.core.errors import StoreUnavailableError
from elastrun.store.tcp import TcpStore
from elastrun.store.tcp import protocol as p
from elastrun.store.tcp.limits import LogLimiter, fd_reserve
from elastrun.store.tcp.service import HANDSHAKE_TIMEOUT

PY = sys.executable
LIMIT = 256


class Store:
    """``python -m elastrun store`` on a free port, optionally under an fd limit."""

    def __init__(self, tmp: Path, limit: int | None = None, port: int = 0) -> None:
        self.err = tmp / f"store-{time.monotonic_ns()}.err"

        def low_limit() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        with self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [PY, "-m", "elastrun", "store", "--host", "127.0.0.1", "--port", str(port)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                # Only setrlimit runs between fork and exec: safe with this test's threads.
                preexec_fn=low_limit,  # noqa: PLW1509
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("elastrun store: serving on"), line + self.log()
        self.port = int(line.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.err.read_text(errors="replace")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return self.proc.returncode


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[list[Store]]:
    started: list[Store] = []
    yield started
    codes = [s.stop() for s in started]
    assert all(c == 0 for c in codes), codes


class Crowd:
    """Many raw connections, driven by one selector: each answers the challenge with a
    hello (or stays silent) and counts as welcomed once the server says so."""

    def __init__(self, port: int, n: int, *, hello: bool) -> None:
        self.hello = hello
        self.sel = selectors.DefaultSelector()
        self.socks: list[socket.socket] = []
        self.bufs: dict[socket.socket, bytearray] = {}
        self.welcomed: set[socket.socket] = set()
        self.closed: set[socket.socket] = set()
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            self.socks.append(s)
            self.bufs[s] = bytearray()
            self.sel.register(s, selectors.EVENT_READ)

    def pump(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            for key, _ in self.sel.select(left):
                self._readable(key.fileobj)  # type: ignore[arg-type]  # only sockets are registered

    def _readable(self, s: socket.socket) -> None:
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(s)
            self.closed.add(s)
            return
        buf = self.bufs[s]
        buf += data
        while len(buf) >= p.HEADER.size:
            (length,) = p.HEADER.unpack(bytes(buf[: p.HEADER.size]))
            if len(buf) < p.HEADER.size + length:
                return
            message = p.decode(bytes(buf[p.HEADER.size : p.HEADER.size + length]))
            del buf[: p.HEADER.size + length]
            if message.get("type") == "challenge" and self.hello:
                hello = {"type": "hello", "version": p.PROTOCOL_VERSION, "proof": None}
                s.setblocking(True)
                s.sendall(p.encode({**hello, "resume": []}, p.HANDSHAKE_MAX_FRAME))
                s.setblocking(False)
            elif message.get("type") == "welcome":
                self.welcomed.add(s)

    def drop(self, socks: list[socket.socket]) -> None:
        for s in socks:
            if s not in self.closed:
                self.sel.unregister(s)
                self.closed.add(s)
            s.close()

    def close(self) -> None:
        self.drop(self.socks)
        self.sel.close()


def test_a_connection_that_never_says_hello_is_closed_after_the_handshake_timeout(
    tmp_path: Path, stores: list[Store]
) -> None:
    store = Store(tmp_path)
    stores.append(store)
    crowd = Crowd(store.port, 1, hello=False)
    try:
        started = time.monotonic()
        while not crowd.closed and time.monotonic() - started < HANDSHAKE_TIMEOUT + 5:
            crowd.pump(0.1)
        took = time.monotonic() - started
    finally:
        crowd.close()
    assert crowd.closed
    assert HANDSHAKE_TIMEOUT - 0.5 <= took <= HANDSHAKE_TIMEOUT + 2, took
    assert "no hello within" in store.log()


def test_a_flood_of_silent_connections_leaves_the_store_serving_with_a_short_log(
    tmp_path: Path, stores: list[Store]
) -> None:
    store = Store(tmp_path, limit=LIMIT)
    stores.append(store)
    crowd = Crowd(store.port, 1000, hello=False)  # four times the descriptor limit
    try:
        crowd.pump(1.0)
        assert store.fds() < LIMIT - fd_reserve(LIMIT) + 16
        started = time.monotonic()
        with TcpStore("127.0.0.1", store.port, connect_timeout=20) as client:
            client.set("still", b"serving")
            assert client.get("still") == b"serving"
        served_after = time.monotonic() - started
        crowd.pump(0.5)
    finally:
        crowd.close()
    log = store.log()
    assert "Traceback" not in log
    assert len(log) < 5_000, log
    assert log.count("not accepting connections") == 1, log
    print(f"a client was served {served_after:.1f}s into a flood of 1000; log {len(log)} bytes")


def test_the_store_keeps_a_reserve_of_descriptors_and_takes_waiting_clients_later(
    tmp_path: Path, stores: list[Store]
) -> None:
    store = Store(tmp_path, limit=LIMIT)
    stores.append(store)
    budget = LIMIT - fd_reserve(LIMIT)
    crowd = Crowd(store.port, 300, hello=True)  # more clients than the budget allows
    try:
        crowd.pump(2.0)
        first = len(crowd.welcomed)
        assert 100 < first <= budget, first
        assert store.fds() <= budget, store.fds()
        assert not crowd.closed  # the others wait in the backlog: not refused, not lost
        crowd.drop(list(crowd.welcomed)[:60])
        crowd.pump(2.0)
        later = len(crowd.welcomed) - first
        assert later >= 50, later
        assert store.fds() <= budget, store.fds()
    finally:
        crowd.close()
    log = store.log()
    assert "Traceback" not in log
    assert "descriptors are free" in log, log
    assert log.count("not accepting connections") <= 2, log


# -- the client: one reconnect window per outage -----------------------------------------


def test_every_call_waiting_on_a_dead_store_gives_up_at_one_deadline(tmp_path: Path) -> None:
    store = Store(tmp_path)
    window = 1.5
    with TcpStore("127.0.0.1", store.port, connect_timeout=window) as client:
        lease = client.grant_lease(30)  # a lease: the client reconnects at once
        client.set("k", b"v", lease=lease)
        store.proc.kill()
        store.proc.wait()
        # Its port stays taken (bound, not listening: a connection is refused) so that no
        # server of another test listens there meanwhile: one did once, and the client,
        # connected to it and dropped, said "keeps dropping" instead of giving up.
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", store.port))
        lost = time.monotonic()
        ended: list[tuple[float, BaseException | None]] = []

        def call() -> None:
            try:
                for _ in range(3):  # several calls in a row, as the rendezvous makes
                    client.get("k")
                ended.append((time.monotonic() - lost, None))
            except StoreUnavailableError as exc:
                ended.append((time.monotonic() - lost, exc))

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        held.close()
    store.stop()
    assert len(ended) == 8
    assert all(isinstance(exc, StoreUnavailableError) for _, exc in ended), ended
    latest = max(took for took, _ in ended)
    # One window (plus at most one short attempt), not one per call or per thread.
    assert window - 0.3 <= latest <= window + 1.0, ended
    exc = ended[0][1]
    assert isinstance(exc, StoreUnavailableError)
    assert exc.address == f"127.0.0.1:{store.port}"
    assert "has not answered for" in str(exc)


def test_after_giving_up_a_client_finds_a_store_that_came_back(
    tmp_path: Path, stores: list[Store]
) -> None:
    store = Store(tmp_path)
    port = store.port
    with TcpStore("127.0.0.1", port, connect_timeout=0.5) as client:
        client.set("k", b"v")
        store.stop()
        with pytest.raises(StoreUnavailableError):
            client.get("k")
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            client.get("k")  # past the window: one short attempt, then at once
        assert time.monotonic() - started < 1.0
        back = Store(tmp_path, port=port)
        stores.append(back)
        assert client.get("k") is None  # a new, empty store
        client.set("k", b"again")
        assert client.get("k") == b"again"


def test_a_silent_store_is_given_up_after_the_request_timeout() -> None:
    # Accepts and greets, then answers nothing: a hung process, or a partition.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held: list[socket.socket] = []

    def serve() -> None:
        try:
            while True:
                conn, _ = listener.accept()
                held.append(conn)
                challenge = {"type": "challenge", "version": p.PROTOCOL_VERSION,
                             "nonce": p.b64(b"n" * 32), "auth": False,
                             "max_frame": p.DEFAULT_MAX_FRAME}  # fmt: skip
                conn.sendall(p.encode(challenge, p.DEFAULT_MAX_FRAME))
                p.recv_frame(conn, p.DEFAULT_MAX_FRAME, bytearray())
                welcome = {"type": "welcome", "version": 1, "resumed": [], "lost": []}
                conn.sendall(p.encode(welcome, p.DEFAULT_MAX_FRAME))
        except OSError:
            pass

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with TcpStore("127.0.0.1", port, connect_timeout=1.0, request_timeout=1.0) as client:
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match=r"did not answer within 1\.0s"):
                client.get("k")
            took = time.monotonic() - started
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
        for conn in held:
            conn.close()
    assert 0.9 <= took < 2.0, took


# -- bounded logging ---------------------------------------------------------------------


class _Records:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, level: int, msg: str, *args: object) -> None:
        self.lines.append(msg % args)


def test_the_log_limiter_lets_a_burst_through_then_counts_what_it_held_back() -> None:
    now = [0.0]
    records = _Records()
    # arg-type: a fake logger with only the log() that LogLimiter calls
    limiter = LogLimiter(records, lambda: now[0], every=10.0, burst=2)  # type: ignore[arg-type]
    for i in range(100):
        limiter.log(30, "handshake", "closing %d", i)
    limiter.log(30, "auth", "refused %s", "x")  # another kind has its own budget
    assert records.lines == ["closing 0", "closing 1", "refused x"]
    now[0] = 10.0
    limiter.log(30, "handshake", "closing %d", 100)
    assert records.lines[-1] == "closing 100 (and 98 more like it, not logged)"
