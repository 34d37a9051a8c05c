"""Failed workers: how they are described, recorded and put in the failure report.

Whether the job restarts is the recovery ladder's decision and the phase transitions are
the loop's. ``reasons`` (pid -> why elastrun ended that worker on purpose) comes from
the watches (``AttemptWatches.reasons``).
"""

from __future__ import annotations

import errno
import signal
from collections.abc import Mapping

from elastrun.agent.attempt import Attempt
from elastrun.agent.policy import RestartBudget
from elastrun.core.errorfile import ErrorFileContents, read_error_file
from elastrun.core.errors import error_chain
from elastrun.observe.sinks import EventSink
from elastrun.pace import Snapshot
from elastrun.supervise.failures.crashloop import FailureSignature, signature_of
from elastrun.supervise.failures.failure import ProcessFailure, signal_name
from elastrun.supervise.processes.procset import Exit


def describe_exit(code: int) -> str:
    """``exited with code C`` or ``was killed by SIGNAME``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def describe_failure(attempt: Attempt, first: Exit) -> str:
    """``rank R (local L) exited with code C``: what the other nodes are told."""
    rank = attempt.global_rank(first.local_rank)
    return f"rank {rank} (local {first.local_rank}) {describe_exit(first.exitcode)}"


def record_failures(
    events: EventSink,
    attempt: Attempt,
    failed: list[Exit],
    *,
    restart: bool,
    stuck: int | None = None,
) -> None:
    """One ``agent.worker_failed`` event per failed exit, whether the job restarts
    or not (emitted before the restart event, so a log reader sees the cause first)."""
    for ex in failed:
        events.record(
            "agent.worker_failed",
            {
                "attempt": attempt.number,
                "rank": attempt.global_rank(ex.local_rank),
                "local_rank": ex.local_rank,
                "exitcode": ex.exitcode,
                "pid": ex.pid,
                "by_agent": ex.by_agent and ex.local_rank != stuck,
                "restart": restart,
            },
        )


def process_failures(
    attempt: Attempt, *, host: str, reasons: Mapping[int, str], stuck: int | None
) -> dict[int, ProcessFailure]:
    """The failed exits of ``attempt`` by global rank, for the failure report
    (``stuck``: the local rank stuck in uninterruptible sleep, if that ended the run)."""
    failures: dict[int, ProcessFailure] = {}
    for ex in failed_exits(attempt):
        global_rank = attempt.global_rank(ex.local_rank)
        failures[global_rank] = ProcessFailure(
            local_rank=ex.local_rank,
            pid=ex.pid,
            exitcode=ex.exitcode,
            error_file=attempt.setup.dest.error_files.get(ex.local_rank, ""),
            global_rank=global_rank,
            host=host,
            observed_at=ex.observed_at,
            terminated_by_agent=ex.by_agent and ex.local_rank != stuck,
            stderr_file=attempt.setup.dest.stderrs.get(ex.local_rank) or None,
            reason=reasons.get(ex.pid),
            log_problem=attempt.setup.relay.log_problem(ex.local_rank),
        )
    return failures


def failed_exits(attempt: Attempt) -> list[Exit]:
    """The attempt's failed exits, in the order they were seen."""
    exits = sorted(attempt.procs.exits.values(), key=lambda e: (e.observed_at, e.local_rank))
    return [ex for ex in exits if ex.exitcode != 0]


def signatures(attempt: Attempt, failed: list[Exit], progress: Snapshot) -> list[FailureSignature]:
    """How each worker of ``failed`` that failed on its own did so (its error file, or
    its signal or exit code) and at which step (``progress``: the attempt's last
    reports, by local rank): what the crash-loop guard compares."""
    found = []
    for ex in failed:
        if ex.by_agent:  # (``failed`` holds failed exits only)
            continue
        path = attempt.setup.dest.error_files.get(ex.local_rank, "")
        contents = read_error_file(path) if path else None
        report = contents if isinstance(contents, ErrorFileContents) else None
        record = progress.get(ex.local_rank)
        found.append(
            signature_of(
                attempt.global_rank(ex.local_rank),
                ex.exitcode,
                message=report.message if report is not None else None,
                traceback=report.traceback if report is not None else None,
                step=record.step if record is not None else None,
                signal_name=signal_name(ex.exitcode) if ex.exitcode < 0 else None,
            )
        )
    return found


#: The errors of a process that has no descriptor left (or a system with no file left).
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def out_of_descriptors(exc: BaseException) -> str | None:
    """What ``exc`` says, when it (or an error it was raised from) is the process or
    the system running out of file descriptors; else None.

    Restarting workers opens files, pipes, sockets and pidfds; where the descriptors ran
    out, the error may come raw (``OSError``) or translated (``ProcessStartError``,
    ``StoreError``, ``RendezvousError``), so the chain is followed.
    """
    if any(isinstance(e, OSError) and e.errno in _OUT_OF_DESCRIPTORS for e in error_chain(exc)):
        return str(exc)
    return None


def failure_note(
    budget: RestartBudget,
    *,
    stuck: int | None,
    stalled: str | None,
    history: list[str],
    crash_loop: str | None = None,
    cannot_restart: str | None = None,
) -> str:
    """Why the job was not restarted, with the earlier failures that were
    (``cannot_restart``: why a restart the budget allowed could not be made)."""
    limit = budget.limit
    refusal = getattr(budget, "refusal", None)
    if stuck is not None:
        note = f"not restarted: local rank {stuck} was stuck in uninterruptible sleep"
    elif cannot_restart:
        note = f"not restarted: {cannot_restart}"
    elif crash_loop:
        note = (
            f"not restarted: the failure looks deterministic: {crash_loop} "
            f"({budget.used()} of {limit} restart(s) used; --no-crash-loop-stop restarts anyway)"
        )
    elif stalled:
        note = f"not restarted: the restarts made no progress: {stalled}"
    elif refusal:
        note = f"not restarted: {refusal}"
    else:
        note = (
            f"restart budget exhausted: {budget.used()} of {limit} restart(s) used "
            f"(--max-restarts {limit})"
        )
    if history:
        note += "\nearlier failures:\n" + "\n".join(f"  {line}" for line in history)
    return note
