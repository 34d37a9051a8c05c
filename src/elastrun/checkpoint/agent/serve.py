"""The node directory served to the other agents, read-only, and the client that reads it.

Each agent serves its node's memory checkpoints on a TCP port bound to the node's
address (the one the rendezvous knows it by; in tests 127.0.0.1), so that other agents
can copy its pieces -- its buddy in the background, any node before a round when it
needs a lost node's pieces. Three requests, over HTTP/1.1 (the standard library's
server and client, kept alive across a step's files):

- ``GET /list``: what the node holds (``holdings.scan``), the global ranks of its
  workers in the current round, the newest step they agreed on (their reports), and
  ``changes``, which names this state of the node's own steps; with
  ``?after=<changes>&hold=<seconds>`` the answer waits until that state changed, at
  most ``hold`` seconds (``HOLD_MAX`` at most), or the server closes;
- ``GET /file/<where>/<name>``: one piece's file (``where``: a step directory under the
  node directory; ``name``: ``rank-<R>.data``, ``.meta.json`` or ``.done``), sent with
  ``sendfile`` (no copy through Python);
- ``POST /copied/<step>``: the copier says it holds the node's ``step``; the server
  writes ``copied-<step>`` (which the ranks' saves wait for) and keeps the newest two.

Every request carries the node's token (``X-Elastrun-Token``), which the agent made at
random and published only in the rendezvous store, with the address: a checkpoint is
the model's state, and the port is reachable on the node's network. A request without
it is refused (403) before anything is read. Nothing outside the node directory's step
directories can be named (a path is matched against the layout, never joined blindly).

Why HTTP: the standard library has both ends, with keep-alive and ``sendfile``; the
agent never imports torch, and a worker never talks to it.

**A held listing, not a poll.** The buddy's copier must start a copy as soon as the
node's ranks wrote a step, and a step can come every few milliseconds: a poll every
20 ms is 50 requests a second per node, each a scan of the pieces and a JSON document,
whether or not anything was saved. So the copier names the state it last saw and the
server holds its request until the state changes: one request per change (or per
``hold`` when nothing happens). The server tells a change by the names in the node
directory and in its own step directories, with their inodes (:func:`changes`; every
file there appears by a rename or goes by an unlink: a marker, a report, a copy's
confirmation), looked at every ``WATCH_EVERY`` seconds on the node itself: a few
``getdents`` calls, no request, no scan of the markers. The standard library has no
file-change notification (inotify), and a worker never talks to its agent, so the
server looks; it does so only while a request is held.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import json
import logging
import math
import mmap
import os
import re
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from elastrun.checkpoint.agent.holdings import (
    Held,
    Listing,
    PeerError,
    listdir,
    newest_agreed,
    scan,
)
from elastrun.core import cancel
from elastrun.core.cancel import Cancelled
from elastrun.core.serving import NurseryRequests, Served
from elastrun.wire import checkpoint as layout

__all__ = [
    "HOLD_MAX",
    "TOKEN_HEADER",
    "WATCH_EVERY",
    "Listing",
    "NodeClient",
    "NodeServer",
    "PeerError",
    "changes",
]

log = logging.getLogger("elastrun.agent")

TOKEN_HEADER = "X-Elastrun-Token"
#: Seconds a peer's request may take to connect or to move its next bytes.
TIMEOUT = 10.0
#: The longest a listing is held (seconds): well within a client's ``TIMEOUT``.
HOLD_MAX = 5.0
#: Seconds between two looks at the node directory while a listing is held (a new step
#: is answered at most this late).
WATCH_EVERY = 0.01
#: Bytes read from the socket at a time when a file is pulled.
_CHUNK = 8 << 20
_FILE = re.compile(
    r"/file/((?:(?:copies/[A-Za-z0-9._-]+|gathered)/)?step-\d{12,})/(rank-\d+\.(?:data|meta\.json|done))"
)
_COPIED = re.compile(r"/copied/(\d+)")
#: The largest body a request may carry (a copy's versions: a few dozen bytes per rank).
_BODY_MAX = 1 << 20


class NodeServer:
    """Serves the node directory ``directory`` on ``addr`` (a free port) to holders of
    ``token``. :meth:`start` binds and starts its thread; :meth:`close` stops it.

    Args:
        directory: the node directory (read at each request: it changes).
        node: this node's id (said in the listing).
        addr: the address to bind (the node's own, never all interfaces).
        token: what every request must carry.
    """

    def __init__(self, directory: str, node: str, addr: str, token: str) -> None:
        self._directory = directory
        self._node = node
        self._addr = addr
        self._token = token
        self._ranks: tuple[int, ...] = ()
        self._served: Served | None = None  # a fresh one per start(); close() closes it

    @property
    def port(self) -> int | None:
        return None if self._served is None else self._served.port

    def set_ranks(self, ranks: Sequence[int]) -> None:
        """The global ranks of the node's workers in the current round."""
        self._ranks = tuple(ranks)

    def start(self) -> int:
        """Bind and serve (once); the port.

        Raises:
            OSError: the address cannot be bound.
        """
        if self._served is None:
            self._served = Served(_Server((self._addr, 0), self), "elastrun-checkpoint-serve")
        return self._served.port

    def close(self) -> None:
        """Stop serving (idempotent; never raises)."""
        served, self._served = self._served, None
        if served is not None:
            served.close()

    # -- what the handler asks ---------------------------------------------------------

    def authorised(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token, self._token)

    def listing(self, after: str | None = None, hold: float = 0.0) -> dict[str, Any]:
        """What the node holds; once its state differs from ``after`` (a listing's
        ``changes``), waiting at most ``hold`` seconds (and ``HOLD_MAX``) for that, or
        until the server closes."""
        mark = changes(self._directory, self._ranks)
        # (On a thread of the server's nursery: its scope is current, and a close ends
        # the hold.)
        scope = cancel.current().child(min(max(hold, 0.0), HOLD_MAX))
        with contextlib.suppress(Cancelled), scope:
            while mark == after and not scope.expired():
                scope.sleep(WATCH_EVERY)  # (cut at the hold's end)
                mark = changes(self._directory, self._ranks)
        # (read after the mark: a change meanwhile makes the next request answer at once)
        return {
            "version": layout.VERSION,
            "node": self._node,
            "ranks": list(self._ranks),
            "newest": newest_agreed(self._directory),
            "pieces": [p._asdict() for p in scan(self._directory)],
            "changes": mark,
        }

    def file_path(self, where: str, name: str) -> str:
        return os.path.join(self._directory, where, name)

    def copied(self, step: int, versions: dict[str, str]) -> None:
        """Write ``copied-<step>`` with the versions copied (rank -> version), by a
        rename, and remove all but the newest two."""
        layout.replace_file(
            os.path.join(self._directory, layout.copied_name(step)), json.dumps(versions)
        )
        marks = sorted(
            s for s in map(layout.step_of_copied, listdir(self._directory)) if s is not None
        )
        for old in marks[:-2]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._directory, layout.copied_name(old)))

    def __repr__(self) -> str:
        return f"NodeServer(node={self._node!r}, addr={self._addr!r}, port={self.port})"


