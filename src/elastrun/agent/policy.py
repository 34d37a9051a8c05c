"""The restart budget the budget rung charges (``agent.rungs``)."""

from __future__ import annotations

from typing import Protocol

from elastrun.core import cancel
from elastrun.core.errors import StoreError


class RestartBudget(Protocol):
    """Counts failure restarts; a job-wide budget lives in the rendezvous store."""

    @property
    def limit(self) -> int: ...

    def used(self) -> int:
        """The restarts used so far (a job-wide budget reads its store, bounded)."""
        ...

    def try_consume(self, what: str = "") -> bool:
        """Take one restart for the failure ``what``; False when the budget is exhausted."""
        ...


class LocalRestartBudget:
    """A budget kept by this agent alone (single node)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0

    def used(self) -> int:
        return self._used

    def try_consume(self, what: str = "") -> bool:
        if self._used >= self.limit:
            return False
        self._used += 1
        return True

    def __repr__(self) -> str:
        return f"LocalRestartBudget(used={self._used}, limit={self.limit})"


class JobBudgetSource(Protocol):
    """Where the job-wide restart budget is kept (the part of a rendezvous's
    ``elastic.JobOutcome`` that the budget reads)."""

    #: Why the last failure got no restart, when the budget was not the reason.
    refusal: str | None

    def report_failure(self, max_restarts: int, what: str = "") -> bool: ...

    def restarts_used(self) -> int: ...


#: How long reading the job's restart count may take (``JobRestartBudget.used()``).
READ_BOUND = 1.0


class JobRestartBudget:
    """The restart budget of the whole job, kept in the rendezvous store.

    A failure seen by several nodes in the same round costs one restart.
    """

    def __init__(self, source: JobBudgetSource, limit: int) -> None:
        self._source = source
        self.limit = limit
        self._known = 0  # the count last read

    def used(self) -> int:
        """The count in the store, read within ``READ_BOUND`` (else the one last read: a
        store that stopped answering must not hold the agent, which reads the count for
        its log lines between starting its workers and watching them)."""
        try:
            with cancel.current().child(READ_BOUND) as scope, scope.active():
                # The counter passes the limit by one when the failing node finds it
                # exhausted.
                self._known = min(self._source.restarts_used(), self.limit)
        except StoreError:
            pass
        return self._known

    def try_consume(self, what: str = "") -> bool:
        return self._source.report_failure(self.limit, what)

    @property
    def refusal(self) -> str | None:
        """Why the last failure got no restart, when the budget was not the reason."""
        return self._source.refusal

    def __repr__(self) -> str:
        return f"JobRestartBudget(limit={self.limit})"


def default_budget(source: JobBudgetSource | None, max_restarts: int) -> RestartBudget:
    """Job-wide when the rendezvous keeps a budget in its store (``source``: its
    ``outcome``), else this agent's own."""
    if source is not None:
        return JobRestartBudget(source, max_restarts)
    return LocalRestartBudget(max_restarts)
