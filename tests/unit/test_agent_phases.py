"""The agent's phases: the table of legal moves is pinned, and every move is reported."""

from __future__ import annotations

import pytest

from elastrun.agent.phases import PHASE_TRANSITIONS, AgentPhase, PhaseMachine

P = AgentPhase


def test_the_table_of_legal_moves_is_pinned() -> None:
    assert {k: set(v) for k, v in PHASE_TRANSITIONS.items()} == {
        P.INIT: {P.RENDEZVOUS, P.DONE},
        P.RENDEZVOUS: {P.RUNNING, P.DONE},
        P.RUNNING: {P.RESTARTING, P.RENDEZVOUS, P.EXIT_BARRIER, P.DONE},
        P.RESTARTING: {P.RENDEZVOUS, P.DONE},
        P.EXIT_BARRIER: {P.RENDEZVOUS, P.DONE},
        P.DONE: set(),
    }


def test_every_phase_can_end_and_done_is_final() -> None:
    for phase, targets in PHASE_TRANSITIONS.items():
        assert phase is P.DONE or P.DONE in targets  # a signal ends any phase


def test_moves_are_reported_and_illegal_ones_refused() -> None:
    seen: list[tuple[str, str]] = []
    m = PhaseMachine(lambda old, new: seen.append((old.value, new.value)))
    for phase in (P.RENDEZVOUS, P.RUNNING, P.EXIT_BARRIER, P.RENDEZVOUS, P.RUNNING):
        m.move(phase)
    m.move(P.RUNNING)  # re-entering is a no-op
    with pytest.raises(RuntimeError, match="running -> init"):
        m.move(P.INIT)
    m.move(P.DONE)
    assert seen[0] == ("init", "rendezvous") and seen[-1] == ("running", "done")
    assert len(seen) == 6
    with pytest.raises(RuntimeError):
        m.move(P.RENDEZVOUS)
