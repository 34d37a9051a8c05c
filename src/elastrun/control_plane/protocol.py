"""What the worker server and its clients agree on: variables, routes, socket paths.

The routes are those of torch's worker server (``torch.distributed.elastic.control_plane``):
``POST /handler/<name>`` calls a handler, ``GET /handler/`` lists them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from elastrun.core.errors import ElastrunError
from elastrun.wire.env import TORCH_WORKER_SERVER_SOCKET_ENV as TORCH_WORKER_SERVER_SOCKET
from elastrun.wire.env import WORKER_SERVER_SOCKET_ENV as ELASTRUN_WORKER_SERVER_SOCKET

__all__ = [
    "ELASTRUN_WORKER_SERVER_SOCKET",
    "HANDLER_PREFIX",
    "TORCH_WORKER_SERVER_SOCKET",
    "Handler",
    "WorkerServerError",
    "reachable",
]

#: ``HANDLER_PREFIX + name`` calls a handler; the prefix alone lists them.
HANDLER_PREFIX = "/handler/"

#: A handler returns its body and content type; it takes no argument (as torch's do).
Handler = Callable[[], tuple[bytes, str]]

# sockaddr_un holds 108 bytes on Linux; longer paths are reached through a directory
# descriptor (see reachable).
_MAX_SUN_PATH = 100


class WorkerServerError(ElastrunError):
    """The worker server could not be started, reached, or gave an error answer."""


@contextlib.contextmanager
def reachable(path: str) -> Iterator[str]:
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
