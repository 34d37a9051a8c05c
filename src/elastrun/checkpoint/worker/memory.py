"""``MemoryCheckpoint``: save every step to the node's memory, load the newest after a
restart.

    ckpt = elastrun.checkpoint.MemoryCheckpoint()
    step = ckpt.load_latest(state)            # None: no checkpoint, start from scratch
    for step in range(0 if step is None else step + 1, steps):
        train_one_step()
        ckpt.save(step, state)
    ckpt.close()

**What blocks the training thread.** ``save`` runs DCP's save on this rank alone
(``checkpoint.worker.storage``): planning, and the copy of each tensor into the node's
shared memory. The rest -- the metadata, the marker, the ranks' agreement that the step
is complete everywhere, and the removal of the step it replaces -- runs on one
background thread.

**At most one save in flight.** A ``save`` called while the previous one is still in
the background waits for it (``on_overlap="wait"``, the default) or is skipped
(``"skip"``), and a log line says so (the first time, then at most once a minute with
the count).

**The newest complete step wins, and memory use is bounded.** After each save, the
background threads of all ranks agree (one all-reduce, MIN, over a gloo group of their
own) whether the step is complete on every rank. If it is, each rank removes its older
step; if not (a rank skipped it, or failed to write it), each rank removes the new one.
So a rank holds at most two steps -- the newest complete on every rank and the one in
progress -- and never removes a step some rank may still need: at any moment, some step
is held complete by every rank. ``load_latest`` finds it: the ranks exchange the steps
each holds complete (an all-gather) and load the newest that all hold, so every rank
loads the same step. A skip is one of these agreements too, so the ranks' collectives
stay in step whatever each one decides; every rank must call ``save`` at the same
steps, as with any collective.

**Persisted to disk** (``persist_dir``): after every ``persist_every`` complete steps,
or on ``persist()``, the newest complete step is written in DCP's own format to a
directory, by a thread of its own (``checkpoint.worker.persist``); this thread only
decides when, in the order of the saves, so every rank persists the same step.

**What the agent is told.** After each save finished in the background, and after each
load, the rank rewrites its report in the node directory (``checkpoint.worker.report``):
its totals of time blocked, time until its marker and copy lag (until the ranks agreed
that the step is complete on all), and the step it restored. The agent turns them
into events and metrics without importing torch.

Rejected: each rank loading its own newest step (ranks would resume at different
steps); MIN of each rank's newest step without the agreement after each save (a rank
that finished step N and removed N-1 while a peer died before finishing N would leave
no common step); the rendezvous store for the agreement (a key per step per rank, and a
client the workers do not otherwise hold).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from elastrun.checkpoint.worker import ranks
from elastrun.checkpoint.worker.errors import MemoryCheckpointError
from elastrun.checkpoint.worker.persist import (
    DEFAULT_KEEP,
    Persister,
    PersistSchedule,
    persist_settings,
)
from elastrun.checkpoint.worker.report import RankReporter
from elastrun.checkpoint.worker.space import (
    StatvfsResult,
    check_space,
    local_world_size,
    state_bytes,
)
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.checkpoint.worker.storage import (
    MemoryStorageReader,
    MemoryStorageWriter,
    default_rank_and_world,
)
from elastrun.core.threads import join_thread
from elastrun.wire.checkpoint import CHECKPOINT_DIR_ENV

__all__ = ["MemoryCheckpoint", "Overlap", "StateDict"]

log = logging.getLogger("elastrun.checkpoint")

Overlap = Literal["wait", "skip"]
#: What ``dcp.save`` and ``dcp.load`` take (DCP's ``STATE_DICT_TYPE``): tensors, DTensors,
#: ``Stateful`` objects and plain values, nested; DCP interprets them, not this module.
StateDict = dict[str, Any]

#: Seconds between two log lines about overlapping saves.
_OVERLAP_LOG_EVERY = 60.0
#: The longest the background thread of a world rebuilt under it is waited for: its
#: collectives on the destroyed groups fail at once (their connections are cut).
_REBUILT_JOIN = 10.0


@dataclass(frozen=True)
class _Job:
    """One ``save`` call for the background thread: a written step to publish, or a
    skipped one (``writer`` None) that the ranks' agreement must count all the same;
    when the call began (monotonic) and how long it blocked, for the rank's report."""

    step: int
    writer: MemoryStorageWriter | None
    started: float
    blocked: float


