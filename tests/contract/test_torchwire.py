"""torch's own TCPStore client against TorchWireServer, with torch's server as the oracle.

Each scenario runs twice -- once against a master ``torch.distributed.TCPStore`` (the
oracle), once against our server -- and both runs must observe the same results.
Byte-level scenarios (a wait released just before its cancellation, a queue push
releasing one waiter, a two-party barrier) drive both servers with raw sockets.

Our server runs in a child process here: torch's client holds the GIL during some
calls (``queue_len``, ``queue_pop``, ``list_keys``, ``barrier``), which would starve a
server thread in the same interpreter. (The agent hosting it never calls torch.)
Tests of the server object itself (lifecycle, limits, misbehaving peers, a thousand
clients) use raw sockets and run it in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import json
import os
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypedDict, TypeVar

import pytest

from elastrun.core.errors import ConfigError, StoreError
from elastrun.store.tcp.protocol import tune_socket
from elastrun.store.torchwire import TorchWireServer
from elastrun.store.torchwire import codec as c
from elastrun.store.torchwire.codec import Op, Request
from elastrun.store.torchwire.engine import compiled_engine_available
from elastrun.store.torchwire.limits import (
    DEFAULT_MAX_CONNECTIONS,
    LISTENER_OPTIONS_INHERITED,
)

TIMEOUT = timedelta(seconds=5)


def _u64(number: int) -> bytes:
    return struct.pack("<Q", number)


_SERVER = textwrap.dedent(
    """
    import asyncio, json, sys
    from elastrun.store.torchwire import TorchWireServer
    options = json.loads(sys.argv[1])
    loop = options.pop("loop")
    if loop == "uvloop":
        import uvloop
        factory = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop
    engine = "compiled" if loop == "compiled" else "python"
    server = TorchWireServer("127.0.0.1", 0, loop_factory=factory, engine=engine, **options)
    print(server.start(), flush=True)
    for line in sys.stdin:
        print(server.num_connections, flush=True)
    server.close()
    """
)


class WireProcess:
    """TorchWireServer in a child process; a line on its stdin asks for its connections."""

    def __init__(self, loop: str, **options: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps({"loop": loop, **options})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = int(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 10)
        assert ready, "the server process did not answer"
        return self.proc.stdout.readline()

    def connections(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return int(self._line())

    def stop(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc.stdout.close()
        return code


def wait_for_connections(wire: WireProcess, expected: int) -> int:
    deadline = time.monotonic() + 5
    while (got := wire.connections()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


@pytest.fixture(scope="session")
def dist() -> Any:
    """torch.distributed, warmed up: the first master TCPStore of a process opens a
    pipe that libuv keeps for the life of the process; open it before any test's
    descriptor accounting starts."""
    module = pytest.importorskip("torch.distributed")
    warm = module.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    del warm
    gc.collect()
    return module


_UVLOOP = pytest.mark.skipif(
    importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
)


_COMPILED = pytest.mark.skipif(
    not compiled_engine_available(), reason="the compiled engine was not built"
)


@pytest.fixture(
    params=[
        "asyncio",
        pytest.param("uvloop", marks=_UVLOOP),
        pytest.param("compiled", marks=_COMPILED),
    ]
)
def loop_name(request: pytest.FixtureRequest) -> str:
    """What serves: the Python engine on either loop it may be given, or the compiled
    engine."""
    name: str = request.param
    return name


def new_server(
    name: str, host: str = "127.0.0.1", max_connections: int = DEFAULT_MAX_CONNECTIONS
) -> TorchWireServer:
    """A server on the engine (and loop) ``name`` names, not started."""
    engine = "compiled" if name == "compiled" else "python"
    return TorchWireServer(
        host,
        max_connections=max_connections,
        loop_factory=loop_factory(name),
        engine=engine,
    )


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


@pytest.fixture
def wire_factory(loop_name: str) -> Iterator[Callable[..., WireProcess]]:
    started: list[WireProcess] = []

    def start(**options: int) -> WireProcess:
        started.append(WireProcess(loop_name, **options))
        return started[-1]

    yield start
    codes = [w.stop() for w in started]
    assert codes == [0] * len(codes), f"server processes exited with {codes}"


@pytest.fixture
def wire(wire_factory: Callable[..., WireProcess]) -> WireProcess:
    return wire_factory()


@pytest.fixture
def ports(dist: Any, wire: WireProcess) -> Iterator[dict[str, int]]:
    """The oracle's port and ours, by name."""
    oracle = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    yield {"torch": oracle.port, "ours": wire.port}
    del oracle
    gc.collect()


