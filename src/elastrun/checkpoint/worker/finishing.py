"""The background thread of a ``MemoryCheckpoint``: it finishes each save after the
training thread copied the step into the node's memory.

For each save, in the order of the calls: publish the step (its metadata, then its
marker), agree with the other ranks whether it is complete on all (one vote in the
workers' store, ``checkpoint.worker.agreement``), keep either it or the step before it,
rewrite the rank's report, and begin a persist when one is due
(``persisting.PersistScheduler``). A skipped step is voted on all the same, so the
ranks' votes stay in step.
``persist()`` calls come through the same queue, so that every rank takes them at the
same point between the saves.

The training thread waits here for the saves in flight and raises what failed in the
background; what both threads read is under one lock. A save that overlaps the one in
flight is said in the log (:class:`Overlaps`).

A vote that fails stops the votes of this world: nothing more is removed (which step
the ranks share is unknown here). When the world's end explains it (the store closed
by the agent at a restart or an in-process round, or the world rebuilt under the
checkpoint) it is said once at info level and the saves are skipped: the training goes
on until its own collectives fail, and a rebuilt world sets up again. Otherwise (a
rank did not vote in time) it is a warning, and the training thread's next call raises.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from elastrun.checkpoint.worker.agreement import Agreement, ended_with_world
from elastrun.checkpoint.worker.errors import MemoryCheckpointError
from elastrun.checkpoint.worker.persisting import PersistScheduler
from elastrun.checkpoint.worker.report import RankReporter
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.checkpoint.worker.storage import MemoryStorageWriter
from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.threads import Nursery

__all__ = ["Finisher", "Overlaps"]

log = logging.getLogger("elastrun.checkpoint")

#: Seconds between two log lines about overlapping saves.
_OVERLAP_LOG_EVERY = 60.0
#: The longest the background thread of a world rebuilt under it is waited for: its
#: vote ends at once when the store closed with the old world, else at its next look at
#: the stop request (``agreement.WAIT_SLICE``) or when its persist request ends.
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


class Finisher:
    """The background thread of a ``MemoryCheckpoint`` and what it shares with the
    training thread (see the module).

    Args:
        persisting: the checkpoint's persisting; its background side runs here.
        before_marker: ``MemoryCheckpoint``'s, called here.

    :meth:`start` begins the thread (again after :meth:`forget`); every other call but
    :meth:`stop` is for a started one.
    """

    def __init__(
        self,
        persisting: PersistScheduler,
        *,
        before_marker: Callable[[int], object] | None = None,
    ) -> None:
        self._persisting = persisting
        self._before_marker = before_marker
        self._steps: RankSteps | None = None
        self._reporter: RankReporter | None = None
        self._agreement: Agreement | None = None
        # (a save, a persist() call, or None: the end)
        self._jobs: queue.SimpleQueue[_Job | Literal["persist"] | None] = queue.SimpleQueue()
        self._nursery: Nursery | None = None  # (a new one at each start)
        # Shared with the background thread, under the lock:
        self._lock = threading.Condition()
        self._issued = 0
        self._done = 0
        self._requests = 0  # persist() calls not yet taken by the background thread
        self._newest: int | None = None
        self._failure: BaseException | None = None
        self._broken: str | None = None
        self._ended = False  # (the votes failed as the world ended: see the module)

    # -- the training thread's -----------------------------------------------------------

    def start(self, steps: RankSteps, reporter: RankReporter, agreement: Agreement | None) -> None:
        """Start the thread, for the rank's ``steps`` and ``reporter``; the ranks agree
        through ``agreement`` (None: a world of one rank)."""
        self._steps, self._reporter, self._agreement = steps, reporter, agreement
        self._nursery = Nursery(join_timeout=None)
        self._nursery.start(self._serve, name="elastrun-checkpoint")

    def stop(self) -> bool:
        """Finish the saves in flight and end the thread; False when there was none."""
        nursery, self._nursery = self._nursery, None
        if nursery is not None:
            self._jobs.put(None)  # (after the saves in flight: the thread ends at it)
            nursery.close()
        return nursery is not None

    def forget(self) -> bool:
        """The world was rebuilt under the checkpoint (an in-process recovery): stop the
        vote in flight, end the thread, waiting a bounded time, and drop the saves in
        flight, their failures and the votes. The newest step stays. Returns whether
        the thread was left behind (it may still use what its saves hold)."""
        nursery, self._nursery = self._nursery, None
        if self._agreement is not None:
            self._agreement.cancel("the world was rebuilt")
        self._jobs.put(None)
        left_behind = nursery is not None and bool(nursery.close(timeout=_REBUILT_JOIN))
        if left_behind:
            log.warning(
                "memory checkpoint: the previous world's background thread did not end "
                "within %.0fs; it is left behind", _REBUILT_JOIN,
            )  # fmt: skip
        self._jobs = queue.SimpleQueue()
        self._agreement = None
        self._steps = self._reporter = None
        with self._lock:
            self._issued = self._done = self._requests = 0
            self._failure = self._broken = None
            self._ended = False
            self._lock.notify_all()
        return left_behind

    def newest(self) -> int | None:
        """The newest step known here to be complete on every rank (None: none yet)."""
        with self._lock:
            return self._newest

    def loaded(self, step: int | None, took: float) -> None:
        """The step just loaded (None: none), in ``took`` seconds, is now the newest
        complete on every rank; the rank's report says so."""
        with self._lock:
            self._newest = step
        assert self._reporter is not None, "not started"
        self._reporter.loaded(step, took)

    def pending(self) -> int:
        """The saves issued and not yet finished in the background."""
        with self._lock:
            return self._issued - self._done

    def submit(
        self, step: int, writer: MemoryStorageWriter | None, started: float, blocked: float
    ) -> None:
        """Finish a save of ``step`` in the background: publish ``writer``'s step, or
        (None) count a skipped or failed one in the ranks' agreement all the same.
        ``started``: when the call began (monotonic); ``blocked``: for how long."""
        with self._lock:
            self._issued += 1
        self._jobs.put(_Job(step, writer, started, blocked))

    def request_persist(self) -> None:
        """A ``persist()`` call, for the background thread after the saves before it."""
        with self._lock:
            self._requests += 1
        self._jobs.put("persist")

    def wait_idle(self) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._done >= self._issued)

    def wait_persisted(self) -> None:
        """Until the background thread took every ``persist()`` call and the persist
        in flight is written."""
        with self._lock:
            self._lock.wait_for(lambda: not self._requests)
        self._persisting.wait()

    def ended(self) -> bool:
        """Whether the votes stopped as the world ended (see the module): saves are
        skipped until the world is set up again."""
        with self._lock:
            return self._ended

    def raise_failure(self) -> None:
        """Raise what failed in the background since the last call (once), and, from
        then on, that the ranks lost each other (unless the world's end explains it).

        Raises:
            MemoryCheckpointError: either.
        """
        with self._lock:
            failure, self._failure = self._failure, None
            broken = None if self._ended else self._broken
        if failure is not None:
            raise MemoryCheckpointError(f"a memory checkpoint save failed: {failure}") from failure
        if broken is not None:
            raise MemoryCheckpointError(f"memory checkpoints stopped: {broken}")

    # -- the background thread -------------------------------------------------------------

    def _serve(self, _scope: CancelScope) -> None:
        jobs = self._jobs  # (its own: a world rebuilt gives the next thread another)
        while True:
            job = jobs.get()
            if job is None:
                return
            if job == "persist":
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
        steps, reporter = self._steps, self._reporter
        assert steps is not None and reporter is not None, "not started"  # (jobs come after it)
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
        agreed = self._agree(written is not None, f"agreeing on step {job.step}")
        if agreed is None:
            return
        lag = time.monotonic() - job.started if agreed else None  # (the copy lag)
        if agreed:
            self._persisting.hold()
            steps.keep_only({job.step})  # (the older step's data becomes the spare)
            with self._lock:
                self._newest = job.step
            if job.writer is not None and job.writer.data_bytes:
                steps.make_spare(job.writer.data_bytes)  # (when no older step left one)
        elif job.writer is not None:
            steps.remove(job.step, spare=True)
            if written is not None:
                log.info("memory checkpoint: step %d is not on every rank: not kept", job.step)
        reporter.saved(blocked=job.blocked, written=written, agreed=lag, newest=self.newest())
        self._persisting.if_due(agreed, self._agree, self.newest)

    def _serve_persist_request(self) -> None:
        """A ``persist()`` call, on the background thread."""
        try:
            self._persisting.on_request(self._agree, self.newest)
        finally:
            with self._lock:
                self._requests -= 1
                self._lock.notify_all()

    def _agree(self, here: bool, what: str) -> bool | None:
        """Whether every rank says ``here``; None when the ranks lost each other, now
        or before (``what``: what for, in the message; see the module)."""
        agreement = self._agreement
        if agreement is None:
            return here
        with self._lock:
            if self._broken is not None:
                return None
        try:
            return agreement.all_hold(here)
        except (RuntimeError, Cancelled) as exc:
            ended = ended_with_world(exc)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            with self._lock:
                self._broken = f"the ranks lost each other {what}: {first}"
                self._ended = ended
            if isinstance(exc, Cancelled):
                pass  # (the training thread, which rebuilt the world, says so)
            elif ended:
                log.info(
                    "memory checkpoint: the workers' store went away %s (the group "
                    "restarts or a new in-process round begins): saves are skipped until "
                    "the checkpoint is set up again", what,
                )  # fmt: skip
            else:
                log.warning("memory checkpoint: %s", self._broken)
            return None

    def __repr__(self) -> str:
        with self._lock:
            return (
                f"Finisher(running={self._nursery is not None}, "
                f"in_flight={self._issued - self._done}, requests={self._requests}, "
                f"newest={self._newest}, broken={self._broken is not None})"
            )


class Overlaps:
    """The saves that overlapped the previous one, still in flight (``on_overlap``),
    said in the log: the first time, then at most once every minute. The training
    thread's."""

    def __init__(self) -> None:
        self._count = 0
        self._waited = 0.0
        self._logged = -math.inf

    def note(self, step: int, waited: float | None) -> None:
        """Step ``step`` overlapped the previous save: it waited ``waited`` seconds
        for it, or (None) was skipped."""
        self._count += 1
        self._waited += waited or 0.0
        now = time.monotonic()
        if now - self._logged < _OVERLAP_LOG_EVERY:
            return
        self._logged = now
        if waited is None:
            log.warning(
                "memory checkpoint: step %d skipped, the previous save still in flight "
                "(on_overlap='skip'; %d step(s) skipped so far)",
                step,
                self._count,
            )
        else:
            log.warning(
                "memory checkpoint: step %d waited %.0f ms for the previous save to finish "
                "(on_overlap='wait'; %d wait(s), %.1f s in all so far)",
                step,
                waited * 1000,
                self._count,
                self._waited,
            )

    def __repr__(self) -> str:
        return f"Overlaps(count={self._count}, waited={self._waited:.1f})"
