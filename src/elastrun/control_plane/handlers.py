"""The worker server's handlers: ``ping`` and ``dump_traceback`` (torch's names)."""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Collection, Mapping

from elastrun.control_plane.protocol import Handler

__all__ = ["DEFAULT_HANDLERS", "SERVER_THREAD", "dump_stacks"]

#: The name of the server's threads, whose stacks a dump leaves out.
SERVER_THREAD = "elastrun-worker-server"


def dump_stacks(omit: Collection[int] = ()) -> str:
    """The current Python stack of every thread of this process, as text.

    Each thread starts with a header naming it (``Thread <ident> "<name>"``), the main
    thread first, then its stack, outermost call first.

    Args:
        omit: idents of threads listed by their header only (the worker server's own
            threads, whose stacks would only show the server answering).
    """
    frames = sys._current_frames()
    names = {t.ident: t for t in threading.enumerate()}
    main_ident = threading.main_thread().ident
    parts: list[str] = []
    for ident in sorted(frames, key=lambda i: (i != main_ident, getattr(names.get(i), "name", ""))):
        thread = names.get(ident)
        label = f'"{thread.name}"' if thread is not None else "(not started by threading)"
        daemon = " daemon" if thread is not None and thread.daemon else ""
        if ident in omit:
            parts.append(f"Thread {ident} {label}{daemon}: the worker server, stack omitted\n\n")
            continue
        parts.append(f"Thread {ident} {label}{daemon} (most recent call last):\n")
        parts.extend(traceback.format_stack(frames[ident]))
        parts.append("\n")
    return "".join(parts)


def _ping() -> tuple[bytes, str]:
    return b"pong", "text/plain"


def _dump_traceback() -> tuple[bytes, str]:
    ours = {threading.get_ident()}
    ours.update(t.ident for t in threading.enumerate() if t.name == SERVER_THREAD and t.ident)
    return dump_stacks(omit=ours).encode("utf-8", "replace"), "text/plain; charset=utf-8"


DEFAULT_HANDLERS: Mapping[str, Handler] = {"ping": _ping, "dump_traceback": _dump_traceback}
