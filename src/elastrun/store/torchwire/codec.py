"""The byte formats of torch's TCPStore client protocol (as spoken by torch 2.13).

Pure: no sockets, no clocks. :class:`RequestParser` turns the bytes a client sends,
in whatever pieces they arrive, into :class:`Request` values; the ``encode_*``
functions build the answers.

The format, as observed from torch 2.13's client and read from its server:

* A request is one command byte (:class:`Op`) followed by the fields of that
  command. There is no length prefix for a whole request, so a request can only be
  parsed field by field.
* Integers are in the machine's byte order of the client -- little-endian on every
  platform torch ships for -- and of fixed width: ``u32`` for the validation magic and
  the ping nonce, ``u64`` for string lengths and key counts, ``i64`` for counters
  (``add``, ``barrier``'s world size, ``multi_set``'s count).
* A key or a value is a ``u64`` length followed by that many bytes.
* The first request on a connection must be ``VALIDATE`` carrying :data:`MAGIC`; it
  has no answer. ``PING`` follows and is answered with its nonce.

Answers are as fixed: a value is ``u64`` length + bytes, a counter an ``i64``, a
``check`` one byte (:class:`CheckReply`), a ``wait`` or ``barrier`` one byte
(:class:`WaitReply`) sent when the keys are there -- or, after the client gave up and
sent ``CANCEL_WAIT``, ``WAIT_CANCELED``.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass

from elastrun.core.errors import StoreError

#: The number a client sends in its first request to show it speaks this protocol.
MAGIC = 0x3C85F7CE

#: Largest request accepted unless configured otherwise: generous, since users store
#: more than torch's own small blobs (torch's own server stops at 8 MiB values).
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
#: Longest key accepted unless configured otherwise (torch's own server: 8 KiB).
DEFAULT_MAX_KEY = 64 * 1024
#: Most keys in one ``check``/``wait``/``multi_get``/``multi_set`` (torch's own limit):
#: each costs a set entry while waiting, far more than its 8 bytes on the wire.
MAX_KEYS_PER_REQUEST = 128 * 1024

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class Op(enum.IntEnum):
    """Command bytes, numbered as torch 2.13's client sends them."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


class CheckReply(enum.IntEnum):
    READY = 0
    NOT_READY = 1


class WaitReply(enum.IntEnum):
    STOP_WAITING = 0
    WAIT_CANCELED = 1


class ProtocolError(StoreError):
    """A client broke the protocol (unknown command, oversized field, bad magic...).

    The server closes that client's connection; nothing else is affected.
    """


@dataclass(frozen=True, slots=True)
class Request:
    """One parsed request.

    ``keys`` and ``values`` hold the command's byte strings in wire order: ``SET``,
    ``APPEND`` and ``QUEUE_PUSH`` one key and one value; ``COMPARE_SET`` one key and
    two values (expected, desired); ``MULTI_SET`` as many values as keys. ``number``
    is the magic (``VALIDATE``), the nonce (``PING``), the amount (``ADD``) or the
    world size (``BARRIER``); 0 otherwise.
    """

    op: Op
    keys: tuple[bytes, ...] = ()
    values: tuple[bytes, ...] = ()
    number: int = 0

    @property
    def key(self) -> bytes:
        """The first key (for commands that name one)."""
        return self.keys[0]


# -- parsing -----------------------------------------------------------------------------

#: A request reader: yields how many bytes it needs next, is sent exactly those bytes,
#: and returns the request. Being a generator, it resumes where it stopped, so a large
#: request arriving in many pieces is parsed once, not once per piece.
_Reader = Generator[int, bytes, Request]


class _Budget:
    """Counts a request's bytes against the frame limit, before they are buffered."""

    __slots__ = ("left",)

    def __init__(self, max_frame: int) -> None:
        self.left = max_frame

    def take(self, size: int, what: str) -> int:
        if size > self.left:
            raise ProtocolError(f"{what} of {size} bytes exceeds the request size limit")
        self.left -= size
        return size


def _u32(budget: _Budget) -> Generator[int, bytes, int]:
    data = yield budget.take(4, "header")
    return int(_U32.unpack(data)[0])


def _u64(budget: _Budget) -> Generator[int, bytes, int]:
    data = yield budget.take(8, "header")
    return int(_U64.unpack(data)[0])


def _i64(budget: _Budget) -> Generator[int, bytes, int]:
    data = yield budget.take(8, "header")
    return int(_I64.unpack(data)[0])


def _blob(budget: _Budget, limit: int, what: str) -> Generator[int, bytes, bytes]:
    size = yield from _u64(budget)
    if size > limit:
        raise ProtocolError(f"{what} of {size} bytes exceeds the {limit}-byte limit")
    if size == 0:
        return b""
    return (yield budget.take(size, what))


def _count(budget: _Budget, signed: bool = False) -> Generator[int, bytes, int]:
    count = yield from (_i64(budget) if signed else _u64(budget))
    if not 0 <= count <= MAX_KEYS_PER_REQUEST:
        raise ProtocolError(f"a request naming {count} keys (at most {MAX_KEYS_PER_REQUEST})")
    return count


