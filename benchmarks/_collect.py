"""Workers report to the benchmark over a Unix socket; their exits are noticed as EOF.

A worker connects to the collector's socket and writes JSON lines (``{"ev": ..., "t":
time.time(), ...}``). The collector, a thread with a selector, stamps each line with its
own receive time and keeps it. When the worker dies -- SIGKILL included -- the kernel
closes its socket, so the collector learns the moment of death without polling and
without being the worker's parent. The benchmark can also write to the workers (a line
that tells idle workers to finish).

The socket is created non-inheritable, so a worker's own children cannot hold it open
past the worker's death.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Worker side, pasted into worker scripts: connect, then `tell("event", key=value)`.
WORKER_SNIPPET = """\
import json as _json, socket as _socket
_SOCK = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
_SOCK.connect(COLLECTOR)

def tell(ev, t=None, **kw):
    msg = {"ev": ev, "t": time.time() if t is None else t, **kw}
    _SOCK.sendall((_json.dumps(msg) + "\\n").encode())
"""


@dataclass
class Conn:
    """One worker's connection: its messages (receive time, message) and when it ended."""

    index: int
    messages: list[tuple[float, dict[str, object]]] = field(default_factory=list)
    t_eof: float | None = None

    @property
    def hello(self) -> dict[str, object]:
        return self.messages[0][1] if self.messages else {}

    def first(self, ev: str) -> dict[str, object] | None:
        for _, msg in self.messages:
            if msg.get("ev") == ev:
                return msg
        return None


class Collector:
    """The server side; use as a context manager (its thread stops on exit)."""

    def __init__(
        self,
        path: Path,
        on_message: Callable[[Conn, dict[str, object]], None] | None = None,
    ) -> None:
        self.path = path
        self._on_message = on_message
        self._sel = selectors.DefaultSelector()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(1024)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        self._cond = threading.Condition()
        self._socks: dict[int, socket.socket] = {}
        self._bufs: dict[int, bytearray] = {}
        self.conns: list[Conn] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="bench-collector", daemon=True)

    def __enter__(self) -> Collector:
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=10)
        for s in list(self._socks.values()):
            s.close()
        self._socks.clear()
        self._listener.close()
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    # -- the benchmark's side ---------------------------------------------------------

    def wait(self, predicate: Callable[[list[Conn]], bool], timeout_s: float) -> bool:
        """Block until `predicate(conns)` holds (evaluated under the lock) or timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self.conns):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def snapshot(self) -> list[Conn]:
        with self._cond:
            return [Conn(c.index, list(c.messages), c.t_eof) for c in self.conns]

    def send_all(self, line: bytes) -> None:
        """Write `line` to every live worker (a small message: it never blocks)."""
        with self._cond:
            socks = list(self._socks.values())
        for s in socks:
            with contextlib.suppress(OSError):
                s.send(line)

    # -- the thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select():
                if key.data == "wake":
                    return
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            with self._cond:
                index = len(self.conns)
                self.conns.append(Conn(index))
                self._socks[index] = sock
                self._bufs[index] = bytearray()
            self._sel.register(sock, selectors.EVENT_READ, index)

    def _read(self, index: int) -> None:
        sock = self._socks[index]
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        now = time.time()
        if not data:
            self._sel.unregister(sock)
            sock.close()
            with self._cond:
                del self._socks[index]
                self.conns[index].t_eof = now
                self._cond.notify_all()
            return
        buf = self._bufs[index]
        buf += data
        lines = []
        while (cut := buf.find(b"\n")) >= 0:
            lines.append(bytes(buf[:cut]))
            del buf[: cut + 1]
        for raw in lines:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            conn = self.conns[index]
            with self._cond:
                conn.messages.append((now, msg))
                self._cond.notify_all()
            if self._on_message is not None:
                self._on_message(conn, msg)

    def __repr__(self) -> str:
        return f"Collector({self.path}, conns={len(self.conns)}, live={len(self._socks)})"
