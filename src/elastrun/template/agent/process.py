"""One running worker template and the agent's end of its control channel.

:meth:`Template.spawn_batch` makes this process a child subreaper for the hand-over, so
that the worker becomes the agent's child. Only for the hand-over: a permanent subreaper
would also inherit every orphaned grandchild of every worker (data loader processes,
compilers) and keep them as zombies, since nothing else in the agent would reap them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import IO

from elastrun.core.cancel import Cancelled, CancelScope, is_default, scope_or_default
from elastrun.core.errors import ElastrunError
from elastrun.core.linux import child_subreaper, die_with_parent
from elastrun.template.agent.key import TemplateKey
from elastrun.wire.template import (
    BATCH_MAX,
    TEMPLATE_MODULE,
    TITLE_ROOM,
    VERSION,
    recv_message,
    send_message,
    version_problem,
)

log = logging.getLogger(__name__)

_STOP_TIMEOUT = 5.0
# After a signal, how long the killed template's answer may take to be read (the channel
# ends once the workers it held back have exited, in milliseconds).
_LEFTOVER_BOUND = 1.0
# How long the processes of an abandoned batch may take to exit once the template is
# dead: they exit at once (end of the go-ahead pipe), unless the machine is wedged.
_BATCH_EXIT_BOUND = 10.0
# Room for workers' command lines beyond the one the template is started for (see
# TITLE_ROOM); a longer one is shown cut.
_TITLE_MARGIN = 256


class TemplateUnavailable(ElastrunError):
    """The template cannot be used (unsafe preload, failed to start); the reason."""


class TemplateBroken(ElastrunError):
    """The template died or stopped answering in the middle of a request."""


def _pid_or_reason(result: object) -> int | str:
    if isinstance(result, dict):
        pid = result.get("pid")
        if isinstance(pid, int):
            return pid
        return str(result.get("error", f"unexpected result {result!r}"))
    return f"unexpected result {result!r}"


def _read_to_end(fd: int, deadline: float) -> tuple[list[bytes], bool]:
    """The lines on ``fd`` until its end or the deadline, and whether its end came."""
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return data.split(), True
            data += chunk
    return data.split(), False


def _reap(pid: int, deadline: float) -> bool:
    """Reap ``pid`` if it is (or becomes, as its exit completes) this process's child;
    False if it is still running at the deadline."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True  # not ours: handed to another reaper, or reaped already
        if done:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


