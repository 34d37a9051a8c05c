"""Memory checkpoints persisted to a directory, in DCP's own format, in the background.

``MemoryCheckpoint(persist_dir=..., persist_every=N)`` writes the newest step complete
on every rank to ``<persist_dir>/step-<S>/`` after every N complete steps, and
``MemoryCheckpoint.persist()`` on request, as DCP's ``FileSystemWriter`` does (a
``.metadata`` file, a data file per rank): plain ``torch.distributed.checkpoint.load``
loads it into a world of any size (DCP reshards), without elastrun.

**Who does what.** The checkpoint's background thread decides when
(``persisting.PersistScheduler``, in the order of the saves: the same decision on every rank.
Before a persist begins, the ranks agree that every rank's persister is idle and
unbroken, so that every rank begins it, a collective, or none does; one that falls due
while another is in flight waits for a later save) and hands the step to
:class:`Persister`, whose own thread does the rest:

1. it copies the rank's step out of the node's memory (``persist_plan.read_snapshot``);
   until then the checkpoint's thread keeps the step (:meth:`Persister.wait_snapshot`
   before it removes any), after it the next saves go on as before;
2. rank 0 removes what a persist that died left (temporary directories);
3. the ranks agree on a temporary name (``.step-<S>.tmp-<token>``) and DCP's collective
   save writes the step there, over a gloo group of the persister's own, never the
   user's process group (a collective there from a second thread would interleave with
   the training's);
4. rank 0 checks that every rank's file is there (a directory that is not shared by all
   ranks fails here, saying so), renames the directory to its final name, and removes
   the persisted steps beyond the newest ``persist_keep``; the ranks then agree on the
   outcome.

A directory under a final name is therefore always complete. A persist that fails (the
disk full, no permission, a rank's file missing) is logged, its temporary directory is
removed, and training goes on: the next one tries again.

Rejected: persisting on the checkpoint's own thread (a slow disk would hold up every
save after it); keeping the step in the node's memory until it is written (a third step
per rank in ``/dev/shm``, whose size is checked for two); each rank writing its own
standalone checkpoint (plain DCP could not load it into another world size).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from elastrun.checkpoint.worker.errors import MemoryCheckpointError
from elastrun.checkpoint.worker.persist_plan import Snapshot, SnapshotPlanner, read_snapshot
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.core.cancel import CancelScope
from elastrun.core.errors import ConfigError
from elastrun.core.threads import Nursery
from elastrun.core.values import size_text

__all__ = [
    "PersistSettings",
    "Persister",
    "persist_settings",
    "persisted_steps",
    "step_dir_name",
    "steps_to_remove",
]

log = logging.getLogger("elastrun.checkpoint")

#: Persisted steps kept by default.
DEFAULT_KEEP = 2

#: How much lower the persisting thread's CPU priority is than the training's.
_NICER = 10


_FINAL = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"\.step-\d+\.(?:tmp|old)-[0-9a-f]+")


@dataclass(frozen=True)
class PersistSettings:
    """Where and how often steps are persisted (see :func:`persist_settings`)."""

    directory: str
    every: int | None
    keep: int


def persist_settings(
    directory: str | os.PathLike[str] | None, every: int | None, keep: int
) -> PersistSettings | None:
    """The persist settings of ``MemoryCheckpoint``'s arguments (None: no persisting).

    Raises:
        ConfigError: ``every`` or ``keep`` is not an integer >= 1 (``every`` may be
            None), or either is given without a directory.
    """
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ConfigError("persist_every", every, "an integer >= 1, or None (on request only)")
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ConfigError("persist_keep", keep, "an integer >= 1")
    if directory is None:
        if every is not None:
            raise ConfigError("persist_every", every, "persist_dir is not given")
        if keep != DEFAULT_KEEP:
            raise ConfigError("persist_keep", keep, "persist_dir is not given")
        return None
    path = os.fspath(directory)
    if not isinstance(path, str) or not path:
        raise ConfigError("persist_dir", directory, "a directory's path")
    return PersistSettings(os.path.abspath(path), every, keep)


def step_dir_name(step: int) -> str:
    """A persisted step's directory in the persist directory."""
    return f"step-{step}"


