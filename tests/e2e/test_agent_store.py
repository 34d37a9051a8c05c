"""The workers' store lives in the agent: ranks may leave in any order.

An ordinary gloo script whose rank 0 tears down and exits at once while the other ranks
still use the default store (a late set/get, a checkpoint library finishing its
coordination) must pass every time, as under torchrun's agent-hosted store. And a rank
that stays alive after every peer exited successfully is named, with its stacks.

Strangers cannot take the agent's descriptors through the workers' store: two thousand
idle connections against an agent limited to 1,024 descriptors, then a worker fails --
the agent reports it and restarts, as without the flood.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from _helpers import ELASTRUN, finish, free_port, run, start, wait_for, write_script
from elastrun.store.tcp.limits import fd_reserve
from elastrun.store.torchwire.engine import compiled_engine_available

pytestmark = pytest.mark.slow

EARLY_EXIT = """
import os, sys, time
import torch, torch.distributed as dist

crash_rank = int(sys.argv[1]) if len(sys.argv) > 1 else -1
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(3) * rank
for _ in range(3):
    dist.all_reduce(t)
if rank == crash_rank and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os.kill(os.getpid(), 9)
store = dist.distributed_c10d._get_default_store()
if rank == 0:
    dist.destroy_process_group()
    sys.exit(0)
time.sleep(0.3)  # rank 0 is gone by now
store.set(f"late/{rank}", "x")
assert store.get(f"late/{rank}") == b"x"
assert store.add("late/count", 1) >= 1
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
# With a second argument N, attempts before N end in a failure of ranks 1 and 2 once both
# are done, so that one launch repeats the whole exchange in N + 1 fresh groups.
again = len(sys.argv) > 2 and restart < int(sys.argv[2])
if again:
    store.add(f"late/again/{restart}", 1)
    while store.add(f"late/again/{restart}", 0) < 2:
        time.sleep(0.01)
dist.destroy_process_group()
print(f"late store operations ok {restart}", flush=True)
open(f"ok_{rank}_{restart}", "w").close()
sys.exit(1 if again else 0)
"""


@pytest.mark.torch
@pytest.mark.parametrize(
    "engine",
    [
        "python",
        pytest.param(
            "compiled",
            marks=pytest.mark.skipif(
                not compiled_engine_available(), reason="the compiled engine was not built"
            ),
        ),
    ],
)
def test_the_workers_store_serves_gloo_groups_on_either_engine(tmp_path: Path, engine: str) -> None:
    # Two groups (a failure of ranks 1 and 2 ends the first), each with rank 0 leaving
    # first, on the engine ELASTRUN_STORE_ENGINE names.
    script = write_script(tmp_path / "early.py", EARLY_EXIT)
    res = run(
        ["--nproc-per-node", "3", "--max-restarts", "1", str(script), "-1", "1"],
        cwd=tmp_path,
        env={"ELASTRUN_STORE_ENGINE": engine},
        timeout=90,
    )
    assert res.returncode == 0, res.stderr
    for attempt in range(2):
        assert res.stdout.count(f"late store operations ok {attempt}") == 2, res.stdout


@pytest.mark.torch
@pytest.mark.timeout(300)  # two launches in a row: the suite's 120 s guard is sized for one
def test_rank_0_leaving_first_does_not_break_the_others_ten_runs_in_a_row(
    tmp_path: Path,
) -> None:
    # Ten groups in all: two launches of five attempts each (the first four attempts of
    # a launch end in a restart), so that the exit of a whole launch is repeated too.
    # The module's other tests add six groups (both engines, after a SIGKILL, two
    # nodes): 16 in all. Twenty here took 40 s of the suite; each is the same exchange.
    script = write_script(tmp_path / "early.py", EARLY_EXIT)
    for i in range(2):
        res = run(
            ["--nproc-per-node", "3", "--max-restarts", "4", str(script), "-1", "4"],
            cwd=tmp_path,
            timeout=120,
        )
        assert res.returncode == 0, f"launch {i}:\n{res.stderr}"
        for attempt in range(5):
            assert res.stdout.count(f"late store operations ok {attempt}") == 2, res.stdout
        assert "Broken pipe" not in res.stderr


@pytest.mark.torch
def test_rank_0_leaving_first_after_a_sigkilled_rank_and_a_restart(tmp_path: Path) -> None:
    script = write_script(tmp_path / "early.py", EARLY_EXIT)
    res = run(
        ["--nproc-per-node", "3", "--max-restarts", "1", str(script), "1"],
        cwd=tmp_path,
        timeout=90,
    )
    assert res.returncode == 0, res.stderr
    assert "restarting all workers" in res.stderr
    # Only the second attempt gets there: the first lost rank 1 to SIGKILL.
    assert sorted(p.name for p in tmp_path.glob("ok_*")) == ["ok_1_1", "ok_2_1"]


@pytest.mark.torch
def test_rank_0_leaving_first_on_two_nodes(tmp_path: Path) -> None:
    script = write_script(tmp_path / "early.py", EARLY_EXIT)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [
        start(
            [
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "early",
                "--local-addr",
                "127.0.0.1",
                "--rdzv-conf",
                "join_timeout=60",
                str(script),
            ],
            cwd=tmp_path,
        )
        for _ in range(2)
    ]
    results = [finish(p, 90) for p in procs]
    for r in results:
        assert r.returncode == 0, r.stderr
    assert sum(r.stdout.count("late store operations ok") for r in results) == 3


STUCK_AT_EXIT = """
import os, sys, time
open(os.path.join(sys.argv[1], "started_" + os.environ["RANK"]), "w").close()
if os.environ["RANK"] == "1":
    def wait_for_a_thread_that_never_ends():
        while True:
            time.sleep(0.05)
    wait_for_a_thread_that_never_ends()
