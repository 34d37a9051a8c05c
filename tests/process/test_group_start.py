"""Starting a group of workers (the agent's and ``start_processes``' start): all or none."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from _helpers import children
from elastrun.core.errors import ProcessStartError
from elastrun.supervise.api import start_processes
from elastrun.supervise.processes.group import GroupMember, start_group, start_worker
from elastrun.supervise.processes.logs import DefaultLogsSpecs, LogsDest, Std
from elastrun.supervise.processes.procset import ProcessSet
from elastrun.supervise.processes.relay import OutputRelay, WorkerStdio
from elastrun.supervise.processes.spawn import (
    ProcessSpec,
    SubprocessStarter,
    WorkerProcess,
    start_each,
)

SLEEP = (sys.executable, "-c", "import time; time.sleep(60)")


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


@pytest.fixture(autouse=True)
def no_fd_leak() -> Iterator[None]:
    before = _open_fds()
    yield
    assert _open_fds() - before == set()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class FailsAt:
    """Starts real sleepers, and fails the start of local rank ``bad``."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.inner = SubprocessStarter()
        self.started: list[WorkerProcess] = []

    def start(self, spec: ProcessSpec) -> WorkerProcess:
        if spec.local_rank == self.bad:
            raise ProcessStartError(f"local rank {spec.local_rank}: cannot start")
        proc = self.inner.start(spec)
        self.started.append(proc)
        return proc

    def start_many(self, specs: Sequence[ProcessSpec]) -> list[WorkerProcess]:
        return start_each(self.start, specs)


def _sleeper(lr: int) -> GroupMember:
    return GroupMember(
        lr,
        prefix=f"[{lr}]:",
        show_on_console=True,
        make_spec=lambda stdio: ProcessSpec(
            lr, dict(os.environ), argv=SLEEP, stdout_fd=stdio.stdout_fd
        ),
    )


def test_a_start_that_fails_midway_kills_the_workers_already_started(tmp_path: Path) -> None:
    # Rank 0 and 1 get a tee'd stdout (a pipe each); rank 2 fails to start.
    dest = LogsDest(to_console={lr: Std.NONE for lr in range(3)})
    for lr in range(3):
        (tmp_path / str(lr)).mkdir()
        dest.stdouts[lr] = dest.tee_stdouts[lr] = str(tmp_path / str(lr) / "stdout.log")
    relay = OutputRelay()
    starter = FailsAt(bad=2)
    with pytest.raises(ProcessStartError, match="local rank 2"):
        start_group(starter, relay, dest, [_sleeper(lr) for lr in range(3)])
    relay.close()
    assert len(starter.started) == 2
    assert all(_gone(p.pid) for p in starter.started)  # killed and reaped
    assert not {p.pid for p in starter.started} & children()


def test_a_group_that_starts_runs_every_local_rank_in_order(tmp_path: Path) -> None:
    dest = LogsDest(stdouts={0: "", 1: ""}, stderrs={0: "", 1: ""})
    relay = OutputRelay()
    procs = start_group(SubprocessStarter(), relay, dest, [_sleeper(0), _sleeper(1)])
    assert [p.local_rank for p in procs] == [0, 1]
    group = ProcessSet(procs)
    group.stop()
    group.close()
    relay.close()


def test_start_processes_leaves_no_process_when_a_start_fails(tmp_path: Path) -> None:
    # Rank 0 finds the executable on its PATH and starts; rank 1's PATH lacks it.
    found, empty = tmp_path / "bin", tmp_path / "empty"
    found.mkdir()
    empty.mkdir()
    worker = found / "worker"
    worker.write_text("#!/bin/sh\nexec sleep 60\n")
    worker.chmod(0o755)
    before = children()
    with pytest.raises(ProcessStartError, match="local rank 1"):
        start_processes(
            name="trainer",
            entrypoint="worker",
            args={0: (), 1: ()},
            envs={0: {"PATH": str(found)}, 1: {"PATH": str(empty)}},
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
        )
    assert children() == before


def test_start_processes_raises_file_not_found_for_a_missing_executable(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="local rank 0") as info:
        start_processes(
            name="trainer",
            entrypoint=str(tmp_path / "no-such-worker"),
            args={0: ()},
            envs={0: {}},
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
        )
    assert isinstance(info.value, ProcessStartError)
    assert info.value.errno == errno.ENOENT


def test_start_processes_raises_runtime_error_for_args_and_envs_of_different_lengths(
    tmp_path: Path,
) -> None:
    with pytest.raises(RuntimeError, match=r"keys 0\.\.1"):
        start_processes(
            name="trainer",
            entrypoint=sys.executable,
            args={0: (), 1: ()},
            envs={0: {}},
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
        )


def test_the_parents_copies_of_a_workers_descriptors_are_closed_even_when_its_start_fails(
    tmp_path: Path,
) -> None:
    out = str(tmp_path / "stdout.log")
    dest = LogsDest(stdouts={0: out}, stderrs={0: ""}, tee_stdouts={0: out})
    (tmp_path / "stdout.log").touch()
    relay = OutputRelay()
    seen: list[WorkerStdio] = []

    def spec(stdio: WorkerStdio) -> ProcessSpec:
        seen.append(stdio)
        return ProcessSpec(0, {}, argv=SLEEP, stdout_fd=stdio.stdout_fd)

    with pytest.raises(ProcessStartError):
        start_worker(
            FailsAt(bad=0), relay, dest, GroupMember(0, "", show_on_console=True, make_spec=spec)
        )
    assert seen and seen[0].owned_fds == []
    relay.close()
