"""The tcp store server as a real process: security, bad peers, scale, dead clients.

Each test starts ``python -m elastrun store`` (the code behind ``elastrun store``)
and stops it with SIGTERM, expecting a clean exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.core.errors import StoreAuthError, StoreCompactedError, StoreError
from elastrun.store.api import EventKind, WatchResult
from elastrun.store.tcp import TcpStore, TcpStoreServer
from elastrun.store.tcp import protocol as p

PY = sys.executable


class Server:
    """A store server process; ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(self, proc: subprocess.Popen[str], port: int, stderr: Path) -> None:
        self.proc = proc
        self.port = port
        self.stderr = stderr

    def log(self) -> str:
        return self.stderr.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)  # generous: a CI machine may be loaded
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    """Started servers; each must exit 0 on SIGTERM at the end of the test."""
    started: list[Server] = []
    yield started
    codes = [server.stop() for server in started]
    assert all(code == 0 for code in codes), f"store servers exited with {codes}"


def start_server(servers: list[Server], tmp: Path, *args: str, port: int = 0) -> Server:
    stderr = tmp / f"server{len(servers)}.err"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [PY, "-m", "elastrun", "store", "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    line = _read_line(proc, 20)
    if not line.startswith("elastrun store: serving on 127.0.0.1:"):
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
        raise AssertionError(f"server did not start: {line!r}, stderr: {stderr.read_text()}")
    server = Server(proc, int(line.rsplit(":", 1)[1]), stderr)
    servers.append(server)
    return server


def token_file(tmp: Path, token: str = "s3cret-token") -> str:
    path = tmp / "token"
    path.write_text(token + "\n")
    return str(path)


class Raw:
    """A hand-driven client speaking the wire protocol, to misbehave on purpose."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = bytearray()
        self.challenge = self.recv()
        self.local = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def hello(self, token: str | None = None, proof: str | None = None) -> None:
        if token is not None:
            proof = p.proof(token, p.unb64(self.challenge["nonce"], "nonce"))
        self.send({"type": "hello", "version": p.PROTOCOL_VERSION, "proof": proof, "resume": []})

    def send(self, message: p.Message) -> None:
        self.sock.sendall(p.encode(message, p.DEFAULT_MAX_FRAME))

    def recv(self) -> p.Message:
        return p.recv_frame(self.sock, p.DEFAULT_MAX_FRAME, self.buf)

    def closed_by_server(self) -> bool:
        """Drain what the server sent; True once it closes the connection."""
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def client(port: int, **kwargs: object) -> Iterator[TcpStore]:
    store = TcpStore("127.0.0.1", port, **kwargs)  # type: ignore[arg-type]  # kwargs: object
    try:
        yield store
    finally:
        store.close()


# -- the command -------------------------------------------------------------------------


def test_the_server_prints_where_it_serves_and_exits_0_on_sigint(
    servers: list[Server], tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    with client(server.port) as store:
        store.set("k", b"v")
    assert server.stop(signal.SIGINT) == 0


@pytest.mark.parametrize("content", [None, ""], ids=["missing", "empty"])
def test_an_unusable_token_file_exits_2_with_one_line(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    done = subprocess.run(
        [PY, "-m", "elastrun", "store", "--port", "0", "--token-file", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("elastrun store: error:") and "token file" in lines[0]


# -- authentication ----------------------------------------------------------------------


def test_only_a_client_proving_the_token_is_served(servers: list[Server], tmp_path: Path) -> None:
    server = start_server(servers, tmp_path, "--token-file", token_file(tmp_path))
    refused = f"store at 127.0.0.1:{server.port} refused authentication: wrong or missing token"
    with client(server.port, token="s3cret-token") as good:
        good.set("k", b"v")
        assert good.get("k") == b"v"
    for token in ("wrong", None):
        with client(server.port, token=token, connect_timeout=5) as bad:
            started = time.monotonic()
            with pytest.raises(StoreAuthError) as caught:
                bad.get("k")
            assert str(caught.value) == refused
            assert time.monotonic() - started < 3  # refused at once, not retried
    assert "authentication failed" in server.log()


def test_a_refused_client_reads_and_writes_nothing(servers: list[Server], tmp_path: Path) -> None:
    server = start_server(servers, tmp_path, "--token-file", token_file(tmp_path))
    with client(server.port, token="s3cret-token") as good:
        good.set("secret", b"treasure")
        # A wrong proof with requests pipelined right behind it.
        raw = Raw(server.port)
        hello = {"type": "hello", "version": 1, "proof": "00" * 32, "resume": []}
        write = {"id": 1, "op": "set", "key": "intruder", "value": p.b64(b"x")}
        read = {"id": 2, "op": "get", "key": "secret"}
        raw.sock.sendall(b"".join(p.encode(m, 4096) for m in (hello, write, read)))
        refusal = raw.recv()
        assert refusal == {"type": "error", "code": "auth", "message": "authentication failed"}
        assert raw.closed_by_server()
        raw.close()
        # No hello at all: a request straight away.
        raw = Raw(server.port)
        raw.send({"id": 1, "op": "set", "key": "intruder", "value": p.b64(b"x")})
        assert raw.closed_by_server()
        raw.close()
        assert good.get("intruder") is None
        assert good.get_prefix("")[0] == {"secret": b"treasure"}


# -- bad frames --------------------------------------------------------------------------


def test_a_malformed_frame_closes_only_that_connection(
    servers: list[Server], tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    with client(server.port) as bystander:
        bystander.set("k", b"1")
        raw = Raw(server.port)
        raw.hello()
        assert raw.recv()["type"] == "welcome"
        raw.sock.sendall(p.HEADER.pack(9) + b"not json!")
        assert raw.closed_by_server()
        raw.close()
        assert bystander.get("k") == b"1"
        bystander.set("k", b"2")
        assert bystander.get("k") == b"2"
    assert "not valid JSON" in server.log()
    assert raw.local in server.log()


def test_an_oversized_frame_closes_only_that_connection(
    servers: list[Server], tmp_path: Path
) -> None:
    limit = 100_000
    server = start_server(servers, tmp_path, "--max-frame", str(limit))
    with client(server.port) as bystander:
        bystander.set("k", b"1")
        for authenticated, size in ((True, limit + 1), (False, p.HANDSHAKE_MAX_FRAME + 1)):
            raw = Raw(server.port)
            if authenticated:
                raw.hello()
                raw.recv()
            # Only the header: the server must refuse before buffering the body.
            raw.sock.sendall(p.HEADER.pack(size))
            assert raw.closed_by_server()
            raw.close()
            assert f"frame of {size} bytes exceeds" in server.log()
        assert bystander.get("k") == b"1"
        # The client refuses to send an oversized value itself and stays usable.
        with pytest.raises(StoreError, match="frame limit"):
            bystander.set("big", b"x" * limit)
        bystander.set("k", b"2")
        assert bystander.get("k") == b"2"


def test_answers_larger_than_a_frame_are_split_or_refused_without_harm() -> None:
    server = TcpStoreServer("127.0.0.1", 0, max_frame=p.HANDSHAKE_MAX_FRAME)
    server.start()
    try:
        with TcpStore("127.0.0.1", server.port) as store:
            start = store.get_prefix("")[1]
            for i in range(100):
                store.set(f"big/{i:03d}", bytes([i]) * 1024)
            # A watch answers with as many changes as fit; resuming gets the rest.
            first = store.watch("big/", start, 1.0)
            assert 0 < len(first.events) < 100
            keys, revision = [e.key for e in first.events], first.revision
            while len(keys) < 100:
                result = store.watch("big/", revision, 1.0)
                keys.extend(e.key for e in result.events)
                revision = result.revision
            assert keys == [f"big/{i:03d}" for i in range(100)]
            # A read that cannot fit is refused; the connection stays usable.
            with pytest.raises(StoreError, match="too large"):
                store.get_prefix("big/")
            assert store.get("big/007") == bytes([7]) * 1024
    finally:
        server.stop()


def test_watchers_woken_by_one_change_share_one_answer_split_when_it_is_too_large() -> None:
    # The server encodes the answer for all the watchers one change wakes once; an
    # answer larger than a frame (here: a lease's 2,000 keys deleted at once) is still
    # split for each of them, and resuming gets the rest.
    server = TcpStoreServer("127.0.0.1", 0, max_frame=p.HANDSHAKE_MAX_FRAME)
    server.start()
    got: dict[int, list[str]] = {}
    clients = [TcpStore("127.0.0.1", server.port) for _ in range(3)]
    try:
        lease = clients[0].grant_lease(60)
        names = [f"k/{i:04d}-" + "n" * 40 for i in range(2000)]
        for name in names:
            clients[0].set(name, b"v", lease=lease)
        start = clients[0].set("marker", b"1")  # the revision after the writes

        def watch(i: int) -> None:
            keys: list[str] = []
            revision = start
            while len(keys) < len(names):
                result = clients[i].watch("k/", revision, 10.0)
                assert all(e.kind is EventKind.DELETE for e in result.events)
                keys.extend(e.key for e in result.events)
                revision = result.revision
            got[i] = keys

        threads = [threading.Thread(target=watch, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # both wait
        clients[0].revoke_lease(lease)
        for t in threads:
            t.join(10)
        assert got == {1: sorted(names), 2: sorted(names)}
    finally:
        for c in clients:
            c.close()
        server.stop()


# -- scale -------------------------------------------------------------------------------


class Crowd:
    """Many raw asyncio clients; each step waits until every client has reached it."""

    def __init__(self, port: int, n: int) -> None:
        self.port = port
        self.n = n
        self.connected = 0
        self.watching = 0
        self.all_in = asyncio.Event()
        self.all_watching = asyncio.Event()
        self.rejoined = 0  # connections the store closed before their welcome

    def _in(self) -> None:
        self.connected += 1
        if self.connected == self.n:
            self.all_in.set()

    def _watching(self) -> None:
        self.watching += 1
        if self.watching == self.n:
            self.all_watching.set()

    async def _join(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect and authenticate. Like the real client, connect again when the store
        closed the connection before its welcome: under a burst it closes the oldest
        unauthenticated connection after ``EVICT_AFTER``, and on a loaded machine this
        one event loop answers a thousand challenges more slowly than that."""
        for _ in range(50):
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                length = p.frame_length(await reader.readexactly(4), p.DEFAULT_MAX_FRAME)
                assert p.decode(await reader.readexactly(length))["type"] == "challenge"
                writer.write(p.encode({"type": "hello", "version": 1, "resume": []}, 4096))
                length = p.frame_length(await reader.readexactly(4), p.DEFAULT_MAX_FRAME)
                assert p.decode(await reader.readexactly(length))["type"] == "welcome"
                return reader, writer
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                self.rejoined += 1
                await asyncio.sleep(0.05)
        raise AssertionError("the store closed this client's connection 50 times")

    async def client(self, i: int) -> None:
        # A client that fails still counts at the steps it did not reach, so that the
        # others go on and the test reports its error instead of waiting out its bound.
        try:
            reader, writer = await self._join()
        except BaseException:
            self._in()
            self._watching()
            raise

        async def recv() -> p.Message:
            length = p.frame_length(await reader.readexactly(4), p.DEFAULT_MAX_FRAME)
            return p.decode(await reader.readexactly(length))

        async def call(message: p.Message) -> object:
            writer.write(p.encode(message, p.DEFAULT_MAX_FRAME))
            answer = await recv()
            assert answer["ok"] is True, answer
            return answer["result"]

        counted_in = counted_watching = False
        try:
            counted_in = True
            self._in()
            await self.all_in.wait()  # every connection is open at once from here on
            value = p.b64(str(i).encode())
            revision = await call({"id": 1, "op": "set", "key": f"c/{i}", "value": value})
            assert await call({"id": 2, "op": "get", "key": f"c/{i}"}) == value
            await call({"id": 3, "op": "add", "key": "total", "amount": 1})
            # Then everyone watches one key at once.
            watch = {"id": 4, "op": "watch", "prefix": "go/", "after": revision, "timeout": 60}
            writer.write(p.encode(watch, 4096))
            counted_watching = True
            self._watching()
            answer = await recv()
            assert answer["ok"] is True, answer
            result = answer["result"]
            assert isinstance(result, dict)
            assert [e["key"] for e in result["events"]] == ["go/now"]
        finally:
            if not counted_in:
                self._in()
            if not counted_watching:
                self._watching()
            writer.close()
            await writer.wait_closed()


def _threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count")


def test_a_thousand_concurrent_clients_are_served_and_watch_without_a_thread_each(
    servers: list[Server], tmp_path: Path
) -> None:
    n = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * n), hard))
    server = start_server(servers, tmp_path)
    crowd = Crowd(server.port, n)
    timings: dict[str, float] = {}

    async def release_the_watchers() -> None:
        await crowd.all_watching.wait()
        await asyncio.sleep(0.5)  # let the server take in the last watch requests
        timings["threads"] = _threads_of(server.proc.pid)
        with client(server.port) as store:
            store.set("go/now", b"1")  # brief blocking call; the crowd waits anyway
        timings["released"] = time.monotonic()

    async def main() -> None:
        async with asyncio.timeout(60):
            results = await asyncio.gather(
                release_the_watchers(),
                *(crowd.client(i) for i in range(n)),
                return_exceptions=True,
            )
        failures = [repr(r) for r in results if r is not None]
        assert not failures, f"{len(failures)} clients failed, e.g. {failures[:3]}"

    try:
        started = time.monotonic()
        asyncio.run(main())
        done = time.monotonic()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with client(server.port) as store:
        assert store.get("total") == str(n).encode()
        assert len(store.get_prefix("c/")[0]) == n
    assert timings["threads"] <= 4, timings  # the loop, not a thread per watcher
    print(
        f"{n} concurrent clients: {done - started:.2f}s in all; "
        f"{n} watchers woken in {done - timings['released']:.2f}s; "
        f"{crowd.rejoined} connection(s) closed before their welcome and made again"
    )


