"""Installing and restoring the launcher's signal handlers (the only place that does).

A signal becomes a ``ShutdownRequest.request`` in a thread of our own, the relay, not in
the handler. Python runs a handler only on the main thread, between two bytecodes: a
main thread blocked in a wait (a lock, or a ``select`` on descriptors the signal does not
touch) runs it only when that wait ends by itself, and when the kernel delivers the
signal to another thread the wait is not even interrupted. Nor may a handler cancel a
scope: cancelling takes locks that the code it interrupted may hold.

So the interpreter's wake-up descriptor (``signal.set_wakeup_fd``), to which its C-level
handler writes each signal's number from whichever thread receives it, is the relay's
pipe; the relay reads the numbers and makes the requests, which cancel the shutdown
scope and so end every wait of the agent, on any thread, at once. The Python handlers
installed do nothing: they replace the default action (and only a Python handler makes
the interpreter write the descriptor).
"""

from __future__ import annotations

import logging
import selectors
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from elastrun.core.cancel import CancelScope
from elastrun.core.shutdown import ShutdownRequest
from elastrun.core.threads import Nursery
from elastrun.core.waker import Waker

log = logging.getLogger("elastrun.launch")

Handler = Callable[[int, FrameType | None], object] | int | None

# How long closing waits for the relay thread (it only reads a pipe).
_RELAY_JOIN = 5.0


def install_signal_handlers(
    signals: Sequence[signal.Signals], request: ShutdownRequest
) -> Callable[[], None]:
    """Route ``signals`` to ``request`` through a relay thread; returns a restore function.

    Outside the main thread Python cannot install handlers; a warning says so and the
    launcher relies on the parent-death guarantees instead.
    """
    if threading.current_thread() is not threading.main_thread():
        log.warning("not on the main thread: signals will not be forwarded to workers")
        return lambda: None
    relayed = frozenset(int(s) for s in signals)  # other handlers' signals are skipped
    pipe = Waker()  # the interpreter's wake-up descriptor, not a stop flag

    def relay(scope: CancelScope) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(pipe.fileno(), selectors.EVENT_READ)
            sel.register(scope.fileno(), selectors.EVENT_READ)  # cancelled by ``restore``
            while True:
                sel.select()
                for signum in pipe.drain():  # relayed even when ``restore`` woke it
                    if signum in relayed:
                        request.request(signum)
                scope.raise_if_cancelled()

    nursery = Nursery(join_timeout=_RELAY_JOIN)
    nursery.start(relay, name="elastrun-signal-relay")
    previous: dict[signal.Signals, Handler] = {}
    for sig in signals:
        try:
            previous[sig] = signal.signal(sig, _relayed)
        except (OSError, ValueError) as exc:
            log.warning("cannot handle %s: %s", sig.name, exc)
    old_wakeup = pipe.install_as_signal_wakeup()

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(old_wakeup)
        # The relay stops only after the wake-up descriptor was restored.
        nursery.close("closed")
        pipe.close()

    return restore


def _relayed(signum: int, frame: FrameType | None) -> None:
    """The Python handler of a relayed signal: nothing to do (see the module docstring)."""
