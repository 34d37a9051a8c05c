"""Crash loops: a rank failing the same way at the same step twice in a row stops the job."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from elastrun.core.errors import RendezvousClosedError
from elastrun.rendezvous.api import RoundOutcome
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.memory import MemoryStore
from elastrun.supervise.failures.crashloop import (
    CrashLoopGuard,
    FailureSignature,
    frames_of,
    signature_of,
)

TRACEBACK = """Traceback (most recent call last):
  File "/job/train.py", line 40, in <module>
    main()
  File "/job/train.py", line 12, in main
    raise ValueError("bad learning rate")
ValueError: bad learning rate
"""


def _node(store: MemoryStore, name: str) -> DynamicRendezvousHandler:
    settings = RendezvousSettings("job", 2, 2, last_call_timeout=0.3)
    return DynamicRendezvousHandler(store, settings, NodeDesc(name, "127.0.0.1", "default", 1))


def _raised(
    rank: int = 1, message: str = "ValueError: bad learning rate", step: int | None = None
) -> FailureSignature:
    return signature_of(rank, 1, message=message, traceback=TRACEBACK, step=step)


def test_frames_are_read_from_the_traceback_outermost_first() -> None:
    assert frames_of(TRACEBACK) == ("/job/train.py:40:<module>", "/job/train.py:12:main")
    assert frames_of(None) == ()


def test_the_same_exception_at_start_up_twice_in_a_row_is_a_crash_loop() -> None:
    guard = CrashLoopGuard()
    assert guard.attempt_failed(0, [_raised()]) is None
    repeated = guard.attempt_failed(1, [_raised()])
    assert repeated is not None and repeated.rank == 1
    assert repeated.describe() == (
        "rank 1 failed with ValueError: bad learning rate before any progress report, "
        "in /job/train.py:12:main"
    )


@pytest.mark.parametrize(
    "second",
    [
        _raised(message="ValueError: bad learning rate (restart 1)"),  # another message
        _raised(step=7),  # another step (the first had none)
        _raised(rank=2),  # another rank
        signature_of(1, 1, message="ValueError: bad learning rate", traceback=None),  # frames
    ],
)
def test_a_failure_that_differs_keeps_its_restarts(second: FailureSignature) -> None:
    guard = CrashLoopGuard()
    guard.attempt_failed(0, [_raised()])
    assert guard.attempt_failed(1, [second]) is None


def test_the_same_step_counts_and_another_step_does_not() -> None:
    guard = CrashLoopGuard()
    guard.attempt_failed(0, [_raised(step=120)])
    assert guard.attempt_failed(1, [_raised(step=130)]) is None
    assert guard.attempt_failed(2, [_raised(step=130)]) is not None


def test_signals_and_bare_exit_codes_need_a_step_to_be_judged() -> None:
    segv = signature_of(0, -11, signal_name="SIGSEGV")
    exited = signature_of(0, 7)
    assert segv.error == "SIGSEGV" and exited.error == "exit code 7"
    for sig in (segv, exited):
        guard = CrashLoopGuard()
        guard.attempt_failed(0, [sig])
        assert guard.attempt_failed(1, [sig]) is None  # nothing places it in the run
    at_step = signature_of(0, -11, signal_name="SIGSEGV", step=55)
    guard = CrashLoopGuard()
    guard.attempt_failed(0, [at_step])
    assert guard.attempt_failed(1, [at_step]) is at_step


def test_only_consecutive_attempts_compare() -> None:
    guard = CrashLoopGuard()
    guard.attempt_failed(0, [_raised()])
    # Attempt 1 ended otherwise (the group re-formed): attempt 2 starts a new row.
    assert guard.attempt_failed(2, [_raised()]) is None
    assert guard.attempt_failed(3, [_raised()]) is not None


def test_a_crash_loop_on_one_node_ends_the_job_on_every_node() -> None:
    store = MemoryStore()
    a, b = (_node(store, name) for name in "ab")
    try:
        joined = [threading.Thread(target=h.next_rendezvous) for h in (a, b)]
        for t in joined:
            t.start()
        for t in joined:
            t.join(30)
        assert a.outcome.restarts_used() == 0 and not a.is_closed()
        a.outcome.report_final_failure(
            "rank 1 (local 1) exited with code 1", "crash loop: rank 1 ..."
        )
        # b's workers finished: its exit barrier learns the job's end at once.
        result = b.outcome.exit_barrier(5)
        assert result.outcome is RoundOutcome.FAILED
        assert "crash loop" in result.reason and "restart budget" not in result.reason
        # b's workers failed too: no restart, and why.
        assert b.outcome.report_failure(5) is False
        assert b.outcome.refusal is not None and "crash loop" in b.outcome.refusal
        with pytest.raises(RendezvousClosedError, match="crash loop"):
            b.next_rendezvous()
        assert a.outcome.restarts_used() == 0  # no restart was taken from the budget
    finally:
        a.leave()
        b.leave()


def test_the_crash_loop_stop_is_on_by_default_and_can_be_turned_off(tmp_path: Path) -> None:
    from elastrun.launch.cli import parse_launch

    (tmp_path / "train.py").write_text("print('hi')\n")
    script = str(tmp_path / "train.py")
    assert parse_launch([script], {}).config.crash_loop_stop is True
    assert parse_launch(["--no-crash-loop-stop", script], {}).config.crash_loop_stop is False
    env = {"PET_NO_CRASH_LOOP_STOP": "1"}
    assert parse_launch([script], env).config.crash_loop_stop is False
