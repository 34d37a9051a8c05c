"""A set of running workers: event-driven exit detection and the one shutdown ladder."""

from __future__ import annotations

import logging
import selectors
import signal
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from elastrun.core.cancel import CancelScope, is_default, scope_or_default
from elastrun.core.clock import SYSTEM_CLOCK, Clock, Deadline
from elastrun.core.procinfo import core_dumping, signal_state
from elastrun.supervise.processes.spawn import WorkerProcess

log = logging.getLogger(__name__)

#: How long reaping may take after SIGKILL before a process is reported as stuck
#: (a process in uninterruptible sleep cannot be killed until the kernel lets go).
REAP_BOUND = 5.0

#: A wait whose scope could get no descriptor (the process is out of them) looks at the
#: scope this often instead: a stop request is still seen within it.
UNWATCHED_SLICE = 0.1


@dataclass(frozen=True)
class Exit:
    """A worker exit as observed by the agent."""

    local_rank: int
    pid: int
    exitcode: int
    observed_at: float  # wall clock, for reports
    by_agent: bool = False  # the agent stopped it (shutdown ladder)


def _stopped_by(code: int, sent: frozenset[int]) -> bool:
    """Whether an exit seen during a stop was the stop itself.

    A signal the ladder did not send (SIGABRT from a native teardown, SIGSEGV) is the
    worker's own failure, however well it was timed; an exit code is taken as the
    worker's answer to the stop (a handler that exits 1 or 143).
    """
    return code >= 0 or -code in sent


@dataclass(frozen=True)
class StopReport:
    """What the shutdown ladder did."""

    exits: tuple[Exit, ...]
    killed: tuple[int, ...]  # local ranks that needed SIGKILL
    unreaped: tuple[int, ...]  # local ranks still alive after the reap bound


# The selector's data for a descriptor that only wakes a wait (a scope's, a notice's);
# a worker's exit descriptor carries its local rank.
_WAKE = "wake"


