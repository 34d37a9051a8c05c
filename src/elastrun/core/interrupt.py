"""Blocking calls that a signal ends at once: every wait of the agent runs in the
shutdown request's cancel scope.

A signal cancels that scope (the launcher's relay thread makes the ``ShutdownRequest``);
each wait the agent makes -- the wait for worker exits, the template's start-up and
forks, the rendezvous (``ElasticRendezvous.next_round``), the exit barrier, the job-wide
budget's store calls, the nodes' in-process agreement -- is handed the scope, and the
store waits deep inside code that takes no scope argument observe it as the thread's
current scope (the whole loop runs with it current). A cancelled wait raises
``Cancelled``; here that becomes ``ShutdownRequested``, which the loop answers in one
place by stopping the workers with the signal. No thread is started to make a wait end:
a wait that cannot take the scope is a defect, except inside the adapter of a
torch-style rendezvous handler (``rendezvous.elastic``), which owns the one thread that
foreign code needs.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import TypeVar

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.errors import ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest

log = logging.getLogger("elastrun.agent")

T = TypeVar("T")


class Interruptible:
    """Runs the agent's blocking calls in the shutdown scope; a signal ends them with
    ``ShutdownRequested``.

    The agent's loop answers that exception (it stops the workers with the signal); this
    object only ends the wait, so the rounds, the in-process steps and the restart
    budget's store calls use it without calling back into the loop.

    Args:
        shutdown: the request the launcher's signal handlers set; its ``scope`` is the
            root scope of every wait.
    """

    def __init__(self, shutdown: ShutdownRequest) -> None:
        self._shutdown = shutdown

    @property
    def scope(self) -> CancelScope:
        """The root scope: cancelled by the first shutdown request."""
        return self._shutdown.scope

    def __call__(self, call: Callable[[CancelScope], T], what: str) -> T:
        """``call(scope)``'s value, unless a signal comes first: for a wait that takes
        its scope (a select on the scope's descriptor, a wait with a deadline of its
        own). The scope is also the calling thread's current one while ``call`` runs.

        Raises:
            ShutdownRequested: a signal was received before or during the call.
        """
        return self.run(lambda: call(self._shutdown.scope), what)

    def run(self, call: Callable[[], T], what: str) -> T:
        """``call()``'s value, unless a signal comes first: for a call whose store waits
        observe the thread's current scope (the shutdown scope, while ``call`` runs).

        Raises:
            ShutdownRequested: a signal was received before or during the call.
        """
        try:
            with self._shutdown.scope.active():
                return call()
        except Cancelled:
            log.info("stopped while waiting for the %s", what)
            signum = self._shutdown.signum
            raise ShutdownRequested(signum if signum is not None else signal.SIGTERM) from None

    def __repr__(self) -> str:
        return f"Interruptible({self._shutdown!r})"
