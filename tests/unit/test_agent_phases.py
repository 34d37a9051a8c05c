"""The agent's phases: the table of legal moves is pinned, every move is reported, and
the worker group's state moves with the phase in one step."""

from __future__ import annotations

import pytest

from elastrun.agent.phases import PHASE_TRANSITIONS, AgentPhase, Lifecycle
from elastrun.agent.spec import WorkerGroup, WorkerSpec, WorkerState
from elastrun.core.errors import IllegalTransitionError
from elastrun.observe.sinks import MemoryEventSink, NullMetricSink

P = AgentPhase
W = WorkerState


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


def _lifecycle() -> tuple[Lifecycle, MemoryEventSink, WorkerGroup]:
    events = MemoryEventSink()
    group = WorkerGroup(WorkerSpec(local_world_size=1, entrypoint="/bin/prog"))
    return Lifecycle(group, events, NullMetricSink()), events, group


def _moves(events: MemoryEventSink, name: str) -> list[tuple[str, str]]:
    return [(str(md["from"]), str(md["to"])) for n, md in events.events if n == name]


def test_moves_are_reported_and_illegal_ones_refused() -> None:
    m, events, _ = _lifecycle()
    for phase in (P.RENDEZVOUS, P.RUNNING, P.EXIT_BARRIER, P.RENDEZVOUS, P.RUNNING):
        m.enter(phase)
    m.enter(P.RUNNING)  # re-entering is a no-op
    with pytest.raises(IllegalTransitionError, match="running -> init"):
        m.enter(P.INIT)
    m.enter(P.DONE)
    seen = _moves(events, "agent.phase")
    assert seen[0] == ("init", "rendezvous") and seen[-1] == ("running", "done")
    assert len(seen) == 6
    with pytest.raises(RuntimeError):  # (an IllegalTransitionError is one too)
        m.enter(P.RENDEZVOUS)


def test_the_worker_state_moves_with_the_phase_or_neither_moves() -> None:
    m, events, group = _lifecycle()
    m.enter(P.RENDEZVOUS)
    m.enter(P.RUNNING, W.HEALTHY)
    assert (m.phase, group.state) == (P.RUNNING, W.HEALTHY)
    with pytest.raises(IllegalTransitionError, match="HEALTHY -> INIT"):
        m.enter(P.RESTARTING, W.INIT)
    assert (m.phase, group.state) == (P.RUNNING, W.HEALTHY)  # nothing moved
    m.enter(P.DONE, W.SUCCEEDED)
    assert _moves(events, "agent.state") == [("INIT", "HEALTHY"), ("HEALTHY", "SUCCEEDED")]
