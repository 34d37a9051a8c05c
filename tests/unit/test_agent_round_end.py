"""How the agent words failures and reads the exit barrier's outcome (agent.failures,
agent.finish): pure functions of their inputs."""

from __future__ import annotations

import signal

import pytest

from elastrun.agent.failures import describe_exit, failure_note
from elastrun.agent.finish import BarrierAction, barrier_action
from elastrun.agent.policy import LocalRestartBudget
from elastrun.rendezvous.api import BarrierResult, RoundOutcome


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (0, "exited with code 0"),
        (3, "exited with code 3"),
        (-signal.SIGKILL, "was killed by SIGKILL"),
        (-200, "was killed by signal 200"),
    ],
)
def test_an_exit_is_described_by_its_code_or_its_signal(code: int, text: str) -> None:
    assert describe_exit(code) == text


def test_an_exhausted_budget_names_its_limit_and_lists_the_earlier_failures() -> None:
    budget = LocalRestartBudget(1)
    assert budget.try_consume()
    note = failure_note(budget, stuck=None, stalled=None, history=["attempt 0: rank 1 ..."])
    assert note == (
        "restart budget exhausted: 1 of 1 restart(s) used (--max-restarts 1)\n"
        "earlier failures:\n  attempt 0: rank 1 ..."
    )


def test_a_stuck_worker_comes_before_a_stalled_run_in_the_note() -> None:
    budget = LocalRestartBudget(3)
    note = failure_note(budget, stuck=2, stalled="no rank passed step 5", history=[])
    assert note == "not restarted: local rank 2 was stuck in uninterruptible sleep"
    note = failure_note(budget, stuck=None, stalled="no rank passed step 5", history=[])
    assert note == "not restarted: the restarts made no progress: no rank passed step 5"


@pytest.mark.parametrize(
    ("outcome", "action"),
    [
        (RoundOutcome.SUCCEEDED, BarrierAction.FINISH),
        (RoundOutcome.TIMED_OUT, BarrierAction.FINISH),
        (RoundOutcome.RESTART, BarrierAction.REFORM),
        (RoundOutcome.FAILED, BarrierAction.FAIL),
    ],
)
def test_the_exit_barriers_outcome_decides_what_this_node_does(
    outcome: RoundOutcome, action: BarrierAction
) -> None:
    assert barrier_action(BarrierResult(outcome, "why")) is action
