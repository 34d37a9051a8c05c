"""Did a peer fail? The agent's answer to a worker whose collective may have failed.

A worker whose training function raised an error that a failed collective can raise
asks the agent before it tears anything down (``wire.inprocess``'s ``ask``). The
error's text cannot tell a peer's death from the worker's own error (a user's
``RuntimeError("socket closed")`` reads like gloo's); the agent knows: it reaps its
node's workers, hears of other nodes' failures and of re-formations through the
rendezvous, and leads the in-process rounds.

The answer is a pure function of what the agent knows and of how long the question has
waited. A death can be in flight when the question comes (the peer's connection breaks
before its exit can be reaped; another node's failure reaches the store a moment
later), so "no peer failed" is held back up to a bound (``hold``); any news of a
failure answers at once. The agent loop evaluates the questions on each pass (the
hub wakes it on every question, the process set on every exit, the rendezvous on every
re-formation) and sets its next wake-up no later than the oldest question's hold ends:
nothing polls, and the loop never blocks on a question.

``Answering`` is the state around that decision: it stamps each question of a running
worker when the agent first sees it, and remembers which workers it told that their
error was their own (a worker told so that then exits explains no other worker's error
raised before it was told).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from elastrun.agent.attempt import Attempt
from elastrun.core.clock import Clock
from elastrun.inprocess.agent.hub import InprocessHub

log = logging.getLogger("elastrun.agent")

#: In ``Known.failed``: a failure that may have come at any time.
ANY_TIME = -math.inf


class Answer(enum.Enum):
    PEER_FAILED = "peer_failed"  # the round is over: recover in place
    OWN = "own"  # no peer failed: the error is the worker's own
    WAIT = "wait"  # not yet: news of a failure may be in flight


@dataclass(frozen=True)
class Question:
    """A worker's unanswered question.

    Attributes:
        local_rank, pid: the worker that asks.
        round: the in-process round its error happened in.
        since: when the agent first saw the question (monotonic).
    """

    local_rank: int
    pid: int
    round: int
    since: float


@dataclass(frozen=True)
class Known:
    """What the agent knows when it answers.

    Attributes:
        round: the newest in-process round it led its workers into (or agreed on).
        failed: the local ranks whose worker exited with an error, not replaced yet,
            each with the time from which its failure can explain a peer's error:
            ``ANY_TIME``, or when the agent told that worker its error was its own (it
            was alive then, so an error raised before cannot come from its death: when
            every rank raises the same error at once, none is told another's failure).
        reforming: the rendezvous says the group re-forms (a worker of another node
            failed, a node was lost, or one waits to join): the round is over.
    """

    round: int
    failed: dict[int, float]
    reforming: bool


def answer(question: Question, known: Known, now: float, hold: float) -> Answer:
    """The answer to ``question`` at ``now`` (monotonic), holding "no peer failed" back
    for ``hold`` seconds after the question came."""
    if known.round > question.round or known.reforming:
        return Answer.PEER_FAILED
    if any(lr != question.local_rank and question.since > t for lr, t in known.failed.items()):
        return Answer.PEER_FAILED
    if now - question.since >= hold:
        return Answer.OWN
    return Answer.WAIT


def hold(nodes: int, base: float, loss_bound: float) -> float:
    """How long "no peer failed" is held back in a round of ``nodes`` nodes: ``base``
    (``wire.ANSWER_HOLD``) covers a peer's exit not yet reaped and another node's
    failure on its way through the store. With other nodes, a node can also vanish
    whole (its agent killed with its workers: their connections break at once, but the
    node is known lost only when its lease ends, ``loss_bound`` seconds later): the
    hold then lasts that, and a second more for the news to arrive. Shorter, the
    survivors of a lost node would be told their failed collectives were their own
    errors and end, and the group would restart instead of shrinking in place."""
    if nodes < 2:
        return base
    return max(base, loss_bound + 1.0)


def hold_ends_in(questions: list[Question], now: float, hold: float) -> float | None:
    """Seconds until the oldest question's hold ends (None: no question waits)."""
    if not questions:
        return None
    return max(0.0, min(q.since for q in questions) + hold - now)


class Answering:
    """This node's answers to its workers' questions.

    Args:
        clock: the agent's.
        answer_hold: how long "no peer failed" is held back on one node.
        loss_bound: the longest a lost node stays a member (the hold grows with it
            when the round has other nodes).
    """

    def __init__(self, clock: Clock, answer_hold: float, loss_bound: float) -> None:
        self._clock = clock
        self._answer_hold = self._hold = answer_hold
        self._loss_bound = loss_bound
        self._asked: dict[tuple[int, int, int], float] = {}  # (lr, pid, round) -> first seen
        self._told_own: dict[int, tuple[int, float]] = {}  # lr -> (pid, when it was told)

    def answer(
        self, hub: InprocessHub, attempt: Attempt, round_no: int, reforming: Callable[[], bool]
    ) -> None:
        """Answer the questions of ``attempt``'s workers that can be answered now
        (``round_no``: the newest in-process round; ``reforming``: whether the
        rendezvous says the group re-forms, asked only while a question waits)."""
        questions = self._questions(hub, attempt)
        if not questions:
            return
        known = Known(round_no, self._failed_since(attempt), reforming())
        self._hold = hold(attempt.plan.facts.group_world_size, self._answer_hold, self._loss_bound)
        now = self._clock.monotonic()
        for q in questions:
            verdict = answer(q, known, now, self._hold)
            if verdict is Answer.WAIT:
                continue
            del self._asked[(q.local_rank, q.pid, q.round)]
            peer_failed = verdict is Answer.PEER_FAILED
            if not peer_failed:
                self._told_own[q.local_rank] = (q.pid, now)
                log.info(
                    "rank %d (local rank %d) raised an error of its own in round %d: no "
                    "peer failed within %.1fs", attempt.global_rank(q.local_rank),
                    q.local_rank, q.round, self._hold,
                )  # fmt: skip
            hub.answer(q.local_rank, q.pid, q.round, peer_failed)

    def next_in(self) -> float | None:
        """Seconds until a question's hold ends (None: none waits)."""
        now = self._clock.monotonic()
        waiting = [Question(lr, pid, n, since) for (lr, pid, n), since in self._asked.items()]
        return hold_ends_in(waiting, now, self._hold)

    def _failed_since(self, attempt: Attempt) -> dict[int, float]:
        """The local ranks whose worker failed, each with the time from which its
        failure can explain another's error (see ``answer.Known``)."""
        failed = {}
        for e in attempt.procs.exits.values():
            if e.exitcode != 0:
                pid, told = self._told_own.get(e.local_rank, (None, ANY_TIME))
                failed[e.local_rank] = told if pid == e.pid else ANY_TIME
        return failed

    def _questions(self, hub: InprocessHub, attempt: Attempt) -> list[Question]:
        """The questions of the attempt's running workers, each stamped when first seen
        (the hub wakes the loop on every message, so at once)."""
        pids = attempt.procs.pids()
        running = set(attempt.procs.running())
        now = self._clock.monotonic()
        asked: dict[tuple[int, int, int], float] = {}
        for lr, (pid, round_no) in hub.questions().items():
            if lr not in running or pids.get(lr) != pid:
                hub.forget(lr, pid)  # it exited, or was replaced: nobody waits for the answer
                continue
            key = (lr, pid, round_no)
            asked[key] = self._asked.get(key, now)
        self._asked = asked
        return [Question(lr, pid, n, since) for (lr, pid, n), since in asked.items()]

    def __repr__(self) -> str:
        return f"Answering(waiting={len(self._asked)}, hold={self._hold})"
