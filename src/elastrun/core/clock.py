"""Clocks and deadlines.

Intervals and deadlines always use the monotonic clock; wall-clock time is only for
timestamps shown to people or written to files. The clock is injected everywhere so
that tests can drive time by hand (see ``elastrun.testing.FakeClock``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    """Source of time: ``monotonic()`` for intervals, ``time()`` for timestamps."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The real clocks of the machine."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "SystemClock()"


SYSTEM_CLOCK: Clock = SystemClock()


@dataclass(frozen=True)
class Deadline:
    """A point on a monotonic clock; ``Deadline.never()`` is infinitely far away."""

    at: float
    clock: Clock = SYSTEM_CLOCK

    @classmethod
    def after(cls, seconds: float, clock: Clock = SYSTEM_CLOCK) -> Deadline:
        return cls(clock.monotonic() + max(0.0, seconds), clock)

    @classmethod
    def never(cls, clock: Clock = SYSTEM_CLOCK) -> Deadline:
        return cls(math.inf, clock)

    def remaining(self) -> float:
        """Seconds left, never negative; ``math.inf`` for a deadline that never comes."""
        return max(0.0, self.at - self.clock.monotonic())

    def expired(self) -> bool:
        return self.clock.monotonic() >= self.at

    def timeout(self, cap: float | None = None) -> float | None:
        """The remaining time as a ``select``-style timeout (None means forever)."""
        left = self.remaining() if cap is None else min(self.remaining(), cap)
        return None if math.isinf(left) else left

    def earliest(self, other: Deadline) -> Deadline:
        return self if self.at <= other.at else other
