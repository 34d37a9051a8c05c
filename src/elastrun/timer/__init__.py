"""Expiration timers: a worker arms a countdown around a block; if it runs out, it is reaped.

The names of ``torch.distributed.elastic.timer``. In a worker started by elastrun with
``TORCHELASTIC_ENABLE_FILE_TIMER=1``::

    from elastrun import timer

    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=60):
        train_step()

Only the standard library and ``elastrun.core`` are imported: workers use this package.
:class:`FileTimerServer`, the agent's watchdog, is here under torch's name too, but it
lives in :mod:`elastrun.supervise.timers` and is loaded only when asked for.
"""

from __future__ import annotations

from elastrun.core.lazy import lazy_getattr
from elastrun.timer.api import (
    RequestQueue,
    TimerClient,
    TimerRequest,
    TimerServer,
    configure,
    expires,
)
from elastrun.timer.file import FileTimerClient, FileTimerRequest
from elastrun.timer.local import LocalTimerClient, LocalTimerServer, MultiprocessingRequestQueue

# As in elastrun/__init__.py: not typing.TYPE_CHECKING, so that workers skip typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    # For type checkers only, so that `timer.FileTimerServer` is a class to them; at run
    # time __getattr__ loads it (pyproject's worker-side contract ignores this one edge).
    from elastrun.supervise.timers.file_server import FileTimerServer

__all__ = [
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",  # lazy: __getattr__
    "LocalTimerClient",
    "LocalTimerServer",
    "MultiprocessingRequestQueue",
    "RequestQueue",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "configure",
    "expires",
]


# A string, not an import statement: this worker-side package must not depend on the
# agent side (pyproject's contracts), and workers must not pay for loading it.
__getattr__ = lazy_getattr(__name__, {"FileTimerServer": "elastrun.supervise.timers.file_server"})
