"""The agent's loop with scripted fake processes: restarts, budget, results, states."""

from __future__ import annotations

import dataclasses
import errno
import signal
from pathlib import Path

import pytest

from elastrun.agent.options import AgentOptions
from elastrun.agent.parts import World
from elastrun.agent.spec import WorkerSpec, WorkerState
from elastrun.core.errors import ProcessStartError, ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest
from elastrun.launch.local_agent import LocalElasticAgent
from elastrun.observe.sinks import MemoryEventSink
from elastrun.supervise.processes.logs import DefaultLogsSpecs
from elastrun.testing import FakeClock, FakeStarter, NullGuard


def _agent(
    tmp_path: Path,
    starter: FakeStarter,
    max_restarts: int,
    world: World | None = None,
    *,
    shutdown_timeout: float = 30.0,
) -> LocalElasticAgent:
    spec = WorkerSpec(local_world_size=3, entrypoint="/bin/prog", max_restarts=max_restarts)
    return LocalElasticAgent(
        spec,
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
        options=AgentOptions(environ={}, run_id="unit", shutdown_timeout=shutdown_timeout),
        world=dataclasses.replace(
            world or World(), starter=starter, guard=NullGuard(), clock=FakeClock()
        ),
    )


def test_success_returns_one_value_per_rank(tmp_path: Path) -> None:
    starter = FakeStarter()
    result = _agent(tmp_path, starter, 0).run()
    assert result.state is WorkerState.SUCCEEDED
    assert result.return_values == {0: None, 1: None, 2: None}


def test_failure_restarts_every_worker_and_counts_restarts(tmp_path: Path) -> None:
    # Rank 2 fails in attempts 0 and 1; the others keep running until stopped.
    starter = FakeStarter(script=lambda a, r: (1 if r == 2 else None) if a < 2 else 0)
    events = MemoryEventSink()
    agent = _agent(tmp_path, starter, 3, World(events=events))
    result = agent.run()
    assert result.state is WorkerState.SUCCEEDED
    assert starter.attempt == 2
    assert [e["TORCHELASTIC_RESTART_COUNT"] for e in starter.envs(2)] == ["2"] * 3
    # Survivors of a failed attempt were stopped with SIGTERM through their groups.
    survivors = [p for p in starter.started if p.attempt == 0 and p.local_rank != 2]
    assert all(p.signals[:1] == [signal.SIGTERM] for p in survivors)
    assert events.names().count("agent.restart") == 2
    assert len(agent.history) == 2 and "rank 2" in agent.history[0]


def test_exhausted_budget_fails_with_the_root_cause_and_terminated_siblings(tmp_path: Path) -> None:
    starter = FakeStarter(script=lambda a, r: 7 if r == 1 else None)
    agent = _agent(tmp_path, starter, 1)
    result = agent.run()
    assert result.state is WorkerState.FAILED
    assert result.failures[1].exitcode == 7 and not result.failures[1].terminated_by_agent
    assert result.failures[0].terminated_by_agent and result.failures[0].exitcode == -signal.SIGTERM
    assert agent.budget_note is not None and "1 of 1" in agent.budget_note
    assert agent.get_worker_group().state is WorkerState.FAILED


def test_a_worker_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    starter = FakeStarter(script=lambda a, r: 1 if r == 0 else None)
    original = starter.start

    def stubborn(spec):  # type: ignore[no-untyped-def]  # wraps the fake's start
        proc = original(spec)
        proc.ignore_signals = True
        return proc

    starter.start = stubborn  # type: ignore[method-assign]  # a fake's method, wrapped
    result = _agent(tmp_path, starter, 0, shutdown_timeout=0).run()
    assert result.failures[1].exitcode == -signal.SIGKILL


def test_a_shutdown_request_stops_workers_with_that_signal(tmp_path: Path) -> None:
    request = ShutdownRequest()
    starter = FakeStarter(script=lambda a, r: None)
    original = starter.start

    def start_then_signal(spec):  # type: ignore[no-untyped-def]  # wraps the fake's start
        proc = original(spec)
        if spec.local_rank == 2:
            request.request(signal.SIGINT)
        return proc

    starter.start = start_then_signal  # type: ignore[method-assign]  # a fake's method, wrapped
    with pytest.raises(ShutdownRequested) as info:
        _agent(tmp_path, starter, 3, World(shutdown=request)).run()
    assert info.value.signum == signal.SIGINT
    assert all(p.signals[0] == signal.SIGINT for p in starter.started)
    request.close()


def test_each_attempt_gets_a_new_log_directory(tmp_path: Path) -> None:
    starter = FakeStarter(script=lambda a, r: 1 if (a == 0 and r == 0) else 0)
    _agent(tmp_path, starter, 1).run()
    (run_dir,) = list(tmp_path.iterdir())
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt_0", "attempt_1"]


class _StuckAfterStart:
    """A fake D-state watch: reports local rank 1 as stuck on the first check."""

    def check(self, pids: dict[int, int]) -> int | None:
        return 1 if 1 in pids else None

    def reason(self, lr: int, pid: int) -> str:
        return f"local rank {lr} (pid {pid}) stuck in uninterruptible sleep for 61s"


def test_a_worker_stuck_in_d_state_fails_the_run_without_restart(tmp_path: Path) -> None:
    starter = FakeStarter(script=lambda a, r: None)
    # arg-type: a fake of the watch's two methods
    agent = _agent(tmp_path, starter, 3, World(stuck_watch=_StuckAfterStart()))  # type: ignore[arg-type]
    result = agent.run()
    assert result.state is WorkerState.FAILED
    assert starter.attempt == 0  # not restarted: restarting cannot free it
    assert "stuck in uninterruptible sleep" in result.failures[1].explanation
    assert not result.failures[1].terminated_by_agent
    assert agent.budget_note is not None and agent.budget_note.startswith("not restarted")


@pytest.mark.parametrize("raw", [True, False], ids=["raw-oserror", "start-error"])
def test_a_restart_out_of_descriptors_ends_with_the_failure_report(
    tmp_path: Path, raw: bool
) -> None:
    # Rank 1 fails; the restart's start finds no descriptor left (a pidfd or a relay
    # pipe: the OSError itself; the process's own pipes: the starter's error). The run
    # ends with the first failure as its root cause and says why it did not restart.
    starter = FakeStarter(script=lambda a, r: 7 if r == 1 else None)
    original = starter.start

    def start(spec):  # type: ignore[no-untyped-def]  # wraps the fake's start
        if starter.attempt == 0 and spec.local_rank == 0:
            emfile = OSError(errno.EMFILE, "Too many open files")
            if raw:
                raise emfile
            raise ProcessStartError("local rank 0: cannot start '/bin/prog'") from emfile
        return original(spec)

    starter.start = start  # type: ignore[method-assign]  # a fake's method, wrapped
    events = MemoryEventSink()
    agent = _agent(tmp_path, starter, 3, World(events=events))
    result = agent.run()
    assert result.state is WorkerState.FAILED
    assert result.failures[1].exitcode == 7 and not result.failures[1].terminated_by_agent
    assert agent.budget_note is not None
    assert "ran out of file descriptors restarting the workers" in agent.budget_note
    assert ("Too many open files" if raw else "cannot start") in agent.budget_note
    assert "agent.failed" in events.names()
    assert all(p.exited() for p in starter.started)  # nothing left running