class _Server(NurseryRequests, HTTPServer):
    request_thread = "elastrun-checkpoint-request"

    def __init__(self, address: tuple[str, int], owner: NodeServer) -> None:
        self.owner = owner
        super().__init__(address, _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        # A peer that went away mid-file (its agent stopped, a copy given up): its
        # request ends; nothing here needs more than a debug line.
        log.debug("checkpoint server: a request from %s ended early", client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # A reply is its headers, then its body (or a file) in a second send: with Nagle's
    # algorithm the second waits for the peer's delayed acknowledgement of the first,
    # 40 ms on Linux, for each of a copy's requests.
    disable_nagle_algorithm = True

    @property
    def _owner(self) -> NodeServer:
        server = self.server
        assert isinstance(server, _Server)  # (the only server that takes this handler)
        return server.owner

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("checkpoint server: " + format, *args)

    def _refused(self) -> bool:
        if self._owner.authorised(self.headers.get(TOKEN_HEADER)):
            return False
        self._reply(403, b"")
        return True

    def _reply(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self._refused():
            return
        path, _, query = self.path.partition("?")
        if path == "/list":
            asked = urllib.parse.parse_qs(query)
            after = asked.get("after", [None])[0]
            try:
                hold = float(asked.get("hold", ["0"])[0])
            except ValueError:
                hold = math.nan
            if math.isnan(hold):
                self._reply(400, b"")
                return
            self._reply(200, json.dumps(self._owner.listing(after, hold)).encode())
            return
        match = _FILE.fullmatch(self.path)
        if match is None or ".." in self.path:
            self._reply(404, b"")
            return
        self._send_file(self._owner.file_path(match.group(1), match.group(2)))

    def do_POST(self) -> None:
        if self._refused():
            return
        match = _COPIED.fullmatch(self.path)
        if match is None:
            self._reply(404, b"")
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(min(length, _BODY_MAX)) or b"{}")
            versions = {str(rank): str(version) for rank, version in body.items()}
        except (ValueError, AttributeError):
            self._reply(400, b"")
            return
        try:
            self._owner.copied(int(match.group(1)), versions)
        except OSError:
            self._reply(500, b"")
            return
        self._reply(200, b"{}")

    def _send_file(self, path: str) -> None:
        try:
            fh = open(path, "rb")  # noqa: SIM115 (closed below, after sendfile)
        except OSError:
            self._reply(404, b"")
            return
        with fh:
            size = os.fstat(fh.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.flush()
            if size:
                self.connection.sendfile(fh, 0, size)


class NodeClient:
    """Reads one peer's node directory (``addr``, ``port``, ``token``: as it published).

    Not thread-safe: one connection, kept alive; one client per thread.
    """

    def __init__(self, addr: str, port: int, token: str, timeout: float = TIMEOUT) -> None:
        self.addr = addr
        self.port = port
        self._token = token
        self._timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False

    def abort(self) -> None:
        """From another thread: end the request in flight at once (its socket is shut
        down; the request raises ``PeerError``, and so does every later one, without
        trying again). A connection still being made is not cut: it ends at its
        timeout."""
        self._aborted = True
        conn = self._conn
        sock = getattr(conn, "sock", None) if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def listing(self, after: str | None = None, hold: float = 0.0) -> Listing:
        """What the peer holds; with ``after`` (an earlier listing's ``changes``), once
        that changed, or after ``hold`` seconds (see the module).

        Raises:
            PeerError: it cannot be reached, or answered nonsense.
        """
        path = "/list"
        if after is not None:
            path += "?" + urllib.parse.urlencode({"after": after, "hold": f"{hold:.3f}"})
        body = self._request("GET", path, lambda resp, _n: resp.read())
        try:
            doc = json.loads(body)
            pieces = [Held(**p) for p in doc["pieces"]]
            newest = doc["newest"]
            return Listing(str(doc["node"]), tuple(int(r) for r in doc["ranks"]),
                           None if newest is None else int(newest), pieces,
                           str(doc.get("changes", "")))  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise PeerError(f"{self.addr}:{self.port} listed nonsense: {exc!r}") from exc

    def fetch(self, where: str, name: str, dest: str, size: int) -> None:
        """Copy the peer's ``<where>/<name>`` into the file ``dest`` (made; replaced),
        which must end with ``size`` bytes.

        Raises:
            PeerError: it cannot be read (gone, another size, the peer gone).
            OSError: ``dest`` cannot be written.
        """

        def into_file(resp: http.client.HTTPResponse, length: int) -> bytes:
            if length != size:
                raise PeerError(f"{where}/{name}: {length} bytes served, {size} expected")
            fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _receive(resp, fd, size)
            finally:
                os.close(fd)
            return b""

        self._request("GET", f"/file/{where}/{name}", into_file)

    def copied(self, step: int, versions: dict[int, str]) -> None:
        """Tell the peer that its ``step`` is copied here: ``versions`` of its ranks'
        pieces (rank -> ``piece_version``).

        Raises:
            PeerError: it cannot be told.
        """
        body = json.dumps({str(rank): v for rank, v in versions.items()}).encode()
        self._request("POST", f"/copied/{step}", lambda resp, _n: resp.read(), body)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _request(
        self,
        method: str,
        path: str,
        take: Callable[[http.client.HTTPResponse, int], bytes],
        body: bytes | None = None,
    ) -> bytes:
        for attempt in (0, 1):  # a kept-alive connection the peer closed: once more
            if self._aborted:
                raise PeerError(f"{self.addr}:{self.port}{path}: the client was stopped")
            conn = self._conn or http.client.HTTPConnection(
                self.addr, self.port, timeout=self._timeout
            )
            self._conn = conn
            try:
                if conn.sock is None:
                    conn.connect()
                    if self._aborted:  # (stopped while it connected: its socket was not cut)
                        raise PeerError(f"{self.addr}:{self.port}{path}: the client was stopped")
                conn.request(method, path, body=body, headers={TOKEN_HEADER: self._token})
                resp = conn.getresponse()
                length = int(resp.getheader("Content-Length") or 0)
                if resp.status != 200:
                    resp.read()
                    raise PeerError(f"{self.addr}:{self.port}{path}: HTTP {resp.status}")
                return take(resp, length)
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                fresh = isinstance(exc, http.client.RemoteDisconnected | ConnectionResetError)
                if attempt == 0 and fresh:
                    continue
                raise PeerError(f"{self.addr}:{self.port}{path}: {exc}") from exc
            except PeerError:
                self.close()
                raise
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return f"NodeClient({self.addr}:{self.port})"


def _receive(resp: http.client.HTTPResponse, fd: int, size: int) -> None:
    """Read the response's ``size`` bytes straight into the file ``fd``: its memory
    is reserved first, then mapped, and the socket reads into the mapping (one copy;
    writing from a buffer would be two)."""
    if size == 0:
        return
    os.posix_fallocate(fd, 0, size)
    with mmap.mmap(fd, size) as mapped:
        view = memoryview(mapped)
        try:
            done = 0
            while done < size:
                n = resp.readinto(view[done : min(size, done + _CHUNK)])
                if not n:
                    raise PeerError(f"the peer closed with {size - done} bytes still to come")
                done += n
        finally:
            view.release()


def changes(directory: str, ranks: Sequence[int]) -> str:
    """What names the present state of the node directory ``directory`` for a held
    listing: the names and inodes of its entries and of its own step directories' (a
    file there appears by a rename and goes by an unlink, so each writing of a marker,
    a report or a copy's confirmation changes it), each of these directories' last
    change (a name and an inode freed and taken again: the time differs), and the
    round's ``ranks``."""
    digest = hashlib.blake2b(repr(tuple(ranks)).encode(), digest_size=12)
    for name, inode in _entries(directory, digest):
        digest.update(f"{name}\0{inode}\0".encode())
        if layout.step_of_dir(name) is not None:
            digest.update(b"/")
            for inner, inner_inode in _entries(os.path.join(directory, name), digest):
                digest.update(f"{inner}\0{inner_inode}\0".encode())
    return digest.hexdigest()


def _entries(path: str, digest: hashlib.blake2b) -> list[tuple[str, int]]:
    """The names in the directory ``path`` with their inodes, sorted (none: it cannot
    be read); its last change goes into ``digest`` first."""
    with contextlib.suppress(OSError), os.scandir(path) as it:
        digest.update(f"{os.stat(path).st_mtime_ns}\0".encode())
        return sorted((e.name, e.inode()) for e in it)
    return []
