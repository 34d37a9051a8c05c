"""The failure report: which worker failed first, and what every failed worker said."""

from __future__ import annotations

import logging
import os

from elastrun.core.errorfile import copy_with_error_code
from elastrun.core.errors import WorkerFailure
from elastrun.core.exitcodes import ExitStatus
from elastrun.supervise.failures.failure import NOT_AVAILABLE, ProcessFailure

__all__ = ["ChildFailedError", "copy_root_cause_error_file"]

_log = logging.getLogger(__name__)

# Delimiter lines are as wide as the widest line of the report, up to this.
_MAX_WIDTH = 80
_INDENT = "  "
_DETAIL_INDENT = "    "


class ChildFailedError(WorkerFailure):
    """Worker processes of one worker group failed; ``str()`` is the failure report.

    The root cause is the failure elastrun observed first among the workers that were
    not terminated by elastrun itself (ties: the smaller global rank); if elastrun
    terminated all of them, the first observed of all. torch instead compares the
    one-second timestamps in the error files, which cannot order failures that happen
    within the same second.

    Args:
        name: what failed, usually the entrypoint (``"train.py"``); the report title.
        failures: the failed workers by global rank.
        budget_note: why there will be no further restart, shown under the title, e.g.
            ``"restart budget exhausted: 3 of 3 restarts used (--max-restarts 3)"``.

    Raises:
        ValueError: ``failures`` is empty.
    """

    #: The launcher's exit status for this failure.
    exit_status: int = ExitStatus.WORKER_FAILED

    def __init__(
        self, name: str, failures: dict[int, ProcessFailure], budget_note: str | None = None
    ) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = failures
        self.budget_note = budget_note
        # The text starts on its own line, so that "ChildFailedError:" printed before it
        # by a traceback does not push the first delimiter line out of alignment.
        super().__init__("\n" + self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """The root cause: ``(global_rank, failure)`` of the first observed failure."""
        own = [(r, f) for r, f in self.failures.items() if not f.terminated_by_agent]
        candidates = own or list(self.failures.items())
        return min(candidates, key=lambda item: (item[1].observed_at, item[0]))

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """The failure report, root cause first (the parameter names are torch's)."""
        root_rank, root = self.get_first_failure()
        header = [f"{self.name} FAILED"]
        if self.budget_note:
            header.append(self.budget_note)
        root_lines = ["Root cause (first observed failure):", *_root_block(root_rank, root)]
        others = sorted(
            ((r, f) for r, f in self.failures.items() if r != root_rank),
            key=lambda item: (item[1].observed_at, item[0]),
        )
        other_lines = [line for r, f in others for line in _other_block(r, f, root_rank, root)]
        other_lines = ["Other failures:", *(other_lines or [f"{_INDENT}<none>"])]

        width = min(max(len(line) for line in [*header, *root_lines, *other_lines]), _MAX_WIDTH)
        border = boarder_delim * width
        section = section_delim * width
        return "\n".join([border, *header, section, *root_lines, section, *other_lines, border])

    def __reduce__(self) -> tuple[type[ChildFailedError], tuple[object, ...]]:
        return (type(self), (self.name, self.failures, self.budget_note))

    def __repr__(self) -> str:
        root_rank, _ = self.get_first_failure()
        return (
            f"ChildFailedError(name={self.name!r}, ranks={sorted(self.failures)}, "
            f"root_cause_rank={root_rank})"
        )


def copy_root_cause_error_file(err: ChildFailedError, dest_path: str) -> bool:
    """Copy the root cause's error file to ``dest_path``, adding its exit code.

    For an agent that runs under another elastic launcher: its own error file then
    names the worker's exception, with ``message.errorCode`` set to the worker's exit
    code. Returns False (and writes nothing) when the root cause left no usable error
    file, or when ``dest_path`` cannot be written (logged); never raises.
    """
    _, root = err.get_first_failure()
    if root.error_file_contents is None:
        return False
    try:
        copy_with_error_code(root.error_file_contents, dest_path, root.exitcode)
    except OSError as exc:
        _log.warning("could not write error file %s: %s", dest_path, exc)
        return False
    return True


def _field(label: str, value: str) -> str:
    return f"{_INDENT}{label:<10}: {value}"


def _indented(text: str, prefix: str = _DETAIL_INDENT) -> list[str]:
    return [f"{prefix}{line}" if line else "" for line in text.rstrip("\n").splitlines()]


def _time(ts: float) -> str:
    # Milliseconds: the point of ordering by observation time is telling apart failures
    # within the same second.
    from datetime import datetime  # only a failure is reported: off a launch's path

    return datetime.fromtimestamp(ts).isoformat(sep="_", timespec="milliseconds")


def _exitcode(failure: ProcessFailure) -> str:
    name = failure.signal_name()
    return f"{failure.exitcode} ({name})" if name != NOT_AVAILABLE else str(failure.exitcode)


def _error_file(failure: ProcessFailure) -> str:
    if failure.error_file_problem is not None:
        return f"{failure.error_file} (unusable: {failure.error_file_problem})"
    return failure.error_file if failure.has_error_file else NOT_AVAILABLE


def _message_lines(label: str, message: str) -> list[str]:
    first, *rest = message.rstrip("\n").splitlines() or [""]
    # Continuation lines of a multi-line message line up under its first line.
    return [_field(label, first), *_indented("\n".join(rest), " " * (len(_INDENT) + 12))]


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]


