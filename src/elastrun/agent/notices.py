"""News for the agent loop that is no stop request: "look again".

Two threads have news that must end the loop's wait for worker exits without ending the
run: the rendezvous' watch (a node waits to join: the loop considers re-forming) and the
in-process hub (a worker's message: the loop answers it). They ``post`` a notice; the
wait watches ``fileno`` beside the stop scope, and every pass of the loop ``take``\\ s the
notices before it looks at what changed. A notice posted while the loop looks, or
between two waits, stays in the pipe and makes the next wait return at once: none is
lost, and nothing polls.

Why not a child scope that a notice cancels: a notice asks for a look, not an end. The
wait would raise for news, and a fresh scope per wait, plus a flag for the notices
posted between two waits, would rebuild what this pipe already is. Stop requests, in
turn, go through the cancel scope only.
"""

from __future__ import annotations

import threading

from elastrun.core.waker import Waker


class Notices:
    """A pending "look again" for the agent loop (thread-safe ``post``).

    The pipe is made on first use (assembling an agent does no I/O); after ``close`` a
    post is dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pipe: Waker | None = None
        self._closed = False

    def post(self) -> None:
        """Ask the loop to look again (from any thread)."""
        pipe = self._open()
        if pipe is not None:
            pipe.wake()

    def fileno(self) -> int:
        """A descriptor readable while a notice is pending (for the loop's wait)."""
        pipe = self._open()
        if pipe is None:
            raise ValueError("the notices are closed")
        return pipe.fileno()

    def take(self) -> None:
        """Consume the pending notices: the loop is about to look at what changed."""
        pipe = self._open()
        if pipe is not None:
            pipe.drain()

    def _open(self) -> Waker | None:
        with self._lock:
            if self._pipe is None and not self._closed:
                self._pipe = Waker()
            return self._pipe

    def close(self) -> None:
        with self._lock:
            pipe, self._pipe = self._pipe, None
            self._closed = True
        if pipe is not None:
            pipe.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._pipe is not None else "unused")
        return f"Notices({state})"