T = TypeVar("T")


def same_on_both(ports: dict[str, int], scenario: Callable[[int], T]) -> T:
    """Run ``scenario`` against both servers; assert equal observations; return ours."""
    seen = {name: scenario(port) for name, port in ports.items()}
    assert seen["ours"] == seen["torch"]
    return seen["ours"]


def client(dist: Any, port: int, **options: object) -> Any:
    """A torch TCPStore client (never a master) of the server on ``port``."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT, **options)


def error_name(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return "no error"


# -- operations through torch's client -----------------------------------------------------


@pytest.mark.torch
def test_every_key_operation_answers_as_torchs_own_server(dist: Any, ports: dict[str, int]) -> None:
    def scenario(port: int) -> list[object]:
        s = client(dist, port)
        out: list[object] = []
        s.set("k", b"v1")
        s.set("empty", b"")
        out += [s.get("k"), s.get("empty"), s.check(["k", "empty"]), s.check(["k", "nope"])]
        out += [s.add("n", 5), s.add("n", -7), s.get("n"), s.add("fresh", 0)]
        s.set("ws", " 12abc")
        s.set("max", str(2**63 - 1))
        out += [s.add("ws", 1), s.add("max", 1)]
        out += [
            s.compare_set("cs1", "", "new"),  # missing key, empty expected: created
            s.compare_set("cs2", "exp", "new"),  # missing key, other expected: not created
            s.check(["cs2"]),
            s.compare_set("cs1", "new", "newer"),  # match: replaced
            s.compare_set("cs1", "wrong", "x"),  # mismatch: current value answered
            s.get("cs1"),
        ]
        out += [s.num_keys(), s.delete_key("n"), s.delete_key("n"), s.num_keys()]
        s.append("ap", b"x")
        s.append("ap", b"yz")
        s.multi_set(["m1", "m2"], ["1", "2"])
        out += [s.get("ap"), s.multi_get(["m1", "m2", "k"]), sorted(s.list_keys())]
        blob = bytes(range(256)) * 4096
        s.set("blob", blob)
        out += [s.get("blob") == blob, s.num_keys()]
        return out

    out = same_on_both(ports, scenario)
    assert out[:4] == [b"v1", b"", True, False]
    assert out[4:10] == [5, -2, b"-2", 0, 13, -(2**63)]
    assert out[10:16] == [b"new", b"exp", False, b"newer", b"newer", b"newer"]


@pytest.mark.torch
def test_a_timed_out_wait_raises_torchs_error_and_the_connection_stays_usable(
    dist: Any, ports: dict[str, int]
) -> None:
    def scenario(port: int) -> list[object]:
        s = client(dist, port)
        started = time.monotonic()
        try:
            s.wait(["missing"], timedelta(milliseconds=200))
            outcome = "returned"
        except dist.DistStoreError as exc:
            outcome = str(exc).split(" after")[0]
        waited = time.monotonic() - started
        s.set_timeout(timedelta(milliseconds=200))
        get_error = error_name(lambda: s.get("also-missing"))
        s.set("after", b"ok")
        return [outcome, 0.15 < waited < 2, get_error, s.get("after"), s.check(["missing"])]

    assert same_on_both(ports, scenario) == [
        "wait timeout",
        True,
        "DistStoreError",
        b"ok",
        False,
    ]


@pytest.mark.torch
def test_get_waits_for_a_key_another_client_sets_later(dist: Any, ports: dict[str, int]) -> None:
    def scenario(port: int) -> list[object]:
        reader = client(dist, port)
        writer = client(dist, port)
        timer = threading.Timer(0.2, lambda: writer.set("late", b"here"))
        started = time.monotonic()
        timer.start()
        value = reader.get("late")
        timer.join()
        return [value, time.monotonic() - started > 0.15]

    assert same_on_both(ports, scenario) == [b"here", True]


@pytest.mark.torch
def test_several_clients_at_once_count_wait_and_see_each_other(
    dist: Any, ports: dict[str, int]
) -> None:
    n, adds = 8, 25

    def scenario(port: int) -> list[object]:
        errors: list[BaseException] = []
        seen: list[list[bytes]] = []

        def worker(i: int) -> None:
            try:
                s = client(dist, port)
                for _ in range(adds):
                    s.add("ctr", 1)
                s.set(f"own{i}", str(i))
                s.wait(["go"])
                seen.append(s.multi_get([f"own{j}" for j in range(n)]))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        main = client(dist, port)
        main.wait([f"own{i}" for i in range(n)])
        main.set("go", b"")
        for t in threads:
            t.join(10)
        return [errors, main.add("ctr", 0), seen]

    errors, total, seen = same_on_both(ports, scenario)
    assert errors == [] and total == n * adds
    assert seen == [[str(j).encode() for j in range(n)]] * n


@pytest.mark.torch
def test_prefix_stores_on_top_behave_as_on_torchs_server(dist: Any, ports: dict[str, int]) -> None:
    def scenario(port: int) -> list[object]:
        base = client(dist, port)
        job = dist.PrefixStore("job", base)
        nested = dist.PrefixStore("inner", job)
        other = dist.PrefixStore("other", base)
        job.set("k", "1")
        nested.set("k", "2")
        job.wait(["k"])
        job.multi_set(["a", "b"], ["x", "y"])
        return [
            job.get("k"),
            nested.get("k"),
            job.add("c", 2),
            job.compare_set("k", "1", "3"),
            job.check(["k"]),
            other.check(["k"]),
            job.multi_get(["a", "b"]),
            job.delete_key("c"),
            base.num_keys(),
            sorted(base.list_keys()),
            error_name(lambda: other.wait(["k"], timedelta(milliseconds=100))),
        ]

    out = same_on_both(ports, scenario)
    assert out[:3] == [b"1", b"2", 2]


@pytest.mark.torch
def test_clients_with_a_world_size_count_themselves_in_like_on_torchs_server(
    dist: Any, ports: dict[str, int]
) -> None:
    def scenario(port: int) -> list[object]:
        clients = [client(dist, port, world_size=3) for _ in range(3)]
        with RawClient(port) as raw:
            count = raw.ask(Request(Op.GET, (b"init/",)), 8 + 1)
        return [clients[0].num_keys(), count]

    assert same_on_both(ports, scenario) == [1, c.encode_bytes(b"3")]


@pytest.mark.torch
def test_queues_push_pop_and_time_out_like_on_torchs_server(
    dist: Any, ports: dict[str, int]
) -> None:
    def scenario(port: int) -> list[object]:
        s = client(dist, port)
        s.queue_push("q", b"1")
        s.queue_push("q", b"2")
        out: list[object] = [s.queue_len("q"), s.queue_pop("q", False), s.check(["q"])]
        out += [s.queue_pop("q"), s.queue_len("q"), s.check(["q"]), s.num_keys()]
        out.append(error_name(lambda: s.queue_pop("q", False)))
        s.set_timeout(timedelta(milliseconds=200))
        out.append(error_name(lambda: s.queue_pop("q")))  # blocks, then gives up
        s.queue_push("q", b"3")
        out.append(s.queue_pop("q"))
        return out

    assert same_on_both(ports, scenario) == [
        2,
        b"1",
        True,
        b"2",
        0,
        False,
        0,
        "QueueEmptyError",
        "DistStoreError",
        b"3",
    ]


@pytest.mark.torch
def test_barriers_pass_and_time_out_like_on_torchs_server(dist: Any, ports: dict[str, int]) -> None:
    def scenario(port: int) -> list[object]:
        s = client(dist, port)
        s.barrier("solo", 1)
        late = error_name(lambda: s.barrier("pair", 2, timedelta(milliseconds=200)))
        s.barrier("pair", 2)  # the timed-out arrival counted
        return [late, s.get("solo"), s.get("pair")]

    assert same_on_both(ports, scenario) == ["DistStoreError", b"1", b"2"]


@pytest.mark.torch
def test_add_on_a_non_number_drops_only_that_client_like_torchs_server(
    dist: Any, ports: dict[str, int]
) -> None:
    def scenario(port: int) -> list[object]:
        victim = client(dist, port)
        bystander = client(dist, port)
        victim.set("word", "abc")
        failed = error_name(lambda: victim.add("word", 1))
        return [failed, bystander.get("word"), bystander.add("n", 1)]

    assert same_on_both(ports, scenario) == ["DistNetworkError", b"abc", 1]


# -- byte-level scenarios on both servers --------------------------------------------------


class RawClient:
    """A validated connection speaking the protocol byte by byte."""

    def __init__(self, port: int, host: str = "127.0.0.1", validate: bool = True) -> None:
        self.sock = socket.create_connection((host, port), timeout=5)
        self._nonce = 1000
        if validate:
            self.send(Request(Op.VALIDATE, number=c.MAGIC))

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, *requests: Request) -> None:
        self.sock.sendall(c.encode_requests(requests))

    def recv(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                break
            data += chunk
        return data

    def ask(self, request: Request, answer_size: int) -> bytes:
        self.send(request)
        return self.recv(answer_size)

    def sync(self) -> bytes:
        """Ping; returns whatever arrived before the pong (the pong itself removed).

        Answers come in order, so anything the server sent earlier precedes the pong.
        """
        self._nonce += 1
        pong = c.encode_u32(self._nonce)
        self.send(Request(Op.PING, number=self._nonce))
        data = b""
        while not data.endswith(pong):
            chunk = self.sock.recv(4096)
            assert chunk, "the server closed the connection"
            data += chunk
        return data[: -len(pong)]

    def closed_by_server(self, timeout: float = 5.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
        return True


def raw_scenarios(port: int) -> dict[str, bytes]:
    seen: dict[str, bytes] = {}
    with RawClient(port) as a, RawClient(port) as b, RawClient(port) as d:
        # A wait released just before the client's cancellation: both answers arrive.
        a.send(Request(Op.WAIT, (b"/x",)))
        b.send(Request(Op.SET, (b"/x",), (b"1",)))
        b.sync()
        a.send(Request(Op.CANCEL_WAIT))
        seen["released-then-cancelled"] = a.recv(2)
        # A cancelled wait is forgotten: a later set sends it nothing.
        a.send(Request(Op.WAIT, (b"/y",)), Request(Op.CANCEL_WAIT))
        seen["cancelled"] = a.recv(1)
        b.send(Request(Op.SET, (b"/y",), (b"1",)))
        b.sync()
        seen["after-cancel"] = a.sync()
        # A blocking queue pop (the client's wait, then pop); one push wakes one waiter.
        a.send(Request(Op.WAIT, (b"/q",)))
        d.send(Request(Op.WAIT, (b"/q",)))
        a.sync()
        d.sync()
        b.send(Request(Op.QUEUE_PUSH, (b"/q",), (b"item",)))
        b.sync()
        seen["push-first"] = a.sync() + b"|" + d.sync()
        seen["pop"] = a.ask(Request(Op.QUEUE_POP, (b"/q",)), 8 + 8 + 4)
        b.send(Request(Op.QUEUE_PUSH, (b"/q",), (b"two",)))
        b.sync()
        seen["push-second"] = d.sync()
        seen["pop-empty"] = b.ask(Request(Op.QUEUE_POP, (b"/none",)), 8)
        # A two-party barrier: the second arrival releases the first.
        a.send(Request(Op.BARRIER, (b"/bar",), number=2))
        seen["barrier-first"] = a.sync()
        b.send(Request(Op.BARRIER, (b"/bar",), number=2))
        seen["barrier-both"] = b.recv(1) + b"|" + a.recv(1)
        # Answers of the other commands, byte for byte.
        seen["check"] = a.ask(Request(Op.CHECK, (b"/x", b"/nope")), 1)
        seen["multi_get"] = a.ask(Request(Op.MULTI_GET, (b"/x", b"/nope")), 2 * 8 + 1)
        seen["num_keys"] = a.ask(Request(Op.GETNUMKEYS), 8)
        seen["delete"] = a.ask(Request(Op.DELETE_KEY, (b"/x",)), 8)
        seen["queue_len"] = a.ask(Request(Op.QUEUE_LEN, (b"/q",)), 8)
    return seen


@pytest.mark.torch
def test_raw_byte_sequences_match_torchs_server(ports: dict[str, int]) -> None:
    seen = same_on_both(ports, raw_scenarios)
    assert seen == {
        "released-then-cancelled": b"\x00\x01",
        "cancelled": b"\x01",
        "after-cancel": b"",
        "push-first": b"\x00|",
        "pop": c.encode_queue_pop(1, b"item"),
        "push-second": b"\x00",
        "pop-empty": c.encode_i64(0),
        "barrier-first": b"",
        "barrier-both": b"\x00|\x00",
        "check": b"\x01",
        "multi_get": c.encode_bytes(b"1") + c.encode_bytes(b""),
        "num_keys": c.encode_i64(3),  # /x, /y, /bar
        "delete": c.encode_i64(1),
        "queue_len": c.encode_i64(1),
    }


# -- limits and misbehaving clients --------------------------------------------------------


@pytest.mark.torch
def test_misbehaving_clients_lose_only_their_own_connection(
    dist: Any, wire_factory: Callable[..., WireProcess]
) -> None:
    wire = wire_factory(max_frame=1 << 20, max_key=1024)
    good = client(dist, wire.port)
    result: list[object] = []
    waiting = threading.Thread(target=lambda: result.append(good.get("later")))
    waiting.start()
    set_header = bytes((Op.SET,)) + c.encode_bytes(b"/k")
    bad = {
        "garbage": (False, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
        "bad magic": (False, bytes((Op.VALIDATE,)) + c.encode_u32(0xDEADBEEF)),
        "no validation": (False, c.encode_request(Request(Op.GETNUMKEYS))),
        "unknown command": (True, b"\x63"),
        "validated twice": (True, c.encode_request(Request(Op.VALIDATE, number=c.MAGIC))),
        "oversized value": (True, set_header + _u64(2 << 20)),
        "oversized key": (True, bytes((Op.GET,)) + _u64(4096)),
        "too many keys": (True, bytes((Op.WAIT,)) + _u64(1 << 40)),
        "second wait": (True, c.encode_requests([Request(Op.WAIT, (b"/a",))] * 2)),
    }
    for name, (validate, payload) in bad.items():
        with RawClient(wire.port, validate=validate) as raw:
            raw.sock.sendall(payload)
            assert raw.closed_by_server(), f"{name}: the server kept the connection"
    # Half a request, then the client vanishes (both a close and a reset).
    for linger in (False, True):
        half = RawClient(wire.port)
        half.sock.sendall(set_header + _u64(100) + b"partial")
        if linger:  # close with RST instead of FIN
            half.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        half.sock.close()
    other = client(dist, wire.port)
    other.set("later", b"still here")
    waiting.join(10)
    assert result == [b"still here"]
    assert good.add("n", 1) == 1
    assert wait_for_connections(wire, 2) == 2


@pytest.mark.torch
def test_values_beyond_torchs_own_8_mib_limit_are_served(dist: Any, wire: WireProcess) -> None:
    s = client(dist, wire.port)
    big = os.urandom(9 << 20)
    s.set("big", big)
    assert s.get("big") == big


@pytest.mark.torch
def test_a_value_over_the_configured_limit_drops_that_client_only(
    dist: Any, wire_factory: Callable[..., WireProcess]
) -> None:
    wire = wire_factory(max_frame=1 << 20)
    sender = client(dist, wire.port)
    bystander = client(dist, wire.port)
    sender.set("fits", b"x" * (1 << 19))
    with contextlib.suppress(Exception):  # fire and forget: the next call notices
        sender.set("huge", b"x" * (2 << 20))
    assert error_name(lambda: sender.get("fits")) == "DistNetworkError"
    assert bystander.get("fits") == b"x" * (1 << 19)
    assert not bystander.check(["huge"])


# -- the server object, in this process ----------------------------------------------------


@pytest.fixture
def server(loop_name: str) -> Iterator[TorchWireServer]:
    s = new_server(loop_name)
    yield s
    s.close()


def test_start_returns_a_port_that_accepts_at_once_and_repr_shows_state(
    server: TorchWireServer,
) -> None:
    assert "new" in repr(server)
    port = server.start()
    assert port == server.port and server.host == "127.0.0.1"
    with RawClient(port) as raw:
        raw.send(Request(Op.SET, (b"/a",), (b"1",)))
        raw.sync()
        assert repr(server) == f"TorchWireServer(127.0.0.1:{port}, serving, keys=1, connections=1)"
    server.close()
    server.close()  # idempotent
    assert "closed" in repr(server) and server.num_connections == 0


def test_close_drops_every_connection_and_waiter_and_ends_the_thread(loop_name: str) -> None:
    server = new_server(loop_name)
    port = server.start()
    clients = [RawClient(port) for _ in range(5)]
    for raw in clients:
        raw.send(Request(Op.WAIT, (b"/never",)))
        raw.sync()
    threads = set(threading.enumerate())
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < 2
    assert all(raw.closed_by_server() for raw in clients)
    for raw in clients:
        raw.sock.close()
    assert not [t for t in threads if t.name.startswith("elastrun-torchwire") and t.is_alive()]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_close_before_start_is_harmless_and_start_after_close_refuses(loop_name: str) -> None:
    server = new_server(loop_name)
    server.close()
    with pytest.raises(StoreError):
        server.start()
    with pytest.raises(StoreError, match="not listening"):
        server.port  # noqa: B018


def test_a_close_while_start_binds_serves_nothing_and_leaves_nothing_open() -> None:
    # (The Python engine: its loop factory runs in start(), after the start is claimed.)
    made: list[TorchWireServer] = []

    def closing_first() -> asyncio.AbstractEventLoop:
        made[0].close()  # from another thread in life; here, between claim and bind
        return asyncio.new_event_loop()

    server = TorchWireServer("127.0.0.1", 0, loop_factory=closing_first, engine="python")
    made.append(server)
    threads = set(threading.enumerate())
    port = server.start()  # binds, then ends what it made at once
    assert repr(server).startswith(f"TorchWireServer(127.0.0.1:{port}, closed")
    assert not [t for t in set(threading.enumerate()) - threads if t.name.startswith("elastrun")]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    server.close()  # idempotent


def test_starting_twice_is_refused(server: TorchWireServer) -> None:
    server.start()
    with pytest.raises(StoreError, match="already started"):
        server.start()


def test_a_taken_port_is_a_store_error_naming_the_address(server: TorchWireServer) -> None:
    port = server.start()
    other = TorchWireServer("127.0.0.1", port)
    with pytest.raises(StoreError, match=f"cannot listen on 127.0.0.1:{port}"):
        other.start()
    other.close()


class _ServerArgs(TypedDict, total=False):
    port: int
    max_connections: int
    max_frame: int
    max_key: int


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"port": 70000}, "port"),
        ({"max_connections": 0}, "max_connections"),
        ({"max_frame": 10}, "max_frame"),
        ({"max_key": 0}, "max_key"),
    ],
)
def test_bad_arguments_are_config_errors_naming_the_field(kwargs: _ServerArgs, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        TorchWireServer("127.0.0.1", **kwargs)
    assert info.value.field == field


@pytest.mark.skipif(not LISTENER_OPTIONS_INHERITED, reason="options set per connection")
def test_accepted_connections_get_the_listeners_nodelay_and_keep_alive_settings() -> None:
    # What the server relies on to set them once, on its listening sockets.
    with socket.socket() as listener:
        tune_socket(listener)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()), listener.accept()[0] as conn:
            options = [
                (socket.IPPROTO_TCP, socket.TCP_NODELAY),
                (socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            ]
            assert [conn.getsockopt(*o) for o in options] == [1, 1, 10, 5, 3]


def test_an_empty_host_listens_on_every_interface_ipv4_and_ipv6(loop_name: str) -> None:
    server = new_server(loop_name, "")
    try:
        port = server.start()
        hosts = ["127.0.0.1"] + (["::1"] if socket.has_ipv6 else [])
        for host in hosts:
            with RawClient(port, host=host) as raw:
                assert raw.ask(Request(Op.GETNUMKEYS), 8) == c.encode_i64(0)
    finally:
        server.close()


def test_connections_beyond_the_limit_are_closed_at_once(loop_name: str) -> None:
    server = new_server(loop_name, max_connections=2)
    try:
        port = server.start()
        first, second = RawClient(port), RawClient(port)
        first.sync()
        second.sync()
        with RawClient(port) as third:
            assert third.closed_by_server()
        first.sock.close()
        deadline = time.monotonic() + 5
        while server.num_connections > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with RawClient(port) as fourth:
            assert fourth.ask(Request(Op.GETNUMKEYS), 8) == c.encode_i64(0)
        second.sock.close()
    finally:
        server.close()


def test_a_thousand_clients_wait_on_one_key_and_are_all_released(
    server: TorchWireServer,
) -> None:
    port = server.start()
    clients = [RawClient(port) for _ in range(1000)]
    try:
        for raw in clients:
            raw.send(Request(Op.WAIT, (b"/go",)))
            assert raw.sync() == b""  # blocked
        with RawClient(port) as setter:
            setter.send(Request(Op.SET, (b"/go",), (b"",)))
            setter.sync()
        assert [raw.recv(1) for raw in clients] == [b"\x00"] * 1000
        # The setter has gone: the server notices its closed connection on its own loop.
        deadline = time.monotonic() + 10
        while server.num_connections != 1000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.num_connections == 1000
    finally:
        for raw in clients:
            raw.sock.close()
