"""What the agent needs from an elastic rendezvous, as one typed interface.

torch's handler interface (``api.RendezvousHandler``) knows rounds, but not the rest of
an elastic job: who this node is, news that the running round must re-form, the
job-wide restart budget, the exit barrier, and whether a cancel scope ends its waits.
``ElasticRendezvous`` names those; elastrun's dynamic handler implements them, and
``as_elastic`` wraps any other handler (torch-style plugins, the standalone one) in
``PlainRendezvous``, which answers as torchrun would: no barrier, a per-agent budget,
no news between rounds other than ``num_nodes_waiting``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from elastrun.rendezvous.api import BarrierResult, RendezvousHandler, RoundOutcome


@runtime_checkable
class ElasticRendezvous(Protocol):
    """The agent's side of an elastic rendezvous, beyond torch's handler methods."""

    #: Whether its waits observe the caller's current cancel scope (``core.cancel``):
    #: the agent then runs it in its shutdown scope, not in a helper thread.
    observes_cancel_scope: bool
    #: Whether ``report_failure``/``restarts_used`` keep a budget for the whole job.
    keeps_job_budget: bool
    #: Whether ``exit_barrier`` waits for the other nodes (else there is none).
    has_exit_barrier: bool
    #: Why the running round must re-form (for the agent's log line).
    change_reason: str
    #: Why ``report_failure`` refused a restart other than an exhausted budget.
    refusal: str | None

    def set_node_info(self, role: str, local_world_size: int) -> None: ...

    def set_change_callback(self, callback: Callable[[], None]) -> None: ...

    def report_failure(self, max_restarts: int, what: str = "") -> bool: ...

    def restarts_used(self) -> int: ...

    def exit_barrier(self, timeout: float) -> BarrierResult: ...


class PlainRendezvous:
    """``ElasticRendezvous`` for a handler that has only torch's methods."""

    observes_cancel_scope = False
    keeps_job_budget = False
    has_exit_barrier = False
    change_reason = ""
    refusal: str | None = None

    def __init__(self, handler: RendezvousHandler) -> None:
        self.handler = handler

    def set_node_info(self, role: str, local_world_size: int) -> None:
        pass  # a torch-style handler learns nothing of the node

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        pass  # re-formation is noticed through num_nodes_waiting on the agent's tick

    def report_failure(self, max_restarts: int, what: str = "") -> bool:
        raise NotImplementedError("a torch-style rendezvous keeps no job-wide budget")

    def restarts_used(self) -> int:
        raise NotImplementedError("a torch-style rendezvous keeps no job-wide budget")

    def exit_barrier(self, timeout: float) -> BarrierResult:
        return BarrierResult(RoundOutcome.SUCCEEDED)  # none: each node ends on its own

    def __repr__(self) -> str:
        return f"PlainRendezvous({self.handler!r})"


def as_elastic(handler: RendezvousHandler) -> ElasticRendezvous:
    """The handler itself when it is elastic, else a ``PlainRendezvous`` around it."""
    if isinstance(handler, ElasticRendezvous):
        return handler
    return PlainRendezvous(handler)
