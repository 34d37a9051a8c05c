"""The etcd store beyond the shared contract: failover, leader loss, watch resume across a
dead member, answers lost in flight, authentication, TLS and namespaces."""

from __future__ import annotations

import http.client
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from etcd_cluster import EtcdCluster, TlsFiles, closed_port

from _helpers import freeze
from elastrun.core.errors import ConfigError, StoreAuthError, StoreError
from elastrun.store.api import EventKind
from elastrun.store.etcd import EtcdStore, parse_endpoints, prefix_end, tls_context

# -- pure helpers ------------------------------------------------------------------------


def test_endpoints_accept_host_port_lists_urls_and_ipv6() -> None:
    assert parse_endpoints("h1:2379, h2:2380,h3") == (
        "http://h1:2379",
        "http://h2:2380",
        "http://h3:2379",
    )
    assert parse_endpoints(["https://h:1", "[::1]:5", "::1"]) == (
        "https://h:1",
        "http://[::1]:5",
        "http://[::1]:2379",
    )
    assert parse_endpoints("h", secure=True) == ("https://h:2379",)


@pytest.mark.parametrize("bad", ["", " , ", "h:port", "h:70000", "ftp://h:1", ":2379"])
def test_bad_endpoints_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_endpoints(bad)


def test_prefix_end_is_the_first_key_after_the_prefix() -> None:
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"") == b"\0"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_unreadable_tls_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cacert"):
        tls_context(str(tmp_path / "missing.pem"), None, None)
    with pytest.raises(ConfigError, match="certificate"):
        tls_context(None, None, str(tmp_path / "client.key"))


# -- helpers -----------------------------------------------------------------------------


