"""The one way elastrun starts a thread, and waits a bounded time for one to end.

Every background thread of ours is named (``elastrun-...``: a stack dump, ``py-spy`` or
a leak check tells whose it is) and is a daemon unless its owner says otherwise: a
thread left behind by a store that stopped answering must never keep the process alive.
How each thread is asked to stop stays its owner's (an event, a waker, a closed
socket): it depends on what the thread blocks in, which only the owner knows.

Nothing here logs a thread's failure: every target either handles its own errors or
hands them to the thread that waits for it (the rendezvous join, the store server's
start), and the interpreter's ``threading.excepthook`` reports the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def new_thread(
    target: Callable[..., object], *args: object, name: str, daemon: bool = True
) -> threading.Thread:
    """A thread that will run ``target(*args)``, not yet started.

    For an owner that must publish the thread before it runs (so that closing, on
    another thread, can find it); everyone else calls :func:`start_thread`.
    """
    return threading.Thread(target=target, args=args, name=name, daemon=daemon)


def start_thread(
    target: Callable[..., object], *args: object, name: str, daemon: bool = True
) -> threading.Thread:
    """Start ``target(*args)`` on a thread called ``name``; the thread, started.

    Raises:
        RuntimeError: the process cannot start another thread.
    """
    thread = new_thread(target, *args, name=name, daemon=daemon)
    thread.start()
    return thread


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
