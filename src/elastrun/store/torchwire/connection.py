"""One torch client's connection: validation, requests, answers, back-pressure.

Everything here runs on the server's event loop. A connection is an
``asyncio.Protocol``: each request is answered inside ``data_received`` -- no task per
request -- and a blocked ``wait`` is only a :class:`~.state.Waiter` whose wake-up
writes the answer. Thousands of idle or waiting clients therefore cost a socket and a
few objects each.

A client that breaks the protocol loses its own connection and nothing else. Who may
connect is bounded as for the rendezvous store (``elastrun.store.tcp.acceptor``, which
accepts for this engine too, says how). What a connection may hold is bounded: its
unparsed input by the request size limit (the parser refuses an oversized field from
its length, before buffering it), its unsent output by pausing its reads while the
kernel will not take more (a client that pipelines ``get``s without reading the
answers stops being read, not served into memory), and its waiting by one ``wait`` at
a time (torch's client is synchronous; a second one is a protocol error).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import cast

from elastrun.core.errors import StoreError
from elastrun.store.tcp.acceptor import Admissions
from elastrun.store.tcp.connection import format_addr
from elastrun.store.tcp.protocol import tune_socket
from elastrun.store.torchwire import codec as c
from elastrun.store.torchwire.limits import LISTENER_OPTIONS_INHERITED, Complaints, Limits
from elastrun.store.torchwire.state import TorchStoreState, Waiter

log = logging.getLogger("elastrun.store.torchwire")


class Hub(Admissions["Connection"]):
    """What every connection of one server shares: the state, limits and registry."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: Limits) -> None:
        super().__init__(loop, functools.partial(Connection, self))
        self.state = TorchStoreState()
        self.limits = limits
        self.complain = Complaints(loop.time)

    def __repr__(self) -> str:
        return (
            f"Hub(connections={len(self.conns)}, unvalidated={len(self.handshaking)}, "
            f"{self.state!r})"
        )


