"""A worker's end of the agent's in-process channel (see ``core.inprocess_wire``)."""

from __future__ import annotations

import os
import selectors
import socket
import time
from typing import Any

from elastrun.core import inprocess_wire as wire


class Channel:
    """One connection to the agent, kept for the worker's life."""

    def __init__(self, sock: socket.socket, local_rank: int) -> None:
        self._sock = sock
        self._reader = wire.LineReader()
        self._pending: list[dict[str, Any]] = []
        self.local_rank = local_rank

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

    def send(self, op: str, **fields: Any) -> None:
        try:
            self._sock.sendall(wire.encode({"op": op, "local_rank": self.local_rank, **fields}))
        except OSError:
            pass  # the agent is gone: it will not announce a round either

    def wait_round(self, after: int, timeout: float) -> dict[str, Any] | None:
        """The newest round message past ``after`` (None: none within ``timeout``, or
        the agent closed the channel). Rounds announced while this worker was busy
        supersede each other: only the newest is taken."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            while True:
                ready = sel.select(0)  # first what already arrived
                if not ready:
                    newest = self._newest(after)
                    if newest is not None:
                        return newest
                    left = deadline - time.monotonic()
                    if left <= 0 or not sel.select(left):
                        return None
                try:
                    data = self._sock.recv(65536)
                except OSError:
                    return self._newest(after)
                if not data:
                    return self._newest(after)
                self._pending.extend(self._reader.feed(data))

    def _newest(self, after: int) -> dict[str, Any] | None:
        rounds = [m for m in self._pending if m.get("op") == "round"]
        self._pending = []
        best = max(rounds, key=lambda m: int(m.get("round", -1)), default=None)
        if best is None or int(best.get("round", -1)) <= after:
            return None
        return best

    def close(self) -> None:
        self._sock.close()

    def __repr__(self) -> str:
        return f"Channel(local_rank={self.local_rank})"
