"""The agent's end of the in-process channel (see ``wire.inprocess``).

One Unix socket per agent, in a private directory. Workers that use
``elastrun.inprocess.run`` connect and say hello (their opt-in); the agent announces
rounds to them, learns when each has synchronised, and answers their questions (did a
peer fail?). A thread of its own serves the socket and wakes the agent loop on every
message; the agent reads the hub's state, and decides the answers in its loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastrun.core.cancel import CancelScope
from elastrun.core.threads import Nursery
from elastrun.wire import inprocess as wire

log = logging.getLogger("elastrun.agent")

# A Unix socket's path must fit in 108 bytes: a long TMPDIR falls back to /tmp.
_PATH_ROOM = 90


@dataclass
class _Peer:
    sock: socket.socket
    reader: wire.LineReader = field(default_factory=wire.LineReader)
    local_rank: int | None = None
    pid: int | None = None


class InprocessHub:
    """Which local workers recover in place, and how far each got in a round."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._dir = _private_dir()
        self.path = os.path.join(self._dir, "s")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._lock = threading.Lock()
        self._peers: dict[socket.socket, _Peer] = {}
        self._hello: dict[int, tuple[int, int]] = {}  # local rank -> (pid, round)
        self._synced: dict[int, tuple[int, int]] = {}  # local rank -> (pid, round)
        self._joined: dict[int, tuple[int, int]] = {}  # local rank -> (pid, round)
        self._commits: dict[int, int] = {}  # local rank -> the commit it synchronised to
        self._asked: dict[int, tuple[int, int]] = {}  # local rank -> (pid, round) unanswered
        self._lost: dict[int, int] = {}  # local rank -> pid: it found the newest commit lost
        # local rank -> (pid, round, message): the newest round announced to that worker,
        # also when its hello had not come yet (a replacement started for a round that was
        # abandoned before it said hello): its hello is answered with it (see _note).
        self._announced: dict[int, tuple[int, int, bytes]] = {}
        self._nursery = Nursery(join_timeout=5)
        self._nursery.start(self._serve, name="elastrun-inprocess")

    # -- what the agent asks ------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """What every worker's environment gets so that it can opt in."""
        return {wire.SOCKET_ENV: self.path}

    def opted_in(self, local_rank: int, pid: int) -> bool:
        with self._lock:
            return self._hello.get(local_rank, (None, 0))[0] == pid

    def synced(self, local_rank: int, pid: int, round_no: int) -> bool:
        with self._lock:
            return self._synced.get(local_rank) == (pid, round_no)

    def has_synced(self, local_rank: int, pid: int) -> bool:
        """Whether that worker synchronised in some round (it holds a commit's state)."""
        with self._lock:
            return self._synced.get(local_rank, (None, 0))[0] == pid

    def said_lost(self, pids: Mapping[int, int]) -> bool:
        """Whether any of the workers ``pids`` (local rank -> pid) found the round's
        newest commit lost (``CommitLostError``): no in-place round can restore it."""
        with self._lock:
            return any(self._lost.get(lr) == pid for lr, pid in pids.items())

    def commit(self, local_rank: int) -> int:
        """The commit that worker holds since its last synchronisation (0: none)."""
        with self._lock:
            return self._commits.get(local_rank, 0)

    def joined(self, local_rank: int, pid: int, round_no: int) -> bool:
        """Whether that worker took round ``round_no`` (or already synchronised in it)."""
        with self._lock:
            said = (self._joined.get(local_rank), self._synced.get(local_rank))
        return (pid, round_no) in said

    def questions(self) -> dict[int, tuple[int, int]]:
        """The unanswered questions (did a peer fail?): local rank -> (pid, round)."""
        with self._lock:
            return dict(self._asked)

    def answer(self, local_rank: int, pid: int, round_no: int, peer_failed: bool) -> None:
        """Answer that worker's question about round ``round_no`` (an answer for a
        question it no longer waits on is dropped)."""
        with self._lock:
            if self._asked.get(local_rank) == (pid, round_no):
                del self._asked[local_rank]
            peers = [p for p in self._peers.values() if (p.local_rank, p.pid) == (local_rank, pid)]
        message = wire.encode({"op": "answer", "round": round_no, "peer_failed": peer_failed})
        for peer in peers:
            _send(peer, message)

    def forget(self, local_rank: int, pid: int) -> None:
        """Drop that worker's question (it exited, or was replaced)."""
        with self._lock:
            if self._asked.get(local_rank, (None, None))[0] == pid:
                del self._asked[local_rank]

    def announce(
        self,
        round_no: int,
        envs: dict[int, dict[str, str]],
        pids: dict[int, int],
        cut: list[str] | None = None,
    ) -> None:
        """Send round ``round_no`` to the workers ``pids`` (local rank -> pid) with their
        environment, and the endpoints whose connections they cut (``cut``)."""
        with self._lock:
            for lr, pid in pids.items():
                env = {k: v for k, v in envs[lr].items() if k in wire.ROUND_VARIABLES}
                message = {"op": "round", "round": round_no, "env": env, "cut": cut or []}
                self._announced[lr] = (pid, round_no, wire.encode(message))
            # Sent under the lock, so that a hello taken meanwhile by the serving thread
            # is answered either here or there, and never with an older round after a
            # newer one (the messages are small, the sockets never full for long).
            for peer in self._peers.values():
                if peer.local_rank in pids and peer.pid == pids[peer.local_rank]:
                    _send(peer, self._announced[peer.local_rank][2])
            # (a replaced worker's connection, still closing, is not sent the round)

    # -- serving -------------------------------------------------------------------------

    def _serve(self, scope: CancelScope) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ, "listen")
            sel.register(scope.fileno(), selectors.EVENT_READ, "stop")
            while True:
                for key, _ in sel.select():
                    if key.data == "stop":
                        return
                    if key.data == "listen":
                        self._accept(sel)
                    else:
                        self._read(sel, key.fileobj)  # type: ignore[arg-type]  # a peer socket

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        sock.setblocking(False)
        with self._lock:
            self._peers[sock] = _Peer(sock)
        sel.register(sock, selectors.EVENT_READ, "peer")

    def _read(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        peer = self._peers[sock]
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        messages: list[dict[str, Any]] = []
        try:
            messages = peer.reader.feed(data) if data else []
        except wire.WireError as exc:
            log.debug("in-process channel: %s", exc)
            data = b""
        for message in messages:
            if not self._note(peer, message):
                data = b""  # a worker of another version: it recovers as torchrun's do
                break
        if not data:
            sel.unregister(sock)
            with self._lock:
                self._peers.pop(sock, None)
            sock.close()
        if messages:
            self._wake()

    def _note(self, peer: _Peer, message: dict[str, Any]) -> bool:
        """Take in one message; False: the connection is to be closed."""
        try:
            lr, round_no = int(message["local_rank"]), int(message.get("round", 0))
        except (KeyError, TypeError, ValueError):
            return True
        op = message["op"]
        if op == "hello" and (problem := wire.version_problem(message)) is not None:
            log.warning("local rank %d is not recovered in place: its hello says %s", lr, problem)
            return False
        with self._lock:
            if op == "hello":
                peer.local_rank, peer.pid = lr, int(message.get("pid", 0))
                self._hello[lr] = (peer.pid, round_no)
                pid, newest, announced = self._announced.get(lr, (None, -1, b""))
                if pid == peer.pid and newest > round_no:
                    # Started into a round that was abandoned before this hello came:
                    # told the newest at once, it leaves the old round's store alone.
                    _send(peer, announced)
            elif op == "synced" and peer.pid is not None:
                self._synced[lr] = (peer.pid, round_no)
                with contextlib.suppress(TypeError, ValueError):
                    self._commits[lr] = int(message.get("commit", 0))
            elif op == "joined" and peer.pid is not None:
                self._joined[lr] = (peer.pid, round_no)
            elif op == "ask" and peer.pid is not None:
                self._asked[lr] = (peer.pid, round_no)
            elif op == "lost" and peer.pid is not None:
                self._lost[lr] = peer.pid
        return True

    def close(self) -> None:
        self._nursery.close()
        with self._lock:
            peers = list(self._peers)
            self._peers.clear()
        for sock in peers:
            sock.close()
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"InprocessHub({self.path!r}, opted_in={sorted(self._hello)})"


def _send(peer: _Peer, data: bytes) -> None:
    with contextlib.suppress(OSError):
        peer.sock.sendall(data)


def _private_dir() -> str:
    base = tempfile.gettempdir()
    if len(base) > _PATH_ROOM - 30:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="elastrun-ip-", dir=base)
