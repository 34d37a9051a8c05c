"""The worker server's client: call a handler, list them, fetch one or many workers' stacks."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterable

from elastrun.control_plane.protocol import HANDLER_PREFIX, WorkerServerError, reachable

__all__ = ["call_handler", "fetch_many_stacks", "fetch_stacks", "list_handlers"]


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            with reachable(self._socket_path) as short:
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
    return _request(socket_path, "POST", HANDLER_PREFIX + name, timeout)


def list_handlers(socket_path: str, timeout: float = 10.0) -> list[str]:
    """The handler names the worker server at ``socket_path`` offers.

    Raises:
        WorkerServerError: as :func:`call_handler`, or the answer is not a JSON list.
    """
    body = _request(socket_path, "GET", HANDLER_PREFIX, timeout)
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
