"""One failed worker process: what the agent observed and what the worker reported."""

from __future__ import annotations

import functools
import os
import signal
import socket
import time
from dataclasses import dataclass, field

from elastrun.core.errorfile import ErrorFileContents, ErrorFileProblem, read_error_file

__all__ = [
    "NOT_AVAILABLE",
    "NO_ERROR_FILE_MESSAGE",
    "STDERR_TAIL_LINES",
    "ProcessFailure",
    "signal_name",
]

NOT_AVAILABLE = "<N/A>"
#: torch's ``ProcessFailure.message`` for a worker that exited with a code and left no
#: error file. Kept word for word: code written for torch compares it.
NO_ERROR_FILE_MESSAGE = (
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
)
#: What torch adds to ``error_file_data`` in that case.
_NO_ERROR_FILE_TRAITS = {"category": "system_terminated_error", "retryability": "False"}

# How much of a failed rank's stderr log the report shows.
STDERR_TAIL_LINES = 20
# Read at most this much from the end of the log for the tail; a long line past this
# is shown cut at the front.
_TAIL_READ_BYTES = 64 * 1024
# A single line in the tail longer than this (a progress bar redrawn with '\r') is cut.
_TAIL_LINE_MAX_CHARS = 1000
# What the write probe writes: a small error file's worth, so it needs a free block.
_PROBE_BYTES = 1024
# getfqdn may do a reverse DNS lookup, slow on badly configured hosts; the answer
# does not change during a run, so ask once per process.
_local_fqdn = functools.cache(socket.getfqdn)


