"""Crash loops: the same rank failing the same way at the same step, attempt after attempt.

Pure logic. After a failed attempt the agent passes, for each of its ranks that failed on
its own (not stopped by elastrun), a :class:`FailureSignature`: what the worker reported
(the exception's type and message and the frames of its traceback, from its error file),
or else the signal that killed it or its exit code, and the last step it reported
(``None`` when it reported none). When a rank failed in two consecutive attempts of this
agent with the same signature, the failure looks deterministic: the job stops instead of
spending the rest of the restart budget on it.

What "the same step" means when a job reports no progress (a plain script, no optimizer,
no ``elastrun.progress()``), or when a rank failed before its first report:

* an exception with no step on either side is the same failure when its type, message
  and frames are: the traceback pins where it happened. This is the classic crash loop,
  a script that raises the same ``ValueError`` at start-up every time;
* a signal or a bare exit code (no error file) with no step on either side is *not*
  judged: nothing places it in the run. A SIGKILL (the OOM killer, an operator), a
  SIGBUS (a bad node) or an ``exit(1)`` after a caught I/O error while loading is as
  likely to come from outside as from the program, and a number says too little to
  call two failures the same. With steps, the same signal or exit code at the same step
  is a crash loop (a segfault in the same step).

Anything that differs -- another message (one that names an address, a timestamp or
the restart count), another frame, another step -- is a new failure, which gets its
restarts. ``--stalled-restarts`` catches the loops this rule lets through.

Ranks are compared by global rank: the rendezvous keeps a node's ranks where it can; a
rank that moved to another node starts afresh there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CrashLoopGuard", "FailureSignature", "frames_of", "signature_of"]

# ``  File "train.py", line 12, in main``: one frame of a Python traceback.
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<func>.+?)\s*$')


def frames_of(traceback: str | None) -> tuple[str, ...]:
    """The frames of a Python traceback, ``file:line:function`` each, outermost first."""
    if not traceback:
        return ()
    found = (_FRAME.match(line) for line in traceback.splitlines())
    return tuple(f"{m['file']}:{m['line']}:{m['func']}" for m in found if m is not None)


@dataclass(frozen=True)
class FailureSignature:
    """How one rank failed in one attempt.

    Attributes:
        rank: the global rank.
        error: ``"ValueError: bad lr"`` (the error file's message), ``"SIGSEGV"``, or
            ``"exit code 3"``.
        frames: the traceback's frames (empty without one).
        step: the last step the rank reported in that attempt, None if it reported none.
        reported: True when the worker reported its error (an error file); False for a
            signal or a bare exit code.
    """

    rank: int
    error: str
    frames: tuple[str, ...] = ()
    step: int | None = None
    reported: bool = True

    def same_failure(self, other: FailureSignature) -> bool:
        """Whether ``other`` is this failure again (see the module docstring)."""
        mine = (self.rank, self.error, self.frames, self.reported)
        if mine != (other.rank, other.error, other.frames, other.reported):
            return False
        if self.step is None and other.step is None:
            return self.reported
        return self.step == other.step

    def describe(self) -> str:
        """``rank 1 failed with ValueError: bad lr at step 3`` (one line)."""
        at = f"at step {self.step}" if self.step is not None else "before any progress report"
        where = f", in {self.frames[-1]}" if self.frames else ""
        return f"rank {self.rank} failed with {self.error} {at}{where}"


def signature_of(
    rank: int,
    exitcode: int,
    *,
    message: str | None = None,
    traceback: str | None = None,
    step: int | None = None,
    signal_name: str | None = None,
) -> FailureSignature:
    """The signature of a failed worker: its error file's ``message`` and ``traceback``
    when it left one, else its signal (``signal_name`` for a negative ``exitcode``) or
    its exit code."""
    if message:
        return FailureSignature(rank, message.strip(), frames_of(traceback), step)
    error = (signal_name or f"signal {-exitcode}") if exitcode < 0 else f"exit code {exitcode}"
    return FailureSignature(rank, error, (), step, False)


class CrashLoopGuard:
    """Remembers the failures of the last failed attempt; finds one that repeats.

    Only consecutive attempts compare: an attempt that ended otherwise (the group
    re-formed, another node's failure restarted it) breaks the row, since the attempt
    numbers then skip one.
    """

    def __init__(self) -> None:
        self._attempt: int | None = None
        self._last: dict[int, FailureSignature] = {}

    def attempt_failed(
        self, attempt: int, failures: Iterable[FailureSignature]
    ) -> FailureSignature | None:
        """Record attempt ``attempt``'s own failures; the one that repeats the same
        rank's failure in attempt ``attempt - 1``, or None."""
        current = {f.rank: f for f in failures}
        previous = self._last if self._attempt == attempt - 1 else {}
        self._attempt, self._last = attempt, current
        for rank in sorted(current):
            before = previous.get(rank)
            if before is not None and before.same_failure(current[rank]):
                return current[rank]
        return None

    def __repr__(self) -> str:
        return f"CrashLoopGuard(attempt={self._attempt}, ranks={sorted(self._last)})"
