"""--slurm: hostlist expansion and the settings derived from a Slurm step's environment."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.core.errors import ConfigError
from elastrun.launch.slurm import (
    BASE_PORT,
    PORT_SPREAD,
    derived_port,
    expand_hostlist,
    slurm_overrides,
)

# What srun sets on the second node of `srun -N2` in job 17 (the variables that matter).
STEP_ENV = {
    "SLURM_JOB_ID": "17",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "node2",
}


# --- hostlists ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("node1", ["node1"]),
        ("node1,node2", ["node1", "node2"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[001-002]", ["n001", "n002"]),
        ("n[5]", ["n5"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[1-2],b,c[3]", ["a1", "a2", "b", "c3"]),
        ("[1-2]", ["1", "2"]),
        ("gpu-node-7.cluster", ["gpu-node-7.cluster"]),
        (" n[1-2] ", ["n1", "n2"]),
        ("a,,b", ["a", "b"]),
        ("n[1-010]", ["n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10"]),
        ("n[1,1]", ["n1", "n1"]),
    ],
)
def test_hostlists_expand_like_slurm(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("", "names no host"),
        ("n[1-2", "without its ']'"),
        ("n1-2]", "without its '['"),
        ("n[[1]]", "nested"),
        ("n[]", "not a number"),
        ("n[a-c]", "not a number"),
        ("n[1-2-3]", "not a number"),
        ("n[3-1]", "ends below its start"),
        ("n[0-99999999]", "more than"),
        ("a[0-999]b[0-9999]", "more than"),
    ],
)
def test_malformed_hostlists_are_config_errors_naming_the_variable(expr: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand_hostlist(expr, "SLURM_STEP_NODELIST")
    assert info.value.field == "SLURM_STEP_NODELIST"
    assert reason in str(info.value)


@given(
    prefix=st.from_regex(r"[a-z][a-z-]{0,5}", fullmatch=True),
    lo=st.integers(0, 500),
    count=st.integers(1, 40),
    width=st.integers(1, 4),
)
def test_a_padded_range_expands_to_every_number_in_order(
    prefix: str, lo: int, count: int, width: int
) -> None:
    hi = lo + count - 1
    expr = f"{prefix}[{str(lo).zfill(width)}-{str(hi).zfill(width)}]"
    assert expand_hostlist(expr) == [f"{prefix}{str(n).zfill(width)}" for n in range(lo, hi + 1)]


# --- the settings ---------------------------------------------------------------------


def test_a_step_gives_run_id_node_count_rank_and_the_first_host_as_endpoint() -> None:
    s = slurm_overrides(STEP_ENV)
    assert s.run_id == "17.0"
    assert s.nnodes == 2
    assert s.hosts == ("node1", "node2")
    assert s.node_rank == 1
    assert s.endpoint == f"node1:{derived_port('17.0')}"
    assert s.is_host is False
    assert s.local_addr == "node2"
    assert any("run id 17.0" in n for n in s.notices)


def test_the_first_node_of_the_step_serves_the_store() -> None:
    s = slurm_overrides({**STEP_ENV, "SLURMD_NODENAME": "node1", "SLURM_NODEID": "0"})
    assert s.node_rank == 0
    assert s.is_host is True


def test_every_node_of_a_step_agrees_and_steps_differ() -> None:
    first = slurm_overrides({**STEP_ENV, "SLURMD_NODENAME": "node1", "SLURM_NODEID": "0"})
    second = slurm_overrides(STEP_ENV)
    assert (first.run_id, first.endpoint) == (second.run_id, second.endpoint)
    other_step = slurm_overrides({**STEP_ENV, "SLURM_STEP_ID": "1"})
    assert other_step.run_id == "17.1" != first.run_id


def test_the_port_is_derived_from_the_run_id_within_its_range() -> None:
    ports = {derived_port(f"{job}.0") for job in range(1000, 1200)}
    assert all(BASE_PORT <= p < BASE_PORT + PORT_SPREAD for p in ports)
    assert len(ports) > 150  # jobs sharing a first node rarely collide


def test_a_port_only_endpoint_keeps_the_first_host() -> None:
    s = slurm_overrides(STEP_ENV, rdzv_endpoint=":29555")
    assert s.endpoint == "node1:29555"
    assert s.is_host is False


def test_a_given_endpoint_with_a_host_is_kept_and_nobody_is_forced_to_serve() -> None:
    s = slurm_overrides(STEP_ENV, rdzv_endpoint="store.example:29400")
    assert s.endpoint == "store.example:29400"
    assert s.is_host is None
    etcd = slurm_overrides(STEP_ENV, rdzv_endpoint="[fd00::1]:2379")
    assert etcd.endpoint == "[fd00::1]:2379"


def test_a_host_only_endpoint_gets_the_derived_port() -> None:
    s = slurm_overrides(STEP_ENV, rdzv_endpoint="store.example")
    assert s.endpoint == f"store.example:{derived_port('17.0')}"


def test_the_step_node_list_wins_over_the_job_node_list() -> None:
    env = {**STEP_ENV, "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_JOB_NUM_NODES": "4"}
    env.update(SLURM_STEP_NODELIST="node[3-4]", SLURM_NNODES="2", SLURMD_NODENAME="node4")
    s = slurm_overrides(env)
    assert s.hosts == ("node3", "node4")
    assert s.endpoint.startswith("node3:")
    assert s.node_rank == 1  # by position in the step, not the job's SLURM_NODEID


def test_without_a_node_name_the_rank_is_slurm_nodeid() -> None:
    env = {k: v for k, v in STEP_ENV.items() if k != "SLURMD_NODENAME"}
    s = slurm_overrides(env)
    assert s.node_rank == 1
    assert s.local_addr is None


def test_outside_an_allocation_slurm_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        slurm_overrides({"PATH": "/usr/bin"})
    assert info.value.field == "--slurm"
    assert "not inside a Slurm allocation" in str(info.value)
    assert "srun" in str(info.value)


def test_a_multi_node_allocation_outside_srun_is_refused() -> None:
    env = {k: v for k, v in STEP_ENV.items() if "STEP" not in k}
    with pytest.raises(ConfigError) as info:
        slurm_overrides(env)
    assert "not inside an srun step" in str(info.value)


def test_a_single_node_batch_script_needs_no_srun() -> None:
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "gpu7", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu7"}  # fmt: skip
    s = slurm_overrides(env)
    assert s.run_id == "9"
    assert (s.nnodes, s.node_rank, s.is_host) == (1, 0, True)


def test_more_than_one_task_per_node_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        slurm_overrides({**STEP_ENV, "SLURM_STEP_NUM_TASKS": "8"})
    assert info.value.field == "SLURM_STEP_NUM_TASKS"
    assert "--ntasks-per-node=1" in str(info.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"SLURM_STEP_NUM_NODES": "3"}, "SLURM_STEP_NUM_NODES"),
        ({"SLURM_STEP_NUM_NODES": "two"}, "SLURM_STEP_NUM_NODES"),
        ({"SLURM_STEP_NODELIST": "node[2-1]"}, "SLURM_STEP_NODELIST"),
        ({"SLURMD_NODENAME": "elsewhere", "SLURM_NODEID": ""}, "SLURMD_NODENAME"),
        ({"SLURMD_NODENAME": "elsewhere", "SLURM_NODEID": "5"}, "SLURM_NODEID"),
    ],
)
def test_inconsistent_variables_are_named(change: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        slurm_overrides({**STEP_ENV, **change})
    assert info.value.field == field


def test_a_bad_endpoint_port_names_the_option() -> None:
    with pytest.raises(ConfigError) as info:
        slurm_overrides(STEP_ENV, rdzv_endpoint=":http")
    assert info.value.field == "--rdzv-endpoint"


# -- the guide's requeue script (docs/clusters.md) ---------------------------------------

_STUB_SRUN = """#!/bin/bash
# Two nodes: runs the task command once per node, returns the highest status (as srun).
shift  # --kill-on-bad-exit=0
high=0
for node in node1 node2; do
    SLURMD_NODENAME=$node "$@"; rc=$?
    [ "$rc" -gt "$high" ] && high=$rc
