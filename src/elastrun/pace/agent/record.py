"""What the agent knows of one worker's progress: the value every detector reads."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ProgressRecord", "Snapshot"]


class ProgressRecord(NamedTuple):
    """One worker's last report, as read from its record.

    A tuple whose first three items are ``(step, last_report, step_time)``.

    Attributes:
        step: the last step reported.
        last_report: when it was reported, on the monotonic clock (seconds; the
            agent's ``time.monotonic()`` is the same clock).
        step_time: the moving average of the time per step in seconds (``None`` until
            two reports were made).
        longest: the longest interval between two reports in seconds (``None`` until
            two reports were made): pauses such as checkpoint saves show here.
        reports: how many reports the worker made (at least 1 in a snapshot).
        pid: the process that wrote the record.
    """

    step: int
    last_report: float
    step_time: float | None
    longest: float | None
    reports: int
    pid: int


#: The records of the workers that reported at least once, by local rank.
Snapshot = dict[int, ProgressRecord]
