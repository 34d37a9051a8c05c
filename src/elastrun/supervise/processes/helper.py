"""A short-lived helper process the agent reads line by line, in a cancel scope.

The node check runs in processes of its own (the agent never imports torch): the agent
starts one, reads the JSON lines it prints, and waits for its exit -- every read in the
agent's shutdown scope and against a deadline, so that a signal or an overrun ends it
at once. Ending it stops its whole session (:meth:`Helper.close`; the node check's
runner ends the descendants it adopted, see ``nodecheck.worker.runner``).

Why the output is read into a bounded tail: a user's check script may write anything,
50 MB without a newline, or a progress bar that redraws itself with ``\r``. Joining each
read onto the unfinished line made the reading quadratic and held the whole output;
the tail costs the same per byte whatever the output, and at most ``TAIL`` lines of
``LINE_MAX`` bytes.

Why not ``subprocess.run(timeout=...)``: that wait cannot be cancelled by a signal,
and DESIGN.md section 5 wants every blocking wait to end within 100 ms of a stop.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress

from elastrun.core.cancel import CancelScope

__all__ = ["Helper"]

log = logging.getLogger("elastrun.agent")

#: Lines of output kept for the failure message.
TAIL = 20
#: The bytes kept of one line: a longer line keeps its end, after ``CUT``.
LINE_MAX = 4096
#: What stands for the start of a line that was cut.
CUT = "..."
#: Lines that may be results (they start with ``{``) kept until read.
PENDING = 64
#: How long a helper asked to stop may take before it is killed.
STOP_GRACE = 2.0
#: How long a killed helper may take to be reaped.
REAP_WAIT = 5.0
#: The most read at once.
READ_SIZE = 65536


class OutputTail:
    """The last lines of a stream fed in chunks, in bounded memory and linear time.

    A line ends at ``\n`` or ``\r`` (each redraw of a progress bar is a line); blank
    lines are skipped. A line longer than ``line_max`` bytes keeps its end, after
    ``CUT``: the unfinished line is cut as it grows, so a stream with no newline at
    all costs no more than one with short lines.

    Args:
        lines: how many lines ``lines`` keeps.
        line_max: the bytes kept of one line.
        pending: how many possible results ``pending`` keeps until they are read.
    """

    def __init__(self, lines: int = TAIL, line_max: int = LINE_MAX, pending: int = PENDING):
        self._line_max = line_max
        self._partial = b""
        self._cut = False  # the unfinished line lost its start
        #: The last lines (decoded, stripped).
        self.lines: collections.deque[str] = collections.deque(maxlen=lines)
        #: The lines that start with ``{``, in order, until taken.
        self.pending: collections.deque[str] = collections.deque(maxlen=pending)

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the stream."""
        *done, rest = (self._partial + chunk).replace(b"\r", b"\n").split(b"\n")
        cut = self._cut
        for raw in done:
            self._add(raw, cut)
            cut = False
        self._cut = cut or len(rest) > self._line_max
        self._partial = rest[-self._line_max :]

    def end(self) -> None:
        """The stream ended: its unfinished line counts as a line."""
        self.feed(b"\n")

    def _add(self, raw: bytes, cut: bool) -> None:
        cut = cut or len(raw) > self._line_max
        line = raw[-self._line_max :].decode(errors="replace").strip()
        if not line:
            return
        if line.startswith("{") and not cut:
            self.pending.append(line)
        self.lines.append(CUT + line if cut else line)

    def __repr__(self) -> str:
        return (
            f"OutputTail(lines={len(self.lines)}, pending={len(self.pending)}, "
            f"partial={len(self._partial)}, cut={self._cut})"
        )


class Helper:
    """One helper process. ``Helper.start`` starts it; ``close`` ends it (idempotent).

    Args:
        proc: the started process (its stdout a pipe with stderr merged in).
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self._eof = False
        self._out = OutputTail()

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str]) -> Helper:
        """Start ``argv`` in a session of its own.

        Raises:
            OSError: it could not be started.
        """
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return cls(proc)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def tail(self) -> collections.deque[str]:
        """The last lines it printed (decoded, stripped; a cut line starts with ``CUT``)."""
        return self._out.lines

    def _read_some(self, scope: CancelScope, deadline: float) -> bool:
        """Read what is there (False: end of output, or the deadline passed)."""
        if self._eof:
            return False
        stdout = self._proc.stdout
        assert stdout is not None, "started with a pipe"
        left = deadline - time.monotonic()
        if left <= 0 or not scope.wait_readable(stdout.fileno(), left):
            return False
        chunk = os.read(stdout.fileno(), READ_SIZE)
        if chunk:
            self._out.feed(chunk)
        else:
            self._eof = True
            self._out.end()
        return True

    def next_result(self, scope: CancelScope, deadline: float) -> dict[str, object] | None:
        """The next JSON object it prints (None: none before its end or ``deadline``).

        Raises:
            Cancelled: ``scope`` was cancelled (the process is left to ``close``).
        """
        pending = self._out.pending
        while True:
            while pending:
                try:
                    doc = json.loads(pending.popleft())
                except ValueError:
                    continue
                if isinstance(doc, dict):
                    return doc
            if not self._read_some(scope, deadline):
                return None

    def finish(self, scope: CancelScope, deadline: float) -> int | None:
        """Read its output to the end and reap it; its exit status (None: it did not end
        by ``deadline`` and was killed).

        Raises:
            Cancelled: ``scope`` was cancelled (the process is left to ``close``).
        """
        while self._read_some(scope, deadline):
            pass
        if not self._eof:
            self.close()
            return None
        left = max(0.0, deadline - time.monotonic())
        try:
            return self._proc.wait(timeout=min(left, REAP_WAIT))
        except subprocess.TimeoutExpired:
            self.close()
            return None

    def close(self) -> None:
        """Stop its session if it still runs: SIGTERM, then SIGKILL after ``STOP_GRACE``;
        reap it, with a bound. Never raises."""
        if self._proc.poll() is None:
            self._signal(signal.SIGTERM)
            self._exits_within(STOP_GRACE)
            # Whatever is left of its session. The leader is not reaped yet, so the
            # group's id (its pid) cannot have been given to another process.
            self._signal(signal.SIGKILL)
            try:
                self._proc.wait(timeout=REAP_WAIT)
            except subprocess.TimeoutExpired:
                log.warning("the check process %d could not be reaped", self._proc.pid)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def _signal(self, sig: signal.Signals) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)

    def _exits_within(self, timeout: float) -> None:
        """Wait until it exits, at most ``timeout``, without reaping it."""
        try:
            pidfd = os.pidfd_open(self._proc.pid)
        except OSError:
            return  # (no pidfd: no grace either)
        try:
            select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)

    def __repr__(self) -> str:
        return f"Helper(pid={self._proc.pid}, returncode={self._proc.returncode})"
