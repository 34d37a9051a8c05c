"""Agents on loopback rendezvousing through a real etcd (``--rdzv-backend etcd``).

Training through etcd, a 3-member etcd losing its leader mid-training, agents losing
the member they talk to, a SIGKILLed node dropped by lease expiry, and an etcd that
cannot be reached or refuses the agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from _helpers import REPO, finish, start, wait_for, write_script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "etcd"))
from etcd_cluster import EtcdCluster, closed_port, find_etcd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_etcd() is None, reason="no etcd binary: run scripts/install-etcd.sh"),
]

DEMO = REPO / "examples" / "ddp_demo.py"

# Each worker records its view of the job, once per attempt, then sleeps argv[2] seconds
# (only in a world of argv[3] workers, when given).
RECORD = """
import json, os, sys, time
keys = ["RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"]
name = "w_{}_{}_{}.json".format(
    os.environ["WORLD_SIZE"], os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"])
with open(os.path.join(sys.argv[1], name), "w") as fh:
    json.dump({k: os.environ[k] for k in keys}, fh)
if len(sys.argv) < 4 or os.environ["WORLD_SIZE"] == sys.argv[3]:
    time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[[int], EtcdCluster]]:
    clusters: list[EtcdCluster] = []

    def make(size: int) -> EtcdCluster:
        binary = find_etcd()
        assert binary is not None
        clusters.append(EtcdCluster(binary, tmp_path / f"etcd{len(clusters)}", size))
        return clusters[-1].start()

    yield make
    for cluster in clusters:
        cluster.stop()


def agent(
    cwd: Path, nnodes: str, endpoints: list[str], args: list[str], *, conf: str = "",
    max_restarts: int = 0,
) -> subprocess.Popen[str]:  # fmt: skip
    rdzv_conf = "last_call_timeout=1,join_timeout=60" + (f",{conf}" if conf else "")
    return start(
        ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "etcd",
         "--rdzv-endpoint", ",".join(endpoints), "--rdzv-id", "job1",
         "--local-addr", "127.0.0.1", "--max-restarts", str(max_restarts),
         "--rdzv-conf", rdzv_conf, *args],
        cwd=cwd,
    )  # fmt: skip


def records(where: Path) -> list[dict[str, str]]:
    """The workers' records written so far (a file a worker is still writing is skipped:
    the callers poll)."""
    found = []
    for p in sorted(where.glob("w_*.json")):
        try:
            found.append(json.loads(p.read_text()))
        except json.JSONDecodeError:
            continue
    return found


def demo(tmp_path: Path, steps: int) -> list[str]:
    return [str(DEMO), "--steps", str(steps), "--checkpoint-every", "5", "--step-time", "0.1",
            "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--result-file", str(tmp_path / "result.json")]  # fmt: skip


def etcd_keys(endpoint: str, prefix: str) -> dict[str, str]:
    import base64

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    request = urllib.request.Request(
        f"http://{endpoint}/v3/kv/range",
        data=json.dumps({"key": b64(prefix), "range_end": b64(end)}).encode(),
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        kvs = json.loads(reply.read()).get("kvs", [])
    return {
        base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
        for kv in kvs
    }


# -- training ----------------------------------------------------------------------------


@pytest.mark.torch
def test_two_agents_train_through_etcd_under_their_prefix(
    tmp_path: Path, make_cluster: Callable[[int], EtcdCluster]
) -> None:
    cluster = make_cluster(1)
    procs = [
        agent(tmp_path, "2", cluster.endpoints, demo(tmp_path, 20), conf="prefix=/team-a")
        for _ in range(2)
    ]
    for r in [finish(p, 120) for p in procs]:
        assert r.returncode == 0, r.stderr[-3000:]
    outcome = json.loads((tmp_path / "result.json").read_text())
    assert outcome["identical"] is True and outcome["world_size"] == 2
    keys = etcd_keys(cluster.endpoints[0], "/")
    assert keys["/team-a/elastrun/job1/ctl/closed"] == "finished"
    assert all(k.startswith("/team-a/elastrun/job1/") for k in keys)


@pytest.mark.torch
def test_a_three_member_etcd_losing_its_leader_mid_training_restarts_no_worker(
    tmp_path: Path, make_cluster: Callable[[int], EtcdCluster]
) -> None:
    cluster = make_cluster(3)
    leader = cluster.leader()
    # Leader first: both agents talk to the member that dies.
    endpoints = [leader.endpoint, *(m.endpoint for m in cluster.members if m is not leader)]
    # A short lease: the agents' keep-alives must reach the new leader in time.
    procs = [agent(tmp_path, "2", endpoints, demo(tmp_path, 40), conf="ttl=5") for _ in range(2)]
    ckpt = tmp_path / "ckpt"
    wait_for(lambda: ckpt.exists() and any(ckpt.iterdir()), 120, "a first checkpoint")
    cluster.kill(leader)
    results = [finish(p, 180) for p in procs]
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "restarting" not in r.stderr and "re-forming" not in r.stderr, r.stderr[-3000:]
    outcome = json.loads((tmp_path / "result.json").read_text())
    assert outcome["identical"] is True and outcome["world_size"] == 2
    assert outcome["restart_count"] == 0
    assert cluster.leader() is not leader


# -- membership and failover, with light workers -----------------------------------------


def test_agents_carry_on_when_the_etcd_member_they_use_dies(
    tmp_path: Path, make_cluster: Callable[[int], EtcdCluster]
) -> None:
    cluster = make_cluster(3)
    leader = cluster.leader()
    used = next(m for m in cluster.members if m is not leader)
    endpoints = [used.endpoint, *(m.endpoint for m in cluster.members if m is not used)]
    script = write_script(tmp_path / "record.py", RECORD)
    procs = [agent(tmp_path, "2", endpoints, [str(script), str(tmp_path), "5"], conf="ttl=3")
             for _ in range(2)]  # fmt: skip
    wait_for(lambda: len(records(tmp_path)) == 2, 60, "both workers")
    cluster.kill(used)
    for r in [finish(p, 60) for p in procs]:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "restarting" not in r.stderr and "re-forming" not in r.stderr, r.stderr[-3000:]
    assert [r["TORCHELASTIC_RESTART_COUNT"] for r in records(tmp_path)] == ["0", "0"]


def test_a_sigkilled_node_is_dropped_by_lease_expiry_and_the_survivors_reform(
    tmp_path: Path, make_cluster: Callable[[int], EtcdCluster]
) -> None:
    cluster = make_cluster(1)
    script = write_script(tmp_path / "record.py", RECORD)
    ttl = 2
    # Workers of the full world sleep; those of a smaller one finish at once.
    procs = [agent(tmp_path, "2:3", cluster.endpoints, [str(script), str(tmp_path), "60", "3"],
                   conf=f"ttl={ttl}") for _ in range(3)]  # fmt: skip

    def world_of(size: int) -> int:
        return sum(r["WORLD_SIZE"] == str(size) for r in records(tmp_path))

    wait_for(lambda: world_of(3) == 3, 60, "a round of three nodes")
    # SIGKILL takes the agent and its workers with no goodbye: only the end of its
    # lease tells the others that it is gone.
    victim = procs[2]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=10)
    killed_at = time.monotonic()
    wait_for(lambda: world_of(2) == 2, 30, "the survivors' round of two")
    assert time.monotonic() - killed_at < ttl + 8
    for r in [finish(p, 60) for p in procs[:2]]:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "lost 1 node(s)" in r.stderr, r.stderr[-3000:]


