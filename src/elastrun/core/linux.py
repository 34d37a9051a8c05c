"""The Linux process controls elastrun uses, in one place: ``prctl`` through libc, and
libc itself for the few other calls Python's ``os`` lacks.

Python's ``os`` module has ``pidfd_open`` and ``waitid`` but no ``prctl``, and two of its
options hold up the supervision: the parent-death signal (a worker dies with the agent,
DESIGN.md section 5) and the child subreaper (a worker forked by the template becomes the
agent's child). A package for ``prctl`` would have to be installed in every training
environment, for three calls; ``ctypes`` is already there.

Both sides use this module -- the agent when it starts workers and the template, and the
worker itself (``elastrun.template.worker.child``) -- so it lives in ``core``, the one
layer worker-side code may import, and it imports nothing but ``ctypes``, ``os`` and
``contextlib``: the template imports it before forking its workers.

Safe between ``fork`` and ``exec``: libc and its ``prctl`` symbol are looked up when this
module is imported, so :func:`die_with_parent` in a ``preexec_fn`` makes system calls
only (no symbol lookup, no lock of the dynamic loader that another thread of the parent
may have held at the fork).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

#: ``prctl`` options (``<linux/prctl.h>``).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
#: Yama's option: name the one process (with its descendants) allowed to ptrace this one.
PR_SET_PTRACER = 0x59616D61


# The symbols already loaded into this process (libc's among them): no search, unlike
# ``ctypes.util.find_library``, which runs ``ldconfig`` in a subprocess on every call.
_LIBC: ctypes.CDLL | None
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - a statically linked interpreter
    _LIBC = None


def libc() -> ctypes.CDLL | None:
    """The C library this process runs on (None where it cannot be opened)."""
    return _LIBC


# (Its result type is ctypes' default, ``c_int``.)
_PRCTL: Callable[..., int] | None = getattr(_LIBC, "prctl", None)


def _call(option: int, arg: object) -> None:
    """``prctl(option, arg, 0, 0, 0)``.

    Raises:
        OSError: the kernel refused (its errno), or libc has no ``prctl``.
    """
    if _PRCTL is None:  # pragma: no cover - every Linux libc has prctl
        raise OSError("prctl is not available in this C library")
    if _PRCTL(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def set_parent_death_signal(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies.

    The request is cleared by a fork (the child does not inherit it) and kept across
    ``exec``. The "parent" is the thread that forked this process: a request armed in a
    child whose parent already died never fires -- see :func:`die_with_parent`.

    Raises:
        OSError: ``sig`` is not a valid signal.
    """
    _call(PR_SET_PDEATHSIG, sig)


def die_with_parent(sig: int, parent: int) -> None:
    """In a new child of ``parent``: die with ``sig`` when ``parent`` dies.

    If ``parent`` died before the signal was armed (between the fork and this call, or
    before the child was handed to it), the request would never fire; the child then
    exits at once with status 1, without running any cleanup (``os._exit``).

    Raises:
        OSError: ``sig`` is not a valid signal.
    """
    set_parent_death_signal(sig)
    if os.getppid() != parent:
        os._exit(1)


def set_ptracer(pid: int) -> None:
    """Let ``pid`` and its descendants read this process's memory where Yama restricts
    ptrace to descendants (0: only descendants again); a no-op without Yama."""
    with suppress(OSError):  # EINVAL: no Yama, nothing to allow
        _call(PR_SET_PTRACER, ctypes.c_ulong(pid))


def is_child_subreaper() -> bool:
    """Whether this process adopts its orphaned descendants (``PR_SET_CHILD_SUBREAPER``).

    Raises:
        OSError: the kernel does not know the option (older than 3.4).
    """
    flag = ctypes.c_int(0)
    _call(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag))
    return bool(flag.value)


def set_child_subreaper(on: bool) -> None:
    """Make this process a child subreaper (``on``), or stop being one.

    Raises:
        OSError: the kernel does not know the option (older than 3.4).
    """
    _call(PR_SET_CHILD_SUBREAPER, int(on))


@contextmanager
def child_subreaper() -> Iterator[bool]:
    """Be a child subreaper inside the ``with`` block; yields whether that is so.

    A descendant orphaned inside the block is re-parented to this process instead of
    init. On leaving, the flag is cleared again unless this process already was a
    subreaper before. Where the kernel has no subreapers, the block runs unchanged and
    the value is False.
    """
    try:
        before = is_child_subreaper()
        if not before:
            set_child_subreaper(True)
    except OSError:
        yield False
        return
    try:
        yield True
    finally:
        if not before:
            set_child_subreaper(False)
