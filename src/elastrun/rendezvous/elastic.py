"""What the agent needs from an elastic rendezvous, as small typed interfaces.

torch's handler interface (``api.RendezvousHandler``) knows rounds, but not the rest of
an elastic job. ``ElasticRendezvous`` names the rounds' part: who this node is, news
that the running round must re-form, stepping away, this node's seat in the run's store
and a wait for the next round that a cancel scope ends. Its other parts are objects of
their own, each handed only to the agent parts that use it: ``JobOutcome`` (the
job-wide restart budget and the exit barrier) and ``ExclusionBoard`` (the nodes kept out
for a cool-down). Types tell what a rendezvous can do, not flags: ``outcome`` is None
where each node ends on its own, as torchrun's (a budget of the agent's, no barrier).

elastrun's dynamic handler implements them, and ``as_elastic`` wraps any other handler
(torch-style plugins, the standalone one) in ``PlainRendezvous``: no outcome, an empty
exclusion board, no news between rounds other than ``num_nodes_waiting``.

A torch-style handler's ``next_rendezvous`` takes no scope and may block for minutes in
code we do not own. The adapter alone runs it on a thread of its nursery and waits for
its result in the caller's scope (``Nursery.call``): the agent above never starts a
thread to make a wait end, and a cancelled scope ends the wait at once (the abandoned
call ends with the process or when the handler shuts down). Why not interrupt the call
itself: nothing in torch's interface allows it, and a signal raised into foreign code
leaves its state unknown. Nothing closes that nursery: the adapter lives as long as the
agent, and nobody has a reason to wait for an abandoned call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from elastrun.core import cancel
from elastrun.core.cancel import CancelScope
from elastrun.core.clock import Clock
from elastrun.core.errors import RendezvousTimeoutError
from elastrun.core.threads import Nursery
from elastrun.rendezvous.api import BarrierResult, RendezvousHandler, RendezvousInfo
from elastrun.rendezvous.exclusion import Exclusion, ExclusionRule
from elastrun.store.api import Store


@dataclass(frozen=True)
class StoreSeat:
    """This node's place in the run's store, for a part that meets the other nodes there
    (the node check builds its board from it): the store, the run's key prefix, this
    node's id and address, its lease (keys bound to it vanish with the node) and the
    rendezvous's clock."""

    store: Store
    prefix: str
    node: str
    addr: str
    lease: int | None
    clock: Clock


class JobOutcome(Protocol):
    """How the job's rounds end, the same for every node: the restart budget of the
    whole job and the exit barrier (elastrun's dynamic rendezvous keeps both in its
    store)."""

    #: Why ``report_failure`` refused a restart other than an exhausted budget.
    refusal: str | None

    def restarts_used(self) -> int: ...

    def report_failure(self, max_restarts: int, what: str = "") -> bool:
        """A local worker failed (``what``): take one restart from the job's budget, once
        per round however many nodes see it; False when none is left (or ``refusal``)."""

    def report_final_failure(self, what: str, why: str) -> None:
        """A local worker failed so that no restart can help (``why``): end the job on
        every node, as an exhausted budget does."""

    def exit_barrier(self, timeout: float) -> BarrierResult:
        """This node's workers finished: wait (up to ``timeout``) for the round's outcome."""


