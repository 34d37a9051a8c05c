"""The workers' progress as the agent follows it: where they report, and the verdicts.

One ``ProgressWatch`` per agent owns the board the workers report into (shared memory in
a private directory, kept across restarts), the hang detector (``--hang-timeout``) and
the guard against restarts that make no progress (``--stalled-restarts``). It decides;
the agent acts (dumps stacks, kills, stops restarting).

Progress across restarts is the job's, whichever process made it. After a group
restart it is read from the board (each rank's reports). An in-process recovery keeps
most processes and starts a replacement whose own counts begin at 0, so there it is the
committed step the recovery restored (the newest commit of the round, every rank's
after the synchronisation): a recovery made progress when it restored a newer commit
than the recovery before it. A crash loop (the same step failing again and again)
restores the same commit each time and is stopped; failures that overlap a recovery
belong to that recovery, which is judged once, when it completes.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterable, Mapping

from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import ElastrunError
from elastrun.pace.agent.board import ProgressBoard, steps_of
from elastrun.pace.agent.guard import NoProgressGuard
from elastrun.pace.agent.hang import AutoTimeout, HangDetector, HangVerdict
from elastrun.pace.agent.record import Snapshot
from elastrun.supervise.processes.stacks import StackDump

log = logging.getLogger("elastrun.agent")

#: How much of a hung rank's stack dump goes into its failure report.
REPORT_STACK_LINES = 25


class ProgressWatch:
    """Progress reports, hang verdicts and the no-progress guard of one agent.

    Args:
        local_world_size: workers per round on this node (one board slot each).
        hang_timeout: see ``--hang-timeout``; None: no hang verdicts.
        stalled_restarts: see ``--stalled-restarts``; None: never stop for that.
        clock: the monotonic clock of the verdicts.
    """

    def __init__(
        self,
        local_world_size: int,
        hang_timeout: float | AutoTimeout | None = None,
        stalled_restarts: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._size = local_world_size
        self._clock = clock
        self._hang = HangDetector(hang_timeout, clock) if hang_timeout is not None else None
        self._guard = NoProgressGuard(stalled_restarts) if stalled_restarts else None
        # The in-process recoveries' guard: one "rank", the job, whose step is the
        # commit each completed recovery restored.
        self._commits = NoProgressGuard(stalled_restarts) if stalled_restarts else None
        self._board: ProgressBoard | None = None
        self._dir: str | None = None

    def worker_values(self, local_ranks: Iterable[int]) -> dict[int, dict[str, str]]:
        """A new attempt's workers' report slots: each local rank's values of the plan's
        progress variables (the board is made at the first start; a replaced worker that
        lingers writes where nobody reads). Empty when the board cannot be made."""
        board = self._open()
        if board is None:
            return {}
        board.reset_all()
        return {lr: board.worker_env(lr) for lr in local_ranks}

    def _open(self) -> ProgressBoard | None:
        if self._board is None:
            try:
                self._dir = tempfile.mkdtemp(prefix="elastrun-progress-")
                self._board = ProgressBoard.create(self._dir, self._size)
            except (OSError, ElastrunError) as exc:  # no temporary dir; the board's file
                log.warning("no progress reports from the workers: %s", exc)
                self.close()
                return None
        return self._board

    def status(self) -> dict[str, dict[str, float | int]]:
        """Each local rank's last step and the age of its last report (health check)."""
        now = self._clock.monotonic()
        return {
            str(lr): {"step": rec.step, "age_s": round(max(0.0, now - rec.last_report), 3)}
            for lr, rec in self.snapshot().items()
        }

    def snapshot(self) -> Snapshot:
        """Every local rank's last report (empty before the first start)."""
        board = self._board
        return {} if board is None or board.closed else board.snapshot()

    def hang(self, running: Iterable[int]) -> HangVerdict | None:
        """The hang verdict on the workers still running, or None."""
        if self._hang is None or self._board is None:
            return None
        return self._hang.check(self._board.snapshot(running))

    def stalled(self) -> str | None:
        """After a failed attempt (before its records are reset): why to stop
        restarting when the last restarts made no progress, else None."""
        if self._guard is None or self._board is None:
            return None
        stop = self._guard.attempt_ended(steps_of(self._board.snapshot()))
        return self._guard.describe() if stop else None

    def recovered(self, commit: int) -> None:
        """An in-process recovery completed, every rank holding ``commit`` (the newest
        commit of the round): judge whether it restored a newer one than the last."""
        if self._commits is not None:
            self._commits.attempt_ended({0: commit})

    def stalled_in_place(self) -> str | None:
        """Before recovering a failure in place: why to stop when the last completed
        in-process recoveries restored no newer commit, else None."""
        guard = self._commits
        if guard is None or not guard.should_stop:
            return None
        return (
            f"{guard.stalled} in-process recoveries in a row restored no newer commit "
            f"than commit {guard.best.get(0, 0)} (limit {guard.limit}): the same step "
            "fails again and again"
        )

    def close(self) -> None:
        """Unmap and remove the board; idempotent, never raises."""
        board, self._board = self._board, None
        if board is not None:
            board.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __repr__(self) -> str:
        return f"ProgressWatch(hang={self._hang!r}, guard={self._guard!r}, board={self._board!r})"


def hang_reasons(
    verdict: HangVerdict,
    global_ranks: Mapping[int, int],
    pids: Mapping[int, int],
    dumps: Mapping[int, StackDump],
) -> dict[int, str]:
    """Log each hung rank and return, by pid, the reason its failure report shows:
    how long it was silent after which step, the ranks that stopped first, its stack."""
    first = ", ".join(f"rank {global_ranks[lr]}" for lr in verdict.stopped_first)
    reasons = {}
    for silence in verdict.ranks:
        if not silence.hung:
            continue
        lr = silence.local_rank
        dump = dumps.get(lr)
        where = f"stacks in {dump.path}" if dump is not None and dump.text else "no stacks"
        log.error(
            "rank %d (local rank %d, pid %d) is hung: no progress for %.1fs after step %d "
            "(--hang-timeout %gs); %s",
            global_ranks[lr], lr, pids[lr], silence.silent_for, silence.step, silence.timeout,
            where,
        )  # fmt: skip
        reason = (
            f"hung: no progress for {silence.silent_for:.0f}s after step {silence.step}"
            f" (ranks that stopped first: {first}); {where}"
        )
        if dump is not None and dump.text:
            reason += "\n" + "\n".join(dump.text.splitlines()[-REPORT_STACK_LINES:])
        reasons[pids[lr]] = reason
    return reasons
