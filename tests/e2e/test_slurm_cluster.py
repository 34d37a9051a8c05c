"""`srun elastrun --slurm`: a real Slurm (slurmctld + two emulated slurmd) on this machine.

The cluster is Debian's slurm-wlm (``scripts/install-slurm.sh``) with a throw-away
configuration: ``auth/none``, the daemons run as root in the foreground, two nodes
``node1`` and ``node2`` that are both this machine (127.0.0.1, one slurmd each on its own
port). The node names must resolve, since ``--slurm`` uses the first node's name as the
rendezvous endpoint and each node's name as its address: the daemons run in a private
mount namespace whose ``/etc/hosts`` maps both names to 127.0.0.1, and the job steps they
start inherit it. Nothing outside that namespace is changed.

Without Slurm installed the tests are skipped locally, and fail in CI (``CI`` set),
where the setup must have installed it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from _helpers import ELASTRUN, REPO, free_ports, wait_for, write_script
from elastrun.launch.slurm import expand_hostlist

pytestmark = pytest.mark.slow

DAEMONS = ("slurmctld", "slurmd", "srun", "sinfo", "scontrol", "unshare", "mount")


def _require_slurm() -> None:
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if not missing:
        return
    reason = f"Slurm is not installed ({', '.join(missing)} missing): bash scripts/install-slurm.sh"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


CONF = """\
ClusterName=elastrun
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/linear
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
KillWait=5
NodeName=node1 NodeAddr=127.0.0.1 Port={node1_port} CPUs=2 State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 Port={node2_port} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
"""

# Mount the hosts file in this namespace only, then run the three daemons in it.
RUN_DAEMONS = """\
set -e
mount --bind "$ROOT/hosts" /etc/hosts
slurmctld -D -i -f "$SLURM_CONF" &
slurmd -D -f "$SLURM_CONF" -N node1 &
slurmd -D -f "$SLURM_CONF" -N node2 &
wait
"""


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]  # SLURM_CONF for srun, sinfo, scontrol

    def srun(
        self, args: list[str], *, cwd: Path, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env}
        proc = subprocess.Popen(
            ["srun", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            os.killpg(proc.pid, signal.SIGINT)  # srun cancels the step on SIGINT
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"srun did not finish in {timeout}s\n{out}\n{err}") from exc
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*"))
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    _require_slurm()
    if os.geteuid() != 0:
        pytest.skip("the emulated Slurm cluster runs its daemons as root")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    ctld, slurmd, node1, node2 = free_ports(4)
    conf = root / "slurm.conf"
    conf.write_text(
        CONF.format(
            root=root, ctld_port=ctld, slurmd_port=slurmd, node1_port=node1, node2_port=node2
        )
    )
    (root / "hosts").write_text(Path("/etc/hosts").read_text() + "\n127.0.0.1 node1 node2\n")
    env = {"SLURM_CONF": str(conf)}
    # The daemons must not carry a test's leak-check tag: they are the fixture's.
    daemon_env = {k: v for k, v in os.environ.items() if k != "ELASTRUN_TEST_TAG"}
    with (root / "log" / "daemons.out").open("w") as out:
        daemons = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "bash", "-c", RUN_DAEMONS],
            env={**daemon_env, **env, "ROOT": str(root)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    c = Cluster(root, env)
    try:
        _wait_for_idle_nodes(c, daemons)
        yield c
    finally:
        try:
            os.killpg(daemons.pid, signal.SIGTERM)
            daemons.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(daemons.pid, signal.SIGKILL)
            daemons.wait(timeout=10)
        except ProcessLookupError:
            pass


def _wait_for_idle_nodes(c: Cluster, daemons: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    states = ""
    while time.monotonic() < deadline:
        if daemons.poll() is not None:
            pytest.fail(f"the Slurm daemons exited ({daemons.returncode})\n{c.logs()}")
        r = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"], env={**os.environ, **c.env},
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
        states = r.stdout
        if r.returncode == 0 and states.count("idle") == 2:
            return
        time.sleep(0.3)
    pytest.fail(f"the Slurm nodes did not come up: {states!r}\n{c.logs()}")


ENV_DUMP = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_STEP_ID"]
with open(os.path.join(sys.argv[1], "env_" + os.environ["RANK"] + ".json"), "w") as fh:
    json.dump({k: os.environ.get(k) for k in keys}, fh)
"""


