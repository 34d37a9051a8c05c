"""The node's memory checkpoint directory, which the agent holds for its workers.

Workers die and are restarted; the agent stays. So the agent makes the directory
(``/dev/shm/elastrun-ckpt-<run id>-<random>``, mode 0700) before its first workers
start, names it to every worker of every attempt (``ELASTRUN_CHECKPOINT_DIR``), and
removes it, with whatever checkpoints it holds, when the run ends -- successfully, by a
failure or by a signal; if the agent itself is killed, its orphan guard removes it. A
worker restarted on this node finds its predecessor's checkpoints there
(``elastrun.checkpoint.worker``; the layout is ``elastrun.wire.checkpoint``'s).

Offered always: an empty directory costs an inode, and only workers that use
``elastrun.checkpoint`` write into it. Where ``/dev/shm`` is missing or not writable,
the workers get no variable (and ``MemoryCheckpoint`` says so if used): a directory on a
disk would not be memory, and is not substituted.

Plain ``os``/``tempfile``/``shutil``: the agent never imports torch.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable

from elastrun.wire.checkpoint import CHECKPOINT_DIR_ENV, DIR_PREFIX

__all__ = ["SHARED_MEMORY", "NodeCheckpointDir"]

log = logging.getLogger("elastrun.agent")

#: Where the node's shared memory is mounted (a tmpfs) on Linux.
SHARED_MEMORY = "/dev/shm"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


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
        if path is None:
            return
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            log.warning("memory checkpoints: could not remove all of %s", path)

    def __repr__(self) -> str:
        return f"NodeCheckpointDir(base={self._base!r}, path={self._path!r})"
