"""The worker server: torch's worker-server routes over HTTP on a unix socket."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler
from socketserver import UnixStreamServer

from elastrun.control_plane.handlers import DEFAULT_HANDLERS, SERVER_THREAD
from elastrun.control_plane.protocol import HANDLER_PREFIX, Handler, WorkerServerError, reachable
from elastrun.core.serving import NurseryRequests, Served

__all__ = ["WorkerServer"]

log = logging.getLogger(__name__)

_MAX_REQUEST_BODY = 1 << 20


class _UnixHTTPServer(NurseryRequests, UnixStreamServer):
    handlers: Mapping[str, Handler]

    def server_bind(self) -> None:
        with reachable(str(self.server_address)) as short:
            self.socket.bind(short)


class _RequestHandler(BaseHTTPRequestHandler):
    server: _UnixHTTPServer
    server_version = "elastrun-worker"
    timeout = 10.0  # a client that sends nothing must not hold a thread forever

    def _route(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_REQUEST_BODY:
            self._reply(413, b"request body too large\n", "text/plain")
            return
        if length:
            self.rfile.read(length)  # handlers take no input; drain it for the client
        path = self.path.split("?", 1)[0]
        if path in (HANDLER_PREFIX.rstrip("/"), HANDLER_PREFIX):
            names = json.dumps(sorted(self.server.handlers)).encode()
            self._reply(200, names, "application/json")
        elif path == "/":
            self._reply(200, b"elastrun worker server: see /handler/\n", "text/plain")
        elif path.startswith(HANDLER_PREFIX):
            self._call(path[len(HANDLER_PREFIX) :])
        else:
            self._reply(404, f"no such path: {path}\n".encode(), "text/plain")

    do_GET = do_POST = _route

    def _call(self, name: str) -> None:
        handler = self.server.handlers.get(name)
        if handler is None:
            self._reply(404, f"handler {name!r} not found\n".encode(), "text/plain")
            return
        try:
            body, content_type = handler()
        except Exception as exc:
            log.exception("worker server handler %s failed", name)
            self._reply(500, f"{name} failed: {exc!r}\n".encode(), "text/plain")
            return
        self._reply(200, body, content_type)

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:
        return "unix-socket"  # a unix peer has no address; the base class would fail

    def log_message(self, format: str, *args: object) -> None:
        # Requests must not end up in the training job's stderr.
        log.debug("worker server: %s", format % args)


class WorkerServer:
    """An HTTP server on a unix socket answering torch's worker-server routes.

    Args:
        socket_path: where to listen. A stale socket file (nobody listening) is
            replaced; a live one, or any other kind of file, is an error.
        handlers: name -> handler; ping and dump_traceback by default.

    The constructor does no I/O; :meth:`start` binds and starts the daemon thread.
    """

    def __init__(self, socket_path: str, handlers: Mapping[str, Handler] | None = None) -> None:
        self.socket_path = socket_path
        self.handlers = dict(DEFAULT_HANDLERS if handlers is None else handlers)
        self._served: Served | None = None  # a fresh one per start(); shutdown() closes it
        self._inode: int | None = None

    def start(self) -> None:
        """Listen on the socket and answer requests from a daemon thread.

        Raises:
            WorkerServerError: the path is in use by a live server or is not a socket,
                or the socket cannot be created (missing directory, permissions).
        """
        if self._served is not None:
            return
        _clear_stale_socket(self.socket_path)
        try:
            server = _UnixHTTPServer(self.socket_path, _RequestHandler)
        except OSError as exc:
            raise WorkerServerError(
                f"cannot listen on {self.socket_path}: {exc.strerror or exc}"
            ) from exc
        server.handlers = self.handlers
        self._inode = os.stat(self.socket_path).st_ino
        self._served = Served(server, SERVER_THREAD)

    def shutdown(self) -> None:
        """Stop serving and remove the socket file. Idempotent; never raises."""
        served, self._served = self._served, None
        if served is None:
            return
        served.close("shut down")
        # Only our own socket: a later server may have replaced the file meanwhile.
        try:
            if os.stat(self.socket_path).st_ino == self._inode:
                os.unlink(self.socket_path)
        except OSError as exc:
            log.debug("could not remove %s: %s", self.socket_path, exc)

    @property
    def running(self) -> bool:
        return self._served is not None

    def __enter__(self) -> WorkerServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"WorkerServer(socket_path={self.socket_path!r}, "
            f"handlers={sorted(self.handlers)}, running={self.running})"
        )


def _clear_stale_socket(path: str) -> None:
    """Remove a socket file nobody listens on (left by a killed worker)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise WorkerServerError(f"cannot use {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISSOCK(mode):
        raise WorkerServerError(f"cannot listen on {path}: it exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        with reachable(path) as short:
            probe.connect(short)
    except OSError:
        os.unlink(path)  # refused: nobody listens there any more
        return
    finally:
        probe.close()
    raise WorkerServerError(f"cannot listen on {path}: another server is listening there")
