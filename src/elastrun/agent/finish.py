"""The end of a round on this node: the workers' return values and the exit barrier's
outcome.

When every local worker finished, a node of a multi-node job waits at the exit barrier
for the round's outcome. What the outcome means for this node is decided here; the loop
acts on it (finish, re-form with the others, or fail).
"""

from __future__ import annotations

import enum
import logging

from elastrun.agent.attempt import Attempt
from elastrun.rendezvous.api import BarrierResult, RoundOutcome

log = logging.getLogger("elastrun.agent")


class BarrierAction(enum.Enum):
    FINISH = "finish"  # the round succeeded, or this node stopped waiting for it
    REFORM = "reform"  # the round failed elsewhere: re-form and start the workers again
    FAIL = "fail"  # the job failed on another node


def return_values(attempt: Attempt) -> dict[int, object]:
    """Each worker's return value (None for executables), by global rank."""
    return {
        attempt.global_rank(lr): proc.return_value() for lr, proc in attempt.procs.processes.items()
    }


def barrier_action(outcome: BarrierResult) -> BarrierAction:
    """What this node does after the exit barrier (logging why, unless it finishes)."""
    if outcome.outcome is RoundOutcome.SUCCEEDED:
        return BarrierAction.FINISH
    if outcome.outcome is RoundOutcome.TIMED_OUT:
        log.warning(
            "exit barrier timed out (%s); this node leaves, the others go on", outcome.reason
        )
        return BarrierAction.FINISH
    if outcome.outcome is RoundOutcome.RESTART:
        log.warning(
            "this node's workers finished, but the round failed elsewhere (%s); "
            "re-forming and starting the workers again",
            outcome.reason,
        )
        return BarrierAction.REFORM
    return BarrierAction.FAIL
