"""The worker control plane: ask a running worker for its stacks over a unix socket.

A worker wraps its main code in :func:`worker_main`::

    from elastrun.control_plane import worker_main

    with worker_main():
        train()

When ``TORCH_WORKER_SERVER_SOCKET`` names a path, a small HTTP server listens on that
unix socket for as long as the ``with`` body runs, with the routes of torch's worker
server (``torch.distributed.elastic.control_plane``), so the same clients work:

* ``POST /handler/ping`` -> ``pong``;
* ``POST /handler/dump_traceback`` -> the Python stacks of every thread of the worker;
* ``GET /handler/`` -> a JSON list of the handler names;
* anything else -> 404 with a one-line explanation.

From a shell: ``curl -s -X POST --unix-socket worker.sock http://w/handler/dump_traceback``;
from Python: :func:`fetch_stacks`. An exception raised in the ``with`` body is written to
``TORCHELASTIC_ERROR_FILE`` exactly as ``record`` would write it (torch's ``worker_main``
stacks ``record`` on a context manager and so records nothing from the body).

The server is pure Python on a daemon thread, so it needs the GIL to answer: a worker
blocked in a C call that holds the GIL cannot reply (collectives, sleeps and I/O
release it). A ``faulthandler`` dump (enabled here on fatal signals) covers that case.

This module runs inside workers: it imports only the standard library,
``elastrun.core`` and ``elastrun.worker``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import stat
import sys
import threading
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler
from socketserver import ThreadingMixIn, UnixStreamServer

from elastrun.core.errors import ElastrunError
from elastrun.core.serving import serve_until_woken
from elastrun.worker.record import ErrorHandler, _forward_child_failure, get_error_handler

__all__ = [
    "ELASTRUN_WORKER_SERVER_SOCKET",
    "TORCH_WORKER_SERVER_SOCKET",
    "WorkerServer",
    "WorkerServerError",
    "call_handler",
    "dump_stacks",
    "fetch_many_stacks",
    "fetch_stacks",
    "list_handlers",
    "serve_from_env",
    "worker_main",
]

log = logging.getLogger(__name__)

TORCH_WORKER_SERVER_SOCKET = "TORCH_WORKER_SERVER_SOCKET"
#: Where elastrun's bootstrap serves for *every* worker (see :func:`serve_from_env`); a
#: separate variable so that a script calling torch's own ``worker_main`` (whose C++
#: server refuses a path that exists) can still use ``TORCH_WORKER_SERVER_SOCKET``.
ELASTRUN_WORKER_SERVER_SOCKET = "ELASTRUN_WORKER_SERVER_SOCKET"

#: A handler returns its body and content type; it takes no argument (as torch's do).
Handler = Callable[[], tuple[bytes, str]]

# sockaddr_un holds 108 bytes on Linux; longer paths are reached through a directory
# descriptor (see _reachable).
_MAX_SUN_PATH = 100
_MAX_REQUEST_BODY = 1 << 20
_SERVER_THREAD = "elastrun-worker-server"


class WorkerServerError(ElastrunError):
    """The worker server could not be started, reached, or gave an error answer."""


# ----------------------------------------------------------------------------- handlers


def dump_stacks(omit: Collection[int] = ()) -> str:
    """The current Python stack of every thread of this process, as text.

    Each thread starts with a header naming it (``Thread <ident> "<name>"``), the main
    thread first, then its stack, outermost call first.

    Args:
        omit: idents of threads listed by their header only (the worker server's own
            threads, whose stacks would only show the server answering).
    """
    frames = sys._current_frames()
    names = {t.ident: t for t in threading.enumerate()}
    main_ident = threading.main_thread().ident

    def order(ident: int) -> tuple[int, str]:
        thread = names.get(ident)
        return (0 if ident == main_ident else 1, thread.name if thread else "")

    parts: list[str] = []
    for ident in sorted(frames, key=order):
        thread = names.get(ident)
        label = f'"{thread.name}"' if thread is not None else "(not started by threading)"
        daemon = " daemon" if thread is not None and thread.daemon else ""
        if ident in omit:
            parts.append(f"Thread {ident} {label}{daemon}: the worker server, stack omitted\n\n")
            continue
        parts.append(f"Thread {ident} {label}{daemon} (most recent call last):\n")
        parts.extend(traceback.format_stack(frames[ident]))
        parts.append("\n")
    return "".join(parts)


def _ping() -> tuple[bytes, str]:
    return b"pong", "text/plain"


def _dump_traceback() -> tuple[bytes, str]:
    ours = {threading.get_ident()}
    ours.update(t.ident for t in threading.enumerate() if t.name == _SERVER_THREAD and t.ident)
    return dump_stacks(omit=ours).encode("utf-8", "replace"), "text/plain; charset=utf-8"


DEFAULT_HANDLERS: Mapping[str, Handler] = {"ping": _ping, "dump_traceback": _dump_traceback}


# ----------------------------------------------------------------------------- server


@contextlib.contextmanager
def _reachable(path: str) -> Iterator[str]:
    """A path naming the same socket that fits in ``sockaddr_un``.

    A long path (deep log directories easily pass 108 bytes) is reached as
    ``/proc/self/fd/<dir fd>/<name>`` through a descriptor of its directory; the
    alternative, ``chdir`` plus a relative name, would race with other threads.
    """
    if len(os.fsencode(path)) <= _MAX_SUN_PATH:
        yield path
        return
    directory, name = os.path.split(os.path.abspath(path))
    fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


class _UnixHTTPServer(ThreadingMixIn, UnixStreamServer):
    daemon_threads = True  # a request being answered must not keep the worker alive
    timeout = 0.0  # see serve_until_woken: handle_request() must never block
    handlers: Mapping[str, Handler]

    def server_bind(self) -> None:
        with _reachable(str(self.server_address)) as short:
            self.socket.bind(short)

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.setblocking(False)


class _RequestHandler(BaseHTTPRequestHandler):
    server: _UnixHTTPServer
    server_version = "elastrun-worker"
    timeout = 10.0  # a client that sends nothing must not hold a thread forever

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def _route(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_REQUEST_BODY:
            self._reply(413, b"request body too large\n", "text/plain")
            return
        if length:
            self.rfile.read(length)  # handlers take no input; drain it for the client
        path = self.path.split("?", 1)[0]
        if path in ("/handler", "/handler/"):
            names = json.dumps(sorted(self.server.handlers)).encode()
            self._reply(200, names, "application/json")
        elif path == "/":
            self._reply(200, b"elastrun worker server: see /handler/\n", "text/plain")
        elif path.startswith("/handler/"):
            self._call(path[len("/handler/") :])
        else:
            self._reply(404, f"no such path: {path}\n".encode(), "text/plain")

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
        self._server: _UnixHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._inode: int | None = None

    def start(self) -> None:
        """Listen on the socket and answer requests from a daemon thread.

        Raises:
            WorkerServerError: the path is in use by a live server or is not a socket,
                or the socket cannot be created (missing directory, permissions).
        """
        if self._server is not None:
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
        self._server = server
        self._wake = socket.socketpair()
        self._thread = threading.Thread(
            target=serve_until_woken,
            args=(server, self._wake[0]),
            name=_SERVER_THREAD,
            daemon=True,
        )
        self._thread.start()

    def shutdown(self) -> None:
        """Stop serving and remove the socket file. Idempotent; never raises."""
        server, thread, wake = self._server, self._thread, self._wake
        self._server = self._thread = self._wake = None
        if wake is not None:
            with contextlib.suppress(OSError):  # the thread is gone already: fine
                wake[1].send(b"x")
        if thread is not None:
            thread.join(timeout=5)
        if server is not None:
            server.server_close()
            self._remove_socket_file()
        if wake is not None:
            for end in wake:
                end.close()

    def _remove_socket_file(self) -> None:
        # Only our own socket: a later server may have replaced the file meanwhile.
        try:
            if os.stat(self.socket_path).st_ino == self._inode:
                os.unlink(self.socket_path)
        except OSError as exc:
            log.debug("could not remove %s: %s", self.socket_path, exc)

    @property
    def running(self) -> bool:
        return self._server is not None

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
        with _reachable(path) as short:
            probe.connect(short)
    except OSError:
        os.unlink(path)  # refused: nobody listens there any more
        return
    finally:
        probe.close()
    raise WorkerServerError(f"cannot listen on {path}: another server is listening there")


# ----------------------------------------------------------------------------- worker_main


def serve_from_env(environ: Mapping[str, str] | None = None) -> WorkerServer | None:
    """Start a :class:`WorkerServer` at ``ELASTRUN_WORKER_SERVER_SOCKET``, if set.

    For the worker bootstrap: every worker then answers stack requests, whether or
    not its script uses :func:`worker_main`. A server that cannot start is logged as a
    warning and None is returned (the worker runs anyway).

    Args:
        environ: the environment to read; ``os.environ`` by default.
    """
    path = (os.environ if environ is None else environ).get(ELASTRUN_WORKER_SERVER_SOCKET)
    return _start_or_warn(path) if path else None


def _start_or_warn(path: str) -> WorkerServer | None:
    server = WorkerServer(path)
    try:
        server.start()
    except WorkerServerError as exc:
        log.warning("worker server not started: %s", exc)
        return None
    return server


@contextlib.contextmanager
def worker_main(error_handler: ErrorHandler | None = None) -> Iterator[None]:
    """Run the ``with`` body as a worker's main code: record errors, serve requests.

    * Fatal-signal stack dumps are enabled (``faulthandler``), as ``record`` does.
    * If ``TORCH_WORKER_SERVER_SOCKET`` is set, a :class:`WorkerServer` listens there
      until the body ends. A server that cannot start is logged as a warning and the
      body runs anyway: training matters more than its debug port.
    * An exception escaping the body is recorded to ``TORCHELASTIC_ERROR_FILE`` the way
      ``record`` records it, then propagates. ``SystemExit`` and ``KeyboardInterrupt``
      are not recorded.

    Also usable as a decorator, ``@worker_main()``, like torch's.

    Args:
        error_handler: the handler to record with; a new default one if None.
    """
    handler = error_handler if error_handler is not None else get_error_handler()
    handler.initialize()
    path = os.environ.get(TORCH_WORKER_SERVER_SOCKET)
    server = _start_or_warn(path) if path else None
    try:
        yield
    except Exception as exc:
        if not _forward_child_failure(handler, exc):
            handler.record_exception(exc)
        raise
    finally:
        if server is not None:
            server.shutdown()


# ----------------------------------------------------------------------------- client


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            with _reachable(self._socket_path) as short:
                sock.connect(short)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _request(socket_path: str, method: str, target: str, timeout: float) -> bytes:
    connection = _UnixHTTPConnection(socket_path, timeout)
    try:
        connection.request(method, target, headers={"Content-Length": "0"})
        response = connection.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as exc:
        raise WorkerServerError(
            f"{socket_path}: {method} {target} failed: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        connection.close()
    if response.status != 200:
        text = body.decode("utf-8", "replace").strip()
        raise WorkerServerError(
            f"{socket_path}: {method} {target} answered {response.status}: {text}"
        )
    return body


def call_handler(socket_path: str, name: str, timeout: float = 10.0) -> bytes:
    """Call handler ``name`` of the worker server at ``socket_path``; its body.

    Works against elastrun's server and torch's (handlers are called with POST).

    Raises:
        WorkerServerError: the server cannot be reached within ``timeout`` seconds, or
            answered with an error status.
    """
    return _request(socket_path, "POST", f"/handler/{name}", timeout)


def list_handlers(socket_path: str, timeout: float = 10.0) -> list[str]:
    """The handler names the worker server at ``socket_path`` offers.

    Raises:
        WorkerServerError: as :func:`call_handler`, or the answer is not a JSON list.
    """
    body = _request(socket_path, "GET", "/handler/", timeout)
    try:
        names = json.loads(body)
    except ValueError as exc:
        raise WorkerServerError(f"{socket_path}: handler list is not JSON") from exc
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise WorkerServerError(f"{socket_path}: handler list is not a list of names")
    return names


def fetch_stacks(socket_path: str, timeout: float = 10.0) -> str:
    """The stacks of every thread of the worker listening at ``socket_path``.

    Raises:
        WorkerServerError: the worker cannot be reached within ``timeout`` seconds (it
            exited, or is stuck holding the GIL) or the dump failed.
    """
    return call_handler(socket_path, "dump_traceback", timeout).decode("utf-8", "replace")


def fetch_many_stacks(
    socket_paths: Iterable[str], timeout: float = 10.0
) -> dict[str, str | WorkerServerError]:
    """Fetch the stacks of many workers at once (a hung job: every rank).

    The requests run concurrently, so unreachable workers cost one ``timeout`` in
    total, not one each.

    Returns:
        socket path -> its stacks, or the :class:`WorkerServerError` it gave, in the
        order of ``socket_paths``.
    """
    from concurrent.futures import ThreadPoolExecutor

    paths = list(dict.fromkeys(socket_paths))
    if not paths:
        return {}

    def one(path: str) -> str | WorkerServerError:
        try:
            return fetch_stacks(path, timeout)
        except WorkerServerError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(32, len(paths))) as pool:
        return dict(zip(paths, pool.map(one, paths), strict=True))
