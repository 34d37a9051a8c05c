"""Starting a group of worker processes: one local rank at a time, all or none.

The agent (one start per attempt) and ``start_processes`` (torch's process-context API)
start their workers the same way: each worker's stdout and stderr are wired through the
output relay, its ``ProcessSpec`` is built around those descriptors, it is started, and
the parent's copies of the descriptors are closed whether or not the start succeeded.
If a start fails midway, the workers already started are killed before the error
propagates, so a failed start leaves no process behind.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable

from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.supervise.processes.logs import LogsDest
from elastrun.supervise.processes.procset import ProcessSet
from elastrun.supervise.processes.relay import OutputRelay, WorkerStdio
from elastrun.supervise.processes.spawn import ProcessSpec, ProcessStarter, WorkerProcess


def start_worker(
    starter: ProcessStarter,
    relay: OutputRelay,
    dest: LogsDest,
    local_rank: int,
    *,
    prefix: str,
    show_on_console: bool,
    make_spec: Callable[[WorkerStdio], ProcessSpec],
    append: bool = False,
) -> WorkerProcess:
    """Start the worker of one local rank with its output wired through ``relay``.

    Args:
        starter: starts the process.
        relay, dest: where the worker's streams go (see ``OutputRelay.wire``).
        local_rank: the worker's local rank.
        prefix: put before each console line of the worker's tee'd streams.
        show_on_console: False for ranks hidden by ``--local-ranks-filter``.
        make_spec: the worker's ``ProcessSpec``, given its stdio descriptors.
        append: add to the rank's log files (a worker replaced in place).

    Raises whatever wiring or starting raises; the parent's copies of the worker's
    descriptors are closed either way.
    """
    stdio = relay.wire(local_rank, dest, prefix, show_on_console=show_on_console, append=append)
    try:
        return starter.start(make_spec(stdio))
    finally:
        stdio.close_in_parent()


def start_group(
    local_ranks: Iterable[int],
    start_one: Callable[[int], WorkerProcess],
    *,
    clock: Clock = SYSTEM_CLOCK,
) -> list[WorkerProcess]:
    """``start_one(local_rank)`` for each local rank in order; all start or none runs.

    When a start raises (or the caller is interrupted), the workers already started are
    killed (SIGKILL, no grace: none of them has done any work yet) and reaped, then the
    exception propagates. The relay is the caller's to close.
    """
    procs: list[WorkerProcess] = []
    try:
        for local_rank in local_ranks:
            procs.append(start_one(local_rank))
    except BaseException:
        partial = ProcessSet(procs, clock=clock)
        partial.stop(signal.SIGKILL, 0)
        partial.close()
        raise
    return procs
