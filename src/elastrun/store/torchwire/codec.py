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
from typing import NamedTuple

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
#: The wire's unsigned and signed 64-bit little-endian numbers (for the connection's
#: fast path).
U64, I64 = _U64, _I64


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


class Request(NamedTuple):
    """One parsed request.

    ``keys`` and ``values`` hold the command's byte strings in wire order: ``SET``,
    ``APPEND`` and ``QUEUE_PUSH`` one key and one value; ``COMPARE_SET`` one key and
    two values (expected, desired); ``MULTI_SET`` as many values as keys. ``number``
    is the magic (``VALIDATE``), the nonce (``PING``), the amount (``ADD``) or the
    world size (``BARRIER``); 0 otherwise.

    A named tuple rather than a frozen dataclass: one is made per request served, and
    a frozen dataclass costs about three times as much to build.
    """

    op: Op
    keys: tuple[bytes, ...] = ()
    values: tuple[bytes, ...] = ()
    number: int = 0

    @property
    def key(self) -> bytes:
        """The first key (for commands that name one)."""
        return self.keys[0]


#: Op by command byte (they are 0..n-1), without ``Op(code)``'s lookup: a microsecond
#: per request.
_OPS: tuple[Op, ...] = tuple(sorted(Op))
#: The fields each command carries, by command byte.
_SHAPE_NUMBER, _SHAPE_BARE, _SHAPE_KEY, _SHAPE_KEY_VALUE, _SHAPE_CAS = range(5)
_SHAPE_KEY_NUMBER, _SHAPE_KEYS, _SHAPE_PAIRS = range(5, 8)
_SHAPES: dict[Op, int] = {
    **dict.fromkeys((Op.VALIDATE, Op.PING), _SHAPE_NUMBER),
    **dict.fromkeys((Op.GETNUMKEYS, Op.CANCEL_WAIT, Op.LIST_KEYS), _SHAPE_BARE),
    **dict.fromkeys((Op.GET, Op.DELETE_KEY, Op.QUEUE_POP, Op.QUEUE_LEN), _SHAPE_KEY),
    **dict.fromkeys((Op.SET, Op.APPEND, Op.QUEUE_PUSH), _SHAPE_KEY_VALUE),
    Op.COMPARE_SET: _SHAPE_CAS,
    **dict.fromkeys((Op.ADD, Op.BARRIER), _SHAPE_KEY_NUMBER),
    **dict.fromkeys((Op.CHECK, Op.WAIT, Op.MULTI_GET), _SHAPE_KEYS),
    Op.MULTI_SET: _SHAPE_PAIRS,
}
_SHAPE_BY_CODE = tuple(_SHAPES[op] for op in _OPS)


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


def _number(budget: _Budget, kind: struct.Struct) -> Generator[int, bytes, int]:
    data = yield budget.take(kind.size, "header")
    return int(kind.unpack(data)[0])


def _blob(budget: _Budget, limit: int, what: str) -> Generator[int, bytes, bytes]:
    size = yield from _number(budget, _U64)
    if size > limit:
        raise ProtocolError(f"{what} of {size} bytes exceeds the {limit}-byte limit")
    if size == 0:
        return b""
    return (yield budget.take(size, what))


def _count(budget: _Budget, signed: bool = False) -> Generator[int, bytes, int]:
    count = yield from _number(budget, _I64 if signed else _U64)
    if not 0 <= count <= MAX_KEYS_PER_REQUEST:
        raise ProtocolError(f"a request naming {count} keys (at most {MAX_KEYS_PER_REQUEST})")
    return count


def _read(max_frame: int, max_key: int) -> _Reader:
    budget = _Budget(max_frame)
    code = (yield budget.take(1, "command"))[0]
    if code >= len(_OPS):
        raise ProtocolError(f"unknown command byte {code}")
    op = _OPS[code]

    def key() -> Generator[int, bytes, bytes]:
        return _blob(budget, max_key, "key")

    def value() -> Generator[int, bytes, bytes]:
        return _blob(budget, max_frame, "value")

    shape = _SHAPE_BY_CODE[code]
    if shape == _SHAPE_NUMBER:
        return Request(op, number=(yield from _number(budget, _U32)))
    if shape == _SHAPE_BARE:
        return Request(op)
    if shape < _SHAPE_KEYS:  # one key, then what the command adds to it
        k = ((yield from key()),)
        if shape == _SHAPE_KEY:
            return Request(op, k)
        if shape == _SHAPE_KEY_NUMBER:
            return Request(op, k, number=(yield from _number(budget, _I64)))
        values = [(yield from value())]
        if shape == _SHAPE_CAS:  # expected, then desired
            values.append((yield from value()))
        return Request(op, k, tuple(values))
    pairs = shape == _SHAPE_PAIRS  # MULTI_SET: the client sends its count signed
    count = yield from _count(budget, signed=pairs)
    keys, values = [], []
    for _ in range(count):
        keys.append((yield from key()))
        if pairs:
            values.append((yield from value()))
    return Request(op, tuple(keys), tuple(values))