"""


def test_a_rank_stuck_after_its_peers_exited_is_named_with_its_stacks(tmp_path: Path) -> None:
    script = write_script(tmp_path / "stuck.py", STUCK_AT_EXIT)
    logs = tmp_path / "logs"
    proc = start(
        ["--nproc-per-node", "3", "--stuck-exit-timeout", "1", "--log-dir", str(logs),
         "--no-template", str(script), str(tmp_path)],
        cwd=tmp_path,
    )  # fmt: skip
    try:
        wait_for(lambda: list(logs.glob("*/attempt_0/1/stacks.txt")), 20, "a stack dump")
        stacks = next(logs.glob("*/attempt_0/1/stacks.txt"))
        wait_for(lambda: "wait_for_a_thread_that_never_ends" in stacks.read_text(), 5, "stacks")
        time.sleep(0.5)
        assert proc.poll() is None  # reported, not stopped
    finally:
        proc.send_signal(signal.SIGTERM)
    res = finish(proc, 30)
    assert res.returncode == 128 + signal.SIGTERM
    warnings = [line for line in res.stderr.splitlines() if "still running" in line]
    assert len(warnings) == 1, res.stderr
    assert "rank 1 (local rank 1" in warnings[0] and str(stacks) in warnings[0]
    assert "it is not stopped" in warnings[0]


def test_no_stuck_at_exit_report_while_peers_still_run_or_when_turned_off(
    tmp_path: Path,
) -> None:
    script = write_script(
        tmp_path / "slow.py",
        """
        import os, time
        time.sleep(2.5 if os.environ["RANK"] == "0" else 0.2)
        """,
    )
    res = run(["--nproc-per-node", "2", "--stuck-exit-timeout", "0", str(script)], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "still running" not in res.stderr
    failing = write_script(
        tmp_path / "failing.py",
        """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(2.5)
        """,
    )
    res = run(
        ["--nproc-per-node", "2", "--stuck-exit-timeout", "1", "--max-restarts", "0",
         str(failing)],
        cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 1
    assert "still running" not in res.stderr


# -- a flood of idle connections to the workers' store ---------------------------------

#: Local rank 0 of the first attempt writes where the workers' store is, and fails when
#: told to; every worker of the restart writes ``restarted_<rank>`` and exits 0.
FLAKY = """
import os, sys, time
here = sys.argv[1]
rank = os.environ["LOCAL_RANK"]
if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    open(os.path.join(here, f"restarted_{rank}"), "w").close()
    sys.exit(0)
if rank == "0":
    with open(os.path.join(here, "store.tmp"), "w") as f:
        f.write(f"{os.environ['MASTER_ADDR']} {os.environ['MASTER_PORT']}")
    os.rename(os.path.join(here, "store.tmp"), os.path.join(here, "store"))
while not os.path.exists(os.path.join(here, "fail_now")):
    time.sleep(0.05)
sys.exit(3 if rank == "0" else 0)
"""

FD_LIMIT = 1024
FLOOD = 2000


def _low_fd_limit() -> None:
    # Soft AND hard: raising the soft limit to the hard one must not hide the problem.
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _room_for_the_flood() -> None:
    """This test process holds the flood's sockets: raise its own soft limit if needed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"this test needs {need} descriptors (hard limit {hard})")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


@pytest.mark.parametrize(
    "engine",
    [
        "python",
        pytest.param(
            "compiled",
            marks=pytest.mark.skipif(
                not compiled_engine_available(), reason="the compiled engine was not built"
            ),
        ),
    ],
)
def test_a_flood_of_idle_connections_to_the_workers_store_leaves_the_agent_its_restart(
    tmp_path: Path, engine: str
) -> None:
    _room_for_the_flood()
    script = write_script(tmp_path / "flaky.py", FLAKY)
    stderr_path = tmp_path / "agent.err"
    with stderr_path.open("w") as err:
        proc = subprocess.Popen(
            [*ELASTRUN, "--nproc-per-node", "2", "--max-restarts", "1", str(script),
             str(tmp_path)],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, text=True,
            env={**os.environ, "ELASTRUN_STORE_ENGINE": engine},
            # Only setrlimit runs between fork and exec: safe with this test's threads.
            start_new_session=True, preexec_fn=_low_fd_limit,  # noqa: PLW1509
        )  # fmt: skip
    flood: list[socket.socket] = []
    try:
        wait_for((tmp_path / "store").exists, 30, "the worker to say where the store is")
        host, port = (tmp_path / "store").read_text().split()
        for _ in range(FLOOD):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.setblocking(False)
            try:
                s.connect((host, int(port)))
            except BlockingIOError:
                pass
            flood.append(s)
        time.sleep(1.0)  # the agent takes in what it will
        agent_fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        (tmp_path / "fail_now").touch()  # a worker fails: the restart needs descriptors
        try:
            code = proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    finally:
        for s in flood:
            s.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err_text = stderr_path.read_text(errors="replace")
    assert code == 0, err_text[-5000:]
    assert "exited with code 3; restarting all workers" in err_text, err_text[-5000:]
    assert sorted(p.name for p in tmp_path.glob("restarted_*")) == ["restarted_0", "restarted_1"]
    assert "Traceback" not in err_text, err_text[:5000]
    assert stderr_path.stat().st_size < 100_000, err_text[:3000]
    # The store stopped taking connections with a reserve left (less what a count's
    # granularity lets through, and what the agent opened meanwhile).
    assert agent_fds <= FD_LIMIT - fd_reserve(FD_LIMIT) + 32, agent_fds
    print(f"{engine}: flood of {FLOOD} under an fd limit of {FD_LIMIT}: agent at {agent_fds} fds")
