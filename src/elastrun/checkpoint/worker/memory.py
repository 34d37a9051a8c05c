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
background thread (``checkpoint.worker.finishing``).

**At most one save in flight.** A ``save`` called while the previous one is still in
the background waits for it (``on_overlap="wait"``, the default) or is skipped
(``"skip"``), and a log line says so (the first time, then at most once a minute with
the count).

**The newest complete step wins, and memory use is bounded.** After each save, the
background threads of all ranks agree (one vote through the rendezvous store, the
workers' store of ``init_process_group``: ``checkpoint.worker.agreement``) whether the
step is complete on every rank. If it is, each rank removes its older
step; if not (a rank skipped it, or failed to write it), each rank removes the new one.
So a rank holds at most two steps -- the newest complete on every rank and the one in
progress -- and never removes a step some rank may still need: at any moment, some step
is held complete by every rank. ``load_latest`` finds it: the ranks vote for the steps
each holds complete and load the newest that all hold, so every rank loads the same
step. A skip is one of these votes too, so the ranks' votes stay in step whatever each
one decides; every rank must call ``save`` at the same steps, as with any collective.
A vote waits a bounded time for a rank that never comes, and ends at once when the
store closes (elastrun's agent closes it when the round ends); then the saves of that
world are skipped, and a world rebuilt in place (``elastrun.inprocess``) sets up
again.

**Persisted to disk** (``persist_dir``): the newest complete step, in DCP's own format,
by a thread of its own, when the background thread says so, in the order of the saves:
the same on every rank (``checkpoint.worker.persist``).

**What the agent is told**: each rank's report in the node directory
(``checkpoint.worker.report``), which the agent turns into events and metrics.

Rejected: each rank loading its own newest step (ranks would resume at different
steps); MIN of each rank's newest step without the agreement after each save (a rank
that finished step N and removed N-1 while a peer died before finishing N would leave
no common step); a gloo group of the checkpoint's own for the agreements (see
``checkpoint.worker.agreement``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from elastrun.checkpoint.worker import agreement
from elastrun.checkpoint.worker.agreement import Agreement
from elastrun.checkpoint.worker.errors import MemoryCheckpointError
from elastrun.checkpoint.worker.finishing import Finisher, Overlaps
from elastrun.checkpoint.worker.persist import DEFAULT_KEEP, persist_settings
from elastrun.checkpoint.worker.persisting import PersistScheduler
from elastrun.checkpoint.worker.report import RankReporter
from elastrun.checkpoint.worker.space import StatvfsResult, check_space, state_bytes
from elastrun.checkpoint.worker.staging import Staging
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.checkpoint.worker.storage import (
    MemoryStorageReader,
    MemoryStorageWriter,
    default_rank_and_world,
)
from elastrun.wire.checkpoint import CHECKPOINT_DIR_ENV

__all__ = ["MemoryCheckpoint", "Overlap", "StateDict"]

log = logging.getLogger("elastrun.checkpoint")

Overlap = Literal["wait", "skip"]
#: What ``dcp.save`` and ``dcp.load`` take (DCP's ``STATE_DICT_TYPE``): tensors, DTensors,
#: ``Stateful`` objects and plain values, nested; DCP interprets them, not this module.
StateDict = dict[str, Any]


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
    through its store, on a connection of the checkpoint's own). Call :meth:`close` (or
    use the object as a context manager) before ``destroy_process_group``.

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
        settings = persist_settings(persist_dir, persist_every, persist_keep)
        self._persisting = PersistScheduler(settings, before_persisted=before_persisted)
        self._finisher = Finisher(self._persisting, before_marker=before_marker)
        self._directory = directory
        self._on_overlap = on_overlap
        self._statvfs = statvfs
        self._steps: RankSteps | None = None
        self._agreement: Agreement | None = None
        # The default group the checkpoint was set up in (None: a world of one rank).
        self._world: weakref.ref[dist.ProcessGroup] | None = None
        self._closed = False
        self._space_checked = False
        self._last: int | None = None  # the last step saved (or skipped) or loaded here
        self._overlaps = Overlaps()
        self._staging = Staging()  # (a pinned buffer once a tensor on a GPU is saved)

    # -- the public calls ----------------------------------------------------------------

    @property
    def newest(self) -> int | None:
        """The newest step known here to be complete on every rank (None: none yet)."""
        return self._finisher.newest()

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
            RuntimeError: torch's ``DistError``: the ranks lost each other as they
                agreed on the step (the store closed, or a rank did not come in time),
                as a collective that failed (which ``elastrun.inprocess`` recovers from).
        """
        started = time.monotonic()
        steps = self._start()
        self._finisher.wait_idle()
        self._finisher.raise_failure()
        if not self._space_checked:
            self._check_space(state_bytes(state_dict))
        complete = steps.loadable_steps()
        agreement = self._agreement
        step = (
            max(complete, default=None) if agreement is None else agreement.newest_common(complete)
        )
        if step is not None:
            reader = MemoryStorageReader(
                steps.directory,
                step,
                rank=steps.rank,
                world_size=steps.world_size,
                staging=self._staging,
            )
            with _dcp_call(f"loading step {step}"):
                dcp_load(state_dict, storage_reader=reader, no_dist=True)
            log.info("memory checkpoint: rank %d loaded step %d", steps.rank, step)
        steps.keep_only(set() if step is None else {step})
        # No rank starts its next save (and makes a step directory) while a peer still
        # removes the directories it left.
        if agreement is not None:
            agreement.barrier()
        self._last = step
        self._finisher.loaded(step, time.monotonic() - started)
        return step

    def save(self, step: int, state_dict: StateDict) -> bool:
        """Save ``state_dict`` as ``step`` (after the previous step saved or loaded):
        copy its tensors into the node's memory, and finish the rest in the background.
        Every rank calls it at the same steps. Returns False when the step was skipped
        (``on_overlap="skip"`` and the previous save still in flight).

        Also False, and nothing is written, once the ranks' store went away (this world
        ended: the group restarts, or an in-process round rebuilds it; see the module).

        Raises:
            CheckpointSpaceError: at the first save, the node's shared memory cannot
                hold two steps of this state on each local rank (nothing is written).
            MemoryCheckpointError: ``step`` is not after the last one, an earlier save
                failed in the background, or a rank did not agree in time.
        """
        started = time.monotonic()
        steps = self._start()
        self._finisher.raise_failure()
        if self._last is not None and step <= self._last:
            raise MemoryCheckpointError(
                f"step {step} comes after step {self._last}: a memory checkpoint's steps grow"
            )
        if self._finisher.ended():
            self._last = step
            return False
        if self._finisher.pending():
            if self._on_overlap == "skip":
                self._last = step
                self._finisher.submit(step, None, started, time.monotonic() - started)
                self._overlaps.note(step, None)
                return False
            waiting = time.monotonic()
            self._finisher.wait_idle()
            self._overlaps.note(step, time.monotonic() - waiting)
            self._finisher.raise_failure()
        writer = MemoryStorageWriter(
            steps.directory,
            step,
            rank=steps.rank,
            world_size=steps.world_size,
            publish_on_finish=False,
            space_check=self._first_save_check,
            staging=self._staging,
        )
        self._last = step
        try:
            with _dcp_call(f"saving step {step}"):
                dcp_save(state_dict, storage_writer=writer, no_dist=True)
        except BaseException:
            steps.remove(step)
            # (the ranks' agreements stay in step)
            self._finisher.submit(step, None, started, time.monotonic() - started)
            raise
        self._finisher.submit(step, writer, started, time.monotonic() - started)
        return True

    def wait(self) -> int | None:
        """Until every save issued here is finished in the background (complete and
        agreed, or dropped): the newest step complete on every rank.

        With ``persist_dir``, also until the persist in flight here is written (a
        failed persist is logged, never raised).

        Raises:
            MemoryCheckpointError: a save failed in the background.
        """
        self._finisher.wait_idle()
        self._finisher.wait_persisted()
        self._finisher.raise_failure()
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
        if self._persisting.settings is None:
            raise MemoryCheckpointError(
                "persist() needs a directory: MemoryCheckpoint(persist_dir=...)"
            )
        self._start()
        self._finisher.request_persist()

    @property
    def persisted(self) -> int | None:
        """The newest step this process persisted to ``persist_dir`` (None: none yet)."""
        return self._persisting.persisted

    def close(self) -> None:
        """Finish the save in flight, stop the background thread and release the
        persister's group and the connection to the store (idempotent). The
        checkpoints stay: they belong to the node."""
        if self._closed:
            return
        self._closed = True
        if not self._finisher.stop():
            return
        self._persisting.close()
        self._staging.release()
        if self._steps is not None:
            self._steps.drop_spare()
        self._agreement = None  # (its connection closes with it)

    def __enter__(self) -> MemoryCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        in_flight = self._finisher.pending()
        newest = self._finisher.newest()
        where = self._steps.directory if self._steps is not None else self._directory
        return (
            f"MemoryCheckpoint(directory={where!r}, on_overlap={self._on_overlap!r}, "
            f"newest={newest}, last={self._last}, in_flight={in_flight}, "
            f"closed={self._closed})"
        )

    # -- setting up ----------------------------------------------------------------------

    def _start(self) -> RankSteps:
        """The rank's steps; on the first call, the ranks' agreement and the thread
        (again after an in-process recovery rebuilt the world: ``_forget_world``)."""
        if self._closed:
            raise MemoryCheckpointError("this MemoryCheckpoint is closed")
        if self._steps is not None and _rebuilt(self._world):
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
                    f"load_latest or save (the ranks agree on steps through its store)"
                )
            self._world = weakref.ref(dist.distributed_c10d._get_default_group())
            self._agreement = agreement.for_world(rank, world)
        self._persisting.start(rank, world, directory)
        self._steps = RankSteps(directory, rank, world)
        reporter = RankReporter(directory, rank, _env_count("LOCAL_RANK", 0), os.getpid())
        self._finisher.start(self._steps, reporter, self._agreement)
        return self._steps

    def _forget_world(self) -> None:
        """The default group this object was set up in is gone: an in-process recovery
        (``elastrun.inprocess``) tore every process group down, and the training
        function runs again in a new world, whose ranks (a replacement among them) set
        up anew, on the new world's store. Stop the background thread (and its vote in
        flight), drop the persister and the save in flight, and set up again at this
        call. The steps in the node's memory stay: ``load_latest`` finds them."""
        log.info("memory checkpoint: the process groups were rebuilt; setting up again")
        if self._finisher.forget():  # (its save may still be writing from the buffer)
            self._staging = Staging()
        self._persisting.forget()
        self._agreement = self._world = None
        self._steps = None

    def _check_space(self, rank_bytes: int) -> None:
        steps = self._steps
        assert steps is not None, "not started"  # (every caller starts first)
        check_space(
            steps.directory,
            rank_bytes,
            rank=steps.rank,
            local_ranks=_env_count("LOCAL_WORLD_SIZE", 1),
            statvfs=self._statvfs,
        )

    def _first_save_check(self, rank_bytes: int) -> None:
        """The writer's check before its first byte: at the first save only (the exact
        size; ``load_latest`` checked an estimate before training began)."""
        if not self._space_checked:
            self._check_space(rank_bytes)
            self._space_checked = True


@contextlib.contextmanager
def _dcp_call(what: str) -> Iterator[None]:
    """A call of DCP on this rank alone: its failure raised as elastrun's (DCP gathers
    every rank's exception into a ``CheckpointException``, a ``BaseException`` whose
    text is a traceback), and its warning that it assumes one process silenced, which
    is the point here (see ``checkpoint.worker.storage``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        try:
            yield
        except CheckpointException as exc:
            inner = next(iter(exc.failures.values()), (exc, None))[0]
            if isinstance(inner, MemoryCheckpointError):
                raise inner from None
            raise MemoryCheckpointError(f"{what} failed: {inner!r}") from inner


def _rebuilt(world: weakref.ref[dist.ProcessGroup] | None) -> bool:
    """Whether the default group that ``world`` names is no longer the default group
    (an in-process recovery destroys every group, and the training function makes
    them anew); None, a world of one rank, never is."""
    if world is None:
        return False
    return not dist.is_initialized() or dist.distributed_c10d._get_default_group() is not world()


def _env_count(name: str, least: int) -> int:
    """The variable ``name`` as an integer of at least ``least`` (``least`` when unset or
    not a number): ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``."""
    try:
        return max(least, int(os.environ.get(name, str(least))))
    except ValueError:
        return least
