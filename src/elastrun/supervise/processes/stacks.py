"""Ask live Python workers for their threads' stacks, and collect what they write.

Every Python worker started through elastrun's bootstrap dumps all its threads' stacks
to ``$ELASTRUN_STACKS_FILE`` (``<attempt>/<local_rank>/stacks.txt``) when it receives
SIGUSR1 (faulthandler, written from C, so a worker stuck in native code holding the GIL
answers too). The agent uses this to keep the evidence before it acts on a worker that
does not exit: a hang, or a rank stuck at exit after its peers finished.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass

from elastrun.core.cancel import Cancelled, CancelScope, scope_or_default

log = logging.getLogger("elastrun.agent")

#: How long a dump may take to appear; faulthandler writes within milliseconds unless
#: the process is stopped or not a Python worker at all.
DUMP_TIMEOUT = 2.0
_POLL = 0.02


@dataclass(frozen=True)
class StackDump:
    """What one worker wrote in answer (``text`` empty when it did not answer)."""

    local_rank: int
    pid: int
    path: str
    text: str


def dump_size(path: str) -> int:
    """The size of a stacks file; 0 when it is not there (a worker's is empty until a dump)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def request_stacks(
    workers: Mapping[int, tuple[int, str]],
    timeout: float = DUMP_TIMEOUT,
    scope: CancelScope | None = None,
) -> dict[int, StackDump]:
    """Signal each worker (``{local_rank: (pid, stacks_path)}``) and wait, at most
    ``timeout`` seconds, until each has appended to its file.

    The wait ends early when ``scope`` (default: the thread's current one, the agent's
    shutdown scope) is cancelled: a stop request keeps what was written so far. The pids
    must be the caller's own unreaped children (a pid cannot be reused while its zombie
    is not reaped), so no stranger is ever signalled. Never raises.
    """
    live = scope_or_default(scope)
    before = {lr: dump_size(path) for lr, (_, path) in workers.items()}
    pending = set()
    for lr, (pid, _) in workers.items():
        with suppress(OSError):  # (already gone)
            os.kill(pid, signal.SIGUSR1)
            pending.add(lr)
    # The dump is written by the worker asynchronously; waiting on the file's growth
    # is the only signal there is (a bounded wait, off the recovery path).
    deadline = time.monotonic() + timeout
    try:
        while pending and time.monotonic() < deadline:
            pending = {lr for lr in pending if dump_size(workers[lr][1]) <= before[lr]}
            if pending:
                live.sleep(_POLL)
        live.sleep(_POLL)  # a dump that has begun gets to finish its last lines
    except Cancelled:
        log.info("stopped waiting for the workers' stacks (%s)", live.reason)
    out = {}
    for lr, (pid, path) in workers.items():
        text = ""
        # No file: not a Python worker, or its log directory is gone.
        with suppress(OSError), open(path, encoding="utf-8", errors="replace") as fh:
            fh.seek(before[lr])
            text = fh.read().rstrip()
        out[lr] = StackDump(lr, pid, path, text)
    return out
