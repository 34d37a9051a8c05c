"""The orphan guard: kills the workers' process groups if the agent dies abruptly.

``PR_SET_PDEATHSIG`` kills a worker when the agent dies, but not the processes the
worker started (data loader workers, compilers, shells). The guard is a tiny process in
its own session that the agent tells, over a pipe, which process groups are alive
(``+PGID`` / ``-PGID`` lines) and which directories are the agent's to remove
(``dPATH``: the node's memory checkpoints, in shared memory, which nothing else would
free). When the pipe reaches end-of-file without a clean ``bye`` -- the agent was
SIGKILLed, crashed, or lost its whole process group -- the guard SIGKILLs every group
it was told about, removes those directories, then exits.

Run as ``python -m elastrun.supervise.processes.guard`` (the agent does this).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from contextlib import suppress


class OrphanGuard:
    """The agent's side of the guard. Starting it costs one small process per agent.

    Args:
        python: the interpreter that runs the guard.
        environ: the guard's environment (the agent's; None: none), with ``PYTHONPATH``
            set over it so that the guard finds this package.
    """

    def __init__(
        self, python: str = sys.executable, environ: Mapping[str, str] | None = None
    ) -> None:
        self._python = python
        self._environ = dict(environ or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self._groups: set[int] = set()

    def start(self) -> None:
        if self._proc is not None:
            return
        self._proc = subprocess.Popen(
            [self._python, "-S", "-m", "elastrun.supervise.processes.guard"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a signal to the agent's group must not reach it
            env={**self._environ, "PYTHONPATH": _package_root()},
        )

    def _send(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            # The guard is gone: workers still die with the agent (parent-death
            # signal); only their own children would be left to their fate.
            self._proc = None

    def watch(self, pgid: int) -> None:
        self._groups.add(pgid)
        self._send(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        if pgid in self._groups:
            self._groups.discard(pgid)
            self._send(f"-{pgid}")

    def remove_if_orphaned(self, path: str) -> None:
        """Remove the directory ``path`` too if the agent dies abruptly (its own teardown
        removes it otherwise). Start the guard first."""
        if "\n" not in path:
            self._send(f"d{path}")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """Tell the guard the agent ends cleanly and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with suppress(OSError):  # (BrokenPipeError too) the guard is gone already
            if proc.stdin is not None:
                proc.stdin.write(b"bye\n")
                proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def __repr__(self) -> str:
        return f"OrphanGuard(pid={self.pid}, groups={sorted(self._groups)})"


def _package_root() -> str:
    # The guard runs with -S (no site), so point it at the directory holding elastrun.
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(os.path.dirname(os.path.dirname(here)))


def _guard_main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    directories: list[str] = []
    clean = False
    for raw in sys.stdin.buffer:
        line = raw.strip()
        if line == b"bye":
            clean = True
            break
        op, arg = line[:1], line[1:]
        if op == b"d" and arg.startswith(b"/"):
            directories.append(os.fsdecode(arg))
        elif op == b"+" and arg.isdigit():
            groups.add(int(arg))
        elif op == b"-" and arg.isdigit():
            groups.discard(int(arg))
    if not clean:
        for pgid in groups:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        for path in directories:
            shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(_guard_main())
