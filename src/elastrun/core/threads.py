"""The one way elastrun starts a thread, and waits a bounded time for one to end.

Every background thread of ours is named (``elastrun-...``: a stack dump, ``py-spy`` or
a leak check tells whose it is) and is a daemon unless its owner says otherwise: a
thread left behind by a store that stopped answering must never keep the process alive.

**Nurseries.** An owner whose threads live as long as it does starts them in a
:class:`Nursery`: each thread runs in the nursery's cancel scope (``core.cancel``),
current for the thread, and closing the nursery cancels the scope and joins every
thread it started, within one bound. A thread stops by the scope it was handed: it
sleeps with ``scope.sleep``, waits for a descriptor with ``scope.wait_readable``, or
wires what it blocks in to ``scope.on_cancel`` (shut a socket down); a store call it
makes observes the scope by itself. So an owner keeps no stop event, waker or pipe of
its own, and cannot forget to join what it started.

Two kinds of thread do not stop when asked, and are nursery threads all the same:

* A thread whose owner waits for its *result* (:meth:`Nursery.call`): the wait takes
  the caller's scope, and a cancelled scope ends the wait, not the call. A call into
  code that takes no scope (a torch-style rendezvous handler's join) cannot be
  interrupted; it is left to end on its own, in its nursery.
* A thread that ends on its own (the output relay drains its pipes until they end or
  its owner's deadline): its target leaves the scope aside, and closing the nursery
  with that deadline (``close(timeout=...)``) is only its bounded join.

Nothing here logs a thread's failure: every target either handles its own errors or
hands them to the thread that waits for it (the rendezvous join, the store server's
start), and the interpreter's ``threading.excepthook`` reports the rest.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar, TypeVarTuple

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.clock import SYSTEM_CLOCK, Deadline

__all__ = ["Call", "Nursery", "join_thread"]

log = logging.getLogger("elastrun.threads")
T = TypeVar("T")
Ts = TypeVarTuple("Ts")


def join_thread(thread: threading.Thread | None, timeout: float | None) -> bool:
    """Wait up to ``timeout`` seconds (None: without a bound) for ``thread`` to end.

    Returns False only when ``thread`` still runs after the wait; True when it ended, or
    there is nothing to wait for: no thread, a thread never started, or the calling
    thread itself (a thread that closes its own owner ends once it returns; joining it
    would raise). Never raises.
    """
    if thread is None or thread.ident is None or thread is threading.current_thread():
        return True
    thread.join(timeout)
    return not thread.is_alive()


class Nursery:
    """Threads that share one cancel scope and end with their owner.

    Args:
        parent: the owner's scope, if it has one: cancelling it stops the threads too.
        join_timeout: how long :meth:`close` waits, in all, for the threads to end
            (None: without a bound).
    """

    def __init__(self, parent: CancelScope | None = None, *, join_timeout: float | None = 5.0):
        self.scope = CancelScope() if parent is None else parent.child()
        self._join_timeout = join_timeout
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def start(
        self,
        target: Callable[[CancelScope, *Ts], object],
        *args: *Ts,
        name: str,
        daemon: bool = True,
    ) -> threading.Thread:
        """Start ``target(scope, *args)`` on a thread, the scope current in it; give the
        thread its ``name=`` (and ``daemon=``, True unless given). A target that raises
        ``Cancelled`` has ended normally.

        Raises:
            RuntimeError: the nursery is closed, or no thread can be started.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"cannot start {name}: its nursery is closed")
            self._threads = [t for t in self._threads if t.ident is None or t.is_alive()]
            # (The one threading.Thread of the package: tests/unit/test_layout_threads.py.)
            thread = threading.Thread(
                target=self._run, args=(target, args), name=name, daemon=daemon
            )
            self._threads.append(thread)
        thread.start()
        return thread

    def call(
        self,
        target: Callable[[CancelScope, *Ts], T],
        *args: *Ts,
        name: str,
        daemon: bool = True,
    ) -> Call[T]:
        """Start ``target(scope, *args)`` as :meth:`start` does, for its value: the
        :class:`Call` returned waits for it in the caller's scope and hands over what it
        returned or raised. A wait that ends first leaves the thread running; closing the
        nursery cancels its scope and joins it as any other.

        Raises:
            RuntimeError: the nursery is closed, or no thread can be started.
        """
        call: Call[T] = Call()
        call.thread = self.start(call._run, target, args, name=name, daemon=daemon)
        return call

    def _run(self, target: Callable[..., object], args: tuple[object, ...]) -> None:
        with self.scope.active(), contextlib.suppress(Cancelled):
            target(self.scope, *args)

    @property
    def closed(self) -> bool:
        return self._closed

    def running(self) -> list[str]:
        """The names of the threads still running."""
        with self._lock:
            return [t.name for t in self._threads if t.is_alive()]

    def close(self, reason: str = "closed", timeout: float | None = None) -> list[str]:
        """Cancel the scope and join every thread, within ``timeout`` in all (None: the
        nursery's own bound); idempotent. The names of the threads still running after
        it (daemons, left to the process's end; logged), never the calling thread's."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        self.scope.cancel(reason)
        bound = self._join_timeout if timeout is None else timeout
        deadline = Deadline.never(SYSTEM_CLOCK) if bound is None else Deadline.after(bound)
        left = [t.name for t in threads if not join_thread(t, deadline.timeout())]
        if left:  # (only with a bound: without one, every join above waited to the end)
            log.warning(
                "threads still running %s s after their nursery closed: %s", bound, ", ".join(left)
            )
        else:
            self.scope.close()
        return left

    def __enter__(self) -> Nursery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Nursery({state}, running={self.running()})"


class Call(Generic[T]):
    """What a target started by :meth:`Nursery.call` returned or raised, once it did."""

    thread: threading.Thread

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._done = False
        self._value: list[T] = []  # (a box: T may itself be None)
        self._error: BaseException | None = None

    def _run(self, scope: CancelScope, target: Callable[..., T], args: tuple[object, ...]) -> None:
        try:
            self._value.append(target(scope, *args))
        except BaseException as exc:  # handed to whoever waits for it (``result``)
            self._error = exc
        with self._cond:
            self._done = True
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        """Whether the target returned or raised."""
        return self._done

    def wait(self, scope: CancelScope) -> bool:
        """Wait in ``scope`` for the target to end: True once it has; False when the
        scope's deadline came first. Neither ends the target's thread.

        Raises:
            Cancelled: ``scope`` was cancelled first.
        """

        def wake() -> None:
            with self._cond:
                self._cond.notify_all()

        with scope.wakes(wake), self._cond:
            while not self._done:
                scope.raise_if_cancelled()
                if scope.expired():
                    return False
                self._cond.wait(scope.deadline.timeout())
        return True

    def result(self) -> T:
        """The target's value; what it raised is raised here.

        Raises:
            RuntimeError: the target has not ended (``wait`` first).
        """
        with self._cond:
            if not self._done:
                raise RuntimeError(f"{self.thread.name} has not ended yet")
            if self._error is not None:
                raise self._error
            return self._value[0]

    def __repr__(self) -> str:
        state = "raised" if self._error is not None else "returned" if self._done else "running"
        return f"Call({self.thread.name}, {state})"
