"""The agent's calls into the dynamic rendezvous, each in a scope that ``leave`` ends.

A call made for the agent (joining, the exit barrier, the budget) waits on the store. A
signal that cancels the agent's scope ends it, as any wait; so must ``leave`` from
another thread, which does not know the caller's scope: each call runs in a child scope
of its own, kept here while it runs, and ``cancel_all`` cancels them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from elastrun.core import cancel
from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    StoreUnavailableError,
)


@dataclass(eq=False)
class AgentCalls:
    """The agent's calls in progress, and how each one ends.

    Args:
        stop: set when this node leaves: a call cancelled then says so.
        give_up: gives the store up for good (``Liveness.store_gone``); the line that
            says so.
    """

    stop: threading.Event
    give_up: Callable[[StoreUnavailableError], str]
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)  # ``_calls``
    _calls: set[CancelScope] = field(default_factory=set, init=False)  # those in progress

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Run one of the agent's calls in a child scope of the caller's current one.

        Raises:
            RendezvousConnectionError: the store was given up.
            RendezvousClosedError: this node left while the call waited.
        """
        with cancel.current().child() as calls, calls.active():
            with self._lock:
                self._calls.add(calls)
            try:
                yield
            except StoreUnavailableError as exc:  # given up for good: say so once
                raise RendezvousConnectionError(self.give_up(exc)) from exc
            except Cancelled:
                if self.stop.is_set():
                    raise RendezvousClosedError(
                        "this node left the rendezvous while it was waiting"
                    ) from None
                raise
            finally:
                with self._lock:
                    self._calls.discard(calls)

    def cancel_all(self, reason: str) -> None:
        with self._lock:
            calls = list(self._calls)
        for scope in calls:
            scope.cancel(reason)

    def __repr__(self) -> str:
        return f"AgentCalls(in_progress={len(self._calls)}, stopped={self.stop.is_set()})"