# -- dead and flaky clients --------------------------------------------------------------

AGENT = textwrap.dedent(
    """
    import sys, time
    from elastrun.store.tcp import TcpStore
    store = TcpStore("127.0.0.1", int(sys.argv[1]))
    lease = store.grant_lease(60)
    store.set("agents/child", b"alive", lease=lease)
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_the_keys_of_a_sigkilled_client_vanish_within_the_disconnect_grace(
    servers: list[Server], tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    agent = subprocess.Popen([PY, "-c", AGENT, str(server.port)], stdout=subprocess.PIPE, text=True)
    try:
        assert _read_line(agent, 20) == "ready\n"
        with client(server.port) as watcher:
            found, revision = watcher.get_prefix("agents/")
            assert found == {"agents/child": b"alive"}
            agent.kill()
            killed = time.monotonic()
            result = watcher.watch("agents/", revision, 10)
            gone = time.monotonic() - killed
            assert [(e.kind, e.key) for e in result.events] == [(EventKind.DELETE, "agents/child")]
    finally:
        agent.kill()
        agent.wait()
        assert agent.stdout is not None
        agent.stdout.close()
    # The lease TTL is 60 s; the dropped connection ends it after the 2 s grace.
    assert 1.5 <= gone < 4.0, gone
    print(f"dead client's keys gone after {gone:.2f}s")


def test_a_lease_survives_a_brief_reconnect(servers: list[Server], tmp_path: Path) -> None:
    server = start_server(servers, tmp_path, "--disconnect-grace", "1.0")
    with client(server.port) as agent, client(server.port) as observer:
        lease = agent.grant_lease(30)
        agent.set("agents/me", b"here", lease=lease)
        _, revision = observer.get_prefix("")
        connection = agent._dialer.current
        assert connection is not None
        connection.sock.shutdown(socket.SHUT_RDWR)  # the network drops under the client
        # Well past the grace: had the client not resumed its lease, the key would go.
        result = observer.watch("agents/", revision, 2.0)
        assert result.events == ()
        assert observer.get("agents/me") == b"here"
        assert agent._dialer.current is not connection  # it did reconnect
        assert agent.keep_alive(lease) is True
        agent.set("agents/me", b"still here", lease=lease)
        assert observer.get("agents/me") == b"still here"
    assert f"resumed leases [{lease}]" in server.log()


def test_a_watch_cut_off_by_a_dropped_connection_resumes_without_loss() -> None:
    server = TcpStoreServer("127.0.0.1", 0)
    server.start()
    try:
        with (
            TcpStore("127.0.0.1", server.port) as watcher,
            TcpStore("127.0.0.1", server.port) as writer,
        ):
            revision = writer.set("room/first", b"1")
            watcher.connect()
            results: list[WatchResult] = []
            thread = threading.Thread(
                target=lambda: results.append(watcher.watch("room/door", revision, 10))
            )
            connection = watcher._dialer.current
            assert connection is not None
            thread.start()
            time.sleep(0.2)  # the watch is in flight
            connection.sock.shutdown(socket.SHUT_RDWR)
            writer.set("room/door", b"open")  # possibly while the watcher reconnects
            thread.join(10)
            assert [(e.key, e.value) for e in results[0].events] == [("room/door", b"open")]
            assert watcher._dialer.current is not connection
    finally:
        server.stop()


def test_after_a_server_restart_the_client_says_so_clearly_and_recovers(
    servers: list[Server], tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    port = server.port
    with client(port, connect_timeout=1.0) as store:
        lease = store.grant_lease(30)
        revision = store.set("k", b"v", lease=lease)
        assert server.stop() == 0
        started = time.monotonic()
        with pytest.raises(StoreError, match=rf"cannot reach the store at 127\.0\.0\.1:{port}"):
            store.get("k")
        assert time.monotonic() - started < 5
        start_server(servers, tmp_path, port=port)
        assert store.get("k") is None  # a new server starts empty
        with client(port) as other:
            other.grant_lease(30)
            other.set("fresh", b"1")
        # Numbers from before the restart name nothing on the new server.
        assert store.keep_alive(lease) is False
        with pytest.raises(StoreCompactedError, match="re-read"):
            store.watch("", revision, 1.0)
        store.set("k", b"again")
        assert store.get("k") == b"again"


def test_an_unreachable_server_is_reported_after_the_connect_timeout() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound but not listening: connections are refused
        with client(port, connect_timeout=0.5) as store:
            started = time.monotonic()
            with pytest.raises(StoreError) as caught:
                store.get("k")
            elapsed = time.monotonic() - started
    assert str(caught.value).startswith(f"cannot reach the store at 127.0.0.1:{port}: ")
    assert 0.4 <= elapsed < 3


# -- requests cut off mid-flight ---------------------------------------------------------


class Hangup:
    """A fake server: it greets, reads one request, and hangs up without an answer."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[p.Message] = []
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                with conn:
                    buf = bytearray()
                    challenge = {
                        "type": "challenge",
                        "version": 1,
                        "nonce": p.b64(b"n" * 32),
                        "auth": False,
                        "max_frame": p.DEFAULT_MAX_FRAME,
                    }
                    conn.sendall(p.encode(challenge, p.DEFAULT_MAX_FRAME))
                    p.recv_frame(conn, p.DEFAULT_MAX_FRAME, buf)
                    welcome = {"type": "welcome", "version": 1, "resumed": [], "lost": []}
                    conn.sendall(p.encode(welcome, p.DEFAULT_MAX_FRAME))
                    self.requests.append(p.recv_frame(conn, p.DEFAULT_MAX_FRAME, buf))

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join()


@pytest.fixture
def hangup() -> Iterator[Hangup]:
    fake = Hangup()
    yield fake
    fake.close()


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.add("n", 1),
        lambda s: s.compare_set("k", None, b"v"),
        lambda s: s.delete("k"),
        lambda s: s.set("k", b"v", lease=7),
    ],
    ids=["add", "compare_set", "delete", "set_with_lease"],
)
def test_a_write_cut_off_mid_flight_is_not_retried_and_its_outcome_is_unknown(
    hangup: Hangup, call: object
) -> None:
    with (
        client(hangup.port, connect_timeout=2) as store,
        pytest.raises(StoreError, match="may or may not have been applied"),
    ):
        call(store)  # type: ignore[operator]  # a parametrized lambda, typed object
    assert len(hangup.requests) == 1


