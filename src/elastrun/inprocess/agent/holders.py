"""Which workers of an attempt still hold the training's state.

A worker holds it when it started with the attempt (it trained from the script's start)
or took a round's commit since. A replacement that has not synchronised yet holds
nothing: when every running worker is one, the newest commit went with the workers that
held it, and an in-process round of them would silently train again from the script's
start. The node then does not recover in place (alone), or says so in its offer (with
other nodes: ``inprocess.agent.agree``).
"""

from __future__ import annotations

from collections.abc import Mapping

from elastrun.agent.attempt import Attempt
from elastrun.inprocess.agent.hub import InprocessHub

__all__ = ["COMMIT_LOST", "STATE_LOST", "holding"]

#: Why a failure is not recovered in place when no running worker holds the state.
STATE_LOST = (
    "every worker that held the training's state has failed (each running worker is a "
    "replacement that had not taken a commit yet)"
)
#: Why, when a worker said so (``CommitLostError``; its traceback says which commit).
COMMIT_LOST = "a worker found the round's newest commit held by no rank (CommitLostError)"


def holding(hub: InprocessHub, started: Mapping[int, int], attempt: Attempt) -> list[int]:
    """The local ranks of ``attempt``'s running workers that hold the training's state;
    ``started``: local rank -> pid of the workers started into an in-process round."""
    pids = attempt.procs.pids()
    if hub.said_lost(pids):  # a worker found the newest commit lost: nobody holds it
        return []
    return [
        lr
        for lr in attempt.procs.running()
        if started.get(lr) != pids[lr] or hub.has_synced(lr, pids[lr])
    ]