done
exit "$high"
"""
# elastrun's status on each node comes from STUB_STATUS_<node>.
_STUB_ELASTRUN = """#!/bin/bash
var="STUB_STATUS_$SLURMD_NODENAME"
exit "${!var}"
"""
_STUB_SCONTROL = """#!/bin/bash
echo "$*" >> "$SCONTROL_LOG"
"""


def _requeue_script() -> str:
    from _helpers import REPO

    text = (REPO / "docs" / "clusters.md").read_text()
    marker = "tested-by: tests/unit/test_slurm.py::test_the_guides_requeue_script_acts_on"
    block = text[text.index(marker) :].split("```bash\n", 1)[1]
    return block.split("\n```", 1)[0] + "\n"


@pytest.mark.parametrize(
    ("statuses", "restarts", "exit_status", "scontrol"),
    [
        ((0, 0), 0, 0, []),
        ((2, 2), 0, 2, []),  # bad configuration: no retry fixes it
        ((1, 93), 0, 93, []),  # a crash loop on node2: do not requeue
        ((1, 75), 0, 75, ["update JobId=17 ExcNodeList=node2", "requeue 17"]),
        ((1, 1), 0, 1, ["requeue 17"]),  # the budget ran out: a retry may succeed
        ((1, 1), 3, 1, []),  # but not forever
    ],
)
def test_the_guides_requeue_script_acts_on_elastruns_exit_status(
    tmp_path: Path, statuses: tuple[int, int], restarts: int, exit_status: int, scontrol: list[str]
) -> None:
    # The guide's script as written, with srun, elastrun and scontrol replaced by stubs
    # (tests/e2e/test_slurm_cluster.py runs elastrun under a real Slurm).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("srun", _STUB_SRUN),
        ("elastrun", _STUB_ELASTRUN),
        ("scontrol", _STUB_SCONTROL),
    ):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "train.sbatch").write_text(_requeue_script())
    log = tmp_path / "scontrol.log"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "17",
        "SLURM_RESTART_COUNT": str(restarts),
        "SCONTROL_LOG": str(log),
        "STUB_STATUS_node1": str(statuses[0]),
        "STUB_STATUS_node2": str(statuses[1]),
    }
    res = subprocess.run(
        ["bash", "train.sbatch"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == exit_status, res.stderr
    assert (log.read_text().splitlines() if log.exists() else []) == scontrol
