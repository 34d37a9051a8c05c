"""Starting worker processes.

Every worker is the leader of its own session and process group, so one ``killpg``
reaches it and everything it started, and it asks the kernel to SIGKILL it when the
agent dies (``PR_SET_PDEATHSIG``). Exit is observed through a pidfd, so the agent's
loop wakes the moment a worker dies instead of polling. Besides the two starters here,
the template ("zygote") starter, ``elastrun.template``, forks a group's workers in one batch.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from elastrun.core.errors import ExecutableNotFoundError, ProcessStartError
from elastrun.core.linux import die_with_parent
from elastrun.wire import bootstrap as _wire

log = logging.getLogger(__name__)


def prepare_child(
    sig: int, expected_parent: int, cpus: frozenset[int] | None, hold_sigint: bool = False
) -> None:
    """In a freshly forked child: bind its CPUs, then arm the parent-death signal (see
    :func:`elastrun.core.linux.die_with_parent`: it exits if the parent is gone).
    ``hold_sigint``: block SIGINT across exec (the worker bootstrap unblocks it)."""
    if hold_sigint:
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT,))
    if cpus:
        os.sched_setaffinity(0, cpus)  # inherited across exec, and by its children
    die_with_parent(sig, expected_parent)


def _holds_sigint(argv: Sequence[str]) -> bool:
    """Whether to start ``argv`` with SIGINT blocked: a worker bootstrap, which unblocks
    it once a SIGINT can no longer be lost (``wire.bootstrap``), started by
    an agent that does not block SIGINT itself (a mask the worker inherits stays)."""
    runs_bootstrap = any(
        a == "-m" and b == _wire.BOOTSTRAP_MODULE for a, b in itertools.pairwise(argv)
    )
    return runs_bootstrap and signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


@dataclass(frozen=True)
class FunctionCall:
    """A Python function to run in a worker, with where to put its return value."""

    function: Callable[..., object]
    args: tuple[object, ...]
    return_file: str


@dataclass(frozen=True)
class ProcessSpec:
    """Everything needed to start one worker.

    Exactly one of ``argv`` (an executable and its arguments) and ``call`` (a Python
    function) is set. ``env`` is the child's complete environment. ``stdout_fd`` and
    ``stderr_fd`` are descriptors for the child's streams (None: inherit).
    """

    local_rank: int
    env: Mapping[str, str]
    argv: tuple[str, ...] | None = None
    call: FunctionCall | None = None
    stdout_fd: int | None = None
    stderr_fd: int | None = None
    cwd: str | None = None
    death_signal: int = signal.SIGKILL
    #: CPUs to bind the worker to (NUMA binding); None leaves its affinity alone.
    cpus: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if (self.argv is None) == (self.call is None):
            raise ValueError("a ProcessSpec needs exactly one of argv and call")


class WorkerProcess(Protocol):
    """A started worker: its pid, an fd that becomes readable when it exits, its code."""

    local_rank: int
    pid: int

    def exit_fd(self) -> int: ...

    def exited(self) -> bool:
        """Whether the process has ended, without reaping it (its pid stays reserved)."""

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group; a group that is gone is no error."""

    def poll(self) -> int | None:
        """The exit code once the process has ended (negative: killed by that signal)."""

    def return_value(self) -> object:
        """The function's return value (None for executables)."""

    def release(self) -> None:
        """Close descriptors held for this process (after it was reaped)."""


class ProcessStarter(Protocol):
    """Starts worker processes."""

    def start(self, spec: ProcessSpec) -> WorkerProcess:
        """Start one worker.

        Raises:
            ProcessStartError: it could not be started.
        """

    def start_many(self, specs: Sequence[ProcessSpec]) -> list[WorkerProcess]:
        """Start the workers of ``specs``, all or none, returned in order (a starter that
        cannot do better than one after another uses :func:`start_each`).

        Raises:
            ProcessStartError: one could not be started; those already started were
                killed and reaped.
        """


def start_each(
    start: Callable[[ProcessSpec], WorkerProcess], specs: Iterable[ProcessSpec]
) -> list[WorkerProcess]:
    """``start(spec)`` for each spec in order; all start or none runs.

    When a start raises (or the caller is interrupted), the workers already started are
    killed (see :func:`kill_started`) and the exception propagates.
    """
    procs: list[WorkerProcess] = []
    try:
        for spec in specs:
            procs.append(start(spec))
    except BaseException:
        kill_started(procs)
        raise
    return procs


def kill_started(procs: Sequence[WorkerProcess]) -> None:
    """SIGKILL workers of a start that failed, with no grace (none has done any work
    yet), and reap them."""
    # procset builds on this module's types; it is loaded by then anyway.
    from elastrun.supervise.processes.procset import ProcessSet

    partial = ProcessSet(procs)
    partial.stop(signal.SIGKILL, 0)
    partial.close()


