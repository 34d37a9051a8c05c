"""Facts about processes read from /proc."""

from __future__ import annotations


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if it is gone.

    Together with the pid it names one process for good: a reused pid gets a later
    start time, so a recorded (pid, start time) is never mistaken for a stranger.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
