"""The torch TCPStore wire format: parsing in pieces, limits, malformed input, answers."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrun.store.torchwire import codec as c
from elastrun.store.torchwire.codec import Op, ProtocolError, Request, RequestParser

# Bytes captured from torch 2.13's client (through a logging proxy): the encoder must
# produce exactly these, and the parser must read them.
TORCH_BYTES = {
    Request(Op.VALIDATE, number=c.MAGIC): bytes.fromhex("00cef7853c"),
    Request(Op.SET, (b"/k",), (b"v1",)): bytes.fromhex(
        "01 0200000000000000 2f6b 0200000000000000 7631"
    ),
    Request(Op.ADD, (b"init/",), number=1): bytes.fromhex(
        "04 0500000000000000 696e69742f 0100000000000000"
    ),
    Request(Op.WAIT, (b"/k",)): bytes.fromhex("06 0100000000000000 0200000000000000 2f6b"),
    Request(Op.CANCEL_WAIT): bytes.fromhex("0c"),
    Request(Op.GETNUMKEYS): bytes.fromhex("07"),
    Request(Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"2")): bytes.fromhex(
        "0b 0200000000000000 0200000000000000 2f61 0100000000000000 31"
        " 0200000000000000 2f62 0100000000000000 32"
    ),
    Request(Op.BARRIER, (b"/bar",), number=1): bytes.fromhex(
        "12 0400000000000000 2f626172 0100000000000000"
    ),
    Request(Op.LIST_KEYS): bytes.fromhex("11"),
}


def parse_all(data: bytes, parser: RequestParser | None = None) -> list[Request]:
    parser = parser or RequestParser()
    parser.feed(data)
    out = []
    while (request := parser.next()) is not None:
        out.append(request)
    return out


@pytest.mark.parametrize("request_, wire", list(TORCH_BYTES.items()))
def test_encoding_matches_the_bytes_torch_sends_and_parses_back(
    request_: Request, wire: bytes
) -> None:
    assert c.encode_request(request_) == wire
    assert parse_all(wire) == [request_]


# -- a strategy for any valid request ----------------------------------------------------

_blobs = st.binary(max_size=40)
_keys = st.lists(_blobs, max_size=5)
_int64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    op = draw(st.sampled_from(list(Op)))
    if op in (Op.VALIDATE, Op.PING):
        return Request(op, number=draw(st.integers(0, 2**32 - 1)))
    if op in (Op.GETNUMKEYS, Op.CANCEL_WAIT, Op.LIST_KEYS):
        return Request(op)
    if op in (Op.GET, Op.DELETE_KEY, Op.QUEUE_POP, Op.QUEUE_LEN):
        return Request(op, (draw(_blobs),))
    if op in (Op.SET, Op.APPEND, Op.QUEUE_PUSH):
        return Request(op, (draw(_blobs),), (draw(_blobs),))
    if op is Op.COMPARE_SET:
        return Request(op, (draw(_blobs),), (draw(_blobs), draw(_blobs)))
    if op in (Op.ADD, Op.BARRIER):
        return Request(op, (draw(_blobs),), number=draw(_int64))
    keys = tuple(draw(_keys))
    if op is Op.MULTI_SET:
        return Request(op, keys, tuple(draw(_blobs) for _ in keys))
    return Request(op, keys)


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), max_size=8), st.data())
def test_any_split_of_a_valid_stream_parses_to_the_same_requests(
    reqs: list[Request], data: st.DataObject
) -> None:
    wire = c.encode_requests(reqs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=12)))
    parser = RequestParser()
    got: list[Request] = []
    start = 0
    for end in [*cuts, len(wire)]:
        parser.feed(wire[start:end])
        start = end
        while (request := parser.next()) is not None:
            got.append(request)
    assert got == reqs
    assert parser.idle


def test_one_byte_at_a_time_parses_a_large_value_once() -> None:
    value = bytes(range(256)) * 100
    wire = c.encode_request(Request(Op.SET, (b"/big",), (value,)))
    parser = RequestParser()
    for i in range(len(wire) - 1):
        parser.feed(wire[i : i + 1])
        assert parser.next() is None
    parser.feed(wire[-1:])
    assert parser.next() == Request(Op.SET, (b"/big",), (value,))


def test_an_unfinished_request_is_not_idle() -> None:
    parser = RequestParser()
    parser.feed(c.encode_request(Request(Op.GET, (b"/k",)))[:5])
    assert parser.next() is None
    assert not parser.idle


# -- malformed and oversized input -------------------------------------------------------


def test_an_unknown_command_byte_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="unknown command byte 200"):
        parse_all(b"\xc8")


def test_a_value_over_the_frame_limit_is_refused_from_its_length_alone() -> None:
    # Only the header arrives: the parser must refuse before any of the value is sent.
    head = b"\x01" + struct.pack("<Q", 2) + b"/k" + struct.pack("<Q", 10_000)
    with pytest.raises(ProtocolError, match="value of 10000 bytes"):
        parse_all(head, RequestParser(max_frame=1024, max_key=64))


def test_a_whole_request_over_the_frame_limit_is_refused() -> None:
    # Each value fits, their sum does not.
    wire = c.encode_request(Request(Op.MULTI_SET, (b"a", b"b"), (b"x" * 600, b"y" * 600)))
    with pytest.raises(ProtocolError, match="exceeds the request size limit"):
        parse_all(wire, RequestParser(max_frame=1024, max_key=64))


def test_a_key_over_the_key_limit_is_refused() -> None:
    wire = c.encode_request(Request(Op.GET, (b"k" * 65,)))
    with pytest.raises(ProtocolError, match="key of 65 bytes exceeds the 64-byte limit"):
        parse_all(wire, RequestParser(max_frame=1024, max_key=64))


@pytest.mark.parametrize("op", [Op.WAIT, Op.CHECK, Op.MULTI_GET])
def test_an_absurd_key_count_is_refused_before_reading_keys(op: Op) -> None:
    with pytest.raises(ProtocolError, match="naming"):
        parse_all(bytes((op,)) + struct.pack("<Q", 2**40))


def test_a_negative_multi_set_count_is_refused() -> None:
    with pytest.raises(ProtocolError, match="naming -1 keys"):
        parse_all(bytes((Op.MULTI_SET,)) + struct.pack("<q", -1))


def test_a_broken_parser_stays_broken_and_holds_nothing() -> None:
    parser = RequestParser()
    parser.feed(b"\xff" + b"x" * 1000)
    with pytest.raises(ProtocolError):
        parser.next()
    assert parser.buffered == 0
    parser.feed(c.encode_request(Request(Op.GETNUMKEYS)))
    with pytest.raises(ProtocolError):
        parser.next()


def test_requests_before_garbage_are_still_returned() -> None:
    parser = RequestParser()
    parser.feed(c.encode_request(Request(Op.GETNUMKEYS)) + b"\xee")
    assert parser.next() == Request(Op.GETNUMKEYS)
    with pytest.raises(ProtocolError):
        parser.next()


# -- answers -----------------------------------------------------------------------------


def test_answers_have_torchs_widths_and_byte_order() -> None:
    assert c.encode_u32(0x19B8) == bytes.fromhex("b8190000")
    assert c.encode_i64(-1) == b"\xff" * 8
    assert c.encode_bytes(b"v2") == bytes.fromhex("0200000000000000 7632")
    assert c.encode_byte(c.WaitReply.WAIT_CANCELED) == b"\x01"
    assert c.encode_byte(c.CheckReply.NOT_READY) == b"\x01"
    assert c.encode_key_list([b"/x"]) == bytes.fromhex("0100000000000000 0200000000000000 2f78")
    assert c.encode_queue_pop(0, None) == bytes(8)
    assert c.encode_queue_pop(1, b"item") == bytes.fromhex(
        "0100000000000000 0400000000000000 6974656d"
    )


def test_command_bytes_are_numbered_without_gaps() -> None:
    # The parser looks commands up by byte in a table.
    assert sorted(Op) == list(range(len(Op)))


@settings(max_examples=200, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=8))
def test_requests_read_whole_or_byte_by_byte_are_the_same(reqs: list[Request]) -> None:
    # Whole requests take the parser's fast path; a byte at a time, its general reader.
    wire = c.encode_requests(reqs)
    parser = RequestParser()
    by_byte: list[Request] = []
    for i in range(len(wire)):
        parser.feed(wire[i : i + 1])
        while (request := parser.next()) is not None:
            by_byte.append(request)
    assert parse_all(wire) == by_byte == reqs
