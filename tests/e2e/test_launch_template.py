"""The worker template of a launch is started before the agent runs its rendezvous, and
that one template serves the first round's workers (its key does not depend on what the
round decides nor on the agent's own paths)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from _helpers import run, write_script
from elastrun.launch.api import launch_agent
from elastrun.launch.config import LaunchConfig
from elastrun.launch.local_agent import LocalElasticAgent

# Says whether it was forked from the template (its set-up module is loaded then).
FORKED = """\
import os, sys
forked = "elastrun.template.worker.child" in sys.modules
os.write(1, f"FORKED {os.environ['RANK']} {forked}\\n".encode())
"""


def _templates_among_children() -> list[int]:
    me = os.getpid()
    with open(f"/proc/{me}/task/{me}/children") as fh:
        children = [int(pid) for pid in fh.read().split()]
    found = []
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if b"elastrun.template.worker.serve" in cmdline:
            found.append(pid)
    return found


def test_the_template_is_running_before_the_agent_runs_its_rendezvous(tmp_path: Path) -> None:
    script = write_script(tmp_path / "forked.py", FORKED)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0)
    seen: list[list[int]] = []

    def on_agent(agent: LocalElasticAgent) -> None:
        seen.append(_templates_among_children())

    launch_agent(config, sys.executable, ["-u", str(script)], on_agent=on_agent)
    assert len(seen) == 1 and len(seen[0]) == 1, seen


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--log-dir", "LOGS", "--tee", "3"],
        ["--virtual-local-rank"],
        ["--max-restarts", "1", "--monitor-interval", "0.05"],
    ],
)
def test_the_template_started_early_serves_the_first_rounds_workers(
    tmp_path: Path, options: list[str]
) -> None:
    script = write_script(tmp_path / "forked.py", FORKED)
    options = [str(tmp_path / "logs") if o == "LOGS" else o for o in options]
    result = run(
        ["--standalone", "--nproc-per-node", "3", *options, str(script)],
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "replacing the worker template" not in result.stderr
    assert "worker template disabled" not in result.stderr
    # With --tee, each line comes prefixed with its rank ("[default0]:FORKED ...").
    lines = sorted(re.findall(r"FORKED \d \w+", result.stdout))
    assert lines == [f"FORKED {rank} True" for rank in range(3)], result.stdout


# Imports torch (numpy's OpenBLAS starts its threads unless a thread variable is 1),
# fails its first attempt, and says whether it was forked and what its pools are.
ONE_WORKER = """\
import os, sys
import torch
forked = "elastrun.template.worker.child" in sys.modules
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
os.write(1, f"ONE {restart} {forked} {torch.get_num_threads()}\\n".encode())
sys.exit(1 if restart == "0" else 0)
"""


@pytest.mark.torch
@pytest.mark.parametrize("omp", [None, "2"])
def test_one_worker_per_node_is_forked_with_the_users_environment_left_as_it_is(
    tmp_path: Path, omp: str | None
) -> None:
    # elastrun sets OMP_NUM_THREADS=1 only for several workers, as torchrun does; the
    # template must serve one worker, and users' own thread counts, as they are.
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    script = write_script(tmp_path / "one.py", ONE_WORKER)
    result = run(
        ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1", str(script)],
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "worker template disabled" not in result.stderr
    threads = min(int(omp or len(os.sched_getaffinity(0))), len(os.sched_getaffinity(0)))
    lines = sorted(re.findall(r"ONE \d \w+ \d+", result.stdout))
    assert lines == [f"ONE 0 True {threads}", f"ONE 1 True {threads}"], result.stdout
