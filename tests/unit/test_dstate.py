"""The uninterruptible-sleep watchdog, on a fake /proc and a hand-driven clock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastrun.core.errors import ConfigError
from elastrun.supervise.processes.dstate import (
    UninterruptibleWatch,
    read_proc_state,
    timeout_from_env,
)
from elastrun.testing import FakeClock
from elastrun.wire.env import UNINTERRUPTIBLE_STATE_TIMEOUT_ENV


class FakeProc:
    """A directory shaped like /proc: ``<pid>/stat`` files whose state we set."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def set(self, pid: int, state: str, comm: str = "python") -> None:
        (self.root / str(pid)).mkdir(exist_ok=True)
        (self.root / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1\n")

    def remove(self, pid: int) -> None:
        (self.root / str(pid) / "stat").unlink()


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def watch_for(proc: FakeProc, clock: FakeClock, timeout: float = 10.0) -> UninterruptibleWatch:
    return UninterruptibleWatch(timeout, clock, proc_root=str(proc.root))


def test_state_letter_is_read_after_the_last_parenthesis(proc: FakeProc) -> None:
    proc.set(7, "D", comm="evil) R (name")
    assert read_proc_state(7, str(proc.root)) == "D"


def test_state_of_a_missing_process_is_none(proc: FakeProc) -> None:
    assert read_proc_state(12345, str(proc.root)) is None


def test_state_of_this_process_is_running() -> None:
    assert read_proc_state(os.getpid()) == "R"


def test_sleeping_workers_are_never_reported(proc: FakeProc, clock: FakeClock) -> None:
    watch = watch_for(proc, clock)
    proc.set(100, "S")
    proc.set(101, "R")
    for _ in range(5):
        assert watch.check({0: 100, 1: 101}) is None
        clock.advance(60)


def test_worker_in_d_state_is_reported_only_after_the_timeout(
    proc: FakeProc, clock: FakeClock
) -> None:
    watch = watch_for(proc, clock, timeout=10)
    proc.set(100, "S")
    proc.set(200, "D")
    assert watch.check({0: 100, 1: 200}) is None  # first seen in D now
    clock.advance(10)
    assert watch.check({0: 100, 1: 200}) is None  # exactly the timeout: not yet
    clock.advance(0.5)
    assert watch.check({0: 100, 1: 200}) == 1
    assert watch.stuck_for(200) == pytest.approx(10.5)


def test_leaving_d_state_restarts_the_count(proc: FakeProc, clock: FakeClock) -> None:
    watch = watch_for(proc, clock, timeout=10)
    proc.set(200, "D")
    watch.check({0: 200})
    clock.advance(8)
    proc.set(200, "S")
    assert watch.check({0: 200}) is None
    proc.set(200, "D")
    clock.advance(1)
    watch.check({0: 200})
    clock.advance(8)
    assert watch.check({0: 200}) is None  # 8 s continuous, not 17 s in total
    clock.advance(3)
    assert watch.check({0: 200}) == 0


def test_a_pid_that_vanished_is_forgotten(proc: FakeProc, clock: FakeClock) -> None:
    watch = watch_for(proc, clock, timeout=10)
    proc.set(200, "D")
    watch.check({0: 200})
    proc.remove(200)
    clock.advance(20)
    assert watch.check({0: 200}) is None
    assert watch.stuck_for(200) == 0.0


def test_a_restarted_worker_with_a_new_pid_starts_from_zero(
    proc: FakeProc, clock: FakeClock
) -> None:
    watch = watch_for(proc, clock, timeout=10)
    proc.set(200, "D")
    watch.check({0: 200})
    clock.advance(9)
    proc.set(300, "D")
    assert watch.check({0: 300}) is None  # pid 200 is no longer a worker
    clock.advance(9)
    assert watch.check({0: 300}) is None
    assert "200" not in repr(watch)


def test_the_worker_stuck_longest_is_reported(proc: FakeProc, clock: FakeClock) -> None:
    watch = watch_for(proc, clock, timeout=5)
    proc.set(300, "D")
    watch.check({0: 200, 2: 300})
    clock.advance(2)
    proc.set(200, "D")
    watch.check({0: 200, 2: 300})
    clock.advance(10)
    assert watch.check({0: 200, 2: 300}) == 2


def test_reason_names_rank_pid_duration_and_variable(proc: FakeProc, clock: FakeClock) -> None:
    watch = watch_for(proc, clock, timeout=5)
    proc.set(200, "D")
    watch.check({3: 200})
    clock.advance(6)
    assert watch.check({3: 200}) == 3
    reason = watch.reason(3, 200)
    assert "local rank 3 (pid 200)" in reason
    assert "6.0s" in reason
    assert UNINTERRUPTIBLE_STATE_TIMEOUT_ENV in reason


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_watch_requires_a_positive_timeout(bad: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        UninterruptibleWatch(bad)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, None), ("", None), ("  ", None), ("0", None), ("-3", None), ("30", 30.0), ("2.5", 2.5)],
)
def test_timeout_from_env_parses_positive_seconds_and_treats_the_rest_as_off(
    raw: str | None, expected: float | None
) -> None:
    environ = {} if raw is None else {UNINTERRUPTIBLE_STATE_TIMEOUT_ENV: raw}
    assert timeout_from_env(environ) == expected


@pytest.mark.parametrize("raw", ["soon", "nan", "1e", "inf", "-inf", "1e12"])
def test_timeout_from_env_refuses_values_that_are_not_finite_seconds(raw: str) -> None:
    with pytest.raises(ConfigError, match=UNINTERRUPTIBLE_STATE_TIMEOUT_ENV) as info:
        timeout_from_env({UNINTERRUPTIBLE_STATE_TIMEOUT_ENV: raw})
    assert info.value.value == raw
