"""Expiration timers: a worker arms a countdown around a block; if it runs out, it is reaped.

The names of ``torch.distributed.elastic.timer``. In a worker started by elastrun with
``TORCHELASTIC_ENABLE_FILE_TIMER=1``::

    from elastrun import timer

    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=60):
        train_step()

Only the standard library and ``elastrun.core`` are imported: workers use this package.
"""

from __future__ import annotations

from elastrun.timer.api import (
    RequestQueue,
    TimerClient,
    TimerRequest,
    TimerServer,
    configure,
    expires,
)
from elastrun.timer.file import FileTimerClient, FileTimerRequest, FileTimerServer
from elastrun.timer.local import LocalTimerClient, LocalTimerServer, MultiprocessingRequestQueue

__all__ = [
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",
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
