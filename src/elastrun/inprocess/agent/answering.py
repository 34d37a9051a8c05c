"""The workers' questions "did a peer fail?" on this node, and the agent's answers: the
state around the pure decision of ``inprocess.agent.answer``.

``Answering`` stamps each question of a running worker when the agent first sees it,
answers the ones that can be answered now (a failure known answers at once; "no peer
failed" waits for its hold), and remembers which workers it told that their error was
their own: a worker told so that then exits explains no other worker's error raised
before it was told. The loop asks it on each pass and wakes no later than
``next_in()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elastrun.agent.attempt import Attempt
from elastrun.core.clock import Clock
from elastrun.inprocess.agent.answer import (
    ANY_TIME,
    Answer,
    Known,
    Question,
    answer,
    hold,
    hold_ends_in,
)
from elastrun.inprocess.agent.hub import InprocessHub

__all__ = ["Answering"]

log = logging.getLogger("elastrun.agent")


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
