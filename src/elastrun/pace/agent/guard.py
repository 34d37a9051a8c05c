"""Stop restarting a job that makes no progress: the same crash at the same step, again.

Pure logic. After each attempt (a run of the worker group that ended in a failure and
would be followed by a restart) the agent passes each rank's last step
(:func:`elastrun.pace.agent.board.steps_of` of the final snapshot, taken before
the records are reset). An attempt made progress when some rank passed the highest
step it had reached in any earlier attempt (a rank seen for the first time passes
nothing, so it counts). ``limit`` consecutive attempts without progress: stop.

Attempts before the first report ever are neutral: a script that reports nothing (no
optimizer, no ``elastrun.progress()``) is never stopped by this guard. Once something
was reported, an attempt that reports nothing (a crash before the first step) is an
attempt without progress.

Steps compare as reported. With the automatic reports each process counts optimizer
steps from 1, so for a script that resumes from checkpoints "passing" means running
more steps in one attempt than any earlier attempt did; a script that reports its
global step (``elastrun.progress(step)``) is judged exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

from elastrun.core.values import check_number

__all__ = ["NoProgressGuard"]


class NoProgressGuard:
    """Counts consecutive attempts in which no rank passed its best step.

    Args:
        limit: attempts without progress in a row that mean "stop" (default 3).

    Raises:
        ConfigError: ``limit`` is not a positive integer.
    """

    def __init__(self, limit: int = 3) -> None:
        self.limit = int(check_number(limit, "limit", integer=True, low=1))
        self._best: dict[int, int] = {}
        #: Consecutive attempts without progress so far.
        self.stalled = 0
        self._last_steps: dict[int, int] = {}

    def attempt_ended(self, steps: Mapping[int, int]) -> bool:
        """Record an ended attempt's last step per rank; True: stop restarting.

        Args:
            steps: ``{rank: step}`` of the ranks that reported in this attempt.
        """
        self._last_steps = dict(steps)
        if not self._best and not steps:
            return False  # nothing ever reported: the guard stays out of the way
        passed = {rank: step for rank, step in steps.items() if step > self._best.get(rank, -1)}
        self._best.update(passed)
        self.stalled = 0 if passed else self.stalled + 1
        return self.should_stop

    @property
    def best(self) -> dict[int, int]:
        """The highest step each rank reached in any attempt."""
        return dict(self._best)

    @property
    def should_stop(self) -> bool:
        return self.stalled >= self.limit

    def describe(self) -> str:
        """Why to stop (or where things stand), for the log and the failure report."""
        best = ", ".join(f"rank {r}: {s}" for r, s in sorted(self._best.items())) or "none"
        last = ", ".join(f"rank {r}: {s}" for r, s in sorted(self._last_steps.items()))
        return (
            f"{self.stalled} consecutive attempt(s) without progress (limit {self.limit}); "
            f"best steps: {best}; last attempt: {last or 'no reports'}"
        )

    def __repr__(self) -> str:
        return f"NoProgressGuard(limit={self.limit}, stalled={self.stalled}, best={self._best})"
