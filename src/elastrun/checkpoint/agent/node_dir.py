"""The node's memory checkpoint directory, which the agent holds for its workers.

Workers die and are restarted; the agent stays. So the agent makes the directory
(``/dev/shm/elastrun-ckpt-<run id>-<random>``, mode 0700) before its first workers
start, names it to every worker of every attempt (``ELASTRUN_CHECKPOINT_DIR``), and
removes it, with whatever checkpoints it holds, when the run ends -- successfully, by a
failure or by a signal; if the agent itself is killed, its orphan guard removes it. A
worker restarted on this node finds its predecessor's checkpoints there
(``elastrun.checkpoint.worker``; the layout is ``elastrun.wire.checkpoint``'s).

**Left behind.** When the agent and its guard both die (a sweep that kills every process
of a container or a test's namespace, the OOM killer), nothing is left to remove the
directory, and shared memory is not freed until the machine restarts. So the agent holds
a lock on a file in its directory for as long as it lives (``flock``, which the kernel
releases with the last process that holds it, in any pid namespace), and an agent that
makes its directory first removes every other node directory in the same place whose
lock nobody holds. The lock file appears under its name already locked (made under
another name, locked, renamed), and a directory without one (an agent of an older
elastrun, or one still making its directory) is never removed.

Offered always: an empty directory costs an inode, and only workers that use
``elastrun.checkpoint`` write into it. Where ``/dev/shm`` is missing or not writable,
the workers get no variable (and ``MemoryCheckpoint`` says so if used): a directory on a
disk would not be memory, and is not substituted.

Plain ``os``/``tempfile``/``shutil``: the agent never imports torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable

from elastrun.wire.checkpoint import CHECKPOINT_DIR_ENV, DIR_PREFIX

__all__ = ["LOCK_FILE", "SHARED_MEMORY", "NodeCheckpointDir", "remove_left_behind"]

log = logging.getLogger("elastrun.agent")

#: Where the node's shared memory is mounted (a tmpfs) on Linux.
SHARED_MEMORY = "/dev/shm"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
#: In a node directory: the file its agent holds locked while it lives.
LOCK_FILE = ".agent.lock"


class NodeCheckpointDir:
    """The node's checkpoint directory: made by :meth:`open`, removed by :meth:`close`.

    Args:
        base: where it is made (a tmpfs: the node's shared memory).
        make_dir: makes a fresh directory (``tempfile.mkdtemp``'s signature).
        on_made: told the directory's path once it is made (the orphan guard, which
            removes it if the agent dies before :meth:`close`).
    """

    def __init__(
        self,
        base: str = SHARED_MEMORY,
        *,
        make_dir: Callable[..., str] = tempfile.mkdtemp,
        on_made: Callable[[str], None] | None = None,
    ) -> None:
        self._base = base
        self._make_dir = make_dir
        self._on_made = on_made
        self._path: str | None = None
        self._lock: int | None = None  # (the lock file's descriptor, held while it lives)
        self._failed = False
        self._closed = False
        self._on_close: list[Callable[[], None]] = []

    @property
    def path(self) -> str | None:
        """The directory (None: not made, or not makeable)."""
        return self._path

    def open(self, run_id: str) -> dict[str, str]:
        """The workers' variable naming the directory, made on the first call (later
        calls name the same one); empty when it cannot be made (said once)."""
        if self._path is None and not self._failed and not self._closed:
            prefix = f"{DIR_PREFIX}{_UNSAFE.sub('_', run_id)[:48]}-"
            remove_left_behind(self._base)
            try:
                self._path = self._make_dir(prefix=prefix, dir=self._base)
            except OSError as exc:
                self._failed = True
                log.warning(
                    "no memory checkpoints on this node: cannot make a directory in %s (%s)",
                    self._base,
                    exc.strerror or exc,
                )
            else:
                self._lock = _hold_lock(self._path)
                if self._on_made is not None:
                    self._on_made(self._path)
        return {CHECKPOINT_DIR_ENV: self._path} if self._path is not None else {}

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (which must not raise) first when the directory is closed:
        what reads or writes the directory for as long as it lives (its server)."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Remove the directory and every checkpoint in it (idempotent; never raises:
        what cannot be removed is logged)."""
        self._closed = True
        callbacks, self._on_close = self._on_close, []
        for callback in reversed(callbacks):
            callback()
        path, self._path = self._path, None
        lock, self._lock = self._lock, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
            if os.path.lexists(path):
                log.warning("memory checkpoints: could not remove all of %s", path)
        if lock is not None:
            os.close(lock)  # (after the removal: no other agent takes it for left behind)

    def __repr__(self) -> str:
        return f"NodeCheckpointDir(base={self._base!r}, path={self._path!r})"


def remove_left_behind(base: str) -> list[str]:
    """Remove the node directories in ``base`` whose agent is gone: their lock file is
    there and nobody holds it (see the module). The directories removed; never raises."""
    removed = []
    with contextlib.suppress(OSError):
        names = [n for n in os.listdir(base) if n.startswith(DIR_PREFIX)]
        for name in sorted(names):
            path = os.path.join(base, name)
            try:
                fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # (no lock file: an older agent's, or one still being made)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # (held: its agent lives)
            else:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                log.info("memory checkpoints: removed %s, left behind by an agent that died", path)
            finally:
                os.close(fd)
    return removed


def _hold_lock(path: str) -> int | None:
    """Make the directory's lock file and hold it: locked before it has its name, so
    that no other agent ever finds it unlocked while this one lives. Its descriptor
    (None: it could not be made; the directory is then never taken for left behind)."""
    tmp = os.path.join(path, LOCK_FILE + ".tmp")
    fd = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, os.path.join(path, LOCK_FILE))
    except OSError as exc:
        if fd is not None:
            os.close(fd)
        log.debug("memory checkpoints: no lock file in %s: %s", path, exc)
        return None
    return fd