@dataclass
class ProcessFailure:
    """A worker process that exited unsuccessfully.

    The first four fields match torch's ``ProcessFailure``. ``__post_init__`` reads the
    worker's error file and stderr tail; it never raises -- whatever cannot be read is
    described in ``error_file_problem`` instead.

    Attributes:
        local_rank: the worker's rank on its node.
        pid: the worker's process id.
        exitcode: the exit status; negative means killed by that signal (``-9``: SIGKILL).
        error_file: the path the worker was told to write its error to; ``""`` (or a
            path where no file exists) means none was written. After construction it
            is ``"<N/A>"`` when no file is there, as torch's is (callers test for it).
        global_rank: the worker's global rank, ``-1`` when unknown.
        host: the host the worker ran on; defaults to this host's FQDN.
        observed_at: wall-clock time the agent noticed the exit; ``0`` means now.
        terminated_by_agent: True when elastrun stopped this worker because another one
            failed (a sibling, not a cause).
        stderr_file: the rank's stderr log, when it was redirected or tee'd.
        reason: why elastrun ended the worker, when it did so on purpose.
        log_problem: why the rank's log files or error file are missing or incomplete,
            when the agent knows (its attempt's log directory could not be made, a log
            file could not be written), e.g. ``"cannot write worker logs to /logs/x:
            No space left on device"``.

    Derived attributes:
        message: torch's message: the error file's message, else for a signal
            ``"Signal 9 (SIGKILL) received by PID 1000"``, else torch's pointer to its
            documentation (:data:`NO_ERROR_FILE_MESSAGE`). Code written for torch
            compares it, so it says nothing of elastrun's own.
        explanation: the failure as elastrun explains it, what the failure report and
            the launcher's log show: the ``reason`` elastrun ended the worker, then the
            error file's message or the signal, and for an exit code without an error
            file why there is none (the file could not be used or written, or the
            worker did not record its exception, with the advice to decorate it).
        timestamp: when the failure happened, in whole epoch seconds (an int, as
            torch's): the error file's time if it has one, else ``observed_at``.
        error_file_data: the error file's JSON document (``{"message": "<NONE>"}``
            when there is none, as in torch).
        error_file_contents: the parsed error file, or None.
        traceback: the Python traceback the worker recorded, or None.
        error_file_problem: why an existing error file could not be used, or None.
        write_problem: why the error file or the stderr log may be missing or empty:
            ``log_problem``, else -- only when the error file is missing after an exit
            with a code, or the stderr log is empty, and elastrun did not stop the
            worker itself -- what writing a small file next to them fails with now
            (``"writing to /logs/x/0 fails now: No space left on device"``), else None.
            It replaces the advice to decorate the worker with ``record``, which a full
            disk or a removed directory would make misleading.
        stderr_problem: why ``stderr_file`` could not be read, or None.
        stderr_tail: the last lines of ``stderr_file`` (at most 20). When the log ends
            with the very traceback of the error file (python printed what the
            bootstrap recorded), that copy is left out and the lines before it are
            kept, so the report does not show the traceback twice.
        stderr_tail_omits_traceback: True when such a copy was left out.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    global_rank: int = -1
    host: str = ""
    observed_at: float = 0.0
    terminated_by_agent: bool = False
    stderr_file: str | None = None
    #: Why elastrun ended the worker, when it did so on purpose (an expired timer, a
    #: worker stuck in uninterruptible sleep); ``explanation`` starts with it.
    reason: str | None = None
    log_problem: str | None = None

    message: str = field(init=False, default="")
    explanation: str = field(init=False)
    timestamp: int = field(init=False)
    error_file_data: dict[str, object] = field(
        init=False, repr=False, default_factory=lambda: {"message": "<NONE>"}
    )
    error_file_contents: ErrorFileContents | None = field(init=False, repr=False, default=None)
    traceback: str | None = field(init=False, repr=False, default=None)
    error_file_problem: str | None = field(init=False, default=None)
    write_problem: str | None = field(init=False)
    stderr_problem: str | None = field(init=False)
    stderr_tail: list[str] = field(init=False, repr=False)
    stderr_tail_omits_traceback: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.host = self.host or _local_fqdn()
        self.observed_at = self.observed_at or time.time()
        self.timestamp = int(self.observed_at)
        self.write_problem = self.log_problem
        error_file_missing = False

        if self.error_file and self.error_file not in (NOT_AVAILABLE, os.devnull):
            contents = read_error_file(self.error_file)
            if isinstance(contents, ErrorFileProblem):
                if not contents.missing:
                    self.error_file_problem = contents.reason
                error_file_missing = contents.missing
            else:
                self.error_file_contents = contents
                self.error_file_data = dict(contents.raw)
                self.traceback = contents.traceback
                self.message = contents.message
                if contents.timestamp is not None:
                    self.timestamp = int(contents.timestamp)

        # Siblings that elastrun stopped are not probed: their silence is expected.
        probe = not self.terminated_by_agent and self.write_problem is None
        if probe and error_file_missing and self.exitcode > 0:
            # (a bare file name is in the working directory)
            self.write_problem = _probe_write(os.path.dirname(self.error_file) or ".")
        if self.error_file_contents is None and self.error_file_problem is None:
            self.error_file = NOT_AVAILABLE
        self.stderr_tail, self.stderr_tail_omits_traceback, self.stderr_problem = _stderr_tail(
            self.stderr_file, self.traceback
        )
        empty_stderr = not self.stderr_tail and self.stderr_problem is None
        if probe and self.write_problem is None and self.stderr_file and empty_stderr:
            self.write_problem = _probe_write(os.path.dirname(self.stderr_file))

        self._describe()

    def _describe(self) -> None:
        """Set ``message`` and ``explanation`` (see the class docstring)."""
        if self.message:
            self.explanation = self.message
        elif self.exitcode < 0:
            self.message = (
                f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
            )
            self.explanation = self.message
        else:
            self.message = NO_ERROR_FILE_MESSAGE
            self.error_file_data["errorTraits"] = dict(_NO_ERROR_FILE_TRAITS)
            self.explanation = self._why_no_error_file()
        if self.reason:
            self.explanation = f"{self.reason}: {self.explanation}"

    def _why_no_error_file(self) -> str:
        if self.error_file_problem is not None:
            return (
                f"exited with code {self.exitcode}; "
                f"its error file could not be used: {self.error_file_problem}"
            )
        if self.write_problem is not None:
            return f"exited with code {self.exitcode}; no error file: {self.write_problem}"
        return (
            f"exited with code {self.exitcode}; no error file (the worker did not report an "
            "exception: decorate its main with elastrun.record or torch's record, "
            "or check its stderr)"
        )

    @property
    def has_error_file(self) -> bool:
        """True when the worker left a readable error file."""
        return self.error_file_contents is not None

    def signal_name(self) -> str:
        """The name of the signal that killed the worker (``"SIGKILL"``), else ``"<N/A>"``."""
        return signal_name(self.exitcode)

    def timestamp_isoformat(self) -> str:
        """``timestamp`` as local time, ``YYYY-MM-DD_HH:MM:SS`` (torch's format)."""
        from datetime import datetime  # only a failure is reported: off a launch's path

        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_", timespec="seconds")


def signal_name(exitcode: int) -> str:
    """``"SIGTERM"`` for ``-15``; ``"<N/A>"`` for a non-negative or unknown code."""
    try:
        return signal.Signals(-exitcode).name  # (no signal is numbered 0 or below)
    except ValueError:
        return NOT_AVAILABLE


def _probe_write(directory: str) -> str | None:
    """What writing a small file in ``directory`` fails with now; None when it works.

    Tells a worker that wrote no error file (or nothing to its stderr log) apart from
    one that could not: a full disk, no inodes left, a removed directory. The probe
    writes and syncs about as much as an error file needs a block for, then removes
    its file; it describes the directory now, not when the worker tried.
    """
    path = os.path.join(directory, f".elastrun-write-probe.{os.getpid()}.{time.monotonic_ns()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return f"writing to {directory} fails now: {exc.strerror or exc}"
    error: OSError | None = None
    try:
        os.write(fd, b"\0" * _PROBE_BYTES)
        os.fsync(fd)
    except OSError as exc:
        error = exc
    try:
        os.close(fd)  # NFS may only report a failed write-back here
    except OSError as exc:
        error = error or exc
    try:
        os.unlink(path)
    except OSError as exc:
        error = error or exc
    return None if error is None else f"writing to {directory} fails now: {error.strerror or error}"


def _stderr_tail(path: str | None, traceback: str | None) -> tuple[list[str], bool, str | None]:
    """The tail of the stderr log, without a trailing copy of ``traceback``; whether a
    copy was dropped; why the log could not be read (None when it could)."""
    tb_lines = [line.rstrip() for line in traceback.rstrip().splitlines()] if traceback else []
    lines, problem = _read_tail(path, STDERR_TAIL_LINES + len(tb_lines))
    # Only an exact copy of the whole traceback is dropped: torch's record captures
    # fewer frames than python prints, and a partial cut would be confusing.
    if tb_lines and [line.rstrip() for line in lines[-len(tb_lines) :]] == tb_lines:
        return lines[: -len(tb_lines)][-STDERR_TAIL_LINES:], True, problem
    return lines[-STDERR_TAIL_LINES:], False, problem


def _read_tail(path: str | None, max_lines: int) -> tuple[list[str], str | None]:
    """The last ``max_lines`` lines of the file at ``path``, and why it could not be
    read (None when it could, or when there is no path)."""
    if not path:
        return [], None
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - _TAIL_READ_BYTES)
            f.seek(start)
            data = f.read(_TAIL_READ_BYTES)
    except OSError as exc:
        # Said in the report: "no stderr" would hide a removed or unreadable log.
        return [], f"cannot read {path}: {exc.strerror or exc}"
    lines = data.decode("utf-8", errors="replace").splitlines()
    if start > 0 and len(lines) > 1:
        lines.pop(0)  # most likely the second half of a line cut by the seek
    while lines and not lines[-1].strip():
        lines.pop()
    return [
        line if len(line) <= _TAIL_LINE_MAX_CHARS else line[:_TAIL_LINE_MAX_CHARS] + "..."
        for line in lines[-max_lines:]
    ], None
