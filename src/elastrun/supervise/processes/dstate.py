"""Watchdog for workers stuck in uninterruptible sleep (process state ``D``).

A process in state D waits inside the kernel (a dead NFS server, a wedged GPU driver,
a failing disk) and ignores every signal, SIGKILL included, until the kernel lets go.
Such a worker neither progresses nor exits, so the agent's loop would wait forever.
With ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=<seconds>`` the agent checks each
worker on every tick and declares the group failed once one worker has been
continuously in state D for longer than that.

torchrun stops such a group and then reports success (exit 0, its defect §5.3);
elastrun reports it as a worker failure with a reason and a non-zero exit. The check
only reads ``/proc``; the clock is injected so unit tests can drive it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.procinfo import read_proc_state
from elastrun.core.values import MAX_SECONDS, check_number
from elastrun.wire.env import UNINTERRUPTIBLE_STATE_TIMEOUT_ENV

__all__ = [
    "UninterruptibleWatch",
    "read_proc_state",
    "timeout_from_env",
]

log = logging.getLogger(__name__)


def timeout_from_env(environ: Mapping[str, str]) -> float | None:
    """The watchdog timeout from ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``.

    Returns None (watchdog off) when the variable is unset or empty, and when it is zero
    or negative (an explicit "off", as with torchrun). torchrun also ignores a value
    that is not a number; here that is a configuration error, so a typo cannot switch
    the watchdog off unnoticed.

    Raises:
        ConfigError: naming the variable, for a value that is not a finite number of
            seconds (at most a year).
    """
    raw = environ.get(UNINTERRUPTIBLE_STATE_TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    value = check_number(
        raw, UNINTERRUPTIBLE_STATE_TIMEOUT_ENV, high=MAX_SECONDS, what="number of seconds"
    )
    return value if value > 0 else None


class UninterruptibleWatch:
    """Tracks how long each worker has been continuously in state D.

    Call :meth:`check` once per agent tick with the live workers. A worker seen in
    any other state (or gone) starts over: only an unbroken run of D samples counts.

    Args:
        timeout: seconds a worker may stay in state D (must be positive).
        clock: the monotonic clock to measure with.
        proc_root: where procfs is mounted (a fake directory in tests).
    """

    def __init__(
        self, timeout: float, clock: Clock = SYSTEM_CLOCK, proc_root: str = "/proc"
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.timeout = timeout
        self._clock = clock
        self._proc_root = proc_root
        self._since: dict[int, float] = {}  # pid -> monotonic time first seen in D

    def check(self, pids: Mapping[int, int]) -> int | None:
        """The local rank of a worker stuck in state D past the timeout, else None.

        Args:
            pids: local rank -> pid of every worker that is still running.

        When several workers are past the timeout, the one stuck longest is returned
        (the lowest local rank on a tie).
        """
        now = self._clock.monotonic()
        live = set(pids.values())
        self._since = {pid: t for pid, t in self._since.items() if pid in live}
        worst: tuple[float, int] | None = None
        for local_rank, pid in sorted(pids.items()):
            state = read_proc_state(pid, self._proc_root)
            if state is None or not state.startswith("D"):
                self._since.pop(pid, None)
                continue
            stuck = now - self._since.setdefault(pid, now)
            if stuck > self.timeout and (worst is None or stuck > worst[0]):
                worst = (stuck, local_rank)
        return None if worst is None else worst[1]

    def stuck_for(self, pid: int) -> float:
        """Seconds ``pid`` has been continuously in state D, as of the last check (0 if not)."""
        since = self._since.get(pid)
        return 0.0 if since is None else self._clock.monotonic() - since

    def reason(self, local_rank: int, pid: int) -> str:
        """A sentence for the failure report about a worker :meth:`check` returned."""
        return (
            f"local rank {local_rank} (pid {pid}) has been in uninterruptible sleep "
            f"(state D) for {self.stuck_for(pid):.1f}s, longer than "
            f"{UNINTERRUPTIBLE_STATE_TIMEOUT_ENV}={self.timeout:g}s"
        )

    def __repr__(self) -> str:
        return f"UninterruptibleWatch(timeout={self.timeout}, in_d_state={sorted(self._since)})"
