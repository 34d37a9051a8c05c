"""The watches over a running attempt: hangs, teardown deadlocks, uninterruptible
sleep and expired timers.

Each pass of the agent's loop asks ``AttemptWatches``; they keep the evidence (stacks,
events, warnings), end hung workers and note why elastrun ended a worker on purpose
(``reasons``, read by the failure report). Whether to restart is the loop's decision.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Protocol

from elastrun.agent.attempt import Attempt
from elastrun.core.clock import Clock
from elastrun.observe.sinks import EventSink
from elastrun.pace.agent.stall_watch import ProgressWatch, hang_reasons
from elastrun.supervise.processes.dstate import UninterruptibleWatch
from elastrun.supervise.processes.stacks import request_stacks

log = logging.getLogger("elastrun.agent")

#: Default of ``stuck_exit_timeout``: a gloo/NCCL teardown ends well within a second of
#: its peers'; a rank 0 that saves or evaluates after the others left can take tens of
#: seconds. A minute separates the two, and the verdict is only a warning with stacks.
STUCK_EXIT_TIMEOUT = 60.0


class FileTimer(Protocol):
    """The agent's expiration-timer watchdog (``supervise.timers.agent_timer.AgentFileTimer``)."""

    def start(self, run_id: str) -> str: ...

    def expired_pids(self) -> dict[int, str]: ...

    def get_last_progress_time(self) -> float: ...

    def stop(self) -> None: ...


class AttemptWatches:
    """What the agent watches in its running workers, beyond their exits.

    Args:
        progress: the progress board and its hang verdicts.
        stuck: finds a worker stuck in uninterruptible sleep (None: off).
        file_timer: the expiration-timer watchdog (None: off).
        stuck_exit_timeout: see ``LocalElasticAgent`` (None: off).
        events, clock: the agent's.
    """

    def __init__(
        self,
        progress: ProgressWatch,
        *,
        stuck: UninterruptibleWatch | None,
        file_timer: FileTimer | None,
        stuck_exit_timeout: float | None,
        events: EventSink,
        clock: Clock,
    ) -> None:
        self._progress = progress
        self._stuck = stuck
        self._file_timer = file_timer
        self._stuck_exit_timeout = stuck_exit_timeout
        self._events = events
        self._clock = clock
        #: pid -> why elastrun ended that worker on purpose (for the failure report).
        self.reasons: dict[int, str] = {}

    def note_expired_timers(self) -> dict[int, str]:
        """Note the workers whose expiration timer expired; returns ``reasons``."""
        if self._file_timer is not None:
            for pid, scope in self._file_timer.expired_pids().items():
                self.reasons[pid] = f"its expiration timer expired (scope {scope})"
        return self.reasons

    def stuck_worker(self, attempt: Attempt) -> int | None:
        """A local rank stuck in uninterruptible sleep past the limit, if any."""
        if self._stuck is None:
            return None
        pids = {lr: attempt.procs.processes[lr].pid for lr in attempt.procs.running()}
        lr = self._stuck.check(pids)
        if lr is not None:
            self.reasons[pids[lr]] = self._stuck.reason(lr, pids[lr])
            log.error(
                "%s; stopping the workers (no restart: it cannot be killed)",
                self.reasons[pids[lr]],
            )
        return lr

    def check_hang(self, attempt: Attempt) -> None:
        """Workers that made no progress for the hang timeout: keep the evidence (every
        local worker's stacks), then kill the hung ones -- their exits are failures the
        recovery ladder handles, with the hang as the reason in the report."""
        if attempt.hang_handled:
            return
        running = attempt.procs.running()
        verdict = self._progress.hang(running)
        if verdict is None:
            return
        attempt.hang_handled = True
        pids = attempt.procs.pids()
        dumps = request_stacks(attempt.stack_requests(running))
        ranks = {w.local_rank: w.ranks.global_rank for w in attempt.plan.workers}
        first = ", ".join(f"rank {ranks[lr]}" for lr in verdict.stopped_first)
        self._events.record(
            "agent.hang",
            {"attempt": attempt.number, "stopped_first": first, "verdict": verdict.describe()},
        )
        self.reasons.update(hang_reasons(verdict, ranks, pids, dumps))
        for lr in verdict.hung:
            # It exited meanwhile: its exit is seen as usual.
            with contextlib.suppress(OSError):
                os.killpg(pids[lr], signal.SIGKILL)  # our unreaped child leads its group

    def check_stuck_at_exit(self, attempt: Attempt) -> None:
        """Warn (once, with stacks) about workers still running long after every other
        local worker exited successfully: a teardown deadlock looks like this, and
        neither it nor torchrun would ever say so. The worker is not stopped."""
        limit = self._stuck_exit_timeout
        exits = attempt.procs.exits
        if limit is None or not exits or any(e.exitcode != 0 for e in exits.values()):
            attempt.lonely_since = None
            return
        now = self._clock.monotonic()
        if attempt.lonely_since is None:
            attempt.lonely_since = now
        if attempt.lonely_reported or now - attempt.lonely_since < limit:
            return
        attempt.lonely_reported = True
        lonely_for = now - attempt.lonely_since
        running = attempt.procs.running()
        pids = attempt.procs.pids()
        dumps = request_stacks(attempt.stack_requests(running))
        for lr in running:
            rank = attempt.global_rank(lr)
            dump = dumps.get(lr)
            stacks = dump.path if dump is not None and dump.text else ""
            where = f"its stacks are in {stacks}" if stacks else "it did not answer a stack request"
            log.warning(
                "rank %d (local rank %d, pid %d) is still running %.0fs after every other "
                "local rank exited successfully; %s (it is not stopped)",
                rank, lr, pids[lr], lonely_for, where,
            )  # fmt: skip
            self._events.record(
                "agent.worker_stuck_at_exit",
                {"attempt": attempt.number, "rank": rank, "local_rank": lr, "pid": pids[lr],
                 "stacks": stacks},
            )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"AttemptWatches(stuck={self._stuck is not None}, "
            f"file_timer={self._file_timer is not None}, "
            f"stuck_exit_timeout={self._stuck_exit_timeout}, reasons={len(self.reasons)})"
        )
