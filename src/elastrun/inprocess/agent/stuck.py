"""Ending the workers stuck on the way to an in-process round.

torch 2.13's gloo now and then leaves a survivor blocked in a collective whose peer
died, never failing it: it never asks the agent, and never reaches the round. Past the
join bound the agent keeps its threads' stacks (in its attempt directory) and SIGKILLs
it, with its process group when it leads one; the loop then replaces it in place, as a
failed worker, in the next round.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Sequence

from elastrun.agent.attempt import Attempt
from elastrun.observe.sinks import EventSink
from elastrun.supervise.processes.stacks import request_stacks

__all__ = ["end_stuck"]

log = logging.getLogger("elastrun.agent")


def end_stuck(
    attempt: Attempt,
    local_ranks: Sequence[int],
    round_no: int,
    join_timeout: float,
    events: EventSink,
) -> None:
    """Keep the stacks of ``attempt``'s workers at ``local_ranks``, then SIGKILL them
    (``round_no``: the round they did not reach within ``join_timeout`` seconds)."""
    dumps = request_stacks(attempt.stack_requests(list(local_ranks)))
    pids = attempt.procs.pids()
    for lr in local_ranks:
        where = dumps[lr].path if lr in dumps and dumps[lr].text else "no stacks"
        log.warning(
            "rank %d (local rank %d, pid %d) did not reach in-process round %d within "
            "%.0fs (stuck in a collective; stacks: %s): replacing it",
            attempt.global_rank(lr), lr, pids[lr], round_no, join_timeout, where,
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