def _read(max_frame: int, max_key: int) -> _Reader:
    budget = _Budget(max_frame)
    code = (yield budget.take(1, "command"))[0]
    try:
        op = Op(code)
    except ValueError:
        raise ProtocolError(f"unknown command byte {code}") from None

    def key() -> Generator[int, bytes, bytes]:
        return _blob(budget, max_key, "key")

    def value() -> Generator[int, bytes, bytes]:
        return _blob(budget, max_frame, "value")

    if op in (Op.VALIDATE, Op.PING):
        return Request(op, number=(yield from _u32(budget)))
    if op in (Op.GETNUMKEYS, Op.CANCEL_WAIT, Op.LIST_KEYS):
        return Request(op)
    if op in (Op.GET, Op.DELETE_KEY, Op.QUEUE_POP, Op.QUEUE_LEN):
        return Request(op, ((yield from key()),))
    if op in (Op.SET, Op.APPEND, Op.QUEUE_PUSH):
        k = yield from key()
        return Request(op, (k,), ((yield from value()),))
    if op is Op.COMPARE_SET:
        k = yield from key()
        expected = yield from value()
        return Request(op, (k,), (expected, (yield from value())))
    if op in (Op.ADD, Op.BARRIER):
        k = yield from key()
        return Request(op, (k,), number=(yield from _i64(budget)))
    if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET):
        count = yield from _count(budget)
        keys = []
        for _ in range(count):
            keys.append((yield from key()))
        return Request(op, tuple(keys))
    # MULTI_SET: the client sends its count signed.
    count = yield from _count(budget, signed=True)
    keys, values = [], []
    for _ in range(count):
        keys.append((yield from key()))
        values.append((yield from value()))
    return Request(op, tuple(keys), tuple(values))


class RequestParser:
    """Incremental parser of one connection's requests.

    :meth:`feed` appends received bytes; :meth:`next` returns the next complete
    request, or None until more bytes arrive. Limits are checked as soon as a length
    is read, so an oversized field is refused before its bytes are buffered: what a
    connection holds is bounded by ``max_frame`` plus one read.

    Raises ``ProtocolError`` (from :meth:`next`) for an unknown command, a key longer
    than ``max_key``, a request larger than ``max_frame`` or too many keys; the
    parser is then unusable and the connection must be closed.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, max_key: int = DEFAULT_MAX_KEY) -> None:
        self._max_frame = max_frame
        self._max_key = max_key
        self._buf = bytearray()
        self._pos = 0  # consumed bytes at the front of _buf, dropped in batches
        self._reader: _Reader | None = None
        self._need = 0
        self._broken: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received and not yet part of a returned request."""
        return len(self._buf) - self._pos

    @property
    def idle(self) -> bool:
        """True between requests: no byte of an unfinished request is held."""
        return self._reader is None and self.buffered == 0

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next(self) -> Request | None:
        if self._broken is not None:
            raise self._broken
        try:
            return self._advance()
        except ProtocolError as exc:
            self._broken = exc
            self._reader = None
            self._buf.clear()
            self._pos = 0
            raise

    def _advance(self) -> Request | None:
        if self._reader is None:
            if self.buffered == 0:
                self._compact()
                return None
            self._reader = _read(self._max_frame, self._max_key)
            self._need = next(self._reader)
        reader = self._reader
        while len(self._buf) - self._pos >= self._need:
            with memoryview(self._buf) as view:  # one copy, not two
                chunk = bytes(view[self._pos : self._pos + self._need])
            self._pos += self._need
            try:
                self._need = reader.send(chunk)
            except StopIteration as done:
                self._reader = None
                self._compact()
                request: Request = done.value
                return request
        self._compact()
        return None

    def _compact(self) -> None:
        # Dropping consumed bytes costs a copy of the rest: do it when the consumed
        # part is large, or free, so that many small requests cost O(bytes) overall.
        if self._pos and (self._pos == len(self._buf) or self._pos > 65536):
            del self._buf[: self._pos]
            self._pos = 0


# -- encoding ----------------------------------------------------------------------------


def encode_u32(number: int) -> bytes:
    return _U32.pack(number)


def encode_i64(number: int) -> bytes:
    return _I64.pack(number)


def encode_bytes(value: bytes) -> bytes:
    """A value as answered to ``get``, ``compare_set`` and ``multi_get``."""
    return _U64.pack(len(value)) + value


def encode_byte(reply: CheckReply | WaitReply) -> bytes:
    return bytes((reply,))


def encode_key_list(keys: Iterable[bytes]) -> bytes:
    """The answer to ``list_keys``: an ``i64`` count, then each key."""
    keys = list(keys)
    return b"".join([_I64.pack(len(keys)), *map(encode_bytes, keys)])


def encode_queue_pop(length: int, value: bytes | None) -> bytes:
    """The answer to ``queue_pop``: the queue's length before the pop, then the value
    when there was one."""
    head = _I64.pack(length)
    return head if value is None else head + encode_bytes(value)


def encode_request(request: Request) -> bytes:
    """The bytes a torch client sends for ``request`` (for tests and tools)."""
    op = request.op
    out = [bytes((op,))]
    if op in (Op.VALIDATE, Op.PING):
        out.append(_U32.pack(request.number))
    elif op in (Op.CHECK, Op.WAIT, Op.MULTI_GET):
        out.append(_U64.pack(len(request.keys)))
        out.extend(map(encode_bytes, request.keys))
    elif op is Op.MULTI_SET:
        out.append(_I64.pack(len(request.keys)))
        for k, v in zip(request.keys, request.values, strict=True):
            out += [encode_bytes(k), encode_bytes(v)]
    else:
        out.extend(map(encode_bytes, request.keys))
        out.extend(map(encode_bytes, request.values))
        if op in (Op.ADD, Op.BARRIER):
            out.append(_I64.pack(request.number))
    return b"".join(out)


def encode_requests(requests: Sequence[Request]) -> bytes:
    return b"".join(map(encode_request, requests))