class Connection(asyncio.Protocol):
    """One client: validated by its first request, then served until it closes."""

    def __init__(self, hub: Hub) -> None:
        self._hub = hub
        self._state = hub.state
        self._parser = c.RequestParser(hub.limits.max_frame, hub.limits.max_key)
        self._transport: asyncio.Transport | None = None
        self._validated = False
        self._paused = False  # the peer is not reading its answers: stop reading
        self._closed = False
        # Validated, open, read, nothing held by the parser: the next read starts with a
        # request that the fast path may serve (kept up to date at each change of those).
        self._plain = False
        self._max_key, self._max_frame = hub.limits.max_key, hub.limits.max_frame
        self._waiter: Waiter | None = None
        self._peer: str | None = None
        # Answers of the requests served in one read, sent in one write (see _serve).
        self._out: list[bytes] = []
        self._out_size = 0
        self._serving = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "ready" if self._validated else "new"
        waiting = ", waiting" if self._waiter is not None else ""
        return f"Connection({self.peer}, {state}{waiting})"

    # -- transport events ----------------------------------------------------------------

    @property
    def peer(self) -> str:
        """The client's address, for messages (looked up on first use: a system call
        that thousands of connections need not make while nothing goes wrong)."""
        if self._peer is None:
            peer = self._transport.get_extra_info("peername") if self._transport else None
            self._peer = format_addr(str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else "?"
        return self._peer

    def close_unauthenticated(self) -> None:
        """Close a connection that has not validated, to make room for a newer one."""
        if not self._validated and not self._closed:
            self._hub.unauthenticated_closed += 1
        self.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream server's
        if self._closed:  # closed to make room between the hand-over and now
            transport.close()
            return
        hub = self._hub
        hub.register(self)  # (made by the acceptor: counted already)
        if len(hub.conns) > hub.limits.max_connections:
            # Accepted only to be closed: a refused client (torch's) retries with
            # back-off until its timeout, by when others may have left.
            hub.complain(
                "refusing the connection from %s: %d clients are connected (the limit)",
                self.peer,
                len(hub.conns) - 1,
            )
            self._closed = True
            hub.handshaking.pop(self, None)
            transport.close()
            return
        if not LISTENER_OPTIONS_INHERITED:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    tune_socket(sock)
                except OSError as exc:  # the peer may already be gone; the read will tell
                    log.debug("socket options for %s: %r", self.peer, exc)

    def data_received(self, data: bytes) -> None:
        if self._plain:
            try:
                used = self._serve_fast(data)
            except StoreError as exc:  # NotANumberError: this client's fault
                self._hub.complain("closing the connection from %s: %s", self.peer, exc)
                self.close()
                return
            if used == len(data):
                return
            data = data[used:]
        elif self._closed:
            return
        self._parser.feed(data)
        self._serve_buffered()
        self._replan()

    def _replan(self) -> None:
        self._plain = (
            self._validated and not self._paused and not self._closed and self._parser.empty
        )

    def _serve_fast(self, data: bytes) -> int:
        """Serve the whole get, set, add, compare_set and ping requests at the start of
        ``data`` (what torch's synchronous client sends in the steady state) without the
        parser, and write their answers at once; returns how many bytes they took. The
        rest (another command, a request cut by the read) goes to the parser after them.
        The answers are those of ``_ANSWERS``, the limits those of the parser."""
        n = len(data)
        at, answer = self._fast_one(data, 0, n)
        if at == n:  # the usual read: one request (the client waits for its answer)
            if answer and self._transport is not None:
                self._transport.write(answer)
            return n
        if at < 0:
            return 0
        answers = [answer]
        # After a wait left blocked, the parser serves the rest (see _serve_buffered):
        # a set among it that releases the wait then answers it after these answers.
        try:
            while at < n and self._waiter is None:
                end, answer = self._fast_one(data, at, n)
                if end < 0:
                    break
                answers.append(answer)
                at = end
        finally:  # a broken request (not a number) closes: what came before is answered
            out = b"".join(answers)
            if out and self._transport is not None:
                self._transport.write(out)
        return at

    def _fast_one(self, data: bytes, at: int, n: int) -> tuple[int, bytes]:
        """One request at ``data[at]`` (see ``_serve_fast``): where it ends and its
        answer (empty for none), or ``_NOT_FAST``."""
        op = data[at]
        if op == _PING:
            if at + 5 > n:
                return _NOT_FAST
            return at + 5, data[at + 1 : at + 5]  # the number, sent back
        if at + 9 > n or op not in _FAST_OPS:
            return _NOT_FAST
        if op == _GET:  # the commonest: checked first
            k: int = at + 9 + _U64_AT(data, at + 1)[0]  # where the key ends
            if k > n or k - at - 9 > self._max_key:
                return _NOT_FAST
            value = self._state.get(data[at + 9 : k])
            return k, _U64_PACK(len(value)) + value
        wait = op == _WAIT  # of one key (torch's get is a wait, then the get)
        if wait and (_U64_AT(data, at + 1)[0] != 1 or self._waiter is not None):
            return _NOT_FAST
        p = at + 17 if wait else at + 9  # where the key starts (its length before it)
        if p > n:
            return _NOT_FAST
        k = p + _U64_AT(data, p - 8)[0]
        if k > n or k - p > self._max_key:
            return _NOT_FAST
        if wait:
            self._waiter = self._state.wait((data[p:k],), self._wake)
            # (blocked: ``_wake`` answers when the key comes)
            return k, _STOP_WAITING if self._waiter is None else b""
        if k + 8 > n:
            return _NOT_FAST
        if op == _ADD:
            return k + 8, _I64_PACK(self._state.add(data[p:k], _I64_AT(data, k)[0]))
        v: int = k + 8 + _U64_AT(data, k)[0]  # where the (first) value ends
        if v > n or v - at > self._max_frame:
            return _NOT_FAST
        if op == _SET:
            self._state.set(data[p:k], data[k + 8 : v])
            return v, b""
        if v + 8 > n:  # compare_set: expected, then desired
            return _NOT_FAST
        w: int = v + 8 + _U64_AT(data, v)[0]
        if w > n or w - at > self._max_frame:
            return _NOT_FAST
        current = self._state.compare_set(data[p:k], data[k + 8 : v], data[v + 8 : w])
        return w, _U64_PACK(len(current)) + current

    def pause_writing(self) -> None:
        self._paused, self._plain = True, False
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self._transport is not None and not self._closed:
            self._transport.resume_reading()
            self._serve_buffered()
            self._replan()

    def eof_received(self) -> bool | None:
        if not self._parser.idle:
            log.debug("%s closed its side in the middle of a request", self.peer)
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed, self._plain = True, False
        self._drop_waiter()
        hub = self._hub
        hub.conns.discard(self)
        hub.handshaking.pop(self, None)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("connection from %s closed (%r)", self.peer, exc)
        hub.room()

    def close(self) -> None:
        """Close at once, dropping answers the kernel has not taken (used on protocol
        errors, after the answers before the broken request are written, to make room,
        and on stop)."""
        self._closed, self._plain = True, False
        self._drop_waiter()
        self._hub.handshaking.pop(self, None)
        if self._transport is not None:
            self._transport.abort()

    # -- requests ------------------------------------------------------------------------

    def _serve_buffered(self) -> None:
        # Every request already received is served before anything is written, and the
        # answers go out in one write: one send() for a client's pipelined requests
        # instead of one each. What waits unsent is bounded by _FLUSH_AT (plus one
        # answer): past it the answers are written, and a paused peer stops the loop.
        self._serving = True
        try:
            parser, state = self._parser, self._state
            while not self._closed and not self._paused:
                request = parser.next()
                if request is None:
                    break
                if not self._validated:
                    self._validate(request)
                    continue
                answer = _ANSWERS.get(request.op)
                if answer is not None:
                    out = answer(state, request)
                    if out is not None:
                        self._send(out)
                elif request.op in _HANDLERS:
                    _HANDLERS[request.op](self, request)
                else:  # VALIDATE again: torch's server closes too
                    raise c.ProtocolError(f"unexpected {request.op.name} request")
                if self._out_size >= _FLUSH_AT:
                    self._flush()
        except StoreError as exc:  # ProtocolError, NotANumberError: this client's fault
            self._hub.complain("closing the connection from %s: %s", self.peer, exc)
            self._flush()  # the answers before the broken request are its own
            self.close()
        except Exception as exc:  # a bug of ours: it costs this client, not every client
            self._hub.complain("internal error serving %s, closing it: %r", self.peer, exc)
            self.close()
        finally:
            self._serving = False
            self._flush()

    def _validate(self, request: c.Request) -> None:
        if request.op is not c.Op.VALIDATE or request.number != c.MAGIC:
            raise c.ProtocolError(
                f"its first request is {request.op.name} {request.number:#x}, not the "
                "validation a torch client sends (another protocol, or not torch?)"
            )
        self._validated = True
        if self._hub.handshaking.pop(self, None) is not None:
            self._hub.room()

    def _send(self, data: bytes) -> None:
        self._out.append(data)
        self._out_size += len(data)

    def _flush(self) -> None:
        out = self._out
        if not out:
            return
        self._out, self._out_size = [], 0
        if self._transport is not None and not self._closed:
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _multi_get(self, r: c.Request) -> None:
        for value in self._state.multi_get(r.keys):
            self._send(c.encode_bytes(value))
            if self._out_size >= _FLUSH_AT:  # the values may be large
                self._flush()

    # -- blocking requests ---------------------------------------------------------------

    def _wait(self, r: c.Request) -> None:
        """``wait`` and ``barrier``: answered when released, at once if they are."""
        if self._waiter is not None:
            raise c.ProtocolError(f"{r.op.name} while its previous wait is still blocked")
        if r.op is c.Op.BARRIER:
            self._waiter = self._state.barrier(r.key, r.number, self._wake)
        else:
            self._waiter = self._state.wait(r.keys, self._wake)
        if self._waiter is None:
            self._send(_STOP_WAITING)

    def _wake(self) -> None:
        # Called while serving another client (whose write released this one), or this
        # one: then the answer joins this read's others, in order.
        self._waiter = None
        self._send(_STOP_WAITING)
        if not self._serving:
            self._flush()

    def _cancel_wait(self, r: c.Request) -> None:
        # The client's wait timed out. If it was released meanwhile, the client
        # reads that STOP_WAITING first, then this answer: it expects both.
        self._drop_waiter()
        self._send(c.encode_byte(c.WaitReply.WAIT_CANCELED))

    def _drop_waiter(self) -> None:
        if self._waiter is not None:
            self._state.cancel(self._waiter)
            self._waiter = None


# The fast path's commands, as plain ints (a byte of the request compares with them).
_PING, _GET, _SET, _ADD, _COMPARE_SET, _WAIT = map(
    int, (c.Op.PING, c.Op.GET, c.Op.SET, c.Op.ADD, c.Op.COMPARE_SET, c.Op.WAIT)
)
_FAST_OPS = frozenset((_GET, _SET, _ADD, _COMPARE_SET, _WAIT))
_U64_AT, _I64_AT = c.U64.unpack_from, c.I64.unpack_from
_U64_PACK, _I64_PACK = c.U64.pack, c.I64.pack

#: Unsent answers a connection gathers before writing them: a read of small requests
#: is answered in one write, a large answer is written at once.
_FLUSH_AT = 64 * 1024
_STOP_WAITING = c.encode_byte(c.WaitReply.STOP_WAITING)
_NOT_FAST = (-1, b"")

#: What each command does to the table and answers (None: nothing), by command.
_ANSWERS: dict[c.Op, Callable[[TorchStoreState, c.Request], bytes | None]] = {
    c.Op.PING: lambda s, r: c.encode_u32(r.number),
    c.Op.SET: lambda s, r: s.set(r.key, r.values[0]),
    c.Op.COMPARE_SET: lambda s, r: c.encode_bytes(s.compare_set(r.key, *r.values)),
    c.Op.GET: lambda s, r: c.encode_bytes(s.get(r.key)),
    c.Op.ADD: lambda s, r: c.encode_i64(s.add(r.key, r.number)),
    c.Op.CHECK: lambda s, r: c.encode_byte(
        c.CheckReply.READY if s.check(r.keys) else c.CheckReply.NOT_READY
    ),
    c.Op.GETNUMKEYS: lambda s, r: c.encode_i64(s.num_keys),
    c.Op.DELETE_KEY: lambda s, r: c.encode_i64(int(s.delete(r.key))),
    c.Op.APPEND: lambda s, r: s.append(r.key, r.values[0]),
    c.Op.MULTI_SET: lambda s, r: s.multi_set(r.keys, r.values),
    c.Op.QUEUE_PUSH: lambda s, r: s.queue_push(r.key, r.values[0]),
    c.Op.QUEUE_POP: lambda s, r: c.encode_queue_pop(*s.queue_pop(r.key)),
    c.Op.QUEUE_LEN: lambda s, r: c.encode_i64(s.queue_len(r.key)),
    c.Op.LIST_KEYS: lambda s, r: c.encode_key_list(s.list_keys()),
}
#: The commands a connection serves itself (its wait, its flushes), by command; with
#: ``_ANSWERS``, all but VALIDATE, which only comes first.
_HANDLERS: dict[c.Op, Callable[[Connection, c.Request], None]] = {
    c.Op.WAIT: Connection._wait,
    c.Op.BARRIER: Connection._wait,
    c.Op.MULTI_GET: Connection._multi_get,
    c.Op.CANCEL_WAIT: Connection._cancel_wait,
}
