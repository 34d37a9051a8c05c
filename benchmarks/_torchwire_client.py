"""A minimal asyncio client of torch's TCPStore wire protocol, for load generation.

It speaks the bytes torch 2.13's C++ client sends (see
``elastrun.store.torchwire.codec``'s docstring): a command byte, then fixed-width
little-endian fields; a key or value is a ``u64`` length and its bytes. The first
request is ``VALIDATE`` with the magic (no answer), then ``PING`` with a nonce (answered
with it), as torch's client does on connect. It is written from the protocol, not
from elastrun's codec, so that it checks the server rather than agreeing with it.

Thousands of these fit in one process: a client is an ``asyncio.Protocol`` with a
buffer and a queue of expected answers. For throughput it can also run one request
back to back (``run_loop``), re-sending from ``data_received`` without a coroutine or
a future per request, so that the client costs as little as possible per operation.

Connecting imitates torch's client: a refused or reset connection is retried after a
back-off (torch's ``ExponentialBackoffWithJitter``: 0.5 s, x1.5, +-50 %), and the
retries are counted. A SYN the server's kernel drops is retransmitted by our kernel
(1 s, then 2 s...), exactly as for torch's client: that wait is inside ``connect``.
"""

from __future__ import annotations

import asyncio
import collections
import random
import socket
import struct
import time
from typing import cast

MAGIC = 0x3C85F7CE
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = 0, 1, 2, 3, 4, 5, 6
PING = 13

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

# Answer kinds: a fixed size in bytes, or BLOB (u64 length + bytes).
BLOB = -1
U32_ANSWER, I64_ANSWER, BYTE_ANSWER = 4, 8, 1


