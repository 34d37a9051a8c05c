"""Ending the workers stuck on the way to an in-process round.

torch 2.13's gloo now and then leaves a survivor blocked in a collective whose peer
went away, never failing it (a send whose write met a reset connection is queued
without an error, and the connection's error then fails every waiting operation but
that one; see docs/inprocess.md): it never asks the agent, and never reaches the round.

Such a worker is told from one that only computes, or waits for its data, by what it
waits on: one of torch's gloo work threads waits with a timeout (an operation in
flight), while the process has no connection left to any worker of the round (the
round's message cut them all: ``inprocess.worker.cut``). Nothing can end that wait
but the group's own timeout, 30 minutes by default. So the agent replaces such a
worker ``SURE_AFTER`` seconds into the round (``blocked_for_good`` at every look over
the last ``CONFIRM`` seconds), and any other that
has not come at the join bound; it keeps their threads' stacks (in the attempt
directory) and SIGKILLs them, with their process group when they lead one. The loop
then replaces them in place, as failed workers, in the next round.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import signal
from collections.abc import Sequence

from elastrun.agent.attempt import Attempt
from elastrun.core.tcp_sockets import Endpoints, connected_to
from elastrun.observe.sinks import EventSink
from elastrun.supervise.processes.stacks import request_stacks

__all__ = ["CONFIRM", "SURE_AFTER", "blocked_for_good", "end_stuck"]

log = logging.getLogger("elastrun.agent")

#: Seconds into a round after which a worker ``blocked_for_good`` is replaced: the
#: round's cut has shut its connections down, and gloo has failed (within
#: milliseconds) every operation that it can fail.
SURE_AFTER = 2.0
#: ... and found so at every look over this many seconds before (a look that falls
#: between the cut and gloo's noticing it, on a loaded machine, is not enough).
CONFIRM = 0.5

#: The name (``comm``) of torch's gloo work threads, which run the collectives.
_GLOO_THREAD = "pt_gloo_runloop"
#: ``futex``'s number, by machine (``/proc/<pid>/task/<tid>/syscall`` gives it and its
#: arguments; the fourth is the timeout, 0 for a wait without one).
_FUTEX = {"x86_64": "202", "aarch64": "98"}


def blocked_for_good(pid: int, peers: Endpoints) -> bool:
    """Whether worker ``pid`` waits in a gloo collective that can no longer end: a gloo
    work thread waits with a timeout, and the process has no established connection to
    or from ``peers`` (where the round's workers listen). False where it cannot be told
    (another system, or ``/proc`` unreadable)."""
    futex = _FUTEX.get(platform.machine())
    if futex is None or not peers:
        return False
    try:
        if not any(_waits_with_timeout(pid, tid, futex) for tid in os.listdir(f"/proc/{pid}/task")):
            return False
    except OSError:
        return False
    return not connected_to(pid, peers)


def _waits_with_timeout(pid: int, tid: str, futex: str) -> bool:
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/comm", encoding="ascii", errors="replace") as fh:
            if fh.read().strip() != _GLOO_THREAD:
                return False
        with open(f"{base}/syscall", encoding="ascii") as fh:
            call = fh.read().split()  # number, six arguments, stack and instruction pointers
    except OSError:
        return False
    return len(call) > 4 and call[0] == futex and int(call[4], 16) != 0


def end_stuck(
    attempt: Attempt,
    local_ranks: Sequence[int],
    round_no: int,
    why: str,
    events: EventSink,
) -> None:
    """Keep the stacks of ``attempt``'s workers at ``local_ranks``, then SIGKILL them
    (``round_no``: the round they did not reach; ``why``: how they were found stuck,
    as the log line says it)."""
    dumps = request_stacks(attempt.stack_requests(list(local_ranks)))
    pids = attempt.procs.pids()
    for lr in local_ranks:
        where = dumps[lr].path if lr in dumps and dumps[lr].text else "no stacks"
        log.warning(
            "rank %d (local rank %d, pid %d) did not reach in-process round %d %s; "
            "stacks: %s): replacing it",
            attempt.global_rank(lr), lr, pids[lr], round_no, why, where,
        )  # fmt: skip
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pids[lr]) == pids[lr]:  # its own group: its children too
                os.killpg(pids[lr], signal.SIGKILL)
            else:
                os.kill(pids[lr], signal.SIGKILL)
    events.record(
        "agent.inprocess_stuck",
        {"ranks": ",".join(str(attempt.global_rank(lr)) for lr in local_ranks)},
    )