def test_srun_with_slurm_is_the_whole_two_node_launch(cluster: Cluster, tmp_path: Path) -> None:
    script = write_script(tmp_path / "env.py", ENV_DUMP)
    r = cluster.srun(
        ["-N2", "--ntasks-per-node=1", *ELASTRUN, "--slurm", "--nproc-per-node", "2",
         str(script), str(tmp_path)],
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{cluster.logs()}"
    envs = [json.loads((tmp_path / f"env_{rank}.json").read_text()) for rank in range(4)]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    job = envs[0]["SLURM_JOB_ID"]
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {f"{job}.0"}
    # Each Slurm node became one elastrun node with two local ranks.
    by_node: dict[str, list[str]] = {}
    for e in envs:
        by_node.setdefault(e["SLURMD_NODENAME"], []).append(e["LOCAL_RANK"])
    assert sorted(by_node) == ["node1", "node2"]
    assert all(sorted(ranks) == ["0", "1"] for ranks in by_node.values())
    # Workers meet at the address of group rank 0: a Slurm node name, not an FQDN.
    assert {e["MASTER_ADDR"] for e in envs} <= {"node1", "node2"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert "served by this node" in r.stderr and "rendezvous at node1:" in r.stderr


def test_more_than_one_task_per_node_fails_before_starting_anything(
    cluster: Cluster, tmp_path: Path
) -> None:
    script = write_script(tmp_path / "env.py", ENV_DUMP)
    r = cluster.srun(
        ["-N1", "--ntasks=2", *ELASTRUN, "--slurm", str(script), str(tmp_path)], cwd=tmp_path
    )
    assert r.returncode != 0
    assert "--ntasks-per-node=1" in r.stderr
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.glob("env_*.json"))


@pytest.mark.parametrize(
    "expr",
    ["node[1-2]", "gpu[01-03,07],cpu-a[8-10]", "r[1-2]n[1-3]", "x1,y[2-3],z", "a,,b",
     "n[1-010]", "n[01-3]", "[1-2]", "n[1,1]"],
)  # fmt: skip
def test_the_hostlist_expander_agrees_with_scontrol(cluster: Cluster, expr: str) -> None:
    r = subprocess.run(
        ["scontrol", "show", "hostnames", expr], env={**os.environ, **cluster.env},
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert expand_hostlist(expr) == r.stdout.split()


def test_slurm_outside_an_allocation_exits_2_with_one_line(tmp_path: Path) -> None:
    script = write_script(tmp_path / "t.py", "print('never')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    r = subprocess.run(
        [*ELASTRUN, "--slurm", str(script)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2
    assert "not inside a Slurm allocation" in r.stderr
    assert "never" not in r.stdout
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_sbatch_style_environment_needs_srun_for_several_nodes(tmp_path: Path) -> None:
    script = write_script(tmp_path / "t.py", "print('never')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(SLURM_JOB_ID="3", SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_NUM_NODES="2",
               SLURM_NODEID="0", SLURMD_NODENAME="node1")  # fmt: skip
    r = subprocess.run(
        [*ELASTRUN, "--slurm", str(script)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2
    assert "not inside an srun step" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _guide_block(test_name: str) -> str:
    """The bash block of docs/clusters.md that names ``test_name`` as its test."""
    text = (REPO / "docs" / "clusters.md").read_text()
    after = text.split(f"tested-by: tests/e2e/test_slurm_cluster.py::{test_name} -->", 1)[1]
    return after.split("```bash\n", 1)[1].split("```", 1)[0]


@pytest.mark.torch
def test_the_guides_sbatch_script_trains_on_two_nodes(cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    script = tmp_path / "train.sbatch"
    script.write_text(_guide_block("test_the_guides_sbatch_script_trains_on_two_nodes"))
    env = {**os.environ, **cluster.env}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    # Polled here rather than with `sbatch --wait`, whose polling interval grows to 30 s.
    wait_for(lambda: _job_state(cluster, job) in FINISHED, 240, f"batch job {job}")
    outputs = list(tmp_path.glob("ddp-demo-*.out"))
    out = outputs[0].read_text() if outputs else "(no output file)"
    state = _job_state(cluster, job)
    assert state == "COMPLETED", f"{state}\n{out[-4000:]}\n{cluster.logs()}"
    assert "final parameters identical on all 4 ranks: True" in out


FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _job_state(cluster: Cluster, job: str) -> str:
    r = subprocess.run(
        ["scontrol", "show", "job", job], env={**os.environ, **cluster.env},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    found = re.search(r"JobState=(\w+)", r.stdout)
    return found.group(1) if found else "UNKNOWN"