def persisted_steps(directory: str) -> list[int]:
    """The steps persisted in ``directory`` (directories under a final name), oldest
    first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = (_FINAL.fullmatch(n) for n in names)
    return sorted(int(m.group(1)) for m in found if m)


def steps_to_remove(existing: Iterable[int], new: int, keep: int) -> list[int]:
    """The persisted steps to remove once ``new`` is complete, keeping ``keep``: the
    newest ones, and ``new`` always (a step lower than older ones -- a run that
    started again -- is kept all the same)."""
    others = sorted({s for s in existing if s != new}, reverse=True)
    return sorted(others[keep - 1 :])


class Persister:
    """Persists steps of rank ``steps.rank`` on a thread of its own (see the module).

    Args:
        settings: the directory and how many steps to keep.
        steps: the rank's steps in the node's memory.
        group: the persister's own gloo group of every rank (None: a world of one).
        before_rename: called on the persisting thread of every rank with a step whose
            files are all written, before it is renamed into place (a seam for tests
            that kill the process there).

    :meth:`begin` and :meth:`wait_snapshot` are the checkpoint thread's;
    :meth:`wait` and :meth:`close` the training thread's.
    """

    def __init__(
        self,
        settings: PersistSettings,
        steps: RankSteps,
        group: dist.ProcessGroup | None,
        *,
        before_rename: Callable[[int], object] | None = None,
    ) -> None:
        self.settings = settings
        self._steps = steps
        self._group = group
        self._before_rename = before_rename
        self._nursery = Nursery(join_timeout=None)  # (a thread per persist: see _persist)
        self._lock = threading.Condition()
        self._busy = False  # a persist began and has not ended
        self._copying = False  # its step is being copied out of the node's memory
        self._persisted: int | None = None
        self._broken: str | None = None

    @property
    def persisted(self) -> int | None:
        """The newest step this process persisted (None: none yet)."""
        with self._lock:
            return self._persisted

    def ready(self) -> bool:
        """No persist in flight here, and none in which the ranks lost each other (then
        no further one is started)."""
        with self._lock:
            return not self._busy and self._broken is None

    def begin(self, step: int) -> None:
        """Persist ``step`` (complete on every rank) in the background; the caller
        keeps it in memory until :meth:`wait_snapshot` returns. Every rank begins the
        same steps, in the same order, each while its persister is idle."""
        with self._lock:
            if self._busy:
                raise RuntimeError("a persist is in flight")  # (the callers agree first)
            self._busy = True
            self._copying = True
        self._nursery.start(self._run, step, name="elastrun-checkpoint-persist")

    def wait_snapshot(self) -> None:
        """Until the step in flight is copied out of the node's memory (it may then be
        removed or written over)."""
        with self._lock:
            self._lock.wait_for(lambda: not self._copying)

    def wait(self) -> None:
        """Until no persist is in flight here."""
        with self._lock:
            self._lock.wait_for(lambda: not self._busy)

    def close(self) -> None:
        """Finish the persist in flight (idempotent)."""
        self._nursery.close()  # (nothing there observes its scope: it waits for the end)

    def __repr__(self) -> str:
        with self._lock:
            state = "copying" if self._copying else "writing" if self._busy else "idle"
            return (
                f"Persister(directory={self.settings.directory!r}, keep={self.settings.keep}, "
                f"state={state}, persisted={self._persisted}, broken={self._broken is not None})"
            )

    # -- the persisting thread -------------------------------------------------------

    def _run(self, _scope: CancelScope, step: int) -> None:
        try:
            self._persist(step)
        except Exception as exc:  # (a persist never ends the training; said here)
            log.error("memory checkpoint: persisting step %d failed: %s", step, exc)
        finally:
            with self._lock:
                self._busy = False
                self._copying = False
                self._lock.notify_all()

    def _snapshot(self, step: int) -> tuple[Snapshot | None, BaseException | None]:
        """This rank's step, copied; or why it could not be, for the planner to raise
        inside DCP's save, where every rank learns of it (a rank that left before the
        save's collectives would leave its peers waiting in them)."""
        try:
            return read_snapshot(self._steps, step), None
        except Exception as exc:  # (handed on, not dropped: see above)
            return None, exc
        finally:
            with self._lock:
                self._copying = False
                self._lock.notify_all()

    def _persist(self, step: int) -> None:
        started = time.monotonic()
        snapshot, failure = self._snapshot(step)
        copied = time.monotonic() - started
        # Writing is never in a hurry: it yields the CPU to training and to the saves
        # (the copy did not: the saves after it may wait for it). A thread cannot be
        # made less nice again, hence a thread per persist.
        _lower_priority()
        nbytes = 0 if snapshot is None else snapshot.nbytes
        directory = self.settings.directory
        lead = self._steps.rank == 0
        if lead:
            _remove_leftovers(directory)
        try:
            # A random number of rank 0's, known to every rank: the temporary directory's
            # name, which unlike a fixed one is never a leftover of a persist that died.
            token = _all_reduce(self._group, secrets.randbits(62) if lead else 0, dist.ReduceOp.SUM)
        except RuntimeError as exc:
            self._lost(step, exc)
            return
        tmp = os.path.join(directory, f".step-{step}.tmp-{token:016x}")
        planner = SnapshotPlanner(snapshot, failure)
        del snapshot  # (the planner drops what other ranks write, after the plan)
        try:
            metadata = _write(tmp, planner, self._group)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, RuntimeError):  # (a collective failed, not the save)
                self._lost(step, exc)
                return
            raise
        del planner
        if self._before_rename is not None:
            self._before_rename(step)
        problem = self._publish(step, tmp, metadata) if lead else None
        try:
            done = _all_reduce(self._group, problem is None, dist.ReduceOp.MIN)
        except RuntimeError as exc:
            self._lost(step, exc)
            return
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
            raise MemoryCheckpointError(problem or "rank 0 could not publish it")
        with self._lock:
            self._persisted = step
        took = time.monotonic() - started
        if lead:
            log.info(
                "memory checkpoint: step %d persisted to %s (%s here, copied in %.2f s, "
                "written in %.2f s)",
                step,
                os.path.join(directory, step_dir_name(step)),
                size_text(nbytes),
                copied,
                took - copied,
            )

    def _publish(self, step: int, tmp: str, metadata: Metadata) -> str | None:
        """Rank 0: check every rank's file, rename the directory into place, remove the
        steps beyond ``keep``. Why it could not (None: it did)."""
        directory = self.settings.directory
        try:
            missing = _missing_files(tmp, metadata)
            if missing:
                return (
                    f"{missing} is not in {tmp} on rank 0's node: persist_dir must be one "
                    f"directory that every rank writes to (shared by all nodes)"
                )
            _rename_into_place(tmp, os.path.join(directory, step_dir_name(step)))
        except OSError as exc:
            return f"{tmp} could not be renamed into place: {exc}"
        for old in steps_to_remove(persisted_steps(directory), step, self.settings.keep):
            try:
                _retire(os.path.join(directory, step_dir_name(old)))
            except OSError as exc:
                log.warning("memory checkpoint: persisted step %d not removed: %s", old, exc)
        return None

    def _lost(self, step: int, exc: BaseException) -> None:
        with self._lock:
            self._broken = f"the ranks lost each other persisting step {step}: {exc}"
            message = self._broken
        log.error("memory checkpoint: persisting stopped: %s", message)


