"""The agent's own phases, as an explicit state machine.

The worker group has its states (``WorkerState``: HEALTHY, FAILED...); the agent has
phases of its own, and a signal or a failure elsewhere must be answered in each of them.
``PHASE_TRANSITIONS`` is the table of legal moves, ``WORKER_TRANSITIONS`` the worker
group's; ``Lifecycle.enter`` checks both and reports every move, so an illegal one is a
bug found at once rather than a hang.
"""

from __future__ import annotations

import enum
import logging

from elastrun.agent.spec import WorkerGroup, WorkerState
from elastrun.core.errors import IllegalTransitionError
from elastrun.observe.sinks import EventSink, MetricSink

log = logging.getLogger("elastrun.agent")


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


# Legal worker-group transitions; ``Lifecycle.enter`` enforces them and emits an event.
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


class Lifecycle:
    """The agent's one state machine: its phase and, moved with it, its worker group's
    state (``WorkerGroup.state``, which torch's callers read).

    Why one machine and not two moved side by side: a phase and a worker state that
    change in two calls can be seen half-moved (a signal between them, an exception in
    the first), and the pairs that make sense are then nowhere written down. ``enter``
    checks both tables before changing either, and reports both moves.

    Args:
        group: the worker group whose state moves with the phase.
        events, metrics: where every move is recorded (``agent.phase``,
            ``agent.state`` events; the one-hot ``agent.state.<state>`` gauge).
    """

    def __init__(self, group: WorkerGroup, events: EventSink, metrics: MetricSink) -> None:
        #: The agent's phase (moved only by ``enter``).
        self.phase = AgentPhase.INIT
        self._group = group
        self._events = events
        self._metrics = metrics

    def enter(self, phase: AgentPhase, workers: WorkerState | None = None) -> None:
        """Enter ``phase``, the worker group's state becoming ``workers`` with it (None:
        unchanged). Re-entering the current phase or state is no move.

        Raises:
            IllegalTransitionError: either move is not in its table (a bug).
        """
        old, old_state = self.phase, self._group.state
        if phase is not old and phase not in PHASE_TRANSITIONS[old]:
            raise IllegalTransitionError(
                f"illegal agent phase transition {old.value} -> {phase.value}"
            )
        new_state = old_state if workers is None else workers
        if new_state is not old_state and new_state not in WORKER_TRANSITIONS[old_state]:
            raise IllegalTransitionError(
                f"illegal worker-group transition {old_state.value} -> {new_state.value}"
            )
        if new_state is not old_state:
            self._group.state = new_state
            self._metrics.put(f"agent.state.{new_state.value}", 1)  # the one-hot gauge
            self._events.record("agent.state", {"from": old_state.value, "to": new_state.value})
        if phase is not old:
            self.phase = phase
            log.debug("agent phase %s -> %s", old.value, phase.value)
            self._events.record("agent.phase", {"from": old.value, "to": phase.value})

    def __repr__(self) -> str:
        return f"Lifecycle(phase={self.phase.value}, workers={self._group.state.value})"
