"""An asyncio client of elastrun's tcp store, for simulating thousands of nodes.

It speaks the same wire protocol as ``elastrun.store.tcp.client.TcpStore`` (it uses the
package's own framing and encoding helpers), one connection per simulated node, so the
server sees exactly what real agents would send: a handshake, then requests multiplexed
by id. What it leaves out is what a benchmark does not need: reconnection, lease resume,
authentication tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable

from elastrun.core.errors import StoreError
from elastrun.store.api import WatchResult
from elastrun.store.tcp import protocol as p


class _Frames(asyncio.Protocol):
    """The connection's byte stream cut into frames, each handed to ``on_frame`` as it
    completes: no task and no loop iteration per frame (what thousands of simulated
    nodes in one process need; asyncio's streams cost two awaits per frame)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.max_frame = p.HANDSHAKE_MAX_FRAME
        self.on_frame: Callable[[p.Message, int], None] = self._early
        self.on_lost: Callable[[BaseException], None] = lambda exc: None
        self.early: asyncio.Queue[p.Message] = asyncio.Queue()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def _early(self, message: p.Message, size: int) -> None:
        self.early.put_nowait(message)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start, end = 0, len(buf)
        try:
            while end - start >= p.HEADER.size:
                length = p.frame_length(bytes(buf[start : start + p.HEADER.size]), self.max_frame)
                if end - start - p.HEADER.size < length:
                    break
                body = bytes(buf[start + p.HEADER.size : start + p.HEADER.size + length])
                start += p.HEADER.size + length
                self.on_frame(p.decode(body), length)
        except p.FrameError as exc:
            assert self.transport is not None
            self.transport.abort()
            self.on_lost(exc)
        del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost(exc or ConnectionError("closed by the server"))


class AsyncStore:
    """One connection to a ``TcpStoreServer``; the methods mirror the ``Store`` protocol."""

    def __init__(self, frames: _Frames, mf: int):
        assert frames.transport is not None
        self._transport = frames.transport
        self._max_frame = mf
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[p.Message]] = {}
        frames.max_frame = mf
        frames.on_frame = self._answer
        frames.on_lost = self._lost
        self.requests = 0
        self.by_op: dict[str, int] = {}  # requests sent, by operation
        self.max_latency = 0.0  # longest wait for an answer to a non-blocking request
        self.bytes_in = 0  # bytes of answers received (frames' bodies)

    @classmethod
    async def connect(cls, host: str, port: int, source: str | None = None) -> AsyncStore:
        """Connect (from the local address ``source``, when given) and shake hands."""
        local = (source, 0) if source else None
        loop = asyncio.get_running_loop()
        _, frames = await loop.create_connection(_Frames, host, port, local_addr=local)
        try:
            challenge = await asyncio.wait_for(frames.early.get(), 60)
            if challenge.get("type") != "challenge":
                raise StoreError("the server did not send a challenge")
            max_frame = p.get_int(challenge, "max_frame")
            hello = {"type": "hello", "version": p.PROTOCOL_VERSION, "proof": None, "resume": []}
            assert frames.transport is not None
            frames.transport.write(p.encode(hello, p.HANDSHAKE_MAX_FRAME))
            frames.max_frame = max(max_frame, p.HANDSHAKE_MAX_FRAME)
            welcome = await asyncio.wait_for(frames.early.get(), 60)
            if welcome.get("type") != "welcome":
                raise StoreError(f"the server refused: {welcome}")
        except BaseException:
            if frames.transport is not None:
                frames.transport.abort()
            raise
        return cls(frames, max_frame)

    def _answer(self, answer: p.Message, size: int) -> None:
        self.bytes_in += size
        rid = answer.get("id")
        fut = self._pending.pop(rid, None) if isinstance(rid, int) else None
        if fut is not None and not fut.done():
            fut.set_result(answer)

    def _lost(self, exc: BaseException) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(StoreError(f"connection lost: {exc!r}"))
        self._pending.clear()

    async def _call(self, op: str, args: p.Message) -> object:
        rid = next(self._ids)
        fut: asyncio.Future[p.Message] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self.requests += 1
        self.by_op[op] = self.by_op.get(op, 0) + 1
        t0 = time.monotonic()
        self._transport.write(p.encode({"id": rid, "op": op, **args}, self._max_frame))
        answer = await fut
        if op not in ("watch", "wait"):
            self.max_latency = max(self.max_latency, time.monotonic() - t0)
        if answer.get("ok") is True:
            return answer.get("result")
        raise p.error_from_code(answer.get("code"), str(answer.get("message")))

    async def get(self, key: str) -> bytes | None:
        return p.opt_unb64(await self._call("get", {"key": key}), "result")

    async def set(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        result = await self._call("set", {"key": key, "value": p.b64(value), "lease": lease})
        return _int(result)

    async def add(self, key: str, amount: int) -> int:
        return _int(await self._call("add", {"key": key, "amount": amount}))

    async def compare_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: int | None = None
    ) -> tuple[bool, bytes | None]:
        args: p.Message = {
            "key": key,
            "expected": p.opt_b64(expected),
            "value": p.b64(value),
            "lease": lease,
        }
        result = await self._call("compare_set", args)
        assert isinstance(result, list)
        return bool(result[0]), p.opt_unb64(result[1], "current")

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        result = await self._call("get_prefix", {"prefix": prefix})
        assert isinstance(result, dict)
        items = result["items"]
        return {str(k): p.unb64(v, "value") for k, v in items.items()}, int(result["revision"])

    async def grant_lease(self, ttl: float) -> int:
        return _int(await self._call("grant_lease", {"ttl": ttl}))

    async def keep_alive(self, lease: int) -> bool:
        return bool(await self._call("keep_alive", {"lease": lease}))

    async def revoke_lease(self, lease: int) -> None:
        await self._call("revoke_lease", {"lease": lease})

    async def watch(self, prefix: str, after_revision: int, timeout: float) -> WatchResult:
        args: p.Message = {
            "prefix": prefix,
            "after": after_revision,
            "timeout": None if math.isinf(timeout) else max(0.0, timeout),
        }
        return p.watch_from_wire(await self._call("watch", args))

    async def wait(self, keys: list[str], timeout: float) -> None:
        args: p.Message = {"keys": keys, "timeout": None if math.isinf(timeout) else timeout}
        await self._call("wait", args)

    def abort(self) -> None:
        """Drop the connection as a crashed process would (no goodbye)."""
        self._transport.abort()

    async def close(self) -> None:
        self._transport.close()


def _int(value: object) -> int:
    """A number the server answered, as the threaded client (``store.tcp.client``) checks it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise StoreError(f"the store answered {value!r} where a number was expected")
    return value
