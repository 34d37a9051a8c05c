"""The agent loop's in-process steps: recovering in place, alone or with other nodes.

``InprocessSteps`` decides, for a failure or a re-formation, whether the workers are
kept (``InprocessRecovery`` judges the workers, this module the round) and carries the
recovery through the loop's phases: alone in its round the node leads its workers into
the next in-process round at once; with other nodes it keeps them through the
rendezvous and agrees on the round with the others (``inprocess.agent.agree``). Each
step returns a ``GroupDecision`` (``agent.ladder``) -- the workers were kept, or the loop
restarts them in the round just joined, or in a new round -- and the loop acts on it:
nothing here calls back into the loop. ``inprocess.agent.rung`` is what the recovery
ladder asks of these steps.
"""

from __future__ import annotations

import logging

from elastrun.agent.attempt import Attempt
from elastrun.agent.ladder import GroupDecision
from elastrun.agent.plan import LaunchPlan
from elastrun.agent.policy import RestartBudget
from elastrun.agent.rounds import Rounds
from elastrun.agent.spec import WorkerGroup
from elastrun.core.interrupt import Interruptible
from elastrun.inprocess.agent.agree import Agreement, Offer, agree
from elastrun.inprocess.agent.recovery import InprocessRecovery
from elastrun.pace.agent.step_watch import PaceWatch
from elastrun.rendezvous.keys import RunKeys
from elastrun.store.api import Store
from elastrun.supervise.processes.procset import Exit

log = logging.getLogger("elastrun.agent")

#: The longest a node that kept its workers waits for the other nodes' offers (seconds;
#: a node that has not written its offer by then is most likely gone).
AGREE_TIMEOUT = 30.0


class InprocessSteps:
    """Carries in-process recoveries through the agent loop.

    Args:
        recovery: judges the workers and leads them into rounds.
        rounds: the rendezvous rounds this node joins.
        group: the worker group (the round's store and size).
        budget: the restart budget (its count goes to every worker).
        pace: the straggler watch (told the ranks of an in-process round).
        interruptible: runs the wait for the other nodes' offers so that a signal ends it.
    """

    def __init__(
        self,
        recovery: InprocessRecovery,
        rounds: Rounds,
        group: WorkerGroup,
        budget: RestartBudget,
        pace: PaceWatch,
        interruptible: Interruptible,
    ) -> None:
        self._recovery = recovery
        self._rounds = rounds
        self._group = group
        self._budget = budget
        self._pace = pace
        self._interruptible = interruptible
        self._joining: int | None = None  # the in-process round fresh workers start in

    @property
    def alone(self) -> bool:
        """Whether this node is alone in its round."""
        return (self._group.group_world_size or 1) == 1

    def why_not(self, attempt: Attempt, failed: list[Exit], *, reform: bool = False) -> str | None:
        """Why this failure cannot be recovered in place; ``reform``: why the workers
        cannot be kept through a re-formation of the group (a node lost or joining)."""
        alone = self.alone and not reform
        why = self._recovery.why_not(attempt, failed, alone=alone)
        if why is None and not alone and not isinstance(self._group.store, Store):
            why = "the rendezvous has no store the nodes can agree through"
        return why

    def recover_alone(self, attempt: Attempt, failed: list[Exit]) -> GroupDecision:
        """Recover in place at once, this node being alone in its round (``why_not``
        said it can); with other nodes the loop keeps the workers through the next
        round instead (``reform_keeping``)."""
        try:
            self._recovery.recover(attempt, failed, self._budget.used())
        except Exception as exc:  # a replacement that cannot start: the usual restart
            self._recovery.round.abandon(f"a replacement could not start: {exc}")
            return GroupDecision.restart_fresh()
        return GroupDecision.kept()

    def reform_keeping(self, attempt: Attempt) -> GroupDecision:
        """Join the next round with this node's workers still running (the loop has
        ended the last round and entered the rendezvous); then lead them into an
        in-process round when every node of the round kept its workers, else restart
        them in the round joined."""
        plan = self._rounds.join()
        failed = [e for e in attempt.procs.exits.values() if e.exitcode != 0]
        kept = self._recovery.why_not(attempt, failed, alone=False) is None
        agreement = self._agree(plan, self._recovery.offer(attempt, kept))
        if agreement is None:
            log.info("not every node kept its workers: restarting them")
            return GroupDecision.restart_in(plan)
        try:
            self._recovery.recover_round(
                attempt, plan, agreement, self._budget.used(), after_failure=bool(failed)
            )
        except Exception as exc:  # a replacement that cannot start: the usual restart
            self._recovery.round.abandon(f"a replacement could not start: {exc}")
            return GroupDecision.restart_in(plan)
        ranks = {w.local_rank: w.ranks.global_rank for w in plan.workers}
        self._pace.start_attempt(attempt.number, ranks)
        return GroupDecision.kept()

    def starting_afresh(self, plan: LaunchPlan, previous: Attempt | None) -> LaunchPlan:
        """This node starts its workers afresh in ``plan``'s round (``previous``: its last
        attempt, if any): tell the nodes that may have kept theirs. The plan to start:
        when they did, this node's workers start in their in-process round and take the
        newest commit (the world grows in place); ``joined`` then tracks the round."""
        self._joining = None
        facts = plan.facts
        if not self._recovery.is_open or facts.group_world_size < 2 or facts.round == 0:
            return plan  # (in a job's first round no node can have kept workers)
        agreement = self._agree(plan, self._recovery.offer_fresh(previous))
        if agreement is None:
            return plan
        self._joining = agreement.round
        return self._recovery.into_round(plan, agreement.round)

    def joined(self, attempt: Attempt) -> None:
        """The workers of ``attempt`` started (see ``starting_afresh``)."""
        if self._joining is not None:
            self._recovery.joined_fresh(attempt, self._joining)
            self._joining = None

    def _agree(self, plan: LaunchPlan, offer: Offer) -> Agreement | None:
        """Tell the round's other nodes what this node offers for an in-process round,
        and (when it kept its workers) hear theirs; the round they all agree on."""
        store, facts = self._group.store, plan.facts
        if not isinstance(store, Store) or (facts.group_world_size < 2 and not offer.kept):
            return None  # (a node alone that kept its workers agrees with itself)
        prefix = RunKeys.of_run(facts.run_id).inprocess(facts.round)
        bound = min(self._recovery.timeout, AGREE_TIMEOUT)
        return self._interruptible.run(
            lambda: agree(store, prefix, facts.group_rank, facts.group_world_size, offer, bound),
            "other nodes' in-process offers",
        )

    def __repr__(self) -> str:
        return f"InprocessSteps(alone={self.alone}, recovery={self._recovery!r})"