class ProcessSet:
    """Watches a group of worker processes.

    ``wait_for_exits`` blocks until a worker exits, a notice arrives, the deadline passes
    or its cancel scope is cancelled -- no sleeping loop. ``stop`` is the one shutdown
    ladder used for restarts and for the final stop alike.

    ``dumping_core(pid)``: whether that process is writing a core dump (read from /proc;
    a fake in tests).
    """

    def __init__(
        self,
        processes: Iterable[WorkerProcess],
        *,
        clock: Clock = SYSTEM_CLOCK,
        dumping_core: Callable[[int], bool] = core_dumping,
    ) -> None:
        self._procs = {p.local_rank: p for p in processes}
        self._live = dict(self._procs)
        self._exits: dict[int, Exit] = {}
        self._clock = clock
        self._sent: frozenset[int] = frozenset()  # the signals the ladder has sent
        self._dumping_core = dumping_core
        # Local ranks found writing a core dump when the ladder's SIGKILL went out: dying
        # of a signal of their own, whatever status the kernel reports after the SIGKILL.
        self._dying: set[int] = set()
        self._sel = selectors.DefaultSelector()
        for proc in self._procs.values():
            self._sel.register(proc.exit_fd(), selectors.EVENT_READ, proc.local_rank)

    @property
    def processes(self) -> dict[int, WorkerProcess]:
        return dict(self._procs)

    @property
    def exits(self) -> dict[int, Exit]:
        return dict(self._exits)

    def running(self) -> list[int]:
        return sorted(self._live)

    def pids(self) -> dict[int, int]:
        return {lr: p.pid for lr, p in self._procs.items()}

    def _collect(self, local_rank: int, by_agent: bool) -> Exit | None:
        proc = self._live.get(local_rank)
        if proc is None or not proc.exited():
            return None
        # The leader is a zombie until reaped below, so its pid -- the group id --
        # cannot have been reused: sweeping the group now reaches only the worker's
        # own leftover children, never a stranger.
        proc.signal_group(signal.SIGKILL)
        code = proc.poll()
        if code is None:
            return None
        del self._live[local_rank]
        with suppress(KeyError, ValueError):
            self._sel.unregister(proc.exit_fd())
        by_agent = by_agent and _stopped_by(code, self._sent) and local_rank not in self._dying
        ex = Exit(local_rank, proc.pid, code, self._clock.time(), by_agent)
        self._exits[local_rank] = ex
        return ex

    def poll(self) -> list[Exit]:
        """Collect exits that already happened, without blocking."""
        return [ex for lr in list(self._live) if (ex := self._collect(lr, False)) is not None]

    def wait_for_exits(
        self,
        deadline: Deadline,
        scope: CancelScope | None = None,
        notices: int | None = None,
    ) -> list[Exit]:
        """Block until at least one worker exits, ``notices`` (a descriptor, for news
        that is no cancellation: the caller drains it) becomes readable, or ``deadline``.

        Returns the exits observed (possibly empty after a notice or the deadline).

        Raises:
            Cancelled: ``scope`` (default: the thread's current one) was cancelled
                first; the exits seen meanwhile are kept in ``exits``.
        """
        scope = scope_or_default(scope)
        scope.raise_if_cancelled()
        found = self.poll()
        if found or (not self._live and notices is None and is_default(scope)):
            return found
        with self._also_watching(scope, notices) as watched:
            while True:
                cap = scope.remaining() if watched else min(scope.remaining(), UNWATCHED_SLICE)
                events = self._sel.select(deadline.timeout(cap=cap))
                over = scope.cancelled or deadline.expired() or scope.remaining() <= 0
                if watched or events or over:
                    break
        scope.raise_if_cancelled()
        ranks = [key.data for key, _ in events if isinstance(key.data, int)]
        found = [ex for lr in ranks if (ex := self._collect(lr, False)) is not None]
        return found + self.poll()

    @contextmanager
    def _also_watching(
        self, scope: CancelScope | None, notices: int | None = None
    ) -> Iterator[bool]:
        """The selector watches ``scope`` (unless None or the default, never cancelled)
        and ``notices`` too for the block; yields False when the scope's descriptor
        could not be made (then the caller looks at the scope every ``UNWATCHED_SLICE``).

        A scope makes its descriptor on first use, and the shutdown ladder is where a
        process out of descriptors must still get its workers stopped and reported
        (the ladder never raises), so that failure is not an error here.
        """
        extra: list[int] = []
        watched = True
        if scope is not None and not is_default(scope):
            try:
                extra.append(scope.fileno())
            except OSError as exc:
                log.warning("waiting without a wake-up descriptor (%s): polling instead", exc)
                watched = False
        if notices is not None:
            extra.append(notices)
        for fd in extra:
            self._sel.register(fd, selectors.EVENT_READ, _WAKE)
        try:
            yield watched
        finally:
            for fd in extra:
                self._sel.unregister(fd)

    def replace(self, proc: WorkerProcess) -> None:
        """Put ``proc`` in the place of its local rank's worker, which has exited (its
        exit was collected): the exit is forgotten and the new process watched (in-process
        recovery replaces one worker and keeps the others)."""
        lr = proc.local_rank
        if lr in self._live:
            raise ValueError(f"local rank {lr} still runs (pid {self._procs[lr].pid})")
        old = self._procs.get(lr)
        if old is not None:
            old.release()
        self._exits.pop(lr, None)
        self._dying.discard(lr)
        self._procs[lr] = self._live[lr] = proc
        self._sel.register(proc.exit_fd(), selectors.EVENT_READ, lr)

    def _signal_groups(self, ranks: Iterable[int], sig: int) -> None:
        for lr in ranks:
            self._procs[lr].signal_group(sig)

    def _wait_all(
        self, deadline: Deadline, by_agent: bool, scope: CancelScope | None = None
    ) -> None:
        """Collect exits until none runs, ``deadline`` passes or ``scope`` is cancelled."""
        if not self._live:
            return  # (the selector may be closed: a stop after ``close``)
        with self._also_watching(scope) as watched:
            while self._live:
                for lr in list(self._live):
                    self._collect(lr, by_agent)
                cut = scope is not None and scope.cancelled
                if not self._live or deadline.expired() or cut:
                    return
                cap = None if watched else UNWATCHED_SLICE
                for key, _ in self._sel.select(deadline.timeout(cap=cap)):
                    if isinstance(key.data, int):
                        self._collect(key.data, by_agent)

    def stop(
        self,
        sig: int = signal.SIGTERM,
        timeout: float = 30.0,
        grace: CancelScope | None = None,
    ) -> StopReport:
        """Stop every worker: ``sig`` to each process group, one shared deadline, SIGKILL,
        then reap with a bound. Idempotent; never raises; reports what it could not reap.

        The wait for the workers to stop ends early when ``grace`` is cancelled (a
        second Ctrl-C: SIGKILL at once). The reaping after SIGKILL takes no scope: it is
        bounded (``REAP_BOUND``), and skipping it would leave processes unreported.
        """
        before = set(self._exits)
        self._sent = frozenset({sig, signal.SIGKILL})
        self._signal_groups(list(self._live), sig)
        self._wait_all(Deadline.after(timeout, self._clock), by_agent=True, scope=grace)
        killed = tuple(sorted(self._live))
        if killed and sig != signal.SIGKILL:
            log.warning(
                "local ranks %s did not stop within %.1fs of %s; sending SIGKILL",
                list(killed),
                timeout,
                signal.Signals(sig).name,
            )
            for lr in killed:  # where the signal is: the evidence for a late worker
                pid = self._procs[lr].pid
                log.warning("local rank %d (pid %d): %s", lr, pid, signal_state(pid) or "gone")
                self._note_core_dump(lr, pid)
            self._signal_groups(killed, signal.SIGKILL)
        if killed:
            # Killed processes still need reaping (SIGKILL takes effect, not at once).
            self._wait_all(Deadline.after(REAP_BOUND, self._clock), by_agent=True)
        unreaped = tuple(sorted(self._live))
        if unreaped:
            log.error(
                "local ranks %s (pids %s) could not be reaped (uninterruptible sleep?)",
                list(unreaped),
                [self._procs[lr].pid for lr in unreaped],
            )
        new = tuple(self._exits[lr] for lr in sorted(self._exits) if lr not in before)
        return StopReport(exits=new, killed=killed, unreaped=unreaped)

    def _note_core_dump(self, local_rank: int, pid: int) -> None:
        """A late worker that is writing a core dump dies of a fatal signal of its own
        (an abort in its teardown): the SIGKILL that follows cuts the dump short, and the
        kernel then reports SIGKILL, so its exit is recorded as its own failure here.

        Why it is killed all the same: a worker's core can take minutes to write (the
        host memory of a large job), and the grace is the user's bound on a stop.
        """
        if self._dumping_core(pid):
            self._dying.add(local_rank)
            log.warning(
                "local rank %d (pid %d) is writing a core dump (it dies of a signal of its "
                "own): the SIGKILL cuts the dump short and the kernel reports SIGKILL",
                local_rank,
                pid,
            )

    def close(self) -> None:
        """Release descriptors of reaped processes and the selector."""
        for lr, proc in self._procs.items():
            if lr not in self._live:
                proc.release()
        self._sel.close()

    def __repr__(self) -> str:
        return f"ProcessSet(running={self.running()}, exited={sorted(self._exits)})"