def blob(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def req_set(key: bytes, value: bytes) -> bytes:
    return bytes((SET,)) + blob(key) + blob(value)


def req_get(key: bytes) -> bytes:
    return bytes((GET,)) + blob(key)


def req_add(key: bytes, amount: int) -> bytes:
    return bytes((ADD,)) + blob(key) + _I64.pack(amount)


def req_compare_set(key: bytes, expected: bytes, desired: bytes) -> bytes:
    return bytes((COMPARE_SET,)) + blob(key) + blob(expected) + blob(desired)


def req_wait(*keys: bytes) -> bytes:
    return bytes((WAIT,)) + _U64.pack(len(keys)) + b"".join(map(blob, keys))


def req_check(*keys: bytes) -> bytes:
    return bytes((CHECK,)) + _U64.pack(len(keys)) + b"".join(map(blob, keys))


def req_ping(nonce: int) -> bytes:
    return bytes((PING,)) + _U32.pack(nonce)


def req_validate() -> bytes:
    return bytes((VALIDATE,)) + _U32.pack(MAGIC)


class WireClient(asyncio.Protocol):
    """One connection. ``request`` sends bytes and awaits one answer of a given kind."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._pending: collections.deque[tuple[int, asyncio.Future[bytes]]] = collections.deque()
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # back-to-back mode
        self._loop_req = b""
        self._loop_kind = 0
        self._loop_stop = 0.0
        self._loop_depth = self._loop_owed = 1
        self.loop_count = 0
        self._loop_done: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport: asyncio passes it as its base class.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as torch's client

    def connection_lost(self, exc: Exception | None) -> None:
        err = ConnectionError(f"connection lost: {exc!r}")
        while self._pending:
            _, fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(err)
        if self._loop_done is not None and not self._loop_done.done():
            self._loop_done.set_exception(err)
        if not self._lost.done():
            self._lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if self._loop_done is not None:
            self._loop_answers()
            return
        while self._pending:
            kind, fut = self._pending[0]
            size = kind
            if kind == BLOB:
                if len(buf) < 8:
                    return
                size = 8 + _U64.unpack_from(buf)[0]
            if len(buf) < size:
                return
            answer = bytes(buf[:size])
            del buf[:size]
            self._pending.popleft()
            if not fut.done():
                fut.set_result(answer[8:] if kind == BLOB else answer)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def request(self, data: bytes, kind: int) -> asyncio.Future[bytes]:
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending.append((kind, fut))
        self.send(data)
        return fut

    async def handshake(self) -> None:
        """VALIDATE then PING, as torch's client does on connect."""
        nonce = random.getrandbits(31)
        self.send(req_validate())
        answer = await self.request(req_ping(nonce), U32_ANSWER)
        if _U32.unpack(answer)[0] != nonce:
            raise ConnectionError(f"ping answered {answer!r}, not the nonce")

    async def add(self, key: bytes, amount: int) -> int:
        return int(_I64.unpack(await self.request(req_add(key, amount), I64_ANSWER))[0])

    async def wait(self, *keys: bytes) -> None:
        if await self.request(req_wait(*keys), BYTE_ANSWER) != b"\x00":
            raise ConnectionError("wait not answered STOP_WAITING")

    async def get(self, key: bytes) -> bytes:
        """torch's ``get``: a wait for the key, then the get."""
        await self.wait(key)
        return await self.request(req_get(key), BLOB)

    def set(self, key: bytes, value: bytes) -> None:
        """No answer: torch's client does not wait for a set either."""
        self.send(req_set(key, value))

    # -- back-to-back -------------------------------------------------------------------

    def run_loop(
        self, data: bytes, kind: int, stop_at: float, depth: int = 1
    ) -> asyncio.Future[int]:
        """Send ``data`` again each time its answer (of ``kind``; fixed size) arrives,
        until the loop's clock passes ``stop_at``; resolves to the number of answers.

        ``depth`` > 1 sends that many copies in one write, and the next write once all
        their answers came: requests in flight, as a pipelining client keeps them."""
        loop = asyncio.get_running_loop()
        self._loop_req, self._loop_kind, self._loop_stop = data * depth, kind, stop_at
        self._loop_depth = self._loop_owed = depth
        self.loop_count = 0
        self._loop_done = loop.create_future()
        self._time = loop.time
        self.send(self._loop_req)
        return self._loop_done

    def _loop_answers(self) -> None:
        buf, size = self._buf, self._loop_kind
        n = len(buf) // size
        if not n:
            return
        del buf[: n * size]
        self.loop_count += n
        self._loop_owed -= n
        if self._loop_owed > 0:
            return
        done = self._loop_done
        assert done is not None
        if self._time() >= self._loop_stop:
            self._loop_done = None
            if not done.done():
                done.set_result(self.loop_count)
            return
        self._loop_owed = self._loop_depth
        self.send(self._loop_req)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Backoff:
    """torch's ExponentialBackoffWithJitter: 500 ms, x1.5, randomised by +-50 %."""

    def __init__(self) -> None:
        self._current = 0.5

    def next(self) -> float:
        delay = self._current * random.uniform(0.5, 1.5)
        self._current = min(self._current * 1.5, 60.0)
        return delay


async def connect(
    host: str, port: int, deadline: float, stats: dict[str, float] | None = None
) -> WireClient:
    """A connected, validated client. Retries refused/reset connects with torch's
    back-off until ``deadline`` (monotonic); ``stats`` gets ``retries`` and the moments
    (``time.time()``) ``start``, ``tcp`` (connected) and ``hello`` (ping answered)."""
    loop = asyncio.get_running_loop()
    if stats is not None:
        stats["start"] = time.time()
    backoff = Backoff()
    retries = 0
    while True:
        try:
            left = deadline - time.monotonic()
            _, client = await asyncio.wait_for(
                loop.create_connection(WireClient, host, port), max(left, 0.001)
            )
            if stats is not None:
                stats["tcp"] = time.time()
            await asyncio.wait_for(client.handshake(), max(deadline - time.monotonic(), 0.001))
            if stats is not None:
                stats["hello"] = time.time()
                stats["retries"] = retries
            return client
        except (ConnectionError, OSError) as exc:
            delay = backoff.next()
            if time.monotonic() + delay >= deadline:
                raise ConnectionError(f"could not connect after {retries} retries: {exc}") from exc
            retries += 1
            await asyncio.sleep(delay)