def test_a_rank_hung_on_one_of_two_nodes_is_found_and_the_job_restarts_once(
    tmp_path: Path, make_cluster: Callable[[int], EtcdCluster]
) -> None:
    cluster = make_cluster(1)
    script = write_script(
        tmp_path / "loop.py",
        """
        import os, time
        import elastrun
        rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
        open(f"ran_{rank}_{attempt}", "w").close()
        for step in range(40):
            if step == 5 and attempt == "0" and rank == "1":
                while True:
                    time.sleep(1)  # a collective that never returns
            elastrun.progress(step)
            time.sleep(0.05)
        """,
    )
    args = ["--hang-timeout", "2", "--no-template", str(script)]
    procs = [agent(tmp_path, "2", cluster.endpoints, args, max_restarts=1) for _ in range(2)]
    results = [finish(p, 90) for p in procs]
    for r in results:
        assert r.returncode == 0, "\n=====\n".join(x.stderr[-3000:] for x in results)
    # Found on the hung rank's node; one restart for the job, every rank ran twice.
    assert sum("rank 1 (local rank 0" in r.stderr and "is hung" in r.stderr for r in results) == 1
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == [
        "ran_0_0", "ran_0_1", "ran_1_0", "ran_1_1",
    ]  # fmt: skip


# -- an etcd that cannot be used ---------------------------------------------------------


def test_an_unreachable_etcd_is_one_line_and_a_nonzero_exit_with_no_worker(
    tmp_path: Path,
) -> None:
    script = write_script(tmp_path / "record.py", RECORD)
    endpoints = [f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"]
    started = time.monotonic()
    r = finish(agent(tmp_path, "2", endpoints, [str(script), str(tmp_path), "0"],
                     conf="read_timeout=2"), 60)  # fmt: skip
    assert time.monotonic() - started < 15
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("elastrun: error:")]
    assert len(errors) == 1 and "cannot reach etcd" in errors[0], r.stderr
    assert all(e.split(":")[-1] in errors[0] for e in endpoints)
    assert "Traceback" not in r.stderr
    assert not records(tmp_path)


def test_an_etcd_refusing_the_credentials_is_one_line_and_no_worker(
    tmp_path: Path, make_cluster: Callable[[int], EtcdCluster]
) -> None:
    cluster = make_cluster(1)
    cluster.enable_auth("s3cret")
    wrong = tmp_path / "password"
    wrong.write_text("wrong\n")
    script = write_script(tmp_path / "record.py", RECORD)
    r = finish(agent(tmp_path, "2", cluster.endpoints, [str(script), str(tmp_path), "0"],
                     conf=f"username=root,password_file={wrong}"), 60)  # fmt: skip
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("elastrun: error:")]
    assert len(errors) == 1 and "refused" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not records(tmp_path)


def test_etcd_v2_is_refused_with_a_pointer_to_etcd(tmp_path: Path) -> None:
    script = write_script(tmp_path / "record.py", RECORD)
    r = finish(start(["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:2379", str(script)],
                     cwd=tmp_path), 30)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "elastrun: error: --rdzv-backend: speaks etcd's v2 API, which etcd 3.6 removed; "
        "use --rdzv-backend etcd (got 'etcd-v2')"
    ]
