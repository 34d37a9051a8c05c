"""One torch client's connection, driven through a fake transport: validation,
back-pressure, protocol errors, and what a closing connection leaves behind."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from elastrun.store.torchwire import codec as c
from elastrun.store.torchwire.codec import Op, Request
from elastrun.store.torchwire.connection import Complaints, Connection, Hub, Limits

VALIDATE = Request(Op.VALIDATE, number=c.MAGIC)


class FakeTransport(asyncio.Transport):
    """Records writes; can pretend the peer stopped reading after some writes."""

    def __init__(self, protocol: Connection, full_after: int | None = None) -> None:
        super().__init__()
        self.protocol = protocol
        self.written: list[bytes] = []
        self.reading = True
        self.aborted = False
        self._full_after = full_after

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 5555) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))
        if self._full_after is not None and len(self.written) >= self._full_after:
            self._full_after = None
            self.protocol.pause_writing()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.aborted

    def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self.protocol.connection_lost(None)


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop = asyncio.new_event_loop()
    yield Hub(loop, Limits(max_connections=10, max_frame=1 << 16, max_key=256))
    loop.close()


def connect(hub: Hub, full_after: int | None = None) -> tuple[Connection, FakeTransport]:
    conn = Connection(hub)
    transport = FakeTransport(conn, full_after)
    conn.connection_made(transport)
    return conn, transport


def test_answers_stop_while_the_peer_is_not_reading_and_resume_in_order(hub: Hub) -> None:
    big = b"v" * (64 * 1024)  # each answer fills what a connection gathers before writing
    hub.state.set(b"/v", big)
    conn, t = connect(hub, full_after=1)
    get = Request(Op.GET, (b"/v",))
    conn.data_received(c.encode_requests([VALIDATE, get, get, get]))
    assert t.written == [c.encode_bytes(big)]
    assert not t.reading  # later requests stay unread in the kernel, not in our memory
    conn.resume_writing()
    assert t.written == [c.encode_bytes(big)] * 3
    assert t.reading


def test_the_answers_to_one_read_go_out_in_one_write_in_order(hub: Hub) -> None:
    hub.state.set(b"/v", b"value")
    conn, t = connect(hub)
    reqs = [VALIDATE, Request(Op.GET, (b"/v",)), Request(Op.ADD, (b"/n",), number=2)]
    reqs += [Request(Op.WAIT, (b"/late",)), Request(Op.SET, (b"/late",), (b"x",))]
    reqs += [Request(Op.PING, number=9)]
    conn.data_received(c.encode_requests(reqs))
    # The wait is released by the set after it, so its answer comes before the ping's.
    expected = [c.encode_bytes(b"value"), c.encode_i64(2), b"\x00", c.encode_u32(9)]
    assert t.written == [b"".join(expected)]


def test_a_client_released_by_another_is_answered_at_once(hub: Hub) -> None:
    waiting, tw = connect(hub)
    waiting.data_received(c.encode_requests([VALIDATE, Request(Op.WAIT, (b"/k",))]))
    setter, ts = connect(hub)
    setter.data_received(c.encode_requests([VALIDATE, Request(Op.SET, (b"/k",), (b"1",))]))
    assert tw.written == [b"\x00"]
    assert ts.written == []


def test_nothing_is_served_before_validation(hub: Hub) -> None:
    conn, t = connect(hub)
    conn.data_received(c.encode_request(Request(Op.GETNUMKEYS)))
    assert t.aborted and t.written == []
    assert hub.conns == set()


def test_a_validated_client_is_answered(hub: Hub) -> None:
    conn, t = connect(hub)
    conn.data_received(c.encode_requests([VALIDATE, Request(Op.PING, number=7)]))
    assert t.written == [c.encode_u32(7)]
    assert hub.conns == {conn}


def test_a_second_wait_while_blocked_closes_the_connection(hub: Hub) -> None:
    conn, t = connect(hub)
    wait = Request(Op.WAIT, (b"/never",))
    conn.data_received(c.encode_requests([VALIDATE, wait, wait]))
    assert t.aborted
    assert "waited_keys=0" in repr(hub.state)


def test_a_lost_connection_leaves_no_waiter_behind(hub: Hub) -> None:
    conn, t = connect(hub)
    conn.data_received(c.encode_requests([VALIDATE, Request(Op.WAIT, (b"/k",))]))
    assert "waited_keys=1" in repr(hub.state)
    conn.connection_lost(ConnectionResetError())
    assert "waited_keys=0" in repr(hub.state)
    hub.state.set(b"/k", b"")  # would write into a closed transport if still waiting
    assert t.written == []


def test_connections_over_the_limit_are_closed_before_any_request(hub: Hub) -> None:
    hub.limits = Limits(max_connections=1)
    connect(hub)
    _, second = connect(hub)
    assert second.aborted
    assert len(hub.conns) == 1


def test_complaints_are_limited_per_period_and_count_what_was_suppressed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    complain = Complaints(lambda: now[0], burst=2, period=10.0)
    for i in range(5):
        complain("bad client %d", i)
    now[0] = 11.0
    complain("bad client %d", 5)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "bad client 0",
        "bad client 1",
        "bad client 5 (3 similar messages suppressed)",
    ]
    assert complain.total == 6