@dataclass(frozen=True)
class _PersistRequest:
    """A ``persist()`` call for the background thread: in the order of the saves, so
    that every rank persists the same step."""


class MemoryCheckpoint:
    """Checkpoints of one rank in its node's memory: save every step, load the newest
    step complete on every rank.

    Args:
        directory: the node's checkpoint directory (None: ``ELASTRUN_CHECKPOINT_DIR``,
            which elastrun's agent sets for its workers).
        on_overlap: what a ``save`` does while the previous one is still in flight:
            ``"wait"`` for it, or ``"skip"`` this step.
        statvfs: how the free space of ``directory`` is read (tests pass a fake).
        before_marker: called on the background thread with a step whose files are
            written, before its marker (a seam for tests that kill the process there).
        persist_dir: a directory that every rank writes to (shared by the nodes) where
            steps are persisted in DCP's own format, ``<persist_dir>/step-<S>/``,
            loadable by plain ``torch.distributed.checkpoint.load`` (None: steps stay
            in memory only). See :meth:`persist`.
        persist_every: persist the newest step after every this many steps complete on
            every rank (None: only when :meth:`persist` is called).
        persist_keep: persisted steps kept; older ones are removed once a newer one is
            complete.
        before_persisted: called on the persisting thread of every rank with a step
            whose files are all written, before it is renamed into place (a seam for
            tests that kill the process there).

    The first :meth:`load_latest` or :meth:`save` call sets up (after
    ``init_process_group`` when the world has more than one rank: the ranks agree
    through a gloo group that every rank makes then). Call :meth:`close` (or use the
    object as a context manager) before ``destroy_process_group``.

    Every rank passes the same arguments.

    Raises:
        ValueError: ``on_overlap`` is neither ``"wait"`` nor ``"skip"``.
        ConfigError: ``persist_every`` or ``persist_keep`` is not an integer >= 1, or
            either is given without ``persist_dir``.
    """

    def __init__(
        self,
        directory: str | None = None,
        *,
        on_overlap: Overlap = "wait",
        statvfs: Callable[[str], StatvfsResult] = os.statvfs,
        before_marker: Callable[[int], object] | None = None,
        persist_dir: str | os.PathLike[str] | None = None,
        persist_every: int | None = None,
        persist_keep: int = DEFAULT_KEEP,
        before_persisted: Callable[[int], object] | None = None,
    ) -> None:
        if on_overlap not in ("wait", "skip"):
            raise ValueError(f"on_overlap: 'wait' or 'skip' (got {on_overlap!r})")
        self._persist_settings = persist_settings(persist_dir, persist_every, persist_keep)
        self._before_persisted = before_persisted
        self._persister: Persister | None = None
        self._persist_group: dist.ProcessGroup | None = None
        self._schedule = PersistSchedule(persist_every)
        self._directory = directory
        self._on_overlap = on_overlap
        self._statvfs = statvfs
        self._before_marker = before_marker
        self._steps: RankSteps | None = None
        self._reporter: RankReporter | None = None
        self._group: dist.ProcessGroup | None = None
        self._jobs: queue.SimpleQueue[_Job | _PersistRequest | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._space_checked = False
        self._last: int | None = None  # the last step saved (or skipped) or loaded here
        self._overlaps = 0
        self._overlap_wait = 0.0
        self._overlap_logged = -math.inf
        # Shared with the background thread, under the lock:
        self._lock = threading.Condition()
        self._issued = 0
        self._done = 0
        self._requests = 0  # persist() calls not yet taken by the background thread
        self._newest: int | None = None
        self._failure: BaseException | None = None
        self._broken: str | None = None

    # -- the public calls ----------------------------------------------------------------

    @property
    def newest(self) -> int | None:
        """The newest step known here to be complete on every rank (None: none yet)."""
        with self._lock:
            return self._newest

    def load_latest(self, state_dict: StateDict) -> int | None:
        """Load the newest step complete on every rank into ``state_dict`` (in place,
        as ``dcp.load``; a collective: every rank calls it) and return that step; None
        when there is none (nothing is loaded). Every other step this rank holds is
        removed, half-written ones included.

        A step is loadable by a rank when its node holds the rank's own piece of it, or
        every rank's piece when the world that saved it had another size (DCP reshards:
        after a node was lost and the job goes on with fewer). Pieces a node lost with
        it come from the copy on its buddy node, which the agents bring to the nodes that
        need them before the workers start.

        Before anything else, the node's shared memory is checked for room for two
        steps of this state on each local rank.

        Raises:
            CheckpointSpaceError: the node's shared memory cannot hold the checkpoints.
            MemoryCheckpointError: no directory, a failure of an earlier save, or the
                step could not be read.
        """
        started = time.monotonic()
        steps = self._start()
        self._wait_idle()
        self._raise_failure()
        if not self._space_checked:
            self._check_space(state_bytes(state_dict))
        # Loadable: the node holds this rank's piece (a world of the size that saved the
        # step) or every rank's (another size: DCP reshards from their union).
        step = self._agree_on_step(steps.loadable_steps())
        if step is not None:
            reader = MemoryStorageReader(
                steps.directory, step, rank=steps.rank, world_size=steps.world_size
            )
            with ranks.dcp_call(f"loading step {step}"):
                dcp_load(state_dict, storage_reader=reader, no_dist=True)
            log.info("memory checkpoint: rank %d loaded step %d", steps.rank, step)
        steps.keep_only(set() if step is None else {step})
        # No rank starts its next save (and makes a step directory) while a peer still
        # removes the directories it left.
        self._barrier()
        with self._lock:
            self._newest = step
        self._last = step
        self._started_reporter().loaded(step, time.monotonic() - started)
        return step

    def save(self, step: int, state_dict: StateDict) -> bool:
        """Save ``state_dict`` as ``step`` (after the previous step saved or loaded):
        copy its tensors into the node's memory, and finish the rest in the background.
        Every rank calls it at the same steps. Returns False when the step was skipped
        (``on_overlap="skip"`` and the previous save still in flight).

        Raises:
            CheckpointSpaceError: at the first save, the node's shared memory cannot
                hold two steps of this state on each local rank (nothing is written).
            MemoryCheckpointError: ``step`` is not after the last one, an earlier save
                failed in the background, or the ranks lost each other.
        """
        started = time.monotonic()
        steps = self._start()
        self._raise_failure()
        if self._last is not None and step <= self._last:
            raise MemoryCheckpointError(
                f"step {step} comes after step {self._last}: a memory checkpoint's steps grow"
            )
        if self._in_flight():
            if self._on_overlap == "skip":
                self._last = step
                self._submit(_Job(step, None, started, time.monotonic() - started))
                self._note_overlap(step, None)
                return False
            waiting = time.monotonic()
            self._wait_idle()
            self._note_overlap(step, time.monotonic() - waiting)
            self._raise_failure()
        writer = MemoryStorageWriter(
            steps.directory,
            step,
            rank=steps.rank,
            world_size=steps.world_size,
            publish_on_finish=False,
            space_check=self._first_save_check,
        )
        self._last = step
        try:
            with ranks.dcp_call(f"saving step {step}"):
                dcp_save(state_dict, storage_writer=writer, no_dist=True)
        except BaseException:
            steps.remove(step)
            # (the ranks' agreements stay in step)
            self._submit(_Job(step, None, started, time.monotonic() - started))
            raise
        self._submit(_Job(step, writer, started, time.monotonic() - started))
        return True

    def wait(self) -> int | None:
        """Until every save issued here is finished in the background (complete and
        agreed, or dropped): the newest step complete on every rank.

        With ``persist_dir``, also until the persist in flight here is written (a
        failed persist is logged, never raised).

        Raises:
            MemoryCheckpointError: a save failed in the background.
        """
        self._wait_idle()
        self._wait_persisted()
        self._raise_failure()
        return self.newest

    def persist(self) -> None:
        """Persist the newest step complete on every rank to ``persist_dir``, in the
        background: the step as it stands once the saves issued before this call are
        finished (a collective: every rank calls it at the same point, between the same
        saves). A persist in flight is finished first. :meth:`wait` or :meth:`close`
        waits for it; :attr:`persisted` then names the step. A failure is logged and
        does not stop training.

        Raises:
            MemoryCheckpointError: no ``persist_dir`` was given, or this object is
                closed.
        """
        if self._persist_settings is None:
            raise MemoryCheckpointError(
                "persist() needs a directory: MemoryCheckpoint(persist_dir=...)"
            )
        self._start()
        with self._lock:
            self._requests += 1
        self._jobs.put(_PersistRequest())

    @property
    def persisted(self) -> int | None:
        """The newest step this process persisted to ``persist_dir`` (None: none yet)."""
        persister = self._persister
        return None if persister is None else persister.persisted

    def close(self) -> None:
        """Finish the save in flight, stop the background thread and release the
        ranks' group (idempotent). The checkpoints stay: they belong to the node."""
        if self._closed:
            return
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._jobs.put(None)
        thread.join()
        self._close_persister()
        if self._steps is not None:
            self._steps.drop_spare()
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def __enter__(self) -> MemoryCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        with self._lock:
            in_flight = self._issued - self._done
            newest = self._newest
        where = self._steps.directory if self._steps is not None else self._directory
        return (
            f"MemoryCheckpoint(directory={where!r}, on_overlap={self._on_overlap!r}, "
            f"newest={newest}, last={self._last}, in_flight={in_flight}, "
            f"closed={self._closed})"
        )

    # -- setting up ----------------------------------------------------------------------

    def _start(self) -> RankSteps:
        """The rank's steps; on the first call, the ranks' group and the thread (again
        after an in-process recovery rebuilt the world: ``_forget_world``)."""
        if self._closed:
            raise MemoryCheckpointError("this MemoryCheckpoint is closed")
        if self._steps is not None and _destroyed(self._group):
            self._forget_world()
        if self._steps is not None:
            return self._steps
        directory = self._directory or os.environ.get(CHECKPOINT_DIR_ENV)
        if not directory:
            raise MemoryCheckpointError(
                f"no node directory for memory checkpoints: {CHECKPOINT_DIR_ENV} is unset "
                f"(elastrun's agent sets it for its workers); pass MemoryCheckpoint(directory=...)"
            )
        if not os.path.isdir(directory):
            raise MemoryCheckpointError(f"{directory}: no such directory for memory checkpoints")
        rank, world = default_rank_and_world()
        if world > 1:
            if not dist.is_initialized():
                raise MemoryCheckpointError(
                    f"a world of {world} ranks: call init_process_group before the first "
                    f"load_latest or save (the ranks agree on steps through it)"
                )
            self._group = dist.new_group(backend="gloo")
        self._start_persister(rank, world, directory)
        self._thread = threading.Thread(target=self._serve, name="elastrun-checkpoint", daemon=True)
        self._thread.start()
        self._steps = RankSteps(directory, rank, world)
        self._reporter = RankReporter(directory, rank, _local_rank(), os.getpid())
        return self._steps

    def _forget_world(self) -> None:
        """The ranks' group was destroyed under this object: an in-process recovery
        (``elastrun.inprocess``) tore every process group down, and the training
        function runs again in a new world, whose ranks (a replacement among them) make
        their groups anew. Stop the background thread (its last agreement failed with
        the group), drop the persister and the save in flight, and set up again at this
        call. The steps in the node's memory stay: ``load_latest`` finds them."""
        log.info("memory checkpoint: the process groups were rebuilt; setting up again")
        thread, self._thread = self._thread, None
        self._jobs.put(None)
        if thread is not None and not join_thread(thread, _REBUILT_JOIN):
            log.warning(
                "memory checkpoint: the previous world's background thread did not end "
                "within %.0fs; it is left behind", _REBUILT_JOIN,
            )  # fmt: skip
        self._jobs = queue.SimpleQueue()
        self._persist_group = None  # (destroyed with the world)
        self._close_persister()
        self._persister = None
        self._group = None
        self._steps = self._reporter = None
        with self._lock:
            self._issued = self._done = self._requests = 0
            self._failure = self._broken = None
            self._lock.notify_all()

    def _check_space(self, rank_bytes: int) -> None:
        steps = self._started()
        check_space(
            steps.directory,
            rank_bytes,
            rank=steps.rank,
            local_ranks=local_world_size(),
            statvfs=self._statvfs,
        )

    def _first_save_check(self, rank_bytes: int) -> None:
        """The writer's check before its first byte: at the first save only (the exact
        size; ``load_latest`` checked an estimate before training began)."""
        if not self._space_checked:
            self._check_space(rank_bytes)
            self._space_checked = True

    def _started(self) -> RankSteps:
        steps = self._steps
        assert steps is not None, "not started"  # (every caller starts first)
        return steps

    def _started_reporter(self) -> RankReporter:
        reporter = self._reporter
        assert reporter is not None, "not started"  # (made with the steps)
        return reporter

    # -- the ranks' agreements -------------------------------------------------------------

    def _agree_on_step(self, complete: list[int]) -> int | None:
        """The newest step every rank holds complete (None: there is none)."""
        return ranks.newest_common(self._group, self._started().world_size, complete)

    def _agree_complete(self, step: int, complete_here: bool) -> bool | None:
        """Whether ``step`` is complete on every rank (None: the ranks lost each other)."""
        try:
            return ranks.all_hold(self._group, complete_here)
        except RuntimeError as exc:
            with self._lock:
                self._broken = f"the ranks lost each other agreeing on step {step}: {exc}"
            log.warning("memory checkpoint: %s", self._broken)
            return None

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    # -- the background thread -------------------------------------------------------------

    def _submit(self, job: _Job) -> None:
        with self._lock:
            self._issued += 1
        self._jobs.put(job)

    def _in_flight(self) -> bool:
        with self._lock:
            return self._done < self._issued

    def _wait_idle(self) -> None:
        with self._lock:
            while self._done < self._issued:
                self._lock.wait()

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
            broken = self._broken
        if failure is not None:
            raise MemoryCheckpointError(f"a memory checkpoint save failed: {failure}") from failure
        if broken is not None:
            raise MemoryCheckpointError(f"memory checkpoints stopped: {broken}")

    def _serve(self) -> None:
        jobs = self._jobs  # (its own: a world rebuilt gives the next thread another)
        while True:
            job = jobs.get()
            if job is None:
                return
            if isinstance(job, _PersistRequest):
                self._serve_persist_request()
                continue
            try:
                self._finish(job)
            except Exception as exc:  # (kept for the next call, which raises it)
                log.error("memory checkpoint: step %d: %s", job.step, exc)
                with self._lock:
                    self._failure = self._failure or exc
            finally:
                with self._lock:
                    self._done += 1
                    self._lock.notify_all()

    def _finish(self, job: _Job) -> None:
        """Publish the step, agree with the other ranks whether it is complete on all,
        and keep either it or the step before it."""
        steps = self._started()
        with self._lock:
            broken = self._broken is not None
        if broken:
            return  # nothing is removed: which step the ranks share is unknown here
        written: float | None = None  # seconds from the call until this rank's marker
        if job.writer is not None:
            try:
                job.writer.publish(self._before_marker)
                written = time.monotonic() - job.started
            except (OSError, MemoryCheckpointError) as exc:
                log.error("memory checkpoint: step %d was not published: %s", job.step, exc)
                with self._lock:
                    self._failure = self._failure or exc
        agreed = self._agree_complete(job.step, written is not None)
        if agreed is None:
            return
        lag = time.monotonic() - job.started if agreed else None  # (the copy lag)
        if agreed:
            self._hold_for_persist()
            steps.keep_only({job.step})  # (the older step's data becomes the spare)
            with self._lock:
                self._newest = job.step
            if job.writer is not None and job.writer.data_bytes:
                steps.make_spare(job.writer.data_bytes)  # (when no older step left one)
        elif job.writer is not None:
            steps.remove(job.step, spare=True)
            if written is not None:
                log.info("memory checkpoint: step %d is not on every rank: not kept", job.step)
        with self._lock:
            newest = self._newest
        self._started_reporter().saved(
            blocked=job.blocked, written=written, agreed=lag, newest=newest
        )
        self._persist_if_due(agreed)

    # -- persisting (checkpoint.worker.persist) -------------------------------------------

    def _start_persister(self, rank: int, world: int, directory: str) -> None:
        """With ``persist_dir``: the persister, with a gloo group of its own (made
        here, by every rank, after the agreements' group)."""
        settings = self._persist_settings
        if settings is None:
            return
        group = dist.new_group(backend="gloo") if world > 1 else None
        self._persister = Persister(
            settings,
            RankSteps(directory, rank, world),
            group,
            before_rename=self._before_persisted,
        )
        self._persist_group = group

    def _close_persister(self) -> None:
        if self._persister is not None:
            self._persister.close()  # (kept: ``persisted`` still answers)
        group, self._persist_group = self._persist_group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def _wait_persisted(self) -> None:
        """Until the background thread took every ``persist()`` call and the persist
        in flight is written."""
        with self._lock:
            while self._requests:
                self._lock.wait()
        persister = self._persister
        if persister is not None:
            persister.wait()

    def _hold_for_persist(self) -> None:
        """Before a step is removed: until the persist in flight copied its step out."""
        if self._persister is not None:
            self._persister.wait_snapshot()

    def _persist_if_due(self, agreed: bool) -> None:
        """After a save: begin a persist of the newest step when one is due and every
        rank's persister is ready (else at a later save). The same on every rank: it
        follows the ranks' agreements."""
        persister = self._persister
        if persister is None:
            return
        if agreed:
            self._schedule.complete()
        if self._schedule.due() and self._all_ready(persister):
            self._begin_persist(persister)

    def _all_ready(self, persister: Persister) -> bool:
        """Whether every rank's persister is idle and unbroken: agreed, so that no rank
        begins a persist (a collective) that another does not."""
        try:
            ready = ranks.all_hold(self._group, persister.is_idle() and not persister.is_broken())
        except RuntimeError as exc:
            with self._lock:
                self._broken = f"the ranks lost each other before a persist: {exc}"
            log.warning("memory checkpoint: %s", self._broken)
            return False
        if not ready:
            log.debug("memory checkpoint: a persist waits: one is in flight or stopped")
        return ready

    def _serve_persist_request(self) -> None:
        """A ``persist()`` call, on the background thread."""
        try:
            persister = self._persister
            if persister is not None:
                persister.wait()  # (on every rank: then every rank's is idle)
                if self._all_ready(persister):
                    self._begin_persist(persister)
        finally:
            with self._lock:
                self._requests -= 1
                self._lock.notify_all()

    def _begin_persist(self, persister: Persister) -> None:
        """Persist the newest step (every rank's persister idle)."""
        self._schedule.started()
        newest = self.newest
        if newest is None:
            log.info("memory checkpoint: no step is complete on every rank: nothing to persist")
        elif newest == persister.persisted:
            log.info("memory checkpoint: step %d is persisted already", newest)
        else:
            persister.begin(newest)

    def _note_overlap(self, step: int, waited: float | None) -> None:
        """Say that a save overlapped the previous one: the first time, then at most
        once every minute."""
        self._overlaps += 1
        self._overlap_wait += waited or 0.0
        now = time.monotonic()
        if now - self._overlap_logged < _OVERLAP_LOG_EVERY:
            return
        self._overlap_logged = now
        if waited is None:
            log.warning(
                "memory checkpoint: step %d skipped, the previous save still in flight "
                "(on_overlap='skip'; %d step(s) skipped so far)",
                step,
                self._overlaps,
            )
        else:
            log.warning(
                "memory checkpoint: step %d waited %.0f ms for the previous save to finish "
                "(on_overlap='wait'; %d wait(s), %.1f s in all so far)",
                step,
                waited * 1000,
                self._overlaps,
                self._overlap_wait,
            )


def _destroyed(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` was destroyed (every group is, when an in-process recovery
    tears the world down); None, a world of one rank, never is."""
    if group is None:
        return False
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return True
    return False


def _local_rank() -> int:
    """This rank's local rank (``LOCAL_RANK``; 0 when unset or not a number)."""
    try:
        return max(0, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError:
        return 0