class ExclusionBoard(Protocol):
    """The job's record of the nodes that sit out a cool-down (``exclusion``)."""

    def set_rule(self, rule: ExclusionRule) -> None:
        """When a node whose workers keep failing sits out a cool-down."""

    def take_kept_at_min(self) -> str | None:
        """Why this node was to be excluded but stayed (the --nnodes minimum), once."""

    def exclude(self, reason: str) -> Exclusion | None:
        """Keep this node out for a cool-down now, for ``reason`` (a failed node check);
        None when the --nnodes minimum keeps it in (``take_kept_at_min`` says why)."""

    def exclusion(self) -> Exclusion | None:
        """This node's exclusion while it holds: it must not join a round until then."""

    def readmit(self) -> None:
        """This node's cool-down is over."""

    def excluded_nodes(self) -> list[Exclusion]:
        """The job's nodes that sit out a cool-down."""

    def wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the run to be closed (in the calling thread's
        current cancel scope); whether it is."""


@runtime_checkable
class ElasticRendezvous(Protocol):
    """The agent's side of an elastic rendezvous's rounds, beyond torch's handler
    methods, with its other parts (``outcome``, ``exclusions``)."""

    #: The longest a node whose agent died unannounced (killed with its workers) stays a
    #: member before the others learn it is lost (its lease's TTL; 0: not known).
    loss_bound: float

    @property
    def outcome(self) -> JobOutcome | None:
        """How the job's rounds end; None: each node ends on its own, as torchrun's."""

    @property
    def exclusions(self) -> ExclusionBoard:
        """The nodes kept out for a cool-down."""

    @property
    def change_reason(self) -> str:
        """Why the running round must re-form (for the agent's log line)."""

    def set_node_info(self, role: str, local_world_size: int) -> None: ...

    def next_round(self, scope: CancelScope) -> RendezvousInfo:
        """The next round (torch's ``next_rendezvous``), waited for in ``scope``.

        Raises:
            Cancelled: ``scope`` was cancelled first.
        """

    def set_change_callback(self, callback: Callable[[], None]) -> None: ...

    def step_away(self, why: str) -> None:
        """This node will not re-join the round after its current one at once (``why``: a
        signal stops it, its agent gave up, it checks itself first): no one may count it
        in that round before it joins. Bounded; never raises."""

    def store_seat(self) -> StoreSeat | None:
        """This node's place in the run's store, with its lease taken first (the node
        check meets the other nodes there); None: no store to meet in (the node is
        checked alone)."""


class NoExclusions:
    """``ExclusionBoard`` with no job-wide record to keep a node out in: a torch-style
    job excludes no one."""

    def set_rule(self, rule: ExclusionRule) -> None:
        pass

    def take_kept_at_min(self) -> str | None:
        return None

    def exclude(self, reason: str) -> Exclusion | None:
        return None

    def exclusion(self) -> Exclusion | None:
        return None

    def readmit(self) -> None:
        pass

    def excluded_nodes(self) -> list[Exclusion]:
        return []

    def wait_closed(self, timeout: float) -> bool:
        cancel.current().sleep(timeout)  # (never asked: no one is excluded here)
        return False


class PlainRendezvous:
    """``ElasticRendezvous`` for a handler that has only torch's methods: no job-wide
    outcome (a budget of the agent's own, no exit barrier) and no exclusions."""

    change_reason = ""
    loss_bound = 0.0  # (torch's handlers keep their liveness to themselves)
    outcome: JobOutcome | None = None

    def __init__(self, handler: RendezvousHandler) -> None:
        self.handler = handler
        self.exclusions: ExclusionBoard = NoExclusions()
        self._joins = Nursery()  # (never closed: see the module docstring)

    def set_node_info(self, role: str, local_world_size: int) -> None:
        pass  # a torch-style handler learns nothing of the node

    def next_round(self, scope: CancelScope) -> RendezvousInfo:
        """The handler's ``next_rendezvous``, in a thread of its own, ended by ``scope``
        (see the module docstring).

        Raises:
            Cancelled: ``scope`` was cancelled first.
            RendezvousTimeoutError: ``scope``'s deadline passed first.
        """
        join = self._joins.call(_next_rendezvous, self.handler, name="elastrun-rendezvous-join")
        if not join.wait(scope):
            raise RendezvousTimeoutError("the rendezvous did not complete before the deadline")
        return join.result()

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        pass  # re-formation is noticed through num_nodes_waiting on the agent's tick

    def step_away(self, why: str) -> None:
        pass  # (torch's handlers count no one in a round before it joins)

    def store_seat(self) -> StoreSeat | None:
        return None  # no store of ours: a node is checked alone, for compute only

    def __repr__(self) -> str:
        return f"PlainRendezvous({self.handler!r}, joins={self._joins.running()})"


def _next_rendezvous(scope: CancelScope, handler: RendezvousHandler) -> RendezvousInfo:
    return handler.next_rendezvous()  # (takes no scope: see the module docstring)


def as_elastic(handler: RendezvousHandler) -> ElasticRendezvous:
    """The handler itself when it is elastic, else a ``PlainRendezvous`` around it."""
    return handler if isinstance(handler, ElasticRendezvous) else PlainRendezvous(handler)
