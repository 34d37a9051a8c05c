"""Installing and restoring the launcher's signal handlers (the only place that does)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from elastrun.core.shutdown import ShutdownRequest

log = logging.getLogger("elastrun.launch")

Handler = Callable[[int, FrameType | None], object] | int | None


def install_signal_handlers(
    signals: Sequence[signal.Signals], request: ShutdownRequest
) -> Callable[[], None]:
    """Route ``signals`` to ``request`` and wake the agent; returns a restore function.

    The handlers only record the request: the agent acts on it at a safe point. Outside
    the main thread Python cannot install handlers; a warning says so and the launcher
    relies on the parent-death guarantees instead.
    """
    if threading.current_thread() is not threading.main_thread():
        log.warning("not on the main thread: signals will not be forwarded to workers")
        return lambda: None

    def handler(signum: int, frame: FrameType | None) -> None:
        request.request(signum)

    previous: dict[signal.Signals, Handler] = {}
    for sig in signals:
        try:
            previous[sig] = signal.signal(sig, handler)
        except (OSError, ValueError) as exc:
            log.warning("cannot handle %s: %s", sig.name, exc)
    old_wakeup = request.waker.install_as_signal_wakeup()

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(old_wakeup)

    return restore
