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

The package runs inside workers: it imports only the standard library, ``elastrun.core``,
``elastrun.wire`` and ``elastrun.worker``.
"""

from __future__ import annotations

from elastrun.control_plane.client import (
    call_handler,
    fetch_many_stacks,
    fetch_stacks,
    list_handlers,
)
from elastrun.control_plane.handlers import DEFAULT_HANDLERS, dump_stacks
from elastrun.control_plane.main import serve_from_env, worker_main
from elastrun.control_plane.protocol import (
    ELASTRUN_WORKER_SERVER_SOCKET,
    TORCH_WORKER_SERVER_SOCKET,
    Handler,
    WorkerServerError,
)
from elastrun.control_plane.server import WorkerServer

__all__ = [
    "DEFAULT_HANDLERS",
    "ELASTRUN_WORKER_SERVER_SOCKET",
    "TORCH_WORKER_SERVER_SOCKET",
    "Handler",
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
