"""One torch client's connection, driven through a fake transport: validation,
back-pressure, protocol errors, and what a closing connection leaves behind."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from elastrun.store.torchwire import codec as c
from elastrun.store.torchwire.codec import Op, Request
from elastrun.store.torchwire.connection import Connection, Hub
from elastrun.store.torchwire.limits import Complaints, Limits

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


# -- one request per read (the fast path) and the same request through the parser ------


_ONE_BY_ONE = [
    Request(Op.SET, (b"/k",), (b"v1",)),
    Request(Op.GET, (b"/k",)),
    Request(Op.GET, (b"/missing",)),
    Request(Op.ADD, (b"/n",), number=5),
    Request(Op.ADD, (b"/n",), number=-7),
    Request(Op.COMPARE_SET, (b"/k",), (b"v1", b"v2")),
    Request(Op.COMPARE_SET, (b"/k",), (b"nope", b"v3")),
    Request(Op.COMPARE_SET, (b"/new",), (b"", b"fresh")),
    Request(Op.PING, number=0xDEADBEEF),
    Request(Op.SET, (b"",), (b"",)),  # an empty key and value
    Request(Op.WAIT, (b"/k",)),  # there: answered at once
    Request(Op.GET, (b"/k",)),
]


def _answers(hub: Hub, split: bool) -> tuple[list[bytes], dict[bytes, bytes]]:
    conn, t = connect(hub)
    conn.data_received(c.encode_requests([VALIDATE]))
    fed: list[bytes] = []
    feed = conn._parser.feed

    def counting_feed(data: bytes) -> None:
        fed.append(data)
        feed(data)

    conn._parser.feed = counting_feed  # type: ignore[method-assign]  # a spy on the parser
    for request in _ONE_BY_ONE:
        data = c.encode_requests([request])
        if split:  # cut in two reads: the parser joins them
            conn.data_received(data[:3])
            conn.data_received(data[3:])
        else:
            conn.data_received(data)
    keys = [b"/k", b"/n", b"/new", b""]
    assert bool(fed) == split  # whole requests never reach the parser
    return t.written, {k: hub.state.get(k) for k in keys}


def test_a_request_in_a_read_of_its_own_is_answered_as_through_the_parser() -> None:
    loop = asyncio.new_event_loop()
    try:
        limits = Limits(max_connections=10, max_frame=1 << 16, max_key=256)
        whole = _answers(Hub(loop, limits), split=False)
        split = _answers(Hub(loop, limits), split=True)
    finally:
        loop.close()
    assert whole == split
    assert whole[0][0] == c.encode_bytes(b"v1")  # the first get
    assert whole[1][b"/n"] == b"-2"


def test_a_set_wakes_a_waiter_also_on_the_fast_path(hub: Hub) -> None:
    waiting, tw = connect(hub)
    waiting.data_received(c.encode_requests([VALIDATE, Request(Op.WAIT, (b"/w",))]))
    assert tw.written == []
    setter, _ = connect(hub)
    setter.data_received(c.encode_requests([VALIDATE]))
    setter.data_received(c.encode_requests([Request(Op.SET, (b"/w",), (b"x",))]))
    assert tw.written == [c.encode_byte(c.WaitReply.STOP_WAITING)]


def test_the_fast_path_keeps_the_limits_and_the_errors(hub: Hub) -> None:
    conn, t = connect(hub)
    conn.data_received(c.encode_requests([VALIDATE]))
    # A key over the limit: left to the parser, which refuses it.
    conn.data_received(c.encode_requests([Request(Op.GET, (b"k" * 300,))]))
    assert t.aborted
    conn, t = connect(hub)
    conn.data_received(c.encode_requests([VALIDATE]))
    hub.state.set(b"/text", b"abc")
    conn.data_received(c.encode_requests([Request(Op.ADD, (b"/text",), number=1)]))
    assert t.aborted and t.written == []  # not a number: this client's connection ends


def test_pipelined_requests_mixing_fast_and_other_commands_are_answered_in_order(
    hub: Hub,
) -> None:
    batch = [
        Request(Op.SET, (b"/a",), (b"1",)),
        Request(Op.PING, number=7),
        Request(Op.GETNUMKEYS),  # not on the fast path: the parser takes it from here
        Request(Op.GET, (b"/a",)),
        Request(Op.ADD, (b"/c",), number=2),
    ]
    conn, t = connect(hub)
    conn.data_received(c.encode_requests([VALIDATE]))
    data = c.encode_requests(batch)
    conn.data_received(data[:-3])  # the last request cut by the read
    conn.data_received(data[-3:])
    assert b"".join(t.written) == b"".join(
        [c.encode_u32(7), c.encode_i64(1), c.encode_bytes(b"1"), c.encode_i64(2)]
    )


def test_a_wait_on_one_missing_key_blocks_on_the_fast_path_and_can_be_cancelled(hub: Hub) -> None:
    conn, t = connect(hub)
    conn.data_received(c.encode_requests([VALIDATE]))
    conn.data_received(c.encode_requests([Request(Op.WAIT, (b"/later",))]))
    assert t.written == []
    conn.data_received(c.encode_requests([Request(Op.CANCEL_WAIT)]))
    assert t.written == [c.encode_byte(c.WaitReply.WAIT_CANCELED)]
    setter, _ = connect(hub)
    setter.data_received(c.encode_requests([VALIDATE, Request(Op.SET, (b"/later",), (b"x",))]))
    assert t.written == [c.encode_byte(c.WaitReply.WAIT_CANCELED)]  # no longer waiting


def test_a_peer_that_stops_reading_is_not_served_on_the_fast_path_until_it_reads(
    hub: Hub,
) -> None:
    hub.state.set(b"/v", b"value")
    conn, t = connect(hub, full_after=2)
    conn.data_received(c.encode_requests([VALIDATE]))
    get = c.encode_requests([Request(Op.GET, (b"/v",))])
    conn.data_received(get)
    conn.data_received(get)  # this answer fills the peer's window
    assert not t.reading
    conn.data_received(get)  # read before the pause took effect: held, not answered
    assert len(t.written) == 2
    conn.resume_writing()
    assert t.written == [c.encode_bytes(b"value")] * 3
    conn.data_received(get)  # and the fast path again
    assert t.written == [c.encode_bytes(b"value")] * 4
    assert t.reading


def test_a_wait_released_later_in_the_same_read_is_answered_in_order(hub: Hub) -> None:
    hub.state.set(b"/v", b"value")
    conn, t = connect(hub)
    conn.data_received(c.encode_requests([VALIDATE]))
    batch = [
        Request(Op.GET, (b"/v",)),
        Request(Op.WAIT, (b"/late",)),  # blocks on the fast path...
        Request(Op.SET, (b"/late",), (b"x",)),  # ...and this releases it
        Request(Op.PING, number=9),
    ]
    conn.data_received(c.encode_requests(batch))
    expected = [c.encode_bytes(b"value"), c.encode_byte(c.WaitReply.STOP_WAITING)]
    assert b"".join(t.written) == b"".join([*expected, c.encode_u32(9)])
