"""The time bounds of in-process recovery, read once from the agent's options and the
rendezvous at the composition root (launch.assemble) into one frozen value."""

from __future__ import annotations

from dataclasses import dataclass

from elastrun.wire import inprocess as wire

__all__ = ["RecoveryBounds"]


@dataclass(frozen=True)
class RecoveryBounds:
    """How long in-process recovery waits for what (seconds).

    Args:
        timeout: the bound on a round's synchronisation.
        join_timeout: the bound on a kept worker's reaching a round (then it is stuck).
        loss_bound: the rendezvous' ``loss_bound`` (with other nodes, the hold covers it).
        answer_hold: the longest "no peer failed" is held back for news of a failure
            in flight (see ``inprocess.agent.answer``), alone in the round.
    """

    timeout: float
    join_timeout: float
    loss_bound: float
    answer_hold: float = wire.ANSWER_HOLD