class LosingProxy:
    """Passes requests on to an etcd member. For the paths in ``lose`` it then hangs up
    without the answer: the request takes effect, and its sender cannot know."""

    def __init__(self, target: str, lose: set[str]) -> None:
        self.target = target
        self.lose = lose
        self.paths: list[str] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with conn:
                self._relay(conn)

    def _relay(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        while len(body) < int(headers.get("content-length", "0")):
            body += conn.recv(65536)
        path = lines[0].split(" ")[1]
        self.paths.append(path)
        host, port = self.target.split(":")
        upstream = http.client.HTTPConnection(host, int(port), timeout=10)
        upstream.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        reply = upstream.getresponse()
        answer = reply.read()
        upstream.close()
        if path in self.lose:
            return  # hang up: the answer is lost
        conn.sendall(
            f"HTTP/1.1 {reply.status} {reply.reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(answer)}\r\nConnection: close\r\n\r\n".encode()
            + answer
        )

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        self._thread.join(timeout=5)


@pytest.fixture
def losing_proxy(etcd: EtcdCluster) -> Iterator[Callable[[set[str]], LosingProxy]]:
    proxies: list[LosingProxy] = []

    def make(lose: set[str]) -> LosingProxy:
        proxies.append(LosingProxy(etcd.endpoints[0], lose))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.close()


@pytest.fixture
def clients() -> Iterator[Callable[..., EtcdStore]]:
    made: list[EtcdStore] = []

    def make(endpoints: list[str], **kwargs: object) -> EtcdStore:
        store = EtcdStore(endpoints, **kwargs)  # type: ignore[arg-type]  # kwargs: object
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


# -- reachability and failover -----------------------------------------------------------


def test_an_unreachable_etcd_fails_within_the_request_timeout_in_one_line(
    clients: Callable[..., EtcdStore],
) -> None:
    ports = [closed_port(), closed_port()]
    store = clients([f"127.0.0.1:{p}" for p in ports], request_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(StoreError) as info:
        store.get("k")
    assert time.monotonic() - started < 3.0
    message = str(info.value)
    assert "\n" not in message
    assert "cannot reach etcd" in message and "connection refused" in message
    assert all(str(p) in message for p in ports)


def test_a_client_moves_past_a_dead_endpoint_and_sticks_to_the_live_one(
    etcd: EtcdCluster, clients: Callable[..., EtcdStore]
) -> None:
    dead = f"127.0.0.1:{closed_port()}"
    store = clients([dead, etcd.endpoints[0]])
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert f"using='http://{etcd.endpoints[0]}'" in repr(store)


def test_a_client_given_every_member_carries_on_when_the_member_it_uses_dies(
    etcd3: EtcdCluster, clients: Callable[..., EtcdStore]
) -> None:
    leader = etcd3.leader()
    follower = next(m for m in etcd3.members if m is not leader)
    others = [m.endpoint for m in etcd3.members if m is not follower]
    store = clients([follower.endpoint, *others])
    lease = store.grant_lease(5)
    store.set("members/me", b"1", lease=lease)
    etcd3.kill(follower)
    assert store.keep_alive(lease) is True
    store.set("after", b"2")
    assert store.get_prefix("")[0] == {"members/me": b"1", "after": b"2"}
    assert follower.endpoint not in repr(store).split("using=")[1]


def test_the_store_carries_on_when_the_leader_dies_and_keeps_its_leases(
    etcd3: EtcdCluster, clients: Callable[..., EtcdStore]
) -> None:
    leader = etcd3.leader()
    store = clients([leader.endpoint, *(m.endpoint for m in etcd3.members if m is not leader)])
    lease = store.grant_lease(3)
    store.set("members/me", b"1", lease=lease)
    etcd3.kill(leader)
    started = time.monotonic()
    # Safe calls (keep-alives, reads) ride out the election by themselves.
    assert store.keep_alive(lease) is True
    assert store.get("members/me") == b"1"
    assert etcd3.leader() is not leader
    store.set("after", b"2")
    assert time.monotonic() - started < 8.0
    # The lease outlived the election and is still kept alive past its TTL.
    for _ in range(8):
        assert store.keep_alive(lease) is True
        time.sleep(0.5)
    assert store.get("members/me") == b"1"


def test_a_watch_resumes_on_another_member_without_losing_or_repeating_events(
    etcd3: EtcdCluster, clients: Callable[..., EtcdStore]
) -> None:
    leader = etcd3.leader()
    victim, spare = (m for m in etcd3.members if m is not leader)
    writer = clients([leader.endpoint])
    watcher = clients([victim.endpoint, spare.endpoint, leader.endpoint])
    total = 60
    start = writer.get_prefix("")[1]

    def write() -> None:
        for i in range(total):
            writer.set(f"w/{i:03d}", str(i).encode())
            if i == total // 2:
                etcd3.kill(victim)  # while the watcher streams from it
            time.sleep(0.01)

    thread = threading.Thread(target=write)
    thread.start()
    seen: list[str] = []
    revision = start
    deadline = time.monotonic() + 30
    while len(seen) < total and time.monotonic() < deadline:
        result = watcher.watch("w/", revision, 1.0)
        assert all(e.kind is EventKind.PUT for e in result.events)
        seen.extend(e.key for e in result.events)
        revision = result.revision
    thread.join()
    assert not victim.alive
    assert seen == [f"w/{i:03d}" for i in range(total)]


def test_a_client_moves_away_from_a_member_that_hangs(
    etcd3: EtcdCluster, clients: Callable[..., EtcdStore]
) -> None:
    leader = etcd3.leader()
    hung = next(m for m in etcd3.members if m is not leader)
    others = [m.endpoint for m in etcd3.members if m is not hung]
    store = clients([hung.endpoint, *others])
    lease = store.grant_lease(5)
    revision = store.set("k", b"1", lease=lease)
    assert hung.proc is not None
    freeze(hung.proc.pid)  # a machine gone silent: no refusal, no answer
    try:
        started = time.monotonic()
        assert store.keep_alive(lease) is True  # its pooled connection hangs: next member
        # Well within the keep-alive interval of the default 15 s lease.
        assert time.monotonic() - started < 3.0
        watcher = clients([hung.endpoint, *others])  # a fresh connection to it hangs too
        store.set("k", b"2")
        events = watcher.watch("k", revision, 1.0).events
        assert [e.value for e in events] == [b"2"]
    finally:
        hung.proc.send_signal(signal.SIGCONT)


def test_a_member_without_a_leader_refuses_at_once_instead_of_hanging(
    etcd3: EtcdCluster, clients: Callable[..., EtcdStore]
) -> None:
    survivor, *gone = etcd3.members
    for m in gone:
        etcd3.kill(m)
    deadline = time.monotonic() + 10
    while etcd3.status(survivor).get("leader") not in (None, "0"):  # it noticed
        assert time.monotonic() < deadline
        time.sleep(0.05)
    store = clients([survivor.endpoint], request_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(StoreError, match="no leader"):
        store.set("k", b"v")
    assert time.monotonic() - started < 4.0


# -- answers lost in flight --------------------------------------------------------------


WRITES = {"/v3/kv/put", "/v3/kv/txn", "/v3/kv/deleterange"}


def test_a_write_whose_answer_is_lost_is_not_repeated(
    etcd: EtcdCluster,
    losing_proxy: Callable[[set[str]], LosingProxy],
    clients: Callable[..., EtcdStore],
) -> None:
    direct = clients(etcd.endpoints)
    before = direct.get_prefix("")[1]
    proxy = losing_proxy(WRITES)
    store = clients([proxy.endpoint, *etcd.endpoints])
    writes: list[Callable[[], object]] = [
        lambda: store.set("k", b"v"),
        lambda: store.compare_set("c", None, b"1"),
        lambda: store.add("n", 1),
        lambda: store.delete("k"),
    ]
    for write in writes:
        with pytest.raises(StoreError, match="outcome unknown") as info:
            write()
        assert "\n" not in str(info.value)
    # Each write reached etcd exactly once, through the proxy, and was never repeated.
    assert [p for p in proxy.paths if p in WRITES] == [
        "/v3/kv/put", "/v3/kv/txn", "/v3/kv/txn", "/v3/kv/deleterange",
    ]  # fmt: skip
    assert direct.get_prefix("")[1] == before + 4
    assert direct.get_prefix("")[0] == {"c": b"1", "n": b"1"}


def test_reads_and_lease_grants_whose_answers_are_lost_are_repeated_elsewhere(
    etcd: EtcdCluster,
    losing_proxy: Callable[[set[str]], LosingProxy],
    clients: Callable[..., EtcdStore],
) -> None:
    clients(etcd.endpoints).set("k", b"v")
    proxy = losing_proxy({"/v3/kv/range", "/v3/lease/grant"})
    assert clients([proxy.endpoint, *etcd.endpoints]).get("k") == b"v"
    store = clients([proxy.endpoint, *etcd.endpoints])
    lease = store.grant_lease(30)  # granted through the proxy, confirmed by the retry
    assert proxy.paths == ["/v3/kv/range", "/v3/lease/grant"]
    store.set("leased", b"1", lease=lease)
    store.revoke_lease(lease)
    assert store.get("leased") is None


# -- namespaces, authentication, TLS -----------------------------------------------------


def test_namespaces_keep_users_of_one_cluster_apart(
    etcd: EtcdCluster, clients: Callable[..., EtcdStore]
) -> None:
    a = clients(etcd.endpoints, namespace="/team-a")
    b = clients(etcd.endpoints, namespace="/team-b")
    raw = clients(etcd.endpoints)
    start = a.set("/elastrun/job/x", b"1")
    b.set("/elastrun/job/x", b"2")
    assert a.get_prefix("/elastrun/")[0] == {"/elastrun/job/x": b"1"}
    assert b.get("/elastrun/job/x") == b"2"
    assert raw.get_prefix("")[0] == {
        "/team-a/elastrun/job/x": b"1",
        "/team-b/elastrun/job/x": b"2",
    }
    events = a.watch("", start - 1, 1.0).events
    assert [(e.key, e.value) for e in events] == [("/elastrun/job/x", b"1")]


def test_authentication_with_a_password_and_refusals_in_one_line(
    make_cluster: Callable[..., EtcdCluster], clients: Callable[..., EtcdStore]
) -> None:
    cluster = make_cluster(1)
    cluster.enable_auth("s3cret")
    good = clients(cluster.endpoints, username="root", password="s3cret")
    good.set("k", b"v")
    assert good.get("k") == b"v"
    for kwargs in ({"username": "root", "password": "wrong"}, {}):
        with pytest.raises(StoreAuthError) as info:
            clients(cluster.endpoints, **kwargs).get("k")
        assert "\n" not in str(info.value)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl tool")
def test_tls_with_client_certificates(
    etcd_binary: str, tmp_path: Path, clients: Callable[..., EtcdStore]
) -> None:
    files = TlsFiles.create(tmp_path / "tls")
    cluster = EtcdCluster(etcd_binary, tmp_path / "etcd", 1, tls=files).start()
    try:
        context = tls_context(str(files.ca), str(files.client_cert), str(files.client_key))
        store = clients(cluster.endpoints, ssl_context=context)
        store.set("k", b"v")
        assert store.get("k") == b"v"
        no_cert = clients(
            cluster.endpoints, ssl_context=tls_context(str(files.ca), None, None),
            request_timeout=1.0,
        )  # fmt: skip
        with pytest.raises(StoreError):
            no_cert.get("k")
    finally:
        cluster.stop()