# -- the persist directory -------------------------------------------------------------


def _write(tmp: str, planner: SnapshotPlanner, group: dist.ProcessGroup | None) -> Metadata:
    """DCP's save of the snapshots into ``tmp``: its files, and its metadata written
    last by rank 0; the checkpoint's metadata.

    Raises:
        MemoryCheckpointError: the save failed on some rank (the same on every rank).
        RuntimeError: a collective failed (the ranks lost each other).
    """
    # No fsync-free shortcut: a persisted step is what survives the node.
    writer = FileSystemWriter(tmp, sync_files=True, per_thread_copy_ahead=0)
    if group is None:
        return _write_alone(writer, planner)
    try:
        metadata: Metadata = dcp_save(
            {}, storage_writer=writer, planner=planner, process_group=group
        )
    except CheckpointException as exc:
        rank, (inner, _trace) = next(iter(exc.failures.items()))
        raise MemoryCheckpointError(f"rank {rank}: {inner}") from inner
    return metadata


def _write_alone(writer: FileSystemWriter, planner: SnapshotPlanner) -> Metadata:
    """DCP's save protocol, stepped through here for a world of one: ``dcp.save``
    would warn that it assumes one process, and silencing a warning from a second
    thread is not safe (the filters are the process's)."""
    planner.set_up_planner({}, writer.storage_meta(), True)
    writer.set_up_storage_writer(True)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([plan])
    plans = writer.prepare_global_plan(plans)
    results = writer.write_data(planner.finish_plan(plans[0]), planner)
    results.wait()
    writer.finish(metadata, [results.value()])
    return metadata


def _all_reduce(group: dist.ProcessGroup | None, value: int, op: dist.ReduceOp.RedOpType) -> int:
    """``value`` reduced by ``op`` over every rank of ``group`` (no group: this rank's
    own): the persister's, on the gloo group its DCP save needs anyway.

    Raises:
        RuntimeError: the collective failed (the ranks lost each other).
    """
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=op, group=group)
    return int(tensor.item())


def _missing_files(tmp: str, metadata: Metadata) -> str | None:
    """The first file the metadata names that is missing or short in ``tmp``."""
    if not os.path.isfile(os.path.join(tmp, ".metadata")):
        return ".metadata"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        try:
            if os.stat(os.path.join(tmp, name)).st_size < end:
                return f"{name} (short)"
        except FileNotFoundError:
            return name
    return None


def _rename_into_place(tmp: str, final: str) -> None:
    """Rename ``tmp`` to ``final``; a step persisted before under that name (a run
    that went back to it) is moved aside first and removed after."""
    aside = None
    if os.path.lexists(final):
        parent, name = os.path.split(tmp)
        aside = os.path.join(parent, name.replace(".tmp-", ".old-", 1))
        os.rename(final, aside)
    os.rename(tmp, final)
    _sync_dir(os.path.dirname(final))
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _retire(path: str) -> None:
    """Remove a persisted step: renamed aside first, so that no half-removed step is
    ever seen under a final name."""
    parent, name = os.path.split(path)
    aside = os.path.join(parent, f".{name}.old-{secrets.randbits(62):016x}")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _remove_leftovers(directory: str) -> None:
    """Remove what persists that died left in ``directory`` (their temporary names)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if _LEFTOVER.fullmatch(name):
            log.info("memory checkpoint: removing %s (left by a persist that did not finish)", name)
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _lower_priority() -> None:
    """Make the calling thread ``_NICER`` nicer (Linux: ``nice`` is per thread), where
    it can: a thread may always be made nicer."""
    with contextlib.suppress(OSError, AttributeError):
        me = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, me) + _NICER
        os.setpriority(os.PRIO_PROCESS, me, min(19, nice))


def _sync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (where the file system allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
