"""One outcome per round on every node, and every phase answers a signal.

Several agents on loopback, one worker each, rendezvousing through c10d (the first
agent serves the store) and, for the races, through a real etcd as well. A failure
anywhere in a round is every node's outcome -- also for a node whose workers already
finished and that waits in the exit barrier: it restarts with the others while the
job-wide budget allows, and exits 1 naming the failure when it does not. A node that
leaves after its exit barrier timed out does not end the run for the nodes still
working.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from _helpers import finish, free_port, start, start_nodes, write_script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "etcd"))
from etcd_cluster import EtcdCluster, find_etcd

pytestmark = pytest.mark.slow

Rdzv = tuple[str, str]  # the backend and its endpoint

BACKENDS = [
    "c10d",
    pytest.param("etcd", marks=pytest.mark.skipif(find_etcd() is None, reason="no etcd binary")),
]

# argv: out_dir, then "RANK:ATTEMPT=ACTION" items; ACTION is "fail" (exit 3) or a sleep.
SCRIPT = """
import os, sys, time
out = sys.argv[1]
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join(out, f"ran_{rank}_{attempt}"), "w").close()
plan = dict(item.split("=") for item in sys.argv[2:])
action = plan.get(f"{rank}:{attempt}", plan.get(f"{rank}:*", "0"))
if action.startswith("fail"):
    time.sleep(float(action[4:] or 0))
    sys.exit(3)
time.sleep(float(action))
"""


@pytest.fixture(params=BACKENDS)
def rdzv(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(backend, endpoint): c10d on a free port, or a one-member etcd of its own."""
    if request.param == "c10d":
        yield "c10d", f"127.0.0.1:{free_port()}"
        return
    binary = find_etcd()
    assert binary is not None
    cluster = EtcdCluster(binary, tmp_path / "etcd", 1).start()
    try:
        yield "etcd", cluster.endpoints[0]
    finally:
        cluster.stop()


def _agents(
    tmp_path: Path,
    plan: list[str],
    *,
    restarts: int,
    nodes: int = 2,
    conf: str = "",
    rdzv: tuple[str, str] | None = None,
) -> list[subprocess.Popen[str]]:
    backend, endpoint = rdzv or ("c10d", f"127.0.0.1:{free_port()}")
    script = write_script(tmp_path / "job.py", SCRIPT)
    args = ["--max-restarts", str(restarts), "--rdzv-conf",
            "join_timeout=60,last_call_timeout=1" + conf, "--no-template",
            str(script), str(tmp_path), *plan]  # fmt: skip
    return start_nodes(nodes, str(nodes), endpoint, "outcome", args, cwd=tmp_path, backend=backend)


def _ran(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("ran_*"))


def test_finish_then_fail_restarts_every_node_once(tmp_path: Path, rdzv: Rdzv) -> None:
    procs = _agents(tmp_path, ["0:0=fail1", "1:0=0"], restarts=1, rdzv=rdzv)
    results = [finish(p, 60) for p in procs]
    for r in results:
        assert r.returncode == 0, r.stderr
    # Both ranks ran twice: the finished one started again with the others.
    assert _ran(tmp_path) == ["ran_0_0", "ran_0_1", "ran_1_0", "ran_1_1"], [
        r.stderr for r in results
    ]
    assert any("the round failed elsewhere" in r.stderr for r in results)


def test_finish_then_fail_without_budget_fails_every_node(
    tmp_path: Path, rdzv: tuple[str, str]
) -> None:
    t0 = time.monotonic()
    procs = _agents(tmp_path, ["0:0=fail1", "1:0=0"], restarts=0, rdzv=rdzv)
    results = [finish(p, 60) for p in procs]
    assert time.monotonic() - t0 < 30
    assert [r.returncode for r in results] == [1, 1], [r.stderr for r in results]
    finished_node = next((r for r in results if "the job failed on another node" in r.stderr), None)
    assert finished_node is not None, [r.stderr for r in results]
    assert "rank 0 (local 0) exited with code 3 on 127.0.0.1" in finished_node.stderr
    assert "Traceback" not in finished_node.stderr, finished_node.stderr
    assert _ran(tmp_path) == ["ran_0_0", "ran_1_0"]


