"""``worker_main``: a worker's main code, with its errors recorded and its server up."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

from elastrun.control_plane.protocol import (
    ELASTRUN_WORKER_SERVER_SOCKET,
    TORCH_WORKER_SERVER_SOCKET,
    WorkerServerError,
)
from elastrun.control_plane.server import WorkerServer
from elastrun.worker.record import ErrorHandler, forward_child_failure, get_error_handler

__all__ = ["serve_from_env", "worker_main"]

log = logging.getLogger(__name__)


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
        if not forward_child_failure(handler, exc):
            handler.record_exception(exc)
        raise
    finally:
        if server is not None:
            server.shutdown()