class Template:
    """One running template process and the agent's end of its control channel."""

    def __init__(
        self,
        key: TemplateKey,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        stderr: IO[bytes],
    ) -> None:
        self.key = key
        self.proc = proc
        self._sock = sock
        self._stderr = stderr
        self.preloaded: list[str] = []
        self.ready_seconds = 0.0
        self._started = time.monotonic()
        #: Whether the hello was received (the modules are imported).
        self.ready = False

    @classmethod
    def launch(
        cls,
        python: str,
        key: TemplateKey,
        preload: Sequence[str],
        optional: Sequence[str],
        worker_argv: Sequence[str] = (),
    ) -> Template:
        """Start a template; it imports its modules while the caller goes on.

        ``worker_argv`` is the command line of the workers it is started for: their
        title needs room in the template's environment (see ``retitle`` in
        :mod:`elastrun.template.worker.child`).

        Raises:
            TemplateUnavailable: the interpreter could not be started.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stderr = tempfile.TemporaryFile(prefix="elastrun-template-")  # noqa: SIM115 - owned by the template object
        # Nothing more on the command line: a worker's title must be longer than it.
        argv = [python, *key.options, "-m", TEMPLATE_MODULE, str(theirs.fileno())]
        title = len(os.fsencode(" ".join(worker_argv)))
        # First in the environment: the memory right after the arguments.
        env = {TITLE_ROOM: " " * (title + _TITLE_MARGIN), **dict(key.env)}
        agent = os.getpid()
        try:
            with child_subreaper():
                # Started while the agent is a subreaper, so the kernel marks the
                # template's descendants as having one (older kernels do not mark
                # existing descendants when the flag is set later).
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,  # the terminal's Ctrl-C is for the agent
                    # Only prctl and getppid run between fork and exec.
                    preexec_fn=lambda: die_with_parent(signal.SIGKILL, agent),  # noqa: PLW1509
                )
        except OSError as exc:
            ours.close()
            stderr.close()
            raise TemplateUnavailable(f"cannot start {python!r}: {exc}") from exc
        finally:
            theirs.close()
        template = cls(key, proc, ours, stderr)
        setup = {"version": VERSION, "preload": list(preload), "optional": list(optional)}
        # A few bytes into an empty socket buffer: never blocks. An OSError: it died
        # already, and await_ready reports how.
        with contextlib.suppress(OSError):
            send_message(ours, setup)
        return template

    def await_ready(self, timeout: float, scope: CancelScope | None = None) -> None:
        """Wait for the template's hello (once), in ``scope`` (default: the thread's
        current one): starting the template imports torch, seconds that a Ctrl-C must
        not wait for.

        Raises:
            TemplateUnavailable: it died, did not answer in time, or reports that
                forking is unsafe.
            Cancelled: ``scope`` was cancelled while the template was starting.
        """
        if self.ready:
            return
        self._wait_readable(timeout, scope_or_default(scope))
        self._sock.settimeout(timeout)
        try:
            got = recv_message(self._sock)
        except (OSError, ConnectionError) as exc:
            raise TemplateUnavailable(
                f"no answer from the template: {exc}{self._stderr_note()}"
            ) from exc
        if got is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(_STOP_TIMEOUT)
            raise TemplateUnavailable(
                f"the template ended during startup ({self.exit_description()})"
                f"{self._stderr_note()}"
            )
        hello, _ = got
        problem = version_problem(hello)
        if problem is not None:
            raise TemplateUnavailable(f"the template speaks {problem}")
        if "unsafe" in hello:
            raise TemplateUnavailable(str(hello["unsafe"]))
        preloaded = hello.get("preloaded", [])
        self.preloaded = [str(m) for m in preloaded] if isinstance(preloaded, list) else []
        self.ready_seconds = time.monotonic() - self._started
        self.ready = True

    def _wait_readable(self, timeout: float, scope: CancelScope) -> None:
        """Block until the template writes or the timeout passes (the read that follows
        says which).

        Raises:
            Cancelled: ``scope`` was cancelled first.
        """
        if not is_default(scope):  # (nothing can end the default scope's wait early)
            scope.wait_readable(self._sock.fileno(), timeout)

    def _await_answer(self, timeout: float, scope: CancelScope) -> bool:
        """Wait until the answer can be read (or the timeout); False when ``scope`` was
        cancelled first."""
        try:
            self._wait_readable(timeout, scope)
        except Cancelled:
            return False
        return True

    def _answer_left_by_killed(self) -> tuple[dict[str, object], list[int]] | None:
        """Kill the template and read the answer it had sent, if any.

        A worker runs only once the template has sent its answer: an answer that is
        not there means no worker of the batch will ever run (those held back exit
        when the template dies); one that is there names the workers that may.
        """
        self._kill()
        self._sock.settimeout(_LEFTOVER_BOUND)
        try:
            return recv_message(self._sock)
        except (OSError, ConnectionError):
            return None

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def _stderr_note(self) -> str:
        """The last line the template wrote to its stderr (import warnings, crashes)."""
        try:
            self._stderr.seek(0, os.SEEK_END)
            self._stderr.seek(max(0, self._stderr.tell() - 2000))
            tail = self._stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f"; its stderr ends with: {tail.splitlines()[-1]}" if tail else ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_description(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def spawn_batch(
        self,
        batch: Sequence[dict[str, object]],
        fds: Sequence[Sequence[int]],
        timeout: float,
        scope: CancelScope | None = None,
    ) -> list[int | str]:
        """Ask for one worker per request (``fds[i]``: request ``i``'s descriptors; at
        most ``BATCH_MAX`` requests); returns each one's pid (a child of this process by
        now) or why the template could not start it.

        The answer is waited for in ``scope`` (default: the thread's current one); its
        cancellation ends the wait at once: the template is killed (a stop is under way),
        and the workers its answer already named, if it had sent one, are returned for
        the agent to stop with the others.

        Raises:
            TemplateBroken: the channel failed; the template should be discarded.
            TemplateUnavailable: forking from the template has become unsafe.
            Cancelled: ``scope`` was cancelled before the template answered; it was
                killed and none of the batch's workers runs.
        """
        if not 0 < len(batch) <= BATCH_MAX or len(fds) != len(batch):
            raise ValueError(f"a batch holds 1 to {BATCH_MAX} requests, each with its fds")
        scope = scope_or_default(scope)
        if scope.cancelled:
            # A stop is under way already: fork nothing, and end the template as a
            # cancellation during the start would.
            self._kill()
            scope.raise_if_cancelled()
        attached = [fd for own in fds for fd in own]
        message = {"version": VERSION, "batch": list(batch)}
        self._sock.settimeout(timeout)
        ledger_r, ledger_w = os.pipe()
        try:
            with child_subreaper():
                got = self._exchange(message, [*attached, ledger_w], ledger_r, timeout, scope)
        finally:
            os.close(ledger_r)
        if got is None:
            raise TemplateBroken("the template closed the channel")
        reply, _ = got
        if "unsafe" in reply:
            raise TemplateUnavailable(str(reply["unsafe"]))
        results = reply.get("results")
        if not isinstance(results, list) or len(results) != len(batch):
            reason = str(reply.get("error", f"unexpected reply {reply!r}"))
            return [reason] * len(batch)
        return [_pid_or_reason(r) for r in results]

    def _exchange(
        self,
        message: dict[str, object],
        fds: list[int],
        ledger: int,
        timeout: float,
        scope: CancelScope,
    ) -> tuple[dict[str, object], list[int]] | None:
        """Send one batch and receive its answer (None: the channel closed), while this
        process is a subreaper. Without an answer, the template is killed and whatever
        the batch had forked is reaped before this returns or raises."""
        try:
            try:
                send_message(self._sock, message, fds)
            finally:
                os.close(fds[-1])  # the ledger's write end: only the batch's processes hold it
            if self._await_answer(timeout, scope):
                got = recv_message(self._sock)
            else:
                got = self._answer_left_by_killed()
                if got is None:
                    self._reap_batch(ledger)
                    raise Cancelled(scope.reason or "cancelled")
        except (OSError, ConnectionError) as exc:
            self._kill()
            self._reap_batch(ledger)
            raise TemplateBroken(str(exc) or type(exc).__name__) from exc
        if got is None:  # it died without answering
            self._kill()
            self._reap_batch(ledger)
        return got

    def _reap_batch(self, ledger: int) -> None:
        """Reap the processes a batch without an answer left to this process.

        The template is dead. Each process the batch forked wrote its pid on the ledger
        and holds it until it exits (none was handed over: no answer, no go-ahead), so
        the end of the ledger means they have all exited. Those the kernel handed to
        this subreaper (a dead template's intermediates, a dead intermediate's worker)
        are its zombies until reaped here; nobody else knows their pids. Intermediates
        first: once one is reaped, its worker has been handed on.
        """
        deadline = time.monotonic() + _BATCH_EXIT_BOUND
        notes, ended = _read_to_end(ledger, deadline)
        pids = [int(n[1:]) for n in notes if n[:1] == b"I" and n[1:].isdigit()]
        pids += [int(n[1:]) for n in notes if n[:1] == b"W" and n[1:].isdigit()]
        left = [pid for pid in pids if not _reap(pid, deadline)]
        if left or not ended:
            log.warning(
                "worker template (pid %d): processes of an abandoned start did not exit "
                "within %.0fs (pids: %s)",
                self.pid,
                _BATCH_EXIT_BOUND,
                ", ".join(map(str, left)) or "unknown",
            )

    def close(self) -> None:
        """Stop the template (end of its channel; SIGKILL if it lingers) and reap it."""
        self._sock.close()
        if not self.ready:
            # Still importing its modules, it would notice the closed channel only when
            # done (seconds of torch's import): it has no workers and nothing to save.
            self.proc.kill()
        try:
            self.proc.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._kill()
        self._stderr.close()

    def __repr__(self) -> str:
        state = self.exit_description() if self.ready else "starting"
        return f"Template(pid={self.pid}, preloaded={self.preloaded}, {state})"
