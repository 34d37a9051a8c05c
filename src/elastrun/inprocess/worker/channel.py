"""A worker's end of the agent's in-process channel (see ``wire.inprocess``).

A thread of the channel reads the agent's messages as they come, also while the
training function runs: a round can be announced to a worker whose collectives have
not failed (a node joins and the world grows, or the round is agreed before this
worker's peers broke). The thread then calls ``on_round``, which cuts the worker's
connections to the previous round's workers, so that its next collective fails and the
recovery loop takes the round. It also takes the agent's answers to the worker's
questions (``peer_failed``: did a peer fail, or was the error the worker's own?).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from elastrun.core.cancel import CancelScope
from elastrun.core.threads import Nursery
from elastrun.wire import inprocess as wire


class Channel:
    """One connection to the agent, kept for the worker's life."""

    def __init__(self, sock: socket.socket, local_rank: int) -> None:
        self._sock = sock
        self._reader = wire.LineReader()
        self._cond = threading.Condition()
        self._rounds: list[dict[str, Any]] = []  # announced, not yet taken
        self._newest = -1  # the newest round the thread has seen
        self._answers: dict[int, bool] = {}  # round -> whether a peer failed in it
        self._ended = False
        self.local_rank = local_rank
        #: Called from the reading thread with each round newer than any before it.
        self.on_round: Callable[[dict[str, Any]], object] | None = None
        self._nursery = Nursery(join_timeout=5)

    @classmethod
    def from_env(cls) -> Channel | None:
        """The channel the agent offers (None outside elastrun, or when it is gone)."""
        path = os.environ.get(wire.SOCKET_ENV)
        if not path:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return None
        sock.set_inheritable(False)
        return cls(sock, int(os.environ.get("LOCAL_RANK", "0")))

    def start(self) -> None:
        """Start reading the agent's messages (a daemon thread), unless it reads already,
        the agent ended the channel, or it is closed. Idempotent."""
        if not (self._ended or self._nursery.closed or self._nursery.running()):
            self._nursery.start(self._read, name="elastrun-inprocess-channel")

    def send(self, op: str, **fields: Any) -> None:
        with contextlib.suppress(OSError):  # the agent is gone: it announces no round either
            self._sock.sendall(wire.encode({"op": op, "local_rank": self.local_rank, **fields}))

    def wait_round(self, after: int, timeout: float) -> dict[str, Any] | None:
        """The newest round message past ``after`` (None: none within ``timeout``, or
        the agent closed the channel). Rounds announced while this worker was busy
        supersede each other: only the newest is taken."""
        self.start()
        with self._cond:
            self._cond.wait_for(lambda: self._ended or self._round_after(after), timeout)
            newest = self._round_after(after)
            self._rounds = []
            return newest

    def _round_after(self, after: int) -> dict[str, Any] | None:
        """The newest round announced, if it is past ``after`` (the condition held)."""
        newest = max(self._rounds, key=lambda m: int(m.get("round", -1)), default=None)
        return newest if newest is not None and int(newest.get("round", -1)) > after else None

    def peer_failed(self, round_no: int, timeout: float) -> bool:
        """Ask the agent whether a peer failed in round ``round_no`` (see the wire's
        ``ask``): True when it says so or announces a newer round (which ``wait_round``
        then takes); False when it says no peer failed, closes the channel, or does not
        answer within ``timeout``: then the error was the worker's own."""
        self.start()
        with self._cond:
            if self._newest > round_no:
                return True  # (told already: no need to ask)
            self._answers.pop(round_no, None)  # (a question about the round asked before)
        self.send("ask", round=round_no)
        with self._cond:
            self._cond.wait_for(
                lambda: self._ended or self._newest > round_no or round_no in self._answers,
                timeout,
            )
            return self._newest > round_no or self._answers.pop(round_no, False)

    def newer_than(self, round_no: int) -> bool:
        """Whether a round newer than ``round_no`` was announced."""
        with self._cond:
            return self._newest > round_no

    def _read(self, _scope: CancelScope) -> None:  # (a recv: close ends it, see there)
        while True:
            try:
                data = self._sock.recv(65536)
                messages = self._reader.feed(data) if data else []
            except (OSError, wire.WireError):  # the channel ends, as when the agent closes it
                data, messages = b"", []
            for message in messages:
                try:
                    n = int(message.get("round", -1))
                except (TypeError, ValueError):
                    continue
                if message.get("op") == "round":
                    self._take(n, message)
                elif message.get("op") == "answer":
                    with self._cond:
                        self._answers[n] = bool(message.get("peer_failed"))
                        self._cond.notify_all()
            if not data:
                with self._cond:
                    self._ended = True
                    self._cond.notify_all()
                return

    def _take(self, n: int, message: dict[str, Any]) -> None:
        if n > self._newest and self.on_round is not None:
            # Before the loop may take the round: what on_round cuts belongs to the
            # previous round, never to what the loop makes for this one.
            with contextlib.suppress(Exception):  # never let the reader die of it
                self.on_round(message)
        with self._cond:
            self._newest = max(self._newest, n)
            self._rounds.append(message)
            self._cond.notify_all()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # ends the reading thread's recv
        self._nursery.close()
        self._sock.close()

    def __repr__(self) -> str:
        return f"Channel(local_rank={self.local_rank}, newest_round={self._newest})"