def _root_block(rank: int, failure: ProcessFailure) -> list[str]:
    lines = [
        _field("rank", f"{rank} (local {failure.local_rank})"),
        _field("host", failure.host),
        _field("pid", str(failure.pid)),
        _field("exitcode", _exitcode(failure)),
        _field("time", _time(failure.observed_at)),
        _field("error_file", _error_file(failure)),
        *_message_lines("message", failure.explanation),
    ]
    if failure.terminated_by_agent:
        lines.append(_field("note", "terminated by elastrun; no worker failed on its own"))
    if failure.traceback:
        lines.append(_field("traceback", ""))
        lines.extend(_indented(failure.traceback))
    lines.extend(_stderr_lines(failure))
    return [line.rstrip() for line in lines]


def _stderr_lines(failure: ProcessFailure) -> list[str]:
    """The stderr tail of the root cause, or why there is none when the log failed."""
    path, problem = failure.stderr_file, failure.write_problem
    if failure.stderr_tail:
        count = len(failure.stderr_tail)
        noun = "line" if count == 1 else "lines"
        where = " before the traceback" if failure.stderr_tail_omits_traceback else ""
        # The log may stop short of the failure when writing it failed.
        caveat = f" (may be incomplete: {problem})" if problem is not None else ""
        return [
            _field("stderr", f"last {count} {noun} of {path}{where}{caveat}"),
            *_indented("\n".join(failure.stderr_tail)),
        ]
    if failure.stderr_tail_omits_traceback:
        return [_field("stderr", f"{path} (only the traceback above)")]
    if failure.stderr_problem is not None:
        return [_field("stderr", failure.stderr_problem)]
    if path and problem is not None:
        # "stderr.log is empty; writing to <its directory> fails now: ..." names the
        # directory once.
        name = os.path.basename(path) if os.path.dirname(path) in problem else path
        return [_field("stderr", f"{name} is empty; {problem}")]
    return []


def _other_block(
    rank: int, failure: ProcessFailure, root_rank: int, root: ProcessFailure
) -> list[str]:
    who = f"{_INDENT}rank {rank} (local {failure.local_rank})"
    host = f", host {failure.host}" if failure.host != root.host else ""
    if failure.terminated_by_agent:
        name = failure.signal_name()
        how = f" ({name})" if name != NOT_AVAILABLE else ""
        after = "" if root.terminated_by_agent else f" after rank {root_rank} failed"
        line = f"{who}: terminated by elastrun{how}{after}"
        if name == NOT_AVAILABLE:
            line += f"; exitcode {failure.exitcode}"
        lines = [line + (f" ({host[2:]})" if host else "")]
        # A stopped sibling is noise unless it had something to say.
        if failure.has_error_file:
            lines.append(f"{_DETAIL_INDENT}{_first_line(failure.explanation)}")
        return lines
    lines = [
        f"{who}: exitcode {_exitcode(failure)}, pid {failure.pid}{host}, "
        f"at {_time(failure.observed_at)}",
        f"{_DETAIL_INDENT}{_first_line(failure.explanation)}",
    ]
    if failure.has_error_file or failure.error_file_problem is not None:
        lines.append(f"{_DETAIL_INDENT}error_file: {_error_file(failure)}")
    return lines


class NoProgressError(ChildFailedError):
    """More restarts would not help: workers failed again and again without passing the
    step they had reached, or a rank failed the same way at the same step twice in a
    row (a crash loop). The launcher exits with ``ExitStatus.DO_NOT_REQUEUE`` (93), so
    that a scheduler that requeues failed jobs can tell this one apart."""

    exit_status: int = ExitStatus.DO_NOT_REQUEUE