def test_fail_then_finish_restarts_every_node_once(tmp_path: Path, rdzv: Rdzv) -> None:
    procs = _agents(tmp_path, ["0:0=fail0.5", "1:0=3"], restarts=1, rdzv=rdzv)
    results = [finish(p, 60) for p in procs]
    for r in results:
        assert r.returncode == 0, r.stderr
    assert _ran(tmp_path) == ["ran_0_0", "ran_0_1", "ran_1_0", "ran_1_1"], [
        r.stderr for r in results
    ]


def test_both_fail_at_once_costs_one_restart(tmp_path: Path, rdzv: Rdzv) -> None:
    procs = _agents(tmp_path, ["0:0=fail0.5", "1:0=fail0.5"], restarts=1, rdzv=rdzv)
    results = [finish(p, 60) for p in procs]
    for r in results:
        assert r.returncode == 0, r.stderr
    assert _ran(tmp_path) == ["ran_0_0", "ran_0_1", "ran_1_0", "ran_1_1"], [
        r.stderr for r in results
    ]


def test_three_nodes_one_fails_after_two_finished_without_budget(
    tmp_path: Path, rdzv: tuple[str, str]
) -> None:
    procs = _agents(tmp_path, ["0:*=0", "1:*=0", "2:0=fail1"], restarts=0, nodes=3, rdzv=rdzv)
    results = [finish(p, 60) for p in procs]
    assert [r.returncode for r in results] == [1, 1, 1], [r.stderr for r in results]


@pytest.mark.parametrize("fast", [0, 1])
def test_a_node_leaving_after_its_barrier_timed_out_lets_the_others_finish(
    tmp_path: Path, fast: int
) -> None:
    slow = 1 - fast
    procs = _agents(
        tmp_path, [f"{fast}:*=0.2", f"{slow}:*=6"], restarts=0, conf=",exit_barrier_timeout=2"
    )
    results = [finish(p, 60) for p in procs]
    for r in results:
        assert r.returncode == 0, r.stderr
        assert "has ended" not in r.stderr
    assert any("exit barrier timed out" in r.stderr for r in results)
    assert _ran(tmp_path) == ["ran_0_0", "ran_1_0"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_ends_the_wait_for_other_nodes_at_once(
    tmp_path: Path, sig: int, rdzv: Rdzv
) -> None:
    script = write_script(tmp_path / "job.py", SCRIPT)
    proc = start(
        ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", rdzv[0],
         "--rdzv-endpoint", rdzv[1], "--rdzv-id", "alone",
         "--local-addr", "127.0.0.1", "--no-template", str(script), str(tmp_path)],
        cwd=tmp_path,
    )  # fmt: skip
    time.sleep(1.5)  # it waits for the second node (join timeout: 600 s)
    t0 = time.monotonic()
    proc.send_signal(sig)
    res = finish(proc, 10)
    assert time.monotonic() - t0 < 2, res.stderr
    assert res.returncode == 128 + sig, res.stderr
    assert "Traceback" not in res.stderr
    assert not _ran(tmp_path)


def test_a_signal_ends_the_exit_barrier_at_once(tmp_path: Path, rdzv: Rdzv) -> None:
    procs = _agents(tmp_path, ["0:*=0", "1:*=30"], restarts=0, rdzv=rdzv)
    deadline = time.monotonic() + 30
    while len(_ran(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # rank 0's node finished and waits in the exit barrier
    for p in procs:
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        res = finish(p, 40)
        assert time.monotonic() - t0 < 5, res.stderr
        assert res.returncode == 128 + signal.SIGTERM, res.stderr
