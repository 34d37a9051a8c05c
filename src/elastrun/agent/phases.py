"""The agent's own phases, as an explicit state machine.

The worker group has its states (``WorkerState``: HEALTHY, FAILED...); the agent has
phases of its own, and a signal or a failure elsewhere must be answered in each of them.
``PHASE_TRANSITIONS`` is the table of legal moves; ``PhaseMachine.move`` checks it and
reports every move, so an illegal one is a bug found at once rather than a hang.
``WORKER_TRANSITIONS`` is the worker group's table (the agent's ``_transition`` checks it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from elastrun.agent.spec import WorkerState


class AgentPhase(enum.Enum):
    INIT = "init"  # configured, nothing started
    RENDEZVOUS = "rendezvous"  # waiting for a round to form
    RUNNING = "running"  # the round's workers run
    RESTARTING = "restarting"  # a worker failed; stopping the group to start again
    EXIT_BARRIER = "exit_barrier"  # local workers finished; waiting for the round's outcome
    DONE = "done"  # finished, failed or stopped: nothing more happens


PHASE_TRANSITIONS: dict[AgentPhase, frozenset[AgentPhase]] = {
    AgentPhase.INIT: frozenset({AgentPhase.RENDEZVOUS, AgentPhase.DONE}),
    AgentPhase.RENDEZVOUS: frozenset({AgentPhase.RUNNING, AgentPhase.DONE}),
    AgentPhase.RUNNING: frozenset(
        {
            AgentPhase.RESTARTING,  # a local worker failed and the budget allows
            AgentPhase.RENDEZVOUS,  # membership changed, or a failure elsewhere
            AgentPhase.EXIT_BARRIER,  # every local worker finished
            AgentPhase.DONE,  # no restart left, a signal, a stuck worker
        }
    ),
    AgentPhase.RESTARTING: frozenset({AgentPhase.RENDEZVOUS, AgentPhase.DONE}),
    AgentPhase.EXIT_BARRIER: frozenset(
        {AgentPhase.RENDEZVOUS, AgentPhase.DONE}  # the round failed elsewhere: re-form
    ),
    AgentPhase.DONE: frozenset(),
}


# Legal worker-group transitions; the agent's ``_transition`` enforces them and emits an event.
WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.INIT: frozenset({WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.STOPPED}),
    WorkerState.HEALTHY: frozenset(
        {WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED, WorkerState.UNHEALTHY}
    ),
    WorkerState.UNHEALTHY: frozenset({WorkerState.FAILED, WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset({WorkerState.HEALTHY, WorkerState.FAILED}),
    WorkerState.SUCCEEDED: frozenset(),
    WorkerState.FAILED: frozenset(),
    WorkerState.UNKNOWN: frozenset(),
}


class PhaseMachine:
    """The current phase; ``move`` enforces the table and tells ``on_move``."""

    def __init__(self, on_move: Callable[[AgentPhase, AgentPhase], None]) -> None:
        self._phase = AgentPhase.INIT
        self._on_move = on_move

    @property
    def phase(self) -> AgentPhase:
        return self._phase

    def move(self, new: AgentPhase) -> None:
        """Enter ``new``; re-entering the current phase is a no-op.

        Raises:
            RuntimeError: the move is not in ``PHASE_TRANSITIONS`` (a bug).
        """
        old = self._phase
        if new is old:
            return
        if new not in PHASE_TRANSITIONS[old]:
            raise RuntimeError(f"illegal agent phase transition {old.value} -> {new.value}")
        self._phase = new
        self._on_move(old, new)

    def __repr__(self) -> str:
        return f"PhaseMachine(phase={self._phase.value})"
