"""The Python API: elastic_launch and LocalElasticAgent with function workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import elastrun
from _helpers import wait_for
from elastrun import (
    ChildFailedError,
    LaunchConfig,
    LocalElasticAgent,
    WorkerSpec,
    WorkerState,
    elastic_launch,
)


def square_rank(offset: int) -> int:
    return int(os.environ["RANK"]) ** 2 + offset


def fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses")


def return_while_a_thread_is_inside_torch() -> str:
    """Returns while a daemon thread runs torch ops with the GIL released: the thread
    takes the GIL back from a C++ destructor, which aborts the process if the
    interpreter is finalizing by then (the race behind gloo's abort at exit)."""
    import threading

    import torch

    a = torch.rand(256, 256)
    started = threading.Event()

    def spin() -> None:
        started.set()
        while True:
            torch.mm(a, a)

    threading.Thread(target=spin, daemon=True).start()
    started.wait()
    return "done"


def leave_an_atexit_handler_and_a_thread(out_dir: str) -> str:
    import atexit
    import threading

    rank = os.environ["RANK"]

    def write(name: str) -> None:
        with open(os.path.join(out_dir, f"{name}{rank}"), "w") as fh:
            fh.write(name)

    atexit.register(write, "atexit")
    threading.Thread(target=write, args=("thread",)).start()
    return rank


def test_public_api_is_pinned() -> None:
    assert elastrun.__all__ == [
        "ChildFailedError",
        "ConfigError",
        "DefaultLogsSpecs",
        "ElastrunError",
        "LaunchConfig",
        "LocalElasticAgent",
        "LogsSpecs",
        "ProcessFailure",
        "RendezvousHandler",
        "RendezvousInfo",
        "RendezvousParameters",
        "RendezvousStoreInfo",
        "RunResult",
        "Std",
        "Worker",
        "WorkerGroup",
        "WorkerSpec",
        "WorkerState",
        "elastic_launch",
        "init_process_group",
        "launch_agent",
        "progress",
        "record",
        "rendezvous_handler_registry",
        "start_processes",
    ]
    for name in elastrun.__all__:
        assert getattr(elastrun, name) is not None


def test_elastic_launch_returns_values_by_global_rank() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=3, max_restarts=0)
    assert elastic_launch(config, square_rank)(10) == {0: 10, 1: 11, 2: 14}


def test_elastic_launch_with_fork_start_method() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, start_method="fork")
    assert elastic_launch(config, square_rank)(1) == {0: 1, 1: 2}


def test_elastic_launch_raises_child_failed_error_naming_the_rank() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=1)
    with pytest.raises(ChildFailedError) as info:
        elastic_launch(config, fail_on_rank_one)()
    rank, failure = info.value.get_first_failure()
    assert rank == 1
    assert "ValueError: rank one refuses" in failure.message
    assert "restart budget exhausted: 1 of 1" in str(info.value)


def test_function_workers_exit_cleanly_while_a_thread_is_inside_torch() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0)
    result = elastic_launch(config, return_while_a_thread_is_inside_torch)()
    assert result == {0: "done", 1: "done"}


def test_function_workers_run_atexit_handlers_and_join_threads(tmp_path: Path) -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0)
    assert elastic_launch(config, leave_an_atexit_handler_and_a_thread)(str(tmp_path)) == {
        0: "0",
        1: "1",
    }
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["atexit0", "atexit1", "thread0", "thread1"]


def test_local_agent_runs_a_function_without_rendezvous_setup() -> None:
    agent = LocalElasticAgent(
        WorkerSpec(role="trainer", local_world_size=4, entrypoint=square_rank, args=(5,))
    )
    result = agent.run()
    assert result.state is WorkerState.SUCCEEDED
    assert result.return_values == {0: 5, 1: 6, 2: 9, 3: 14}


def test_local_agent_runs_an_executable(tmp_path: Path) -> None:
    import sys

    out = tmp_path / "out"
    agent = LocalElasticAgent(
        WorkerSpec(
            local_world_size=2,
            entrypoint=sys.executable,
            args=("-c", f"import os; open(r'{out}' + os.environ['RANK'], 'w').close()"),
        )
    )
    result = agent.run()
    assert result.state is WorkerState.SUCCEEDED
    assert result.return_values == {0: None, 1: None}
    assert (tmp_path / "out0").exists() and (tmp_path / "out1").exists()


def test_worker_side_init_process_group_explains_a_missing_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(elastrun.ConfigError, match="not started by elastrun"):
        elastrun.init_process_group(backend="gloo")


_OVERLAP_WORK = """
import os
import time
from pathlib import Path


def work(ready: str, go: str) -> int:
    Path(ready + os.environ["RANK"]).touch()
    while not Path(go).exists():
        time.sleep(0.05)
    return int(os.environ["RANK"])
"""

_OVERLAP_JOB = """
import sys

from elastrun import LaunchConfig, elastic_launch
from overlap_work import work

config = LaunchConfig(
    min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0,
    rdzv_configs={"read_timeout": "5"},
)
print(elastic_launch(config, work)(sys.argv[1], sys.argv[2]))
"""


def test_two_one_node_jobs_with_the_default_endpoint_do_not_share_a_store(
    tmp_path: Path,
) -> None:
    """With no endpoint, a one-node job serves no store: a second such job on the machine
    must not become a client of the first's store, and fail once the first ends."""
    (tmp_path / "overlap_work.py").write_text(_OVERLAP_WORK)
    (tmp_path / "overlap_job.py").write_text(_OVERLAP_JOB)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    jobs: list[subprocess.Popen[str]] = []
    try:
        for name in ("first", "second"):
            ready, go = tmp_path / f"{name}-ready", tmp_path / f"{name}-go"
            jobs.append(
                subprocess.Popen(
                    [sys.executable, "overlap_job.py", str(ready), str(go)],
                    cwd=tmp_path,
                    env={**os.environ, "PYTHONPATH": path},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            wait_for(lambda r=ready: Path(f"{r}1").exists(), 60, f"the {name} job's workers")
        for job, name in zip(jobs, ("first", "second"), strict=True):
            (tmp_path / f"{name}-go").touch()
            out, err = job.communicate(timeout=60)
            assert job.returncode == 0, err
            assert out.strip().splitlines()[-1] == "{0: 0, 1: 1}", out
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.communicate()