def test_a_read_cut_off_mid_flight_is_retried(hangup: Hangup) -> None:
    with (
        client(hangup.port, connect_timeout=2) as store,
        pytest.raises(StoreError, match="keeps dropping"),
    ):
        store.get("k")
    assert [r["op"] for r in hangup.requests] == ["get"] * 4


# -- addresses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "reachable_as"),
    [("::1", ["::1"]), ("localhost", ["127.0.0.1", "::1", "localhost"])],
)
def test_the_server_listens_on_every_loopback_its_host_names(
    host: str, reachable_as: list[str]
) -> None:
    server = TcpStoreServer(host, 0)
    server.start()
    try:
        for name in reachable_as:
            with TcpStore(name, server.port, connect_timeout=2) as store:
                store.add("visits", 1)
        with TcpStore(reachable_as[0], server.port) as store:
            assert store.get("visits") == str(len(reachable_as)).encode()
    finally:
        server.stop()


def test_closing_a_client_cuts_its_connection_and_joins_every_reader_it_started() -> None:
    server = TcpStoreServer("127.0.0.1", 0)
    server.start()

    def readers() -> list[str]:  # (this server's: by its port)
        return [t.name for t in threading.enumerate() if t.name.endswith(f":{server.port}")]

    try:
        store = TcpStore("127.0.0.1", server.port)
        lease = store.grant_lease(30.0)  # a client with a lease reconnects at once
        store.set("held", b"1", lease=lease)
        first = store._dialer.current
        assert first is not None
        first.abort()  # lost: its reader dials the next connection
        deadline = time.monotonic() + 10
        while store._dialer.current is first and time.monotonic() < deadline:
            time.sleep(0.01)
        second = store._dialer.current
        assert second is not None and second is not first
        assert readers() != []
        store.close()
        assert [c.reading for c in (first, second)] == [False, False] and not second.alive
        assert readers() == []
    finally:
        server.stop()
