"""Starting a group of worker processes, all or none: the agent's (one start per attempt)
and ``start_processes``'s (torch's process-context API) alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elastrun.supervise.processes.logs import LogsDest
from elastrun.supervise.processes.relay import OutputRelay, WorkerStdio
from elastrun.supervise.processes.spawn import ProcessSpec, ProcessStarter, WorkerProcess


@dataclass(frozen=True)
class GroupMember:
    """One worker of a group to start.

    Args:
        local_rank: the worker's local rank.
        prefix: put before each console line of the worker's tee'd streams.
        show_on_console: False for ranks hidden by ``--local-ranks-filter``.
        make_spec: the worker's ``ProcessSpec``, given its stdio descriptors.
        append: add to the rank's log files (a worker replaced in place).
    """

    local_rank: int
    prefix: str
    show_on_console: bool
    make_spec: Callable[[WorkerStdio], ProcessSpec]
    append: bool = False


def start_group(
    starter: ProcessStarter,
    relay: OutputRelay,
    dest: LogsDest,
    members: Sequence[GroupMember],
) -> list[WorkerProcess]:
    """Start every member with its output wired through ``relay``: all or none, in order.

    Each member's ``ProcessSpec`` is built around its wired descriptors, and the whole
    group goes to the starter at once (``start_many``: the template forks a group's
    workers in one batch). ``relay`` and ``dest``: see ``OutputRelay.wire``.

    Raises whatever wiring or starting raises, with no worker left running; the
    parent's copies of the workers' descriptors are closed either way. The relay is the
    caller's to close.
    """
    stdios: list[WorkerStdio] = []
    try:
        for m in members:
            stdios.append(
                relay.wire(
                    m.local_rank,
                    dest,
                    m.prefix,
                    show_on_console=m.show_on_console,
                    append=m.append,
                )
            )
        specs = [m.make_spec(stdio) for m, stdio in zip(members, stdios, strict=True)]
        return starter.start_many(specs)
    finally:
        for stdio in stdios:
            stdio.close_in_parent()


def start_worker(
    starter: ProcessStarter, relay: OutputRelay, dest: LogsDest, member: GroupMember
) -> WorkerProcess:
    """Start one worker with its output wired through ``relay`` (see :func:`start_group`)."""
    return start_group(starter, relay, dest, [member])[0]