# -- the fast path: a whole, valid request in one buffer ---------------------------------
#
# Nearly every request arrives whole in one read (torch's client sends each in one
# write; they are small). Reading those through the generator costs a resumption and a
# copy per field: about half the server's time per request, measured under load. So a
# request that lies whole in the buffer is read by ``_whole`` in straight-line code,
# and anything else -- a request cut by a read, a broken limit, an unknown command --
# is left to the generator, which stays the one definition of the format and of its
# errors: ``_whole`` either returns exactly what the generator would, or None.

_Buffer = bytes | bytearray


def _span(data: _Buffer, at: int, limit: int) -> int:
    """Where the blob at ``at`` ends, or -1 when it is not whole or over ``limit``."""
    if at + 8 > len(data):
        return -1
    size: int = _U64.unpack_from(data, at)[0]
    stop = at + 8 + size
    return -1 if size > limit or stop > len(data) else stop


def _whole(data: _Buffer, at: int, max_frame: int, max_key: int) -> tuple[Request, int] | None:
    """The request starting at ``data[at]`` and where it ends, when it is whole and
    within the limits; None otherwise (see above)."""
    code = data[at]
    if code >= len(_OPS):
        return None
    op, shape, p = _OPS[code], _SHAPE_BY_CODE[code], at + 1
    if shape == _SHAPE_NUMBER:
        if p + 4 > len(data):
            return None
        return Request(op, number=_U32.unpack_from(data, p)[0]), p + 4
    if shape == _SHAPE_BARE:
        return Request(op), p
    if shape >= _SHAPE_KEYS:
        return _whole_list(data, at, op, max_frame, max_key)
    k = _span(data, p, max_key)
    if k < 0:
        return None
    key = bytes(data[p + 8 : k])
    if shape == _SHAPE_KEY:
        found = Request(op, (key,)), k
    elif shape == _SHAPE_KEY_NUMBER:
        if k + 8 > len(data):
            return None
        found = Request(op, (key,), number=_I64.unpack_from(data, k)[0]), k + 8
    else:
        v = _span(data, k, max_frame)
        if v < 0:
            return None
        value = bytes(data[k + 8 : v])
        if shape == _SHAPE_KEY_VALUE:
            found = Request(op, (key,), (value,)), v
        else:  # compare_set: expected, then desired
            w = _span(data, v, max_frame)
            if w < 0:
                return None
            found = Request(op, (key,), (value, bytes(data[v + 8 : w]))), w
    return found if found[1] - at <= max_frame else None


def _whole_list(
    data: _Buffer, at: int, op: Op, max_frame: int, max_key: int
) -> tuple[Request, int] | None:
    """``_whole`` for the commands that carry a count of keys (and values)."""
    p = at + 9
    if p > len(data):
        return None
    pairs = op is Op.MULTI_SET  # its count is sent signed
    count: int = (_I64 if pairs else _U64).unpack_from(data, at + 1)[0]
    if not 0 <= count <= MAX_KEYS_PER_REQUEST:
        return None
    keys: list[bytes] = []
    values: list[bytes] = []
    for _ in range(count):
        stop = _span(data, p, max_key)
        if stop < 0:
            return None
        keys.append(bytes(data[p + 8 : stop]))
        p = stop
        if pairs:
            stop = _span(data, p, max_frame)
            if stop < 0:
                return None
            values.append(bytes(data[p + 8 : stop]))
            p = stop
    if p - at > max_frame:
        return None
    return Request(op, tuple(keys), tuple(values)), p


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
        # What was received and not yet returned is ``_buf[_pos:]``. ``_buf`` is the
        # received ``bytes`` itself while each read holds whole requests (no copy), and
        # becomes a bytearray only to join the pieces of a request cut by a read.
        self._buf: _Buffer = b""
        self._pos = 0
        self._reader: _Reader | None = None
        self._need = 0
        self._broken: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received and not yet part of a returned request."""
        return len(self._buf) - self._pos

    @property
    def empty(self) -> bool:
        """True when nothing is held at all: the next read starts a request."""
        return self._reader is None and self._broken is None and self._pos >= len(self._buf)

    @property
    def idle(self) -> bool:
        """True between requests: no byte of an unfinished request is held."""
        return self._reader is None and self.buffered == 0

    def feed(self, data: bytes) -> None:
        if self._pos >= len(self._buf):  # nothing held: keep the read as it is
            self._buf, self._pos = data, 0
            return
        if not isinstance(self._buf, bytearray):
            self._buf, self._pos = bytearray(memoryview(self._buf)[self._pos :]), 0
        self._buf += data

    def next(self) -> Request | None:
        if self._reader is None and self._broken is None:
            if self._pos >= len(self._buf):
                return None
            found = _whole(self._buf, self._pos, self._max_frame, self._max_key)
            if found is not None:
                request, self._pos = found
                if self._pos == len(self._buf):
                    self._buf, self._pos = b"", 0
                return request
        if self._broken is not None:
            raise self._broken
        try:
            return self._advance()
        except ProtocolError as exc:
            self._broken = exc
            self._reader = None
            self._buf, self._pos = b"", 0
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
        if self._pos == len(self._buf):
            self._buf, self._pos = b"", 0
        elif self._pos > 65536:
            self._buf, self._pos = bytearray(memoryview(self._buf)[self._pos :]), 0


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
