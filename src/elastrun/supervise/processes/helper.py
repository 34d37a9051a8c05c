"""A short-lived helper process the agent reads line by line, in a cancel scope.

The node check runs in processes of its own (the agent never imports torch): the agent
starts one, reads the JSON lines it prints, and waits for its exit -- every read in the
agent's shutdown scope and against a deadline, so that a signal or an overrun ends it
at once. It runs in a session of its own; ending it kills that whole session (a user's
check script may start children) and reaps it with a bound. Its stdout and stderr are
one stream: only the last lines are kept, for the message when it fails.

Why not ``subprocess.run(timeout=...)``: that wait cannot be cancelled by a signal,
and DESIGN.md section 5 wants every blocking wait to end within 100 ms of a stop.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from elastrun.core.cancel import CancelScope

__all__ = ["Helper"]

log = logging.getLogger("elastrun.agent")

#: Lines of output kept for the failure message.
TAIL = 20
#: How long a killed helper may take to be reaped.
REAP_WAIT = 5.0


class Helper:
    """One helper process. ``Helper.start`` starts it; ``close`` ends it (idempotent).

    Args:
        proc: the started process (its stdout a pipe with stderr merged in).
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self._buf = b""
        self._eof = False
        #: The last lines it printed (decoded, stripped).
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL)
        self._pending: collections.deque[str] = collections.deque()

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

    def _read_some(self, scope: CancelScope, deadline: float) -> bool:
        """Read what is there (False: end of output, or the deadline passed)."""
        if self._eof:
            return False
        stdout = self._proc.stdout
        assert stdout is not None, "started with a pipe"
        left = deadline - time.monotonic()
        if left <= 0 or not scope.wait_readable(stdout.fileno(), left):
            return False
        chunk = os.read(stdout.fileno(), 65536)
        if not chunk:
            self._eof = True
            chunk = b"\n"
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if line:
                self.tail.append(line)
                self._pending.append(line)
        return True

    def next_result(self, scope: CancelScope, deadline: float) -> dict[str, object] | None:
        """The next JSON object it prints (None: none before its end or ``deadline``).

        Raises:
            Cancelled: ``scope`` was cancelled (the process is left to ``close``).
        """
        while True:
            while self._pending:
                line = self._pending.popleft()
                if line.startswith("{"):
                    try:
                        doc = json.loads(line)
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
        """Kill its session if it still runs and reap it, with a bound. Never raises."""
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self._proc.wait(timeout=REAP_WAIT)
            except subprocess.TimeoutExpired:
                log.warning("the check process %d could not be reaped", self._proc.pid)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __repr__(self) -> str:
        return f"Helper(pid={self._proc.pid}, returncode={self._proc.returncode})"