@dataclass
class _Handle:
    local_rank: int
    pid: int
    _pidfd: int
    _wait: Callable[[], int | None]
    _return_file: str | None = None
    _code: int | None = None

    def exit_fd(self) -> int:
        return self._pidfd

    def exited(self) -> bool:
        if self._code is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True  # already reaped
        return info is not None

    def poll(self) -> int | None:
        if self._code is None:
            self._code = self._wait()
        return self._code

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.warning("no permission to signal process group %d", self.pid)

    def return_value(self) -> object:
        path = self._return_file
        if not path or not os.path.exists(path):
            return None
        import pickle  # only function workers need it, not a launch of a script

        with open(path, "rb") as fh:
            # The file was written by our own child from the user's return value: the
            # one place a pickle crosses a process boundary, as with multiprocessing.
            return pickle.load(fh)

    def release(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def __repr__(self) -> str:
        return f"WorkerProcess(local_rank={self.local_rank}, pid={self.pid}, exit={self._code})"


def adopt_child(local_rank: int, pid: int, return_file: str | None = None) -> WorkerProcess:
    """The handle of ``pid``, a running child of this process started without
    ``subprocess`` (forked here, or forked by the template and handed to this process).

    Its exit is observed through a pidfd and its status reaped with ``waitpid``.
    ``return_file``: where a function worker leaves its return value.

    Raises:
        ProcessLookupError: ``pid`` is gone (already reaped).
    """
    wait = functools.partial(_waitpid_nohang, pid)
    return _Handle(local_rank, pid, os.pidfd_open(pid), wait, return_file)


def _waitpid_nohang(pid: int) -> int | None:
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return None if got == 0 else os.waitstatus_to_exitcode(status)


class SubprocessStarter:
    """Start workers as fresh processes (``subprocess.Popen``).

    Function workers run in a fresh interpreter through ``elastrun.worker.fnrunner``:
    the function and its arguments are pickled to a file, as multiprocessing's spawn
    start method would send them, so they must be importable by name.
    """

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python

    def start(self, spec: ProcessSpec) -> WorkerProcess:
        argv = spec.argv
        return_file = None
        if spec.call is not None:
            payload = spec.call.return_file + ".call"
            write_call_payload(payload, spec.call)
            argv = (self._python, "-u", "-m", "elastrun.worker.fnrunner", payload)
            return_file = spec.call.return_file
        assert argv is not None
        parent, death, cpus = os.getpid(), spec.death_signal, spec.cpus
        env = dict(spec.env)
        hold = _holds_sigint(argv)
        if hold:
            env[_wire.SIGINT_HELD_ENV] = str(_wire.VERSION)
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=spec.stdout_fd,
                stderr=spec.stderr_fd,
                cwd=spec.cwd,
                start_new_session=True,
                # Only syscalls (sigmask, affinity, prctl, getppid) run between fork and
                # exec: no locks, no allocation, so the relay thread cannot deadlock it.
                preexec_fn=lambda: prepare_child(death, parent, cpus, hold),  # noqa: PLW1509
            )
        except OSError as exc:
            message = (
                f"local rank {spec.local_rank}: cannot start {argv[0]!r}: {exc.strerror or exc}"
            )
            if isinstance(exc, FileNotFoundError):
                missing = ExecutableNotFoundError(message)
                missing.errno = exc.errno  # for ``errno == ENOENT`` checks; str() stays ours
                raise missing from exc
            raise ProcessStartError(message) from exc
        return _Handle(spec.local_rank, proc.pid, os.pidfd_open(proc.pid), proc.poll, return_file)

    def start_many(self, specs: Sequence[ProcessSpec]) -> list[WorkerProcess]:
        return start_each(self.start, specs)


def _main_file_for(function: Callable[..., object]) -> str | None:
    """The script the child must re-import so that ``function`` can be found.

    Only a function defined in the user's main script needs it. A main module that is
    a package's ``__main__`` (``python -m elastrun``) is never re-run: it is the
    launcher itself, not user code (multiprocessing makes the same exception).
    """
    if getattr(function, "__module__", None) != "__main__":
        return None
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and (spec.name == "__main__" or spec.name.endswith(".__main__")):
        return None
    path: str | None = getattr(main, "__file__", None)
    return path


def write_call_payload(path: str, call: FunctionCall) -> None:
    """Write a function call for ``elastrun.worker.fnrunner``.

    The file is one JSON header line (format version, the parent's ``__main__`` file,
    ``sys.path`` and working directory) followed by the pickled ``(function, args,
    return_file)``. The child prepares ``__main__`` from the header before unpickling,
    the way multiprocessing's spawn method re-imports the main module, so a function
    defined in the user's script is found again.
    """
    header = {
        "version": 1,
        "main_file": _main_file_for(call.function),
        "sys_path": list(sys.path),
        "cwd": os.getcwd(),
    }
    import pickle

    try:
        body = pickle.dumps((call.function, call.args, call.return_file))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ProcessStartError(
            f"cannot send {call.function!r} to a worker process: {exc} "
            "(function workers must be importable by name; use --start-method fork "
            "for local closures)"
        ) from exc
    with open(path, "wb") as fh:
        fh.write(json.dumps(header).encode() + b"\n")
        fh.write(body)


class ForkStarter:
    """Start function workers by forking the agent (``--start-method fork``)."""

    def start_many(self, specs: Sequence[ProcessSpec]) -> list[WorkerProcess]:
        return start_each(self.start, specs)

    def start(self, spec: ProcessSpec) -> WorkerProcess:
        if spec.call is None:
            raise ProcessStartError("the fork starter runs Python functions only")
        parent = os.getpid()
        # Flush before forking so that buffered output is not written twice.
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, measured by process tests
            code = 1
            try:
                os.setsid()
                prepare_child(spec.death_signal, parent, spec.cpus)
                if spec.stdout_fd is not None:
                    os.dup2(spec.stdout_fd, 1)
                if spec.stderr_fd is not None:
                    os.dup2(spec.stderr_fd, 2)
                if spec.cwd:
                    os.chdir(spec.cwd)
                os.environ.clear()
                os.environ.update(spec.env)
                from elastrun.worker.fnrunner import run_call

                code = run_call(spec.call.function, spec.call.args, spec.call.return_file)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        return adopt_child(spec.local_rank, pid, spec.call.return_file)
