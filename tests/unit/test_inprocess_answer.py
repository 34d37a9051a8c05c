"""The agent's answer to a worker whose collective may have failed: did a peer fail?"""

from __future__ import annotations

from elastrun.inprocess.agent.answer import (
    ANY_TIME,
    Answer,
    Known,
    Question,
    answer,
    hold,
    hold_ends_in,
)

HOLD = 5.0
ASKED = Question(local_rank=0, pid=100, round=2, since=10.0)
QUIET = Known(round=2, failed={}, reforming=False)


def test_no_news_of_a_failure_holds_the_answer_then_names_the_workers_own_error() -> None:
    assert answer(ASKED, QUIET, now=10.0, hold=HOLD) is Answer.WAIT
    assert answer(ASKED, QUIET, now=14.9, hold=HOLD) is Answer.WAIT
    assert answer(ASKED, QUIET, now=15.0, hold=HOLD) is Answer.OWN


def test_another_local_workers_failed_exit_is_a_peer_failure_at_once() -> None:
    known = Known(round=2, failed={1: ANY_TIME}, reforming=False)
    assert answer(ASKED, known, now=10.0, hold=HOLD) is Answer.PEER_FAILED
    # Its own exit is not a peer's (a question is only kept while its worker runs).
    alone = Known(round=2, failed={0: ANY_TIME}, reforming=False)
    assert answer(ASKED, alone, now=15.0, hold=HOLD) is Answer.OWN


def test_a_peer_told_its_error_was_its_own_explains_only_errors_raised_after_that() -> None:
    # Every rank raised the same error at once: rank 1 was told first, and ended; rank
    # 0 asked before that, so rank 1's death cannot explain its error.
    told = Known(round=2, failed={1: 14.0}, reforming=False)
    assert answer(ASKED, told, now=14.5, hold=HOLD) is Answer.WAIT
    assert answer(ASKED, told, now=15.0, hold=HOLD) is Answer.OWN
    later = Question(local_rank=0, pid=100, round=2, since=14.2)  # its collective broke
    assert answer(later, told, now=14.2, hold=HOLD) is Answer.PEER_FAILED


def test_a_newer_round_or_a_reforming_group_is_a_peer_failure_at_once() -> None:
    newer = Known(round=3, failed={}, reforming=False)
    assert answer(ASKED, newer, now=10.0, hold=HOLD) is Answer.PEER_FAILED
    reforming = Known(round=2, failed={}, reforming=True)  # another node's failure
    assert answer(ASKED, reforming, now=10.0, hold=HOLD) is Answer.PEER_FAILED
    # News that comes during the hold still answers "peer failed", even past it.
    assert answer(ASKED, reforming, now=30.0, hold=HOLD) is Answer.PEER_FAILED


def test_the_loop_wakes_when_the_oldest_questions_hold_ends() -> None:
    later = Question(local_rank=1, pid=101, round=2, since=12.0)
    assert hold_ends_in([], now=11.0, hold=HOLD) is None
    assert hold_ends_in([later, ASKED], now=11.0, hold=HOLD) == 4.0
    assert hold_ends_in([ASKED], now=20.0, hold=HOLD) == 0.0


def test_with_other_nodes_the_hold_covers_a_vanished_nodes_lease() -> None:
    assert hold(1, HOLD, loss_bound=10.0) == HOLD  # alone: no node can vanish unseen
    assert hold(2, HOLD, loss_bound=10.0) == 11.0  # its lease ends, then its news comes
    assert hold(2, HOLD, loss_bound=3.0) == HOLD
    assert hold(2, HOLD, loss_bound=0.0) == HOLD  # a rendezvous that does not say
